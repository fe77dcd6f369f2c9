"""The segmented-8 merge tree that every split reduction of the strict kernels shares.

A reduction split into ``SEGMENTS = 8`` ordered segments (a GEMM's reduction columns, :mod:`h3gate.kernels.gemm_merge`;
the packed rows of a row-sum, :mod:`h3gate.kernels.row_merge`) is summed as
``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``, elementwise IEEE FP32 adds. Rank r of a group of ``n`` in
``DEGREES`` owns segments ``[r * 8/n, (r + 1) * 8/n)`` and evaluates the tree's lower levels on them; after an
all-gather in rank order :func:`combine` applies the upper log2(n) levels, and :func:`finish` adds the bias (FP32) and
rounds once (RNE) to the output dtype. So every degree evaluates the same sums in the same order.
"""

from __future__ import annotations

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.kernels.common import check_tensor

SEGMENTS = 8
DEGREES = (1, 2, 4, 8)
_DTYPES = (torch.bfloat16, torch.float32)


def owned_segments(degree: int, rank: int) -> range:
    """Segments of rank ``rank`` of TP``degree``: ``[rank * 8/degree, (rank + 1) * 8/degree)``."""
    if degree not in DEGREES or not 0 <= rank < degree:
        raise InputError(f"gemm seg8: TP degree {degree} rank {rank}: degree must be one of {DEGREES}, 0 <= rank < it")
    per = SEGMENTS // degree
    return range(rank * per, (rank + 1) * per)


def combine(subtrees: list[torch.Tensor], degree: int, *, op: str = "gemm_seg8") -> torch.Tensor:
    """The tree's upper log2(degree) levels over the ranks' subtrees, gathered in rank order: FP32 sum.

    ``degree`` 1 returns the single subtree; 2: ``s0 + s1``; 4: ``(s0 + s1) + (s2 + s3)``; 8: the whole tree."""
    if degree not in DEGREES:
        raise InputError(f"{op}: degree: {degree!r}, expected one of {DEGREES}")
    if not isinstance(subtrees, list | tuple) or len(subtrees) != degree:
        got = len(subtrees) if isinstance(subtrees, list | tuple) else type(subtrees).__name__
        raise InputError(f"{op}: subtrees: {got} given, expected one per rank ({degree}) in rank order")
    first = subtrees[0]
    for i, s in enumerate(subtrees):
        check_tensor(op, f"subtrees[{i}]", s, (torch.float32,), device=first.device if i else None, contiguous=False)
        if s.shape != first.shape:
            raise InputError(f"{op}: subtrees[{i}]: shape {tuple(s.shape)} != subtrees[0] {tuple(first.shape)}")
    level = list(subtrees)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def finish(
    total: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, *, op: str = "gemm_seg8"
) -> torch.Tensor:
    """``cast(total + float(bias))``: one IEEE FP32 add (when a bias is given), one RNE rounding to ``dtype``."""
    check_tensor(op, "total", total, (torch.float32,), contiguous=False)
    if dtype not in _DTYPES:
        raise InputError(f"{op}: dtype: {dtype_name(dtype)} not supported (expected bfloat16, float32)")
    if bias is not None:
        check_tensor(op, "bias", bias, _DTYPES, ndim=1, device=total.device)
        if bias.shape[0] != total.shape[-1]:
            raise InputError(f"{op}: bias: length {bias.shape[0]} != output width {total.shape[-1]}")
        return (total + bias.float()).to(dtype)
    out = total.to(dtype)
    return out.clone() if out.data_ptr() == total.data_ptr() else out
