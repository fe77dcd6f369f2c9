"""The strict attention forward with TMA tile loads (the ``triton_tma`` path): the same walk and arithmetic as the
pointer kernel, other load instructions.

Per program (BLOCK_M query rows, batch, head) the kernel builds device-side tensor descriptors over its (batch,
head)'s (S, D) slices of q, k, v and out (row stride ``nh * D``, 16-byte aligned since D = 128) and loads the q
tile once and each (BLOCK_N, D) K/V block with TMA instead of per-thread pointer loads. TMA fills rows past S with
zeros, exactly the values the pointer kernel's masked loads give, and the tail block's scores are masked to -inf by
the shared :func:`h3gate.kernels.attention_math.fwd_step`, so every tile holds the pointer kernel's values and the same
online-softmax step runs on them: the declared contract (``attention.py``, ``attention.yaml``) is unchanged, and
the path is a load-path choice whose bytes the GPU evidence compares with the pointer kernel
(``tools/gpu_perf_probe.py --sections attn_tma``).

With a walk order the K/V operands arrive gathered into canonical order (contiguous: TMA walks them) and the query
block is read, and the output stored, through ``order[i]`` by pointers (TMA has no row gather on Hopper).

CUDA only: TMA does not exist under the CPU interpreter, which runs the pointer kernel (same arithmetic). Which
path a call runs is declared in the operator's manifest (:func:`h3gate.kernels.attention.paths`); both load paths
carry the one kernel id and contract (the bytes measured equal), and the launch record names the path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.kernels.attention_config import AttnConfig, qk_scale
from h3gate.kernels.attention_math import fwd_step, log2, packed_rows
from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, tma_allocator
from h3gate.kernels.exact import rne, zeros


@triton.jit
def _attn_fwd_tma_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, ord_ptr, S, H, qk_scale, stride_b, stride_s,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP2: tl.constexpr,
                         FMA: tl.constexpr, ORDERED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    k_desc = tl.make_tensor_descriptor(k_ptr + base, [S, D], [stride_s, 1], [BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(v_ptr + base, [S, D], [stride_s, 1], [BLOCK_N, D])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ORDERED:  # the query block through order[i] (pointers), the output stored the same way
        rows = base + packed_rows(ord_ptr, offs_m, S, ORDERED)[:, None] * stride_s + tl.arange(0, D)[None, :]
        q = tl.load(q_ptr + rows, mask=offs_m[:, None] < S, other=0.0)
    else:
        q = tl.make_tensor_descriptor(q_ptr + base, [S, D], [stride_s, 1], [BLOCK_M, D]).load([pid_m * BLOCK_M, 0])
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = zeros((BLOCK_M,), tl.float32)
    acc = zeros((BLOCK_M, D), tl.float32)
    n_full = S // BLOCK_N
    for j in tl.range(0, n_full):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        k = k_desc.load([j * BLOCK_N, 0])
        v = v_desc.load([j * BLOCK_N, 0])
        m_i, l_i, acc = fwd_step(q, k, v, m_i, l_i, acc, offs_n, S, qk_scale, BLOCK_M, BLOCK_N, False, EXP2, FMA,
                                 INTERPRET)  # fmt: skip
    if n_full * BLOCK_N < S:
        offs_n = n_full * BLOCK_N + tl.arange(0, BLOCK_N)
        k = k_desc.load([n_full * BLOCK_N, 0])
        v = v_desc.load([n_full * BLOCK_N, 0])
        m_i, l_i, acc = fwd_step(q, k, v, m_i, l_i, acc, offs_n, S, qk_scale, BLOCK_M, BLOCK_N, True, EXP2, FMA,
                                 INTERPRET)  # fmt: skip
    out = rne(tl.div_rn(acc, l_i[:, None]), o_ptr.dtype.element_ty, INTERPRET)
    if ORDERED:
        tl.store(o_ptr + rows, out, mask=offs_m[:, None] < S)
    else:  # rows past S are not written
        tl.make_tensor_descriptor(o_ptr + base, [S, D], [stride_s, 1], [BLOCK_M, D]).store([pid_m * BLOCK_M, 0], out)
    tl.store(lse_ptr + bh.to(tl.int64) * S + offs_m, m_i + log2(l_i, INTERPRET), mask=offs_m < S)


def forward_tma(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttnConfig, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`h3gate.kernels.attention.forward` with TMA loads (CUDA; q contiguous, k and v already in canonical
    order when ``order`` is given)."""
    b, s, h, d = q.shape
    out = torch.empty((b, s, h * d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b * h, s), dtype=torch.float32, device=q.device)
    triton.set_allocator(tma_allocator)  # device-side descriptors need scratch (a context variable: every launch)
    grid = (triton.cdiv(s, cfg.fwd_m), b * h)
    _attn_fwd_tma_kernel[grid](
        q, k, v, out, lse, q if order is None else order, s, h, qk_scale(d), q.stride(0), q.stride(1),
        D=d, BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, EXP2=cfg.exp2_code, FMA=cfg.fwd_fma,
        ORDERED=order is not None, INTERPRET=INTERPRET, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        **STRICT_LAUNCH,
    )  # fmt: skip
    return out, lse
