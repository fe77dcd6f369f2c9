"""Bad inputs across the verbs: each is exit 2 and one line ``h3gate: error: ...`` naming the thing, nothing else.

Only inputs refused before any model runs are here (well under a second each).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from h3gate.paths import MANIFESTS

TINY = MANIFESTS / "configs" / "tiny.yaml"
GEOMETRY = ["--text-tokens", "8", "--latent-frames", "2", "--latent-height", "4", "--latent-width", "4"]


def _tiny_with(old: str, new: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / "cfg.yaml"
        text = TINY.read_text(encoding="utf-8")
        assert old in text
        path.write_text(text.replace(old, new, 1), encoding="utf-8")
        return path

    return make


def _text(content: str, name: str = "cfg.yaml") -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        (tmp / name).write_text(content, encoding="utf-8")
        return tmp / name

    return make


def _a_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("x", encoding="utf-8")
    return tmp / "afile"


def _busy_dir(tmp: Path) -> Path:
    (tmp / "busy").mkdir()
    (tmp / "busy" / "x").write_text("x", encoding="utf-8")
    return tmp / "busy"


@pytest.fixture(scope="module")
def config_json(tiny_checkpoint) -> Path:
    """A valid tiny ``config.json`` (from a written synthetic checkpoint)."""
    return tiny_checkpoint("cli-errors", "ck", 0) / "config.json"


def _ckpt_with(tmp: Path, config_json: Path, name: str, content: bytes) -> Path:
    folder = tmp / name.split(".")[-1]
    folder.mkdir()
    shutil.copy(config_json, folder / "config.json")
    (folder / name).write_bytes(content)
    return folder


CONFIG_CASES = [
    (_tiny_with("ffn_dim: 384", "ffn_dim: 384\n  bogus: 1"), "cfg.yaml: config.bogus: unknown field"),
    (_tiny_with("num_layers: 2", "num_layers: -2"), "cfg.yaml: config.num_layers: must be > 0"),
    (_text("layers: [\n"), "cfg.yaml: line 2, column 1: malformed YAML"),
    (_text("- 1\n"), "cfg.yaml: (top level): must be a mapping"),
    (lambda tmp: tmp / "missing.yaml", "missing.yaml: no such config file"),
]


@pytest.mark.parametrize(("make", "message"), CONFIG_CASES)
def test_bad_config_files(run_cli, tmp_path, make, message):
    cfg = make(tmp_path)
    code, out, err = run_cli("synth-checkpoint", "--config", cfg, "--out", tmp_path / "ck")
    assert (code, out) == (2, "")
    assert err.startswith("h3gate: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "ck").exists()


CASES = [
    (["layout", "bogus"], "layout 'bogus': unknown"),
    (["layout", "--audio-latents", "4", *GEOMETRY[:2], "--latent-frames", "3", *GEOMETRY[4:]], "--latent-frames 3"),
    (["layout", "--audio-latents", "4", *GEOMETRY[:-1], "5"], "--latent-width 5: must be a multiple of"),
    (["layout", "--audio-latents", "4", *GEOMETRY, "--text-vision-rows", "5:2"], "(5:2): start must be < end"),
    (["layout", "--audio-latents", "4", *GEOMETRY, "--text-vision-rows", "x"], "--text-vision-rows 'x'"),
    (["layout", "tiny", "--save", "{afile}/x.safetensors"], "afile is not a folder"),
    (["schedule", "--steps", "1"], "--steps 1: must be an integer >= 2"),
    (["schedule", "--steps", "4", "--shift", "0"], "--shift 0.0: must be a finite number > 0"),
    (["schedule", "--steps", "4", "--shift", "nan"], "--shift nan: must be a finite number > 0"),
    (["synth-checkpoint", "--out", "{busy}"], "busy: already exists and is not an empty folder"),
    (["synth-checkpoint", "--out", "{afile}/sub"], "afile/sub: cannot create ({afile} is a file, not a folder)"),
    (["fingerprint", "--checkpoint", "{afile}"], "afile: is a file, not a checkpoint folder"),
    (["fingerprint", "--checkpoint", "{zero}"], "diffusion_pytorch_model.safetensors: not a safetensors file (0 bytes"),
    (["fingerprint", "--checkpoint", "{badindex}"], "diffusion_pytorch_model.safetensors.index.json: malformed JSON"),
    (["seal", "{missing}"], "missing: no such evidence folder"),
    (["seal", "--verify", "{empty}"], "empty: no SEAL.json to verify"),
    (["ablate", "BOGUS"], "ablation row 'BOGUS': unknown"),
    (["ablate", "--list", "--all"], "ablate: --list takes no ROW and no --all"),
    (["bench", "--device", "cpu"], "bench needs --device cuda"),
    (["run", "ws1-ops", "--op", "bogus", "--device", "cpu"], "operator 'bogus': not declared"),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_inputs_are_one_line_exit_2(run_cli, tmp_path, config_json, args, message):
    places = {
        "afile": _a_file(tmp_path),
        "busy": _busy_dir(tmp_path),
        "zero": _ckpt_with(tmp_path, config_json, "diffusion_pytorch_model.safetensors", b""),
        "badindex": _ckpt_with(tmp_path, config_json, "diffusion_pytorch_model.safetensors.index.json", b"notjson{"),
        "missing": tmp_path / "missing",
        "empty": tmp_path / "empty",
    }
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(*(a.format(**places) for a in args))
    assert (code, out) == (2, "")
    assert err.startswith("h3gate: error: ") and err.count("\n") == 1 and message.format(**places) in err, err


@pytest.mark.parametrize(
    "exc",
    [
        pytest.param(
            lambda: __import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 994 MiB\nmore"),
            id="cuda",
        ),
        pytest.param(lambda: MemoryError("host"), id="host"),
    ],
)
def test_out_of_memory_is_one_line_exit_2(run_cli, monkeypatch, exc):
    """A request too large for the machine is refused in one line (no traceback), exit 2."""
    from h3gate.commands import validate_cmd

    def boom(settings: object) -> int:
        raise exc()

    monkeypatch.setattr(validate_cmd, "validate_command", boom)
    code, out, err = run_cli("validate")
    assert code == 2 and out == ""
    assert err.startswith("h3gate: error: out of memory (") and err.count("\n") == 1 and "Traceback" not in err


def test_other_runtime_errors_are_bugs_exit_3_with_their_traceback_in_a_file(run_cli, monkeypatch):
    from h3gate.commands import validate_cmd

    def boom(settings: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(validate_cmd, "validate_command", boom)
    code, out, err = run_cli("validate")
    assert code == 3 and out == "" and err.count("\n") == 1
    assert err.startswith("h3gate: internal error: RuntimeError: a bug (traceback in ")
    traceback_file = err.strip().split("traceback in ", 1)[1].rstrip(")")
    assert "RuntimeError: a bug" in Path(traceback_file).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("module", "attr", "args"),
    [
        ("h3gate.commands.model_cmd", "run_model_gate", ["run", "ws1-model", "--no-backward"]),
        ("h3gate.commands.trajectory_cmd", "run_ws1_trajectory", ["run", "ws1-trajectory"]),
        ("h3gate.commands.compare_cmd", "compare_runs", ["compare", "a", "b"]),
    ],
)
def test_a_crash_inside_the_new_engines_is_exit_3_never_a_verdict(run_cli, monkeypatch, tmp_path, module, attr, args):
    """ws1-model, ws1-trajectory and compare: a bug inside the engine is exit 3 with its traceback in a file under
    --out, and no evidence is written."""
    import importlib

    def boom(*a, **k):
        raise RuntimeError("a bug in the engine")

    monkeypatch.setattr(importlib.import_module(module), attr, boom)
    out = tmp_path / "ev"
    code, stdout, err = run_cli(*args, "--out", str(out))
    assert code == 3 and stdout == "" and err.count("\n") == 1, err
    assert err.startswith("h3gate: internal error: RuntimeError: a bug in the engine (traceback in ")
    assert not list(out.glob("*.json"))  # no evidence, no verdict
    traceback_file = Path(err.strip().split("traceback in ", 1)[1].rstrip(")"))
    assert traceback_file.parent == out and "a bug in the engine" in traceback_file.read_text(encoding="utf-8")
