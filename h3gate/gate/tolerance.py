"""Evaluate error bounds of a tolerance profile (``h3gate.manifests.tolerances``) against measured errors.

Bounds are relative to the provider's own error against the golden:

* node / gradient: ``candidate[metric] <= factor * provider[metric] + floor``;
* BF16 leaf gradient, alternatively: ``candidate.max_abs <= provider.max_abs + n * ulp_bf16(max |golden|)`` with
  ``ulp_bf16(m) = 2 ** (floor(log2 m) - 7)`` (BF16 keeps 8 significant bits).

A missing (non-finite) error never passes.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

BF16_MANTISSA_BITS = 7


def bf16_ulp(magnitude: float) -> float:
    """Spacing of BF16 numbers at ``magnitude`` (0 for 0 or non-finite magnitudes)."""
    if not math.isfinite(magnitude) or magnitude <= 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(magnitude)) - BF16_MANTISSA_BITS)


def error_check(candidate: dict, provider: dict, metric: str, factor: float, floor: float) -> dict:
    """``{"metric", "candidate", "provider", "bound", "pass"}``: candidate <= factor * provider + floor."""
    c, p = candidate.get(metric), provider.get(metric)
    limit = None if p is None else factor * p + floor
    ok = c is not None and limit is not None and c <= limit
    return {"metric": metric, "candidate": c, "provider": p, "bound": limit, "pass": bool(ok)}


def leaf_check(
    candidate: dict,
    provider: dict,
    golden_max_abs: float,
    is_bf16: bool,
    metric: str,
    factor: float,
    floor: float,
    ulps: int,
) -> dict:
    """A leaf gradient passes by the factor bound, or (BF16 leaf, ``ulps`` > 0) by the ulp allowance."""
    rec = error_check(candidate, provider, metric, factor, floor)
    rec["passed_by"] = "factor" if rec["pass"] else None
    rec["ulp_bound"] = None
    if is_bf16 and ulps > 0:
        c, p = candidate.get("max_abs"), provider.get("max_abs")
        ulp_limit = None if p is None else p + ulps * bf16_ulp(golden_max_abs)
        rec["ulp_bound"] = ulp_limit
        if not rec["pass"] and c is not None and ulp_limit is not None and c <= ulp_limit:
            rec["pass"] = True
            rec["passed_by"] = "ulp"
    return rec


@dataclass(frozen=True)
class IsolatedPromise:
    """Whether a node's isolated-bitwise promise applies: ``listed`` in the profile (``isolated_bitwise``, or
    ``isolated_bitwise_on`` for this device kind: ``on_device``), and ``applies``."""

    listed: bool
    on_device: bool
    applies: bool


def isolated_promise(forward, device: str, node: str, provider_bitwise: bool, single_forward: bool) -> IsolatedPromise:
    """The one decision of both gates. Profile entries are fnmatch patterns over node names (``block.*.norm1``). A
    plain entry applies where every kernel's contract declares ``provider_bitwise``; a device-kind entry, measured
    for the single walk, applies whatever the contracts say while each op's forward is its single-walk kernel's
    (``single_forward``: no merge twin that changes the forward's order)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    on_device = any(fnmatch.fnmatchcase(node, p) for p in forward.isolated_bitwise_on.get(kind, []))
    listed = on_device or any(fnmatch.fnmatchcase(node, p) for p in forward.isolated_bitwise)
    return IsolatedPromise(listed, on_device, (on_device and single_forward) or (listed and provider_bitwise))
