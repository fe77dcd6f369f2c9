"""What ran, where, and from which bytes: the provenance block stamped on every evidence document."""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
import sys
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

import h3gate
from h3gate.bounded import loads_json
from h3gate.errors import InputError
from h3gate.paths import display

# The checkout the running code came from (not H3GATE_HOME, which only relocates data).
_CODE_ROOT = Path(h3gate.__file__).resolve().parents[1]
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks; an unreadable file is an input error naming it."""
    digest = hashlib.sha256()
    try:
        with Path(path).open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise InputError(f"{display(path)}: cannot read ({exc.strerror or exc})") from None
    return digest.hexdigest()


# The code as an installed wheel lays it out: every path below is a logical one, the same in a wheel and a checkout.
CODE_GLOBS: tuple[str, ...] = ("h3gate/**/*.py", "h3gate/data/manifests/**/*.yaml", "h3gate/data/schemas/*.json")
# A source checkout keeps the kernels, manifests and schemas at its top level; each maps onto its installed place.
CHECKOUT_SOURCES: tuple[tuple[str, str, str], ...] = (
    ("kernels", "**/*.py", "h3gate/kernels"),
    ("manifests", "**/*.yaml", "h3gate/data/manifests"),
    ("schemas", "*.json", "h3gate/data/schemas"),
)
# Before the data moved into the package (commits up to e8fc078) manifests/ and schemas/ sat at the top level, and
# their evidence hashed those physical paths.
LEGACY_CODE_GLOBS: tuple[str, ...] = ("h3gate/**/*.py", "manifests/**/*.yaml", "schemas/*.json")


def code_files(root: Path, globs: tuple[str, ...] = CODE_GLOBS) -> dict[str, Path]:
    """Logical path -> file of the code under ``root``: ``globs`` as they match, and, where ``root`` is a checkout
    with a top-level ``kernels/`` folder, that folder, ``manifests/`` and ``schemas/`` under their installed paths
    (the checkout's ``h3gate/kernels/__init__.py`` only points at ``kernels/``; the wheel's is
    ``kernels/__init__.py``)."""
    found = {p.relative_to(root).as_posix(): p for g in globs for p in root.glob(g) if p.is_file()}
    if globs == CODE_GLOBS and (root / "kernels").is_dir():
        found.pop("h3gate/kernels/__init__.py", None)
        for top, pattern, logical in CHECKOUT_SOURCES:
            for p in (root / top).glob(pattern):
                if p.is_file():
                    found[f"{logical}/{p.relative_to(root / top).as_posix()}"] = p
    return {k: v for k, v in found.items() if "__pycache__" not in v.parts}


@cache
def code_sha256(root: Path = _CODE_ROOT, globs: tuple[str, ...] = CODE_GLOBS) -> str:
    """sha256 over the code that runs: for every file of :func:`code_files`, in sorted logical POSIX path order,
    ``path`` NUL ``sha256(bytes)`` newline. Identifies the code without git (the GPU host gets a copied tree whose
    ``.git`` may point at another commit); ``tools/code_sha256.py REV`` recomputes it for a commit. ``root`` is the
    checkout, or site-packages for an installed wheel (same hash)."""
    digest = hashlib.sha256()
    for logical, path in sorted(code_files(root, globs).items()):
        digest.update(logical.encode() + b"\0" + sha256_file(path).encode() + b"\n")
    return digest.hexdigest()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(_CODE_ROOT), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


STAMP = ".h3gate-revision"
MAX_DIRTY_FILES = 50


def _is_sha(text: str) -> bool:
    return len(text) == 40 and all(c in "0123456789abcdef" for c in text)


def read_stamp(root: Path) -> dict | None:
    """``.h3gate-revision`` written by ``tools/stamp_revision.py`` before a tree is copied to another host:
    ``{"revision", "code_sha256", "dirty_files"}`` (JSON), or a bare 40-hex revision (older stamps)."""
    path = root / STAMP
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8").strip()
    if _is_sha(text):
        return {"revision": text, "code_sha256": None, "dirty_files": None}
    try:
        stamp = loads_json(text, display(path))
    except (ValueError, InputError):
        return None
    if not isinstance(stamp, dict) or not _is_sha(str(stamp.get("revision", ""))):
        return None
    return stamp


@cache
def git_state() -> tuple[str, bool | None, str, tuple[str, ...]]:
    """(revision, dirty, source, files that differ from the revision) of the running code, once per process.

    * ``stamp``: a stamp whose ``code_sha256`` equals the running code's names the revision it was made from, and
      the files that then differed from it (a tree copied to a GPU host carries it; that copy's own ``.git`` may
      point at another commit, so a matching stamp wins over git);
    * ``git``: ``HEAD`` of the checkout and ``git status --porcelain``;
    * a bare-revision stamp (older tools) only without git, dirty unknown; else ``("unknown", None, "none", ())``.
    """
    stamp = read_stamp(_CODE_ROOT)
    if stamp is not None and stamp.get("code_sha256") == code_sha256(_CODE_ROOT):
        files = tuple(str(f) for f in stamp.get("dirty_files") or [])[:MAX_DIRTY_FILES]
        return stamp["revision"], bool(files), "stamp", files
    rev = _git("rev-parse", "HEAD")
    if rev is None or not rev.strip():
        if stamp is not None and stamp.get("code_sha256") is None:
            return stamp["revision"], None, "stamp", ()
        return "unknown", None, "none", ()
    status = _git("status", "--porcelain")
    if status is None:
        return rev.strip(), None, "git", ()
    files = tuple(line[3:] for line in status.splitlines() if line.strip())[:MAX_DIRTY_FILES]
    return rev.strip(), bool(files), "git", files


def _versions() -> tuple[str, str | None]:
    import torch

    try:
        import triton

        triton_version: str | None = str(triton.__version__)
    except ImportError:
        triton_version = None
    return str(torch.__version__), triton_version


def _device_name(device: str | None) -> str:
    import torch

    if device is not None and device.startswith("cuda") and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(torch.device(device)))
    return platform.processor() or platform.machine() or "unknown"


def provenance(
    command: list[str] | None = None, manifests: list[Path] | None = None, device: str | None = None
) -> dict:
    """The provenance block (schema ``common.schema.json#/$defs/provenance``).

    ``manifests`` are hashed (sha256 of their bytes) and keyed by their repository-relative path; ``device`` is
    the execution device string (``cpu``/``cuda``/``cuda:N``) and is resolved to a hardware name.
    """
    import torch

    torch_version, triton_version = _versions()
    revision, dirty, source, dirty_files = git_state()
    hashes: dict[str, str] = {}
    for path in manifests or []:
        hashes[display(Path(path))] = sha256_file(Path(path))
    return {
        "h3gate_version": h3gate.__version__,
        "git_revision": revision,
        "git_dirty": dirty,
        "revision_source": source,
        "dirty_files": list(dirty_files),
        "code_sha256": code_sha256(),
        "python": platform.python_version(),
        "torch": torch_version,
        "triton": triton_version,
        "device": device,
        "device_name": _device_name(device),
        "allow_tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "allow_tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "gemm_launch": os.environ.get("H3GATE_GEMM_LAUNCH"),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "intra_op_threads": torch.get_num_threads(),
        "manifests": hashes,
        "command": [str(a) for a in (sys.argv if command is None else command)],
        "time_utc": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "hostname": socket.gethostname(),
    }
