"""Backward of the strict full attention in one pass: the dK/dV walk also carries dQ's sums, in the same order.

Same contract and bytes as :mod:`h3gate.kernels.attention_bwd` (``AttnConfig.bwd_fused``, a launch field); what
changes is who computes dQ's products. There, a dQ program per query block recomputes ``p`` and ``dp`` and walks the
KV blocks in ascending order, ``dq = mma(cast(ds), k, dq)``: one FP32 accumulator per element, extended by one MMA
k-step (16 KV rows) at a time, KV rows ascending. Here the dK/dV program of KV block ``n`` already holds ``ds`` for
every query step, so it extends that same chain by its own KV rows:

* for query step ``j`` (``kv_m`` rows, ascending) the program waits until ``sem[bh, j] == n`` (the program of KV
  block ``n - 1`` has stored its partial sum), reads the FP32 partial sums ``acc`` of those rows (zeros for
  ``n = 0``), runs ``acc = mma(cast(ds), k, acc)`` over its ``kv_n`` KV rows (k-steps ascending), stores ``acc`` and
  sets ``sem[bh, j] = n + 1``. Once every chain is complete, a last kernel stores ``cast(acc * 1/sqrt(D))`` at dq's
  packed rows (the dQ kernel's epilogue).
* So every element of dq is the same chain of MMA k-steps over the same KV rows in the same ascending order, from
  the same ``+0`` start, on the same ``cast(ds)`` values (``p`` and ``dp`` are per-element dot products over D, the
  same in either operand order), followed by the same scale and rounding: the bytes of the dQ kernel. KV rows past S
  contribute ``cast(ds) = 0`` there (masked), and are masked to 0 here too. Measured, not assumed: the H200 probe
  (``tools/gpu_attention_bwd.py``) compares dq, dk and dv byte for byte with the three-kernel backward.
* The handoff is a plain FP32 store and load through L2 (``.cg``, no atomic arithmetic on values); the semaphore is
  an int32 per (batch x head, query step), written with release and read with acquire semantics. Programs take a
  ticket (``atomic_add`` on a counter) and derive their (KV block, batch x head) from it, KV block fastest: a program
  only ever waits on a lower ticket, which has already started, so the chain cannot deadlock whatever order the
  hardware launches programs in.
* dK/dV are untouched: the same program, the same ascending walk and the same MMAs as ``_dkdv_kernel``.

Memory: an FP32 (batch x heads, S, D) buffer of partial sums (twice dq's bytes) and one int32 per (batch x head,
query step), both per call.

Not in production: on the H200 it was byte-equal to the three-kernel backward at every case probed and 2.2x slower
(560 vs 259 ms at S = 38974; ``docs/measurements/perf-probe-17.json``). Each query step waits for its predecessor's
store, load and release before its own MMA, and nothing else runs meanwhile: the hand-off needs its own warp (warp
specialisation, as FlashAttention-3 gives its dQ writer), which a Triton kernel cannot declare. Kept, tested under
the interpreter and compiled for sm_90 in CI, as the measured base of that next step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.kernels.attention import exp2_fwd, packed_rows
from h3gate.kernels.attention_bwd import _walk_descs, _walk_tiles
from h3gate.kernels.common import STRICT_LAUNCH
from h3gate.kernels.exact import helper, rne
from h3gate.kernels.gemm import mma


@helper
def _dq_handoff(ds_t, k, acc_ptr, sem, offs_m, pid_n, S, D: tl.constexpr, INTERPRET: tl.constexpr):
    """Extend the dq chain of query rows ``offs_m`` by this program's KV rows, once its predecessor has."""
    while tl.atomic_add(sem, 0, sem="acquire") != pid_n:
        pass
    offs_d = tl.arange(0, D)
    mask = offs_m[:, None] < S
    cell = acc_ptr + offs_m.to(tl.int64)[:, None] * D + offs_d[None, :]
    first = (tl.zeros_like(offs_m) + pid_n) == 0  # KV block 0 starts the chain at +0 (a tensor mask: Triton 3.9's
    acc = tl.load(cell, mask=mask & ~first[:, None], other=0.0, cache_modifier=".cg")  # interpreter refuses scalar ones
    acc = mma(tl.trans(ds_t), k, acc, INTERPRET)
    tl.store(cell, acc, mask=mask, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's store is issued before the release below
    tl.atomic_xchg(sem, pid_n + 1, sem="release")


@triton.jit
def _dq_finish_kernel(acc_ptr, dq_ptr, ord_ptr, S, H, sm_scale, stride_b, stride_s, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, ORDERED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``dq = cast(acc * 1/sqrt(D))`` stored at the packed rows: the dQ kernel's epilogue, on the finished chains."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask = offs_m[:, None] < S
    acc = tl.load(acc_ptr + (bh.to(tl.int64) * S + offs_m)[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    rows = base + packed_rows(ord_ptr, offs_m, S, ORDERED)[:, None] * stride_s + offs_d[None, :]
    tl.store(dq_ptr + rows, rne(acc * sm_scale, dq_ptr.dtype.element_ty, INTERPRET), mask=mask)


@helper
def _fused_block(k, v, dk, dv, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, acc_ptr, sem, base, stat, start,
                 S, stride_s, qk_scale, kv_valid, pid_n, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 D: tl.constexpr, MASK: tl.constexpr, EXP2: tl.constexpr, FMA: tl.constexpr, USE_TMA: tl.constexpr,
                 INTERPRET: tl.constexpr):  # fmt: skip
    """One query step of the dK/dV walk (``attention_bwd._dkdv_block``'s operations), then the dq handoff."""
    offs_m = start + tl.arange(0, BLOCK_M)
    q, do = _walk_tiles(q_ptr, do_ptr, q_desc, do_desc, base, start, S, stride_s, BLOCK_M, D, MASK, USE_TMA)
    if MASK:
        lse = tl.load(lse_ptr + stat + offs_m, mask=offs_m < S, other=0.0)
        dl = tl.load(delta_ptr + stat + offs_m, mask=offs_m < S, other=0.0)
    else:
        lse = tl.load(lse_ptr + stat + offs_m)
        dl = tl.load(delta_ptr + stat + offs_m)
    qk_t = mma(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), INTERPRET)
    if FMA:  # declared: one explicit fma per score (attention_bwd's docstring)
        p_t = exp2_fwd(tl.fma(qk_t, qk_scale, -lse[None, :]), EXP2, INTERPRET)
    else:
        p_t = exp2_fwd(qk_t * qk_scale - lse[None, :], EXP2, INTERPRET)
    if MASK:
        p_t = tl.where(offs_m[None, :] < S, p_t, 0.0)
    dv = mma(rne(p_t, do.dtype, INTERPRET), do, dv, INTERPRET)
    dp_t = mma(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), INTERPRET)
    ds_t = rne(p_t * (dp_t - dl[None, :]), q.dtype, INTERPRET)
    dk = mma(ds_t, q, dk, INTERPRET)
    ds_q = tl.where(kv_valid[:, None], ds_t, 0.0).to(ds_t.dtype)  # KV rows past S add nothing, as in the dQ kernel
    _dq_handoff(ds_q, k, acc_ptr + stat * D, sem + start // BLOCK_M, offs_m, pid_n, S, D, INTERPRET)
    return dk, dv


@triton.jit
def _fused_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, acc_ptr, sem_ptr, ord_ptr, S, H,
                  qk_scale, sm_scale, stride_b, stride_s, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, EXP2: tl.constexpr, FMA: tl.constexpr, ORDERED: tl.constexpr,
                  USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """q, dout: walked (canonical rows); k, v, dk, dv: through the order; acc: canonical rows. ``sem_ptr[0]`` is the
    ticket counter, ``sem_ptr[1 + bh * m_steps + j]`` query step j's semaphore of (batch x head) bh."""
    n_blocks = tl.cdiv(S, BLOCK_N)
    m_steps = tl.cdiv(S, BLOCK_M)
    ticket = tl.atomic_add(sem_ptr, 1)
    pid_n = ticket % n_blocks
    bh = ticket // n_blocks
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    stat = bh.to(tl.int64) * S
    sem = sem_ptr + 1 + bh * m_steps
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = base + packed_rows(ord_ptr, offs_n, S, ORDERED)[:, None] * stride_s + tl.arange(0, D)[None, :]
    kv_valid = offs_n < S
    k = tl.load(k_ptr + rows, mask=kv_valid[:, None], other=0.0)
    v = tl.load(v_ptr + rows, mask=kv_valid[:, None], other=0.0)
    q_desc, do_desc = _walk_descs(q_ptr, do_ptr, base, S, stride_s, BLOCK_M, D, USE_TMA)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    m_full = S // BLOCK_M
    for j in range(0, m_full):
        dk, dv = _fused_block(k, v, dk, dv, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, acc_ptr, sem, base,
                              stat, j * BLOCK_M, S, stride_s, qk_scale, kv_valid, pid_n, BLOCK_N, BLOCK_M, D, False,
                              EXP2, FMA, USE_TMA, INTERPRET)  # fmt: skip
    if m_full * BLOCK_M < S:
        dk, dv = _fused_block(k, v, dk, dv, q_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, acc_ptr, sem, base,
                              stat, m_full * BLOCK_M, S, stride_s, qk_scale, kv_valid, pid_n, BLOCK_N, BLOCK_M, D,
                              True, EXP2, FMA, USE_TMA, INTERPRET)  # fmt: skip
    dk = dk * sm_scale
    tl.store(dk_ptr + rows, rne(dk, dk_ptr.dtype.element_ty, INTERPRET), mask=kv_valid[:, None])
    tl.store(dv_ptr + rows, rne(dv, dv_ptr.dtype.element_ty, INTERPRET), mask=kv_valid[:, None])


def launch_fused(q_walk, k, v, do_walk, lse, delta, dq, dk, dv, ord_arg, ordered: bool, cfg, sm_scale: float,
                 c: float, tma: bool, interpret: bool) -> None:  # fmt: skip
    """Run the one-pass dK/dV/dQ kernel (``attention_bwd.backward`` prepares the operands)."""
    b, s, h, d = k.shape
    m_steps = triton.cdiv(s, cfg.kv_m)
    acc = torch.empty((b * h, s, d), dtype=torch.float32, device=k.device)
    sem = torch.zeros(1 + b * h * m_steps, dtype=torch.int32, device=k.device)
    _fused_kernel[(triton.cdiv(s, cfg.kv_n) * b * h,)](
        q_walk, k, v, do_walk, lse, delta, dk, dv, acc, sem, ord_arg, s, h, c, sm_scale, k.stride(0), k.stride(1),
        D=d, BLOCK_N=cfg.kv_n, BLOCK_M=cfg.kv_m, EXP2=cfg.bwd_exp2_code, FMA=cfg.bwd_fma, ORDERED=ordered,
        USE_TMA=tma, INTERPRET=interpret, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages, **STRICT_LAUNCH,
    )  # fmt: skip
    _dq_finish_kernel[(triton.cdiv(s, 64), b * h)](
        acc, dq, ord_arg, s, h, sm_scale, k.stride(0), k.stride(1), D=d, BLOCK_M=64, ORDERED=ordered,
        INTERPRET=interpret, num_warps=4, **STRICT_LAUNCH,
    )  # fmt: skip
