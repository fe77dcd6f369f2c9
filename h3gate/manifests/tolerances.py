"""Tolerance profiles (``manifests/tolerances/*.yaml``): what a gate promises, committed before results are seen.

A profile says which nodes promise isolated bitwise equality with the provider, how far a candidate's error against
the golden may exceed the provider's own (``factor * provider + floor``), the BF16 ulp allowance for leaf gradients,
and keeps a ``history`` of every change of a bound and why (a bound is never loosened silently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, field_validator

from h3gate.manifests.loader import load_yaml, resolve
from h3gate.manifests.model_config import Strict
from h3gate.paths import MANIFESTS

TOLERANCES = MANIFESTS / "tolerances"
Metric = Literal["rel_l2", "max_abs"]
# Provider variants a row rule may name (run by ``h3gate.gate.variants``).
CPU_VARIANTS = ("threads-1", "mkldnn-off")
CUDA_VARIANTS = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math", "blas-cublas", "blas-cublaslt")
PROVIDER_VARIANTS = ("default", *CPU_VARIANTS, *CUDA_VARIANTS)


class ForwardBounds(Strict):
    """Per forward node: repeat and batch-row bitwise, promised isolated bitwise, and an error bound vs golden."""

    repeat_bitwise: bool = True
    batch_row_bitwise: bool = True
    # Nodes promising bitwise equality with the provider on the provider's own inputs. A promise applies only when
    # every op of the node runs the reference or a kernel whose contract declares provider_bitwise: true.
    isolated_bitwise: list[str] = []
    # Per device kind (cpu / cuda): nodes promising isolated bitwise equality there whatever their kernel's
    # contract says (e.g. the GEMMs, bitwise with cuBLAS on the H200 as measured by ws1-ops).
    isolated_bitwise_on: dict[Literal["cpu", "cuda"], list[str]] = {}
    error_metric: Metric = "rel_l2"
    error_factor: PositiveFloat
    error_floor: NonNegativeFloat


class BackwardBounds(Strict):
    """Gradients: repeat and batch-row bitwise, leaf and node-gradient error bounds vs golden."""

    repeat_bitwise: bool = True
    batch_row_bitwise: bool = True
    # The forward under autograd (training) equals the forward under no_grad (rollout), node by node.
    autograd_forward_bitwise: bool = True
    error_metric: Metric = "rel_l2"
    leaf_factor: PositiveFloat
    leaf_floor: NonNegativeFloat
    # A BF16 leaf also passes when candidate max_abs <= provider max_abs + N BF16 ulps at max |golden|.
    bf16_ulp_allowance: NonNegativeInt = 0
    node_factor: PositiveFloat
    node_floor: NonNegativeFloat


class RowRule(Strict):
    """Row-resolved acceptance (``h3gate.gate.rows``): each packed row's error against the golden is at most
    ``factor`` x the provider-variant envelope over ``scope`` + ``floor_ulps`` ulps of the tensor's dtype at 1.0."""

    metric: Literal["row_rel_l2"] = "row_rel_l2"
    scope: Literal["row", "modality", "tensor"]
    factor: PositiveFloat
    floor_ulps: NonNegativeFloat
    # Provider variants run to build the envelope (``h3gate.gate.variants``); those a device cannot run are skipped
    # and reported. ``default`` always runs.
    variants: list[str] = Field(min_length=1)
    calibration: str = Field(min_length=1)
    # Dtypes whose row bound is raised to the operator contract's declared rel_l2 (``run ws1-ops``'s rule): where
    # the provider variants do not span the rounding noise of that dtype, a factor over their envelope is not
    # calibrated. Empty (the default) for profiles that do not say it.
    contract_floor: list[Literal["float32", "float64"]] = []

    @field_validator("variants")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in PROVIDER_VARIANTS]
        if unknown:
            raise ValueError(f"unknown provider variant {unknown[0]!r} (known: {', '.join(PROVIDER_VARIANTS)})")
        return names


class HistoryEntry(Strict):
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    change: str = Field(min_length=1)
    reason: str = Field(min_length=1)


class ToleranceProfile(Strict):
    name: str
    description: str
    forward: ForwardBounds
    backward: BackwardBounds
    row_rule: RowRule
    history: list[HistoryEntry] = Field(min_length=1)


def tolerance_path(name_or_path: str | Path) -> Path:
    """``manifests/tolerances/NAME.yaml`` or a YAML path; unknown names list the known profiles."""
    return resolve(name_or_path, TOLERANCES, "tolerance profile")


def load_tolerance(name_or_path: str | Path) -> ToleranceProfile:
    """A named tolerance profile or a YAML path, validated with ``file: dotted.path: message`` breadcrumbs."""
    return load_yaml(tolerance_path(name_or_path), ToleranceProfile)


def tolerance_names() -> list[str]:
    return sorted(p.stem for p in TOLERANCES.glob("*.yaml"))
