"""Seal an evidence folder (per-file sha256 + one root hash) and verify it later.

``SEAL.json`` lists every file under the folder except itself, sorted by POSIX relative path, with its sha256
and size. The root is ``sha256("".join(f"{sha256}  {path}\\n" for each file in that order))`` - the same lines
``sha256sum`` prints. JSON files must validate against their evidence schema before they are sealed; other files
(figures, safetensors) are hashed only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3gate.errors import InputError
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.schema import validate_document
from h3gate.evidence.writer import write_evidence
from h3gate.paths import display

SEAL_NAME = "SEAL.json"


@dataclass
class SealReport:
    """The outcome of ``verify_folder``; ``ok`` only when nothing changed, appeared, vanished or fails a schema."""

    ok: bool
    changed: list[str]
    added: list[str]
    removed: list[str]
    schema_errors: list[str]
    root_ok: bool
    files: list[str] = field(default_factory=list)  # every path seen: sealed or present now, sorted
    root: str = ""  # the root recorded in SEAL.json
    actual_root: str = ""  # the root of the folder as it is now


def root_hash(entries: dict[str, str]) -> str:
    """sha256 over the sorted lines ``"<sha256>  <relpath>\\n"``."""
    lines = "".join(f"{entries[p]}  {p}\n" for p in sorted(entries))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def load_json(path: Path, rel: str) -> Any:
    """Parse one JSON file strictly (NaN/Infinity refused); failures are input errors naming ``rel``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except OSError as exc:
        raise InputError(f"{rel}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InputError(f"{rel}: malformed JSON ({exc})") from None


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


def seal_folder(folder: Path) -> dict:
    """Validate and hash every file under ``folder``, write ``folder/SEAL.json`` and return the seal document."""
    folder = _require_folder(folder)
    files = scan(folder)
    if not files:
        raise InputError(f"{display(folder)}: nothing to seal (no files)")
    entries = []
    for rel, path in files.items():
        kind = check_json(path, rel) if path.suffix == ".json" else None
        entries.append({"path": rel, "sha256": sha256_file(path), "bytes": path.stat().st_size, "kind": kind})
    root = root_hash({e["path"]: e["sha256"] for e in entries})
    written = write_evidence(folder, SEAL_NAME, "seal", {"files": entries, "root": root})
    return load_json(written, SEAL_NAME)


def verify_folder(folder: Path) -> SealReport:
    """Re-validate schemas and re-hash every file against ``folder/SEAL.json``.

    ``changed``: sealed files whose sha256 differs; ``added``/``removed``: files present now but not sealed, or
    sealed but gone; ``schema_errors``: ``"<path>: <message>"`` for JSON files failing their schema now;
    ``root_ok``: the recorded root equals the root of the folder as it is now.
    """
    folder = _require_folder(folder)
    seal_path = folder / SEAL_NAME
    if not seal_path.is_file():
        raise InputError(f"{display(folder)}: no {SEAL_NAME} to verify (run `h3gate seal {display(folder)}` first)")
    seal = load_json(seal_path, f"{display(folder)}/{SEAL_NAME}")
    validate_document(seal, "seal", source=f"{display(folder)}/{SEAL_NAME}")
    sealed = {e["path"]: e["sha256"] for e in seal["files"]}
    files = scan(folder)
    now = {rel: sha256_file(path) for rel, path in files.items()}
    changed = sorted(p for p in sealed if p in now and now[p] != sealed[p])
    added = sorted(p for p in now if p not in sealed)
    removed = sorted(p for p in sealed if p not in now)
    schema_errors = []
    for rel, path in files.items():
        if path.suffix == ".json":
            try:
                check_json(path, rel)
            except InputError as exc:
                schema_errors.append(str(exc))
    actual_root = root_hash(now)
    root_ok = actual_root == seal["root"]
    ok = root_ok and not (changed or added or removed or schema_errors)
    return SealReport(
        ok=ok,
        changed=changed,
        added=added,
        removed=removed,
        schema_errors=schema_errors,
        root_ok=root_ok,
        files=sorted(set(sealed) | set(now)),
        root=seal["root"],
        actual_root=actual_root,
    )
