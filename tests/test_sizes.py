"""Issue 43 items 1-3: absurd sizes refused against an estimate, bounded JSON/YAML, failing writes, output paths.

Each refusal is exit 2 (an InputError naming the option, field or file) before any allocation; each bounded parser
has a negative control (the same input through the unbounded parser raises RecursionError); the estimates are
compared with what the work measurably takes (peak RSS of a subprocess, bytes written).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from h3gate import memory
from h3gate.bounded import MAX_DEPTH, MAX_YAML_NODES, json_depth, loads_json, loads_yaml
from h3gate.errors import InputError

DEEP = 50_000
ROOT = Path(__file__).resolve().parents[1]


def _deep_json(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


# ---- 2. bounded parsers ---------------------------------------------------------------------------------------


def test_deep_json_is_an_input_error_naming_the_file_and_the_limit():
    with pytest.raises(RecursionError):  # negative control: the unbounded parser
        json.loads(_deep_json())
    with pytest.raises(InputError, match=rf"cfg\.json: JSON nested {DEEP} levels deep, above the limit of {MAX_DEPTH}"):
        loads_json(_deep_json(), "cfg.json")
    assert loads_json(_deep_json(MAX_DEPTH), "ok.json") == json.loads(_deep_json(MAX_DEPTH))


def test_json_depth_skips_string_literals():
    assert json_depth('{"a": "[[[[{{{{\\"[[", "b": [1, {"c": []}]}') == 4
    assert json_depth("17") == 0


def test_oversized_json_is_refused_before_parsing():
    with pytest.raises(InputError, match=r"big\.json: 101 bytes exceeds the 100-byte limit"):
        loads_json("[" + "0," * 49 + "0]", "big.json", max_bytes=100)


def test_deep_yaml_is_an_input_error():
    text = "a: " + "[" * DEEP + "]" * DEEP + "\n"
    with pytest.raises(RecursionError):  # negative control
        yaml.safe_load(text)
    with pytest.raises(InputError, match=rf"t\.yaml: YAML nested more than {MAX_DEPTH} levels deep"):
        loads_yaml(text, "t.yaml")


def test_yaml_alias_expansion_is_bounded_but_plain_anchors_load():
    assert loads_yaml("a: &x [1, 2]\nb: *x\n", "ok.yaml") == {"a": [1, 2], "b": [1, 2]}
    levels = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(7)]
    with pytest.raises(InputError, match=f"past the limit of {MAX_YAML_NODES:,} nodes"):
        loads_yaml("\n".join(levels) + "\n", "lol.yaml")
    assert len(yaml.safe_load("\n".join(levels[:3]) + "\n")) == 3  # control: the same shape, small, loads


def test_every_manifest_loads_through_the_bounded_loader():
    from h3gate.manifests.loader import read_yaml
    from h3gate.paths import MANIFESTS

    files = sorted(MANIFESTS.rglob("*.yaml"))
    assert files
    for f in files:
        assert read_yaml(f) is not None


def _deep_files(tmp_path: Path) -> dict[str, Path]:
    deep = _deep_json()
    (tmp_path / "config.json").write_text(deep)
    (tmp_path / "index.json").write_text(deep)
    (tmp_path / "deep.yaml").write_text("a: " + deep + "\n")
    blob = deep.encode()
    (tmp_path / "h.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob)
    return {n: tmp_path / n for n in ("config.json", "index.json", "deep.yaml", "h.safetensors")}


@pytest.mark.parametrize("reader", ["config.json", "index.json", "header", "tolerance", "config yaml", "evidence"])
def test_every_reader_refuses_a_deep_document(reader, tmp_path):
    """config.json and index.json (``checkpoint.read_json``), a safetensors header, a ``--tolerance`` and a
    ``--config`` YAML, an evidence file under seal/report (``seal.load_json``)."""
    from h3gate.checkpoint import read_json, read_safetensors_header
    from h3gate.evidence.seal import load_json
    from h3gate.manifests.model_config import load_config
    from h3gate.manifests.tolerances import load_tolerance

    files = _deep_files(tmp_path)
    call = {
        "config.json": lambda: read_json(files["config.json"]),
        "index.json": lambda: read_json(files["index.json"]),
        "header": lambda: read_safetensors_header(files["h.safetensors"]),
        "tolerance": lambda: load_tolerance(files["deep.yaml"]),
        "config yaml": lambda: load_config(files["deep.yaml"]),
        "evidence": lambda: load_json(files["config.json"], "run/ws1-ops.json"),
    }[reader]
    with pytest.raises(InputError, match=r"(\.json|\.yaml|\.safetensors): .*nested .*(limit of 64|64 levels)"):
        call()


@pytest.mark.parametrize("verb", ["fingerprint", "seal"])
def test_deep_documents_under_the_cli_are_exit_2(verb, tmp_path, run_cli):
    folder = tmp_path / "in"
    folder.mkdir()
    if verb == "fingerprint":
        (folder / "config.json").write_text(_deep_json())
        code, _, err = run_cli("fingerprint", "--checkpoint", folder, "--out", tmp_path / "ev")
    else:
        (folder / "ws1-ops.json").write_text(_deep_json())
        code, _, err = run_cli("seal", folder)
    assert code == 2, err
    assert err.startswith("h3gate: error: ") and "nested 50000 levels deep, above the limit of 64" in err, err


# ---- 2. failing writes -----------------------------------------------------------------------------------------


def test_a_failed_safetensors_write_is_exit_2_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from h3gate.evidence.writer import atomic_write_safetensors

    def full(*_a, **_k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(InputError, match=r"step 0: cannot write \(.*StorageFull"):
        atomic_write_safetensors({tmp_path / "a.safetensors": {"x": torch.zeros(2)}}, {}, "step 0")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_text_write_is_exit_2_naming_the_path(tmp_path, monkeypatch):
    from h3gate.evidence import writer

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", full)
    with pytest.raises(InputError, match=r"e\.json: cannot write \(No space left on device\)"):
        writer.atomic_write_text(tmp_path / "e.json", "{}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_trajectory_on_a_full_disk_is_exit_2(tmp_path):
    """RLIMIT_FSIZE in a subprocess: every write past 2 KB fails (EFBIG), as a full disk would."""
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000)); from h3gate.cli import main; "
        f"main(['run', 'ws1-trajectory', '--steps', '3', '--out', {str(tmp_path / 't')!r}])"
    )
    # GIT_OPTIONAL_LOCKS=0: provenance's ``git status`` must not try to refresh the checkout's index under the limit
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "GIT_OPTIONAL_LOCKS": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot write" in proc.stderr and "Traceback" not in proc.stderr


# ---- 1. sizes --------------------------------------------------------------------------------------------------


def test_steps_above_the_declared_maximum_are_refused_before_any_grid():
    from h3gate.schedule import build_schedule

    with pytest.raises(InputError, match=r"--steps 1000000000: above the limit of 10,000"):
        build_schedule(1_000_000_000, 12.0)
    assert build_schedule(memory.MAX_STEPS, 12.0).steps == memory.MAX_STEPS  # control: the limit itself is fine


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_layers", 1_000_000_000, "num_layers \\+ num_refiner_layers 1000000001: above the limit"),
        ("hidden_size", 1_000_000_000, "hidden_size 1000000000: above the limit"),
        ("num_attention_heads", 1_000_000_000, "num_attention_heads \\* attention_head_dim 128000000000"),
    ],
)
def test_absurd_config_fields_are_refused_naming_the_field(field, value, message):
    from h3gate.checkpoint import parse_diffusers_config
    from h3gate.manifests.model_config import load_config

    body = load_config("tiny").config.diffusers_config()
    assert parse_diffusers_config(dict(body), "ok/config.json").num_layers == body["num_layers"]  # control
    with pytest.raises(InputError, match="x/config.json: .*" + message):
        parse_diffusers_config({**body, field: value}, "x/config.json")


def test_config_bookkeeping_is_checked_against_host_memory(monkeypatch):
    from h3gate.manifests import model_config
    from h3gate.manifests.loader import validate

    body = model_config.load_config("tiny").config.model_dump()
    monkeypatch.setattr(model_config, "host_available_bytes", lambda: 100 * model_config.LAYER_STRUCTURE_BYTES)
    assert validate({**body, "num_layers": 90}, model_config.ModelConfig, "c").num_layers == 90
    with pytest.raises(InputError, match="c: .*num_layers 200: needs at least .* GiB of host memory"):
        validate({**body, "num_layers": 200}, model_config.ModelConfig, "c")


def test_host_memory_honours_rlimit_as():
    code = (
        "import resource; from h3gate import memory; before = memory.host_available_bytes(); "
        "mapped = memory._proc_kib('/proc/self/status', 'VmSize'); "
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, resource.RLIM_INFINITY)); "
        "after = memory.host_available_bytes(); print(before, after)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert after <= 2**30 < before


def test_synth_refuses_a_disk_too_small_and_leaves_nothing(tmp_path, monkeypatch):
    from h3gate import synth
    from h3gate.manifests.model_config import load_config

    monkeypatch.setattr(memory.shutil, "disk_usage", lambda _p: type("U", (), {"free": 10_000})())
    with pytest.raises(InputError, match=r"writes at least .* GiB, 0.0 GiB free on the disk of"):
        synth.write_checkpoint(load_config("tiny").config, 0, tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_synth_disk_estimate_covers_what_it_writes(tmp_path, monkeypatch):
    from h3gate import synth
    from h3gate.manifests.model_config import load_config

    seen: list[int] = []
    monkeypatch.setattr(synth, "require_disk", lambda n, *_a, **_k: seen.append(n))
    for shard in (None, 200_000):
        out = tmp_path / f"c{shard}"
        synth.write_checkpoint(load_config("tiny").config, 0, out, shard_size=shard)
        written = sum(f.stat().st_size for f in out.iterdir())
        assert written <= seen[-1] <= 2 * written + synth.CONFIG_FILES_BYTES, (written, seen[-1])


# The child reports its own high-water mark (VmHWM, reset by exec) as it exits: a child's ru_maxrss would also count
# the pages of the parent it was forked from (a pytest worker holding GBs after other tests), hiding any growth.
_REPORT_PEAK = """import atexit, re, sys
atexit.register(lambda: print("VMHWM", re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1),
                              file=sys.stderr))
from h3gate.cli import main
main(sys.argv[1:])
"""


def _peak_rss_kib(argv: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _REPORT_PEAK, *argv], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(next(line.split()[1] for line in proc.stderr.splitlines() if line.startswith("VMHWM ")))


@pytest.mark.slow
def test_schedule_estimate_against_measured_peak():
    """``schedule --steps N`` (the printed table): the estimate covers the peak's growth over a 2-point grid and is
    not absurdly above it."""
    from h3gate.commands.schedule_cmd import PRINT_BYTES_PER_STEP

    base = _peak_rss_kib(["schedule", "--steps", "2"]) * 1024
    for steps in (5000, 10_000):
        grown = _peak_rss_kib(["schedule", "--steps", str(steps)]) * 1024 - base
        estimate = PRINT_BYTES_PER_STEP * steps
        assert grown <= estimate <= 4 * grown + 16 * 2**20, (steps, grown, estimate)


def test_check_writable(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file, not a folder"):
        memory.check_writable(tmp_path / "f" / "x", "--save-tensors", folder=True)
    with pytest.raises(InputError, match="cannot write in /proc"):
        memory.check_writable(Path("/proc/h3gate-nowhere/x"), "--save-tensors", folder=True)
    with pytest.raises(InputError, match="exists and is not a folder"):
        memory.check_writable(tmp_path / "f", "--save-tensors", folder=True)
    memory.check_writable(tmp_path / "new" / "deeper", "--save-tensors", folder=True)  # control
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


# ---- 3. output paths and indices before the work ---------------------------------------------------------------


@pytest.mark.parametrize("verb", ["ws1-block", "ws1-model"])
def test_save_tensors_is_checked_before_the_gate(verb, tmp_path, run_cli, monkeypatch):
    from h3gate.commands import model_cmd, run_cmd

    def no_work(*_a, **_k):
        raise AssertionError("the gate started before --save-tensors was checked")

    for module in (run_cmd, model_cmd):
        monkeypatch.setattr(module, "prepare", no_work)
    code, _, err = run_cli("run", verb, "--save-tensors", "/proc/h3gate-nowhere/x", "--out", tmp_path / "ev")
    assert code == 2 and "--save-tensors /proc/h3gate-nowhere/x: cannot write in /proc" in err, err


@pytest.mark.parametrize("verb", [["layout", "tiny"], ["schedule", "--steps", "4"]])
def test_save_is_checked_before_the_work(verb, run_cli):
    code, _, err = run_cli(*verb, "--save", "/sys/h3gate.safetensors")
    assert code == 2 and "--save /sys/h3gate.safetensors: cannot write in /sys" in err, err


@pytest.mark.slow
def test_trajectory_disk_estimate_covers_each_step_file(tmp_path, run_cli):
    from h3gate.runs.ws1_trajectory import TrajectorySettings, prepare_trajectory, step_file_bytes

    for batch_with in (None, 7):
        extra = [] if batch_with is None else ["--batch-with", str(batch_with)]
        out = tmp_path / f"t{batch_with}"
        code, _, err = run_cli("run", "ws1-trajectory", "--steps", "3", "--device", "cpu", "--out", out, *extra)
        assert code == 0, err
        estimate = step_file_bytes(prepare_trajectory(TrajectorySettings(steps=3, batch_with=batch_with)))
        for side in sorted((out / "steps").glob("step-*.json")):
            written = side.stat().st_size + side.with_suffix(".safetensors").stat().st_size
            assert written <= estimate <= 2 * written + 64 * 1024, (written, estimate)


@pytest.mark.slow
def test_ws1_ops_estimate_against_measured_peak(tmp_path):
    """``run ws1-ops --op h3_swiglu`` at tiny (264 rows) and medium (3160): the estimate's growth covers the
    measured peak's growth and is not absurdly above it."""
    from h3gate.manifests.model_config import load_config
    from h3gate.runs.ws1_ops import case_bytes

    cfg = load_config("tiny").config
    peaks = {}
    for layout, rows in (("tiny", 264), ("medium", 3160)):
        argv = ["run", "ws1-ops", "--op", "h3_swiglu", "--layouts", layout, "--out", str(tmp_path / layout)]
        peaks[rows] = _peak_rss_kib(argv) * 1024
    grown = peaks[3160] - peaks[264]
    estimate = case_bytes("h3_swiglu", 3160, cfg) - case_bytes("h3_swiglu", 264, cfg)
    assert grown <= estimate <= 4 * grown + 16 * 2**20, (grown, estimate)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["schedule", "--steps", "1000000000"], "--steps 1000000000: above the limit of 10,000"),
        (["run", "ws1-trajectory", "--steps", "1000000000"], "--steps 1000000000: above the limit of 10,000"),
        (["run", "arms", "--steps", "1000000000"], "--steps 1000000000: above the limit of 10,000"),
        (
            ["run", "arms", "--batch", "1000000000"],
            "--batch 1000000000 --steps 4 at --layout micro --config tiny: needs at least 14099121.1 GiB",
        ),  # fmt: skip
    ],
)
def test_absurd_steps_and_batch_are_exit_2(args, message, run_cli, tmp_path):
    code, _, err = run_cli(*args, *(["--out", tmp_path / "o"] if args[0] == "run" else []))
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()
