"""Where the repository's data lives: manifests, schemas and the default evidence folder."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("H3GATE_HOME", Path(__file__).resolve().parents[1]))
MANIFESTS = ROOT / "manifests"
SCHEMAS = ROOT / "schemas"
EVIDENCE = ROOT / "evidence"
LOCAL_EVIDENCE = EVIDENCE / "local"


def display(path: Path) -> str:
    """A path as the user should read it in messages: relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
