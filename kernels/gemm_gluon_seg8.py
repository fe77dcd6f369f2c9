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
``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` with the adds of :func:`h3gate.kernels.exact.fold_segment`: the
pending subtrees of 1, 2 and 4 segments wait in three slots of this consumer's own, the older subtree the left
operand of each IEEE FP32 add (launched without FMA contraction); the accumulator then restarts at zero. Epilogue:
+ bias in FP32, one RNE rounding to bfloat16. Which program, consumer, MMA or slot holds an element is scheduling;
the bytes equal the Triton seg8 kernel's, checked on an H100 (sm_90, the H200's architecture and compiler) at the
block's O and down, M = 3160 and 38974 (``tools/gpu_seg8_gluon_check.py``).

Design: where the slots live. A consumer thread gets 240 registers (``REGS``); its 64 rows of a 128-column tile are
64 FP32 accumulator registers, and a slot is 64 more (32 KB a consumer). The shared memory (227 KB) holds the TMA
ring, 32 KB a stage at 128 columns. Two layouts, picked by the tiling's ``block_n``:

* 128 (production, :data:`SEG8_GLUON`): the slots by how often they are used. Level 1 (written at every even segment,
  read at every odd one) in registers: acc + s0 = 128 of the 240 (level 2 there as well, 192, makes ptxas spill).
  Level 2 (2 writes, 2 reads a tile) in shared memory, 32 KB a consumer (:data:`SLOT_LAYOUT`); with a ring of 4
  (128 KB) 192 KB. Level 4 (1 write at j = 3, 1 read at j = 7) in global scratch, 32 KB a consumer (8 MB at 132
  programs), addressed in the accumulator's register layout so that each thread reads back only what it wrote
  (program order, no barrier). The output is stored from registers (no staging buffer). Per tile and consumer the
  tree moves 2 x 32 KB each way through shared memory (~1k cycles of the SM's 128 B/clk for both consumers), one
  L2 round trip of 64 KB for both (~1-2k cycles, the one load that stalls) and drains the MMAs 8 times (~0.3k cycles
  each, the ring staying full meanwhile): ~4-5k cycles against ~57k of MMA for O (K = 7168: 112 chunks of ~512
  tensor-core cycles at 128 x 128) and ~115k for down, ~8 % and ~4 % over a single walk of the same tile. The cost
  is the tile: 128 x 128 reads 33 % more operand bytes a FLOP than the single walk's 128 x 256.
* 256: the single walk's tile, as two n128 MMAs a k16 step into two 64 x 128 accumulators (its B tail mechanism:
  B rows ``[off, off + 128)`` and ``[off + 128, off + 256)``) so that a fold holds 128 + 64 registers, not 128 + 128;
  all three slots (3 x 64 KB a consumer) in global scratch, 384 KB a program (50 MB at 132 programs, the L2's size),
  in the register layout as above. Stores are fire-and-forget; loads stall: per tile and consumer 7 slot stores and 7
  loads of 64 KB, 1.8 MB a tile of L2 traffic against 5.5 MB of operands for O; estimated ~13-26k cycles a tile (7
  L2 round trips of 128 KB at 40-80 B/clk, 8 drains) against ~115k of MMA for O and ~230k for down: ~11-23 % and
  ~6-11 % over the single walk, less where the producer's prefetch or the other consumer overlaps it.

GPU only (Gluon has no interpreter); sm_90, bfloat16, rows 16-byte aligned (TMA).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from h3gate.kernels.common import STRICT_LAUNCH
from h3gate.kernels.gemm_configs import GemmConfig
from h3gate.kernels.gemm_gluon import B_ROWS, K_MAJOR, _mainloop, _producer, _store, _store_tma, _tile_coords
from h3gate.kernels.gemm_gluon_plan import REGS, WS_MAXNREG, desc, plan

# The segmented-8 Gluon forward's tiling: two consumers of 64 rows x 128 columns, the tree's levels 1 and 2 on chip,
# BLOCK_K 64 (it runs only for layers whose pinned BLOCK_K is this one), GROUP_M 16, a ring of 4: 196856 bytes of shared
# memory (a ring of 5 takes 229648 of the 232448 an H100 / H200 block may have). With block_n 256 the slots are in
# global scratch (see above).
SEG8_GLUON = GemmConfig(128, 128, 64, 16, 4, 4, persistent=True, tma=True, gluon=True)
SEGMENTS = gl.constexpr(8)
CONSUMERS = gl.constexpr(2)
# A consumer's level-2 slot in shared memory, written and read in the accumulator's own register layout (wgmma's m64
# fragment: a warp's lanes hold rows r .. r + 7, 8 columns each, a pair of FP32 per lane). Its 8-element vectors are
# XOR-swizzled by row % 4, so the 4 rows r .. r + 3 of one access land on the 4 distinct 32-byte bank groups: a warp's
# 256 bytes take the 2 wavefronts a 128-byte bank width allows. The earlier (2, 1, 8) swizzle moved pairs inside one
# 32-byte group and measured 8-way (loads) and 11-way (stores) conflicts on an H100 (docs/ws2-merge-order.md).
SLOT_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0]))


def halves(cfg: GemmConfig) -> tuple[int, int]:
    """(NB, NT): the two MMAs' B rows of a ``cfg`` tile; 256 columns as 128 + 128 (slots in global scratch), up to
    128 as one MMA (levels 1 and 2 on chip)."""
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
def _segment(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, cps, j, layout: gl.constexpr,
             layout_t: gl.constexpr, C: gl.constexpr, NB: gl.constexpr, NT: gl.constexpr, NT_L: gl.constexpr,
             STAGES: gl.constexpr, OPERANDS: gl.constexpr = 0):  # fmt: skip
    """Segment ``j``'s partial: its chunks (none: +0) from zero accumulators (``acc_t``: NT_L columns, NT of them
    multiplied) by the single walk's :func:`_mainloop` (``OPERANDS``: the slots' operand layout); returns (acc,
    acc_t, the ring step after it)."""
    lo = gl.minimum(j * cps, k_tiles)
    n = gl.minimum(lo + cps, k_tiles) - lo
    acc = gl.zeros([64, NB], gl.float32, layout)
    acc_t = gl.zeros([64, NT_L], gl.float32, layout_t)
    if n > 0:
        acc, acc_t, step = _mainloop(a_ring, b_ring, bt_ring, full, empty, step, n, acc, acc_t, C, NB, NT, STAGES,
                                     OPERANDS)  # fmt: skip
    return acc, acc_t, step


@gluon.jit
def _tree_scratch(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, cps, base, C: gl.constexpr, NB: gl.constexpr,
                  NT: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One tile's 8 segments for consumer C, the tree's pending subtrees in its global scratch slots (``base``);
    returns (the tree's two halves, the ring step after the tile)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
    layout_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NT, 16])  # fmt: skip
    W: gl.constexpr = NB + NT
    acc = gl.zeros([64, NB], gl.float32, layout)
    acc_t = gl.zeros([64, NT], gl.float32, layout_t)
    for j in range(SEGMENTS):
        acc, acc_t, step = _segment(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, cps, j, layout, layout_t, C,
                                    NB, NT, NT, STAGES)  # fmt: skip
        acc = _fold(acc, _slot_ptrs(base, layout, W, 0, NB), j, 64 * W)
        acc_t = _fold(acc_t, _slot_ptrs(base, layout_t, W, NB, NT), j, 64 * W)
    return acc, acc_t, step


@gluon.jit
def _tree_onchip(a_ring, b_ring, full, empty, step, k_tiles, cps, slot, ptrs, C: gl.constexpr, NB: gl.constexpr,
                 STAGES: gl.constexpr, OPERANDS: gl.constexpr = 0, NSEG: gl.constexpr = 8):  # fmt: skip
    """One tile's ``NSEG`` (8 or 4) segments for consumer C, the pending subtree of 1 segment in registers (``s0``),
    of 2 in this consumer's shared-memory ``slot``, of 4 in its global scratch (``ptrs``, in the accumulator's layout;
    8 segments only); the adds of :func:`_fold` (with 4 segments its first four: ``(p0 + p1) + (p2 + p3)``). Returns
    (the tree, a placeholder, the ring step after the tile)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
    layout_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    acc = gl.zeros([64, NB], gl.float32, layout)
    acc_t = gl.zeros([64, 8], gl.float32, layout_t)
    s0 = acc
    gl.static_assert(NSEG == 8 or NSEG == 4, "the on-chip tree folds 8 or 4 segments")
    for j in range(NSEG):
        acc, acc_t, step = _segment(a_ring, b_ring, b_ring, full, empty, step, k_tiles, cps, j, layout, layout_t, C,
                                    NB, 0, 8, STAGES, OPERANDS)  # fmt: skip
        if j % 2 == 0:
            s0 = acc
        else:
            acc = s0 + acc
            if j % 4 == 1:
                slot.store(acc)
            else:
                acc = slot.load(layout) + acc
                if NSEG == 8:
                    if j == 3:
                        gl.store(ptrs, acc)
                    else:
                        acc = gl.load(ptrs) + acc
    return acc, acc_t, step


@gluon.jit
def _consumer(a_ring, b_ring, bt_ring, full, empty, c_desc, c_smem, slots, c_ptr, bias_ptr, scratch_ptr, M, N,
              stride_cm, num_tiles, num_pid_a, num_pid_b, k_tiles, cps, C: gl.constexpr, NB: gl.constexpr,
              NT: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
              OPERANDS: gl.constexpr = 0, NSEG: gl.constexpr = 8):  # fmt: skip
    """Consumer C's 64 rows of the program's tiles (:func:`_producer`'s order): the tree (NT > 0: through global
    scratch, each half stored by TMA through its staging buffer; else on chip, stored from registers), + bias, one
    rounding. ``OPERANDS`` (on chip only): the slots' operand layout (:func:`h3gate.kernels.gemm_gluon._mma_chunk`:
    the dX's, the weight gradient's: :mod:`h3gate.kernels.gemm_gluon_rows_dw`); ``NSEG`` (on chip only): 8
    segments, or 4 (the weight gradient's row segments: the tree ``(q0 + q1) + (q2 + q3)``, no global slot)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
    FLOATS: gl.constexpr = 3 * 64 * (NB + NT) if NT > 0 else 64 * NB  # this consumer's global scratch
    step = gl.program_id(0) * 0  # a tensor even where a launch specialises k_tiles = 1 as a constant
    base = scratch_ptr + (gl.program_id(0) * CONSUMERS + C).to(gl.int64) * FLOATS
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        off_i = pid_a * 128 + C * 64
        off_j = pid_b * (NB + NT)
        if NT > 0:
            acc, acc_t, step = _tree_scratch(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, cps, base, C, NB,
                                             NT, STAGES)  # fmt: skip
            _store_tma(acc, c_desc, c_smem.index(2 * C), bias_ptr, off_i, off_j, N, NB, HAS_BIAS)
            _store_tma(acc_t, c_desc, c_smem.index(2 * C + 1), bias_ptr, off_i, off_j + NB, N, NT, HAS_BIAS)
        else:
            acc, acc_t, step = _tree_onchip(a_ring, b_ring, full, empty, step, k_tiles, cps, slots.index(C),
                                            _slot_ptrs(base, layout, NB, 0, NB), C, NB, STAGES, OPERANDS,
                                            NSEG)  # fmt: skip
            offs_i = off_i + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
            _store(acc, c_ptr, bias_ptr, offs_i, off_j, M, N, stride_cm, NB, False, HAS_BIAS)
    if NT > 0:
        tma.store_wait(0)


@gluon.jit
def _seg8_ws_kernel(a_desc, b_desc, bt_desc, c_desc, c_ptr, bias_ptr, scratch_ptr, M, N, stride_cm, num_tiles,
                    num_pid_a, num_pid_b, k_tiles, cps, BLOCK_B: gl.constexpr, B_TAIL: gl.constexpr,
                    BLOCK_K: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                    REGS_C: gl.constexpr, REGS_P: gl.constexpr, OPERANDS: gl.constexpr):  # fmt: skip
    """``num_warps`` = 4 (consumer 0); consumer 1 and the one-warp producer are workers. A tile: 128 A (X) rows x
    (BLOCK_B + B_TAIL) B (W) rows, B_TAIL 0 (``scratch_ptr``: (programs, 2, 1, 64, BLOCK_B) FP32, the level-4 slot)
    or BLOCK_B (``scratch_ptr``: (programs, 2, 3, 64, 2 * BLOCK_B), every slot); ``cps`` chunks a segment.
    ``OPERANDS`` B_ROWS (dX = dY W, B_TAIL 0): A is dY, B = W's (BLOCK_K x BLOCK_B) boxes of reduction rows."""
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BLOCK_K], a_desc.layout)
    if OPERANDS == B_ROWS:
        b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_B], b_desc.layout)
    else:
        b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_B, BLOCK_K], b_desc.layout)
    if B_TAIL > 0:
        bt_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, B_TAIL, BLOCK_K], bt_desc.layout)
    else:
        bt_ring = b_ring  # unused
    if B_TAIL > 0:  # the slots in global scratch, the output staged for TMA stores
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * CONSUMERS, 64, BLOCK_B], c_desc.layout)
        slots = c_smem  # unused
    else:  # each consumer's level-2 subtree (SLOT_LAYOUT)
        slots = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 64, BLOCK_B], SLOT_LAYOUT)
        c_smem = slots  # unused: stored from registers
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    zero = gl.program_id(0) * 0  # the producer's unused narrow-tile and grouped-launch arguments
    gl.warp_specialize(
        [
            (_consumer, (a_ring, b_ring, bt_ring, full, empty, c_desc, c_smem, slots, c_ptr, bias_ptr, scratch_ptr,
                         M, N, stride_cm, num_tiles, num_pid_a, num_pid_b, k_tiles, cps, 0, BLOCK_B, B_TAIL, GROUP,
                         STAGES, HAS_BIAS, OPERANDS)),
            (_consumer, (a_ring, b_ring, bt_ring, full, empty, c_desc, c_smem, slots, c_ptr, bias_ptr, scratch_ptr,
                         M, N, stride_cm, num_tiles, num_pid_a, num_pid_b, k_tiles, cps, 1, BLOCK_B, B_TAIL, GROUP,
                         STAGES, HAS_BIAS, OPERANDS)),
            (_producer, (a_desc, b_desc, b_desc, b_desc, bt_desc, b_desc, a_ring, b_ring, bt_ring, full, empty,
                         num_tiles, num_pid_a, num_pid_b, zero, zero, zero, zero, k_tiles, BLOCK_B, B_TAIL, 0,
                         BLOCK_K, GROUP, STAGES, 128, 1, OPERANDS)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def seg8_descriptors(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: GemmConfig, dx: bool = False) -> dict:
    """Host TMA descriptors: A = X (128-row boxes), B = W (NB rows; ``dx``: BLOCK_K rows x NB columns), its tail (NT
    rows) and C = Y (64 x NB) where the tile has two halves (else None: stored from registers)."""
    nb, nt = halves(cfg)
    bk = cfg.block_k
    b_desc = desc(w, [bk, nb] if dx else [nb, bk])
    return {"a_desc": desc(x, [128, bk]), "b_desc": b_desc, "bt_desc": desc(w, [nt, bk]) if nt else None,
            "c_desc": desc(y, [64, nb]) if nt else None}  # fmt: skip


def seg8_constants(cfg: GemmConfig, bias: bool, dx: bool = False) -> dict:
    """The kernel's compile-time constants and register limit for ``cfg`` (a bias added or not; ``dx``: B's boxes
    of reduction rows)."""
    nb, nt = halves(cfg)
    return {"BLOCK_B": nb, "B_TAIL": nt, "BLOCK_K": cfg.block_k, "GROUP": cfg.group_m, "STAGES": cfg.num_stages,
            "HAS_BIAS": bias, "REGS_C": REGS[0], "REGS_P": REGS[1], "maxnreg": WS_MAXNREG,
            "OPERANDS": B_ROWS if dx else K_MAJOR}  # fmt: skip


def matmul_seg8_ws(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig,
                   seg: int, programs: int, dx: bool = False) -> torch.Tensor:  # fmt: skip
    """``y (M, N)`` = the segmented-8 ``x (M, K) @ w (N, K)^T [+ bias]`` (``dx``: ``x (M, K) @ w (K, N)``, the
    column-parallel dX dY W) (contiguous bfloat16, 16-byte aligned rows and bases, CUDA, sm_90) with segments of
    ``seg`` columns of x (a multiple of ``cfg.block_k``, the layer's pinned BLOCK_K), ``programs`` the SM count."""
    m, k = x.shape
    n = w.shape[1] if dx else w.shape[0]
    if seg % cfg.block_k or cfg.block_m != 128 or (dx and halves(cfg)[1]):
        raise ValueError(f"gemm_gluon_seg8: segment {seg} with tiling {cfg.tag}")
    p = plan(m, n, k, cfg, programs)
    slots = 3 if halves(cfg)[1] else 1  # global slots a consumer: all three 256 wide, the level-4 one 128 wide
    size = (p.grid, CONSUMERS.value, slots, 64, cfg.block_n)
    scratch = torch.empty(size, dtype=torch.float32, device=x.device)
    _seg8_ws_kernel[(p.grid,)](
        **seg8_descriptors(x, w, y, cfg, dx), c_ptr=y, bias_ptr=bias if bias is not None else y, scratch_ptr=scratch,
        M=m, N=n, stride_cm=y.stride(0), num_tiles=p.tiles, num_pid_a=p.pid_a, num_pid_b=p.pid_b, k_tiles=p.k_tiles,
        cps=seg // cfg.block_k, num_warps=4, **seg8_constants(cfg, bias is not None, dx), **STRICT_LAUNCH,
    )  # fmt: skip
    return y
