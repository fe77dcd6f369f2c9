"""The strict attention's dK/dV walk as a warp-specialised Gluon kernel for Hopper (``AttnConfig.bwd_gluon``): the
same walk and arithmetic as ``attention_bwd._dkdv_kernel``, its MMAs issued asynchronously.

Triton's pipeliner makes an MMA asynchronous only when its result feeds another MMA's accumulator, so the Triton
dK/dV kernel waits for ``k q^T`` and for ``v dout^T`` before the CUDA cores may use them, and no MMA runs meanwhile.
Here one program of 128 KV rows (batch x head ``bh``) has three partitions:

* a one-warp producer issuing every TMA load: each 64-row query step's q and dout tiles (canonical rows) into a
  ring of ``STAGES`` buffers (``*_full``: loaded; ``*_empty``: both consumers done with it);
* two consumer warpgroups of 64 KV rows each (the default partition and a worker). Each loads its k and v rows once
  (through the walk order) into shared memory, then per query step issues ``qk^T = k q^T`` and ``dp^T = v dout^T``
  together, forms ``p^T`` while ``dp^T`` is in flight, issues ``dv += cast(p^T) dout``, forms ``ds^T`` while that
  runs, issues ``dk += cast(ds^T) q`` and retires both before the step ends (ptxas serialises ``wgmma`` when a group
  stays in flight across the loop's back edge).

The arithmetic of every element is ``_dkdv_block``'s, with the same operations on the same layouts: ``wgmma``
m64n64k16 for ``k q^T`` and ``v dout^T`` (K = D = 128, 8 k-steps ascending, onto zero FP32 accumulators), m64n128k16 for
``cast(p^T) dout`` and ``cast(ds^T) q`` (K = 64 query rows, 4 k-steps ascending, chained across the query steps in
ascending order); ``p^T = exp2(fma(qk^T, c, -lse2))`` (or ``qk^T * c - lse2``) with the declared ``bwd_exp2`` form,
zero past S in the last step; ``ds^T = cast(p^T * (dp^T - delta))``; ``dk *= 1/sqrt(D)`` at the end, each gradient
rounded once (RNE) when stored. q / dout come by host TMA descriptors over (B, S, nh * D) views with (1, 64, D) boxes,
so rows past S are zeros (as the pointer kernel's masked loads give). The kernel id and contract are
:mod:`h3gate.kernels.attention`'s; the H200 probe (``tools/gpu_attention_bwd.py``) compares dK and dV byte for byte
with the Triton kernel's.

GPU only (Gluon has no interpreter; the interpreter runs the Triton kernel, the same arithmetic); sm_90, bfloat16,
D = 128, ``kv_n`` = 128, ``kv_m`` = 64. ``tests/triton_kernels/sm90_lowering.py`` compiles it for sm_90 on the CPU.
"""

from __future__ import annotations

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

from h3gate.kernels.attention import AttnConfig
from h3gate.kernels.attention_gluon import _exp2, _load, descriptors
from h3gate.kernels.common import STRICT_LAUNCH

KV_ROWS = 64  # KV rows a consumer warpgroup owns (the program owns two consumers' worth: kv_n = 128)
# Registers a thread (setmaxnreg) of the worker consumer and the producer: (232, 40) as the forward, or (240, 24).
REGS = (232, 40)
COMPACT = False  # load lse2 / delta one element a thread, then convert to the scores' column layout
WS_MAXNREG = 168
EARLY_DV = False  # issue dv's MMA before ds^T is formed (more live registers); the probe measures both


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
    """``_dkdv_block``'s p^T from the raw scores (KV rows x query rows), zero in query columns past S."""
    if FMA:
        p = _exp2(gl.fma(qk, qk_scale, -gl.expand_dims(lse, 0)), EXP2)
    else:
        p = _exp2(qk * qk_scale - gl.expand_dims(lse, 0), EXP2)
    if MASK:
        p = gl.where(gl.expand_dims(offs_q, 0) < S, p, 0.0)
    return p


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, q_full, do_full, q_empty, do_empty, k_ptr, v_ptr, dk_ptr, dv_ptr,
                   lse_ptr, delta_ptr, ord_ptr, S, stat, base, first, qk_scale, sm_scale, stride_s,
                   BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, EXP2: gl.constexpr,
                   FMA: gl.constexpr, ORDERED: gl.constexpr, EARLY_DV: gl.constexpr,
                   COMPACT: gl.constexpr):  # fmt: skip
    KV: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    _own_rows(k_ptr, v_ptr, k_smem, v_smem, ord_ptr, S, base, first, stride_s, KV, D, ORDERED)
    zero_s = gl.zeros([KV, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([KV, D], gl.float32, a_layout)
    dv = gl.zeros([KV, D], gl.float32, a_layout)
    q_slice: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_q0 = gl.arange(0, BLOCK_M, layout=q_slice)
    offs_c0 = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0]))
    for j in range(0, gl.cdiv(S, BLOCK_M)):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        offs_q = j * BLOCK_M + offs_q0
        if COMPACT:  # one address a thread, then a layout conversion (fewer live registers)
            offs_c = j * BLOCK_M + offs_c0
            lse = gl.convert_layout(gl.load(lse_ptr + stat + offs_c, mask=offs_c < S, other=0.0), q_slice)
            dl = gl.convert_layout(gl.load(delta_ptr + stat + offs_c, mask=offs_c < S, other=0.0), q_slice)
        else:
            lse = gl.load(lse_ptr + stat + offs_q, mask=offs_q < S, other=0.0)
            dl = gl.load(delta_ptr + stat + offs_q, mask=offs_q < S, other=0.0)
        q_tile = q_smem.index(slot).reshape([BLOCK_M, D])
        do_tile = do_smem.index(slot).reshape([BLOCK_M, D])
        mbarrier.wait(q_full.index(slot), phase)
        qk = warpgroup_mma(k_smem, q_tile.permute((1, 0)), zero_s, is_async=True)
        mbarrier.wait(do_full.index(slot), phase)
        dp = warpgroup_mma(v_smem, do_tile.permute((1, 0)), zero_s, is_async=True)
        qk = warpgroup_mma_wait(1, deps=(qk,))
        if (j + 1) * BLOCK_M > S:
            p = _p_t(qk, lse, offs_q, S, qk_scale, True, EXP2, FMA)
        else:
            p = _p_t(qk, lse, offs_q, S, qk_scale, False, EXP2, FMA)
        if EARLY_DV:  # dv's MMA runs while ds^T is formed
            p_op = gl.convert_layout(p.to(gl.bfloat16), op_layout)
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp,))
            ds_op = gl.convert_layout((p * (dp - gl.expand_dims(dl, 0))).to(gl.bfloat16), op_layout)
        else:  # fewer live registers: both products issued once ds^T is formed
            dp = warpgroup_mma_wait(0, deps=(dp,))
            ds_op = gl.convert_layout((p * (dp - gl.expand_dims(dl, 0))).to(gl.bfloat16), op_layout)
            p_op = gl.convert_layout(p.to(gl.bfloat16), op_layout)
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
    dk = dk * sm_scale
    offs = first + gl.arange(0, KV, layout=gl.SliceLayout(1, a_layout))
    if ORDERED:
        rows = gl.load(ord_ptr + offs, mask=offs < S, other=0)
    else:
        rows = offs.to(gl.int64)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, a_layout))
    ptrs = base + gl.expand_dims(rows, 1) * stride_s + gl.expand_dims(cols, 0)
    valid = gl.expand_dims(offs < S, 1)
    gl.store(dk_ptr + ptrs, dk.to(gl.bfloat16), mask=valid)
    gl.store(dv_ptr + ptrs, dv.to(gl.bfloat16), mask=valid)


@gluon.jit
def _dkdv_producer(q_desc, do_desc, q_smem, do_smem, q_full, do_full, q_empty, do_empty, S, b, col,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    for j in range(0, gl.cdiv(S, BLOCK_M)):
        slot = j % STAGES
        free = ((j // STAGES) & 1) ^ 1  # a fresh barrier passes parity 1: the first STAGES loads do not wait
        mbarrier.wait(q_empty.index(slot), free)
        _load(q_desc, q_smem.index(slot), q_full.index(slot), b, j * BLOCK_M, col)
        mbarrier.wait(do_empty.index(slot), free)
        _load(do_desc, do_smem.index(slot), do_full.index(slot), b, j * BLOCK_M, col)


@gluon.jit
def _dkdv_ws_kernel(q_desc, do_desc, k_ptr, v_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, ord_ptr, S, H, qk_scale,
                    sm_scale, stride_b, stride_s, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                    EXP2: gl.constexpr, FMA: gl.constexpr, ORDERED: gl.constexpr,
                    EARLY_DV: gl.constexpr, COMPACT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):  # fmt: skip
    """128 KV rows a program (two consumers of 64), ``BLOCK_M`` query rows a step; ``num_warps`` = 4."""
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    col = (bh % H) * D
    base = b.to(gl.int64) * stride_b + col
    stat = bh.to(gl.int64) * S
    first = pid_n * 128
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], kv_layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], kv_layout)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, BLOCK_M, D], do_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(do_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)
    gl.warp_specialize(
        [
            (_dkdv_consumer, (k_smem.index(0), v_smem.index(0), q_smem, do_smem, q_full, do_full, q_empty, do_empty,
                              k_ptr, v_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, ord_ptr, S, stat, base, first,
                              qk_scale, sm_scale, stride_s, BLOCK_M, D, STAGES, EXP2, FMA, ORDERED, EARLY_DV, COMPACT)),
            (_dkdv_consumer, (k_smem.index(1), v_smem.index(1), q_smem, do_smem, q_full, do_full, q_empty, do_empty,
                              k_ptr, v_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, ord_ptr, S, stat, base, first + 64,
                              qk_scale, sm_scale, stride_s, BLOCK_M, D, STAGES, EXP2, FMA, ORDERED, EARLY_DV, COMPACT)),
            (_dkdv_producer, (q_desc, do_desc, q_smem, do_smem, q_full, do_full, q_empty, do_empty, S, b, col,
                              BLOCK_M, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def check_tiling(cfg: AttnConfig) -> None:
    """The tiling this kernel implements (a programming error otherwise: the tiling tables are validated)."""
    if (cfg.kv_n, cfg.kv_m) != (2 * KV_ROWS, 64):
        raise ValueError(f"bwd_gluon runs kv_n = 128, kv_m = 64, not {cfg.kv_n} x {cfg.kv_m}")


def dkdv_gluon(q_c: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do_c: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, order: torch.Tensor | None, cfg: AttnConfig,
               sm_scale: float, c: float, stages: int = 2) -> None:  # fmt: skip
    """dK and dV into ``dk`` / ``dv`` (packed rows) from canonical copies ``q_c`` / ``do_c`` (contiguous bfloat16),
    ``k`` / ``v`` read through ``order`` (None: packed order), lse2 and delta (canonical rows)."""
    check_tiling(cfg)
    b, s, h, d = k.shape
    q_desc, do_desc, _ = descriptors(q_c, do_c.view(b, s, h, d), q_c, cfg.kv_m, cfg.kv_m)
    _dkdv_ws_kernel[(triton.cdiv(s, cfg.kv_n), b * h)](
        q_desc, do_desc, k, v, dk, dv, lse, delta, k if order is None else order, s, h, c, sm_scale, k.stride(0),
        k.stride(1), D=d, BLOCK_M=cfg.kv_m, STAGES=stages, EXP2=cfg.bwd_exp2_code, FMA=cfg.bwd_fma,
        ORDERED=order is not None, EARLY_DV=EARLY_DV, COMPACT=COMPACT, CONSUMER_REGS=REGS[0],
        PRODUCER_REGS=REGS[1], num_warps=4, maxnreg=WS_MAXNREG, **STRICT_LAUNCH,
    )  # fmt: skip
