"""The strict GEMM's Triton kernels: ``C = A @ B [+ bias]`` over one ascending BLOCK_K walk, and the fixed-order
column sum of the bias gradient. The contract (maths, reduction order, cast points, row invariance) is
:mod:`h3gate.kernels.gemm`'s; tilings come from :mod:`h3gate.kernels.gemm_configs`.

* ``matmul`` - one program owns one (BLOCK_M x BLOCK_N) output tile (a persistent program walks tiles ``pid``,
  ``pid + programs``, ... in the GROUP_M-swizzled order of :func:`tile_coords`) and walks the reduction in ascending
  BLOCK_K chunks, ``acc = dot(a_chunk, b_chunk, acc)`` in FP32 from zero (:func:`h3gate.kernels.exact.mma`); a masked
  tail adds exact zeros; the bias is added in FP32 and the tile rounded once (RNE) to the output dtype. Operands are
  loaded as tiles of their stored row-major layouts (pointer loads, or TMA descriptors with ``GemmConfig.tma``) and
  transposed on chip; a swapped forward tiling runs :func:`h3gate.kernels.gemm_swapped.matmul_swapped`.
* ``colsum`` - ``out[n] = sum_m g[m, n]``: rows in ascending 32-row chunks, each chunk reduced by ``tl.sum``'s fixed
  tree, FP32, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, aligned, num_sms, tma_allocator
from h3gate.kernels.exact import cdiv, helper, mma, rne, zeros
from h3gate.kernels.gemm_configs import GemmConfig, tail_split
from h3gate.kernels.gemm_swapped import matmul_swapped


@helper
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped (GROUP_M-swizzled) tile order: a scheduling choice only."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % size_m
    pid_n = (tile_id % in_group) // size_m
    return pid_m, pid_n


@helper
def _tile(
    a_ptr, b_ptr, c_ptr, bias_ptr, a_desc, b_desc, c_desc, off_m, off_n, M, N, R,
    stride_am, stride_ar, stride_br, stride_bn, stride_cm, k_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_R: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M x BLOCK_N) output tile at (off_m, off_n): the ascending BLOCK_K walk, bias, one rounding."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # Out-of-bounds rows/columns are zero-filled by the TMA unit.
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_TRANS:
                a = tl.trans(a_desc.load([off_k, off_m]))
            else:
                a = a_desc.load([off_m, off_k])
            if B_TRANS:
                b = tl.trans(b_desc.load([off_n, off_k]))
            else:
                b = b_desc.load([off_k, off_n])
            acc = mma(a, b, acc, INTERPRET)
    else:
        # Every operand is read as the tile of its *stored* layout (unit stride along the tile's last axis, so the
        # loads coalesce along the contiguous dimension) and transposed in registers/shared memory.
        offs_k = tl.arange(0, BLOCK_K)
        if A_TRANS:  # stored (R, M): load the (BLOCK_K, BLOCK_M) tile
            a_ptrs = a_ptr + offs_k.to(tl.int64)[:, None] * stride_ar + offs_m[None, :] * stride_am
        else:
            a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ar
        if B_TRANS:  # stored (N, R): load the (BLOCK_N, BLOCK_K) tile
            b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :] * stride_br
        else:
            b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * stride_br + offs_n[None, :] * stride_bn
        for ki in range(k_tiles):
            if EVEN_R:
                if A_TRANS:
                    a = tl.trans(tl.load(a_ptrs, mask=mask_m[None, :], other=0.0))
                else:
                    a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                if B_TRANS:
                    b = tl.trans(tl.load(b_ptrs, mask=mask_n[:, None], other=0.0))
                else:
                    b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                in_k = offs_k < R - ki * BLOCK_K
                if A_TRANS:
                    a = tl.trans(tl.load(a_ptrs, mask=in_k[:, None] & mask_m[None, :], other=0.0))
                else:
                    a = tl.load(a_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
                if B_TRANS:
                    b = tl.trans(tl.load(b_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0))
                else:
                    b = tl.load(b_ptrs, mask=in_k[:, None] & mask_n[None, :], other=0.0)
            acc = mma(a, b, acc, INTERPRET)
            a_ptrs += BLOCK_K * stride_ar
            b_ptrs += BLOCK_K * stride_br
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    out = rne(acc, c_ptr.dtype.element_ty, INTERPRET)
    if USE_TMA:
        c_desc.store([off_m, off_n], out)
    else:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M", "NUM_PROGS", "N_SPLIT"])
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    R,
    stride_am,
    stride_ar,
    stride_br,
    stride_bn,
    stride_cm,
    NUM_PROGS,
    N_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_R: tl.constexpr,
    A_TRANS: tl.constexpr,
    B_TRANS: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """C (M, N) = A (M, R) @ B (R, N) [+ bias (N,)], A and B addressed through strides.

    ``A_TRANS``: A is stored as (R, M) row-major (stride_am == 1); ``B_TRANS``: B is stored as (N, R) row-major
    (stride_br == 1). Both variants (pointer and TMA) load the tile of the stored layout, contiguous along its last
    axis, and ``tl.trans`` it on chip: the MMA sees the same values, so the arithmetic is unchanged.

    Columns [0, N_SPLIT) are covered by BLOCK_N-wide tiles; with ``TAIL_N > 0`` (persistent launches only) columns
    [N_SPLIT, N) are then covered by TAIL_N-wide tiles, dealt out round robin from the program after the one that
    took the last wide tile. Without a tail N_SPLIT == N. Either way each output element gets the same K walk.
    """
    pid = tl.program_id(0)
    num_pid_m = cdiv(M, BLOCK_M)
    num_pid_n = cdiv(N_SPLIT, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = cdiv(R, BLOCK_K)
    if USE_TMA:
        if A_TRANS:
            a_desc = tl.make_tensor_descriptor(a_ptr, [R, M], [stride_ar, 1], [BLOCK_K, BLOCK_M])
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, [M, R], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_TRANS:
            b_desc = tl.make_tensor_descriptor(b_ptr, [N, R], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, [R, N], [stride_br, 1], [BLOCK_K, BLOCK_N])
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
    else:
        a_desc, b_desc, c_desc = a_ptr, b_ptr, c_ptr  # unused: the pointer path
    for tile_id in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        _tile(
            a_ptr, b_ptr, c_ptr, bias_ptr, a_desc, b_desc, c_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, R,
            stride_am, stride_ar, stride_br, stride_bn, stride_cm, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS,
            EVEN_R, A_TRANS, B_TRANS, USE_TMA, INTERPRET,
        )  # fmt: skip
    if TAIL_N > 0:
        if USE_TMA:
            if B_TRANS:
                bt_desc = tl.make_tensor_descriptor(b_ptr, [N, R], [stride_bn, 1], [TAIL_N, BLOCK_K])
            else:
                bt_desc = tl.make_tensor_descriptor(b_ptr, [R, N], [stride_br, 1], [BLOCK_K, TAIL_N])
            ct_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, TAIL_N])
        else:
            bt_desc, ct_desc = b_ptr, c_ptr
        num_pid_t = cdiv(N - N_SPLIT, TAIL_N)
        first = (pid + NUM_PROGS - num_tiles % NUM_PROGS) % NUM_PROGS
        for tile_id in tl.range(first, num_pid_m * num_pid_t, NUM_PROGS, flatten=FLATTEN):
            pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_t, GROUP_M)
            _tile(
                a_ptr, b_ptr, c_ptr, bias_ptr, a_desc, bt_desc, ct_desc, pid_m * BLOCK_M, N_SPLIT + pid_n * TAIL_N,
                M, N, R, stride_am, stride_ar, stride_br, stride_bn, stride_cm, k_tiles, BLOCK_M, TAIL_N, BLOCK_K,
                HAS_BIAS, EVEN_R, A_TRANS, B_TRANS, USE_TMA, INTERPRET,
            )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _colsum_kernel(g_ptr, out_ptr, M, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """out[n] = sum_m g[m, n]: rows in ascending BLOCK_R chunks, each chunk reduced by tl.sum's fixed tree; FP32."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_R):
        offs_r = m0 + tl.arange(0, BLOCK_R)
        ptrs = g_ptr + offs_r.to(tl.int64)[:, None] * N + offs_n[None, :]
        g = tl.load(ptrs, mask=(offs_r[:, None] < M) & mask_n[None, :], other=0.0).to(tl.float32)
        acc = acc + tl.sum(g, axis=0)
    tl.store(out_ptr + offs_n, rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask_n)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemmConfig,
    *,
    a_trans: bool,
    b_trans: bool,
) -> torch.Tensor:
    """``out (M, N) = A @ B [+ bias]`` with FP32 accumulation and one rounding into ``out``'s dtype.

    ``a`` is (M, R) row-major, or (R, M) row-major when ``a_trans``; ``b`` is (R, N) row-major, or (N, R)
    row-major when ``b_trans``. All tensors contiguous, on one device, of one floating dtype.
    """
    m, n = out.shape
    r = a.shape[0] if a_trans else a.shape[1]
    stride_am, stride_ar = (1, a.stride(0)) if a_trans else (a.stride(0), 1)
    stride_br, stride_bn = (1, b.stride(0)) if b_trans else (b.stride(0), 1)
    tma = cfg.tma and out.device.type == "cuda"
    if tma:
        a, b = aligned(a), aligned(b)
        triton.set_allocator(tma_allocator)  # a context variable: set on every launch (autograd threads too)
    if cfg.swap_ab:
        if a_trans or not b_trans:
            raise ValueError(f"GemmConfig {cfg.tag}: swap_ab is a forward tiling (X (M, K) @ W (N, K)^T)")
        return matmul_swapped(a, b, out, bias, cfg)
    m_tiles = -(-m // cfg.block_m)  # ceil divisions (triton.cdiv is a jit wrapper: slower)
    tiles = m_tiles * -(-n // cfg.block_n)
    progs = min(tiles, num_sms(out.device)) if cfg.persistent else tiles
    n_split = tail_split(m_tiles, n, cfg.block_n, cfg.tail_block_n, progs) if cfg.tail_block_n else None
    target = out if not tma or out.data_ptr() % 16 == 0 else torch.empty_like(out)
    _gemm_kernel[(progs,)](
        a,
        b,
        target,
        bias if bias is not None else target,
        m,
        n,
        r,
        stride_am,
        stride_ar,
        stride_br,
        stride_bn,
        target.stride(0),
        progs,
        n if n_split is None else n_split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        TAIL_N=0 if n_split is None else cfg.tail_block_n,
        GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None,
        EVEN_R=r % cfg.block_k == 0,
        A_TRANS=a_trans,
        B_TRANS=b_trans,
        USE_TMA=tma,
        FLATTEN=cfg.persistent,
        INTERPRET=INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **STRICT_LAUNCH,
    )
    if target is not out:
        out.copy_(target)
    return out


def colsum(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fixed-order column sum of a contiguous (M, N) tensor, FP32 accumulation, one rounding to ``dtype``."""
    m, n = g.shape
    out = torch.empty(n, dtype=dtype, device=g.device)
    block_n = 128
    _colsum_kernel[(triton.cdiv(n, block_n),)](
        g, out, m, n, BLOCK_R=32, BLOCK_N=block_n, INTERPRET=INTERPRET, num_warps=4, **STRICT_LAUNCH
    )
    return out
