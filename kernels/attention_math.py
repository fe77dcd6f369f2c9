"""Shared pieces of the strict attention's Triton kernels: the exp2 / log2 forms, the walk order's row addressing and
one online-softmax step (the forward's arithmetic, shared by the pointer and TMA kernels), and the host gather of a
walked operand into canonical order."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.language.extra import libdevice

from h3gate.kernels.exact import helper, mma, rne, zeros


@helper
def exp2(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp2(x)
    else:
        return libdevice.exp2(x)


@helper
def exp2_fwd(x, EXP2: tl.constexpr, INTERPRET: tl.constexpr):
    """exp2 of the forward / backward recomputation: libdevice (EXP2=0) or the declared PTX
    ``ex2.approx[.ftz].f32`` (1, 2)."""
    if INTERPRET:
        return tl.exp2(x)
    elif EXP2 == 2:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif EXP2 == 1:
        return tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return libdevice.exp2(x)


@helper
def log2(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.log2(x)
    else:
        return libdevice.log2(x)


@helper
def packed_rows(ord_ptr, offs, S, ORDERED: tl.constexpr):
    """The packed rows of canonical rows ``offs``: ``order[offs]`` (row 0 past S: those loads are masked), or
    ``offs`` itself without an order."""
    if ORDERED:
        return tl.load(ord_ptr + offs, mask=offs < S, other=0)
    else:
        return offs


@helper
def fwd_step(q, k, v, m_i, l_i, acc, offs_n, S, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK: tl.constexpr, EXP2: tl.constexpr, FMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One KV block of the online softmax (module docstring) on loaded k, v tiles (rows past S zero, masked)."""
    if FMA:  # declared: one explicit fma per score (see the module docstring)
        qk = mma(q, tl.trans(k), zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET)
        if MASK:
            qk = tl.where(offs_n[None, :] < S, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = exp2_fwd(tl.fma(qk, qk_scale, -m_new[:, None]), EXP2, INTERPRET)
    else:
        s = mma(q, tl.trans(k), zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET) * qk_scale
        if MASK:
            s = tl.where(offs_n[None, :] < S, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = exp2_fwd(s - m_new[:, None], EXP2, INTERPRET)
    alpha = exp2_fwd(m_i - m_new, EXP2, INTERPRET)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = mma(rne(p, v.dtype, INTERPRET), v, acc, INTERPRET)
    return m_new, l_i, acc


def gather_rows(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A walked operand's rows (dim 1) in canonical order: ``t[:, order]``, a contiguous copy (``t`` without one)."""
    return t if order is None else t.index_select(1, order)
