"""``h3gate run arms``: the issue's CPU acceptance - all four arms over 3 denoising steps (``--steps 4``) on the tiny
config's diffusers module with a PEFT LoRA, plus the negative controls that must fail and be located, and the bad
inputs (exit 2, one line).

The acceptance run (marked slow: ``make test-slow``, which CI runs beside ``make test``) is made as a user makes it:
the CLI in a subprocess, strict Triton kernels under the CPU interpreter. The negative controls keep one block
(``--layers 1``) and one step (``--steps 2``) of R/R only: a one-row fault on the strict training side's second
pass, forward (the velocities drift: located to the node, packed row and modality) and backward (the gradients do
not repeat: the first differing gradient is named). The faulted row is a video row: with one block, a text row's
last-block values reach neither velocity nor loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.parity
H3GATE = [sys.executable, "-m", "h3gate", "--quiet", "run", "arms", "--device", "cpu"]


def _run(args: list[str], tmp: Path) -> tuple[int, dict, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([*H3GATE, *args, "--out", str(tmp), "--json"], capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    brief = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    return done.returncode, brief, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory) -> tuple[int, dict, dict, str]:
    out = tmp_path_factory.mktemp("arms")
    code, brief, log = _run(["--steps", "4", "--batch", "2", "--lora-rank", "2"], out)
    doc = json.loads((out / "arms.json").read_text()) if (out / "arms.json").is_file() else {}
    return code, brief, doc, log


@pytest.mark.slow  # the acceptance run, 220 s of make test's 300 on two cores: make test-slow (.ci/run runs both)
def test_all_four_arms_three_steps_r_r_byte_equal_and_the_lora_gate(acceptance) -> None:
    code, brief, doc, log = acceptance
    assert code == 0, log
    arms = {a["arm"]: a for a in brief["arms"]}
    assert list(arms) == ["P/P", "R/P", "P/R", "R/R"]
    rr = arms["R/R"]
    assert rr["byte_equal"] is True and rr["first_drift"] is None and rr["first_drift_step"] is None
    assert rr["gradients_repeat_bitwise"] is True and rr["lora_gate"] is True
    assert rr["drift"] == {"video": {"max_abs": 0.0, "rel_l2": 0.0}, "audio": {"max_abs": 0.0, "rel_l2": 0.0}}
    full = {a["arm"]: a for a in doc["arms"]}
    assert doc["run"]["schedule"]["evaluations"] == 3 and doc["run"]["training"]["mode"] == "lora"
    for step in full["R/R"]["steps"]:
        assert len(step["requests"]) == 2 and sorted(step["order"]) == [0, 1] and step["order"] != [0, 1]
        for request in step["requests"]:
            for m in ("video", "audio"):
                assert {c for c, r in request[m].items() if r["bitwise"]} == {"alone", "batch.pass1", "batch.pass2"}
        lora = step["gradients"]["lora"]
        assert lora["all_nonzero"] and lora["base_gradients_absent"] and lora["tensors"] > 0
        assert step["trace_ops"]["h3_lora_update triton"] > 0 and "h3_qkv_gemm provider" not in step["trace_ops"]
    assert full["R/R"]["rollout_trace_ops"]["h3_full_attention triton"] > 0


@pytest.mark.slow  # the same acceptance run
def test_mixed_arms_drift_and_the_drift_is_located(acceptance) -> None:
    _, brief, doc, _ = acceptance
    arms = {a["arm"]: a for a in brief["arms"]}
    for name in ("R/P", "P/R"):
        arm = arms[name]
        assert arm["byte_equal"] is False and arm["first_drift_step"] == 0
        where = arm["first_drift"]
        assert where["replay_faithful"] == {"rollout": True, "training": True}
        assert where["node"] and where["modality"] in ("text", "video", "audio") and isinstance(where["row"], int)
        assert where["max_abs"] > 0
    assert arms["P/P"]["gradients_repeat_bitwise"] is True and arms["P/P"]["lora_gate"] is True


@pytest.mark.slow  # 21 s of make test's 300 on two cores: make test-slow (.ci/run runs both), with the backward one
def test_a_forward_fault_on_the_strict_training_side_fails_r_r_and_is_located(tmp_path) -> None:
    args = ["--arms", "R/R", "--steps", "2", "--layers", "1", "--fault", "block.0.o_proj:30"]
    code, brief, log = _run(args, tmp_path)
    assert code == 1, log
    rr = brief["arms"][0]
    assert rr["byte_equal"] is False and rr["first_drift_step"] == 0
    where = rr["first_drift"]
    assert (where["node"], where["row"], where["composition"]) == ("block.0.o_proj", 30, "batch.pass2")
    assert where["modality"] == "video"  # micro: rows 0-23 text, 24-39 video, 40-51 audio, 52-83 video
    assert where["replay_faithful"] == {"rollout": True, "training": True}
    assert rr["gradients_repeat_bitwise"] is False  # the second pass's gradients follow its faulted forward
    assert "R/R.byte_equal (first drift at step 0)" in brief["failing_checks"]


@pytest.mark.slow  # 40 s of make test's 300 on two cores (the forward fault above stays there): make test-slow
def test_a_backward_fault_fails_the_gradient_repeat_and_names_the_gradient(tmp_path) -> None:
    args = ["--arms", "R/R", "--steps", "2", "--layers", "1", "--fault", "block.0.q_proj:30:backward"]
    code, brief, log = _run(args, tmp_path)
    assert code == 1, log
    rr = brief["arms"][0]
    assert rr["byte_equal"] is True and rr["gradients_repeat_bitwise"] is False
    assert brief["failing_checks"] == ["R/R.gradients_repeat_bitwise"]
    doc = json.loads((tmp_path / "arms.json").read_text())
    first = doc["arms"][0]["steps"][0]["gradients"]["first_differing"]
    assert first["name"] and first["max_abs"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arms", "P/X"], "--arms 'P/X': expected a comma-separated list of P/P, R/P, P/R, R/R"),
        (["--arms", "R/R,R/R"], "--arms 'R/R,R/R': an arm is listed twice"),
        (["--lora-rank", "0"], "--lora-rank 0: must be at least 1"),
        (["--batch", "0"], "--batch 0: must be at least 1"),
        (["--steps", "1"], "--steps 1: must be at least 2"),
        (["--layers", "3"], "--layers 3: must be in 1..2"),
        (["--fault", "block.9.o_proj:1"], "unknown node 'block.9.o_proj'"),
        (["--arms", "P/P", "--fault", "block.0.o_proj:1"], "needs an arm that trains with R"),
        (["--layout", "nope"], "nope"),
        (["--rollout", "vllm"], "--rollout 'vllm': must be one of diffusers, sglang"),
        (["--tp", "2"], "--tp 2: only with --rollout sglang"),
        (["--ulysses", "2"], "--ulysses 2: only with --rollout sglang"),
        (["--sglang-attention-backend", "fa"], "--sglang-attention-backend: only with --rollout sglang"),
        (["--merge-order", "seg4"], "--merge-order 'seg4': must be one of single, seg8"),
    ],
)
def test_bad_input_is_exit_2_with_one_line_before_any_work(run_cli, tmp_path, args, message) -> None:
    out = tmp_path / "out"
    code, stdout, err = run_cli("--quiet", "run", "arms", "--device", "cpu", *args, "--out", out)
    assert code == 2, stdout + err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_missing_diffusers_or_peft_is_one_line_naming_the_extra(run_cli, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)
    code, _, err = run_cli("--quiet", "run", "arms", "--device", "cpu", "--lora-rank", "2", "--out", tmp_path / "a")
    assert code == 2 and err.strip() == "h3gate: error: --lora-rank: needs peft: pip install 'h3gate[lora]'"
    monkeypatch.setitem(sys.modules, "diffusers", None)
    code, _, err = run_cli("--quiet", "run", "arms", "--device", "cpu", "--out", tmp_path / "b")
    assert code == 2
    assert err.strip() == "h3gate: error: run arms: needs diffusers 0.42.x: pip install 'h3gate[diffusers]'"


def test_without_sglang_the_sglang_rollout_is_one_line_saying_how_to_get_it(run_cli, monkeypatch, tmp_path) -> None:
    from h3gate.adapters.sglang import runtime

    def missing(name):
        raise runtime.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(runtime.importlib.metadata, "version", missing)
    out = tmp_path / "out"
    code, _, err = run_cli("--quiet", "run", "arms", "--device", "cpu", "--rollout", "sglang", "--out", out)
    assert code == 2 and err.strip() == "h3gate: error: --rollout sglang: needs sglang 0.5.23: make install-sglang"
    assert not out.exists()


def test_a_crash_is_exit_3_never_a_verdict(run_cli, monkeypatch, tmp_path) -> None:
    import h3gate.commands.arms_cmd as arms_cmd

    def boom(*args, **kwargs):
        raise RuntimeError("injected crash")

    monkeypatch.setattr(arms_cmd, "run_arms", boom)
    code, stdout, err = run_cli("--quiet", "run", "arms", "--device", "cpu", "--out", tmp_path / "out")
    assert code == 3, stdout + err
    assert err.startswith("h3gate: internal error: RuntimeError: injected crash") and "Traceback" not in err
    assert not (tmp_path / "out" / "arms.json").exists()
