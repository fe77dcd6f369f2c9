"""The strict GEMM forward as a warp-specialised persistent Gluon kernel for Hopper: the same K walk and arithmetic
as :mod:`h3gate.kernels.gemm`, its instructions scheduled explicitly (``GemmConfig.gluon``).

Triton 3.6's own Hopper GEMM issues each ``wgmma`` from the warps that also wait for the loads, and its automatic warp
specialisation gave nothing on sm_90 (``docs/measurements/gemm-gap-profile.md``). Here the product
``C[i, j] = sum_k A[i, k] B[j, k]`` of two K-contiguous operands (A: ``a_rows`` x K, B: ``b_rows`` x K) is run by
the partitions of one persistent program an SM, walking output tiles ``pid``, ``pid + programs``, ... in the
GROUP_M-swizzled order of :func:`h3gate.kernels.gemm_triton.tile_coords`:

* a one-warp producer issuing every TMA load: per tile, per ascending ``BLOCK_K`` chunk, the (128 x BLOCK_K) A
  tile and the (BLOCK_B x BLOCK_K) B tile (and a (B_TAIL x BLOCK_K) B tail) into a ring of ``STAGES`` buffers
  (``full``: loaded; ``empty``: every consumer done with it); the ring runs on across tiles, so the next tile's first
  chunks load during this tile's epilogue;
* two consumer warpgroups of 64 A rows each, every chunk one asynchronous ``wgmma`` (m64,
  N = BLOCK_B, k16 steps; a second one, N = B_TAIL, over the tail) onto zero FP32 accumulators, the chunk's MMAs kept
  in flight while the next chunk's barrier is awaited; the epilogue adds the bias in FP32 and rounds once to bfloat16
  (round to nearest even).

The forward ``Y (M, N) = X (M, K) @ W (N, K)^T`` runs it either way round (``GemmConfig.swap_ab``): unswapped,
A = X and B = W (a tile is ``block_m`` tokens x ``block_n`` weight rows, stored through shared memory by TMA; with
``tail_block_n`` the last columns are narrower tiles dealt after the wide ones, stored from registers),
or swapped, A = W and B = X (``Y^T = W X^T``: 128 weight rows x ``block_n + tail_m`` tokens, two MMAs since register
tiles are powers of two, so 264 tokens are two tiles of 128 + 8; stored transposed from registers). Either way each
output element is one FP32 sum over K in ascending BLOCK_K chunks, each chunk the MMA's k16 steps in ascending order,
the walk of the Triton kernel's ``tl.dot`` (lowered to the same ``wgmma`` steps); the K tail past K and rows past M or
N read TMA's zero fill and are never stored. Which program, partition, tile or MMA holds an element is scheduling.
The bytes equal the Triton kernel's on the H200 at every case probed (``tools/gpu_gemm_gluon.py``,
``docs/measurements/perf-probe-{30,31,32}.json``).

A grouped launch (:func:`matmul_ws_grouped`) runs two or three weights of one shape on the same X (q, k, v) as one
product over the weights' concatenation, each tile's B loads and C store addressed to its own weight and output.

GPU only (Gluon has no interpreter; the CPU interpreter runs the Triton kernel, the same arithmetic); sm_90, bfloat16.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from h3gate.kernels.common import STRICT_LAUNCH
from h3gate.kernels.gemm_configs import GemmConfig
from h3gate.kernels.gemm_gluon_plan import (
    cdiv,
    desc,
    descriptors,
    groupable,
    launch_constants,
    plan,
)

# Triton 3.6 and 3.7 name the TMA copies async_copy_global_to_shared / async_copy_shared_to_global, 3.9 async_load /
# async_store (same positional arguments).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


# How a ring slot holds the MMA's operands (:func:`_mma_chunk`): K-contiguous tiles (the forward), B as boxes of
# BLOCK_K reduction rows (dX = dY W: W row-major), or both (dW = dY^T X).
K_MAJOR, B_ROWS, AB_ROWS = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)


@gluon.jit
def _tile_coords(tile_id, num_pid_a, num_pid_b, GROUP: gl.constexpr):
    """GROUP-swizzled tile order over (A tiles, B tiles): scheduling only."""
    in_group = GROUP * num_pid_b
    first_a = (tile_id // in_group) * GROUP
    size_a = gl.minimum(num_pid_a - first_a, GROUP)
    return first_a + (tile_id % in_group) % size_a, (tile_id % in_group) // size_a


@gluon.jit
def _group_of(pid_b, per_group, NB: gl.constexpr):
    """Grouped launches: B tile ``pid_b`` of the operands' concatenation is tile ``pid_b - g * per_group`` of operand
    ``g``; returns (g, its first B row there)."""
    g = pid_b // per_group
    return g, (pid_b - g * per_group) * NB


@gluon.jit
def _load_b(b_desc, b1_desc, b2_desc, pid_b, per_group, k0, bar, dst, NB: gl.constexpr):
    """Grouped launches: the NB rows of B tile ``pid_b`` at column ``k0`` from operand ``pid_b // per_group``."""
    g, off = _group_of(pid_b, per_group, NB)
    if g == 0:
        _tma_load(b_desc, [off, k0], bar, dst)
    elif g == 1:
        _tma_load(b1_desc, [off, k0], bar, dst)
    else:
        _tma_load(b2_desc, [off, k0], bar, dst)


@gluon.jit
def _produce(a_desc, b_desc, b1_desc, b2_desc, bt_desc, a_ring, b_ring, bt_ring, full, empty, step, first, n_tiles,
             num_pid_a, num_pid_b, col0, per_group, k_tiles, NB: gl.constexpr, NT: gl.constexpr,
             BLOCK_K: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, A_ROWS: gl.constexpr,
             GROUPS: gl.constexpr, OPERANDS: gl.constexpr = 0):  # fmt: skip
    """Tiles ``first``, ``first + programs``, ... of ``n_tiles`` (B rows ``col0 + pid_b * (NB + NT)``): each chunk's A
    tile (A_ROWS rows), NB B rows (``b_desc``; grouped: of ``b_desc``, ``b1_desc`` or ``b2_desc``, ``per_group`` B
    tiles each; ``OPERANDS`` B_ROWS: the (BLOCK_K x NB) box of B's reduction rows ``ki * BLOCK_K`` at column
    ``col0 + pid_b * NB``) and NT more (``bt_desc``, NT > 0) into the ring, ascending K; a slot is reloaded once every
    consumer released it. Returns the ring step after the last."""
    for t in range(first, n_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        off_b = col0 + pid_b * (NB + NT)
        for ki in range(k_tiles):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            bar = full.index(slot)
            a_bytes: gl.constexpr = a_desc.block_type.nbytes
            if NT > 0:
                mbarrier.expect(bar, a_bytes + b_desc.block_type.nbytes + bt_desc.block_type.nbytes)
                _tma_load(bt_desc, [off_b + NB, ki * BLOCK_K], bar, bt_ring.index(slot))
            else:
                mbarrier.expect(bar, a_bytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_a * A_ROWS, ki * BLOCK_K], bar, a_ring.index(slot))
            if GROUPS > 1:
                _load_b(b_desc, b1_desc, b2_desc, pid_b, per_group, ki * BLOCK_K, bar, b_ring.index(slot).slice(0, NB),
                        NB)  # fmt: skip
            elif OPERANDS == B_ROWS:
                _tma_load(b_desc, [ki * BLOCK_K, off_b], bar, b_ring.index(slot))
            else:
                _tma_load(b_desc, [off_b, ki * BLOCK_K], bar, b_ring.index(slot).slice(0, NB))
            step += 1
    return step


@gluon.jit
def _producer(a_desc, b_desc, b1_desc, b2_desc, bt_desc, bn_desc, a_ring, b_ring, bt_ring, full, empty, num_tiles,
              num_pid_a, num_pid_b, n_split, num_narrow, num_pid_n, per_group, k_tiles, BLOCK_B: gl.constexpr,
              B_TAIL: gl.constexpr, NARROW: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr,
              STAGES: gl.constexpr, A_ROWS: gl.constexpr, GROUPS: gl.constexpr,
              OPERANDS: gl.constexpr = 0):  # fmt: skip
    """The wide tiles, then (``NARROW`` > 0) the narrow tiles of the last columns, dealt on from the program after
    the one that took the last wide tile (as :mod:`h3gate.kernels.gemm` deals its tail tiles); ``OPERANDS``: the
    wide tiles' B loads (:func:`_produce`)."""
    start = gl.program_id(0) * 0  # a tensor even where a launch specialises k_tiles = 1 as a constant
    step = _produce(a_desc, b_desc, b1_desc, b2_desc, bt_desc, a_ring, b_ring, bt_ring, full, empty, start,
                    gl.program_id(0), num_tiles, num_pid_a, num_pid_b, 0, per_group, k_tiles, BLOCK_B, B_TAIL,
                    BLOCK_K, GROUP, STAGES, A_ROWS, GROUPS, OPERANDS)  # fmt: skip
    if NARROW > 0:
        programs = gl.num_programs(0)
        first = (gl.program_id(0) + programs - num_tiles % programs) % programs
        _produce(a_desc, bn_desc, bn_desc, bn_desc, bt_desc, a_ring, b_ring, bt_ring, full, empty, step, first,
                 num_narrow, num_pid_a, num_pid_n, n_split, 0, k_tiles, NARROW, 0, BLOCK_K, GROUP, STAGES, A_ROWS,
                 1)  # fmt: skip


@gluon.jit
def _mma_chunk(a_ring, b_ring, bt_ring, full, step, acc, acc_t, C: gl.constexpr, NB: gl.constexpr,
               NT: gl.constexpr, STAGES: gl.constexpr, OPERANDS: gl.constexpr = 0):  # fmt: skip
    """Issue this consumer's MMAs of ring step ``step`` (``acc += A B^T`` over NB B rows, ``acc_t`` over NT more);
    consumer C's 64 rows of a slot's A tile from row C * 64. ``OPERANDS`` (NT = 0 unless K_MAJOR): how a slot holds
    them, :data:`K_MAJOR` (both K-contiguous, B as NB rows: the forward), :data:`B_ROWS` (B as one (BLOCK_K x NB) box
    of reduction rows, fed as an MN-major view: ``acc += A B``, the seg8 dX) or :data:`AB_ROWS` (A too, consumer C's
    (BLOCK_K x 64) box from row C * 64: ``acc += A^T B``, the weight gradient)."""
    slot = step % STAGES
    mbarrier.wait(full.index(slot), (step // STAGES) & 1)
    a = a_ring.index(slot).slice(C * 64, 64)
    if OPERANDS == AB_ROWS:
        acc = warpgroup_mma(a.permute((1, 0)), b_ring.index(slot), acc, is_async=True)
    elif OPERANDS == B_ROWS:
        acc = warpgroup_mma(a, b_ring.index(slot), acc, is_async=True)
    else:
        acc = warpgroup_mma(a, b_ring.index(slot).slice(0, NB).permute((1, 0)), acc, is_async=True)
    if NT > 0:
        acc_t = warpgroup_mma(a, bt_ring.index(slot).permute((1, 0)), acc_t, is_async=True)
    return acc, acc_t


@gluon.jit
def _mainloop(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, acc, acc_t, C: gl.constexpr, NB: gl.constexpr,
              NT: gl.constexpr, STAGES: gl.constexpr, OPERANDS: gl.constexpr = 0):  # fmt: skip
    """This consumer's 64 A rows of one tile over the ascending chunks, one chunk's MMAs kept in flight while the next
    chunk's barrier is awaited (``OPERANDS``: :func:`_mma_chunk`'s); returns (acc, acc_t, the ring step after the
    tile)."""
    for ki in range(k_tiles):
        acc, acc_t = _mma_chunk(a_ring, b_ring, bt_ring, full, step, acc, acc_t, C, NB, NT, STAGES, OPERANDS)
        if NT > 0:
            acc, acc_t = warpgroup_mma_wait(2, deps=(acc, acc_t))  # the previous chunk's MMAs have retired
        else:
            acc = warpgroup_mma_wait(1, deps=(acc,))
        if ki > 0:
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        step += 1
    if NT > 0:
        acc, acc_t = warpgroup_mma_wait(0, deps=(acc, acc_t))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    return acc, acc_t, step


@gluon.jit
def _store(acc, c_ptr, bias_ptr, offs_i, off_j, M, N, stride_cm, NJ: gl.constexpr, SWAP: gl.constexpr,
           HAS_BIAS: gl.constexpr):  # fmt: skip
    """Bias in FP32, one rounding to bfloat16 (an FP32 output: stored as summed), stored element by element: rows
    ``offs_i`` of A, NJ rows of B from ``off_j`` (swapped: A rows are output columns, B rows output rows)."""
    offs_j = off_j + gl.arange(0, NJ, layout=gl.SliceLayout(0, acc.type.layout))
    if SWAP:  # i: weight row (output column), j: token (output row)
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_i, mask=offs_i < N, other=0.0).to(gl.float32), 1)
        ptrs = c_ptr + gl.expand_dims(offs_j.to(gl.int64), 0) * stride_cm + gl.expand_dims(offs_i, 1)
        mask = gl.expand_dims(offs_j < M, 0) & gl.expand_dims(offs_i < N, 1)
    else:  # i: token, j: weight row
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_j, mask=offs_j < N, other=0.0).to(gl.float32), 0)
        ptrs = c_ptr + gl.expand_dims(offs_i.to(gl.int64), 1) * stride_cm + gl.expand_dims(offs_j, 0)
        mask = gl.expand_dims(offs_i < M, 1) & gl.expand_dims(offs_j < N, 0)
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _store_tma(acc, desc, smem, bias_ptr, off_i, off_j, N, NJ: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Bias in FP32, one rounding to bfloat16 into ``smem`` (this consumer's buffer, once its last store has read
    it), then one TMA store of the (64, NJ) box at (``off_i``, ``off_j``): rows past M, columns past N dropped."""
    if HAS_BIAS:
        offs_n = off_j + gl.arange(0, NJ, layout=gl.SliceLayout(0, acc.type.layout))
        acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32), 0)
    tma.store_wait(0)
    smem.store(acc.to(gl.bfloat16))
    fence_async_shared()
    _tma_store(desc, [off_i, off_j], smem)


@gluon.jit
def _consume(a_ring, b_ring, bt_ring, full, empty, c_desc, c1_desc, c2_desc, c_smem, c_ptr, bias_ptr, M, N, stride_cm,
             step, first, n_tiles, num_pid_a, num_pid_b, col0, per_group, k_tiles, C: gl.constexpr, NB: gl.constexpr,
             NT: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, SWAP: gl.constexpr, HAS_BIAS: gl.constexpr,
             TMA_STORE: gl.constexpr, A_ROWS: gl.constexpr, GROUPS: gl.constexpr):  # fmt: skip
    """Consumer ``C``'s rows ``C * 64 ...`` of the tiles :func:`_produce` loads with the same arguments, each then
    stored (``TMA_STORE``, unswapped tiles without a B tail: through shared memory by TMA, grouped: into output
    ``c_desc``, ``c1_desc`` or ``c2_desc`` by the tile's operand; else from registers)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
    NT_L: gl.constexpr = NT if NT > 0 else 8
    layout_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NT_L, 16])  # fmt: skip
    for t in range(first, n_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        acc = gl.zeros([64, NB], gl.float32, layout)
        acc_t = gl.zeros([64, NT_L], gl.float32, layout_t)
        acc, acc_t, step = _mainloop(a_ring, b_ring, bt_ring, full, empty, step, k_tiles, acc, acc_t, C, NB, NT,
                                     STAGES)  # fmt: skip
        off_i = pid_a * A_ROWS + C * 64
        off_j = col0 + pid_b * (NB + NT)
        if GROUPS > 1:  # unswapped, no B tail, no bias, TMA-stored (matmul_ws_grouped)
            g, off_g = _group_of(pid_b, per_group, NB)
            if g == 0:
                _store_tma(acc, c_desc, c_smem.index(C), bias_ptr, off_i, off_g, N, NB, False)
            elif g == 1:
                _store_tma(acc, c1_desc, c_smem.index(C), bias_ptr, off_i, off_g, N, NB, False)
            else:
                _store_tma(acc, c2_desc, c_smem.index(C), bias_ptr, off_i, off_g, N, NB, False)
        elif TMA_STORE:
            _store_tma(acc, c_desc, c_smem.index(C), bias_ptr, off_i, off_j, N, NB, HAS_BIAS)
        else:
            offs_i = off_i + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
            _store(acc, c_ptr, bias_ptr, offs_i, off_j, M, N, stride_cm, NB, SWAP, HAS_BIAS)
            if NT > 0:
                offs_it = off_i + gl.arange(0, 64, layout=gl.SliceLayout(1, layout_t))
                _store(acc_t, c_ptr, bias_ptr, offs_it, off_j + NB, M, N, stride_cm, NT, SWAP, HAS_BIAS)
    return step


@gluon.jit
def _consumer(a_ring, b_ring, bt_ring, full, empty, c_desc, c1_desc, c2_desc, c_smem, c_ptr, bias_ptr, M, N,
              stride_cm, num_tiles, num_pid_a, num_pid_b, n_split, num_narrow, num_pid_n, per_group, k_tiles,
              C: gl.constexpr, BLOCK_B: gl.constexpr, B_TAIL: gl.constexpr, NARROW: gl.constexpr, GROUP: gl.constexpr,
              STAGES: gl.constexpr, SWAP: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr,
              A_ROWS: gl.constexpr, GROUPS: gl.constexpr):  # fmt: skip
    """The wide tiles (stored by TMA where ``TMA_STORE``), then the narrow ones (stored from registers)."""
    start = gl.program_id(0) * 0  # a tensor even where a launch specialises k_tiles = 1 as a constant
    step = _consume(a_ring, b_ring, bt_ring, full, empty, c_desc, c1_desc, c2_desc, c_smem, c_ptr, bias_ptr, M, N,
                    stride_cm, start, gl.program_id(0), num_tiles, num_pid_a, num_pid_b, 0, per_group, k_tiles,
                    C, BLOCK_B, B_TAIL, GROUP, STAGES, SWAP, HAS_BIAS, TMA_STORE, A_ROWS, GROUPS)  # fmt: skip
    if NARROW > 0:
        programs = gl.num_programs(0)
        first = (gl.program_id(0) + programs - num_tiles % programs) % programs
        _consume(a_ring, b_ring, bt_ring, full, empty, c_desc, c_desc, c_desc, c_smem, c_ptr, bias_ptr, M, N,
                 stride_cm, step, first, num_narrow, num_pid_a, num_pid_n, n_split, 0, k_tiles, C, NARROW, 0, GROUP,
                 STAGES, SWAP, HAS_BIAS, False, A_ROWS, 1)  # fmt: skip
    if TMA_STORE or GROUPS > 1:
        tma.store_wait(0)


@gluon.jit
def _gemm_ws_kernel(a_desc, b_desc, b1_desc, b2_desc, bt_desc, bn_desc, c_desc, c1_desc, c2_desc, c_ptr, bias_ptr, M,
                    N, stride_cm, num_tiles, num_pid_a, num_pid_b, n_split, num_narrow, num_pid_n, per_group, k_tiles,
                    BLOCK_B: gl.constexpr, B_TAIL: gl.constexpr, NARROW: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP: gl.constexpr, STAGES: gl.constexpr, SWAP: gl.constexpr, HAS_BIAS: gl.constexpr,
                    TMA_STORE: gl.constexpr, A_ROWS: gl.constexpr, GROUPS: gl.constexpr, REGS_C: gl.constexpr,
                    REGS_P: gl.constexpr):  # fmt: skip
    """``num_warps`` = 4 (one consumer warpgroup); the other consumer and the producer are workers. A tile is A_ROWS
    (128) A rows x (BLOCK_B + B_TAIL) B rows; with NARROW > 0 the columns from ``n_split`` on are NARROW-wide tiles.
    ``TMA_STORE`` (unswapped only): wide tiles through shared memory by TMA. ``GROUPS`` > 1 (:func:`matmul_ws_grouped`):
    B is the concatenation of ``b_desc``, ``b1_desc`` (and ``b2_desc``), ``per_group`` B tiles each, the outputs
    ``c_desc``, ``c1_desc`` (and ``c2_desc``)."""
    CONSUMERS: gl.constexpr = A_ROWS // 64
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, A_ROWS, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_B, BLOCK_K], b_desc.layout)
    if B_TAIL > 0:
        bt_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, B_TAIL, BLOCK_K], bt_desc.layout)
    else:
        bt_ring = b_ring  # unused
    if TMA_STORE:
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 64, BLOCK_B], c_desc.layout)
    else:
        c_smem = a_ring  # unused: stored from registers
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    gl.warp_specialize(
        [
            (_consumer, (a_ring, b_ring, bt_ring, full, empty, c_desc, c1_desc, c2_desc, c_smem, c_ptr, bias_ptr, M, N,
                         stride_cm, num_tiles, num_pid_a, num_pid_b, n_split, num_narrow, num_pid_n, per_group,
                         k_tiles, 0, BLOCK_B, B_TAIL, NARROW, GROUP, STAGES, SWAP, HAS_BIAS, TMA_STORE, A_ROWS,
                         GROUPS)),
            (_consumer, (a_ring, b_ring, bt_ring, full, empty, c_desc, c1_desc, c2_desc, c_smem, c_ptr, bias_ptr, M, N,
                         stride_cm, num_tiles, num_pid_a, num_pid_b, n_split, num_narrow, num_pid_n, per_group,
                         k_tiles, 1, BLOCK_B, B_TAIL, NARROW, GROUP, STAGES, SWAP, HAS_BIAS, TMA_STORE, A_ROWS,
                         GROUPS)),
            (_producer, (a_desc, b_desc, b1_desc, b2_desc, bt_desc, bn_desc, a_ring, b_ring, bt_ring, full, empty,
                         num_tiles, num_pid_a, num_pid_b, n_split, num_narrow, num_pid_n, per_group, k_tiles, BLOCK_B,
                         B_TAIL, NARROW, BLOCK_K, GROUP, STAGES, A_ROWS, GROUPS)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def matmul_ws(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig, programs: int
) -> torch.Tensor:
    """``y (M, N) = x (M, K) @ w (N, K)^T [+ bias]`` (contiguous bfloat16, 16-byte aligned rows and bases, CUDA) with
    ``cfg``'s tiling read this way: ``block_m`` the A rows of a tile (128: two consumers of 64),
    ``block_n`` the wide tile's B rows (weight rows, or tokens with ``swap_ab``), ``tail_m`` more B rows in a second
    MMA (0: none), ``tail_block_n`` the narrow tiles' width (normal orientation), ``group_m`` the swizzle,
    ``num_stages`` the ring depth. FP32 accumulation over ascending ``block_k`` chunks, one rounding; ``programs``:
    the SM count."""
    m, k = x.shape
    n = w.shape[0]
    p = plan(m, n, k, cfg, programs)
    _gemm_ws_kernel[(p.grid,)](
        **descriptors(x, w, y, cfg, p.n_split is not None), c_ptr=y, bias_ptr=bias if bias is not None else y, M=m,
        N=n, stride_cm=y.stride(0), num_tiles=p.tiles, num_pid_a=p.pid_a, num_pid_b=p.pid_b, n_split=p.n_split or 0,
        num_narrow=p.narrow_tiles, num_pid_n=p.pid_n, per_group=0, k_tiles=p.k_tiles, num_warps=4,
        **launch_constants(cfg, p.n_split is not None, bias is not None), **STRICT_LAUNCH,
    )  # fmt: skip
    return y


def matmul_ws_grouped(
    x: torch.Tensor, ws: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], cfg: GemmConfig, programs: int
) -> Sequence[torch.Tensor]:
    """``ys[g] (M, N) = x (M, K) @ ws[g] (N, K)^T`` for two or three weights of one shape in one persistent launch
    (no bias; :func:`groupable`): the tiles of the weights' concatenation (``G * N`` columns, ``block_n``-wide, none
    straddling two weights) in :func:`matmul_ws`'s swizzled order, no narrow tiles. Each output element is the same
    FP32 sum over ascending ``block_k`` chunks as :func:`matmul_ws` computes; only which program holds it differs, and
    the tail of one weight's tiles fills the wave the next weight's begin (q, k, v at M = 3160: 2100 tiles, 15.9 waves
    on 132 SMs, against 5.3 a weight)."""
    m, k = x.shape
    n, groups = ws[0].shape[0], len(ws)
    if not groupable(cfg, n, groups) or any(w.shape != ws[0].shape for w in ws) or len(ys) != groups:
        raise ValueError(f"gemm_gluon.matmul_ws_grouped: {groups} weights of {[tuple(w.shape) for w in ws]} with {cfg}")
    per_group, pid_a = n // cfg.block_n, cdiv(m, cfg.block_m)
    tiles = pid_a * per_group * groups
    descs = descriptors(x, ws[0], ys[0], cfg, False)
    pairs = zip(ws[1:], ys[1:], strict=True)
    extra = [(desc(w, [cfg.block_n, cfg.block_k]), desc(y, [64, cfg.block_n])) for w, y in pairs]
    extra += extra[-1:] * (3 - groups)  # an unused third operand repeats the second
    descs.update(b1_desc=extra[0][0], c1_desc=extra[0][1], b2_desc=extra[1][0], c2_desc=extra[1][1])
    _gemm_ws_kernel[(min(tiles, programs),)](
        **descs, c_ptr=ys[0], bias_ptr=ys[0], M=m, N=n, stride_cm=ys[0].stride(0), num_tiles=tiles, num_pid_a=pid_a,
        num_pid_b=per_group * groups, n_split=0, num_narrow=0, num_pid_n=0, per_group=per_group,
        k_tiles=cdiv(k, cfg.block_k), num_warps=4, **launch_constants(cfg, False, False, groups), **STRICT_LAUNCH,
    )  # fmt: skip
    return ys
