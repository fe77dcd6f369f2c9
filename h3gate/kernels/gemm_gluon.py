"""The strict GEMM forward as a warp-specialised persistent Gluon kernel for Hopper: the same K walk and arithmetic
as :mod:`h3gate.kernels.gemm`, its instructions scheduled explicitly (``GemmConfig.gluon``).

Triton 3.6's own Hopper GEMM issues each ``wgmma`` from the warps that also wait for the loads, and its automatic warp
specialisation gave nothing on sm_90 (``docs/measurements/gemm-gap-profile.md``). Here the product
``C[i, j] = sum_k A[i, k] B[j, k]`` of two K-contiguous operands (A: ``a_rows`` x K, B: ``b_rows`` x K) is run by
three partitions of one persistent program an SM, walking output tiles ``pid``, ``pid + programs``, ... in the
GROUP_M-swizzled order of :func:`h3gate.kernels.gemm._tile_coords`:

* a one-warp producer issuing every TMA load: per tile, per ascending ``BLOCK_K`` chunk, the (128 x BLOCK_K) A tile
  and the (BLOCK_B x BLOCK_K) B tile into a ring of ``STAGES`` buffers (``full``: loaded; ``empty``: both consumers
  done with it); the ring runs on across tiles, so the next tile's first chunks load during this tile's epilogue;
* two consumer warpgroups of 64 A rows each, every chunk one asynchronous ``wgmma`` (m64, N = BLOCK_B, k16 steps)
  onto a zero FP32 accumulator, one MMA kept in flight (``warpgroup_mma_wait(1)``) while the next chunk's barrier is
  awaited; the epilogue adds the bias in FP32 and rounds once to bfloat16 (round to nearest even).

The forward ``Y (M, N) = X (M, K) @ W (N, K)^T`` runs it either way round: ``swap=False`` with A = X, B = W (a tile is
128 token rows x BLOCK_B weight rows, stored through shared memory by TMA), or ``swap=True`` with A = W, B = X
(``Y^T = W X^T``: 128 weight rows x BLOCK_B tokens, BLOCK_B any multiple of 8 up to 256, so 264 tokens are two tiles
of 136; stored transposed, element by element). Either way each output element is one FP32 sum over K in ascending
BLOCK_K chunks, each chunk the MMA's k16 steps in ascending order, the walk of the Triton kernel's ``tl.dot``
(lowered to the same ``wgmma`` shape); the K tail past K reads TMA's zero fill. Which program, partition or tile holds
an element is scheduling. The bytes are checked against the Triton kernel on the H200 (``tools/gpu_gemm_gluon.py``).

GPU only (Gluon has no interpreter; the CPU interpreter runs the Triton kernel, the same arithmetic); sm_90, bfloat16.
"""

from __future__ import annotations

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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from h3gate.kernels.common import STRICT_LAUNCH

# Triton 3.6 and 3.7 name the TMA copies async_copy_global_to_shared / async_copy_shared_to_global, 3.9 async_load /
# async_store (same positional arguments).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

BLOCK_A = 128  # two consumer warpgroups of 64 A rows
# Registers a thread (setmaxnreg): the worker consumer and the producer; the default consumer gets what the launch's
# limit leaves (the attention's split, h3gate.kernels.attention_gluon.REGS).
REGS = (240, 24)
WS_MAXNREG = 168


@gluon.jit
def _tile_coords(tile_id, num_pid_a, num_pid_b, GROUP: gl.constexpr):
    """GROUP-swizzled tile order over (A tiles, B tiles): scheduling only."""
    in_group = GROUP * num_pid_b
    first_a = (tile_id // in_group) * GROUP
    size_a = gl.minimum(num_pid_a - first_a, GROUP)
    return first_a + (tile_id % in_group) % size_a, (tile_id % in_group) // size_a


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, full, empty, num_tiles, num_pid_a, num_pid_b, k_tiles,
              BLOCK_B: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Every tile's chunks in ascending K into the ring; a slot is reloaded once both consumers released it."""
    step = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        for ki in range(k_tiles):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            bar = full.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_a * 128, ki * BLOCK_K], bar, a_ring.index(slot))
            _tma_load(b_desc, [pid_b * BLOCK_B, ki * BLOCK_K], bar, b_ring.index(slot))
            step += 1


@gluon.jit
def _mainloop(a_ring, b_ring, full, empty, step, k_tiles, acc, C: gl.constexpr, STAGES: gl.constexpr):
    """This consumer's 64 A rows of one tile: ``acc += A_chunk B_chunk^T`` over the ascending chunks, one MMA in
    flight; returns (acc, the ring step after the tile)."""
    for ki in range(k_tiles):
        slot = step % STAGES
        mbarrier.wait(full.index(slot), (step // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(slot).slice(C * 64, 64), b_ring.index(slot).permute((1, 0)), acc,
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous chunk's MMA has retired: release its slot
        if ki > 0:
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        step += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    return acc, step


@gluon.jit
def _consumer(a_ring, b_ring, full, empty, c_desc, c_smem, c_ptr, bias_ptr, M, N, stride_cm, num_tiles, num_pid_a,
              num_pid_b, k_tiles, C: gl.constexpr, BLOCK_B: gl.constexpr, GROUP: gl.constexpr,
              STAGES: gl.constexpr, SWAP: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
    """Consumer ``C``: rows ``C * 64 ...`` of every tile the program walks, then the tile's epilogue."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_B, 16])  # fmt: skip
    step = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        acc = gl.zeros([64, BLOCK_B], gl.float32, acc_layout)
        acc, step = _mainloop(a_ring, b_ring, full, empty, step, k_tiles, acc, C, STAGES)
        offs_i = pid_a * 128 + C * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        offs_j = pid_b * BLOCK_B + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(0, acc_layout))
        if SWAP:  # i: weight row (output column), j: token (output row)
            if HAS_BIAS:
                acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_i, mask=offs_i < N, other=0.0).to(gl.float32), 1)
            ptrs = c_ptr + gl.expand_dims(offs_j.to(gl.int64), 0) * stride_cm + gl.expand_dims(offs_i, 1)
            gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(offs_j < M, 0) & gl.expand_dims(offs_i < N, 1))
        else:  # i: token, j: weight row
            if HAS_BIAS:
                acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_j, mask=offs_j < N, other=0.0).to(gl.float32), 0)
            tma.store_wait(0)  # this consumer's last store has read its half of c_smem
            half = c_smem.index(C)
            half.store(acc.to(gl.bfloat16))
            fence_async_shared()
            _tma_store(c_desc, [pid_a * 128 + C * 64, pid_b * BLOCK_B], half)
    if not SWAP:
        tma.store_wait(0)


@gluon.jit
def _gemm_ws_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, M, N, stride_cm, num_tiles, num_pid_a, num_pid_b,
                    k_tiles, BLOCK_B: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                    SWAP: gl.constexpr, HAS_BIAS: gl.constexpr, REGS_C: gl.constexpr,
                    REGS_P: gl.constexpr):  # fmt: skip
    """``num_warps`` = 4 (one consumer warpgroup); the other consumer and the producer are workers."""
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_B, BLOCK_K], b_desc.layout)
    if SWAP:
        c_smem = a_ring  # unused: the swapped epilogue stores from registers
    else:
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BLOCK_B], c_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize(
        [
            (_consumer, (a_ring, b_ring, full, empty, c_desc, c_smem, c_ptr, bias_ptr, M, N, stride_cm, num_tiles,
                         num_pid_a, num_pid_b, k_tiles, 0, BLOCK_B, GROUP, STAGES, SWAP, HAS_BIAS)),
            (_consumer, (a_ring, b_ring, full, empty, c_desc, c_smem, c_ptr, bias_ptr, M, N, stride_cm, num_tiles,
                         num_pid_a, num_pid_b, k_tiles, 1, BLOCK_B, GROUP, STAGES, SWAP, HAS_BIAS)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, full, empty, num_tiles, num_pid_a, num_pid_b, k_tiles,
                         BLOCK_B, BLOCK_K, GROUP, STAGES)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def descriptors(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_b: int, block_k: int, swap: bool) -> tuple:
    """Host TMA descriptors: (A, B, C) for the forward ``y = x @ w^T`` (C, a consumer's 64-row half of a tile, only
    without ``swap``)."""
    a, b = (w, x) if swap else (x, w)
    return _desc(a, [BLOCK_A, block_k]), _desc(b, [block_b, block_k]), None if swap else _desc(y, [64, block_b])


def launch_args(m: int, n: int, k: int, block_b: int, block_k: int, swap: bool, programs: int) -> tuple[int, ...]:
    """(programs, num_tiles, A tiles, B tiles, K chunks) of one launch."""
    a_rows, b_rows = (n, m) if swap else (m, n)
    pid_a, pid_b = -(-a_rows // BLOCK_A), -(-b_rows // block_b)
    tiles = pid_a * pid_b
    return min(tiles, programs), tiles, pid_a, pid_b, -(-k // block_k)


def matmul_ws(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    block_b: int,
    block_k: int,
    group: int,
    stages: int,
    swap: bool,
    programs: int,
) -> torch.Tensor:
    """``y (M, N) = x (M, K) @ w (N, K)^T [+ bias]`` (contiguous bfloat16, 16-byte aligned, CUDA): FP32 accumulation
    over ascending ``block_k`` chunks, one rounding; ``programs``: the persistent grid (the SM count)."""
    m, k = x.shape
    n = w.shape[0]
    a_desc, b_desc, c_desc = descriptors(x, w, y, block_b, block_k, swap)
    grid, tiles, pid_a, pid_b, k_tiles = launch_args(m, n, k, block_b, block_k, swap, programs)
    _gemm_ws_kernel[(grid,)](
        a_desc, b_desc, c_desc, y, bias if bias is not None else y, m, n, y.stride(0), tiles, pid_a, pid_b, k_tiles,
        BLOCK_B=block_b, BLOCK_K=block_k, GROUP=group, STAGES=stages, SWAP=swap, HAS_BIAS=bias is not None,
        REGS_C=REGS[0], REGS_P=REGS[1], num_warps=4, maxnreg=WS_MAXNREG, **STRICT_LAUNCH,
    )  # fmt: skip
    return y
