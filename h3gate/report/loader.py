"""Find and classify the evidence a report reads: every ``*.json`` evidence document under the inputs, the seal that
covers each one, and that seal's status from :func:`h3gate.evidence.seal.verify_folder`.

Inputs are evidence files or folders, sealed or not. A missing path, an unreadable or malformed file, a file given
by name that is not an evidence document, or a document failing its schema is an :class:`InputError` (exit 2). A
JSON file inside a folder that is not an evidence document (no string ``kind``) is skipped and listed on the page.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from h3gate.errors import InputError
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.schema import validate_document
from h3gate.evidence.seal import SEAL_NAME, SealReport, load_json, verify_folder
from h3gate.paths import display

SEAL_KIND = "seal"
NOT_VERIFIED = "not verified"
BACKGROUND_BYTES = 4 << 20  # sealed folders with more JSON than this are verified in a worker process
# Kinds that belong to a trajectory RUNDIR: counted under their run, not listed one by one.
RUN_PARTS = ("trajectory-step", "trajectory-manifest")


@dataclass(frozen=True, eq=False)
class Document:
    """One evidence document: where it was found, its kind and parsed body, and the folder of the seal over it."""

    label: str  # the input's label (its folder name), the first part of every figure id
    path: Path
    rel: str  # POSIX path relative to the input folder (the file name for a file input)
    kind: str
    doc: dict
    seal: Path | None  # the folder whose SEAL.json lists this file, or None

    @property
    def where(self) -> str:
        """``label/rel``: how the page names the document."""
        return f"{self.label}/{self.rel}"

    @property
    def verdict(self) -> str | None:
        value = self.doc.get("verdict")
        return value if isinstance(value, str) else None


@dataclass
class InputSummary:
    """What one input path held."""

    path: Path
    label: str
    is_file: bool
    documents: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, why)


@dataclass
class SealStatus:
    """The verification of one sealed folder: ``report`` from ``verify_folder``, or ``error`` when it could not run."""

    folder: Path
    report: SealReport | None = None
    error: str | None = None

    def state(self) -> str:
        """verified | failed | unverifiable | not verified (when asked not to)."""
        if self.report is None:
            return NOT_VERIFIED if self.error == NOT_VERIFIED else "unverifiable"
        return "verified" if self.report.ok else "failed"

    def signature(self) -> str:
        """One phrase on the signature (no public key is given to a report, so origin is never proven here)."""
        if self.report is None or not self.report.seal_sha256:
            return "signature unknown"
        if self.report.signature == "unsigned":
            return "unsigned (integrity only, origin not proven)"
        if self.report.signature == "invalid":
            return "signature INVALID"
        return f"signed by ed25519 key sha256 {self.report.signer} (valid; origin needs --pubkey at seal --verify)"

    def file_state(self, rel: str) -> str:
        """The state of one sealed file (path relative to the sealed folder)."""
        r = self.report
        if r is None:
            return f"sealed, seal {self.state()}"
        if rel in r.changed:
            return "changed since sealing"
        if rel in r.added:
            return "added after sealing"
        if any(msg.startswith(f"{rel}: ") for msg in r.schema_errors):
            return "fails its schema now"
        return "sealed, verified" if r.ok else "sealed file ok, seal failed"


@dataclass
class Inventory:
    """Everything the inputs held: documents in input order, per-input summaries, and seals by folder."""

    inputs: list[InputSummary]
    documents: list[Document]
    seals: dict[Path, SealStatus]
    pool: ProcessPoolExecutor | None = None
    pending: dict[Path, Future] = field(default_factory=dict)

    def wait_seals(self) -> None:
        """Collect the seal verifications started by :func:`load_inventory`."""
        try:
            for folder, future in self.pending.items():
                self.seals[folder] = future.result()
        finally:
            self.pending = {}
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
                self.pool = None

    def of_kind(self, *kinds: str) -> list[Document]:
        return [d for d in self.documents if d.kind in kinds]

    def seal_of(self, document: Document) -> tuple[SealStatus | None, str]:
        """(the seal's status, the document's state under it) or (None, "not sealed")."""
        if document.seal is None:
            return None, "not sealed"
        status = self.seals[document.seal]
        return status, status.file_state(document.path.resolve().relative_to(document.seal).as_posix())


def check_inputs(paths: list[Path]) -> None:
    """Refuse missing, unreadable or non-JSON inputs before any work (one line each, exit 2)."""
    if not paths:
        raise InputError("report: give at least one evidence file or folder")
    for path in paths:
        if not path.exists():
            raise InputError(f"{display(path)}: no such evidence file or folder")
        if path.is_dir():
            if not os.access(path, os.R_OK | os.X_OK):
                raise InputError(f"{display(path)}: cannot read (permission denied)")
        elif not path.is_file():
            raise InputError(f"{display(path)}: not a regular file or folder")
        elif path.suffix != ".json":
            raise InputError(f"{display(path)}: not an evidence file (a .json evidence document, or a folder of them)")
        elif not os.access(path, os.R_OK):
            raise InputError(f"{display(path)}: cannot read (permission denied)")


def _label(path: Path) -> str:
    """A short name for an input: its folder name (a file's parent folder)."""
    resolved = path.resolve()
    folder = resolved.parent if resolved.is_file() else resolved
    return folder.name or "root"


def _seal_folder(path: Path) -> Path | None:
    """The nearest folder at or above ``path``'s folder holding a SEAL.json (resolved), or None."""
    folder = path.resolve().parent
    for candidate in (folder, *folder.parents):
        if (candidate / SEAL_NAME).is_file():
            return candidate
    return None


def _read(path: Path, name: str, explicit: bool) -> tuple[str | None, dict | None]:
    """(kind, document) of one JSON file; (None, None) for JSON that is not evidence inside a folder."""
    doc = load_json(path, name)
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        if explicit:
            raise InputError(f"{name}: not an evidence document (a JSON object with a string 'kind')")
        return None, None
    return doc["kind"], doc


def _files(path: Path) -> list[tuple[Path, str]]:
    """(file, POSIX path relative to the input) for every *.json of an input, sorted; a file input is itself."""
    if path.is_file():
        return [(path, path.name)]
    found = []
    for file in sorted(path.rglob("*.json")):
        if file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts):
            found.append((file, file.relative_to(path).as_posix()))
    return found


def _load_input(path: Path, labels: set[str]) -> tuple[InputSummary, list[Document], set[Path]]:
    label = _label(path)
    base, n = label, 2
    while label in labels:  # two inputs with the same folder name: keep ids distinct
        label, n = f"{base}-{n}", n + 1
    labels.add(label)
    summary = InputSummary(path=path, label=label, is_file=path.is_file())
    documents: list[Document] = []
    seals: set[Path] = set()
    for file, rel in _files(path):
        name = display(file)
        kind, doc = _read(file, name, explicit=path.is_file())
        if kind is None or doc is None:
            summary.skipped.append((rel, "not an evidence document (no string 'kind')"))
            continue
        seal = _seal_folder(file)
        if kind == SEAL_KIND:
            seals.add(file.resolve().parent)
            continue
        if seal is not None:
            seals.add(seal)
        documents.append(Document(label, file, rel, kind, doc, seal))
        summary.kinds[kind] = summary.kinds.get(kind, 0) + 1
    summary.documents = len(documents)
    return summary, documents, seals


def seal_status(folder: Path) -> SealStatus:
    """Verify one sealed folder with the seal's own verification (never reimplemented here)."""
    try:
        return SealStatus(folder, report=verify_folder(folder))
    except InputError as exc:  # e.g. a symbolic link in the folder: the page says why it could not be verified
        return SealStatus(folder, error=str(exc))


def _sealed_hashes(folder: Path) -> dict[str, str]:
    """path -> sha256 as SEAL.json lists them ({} when it does not parse: the verification reports that)."""
    try:
        seal = load_json(folder / SEAL_NAME, display(folder / SEAL_NAME))
        return {str(e["path"]): str(e["sha256"]) for e in seal["files"]}
    except (InputError, KeyError, TypeError):
        return {}


def _check_schemas(documents: list[Document], folders: set[Path]) -> None:
    """Every document must pass its schema before it is drawn. A file whose bytes are those its seal lists passed
    when it was sealed (sealing validates every file); the seal's own verification re-validates it and the page
    shows the outcome. Every other file is validated here."""
    hashes = {folder: _sealed_hashes(folder) for folder in folders}
    for d in documents:
        if d.seal is not None:
            rel = d.path.resolve().relative_to(d.seal).as_posix()
            sealed = hashes.get(d.seal, {}).get(rel)
            if sealed is not None and sealed == sha256_file(d.path):
                continue
        validate_document(d.doc, source=display(d.path))


def _json_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.json") if p.is_file())


def start_seal_checks(folders: list[Path]) -> tuple[ProcessPoolExecutor | None, dict[Path, Future]]:
    """Verify each sealed folder: small ones here and now, large ones in a worker process (schema validation of a
    few MB of JSON takes seconds; the figures are drawn meanwhile)."""
    pending: dict[Path, Future] = {}
    pool = None
    for folder in folders:
        if _json_bytes(folder) < BACKGROUND_BYTES:
            done: Future = Future()
            done.set_result(seal_status(folder))
            pending[folder] = done
            continue
        if pool is None:
            pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pending[folder] = pool.submit(seal_status, folder)
    return pool, pending


def load_inventory(paths: list[Path], step: Callable[[str], None] | None = None, verify: bool = True) -> Inventory:
    """Read every input (see the module docstring) and start verifying each seal over them (once per sealed
    folder, in a worker process; :meth:`Inventory.wait_seals` collects them). ``verify=False`` skips the seals
    (their status then reads "not verified"). ``step(label)`` is called before each input is read (progress)."""
    step = step or (lambda label: None)
    check_inputs(paths)
    inputs: list[InputSummary] = []
    documents: list[Document] = []
    folders: set[Path] = set()
    labels: set[str] = set()
    for path in paths:
        step(f"read {display(path)}")
        summary, docs, seals = _load_input(path, labels)
        inputs.append(summary)
        documents.extend(docs)
        folders |= seals
    _check_schemas(documents, folders)
    inventory = Inventory(inputs, documents, {f: SealStatus(f, error=NOT_VERIFIED) for f in sorted(folders)})
    if verify:
        inventory.pool, inventory.pending = start_seal_checks(sorted(folders))
    return inventory
