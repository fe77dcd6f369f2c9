"""Row-resolved acceptance: every packed row of every tensor against a bound calibrated from provider variants.

A whole-tensor error dilutes one bad row by ``sqrt(rows)``; this rule judges each row on its own.

* Row error (float64): ``e_r = ||c_r - g_r||_2 / ||g_r||_2`` over the row's elements (the slice along the
  tensor's row axis, every other axis flattened); a row whose golden is all zero has ``e_r = 0`` when the
  candidate's row is zero too and ``inf`` otherwise. Non-finite candidate values give ``inf``.
* Envelope: ``E_r = max_v e_r(provider variant v)`` over the provider variants that ran (the default provider
  included), then widened over the rule's scope: ``row`` keeps ``E_r``; ``modality`` takes the max over the rows of
  the same modality (text / video / audio; rows without a modality form one group); ``tensor`` the max over all.
* Bound: ``B_r = factor * E_r + floor_ulps * ulp(dtype)``, ``ulp`` being the spacing of the tensor's dtype at 1.0
  (bf16 ``2^-7``, fp32 ``2^-23``). A row passes when ``e_r <= B_r``; the record names the worst row by
  ``e_r / B_r``, and the first row over its bound.
* Calibration spread (from provider variants only): for each variant, its row errors against the envelope of the
  *other* variants (leave-one-out), worst ratio over rows. A ``factor`` above the spread leaves room for a sound
  candidate that differs from the provider the way the provider's own variants differ from each other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence

import torch

from h3gate.kernels.row_error import row_error_norms

ULP_AT_ONE: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**-7,
    torch.float16: 2.0**-10,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
}
GROUP_NAMES = ("text", "video", "audio")


# Rows are upcast to float64 at most this many elements at a time: a released-width value at S = 83386 holds up to
# 2.4e9 elements, whose float64 copy and difference would need 38 GB beside the values the gate holds.
CHUNK_ELEMENTS = 1 << 26


def _row_major(t: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """``t`` with its row axis first (a view; no row axis and fewer than 2 dims: one row, the whole tensor)."""
    t = t.detach()
    if row_dim is None:
        row_dim = 0 if t.ndim >= 2 else None
    return t.reshape(1, -1) if row_dim is None else t.movedim(row_dim, 0)


def as_rows(t: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """(R, -1) float64 view of ``t``: rows along ``row_dim`` (batch folded away: it must be 1); 0-d / 1-d / no row
    axis -> rows along dim 0 for 2-d+ tensors, one row otherwise."""
    rows = _row_major(t, row_dim)
    return rows.reshape(rows.shape[0], -1).to(torch.float64)


def row_chunks(rows: int, width: int) -> list[tuple[int, int]]:
    """``[r0, r1)`` row ranges of at most :data:`CHUNK_ELEMENTS` elements (one range for a small tensor)."""
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)] or [(0, 0)]


def row_errors(candidate: torch.Tensor, golden: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """Per-row relative L2 error of ``candidate`` against ``golden`` (float64, on the CPU); see the module doc.

    The norms: on a GPU one pass of :mod:`h3gate.kernels.row_error` (each element widened to float64 once, its
    fixed reduction order) for rows of up to 2^16 elements, otherwise torch's float64 norms over rows upcast in
    chunks of whole rows (:func:`row_chunks`: the float64 working set stays at two chunks)."""
    if candidate.shape != golden.shape:
        raise ValueError(f"shape mismatch {tuple(candidate.shape)} vs {tuple(golden.shape)}")
    c = _row_major(candidate, row_dim)
    g = _row_major(golden.to(candidate.device), row_dim)
    width = c[0].numel() if c.shape[0] else 0
    parts = []
    for r0, r1 in row_chunks(c.shape[0], width):
        num, den, finite = row_error_norms(c[r0:r1].reshape(r1 - r0, -1), g[r0:r1].reshape(r1 - r0, -1))
        err = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), torch.where(num > 0, math.inf, 0.0))
        err = torch.where(finite, err, math.inf)
        parts.append(torch.where(torch.isnan(err), math.inf, err).cpu())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def group_ids(rows: int, modalities: Sequence[str] | None, scope: str) -> torch.Tensor:
    """Group index per row for an envelope scope: one group per row, per modality, or one for the tensor (a shared
    tensor, memoised: read it, never write it)."""
    by_modality = scope == "modality" and modalities is not None and len(modalities) == rows
    return _group_ids(rows, tuple(modalities) if by_modality else None, "modality" if by_modality else scope)


@functools.lru_cache(maxsize=32)
def _group_ids(rows: int, modalities: tuple[str, ...] | None, scope: str) -> torch.Tensor:
    if scope == "row":
        return torch.arange(rows)
    if modalities is None:
        return torch.zeros(rows, dtype=torch.long)
    names = {m: i for i, m in enumerate(GROUP_NAMES)}
    return torch.tensor([names.get(m, len(names)) for m in modalities], dtype=torch.long)


def group_max(errors: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``(..., G)``: per group, the max of ``errors`` (``(..., R)``) over the group's rows (-inf for no rows)."""
    lead = errors.shape[:-1]
    top = torch.full((*lead, int(groups.max()) + 1), -math.inf, dtype=errors.dtype)
    return top.scatter_reduce(-1, groups.expand(*lead, -1), errors, reduce="amax")


def widen(errors: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each row's value replaced by the max over its group."""
    return group_max(errors, groups)[..., groups]


def envelope(variants: Sequence[torch.Tensor], groups: torch.Tensor) -> torch.Tensor:
    """``max_v e_r(v)`` widened over the scope's groups."""
    return widen(torch.stack(list(variants)).amax(dim=0), groups)


def dtype_floor(dtype: torch.dtype, floor_ulps: float) -> float:
    return floor_ulps * ULP_AT_ONE.get(dtype, 0.0)


def _row_name(row: int | None, modalities: Sequence[str] | None) -> str:
    if row is None:
        return "-"
    mod = modalities[row] if modalities is not None and row < len(modalities) else None
    return f"row {row}" + (f" {mod}" if mod else "")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def row_bounds(envelope_rows: torch.Tensor, factor: float, floor: float, at_least: float = 0.0) -> torch.Tensor:
    """``B_r = max(factor * E_r + floor, at_least)`` for every row."""
    return (factor * envelope_rows + floor).clamp(min=at_least)


def row_check(
    errors: torch.Tensor,
    envelope_rows: torch.Tensor,
    factor: float,
    floor: float,
    modalities: Sequence[str] | None,
    at_least: float = 0.0,
) -> dict:
    """The ``row_check`` evidence record: worst row by error / bound, first row over, count over, pass. ``at_least``
    raises every row's bound to a declared accuracy (ws1-ops: the operator contract's rel_l2 bound, per row)."""
    bound = row_bounds(envelope_rows, factor, floor, at_least)
    ratio = torch.where(bound > 0, errors / torch.where(bound > 0, bound, 1.0), torch.where(errors > 0, math.inf, 0.0))
    over = torch.nonzero(~(errors <= bound)).flatten()
    worst = int(torch.argmax(torch.where(torch.isnan(ratio), math.inf, ratio)))
    first = int(over[0]) if over.numel() else None
    mods = modalities if modalities is not None and len(modalities) == errors.numel() else None
    return {
        "rows": int(errors.numel()),
        "worst_row": worst,
        "worst_modality": None if mods is None else mods[worst],
        "error": _finite(float(errors[worst])),
        "bound": _finite(float(bound[worst])),
        "ratio": _finite(float(ratio[worst])),
        "rows_over": int(over.numel()),
        "first_over_row": first,
        "first_over_modality": None if mods is None or first is None else mods[first],
        "pass": over.numel() == 0,
    }


def describe(check: dict, modalities: Sequence[str] | None = None) -> str:
    """One line for a failing-check detail: where, error, bound."""
    row = check["first_over_row"] if check["first_over_row"] is not None else check["worst_row"]
    mods = modalities if modalities is not None and len(modalities) == check["rows"] else None
    err, bound = check["error"], check["bound"]
    return (
        f"{_row_name(row, mods)}: {check['rows_over']} of {check['rows']} rows over the row bound; worst "
        f"{_row_name(check['worst_row'], mods)} {_num(err)} > {_num(bound)}"
    )


def _num(x: float | None) -> str:
    return "inf" if x is None else f"{x:.3e}"


def spread(variants: Mapping[str, torch.Tensor], groups: torch.Tensor) -> dict[str, float | None]:
    """Leave-one-out calibration: per variant, ``max_r e_r(v) / E_r(other variants)`` (None without others).

    All variants at once: each variant's per-group max, then the max over the other variants as the larger of the
    running maxima before and after it (max is exact, so this is :func:`envelope` of the others, value for value)."""
    names = list(variants)
    if len(names) < 2:
        return dict.fromkeys(names)
    errs = torch.stack([variants[n] for n in names])
    per_group = group_max(errs, groups)
    before = torch.full_like(per_group, -math.inf)
    after = torch.full_like(per_group, -math.inf)
    before[1:] = per_group[:-1].cummax(dim=0).values
    after[:-1] = per_group.flip(0)[:-1].cummax(dim=0).values.flip(0)
    env = torch.maximum(before, after)[:, groups]
    ratio = torch.where(env > 0, errs / torch.where(env > 0, env, 1.0), torch.where(errs > 0, math.inf, 1.0))
    return {n: _finite(v) for n, v in zip(names, ratio.amax(dim=1).tolist(), strict=True)}


def rule_sha256(rule: Mapping) -> str:
    """sha256 of the rule's canonical JSON (sorted keys, no whitespace): hashed into every gate's evidence."""
    text = json.dumps(rule, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
