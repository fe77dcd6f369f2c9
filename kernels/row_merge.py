"""The row-segment merge order: sums over packed rows that context parallelism splits (issue 18, WS2).

Every gradient that is a sum over packed rows - a GEMM's dW (and db), an RMSNorm's weight gradient, the AdaLN
tables' gradients (the row gather's backward), the QK norm's weight gradient - is split when CP shards the rows.
This fixes one order that every CP degree in {1, 2, 4, 8} evaluates, and that the one-device ``*_seg8`` operators
(the WS2 reference) evaluate too:

* segments - the S packed rows (dim -2 of an activation; batch items fold into every segment) are cut into
  ``SEGMENTS = 8`` contiguous segments ``[r_i, r_i+1)``, ``r_i = min(i * L, S)``, ``L = ceil(S / 8)``: a function of
  S alone, never of the CP degree. The last segment may be short; trailing ones are empty only when S is tiny
  (e.g. S = 17: L = 3, segments 6 and 7 empty). CP``n`` rank c holds segments ``[c * 8/n, (c + 1) * 8/n)``, i.e.
  the rows ``[r_{c 8/n}, r_{(c+1) 8/n})`` (:func:`cp_row_bounds`): shards of any S, never split inside a segment.
* per segment - the operator's own single-device reduction run on the segment's rows alone (its kernels, tilings
  and chunk order unchanged, the rows of the segment b-major), kept in FP32, unrounded; an empty segment is +0.
* tree - ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``, elementwise IEEE FP32 adds; a rank evaluates the
  levels over its own segments, an all-gather in rank order (:class:`RowGroup`) and the upper log2(n) levels
  (:func:`h3gate.kernels.merge_tree.combine`) finish it on every rank; then one RNE rounding to the gradient's dtype.

So CP1 = CP2 = CP4 = CP8 byte for byte: the same segments over the same rows, each partial from the same values
by the same kernel, the same tree. Not bitwise the single-walk operators' gradients (another FP32 order).

A GEMM's weight gradient (dW and db) is split by CP alone (TP splits its output, never its rows; under SP the
GEMMs' inputs are gathered to the CP rows), and CP goes to 4: its rows are cut into ``DW_SEGMENTS = 4`` segments,
the pairs of the 8 (``[r_{2j}, r_{2j+2})``, :func:`dw_bounds`), summed as ``(q0 + q1) + (q2 + q3)``. CP``n`` rank c
owns pair segments ``[c * 4/n, (c + 1) * 4/n)``, the same rows as above; CP8 would split a pair and is refused
(:meth:`RowGroup.dw_owned`). Half the segments halve the restarts and the pending subtrees of the fused dW kernels.

The active group is a context (:func:`packed_rows`), read by the operators at FORWARD time and kept for their
backward (autograd may run the backward on another thread): outside any context a ``*_seg8`` operator uses the
one-device group of its own rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.kernels.merge_tree import SEGMENTS, combine, owned_segments

DW_SEGMENTS = 4  # a GEMM weight gradient's row segments: the pairs of the 8 (module docstring)

Gather = Callable[[torch.Tensor], list[torch.Tensor]]
Partial = Callable[[int, int], Sequence[torch.Tensor]]


@functools.lru_cache(maxsize=256)
def row_bounds(seq_len: int) -> tuple[int, ...]:
    """The 9 segment boundaries ``r_i = min(i * L, S)``, ``L = ceil(S / 8)``, of S packed rows (module docstring);
    memoised: a block's backward asks for them thousands of times."""
    length = -(-seq_len // SEGMENTS)
    return tuple(min(i * length, seq_len) for i in range(SEGMENTS + 1))


def dw_bounds(seq_len: int) -> tuple[int, ...]:
    """The 5 boundaries ``r_0, r_2, r_4, r_6, r_8`` of a GEMM weight gradient's ``DW_SEGMENTS`` row segments (the pairs
    of :func:`row_bounds`' 8; module docstring): ``min(j * 2L, S)``."""
    return row_bounds(seq_len)[:: SEGMENTS // DW_SEGMENTS]


def cp_row_bounds(seq_len: int, degree: int) -> tuple[int, ...]:
    """The ``degree + 1`` row boundaries of the CP shards: rank c holds its segments' rows."""
    bounds = row_bounds(seq_len)
    return tuple(bounds[owned_segments(degree, c).start] for c in range(degree)) + (seq_len,)


@dataclass(frozen=True)
class RowGroup:
    """Who shares the packed rows of a row-sum: CP degree, this rank, the GLOBAL row count and the all-gather of FP32
    subtrees (rank order)."""

    degree: int
    rank: int
    seq_len: int
    gather: Gather

    @property
    def bounds(self) -> tuple[int, ...]:
        return row_bounds(self.seq_len)

    @property
    def owned(self) -> range:
        return owned_segments(self.degree, self.rank)

    @property
    def lo(self) -> int:
        return self.bounds[self.owned.start]

    @property
    def hi(self) -> int:
        return self.bounds[self.owned.stop]

    @property
    def dw_owned(self) -> range:
        """The pair segments (of :func:`dw_bounds`' 4) this rank owns for a GEMM weight gradient: the pairs of its
        :attr:`owned` row segments, refused where those are not whole pairs (CP8)."""
        pair, owned = SEGMENTS // DW_SEGMENTS, self.owned
        if len(owned) % pair:
            raise InputError(
                f"gemm weight gradient: CP degree {self.degree} splits a row segment pair (the order has "
                f"{DW_SEGMENTS} row segments); supported CP degrees: up to {DW_SEGMENTS}"
            )
        return range(owned.start // pair, owned.stop // pair)

    def merge(self, subtree: torch.Tensor) -> torch.Tensor:
        return subtree if self.degree == 1 else combine(self.gather(subtree.contiguous()), self.degree, op="row seg8")


def one_device(seq_len: int) -> RowGroup:
    return RowGroup(1, 0, seq_len, lambda t: [t])


_ACTIVE: ContextVar[RowGroup | None] = ContextVar("h3gate_row_group", default=None)


@contextmanager
def packed_rows(group: RowGroup) -> Iterator[RowGroup]:
    """Within the block, ``*_seg8`` operators treat their rows as ``group``'s shard of the packed sequence."""
    token = _ACTIVE.set(group)
    try:
        yield group
    finally:
        _ACTIVE.reset(token)


def rows_for(op: str, local_rows: int) -> RowGroup:
    """The group an operator's row-sums use for an input of ``local_rows`` packed rows (checked against the shard)."""
    group = _ACTIVE.get()
    if group is None:
        return one_device(local_rows)
    if group.hi - group.lo != local_rows:
        raise InputError(
            f"{op}: {local_rows} packed rows, but the active row group's rank {group.rank} holds "
            f"[{group.lo}, {group.hi}) of {group.seq_len}"
        )
    return group


def local_spans(group: RowGroup) -> list[tuple[int, int]]:
    """The LOCAL row range ``[lo, hi)`` of each segment the rank owns (empty ones too), in order."""
    bounds, owned = group.bounds, group.owned
    lo = bounds[owned.start]
    return [(bounds[i] - lo, bounds[i + 1] - lo) for i in owned]


def row_sum(
    group: RowGroup,
    partial: Partial | None,
    shapes: Sequence[tuple[int, ...]],
    device,
    stacked: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """The FP32 sums over every packed row of the tensors ``partial(lo, hi)`` returns for the LOCAL rows
    ``[lo, hi)`` of one segment (one FP32 tensor per entry of ``shapes``), then of ``stacked`` (sums whose
    per-segment partials were computed in one pass: each (owned segments, *shape) FP32): the owned segments'
    subtree, one all-gather of all of them (flattened together), the tree's upper levels. Unrounded."""
    shapes = [torch.Size(s) for s in shapes]
    if partial is None and not shapes and stacked:  # the stacked sums alone: already one row a segment
        flat = [t.reshape(t.shape[0], -1) for t in stacked]
        level = flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)
    else:
        level = _segment_rows(group, partial, shapes, device, stacked)
    total = group.merge(subtree(level))
    out, at = [], 0
    for sh in [*shapes, *(t.shape[1:] for t in stacked)]:
        out.append(total[at : at + sh.numel()].view(sh))
        at += sh.numel()
    return out


def subtree(level: torch.Tensor) -> torch.Tensor:
    """The tree over the rows of ``level`` (owned segments, width), FP32: ``(p0 + p1)``, ``(p2 + p3)``, ... then the
    same over those, until one row is left (elementwise IEEE adds, the older subtree the left operand)."""
    while level.shape[0] > 1:
        level = level[0::2] + level[1::2]
    return level[0]


def _segment_rows(group: RowGroup, partial: Partial | None, shapes: list[torch.Size], device,
                  stacked: Sequence[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """:func:`row_sum`'s (owned segments, width) FP32 rows: each segment's partials (``+0`` where empty) and its
    slices of ``stacked``, flattened into one row."""
    width = sum(s.numel() for s in shapes)
    level = []
    for k, (lo, hi) in enumerate(local_spans(group)):
        parts = partial(lo, hi) if partial is not None and hi > lo else []
        for p, sh in zip(parts, shapes, strict=True) if parts else ():
            if p.dtype != torch.float32 or p.shape != sh:
                raise ValueError(f"row seg8 partial: {p.dtype} {tuple(p.shape)}, expected float32 {tuple(sh)}")
        flat = [p.reshape(-1) for p in parts] or [torch.zeros(width, dtype=torch.float32, device=device)]
        level.append(torch.cat(flat + [t[k].reshape(-1) for t in stacked]))
    return torch.stack(level)


def seq_slice(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of dim -2 (the packed rows of a (..., S, H) activation), contiguous."""
    return t[..., lo:hi, :].contiguous()
