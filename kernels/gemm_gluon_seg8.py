"""The segmented-8 strict GEMM forward (:mod:`h3gate.kernels.gemm_merge`, one device, all 8 segments, bias, one
rounding) as a warp-specialised persistent Gluon kernel for Hopper, bfloat16: the producer and the chunk walk of
:mod:`h3gate.kernels.gemm_gluon`, the per-segment restart and the tree of ``_seg8_kernel``.

Arithmetic (the Triton seg8 kernel's, element for element). K is cut at multiples of ``cps = S / BLOCK_K`` chunks
(``S = BLOCK_K * ceil(ceil(K / 8) / BLOCK_K)``, BLOCK_K the full layer's pinned one: the caller runs this kernel only
when its tiling's BLOCK_K is that one). Segment ``j`` is chunks ``[j * cps, min((j + 1) * cps, k_tiles))``, walked in
ascending order from a zero FP32 accumulator, each chunk the ``wgmma`` k16 steps of the single-walk Gluon kernel
(:func:`h3gate.kernels.gemm_gluon._mainloop` itself); the K tail past K reads TMA's zero fill as the Triton walk reads
its mask's zeros, and an empty trailing segment is the zero accumulator, +0. At each segment's end the consumer waits
its MMAs (``warpgroup_mma_wait(0)``, the walk's own end) and folds the partial into
``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` exactly as :func:`h3gate.kernels.exact.fold_segment` does: the
pending subtrees (level 1, 2, 4) wait in three FP32 slots of this program's and consumer's own global scratch, the
older subtree the left operand of each IEEE add (launched without FMA contraction); the accumulator then restarts at
zero. Epilogue: + bias in FP32, one RNE rounding to bfloat16, TMA store. Which program, consumer or MMA holds an
element is scheduling; the bytes are claimed equal to the Triton seg8 kernel's, to be confirmed on the H200
(``tools/gpu_seg8_gluon_check.py``).

Design. A tile is 128 rows (two consumer warpgroups of 64) x ``block_n`` columns; ``block_n`` 256 runs as two
n128 MMAs a k16 step into two 64 x 128 accumulators (the B tail mechanism of the single-walk kernel, B rows
``[off, off + 128)`` and ``[off + 128, off + 256)``) so the fold touches 64 registers at a time: a consumer thread
holds 2 x 64 FP32 accumulator registers, plus 64 for a slot half being loaded, of the 240 it gets (``REGS``); one
64 x 256 accumulator would need 128 + 128 at a fold. The slots live in global memory (shared memory holds the ring,
3 x 48 KB, and the output staging, 64 KB: no room for 3 x 128 KB of FP32 subtrees), addressed in the accumulator's
own register layout, so each thread reads back only what it wrote (program order, no barrier). Stores are
fire-and-forget; loads stall the consumer: per tile and consumer the tree stores 7 and loads 7 slot tiles of
64 KB (odd segments 1, 2, 1, 3 loads at j = 1, 3, 5, 7). Estimate at M = 3160 on 132 SMs: a 128 x 256 tile's
chunk is ~1k tensor-core cycles, so O (K = 7168, 112 chunks) is ~115k cycles of MMA a tile and down (K = 14336) ~230k;
the folds cost the MMA drain at each of 8 boundaries (~0.3k cycles) and ~7 L2 round trips of 128 KB a tile (both
consumers fold at the same chunk; ~1.5-3k cycles each), ~13-24k cycles: ~11-20 % over the single walk for O,
~6-10 % for down, less where the other consumer's MMAs or the producer's prefetch (the ring stays full during a fold)
overlap it. The scratch is 384 KB a program (50 MB at 132 programs, the L2's size; ``block_n`` 128 halves it).

GPU only (Gluon has no interpreter); sm_90, bfloat16, rows 16-byte aligned (TMA).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from h3gate.kernels.common import STRICT_LAUNCH
from h3gate.kernels.gemm_configs import GemmConfig
from h3gate.kernels.gemm_gluon import _mainloop, _producer, _store_tma, _tile_coords
from h3gate.kernels.gemm_gluon_plan import REGS, WS_MAXNREG, desc, plan

# The segmented-8 Gluon forward's tiling: two consumers of 64 rows x 256 columns (two n128 MMAs), BLOCK_K 64 (it runs
# only for layers whose pinned BLOCK_K is this one), GROUP_M 16, a ring of 3 (the single-walk wide tiling's shape).
SEG8_GLUON = GemmConfig(128, 256, 64, 16, 4, 3, persistent=True, tma=True, gluon=True)
SEGMENTS = gl.constexpr(8)
CONSUMERS = gl.constexpr(2)


def halves(cfg: GemmConfig) -> tuple[int, int]:
    """(NB, NT): the two MMAs' B rows of a ``cfg`` tile; 256 columns as 128 + 128, up to 128 as one MMA."""
    return (cfg.block_n // 2, cfg.block_n // 2) if cfg.block_n == 256 else (cfg.block_n, 0)


@gluon.jit
def _settled(x):
    """``x`` unchanged (a register move with side effects, which no load crosses): a fold's next slot load is issued
    after the adds that made ``x``, so one slot half (64 registers a thread) is loaded at a time; a scheduler issuing
    all of a fold's loads first would hold 6 x 64 and spill."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _fold(acc, ptrs, j, TILE: gl.constexpr):
    """Segment ``j``'s partial ``acc`` folded into the tree (:func:`h3gate.kernels.exact.fold_segment`): slots 0, 1,
    2 (``ptrs``, ``ptrs + TILE``, ``ptrs + 2 * TILE``) hold the pending subtrees of 1, 2 and 4 segments, the older
    subtree the left operand; returns the subtree ending at ``j`` (at j = 7 the whole tree)."""
    if j % 2 == 1:
        acc = _settled(gl.load(ptrs) + acc)
    if j % 4 == 3:
        acc = _settled(gl.load(ptrs + TILE) + acc)
    if j == 7:
        acc = _settled(gl.load(ptrs + 2 * TILE) + acc)
    if j % 2 == 0:
        gl.store(ptrs, acc)
    elif j % 4 == 1:
        gl.store(ptrs + TILE, acc)
    elif j == 3:
        gl.store(ptrs + 2 * TILE, acc)
    return acc


@gluon.jit
def _slot_ptrs(base, layout: gl.constexpr, W: gl.constexpr, COL0: gl.constexpr, NJ: gl.constexpr):
    """Slot 0 of a (64, NJ) accumulator at column COL0 of this consumer's (64, W) scratch tiles, in its layout."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, NJ, layout=gl.SliceLayout(0, layout))
    return base + (gl.expand_dims(rows.to(gl.int64) * W, 1) + gl.expand_dims(cols.to(gl.int64), 0))


@gluon.jit
def _tree(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, cps, base, C: gl.constexpr, NB: gl.constexpr,
          NT: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One tile's 8 segments for consumer C: each from zero accumulators over its chunks (the single walk's
    :func:`_mainloop`), folded into the tree; returns (the tree's two halves, the ring step after the tile)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
    NT_L: gl.constexpr = NT if NT > 0 else 8
    layout_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NT_L, 16])  # fmt: skip
    W: gl.constexpr = NB + NT
    TILE: gl.constexpr = 64 * W
    acc = gl.zeros([64, NB], gl.float32, layout)
    acc_t = gl.zeros([64, NT_L], gl.float32, layout_t)
    for j in range(SEGMENTS):
        lo = gl.minimum(j * cps, k_tiles)
        n = gl.minimum(lo + cps, k_tiles) - lo
        acc = gl.zeros([64, NB], gl.float32, layout)
        acc_t = gl.zeros([64, NT_L], gl.float32, layout_t)
        if n > 0:
            acc, acc_t, step = _mainloop(a_ring, b_ring, bt_ring, full, empty, step, n, acc, acc_t, C, NB, NT,
                                         STAGES)  # fmt: skip
        acc = _fold(acc, _slot_ptrs(base, layout, W, 0, NB), j, TILE)
        if NT > 0:
            acc_t = _fold(acc_t, _slot_ptrs(base, layout_t, W, NB, NT_L), j, TILE)
    return acc, acc_t, step


@gluon.jit
def _consumer(a_ring, b_ring, bt_ring, full, empty, c_desc, c_smem, bias_ptr, scratch_ptr, N, num_tiles, num_pid_a,
              num_pid_b, k_tiles, cps, C: gl.constexpr, NB: gl.constexpr, NT: gl.constexpr, GROUP: gl.constexpr,
              STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
    """Consumer C's 64 rows of the program's tiles (:func:`_producer`'s order): the tree, + bias, one rounding, TMA
    stores of each half through its own staging buffer."""
    step = k_tiles * 0
    base = scratch_ptr + (gl.program_id(0) * CONSUMERS + C).to(gl.int64) * (3 * 64 * (NB + NT))
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        acc, acc_t, step = _tree(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, cps, base, C, NB, NT, STAGES)
        off_i = pid_a * 128 + C * 64
        off_j = pid_b * (NB + NT)
        _store_tma(acc, c_desc, c_smem.index(2 * C), bias_ptr, off_i, off_j, N, NB, HAS_BIAS)
        if NT > 0:
            _store_tma(acc_t, c_desc, c_smem.index(2 * C + 1), bias_ptr, off_i, off_j + NB, N, NT, HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def _seg8_ws_kernel(a_desc, b_desc, bt_desc, c_desc, bias_ptr, scratch_ptr, N, num_tiles, num_pid_a, num_pid_b,
                    k_tiles, cps, BLOCK_B: gl.constexpr, B_TAIL: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, REGS_C: gl.constexpr,
                    REGS_P: gl.constexpr):  # fmt: skip
    """``num_warps`` = 4 (consumer 0); consumer 1 and the one-warp producer are workers. A tile: 128 A (X) rows x
    (BLOCK_B + B_TAIL) B (W) rows, B_TAIL 0 or BLOCK_B; ``cps`` chunks a segment; ``scratch_ptr``: (programs, 2, 3,
    64, BLOCK_B + B_TAIL) FP32."""
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_B, BLOCK_K], b_desc.layout)
    if B_TAIL > 0:
        bt_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, B_TAIL, BLOCK_K], bt_desc.layout)
    else:
        bt_ring = b_ring  # unused
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * CONSUMERS, 64, BLOCK_B], c_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    zero = num_tiles * 0  # the producer's unused narrow-tile and grouped-launch arguments
    gl.warp_specialize(
        [
            (_consumer, (a_ring, b_ring, bt_ring, full, empty, c_desc, c_smem, bias_ptr, scratch_ptr, N, num_tiles,
                         num_pid_a, num_pid_b, k_tiles, cps, 0, BLOCK_B, B_TAIL, GROUP, STAGES, HAS_BIAS)),
            (_consumer, (a_ring, b_ring, bt_ring, full, empty, c_desc, c_smem, bias_ptr, scratch_ptr, N, num_tiles,
                         num_pid_a, num_pid_b, k_tiles, cps, 1, BLOCK_B, B_TAIL, GROUP, STAGES, HAS_BIAS)),
            (_producer, (a_desc, b_desc, b_desc, b_desc, bt_desc, b_desc, a_ring, b_ring, bt_ring, full, empty,
                         num_tiles, num_pid_a, num_pid_b, zero, zero, zero, zero, k_tiles, BLOCK_B, B_TAIL, 0,
                         BLOCK_K, GROUP, STAGES, 128, 1)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def seg8_descriptors(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: GemmConfig) -> dict:
    """Host TMA descriptors: A = X (128-row boxes), B = W (NB rows), its tail (NT rows, or None), C = Y (64 x NB)."""
    nb, nt = halves(cfg)
    bk = cfg.block_k
    return {"a_desc": desc(x, [128, bk]), "b_desc": desc(w, [nb, bk]), "bt_desc": desc(w, [nt, bk]) if nt else None,
            "c_desc": desc(y, [64, nb])}  # fmt: skip


def seg8_constants(cfg: GemmConfig, bias: bool) -> dict:
    """The kernel's compile-time constants and register limit for ``cfg`` (a bias added or not)."""
    nb, nt = halves(cfg)
    return {"BLOCK_B": nb, "B_TAIL": nt, "BLOCK_K": cfg.block_k, "GROUP": cfg.group_m, "STAGES": cfg.num_stages,
            "HAS_BIAS": bias, "REGS_C": REGS[0], "REGS_P": REGS[1], "maxnreg": WS_MAXNREG}  # fmt: skip


def matmul_seg8_ws(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig,
                   seg: int, programs: int) -> torch.Tensor:  # fmt: skip
    """``y (M, N)`` = the segmented-8 ``x (M, K) @ w (N, K)^T [+ bias]`` (contiguous bfloat16, 16-byte aligned rows
    and bases, CUDA, sm_90) with segments of ``seg`` columns (a multiple of ``cfg.block_k``, the layer's pinned
    BLOCK_K), ``programs`` the SM count."""
    m, k = x.shape
    n = w.shape[0]
    if seg % cfg.block_k or cfg.block_m != 128 or halves(cfg)[1] not in (0, halves(cfg)[0]):
        raise ValueError(f"gemm_gluon_seg8: segment {seg} with tiling {cfg.tag}")
    p = plan(m, n, k, cfg, programs)
    scratch = torch.empty((p.grid, CONSUMERS.value, 3, 64, cfg.block_n), dtype=torch.float32, device=x.device)
    _seg8_ws_kernel[(p.grid,)](
        **seg8_descriptors(x, w, y, cfg), bias_ptr=bias if bias is not None else y, scratch_ptr=scratch, N=n,
        num_tiles=p.tiles, num_pid_a=p.pid_a, num_pid_b=p.pid_b, k_tiles=p.k_tiles, cps=seg // cfg.block_k,
        num_warps=4, **seg8_constants(cfg, bias is not None), **STRICT_LAUNCH,
    )  # fmt: skip
    return y
