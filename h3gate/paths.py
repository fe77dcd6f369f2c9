"""Where h3gate's data lives: the manifests and schemas it ships, and the evidence folders.

Manifests and schemas live at the top of the repository, ``manifests/`` and ``schemas/`` (beside ``kernels/``); a
wheel carries them as package data, ``h3gate/data/manifests`` and ``h3gate/data/schemas``, found through
:mod:`importlib.resources`. A source checkout (editable install, or ``PYTHONPATH`` at the checkout) reads its own
top-level folders. ``H3GATE_HOME=DIR`` reads ``DIR/manifests`` and ``DIR/schemas`` instead (and writes evidence under
``DIR/evidence``). Evidence defaults to ``<checkout>/evidence``
when the code runs from a source checkout (editable install, or ``PYTHONPATH`` at the checkout) and to
``./evidence`` in the current directory for an installed wheel, never into site-packages.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def _checkout() -> Path | None:
    """The source checkout the code runs from, or None for an installed wheel (site-packages has no pyproject)."""
    top = Path(__file__).resolve().parents[1]
    return top if (top / "pyproject.toml").is_file() else None


def _data_root(checkout: Path | None) -> Path:
    """Where ``manifests/`` and ``schemas/`` are: the checkout's top level, or the wheel's package data (pip installs
    packages as files, never zipped)."""
    if checkout is not None and (checkout / "manifests").is_dir():
        return checkout
    data = files("h3gate") / "data"
    if not isinstance(data, Path):
        raise RuntimeError(f"h3gate package data {data!r} is not on the filesystem; install h3gate unzipped")
    return data


_HOME = os.environ.get("H3GATE_HOME")
CHECKOUT = _checkout()
ROOT = Path(_HOME) if _HOME else _data_root(CHECKOUT)  # the data root: manifests/ and schemas/
MANIFESTS = ROOT / "manifests"
SCHEMAS = ROOT / "schemas"
EVIDENCE = ROOT / "evidence" if _HOME else (CHECKOUT / "evidence" if CHECKOUT else Path("evidence"))
LOCAL_EVIDENCE = EVIDENCE / "local"


def display(path: Path) -> str:
    """A path as the user should read it in messages: ``manifests/...`` and ``schemas/...`` relative to the data
    root, other paths of the checkout relative to it, anything else as given (also when it cannot be resolved: a
    symbolic link loop, an unreadable parent)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13); OSError: ELOOP and friends
        return str(path)
    for base in (ROOT, CHECKOUT):
        if base is not None:
            try:
                return str(resolved.relative_to(base.resolve()))
            except ValueError:
                pass
    return str(path)
