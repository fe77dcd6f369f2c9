"""The strict attention backward's two walks as warp-specialised Gluon kernels for Hopper (the
``gluon_warp_specialised`` path): dK/dV (``attention_bwd._dkdv_kernel``) and dQ (``_dq_kernel``), the same walks and
arithmetic, the MMAs asynchronous.

Triton's pipeliner makes an MMA asynchronous only when its result feeds another MMA's accumulator, so the Triton
kernels wait for ``q k^T`` and for ``dout v^T`` before the CUDA cores may use them, one at a time. Here one program
owns 128 rows (KV rows for dK/dV, query rows for dQ; ``_bwd_ws_kernel``, ``DQ`` picks the walk) in three partitions:

* a one-warp producer issuing every TMA load of the walked operands (q and dout for dK/dV, k and v for dQ; canonical
  rows) in 64-row steps into a ring of ``STAGES`` buffers (``*_full``: loaded; ``*_empty``: both consumers done);
* two consumer warpgroups of 64 owned rows each (the default partition and a worker, 240 registers a thread). Each
  loads its own rows once (through the walk order) into shared memory, then per step issues the two score products
  together and forms p while the second runs:
  - dK/dV (the walked query rows' lse2 and delta come with q and dout, by the producer's TMA: 7-10 % faster than
    loading them in the consumers, and no spills): ``qk^T = k q^T``, ``dp^T = v dout^T``; ``p^T``; then
    ``ds^T = cast(p^T * (dp^T - delta))``, and ``dv += cast(p^T) dout``, ``dk += ds^T q`` issued together (ds^T
    before dv: fewer live registers);
  - dQ: ``qk = q k^T``, ``dp = dout v^T``; ``p``; ``ds = cast(p * (dp - delta))``; ``dq += ds k``, software-pipelined:
    step j + 1's scores are issued before step j's ``dq`` product (5-6 % faster than the plain order).
  Every MMA group is retired within its step (ptxas serialises ``wgmma`` when a group stays in flight across the
  loop's back edge).

One program a tile, on an (m_tiles, B * H) grid.

The arithmetic of every element is ``_dkdv_block``'s / ``_dq_block``'s, with the same operations on the same layouts:
``wgmma`` m64n64k16 for the score products (K = D = 128, 8 k-steps ascending, onto zero FP32 accumulators),
m64n128k16 for the gradient products (K = 64 rows of the step, 4 k-steps ascending, chained across the steps in
ascending order); ``p = exp2(fma(qk, c, -lse2))`` (or ``qk * c - lse2``) with the declared ``bwd_exp2`` form, zero
past S in the last step; ``dk`` and ``dq`` times ``1/sqrt(D)`` at the end, each gradient rounded once (RNE) when
stored. The walked operands come by host TMA descriptors over (B, S, nh * D) views with (1, 64, D) boxes, so rows past
S are zeros (as the pointer kernels' masked loads give). The kernel id and contract are
:mod:`h3gate.kernels.attention`'s; the H200 probe (``tools/gpu_attention_bwd.py``) compares dq, dk and dv byte for
byte with the Triton kernels' (equal at S = 264 ... 38974, batch 2, walk orders).

GPU only (Gluon has no interpreter; the interpreter runs the Triton kernels, the same arithmetic); sm_90, bfloat16,
D = 128, tiling kv 128 x 64 and q 128 x 64. ``tests/triton_kernels/sm90_lowering.py`` compiles both for sm_90 on the
CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from h3gate.kernels.attention_config import PRODUCTION, AttnConfig, AttnLaunch
from h3gate.kernels.attention_gluon import _exp2, descriptors, walk_producer
from h3gate.kernels.attention_math import gather_rows
from h3gate.kernels.attention_sources import copied_tiles, tile_sources
from h3gate.kernels.common import STRICT_LAUNCH

# Registers a thread (setmaxnreg) of the worker consumer and the producer: 240 / 24 (with 232 / 40 the dK/dV kernel
# spilled twice as much and ran 5 % slower at S = 38974); 12 warps x 168 = the 64K registers of an SM.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
WS_MAXNREG = 168


@gluon.jit
def _own_rows(k_ptr, v_ptr, k_smem, v_smem, ord_ptr, S, base, first, stride_s, KV: gl.constexpr, D: gl.constexpr,
              ORDERED: gl.constexpr):  # fmt: skip
    """This consumer's k and v rows (``first`` .. ``first + KV``, through the order; zero past S) into shared memory."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs = first + gl.arange(0, KV, layout=gl.SliceLayout(1, ld))
    if ORDERED:
        rows = gl.load(ord_ptr + offs, mask=offs < S, other=0)
    else:
        rows = offs.to(gl.int64)
    ptrs = base + gl.expand_dims(rows, 1) * stride_s + gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, ld)), 0)
    valid = gl.expand_dims(offs < S, 1)
    k_smem.store(gl.load(k_ptr + ptrs, mask=valid, other=0.0))
    v_smem.store(gl.load(v_ptr + ptrs, mask=valid, other=0.0))
    fence_async_shared()


@gluon.jit
def _p_t(qk, lse, offs_q, S, qk_scale, MASK: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr):
    """``_dkdv_block``'s p^T from the raw scores (KV rows x query rows) and the (1, query rows) lse2, zero in query
    columns past S."""
    if FMA:
        p = _exp2(gl.fma(qk, qk_scale, -lse), EXP2)
    else:
        p = _exp2(qk * qk_scale - lse, EXP2)
    if MASK:
        p = gl.where(gl.expand_dims(offs_q, 0) < S, p, 0.0)
    return p


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, q_full, do_full, q_empty, do_empty, k_ptr, v_ptr, dk_ptr, dv_ptr,
                   ord_ptr, S, base, first, qk_scale, sm_scale, stride_s, lse_smem, dl_smem, BLOCK_M: gl.constexpr,
                   D: gl.constexpr, STAGES: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr,
                   ORDERED: gl.constexpr):  # fmt: skip
    """``_dkdv_kernel``'s walk for 64 KV rows; the walked query rows' lse2 and delta read from the shared-memory ring
    the producer fills with them beside q and dout."""
    KV: gl.constexpr = 64
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    _own_rows(k_ptr, v_ptr, k_smem, v_smem, ord_ptr, S, base, first, stride_s, KV, D, ORDERED)
    zero_s = gl.zeros([KV, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([KV, D], gl.float32, a_layout)
    dv = gl.zeros([KV, D], gl.float32, a_layout)
    offs_q0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    for j in range(0, gl.cdiv(S, BLOCK_M)):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        offs_q = j * BLOCK_M + offs_q0
        q_tile = q_smem.index(slot).reshape([BLOCK_M, D])
        do_tile = do_smem.index(slot).reshape([BLOCK_M, D])
        mbarrier.wait(q_full.index(slot), phase)
        qk = warpgroup_mma(k_smem, q_tile.permute((1, 0)), zero_s, is_async=True)
        mbarrier.wait(do_full.index(slot), phase)
        dp = warpgroup_mma(v_smem, do_tile.permute((1, 0)), zero_s, is_async=True)
        lse = lse_smem.index(slot).load(s_layout)  # zeros past S (TMA fill), as the masked loads give
        dl = dl_smem.index(slot).load(s_layout)
        qk = warpgroup_mma_wait(1, deps=(qk,))
        if (j + 1) * BLOCK_M > S:
            p = _p_t(qk, lse, offs_q, S, qk_scale, True, EXP2, FMA)
        else:
            p = _p_t(qk, lse, offs_q, S, qk_scale, False, EXP2, FMA)
        dp = warpgroup_mma_wait(0, deps=(dp,))  # both products issued once ds^T is formed (fewer live registers)
        ds_op = gl.convert_layout((p * (dp - dl)).to(gl.bfloat16), op_layout)
        p_op = gl.convert_layout(p.to(gl.bfloat16), op_layout)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
    _store_rows(dk_ptr, dk * sm_scale, ord_ptr, S, base, first, stride_s, a_layout, KV, D, ORDERED)
    _store_rows(dv_ptr, dv, ord_ptr, S, base, first, stride_s, a_layout, KV, D, ORDERED)


@gluon.jit
def _dq_p(qk, lse, j, offs_n0, S, qk_scale, BLOCK_N: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr):
    """``_dq_block``'s p of KV step ``j`` from the raw scores, zero in KV columns past S."""
    if FMA:
        p = _exp2(gl.fma(qk, qk_scale, -lse), EXP2)
    else:
        p = _exp2(qk * qk_scale - lse, EXP2)
    if (j + 1) * BLOCK_N > S:
        p = gl.where(gl.expand_dims(j * BLOCK_N + offs_n0, 0) < S, p, 0.0)
    return p


@gluon.jit
def _store_rows(ptr, acc, ord_ptr, S, base, first, stride_s, layout: gl.constexpr, M: gl.constexpr,
                D: gl.constexpr, ORDERED: gl.constexpr):  # fmt: skip
    """Rows ``first`` .. ``first + M`` of ``acc`` (FP32) rounded once (RNE) to bfloat16, through the order."""
    offs = first + gl.arange(0, M, layout=gl.SliceLayout(1, layout))
    if ORDERED:
        rows = gl.load(ord_ptr + offs, mask=offs < S, other=0)
    else:
        rows = offs.to(gl.int64)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    gl.store(ptr + base + gl.expand_dims(rows, 1) * stride_s + gl.expand_dims(cols, 0), acc.to(gl.bfloat16),
             mask=gl.expand_dims(offs < S, 1))  # fmt: skip


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_ptr, do_ptr, dq_ptr, lse_ptr,
                 delta_ptr, ord_ptr, S, stat, base, first, qk_scale, sm_scale, stride_s, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr,
                 ORDERED: gl.constexpr):  # fmt: skip
    """``_dq_block``'s walk for 64 query rows: per KV step ``qk = q k^T`` and ``dp = dout v^T`` issued together,
    ``p = exp2(fma(qk, c, -lse2))`` (zero in KV columns past S), ``ds = cast(p * (dp - delta))``, ``dq += ds k``;
    software-pipelined: step j + 1's ``qk`` is issued before step j's ``dq`` product, and its p formed while that and
    step j + 1's ``dp`` run (the same products in the same order)."""
    M: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    _own_rows(q_ptr, do_ptr, q_smem, do_smem, ord_ptr, S, base, first, stride_s, M, D, ORDERED)
    offs_m = first + gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
    lse = gl.expand_dims(gl.load(lse_ptr + stat + offs_m, mask=offs_m < S, other=0.0), 1)
    dl = gl.expand_dims(gl.load(delta_ptr + stat + offs_m, mask=offs_m < S, other=0.0), 1)
    zero_s = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([M, D], gl.float32, a_layout)
    offs_n0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_steps = gl.cdiv(S, BLOCK_N)
    mbarrier.wait(k_full.index(0), 0)
    qk = warpgroup_mma(q_smem, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), zero_s, is_async=True)
    mbarrier.wait(v_full.index(0), 0)
    dp = warpgroup_mma(do_smem, v_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), zero_s, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk,))
    p = _dq_p(qk, lse, 0, offs_n0, S, qk_scale, BLOCK_N, EXP2, FMA)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    ds_op = gl.convert_layout((p * (dp - dl)).to(gl.bfloat16), op_layout)
    for j in range(0, n_steps - 1):
        slot = j % STAGES
        nxt = (j + 1) % STAGES
        phase = ((j + 1) // STAGES) & 1
        mbarrier.wait(k_full.index(nxt), phase)
        qk = warpgroup_mma(q_smem, k_smem.index(nxt).reshape([BLOCK_N, D]).permute((1, 0)), zero_s,
                           is_async=True)  # fmt: skip
        dq = warpgroup_mma(ds_op, k_smem.index(slot).reshape([BLOCK_N, D]), dq, is_async=True)
        mbarrier.wait(v_full.index(nxt), phase)
        dp = warpgroup_mma(do_smem, v_smem.index(nxt).reshape([BLOCK_N, D]).permute((1, 0)), zero_s,
                           is_async=True)  # fmt: skip
        qk = warpgroup_mma_wait(2, deps=(qk,))
        p = _dq_p(qk, lse, j + 1, offs_n0, S, qk_scale, BLOCK_N, EXP2, FMA)
        dq, ds_op = warpgroup_mma_wait(1, deps=(dq, ds_op))
        mbarrier.arrive(k_empty.index(slot), count=1)
        mbarrier.arrive(v_empty.index(slot), count=1)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds_op = gl.convert_layout((p * (dp - dl)).to(gl.bfloat16), op_layout)
    last = (n_steps - 1) % STAGES
    dq = warpgroup_mma(ds_op, k_smem.index(last).reshape([BLOCK_N, D]), dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
    _store_rows(dq_ptr, dq * sm_scale, ord_ptr, S, base, first, stride_s, a_layout, M, D, ORDERED)


@gluon.jit
def _consumer(own_a, own_b, a_smem, b_smem, a_full, b_full, a_empty, b_empty, own_a_ptr, own_b_ptr, out_a_ptr,
              out_b_ptr, lse_ptr, delta_ptr, ord_ptr, S, stat, base, first, qk_scale, sm_scale, stride_s, la_smem,
              lb_smem, ROW0: gl.constexpr, STEP: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              EXP2: gl.constexpr, FMA: gl.constexpr, ORDERED: gl.constexpr, DQ: gl.constexpr):  # fmt: skip
    """One consumer's walk: rows ``ROW0`` .. ``ROW0 + 64`` of this program's tile (``DQ``: query rows, else KV rows)."""
    if DQ:
        _dq_consumer(own_a, own_b, a_smem, b_smem, a_full, b_full, a_empty, b_empty, own_a_ptr, own_b_ptr, out_a_ptr,
                     lse_ptr, delta_ptr, ord_ptr, S, stat, base, first + ROW0, qk_scale, sm_scale, stride_s, STEP, D,
                     STAGES, EXP2, FMA, ORDERED)  # fmt: skip
    else:
        _dkdv_consumer(own_a, own_b, a_smem, b_smem, a_full, b_full, a_empty, b_empty, own_a_ptr, own_b_ptr,
                       out_a_ptr, out_b_ptr, ord_ptr, S, base, first + ROW0, qk_scale, sm_scale, stride_s, la_smem,
                       lb_smem, STEP, D, STAGES, EXP2, FMA, ORDERED)  # fmt: skip


@gluon.jit
def _producer(a_desc, b_desc, la_desc, lb_desc, a_smem, b_smem, la_smem, lb_smem, a_full, b_full, a_empty, b_empty,
              S, b, bh, col, tile_map, a_copy, b_copy, STEP: gl.constexpr, STAGES: gl.constexpr,
              STATS: gl.constexpr):  # fmt: skip
    """``walk_producer`` of this program's walked operands (q and dout for dK/dV, k and v for dQ), and with ``STATS``
    (the dK/dV walk) each walked tile's lse2 (with q) and delta (with dout) beside it, (1, STEP) FP32 boxes of the
    (B * nh, S) arrays, zeros past S. With ``tile_map`` the walked operands are the packed tensors and ``a_copy`` /
    ``b_copy`` their copied tiles."""
    if STATS:
        walk_producer(a_desc, b_desc, a_smem, b_smem, a_full, b_full, a_empty, b_empty, S, b, col, STEP, STAGES, 0,
                      la_desc, lb_desc, la_smem, lb_smem, bh, tile_map, a_copy, b_copy)  # fmt: skip
    else:
        walk_producer(a_desc, b_desc, a_smem, b_smem, a_full, b_full, a_empty, b_empty, S, b, col, STEP, STAGES, 0,
                      tile_map=tile_map, a_copy=a_copy, b_copy=b_copy)  # fmt: skip


@gluon.jit
def _bwd_ws_kernel(a_desc, b_desc, la_desc, lb_desc, own_a_ptr, own_b_ptr, out_a_ptr, out_b_ptr, lse_ptr, delta_ptr,
                   ord_ptr, tile_map, a_copy, b_copy, S, H, qk_scale, sm_scale, stride_b, stride_s, D: gl.constexpr,
                   STEP: gl.constexpr, STAGES: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr,
                   ORDERED: gl.constexpr, DQ: gl.constexpr):  # fmt: skip
    """128 owned rows a program (two consumers of 64: KV rows for dK/dV, query rows with ``DQ``) on an (m_tiles,
    B * H) grid, the walked operands (a, b) ``STEP`` rows a step; ``num_warps`` = 4. ``la_desc`` / ``lb_desc``: lse2 /
    delta descriptors (read by the dK/dV walk)."""
    pid = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    col = (bh % H) * D
    base = b.to(gl.int64) * stride_b + col
    stat = bh.to(gl.int64) * S
    first = pid * 128
    own_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    own_a = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], own_layout)
    own_b = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], own_layout)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, STEP, D], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, STEP, D], b_desc.layout)
    a_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_full.index(i), count=1)
        mbarrier.init(b_full.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=2)
        mbarrier.init(b_empty.index(i), count=2)
    STATS: gl.constexpr = not DQ  # only the dK/dV walk reads lse2 / delta by TMA
    if DQ:
        la_smem = a_smem  # unused by the dQ walk
        lb_smem = b_smem
    else:
        la_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STEP], la_desc.layout)
        lb_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STEP], lb_desc.layout)
    gl.warp_specialize(
        [
            (_consumer, (own_a.index(0), own_b.index(0), a_smem, b_smem, a_full, b_full, a_empty, b_empty, own_a_ptr,
                         own_b_ptr, out_a_ptr, out_b_ptr, lse_ptr, delta_ptr, ord_ptr, S, stat, base, first, qk_scale,
                         sm_scale, stride_s, la_smem, lb_smem, 0, STEP, D, STAGES, EXP2, FMA, ORDERED, DQ)),
            (_consumer, (own_a.index(1), own_b.index(1), a_smem, b_smem, a_full, b_full, a_empty, b_empty, own_a_ptr,
                         own_b_ptr, out_a_ptr, out_b_ptr, lse_ptr, delta_ptr, ord_ptr, S, stat, base, first, qk_scale,
                         sm_scale, stride_s, la_smem, lb_smem, 64, STEP, D, STAGES, EXP2, FMA, ORDERED, DQ)),
            (_producer, (a_desc, b_desc, la_desc, lb_desc, a_smem, b_smem, la_smem, lb_smem, a_full, b_full, a_empty,
                         b_empty, S, b, bh, col, tile_map, a_copy, b_copy, STEP, STAGES, STATS)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def check_tiling(cfg: AttnConfig) -> None:
    """The tiling these kernels implement (a programming error otherwise: the tiling tables are validated)."""
    if (cfg.kv_n, cfg.kv_m, cfg.q_m, cfg.q_n) != (128, 64, 128, 64):
        raise ValueError(f"the Gluon backward runs kv 128 x 64 and q 128 x 64, not the tiling {cfg.tag}")


def _launch(walk_a: torch.Tensor, walk_b: torch.Tensor, own_a: torch.Tensor, own_b: torch.Tensor,
            out_a: torch.Tensor, out_b: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
            order: torch.Tensor | None, cfg: AttnConfig, sm_scale: float, c: float, dq: bool,
            launch: AttnLaunch) -> None:  # fmt: skip
    """The walk of ``walk_a`` / ``walk_b`` (packed rows, walked in ``order``: through their tile sources, or whole
    canonical copies without ``launch.tile_sources``) against the owned rows ``own_a`` / ``own_b``."""
    b, s, h, d = own_a.shape
    walk_a, walk_b = walk_a.view(b, s, h, d), walk_b.view(b, s, h, d)
    tile_map = copies = None
    if order is not None and launch.tile_sources:
        src = tile_sources(order, 64)
        tile_map = src.tile_map
        copies = descriptors(*(copied_tiles(t, src) for t in (walk_a, walk_b, walk_a)), 64, 64)[:2]
    elif order is not None:
        walk_a, walk_b = gather_rows(walk_a, order), gather_rows(walk_b, order)
    a_desc, b_desc, _ = descriptors(walk_a, walk_b, walk_a, 64, 64)
    la_desc, lb_desc = stats_descriptors(lse, delta, 64)
    _bwd_ws_kernel[(triton.cdiv(s, 128), b * h)](
        a_desc, b_desc, la_desc, lb_desc, own_a, own_b, out_a, out_b, lse, delta, own_a if order is None else order,
        tile_map, *(copies or (None, None)), s, h, c, sm_scale, own_a.stride(0), own_a.stride(1), D=d, STEP=64,
        STAGES=cfg.kv_stages if not dq else cfg.q_stages, EXP2=cfg.bwd_exp2_code, FMA=cfg.bwd_fma,
        ORDERED=order is not None, DQ=dq, num_warps=4, maxnreg=WS_MAXNREG, **STRICT_LAUNCH,
    )  # fmt: skip


def stats_descriptors(lse: torch.Tensor, delta: torch.Tensor, step: int) -> tuple:
    """Host TMA descriptors over the (B * nh, S) FP32 lse2 and delta with (1, ``step``) boxes (zeros past S). TMA
    needs 16-byte row strides: where S is not a multiple of 4 the rows are copied into a zero-padded buffer (2 x 4 S
    bytes a head, about 17 MB at 768p)."""
    rows, s = lse.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)

    def desc(t: torch.Tensor) -> TensorDescriptor:
        if s % 4:
            t = torch.nn.functional.pad(t, (0, 4 - s % 4))
        return TensorDescriptor(t, [rows, s], [t.stride(0), 1], [1, step], layout)

    return desc(lse), desc(delta)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def both_walks(dkdv: Callable[[], None], dq: Callable[[], None], device: torch.device, side_stream: bool) -> None:
    """The dK/dV walk, then the dQ walk; with ``side_stream`` the dQ walk is enqueued on a side stream that waits
    for what the caller's stream has queued so far, and the caller's stream waits for it before its next work (the
    two kernels may then run at once; each reads the same inputs and writes only its own outputs). Temporaries the
    dQ walk allocates belong to the side stream; everything else it touches outlives the join."""
    if not side_stream:
        dkdv()
        dq()
        return
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(main)
    dkdv()
    with torch.cuda.stream(side):
        dq()
    main.wait_stream(side)


def dkdv_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, order: torch.Tensor | None, cfg: AttnConfig,
               sm_scale: float, c: float, launch: AttnLaunch = PRODUCTION) -> None:  # fmt: skip
    """dK and dV into ``dk`` / ``dv`` (packed rows): the walk of ``q`` / ``do`` (contiguous bfloat16, packed rows) in
    ``order`` (None: packed order), the owned ``k`` / ``v`` rows read through it, lse2 and delta (canonical rows)."""
    check_tiling(cfg)
    _launch(q, do, k, v, dk, dv, lse, delta, order, cfg, sm_scale, c, False, launch)


def dq_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, dq: torch.Tensor, order: torch.Tensor | None, cfg: AttnConfig, sm_scale: float,
             c: float, launch: AttnLaunch = PRODUCTION) -> None:  # fmt: skip
    """dQ into ``dq`` (packed rows): the walk of ``k`` / ``v`` (contiguous bfloat16, packed rows) in ``order``, the
    owned ``q`` / ``do`` rows read through it, lse2 and delta (canonical rows)."""
    check_tiling(cfg)
    _launch(k, v, q, do, dq, dq, lse, delta, order, cfg, sm_scale, c, True, launch)
