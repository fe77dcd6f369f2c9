"""The strict GEMM's forward with the operands swapped (``Y^T = W @ X^T``), for few rows: same contract, other tiles.

Why: at small M (the tiny layout's 264 rows) a tile of 64/128 *rows* leaves a mostly empty last row tile (264 =
2 x 128 + 8), and every row tile streams the whole weight again. With the operands swapped the MMA's M extent is a
block of weight rows (BLOCK_N output columns) and its N extent is a chunk of tokens, which the MMA allows in steps
of 8; Triton tiles are powers of two, so a chunk is ``BLOCK_M + TAIL_M`` tokens run as two dots (one chunk of
256 + 16 covers the 264 rows with 3 % padding, so each weight tile is read once per call).

Contract (the same as :mod:`h3gate.kernels.gemm`'s forward, so the bytes are too):

* maths - ``Y (M, N) = X (M, K) @ W^T + b``; the program owning weight rows [n0, n0 + BLOCK_N) and tokens
  [t0, t0 + BLOCK_M + TAIL_M) computes ``acc^T (BLOCK_N, chunk)``.
* reduction order - ascending BLOCK_K chunks of K, ``acc = dot(w_chunk, x_chunk^T, acc)`` in FP32, BLOCK_K the
  layer's (``gemm_configs``), never split; every output element (m, n) sums the same products over the same K chunks
  in the same order as in the unswapped kernel: the MMA's fixed order inside a chunk is per element, whichever operand
  holds the row. Measured, not assumed: bitwise equal to the production tiling (and cuBLAS) on the H200
  at M = 264 and 925 (88 runs), and ws1-ops' prefix probe checks it on every run.
* cast points - bias added in FP32, one round-to-nearest-even cast to the output dtype, stored transposed.
* row invariance - M is not a compile-time constant; a token's column in the chunk and the other tokens only decide
  where its sums sit in the tile, never what they add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH
from h3gate.kernels.exact import cdiv, f32, helper, rne, zeros
from h3gate.kernels.gemm_configs import GemmConfig


@helper
def _mma(w, x, acc, INTERPRET: tl.constexpr):
    """``acc + w @ x^T`` in FP32, x loaded as its stored (tokens, BLOCK_K) tile; interpreted BF16: exact upcast."""
    if w.dtype == tl.float32:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    elif INTERPRET:
        return tl.dot(f32(w, INTERPRET), tl.trans(f32(x, INTERPRET)), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(x), acc)


@helper
def _store(c_ptr, bias_ptr, acc, offs_n, mask_n, offs_t, M, stride_cm, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """Epilogue of one token block: ``cast(acc + float(b))`` stored at Y[t, n]."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out = rne(acc, c_ptr.dtype.element_ty, INTERPRET)
    ptrs = c_ptr + offs_t.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    tl.store(ptrs, out, mask=mask_n[:, None] & (offs_t[None, :] < M))


@triton.jit(do_not_specialize=["M"])
def _gemm_swapped_kernel(
    x_ptr, w_ptr, c_ptr, bias_ptr, M, N, K, stride_xm, stride_wn, stride_cm,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Tile (pid_n, pid_c): weight rows [pid_n * BLOCK_N, +BLOCK_N) x tokens [pid_c * CHUNK, +CHUNK), CHUNK =
    BLOCK_M + TAIL_M; the chunks of one weight block are adjacent programs (they share its weight tiles in L2)."""
    CHUNK: tl.constexpr = BLOCK_M + TAIL_M
    pid = tl.program_id(0)
    num_chunks = cdiv(M, CHUNK)
    pid_n = pid // num_chunks
    off_n = pid_n * BLOCK_N
    off_t = (pid % num_chunks) * CHUNK
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_t = off_t + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_t = offs_t < M
    acc = zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if TAIL_M > 0:
        offs_u = off_t + BLOCK_M + tl.arange(0, TAIL_M)
        mask_u = offs_u < M
        acc_u = zeros((BLOCK_N, TAIL_M), dtype=tl.float32)
    k_tiles = cdiv(K, BLOCK_K)
    if USE_TMA:  # out-of-bounds rows/columns are zero-filled by the TMA unit
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
        if TAIL_M > 0:
            u_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [TAIL_M, BLOCK_K])
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            w = w_desc.load([off_n, off_k])
            acc = _mma(w, x_desc.load([off_t, off_k]), acc, INTERPRET)
            if TAIL_M > 0:
                acc_u = _mma(w, u_desc.load([off_t + BLOCK_M, off_k]), acc_u, INTERPRET)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        if TAIL_M > 0:
            u_ptrs = x_ptr + offs_u.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        for ki in range(k_tiles):
            if EVEN_K:  # rows masked only (a K tail would add masked zeros: exact)
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                acc = _mma(w, tl.load(x_ptrs, mask=mask_t[:, None], other=0.0), acc, INTERPRET)
                if TAIL_M > 0:
                    acc_u = _mma(w, tl.load(u_ptrs, mask=mask_u[:, None], other=0.0), acc_u, INTERPRET)
            else:
                in_k = (offs_k < K - ki * BLOCK_K)[None, :]
                w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k, other=0.0)
                acc = _mma(w, tl.load(x_ptrs, mask=mask_t[:, None] & in_k, other=0.0), acc, INTERPRET)
                if TAIL_M > 0:
                    acc_u = _mma(w, tl.load(u_ptrs, mask=mask_u[:, None] & in_k, other=0.0), acc_u, INTERPRET)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            if TAIL_M > 0:
                u_ptrs += BLOCK_K
    _store(c_ptr, bias_ptr, acc, offs_n, mask_n, offs_t, M, stride_cm, HAS_BIAS, INTERPRET)
    if TAIL_M > 0:
        _store(c_ptr, bias_ptr, acc_u, offs_n, mask_n, offs_u, M, stride_cm, HAS_BIAS, INTERPRET)


def matmul_swapped(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig
) -> torch.Tensor:
    """``out (M, N) = x (M, K) @ w (N, K)^T [+ bias]``: contiguous tensors on one device, one dtype (checked by the
    caller, :func:`h3gate.kernels.gemm_triton.matmul`). TMA needs 16-byte aligned bases: the caller passes aligned
    ones."""
    m, n = out.shape
    k = x.shape[1]
    chunk = cfg.block_m + cfg.tail_m
    grid = (-(-n // cfg.block_n) * -(-m // chunk),)
    _gemm_swapped_kernel[grid](
        x, w, out, bias if bias is not None else out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, USE_TMA=cfg.tma and out.device.type == "cuda", INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **STRICT_LAUNCH,
    )  # fmt: skip
    return out
