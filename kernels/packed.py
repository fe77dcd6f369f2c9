"""Packed-sequence rows: ``packed_index_copy`` (zero init + text/video/audio scatter) and ``packed_index_select``.

``packed_index_copy``: the provider zero-fills (B, S, H) at text's dtype and runs three ``index_copy`` calls. Here
the scatter is inverted into a gather: a row map ``kind[p] in {-1, 0 text, 1 video, 2 audio}``, ``src[p]`` (built with
unique indices, so it is exact) and one program per (row block, column block, batch item) that copies row ``p`` from
its source, cast once (round-to-nearest-even, ``.to(text.dtype)``) or writes +0.0. Strict inputs are a partition:
a row named twice (inside one index tensor or across two) is an input error, since the provider's result then
depends on write order. Bitwise equal to the provider. Backward: gathers (``grad[:, idx]`` cast back to each
source's dtype) - no accumulation, so also bitwise.

``packed_index_select``: ``out[b, n] = x[b, idx[n]]`` (a gather, bitwise). Backward: ``index_add`` in the provider
(atomics on CUDA); here a fixed-order float32 segment sum per batch item (``gather.segment_sum``: output positions
sorted stably by source row, 256-position chunks of 32-position sub-tiles, chunks in ascending order), cast once;
duplicate indices allowed. When no index repeats, every segment has at most one term and the same sum (``0.0 + g``,
or +0.0) is computed by an inverse-index gather (no sort, one pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.errors import InputError
from h3gate.kernels import exact
from h3gate.kernels.common import (
    INTERPRET,
    ROW_SCALE,
    STRICT_LAUNCH,
    cached,
    check_indices,
    check_tensor,
    needs_graph,
    next_pow2,
)
from h3gate.kernels.gather import gather_rows, segment_plan, segment_sum

_DTYPES = (torch.float32, torch.bfloat16)
_COPY = "packed_index_copy"
_SELECT = "packed_index_select"


@triton.jit
def _scatter_kernel(
    t_ptr, v_ptr, a_ptr, kind_ptr, src_ptr, out_ptr, S, H, t_bs, v_bs, a_bs,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    rm = rows < S
    cm = (cols < H)[None, :]
    kind = tl.load(kind_ptr + rows, mask=rm, other=-1)[:, None]
    src = tl.load(src_ptr + rows, mask=rm, other=0).to(tl.int64)[:, None] * H + cols[None, :]
    tv = exact.f32(tl.load(t_ptr + b * t_bs + src, mask=cm & (kind == 0), other=0.0), INTERPRET)
    vv = exact.f32(tl.load(v_ptr + b * v_bs + src, mask=cm & (kind == 1), other=0.0), INTERPRET)
    av = exact.f32(tl.load(a_ptr + b * a_bs + src, mask=cm & (kind == 2), other=0.0), INTERPRET)
    val = tl.where(kind == 0, tv, tl.where(kind == 1, vv, tl.where(kind == 2, av, 0.0)))
    out_offs = b * S * H + rows[:, None] * H + cols[None, :]
    tl.store(out_ptr + out_offs, exact.rne(val, DT, INTERPRET), mask=rm[:, None] & cm)


class _IndexCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, text, video, audio, ti, vi, ai, kind, src):
        nb, h = text.shape[0], text.shape[-1]
        s = kind.shape[0]
        out = torch.empty((nb, s, h), dtype=text.dtype, device=text.device)
        block_h = min(next_pow2(h), 1024)
        block_m = max(1, 2048 // block_h) * ROW_SCALE
        grid = (triton.cdiv(s, block_m), triton.cdiv(h, block_h), nb)
        _scatter_kernel[grid](
            text, video, audio, kind, src, out, s, h, text.stride(0), video.stride(0), audio.stride(0),
            BLOCK_M=block_m, BLOCK_H=block_h, INTERPRET=INTERPRET, num_warps=4, **STRICT_LAUNCH,
        )  # fmt: skip
        ctx.save_for_backward(ti, vi, ai)
        ctx.dtypes = (text.dtype, video.dtype, audio.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous()
        grads = [
            gather_rows(g, idx, dt) if need else None
            for idx, dt, need in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3], strict=True)
        ]
        return (*grads, None, None, None, None, None)


def packed_index_copy(text, video, audio, text_indices, video_indices, audio_indices, seq_len: int) -> torch.Tensor:
    """(B, Nt, H) text, (B, Nv, H) video, (B, Na, H) audio -> (B, seq_len, H) at text's dtype; other rows +0.0."""
    check_tensor(_COPY, "text", text, _DTYPES, ndim=3)
    dev = text.device
    for name, t in (("video", video), ("audio", audio)):
        check_tensor(_COPY, name, t, _DTYPES, ndim=3, device=dev)
        if t.shape[0] != text.shape[0] or t.shape[2] != text.shape[2]:
            raise InputError(
                f"{_COPY}: {name}: shape {tuple(t.shape)} does not match text (B, *, H) {tuple(text.shape)}"
            )
    if not isinstance(seq_len, int) or seq_len < 1:
        raise InputError(f"{_COPY}: seq_len: must be a positive integer, got {seq_len!r}")
    named = (("text_indices", text_indices, text), ("video_indices", video_indices, video))
    named += (("audio_indices", audio_indices, audio),)
    for name, idx, t in named:
        check_indices(_COPY, name, idx, t.shape[1], seq_len, dev)
    indices = (text_indices, video_indices, audio_indices)
    kind, src = cached("packed-row-map", indices, (seq_len,), lambda: _row_map(named, seq_len, dev))
    return _IndexCopy.apply(text, video, audio, text_indices, video_indices, audio_indices, kind, src)


def _row_map(named: tuple, seq_len: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """kind[p] (-1 none, 0 text, 1 video, 2 audio) and src[p] (row in that source); a row named twice is refused."""
    kind = torch.full((seq_len,), -1, dtype=torch.int32, device=dev)
    src = torch.zeros(seq_len, dtype=torch.int64, device=dev)
    seen = torch.zeros(seq_len, dtype=torch.int64, device=dev)
    for code, (name, idx, _) in enumerate(named):
        seen += torch.bincount(idx, minlength=seq_len)
        dup = torch.nonzero(seen > 1)
        if dup.numel():
            raise InputError(f"{_COPY}: {name}: row {int(dup[0, 0])} written twice (strict inputs are a partition)")
        kind[idx] = code
        src[idx] = torch.arange(idx.shape[0], device=dev)
    return kind, src


class _IndexSelect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices):
        ctx.idx = indices  # kept as the same object so cached backward facts (inverse map, plan) are found again
        ctx.rows, ctx.dtype = x.shape[1], x.dtype
        return gather_rows(x, indices)

    @staticmethod
    def backward(ctx, grad):
        idx = ctx.idx
        g = grad.contiguous()
        inverse = cached("select-inverse", (idx,), (ctx.rows,), lambda: _inverse(idx, ctx.rows))
        if inverse is not None:  # every segment has at most one term
            return gather_rows(g, inverse, ctx.dtype, sum1=True), None
        plan = cached("select-plan", (idx,), (ctx.rows,), lambda: segment_plan(idx, ctx.rows))
        return segment_sum(g, plan, ctx.dtype), None


def _inverse(idx: torch.Tensor, rows: int) -> torch.Tensor | None:
    """inverse[s] = n with idx[n] == s (-1 where none), or None when an index repeats."""
    if int(torch.bincount(idx, minlength=rows).max()) > 1:
        return None
    inverse = torch.full((rows,), -1, dtype=torch.int64, device=idx.device)
    inverse[idx] = torch.arange(idx.shape[0], device=idx.device)
    return inverse


def packed_index_select(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, S, C) -> (B, N, C): rows ``indices`` of every batch item (duplicates allowed).

    Without an autograd graph to build (grad mode off, or ``x`` not requiring grad) the gather is launched directly,
    skipping ``autograd.Function.apply``: the same launch (``gather_rows``) and bytes, less host time."""
    check_tensor(_SELECT, "x", x, _DTYPES, ndim=3)
    check_indices(_SELECT, "indices", indices, None, x.shape[1], x.device)
    if needs_graph(x):
        return _IndexSelect.apply(x, indices)
    return gather_rows(x, indices)
