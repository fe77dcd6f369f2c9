"""Backward of the strict full attention in one pass: the dK/dV walk also carries dQ's sums, in the same order.

The kernel is ``attention_bwd._dkdv_kernel`` with ``FUSED`` (its hand-off, ``_dq_handoff``, follows each query step);
this module launches it, finishes dq and says why the bytes are the three-kernel backward's.

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
* dK/dV are untouched: it is ``_dkdv_kernel`` itself. ``FUSED`` only adds the ticket and the hand-off; with it off the
  kernel compiles (Triton 3.6 and 3.7, sm_90) to the same PTX instructions as before the flag existed, up to register
  names and the order of a few address computations. The H200 probe ran at ``5993e28``, when the one-pass kernel was
  a separate copy of these operations.

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

from h3gate.kernels.attention import packed_rows
from h3gate.kernels.attention_bwd import _dkdv_kernel
from h3gate.kernels.common import STRICT_LAUNCH
from h3gate.kernels.exact import rne


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


def launch_fused(q_walk, k, v, do_walk, lse, delta, dq, dk, dv, ord_arg, ordered: bool, cfg, sm_scale: float,
                 c: float, tma: bool, interpret: bool) -> None:  # fmt: skip
    """Run the one-pass dK/dV/dQ kernel (``attention_bwd.backward`` prepares the operands)."""
    b, s, h, d = k.shape
    m_steps = triton.cdiv(s, cfg.kv_m)
    acc = torch.empty((b * h, s, d), dtype=torch.float32, device=k.device)
    sem = torch.zeros(1 + b * h * m_steps, dtype=torch.int32, device=k.device)
    _dkdv_kernel[(triton.cdiv(s, cfg.kv_n) * b * h,)](
        q_walk, k, v, do_walk, lse, delta, dk, dv, acc, sem, ord_arg, s, h, c, sm_scale, k.stride(0), k.stride(1),
        D=d, BLOCK_N=cfg.kv_n, BLOCK_M=cfg.kv_m, EXP2=cfg.bwd_exp2_code, FMA=cfg.bwd_fma, ORDERED=ordered,
        USE_TMA=tma, FUSED=True, INTERPRET=interpret, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
        **STRICT_LAUNCH,
    )  # fmt: skip
    _dq_finish_kernel[(triton.cdiv(s, 64), b * h)](
        acc, dq, ord_arg, s, h, sm_scale, k.stride(0), k.stride(1), D=d, BLOCK_M=64, ORDERED=ordered,
        INTERPRET=interpret, num_warps=4, **STRICT_LAUNCH,
    )  # fmt: skip
