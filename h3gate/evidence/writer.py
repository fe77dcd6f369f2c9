"""Write one evidence document: stamp provenance, make it plain finite JSON, validate, write atomically."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

from h3gate.errors import InputError, set_crash_folder
from h3gate.evidence.provenance import provenance
from h3gate.evidence.schema import validate_document
from h3gate.paths import display

SCHEMA_VERSION = 1
_RESERVED = ("kind", "schema_version", "provenance")


def to_json(value: Any, where: str = "$") -> Any:
    """``value`` as plain JSON data: tuples -> lists, paths -> strings, 0-d numpy/torch scalars -> Python numbers.

    A NaN or infinite float raises :class:`RuntimeError` naming its JSON path: evidence is finite or ``null``.
    Anything else unrepresentable is also a :class:`RuntimeError` (a bug in the caller, not a bad input).
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RuntimeError(f"evidence {where}: non-finite float {value!r}; record null (and why) instead")
        return float(value)
    if isinstance(value, Enum):
        return to_json(value.value, where)
    if isinstance(value, Path | PurePosixPath):
        return display(Path(value))
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise RuntimeError(f"evidence {where}: key {key!r} is not a string")
            out[str(key)] = to_json(item, f"{where}.{key}")
        return out
    if isinstance(value, list | tuple):
        return [to_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if getattr(value, "shape", None) is not None and tuple(value.shape) == () and hasattr(value, "item"):
        return to_json(value.item(), where)  # numpy scalar or 0-d tensor
    raise RuntimeError(f"evidence {where}: {type(value).__name__} is not JSON data")


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under the process umask (0o644 under the usual 022).

    ``tempfile.mkstemp`` creates 0600 files whatever the umask; atomic writers chmod their temp file to this.
    """
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_safetensors(files: dict[Path, dict], metadata: dict[str, str], label: str) -> None:
    """Write each ``path -> {name: tensor}`` as safetensors: every temp file first (in its target folder, chmod to
    :func:`new_file_mode`: ``save_file`` leaves 0600 whatever the umask), then ``os.replace`` each; nothing
    half-written. An ``OSError`` (or the library's ``SafetensorError`` of a failed write, e.g. a full disk) becomes
    ``InputError("<label>: cannot write (...)")``."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    temps: dict[Path, str] = {}
    try:
        for path, tensors in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            temps[path] = tmp
            save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, new_file_mode())
        for path, tmp in temps.items():
            os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:
        raise InputError(f"{label}: cannot write ({getattr(exc, 'strerror', None) or exc})") from None
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``; nothing half-written.

    The file gets the mode of any new file under the umask (:func:`new_file_mode`), not mkstemp's 0600. An
    ``OSError`` (a full disk, a lost permission) is an ``InputError`` naming ``path``, the temp file removed.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"{display(path)}: cannot write ({exc.strerror or exc})") from None
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise InputError(f"{display(path)}: cannot write ({exc.strerror or exc})") from None
        raise


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"{display(folder)}: exists and is not a folder") from None
    except OSError as exc:
        raise InputError(f"{display(folder)}: cannot create evidence folder ({exc.strerror or exc})") from None


def prepare_out(folder: Path, flag: str = "--out") -> Path:
    """Validate an evidence folder before any work, leaving nothing behind: an existing folder must take a new file
    (probed with a temp file, removed); a missing one must be creatable (its missing parents are created and
    removed again). It becomes the folder a crash's traceback goes to. An existing file, or a place that cannot be
    written, is an :class:`InputError` naming the folder."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{flag} {display(folder)}: exists and is not a folder")
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        for path in reversed(missing):
            path.mkdir()
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".h3gate-write-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"{flag} {display(folder)}: cannot write there ({exc.strerror or exc})") from None
    finally:
        for path in missing:
            with contextlib.suppress(OSError):
                path.rmdir()
    set_crash_folder(folder)
    return folder


def write_evidence(
    folder: Path,
    filename: str,
    kind: str,
    body: dict,
    command: list[str] | None = None,
    manifests: list[Path] | None = None,
    device: str | None = None,
    finalize: Callable[[dict], dict] | None = None,
) -> Path:
    """Write ``{"kind", "schema_version": 1, "provenance", **body}`` to ``folder/filename`` and return its path.

    ``finalize`` maps the complete plain-JSON document (provenance stamped) to the one written: the seal uses it to
    add its self-hash and signature. The document is validated against ``schemas/<kind>.schema.json`` first; our
    own output failing its schema is a bug and raises :class:`RuntimeError`. An unusable ``folder`` (user input)
    is an :class:`InputError`.
    """
    rel = PurePosixPath(filename)
    if rel.is_absolute() or ".." in rel.parts or rel.suffix != ".json" or not rel.name:
        raise RuntimeError(f"evidence file name {filename!r}: must be a relative path ending in .json")
    clash = [k for k in _RESERVED if k in body]
    if clash:
        raise RuntimeError(f"evidence {filename}: body must not set {', '.join(clash)}")
    doc = to_json(
        {
            "kind": kind,
            "schema_version": SCHEMA_VERSION,
            "provenance": provenance(command=command, manifests=manifests, device=device),
            **body,
        }
    )
    if finalize is not None:
        doc = finalize(doc)
    try:
        validate_document(doc, kind, source=f"evidence {filename}")
    except InputError as exc:
        raise RuntimeError(f"h3gate wrote evidence that fails its own schema: {exc}") from None
    text = json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    path = Path(folder) / rel
    _make_folder(path.parent)
    try:
        atomic_write_text(path, text)
    except OSError as exc:
        raise InputError(f"{display(path)}: cannot write ({exc.strerror or exc})") from None
    return path
