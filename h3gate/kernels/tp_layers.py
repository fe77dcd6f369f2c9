"""Tensor-parallel strict layers: one autograd mechanism for TP1 (one device) and every TPn rank (n in 1, 2, 4, 8).

The merge order of every reduction that TP splits is the segmented-8 order of :mod:`h3gate.kernels.gemm_merge`
(segments fixed by the FULL layer, a fixed FP32 tree, one rounding). A layer here takes a :class:`MergeGroup`: its
degree n, the rank r and ``gather`` (every rank's FP32 subtree in rank order). TP1 is ``MergeGroup(1, 0, [t])``:
the same functions, no communication, which is what the one-device ``*_seg8`` operators run. Contract per layer:

* :class:`ColumnLinear` (Q/K/V, FFN gate/up; weight rows = the rank's output columns) - forward: the single-walk
  kernel on the rank's rows with the full layer's tiling ``gemm_config("fwd", N, K, dtype, M)`` (an element's K walk
  never depends on the slice). dX: reduction over N, which TP splits: the rank's segmented-8 subtree of
  ``dY[:, N_r] @ W[N_r, :]`` (its owned segments), gathered, the tree's upper levels, one rounding. ``halves``
  (gate/up, fused (2F, K) weight owned as chunk pairs): each half is its own (F, K) segmented-8 reduction and
  ``dX = rne(T_value + T_gate)`` (one FP32 add of the two trees). dW = dY^T @ X as the single walk (over M, unsplit).
* :class:`RowLinear` (attention O, FFN down; weight columns = the rank's K) - forward: the rank's subtree over its
  K segments, gathered, upper levels, one rounding: every rank holds the full Y. dX (its K columns): the full
  segmented-8 walk over N (unsplit), one rounding. dW (its columns) = dY^T @ X_r as the single walk.
* :class:`QkNormGrouped` (per-head RMSNorm over D) - rows and their dX are per head (unsplit). Its weight gradient
  sums over every (row, head): the heads are cut into 8 groups ``[g_i, g_i+1)``, ``g_i = min(i * ceil(nh / 8), nh)``;
  group i's FP32 partial is the norm kernel's own row order over the rows ``(b, s, h in group i)`` (ascending,
  ``gather.sum_rows`` of its program partials, FP32); the 8 partials take the same fixed tree, then one rounding.

TPn ranks own segments / head groups ``[r * 8/n, (r + 1) * 8/n)``; :func:`check_alignment` proves that the heads and
FFN channels a rank owns are exactly its segments (otherwise TPn is refused for that config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.kernels.common import needs_graph
from h3gate.kernels.gather import sum_rows
from h3gate.kernels.gemm import _check as check_linear
from h3gate.kernels.gemm import _forward as single_walk
from h3gate.kernels.gemm import matmul
from h3gate.kernels.gemm_configs import gemm_config
from h3gate.kernels.gemm_merge import SEGMENTS, combine, finish, owned_segments, rank_slice, segment_partials
from h3gate.kernels.norms import HEAD_DIM, check_qk, qk_rmsnorm, rms_backward, rms_forward

KERNEL_ID = "triton:h3gate.tp_layers_seg8:v1"

Gather = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class MergeGroup:
    """Who shares a split reduction: TP degree, this rank, and the all-gather of FP32 subtrees (rank order)."""

    degree: int
    rank: int
    gather: Gather

    @property
    def owned(self) -> range:
        return owned_segments(self.degree, self.rank)

    def merge(self, subtree: torch.Tensor) -> torch.Tensor:
        """The tree's upper log2(degree) levels over every rank's subtree: the full FP32 sum, on every rank."""
        return subtree if self.degree == 1 else combine(self.gather(subtree.contiguous()), self.degree)


ONE_DEVICE = MergeGroup(1, 0, lambda t: [t])


def head_groups(heads: int) -> tuple[int, ...]:
    """The 9 head-group boundaries ``min(i * ceil(nh / 8), nh)`` of the QK-norm weight gradient."""
    per = -(-heads // SEGMENTS)
    return tuple(min(i * per, heads) for i in range(SEGMENTS + 1))


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


def _dw(g2: torch.Tensor, x2: torch.Tensor, out_shape: tuple[int, int], full: tuple[int, int], dtype) -> torch.Tensor:
    """dW (or the rank's slice of it) = dY^T @ X, the single walk over M with the full layer's dW tiling."""
    dw = torch.empty(out_shape, dtype=dtype, device=g2.device)
    matmul(g2, x2, dw, None, gemm_config("dw", full[0], full[1], dtype), a_trans=True, b_trans=False)
    return dw


def _column_dx(g2: torch.Tensor, w: torch.Tensor, full: tuple[int, int], halves: bool, group: MergeGroup):
    """The column-parallel dX FP32 sum (before the rounding), merged over the group."""
    if not halves:
        return group.merge(segment_partials(g2, w, group.owned, full, "dx", op="tp column dX"))
    f_loc, half = w.shape[0] // 2, (full[0] // 2, full[1])
    value, gate = (
        group.merge(segment_partials(g2[:, s].contiguous(), w[s], group.owned, half, "dx", op="tp gate/up dX"))
        for s in (slice(0, f_loc), slice(f_loc, 2 * f_loc))
    )
    return value + gate


class ColumnLinear(torch.autograd.Function):
    """``x (..., K) @ w_local (N_r, K)^T`` -> (..., N_r) on a column-parallel layer of full weight ``full`` (N, K)."""

    @staticmethod
    def forward(ctx, x, w, full: tuple[int, int], halves: bool, group: MergeGroup):
        ctx.save_for_backward(x, w)
        ctx.full, ctx.halves, ctx.group = full, halves, group
        return _column_forward(x, w, full)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, w.shape[0]).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = finish(_column_dx(g2, w, ctx.full, ctx.halves, ctx.group), None, x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _dw(g2, x.reshape(-1, x.shape[-1]), tuple(w.shape), ctx.full, w.dtype)
        return dx, dw, None, None, None


def _column_forward(x: torch.Tensor, w: torch.Tensor, full: tuple[int, int]) -> torch.Tensor:
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
        ctx.full, ctx.group = full, group
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
            dw = _dw(g2, x.reshape(-1, x.shape[-1]), tuple(w.shape), ctx.full, w.dtype)
        return dx, dw, None, None


# ----------------------------------------------------------------------------------------------------- QK norm


class QkNormGrouped(torch.autograd.Function):
    """Per-head RMSNorm of ``x (B, S, h_r * 128)`` -> (B, S, h_r, 128); the weight gradient in head-group order.

    ``first_head`` is the rank's first head in the full layer of ``heads`` heads."""

    @staticmethod
    def forward(ctx, x, weight, heads: int, first_head: int, eps: float, group: MergeGroup):
        xv = x.view(*x.shape[:-1], -1, HEAD_DIM)
        out, rstd = rms_forward(xv, weight, None, None, None, eps, any(ctx.needs_input_grad[:2]))
        ctx.save_for_backward(xv, weight, rstd)
        ctx.heads, ctx.first, ctx.group = heads, first_head, group
        return out

    @staticmethod
    def backward(ctx, grad):
        xv, weight, rstd = ctx.saved_tensors
        g = grad.contiguous()
        local = xv.shape[-2]
        rstd = rstd.view(*xv.shape[:-1])
        bounds = head_groups(ctx.heads)
        dx = torch.empty_like(xv)
        partials = []
        for i in ctx.group.owned:
            lo, hi = bounds[i] - ctx.first, bounds[i + 1] - ctx.first
            if hi <= lo:
                partials.append(torch.zeros(HEAD_DIM, dtype=torch.float32, device=xv.device))
                continue
            if not 0 <= lo < hi <= local:
                raise InputError(f"h3_qk_rmsnorm_d128_seg8: head group {i} is not on this rank's {local} heads")
            part = (t[..., lo:hi, :].contiguous() for t in (xv, g))
            dxi, dwp, _ = rms_backward(next(part), weight, rstd[..., lo:hi].contiguous(), next(part))
            dx[..., lo:hi, :] = dxi
            partials.append(sum_rows(dwp, torch.float32))
        level = partials
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


h3_qkv_gemm_seg8 = _column_op("h3_qkv_gemm_seg8", halves=False)
h3_ffn_gate_up_gemm_seg8 = _column_op("h3_ffn_gate_up_gemm_seg8", halves=True)


def h3_qk_rmsnorm_d128_seg8(x: torch.Tensor, weight: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """``h3_qk_rmsnorm_d128_seg8``: the QK norm's rows unchanged, its weight gradient in head-group order."""
    check_qk("h3_qk_rmsnorm_d128_seg8", x, weight, heads, eps)
    if not needs_graph(x, weight):
        return qk_rmsnorm(x, weight, heads, eps)
    return QkNormGrouped.apply(x, weight, heads, 0, float(eps), ONE_DEVICE)
