"""Row-segment (CP-ready) twins of the row operators, and the GEMM weight gradients in the row-segment order.

The forward of every operator here is its single-device operator's, launch for launch (the same bytes); only the
gradients that sum over packed rows change order: they follow :mod:`h3gate.kernels.row_merge` (8 row segments
fixed by S, 4 for a GEMM's weight gradient, each the operator's own reduction on that segment's rows at FP32, the
fixed tree, one rounding).

* :func:`linear_row_grads` - dW = dY^T X (and db = sum dY) over a weight gradient's 4 row segments (the pairs of
  the 8: :func:`~h3gate.kernels.row_merge.dw_bounds`; only CP splits them, CP <= 4): every segment's partial and
  the tree ``(q0 + q1) + (q2 + q3)`` inside one program per dW tile (:mod:`h3gate.kernels.rows_dw`: per segment the
  single-walk dW kernel's walk with the FULL layer's BLOCK_K, ``gemm_config("dw", N, K, dtype)``; db per segment the
  colsum kernel's walk), one launch each, rounded in the epilogue on one device; no partial buffers.
* ``h3_rmsnorm_modulate_seg8`` / ``final_adaln_out_seg8`` - dx per row exactly ``h3_rmsnorm_modulate``'s (every
  row's dx is its own); per segment the weight partial (the kernel's 32-row program partials, programs starting at
  the segment's first row, by ``gather.sum_rows``' order at FP32) and the shift / scale table partials
  (``gather.table_grad`` of the segment's rows at FP32); the three trees, one rounding each. One backward launch for
  every segment (:func:`h3gate.kernels.norms.rms_backward_segments`) and one segment sum of all weight partials
  (:func:`weight_partials`); v1 launched the norm's backward once per segment: the same bytes.
* ``adaln_gate_residual_seg8`` - forward and dy as ``adaln_gate_residual``; the gate table's gradient per segment
  (``table_grad(g, idx, other=y)`` at FP32), the tree, one rounding.
"""

from __future__ import annotations

import functools

import torch

from h3gate.kernels import selection
from h3gate.kernels.common import INTERPRET, aligned, cached, num_sms
from h3gate.kernels.elementwise import _GateResidual, check_gate_residual, gate_launch
from h3gate.kernels.gather import segment_plan, segment_sum
from h3gate.kernels.gemm_configs import PRODUCTION, GemmLaunch
from h3gate.kernels.gemm_gluon_rows_dw import ROWS_DW_GLUON, rows_dw_ws
from h3gate.kernels.merge_tree import finish
from h3gate.kernels.norms import check_modulate, rms_backward, rms_backward_segments, rms_forward
from h3gate.kernels.row_merge import RowGroup, local_spans, row_sum, rows_for
from h3gate.kernels.rows_dw import fused_dw_config, rows_colsum, rows_dw

KERNEL_ID = "triton:h3gate.rows_seg8:v2"
F32 = torch.float32
TRITON_DW, GLUON_DW = "triton_rows_dw", "gluon_warp_specialised_rows_dw"  # the weight gradient's kernel paths


def linear_rows(op: str, x: torch.Tensor) -> RowGroup:
    """The row group a linear layer's weight gradient uses for input ``x`` (read at forward time)."""
    return rows_for(op, x.shape[-2] if x.ndim >= 2 else 1)


def dw_path(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, rows: RowGroup,
            full: tuple[int, int], launch: GemmLaunch = PRODUCTION) -> str:  # fmt: skip
    """The weight gradient's kernel for dY (B, S, N) and X (B, S, K) (``shape`` = (B, S, N, K)) of a slice of the
    ``full`` layer: ``GLUON_DW`` (:mod:`h3gate.kernels.gemm_gluon_rows_dw`) where ``launch.rows_dw_gluon`` on a Hopper
    GPU (never interpreted) for the one-device dW (all 4 segments, rounded once) of one batch item in bfloat16, the
    full layer's dW BLOCK_K the Gluon tiling's (the same chunks) and N, K multiples of 8 (TMA rows, and every
    segment's first row 16-byte aligned); else ``TRITON_DW`` (:func:`h3gate.kernels.rows_dw.rows_dw`)."""
    batch, seq, n, k = shape
    fits = rows.degree == 1 and batch == 1 and seq > 0 and dtype == torch.bfloat16 and n % 8 == 0 and k % 8 == 0
    if not (launch.rows_dw_gluon and fits) or fused_dw_config(full, dtype).block_k != ROWS_DW_GLUON.block_k:
        return TRITON_DW
    return GLUON_DW if selection.device_class(device) == "cuda-sm90" else TRITON_DW


def dw_record(x: torch.Tensor, full: tuple[int, int], rows: RowGroup, launch: GemmLaunch = PRODUCTION) -> dict:
    """The launch record of the one-device weight gradient of ``x (..., S, K) @ w (N, K)^T`` (``full`` = (N, K)):
    :func:`dw_path`'s kernel, its tiling and whether TMA loads it (the Gluon kernel; ``rows_dw``'s TMA walk where
    ``launch.rows_dw_tma`` on CUDA for one batch item of 8-multiple widths)."""
    (n, k), x3 = full, (x.reshape(1, -1) if x.ndim == 1 else x)
    shape = (x3.shape[:-2].numel(), x3.shape[-2], n, k)
    path = dw_path(shape, x.dtype, x.device, rows, full, launch)
    if path == GLUON_DW:
        return {"tiling": ROWS_DW_GLUON.tag, "tma": True, "kernel": path}
    tma = launch.rows_dw_tma and shape[0] == 1 and not (n % 8 or k % 8) and x.is_cuda and not INTERPRET
    return {"tiling": fused_dw_config(full, x.dtype).tag, "tma": tma, "kernel": path}


def linear_row_grads(
    gy: torch.Tensor,
    x: torch.Tensor,
    w_shape: tuple[int, int],
    full: tuple[int, int],
    rows: RowGroup,
    bias: bool,
    launch: GemmLaunch = PRODUCTION,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dW, db) of ``y = x @ w^T [+ b]`` (``w`` of shape ``w_shape``, a slice of the full ``full`` (N, K) layer) in
    the row-segment order, rounded once to x's dtype; ``gy`` (..., S, N_local), ``x`` (..., S, K_local). One launch
    for dW (:func:`dw_path`'s kernel) and one for db (:mod:`h3gate.kernels.rows_dw`); under CP the FP32 subtrees
    are merged over the group (one all-gather of both) and rounded after."""
    x = x.reshape(1, -1) if x.ndim == 1 else x
    n_loc, k_loc, s_loc, batch = gy.shape[-1], x.shape[-1], x.shape[-2], x.shape[:-2].numel()
    g3 = gy.reshape(batch, s_loc, n_loc).contiguous()
    x3 = x.reshape(batch, s_loc, k_loc).contiguous()
    if (n_loc, k_loc) != tuple(w_shape):
        raise ValueError(f"linear_row_grads: dY/X widths {(n_loc, k_loc)} != weight shape {tuple(w_shape)}")
    out = x.dtype if rows.degree == 1 else None
    if dw_path((batch, s_loc, n_loc, k_loc), x.dtype, x.device, rows, full, launch) == GLUON_DW:
        dw = torch.empty((n_loc, k_loc), dtype=x.dtype, device=x.device)
        rows_dw_ws(aligned(g3[0]), aligned(x3[0]), dw, num_sms(x.device))
    else:
        dw = rows_dw(g3, x3, rows, fused_dw_config(full, x.dtype), out, launch)
    db = rows_colsum(g3, rows, out) if bias else None
    if out is not None:
        return dw, db
    total = rows.merge(torch.cat([dw.reshape(-1)] + ([db] if bias else [])))
    dw = finish(total[: dw.numel()].view(dw.shape), None, x.dtype)
    return dw, (finish(total[dw.numel() :], None, x.dtype) if bias else None)


def table_partials(g, idx, rows: int, spans, other=None) -> torch.Tensor:
    """Every segment's table gradient at once: (segments, rows, H) FP32, segment k's slice the fixed-order segment
    sum of ``g`` (times ``other``) over its rows ``spans[k]`` by table row. One plan keyed ``k * rows + idx[s]``:
    rows sorted stably by key keep, within a (segment, table row) pair, exactly the order ``gather.table_grad`` walks
    on that segment's rows alone (ascending, batch-major; 256-row chunks), so the bytes are that per-segment sum's."""
    h = g.shape[-1]
    a = g.reshape(1, -1, h)
    reps = a.shape[1] // idx.shape[0]

    def plan():
        seg = torch.empty_like(idx)
        for k, (lo, hi) in enumerate(spans):
            seg[lo:hi] = k
        return segment_plan((seg * rows + idx).repeat(reps), len(spans) * rows)

    p = cached("row-table-plan", (idx,), (reps, rows, tuple(spans)), plan)
    out = segment_sum(a, p, F32, None if other is None else other.reshape(1, -1, h))
    return out[0].view(len(spans), rows, h)


@functools.lru_cache(maxsize=64)
def _weight_plan(firsts: tuple[int, ...], device: torch.device):
    """The plan of :func:`weight_partials`: partial row r belongs to the segment k with ``firsts[k] <= r <
    firsts[k + 1]``."""
    counts = torch.tensor([b - a for a, b in zip(firsts, firsts[1:], strict=False)])
    return segment_plan(torch.repeat_interleave(torch.arange(len(counts)), counts).to(device), len(counts))


def weight_partials(dwp: torch.Tensor, firsts: tuple[int, ...]) -> torch.Tensor:
    """(segments, H) FP32: segment k's program partials (rows ``[firsts[k], firsts[k + 1])`` of ``dwp``) summed in
    ``gather.sum_rows``' order, all segments in one plan keyed by segment (each key's 256-row chunks start at its own
    first row, as ``sum_rows`` of that segment's partials alone; a segment without partials is +0)."""
    return segment_sum(dwp.unsqueeze(0), _weight_plan(tuple(firsts), dwp.device), F32)[0]


class _RmsNormRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, shift, scale, idx, eps, op):
        out, rstd = rms_forward(x, weight, shift, scale, idx, eps, any(ctx.needs_input_grad[:4]))
        ctx.save_for_backward(x, weight, rstd, scale)
        ctx.idx, ctx.rows = idx, rows_for(op, x.shape[-2])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, scale = ctx.saved_tensors
        idx, g = ctx.idx, grad.contiguous()
        need_w, need_shift, need_scale = ctx.needs_input_grad[1:4]
        if not (need_w or need_shift or need_scale):
            return rms_backward(x, weight, rstd, g, scale, idx)[0], None, None, None, None, None, None
        spans = local_spans(ctx.rows)
        segments = [(lo, hi - lo, 0, 1) for lo, hi in spans]
        dx, dwp, n, firsts = rms_backward_segments(x, weight, rstd, g, scale, idx, segments, need_scale)
        stacked = [weight_partials(dwp, firsts)] if need_w else []
        if need_shift:
            stacked.append(table_partials(g, idx, scale.shape[0], spans))
        if need_scale:
            stacked.append(table_partials(g, idx, scale.shape[0], spans, other=n))
        sums = iter(row_sum(ctx.rows, None, [], x.device, stacked))
        dweight, dshift, dscale = (finish(next(sums), None, x.dtype) if need else None
                                   for need in (need_w, need_shift, need_scale))  # fmt: skip
        return dx, dweight, dshift, dscale, None, None, None


def _modulate_seg8(op: str, index_arg: str):
    def fn(x, weight, shift, scale, indices, eps: float) -> torch.Tensor:
        check_modulate(op, x, weight, shift, scale, indices, eps, index_arg)
        return _RmsNormRows.apply(x, weight, shift, scale, indices, float(eps), op)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"``{op}``: the modulated RMSNorm; its weight and table gradients in the row-segment order."
    return fn


h3_rmsnorm_modulate_seg8 = _modulate_seg8("h3_rmsnorm_modulate_seg8", "adaln_indices")
final_adaln_out_seg8 = _modulate_seg8("final_adaln_out_seg8", "timestep_indices")


class _GateResidualRows(_GateResidual):
    """``adaln_gate_residual``'s forward (its autograd Function's, unchanged); the gate's gradient in row order."""

    @staticmethod
    def forward(ctx, x, y, gate, idx):
        ctx.rows = rows_for("adaln_gate_residual_seg8", x.shape[-2])
        return _GateResidual.forward(ctx, x, y, gate, idx)

    @staticmethod
    def backward(ctx, grad):
        y, gate = ctx.saved_tensors
        idx, g = ctx.idx, grad.contiguous()
        dy = dgate = None
        if ctx.needs_input_grad[1]:
            dy = torch.empty_like(y)
            gate_launch(y, g, gate, idx, dy, bwd=True)
        if ctx.needs_input_grad[2]:
            spans = local_spans(ctx.rows)
            total = row_sum(ctx.rows, None, [], y.device, [table_partials(g, idx, gate.shape[0], spans, other=y)])[0]
            dgate = finish(total, None, gate.dtype)
        return g, dy, dgate, None


def adaln_gate_residual_seg8(x, y, gate, adaln_indices) -> torch.Tensor:
    """``adaln_gate_residual_seg8``: ``x + gate[idx] * y``; the gate table's gradient in the row-segment order."""
    check_gate_residual("adaln_gate_residual_seg8", x, y, gate, adaln_indices)
    return _GateResidualRows.apply(x, y, gate, adaln_indices)
