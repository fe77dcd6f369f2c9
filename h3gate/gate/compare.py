"""How two tensors agree: bitwise, else the first differing packed row (and its modality), max |a - b|, relative L2.

* ``bitwise`` means identical dtype, shape and bytes (so ``-0.0`` vs ``+0.0`` and NaN payloads count as differences).
* A packed row ``r`` differs when any element whose index along ``row_dim`` is ``r`` differs bitwise (over every
  batch item, head and channel). ``first_row`` is the smallest such ``r``; ``rows_differing`` counts them.
* ``max_abs = max |a - b|`` and ``rel_l2 = ||a - b||_2 / ||b||_2`` are computed in float64 (``b`` is the reference);
  a non-finite value, or ``rel_l2`` against an all-zero reference with a nonzero difference, is recorded as ``null``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from h3gate.gate.rows import CHUNK_ELEMENTS
from h3gate.hashing import tensor_sha256  # noqa: F401  (re-exported: reports hash through the gate)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as an integer tensor of the same shape (for exact comparisons)."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape and the same bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(bits(a), bits(b.to(a.device))))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def error(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    """``{"max_abs", "rel_l2"}`` of ``candidate`` against ``reference`` (any dtypes), in float64.

    Large tensors are upcast :data:`h3gate.gate.rows.CHUNK_ELEMENTS` elements at a time (the norms are then the
    square roots of summed chunk squares, which may differ from one reduction in the last float64 bits)."""
    if candidate.shape != reference.shape:
        raise ValueError(f"shape mismatch {tuple(candidate.shape)} vs {tuple(reference.shape)}")
    c_all = candidate.detach().reshape(-1)
    r_all = reference.detach().to(device=c_all.device).reshape(-1)
    if c_all.numel() == 0:
        return {"max_abs": 0.0, "rel_l2": 0.0}
    if c_all.numel() <= CHUNK_ELEMENTS:
        c, r = c_all.to(torch.float64), r_all.to(torch.float64)
        diff = c - r
        max_abs = float(diff.abs().max())
        num, den = float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(r))
    else:
        maxima, num2, den2 = [], 0.0, 0.0
        for i in range(0, c_all.numel(), CHUNK_ELEMENTS):
            c = c_all[i : i + CHUNK_ELEMENTS].to(torch.float64)
            r = r_all[i : i + CHUNK_ELEMENTS].to(torch.float64)
            diff = c - r
            maxima.append(float(diff.abs().max()))
            num2 += float(torch.linalg.vector_norm(diff)) ** 2
            den2 += float(torch.linalg.vector_norm(r)) ** 2
        max_abs = float(torch.tensor(maxima, dtype=torch.float64).max())  # NaN stays NaN (Python max drops it)
        num, den = math.sqrt(num2), math.sqrt(den2)
    max_abs = _finite(max_abs)
    if den > 0:
        rel = _finite(num / den)
    else:
        rel = 0.0 if num == 0 else None
    return {"max_abs": max_abs, "rel_l2": rel}


def differing_rows(a: torch.Tensor, b: torch.Tensor, row_dim: int | None) -> torch.Tensor | None:
    """Sorted int64 indices of the rows (along ``row_dim``) holding any bitwise difference; None without rows."""
    if row_dim is None or a.ndim == 0:
        return None
    d = bits(a) != bits(b.to(a.device))
    d = d.movedim(row_dim, 0).reshape(d.shape[row_dim], -1).any(dim=1)
    return torch.nonzero(d).flatten().cpu()


def agreement(
    a: torch.Tensor,
    b: torch.Tensor,
    row_dim: int | None = 1,
    modalities: Sequence[str] | None = None,
) -> dict:
    """The ``common.schema.json#/$defs/agreement`` record of ``a`` against reference ``b``.

    ``modalities[r]`` names packed row ``r`` (text / video / audio) for ``first_modality``.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        err = error(a, b) if a.shape == b.shape else {"max_abs": None, "rel_l2": None}
        return {"bitwise": False, "first_row": None, "first_modality": None, "rows_differing": None, **err}
    if bitwise_equal(a, b):
        return {
            "bitwise": True,
            "first_row": None,
            "first_modality": None,
            "max_abs": 0.0,
            "rel_l2": 0.0,
            "rows_differing": 0,
        }
    rows = differing_rows(a, b, row_dim)
    first = int(rows[0]) if rows is not None and rows.numel() else None
    modality = modalities[first] if first is not None and modalities is not None else None
    return {
        "bitwise": False,
        "first_row": first,
        "first_modality": modality,
        "rows_differing": None if rows is None else int(rows.numel()),
        **error(a, b),
    }
