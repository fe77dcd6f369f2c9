"""The sealed GPU evidence committed under evidence/ still verifies: schemas, per-file hashes and the root."""

from __future__ import annotations

import pytest

from h3gate.evidence.seal import verify_folder
from h3gate.paths import EVIDENCE

SEALED = sorted(p.parent for p in EVIDENCE.rglob("SEAL.json") if "local" not in p.relative_to(EVIDENCE).parts)


def test_committed_evidence_exists() -> None:
    assert SEALED, "no sealed evidence folder under evidence/"


# the GPU folders (hundreds of records, 7-10 s each on one core) verify under make test-slow, which .ci/run also runs
LARGE = {"h100", "h200"}


@pytest.mark.parametrize(
    "folder",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in LARGE else p for p in SEALED],
    ids=[str(p.relative_to(EVIDENCE)) for p in SEALED],
)
def test_committed_evidence_verifies(folder) -> None:
    report = verify_folder(folder)
    assert report.ok, (report.changed, report.added, report.removed, report.schema_errors, report.root_ok)
