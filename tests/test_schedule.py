"""Sigma grid, Euler step and the ``h3gate schedule`` verb (no oracle)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from h3gate.errors import InputError
from h3gate.schedule import build_schedule, euler_step, sigma_hash, step_at


def test_grid_shape_and_conventions() -> None:
    schedule = build_schedule(5, 3.0)
    # 3 * b / (1 + 2 * b) on b = 1, .75, .5, .25, 0 in float32
    base = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.equal(schedule.sigmas, (3.0 * base / (1 + 2.0 * base)).float())
    assert schedule.sigmas[0].item() == 1.0 and schedule.sigmas[-1].item() == 0.0
    assert torch.equal(schedule.timesteps, 1.0 - schedule.sigmas[:-1])
    assert schedule.num_evaluations == 4 and schedule.sigmas.dtype == schedule.timesteps.dtype == torch.float32
    assert bool((schedule.sigmas[1:] < schedule.sigmas[:-1]).all())
    assert sigma_hash(schedule) == hashlib.sha256(schedule.sigmas.numpy().tobytes()).hexdigest()
    assert sigma_hash(schedule) != sigma_hash(build_schedule(5, 12.0))


def test_large_shift_collapses_duplicates() -> None:
    schedule = build_schedule(1000, 1e4)
    assert schedule.sigmas.numel() == 980  # 20 float32 collisions near sigma = 1 were collapsed
    assert schedule.num_evaluations == 979
    assert bool((schedule.sigmas[1:] < schedule.sigmas[:-1]).all())


def test_euler_step_is_the_data_ward_blend() -> None:
    sample = torch.tensor([1.0, -2.0], dtype=torch.float64)
    velocity = torch.tensor([0.5, 4.0], dtype=torch.float64)
    # sigma 0.5 -> 0.25, t = 0.5: x0 = x + 0.5 v, x_next = 0.5 x + 0.5 x0
    out = euler_step(velocity, 0.5, sample, 0.5, 0.25)
    assert out.tolist() == [1.125, -1.0]
    bf16 = sample.to(torch.bfloat16)
    assert euler_step(velocity.to(torch.bfloat16), 0.5, bf16, 0.5, 0.25).dtype == torch.bfloat16
    with pytest.raises(InputError, match="timestep: must be a float"):
        euler_step(velocity, 1, sample, 0.5, 0.25)
    schedule = build_schedule(3, 1.0)
    with pytest.raises(InputError, match=r"step index 2: outside \[0, 2\)"):
        step_at(schedule, 2, velocity, sample)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "1"], "--steps 1: must be an integer >= 2 (the grid includes the terminal sigma 0)"),
        (["--steps", "-4"], "--steps -4: must be an integer >= 2 (the grid includes the terminal sigma 0)"),
        (["--steps", "10", "--shift", "0"], "--shift 0.0: must be a finite number > 0"),
        (["--steps", "10", "--shift", "-2.5"], "--shift -2.5: must be a finite number > 0"),
        (["--steps", "10", "--shift", "inf"], "--shift inf: must be a finite number > 0"),
        (["--steps", "10", "--shift", "nan"], "--shift nan: must be a finite number > 0"),
        (
            ["--steps", "10", "--shift", "1e308"],
            "--shift 1e+308: sigma 0 of the float32 grid is not finite (the shift overflows float32)",
        ),
        (["--steps", "10", "--save", "grid.pt"], "--save grid.pt: must end in .safetensors"),
    ],
)
def test_schedule_cli_errors(run_cli, args: list[str], message: str) -> None:
    assert run_cli("schedule", *args) == (2, "", f"h3gate: error: {message}\n")


@pytest.mark.parametrize("args", [[], ["--steps", "x"]])
def test_schedule_cli_usage_errors_exit_2(run_cli, args: list[str]) -> None:
    code, out, err = run_cli("schedule", *args)
    assert (code, out) == (2, "")
    assert err.startswith("h3gate: error: ") and "steps" in err and err.count("\n") == 1


def test_schedule_cli_json_and_save_roundtrip(run_cli, tmp_path: Path) -> None:
    target = tmp_path / "grid.safetensors"
    code, out, err = run_cli("schedule", "--steps", "9", "--shift", "12", "--json", "--save", target)
    assert (code, err) == (0, "")
    schedule = build_schedule(9, 12.0)
    body = json.loads(out)
    assert body["num_evaluations"] == 8 and body["sigma_sha256"] == sigma_hash(schedule)
    assert torch.equal(torch.tensor(body["sigmas"], dtype=torch.float32), schedule.sigmas)
    assert torch.equal(torch.tensor(body["timesteps"], dtype=torch.float32), schedule.timesteps)
    loaded = load_file(target)
    assert loaded["sigmas"].dtype == torch.float32 and torch.equal(loaded["sigmas"], schedule.sigmas)
    assert torch.equal(loaded["timesteps"], schedule.timesteps)
    code, out, _ = run_cli("schedule", "--steps", "4")
    assert code == 0 and "3 evaluations" in out and sigma_hash(build_schedule(4, 12.0)) in out
