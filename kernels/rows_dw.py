"""The GEMM weight gradient in the row-segment order, evaluated inside one program per dW tile (no partial buffers).

``dW = dY^T X`` (N_loc, K_loc) and ``db = sum_rows dY`` (N_loc,) over the packed rows of ``dY`` (B, S_loc, N_loc) and
``X`` (B, S_loc, K_loc), in :mod:`h3gate.kernels.row_merge`'s order. Contract:

* segments - the 4 row segments ``[r'_j, r'_j+1)``, ``r'_j = min(j * L', S)``, ``L' = 2 ceil(S / 8)`` of the GLOBAL S
  packed rows (a function of S alone: the pairs of the 8 row segments, :func:`h3gate.kernels.row_merge.dw_bounds`); a CP
  rank (n <= 4) owns segments ``[c * 4/n, (c + 1) * 4/n)``, its local rows shifted by its first row. A segment's rows
  are walked b-major (batch item 0's rows of the segment, then item 1's, ...), exactly the rows
  ``seq_slice(t, lo, hi).reshape(-1, width)`` lists.
* per segment (dW) - one program per BLOCK_M x BLOCK_N tile of dW (persistent: tiles pid, pid + #programs, ...)
  walks each owned segment's rows from ``acc = 0`` in FP32 in ascending BLOCK_K-row chunks,
  ``acc = dot(dY_chunk^T, X_chunk, acc)`` (:func:`h3gate.kernels.exact.mma`: BF16 on the tensor cores with an FP32
  accumulator, FP32 as an IEEE FMA dot), a masked tail adding exact zeros at the segment's end: the loads and MMA of
  the single-walk dW kernel (:func:`h3gate.kernels.gemm_triton.matmul`, ``a_trans``) launched on that segment's rows
  alone, with the full layer's ``gemm_config("dw", N, K, dtype)`` BLOCK_K; an empty segment gives +0.
* per segment (db) - the colsum kernel's walk on the segment's rows: ascending 32-row chunks, each reduced by
  ``tl.sum``'s fixed tree (the same (32, 128) tile and 4 warps as :func:`h3gate.kernels.gemm_triton.colsum`), FP32.
* tree - ``(q0 + q1) + (q2 + q3)`` in IEEE FP32 adds (no FMA: STRICT_LAUNCH), each add done as soon as its sibling
  is: dW's pending subtrees (at most two) in the program's own scratch slots (as :mod:`h3gate.kernels.gemm_merge`),
  db's in registers. A rank evaluates the levels over its owned segments.
* cast points - ``finish``: when the device owns all 4 segments, one RNE rounding to the output dtype in the epilogue;
  else the FP32 subtree, which the caller all-gathers, combines (:meth:`RowGroup.merge`) and rounds.

Bitwise the single-walk dW kernel launched once per segment into FP32 partials and the tree added by torch
(``tests/triton_kernels/rows_dw_reference.py``): the same products added in the same order. The tile shape (BLOCK_N
capped at 128 so the accumulator and a slot tile fit the registers), the grid, the tile order and the loads (pointer
loads; TMA loads with the tail chunk's rows past the segment zeroed on chip where ``GemmLaunch.rows_dw_tma``, off until
measured) are scheduling, never arithmetic.

Predicted gain (H200: ~4.8 TB/s HBM, ~990 TFLOP/s dense BF16). Per weight (N, K) v1 moved about 186 N K bytes beside
the GEMM: 8 FP32 partials written (32 N K), copied by ``torch.cat`` (64 N K), 7 tree adds (84 N K), the rounding
(6 N K). This kernel writes the 2 N K rounded bytes and keeps 3 slot stores and loads per tile in L2 (the per-program
slots, 132 x 2 x 64 KiB = 17 MiB, are reused tile after tile; 7 with the 8 segments the order had until 2026-12-07).
The GEMM's own work is 2 M N K FLOPs:

=========================  =========  ==========  ============  ==========  ==============
weight (N x K)             M          GEMM (ms)   v1 bytes      v1 (ms)     v1 / GEMM
=========================  =========  ==========  ============  ==========  ==============
q, k, v, o (7168 x 5376)   3160       0.25        7.2 GB        1.5         6.1
gate_up (28672 x 5376)     3160       0.98        28.7 GB       6.0         6.1
down (5376 x 14336)        3160       0.49        14.3 GB       3.0         6.1
q, k, v, o                 38974      3.0         7.2 GB        1.5         0.5
gate_up                    38974      12.0        28.7 GB       6.0         0.5
=========================  =========  ==========  ============  ==========  ==============

At medium (M = 3160) the six weights' v1 traffic, about 72 GB (15 ms), is six times their 2.5 ms of dense GEMM: the
backward's 28 ms over the single walk (bench ws1-block, H200) is this traffic and the launches around it. At 768p
(M = 38974) the same 15 ms sits beside 30 ms of GEMM. Predicted: the seg8 block backward loses ~15 ms of its 28 ms
excess at medium and most of its excess at 768p; the rest is the slots (L2) and BLOCK_N 128 against the single walk's
256-wide TMA tiles.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, num_sms, tma_allocator
from h3gate.kernels.exact import cdiv, fold_segment, helper, mma, rne, zeros, zeros_like
from h3gate.kernels.gemm_configs import PRODUCTION, GemmConfig, GemmLaunch, gemm_config
from h3gate.kernels.gemm_triton import tile_coords
from h3gate.kernels.row_merge import RowGroup, dw_bounds

SMEM_LIMIT = 232448  # bytes of shared memory per block on the H100/H200 (the tightest target)
COLSUM_ROWS, COLSUM_WIDTH, COLSUM_WARPS = 32, 128, 4  # gemm_triton.colsum's tile and warps: its tl.sum tree


def fp32_out_config(cfg: GemmConfig, dtype: torch.dtype) -> GemmConfig:
    """The dW tiling with an FP32 output: the same tile and BLOCK_K (so the same MMA sequence per element), the
    pipeline depth lowered until the input stages and the FP32 epilogue tile fit in shared memory. ``num_stages``
    only decides how many chunks are loaded ahead, never what is added or in which order."""
    elt = torch.tensor([], dtype=dtype).element_size()
    stages = cfg.num_stages
    while (
        stages > 1
        and stages * (cfg.block_m + cfg.block_n) * cfg.block_k * elt + cfg.block_m * cfg.block_n * 4 > SMEM_LIMIT
    ):
        stages -= 1
    return replace(cfg, num_stages=stages)


def fused_dw_config(full: tuple[int, int], dtype: torch.dtype) -> GemmConfig:
    """The full layer's dW tiling (its BLOCK_K fixes the row chunks) with BLOCK_N capped at 128, persistent, pointer
    loads, the pipeline depth fitted to an FP32 epilogue tile (:func:`fp32_out_config`)."""
    cfg = gemm_config("dw", full[0], full[1], dtype)
    cfg = replace(cfg, block_n=min(cfg.block_n, 128), persistent=True, tma=False, tail_block_n=0)
    return fp32_out_config(cfg, dtype)


@helper
def _bounds(seg, L, S_GLOB, LO):
    """Local rows ``[lo, hi)`` of global segment ``seg``: ``min(seg * L, S) - LO``, ``min((seg + 1) * L, S) - LO``."""
    return tl.minimum(seg * L, S_GLOB) - LO, tl.minimum((seg + 1) * L, S_GLOB) - LO


@helper
def _rows(j, lo, seg_rows, S_LOC, BATCHED: tl.constexpr):
    """Flat row of the segment's j-th row in b-major order: ``(j // rows) * S_LOC + lo + j % rows`` (int64)."""
    if BATCHED:
        b = j // seg_rows
        return (b * S_LOC + lo + (j - b * seg_rows)).to(tl.int64)
    else:
        return (lo + j).to(tl.int64)


@helper
def _walk(g_ptr, x_ptr, offs_m, offs_n, mask_m, mask_n, lo, seg_rows, length, S_LOC, stride_g, stride_x,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BATCHED: tl.constexpr,
          INTERPRET: tl.constexpr):  # fmt: skip
    """One segment of one dW tile: its ``length`` rows in ascending BLOCK_K chunks from acc = 0 (FP32), the single
    walk's ``a_trans`` loads (dY's (BLOCK_K, BLOCK_M) tile transposed on chip, X's (BLOCK_K, BLOCK_N) tile) and
    MMA, rows past the segment's end masked to zero."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(cdiv(length, BLOCK_K)):
        j = ki * BLOCK_K + offs_k
        in_k = j < length
        row = _rows(j, lo, seg_rows, S_LOC, BATCHED)
        a = tl.trans(tl.load(g_ptr + row[:, None] * stride_g + offs_m[None, :], mask=in_k[:, None] & mask_m[None, :],
                             other=0.0))  # fmt: skip
        b = tl.load(x_ptr + row[:, None] * stride_x + offs_n[None, :], mask=in_k[:, None] & mask_n[None, :], other=0.0)
        acc = mma(a, b, acc, INTERPRET)
    return acc


@helper
def _walk_tma(a_desc, b_desc, off_m, off_n, lo, length, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """:func:`_walk` with TMA tile loads (one item, rows ``lo + [0, length)``): the whole chunks as loaded, then the
    tail chunk with its rows past the segment's end set to zero before the MMA (the same values as the masked loads;
    rows past the tensor's end are zero-filled by the TMA unit)."""
    acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    full = length // BLOCK_K
    for ki in range(full):
        a = tl.trans(a_desc.load([lo + ki * BLOCK_K, off_m]))
        acc = mma(a, b_desc.load([lo + ki * BLOCK_K, off_n]), acc, INTERPRET)
    if length > full * BLOCK_K:
        in_k = (tl.arange(0, BLOCK_K) < length - full * BLOCK_K)[:, None]
        a = a_desc.load([lo + full * BLOCK_K, off_m])
        b = b_desc.load([lo + full * BLOCK_K, off_n])
        acc = mma(tl.trans(tl.where(in_k, a, zeros_like(a))), tl.where(in_k, b, zeros_like(b)), acc, INTERPRET)
    return acc


@triton.jit(do_not_specialize=["S_LOC", "L", "S_GLOB", "LO", "SEG0", "NUM_PROGS"])
def _rows_dw_kernel(
    g_ptr, x_ptr, out_ptr, scratch_ptr, N, K, S_LOC, BATCH, L, S_GLOB, LO, SEG0, stride_g, stride_x, stride_o,
    NUM_PROGS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    C: tl.constexpr, FINISH: tl.constexpr, BATCHED: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """OUT (N, K) = the tree over the C owned segments SEG0, ..., SEG0 + C - 1 of dY^T X, per tile: each segment
    walked from acc = 0, pending subtrees in this program's scratch slots (slot l: a finished subtree of 2^l
    segments), merged as soon as their sibling is done. ``FINISH``: one RNE rounding to OUT's dtype; else OUT is
    the FP32 subtree. Persistent: program ``pid`` owns tiles pid, pid + NUM_PROGS, ... and its two slots."""
    pid = tl.program_id(0)
    num_pid_m = cdiv(N, BLOCK_M)
    num_pid_n = cdiv(K, BLOCK_N)
    if USE_TMA:  # one batch item (BATCHED False): the segment's rows are contiguous
        a_desc = tl.make_tensor_descriptor(g_ptr, [S_LOC, N], [stride_g, 1], [BLOCK_K, BLOCK_M])
        b_desc = tl.make_tensor_descriptor(x_ptr, [S_LOC, K], [stride_x, 1], [BLOCK_K, BLOCK_N])
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    slots = scratch_ptr + pid.to(tl.int64) * (2 * BLOCK_M * BLOCK_N) + tile
    for tile_id in range(pid, num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < N
        mask_n = offs_n < K
        acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(C):
            lo, hi = _bounds(pid * 0 + SEG0 + j, L, S_GLOB, LO)  # scalar tensors, compiled and interpreted
            if USE_TMA:
                acc = _walk_tma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, lo, hi - lo, BLOCK_M, BLOCK_N,
                                BLOCK_K, INTERPRET)  # fmt: skip
            else:
                acc = _walk(g_ptr, x_ptr, offs_m, offs_n, mask_m, mask_n, lo, hi - lo, BATCH * (hi - lo), S_LOC,
                            stride_g, stride_x, BLOCK_M, BLOCK_N, BLOCK_K, BATCHED, INTERPRET)  # fmt: skip
            acc = fold_segment(acc, slots, j, C - 1, BLOCK_M, BLOCK_N)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
        if FINISH:
            tl.store(out_ptrs, rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask_m[:, None] & mask_n[None, :])
        else:
            tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["S_LOC", "L", "S_GLOB", "LO", "SEG0"])
def _rows_colsum_kernel(
    g_ptr, out_ptr, N, S_LOC, BATCH, L, S_GLOB, LO, SEG0, stride_g, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    C: tl.constexpr, FINISH: tl.constexpr, BATCHED: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out (N,) = the tree over the C owned segments of the column sums of dY: per segment ascending BLOCK_R-row
    chunks from acc = 0, each chunk reduced by tl.sum's fixed tree (the colsum kernel's walk); the tree's pending
    subtrees in registers. ``FINISH``: one RNE rounding to out's dtype; else the FP32 subtree."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    s0 = zeros((BLOCK_N,), dtype=tl.float32)
    s1 = zeros((BLOCK_N,), dtype=tl.float32)
    s2 = zeros((BLOCK_N,), dtype=tl.float32)
    acc = zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(C):
        lo, hi = _bounds(pid * 0 + SEG0 + j, L, S_GLOB, LO)
        length = BATCH * (hi - lo)
        acc = zeros((BLOCK_N,), dtype=tl.float32)
        for m0 in range(0, length, BLOCK_R):
            jj = m0 + offs_r
            row = _rows(jj, lo, hi - lo, S_LOC, BATCHED)
            ptrs = g_ptr + row[:, None] * stride_g + offs_n[None, :]
            g = tl.load(ptrs, mask=(jj[:, None] < length) & mask_n[None, :], other=0.0).to(tl.float32)
            acc = acc + tl.sum(g, axis=0)
        if j % 2 == 1:
            acc = s0 + acc
        if j % 4 == 3:
            acc = s1 + acc
        if j % 8 == 7:
            acc = s2 + acc
        if j != C - 1:
            if j % 2 == 0:
                s0 = acc
            elif j % 4 == 1:
                s1 = acc
            else:
                s2 = acc
    if FINISH:
        tl.store(out_ptr + offs_n, rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, acc, mask=mask_n)


def _segments(rows: RowGroup) -> dict:
    """The kernels' segment arguments of ``rows``: L' (the pair segments' length), S, the rank's first row, its first
    owned segment and how many it owns (C)."""
    owned = rows.dw_owned
    return dict(L=dw_bounds(rows.seq_len)[1], S_GLOB=rows.seq_len, LO=rows.lo, SEG0=owned.start, C=len(owned))


def _tma_fits(g: torch.Tensor, x: torch.Tensor) -> bool:
    """TMA loads on CUDA for one batch item whose bases and row strides are 16-byte aligned (else the pointer walk:
    the same chunks, values and MMA)."""
    return (g.is_cuda and not INTERPRET and g.shape[0] == 1 and all(t.data_ptr() % 16 == 0
            and (t.shape[-1] * t.element_size()) % 16 == 0 for t in (g, x)))  # fmt: skip


def rows_dw(
    g: torch.Tensor,
    x: torch.Tensor,
    rows: RowGroup,
    cfg: GemmConfig,
    dtype: torch.dtype | None,
    launch: GemmLaunch = PRODUCTION,
) -> torch.Tensor:
    """dW (N_loc, K_loc) of contiguous ``g`` (B, S_loc, N_loc) and ``x`` (B, S_loc, K_loc) over ``rows``' owned
    segments: rounded to ``dtype`` (the device owns all 4 segments), or the FP32 subtree (``dtype`` None). TMA loads
    where ``launch.rows_dw_tma`` and the operands allow them."""
    batch, s_loc, n = g.shape
    k = x.shape[-1]
    tma = launch.rows_dw_tma and _tma_fits(g, x)
    if tma:
        triton.set_allocator(tma_allocator)
    out = torch.empty((n, k), dtype=dtype or torch.float32, device=x.device)
    tiles = -(-n // cfg.block_m) * -(-k // cfg.block_n)
    progs = max(1, min(tiles, num_sms(x.device)))
    scratch = torch.empty((progs, 2, cfg.block_m, cfg.block_n), dtype=torch.float32, device=x.device)
    _rows_dw_kernel[(progs,)](
        g, x, out, scratch, n, k, s_loc, batch, **_segments(rows), stride_g=n, stride_x=k, stride_o=k,
        NUM_PROGS=progs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FINISH=dtype is not None, BATCHED=batch > 1, USE_TMA=tma, INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **STRICT_LAUNCH,
    )  # fmt: skip
    return out


def rows_colsum(g: torch.Tensor, rows: RowGroup, dtype: torch.dtype | None) -> torch.Tensor:
    """db (N_loc,) = the column sums of contiguous ``g`` (B, S_loc, N_loc) over ``rows``' owned segments: rounded to
    ``dtype``, or the FP32 subtree (``dtype`` None)."""
    batch, s_loc, n = g.shape
    out = torch.empty(n, dtype=dtype or torch.float32, device=g.device)
    _rows_colsum_kernel[(triton.cdiv(n, COLSUM_WIDTH),)](
        g, out, n, s_loc, batch, **_segments(rows), stride_g=n, BLOCK_R=COLSUM_ROWS, BLOCK_N=COLSUM_WIDTH,
        FINISH=dtype is not None, BATCHED=batch > 1, INTERPRET=INTERPRET,
        num_warps=COLSUM_WARPS, **STRICT_LAUNCH,
    )  # fmt: skip
    return out
