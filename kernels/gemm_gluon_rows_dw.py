"""The GEMM weight gradient in the row-segment order (:mod:`h3gate.kernels.rows_dw`, one device, all 4 segments, one
rounding) as a warp-specialised persistent Gluon kernel for Hopper, bfloat16: the producer / consumer structure of
:mod:`h3gate.kernels.gemm_gluon` and the consumers, tree and slots of :mod:`h3gate.kernels.gemm_gluon_seg8`.

Arithmetic (``rows_dw``'s, element for element). ``dW (N, K) = dY^T X``, dY (S, N) and X (S, K) row-major, one batch
item. The rows are cut into the 4 segments ``[r'_i, r'_i+1)``, ``r'_i = min(i * L', S)``, ``L' = 2 ceil(S / 8)``
(:func:`h3gate.kernels.row_merge.dw_bounds`; NOT at multiples of BLOCK_K). Segment i is walked from a zero FP32
accumulator in ascending BLOCK_K-row chunks starting at its own first row ``r'_i``, each chunk the ``wgmma`` k16 steps
of the single-walk dW kernel (``gemm_triton.matmul(..., a_trans=True)``, which loads the stored (BLOCK_K x 128) tiles
and transposes dY on chip; here the same boxes are fed as MN-major shared-memory views: :func:`gemm_gluon._mma_chunk`'s
``AB_ROWS``). The tail chunk's rows past the segment's end add exact zeros in both operands: each segment has its own
pair of TMA descriptors whose global shape is the segment's rows alone (base at row ``r'_i``, ``r'_i * width * 2``
bytes: 16-byte aligned for widths that are multiples of 8), so the TMA unit zero-fills them; no shared-memory pass. An
empty segment (S < 4 L') gives +0. The tree ``(p0 + p1) + (p2 + p3)`` and its slots are the seg8 forward's on-chip
layout (level 1 in registers, level 2 in shared memory; ``NSEG`` 4: no global slot; IEEE FP32 adds without contraction);
one RNE rounding to bfloat16, stored from registers. The bytes equal ``rows_dw``'s, measured on an H100
(``tools/gpu_seg8_gluon_dw_check.py``, docs/measurements/h100/seg8-gluon-dw4-check.json).

Segments as chunk counts: the consumers' walk (``gemm_gluon_seg8._segment``) gives segment j the chunks
``[min(j cps, T), min((j + 1) cps, T))`` of a chunk sequence of T. With ``cps = ceil(L' / BLOCK_K)`` and
``T = sum_i ceil(len_i / BLOCK_K)`` this is every segment's own chunk count: the segments before the one holding row
S - 1 are whole (L rows, cps chunks), that one has ``ceil(len / BLOCK_K)`` <= cps, the rest none. The producer loads
chunk c of segment j at row ``c * BLOCK_K`` of segment j's descriptors.

Tiling (:data:`ROWS_DW_GLUON`): a tile is 128 dW rows (dY columns) x 128 dW columns (X columns), two consumers of
64 dW rows, BLOCK_K 64 (only layers whose pinned dW BLOCK_K is 64 run here: the chunks are the full layer's).
A ring slot holds two (64 x 64) dY boxes (consumer C's at row C * 64) and one (64 x 128) X box: 32 KB, as the
forward's; with a ring of 4 and the two 32 KB level-2 slots 192 KB of shared memory. Registers a consumer thread:
the 64 x 128 accumulator and the level-1 subtree, 128 of its 240 (the forward's budget). The output (N, K) is read
as one weight's dW: pid_a over N (A = dY^T), pid_b over K (B = X), GROUP_M-swizzled.

Lowered for sm_90 (``tests/triton_kernels/test_sm90_compile.py``): per consumer one m64n128k16 wgmma of 4 k16 steps
a chunk with both operands' transpose bits set (trans-a, trans-b: the form the Triton ``rows_dw`` pointer walk's
``tl.dot`` lowers to), 16 TMA copies (4 segments x two dY boxes and the X box in two 64-column copies), 256 IEEE adds
(2 fold sites x 64 registers x 2 consumers), no FMA, no atomics, no spills.

Cost: the MMA work is the chunks, ``4 ceil(L' / 64)`` a tile against the single walk's ``ceil(S / 64)``: at
S = 3160 (L' = 790) 52 against 50 (+4 %), at S = 38974 612 against 609; the tile reads 1.33x the single walk's
operand bytes a FLOP (128 x 128 against 128 x 256) and drains its MMAs 4 times a tile. Measured (H100): 1.46-1.71x
the single-walk dW at S = 3160 and 1.07-1.25x at 38974, where the 8 segments the order had until 2026-12-07 (7 chunks
a segment at S = 3160, 8 drains, a global slot) measured 1.81-2.72x and 1.14-1.57x. Host: 8 descriptors a launch.

GPU only (Gluon has no interpreter); sm_90, bfloat16, one batch item, rows 16-byte aligned (TMA).
"""

from __future__ import annotations

from itertools import pairwise

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from h3gate.kernels.common import STRICT_LAUNCH
from h3gate.kernels.gemm_configs import GemmConfig
from h3gate.kernels.gemm_gluon import AB_ROWS, _tile_coords, _tma_load
from h3gate.kernels.gemm_gluon_plan import REGS, WS_MAXNREG, cdiv, desc
from h3gate.kernels.gemm_gluon_seg8 import CONSUMERS, SLOT_LAYOUT, _consumer
from h3gate.kernels.row_merge import DW_SEGMENTS, dw_bounds

NSEG = gl.constexpr(DW_SEGMENTS)

# 128 dW rows x 128 dW columns, BLOCK_K 64, GROUP_M 8 (the dW tables'), two consumers, a ring of 4.
ROWS_DW_GLUON = GemmConfig(128, 128, 64, 8, 4, 4, persistent=True, tma=True, gluon=True)


@gluon.jit
def _dw_producer(g_descs, x_descs, a_ring, b_ring, full, empty, num_tiles, num_pid_a, num_pid_b, k_tiles, cps,
                 BLOCK_K: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Per tile (the consumers' order), per segment j, per ascending chunk c of it: dY rows ``c * BLOCK_K`` of
    segment j, columns ``pid_a * 128 + [0, 64)`` and ``+ [64, 128)`` (consumers 0, 1), and X's 128 columns from
    ``pid_b * 128`` into the ring; a slot is reloaded once both consumers released it."""
    step = gl.program_id(0) * 0  # a tensor even where a launch specialises k_tiles = 1 as a constant
    nbytes: gl.constexpr = 2 * g_descs[0].block_type.nbytes + x_descs[0].block_type.nbytes
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        for j in gl.static_range(NSEG):
            lo = gl.minimum(j * cps, k_tiles)
            for c in range(gl.minimum(lo + cps, k_tiles) - lo):
                slot = step % STAGES
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                bar = full.index(slot)
                mbarrier.expect(bar, nbytes)
                _tma_load(g_descs[j], [c * BLOCK_K, pid_a * 128], bar, a_ring.index(slot).slice(0, BLOCK_K))
                _tma_load(g_descs[j], [c * BLOCK_K, pid_a * 128 + 64], bar, a_ring.index(slot).slice(BLOCK_K, BLOCK_K))
                _tma_load(x_descs[j], [c * BLOCK_K, pid_b * 128], bar, b_ring.index(slot))
                step += 1


@gluon.jit
def _rows_dw_ws_kernel(g0, g1, g2, g3, x0, x1, x2, x3, c_ptr, scratch_ptr, M, N, stride_cm, num_tiles, num_pid_a,
                       num_pid_b, k_tiles, cps, BLOCK_K: gl.constexpr,
                       GROUP: gl.constexpr, STAGES: gl.constexpr, REGS_C: gl.constexpr,
                       REGS_P: gl.constexpr):  # fmt: skip
    """``c_ptr`` (M, N) = dW (M = dY's width, N = X's) in the row-segment order; ``g0`` ... ``g3`` / ``x0`` ... ``x3``:
    each segment's (BLOCK_K x 64) dY and (BLOCK_K x 128) X descriptors (separate arguments: Triton 3.6's launcher
    encodes host descriptors only at the top level of the signature, not inside tuples); ``scratch_ptr``: the
    consumers' global slot, never read or written with 4 segments (one FP32). ``num_warps`` = 4 (consumer 0);
    consumer 1 and the one-warp producer are workers."""
    g_descs = (g0, g1, g2, g3)
    x_descs = (x0, x1, x2, x3)
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * BLOCK_K, 64], g_descs[0].layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, 128], x_descs[0].layout)
    slots = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 64, 128], SLOT_LAYOUT)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    gl.warp_specialize(
        [
            (_consumer, (a_ring, b_ring, b_ring, full, empty, slots, slots, slots, c_ptr, c_ptr, scratch_ptr, M, N,
                         stride_cm, num_tiles, num_pid_a, num_pid_b, k_tiles, cps, 0, 128, 0, GROUP, STAGES, False,
                         AB_ROWS, NSEG)),
            (_consumer, (a_ring, b_ring, b_ring, full, empty, slots, slots, slots, c_ptr, c_ptr, scratch_ptr, M, N,
                         stride_cm, num_tiles, num_pid_a, num_pid_b, k_tiles, cps, 1, 128, 0, GROUP, STAGES, False,
                         AB_ROWS, NSEG)),
            (_dw_producer, (g_descs, x_descs, a_ring, b_ring, full, empty, num_tiles, num_pid_a, num_pid_b, k_tiles,
                            cps, BLOCK_K, GROUP, STAGES)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def segment_chunks(seq_len: int, block_k: int) -> tuple[int, int]:
    """(cps, T): the chunks of a whole segment and of all segments together (module docstring)."""
    bounds = dw_bounds(seq_len)
    return cdiv(bounds[1] - bounds[0], block_k), sum(cdiv(b - a, block_k) for a, b in pairwise(bounds))


def segment_descriptors(g: torch.Tensor, x: torch.Tensor, block_k: int) -> tuple[tuple, tuple]:
    """Each segment's TMA descriptors over its rows of ``g`` (S, N) and ``x`` (S, K) alone (rows past its end read as
    zeros): (BLOCK_K x 64) and (BLOCK_K x 128) boxes; an empty segment repeats segment 0's (never loaded)."""
    bounds = dw_bounds(g.shape[0])
    spans = [(a, b) if b > a else (bounds[0], bounds[1]) for a, b in pairwise(bounds)]
    return (tuple(desc(g[a:b], [block_k, 64]) for a, b in spans),
            tuple(desc(x[a:b], [block_k, 128]) for a, b in spans))  # fmt: skip


def launch_args(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, cfg: GemmConfig, programs: int) -> dict:
    """Everything :func:`rows_dw_ws` passes the kernel but the scratch: descriptors, sizes, grid, constants."""
    (s, n), k = g.shape, x.shape[1]
    pid_a, pid_b = cdiv(n, cfg.block_m), cdiv(k, cfg.block_n)
    cps, total = segment_chunks(s, cfg.block_k)
    g_descs, x_descs = segment_descriptors(g, x, cfg.block_k)
    descs = {**{f"g{i}": d for i, d in enumerate(g_descs)}, **{f"x{i}": d for i, d in enumerate(x_descs)}}
    return {**descs, "c_ptr": out, "M": n, "N": k, "stride_cm": out.stride(0),
            "num_tiles": pid_a * pid_b, "num_pid_a": pid_a, "num_pid_b": pid_b, "k_tiles": total, "cps": cps,
            "BLOCK_K": cfg.block_k, "GROUP": cfg.group_m, "STAGES": cfg.num_stages, "REGS_C": REGS[0],
            "REGS_P": REGS[1], "maxnreg": WS_MAXNREG, "grid": min(pid_a * pid_b, programs)}  # fmt: skip


def rows_dw_ws(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, programs: int,
               cfg: GemmConfig = ROWS_DW_GLUON) -> torch.Tensor:  # fmt: skip
    """``out (N, K)`` (bfloat16) = dW of contiguous bfloat16 ``g`` (S, N) and ``x`` (S, K) (16-byte aligned bases,
    N and K multiples of 8, CUDA, sm_90) over all 4 row segments of S, rounded once; ``programs``: the SM count."""
    if cfg.block_k != 64 or cfg.block_m != 128 or cfg.block_n != 128 or g.shape[0] != x.shape[0] or g.shape[0] < 1:
        raise ValueError(f"gemm_gluon_rows_dw: {tuple(g.shape)} x {tuple(x.shape)} with tiling {cfg.tag}")
    args = launch_args(g, x, out, cfg, programs)
    grid = args.pop("grid")
    scratch = torch.empty(1, dtype=torch.float32, device=x.device)  # no global slot with 4 segments
    _rows_dw_ws_kernel[(grid,)](scratch_ptr=scratch, num_warps=4, **args, **STRICT_LAUNCH)
    return out
