"""Seal an evidence folder (per-file sha256, a root hash, a self-hash, optionally a signature) and verify it later.

``SEAL.json`` lists every file under the folder except itself, sorted by POSIX relative path, with its sha256
and size. The root is ``sha256("".join(f"{sha256}  {path}\\n" for each file in that order))`` - the same lines
``sha256sum`` prints. JSON files must validate against their evidence schema before they are sealed; other files
(figures, safetensors) are hashed only.

The seal covers itself: its body (every field but ``seal_sha256`` and ``signature``: provenance, file list, root,
signer) is serialised canonically (:func:`canonical_body`) and ``seal_sha256`` is the sha256 of those bytes, so any
edit of SEAL.json's content fails verification. With a key, ``signer`` names the Ed25519 public key and
``signature`` is its signature of the same bytes: an unsigned seal proves integrity (against accidental change);
a signed one verified against a public key obtained out of band also proves origin.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3gate.bounded import MAX_EVIDENCE_BYTES, loads_json, read_bounded
from h3gate.errors import InputError
from h3gate.evidence import signing
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.runfolder import refuse_unfinished
from h3gate.evidence.schema import validate_document
from h3gate.evidence.writer import write_evidence
from h3gate.paths import display

SEAL_NAME = "SEAL.json"
SELF_FIELDS = ("seal_sha256", "signature")  # the fields the canonical body leaves out


@dataclass
class SealReport:
    """The outcome of ``verify_folder``; ``ok`` only when nothing changed, appeared, vanished or fails a schema,
    SEAL.json's body still hashes to its ``seal_sha256``, a present signature is valid, and (with a public key)
    the seal is signed by that key."""

    ok: bool
    changed: list[str]
    added: list[str]
    removed: list[str]
    schema_errors: list[str]
    root_ok: bool
    files: list[str] = field(default_factory=list)  # every path seen: sealed or present now, sorted
    root: str = ""  # the root recorded in SEAL.json
    actual_root: str = ""  # the root of the folder as it is now
    seal_ok: bool = False  # SEAL.json parses, matches its schema and its body hashes to its seal_sha256
    seal_sha256: str = ""  # recorded
    actual_seal_sha256: str = ""  # of the body as it is now
    signature: str = "unsigned"  # unsigned | valid | invalid
    signer: str | None = None  # fingerprint of the key SEAL.json names
    pubkey: str | None = None  # fingerprint of the public key given to verify against
    origin_ok: bool | None = None  # signed by that key; None when no public key was given
    seal_errors: list[str] = field(default_factory=list)  # findings about SEAL.json itself, one line each


def root_hash(entries: dict[str, str]) -> str:
    """sha256 over the sorted lines ``"<sha256>  <relpath>\\n"``."""
    lines = "".join(f"{entries[p]}  {p}\n" for p in sorted(entries))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def canonical_body(seal: dict) -> bytes:
    """SEAL.json's body without :data:`SELF_FIELDS` as canonical JSON: ``sort_keys``, ``(",", ":")``, ASCII."""
    body = {k: v for k, v in seal.items() if k not in SELF_FIELDS}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("ascii")


def body_sha256(seal: dict) -> str:
    """sha256 (hex) of :func:`canonical_body`: what ``seal_sha256`` records."""
    return hashlib.sha256(canonical_body(seal)).hexdigest()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"duplicate key {dup!r}")
    return dict(pairs)


def parse_json(text: str, rel: str) -> Any:
    """Parse JSON text strictly (NaN/Infinity and duplicate keys refused); failures are input errors naming
    ``rel``."""
    try:
        return loads_json(
            text, rel, MAX_EVIDENCE_BYTES, parse_constant=_reject_constant, object_pairs_hook=_unique_keys
        )
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise InputError(f"{rel}: malformed JSON ({exc})") from None


def read_text(path: Path, rel: str) -> str:
    """A file's UTF-8 text; unreadable is an input error naming ``rel``, bad UTF-8 malformed JSON."""
    try:
        return read_bounded(path, rel, MAX_EVIDENCE_BYTES)
    except OSError as exc:
        raise InputError(f"{rel}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{rel}: malformed JSON ({exc})") from None


def load_json(path: Path, rel: str) -> Any:
    """:func:`parse_json` of the file at ``path``."""
    return parse_json(read_text(path, rel), rel)


def check_json(path: Path, rel: str) -> str:
    """Validate one evidence JSON file against the schema its ``kind`` names; return the kind."""
    doc = load_json(path, rel)
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        raise InputError(f"{rel}: $.kind: not an evidence document (a JSON object with a string 'kind')")
    validate_document(doc, source=rel)
    return doc["kind"]


def _require_folder(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{display(folder)}: no such evidence folder")
    return folder


def scan(folder: Path) -> dict[str, Path]:
    """Every file under ``folder`` (recursive) by sorted POSIX relative path, top-level SEAL.json excluded.

    Symbolic links and special files are refused: a seal covers bytes that live in the folder.
    """
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            raise InputError(f"{display(folder)}/{rel}: symbolic links cannot be sealed")
        if path.is_dir():
            continue
        if not path.is_file():
            raise InputError(f"{display(folder)}/{rel}: not a regular file")
        if rel != SEAL_NAME:
            found[rel] = path
    return dict(sorted(found.items()))


def finalizer(key: signing.Ed25519PrivateKey | None) -> Callable[[dict], dict]:
    """The ``write_evidence`` finalizer adding ``seal_sha256`` and (with ``key``) the signature of the body."""

    def finalize(doc: dict) -> dict:
        message = canonical_body(doc)
        signature = None if key is None else signing.sign(key, message)
        return {**doc, "seal_sha256": hashlib.sha256(message).hexdigest(), "signature": signature}

    return finalize


def _signing_key(key: Path | None, folder: Path) -> signing.Ed25519PrivateKey | None:
    if key is None:
        return None
    private = signing.load_private_key(key)
    try:
        inside = Path(key).resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        inside = False
    if inside:
        raise InputError(f"{display(Path(key))}: the private key lies inside the folder being sealed; keep it outside")
    return private


def seal_folder(folder: Path, key: Path | None = None) -> dict:
    """Validate and hash every file under ``folder``, write ``folder/SEAL.json`` and return the seal document.

    ``key``: an Ed25519 private key file (``h3gate keygen``); the seal then records its public key and signs its
    canonical body. The key is loaded and every file validated before anything is written.
    """
    folder = _require_folder(folder)
    refuse_unfinished(folder)
    private = _signing_key(key, folder)
    files = scan(folder)
    if not files:
        raise InputError(f"{display(folder)}: nothing to seal (no files)")
    entries = []
    for rel, path in files.items():
        kind = check_json(path, rel) if path.suffix == ".json" else None
        entries.append({"path": rel, "sha256": sha256_file(path), "bytes": path.stat().st_size, "kind": kind})
    root = root_hash({e["path"]: e["sha256"] for e in entries})
    signer = None if private is None else signing.signer_record(private)
    body = {"files": entries, "root": root, "signer": signer}
    written = write_evidence(folder, SEAL_NAME, "seal", body, finalize=finalizer(private))
    return load_json(written, SEAL_NAME)


def _load_seal(seal_path: Path, where: str) -> tuple[dict | None, str | None]:
    """(seal, None) when SEAL.json parses and matches its schema, else (None, the one-line finding).

    A missing or unreadable SEAL.json is an input error (exit 2); one that reads but is not a valid seal is a
    finding (exit 1): it was edited, or written by another version.
    """
    if not seal_path.is_file():
        raise InputError(f"{where}: no {SEAL_NAME} to verify (run `h3gate seal {where}` first)")
    rel = f"{where}/{SEAL_NAME}"
    text = read_text(seal_path, rel)
    try:
        seal = parse_json(text, rel)
        if not isinstance(seal, dict):
            raise InputError(f"{rel}: $: not a JSON object")
        validate_document(seal, "seal", source=rel)
    except InputError as exc:
        return None, f"{exc} (not a seal this h3gate can verify: edited, or written by another version)"
    return seal, None


def _check_signature(seal: dict, report: SealReport, public: signing.Ed25519PublicKey | None) -> None:
    """Fill the signature fields of ``report`` (and its ``seal_errors``) from ``seal`` and ``public``."""
    signer, signature = seal["signer"], seal["signature"]
    if public is not None:
        report.pubkey = signing.fingerprint(public)
    if signer is None and signature is None:
        report.signature = "unsigned"
        if public is not None:
            report.origin_ok = False
            report.seal_errors.append(
                f"unsigned: {SEAL_NAME} carries no signature, so it cannot be shown to come from the holder of "
                f"--pubkey (key sha256 {report.pubkey}); it may have been resealed without the key"
            )
        return
    embedded = None if signer is None else signing.embedded_public_key(signer)
    report.signer = None if signer is None else signer.get("fingerprint")
    if signer is None:
        reason = "a signature without a signer"
    elif signature is None:
        reason = "a signer without a signature"
    elif embedded is None:
        reason = "the signer's public key is malformed or does not match its fingerprint"
    elif not signing.signature_valid(embedded, signature, canonical_body(seal)):
        reason = "the signature does not match the seal body (changed after it was signed)"
    else:
        reason = None
    report.signature = "invalid" if reason else "valid"
    if reason:
        report.seal_errors.append(f"signature invalid: {reason}")
    if public is not None:
        same = embedded is not None and signing.raw_public(embedded) == signing.raw_public(public)
        report.origin_ok = report.signature == "valid" and same
        if report.signature == "valid" and not report.origin_ok:
            report.seal_errors.append(
                f"signed by another key: {SEAL_NAME} is signed by key sha256 {report.signer}, "
                f"--pubkey is key sha256 {report.pubkey}"
            )


def verify_folder(folder: Path, pubkey: Path | None = None) -> SealReport:
    """Re-validate schemas and re-hash every file against ``folder/SEAL.json``; check SEAL.json's own hash and
    signature (against ``pubkey``, a PEM Ed25519 public key file, when given).

    ``changed``: sealed files whose sha256 differs; ``added``/``removed``: files present now but not sealed, or
    sealed but gone; ``schema_errors``: ``"<path>: <message>"`` for JSON files failing their schema now;
    ``root_ok``: the recorded root equals the root of the folder as it is now; ``seal_errors``: what is wrong with
    SEAL.json itself (unparsable or schema-invalid, edited body, bad signature, unsigned or other key).
    """
    folder = _require_folder(folder)
    public = None if pubkey is None else signing.load_public_key(pubkey)
    seal, problem = _load_seal(folder / SEAL_NAME, display(folder))
    files = scan(folder)
    now = {rel: sha256_file(path) for rel, path in files.items()}
    if seal is None:
        empty: list[str] = []
        return SealReport(False, empty, empty, empty, empty, False, files=sorted(now), seal_errors=[str(problem)])
    sealed = {e["path"]: e["sha256"] for e in seal["files"]}
    schema_errors = []
    for rel, path in files.items():
        if path.suffix == ".json":
            try:
                check_json(path, rel)
            except InputError as exc:
                schema_errors.append(str(exc))
    actual_root = root_hash(now)
    report = SealReport(
        ok=False,
        changed=sorted(p for p in sealed if p in now and now[p] != sealed[p]),
        added=sorted(p for p in now if p not in sealed),
        removed=sorted(p for p in sealed if p not in now),
        schema_errors=schema_errors,
        root_ok=actual_root == seal["root"],
        files=sorted(set(sealed) | set(now)),
        root=seal["root"],
        actual_root=actual_root,
        seal_sha256=seal["seal_sha256"],
        actual_seal_sha256=body_sha256(seal),
    )
    report.seal_ok = report.seal_sha256 == report.actual_seal_sha256
    if not report.seal_ok:
        report.seal_errors.append(
            f"seal_sha256 mismatch: {SEAL_NAME} was edited after sealing (recorded {report.seal_sha256}, "
            f"its body now hashes to {report.actual_seal_sha256})"
        )
    _check_signature(seal, report, public)
    findings = report.changed or report.added or report.removed or report.schema_errors or report.seal_errors
    report.ok = report.root_ok and not findings
    return report
