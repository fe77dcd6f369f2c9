"""``h3gate seal``: per-file sha256 + root + self-hash over a folder, Ed25519 signing, and ``--verify`` catching every
kind of change (of a file or of SEAL.json itself) and every signature that does not prove origin."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from h3gate.errors import InputError
from h3gate.evidence.seal import body_sha256, finalizer, seal_folder, verify_folder
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
    body = {k: sealed[k] for k in ("files", "root", "signer")}
    path = write_evidence(folder, "copy/SEAL.json", "seal", body, finalize=finalizer(None))
    assert path.is_file()
    assert [e["path"] for e in seal_folder(folder)["files"]][:2] == ["copy/SEAL.json", "fig.png"]


# -- the seal covers itself --------------------------------------------------------------------------------------
def _edit_seal(folder: Path, edit) -> None:
    seal = json.loads((folder / "SEAL.json").read_text())
    edit(seal)
    (folder / "SEAL.json").write_text(json.dumps(seal, indent=1))


def test_seal_sha256_is_the_canonical_body_hash(folder):
    seal = seal_folder(folder)
    body = {k: v for k, v in seal.items() if k not in ("seal_sha256", "signature")}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert seal["seal_sha256"] == hashlib.sha256(canonical).hexdigest() == body_sha256(seal)
    assert seal["signer"] is None and seal["signature"] is None
    # reformatting (whitespace, key order) is not an edit of the content: still verifies
    text = json.dumps(dict(reversed(list(seal.items()))), indent=4)
    (folder / "SEAL.json").write_text(text)
    assert verify_folder(folder).ok


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda s: s["provenance"].update(hostname="elsewhere"), id="provenance-hostname"),
        pytest.param(lambda s: s["provenance"].update(git_revision="0" * 40), id="provenance-revision"),
        pytest.param(lambda s: s["provenance"]["command"].append("--forged"), id="provenance-command"),
        pytest.param(lambda s: s["files"][0].update(bytes=s["files"][0]["bytes"] + 1), id="file-bytes"),
        pytest.param(lambda s: s["files"][0].update(kind="seal"), id="file-kind"),
    ],
)
def test_edited_seal_body_fails_verify(folder, run_cli, edit):
    seal_folder(folder)
    assert run_cli("seal", folder, "--verify")[0] == 0  # the control: unedited, it verifies
    _edit_seal(folder, edit)
    code, out, err = run_cli("seal", folder, "--verify")
    assert (code, err) == (1, "")
    assert "seal: seal_sha256 mismatch: SEAL.json was edited after sealing" in out
    report = verify_folder(folder)
    assert not report.ok and not report.seal_ok and report.root_ok  # the files themselves are untouched


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("seal_sha256"), "'seal_sha256' is a required property"),
        (lambda s: s.update(note="added"), "Additional properties are not allowed ('note' was unexpected)"),
        (lambda s: s.update(seal_sha256="x"), "$.seal_sha256: 'x' does not match"),
    ],
    ids=["no-self-hash", "extra-field", "bad-self-hash"],
)
def test_seal_failing_its_schema_fails_verify(folder, run_cli, edit, message):
    seal_folder(folder)
    _edit_seal(folder, edit)
    code, out, err = run_cli("seal", folder, "--verify")
    assert (code, err) == (1, "")
    assert message in out and "not a seal this h3gate can verify" in out
    assert verify_folder(folder).seal_errors


def test_seal_json_not_json_fails_verify(folder, run_cli):
    seal_folder(folder)
    (folder / "SEAL.json").write_text('{"kind": "seal", "kind": "seal"}')
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1 and "malformed JSON (duplicate key 'kind')" in out


def test_forged_self_hash_passes_integrity_only(folder):
    """Unsigned, an edit with a recomputed seal_sha256 verifies: integrity against accidental change, not origin."""
    seal_folder(folder)
    _edit_seal(folder, lambda s: s["provenance"].update(hostname="forged"))
    _edit_seal(folder, lambda s: s.update(seal_sha256=body_sha256(s)))
    report = verify_folder(folder)
    assert report.ok and report.signature == "unsigned" and report.origin_ok is None


# -- signing -----------------------------------------------------------------------------------------------------
@pytest.fixture
def keys(tmp_path, run_cli) -> tuple[Path, Path]:
    """Two key pairs from ``h3gate keygen``: (tmp/keys/a, tmp/keys/b); ``.pub`` next to each."""
    (tmp_path / "keys").mkdir()
    for name in ("a", "b"):
        code, out, err = run_cli("keygen", "--out", tmp_path / "keys" / name)
        assert (code, err) == (0, "") and "key sha256" in out
    return tmp_path / "keys" / "a", tmp_path / "keys" / "b"


def _pub(key: Path) -> Path:
    return key.with_name(key.name + ".pub")


def test_keygen_writes_pem_pair_with_modes(keys):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_pem_public_key

    key, _ = keys
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8
    assert isinstance(load_pem_private_key(key.read_bytes(), None), Ed25519PrivateKey)
    assert isinstance(load_pem_public_key(_pub(key).read_bytes()), Ed25519PublicKey)
    assert key.stat().st_mode & 0o777 == 0o600


def test_keygen_refuses_to_overwrite(keys, run_cli):
    key, other = keys
    before = key.read_bytes()
    code, out, err = run_cli("keygen", "--out", key)
    assert (code, out, err) == (2, "", f"h3gate: error: {key}: already exists; refusing to overwrite\n")
    assert key.read_bytes() == before
    _pub(other).rename(_pub(key.with_name("c")))  # only c.pub exists: c is not written either
    code, _, err = run_cli("keygen", "--out", key.with_name("c"))
    assert (code, err) == (2, f"h3gate: error: {_pub(key.with_name('c'))}: already exists; refusing to overwrite\n")
    assert not key.with_name("c").exists()


def test_signed_round_trip(folder, keys, run_cli):
    key, _ = keys
    code, out, _ = run_cli("seal", folder, "--key", key)
    assert code == 0 and "signed: ed25519 key sha256" in out
    seal = json.loads((folder / "SEAL.json").read_text())
    assert seal["signer"]["algorithm"] == "ed25519" and seal["signature"]
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 0 and "origin NOT proven without --pubkey" in out
    code, out, _ = run_cli("seal", folder, "--verify", "--pubkey", _pub(key))
    assert code == 0 and "origin proven" in out
    assert out.endswith("verdict: pass (seal verified: integrity and origin)\n")
    report = verify_folder(folder, _pub(key))
    assert (report.ok, report.signature, report.origin_ok) == (True, "valid", True)


def test_verify_with_another_pubkey_fails(folder, keys, run_cli):
    key, other = keys
    seal_folder(folder, key)
    assert run_cli("seal", folder, "--verify", "--pubkey", _pub(key))[0] == 0  # control
    code, out, _ = run_cli("seal", folder, "--verify", "--pubkey", _pub(other))
    assert code == 1 and "seal: signed by another key" in out
    assert verify_folder(folder, _pub(other)).origin_ok is False


def test_resealed_without_key_fails_with_pubkey(folder, keys, run_cli):
    key, _ = keys
    seal_folder(folder, key)
    assert run_cli("seal", folder, "--verify", "--pubkey", _pub(key))[0] == 0  # control
    (folder / "fig.png").write_bytes(b"a changed figure")
    assert run_cli("seal", folder)[0] == 0  # anyone can reseal...
    assert run_cli("seal", folder, "--verify")[0] == 0  # ...and integrity alone holds
    code, out, _ = run_cli("seal", folder, "--verify", "--pubkey", _pub(key))
    assert code == 1 and "seal: unsigned: SEAL.json carries no signature" in out


def test_resigned_with_another_key_fails_with_pubkey(folder, keys, run_cli):
    key, other = keys
    seal_folder(folder, key)
    seal_folder(folder, other)
    assert run_cli("seal", folder, "--verify")[0] == 0  # a valid signature, by the key SEAL.json names
    code, out, _ = run_cli("seal", folder, "--verify", "--pubkey", _pub(key))
    assert code == 1 and "signed by another key" in out


def _other_key(b64: str) -> str:
    """A different well-formed 32-byte key: the first base64 character changed."""
    return ("B" if b64[0] == "A" else "A") + b64[1:]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda s: s["provenance"].update(hostname="forged"), id="body"),
        pytest.param(lambda s: s["signer"].update(fingerprint="0" * 64), id="signer-fingerprint"),
        pytest.param(lambda s: s["signer"].update(public_key=_other_key(s["signer"]["public_key"])), id="signer-key"),
        pytest.param(lambda s: s.update(signature=None), id="signature-dropped"),
        pytest.param(lambda s: s.update(signer=None), id="signer-dropped"),
    ],
)
def test_signed_seal_edited_with_recomputed_hash_fails(folder, keys, run_cli, edit):
    """Whoever edits a signed seal and recomputes seal_sha256 still breaks the signature (no --pubkey needed)."""
    key, _ = keys
    seal_folder(folder, key)
    _edit_seal(folder, edit)
    _edit_seal(folder, lambda s: s.update(seal_sha256=body_sha256(s)))
    code, out, _ = run_cli("seal", folder, "--verify")
    assert code == 1 and "seal: signature invalid" in out
    assert verify_folder(folder).signature == "invalid"


def _rsa_pem(private: bool) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    if private:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize(
    ("option", "content", "message"),
    [
        ("--key", b"not a key\n", "not an Ed25519 private key (PEM PKCS8 expected)"),
        ("--key", None, "cannot read private key (No such file or directory)"),
        ("--key", "pub", "not an Ed25519 private key (PEM PKCS8 expected)"),
        ("--key", "rsa-private", "not an Ed25519 private key (found RSAPrivateKey)"),
        ("--key", "encrypted", "encrypted private key; h3gate reads unencrypted PEM PKCS8"),
        ("--pubkey", b"", "not an Ed25519 public key (PEM SubjectPublicKeyInfo expected)"),
        ("--pubkey", "private", "not an Ed25519 public key (PEM SubjectPublicKeyInfo expected)"),
        ("--pubkey", "rsa-public", "not an Ed25519 public key (found RSAPublicKey)"),
        ("--pubkey", None, "cannot read public key (No such file or directory)"),
    ],
)
def test_bad_key_files_exit_2(folder, keys, run_cli, tmp_path, option, content, message):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key, _ = keys
    seal_folder(folder)
    before = (folder / "SEAL.json").read_bytes()
    made = {
        "pub": _pub(key).read_bytes(),
        "private": key.read_bytes(),
        "rsa-private": _rsa_pem(private=True),
        "rsa-public": _rsa_pem(private=False),
        "encrypted": load_pem_private_key(key.read_bytes(), None).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        ),
    }
    bad = tmp_path / "bad.key"
    if content is not None:
        bad.write_bytes(made.get(content, content) if isinstance(content, str) else content)
    args = ("seal", folder, "--key", bad) if option == "--key" else ("seal", folder, "--verify", "--pubkey", bad)
    code, out, err = run_cli(*args)
    assert (code, out, err) == (2, "", f"h3gate: error: {bad}: {message}\n")
    assert (folder / "SEAL.json").read_bytes() == before  # nothing written


def test_key_options_in_the_wrong_mode_and_key_inside_folder(folder, keys, run_cli):
    key, _ = keys
    code, _, err = run_cli("seal", folder, "--verify", "--key", key)
    assert (code, err) == (2, "h3gate: error: --key: only used when sealing (verify takes --pubkey PUB)\n")
    code, _, err = run_cli("seal", folder, "--pubkey", _pub(key))
    assert (code, err) == (2, "h3gate: error: --pubkey: only used with --verify (sealing takes --key KEY)\n")
    inside = folder / "signing.key"
    inside.write_bytes(key.read_bytes())
    code, _, err = run_cli("seal", folder, "--key", inside)
    assert code == 2 and "the private key lies inside the folder being sealed" in err
    assert not (folder / "SEAL.json").exists()
