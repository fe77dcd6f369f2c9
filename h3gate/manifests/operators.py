"""Operator declarations: ``manifests/operators/*.yaml``. Each operator name is declared exactly once, across files.

An operator binds a name to its provider reference (PyTorch, the provider's op sequence, dtypes and casts), its
strict kernel (or none yet) and its numerical contract. Bindings are ``module:function`` import paths resolved by
:mod:`h3gate.ops.registry`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt

from h3gate.errors import InputError
from h3gate.manifests.loader import read_yaml, validate
from h3gate.manifests.model_config import Strict
from h3gate.paths import MANIFESTS, display

ImportPath = str  # "package.module:function"
_IMPORT = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


AccuracyDtype = Literal["float32", "bfloat16", "float16"]


class Accuracy(Strict):
    """Bounds declared before measuring: rel_l2 = ||kernel - golden|| / ||golden|| against the float64 golden, keyed
    by the compared tensor's dtype (the output forward; each input gradient backward). Checked by ``run ws1-ops``."""

    forward: dict[AccuracyDtype, NonNegativeFloat] = Field(min_length=1)
    backward: dict[AccuracyDtype, NonNegativeFloat] = Field(default_factory=dict)


class Contract(Strict):
    """What a strict kernel promises; restated in the kernel's docstring and checked by its tests."""

    accumulator: Literal["float32", "float64", "none"]
    reduction_order: str
    cast_points: list[str]
    split_policy: Literal["none"] | str
    atomics: bool = False
    dtypes: list[Literal["float32", "bfloat16", "float16", "int64"]] = Field(min_length=1)
    provider_bitwise: bool
    backward: str
    supported: str
    accuracy: Accuracy | None = None


class SmallRows(Strict):
    """A second ratio for cases with fewer than ``below`` rows (e.g. the GEMM's small-M tile buckets, M < SMALL_M)."""

    below: PositiveInt
    min_ratio: PositiveFloat


class BenchTarget(Strict):
    """The operator's speed target, declared before measuring and gated by ``h3gate bench --op``.

    ratio = baseline median / kernel median, both timed side by side in one run. ``baseline``: ``provider`` (the
    operator's reference, e.g. ``F.linear`` = cuBLAS) or ``sdpa_flash`` (the reference with PyTorch SDPA pinned to
    its flash backend). ``kind: compute`` means the copy-bandwidth check does not apply. Without a declared target
    an operator is gated by the default criteria of :mod:`h3gate.bench.ops` (not slower than the provider; copy
    bandwidth when memory-bound)."""

    kind: Literal["compute", "memory"]
    baseline: Literal["provider", "sdpa_flash"] = "provider"
    min_ratio: PositiveFloat
    small_rows: SmallRows | None = None
    source: str = Field(min_length=1)


class OperatorSpec(Strict):
    rfc_row: str
    family: str
    description: str
    reference: str = Field(pattern=_IMPORT)
    kernel: str | None = Field(default=None, pattern=_IMPORT)
    kernel_id: str | None = None
    label: Literal["row", "interim"] = "row"
    contract: Contract
    bench: BenchTarget | None = None


class OperatorFile(Strict):
    operators: dict[str, OperatorSpec]


def load_operator_specs(folder: Path | None = None) -> dict[str, OperatorSpec]:
    """All operator declarations; a name declared in two files is an input error naming both."""
    folder = folder or MANIFESTS / "operators"
    specs: dict[str, OperatorSpec] = {}
    origin: dict[str, str] = {}
    for path in sorted(folder.glob("*.yaml")):
        parsed = validate(read_yaml(path), OperatorFile, display(path))
        for name, spec in parsed.operators.items():
            if name in specs:
                raise InputError(f"{display(path)}: operators.{name}: already declared in {origin[name]}")
            if spec.kernel is not None and spec.kernel_id is None:
                raise InputError(f"{display(path)}: operators.{name}.kernel_id: required when kernel is set")
            specs[name] = spec
            origin[name] = display(path)
    return specs
