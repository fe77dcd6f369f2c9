"""The reference of the fused row-segment weight gradient (kernels/rows_dw.py): ``rows_seg8.linear_row_grads`` v1,
which launched the single-walk dW kernel (and the colsum kernel) once per segment of a weight gradient (the 4 pairs of
row segments, ``row_merge.dw_bounds``) into FP32 partials and added them with ``row_merge.subtree``'s torch tree.
Test code only: the fused kernel must equal it byte for byte."""

from __future__ import annotations

import torch

from h3gate.kernels.gemm_configs import gemm_config
from h3gate.kernels.gemm_triton import colsum, matmul
from h3gate.kernels.merge_tree import finish
from h3gate.kernels.row_merge import RowGroup, dw_bounds, row_sum, seq_slice, subtree
from h3gate.kernels.rows_dw import fp32_out_config

F32 = torch.float32


def dw_spans(group: RowGroup) -> list[tuple[int, int]]:
    """The LOCAL rows ``[lo, hi)`` of each weight-gradient segment the rank owns (empty ones too), in order."""
    bounds, owned = dw_bounds(group.seq_len), group.dw_owned
    return [(bounds[i] - bounds[owned.start], bounds[i + 1] - bounds[owned.start]) for i in owned]


def linear_row_grads_v1(
    gy: torch.Tensor,
    x: torch.Tensor,
    w_shape: tuple[int, int],
    full: tuple[int, int],
    rows: RowGroup,
    bias: bool,
    launch=None,
    *,
    spans_of=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """v1's (dW, db): per segment ``matmul`` (a_trans, the full layer's dw tiling, FP32 out) and ``colsum`` at FP32
    on the segment's rows, the tree and the group's merge, one rounding (``launch``, the fused kernel's launch
    choices, is not v1's). ``spans_of`` (a negative control) replaces :func:`dw_spans` for the segment rows."""
    x = x.reshape(1, -1) if x.ndim == 1 else x
    n_loc, k_loc = gy.shape[-1], x.shape[-1]
    cfg = fp32_out_config(gemm_config("dw", full[0], full[1], x.dtype), x.dtype)
    g3 = gy.reshape(*x.shape[:-1], n_loc)
    width = w_shape[0] * w_shape[1] + (w_shape[0] if bias else 0)
    level = []
    for lo, hi in (spans_of or dw_spans)(rows):
        if hi == lo:
            level.append(torch.zeros(width, dtype=F32, device=x.device))
            continue
        gs, xs = seq_slice(g3, lo, hi).reshape(-1, n_loc), seq_slice(x, lo, hi).reshape(-1, k_loc)
        dw = torch.empty(w_shape, dtype=F32, device=x.device)
        matmul(gs, xs, dw, None, cfg, a_trans=True, b_trans=False)
        level.append(torch.cat([dw.reshape(-1)] + ([colsum(gs, F32)] if bias else [])))
    total = rows.merge(subtree(torch.stack(level)))
    dw = finish(total[: w_shape[0] * w_shape[1]].view(w_shape), None, x.dtype)
    return dw, (finish(total[w_shape[0] * w_shape[1] :], None, x.dtype) if bias else None)


def rmsnorm_rows_backward_v1(x, weight, rstd, g, scale, idx, rows: RowGroup, need=(True, True, True)):
    """v1's ``_RmsNormRows.backward`` (the seg8 modulated RMSNorm): the norm's backward kernel launched once per row
    segment (its dx, n and 32-row program partials, the partials by ``gather.sum_rows``), the shift / scale table
    partials, ``row_sum``'s tree; ``(dx, dweight, dshift, dscale)``."""
    from h3gate.kernels.gather import sum_rows
    from h3gate.kernels.norms import rms_backward
    from h3gate.kernels.row_merge import local_spans
    from h3gate.kernels.rows_seg8 import table_partials

    need_w, need_shift, need_scale = need
    rstd = rstd.view(x.shape[:-1])
    dx = torch.empty_like(x)
    n = torch.empty_like(x) if need_scale else None
    spans, w_parts = local_spans(rows), []
    for lo, hi in spans:
        if hi <= lo:
            w_parts.append(torch.zeros(weight.shape, dtype=F32, device=x.device))
            continue
        xs, gs, rs = seq_slice(x, lo, hi), seq_slice(g, lo, hi), rstd[..., lo:hi].contiguous()
        dxs, dwp, ns = rms_backward(xs, weight, rs, gs, scale, idx[lo:hi], need_scale)
        dx[..., lo:hi, :] = dxs
        if n is not None:
            n[..., lo:hi, :] = ns
        w_parts.append(sum_rows(dwp, F32))
    stacked = [torch.stack(w_parts)] if need_w else []
    if need_shift:
        stacked.append(table_partials(g, idx, scale.shape[0], spans))
    if need_scale:
        stacked.append(table_partials(g, idx, scale.shape[0], spans, other=n))
    sums = iter(row_sum(rows, None, [], x.device, stacked))
    return (dx, *(finish(next(sums), None, x.dtype) if want else None for want in need))


def qk_norm_backward_v1(xv, weight, rstd, g, heads: int, first: int, rows: RowGroup, group):
    """v1's ``QkNormGrouped.backward`` (the seg8 QK norm): the norm's backward launched once per (head group, row
    segment) on that block's rows copied out, ``sum_rows`` of its program partials, ``row_sum``'s tree over the row
    segments, the head-group tree; ``(dx (..., h_r * 128), dweight)``."""
    from h3gate.kernels.gather import sum_rows
    from h3gate.kernels.norms import HEAD_DIM, rms_backward
    from h3gate.kernels.tp_layers import head_groups

    rstd = rstd.view(*xv.shape[:-1])
    bounds = head_groups(heads)
    spans = [(bounds[i] - first, bounds[i + 1] - first) for i in group.owned]
    dx = torch.empty_like(xv)
    groups = [None if hi <= lo else (xv[..., lo:hi, :].contiguous(), g[..., lo:hi, :].contiguous(),
                                     rstd[..., lo:hi].contiguous()) for lo, hi in spans]  # fmt: skip

    def partial(r0: int, r1: int) -> list[torch.Tensor]:
        out = []
        for (lo, hi), grp in zip(spans, groups, strict=True):
            if grp is None:
                out.append(torch.zeros(HEAD_DIM, dtype=F32, device=xv.device))
                continue
            xs, gs, rs = (t[:, r0:r1].contiguous() for t in grp)
            dxi, dwp, _ = rms_backward(xs, weight, rs, gs)
            dx[..., r0:r1, lo:hi, :] = dxi
            out.append(sum_rows(dwp, F32))
        return out

    level = row_sum(rows, partial, [(HEAD_DIM,)] * len(spans), xv.device)
    while len(level) > 1:
        level = [level[j] + level[j + 1] for j in range(0, len(level), 2)]
    return dx.view(*g.shape[:-2], -1), finish(group.merge(level[0]), None, weight.dtype)
