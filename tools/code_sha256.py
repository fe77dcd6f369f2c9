#!/usr/bin/env python3
"""Print the provenance ``code_sha256`` of a commit (or of the working tree when no revision is given).

    python3 tools/code_sha256.py [REV]

Evidence written on the GPU host records ``code_sha256``; this recomputes it from git to name the commit it ran.
Commits from before the data moved into the package (top-level ``manifests/`` and ``schemas/``, kernels inside the
package) are hashed with the globs of their own layout, so the hashes that old evidence names are reproduced; the
current layout (top-level ``kernels/``, ``manifests/``, ``schemas/``) hashes each file under its installed path.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from h3gate.evidence.provenance import CODE_GLOBS, LEGACY_CODE_GLOBS, code_sha256

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def commit_sha256(rev: str) -> str:
    """``code_sha256`` of the tree at ``rev``, in the layout that commit had."""
    top = set(_git("ls-tree", "--name-only", rev).decode().split())
    if "kernels" in top:  # kernels, manifests and schemas at the top level: hashed under their installed paths
        parts, globs = ["h3gate", "kernels", "manifests", "schemas"], CODE_GLOBS
    elif "manifests" in top:  # commits up to e8fc078: the physical paths
        parts, globs = ["h3gate", "manifests", "schemas"], LEGACY_CODE_GLOBS
    else:
        parts, globs = ["h3gate"], CODE_GLOBS
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["tar", "-x", "-C", tmp], input=_git("archive", rev, *parts), check=True)
        return code_sha256(Path(tmp), globs)


def main() -> None:
    print(commit_sha256(sys.argv[1]) if len(sys.argv) > 1 else code_sha256(ROOT))


if __name__ == "__main__":
    main()
