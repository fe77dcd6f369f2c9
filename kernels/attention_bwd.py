"""Backward of the strict full attention as Triton kernels (the ``triton_pointer`` and ``triton_tma`` paths): three
kernels, fixed orders, no atomics.

With ``c = log2(e) / sqrt(D)``, ``s = (q k^T) * c`` and the forward's FP32 ``lse2`` (log2 domain), every kernel
recomputes ``p = exp2(s - lse2)`` exactly as the others do:

1. ``delta[r] = sum_d f32(out[r, d]) * f32(dout[r, d])`` - FP32 products, one fixed tree over D = 128.
2. dK/dV - one program per (KV block of ``kv_n`` rows, batch, head); it walks the query blocks of ``kv_m`` rows in
   ascending order (masked tail last): ``dv += cast(p^T) @ dout``, ``dp^T = v @ dout^T``,
   ``ds^T = p^T * (dp^T - delta)``, ``dk += cast(ds^T) @ q``; at the end ``dk *= 1/sqrt(D)``.
3. dQ - one program per (query block of ``q_m`` rows, batch, head); it walks the KV blocks of ``q_n`` rows in
   ascending order: ``ds = p * (dout @ v^T - delta)``, ``dq += cast(ds) @ k``; at the end ``dq *= 1/sqrt(D)``.

Declared options (fields of the (D, dtype) config, default strict): ``bwd_exp2`` evaluates every ``exp2`` above
with libdevice ``__nv_exp2f`` (default), the explicit PTX ``ex2.approx.f32`` ("ex2") or ``ex2.approx.ftz.f32``
("ex2ftz", subnormal results flush to +0); ``bwd_fma`` forms the exponent as one explicit ``fma(q k^T, c, -lse2)``
(one rounding) instead of ``(q k^T) * c - lse2`` (two). Both kernels use the same option, so dK/dV and dQ see the
same p. These are written instructions (inline asm / ``tl.fma``), never compiler fast-math: launches keep
``enable_fp_fusion=False``. The interpreter evaluates them with ``tl.exp2`` / ``tl.fma``.

With a walk order (:mod:`h3gate.kernels.attention`): the operands a kernel walks in its inner loop (q and dout for
dK/dV, k and v for dQ) are gathered into canonical order (contiguous copies, each made just before its kernel), the
rows a program owns are read in place through ``order[i]`` (``packed_rows``) and its dq, dk, dv rows stored straight
to their packed rows; ``lse2`` and ``delta`` are indexed canonically. The bytes are those of the kernels on gathered
copies scattered back (no addition anywhere).

The ``triton_tma`` path (CUDA only) loads the inner loop's tiles with TMA (device-side descriptors over the (batch,
head)'s (S, D) slice; rows past S zero-filled, as the masked pointer loads give): the same values, the same
instructions on them. The ``gluon_warp_specialised`` path runs both walks as warp-specialised Gluon kernels on Hopper,
the same arithmetic (:mod:`h3gate.kernels.attention_bwd_gluon`).

All accumulators are FP32; ``cast`` rounds to the input dtype (RNE) before an MMA (identity for float32), and each
gradient is rounded once when stored. No split over the query or KV axis, no atomics: each output element is
written by exactly one program, so dQ/dK/dV are repeat-bitwise and batch-row invariant.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3gate.kernels.attention_config import AttnConfig, qk_scale
from h3gate.kernels.attention_math import exp2_fwd, gather_rows, packed_rows
from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, tma_allocator
from h3gate.kernels.exact import f32, helper, mma, rne, zeros


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, ord_ptr, S, H, stride_b, stride_s, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, ORDERED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = base + packed_rows(ord_ptr, offs_m, S, ORDERED)[:, None] * stride_s + tl.arange(0, D)[None, :]
    o = f32(tl.load(o_ptr + rows, mask=offs_m[:, None] < S, other=0.0), INTERPRET)
    do = f32(tl.load(do_ptr + rows, mask=offs_m[:, None] < S, other=0.0), INTERPRET)
    tl.store(delta_ptr + bh.to(tl.int64) * S + offs_m, tl.sum(o * do, 1), mask=offs_m < S)


@helper
def _walk_tiles(a_ptr, b_ptr, a_desc, b_desc, base, start, S, stride_s, BLOCK: tl.constexpr, D: tl.constexpr,
                MASK: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """Rows [start, start + BLOCK) of two walked (canonical, contiguous) operands; rows past S are zero."""
    if USE_TMA:
        return a_desc.load([start, 0]), b_desc.load([start, 0])
    else:
        offs = start + tl.arange(0, BLOCK)
        rows = base + offs[:, None] * stride_s + tl.arange(0, D)[None, :]
        if MASK:
            return (tl.load(a_ptr + rows, mask=offs[:, None] < S, other=0.0),
                    tl.load(b_ptr + rows, mask=offs[:, None] < S, other=0.0))  # fmt: skip
        else:
            return tl.load(a_ptr + rows), tl.load(b_ptr + rows)


@helper
def _walk_descs(a_ptr, b_ptr, base, S, stride_s, BLOCK: tl.constexpr, D: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        return (tl.make_tensor_descriptor(a_ptr + base, [S, D], [stride_s, 1], [BLOCK, D]),
                tl.make_tensor_descriptor(b_ptr + base, [S, D], [stride_s, 1], [BLOCK, D]))  # fmt: skip
    else:
        return a_ptr, b_ptr  # unused: the pointer path


@helper
def _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, base, stat, start, S, stride_s,
                qk_scale, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr,
                EXP2: tl.constexpr, FMA: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One query step of the dK/dV walk."""
    offs_m = start + tl.arange(0, BLOCK_M)
    q, do = _walk_tiles(q_ptr, do_ptr, q_desc, do_desc, base, start, S, stride_s, BLOCK_M, D, MASK, USE_TMA)
    if MASK:
        lse = tl.load(lse_ptr + stat + offs_m, mask=offs_m < S, other=0.0)
        dl = tl.load(delta_ptr + stat + offs_m, mask=offs_m < S, other=0.0)
    else:
        lse = tl.load(lse_ptr + stat + offs_m)
        dl = tl.load(delta_ptr + stat + offs_m)
    qk_t = mma(k, tl.trans(q), zeros((BLOCK_N, BLOCK_M), tl.float32), INTERPRET)
    if FMA:  # declared: one explicit fma per score (module docstring)
        p_t = exp2_fwd(tl.fma(qk_t, qk_scale, -lse[None, :]), EXP2, INTERPRET)
    else:
        p_t = exp2_fwd(qk_t * qk_scale - lse[None, :], EXP2, INTERPRET)
    if MASK:
        p_t = tl.where(offs_m[None, :] < S, p_t, 0.0)
    dv = mma(rne(p_t, do.dtype, INTERPRET), do, dv, INTERPRET)
    dp_t = mma(v, tl.trans(do), zeros((BLOCK_N, BLOCK_M), tl.float32), INTERPRET)
    ds = rne(p_t * (dp_t - dl[None, :]), q.dtype, INTERPRET)
    dk = mma(ds, q, dk, INTERPRET)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, ord_ptr, S, H, qk_scale, sm_scale,
                 stride_b, stride_s, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 EXP2: tl.constexpr, FMA: tl.constexpr, ORDERED: tl.constexpr, USE_TMA: tl.constexpr,
                 INTERPRET: tl.constexpr):  # fmt: skip
    """q, dout: walked (canonical rows); k, v, dk, dv: this program's rows, through the order."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    stat = bh.to(tl.int64) * S
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = base + packed_rows(ord_ptr, offs_n, S, ORDERED)[:, None] * stride_s + tl.arange(0, D)[None, :]
    kv_valid = offs_n < S
    k = tl.load(k_ptr + rows, mask=kv_valid[:, None], other=0.0)
    v = tl.load(v_ptr + rows, mask=kv_valid[:, None], other=0.0)
    q_desc, do_desc = _walk_descs(q_ptr, do_ptr, base, S, stride_s, BLOCK_M, D, USE_TMA)
    dk = zeros((BLOCK_N, D), tl.float32)
    dv = zeros((BLOCK_N, D), tl.float32)
    m_full = S // BLOCK_M
    for j in range(0, m_full):
        dk, dv = _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, base, stat, j * BLOCK_M,
                             S, stride_s, qk_scale, BLOCK_N, BLOCK_M, D, False, EXP2, FMA, USE_TMA,
                             INTERPRET)  # fmt: skip
    if m_full * BLOCK_M < S:
        dk, dv = _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, base, stat,
                             m_full * BLOCK_M, S, stride_s, qk_scale, BLOCK_N, BLOCK_M, D, True, EXP2, FMA, USE_TMA,
                             INTERPRET)  # fmt: skip
    dk = dk * sm_scale
    tl.store(dk_ptr + rows, rne(dk, dk_ptr.dtype.element_ty, INTERPRET), mask=kv_valid[:, None])
    tl.store(dv_ptr + rows, rne(dv, dv_ptr.dtype.element_ty, INTERPRET), mask=kv_valid[:, None])


@helper
def _dq_block(q, do, lse, dl, dq, k_ptr, v_ptr, k_desc, v_desc, base, start, S, stride_s, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr, EXP2: tl.constexpr,
              FMA: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    offs_n = start + tl.arange(0, BLOCK_N)
    k, v = _walk_tiles(k_ptr, v_ptr, k_desc, v_desc, base, start, S, stride_s, BLOCK_N, D, MASK, USE_TMA)
    qk = mma(q, tl.trans(k), zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET)
    if FMA:  # declared: one explicit fma per score (module docstring)
        p = exp2_fwd(tl.fma(qk, qk_scale, -lse[:, None]), EXP2, INTERPRET)
    else:
        p = exp2_fwd(qk * qk_scale - lse[:, None], EXP2, INTERPRET)
    if MASK:
        p = tl.where(offs_n[None, :] < S, p, 0.0)
    dp = mma(do, tl.trans(v), zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET)
    ds = p * (dp - dl[:, None])
    return mma(rne(ds, k.dtype, INTERPRET), k, dq, INTERPRET)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, ord_ptr, S, H, qk_scale, sm_scale, stride_b,
               stride_s, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP2: tl.constexpr,
               FMA: tl.constexpr, ORDERED: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """k, v: walked (canonical rows); q, dout, dq: this program's rows, through the order."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    stat = bh.to(tl.int64) * S
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = base + packed_rows(ord_ptr, offs_m, S, ORDERED)[:, None] * stride_s + tl.arange(0, D)[None, :]
    mask_m = offs_m < S
    q = tl.load(q_ptr + rows, mask=mask_m[:, None], other=0.0)
    do = tl.load(do_ptr + rows, mask=mask_m[:, None], other=0.0)
    lse = tl.load(lse_ptr + stat + offs_m, mask=mask_m, other=0.0)
    dl = tl.load(delta_ptr + stat + offs_m, mask=mask_m, other=0.0)
    k_desc, v_desc = _walk_descs(k_ptr, v_ptr, base, S, stride_s, BLOCK_N, D, USE_TMA)
    dq = zeros((BLOCK_M, D), tl.float32)
    n_full = S // BLOCK_N
    for j in range(0, n_full):
        dq = _dq_block(q, do, lse, dl, dq, k_ptr, v_ptr, k_desc, v_desc, base, j * BLOCK_N, S, stride_s, qk_scale,
                       BLOCK_M, BLOCK_N, D, False, EXP2, FMA, USE_TMA, INTERPRET)  # fmt: skip
    if n_full * BLOCK_N < S:
        dq = _dq_block(q, do, lse, dl, dq, k_ptr, v_ptr, k_desc, v_desc, base, n_full * BLOCK_N, S, stride_s,
                       qk_scale, BLOCK_M, BLOCK_N, D, True, EXP2, FMA, USE_TMA, INTERPRET)  # fmt: skip
    dq = dq * sm_scale
    tl.store(dq_ptr + rows, rne(dq, dq_ptr.dtype.element_ty, INTERPRET), mask=mask_m[:, None])


def delta(out: torch.Tensor, grad: torch.Tensor, order: torch.Tensor | None, heads: int) -> torch.Tensor:
    """``delta[bh, i] = sum_d f32(out[r, d]) * f32(dout[r, d])`` for canonical row ``i`` (packed row ``r``): FP32
    products, one fixed tree over D; (B * nh, S) float32."""
    b, s = out.shape[:2]
    d = out.shape[2] // heads
    result = torch.empty((b * heads, s), dtype=torch.float32, device=out.device)
    _delta_kernel[(triton.cdiv(s, 64), b * heads)](
        out, grad, result, out if order is None else order, s, heads, out.stride(0), out.stride(1), D=d, BLOCK_M=64,
        ORDERED=order is not None, INTERPRET=INTERPRET, num_warps=4, **STRICT_LAUNCH,
    )  # fmt: skip
    return result


def walks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    lse: torch.Tensor,
    delta_: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: AttnConfig,
    order: torch.Tensor | None,
    tma: bool,
) -> None:
    """The dK/dV and dQ walks into ``grads`` = (dq, dk, dv) (packed rows), from lse2 and delta (canonical rows),
    walking ``order`` (None: packed order); ``tma``: the walked tiles loaded by TMA (CUDA only)."""
    dq, dk, dv = grads
    b, s, h, d = q.shape
    sm_scale, c = 1.0 / math.sqrt(d), qk_scale(d)
    stride_b, stride_s = q.stride(0), q.stride(1)
    ordered, ord_arg = order is not None, q if order is None else order
    if tma:
        triton.set_allocator(tma_allocator)  # device-side descriptors need scratch (a context variable)
    _dkdv_kernel[(triton.cdiv(s, cfg.kv_n), b * h)](
        gather_rows(q, order), k, v, gather_rows(grad, order), lse, delta_, dk, dv, ord_arg, s, h, c, sm_scale,
        stride_b, stride_s, D=d, BLOCK_N=cfg.kv_n, BLOCK_M=cfg.kv_m, EXP2=cfg.bwd_exp2_code, FMA=cfg.bwd_fma,
        ORDERED=ordered, USE_TMA=tma, INTERPRET=INTERPRET, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
        **STRICT_LAUNCH,
    )  # fmt: skip
    _dq_kernel[(triton.cdiv(s, cfg.q_m), b * h)](
        q, gather_rows(k, order), gather_rows(v, order), grad, lse, delta_, dq, ord_arg, s, h, c, sm_scale, stride_b,
        stride_s, D=d, BLOCK_M=cfg.q_m, BLOCK_N=cfg.q_n, EXP2=cfg.bwd_exp2_code, FMA=cfg.bwd_fma, ORDERED=ordered,
        USE_TMA=tma, INTERPRET=INTERPRET, num_warps=cfg.q_warps, num_stages=cfg.q_stages, **STRICT_LAUNCH,
    )  # fmt: skip
