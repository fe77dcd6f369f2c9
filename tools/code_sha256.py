#!/usr/bin/env python3
"""Print the provenance ``code_sha256`` of a commit (or of the working tree when no revision is given).

    python3 tools/code_sha256.py [REV]

Evidence written on the GPU host records ``code_sha256``; this recomputes it from git to name the commit it ran.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from h3gate.evidence.provenance import code_sha256

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if len(sys.argv) < 2:
        print(code_sha256(ROOT))
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", sys.argv[1], "h3gate", "manifests", "schemas"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        print(code_sha256(Path(tmp)))


if __name__ == "__main__":
    main()
