"""Tensor-parallel strict layers: one autograd mechanism for TP1 (one device) and every TPn rank (n in 1, 2, 4, 8).

The merge order of every reduction that TP splits is the segmented-8 order of :mod:`h3gate.kernels.gemm_merge`
(segments fixed by the FULL layer, a fixed FP32 tree, one rounding). A layer here takes a :class:`MergeGroup`: its
degree n, the rank r and ``gather`` (every rank's FP32 subtree in rank order). TP1 is ``MergeGroup(1, 0, [t])``:
the same functions, no communication, which is what the one-device ``*_seg8`` operators run. Contract per layer:

* :class:`ColumnLinear` (Q/K/V, FFN gate/up; weight rows = the rank's output columns) - forward: the single-walk
  kernel on the rank's rows with the full layer's tiling ``gemm_config("fwd", N, K, dtype, M)`` (an element's K walk
  never depends on the slice; a whole layer, TP1, by the operator's declared forward path, the same walk). dX:
  reduction over N, which TP splits: the rank's segmented-8 subtree of ``dY[:, N_r] @ W[N_r, :]`` (its owned
  segments), gathered, the tree's upper levels, one rounding. ``halves``
  (gate/up, fused (2F, K) weight owned as chunk pairs): each half is its own (F, K) segmented-8 reduction and
  ``dX = rne(T_value + T_gate)`` (one FP32 add of the two trees). dW = dY^T @ X in a weight gradient's row-segment
  order over the packed rows (4 segments: :func:`h3gate.kernels.rows_seg8.linear_row_grads`, one fused launch,
  :mod:`h3gate.kernels.rows_dw`; merged over CP, unsplit by TP).
* :class:`RowLinear` (attention O, FFN down; weight columns = the rank's K) - forward: the rank's subtree over its
  K segments, gathered, upper levels, one rounding: every rank holds the full Y. dX (its K columns): the full
  segmented-8 walk over N (unsplit), one rounding. dW (its columns) = dY^T @ X_r in the row-segment order.
* :class:`QkNormGrouped` (per-head RMSNorm over D) - rows and their dX are per head (unsplit). Its weight gradient
  sums over every (row, head): the heads are cut into 8 groups ``[g_i, g_i+1)``, ``g_i = min(i * ceil(nh / 8), nh)``;
  group i's FP32 partial is the row-segment tree (:mod:`h3gate.kernels.row_merge`) of the norm kernel's own row
  order over each segment's rows ``(b, s, h in group i)`` (``gather.sum_rows`` of its program partials, FP32); the 8
  group partials take the same fixed tree, then one rounding.

TPn ranks own segments / head groups ``[r * 8/n, (r + 1) * 8/n)``; :func:`check_alignment` proves that the heads and
FFN channels a rank owns are exactly its segments (otherwise TPn is refused for that config).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.kernels.common import needs_graph
from h3gate.kernels.gemm import check_linear, linear_grouped
from h3gate.kernels.gemm import forward as single_walk
from h3gate.kernels.gemm_configs import gemm_config
from h3gate.kernels.gemm_merge import rank_slice, segment_partials, segment_total
from h3gate.kernels.gemm_triton import matmul
from h3gate.kernels.merge_tree import SEGMENTS, combine, finish, owned_segments
from h3gate.kernels.norms import HEAD_DIM, check_qk, qk_rmsnorm, rms_backward_segments, rms_forward
from h3gate.kernels.row_merge import local_spans, row_sum, rows_for
from h3gate.kernels.rows_seg8 import linear_row_grads, linear_rows, weight_partials

KERNEL_ID = "triton:h3gate.tp_layers_seg8:v3"

Gather = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class MergeGroup:
    """Who shares a split reduction: TP degree, this rank, and the all-gather of FP32 subtrees (rank order).

    ``chunks[r]`` is the chunk (segments, heads, channels) rank r owns (None: its rank); :meth:`merge` combines the
    gathered subtrees in chunk (logical) order, or in rank order when ``rank_order`` (a negative control)."""

    degree: int
    rank: int
    gather: Gather
    chunks: tuple[int, ...] | None = None
    rank_order: bool = False

    @property
    def chunk(self) -> int:
        return self.rank if self.chunks is None else self.chunks[self.rank]

    @property
    def owned(self) -> range:
        return owned_segments(self.degree, self.chunk)

    def merge(self, subtree: torch.Tensor) -> torch.Tensor:
        """The tree's upper log2(degree) levels over every rank's subtree: the full FP32 sum, on every rank."""
        if self.degree == 1:
            return subtree
        parts = self.gather(subtree.contiguous())
        if self.chunks is not None and not self.rank_order:
            parts = [parts[self.chunks.index(c)] for c in range(self.degree)]  # the subtree of chunk 0, 1, ...
        return combine(parts, self.degree)


ONE_DEVICE = MergeGroup(1, 0, lambda t: [t])


def head_groups(heads: int) -> tuple[int, ...]:
    """The 9 head-group boundaries ``min(i * ceil(nh / 8), nh)`` of the QK-norm weight gradient."""
    per = -(-heads // SEGMENTS)
    return tuple(min(i * per, heads) for i in range(SEGMENTS + 1))


def check_tp_order(degree: int, merge: str, cfg, what: str, remedy: str) -> None:
    """TP``degree`` > 1 needs the TP-invariant merge order (``seg8``) and a config (``num_attention_heads``,
    ``attention_head_dim``, ``hidden_size``, ``ffn_dim``) whose BF16 widths fall on its segment boundaries
    (:func:`check_alignment`); ``what`` names the request, ``remedy`` the way out, in the InputError."""
    if degree == 1:
        return
    if merge != "seg8":
        raise InputError(f"{what}: merge order {merge!r} is not TP-invariant; {remedy}")
    check_alignment(degree, cfg.num_attention_heads, cfg.attention_head_dim, cfg.hidden_size, cfg.ffn_dim,
                    torch.bfloat16)  # fmt: skip


def check_alignment(degree: int, heads: int, head_dim: int, hidden: int, ffn: int, dtype: torch.dtype) -> None:
    """TP``degree`` shards heads and FFN channels contiguously in rank order; each rank's share must be exactly its
    owned segments of every split reduction (O and Q/K/V dX over nh*D, FFN down and gate/up dX over F) and its head
    groups. Raises :class:`InputError` naming the first layer that does not align."""
    if heads % degree or ffn % degree:
        raise InputError(f"TP{degree}: {heads} heads and {ffn} FFN channels must both divide by {degree}")
    nd = heads * head_dim
    layers = (
        ("attention O forward", "fwd", (hidden, nd), nd),
        ("Q/K/V dX", "dx", (nd, hidden), nd),
        ("FFN down forward", "fwd", (hidden, ffn), ffn),
        ("FFN gate/up dX (each half)", "dx", (ffn, hidden), ffn),
    )
    groups = head_groups(heads)
    for rank in range(degree):
        owned = owned_segments(degree, rank)
        for what, role, shape, width in layers:
            got = rank_slice(role, shape, dtype, degree, rank)
            want = slice(rank * width // degree, (rank + 1) * width // degree)
            if (got.start, got.stop) != (want.start, want.stop):
                raise InputError(
                    f"TP{degree} rank {rank}: {what}: its segments cover [{got.start}, {got.stop}) but the rank owns "
                    f"[{want.start}, {want.stop}); this config's widths do not fall on segment boundaries"
                )
        lo, hi = groups[owned.start] * head_dim, groups[owned.stop] * head_dim
        if (lo, hi) != (rank * nd // degree, (rank + 1) * nd // degree):
            raise InputError(f"TP{degree} rank {rank}: QK-norm head groups do not fall on the rank's heads")


# ------------------------------------------------------------------------------------------------ column-parallel


def _column_dx(g2: torch.Tensor, w: torch.Tensor, full: tuple[int, int], halves: bool, group: MergeGroup,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The column-parallel dX: the FP32 sum merged over the group, one rounding to ``dtype`` (a whole layer on one
    device: rounded in the kernel's epilogue). ``halves``: each half's sum (its columns of dY read in place), one FP32
    add, one rounding."""
    if not halves:
        if group.degree == 1 and tuple(w.shape) == tuple(full):
            return segment_total(g2, w, full, "dx", out_dtype=dtype, op="tp column dX")
        return finish(group.merge(segment_partials(g2, w, group.owned, full, "dx", op="tp column dX")), None, dtype)
    f_loc, half = w.shape[0] // 2, (full[0] // 2, full[1])
    value, gate = (
        group.merge(segment_partials(g2[:, s], w[s], group.owned, half, "dx", op="tp gate/up dX"))
        for s in (slice(0, f_loc), slice(f_loc, 2 * f_loc))
    )
    return finish(value + gate, None, dtype)


class ColumnLinear(torch.autograd.Function):
    """``x (..., K) @ w_local (N_r, K)^T`` -> (..., N_r) on a column-parallel layer of full weight ``full`` (N, K)."""

    @staticmethod
    def forward(ctx, x, w, full: tuple[int, int], halves: bool, group: MergeGroup):
        ctx.save_for_backward(x, w)
        ctx.full, ctx.halves, ctx.group, ctx.rows = full, halves, group, linear_rows("tp column", x)
        return _column_forward(x, w, full)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, w.shape[0]).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _column_dx(g2, w, ctx.full, ctx.halves, ctx.group, x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = linear_row_grads(gy, x, tuple(w.shape), ctx.full, ctx.rows, False)[0]
        return dx, dw, None, None, None


def _column_forward(x: torch.Tensor, w: torch.Tensor, full: tuple[int, int]) -> torch.Tensor:
    """The single walk with the full layer's tiling: a layer whole here (one device) by the operator's declared
    forward path (:func:`h3gate.kernels.gemm.forward`, the Gluon kernel on Hopper), a rank's rows of W by the Triton
    kernel; the same K walk, so the same bytes."""
    if tuple(w.shape) == tuple(full):
        return single_walk(x, w, None)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    cfg = gemm_config("fwd", full[0], full[1], x.dtype, x2.shape[0])
    matmul(x2, w, y, None, cfg, a_trans=False, b_trans=True)
    return y.view(*x.shape[:-1], w.shape[0])


# --------------------------------------------------------------------------------------------------- row-parallel


class RowLinear(torch.autograd.Function):
    """``x_local (..., K_r) @ w_local (N, K_r)^T`` merged over the group -> the full (..., N) on every rank."""

    @staticmethod
    def forward(ctx, x, w, full: tuple[int, int], group: MergeGroup):
        ctx.save_for_backward(x, w)
        ctx.full, ctx.group, ctx.rows = full, group, linear_rows("tp row", x)
        sub = segment_partials(x, w, group.owned, full, "fwd", op="tp row forward")
        return finish(group.merge(sub), None, x.dtype).view(*x.shape[:-1], full[0])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, ctx.full[0]).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            sub = segment_partials(g2, w, range(SEGMENTS), ctx.full, "dx", op="tp row dX")
            dx = finish(sub, None, x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = linear_row_grads(gy, x, tuple(w.shape), ctx.full, ctx.rows, False)[0]
        return dx, dw, None, None


# ----------------------------------------------------------------------------------------------------- QK norm


class QkNormGrouped(torch.autograd.Function):
    """Per-head RMSNorm of ``x (B, S, h_r * 128)`` -> (B, S, h_r, 128); the weight gradient in (head group, row
    segment) order: per head group the row-segment tree (:mod:`h3gate.kernels.row_merge`, merged over CP), then the
    head-group tree (merged over TP), one rounding.

    ``first_head`` is the rank's first head in the full layer of ``heads`` heads."""

    @staticmethod
    def forward(ctx, x, weight, heads: int, first_head: int, eps: float, group: MergeGroup):
        xv = x.view(*x.shape[:-1], -1, HEAD_DIM)
        out, rstd = rms_forward(xv, weight, None, None, None, eps, any(ctx.needs_input_grad[:2]))
        ctx.save_for_backward(xv, weight, rstd)
        ctx.heads, ctx.first, ctx.group = heads, first_head, group
        ctx.rows = rows_for("h3_qk_rmsnorm_d128_seg8", x.shape[-2])
        return out

    @staticmethod
    def backward(ctx, grad):
        xv, weight, rstd = ctx.saved_tensors
        g = grad.contiguous()
        bounds, local = head_groups(ctx.heads), xv.shape[-2]
        spans = [(bounds[i] - ctx.first, bounds[i + 1] - ctx.first) for i in ctx.group.owned]
        for i, (lo, hi) in zip(ctx.group.owned, spans, strict=True):
            if hi > lo and not 0 <= lo < hi <= local:
                raise InputError(f"h3_qk_rmsnorm_d128_seg8: head group {i} is not on this rank's {local} heads")
        # one launch: segment (group i, row segment k) = the rows (b, s in k, h in i), group-major
        row_spans = local_spans(ctx.rows)
        segments = [(r0, r1 - r0, lo, max(hi - lo, 0)) for lo, hi in spans for r0, r1 in row_spans]
        dx, dwp, _, firsts = rms_backward_segments(xv, weight, rstd, g, None, None, segments, heads=True)
        parts = weight_partials(dwp, firsts).view(len(spans), len(row_spans), HEAD_DIM)
        level = list(row_sum(ctx.rows, None, [], xv.device, [parts.transpose(0, 1)])[0].unbind(0))
        while len(level) > 1:
            level = [level[j] + level[j + 1] for j in range(0, len(level), 2)]
        dweight = finish(ctx.group.merge(level[0]), None, weight.dtype)
        return dx.view(*grad.shape[:-2], -1), dweight, None, None, None, None


# ------------------------------------------------------------------------------------ the one-device (TP1) operators


def _column_op(op: str, halves: bool):
    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        check_linear(op, x, weight, bias)
        if bias is not None:
            raise InputError(f"{op}: bias: the block's column-parallel layers have none")
        if halves and weight.shape[0] % 2:
            raise InputError(f"{op}: weight: {weight.shape[0]} rows, expected an even (value | gate) fused width")
        if needs_graph(x, weight):
            return ColumnLinear.apply(x, weight, tuple(weight.shape), halves, ONE_DEVICE)
        return single_walk(x, weight, None)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"``{op}``: the single-walk forward, its dX in the segmented-8 order (module docstring)."
    return fn


def _column_grouped(op: str, fn: Callable) -> Callable:
    """``grouped(x, weights)`` of a column twin (q, k, v: :func:`h3gate.graph.execute.sibling_gemms`): without an
    autograd graph one grouped launch of the single walk (:func:`h3gate.kernels.gemm.linear_grouped`: bitwise the
    calls one by one), else the twin a weight at a time (its dX in the segmented-8 order)."""

    def grouped(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if needs_graph(x, *weights):
            return [fn(x, w) for w in weights]
        return linear_grouped(x, weights, op=op)

    return grouped


h3_qkv_gemm_seg8 = _column_op("h3_qkv_gemm_seg8", halves=False)
h3_qkv_gemm_seg8.grouped = _column_grouped("h3_qkv_gemm_seg8", h3_qkv_gemm_seg8)
h3_ffn_gate_up_gemm_seg8 = _column_op("h3_ffn_gate_up_gemm_seg8", halves=True)


def h3_qk_rmsnorm_d128_seg8(x: torch.Tensor, weight: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """``h3_qk_rmsnorm_d128_seg8``: the QK norm's rows unchanged, its weight gradient in head-group order."""
    check_qk("h3_qk_rmsnorm_d128_seg8", x, weight, heads, eps)
    if not needs_graph(x, weight):
        return qk_rmsnorm(x, weight, heads, eps)
    return QkNormGrouped.apply(x, weight, heads, 0, float(eps), ONE_DEVICE)
