"""The package's source files as Python imports them: ``h3gate/**/*.py`` and the repository's top-level ``kernels/``
(the modules of ``h3gate.kernels``, whose ``__init__`` in ``h3gate/kernels/`` points there). The architecture,
executor, numerics and import checks read every module through :func:`sources`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "h3gate"
KERNELS = ROOT / "kernels"
SHIM = PACKAGE / "kernels" / "__init__.py"


def module_name(path: Path) -> str:
    """``h3gate/graph/execute.py`` -> ``h3gate.graph.execute``; ``kernels/gemm.py`` -> ``h3gate.kernels.gemm``."""
    path = Path(path).resolve()
    if path.is_relative_to(KERNELS):
        parts = ("h3gate", "kernels", *path.relative_to(KERNELS).with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    """Module name -> source file, for every module of the package (``h3gate.kernels`` itself: its ``__init__``)."""
    files = list(PACKAGE.rglob("*.py")) + list(KERNELS.rglob("*.py"))
    return {module_name(p): p for p in sorted(files) if "__pycache__" not in p.parts}


def relative(path: Path) -> str:
    """A source file's path relative to the repository (``kernels/gemm.py``, ``h3gate/strict.py``)."""
    return Path(path).resolve().relative_to(ROOT).as_posix()
