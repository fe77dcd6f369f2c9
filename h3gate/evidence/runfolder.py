"""Run folders: the one way every verb gets the folder its evidence goes to; evidence is never silently replaced.

Without ``--out`` a run writes a new folder ``<default>/<UTC yyyymmddTHHMMSSZ>-<6 hex>/`` and, once its evidence is
complete (gate pass or gate fail), points the relative symbolic link ``<default>/latest`` at it (a temp link
renamed over the old one). An explicit ``--out`` that already holds h3gate evidence (a ``*.json`` or
``*.safetensors`` file, or a run marker) is refused unless ``--force`` (the run then writes over the files it
writes; others stay).

While a run works it holds an exclusive ``flock`` on :data:`LOCK_NAME` in its folder (the file names the holder:
pid, host, start time, command; a second run into the folder is refused naming it) and keeps the marker
:data:`UNFINISHED_NAME` there until its evidence is written. On taking the lock it removes a killed run's temp files
(``.*.tmp``, anywhere under the folder). A run that ends in bad input or a crash before writing anything removes
the folders it created. ``h3gate seal`` refuses a folder with temp files, the marker or a lock
(:func:`refuse_unfinished`); ``seal``, ``report`` and ``compare`` given a folder with a ``latest`` link use the run
it points to (:func:`resolve_latest`).

Commands wrap their function in :func:`run_scope` and call :func:`enter_run` where the folder is needed: the run
folder stays open until the command returns (complete) or raises (cleaned up), without re-indenting the command.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

from h3gate.bounded import load_json_file
from h3gate.errors import InputError, set_crash_folder
from h3gate.evidence.writer import prepare_out
from h3gate.paths import display

LOCK_NAME = ".h3gate-lock"
UNFINISHED_NAME = ".h3gate-unfinished"
LATEST = "latest"
TEMP_GLOB = ".*.tmp"
MARKERS = (LOCK_NAME, UNFINISHED_NAME)
EVIDENCE_SUFFIXES = (".json", ".safetensors")


def run_stamp() -> str:
    """A new run folder's name: UTC time to the second and 6 random hex digits (two runs in one second differ)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def evidence_in(folder: Path) -> list[str]:
    """The names of h3gate evidence at the top of ``folder``: evidence files and run markers (sorted)."""
    if not folder.is_dir():
        return []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return sorted(p.name for p in entries if p.name in MARKERS or (p.suffix in EVIDENCE_SUFFIXES and p.is_file()))


def temp_files(folder: Path) -> list[Path]:
    """A killed run's temp files under ``folder`` (``.*.tmp``, any depth; links are not followed)."""
    return sorted(p for p in folder.rglob(TEMP_GLOB) if p.is_file() and not p.is_symlink())


def _holder_text(lock: Path) -> str:
    """``pid N (<command>, started <time>)`` from a lock file's record (what there is of it)."""
    try:
        rec = load_json_file(lock, display(lock), 64 * 1024)
        return f"pid {rec['pid']} ({rec['command']}, started {rec['started']}, host {rec['host']})"
    except (OSError, ValueError, KeyError, TypeError, InputError):
        return "another h3gate run (its lock file names no holder yet)"


def lock_holder(folder: Path) -> str | None:
    """Who holds ``folder``'s run lock now (:func:`_holder_text`), or None when nobody does."""
    lock = Path(folder) / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(lock)
    finally:
        os.close(fd)
    return None


def refuse_unfinished(folder: Path, verb: str = "seal") -> None:
    """Refuse (InputError) a folder a run is writing or a killed run left: temp files, the unfinished marker, a lock."""
    folder = Path(folder)
    holder = lock_holder(folder)
    if holder is not None:
        raise InputError(f"{verb} {display(folder)}: in use by {holder}; wait for it to finish")
    found = [p.relative_to(folder).as_posix() for p in temp_files(folder)]
    found += [name for name in (UNFINISHED_NAME, LOCK_NAME) if (folder / name).exists()]
    if found:
        raise InputError(
            f"{verb} {display(folder)}: holds an unfinished run ({', '.join(found)}): a run was killed while "
            "writing it; a new run into it (--out FOLDER --force) cleans its temp files, or write a new run"
        )


def resolve_latest(folder: Path) -> Path | None:
    """``folder/latest``'s run folder when ``folder`` is a default parent with that link, else None."""
    link = Path(folder) / LATEST
    if link.is_symlink() and link.is_dir():
        return Path(folder) / os.readlink(link)
    return None


@dataclass
class RunFolder:
    """An open run folder: ``path`` (where the evidence goes), the default ``parent`` whose ``latest`` link points
    at it once complete (None for an explicit ``--out``), the folders this run made, the lock's descriptor."""

    path: Path
    parent: Path | None = None
    created: list[Path] = field(default_factory=list)
    before: dict[str, tuple[int, int]] = field(default_factory=dict)
    lock_fd: int | None = None

    def wrote(self) -> bool:
        """Whether any file under the folder (markers and temp files aside) appeared or changed during the run."""
        return _snapshot(self.path) != self.before


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for p in folder.rglob("*"):
        if p.name in MARKERS or (p.name.startswith(".") and p.name.endswith(".tmp")):
            continue
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                out[p.relative_to(folder).as_posix()] = (st.st_mtime_ns, st.st_size)
    return out


def check_out(out: Path | None, force: bool, flag: str = "--out", reuse: bool = False) -> None:
    """The cheap checks of an explicit ``--out`` before any work, leaving nothing behind: writable
    (:func:`prepare_out`), not holding evidence unless ``force`` or ``reuse`` (a run resumed in its own folder),
    not in use by a running run."""
    if out is None:
        return
    out = Path(out)
    prepare_out(out, flag)
    holder = lock_holder(out)
    if holder is not None:
        raise InputError(f"{display(out)}: in use by {holder}")
    found = evidence_in(out)
    if found and not (force or reuse):
        what = "an unfinished h3gate run" if set(found) <= set(MARKERS) else "h3gate evidence"
        raise InputError(
            f"{flag} {display(out)}: holds {what} ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}); "
            f"--force replaces it (or leave out {flag}: each run then writes a new folder)"
        )


def _mkdirs(folder: Path, flag: str, exist_ok: bool) -> list[Path]:
    """Create ``folder`` and its missing parents; return the created ones, deepest first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    if folder.exists() and not exist_ok:
        raise FileExistsError(folder)
    made: list[Path] = []
    try:
        for p in reversed(missing):
            p.mkdir()
            made.insert(0, p)
    except FileExistsError:
        _remove_made(made)
        raise
    except OSError as exc:
        _remove_made(made)
        raise InputError(f"{flag} {display(folder)}: cannot create ({exc.strerror or exc})") from None
    return made


def _remove_made(made: list[Path]) -> None:
    for p in made:  # deepest first; only folders left empty go
        with contextlib.suppress(OSError):
            p.rmdir()


def _new_run_path(parent: Path) -> tuple[Path, list[Path]]:
    for _ in range(100):
        path = parent / run_stamp()
        try:
            return path, _mkdirs(path, "evidence folder", exist_ok=False)
        except FileExistsError:
            continue
    raise RuntimeError(f"{display(parent)}: no free run folder name after 100 tries")


def _acquire(folder: Path, flag: str) -> tuple[int, str]:
    """Take the exclusive lock on ``folder/LOCK_NAME`` and record the holder in it (returned); refused when held."""
    lock = folder / LOCK_NAME
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InputError(f"{flag} {display(folder)}: cannot lock ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(f"{display(folder)}: in use by {_holder_text(lock)}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder finished and unlinked the file between our open and flock: take the new one
            break
        os.close(fd)
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["h3gate", *sys.argv[1:]]) if sys.argv else "h3gate",
    }
    text = json.dumps(record) + "\n"
    os.ftruncate(fd, 0)
    os.write(fd, text.encode("utf-8"))
    return fd, text


def _release(run: RunFolder) -> None:
    if run.lock_fd is None:
        return
    with contextlib.suppress(OSError):
        (run.path / LOCK_NAME).unlink()
    os.close(run.lock_fd)
    run.lock_fd = None


def _point_latest(parent: Path, run: Path) -> None:
    """``parent/latest`` -> ``run.name``, replaced atomically (a temp link renamed over it)."""
    tmp = parent / f".{LATEST}.{secrets.token_hex(4)}.tmp"
    os.symlink(run.name, tmp)
    try:
        os.replace(tmp, parent / LATEST)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _discard(run: RunFolder) -> None:
    """Remove what a run that wrote nothing made: its markers and temp files, then the folders it created."""
    with contextlib.suppress(OSError):
        (run.path / UNFINISHED_NAME).unlink()
    _release(run)
    if run.created and run.created[0] == run.path:  # made by this run, holding nothing written: empty folders at most
        shutil.rmtree(run.path, ignore_errors=True)
    _remove_made(run.created)


@contextmanager
def open_run(
    out: Path | None, default: Path, force: bool = False, flag: str = "--out", reuse: bool = False
) -> Iterator[RunFolder]:
    """The run folder of one command (see the module docstring): ``out`` or a new ``default/<stamp>``; locked,
    marked unfinished, a killed run's temp files removed. On a normal exit with evidence written the marker goes
    and (default folder) ``latest`` is pointed at it; with nothing written, or on an exception before anything was
    written, the folders it created are removed. ``reuse``: an existing run in ``out`` is continued (no ``force``
    needed)."""
    if out is None:
        path, created = _new_run_path(Path(default))
        parent: Path | None = Path(default)
    else:
        path = Path(out)
        check_out(path, force, flag, reuse)
        created, parent = _mkdirs(path, flag, exist_ok=True), None
    run = RunFolder(path, parent, created)
    try:
        run.lock_fd, holder = _acquire(path, flag)
    except BaseException:
        _remove_made(created)  # another run's markers stay
        raise
    try:
        for tmp in temp_files(path):
            tmp.unlink(missing_ok=True)
        (path / UNFINISHED_NAME).write_text(holder, encoding="utf-8")
        run.before = _snapshot(path)
    except BaseException:
        _discard(run)
        raise
    set_crash_folder(path)
    try:
        yield run
    except BaseException:
        if run.wrote():
            _release(run)  # partial evidence stays, marked unfinished: seal refuses it
        else:
            _discard(run)
        raise
    if not run.wrote() and run.created:
        _discard(run)
        return
    with contextlib.suppress(OSError):
        (path / UNFINISHED_NAME).unlink()
    try:
        if parent is not None:
            _point_latest(parent, path)
    finally:
        _release(run)


_SCOPES: list[ExitStack] = []
P = ParamSpec("P")
R = TypeVar("R")


def run_scope(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a command function: a run folder it opens with :func:`enter_run` stays open until it returns."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with ExitStack() as stack:
            _SCOPES.append(stack)
            try:
                return fn(*args, **kwargs)
            finally:
                _SCOPES.pop()

    return wrapper


def enter_run(out: Path | None, default: Path, force: bool = False, flag: str = "--out", reuse: bool = False) -> Path:
    """:func:`open_run` held open by the enclosing :func:`run_scope` command; returns the run folder's path."""
    if not _SCOPES:
        raise RuntimeError("enter_run outside a @run_scope command")
    return _SCOPES[-1].enter_context(open_run(out, default, force, flag, reuse)).path
