"""Row gathers and fixed-order segment sums: ``adaln_row_gather`` and the deterministic backward of every gather.

Forward (:func:`gather_rows`): ``out[b, n, :] = src[b, idx[n], :]`` - a copy, or one round-to-nearest-even cast when
the output dtype differs (``.to(dtype)`` semantics), bitwise equal to ``index_select``. No arithmetic, no reduction.

Backward (:func:`segment_sum`): the gradient a gather sends back to its source is a segment sum,
``out[b, j, :] = sum over rows r with seg[r] == j of contrib(b, r)``, where ``contrib = a[r]`` or ``a[r] * c[r]``
(one float32 product). PyTorch accumulates it with atomics (``index_add``: order set by the scheduler); here the
order is fixed by the index values alone:

1. rows are sorted stably by segment (``torch.sort(stable=True)``: ascending ``r`` inside each segment);
2. each segment is cut into chunks of ``CHUNK = 256`` consecutive sorted rows; stage 1 walks a chunk in sub-tiles
   of ``SUB = 32`` consecutive sorted rows in ascending order, combines each sub-tile by one ``tl.sum`` tree over its
   32 rows (fixed shape; rows past the chunk's end add exact zeros) and adds it to a float32 partial;
3. stage 2 sums a segment's partials sequentially in ascending chunk order, then casts once to the output dtype.

Accumulator float32; no atomics; nothing depends on launch geometry, SM count or the other segments. Segments no
row maps to are +0.0 (as ``index_add`` into zeros).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from h3gate.kernels import exact
from h3gate.kernels.common import (
    INTERPRET,
    ROW_SCALE,
    STRICT_LAUNCH,
    cached,
    check_indices,
    check_table,
    next_pow2,
)

CHUNK = 256
SUB = 32  # rows per sub-tile of a chunk
SEGMENTS_PER_PROGRAM = 32 if INTERPRET else 1  # the segment reduce (interpreted: fewer, larger programs)
_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _gather_kernel(
    src_ptr, idx_ptr, out_ptr, N, C, src_bs, src_rs, out_bs, out_rs,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, CAST: tl.constexpr, SUM1: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    rmask = rows < N
    src_rows = tl.load(idx_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    m = rmask[:, None] & (cols < C)[None, :]
    ml = m & (src_rows >= 0)[:, None]  # source row -1: nothing to read, the output is +0.0
    v = tl.load(src_ptr + b * src_bs + src_rows[:, None] * src_rs + cols[None, :], mask=ml, other=0.0)
    if SUM1:  # a one-term float32 sum (0.0 + v), as a segment sum or index_add into zeros computes it
        v = exact.rne(0.0 + exact.f32(v, INTERPRET), out_ptr.dtype.element_ty, INTERPRET)
    elif CAST:
        v = exact.rne(exact.f32(v, INTERPRET), out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + b * out_bs + rows.to(tl.int64)[:, None] * out_rs + cols[None, :], v, mask=m)


def gather_rows(
    src: torch.Tensor, idx: torch.Tensor, out_dtype: torch.dtype | None = None, sum1: bool = False
) -> torch.Tensor:
    """(B, S, C) or (S, C) rows (inner dim contiguous, rows may be strided) -> same rank with N = len(idx) rows.

    ``idx[n] == -1`` writes +0.0; ``sum1`` computes ``0.0 + v`` in float32 (a one-term segment sum)."""
    squeeze = src.ndim == 2
    s3 = src.unsqueeze(0) if squeeze else src
    nb, _, c = s3.shape
    n = idx.shape[0]
    out_dtype = out_dtype or src.dtype
    out = torch.empty((nb, n, c), dtype=out_dtype, device=src.device)
    block_c = min(next_pow2(c), 1024)
    block_n = max(1, min(16, 2048 // block_c)) * ROW_SCALE
    grid = (triton.cdiv(n, block_n), triton.cdiv(c, block_c), nb)
    _gather_kernel[grid](
        s3, idx, out, n, c, s3.stride(0), s3.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=block_n, BLOCK_C=block_c, CAST=out_dtype != src.dtype, SUM1=sum1, INTERPRET=INTERPRET, num_warps=4,
        **STRICT_LAUNCH,
    )  # fmt: skip
    return out[0] if squeeze else out


@triton.jit
def _segment_partial_kernel(
    a_ptr, c_ptr, order_ptr, cstart_ptr, cend_ptr, part_ptr, H, a_bs, a_rs, c_bs, c_rs, part_bs, n_sub,
    SUB: tl.constexpr, BLOCK_H: tl.constexpr, PRODUCT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    cm = cols < H
    start = tl.load(cstart_ptr + k)
    end = tl.load(cend_ptr + k)
    acc = exact.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(0, n_sub):  # n_sub = sub-tiles in the longest chunk; shorter chunks add exact zeros
        p = start + i * SUB + tl.arange(0, SUB)
        valid = p < end
        r = tl.load(order_ptr + p, mask=valid, other=0).to(tl.int64)
        m = valid[:, None] & cm[None, :]
        v = exact.f32(tl.load(a_ptr + b * a_bs + r[:, None] * a_rs + cols[None, :], mask=m, other=0.0), INTERPRET)
        if PRODUCT:
            cv = tl.load(c_ptr + b * c_bs + r[:, None] * c_rs + cols[None, :], mask=m, other=0.0)
            v = v * exact.f32(cv, INTERPRET)
        acc = acc + tl.sum(v, axis=0)
    tl.store(part_ptr + b * part_bs + k.to(tl.int64) * H + cols, acc, mask=cm)


@triton.jit
def _segment_reduce_kernel(
    part_ptr, seg_cstart_ptr, out_ptr, H, num_segments, max_chunks, part_bs, out_bs, out_rs,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[b, j] = the chunk partials of segment j added in ascending chunk order from 0.0, for BLOCK_S segments and
    BLOCK_H columns a program (each element its own sequential sum: the tile shape is not arithmetic)."""
    segs = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    sm = segs < num_segments
    cm = cols < H
    first = tl.load(seg_cstart_ptr + segs, mask=sm, other=0)
    last = tl.load(seg_cstart_ptr + segs + 1, mask=sm, other=0)
    acc = exact.zeros([BLOCK_S, BLOCK_H], dtype=tl.float32)
    for i in range(0, max_chunks):
        k = first + i
        live = (k < last)[:, None] & cm[None, :]
        v = tl.load(part_ptr + b * part_bs + k.to(tl.int64)[:, None] * H + cols[None, :], mask=live, other=0.0)
        acc = tl.where(live, acc + v, acc)
    out = exact.rne(acc, out_ptr.dtype.element_ty, INTERPRET)
    rows = segs.to(tl.int64)[:, None] * out_rs
    tl.store(out_ptr + b * out_bs + rows + cols[None, :], out, mask=sm[:, None] & cm[None, :])


@dataclass(frozen=True)
class SegmentPlan:
    """Sorted rows cut into chunks: the whole summation order of one segment sum."""

    order: torch.Tensor  # (M,) rows sorted stably by segment
    chunk_start: torch.Tensor  # (K,) positions into ``order``
    chunk_end: torch.Tensor  # (K,)
    seg_chunk_start: torch.Tensor  # (num_segments + 1,) first chunk of each segment
    num_chunks: int
    max_chunks: int
    num_segments: int
    max_len: int  # longest chunk, <= CHUNK


def segment_plan(seg: torch.Tensor, num_segments: int) -> SegmentPlan:
    """Plan the fixed-order sum of rows grouped by ``seg`` (int64, values in [0, num_segments))."""
    dev = seg.device
    sorted_seg, order = torch.sort(seg, stable=True)
    bounds = torch.searchsorted(sorted_seg, torch.arange(num_segments + 1, device=dev, dtype=seg.dtype))
    counts = bounds[1:] - bounds[:-1]
    nch = (counts + CHUNK - 1) // CHUNK
    seg_cstart = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(nch, 0)])
    total = int(seg_cstart[-1])
    chunk_seg = torch.repeat_interleave(torch.arange(num_segments, device=dev), nch, output_size=total)
    local = torch.arange(total, device=dev) - seg_cstart[chunk_seg]
    start = bounds[chunk_seg] + local * CHUNK
    end = torch.minimum(start + CHUNK, bounds[chunk_seg + 1])
    max_len = int(torch.clamp(counts, max=CHUNK).max())
    return SegmentPlan(order, start, end, seg_cstart, total, int(nch.max()), num_segments, max_len)


def segment_sum(
    a: torch.Tensor,
    plan: SegmentPlan,
    out_dtype: torch.dtype,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, M, H) contributions ``a`` (times ``c`` when given), summed per segment -> (B, num_segments, H)."""
    nb, _, h = a.shape
    block_h = min(next_pow2(h), 128 * ROW_SCALE)  # a column's sum is its own: it does not depend on its neighbours
    part = torch.empty((nb, max(plan.num_chunks, 1), h), dtype=torch.float32, device=a.device)
    cc = a if c is None else c
    if plan.num_chunks:
        _segment_partial_kernel[(plan.num_chunks, triton.cdiv(h, block_h), nb)](
            a, cc, plan.order, plan.chunk_start, plan.chunk_end, part, h,
            a.stride(0), a.stride(1), cc.stride(0), cc.stride(1), part.stride(0), triton.cdiv(plan.max_len, SUB),
            SUB=SUB, BLOCK_H=block_h, PRODUCT=c is not None, INTERPRET=INTERPRET, num_warps=4, **STRICT_LAUNCH,
        )  # fmt: skip
    out = torch.empty((nb, plan.num_segments, h), dtype=out_dtype, device=a.device)
    block_s = min(next_pow2(plan.num_segments), SEGMENTS_PER_PROGRAM)
    _segment_reduce_kernel[(triton.cdiv(plan.num_segments, block_s), triton.cdiv(h, block_h), nb)](
        part, plan.seg_chunk_start, out, h, plan.num_segments, plan.max_chunks, part.stride(0), out.stride(0),
        out.stride(1), BLOCK_S=block_s, BLOCK_H=block_h, INTERPRET=INTERPRET, num_warps=4, **STRICT_LAUNCH,
    )  # fmt: skip
    return out


@functools.lru_cache(maxsize=256)
def _rows_plan(m: int, device: torch.device) -> SegmentPlan:
    """The one-segment plan of :func:`sum_rows` over ``m`` rows (index tensors built once per (m, device))."""
    return SegmentPlan(
        order=torch.arange(m, device=device),
        chunk_start=torch.arange(0, m, CHUNK, device=device),
        chunk_end=torch.clamp(torch.arange(CHUNK, m + CHUNK, CHUNK, device=device), max=m),
        seg_chunk_start=torch.tensor([0, triton.cdiv(m, CHUNK)], device=device),
        num_chunks=triton.cdiv(m, CHUNK),
        max_chunks=triton.cdiv(m, CHUNK),
        num_segments=1,
        max_len=min(m, CHUNK),
    )


def sum_rows(a: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(M, H) float32 partials summed sequentially in ascending row order -> (H,) ``out_dtype`` (one segment)."""
    return segment_sum(a.unsqueeze(0), _rows_plan(a.shape[0], a.device), out_dtype)[0, 0]


def table_grad(
    contrib: torch.Tensor, idx: torch.Tensor, rows: int, dtype: torch.dtype, other: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of a (rows, H) table gathered by ``idx`` (S,) into (..., S, H) outputs: a fixed-order segment sum
    over every output row, batch items included (row ``b * S + s`` reads table row ``idx[s]``)."""
    h = contrib.shape[-1]
    a = contrib.reshape(1, -1, h)
    reps = a.shape[1] // idx.shape[0]
    plan = cached("table-plan", (idx,), (reps, rows), lambda: segment_plan(idx.repeat(reps), rows))
    return segment_sum(a, plan, dtype, None if other is None else other.reshape(1, -1, h))[0]


class _AdalnRowGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table: torch.Tensor, adaln_indices: torch.Tensor) -> torch.Tensor:
        ctx.idx = adaln_indices  # the same object, so the cached segment plan is found again
        ctx.rows, ctx.dtype = table.shape[0], table.dtype
        return gather_rows(table, adaln_indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return table_grad(grad.contiguous(), ctx.idx, ctx.rows, ctx.dtype), None


def adaln_row_gather(table: torch.Tensor, adaln_indices: torch.Tensor) -> torch.Tensor:
    """(3T, H) table (rows may be strided, e.g. a chunk of the AdaLN projection), (S,) int64 -> (S, H) copy.

    Backward: fixed-order float32 segment sum of the output gradient into the table rows (module docstring)."""
    op = "adaln_row_gather"
    check_table(op, "table", table, _DTYPES, None, getattr(table, "device", None))
    check_indices(op, "adaln_indices", adaln_indices, None, table.shape[0], table.device)
    return _AdalnRowGather.apply(table, adaln_indices)
