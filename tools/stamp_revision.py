"""Stamp the revision into ``.h3gate-revision`` (git-ignored) before copying the tree to another host.

The stamp is JSON: ``{"revision": HEAD, "code_sha256": <the code hash of this tree>, "dirty_files": [...]}``.
On the other host, provenance uses it while the code there hashes the same (``h3gate/evidence/provenance.py``),
whatever that copy's own ``.git`` says; edit the code after stamping and the stamp is ignored.

    python3 tools/stamp_revision.py        # prints the stamp
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from h3gate.evidence.provenance import STAMP, code_sha256  # noqa: E402


def main() -> int:
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    status = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True, check=True
    )
    files = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    stamp = {"revision": rev.stdout.strip(), "code_sha256": code_sha256(ROOT), "dirty_files": files}
    (ROOT / STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(stamp, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
