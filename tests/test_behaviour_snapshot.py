"""``tools/behaviour_snapshot.py``: extract and compare on synthetic battery folders (no battery run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "behaviour_snapshot.py"
_SPEC = importlib.util.spec_from_file_location("behaviour_snapshot", _PATH)
snap = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("behaviour_snapshot", snap)  # dataclasses look their module up there
_SPEC.loader.exec_module(snap)

TENSOR = "a" * 64


def _evidence(folder: Path, stamp: str, tensor: str = TENSOR, error: float = 1e-3) -> dict:
    """One ws1-block-like file whose volatile fields depend on ``stamp`` only."""
    return {
        "kind": "ws1-block",
        "provenance": {
            "time_utc": stamp,
            "command": ["h3gate", "--out", str(folder)],
            "manifests": {"manifests/layouts.yaml": "b" * 64},
        },
        "memory": {"store": "device", "host_available_gib": len(stamp)},
        "checkpoint": {"path": str(folder / "checkpoint-tiny"), "git_revision": stamp},
        "nodes": [{"name": "q_proj", "error": error, "forward_s": len(stamp) / 7, "tensor_sha256": tensor}],
        "steps": [{"step": 0, "seconds": len(stamp) / 3}],
        "timing": {"wall_s": 1.0},
        "verdict": "pass",
    }


def _battery(root: Path, name: str, stamp: str, **kw) -> Path:
    folder = root / name
    (folder / "evidence" / "ws1-block").mkdir(parents=True)
    body = _evidence(folder, stamp, **kw)
    (folder / "evidence" / "ws1-block" / "ws1-block.json").write_text(json.dumps(body), encoding="utf-8")
    (folder / "evidence" / "ws1-block" / "step.safetensors").write_bytes(b"tensor bytes")
    runs = {"checkout": str(root / "checkout"), "dir": str(folder),
            "cases": [{"name": "ws1-block", "rc": 0, "expect": 0}]}  # fmt: skip
    (folder / "runs.json").write_text(json.dumps(runs), encoding="utf-8")
    return folder


def test_volatile_fields_and_folders_do_not_count(tmp_path, capsys):
    a = snap.extract(_battery(tmp_path, "a", "2026-01-01T00:00:00Z"))
    b = snap.extract(_battery(tmp_path, "bb", "2027-12-31T23:59:59Z+later"))
    assert a == b
    rec = a["files"]["evidence/ws1-block/ws1-block.json"]
    assert rec["sha256"] == {"$.nodes[0].tensor_sha256": TENSOR}
    assert rec["manifests_read"] == {"manifests/layouts.yaml": "b" * 64}
    assert rec["body"]["checkpoint"] == {"path": "<DIR>/checkpoint-tiny"}
    assert "provenance" not in rec["body"] and "timing" not in rec["body"]
    assert rec["body"]["nodes"][0]["error"] == 1e-3  # arithmetic is kept
    assert a["files"]["evidence/ws1-block/step.safetensors"] == {"file_sha256": snap.file_sha256(
        tmp_path / "a" / "evidence" / "ws1-block" / "step.safetensors")}  # fmt: skip
    assert snap.compare(a, b) == 0
    assert "all identical" in capsys.readouterr().out


@pytest.mark.parametrize("change", [{"tensor": "c" * 64}, {"error": 2e-3}])
def test_a_changed_hash_or_error_is_reported(tmp_path, capsys, change):
    a = snap.extract(_battery(tmp_path, "a", "same"))
    b = snap.extract(_battery(tmp_path, "b", "same", **change))
    assert snap.compare(a, b) == 1
    out = capsys.readouterr().out
    assert "evidence/ws1-block/ws1-block.json: DIFFERS" in out
    if "tensor" in change:
        assert "1 sha256 paths, 0 other paths" in out and "sha256 $.nodes[0].tensor_sha256" in out
    else:
        assert "0 sha256 paths, 1 other paths" in out and "other  $.nodes[0].error" in out


def test_exit_codes_missing_files_and_digest_only_snapshots(tmp_path, capsys):
    a = snap.extract(_battery(tmp_path, "a", "same"), bodies=False)
    b = json.loads(json.dumps(a))
    b["cases"]["ws1-block"]["rc"] = 1
    b["files"]["evidence/ws1-block/renamed.json"] = b["files"].pop("evidence/ws1-block/ws1-block.json")
    assert snap.compare(a, b) == 1
    out = capsys.readouterr().out
    assert "case ws1-block: exit code 0 != 1" in out
    assert "evidence/ws1-block/ws1-block.json: only in A" in out
    assert "evidence/ws1-block/renamed.json: only in B" in out


def test_seal_hashes_are_volatile_but_its_file_list_is_not():
    seal = {"kind": "seal", "files": [{"path": "x.json", "sha256": "1" * 64, "bytes": 10, "kind": "ws1-block"}],
            "root": "2" * 64, "seal_sha256": "3" * 64, "signer": None}  # fmt: skip
    body = snap.canonical(seal, [], seal=True)
    assert body == {"kind": "seal", "files": [{"path": "x.json", "kind": "ws1-block"}], "signer": None}


def test_cli_compare_exit_code(tmp_path):
    a = snap.extract(_battery(tmp_path, "a", "same"))
    b = snap.extract(_battery(tmp_path, "b", "same", tensor="d" * 64))
    for name, doc in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(doc), encoding="utf-8")
    assert snap.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert snap.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1


def test_keys_with_dots_are_quoted_in_paths():
    doc = {"leaves": {"attn.to_q.weight": {"sha256": "e" * 64}}, "rows": [{"a b": 1}]}
    assert snap.sha256_fields(doc) == {'$.leaves["attn.to_q.weight"].sha256': "e" * 64}
    assert snap.leaves(doc)[-1] == ('$.rows[0]["a b"]', 1)
