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
from h3gate.evidence.provenance import code_files, code_sha256
from tests.package_sources import sources

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
    assert got["root"] == str(PACKAGE.parent) and got["checkout"] == str(PACKAGE.parent)
    assert got["evidence"] == str(PACKAGE.parent / "evidence" / "local")
    assert got["layouts"] == "manifests/layouts.yaml" and got["run"] == "evidence/local/r"


def test_installed_package_reads_its_data_and_writes_evidence_under_the_working_directory(tmp_path) -> None:
    """The package alone, as pip lays a wheel out in site-packages (no pyproject.toml beside it)."""
    site, cwd = tmp_path / "site", tmp_path / "run"
    wheel_layout(site)
    cwd.mkdir()
    got = probe(cwd, pythonpath=site)
    assert got["root"] == str(site / "h3gate" / "data") and got["checkout"] is None
    assert got["evidence"] == "evidence/local" and got["run"] == "evidence/local/r"  # relative: the current directory
    assert got["layouts"] == "manifests/layouts.yaml"


def test_h3gate_home_relocates_manifests_schemas_and_evidence(tmp_path) -> None:
    got = probe(tmp_path, home=tmp_path / "home")
    assert got["root"] == str(tmp_path / "home") and got["evidence"] == str(tmp_path / "home" / "evidence" / "local")
    assert got["layouts"] == "manifests/layouts.yaml"


def wheel_layout(site: Path) -> None:
    """The package as a wheel lays it out in ``site``: ``h3gate/``, ``kernels/`` as ``h3gate/kernels`` and the data as
    ``h3gate/data/{manifests,schemas}`` (``pyproject.toml``'s package-dir)."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PACKAGE, site / "h3gate", ignore=ignore)
    shutil.rmtree(site / "h3gate" / "kernels")
    shutil.copytree(PACKAGE.parent / "kernels", site / "h3gate" / "kernels", ignore=ignore)
    for name in ("manifests", "schemas"):
        shutil.copytree(PACKAGE.parent / name, site / "h3gate" / "data" / name, ignore=ignore)


@pytest.mark.skipif(paths.CHECKOUT is None, reason="reads pyproject.toml")
def test_the_wheel_and_the_code_hash_cover_every_data_file_and_kernel() -> None:
    """pyproject maps kernels/, manifests/ and schemas/ into the package and ships every data file; the package list
    names every package; the code hash covers the same files."""
    tool = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs, listed = tool["package-dir"], set(tool["packages"])
    assert dirs["h3gate.kernels"] == "kernels"
    root = PACKAGE.parent
    for package, data in tool["package-data"].items():
        assert package in listed, package
        top = package.removeprefix("h3gate.data.").split(".")[0]
        folder = root / dirs[f"h3gate.data.{top}"] / Path(*package.removeprefix(f"h3gate.data.{top}").split(".")[1:])
        files = {p for g in data for p in folder.glob(g)}
        assert files == {p for p in folder.iterdir() if p.is_file()}, f"{folder}: not every file ships"
    data_dirs = {f"h3gate.data.{top}" + "".join(f".{x}" for x in p.relative_to(root / top).parts)
                 for top in ("manifests", "schemas") for p in [root / top, *(root / top).rglob("*")] if p.is_dir()
                 and "__pycache__" not in p.parts}  # fmt: skip
    packages = {m for m in sources() if (root / m.replace(".", "/") / "__init__.py").is_file()}
    assert listed == packages | {"h3gate.kernels"} | data_dirs, "pyproject's packages miss or add a package"
    logical = set(code_files(root))
    shipped = {f"h3gate/data/{p.relative_to(root).as_posix()}" for top in ("manifests", "schemas")
               for p in (root / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
    assert shipped <= logical and {f"h3gate/kernels/{p.name}" for p in (root / "kernels").glob("*.py")} <= logical


def test_the_code_hash_is_the_same_in_a_checkout_and_in_the_wheel_layout(tmp_path) -> None:
    site = tmp_path / "site"
    wheel_layout(site)
    assert code_sha256(site) == code_sha256(PACKAGE.parent)
    assert set(code_files(site)) == set(code_files(PACKAGE.parent))


def test_the_checkout_never_shadows_the_kernels_distribution(tmp_path) -> None:
    """``kernels/`` has no ``__init__.py``: from the repository's root (on ``sys.path`` first, as ``python -m`` and
    pytest put it), ``import kernels`` is the ``kernels`` distribution diffusers and SGLang import, not our folder."""
    root = PACKAGE.parent
    assert (root / "kernels").is_dir() and not (root / "kernels" / "__init__.py").exists()
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    origin = done.stdout.strip()
    assert origin == "None" or not origin.startswith(str(root / "kernels")), origin
