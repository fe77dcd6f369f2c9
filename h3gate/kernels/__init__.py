"""``h3gate.kernels``: the strict Triton and Gluon kernels, one module per operator family (DESIGN.md; their contracts
in ``manifests/operators/``). The sources live in the repository's top-level ``kernels/`` folder, which has no
``__init__.py`` of its own, so that a checkout on ``sys.path`` never shadows the ``kernels`` distribution (diffusers and
SGLang import it); this package extends its search path there, so a plain checkout on ``PYTHONPATH`` imports
``h3gate.kernels.gemm`` from ``kernels/gemm.py``. A wheel and an editable install map ``kernels/`` to ``h3gate/kernels``
(``pyproject.toml``'s package-dir)."""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "kernels"))  # noqa: F821 - a package's own __path__
