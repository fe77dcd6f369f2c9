"""Sigma grids, Euler steps and the noise mix bitwise against diffusers' MiniMaxH3Scheduler (the oracle)."""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from h3gate.schedule import build_schedule, euler_step, scale_noise, step_at

pytestmark = pytest.mark.parity
SHIFTS = [1.0, 3.0, 12.0, 0.37, 2.5, 7.25, 100.0, 1e7]


def provider(steps: int, shift: float) -> MiniMaxH3Scheduler:
    scheduler = MiniMaxH3Scheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler


@pytest.mark.parametrize("shift", SHIFTS)
def test_sigma_grids_bitwise(shift: float) -> None:
    collapsed = 0
    for steps in range(2, 61):
        mine, ref = build_schedule(steps, shift), provider(steps, shift)
        assert torch.equal(mine.sigmas, ref.sigmas) and mine.sigmas.dtype == ref.sigmas.dtype, steps
        assert torch.equal(mine.timesteps, ref.timesteps) and mine.timesteps.dtype == ref.timesteps.dtype, steps
        assert mine.num_evaluations == ref.num_inference_steps
        collapsed += steps - mine.sigmas.numel()
    assert (collapsed > 0) == (shift == 1e7)  # the duplicate collapse is exercised, and only where it must be


def test_long_grid_with_collapse_bitwise() -> None:
    mine, ref = build_schedule(1000, 1e4), provider(1000, 1e4)
    assert mine.sigmas.numel() < 1000
    assert torch.equal(mine.sigmas, ref.sigmas) and torch.equal(mine.timesteps, ref.timesteps)


@pytest.mark.parametrize("shift", [12.0, 3.0, 0.37])
@pytest.mark.parametrize(
    ("sample_dtype", "output_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float64, torch.float64),
    ],
)
def test_euler_trajectory_bitwise(shift: float, sample_dtype: torch.dtype, output_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    schedule, scheduler = build_schedule(25, shift), provider(25, shift)
    mine = ref = torch.randn(2, 3, 5, 7, generator=gen).to(sample_dtype)
    for index, timestep in enumerate(scheduler.timesteps):
        velocity = torch.randn(2, 3, 5, 7, generator=gen).to(output_dtype)
        ref = scheduler.step(velocity, timestep, ref).prev_sample
        mine = step_at(schedule, index, velocity, mine)
        assert mine.dtype == ref.dtype == sample_dtype
        assert torch.equal(mine, ref), index
    assert scheduler.step_index == schedule.num_evaluations


def test_euler_step_float_timestep_bitwise() -> None:
    """A Python-float timestep (rounded straight to the sample dtype) follows the scheduler too."""
    schedule, scheduler = build_schedule(12, 12.0), provider(12, 12.0)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        scheduler.set_timesteps(12)
        sample = torch.randn(64, generator=gen).to(dtype)
        for index in range(schedule.num_evaluations):
            velocity = torch.randn(64, generator=gen).to(dtype)
            t = float(schedule.timesteps[index])
            ref = scheduler.step(velocity, t, sample).prev_sample
            mine = euler_step(velocity, t, sample, schedule.sigmas[index], schedule.sigmas[index + 1])
            assert torch.equal(mine, ref), (dtype, index)
            sample = ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("t", [0.999, 0.5, 1.0, 0.123456789])
def test_scale_noise_bitwise(dtype: torch.dtype, t: float) -> None:
    gen = torch.Generator().manual_seed(11)
    sample, noise = (torch.randn(3, 4, 9, generator=gen).to(dtype) for _ in range(2))
    scheduler = MiniMaxH3Scheduler(shift=12.0)
    for timestep in (t, torch.tensor(t, dtype=torch.float32), torch.full((3,), t, dtype=torch.float64)):
        expected = scheduler.scale_noise(sample, timestep, noise)
        got = scale_noise(sample, timestep, noise)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
