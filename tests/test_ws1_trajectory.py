"""``h3gate run ws1-trajectory`` and ``h3gate compare``: the issue's CPU acceptance. Six steps (``--steps 7``); a run
stopped at step 3 and resumed equals an uninterrupted one byte for byte; a batched run equals it too (strict kernels
are batch-invariant); the provider drifts and the drift is located to a node; a damaged step and changed settings are
refused (exit 2, one line naming the thing).

The runs are made as a user makes them: the CLI in a subprocess, tiny config, micro layout, strict Triton kernels
under the CPU interpreter. Each run is made once per test session, also under ``pytest -n``: the first worker that
needs it makes it (under a file lock) and every test works on a copy before changing anything. The refusals run
the CLI in-process (``run_cli``): they are refused before any model evaluation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock, Timeout
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3gate.gate.compare import tensor_sha256

H3GATE = [sys.executable, "-m", "h3gate"]
STEPS = ["--steps", "7"]  # 7 grid points: 6 model evaluations, steps 0..5
EVALUATIONS = 6
TRAJ = ["--quiet", "run", "ws1-trajectory"]

Result = tuple[int, str, str]


def _run(args: list[str], cwd: Path) -> Result:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([*H3GATE, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    return done.returncode, done.stdout, done.stderr


def _ok(result: Result) -> None:
    code, out, err = result
    assert code == 0, out[-3000:] + err[-3000:]


def _doc(rundir: Path) -> dict:
    return json.loads((rundir / "ws1-trajectory.json").read_text(encoding="utf-8"))


def doc_pairs(rundir: Path) -> int:
    """The candidate's determinism pairs of the RUNDIR's last invocation."""
    return _doc(rundir)["determinism"]["pairs"].get("candidate", 0)


def _step_bytes(rundir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((rundir / "steps").glob("step-*.safetensors"))}


def _tree(rundir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(rundir)): p.read_bytes() for p in sorted(rundir.rglob("*")) if p.is_file()}


def _make_a(d: Path) -> list[Result]:
    """The uninterrupted strict run."""
    return [_run([*TRAJ, "--out", str(d), *STEPS], d.parent)]


def _make_b(d: Path) -> list[Result]:
    """Stopped after step 3 (what it held then kept beside it), then resumed."""
    first = _run([*TRAJ, "--out", str(d), *STEPS, "--until", "3"], d.parent)
    at_stop = {"doc": _doc(d) if first[0] == 0 else None, "steps": sorted(p.name for p in d.glob("steps/*"))}
    (d.parent / "at-stop.json").write_text(json.dumps(at_stop), encoding="utf-8")
    return [first, _run([*TRAJ, "--out", str(d), *STEPS, "--resume"], d.parent)]


def _make_c(d: Path) -> list[Result]:
    """Every step batched beside an unrelated request (seed 11); stopped after step 2, then resumed."""
    first = _run([*TRAJ, "--out", str(d), *STEPS, "--batch-with", "11", "--until", "2"], d.parent)
    return [first, _run([*TRAJ, "--out", str(d), *STEPS, "--batch-with", "11", "--resume"], d.parent)]


def _make_p(d: Path) -> list[Result]:
    """The provider (``--mode off``)."""
    return [_run([*TRAJ, "--out", str(d), *STEPS, "--mode", "off"], d.parent)]


MAKERS = {"c": _make_c, "b": _make_b, "a": _make_a, "p": _make_p}  # longest first


def _wanted(request: pytest.FixtureRequest) -> set[str]:
    """The runs (``run_<key>`` fixtures) some selected test of this session uses."""
    used = {f for item in request.session.items for f in getattr(item, "fixturenames", ())}
    return {key for key in MAKERS if f"run_{key}" in used}


def _shared(factory: pytest.TempPathFactory, name: str, wanted: set[str]) -> tuple[Path, list[Result]]:
    """Run ``name``'s RUNDIR, made once per session, with the results of its invocations; treat it as read-only.

    Under xdist the runs live in the session's shared temp folder, each made under a file lock by the first worker
    that gets the lock; a worker that finds the run it needs being made by another makes a run nobody has started
    yet and a selected test uses (``wanted``, longest first) while it waits, so both workers are busy while the runs
    are made."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def make(key: str, wait: bool) -> bool:
        folder = root / f"ws1-trajectory-{key}"
        lock = FileLock(f"{folder}.lock")
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except Timeout:
            return False
        try:
            if not (folder / "results.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                made = MAKERS[key](folder / "run")
                (folder / "results.json").write_text(json.dumps(made), encoding="utf-8")
        finally:
            lock.release()
        return True

    folder = root / f"ws1-trajectory-{name}"
    if not make(name, wait=False):
        for key in MAKERS:
            if (folder / "results.json").is_file():
                break
            if key != name and key in wanted:
                make(key, wait=False)
        make(name, wait=True)
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    return folder / "run", [tuple(r) for r in results]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, request):
    return _shared(tmp_path_factory, "a", _wanted(request))


@pytest.fixture(scope="module")
def run_b(tmp_path_factory, request):
    return _shared(tmp_path_factory, "b", _wanted(request))


@pytest.fixture(scope="module")
def run_c(tmp_path_factory, request):
    return _shared(tmp_path_factory, "c", _wanted(request))


@pytest.fixture(scope="module")
def run_p(tmp_path_factory, request):
    return _shared(tmp_path_factory, "p", _wanted(request))


def _compare(a: Path, b: Path, tmp: Path) -> tuple[int, dict]:
    code, out, err = _run(["--quiet", "compare", str(a), str(b), "--out", str(tmp / "cmp"), "--json"], tmp)
    assert code in (0, 1), out[-3000:] + err[-3000:]
    return code, json.loads(out)


def _copy(run: tuple[Path, list], tmp: Path) -> Path:
    rundir, results = run
    for result in results:
        _ok(result)
    return Path(shutil.copytree(rundir, tmp / "run"))


def _refused(result: Result, *parts: str) -> str:
    code, out, err = result
    assert code == 2, out[-2000:] + err[-2000:]
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n") and lines[0].startswith("h3gate: error: "), err
    assert "Traceback" not in err and out == "", (out, err)
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _rewrite_step(rundir: Path, step: int, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change a saved step's tensors and make its sidecar agree (file sha256, every tensor's digest), so only
    the content check can refuse it."""
    path = rundir / "steps" / f"step-{step:04d}.safetensors"
    side = path.with_suffix(".json")
    with safe_open(str(path), "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)
    record = json.loads(side.read_text(encoding="utf-8"))
    record["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    for name, tensor in tensors.items():
        record["tensors"][name]["sha256"] = tensor_sha256(tensor)
    side.write_text(json.dumps(record, indent=1), encoding="utf-8")


# 1. the uninterrupted run


def test_an_uninterrupted_strict_run_saves_every_step_with_its_digests(run_a, tmp_path) -> None:
    rundir, (result,) = run_a
    _ok(result)
    # compared: its first step evaluated twice, every node's pair bitwise (an invocation evaluating nothing compares
    # nothing: complete, not passed, issue 42; tests/test_determinism_verbs.py)
    assert re.fullmatch(r"verdict: pass \(\d+ determinism pairs; 6/6 steps saved\)", result[1].splitlines()[-1])
    assert doc_pairs(rundir) > 0 and "; all bitwise" in result[1]
    assert (rundir / "manifest.json").is_file()
    names = [f"step-{k:04d}" for k in range(EVALUATIONS)]
    assert sorted(p.name for p in (rundir / "steps").iterdir()) == sorted(
        [f"{n}.safetensors" for n in names] + [f"{n}.json" for n in names]
    )
    doc = _doc(rundir)
    assert doc["kind"] == "ws1-trajectory" and doc["verdict"] == "pass" and doc["failing_checks"] == []
    assert (doc["evaluations"], doc["steps_saved"], doc["complete"]) == (EVALUATIONS, EVALUATIONS, True)
    assert (doc["run"]["mode"], doc["run"]["device_kind"], doc["run"]["layout"]["name"]) == ("strict", "cpu", "micro")
    assert (doc["run"]["schedule"]["steps"], doc["run"]["batch"]["with_seed"]) == (7, None)
    assert len(doc["invocations"]) == 1
    assert doc["memory"]["upper_gib"] >= doc["memory"]["device_gib"] > 0 and doc["memory"]["available_gib"] > 0
    assert [s["step"] for s in doc["invocation"]["steps"]] == list(range(EVALUATIONS))
    for k, name in enumerate(names):
        side = json.loads((rundir / "steps" / f"{name}.json").read_text(encoding="utf-8"))
        data = (rundir / "steps" / f"{name}.safetensors").read_bytes()
        assert side["kind"] == "trajectory-step" and side["step"] == k
        assert side["file"] == f"steps/{name}.safetensors"
        assert side["file_sha256"] == hashlib.sha256(data).hexdigest()
        assert doc["step_files"][side["file"]] == side["file_sha256"]
        tensors = load_file(str(rundir / "steps" / f"{name}.safetensors"))
        assert set(tensors) == {"video_latents", "audio_latents", "video_velocity", "audio_velocity"}
        assert {n: tensor_sha256(t) for n, t in tensors.items()} == {n: r["sha256"] for n, r in side["tensors"].items()}
    sealed = shutil.copytree(rundir, tmp_path / "sealed")
    _ok(_run(["seal", str(sealed)], tmp_path))
    _ok(_run(["seal", "--verify", str(sealed)], tmp_path))


# 2. stop at 3 and resume equals the uninterrupted run


def test_stopped_at_step_3_and_resumed_equals_the_uninterrupted_run(run_b, run_a, tmp_path) -> None:
    rundir, (first, second) = run_b
    _ok(first)
    _ok(second)
    assert re.fullmatch(rf"verdict: pass \(\d+ determinism pairs; 4/{EVALUATIONS} steps saved\)",
                        first[1].splitlines()[-1])  # fmt: skip
    at_stop = json.loads((rundir.parent / "at-stop.json").read_text(encoding="utf-8"))
    assert (at_stop["doc"]["steps_saved"], at_stop["doc"]["complete"]) == (4, False)
    assert at_stop["steps"] == sorted(f"step-{k:04d}.{x}" for k in range(4) for x in ("json", "safetensors"))
    doc = _doc(rundir)
    assert (doc["steps_saved"], doc["complete"], doc["verdict"]) == (EVALUATIONS, True, "pass")
    assert len(doc["invocations"]) == 2
    one, two = doc["invocations"]
    assert (one["resumed_from"], one["until"], [s["step"] for s in one["steps"]]) == (None, 3, [0, 1, 2, 3])
    assert (two["resumed_from"], two["until"], [s["step"] for s in two["steps"]]) == (4, None, [4, 5])
    assert not any(inv.get("unrecorded") for inv in doc["invocations"])  # every invocation wrote its record
    a_dir, (a_result,) = run_a
    _ok(a_result)
    mine, theirs = _step_bytes(rundir), _step_bytes(a_dir)
    assert len(mine) == EVALUATIONS and mine == theirs
    code, cmp = _compare(a_dir, rundir, tmp_path)
    assert code == 0 and cmp["verdict"] == "pass"
    assert (cmp["all_equal"], cmp["steps_compared"], cmp["first_drift_step"], cmp["first_drift"]) == (
        True,
        EVALUATIONS,
        None,
        None,
    )
    assert all(rec["equal"] for rec in cmp["steps"])


# 3. --verify-last


def test_verify_last_recomputes_the_last_step_bitwise(run_a, tmp_path) -> None:
    rundir = _copy(run_a, tmp_path)
    before = _step_bytes(rundir)
    result = _run([*TRAJ, "--out", str(rundir), *STEPS, "--resume", "--verify-last"], tmp_path)
    _ok(result)
    last = EVALUATIONS - 1
    verdict = rf"verdict: pass \(step {last} recomputed bitwise; \d+ determinism pairs; 6/6 steps saved\)"
    assert re.fullmatch(verdict, result[1].splitlines()[-1])
    doc = _doc(rundir)
    inv = doc["invocation"]
    assert inv["verify_last"]["step"] == EVALUATIONS - 1 and inv["verify_last"]["bitwise"] is True
    assert inv["verify_last"]["per_modality"] == {"video": True, "audio": True}
    assert (inv["resumed_from"], inv["steps"], doc["verdict"]) == (EVALUATIONS, [], "pass")
    assert len(doc["invocations"]) == 2 and _step_bytes(rundir) == before


@pytest.mark.slow  # 6 s on two cores: make test-slow (.ci/run runs both); make test's budget
def test_verify_last_fails_when_the_saved_velocity_is_not_the_models(run_a, tmp_path) -> None:
    rundir = _copy(run_a, tmp_path)
    last = EVALUATIONS - 1

    def nudge(t: dict[str, torch.Tensor]) -> None:
        t["audio_velocity"][-1, 0] += 1e-3

    _rewrite_step(rundir, last, nudge)
    code, out, err = _run([*TRAJ, "--out", str(rundir), *STEPS, "--verify-last"], tmp_path)
    assert code == 1, out[-2000:] + err[-2000:]
    assert out.splitlines()[-1].startswith(f"verdict: fail (step {last} recomputed with different bytes; ")
    doc = _doc(rundir)
    assert doc["verdict"] == "fail" and doc["failing_checks"] == [f"verify_last.step_{last}.bitwise"]
    assert doc["invocation"]["verify_last"]["per_modality"] == {"video": True, "audio": False}


# 4. batch invariance


# batch invariance is gated at every node in make test by ws1-block's and ws1-model's batch lanes; the trajectory's
# own batched run (25 s of make test's 300 on two cores) runs in make test-slow, which .ci/run runs too
@pytest.mark.slow
def test_a_batched_run_equals_the_unbatched_one(run_c, run_a, tmp_path) -> None:
    rundir, (first, second) = run_c
    _ok(first)
    _ok(second)
    doc = _doc(rundir)
    assert (doc["steps_saved"], doc["complete"]) == (EVALUATIONS, True)
    assert doc["run"]["batch"] == {"with_seed": 11, "size": 2, "position": 1}
    assert [len(i["steps"]) for i in doc["invocations"]] == [3, 3]
    for k in range(EVALUATIONS):
        tensors = load_file(str(rundir / "steps" / f"step-{k:04d}.safetensors"))
        assert {"batch.video_latents", "batch.audio_latents", "batch.video_velocity", "batch.audio_velocity"} <= set(
            tensors
        )
        assert not torch.equal(tensors["batch.video_latents"], tensors["video_latents"])
    a_dir, _ = run_a
    code, cmp = _compare(a_dir, rundir, tmp_path)
    assert code == 0
    assert (cmp["all_equal"], cmp["steps_compared"], cmp["first_drift_step"]) == (True, EVALUATIONS, None)


# 5. the provider drifts, located


def test_the_provider_drifts_from_step_0_located_to_a_node(run_p, run_a, tmp_path) -> None:
    p_dir, (result,) = run_p
    _ok(result)
    assert _doc(p_dir)["run"]["mode"] == "off" and _doc(p_dir)["complete"]
    a_dir, _ = run_a
    code, cmp = _compare(a_dir, p_dir, tmp_path)
    assert code == 1 and cmp["verdict"] == "fail"
    assert (cmp["all_equal"], cmp["steps_compared"], cmp["first_drift_step"]) == (False, EVALUATIONS, 0)
    drift = cmp["first_drift"]
    assert drift["step"] == 0
    assert isinstance(drift["node"], str) and drift["node"] and isinstance(drift["stage"], str) and drift["stage"]
    assert drift["modality"] in ("video", "audio", "text") and isinstance(drift["row"], int)
    assert drift["max_abs"] > 0 and drift["rel_l2"] > 0
    step0 = cmp["steps"][0]
    assert step0["video_latents"]["bitwise"] and step0["audio_latents"]["bitwise"]  # same initial latents
    assert not step0["equal"]
    sizes = [
        rec[f"{m}_{w}"]["rel_l2"] for rec in cmp["steps"] for m in ("video", "audio") for w in ("latents", "velocity")
    ]
    assert any(s > 0 for s in sizes) and all(s >= 0 for s in sizes)
    assert all(rec["video_velocity"]["max_abs"] > 0 for rec in cmp["steps"])


# 6. refusals: exit 2, one line naming the thing, the RUNDIR left as it was (in-process: nothing is evaluated)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "9"], "schedule.steps differs"),
        ([*STEPS, "--mode", "off"], "mode differs"),
        ([*STEPS, "--batch-with", "3"], "batch.with_seed differs"),
        ([*STEPS, "--merge-order", "single"], "merge_order differs from the saved run (saved 'seg8', now 'single')"),
    ],
    ids=["steps", "mode", "batch-with", "merge-order"],
)
def test_resume_with_changed_settings_is_refused(run_a, tmp_path, run_cli, args, message) -> None:
    rundir = _copy(run_a, tmp_path)
    before = _tree(rundir)
    _refused(run_cli(*TRAJ, "--out", str(rundir), *args, "--resume"), message, "--resume")
    assert _tree(rundir) == before


@pytest.mark.parametrize(
    ("until", "message"), [("-1", "must be a step index >= 0"), ("99", "past the run's last step")]
)
def test_an_until_outside_the_runs_steps_is_refused_before_the_rundir_is_made(tmp_path, run_cli, until, message):
    rundir = tmp_path / "never"
    _refused(run_cli(*TRAJ, "--out", str(rundir), *STEPS, "--until", until), "--until", message)
    assert not rundir.exists()


def test_a_rundir_holding_a_run_is_refused_without_resume(run_a, tmp_path, run_cli) -> None:
    rundir = _copy(run_a, tmp_path)
    before = _tree(rundir)
    _refused(run_cli(*TRAJ, "--out", str(rundir), *STEPS), "holds a trajectory run already", "--resume")
    assert _tree(rundir) == before


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(("step", "damage"), [(1, _flip), (4, _truncate)], ids=["flipped-byte", "truncated"])
def test_a_damaged_step_file_is_refused(run_a, tmp_path, run_cli, step, damage) -> None:
    rundir = _copy(run_a, tmp_path)
    name = f"steps/step-{step:04d}.safetensors"
    damage(rundir / name)
    before = _tree(rundir)
    _refused(run_cli(*TRAJ, "--out", str(rundir), *STEPS, "--resume"), name, "sha256 differs")
    assert _tree(rundir) == before


def test_an_altered_sidecar_digest_is_refused(run_a, tmp_path, run_cli) -> None:
    rundir = _copy(run_a, tmp_path)
    side = rundir / "steps" / "step-0002.json"
    record = json.loads(side.read_text(encoding="utf-8"))
    record["tensors"]["video_velocity"]["sha256"] = "0" * 64
    side.write_text(json.dumps(record, indent=1), encoding="utf-8")
    before = _tree(rundir)
    line = _refused(run_cli(*TRAJ, "--out", str(rundir), *STEPS, "--resume"), "step-0002")
    assert "video_velocity" in line and "digest" in line
    assert _tree(rundir) == before


def test_a_step_whose_inputs_are_not_what_the_previous_implies_is_refused(run_a, tmp_path, run_cli) -> None:
    rundir = _copy(run_a, tmp_path)

    def nudge(t: dict[str, torch.Tensor]) -> None:
        t["video_latents"][-1, 0] += 1e-3

    _rewrite_step(rundir, 3, nudge)
    before = _tree(rundir)
    _refused(
        run_cli(*TRAJ, "--out", str(rundir), *STEPS, "--resume"),
        "steps/step-0003.safetensors",
        "not what step 2 implies",
    )
    assert _tree(rundir) == before


def test_step_0_whose_inputs_are_not_the_initial_latents_is_refused_naming_them(run_a, tmp_path, run_cli) -> None:
    rundir = _copy(run_a, tmp_path)

    def nudge(t: dict[str, torch.Tensor]) -> None:
        t["video_latents"][-1, 0] += 1e-3

    _rewrite_step(rundir, 0, nudge)
    line = _refused(run_cli(*TRAJ, "--out", str(rundir), *STEPS, "--resume"), "steps/step-0000.safetensors")
    assert "step -1" not in line and "initial" in line, line


@pytest.mark.slow  # 6 s on two cores: make test-slow (.ci/run runs both); make test's budget
def test_a_killed_invocation_leaves_temp_files_that_are_removed_and_steps_listed_as_unrecorded(run_b, tmp_path):
    """Killed while writing step 4, before it wrote its record: the resuming invocation removes the half-written
    temp files (never a step), and lists the steps the killed one saved as one ``unrecorded`` invocation (each
    step's seconds from its step record) before its own, and says so on the console."""
    rundir = _copy(run_b, tmp_path)
    steps = rundir / "steps"
    (rundir / "ws1-trajectory.json").unlink()  # the killed invocation (steps 0..3 saved) wrote no record
    for k in (4, 5):
        (steps / f"step-{k:04d}.json").unlink()
        (steps / f"step-{k:04d}.safetensors").unlink()
    want = _step_bytes(rundir)
    (steps / ".step-0004.safetensors.x.tmp").write_bytes(b"half a step file")
    (steps / ".step-0006.safetensors.x.tmp").write_bytes(b"\x00" * 100)
    code, out, err = _run([*TRAJ[1:], "--out", str(rundir), *STEPS, "--resume", "--until", "4"], tmp_path)
    assert code == 0, out[-3000:] + err[-3000:]
    assert "steps 0..3: saved by an invocation that left no record" in " ".join(out.split())
    lost, mine = _doc(rundir)["invocations"]
    assert lost["unrecorded"] is True and [s["step"] for s in lost["steps"]] == [0, 1, 2, 3]
    sides = [json.loads((steps / f"step-{k:04d}.json").read_text(encoding="utf-8")) for k in range(4)]
    assert [s["seconds"] for s in lost["steps"]] == [s["seconds"] for s in sides]
    assert "unrecorded" not in mine
    assert sorted(p.name for p in steps.iterdir()) == sorted(
        f"step-{k:04d}.{x}" for k in range(5) for x in ("json", "safetensors")
    )
    doc = _doc(rundir)
    assert (doc["steps_saved"], doc["complete"], doc["invocation"]["resumed_from"]) == (5, False, 4)
    assert [s["step"] for s in doc["invocation"]["steps"]] == [4]
    got = _step_bytes(rundir)
    assert {k: got[k] for k in want} == want
    assert got["step-0004.safetensors"] == (run_b[0] / "steps" / "step-0004.safetensors").read_bytes()


def test_verify_last_on_a_folder_without_a_run_names_its_own_flag(tmp_path, run_cli) -> None:
    code, out, err = run_cli(*TRAJ, "--out", str(tmp_path / "none"), "--verify-last")
    assert code == 2 and out == ""
    assert err.startswith("h3gate: error: --verify-last ") and "no manifest.json" in err and err.count("\n") == 1
