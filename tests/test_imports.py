"""Every module of the package imports, and every third-party module it imports is a declared dependency: in
``[project].dependencies``, or in an optional extra (``report``: matplotlib, Pillow) when it is imported only inside
functions, so that every module still imports without the extra.

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
DIST_OF = {"yaml": "pyyaml", "PIL": "pillow", "pynvml": "nvidia-ml-py"}
EXTRAS_NOT_RUNTIME = ("test",)  # extras that are not a runtime feature: never a place for h3gate's own imports
# Installed apart, by a make target from a pinned requirements file (pip cannot express --no-deps in an extra), and
# imported only inside functions, as an extra's packages are: top-level module -> its requirements file.
INSTALLED_APART = {"sglang": "tools/sglang-requirements.txt"}


def all_modules() -> list[str]:
    """Every module and package of h3gate (``h3gate.kernels`` included, from ``kernels/`` in a checkout)."""
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


def _tops(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    return []


def _eager(tree: ast.Module) -> set[str]:
    """Top-level modules imported when the module itself is imported (not in a function, not under TYPE_CHECKING)."""
    found: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):  # never run
            stack.extend(node.orelse)
            continue
        found.update(_tops(node))
        stack.extend(ast.iter_child_nodes(node))
    return found


def _third_party_imports(package: Path, eager_only: bool = False) -> dict[str, set[str]]:
    """Top-level third-party module -> the files of ``package`` that import it (absolute imports, any depth; with
    ``eager_only`` only those run when the module is imported)."""
    found: dict[str, set[str]] = {}
    files = sorted(package.rglob("*.py"))
    if package.name == "h3gate" and (package.parent / "kernels").is_dir():  # a checkout: kernels/ is h3gate.kernels
        files += sorted((package.parent / "kernels").rglob("*.py"))
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tops = _eager(tree) if eager_only else {top for node in ast.walk(tree) for top in _tops(node)}
        for top in tops:
            if top != "h3gate" and top not in sys.stdlib_module_names:
                found.setdefault(top, set()).add(path.relative_to(package.parent).as_posix())
    return found


def _names(deps: list[str]) -> set[str]:
    names = set()
    for dep in deps:
        name = dep
        for sep in "<>=!~;[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower().replace("_", "-"))
    return names


def _project(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]


def _declared(pyproject: Path) -> set[str]:
    return _names(_project(pyproject)["dependencies"])


def _optional(pyproject: Path) -> set[str]:
    """Distributions of the runtime extras (``h3gate[report]``), the test extra left out."""
    extras = _project(pyproject).get("optional-dependencies", {})
    return {n for name, deps in extras.items() if name not in EXTRAS_NOT_RUNTIME for n in _names(deps)}


def _dist(top: str) -> str:
    return DIST_OF.get(top, top).lower()


def test_every_third_party_import_is_a_declared_dependency() -> None:
    package = Path(h3gate.__file__).parent
    pyproject = package.parent / "pyproject.toml"
    declared, optional = _declared(pyproject), _optional(pyproject)
    used = _third_party_imports(package)
    assert {"torch", "triton", "typer", "yaml", "matplotlib"} <= set(used)  # module and function level imports
    apart = set(INSTALLED_APART)
    missing = {top: sorted(files) for top, files in used.items() if _dist(top) not in declared | optional | apart}
    assert not missing, f"imported but not in [project].dependencies or a runtime extra: {missing}"
    for top, requirements in INSTALLED_APART.items():
        pins = (package.parent / requirements).read_text(encoding="utf-8").splitlines()
        assert any(line.startswith(f"{top}==") for line in pins), f"{requirements}: does not pin {top}"


def test_optional_extras_are_imported_lazily() -> None:
    """A module importing an extra's package at import time would break every module's import without the extra
    (the wheel smoke test imports them all from the wheel alone)."""
    package = Path(h3gate.__file__).parent
    pyproject = package.parent / "pyproject.toml"
    declared, optional = _declared(pyproject), _optional(pyproject)
    assert {"matplotlib", "pillow"} <= optional
    eager = _third_party_imports(package, eager_only=True)
    assert "torch" in eager and "matplotlib" not in eager
    offenders = {
        top: sorted(f) for top, f in eager.items() if _dist(top) in (optional - declared) | set(INSTALLED_APART)
    }
    assert not offenders, f"optional extras imported at module level (import them inside the function): {offenders}"


if __name__ == "__main__":
    modules = import_all()
    print(f"imported {len(modules)} modules of h3gate from {Path(h3gate.__file__).parent}")
