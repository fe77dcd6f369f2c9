"""``h3gate seal``: per-file sha256 + root over a folder, and ``--verify`` catching every kind of change."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from h3gate.errors import InputError
from h3gate.evidence.seal import seal_folder, verify_folder
from h3gate.evidence.writer import write_evidence


@pytest.fixture
def folder(tmp_path) -> Path:
    """An evidence folder: a nested sealed sub-folder (valid ``seal`` evidence), a figure, a nested data file."""
    root = tmp_path / "ev"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data.bin").write_bytes(bytes(range(256)))
    seal_folder(root / "sub")  # sub/SEAL.json: a schema-validated JSON evidence file inside the outer folder
    (root / "fig.png").write_bytes(b"\x89PNG fake figure")
    return root


def test_seal_then_verify(folder, run_cli):
    code, out, err = run_cli("seal", folder)
    assert (code, err) == (0, "")
    seal = json.loads((folder / "SEAL.json").read_text())
    paths = [e["path"] for e in seal["files"]]
    assert paths == ["fig.png", "sub/SEAL.json", "sub/data.bin"]
    assert [e["kind"] for e in seal["files"]] == [None, "seal", None]
    lines = "".join(f"{hashlib.sha256((folder / p).read_bytes()).hexdigest()}  {p}\n" for p in paths)
    assert seal["root"] == hashlib.sha256(lines.encode()).hexdigest()  # sha256sum-style root
    assert seal["root"] in out
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 0 and "seal verified" in out
    assert verify_folder(folder).ok


def test_flipped_byte_is_reported(folder, run_cli):
    seal_folder(folder)
    data = bytearray((folder / "sub" / "data.bin").read_bytes())
    data[17] ^= 1
    (folder / "sub" / "data.bin").write_bytes(bytes(data))
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1
    assert "changed: sub/data.bin" in out and "root mismatch" in out
    report = verify_folder(folder)
    assert (report.changed, report.added, report.removed, report.root_ok) == (["sub/data.bin"], [], [], False)


def test_added_file_is_reported(folder, run_cli):
    seal_folder(folder)
    (folder / "sub" / "extra.txt").write_text("late")
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1 and "added: sub/extra.txt" in out
    assert verify_folder(folder).added == ["sub/extra.txt"]


def test_removed_file_is_reported(folder, run_cli):
    seal_folder(folder)
    (folder / "fig.png").unlink()
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1 and "removed: fig.png" in out
    assert verify_folder(folder).removed == ["fig.png"]


def test_edited_seal_root_is_reported(folder, run_cli):
    seal_folder(folder)
    seal = json.loads((folder / "SEAL.json").read_text())
    seal["root"] = "0" * 64
    (folder / "SEAL.json").write_text(json.dumps(seal))
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1 and "root mismatch" in out
    report = verify_folder(folder)
    assert not report.root_ok and not (report.changed or report.added or report.removed)


def test_schema_invalid_evidence_is_refused_then_reported(folder, run_cli):
    bad = {"kind": "seal", "schema_version": 1, "files": [], "root": "x"}
    (folder / "bad.json").write_text(json.dumps(bad))
    code, _, err = run_cli("seal", folder)
    assert code == 2 and "h3gate: error: bad.json: $: 'provenance' is a required property" in err
    assert not (folder / "SEAL.json").exists()

    (folder / "bad.json").unlink()
    seal_folder(folder)
    doc = json.loads((folder / "sub" / "SEAL.json").read_text())
    del doc["provenance"]["hostname"]  # still parses, no longer matches its schema (and its hash changes)
    (folder / "sub" / "SEAL.json").write_text(json.dumps(doc))
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1
    assert "schema error: sub/SEAL.json: $.provenance: 'hostname' is a required property" in out
    assert verify_folder(folder).changed == ["sub/SEAL.json"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("broken.json", "{not json", "broken.json: malformed JSON"),
        ("nan.json", '{"kind": "seal", "x": NaN}', "nan.json: malformed JSON (non-finite number NaN)"),
        ("plain.json", "[1, 2]", "plain.json: $.kind: not an evidence document"),
        ("other.json", '{"kind": "nosuch"}', "other.json: kind 'nosuch': no schema"),
    ],
)
def test_unsealable_json_is_an_input_error(folder, name, text, message):
    (folder / name).write_text(text)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        seal_folder(folder)
    assert not (folder / "SEAL.json").exists()


def test_bad_folders_exit_2(tmp_path, run_cli):
    code, _, err = run_cli("seal", tmp_path / "missing", "--verify")
    assert code == 2 and "missing: no such evidence folder" in err
    (tmp_path / "unsealed").mkdir()
    (tmp_path / "unsealed" / "a.txt").write_text("a")
    code, _, err = run_cli("seal", tmp_path / "unsealed", "--verify")
    assert code == 2 and "no SEAL.json to verify" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("seal", tmp_path / "empty")
    assert code == 2 and "nothing to seal" in err


def test_symlinks_are_refused(folder):
    (folder / "link").symlink_to(folder / "fig.png")
    with pytest.raises(InputError, match="link: symbolic links cannot be sealed"):
        seal_folder(folder)


def test_write_evidence_then_seal(folder):
    """A document from the writer seals as-is (the writer's output is what seal validates)."""
    sealed = seal_folder(folder / "sub")
    path = write_evidence(folder, "copy/SEAL.json", "seal", {"files": sealed["files"], "root": sealed["root"]})
    assert path.is_file()
    assert [e["path"] for e in seal_folder(folder)["files"]][:2] == ["copy/SEAL.json", "fig.png"]
