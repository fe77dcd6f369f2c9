"""Every module of the package imports, and every third-party module it imports is a declared dependency.

``python tests/test_imports.py`` runs the import check without pytest: ``tools/wheel_smoke.sh`` runs it in a venv made
from the wheel alone (no test extra), where an undeclared dependency is missing for real.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import tomllib
from pathlib import Path

import h3gate

# Import names whose distribution is spelled otherwise.
DIST_OF = {"yaml": "pyyaml"}


def all_modules() -> list[str]:
    """Every module and package under h3gate (the data tree, h3gate/data, holds no code and is not a package)."""
    return sorted(m.name for m in pkgutil.walk_packages(h3gate.__path__, "h3gate."))


def import_all() -> list[str]:
    names = all_modules()
    for name in names:
        importlib.import_module(name)
    return names


def test_every_module_imports() -> None:
    names = import_all()
    for expected in ("h3gate.cli", "h3gate.manifests.loader", "h3gate.kernels.gemm", "h3gate.evidence.schema"):
        assert expected in names, expected  # the walk reaches every subpackage
    assert len(names) >= 80, len(names)


def _third_party_imports(package: Path) -> dict[str, set[str]]:
    """Top-level third-party module -> the files of ``package`` that import it (absolute imports, any depth)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top != "h3gate" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(path.relative_to(package.parent).as_posix())
    return found


def _declared(pyproject: Path) -> set[str]:
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    names = set()
    for dep in deps:
        name = dep
        for sep in "<>=!~;[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower().replace("_", "-"))
    return names


def test_every_third_party_import_is_a_declared_dependency() -> None:
    package = Path(h3gate.__file__).parent
    declared = _declared(package.parent / "pyproject.toml")
    used = _third_party_imports(package)
    assert {"torch", "triton", "typer", "yaml"} <= set(used)  # the scan sees imports at module and function level
    missing = {top: sorted(files) for top, files in used.items() if DIST_OF.get(top, top) not in declared}
    assert not missing, f"imported but not in [project].dependencies: {missing}"


if __name__ == "__main__":
    modules = import_all()
    print(f"imported {len(modules)} modules of h3gate from {Path(h3gate.__file__).parent}")
