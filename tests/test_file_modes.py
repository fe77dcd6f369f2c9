"""Files h3gate writes honour the umask (0644 under 022, 0600 under 077); private keys are always 0600."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from h3gate.evidence.seal import seal_folder
from h3gate.evidence.writer import new_file_mode, write_evidence


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_evidence_and_seal_modes(tmp_path, umask):
    want = 0o644 if umask == 0o022 else 0o600
    assert new_file_mode() == want
    sealed = seal_folder(_sub(tmp_path))
    path = write_evidence(tmp_path / "ev", "copy.json", "seal", {k: sealed[k] for k in ("files", "root", "signer")},
                          finalize=lambda d: {**d, "seal_sha256": "0" * 64, "signature": None})  # fmt: skip
    assert _mode(path) == want
    assert _mode(tmp_path / "sub" / "SEAL.json") == want


def _sub(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a")
    return tmp_path / "sub"


def test_keygen_modes(tmp_path, umask, run_cli):
    assert run_cli("keygen", "--out", tmp_path / "k")[0] == 0
    assert _mode(tmp_path / "k") == 0o600
    assert _mode(tmp_path / "k.pub") == (0o644 if umask == 0o022 else 0o600)


def test_safetensors_writers_modes(tmp_path, umask, run_cli):
    from h3gate.commands.run_cmd import save_tensor_files

    want = 0o644 if umask == 0o022 else 0o600
    code, _, err = run_cli("layout", "tiny", "--save", tmp_path / "layout.safetensors")
    assert (code, err) == (0, "")
    assert _mode(tmp_path / "layout.safetensors") == want
    save_tensor_files(tmp_path / "tensors", {"x": {"t": torch.zeros(2)}}, {"format": "pt"})
    assert _mode(tmp_path / "tensors" / "x.safetensors") == want


def test_synthetic_checkpoint_modes(tmp_path, umask, run_cli):
    assert run_cli("synth-checkpoint", "--out", tmp_path / "ck")[0] == 0
    want = 0o644 if umask == 0o022 else 0o600
    assert {p.name: _mode(p) for p in (tmp_path / "ck").iterdir()} == dict.fromkeys(
        [p.name for p in (tmp_path / "ck").iterdir()], want
    )
    assert _mode(tmp_path / "ck") == (0o755 if umask == 0o022 else 0o700)
