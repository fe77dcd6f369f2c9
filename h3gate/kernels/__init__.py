"""``h3gate.kernels`` in a source checkout: the Triton and Gluon sources live in the repository's top-level
``kernels/`` folder (beside ``manifests/`` and ``schemas/``), and this package extends its search path there, so a
plain checkout on ``PYTHONPATH`` and an editable install import ``h3gate.kernels.gemm`` from ``kernels/gemm.py``. A
wheel installs ``kernels/`` itself as ``h3gate/kernels`` (``pyproject.toml``'s package-dir), without this file. The
import name stays ``h3gate.kernels``: a top-level ``kernels`` package belongs to the ``kernels`` distribution."""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "kernels"))  # noqa: F821 - a package's own __path__
