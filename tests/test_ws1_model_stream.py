"""``h3gate run ws1-model --stream``: the whole-model gate in three phases over a run folder gives the record an
unsharded run gives (verdict, tensors judged, failing checks, first drift / failure, every node's and gradient's
worst row per view, determinism counts); it resumes to the same record, refuses a folder of other settings, splits
its ranges over torch's launcher's ranks, and fails when a range's recomputed boundary differs from phase 1's.

The default set runs mode off (the provider bound as the candidate: the lanes, boundaries, merge and checks are the
same code, no Triton interpreter), forward only, in one module fixture; the backward's boundaries, strict mode, the
ranks and the faults are slow tests.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3gate.runs import stream_files

# memory: the plain run's plan (a streamed run plans each range, with the range's stages, and records no plan)
VOLATILE = {"timing", "provenance", "streamed", "forward_s", "stage_seconds", "seconds", "total_s", "wall_s", "memory"}
OFF = ["--mode", "off", "--no-backward"]
BACKWARD = ["--mode", "off"]


def _cli(*args: str) -> tuple[int, str]:
    from h3gate.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    return exc.value.code, out.getvalue()


def _doc(folder: Path) -> dict:
    return json.loads((folder / "ws1-model.json").read_text(encoding="utf-8"))


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _differences(a, b, path: str = "$") -> list[str]:
    """Every field (dotted path) where two records differ, timing and paths left out."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in set(a) ^ set(b)]
        for k in a:
            if k in b:
                out += _differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [] if len(a) == len(b) else [f"{path}: {len(a)} vs {len(b)} items"]
        return out + [d for i, (x, y) in enumerate(zip(a, b, strict=False)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def assert_same_record(plain: dict, streamed: dict) -> None:
    """The claims field by field (then everything else but timing and paths)."""
    assert streamed["verdict"] == plain["verdict"]
    assert streamed["failing_checks"] == plain["failing_checks"]
    for key in ("first_drift", "first_failure", "first_row_failure", "drifts"):
        assert streamed[key] == plain[key], key
    assert streamed["summary"] == plain["summary"]
    assert [n["name"] for n in streamed["nodes"]] == [n["name"] for n in plain["nodes"]]
    for s, p in zip(streamed["nodes"], plain["nodes"], strict=True):
        assert {v: r["ratio"] for v, r in s["rows"].items()} == {v: r["ratio"] for v, r in p["rows"].items()}, s["name"]
    assert (streamed["backward"] is None) == (plain["backward"] is None)
    for key in ("gradients", "leaves") if plain["backward"] is not None else ():
        sg, pg = streamed["backward"][key], plain["backward"][key]
        assert list(sg) == list(pg)
        for name in pg:
            assert {v: r["ratio"] for v, r in sg[name]["rows"].items()} == {
                v: r["ratio"] for v, r in pg[name]["rows"].items()
            }, name
    det_keys = ("evaluations", "keys", "pairs", "mismatches", "pass")
    assert {k: streamed["determinism"][k] for k in det_keys} == {k: plain["determinism"][k] for k in det_keys}
    assert _differences(_strip(plain), _strip(streamed)) == []


def _pair(tmp: Path, options: list[str]) -> dict:
    plain = _cli("--quiet", "run", "ws1-model", *options, "--out", tmp / "plain")
    streamed = _cli("--quiet", "run", "ws1-model", *options, "--stream", "--out", tmp / "streamed")
    return {"tmp": tmp, "plain": plain, "streamed": streamed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The plain and the streamed mode-off forward of the default config (tiny, micro: 2 blocks, a range each)."""
    return _pair(tmp_path_factory.mktemp("stream"), OFF)


def _stored_as_estimated(folder: Path, lanes: set[str], directions: tuple[str, ...]) -> None:
    for d in directions:
        assert (folder / "boundaries" / "before-block-1" / f"{d}.json").is_file(), d
    assert (folder / "boundaries" / "end" / "forward.json").is_file()
    stored = {p.stem for p in (folder / "boundaries" / "before-block-1" / "forward").glob("*.safetensors")}
    assert stored == {stream_files.lane_slug(n) for n in lanes}
    measured = sum(p.stat().st_size for p in (folder / "boundaries" / "before-block-1").rglob("*.safetensors"))
    estimate = json.loads((folder / "plan.json").read_text())["memory"]["bytes_per_boundary"]
    assert measured <= estimate < 2 * measured + 2**20, (measured, estimate)


def test_a_streamed_run_gives_the_unsharded_record(runs) -> None:
    (code_p, _), (code_s, out) = runs["plain"], runs["streamed"]
    assert code_s == code_p and out.splitlines()[-1].startswith("verdict: ")
    plain, streamed = _doc(runs["tmp"] / "plain"), _doc(runs["tmp"] / "streamed")
    assert_same_record(plain, streamed)
    s = streamed["streamed"]
    assert s["plan"]["ranges"] == [[0, 1], [1, 2]] and s["ranges_missing"] == []
    assert [r["range"] for r in s["ranges"]] == [[0, 1], [1, 2]]
    assert s["ranges"][0]["stages"][0] == "embed" and s["ranges"][1]["stages"][-1] == "heads"
    for r in s["ranges"]:  # the clock split: every part measured
        assert r["parts"]["forward"]["seconds"] > 0 and r["parts"]["forward"]["golden"] > 0
        assert r["parts"]["forward"]["isolated"] > 0 and r["parts"]["forward"]["batch"] > 0
    _stored_as_estimated(runs["tmp"] / "streamed", {lane["name"] for lane in streamed["lanes"]}, ("forward",))


def streamed_lanes(runs: dict) -> list[dict]:
    return _doc(runs["tmp"] / "streamed")["lanes"]


def test_the_projection_tool_reads_the_measured_ranges(runs, capsys) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "project_ws1_model.py"
    spec = importlib.util.spec_from_file_location("project_ws1_model", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(runs["tmp"] / "streamed"), "--blocks", "50", "--range-size", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    proj, block = doc["projection"], doc["per_block"]["forward"]
    assert doc["blocks_measured"] == ["block.0", "block.1"] and proj["ranges"] == 10
    assert abs(sum(block[p] for p in tool.PARTS) - block["seconds"]) < 1e-3
    one, eight = proj["gpus"]["1"], proj["gpus"]["8"]
    assert one["phase2_s"] == proj["phase2_work_s"] and one["phase2_s"] / 5 < eight["phase2_s"] < one["phase2_s"]
    # three values each rounded to 0.1 s: their sums differ by at most 3 * 0.05 s
    assert abs(one["total_s"] - (proj["phase1_s"] + one["phase2_s"])) <= 0.15 + 1e-9
    # phase 1 split by lane: every lane's seconds are in the sidecars; on 8 ranks the slowest rank's share
    lanes = doc["phase1_lanes_s"]["forward"]
    assert set(lanes) == {lane["name"] for lane in streamed_lanes(runs)} and all(v > 0 for v in lanes.values())
    assert one["phase1_from"] == eight["phase1_from"] == "per-lane seconds" and one["phase1_s"] == proj["phase1_s"]
    assert one["phase1_s"] - sum(lanes.values()) * 25 - 0.1 < eight["phase1_s"] < one["phase1_s"]
    # phase 1 ran 2 blocks, its backward (none here) would cover range 1:2; projected: 50 blocks, backward 5:50
    assert proj["phase1_scale"] == {"forward": 25.0, "backward": 45.0}


def test_an_interrupted_run_resumes_to_the_same_record(runs) -> None:
    """Phase 1 stopped after its first boundary (its end and backward boundaries gone), one range gated."""
    folder = runs["tmp"] / "resumed"
    shutil.copytree(runs["tmp"] / "streamed", folder)
    (folder / "ws1-model.json").unlink()
    (folder / "ranges" / "1-2.json").unlink()
    shutil.rmtree(folder / "boundaries" / "end")
    code, out = _cli("--quiet", "run", "ws1-model", *OFF, "--stream", "--resume", folder)
    assert code == runs["streamed"][0], out
    assert_same_record(_doc(runs["tmp"] / "streamed"), _doc(folder))
    assert _doc(folder)["streamed"]["ranges_missing"] == [] and _doc(folder)["streamed"]["phase1"]["calls"] == 2


@pytest.mark.slow  # mode off with the backward: plain, streamed, and resumed from the middle of phase 1's backward
def test_the_backward_streams_and_resumes_to_the_unsharded_record(tmp_path, monkeypatch) -> None:
    """Phase 1's backward recomputes block 1's range one stage at a time (host checkpoints between)."""
    monkeypatch.setattr("h3gate.runs.model_stream.SEGMENT", 1)
    pair = _pair(tmp_path, BACKWARD)
    assert pair["streamed"][0] == pair["plain"][0]
    plain, streamed = _doc(tmp_path / "plain"), _doc(tmp_path / "streamed")
    assert_same_record(plain, streamed)
    assert streamed["backward"]["leaves"] and streamed["streamed"]["ranges"][0]["parts"]["backward"]["golden"] > 0
    _stored_as_estimated(tmp_path / "streamed", {lane["name"] for lane in streamed["lanes"]}, ("forward", "backward"))
    folder = tmp_path / "streamed"
    for gone in ("ws1-model.json", "ranges/0-1.json", "boundaries/before-block-1/backward.json"):
        (folder / gone).unlink()
    code, _ = _cli("--quiet", "run", "ws1-model", *BACKWARD, "--stream", "--resume", folder)
    assert code == pair["plain"][0]
    assert_same_record(plain, _doc(folder))


def test_resume_refuses_a_folder_of_other_settings(runs, run_cli) -> None:
    code, out, err = run_cli("run", "ws1-model", *OFF, "--seed", "1", "--stream", "--resume", runs["tmp"] / "streamed")
    assert code == 2 and out == ""
    assert err.strip().endswith("run.seed differs from the saved run (saved 0, now 1)") and len(err.splitlines()) == 1
    code, _, err = run_cli("run", "ws1-model", "--mode", "off", "--stream", "--resume", runs["tmp"] / "streamed")
    assert code == 2 and "backward differs from the saved run (saved False, now True)" in err
    code, _, err = run_cli("run", "ws1-model", *OFF, "--resume", runs["tmp"] / "plain")
    assert code == 2 and "no plan.json (not a streamed ws1-model run folder)" in err


@pytest.mark.slow  # one range again (~3 s; --from and --merge are in the negative control below too)
def test_one_range_then_a_merge(runs, tmp_path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(runs["tmp"] / "streamed", folder)
    (folder / "ws1-model.json").unlink()
    (folder / "ranges" / "0-1.json").unlink()
    code, out = _cli("--quiet", "run", "ws1-model", *OFF, "--merge", folder)
    assert code == 2
    code, out = _cli("--quiet", "run", "ws1-model", *OFF, "--merge", folder, "--partial")
    assert code == 1 and _doc(folder)["failing_checks"][-1] == "stream.incomplete (ranges 0:1 not gated)"
    code, out = _cli("--quiet", "run", "ws1-model", *OFF, "--layers", "0:1", "--from", folder)
    assert code == 0 and out.splitlines()[-1].startswith("verdict: complete (range 0:1 of 2 gated")
    code, out = _cli("--quiet", "run", "ws1-model", *OFF, "--merge", folder)
    assert code == runs["streamed"][0]
    assert_same_record(_doc(runs["tmp"] / "plain"), _doc(folder))


def _bump_boundary(folder: Path, lane: str, tensor: str) -> None:
    """Rewrite one lane's stored boundary with one element changed and its sidecar updated: a phase 1 whose
    values a range does not reproduce."""
    from safetensors.torch import load_file

    path = folder / "boundaries" / "before-block-1" / "forward" / f"{stream_files.lane_slug(lane)}.safetensors"
    values = load_file(str(path))
    t = values[tensor].clone()
    t.view(-1)[7] = t.view(-1)[7] * 2 + 1
    values[tensor] = t
    from h3gate.evidence.writer import atomic_write_safetensors

    atomic_write_safetensors({path: values}, {"lane": lane}, "test")
    side = folder / "boundaries" / "before-block-1" / "forward.json"
    doc = json.loads(side.read_text())
    from h3gate.evidence.provenance import sha256_file

    doc["lanes"][lane]["sha256"] = sha256_file(path)
    side.write_text(json.dumps(doc))


def test_a_range_whose_end_differs_from_phase_1_fails_naming_lane_and_tensor(runs, tmp_path) -> None:
    """Negative control of the cross-phase check: the candidate's and the provider's stored block-0 outputs altered
    in one element; the candidate's fails the gate, the provider's is reported (as its determinism mismatches)."""
    folder = tmp_path / "run"
    shutil.copytree(runs["tmp"] / "streamed", folder)
    (folder / "ws1-model.json").unlink()
    (folder / "ranges" / "0-1.json").unlink()
    _bump_boundary(folder, "candidate", "block.0.residual_mlp")
    _bump_boundary(folder, "provider", "block.0.residual_mlp")
    code, _ = _cli("--quiet", "run", "ws1-model", *OFF, "--layers", "0:1", "--from", folder)
    assert code == 0
    code, out = _cli("--quiet", "run", "ws1-model", *OFF, "--merge", folder)
    doc = _doc(folder)
    assert code == 1 and doc["verdict"] == "fail"
    bad = [c for c in doc["failing_checks"] if c.startswith("stream.boundary.")]
    assert len(bad) == 1 and bad[0].startswith("stream.boundary.candidate.block.0.residual_mlp.bitwise")
    assert "phase 1's stored boundary, row 0)" in bad[0]
    kinds = {m["lane"]: m["fails"] for m in doc["streamed"]["ranges"][0]["boundary_mismatches"]}
    assert kinds == {"candidate": True, "provider": False}
    first = doc["first_failure"]
    assert (first["check"], first["node"], first["row"]) == ("stream_boundary_bitwise", "block.0.residual_mlp", 0)


def test_an_altered_boundary_file_is_refused(runs, tmp_path, run_cli) -> None:
    folder = tmp_path / "run"
    shutil.copytree(runs["tmp"] / "streamed", folder)
    path = folder / "boundaries" / "before-block-1" / "forward" / "candidate.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    code, _, err = run_cli("run", "ws1-model", *OFF, "--layers", "1:2", "--from", folder)
    (folder / "ranges" / "1-2.json").unlink()
    code, _, err = run_cli("run", "ws1-model", *OFF, "--layers", "1:2", "--from", folder)
    assert code == 2 and "candidate.safetensors: sha256 differs from its sidecar" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stream", "--ranges", "0:1"], "--ranges '0:1': must be contiguous ranges A:B covering blocks 0 .. 1"),
        (["--stream", "--ranges", "0:1,x"], "--ranges '0:1,x': 'x' is not A:B"),
        (["--stream", "--ranges", "0:1", "--range-size", "1"], "--ranges and --range-size: give one of them"),
        (["--stream", "--fault", "block.1.o_proj:3:ulp@1"], "ulp@K counts one process's evaluations"),
        (["--stream", "--candidate", "sglang"], "the SGLang candidate is computed whole"),
    ],
)
def test_bad_streamed_input_is_exit_2_with_one_line(run_cli, tmp_path, args, message) -> None:
    code, out, err = run_cli("run", "ws1-model", *OFF, *args, "--out", tmp_path / "ev")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "ev").exists()


def test_from_needs_a_planned_range(runs, run_cli) -> None:
    folder = runs["tmp"] / "streamed"
    code, _, err = run_cli("run", "ws1-model", *OFF, "--layers", "0:2", "--from", folder)
    assert code == 2 and "--layers 0:2: not one of the run's ranges (0:1, 1:2)" in err
    code, _, err = run_cli("run", "ws1-model", *OFF, "--from", folder)
    assert code == 2 and "--from RUNDIR: needs --layers A:B" in err


def test_boundaries_beyond_the_disk_are_refused_before_anything_runs(monkeypatch, run_cli, tmp_path) -> None:
    monkeypatch.setattr("h3gate.memory.free_disk_bytes", lambda path: 1000)
    code, out, err = run_cli("run", "ws1-model", *OFF, "--stream", "--out", tmp_path / "ev")
    assert code == 2 and len(err.splitlines()) == 1
    assert "--stream: 2 boundaries of" in err and "1000" not in out and "fewer ranges (--range-size)" in err
    assert not (tmp_path / "ev" / "boundaries").exists()


def _subprocess(args: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3gate", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=1200)  # fmt: skip


def _env(threads: int = 1) -> dict:
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}


@pytest.mark.slow  # strict kernels under the interpreter: the plain run, then 2 gloo ranks (~2 min on two cores)
def test_two_ranks_under_torchrun_give_the_unsharded_record(tmp_path) -> None:
    from h3gate.ranks import run_ranks

    plain = _subprocess(["--quiet", "run", "ws1-model", "--out", tmp_path / "plain"], _env())
    args = ["--quiet", "run", "ws1-model", "--stream", "--out", str(tmp_path / "streamed")]
    errors = run_ranks("h3gate", 2, tmp_path / "launch", 1, 1200, args=args)
    assert errors == [], errors
    doc = _doc(tmp_path / "streamed")
    assert_same_record(_doc(tmp_path / "plain"), doc)
    assert plain.returncode == (0 if doc["verdict"] == "pass" else 1)
    assert doc["streamed"]["world_size"] == 2 and [r["rank"] for r in doc["streamed"]["ranges"]] == [0, 1]
    logs = (tmp_path / "launch" / "rank-logs").rglob("stdout.log")
    text = {p.parent.name: p.read_text() for p in logs}
    assert text["0"].splitlines()[-1].startswith("verdict: ") and text["1"].startswith("rank 1: ranges 1:2 gated")


TURNS_MAIN = """import sys
from h3gate.commands import model_stream_cmd
from h3gate.cli import main

model_stream_cmd.turns_to_fit = lambda nbytes, sharing, available: sharing  # as if two gates did not fit at once
sys.exit(main())
"""


@pytest.mark.slow  # two gloo ranks launched by torchrun (~8 s of one core), kept out of make test's budget
def test_ranks_sharing_a_device_that_cannot_hold_both_gates_take_turns(runs, tmp_path, monkeypatch) -> None:
    """Two ranks on one device (the CPU here) whose phase-2 gates do not fit it together gate their ranges one rank
    at a time (``device_turns`` 2 in the record) and give the unsharded record."""
    from h3gate.ranks import run_ranks

    (tmp_path / "turns_main.py").write_text(TURNS_MAIN, encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    args = ["--quiet", "run", "ws1-model", *OFF, "--stream", "--out", str(tmp_path / "streamed")]
    errors = run_ranks("turns_main", 2, tmp_path / "launch", 1, 1200, args=args)
    assert errors == [], errors
    doc = _doc(tmp_path / "streamed")
    assert_same_record(_doc(runs["tmp"] / "plain"), doc)
    assert doc["streamed"]["world_size"] == 2 and doc["streamed"]["device_turns"] == 2
    assert [r["rank"] for r in doc["streamed"]["ranges"]] == [0, 1]


def test_which_ranks_share_a_device_and_when_they_take_turns() -> None:
    """Local rank R on GPU R mod count; the CPU is one device for every local rank. Turns: all at once where the
    upper estimate fits ``sharing`` times, else one at a time (4 ranks of ~20 GiB on a 79 GiB H100: 4 turns)."""
    from h3gate.commands.model_stream_cmd import placement
    from h3gate.memory import turns_to_fit

    assert [placement("cuda", r, 4, 1) for r in range(4)] == [(0, 4, 0), (0, 4, 1), (0, 4, 2), (0, 4, 3)]
    assert [placement("cuda", r, 4, 2) for r in range(4)] == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    assert [placement("cuda", r, 3, 2) for r in range(3)] == [(0, 2, 0), (1, 1, 0), (0, 2, 1)]
    assert [placement("cuda", r, 8, 8) for r in range(8)] == [(r, 1, 0) for r in range(8)]
    assert [placement("cuda", r, 2, 8) for r in range(2)] == [(0, 1, 0), (1, 1, 0)]  # fewer ranks than GPUs
    assert [placement("cpu", r, 2, 4) for r in range(2)] == [(0, 2, 0), (0, 2, 1)]
    gib = 2**30
    assert turns_to_fit(20 * gib, 4, 79 * gib) == 4 and turns_to_fit(20 * gib, 2, 79 * gib) == 1
    assert turns_to_fit(20 * gib, 1, 10 * gib) == 1 and turns_to_fit(None, 4, 79 * gib) == 1
    assert turns_to_fit(20 * gib, 4, None) == 1


@pytest.mark.slow  # a one-row fault in block 1, strict kernels, plain and streamed (~2 min on two cores)
def test_a_fault_in_block_1_is_located_where_the_unsharded_run_locates_it(tmp_path) -> None:
    fault = ["--fault", "block.1.o_proj:5"]
    _subprocess(["--quiet", "run", "ws1-model", *fault, "--out", tmp_path / "plain"], _env())
    done = _subprocess(["--quiet", "run", "ws1-model", *fault, "--stream", "--out", tmp_path / "s"], _env())
    assert done.returncode == 1, done.stderr[-2000:]
    plain, streamed = _doc(tmp_path / "plain"), _doc(tmp_path / "s")
    assert streamed["first_failure"]["node"] == "block.1.o_proj" and streamed["first_failure"]["row"] == 5
    assert_same_record(plain, streamed)


@pytest.mark.slow  # mode off, forward only: the plain and the streamed run (~10 s on two cores)
def test_a_fault_in_block_1_mode_off(tmp_path) -> None:
    fault = ["--fault", "block.1.o_proj:5", "--no-backward"]
    _cli("--quiet", "run", "ws1-model", *OFF, *fault, "--out", tmp_path / "plain")
    code, _ = _cli("--quiet", "run", "ws1-model", *OFF, *fault, "--stream", "--out", tmp_path / "s")
    plain, streamed = _doc(tmp_path / "plain"), _doc(tmp_path / "s")
    assert code == 1 and streamed["first_failure"]["node"] == "block.1.o_proj"
    assert streamed["first_failure"]["row"] == 5 and streamed["first_failure"]["layer"] == 1
    assert_same_record(plain, streamed)


def test_torch_is_not_left_in_a_process_group() -> None:
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


def test_the_default_range_plans() -> None:
    from h3gate.commands.model_stream_cmd import parse_ranges

    assert parse_ranges(None, None, 2) == [(0, 1), (1, 2)]
    assert parse_ranges(None, None, 50) == [(a, a + 5) for a in range(0, 50, 5)]
    assert parse_ranges(None, 7, 50)[-1] == (49, 50) and parse_ranges("0:5,5:45,45:50", None, 50)[1] == (5, 45)


def _refused_variant():
    """A provider variant that fails when entered, as a variant that runs out of memory at a long S (at 768p)."""
    from h3gate.gate.variants import Variant

    @contextlib.contextmanager
    def enter():
        raise RuntimeError("CUDA out of memory. Tried to allocate 340.00 GiB")
        yield

    return Variant("oom", enter)


def test_a_lane_refused_in_the_forward_gets_no_cotangents() -> None:
    from h3gate.graph.core import OpTable
    from h3gate.graph.model import OUTPUTS
    from h3gate.runs.model_backward import model_incoming
    from h3gate.runs.model_lanes import Lane

    outputs = {name: torch.zeros(1, 3, 2) for name in OUTPUTS}
    kept = Lane("provider", "provider", OpTable(lambda op: None), dict(outputs), save=True)
    no_table = OpTable(lambda op: None)
    refused = Lane("provider:oom", "provider", no_table, {}, save=True, refused="refused at run time: out of memory")
    incoming = model_incoming(0, [kept, refused])
    assert incoming["provider:oom"] == {} and set(incoming["provider"]) == set(OUTPUTS)
    with pytest.raises(KeyError, match="heads.video_select"):  # control: the refusal is what spares the lane
        model_incoming(0, [Lane("provider:oom", "provider", OpTable(lambda op: None), {}, save=True)])


@pytest.mark.slow  # mode off with the backward, plain and streamed, a variant refused at once (~10 s on two cores)
def test_a_variant_refused_in_the_forward_streams_with_the_backward(tmp_path, monkeypatch) -> None:
    """A provider variant refused at run time (out of memory) is recorded as skipped by both runs; phase 1's
    backward and the ranges go on without it, to the unsharded record."""
    from h3gate.runs import ws1_model

    real = ws1_model.provider_variants
    monkeypatch.setattr(ws1_model, "provider_variants",
                        lambda names, device: _with_variant(real(names, device), _refused_variant()))  # fmt: skip
    plain = _cli("--quiet", "run", "ws1-model", *BACKWARD, "--out", tmp_path / "plain")
    monkeypatch.setattr(ws1_model, "provider_variants",
                        lambda names, device: _with_variant(real(names, device), _refused_variant()))  # fmt: skip
    streamed = _cli("--quiet", "run", "ws1-model", *BACKWARD, "--stream", "--out", tmp_path / "streamed")
    assert streamed[0] == plain[0] == 0, (plain, streamed)
    doc = _doc(tmp_path / "streamed")
    skipped = doc["row_rule"]["variants_skipped"]
    assert any(s["name"] == "oom" and "out of memory" in s["reason"] for s in skipped), skipped
    assert_same_record(_doc(tmp_path / "plain"), doc)


def _with_variant(made, variant):
    run, skipped = made
    return [*run, variant], skipped


@pytest.mark.slow  # mode off, backward fault: plain, plain and streamed holding on the host (~10 s; the stage
# backward's keeps are checked bitwise in make test: tests/test_stage_keep.py)
def test_holding_on_the_host_gives_the_same_record_and_locates_a_backward_fault(tmp_path, monkeypatch) -> None:
    """The backward holding on the host (the golden's gradients and the waiting provider's in host memory, as at 768p
    on one H200) gives the record of the run holding on the device, plain and streamed, to the field: a one-row
    backward fault is still caught at its row and named after its maker. The records say where the run held."""
    from h3gate.commands import model_stream_cmd
    from h3gate.runs import setup, ws1_model

    fault = [*BACKWARD, "--fault", "block.0.ffn_down:70:scale:backward"]
    code, _ = _cli("--quiet", "run", "ws1-model", *fault, "--out", tmp_path / "device")
    for module in (setup, ws1_model, model_stream_cmd):
        monkeypatch.setattr(module, "hold_on_host", lambda cfg, rows, providers, backward, device: backward)
    held, _ = _cli("--quiet", "run", "ws1-model", *fault, "--out", tmp_path / "host")
    streamed, _ = _cli("--quiet", "run", "ws1-model", *fault, "--stream", "--out", tmp_path / "streamed")
    assert code == held == streamed == 1
    device, host = _doc(tmp_path / "device"), _doc(tmp_path / "host")
    failure = host["first_row_failure"]
    assert (failure["direction"], failure["node"], failure["row"], failure["operator"]) == (
        "backward", "block.0.swiglu", 70, "block.0.ffn_down",
    )  # fmt: skip
    assert "hold" not in device["memory"] and host["memory"]["hold"] == "host"
    assert_same_record(device, host)
    doc = _doc(tmp_path / "streamed")
    assert_same_record(device, doc)
    ranges = [json.loads(p.read_text()) for p in sorted((tmp_path / "streamed" / "ranges").glob("*.json"))]
    assert ranges and {r["timing"]["held"] for r in ranges} == {"host"}
