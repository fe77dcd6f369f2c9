"""``synth-checkpoint`` killed while writing (a real SIGKILL of a child process) leaves its hidden ``.<name>.*.partial``
folder beside the destination; the next write into the same destination removes it and says so, while a partial
folder a live writer still holds is refused (exit 2, naming it), never removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# The child: the tiny config's checkpoint into OUT, stopped for good after its config.json (it prints "ready").
CHILD = """
import sys, time
import h3gate.synth as synth
from h3gate.manifests.model_config import load_config

def stall(*args, **kwargs):
    print("ready", flush=True)
    time.sleep(600)

synth.write_safetensors = stall
synth.write_checkpoint(load_config("tiny").config, 0, sys.argv[1])
"""


def _stalled_writer(out: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def _partials(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*.partial"))


def test_a_sigkilled_writes_partial_folder_is_removed_by_the_next_write(run_cli, tmp_path):
    out = tmp_path / "ckpt"
    child = _stalled_writer(out)
    try:
        live = _partials(out)
        assert len(live) == 1 and not out.exists()
        # while its writer lives, the partial folder is refused, named, and kept
        code, stdout, err = run_cli("synth-checkpoint", "--config", "tiny", "--out", out)
        assert code == 2 and live[0] in err and "being written by another h3gate process" in err, err
        assert _partials(out) == live and not out.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL and _partials(out) == live  # the kill left it behind
    code, stdout, err = run_cli("synth-checkpoint", "--config", "tiny", "--out", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["cleaned"] == live and _partials(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_write_into_another_destination_leaves_its_partial_alone(tmp_path):
    from h3gate.synth import clean_partials

    other = tmp_path / ".ckpt-b.x1.partial"
    other.mkdir()
    assert clean_partials(tmp_path / "ckpt") == [] and other.is_dir()  # another destination's name
    assert clean_partials(tmp_path / "ckpt-b") == [other.name] and not other.exists()
