"""Within-run determinism (:mod:`h3gate.graph.determinism`) in ``run ws1-trajectory``, ``run arms`` and ``run ws2``:
each records every evaluation by its strict kernels, prints the determinism line, writes the ``determinism`` block
and fails on a one-ulp change confined to ONE evaluation of one node (``--fault NODE:ROW:ulp@K``), at every position
of that node's call sequence; an invocation that evaluates nothing says it compared nothing.

In the default set: the trajectory's one-step run in-process, clean and with the injection at every position of the
node's call sequence (``step 0``, ``step 0 repeat``), the merged record of several processes and the bad inputs.
``slow`` (make test-slow): ws2's TP1 in-process (``forward``, ``forward repeat``), arms' strict rollout alone, and
the CLI runs of arms (a training pass) and of ws2's ranks (a rank's repeat).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from h3gate.graph import determinism

pytestmark = pytest.mark.usefixtures("one_thread")
NODE, ROW = "block.0.o_proj", 3
TRAJ = ("--quiet", "run", "ws1-trajectory", "--device", "cpu", "--steps", "2")


def _line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("determinism: "))


# -- run ws1-trajectory ------------------------------------------------------------------------------------------


def test_a_trajectory_step_and_its_repeat_are_compared_and_an_idle_resume_is_complete(run_cli, tmp_path):
    code, out, err = run_cli(*TRAJ, "--out", tmp_path / "run")
    assert code == 0, out + err
    pairs = r"determinism: \d+ evaluations, pairs on identical inputs: candidate \d+; all bitwise"
    assert re.fullmatch(pairs, _line(out))
    doc = json.loads((tmp_path / "run" / "ws1-trajectory.json").read_text())
    rec = doc["determinism"]
    assert doc["verdict"] == "pass" and rec["pass"] and rec["mismatches"] == [] and "note" not in rec
    assert rec["pairs"]["candidate"] * 2 >= rec["evaluations"]  # every node of the step has its repeat
    assert out.splitlines()[-1].startswith("verdict: pass (")
    # --resume with every step saved evaluates nothing: it compared nothing and says so, --json included
    code, out, err = run_cli(*TRAJ, "--out", tmp_path / "run", "--resume", "--json")
    assert code == 0, out + err
    doc = json.loads(out)
    assert doc["verdict"] == "complete" and doc["invocation"]["steps"] == []
    assert doc["determinism"]["pairs"] == {} and doc["determinism"]["note"] == determinism.NOTHING_COMPARED


@pytest.mark.parametrize("call", [1, 2])  # every position of the node's call sequence: step 0, step 0 repeat
def test_one_ulp_in_one_trajectory_evaluation_fails_naming_the_node(run_cli, tmp_path, call):
    code, out, err = run_cli(*TRAJ, "--out", tmp_path / "run", "--fault", f"{NODE}:{ROW}:ulp@{call}")
    assert code == 1, out + err
    assert f"first: candidate {NODE} forward (step 0 vs step 0 repeat, row {ROW})" in _line(out)
    doc = json.loads((tmp_path / "run" / "ws1-trajectory.json").read_text())
    assert doc["verdict"] == "fail"
    assert (
        f"determinism.{NODE}.forward.bitwise (out: step 0 vs step 0 repeat, row {ROW}, text)" in doc["failing_checks"]
    )
    fired = "step 0" if call == 1 else "step 0 repeat"
    assert doc["invocation"]["injected_fault"].endswith(f"(the {fired} evaluation)")


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (f"{NODE}:{ROW}", "run ws1-trajectory takes NODE:ROW:ulp@K"),
        (f"{NODE}:{ROW}:ulp@1:backward", "forward only"),
        (f"{NODE}:{ROW}:ulp@1:scale", "ulp@K is the kind; only a direction may follow it"),
        (f"block.9.o_proj:{ROW}:ulp@1", "unknown node 'block.9.o_proj'"),
    ],
)
def test_a_bad_trajectory_fault_is_exit_2_before_the_rundir_is_made(run_cli, tmp_path, fault, message):
    code, out, err = run_cli(*TRAJ, "--out", tmp_path / "run", "--fault", fault)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


# -- run ws2 -----------------------------------------------------------------------------------------------------


def _tp1(tmp_path: Path, fault: str | None = None) -> dict:
    """ws2's TP1 reference in-process (its forward and backward, then every node once more) under ``fault``'s
    injection."""
    from h3gate.numerics import strict_numerics
    from h3gate.parallel.ws2 import Ws2Settings, _reference, plan_ws2

    plan = plan_ws2(Ws2Settings("tp2", faults=[] if fault is None else [fault]))
    single = None if plan.injection is None else plan.injection.injection
    with strict_numerics("cpu"), determinism.injecting(single) if single else determinism.evaluation("clean"):
        *_, record = _reference(plan, tmp_path)
    return record


@pytest.mark.slow  # TP1's forward and backward three times (about 10 s each on two cores): make test-slow
@pytest.mark.parametrize("call", [None, 1, 2])  # clean, then every position of o_proj's calls: forward, its repeat
def test_ws2_tp1_evaluates_every_node_twice_and_one_ulp_in_either_fails(tmp_path, call):
    rec = _tp1(tmp_path, None if call is None else f"0:o_proj:{ROW}:ulp@{call}")
    assert rec["evaluations"] == 34 and rec["pairs"] == {"candidate": 17}
    if call is None:
        assert rec["pass"] and rec["mismatches"] == []
        return
    assert not rec["pass"]
    assert [(m["node"], m["row"], m["passes"]) for m in rec["mismatches"]] == [
        ("o_proj", ROW, ["forward", "forward repeat"])
    ]


def test_ws2_merges_each_processes_record_and_names_the_rank():
    clean = {"evaluations": 34, "keys": 17, "pairs": {"candidate": 17}, "mismatches": []}
    bad = {**clean, "mismatches": [{"node": "o_proj", "kind": "forward", "value": "out", "role": "candidate",
                                    "passes": ["forward", "forward repeat"], "row": 3, "rows": 84}]}  # fmt: skip
    from h3gate.parallel.ws2 import merged_determinism

    rec = merged_determinism([("TP1", None, clean), ("rank 0", 0, clean), ("rank 1", 1, bad)])
    assert rec["pairs"] == {"candidate": 51} and rec["evaluations"] == 102 and not rec["pass"]
    assert rec["mismatches"][0]["rank"] == 1 and [r["name"] for r in rec["ranks"]] == ["TP1", "rank 0", "rank 1"]
    assert merged_determinism([("TP1", None, None)])["note"] == determinism.NOTHING_COMPARED


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("0:o_proj:3:ulp@1:scale", "ulp@K is the kind; only a direction may follow it"),
        ("0:o_proj:3:forward:backward", "expected RANK:NODE:ROW[:forward|backward]"),
    ],
)
def test_a_bad_ws2_ulp_fault_is_exit_2(run_cli, tmp_path, fault, message):
    code, out, err = run_cli("--quiet", "run", "ws2", "--topology", "tp2", "--fault", fault, "--out", tmp_path / "o")
    assert code == 2 and message in err, err


@pytest.mark.slow  # two gloo ranks (about 40 s on two cores): make test-slow
def test_one_ulp_in_a_ranks_repeat_fails_ws2_naming_node_and_rank(run_cli, tmp_path):
    code, out, err = run_cli("--quiet", "run", "ws2", "--topology", "tp2", "--fault", f"1:o_proj:{ROW}:ulp@2",
                             "--out", tmp_path / "o")  # fmt: skip
    assert code == 1, out + err
    doc = json.loads((tmp_path / "o" / "ws2.json").read_text())
    assert doc["forward_byte_equal"] and doc["backward_byte_equal"]  # the repeat alone was changed
    assert "first: candidate o_proj forward on rank 1 (forward vs forward repeat, row 3)" in _line(out)
    assert [m["rank"] for m in doc["determinism"]["mismatches"]] == [1]
    assert any(c.startswith("determinism.o_proj.forward.bitwise") and c.endswith("on rank 1")
               for c in doc["failing_checks"])  # fmt: skip


# -- run arms ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arms_stack():
    pytest.importorskip("diffusers")
    from h3gate.arms.stack import ArmsSettings, build_stack, plan_stack

    stack, source = plan_stack(ArmsSettings(arms=("R/R",), steps=2, layers=1, batch=1))
    build_stack(stack, source)
    return stack


@pytest.mark.slow  # the module built and two strict rollouts (about 15 s on two cores): make test-slow
@pytest.mark.parametrize("call", [1, 2])  # the strict rollout's calls of the node: step 0, step 0 repeat
def test_one_ulp_in_the_strict_rollout_is_a_candidate_mismatch(arms_stack, tmp_path, call):
    from h3gate.arms.sides import rollout

    recorder = determinism.Recorder()
    spec = determinism.Injection(NODE, call, "forward", 30)
    with determinism.recording(recorder), determinism.injecting(spec) as state:
        rollout(arms_stack, "R", tmp_path / "rollout-R")
    assert state.fired == ("rollout R step 0" if call == 1 else "rollout R step 0 repeat")
    assert [(m["node"], m["row"], m["role"]) for m in recorder.failing()] == [(NODE, 30, "candidate")]


@pytest.mark.slow  # a training step with its backward (about 25 s on two cores): make test-slow
def test_one_ulp_in_a_training_pass_fails_arms_naming_the_node(run_cli, tmp_path):
    args = ["--arms", "R/R", "--steps", "2", "--layers", "1", "--batch", "1", "--fault", f"{NODE}:30:ulp@6"]
    code, out, err = run_cli("--quiet", "run", "arms", "--device", "cpu", *args, "--out", tmp_path / "o")
    assert code == 1, out + err
    assert f"first: candidate {NODE} forward (training R step 0 alone 0 vs training R step 0 pass 2, row 30)" in _line(
        out
    )
    doc = json.loads((tmp_path / "o" / "arms.json").read_text())
    assert doc["arms"][0]["byte_equal"]  # one ulp that no velocity shows: only the determinism check sees it
    assert doc["failing_checks"] == [
        f"determinism.{NODE}.forward.bitwise (out: training R step 0 alone 0 vs training R step 0 pass 2, row 30, "
        "video)"
    ]
