"""RMSNorm rows: ``h3_rmsnorm`` (plain), ``h3_rmsnorm_modulate`` / ``final_adaln_out`` (norm + AdaLN modulation) and
``h3_qk_rmsnorm_d128`` (per head over D = 128).

Forward, per row (one row never reads another; rows per program fixed by H alone, never by the row count):

* ``ss = sum(x_f32 * x_f32)`` - float32. Rows up to ``CHUNK_H = 2048`` wide: one ``tl.sum`` tree over the row's
  ``BLOCK_H = next_pow2(H)`` lanes. Wider rows (H = 5376): the row is cut into ``ceil(H / 2048)`` column chunks;
  lane ``l`` accumulates ``x[c * 2048 + l]^2`` over chunks ``c = 0, 1, ...`` in ascending order (masked lanes add
  exact zeros), then one ``tl.sum`` tree (4 warps) combines the 2048 lane sums. Both fixed by H and the backend,
  identical for every row and every row count;
* ``rstd = 1 / sqrt_rn(ss / H + eps)`` - IEEE division and square root;
* ``n = round(x_f32 * rstd * w_f32)`` (one rounding, the torch>=2.9 ``_fused_rms_norm`` composite) or, when the
  provider rounds before the weight (``ROUND_FIRST``), ``round(round(x_f32 * rstd) * w)``. The rule is measured,
  not assumed: :func:`provider_rounds_first` runs the device's ``F.rms_norm`` on an exact-sum probe once per process
  and picks the order that reproduces it;
* modulation at the provider's dtype, rounding after each op: ``round(round(n * round(1 + scale[row])) + shift[row])``
  with ``row = idx[s]`` read straight from the (row-strided) table. Wide rows apply this in a second pass over the
  same chunks (x re-read; it is still in L2).

Not provider-bitwise in general: the provider's sum of squares is torch's own reduction (CPU cascade sum, CUDA
reduce kernel) whose order differs; with exact-sum inputs (where order cannot matter) every rounding point matches.

Backward (float32, deterministic, no atomics): ``dn = g * round(1 + scale[row])`` (or ``g``),
``dx = rstd * (dn * w - xhat * sum(dn * w * xhat) / H)`` per row (one ``tl.sum`` tree), cast once.
``dweight``: each program owns ``max(BWD_ROWS, BLOCK_M)`` consecutive rows (``BWD_ROWS = 32``), taken as sub-tiles of
the forward's ``BLOCK_M`` rows (fixed by H and the backend) in ascending order, each sub-tile's ``dn * xhat``
combined by one ``tl.sum`` tree over its rows and added to a float32 partial; the partials are combined in the
segment-sum order of ``gather.sum_rows`` (256-row chunks of 32-row sub-tiles, ascending) and cast once.
``dshift``/``dscale`` tables: fixed-order segment sums of ``g`` / ``g * n`` over every row (``gather.table_grad``).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gate.errors import InputError
from h3gate.kernels import exact
from h3gate.kernels.common import (
    INTERPRET,
    ROW_SCALE,
    STRICT_LAUNCH,
    check_dtype_as,
    check_indices,
    check_table,
    check_tensor,
    next_pow2,
)
from h3gate.kernels.gather import sum_rows, table_grad

BWD_ROWS = 32
CHUNK_H = 2048  # forward column chunk of rows wider than this
HEAD_DIM = 128
_DTYPES = (torch.float32, torch.bfloat16)


@exact.helper
def _normed(xhat, w, DT: tl.constexpr, ROUND_FIRST: tl.constexpr, INTERPRET: tl.constexpr):
    if ROUND_FIRST:
        return exact.rnd(exact.rnd(xhat, DT, INTERPRET) * w, DT, INTERPRET)
    else:
        return exact.rnd(xhat * w, DT, INTERPRET)


@exact.helper
def _rstd(ss, h_f, eps):
    """``1 / sqrt_rn(ss / H + eps)``: IEEE division and square root, float32."""
    return tl.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.sqrt_rn(tl.div_rn(ss, h_f) + eps))


@exact.helper
def _modulated(n, sc_raw, sh_raw, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """``round(round(n * round(1 + scale)) + shift)`` at the output dtype, rounding after each op."""
    n = exact.rnd(n * exact.rnd(1.0 + exact.f32(sc_raw, INTERPRET), DT, INTERPRET), DT, INTERPRET)
    return exact.rnd(n + exact.f32(sh_raw, INTERPRET), DT, INTERPRET)


@triton.jit
def _rms_fwd_kernel(
    x_ptr, w_ptr, out_ptr, rstd_ptr, shift_ptr, scale_ptr, idx_ptr, M, H, S, shift_rs, scale_rs, h_f, eps,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, NCH: tl.constexpr, MODULATE: tl.constexpr,
    ROUND_FIRST: tl.constexpr, SAVE_RSTD: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    rm = rows < M
    if NCH == 1:  # the whole row in one register tile
        cm = cols < H
        m = rm[:, None] & cm[None, :]
        offs = rows[:, None] * H + cols[None, :]
        x = exact.f32(tl.load(x_ptr + offs, mask=m, other=0.0), INTERPRET)
        if MODULATE:
            # Issued before the reduction (they do not depend on it) so the index -> table-row load chain overlaps
            # the x load instead of following the reduction's barriers; only the issue order changes.
            j = tl.load(idx_ptr + rows % S, mask=rm, other=0).to(tl.int64)
            sc_raw = tl.load(scale_ptr + j[:, None] * scale_rs + cols[None, :], mask=m, other=0.0)
            sh_raw = tl.load(shift_ptr + j[:, None] * shift_rs + cols[None, :], mask=m, other=0.0)
        w = exact.f32(tl.load(w_ptr + cols, mask=cm, other=0.0), INTERPRET)
        rstd = _rstd(tl.sum(x * x, axis=1), h_f, eps)
        n = _normed(x * rstd[:, None], w[None, :], DT, ROUND_FIRST, INTERPRET)
        if MODULATE:
            n = _modulated(n, sc_raw, sh_raw, DT, INTERPRET)
        tl.store(out_ptr + offs, exact.rne(n, DT, INTERPRET), mask=m)
    else:  # wide rows: NCH column chunks of BLOCK_H, two passes (the second re-reads x, an L2 hit)
        acc = exact.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for c in tl.static_range(NCH):
            cc = c * BLOCK_H + cols
            m = rm[:, None] & (cc < H)[None, :]
            x = exact.f32(tl.load(x_ptr + rows[:, None] * H + cc[None, :], mask=m, other=0.0), INTERPRET)
            acc = acc + x * x
        rstd = _rstd(tl.sum(acc, axis=1), h_f, eps)
        if MODULATE:
            j = tl.load(idx_ptr + rows % S, mask=rm, other=0).to(tl.int64)
        for c in tl.static_range(NCH):
            cc = c * BLOCK_H + cols
            cm = cc < H
            m = rm[:, None] & cm[None, :]
            offs = rows[:, None] * H + cc[None, :]
            x = exact.f32(tl.load(x_ptr + offs, mask=m, other=0.0), INTERPRET)
            w = exact.f32(tl.load(w_ptr + cc, mask=cm, other=0.0), INTERPRET)
            n = _normed(x * rstd[:, None], w[None, :], DT, ROUND_FIRST, INTERPRET)
            if MODULATE:
                sc_raw = tl.load(scale_ptr + j[:, None] * scale_rs + cc[None, :], mask=m, other=0.0)
                sh_raw = tl.load(shift_ptr + j[:, None] * shift_rs + cc[None, :], mask=m, other=0.0)
                n = _modulated(n, sc_raw, sh_raw, DT, INTERPRET)
            tl.store(out_ptr + offs, exact.rne(n, DT, INTERPRET), mask=m)
    if SAVE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=rm)


@triton.jit
def _rms_bwd_kernel(
    x_ptr, w_ptr, g_ptr, rstd_ptr, scale_ptr, idx_ptr, dx_ptr, n_ptr, dwp_ptr, seg_ptr, M, H, S, HR, scale_rs, h_f,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, MODULATE: tl.constexpr,
    ROUND_FIRST: tl.constexpr, NEED_N: tl.constexpr, SEGMENTED: tl.constexpr, NSEG: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Rows ``pid * ROWS + [0, ROWS)`` of M (``idx`` row ``r % S``). ``SEGMENTED`` (:func:`rms_backward_segments`):
    the rows are (M batch items, S positions, HR heads); ``seg_ptr`` (5, NSEG) int64 holds per segment its first
    program, first position ``lo``, positions ``len``, first head ``h0`` and heads ``w``; program ``pid`` of segment
    k walks that segment's ``M * len * w`` rows in (item, position, head) order from its ``pid - first``-th block of
    ROWS, exactly as a launch on those rows copied out alone would (idx row ``lo + s``)."""
    DT: tl.constexpr = dx_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cm = cols < H
    w = exact.f32(tl.load(w_ptr + cols, mask=cm, other=0.0), INTERPRET)[None, :]
    dw = exact.zeros([BLOCK_H], dtype=tl.float32)
    if SEGMENTED:
        k = pid * 0
        for t in tl.static_range(1, NSEG):
            k += (tl.load(seg_ptr + t) <= pid).to(tl.int64)
        first = pid - tl.load(seg_ptr + k)
        lo = tl.load(seg_ptr + NSEG + k)
        per = tl.load(seg_ptr + 2 * NSEG + k)
        h0 = tl.load(seg_ptr + 3 * NSEG + k)
        width = tl.load(seg_ptr + 4 * NSEG + k)
        per = per * width
    for i in range(0, ROWS // BLOCK_M):
        if SEGMENTED:
            v = first * ROWS + i * BLOCK_M + tl.arange(0, BLOCK_M)
            rm = v < M * per
            b = v // per
            rem = v - b * per
            pos = rem // width
            irow = lo + pos
            rows = (b * S + irow) * HR + h0 + (rem - pos * width)
        else:
            rows = pid * ROWS + i * BLOCK_M + tl.arange(0, BLOCK_M)
            rm = rows < M
            irow = rows % S
        m = rm[:, None] & cm[None, :]
        offs = rows[:, None] * H + cols[None, :]
        x = exact.f32(tl.load(x_ptr + offs, mask=m, other=0.0), INTERPRET)
        g = exact.f32(tl.load(g_ptr + offs, mask=m, other=0.0), INTERPRET)
        rstd = tl.load(rstd_ptr + rows, mask=rm, other=0.0)[:, None]
        xhat = x * rstd
        if MODULATE:
            j = tl.load(idx_ptr + irow, mask=rm, other=0).to(tl.int64)
            sc = exact.f32(tl.load(scale_ptr + j[:, None] * scale_rs + cols[None, :], mask=m, other=0.0), INTERPRET)
            dn = g * exact.rnd(1.0 + sc, DT, INTERPRET)
            if NEED_N:
                tl.store(n_ptr + offs, exact.rne(_normed(xhat, w, DT, ROUND_FIRST, INTERPRET), DT, INTERPRET), mask=m)
        else:
            dn = g
        dw = dw + tl.sum(dn * xhat, axis=0)
        dxhat = dn * w
        c = tl.div_rn(tl.sum(dxhat * xhat, axis=1), h_f)[:, None]
        dx = rstd * (dxhat - xhat * c)
        tl.store(dx_ptr + offs, exact.rne(dx, DT, INTERPRET), mask=m)
    tl.store(dwp_ptr + pid * H + cols, dw, mask=cm)


@cache
def _probe(device_type: str, index: int | None) -> bool:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    gen = torch.Generator().manual_seed(1234)
    h = 64
    x = (torch.randint(-16, 17, (256, h), generator=gen).float() / 4).to(torch.bfloat16).to(device)
    w = torch.randn(h, generator=gen).to(torch.bfloat16).to(device)
    with torch.no_grad():
        got = F.rms_norm(x, (h,), w, 1e-5)
        xf = x.float()
        xhat = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) / h + 1e-5)  # exact sum: order cannot matter
        first = (xhat.to(torch.bfloat16) * w).view(torch.int16)
        once = (xhat * w.float()).to(torch.bfloat16).view(torch.int16)
        miss_first = int((first != got.view(torch.int16)).sum())
        miss_once = int((once != got.view(torch.int16)).sum())
    return miss_first < miss_once


def provider_rounds_first(device: torch.device) -> bool:
    """Whether ``F.rms_norm`` on ``device`` rounds ``x * rstd`` to the input dtype before the weight multiply.

    Measured once per process (exact-sum probe, 256 x 64 bfloat16); the order with fewer mismatches wins."""
    return _probe(device.type, device.index)


def rounding_rule(device: torch.device) -> str:
    return "round(x*rstd) then *w" if provider_rounds_first(device) else "round(x*rstd*w) once"


def _bwd_config(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_M, warps) of the backward: the whole row in one register tile."""
    block_h = next_pow2(h)
    block_m = max(1, min(16, 2048 // block_h))
    tile = block_m * block_h
    return block_h, block_m * ROW_SCALE, 4 if tile <= 2048 else (8 if tile <= 8192 else 16)


def _fwd_config(h: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_M, chunks, warps) of the forward, a function of H (and the backend) alone.

    Rows up to CHUNK_H wide: as the backward (one register tile per row). Wider rows: CHUNK_H-wide chunks, one row
    per program at 4 warps. The whole-row tile (next_pow2(5376) = 8192 lanes, ~94 registers per thread) held the
    modulated norm to 2 blocks per SM and 57% of copy bandwidth at 768p; the chunked form (2048-wide chunks on 4
    warps) measured 91% on the H200."""
    if next_pow2(h) <= CHUNK_H:
        block_h, block_m, warps = _bwd_config(h)
        return block_h, block_m, 1, warps
    return CHUNK_H, ROW_SCALE, triton.cdiv(h, CHUNK_H), 4


def rms_forward(x, weight, shift, scale, idx, eps: float, save: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward launch: ``(out, rstd)`` (rstd per row when ``save``, else one unused slot)."""
    h = x.shape[-1]
    m = x.numel() // h
    s = idx.shape[0] if idx is not None else 1
    modulate = idx is not None
    out = torch.empty_like(x)
    rstd = torch.empty(m if save else 1, dtype=torch.float32, device=x.device)
    block_h, block_m, nch, warps = _fwd_config(h)
    _rms_fwd_kernel[(triton.cdiv(m, block_m),)](
        x, weight, out, rstd, shift if modulate else x, scale if modulate else x, idx if modulate else x,
        m, h, s, shift.stride(0) if modulate else 0, scale.stride(0) if modulate else 0, float(h), float(eps),
        BLOCK_M=block_m, BLOCK_H=block_h, NCH=nch, MODULATE=modulate, ROUND_FIRST=provider_rounds_first(x.device),
        SAVE_RSTD=save, INTERPRET=INTERPRET, num_warps=warps, **STRICT_LAUNCH,
    )  # fmt: skip
    return out, rstd


def rms_backward(x, weight, rstd, g, scale=None, idx=None, need_n: bool = False):
    """The backward launch: ``(dx, dweight_partials (programs, H) FP32, n)``; ``n`` (the normed rows, for the scale
    table's gradient) only when ``need_n``. Each program owns ``max(BWD_ROWS, BLOCK_M)`` consecutive rows."""
    modulate = idx is not None
    h = x.shape[-1]
    m = x.numel() // h
    dx = torch.empty_like(x)
    n = torch.empty_like(x) if need_n else dx
    block_h, block_m, warps = _bwd_config(h)
    rows = max(BWD_ROWS, block_m)
    progs = triton.cdiv(m, rows)
    dwp = torch.empty((progs, h), dtype=torch.float32, device=x.device)
    _rms_bwd_kernel[(progs,)](
        x, weight, g, rstd, scale if modulate else x, idx if modulate else x, dx, n, dwp, dwp,
        m, h, idx.shape[0] if modulate else 1, 1, scale.stride(0) if modulate else 0, float(h),
        ROWS=rows, BLOCK_M=block_m, BLOCK_H=block_h, MODULATE=modulate, ROUND_FIRST=provider_rounds_first(x.device),
        NEED_N=need_n, SEGMENTED=False, NSEG=1, INTERPRET=INTERPRET, num_warps=warps, **STRICT_LAUNCH,
    )  # fmt: skip
    return dx, dwp, n if need_n else None


def _nseg(n: int) -> int:
    return 8 if n <= 8 else 64


@cache
def _segment_table(segments: tuple[tuple[int, int, int, int], ...], batch: int, rows: int, device: torch.device):
    """(first program of each segment, then the total) and the (5, NSEG) int64 table of the segmented launch:
    first program, first position, positions, first head, heads per segment (padding segments start at the total)."""
    firsts = [0]
    for _, length, _, width in segments:
        firsts.append(firsts[-1] + triton.cdiv(batch * length * width, rows))
    pad = _nseg(len(segments)) - len(segments)
    cols = [firsts[:-1] + [firsts[-1]] * pad, [lo for lo, _, _, _ in segments] + [0] * pad,
            [max(n, 1) for _, n, _, _ in segments] + [1] * pad, [h0 for _, _, h0, _ in segments] + [0] * pad,
            [max(w, 1) for _, _, _, w in segments] + [1] * pad]  # fmt: skip
    return tuple(firsts), torch.tensor(cols, dtype=torch.int64, device=device)


def rms_backward_segments(x, weight, rstd, g, scale, idx, segments, need_n: bool = False, heads: bool = False):
    """:func:`rms_backward` of every segment in ONE launch: ``(dx, dweight_partials, n, firsts)``. ``x`` is
    (..., S, H), or with ``heads`` (..., S, HR, H) (the QK norm's (position, head) rows); ``segments[k] = (lo, len,
    h0, w)``: positions ``[lo, lo + len)`` x heads ``[h0, h0 + w)`` of every batch item (at most 64 segments). dx
    and n of every covered row (a row's own, as any launch gives them); segment k's program partials in rows
    ``[firsts[k], firsts[k + 1])``, bitwise those of ``rms_backward`` on the segment's rows copied out alone
    (``x[..., lo:lo+len, h0:h0+w, :]``, ``idx[lo:lo+len]``): the same programs of ROWS rows from its first row."""
    modulate = idx is not None
    h, s, hr = x.shape[-1], x.shape[-3 if heads else -2], x.shape[-2] if heads else 1
    batch = x.numel() // (h * hr * s) if s else 0
    dx = torch.empty_like(x)
    n = torch.empty_like(x) if need_n else dx
    block_h, block_m, warps = _bwd_config(h)
    rows = max(BWD_ROWS, block_m)
    firsts, table = _segment_table(tuple(segments), batch, rows, x.device)
    dwp = torch.empty((firsts[-1], h), dtype=torch.float32, device=x.device)
    if firsts[-1]:
        _rms_bwd_kernel[(firsts[-1],)](
            x, weight, g, rstd, scale if modulate else x, idx if modulate else x, dx, n, dwp, table,
            batch, h, s, hr, scale.stride(0) if modulate else 0, float(h),
            ROWS=rows, BLOCK_M=block_m, BLOCK_H=block_h, MODULATE=modulate,
            ROUND_FIRST=provider_rounds_first(x.device), NEED_N=need_n, SEGMENTED=True, NSEG=_nseg(len(segments)),
            INTERPRET=INTERPRET, num_warps=warps, **STRICT_LAUNCH,
        )  # fmt: skip
    return dx, dwp, n if need_n else None, firsts


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, shift, scale, idx, eps):
        out, rstd = rms_forward(x, weight, shift, scale, idx, eps, any(ctx.needs_input_grad[:4]))
        ctx.save_for_backward(x, weight, rstd, scale)
        ctx.idx = idx  # the same object, so cached segment plans are found again
        ctx.table_rows = scale.shape[0] if idx is not None else 0
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, scale = ctx.saved_tensors
        idx = ctx.idx
        modulate = idx is not None
        g = grad.contiguous()
        need_n = modulate and ctx.needs_input_grad[3]
        dx, dwp, n = rms_backward(x, weight, rstd, g, scale if modulate else None, idx, need_n)
        dweight = sum_rows(dwp, weight.dtype) if ctx.needs_input_grad[1] else None
        dshift = dscale = None
        if modulate and ctx.needs_input_grad[2]:
            dshift = table_grad(g, idx, ctx.table_rows, x.dtype)
        if need_n:
            dscale = table_grad(g, idx, ctx.table_rows, x.dtype, other=n)
        return dx, dweight, dshift, dscale, None, None


def _check_x(op: str, x: torch.Tensor, weight: torch.Tensor, width: int | None = None) -> None:
    check_tensor(op, "x", x, _DTYPES)
    if x.ndim < 2:
        raise InputError(f"{op}: x: expected (..., rows, H), got shape {tuple(x.shape)}")
    check_tensor(op, "weight", weight, _DTYPES, ndim=1, device=x.device)
    check_dtype_as(op, "weight", weight, x.dtype, "x")
    h = width or x.shape[-1]
    if weight.shape[0] != h:
        raise InputError(f"{op}: weight: length {weight.shape[0]}, expected {h}")


def _check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, int | float) or not eps > 0:
        raise InputError(f"{op}: eps: must be a positive number, got {eps!r}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h3_rmsnorm``: RMSNorm over the last dim of a contiguous (..., H) tensor (refiner and final norms)."""
    _check_x("h3_rmsnorm", x, weight)
    _check_eps("h3_rmsnorm", eps)
    return _RmsNorm.apply(x, weight, None, None, None, float(eps))


def check_modulate(op: str, x, weight, shift, scale, indices, eps, index_arg: str) -> None:
    """The modulated norm's inputs (every operator of this kernel family, the ``_seg8`` twins too)."""
    _check_x(op, x, weight)
    _check_eps(op, eps)
    if x.ndim not in (2, 3):
        raise InputError(f"{op}: x: expected (B, S, H) or (S, H), got shape {tuple(x.shape)}")
    h = x.shape[-1]
    check_table(op, "shift", shift, _DTYPES, h, x.device)
    check_table(op, "scale", scale, _DTYPES, h, x.device)
    check_dtype_as(op, "shift", shift, x.dtype, "x")
    check_dtype_as(op, "scale", scale, x.dtype, "x")
    if shift.shape[0] != scale.shape[0]:
        raise InputError(f"{op}: shift/scale: {shift.shape[0]} vs {scale.shape[0]} table rows")
    check_indices(op, index_arg, indices, x.shape[-2], scale.shape[0], x.device)


def _modulate(op: str, x, weight, shift, scale, indices, eps, index_arg: str) -> torch.Tensor:
    check_modulate(op, x, weight, shift, scale, indices, eps, index_arg)
    return _RmsNorm.apply(x, weight, shift, scale, indices, float(eps))


def rmsnorm_modulate(x, weight, shift, scale, adaln_indices, eps: float) -> torch.Tensor:
    """``h3_rmsnorm_modulate``: ``rmsnorm(x) * (1 + scale[idx]) + shift[idx]``; (3T, H) tables may be row-strided
    chunks of the AdaLN projection (no copy)."""
    return _modulate("h3_rmsnorm_modulate", x, weight, shift, scale, adaln_indices, eps, "adaln_indices")


def final_adaln_out(x, weight, shift, scale, timestep_indices, eps: float) -> torch.Tensor:
    """``final_adaln_out``: the same kernel with (T, H) per-timestep shift/scale tables and ``timestep_indices``."""
    return _modulate("final_adaln_out", x, weight, shift, scale, timestep_indices, eps, "timestep_indices")


def check_qk(op: str, x: torch.Tensor, weight: torch.Tensor, heads: int, eps: float) -> None:
    """The QK norm's inputs: (..., nh*128) rows, ``heads`` dividing the width into D = 128 heads, a (128,) weight."""
    check_tensor(op, "x", x, _DTYPES)
    if not isinstance(heads, int) or heads < 1 or x.shape[-1] % heads:
        raise InputError(f"{op}: heads: {heads!r} does not divide the last dim {x.shape[-1]}")
    d = x.shape[-1] // heads
    if d != HEAD_DIM:
        raise InputError(f"{op}: x: head dim {d} unsupported (this kernel is D = {HEAD_DIM} only)")
    _check_x(op, x, weight, HEAD_DIM)
    _check_eps(op, eps)


def qk_rmsnorm(x: torch.Tensor, weight: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """``h3_qk_rmsnorm_d128``: (B, S, nh*128) -> (B, S, nh, 128), RMSNorm per head over D = 128 (any head count)."""
    check_qk("h3_qk_rmsnorm_d128", x, weight, heads, eps)
    return _RmsNorm.apply(x.view(*x.shape[:-1], heads, HEAD_DIM), weight, None, None, None, float(eps))
