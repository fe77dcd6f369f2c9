"""Where data and evidence live: package data in a checkout and in an installed wheel, ``H3GATE_HOME``, and what the
wheel's package-data globs and ``code_sha256`` cover."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import h3gate
from h3gate import paths
from h3gate.evidence.provenance import CODE_GLOBS

PACKAGE = Path(h3gate.__file__).resolve().parent
PROBE = (
    "import json; from h3gate import paths; print(json.dumps({k: None if v is None else str(v) for k, v in "
    "dict(root=paths.ROOT, checkout=paths.CHECKOUT, evidence=paths.LOCAL_EVIDENCE).items()} | "
    "{'layouts': paths.display(paths.MANIFESTS / 'layouts.yaml'), 'run': paths.display(paths.LOCAL_EVIDENCE / 'r')}))"
)


def probe(cwd: Path, pythonpath: Path | None = None, home: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("H3GATE_HOME", "PYTHONPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    if home is not None:
        env["H3GATE_HOME"] = str(home)
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(paths.CHECKOUT is None, reason="the suite runs from a checkout")
def test_checkout_reads_package_data_and_writes_evidence_into_the_checkout(tmp_path) -> None:
    got = probe(tmp_path)
    assert got["root"] == str(PACKAGE / "data") and got["checkout"] == str(PACKAGE.parent)
    assert got["evidence"] == str(PACKAGE.parent / "evidence" / "local")
    assert got["layouts"] == "manifests/layouts.yaml" and got["run"] == "evidence/local/r"


def test_installed_package_reads_its_data_and_writes_evidence_under_the_working_directory(tmp_path) -> None:
    """The package alone, as pip lays a wheel out in site-packages (no pyproject.toml beside it)."""
    site, cwd = tmp_path / "site", tmp_path / "run"
    shutil.copytree(PACKAGE, site / "h3gate", ignore=shutil.ignore_patterns("__pycache__"))
    cwd.mkdir()
    got = probe(cwd, pythonpath=site)
    assert got["root"] == str(site / "h3gate" / "data") and got["checkout"] is None
    assert got["evidence"] == "evidence/local" and got["run"] == "evidence/local/r"  # relative: the current directory
    assert got["layouts"] == "manifests/layouts.yaml"


def test_h3gate_home_relocates_manifests_schemas_and_evidence(tmp_path) -> None:
    got = probe(tmp_path, home=tmp_path / "home")
    assert got["root"] == str(tmp_path / "home") and got["evidence"] == str(tmp_path / "home" / "evidence" / "local")
    assert got["layouts"] == "manifests/layouts.yaml"


@pytest.mark.skipif(paths.CHECKOUT is None, reason="reads pyproject.toml")
def test_the_wheel_and_the_code_hash_cover_every_data_file() -> None:
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    globs = pyproject["tool"]["setuptools"]["package-data"]["h3gate.data"]
    data = PACKAGE / "data"
    files = {p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert {"manifests/layouts.yaml", "manifests/configs/tiny.yaml", "schemas/common.schema.json"} <= files
    assert {p.relative_to(data).as_posix() for g in globs for p in data.glob(g)} == files, "not in the wheel"
    assert sorted(f"h3gate/data/{g}" for g in globs) == sorted(g for g in CODE_GLOBS if g.startswith("h3gate/data/"))
