"""Operator declarations: ``manifests/operators/*.yaml``. Each operator name is declared exactly once, across files.

An operator binds a name to its provider reference (PyTorch, the provider's op sequence, dtypes and casts), its
strict kernel (or none yet) and its numerical contract. Bindings are ``module:function`` import paths resolved by
:mod:`h3gate.ops.registry`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

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
    # A merge twin whose forward is its operator's single-walk kernel, byte for byte (only the backward's order
    # differs): a device-measured promise of the single walk's forward (a tolerance's isolated_bitwise_on) holds.
    forward_as_single: bool = False
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


DeviceClass = Literal["cpu-interpreter", "cuda-sm90", "cuda-other"]
DEVICE_CLASSES: tuple[str, ...] = get_args(DeviceClass)
Product = Literal["forward", "backward", "grouped"]
PRODUCTS: tuple[str, ...] = get_args(Product)


class PathRule(Strict):
    """One row of a selection table: on each of ``devices``, a ``product`` call whose size lies in
    ``[size[0], size[1])`` (``size[1]`` null: unbounded) runs the kernel path ``path``."""

    devices: list[DeviceClass] = Field(min_length=1)
    product: Product = "forward"
    size: tuple[NonNegativeInt, PositiveInt | None]
    path: str = Field(pattern=r"^[a-z][a-z0-9_]*$")

    @model_validator(mode="after")
    def _range(self) -> PathRule:
        lo, hi = self.size
        if hi is not None and hi <= lo:
            raise ValueError(f"size [{lo}, {hi}): the bound must exceed the start")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices {self.devices}: a device class named twice")
        return self


class PathScope(Strict):
    """The calls a selection table governs: their dtype and the family's shape key (a GEMM's weight (N, K), the
    attention's head dim D)."""

    dtype: Literal["bfloat16", "float32"]
    weight: tuple[PositiveInt, PositiveInt] | None = None
    head_dim: PositiveInt | None = None

    @model_validator(mode="after")
    def _one_key(self) -> PathScope:
        if (self.weight is None) == (self.head_dim is None):
            raise ValueError("give exactly one of weight (a GEMM layer's (N, K)) and head_dim (the attention's D)")
        return self

    @property
    def key(self) -> tuple:
        """The family's lookup key: ``("weight", N, K, dtype)`` or ``("head_dim", D, dtype)``."""
        return ("weight", *self.weight, self.dtype) if self.weight else ("head_dim", self.head_dim, self.dtype)


class PathTable(Strict):
    """Which kernel path runs the operator's products here, declared: for calls in ``scope``, by device class and size
    bucket (``size``: the rows M of a GEMM, the sequence length S of the attention); every other call, and every
    product the rules do not list, runs ``otherwise``. For each (device class, product) the rules list, their ranges
    cover [0, unbounded) once, except ``grouped`` (one launch for sibling weights): sizes no grouped rule covers run
    one forward call a weight. So each (device, product, size) has exactly one path."""

    size: Literal["rows", "seq_len"]
    scope: PathScope
    otherwise: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    rules: list[PathRule] = Field(min_length=1)

    @model_validator(mode="after")
    def _coverage(self) -> PathTable:
        spans: dict[tuple[str, str], list[tuple[int, int | None]]] = {}
        for rule in self.rules:
            for device in rule.devices:
                spans.setdefault((device, rule.product), []).append(rule.size)
        for (device, product), ranges in sorted(spans.items()):
            ranges.sort(key=lambda r: r[0])
            where = f"rules for {device} {product}"
            for (lo, hi), (nxt, _) in zip(ranges, ranges[1:], strict=False):
                if hi is None or hi > nxt:
                    raise ValueError(f"{where}: [{lo}, {hi}) overlaps the range from {nxt}")
                if hi < nxt and product != "grouped":
                    raise ValueError(f"{where}: no path for sizes [{hi}, {nxt})")
            if product != "grouped" and (ranges[0][0] != 0 or ranges[-1][1] is not None):
                raise ValueError(f"{where}: must cover every size from 0 on (the last range unbounded)")
        return self

    def path(self, device: str, product: str, size: int) -> str | None:
        """The declared path of a call in scope; None for a ``grouped`` call no rule covers (one call a weight)."""
        for rule in self.rules:
            lo, hi = rule.size
            if rule.product == product and device in rule.devices and lo <= size and (hi is None or size < hi):
                return rule.path
        return None if product == "grouped" else self.otherwise


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
    paths: PathTable | None = None


class OperatorFile(Strict):
    operators: dict[str, OperatorSpec]


def load_operator_specs(folder: Path | None = None) -> dict[str, OperatorSpec]:
    """All operator declarations; a name declared in two files is an input error naming both, and so is a selection
    table whose scope another operator of its family already declares, or whose ``otherwise`` differs from the
    family's other tables (the path of every call outside all scopes)."""
    folder = folder or MANIFESTS / "operators"
    specs: dict[str, OperatorSpec] = {}
    origin: dict[str, str] = {}
    scopes: dict[tuple, str] = {}
    defaults: dict[str, tuple[str, str]] = {}
    for path in sorted(folder.glob("*.yaml")):
        parsed = validate(read_yaml(path), OperatorFile, display(path))
        for name, spec in parsed.operators.items():
            where = f"{display(path)}: operators.{name}"
            if name in specs:
                raise InputError(f"{where}: already declared in {origin[name]}")
            if spec.kernel is not None and spec.kernel_id is None:
                raise InputError(f"{where}.kernel_id: required when kernel is set")
            if spec.paths is not None:
                key = (spec.family, *spec.paths.scope.key)
                if key in scopes:
                    raise InputError(f"{where}.paths.scope: {spec.paths.scope.key} already selected by {scopes[key]}")
                scopes[key] = name
                default = defaults.setdefault(spec.family, (spec.paths.otherwise, name))
                if default[0] != spec.paths.otherwise:
                    raise InputError(
                        f"{where}.paths.otherwise: {spec.paths.otherwise!r}, but {default[1]} of family "
                        f"{spec.family} says {default[0]!r} (the path of every call outside the family's scopes)"
                    )
            specs[name] = spec
            origin[name] = display(path)
    return specs
