"""The strict attention forward as a warp-specialised Gluon kernel for Hopper (the ``gluon_warp_specialised`` path): the
same walk and arithmetic, its instructions scheduled as FlashAttention-3 schedules them.

Triton's pipeliner makes an MMA asynchronous only when its result feeds another MMA's accumulator (Triton's
``WGMMAPipeline.cpp``, rule 3), so the Triton kernels (:mod:`h3gate.kernels.attention`, ``attention_tma``) wait for
each ``q k^T`` before its softmax, and the softmax runs while no MMA is in flight. Here a tile of 128 query rows of one
(batch, head) is run by three partitions, and one persistent program an SM walks the tiles ``pid``, ``pid + programs``,
... (``AttnLaunch.persistent``), its K/V ring and the consumers' turns running on from tile to tile:

* a one-warp producer issuing every TMA load: a tile's 128 query rows (once both consumers retired the last tile's
  ``q k^T``: ``q_empty``), then each ``fwd_n``-row K and V tile into a ring of ``STAGES`` buffers (``*_full``
  barriers: loaded; ``*_empty``: both consumers done with it). With a walk order Q, like K and V, arrives as a copy
  in canonical order, and each output row is stored to its packed row through ``order[i]``;
* two consumer warpgroups of 64 query rows each (the default partition and a worker, 240 registers a thread) that
  take turns issuing their MMAs (``turn`` barriers), so one's softmax runs on the CUDA cores while the other's MMAs
  run on the tensor cores. Per KV block ``j`` a consumer issues ``S_{j+1} = q k_{j+1}^T``, rescales ``acc`` by
  ``alpha_j`` and issues ``acc += P_j V_j`` (both asynchronous ``wgmma``), hands the turn over, waits for
  ``S_{j+1}`` and runs block ``j + 1``'s softmax while ``P_j V_j`` is in flight, then waits for it. Every MMA group
  is retired within its iteration: ptxas serialises ``wgmma`` (warning C7514) when a group stays in flight across
  the loop's back edge.

The arithmetic of every row is the Triton kernels' (``attention.fwd_step``), written with the same operations on the
same layouts: ``q k^T`` by ``wgmma`` (m64, N = ``fwd_n``, k16) from shared memory onto a zero FP32 accumulator; the row
maximum of the raw scores times ``qk_scale``; ``p = exp2(fma(qk, qk_scale, -m'))`` with ``ex2.approx.ftz.f32`` (the
declared ``fwd_fma`` / ``fwd_exp2`` forms); ``alpha = exp2(m - m')``; ``l = l * alpha + rowsum(p)`` (the row sum reduced
in the NVMMA accumulator layout, as Triton reduces it); ``acc = acc * alpha``, then ``acc += bf16(p) v`` by ``wgmma``
m64n128k16 with ``p`` from registers; ``out = bf16(acc / l)`` (IEEE division) and ``lse2 = m + log2(l)`` (libdevice).
The KV walk is ``attention``'s: ``fwd_n``-wide blocks (128 keys: ``q k^T`` by m64n128k16, ``p v`` with K = 128) in
ascending order, the last one masked where its rows pass S. K/V/Q come by host TMA descriptors over (B, S, nh * D) views
with (1, rows, D) boxes, so rows past S are zeros (as the pointer kernel's masked loads give), never the next batch
item's. Only the order in which independent instructions are issued differs: the bytes are the Triton kernels' at every
S, batch and walk order probed on the H200, one program a tile or persistent; the contract and kernel id are
:mod:`h3gate.kernels.attention`'s.

GPU only (Gluon has no interpreter; the CPU interpreter runs the pointer kernel, the same arithmetic); sm_90,
bfloat16, D = 128. ``tests/triton_kernels/sm90_lowering.py`` compiles it for sm_90 on the CPU and checks that ptxas
keeps its ``wgmma`` asynchronous and spills nothing.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from h3gate.kernels.attention_config import PRODUCTION, AttnConfig, AttnLaunch, qk_scale
from h3gate.kernels.attention_math import gather_rows
from h3gate.kernels.attention_sources import copied_tiles, tile_sources
from h3gate.kernels.common import STRICT_LAUNCH, num_sms
from h3gate.kernels.gemm_gluon_plan import nvmma_layout

# Triton 3.6 and 3.7 name the TMA tile load async_copy_global_to_shared, 3.9 async_load (same positional arguments).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _exp2(x, EXP2: gl.constexpr):
    """``attention.exp2_fwd``: the declared PTX ``ex2.approx[.ftz].f32`` (EXP2 = 2, 1) or libdevice (0)."""
    if EXP2 == 2:
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    elif EXP2 == 1:
        return gl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return libdevice.exp2(x)


@gluon.jit
def _softmax(qk, m_i, l_i, offs_n, S, qk_scale, MASK: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr):
    """``attention.fwd_step`` up to the PV product: (p, alpha, m', l') from the raw scores ``qk``."""
    if FMA:
        if MASK:
            qk = gl.where(gl.expand_dims(offs_n, 0) < S, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = _exp2(gl.fma(qk, qk_scale, -gl.expand_dims(m_new, 1)), EXP2)
    else:
        s = qk * qk_scale
        if MASK:
            s = gl.where(gl.expand_dims(offs_n, 0) < S, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = _exp2(s - gl.expand_dims(m_new, 1), EXP2)
    alpha = _exp2(m_i - m_new, EXP2)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_block(qk, m_i, l_i, start, offs_n0, S, qk_scale, BLOCK_N: gl.constexpr, EXP2: gl.constexpr,
                   FMA: gl.constexpr):  # fmt: skip
    """:func:`_softmax` of the KV block starting at row ``start``, masked only when it passes S (masking a full
    block would change nothing but the time)."""
    offs_n = start + offs_n0
    if start + BLOCK_N > S:
        p, alpha, m_new, l_new = _softmax(qk, m_i, l_i, offs_n, S, qk_scale, True, EXP2, FMA)
    else:
        p, alpha, m_new, l_new = _softmax(qk, m_i, l_i, offs_n, S, qk_scale, False, EXP2, FMA)
    return p, alpha, m_new, l_new


@gluon.jit
def _load(desc, smem, bar, coord0, coord1, coord2):
    """One (1, rows, D) tile by TMA into ``smem``, signalled on ``bar``."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [coord0, coord1, coord2], bar, smem)


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int) -> tuple:
    """Host TMA descriptors over (B, rows, nh * D) views of each (B, rows, nh, D) tensor (its own row count: a copy
    of a few tiles has fewer), one (1, rows, D) box per (batch, rows, head): rows past the tensor's end are filled
    with zeros, never read from the next batch item."""
    d = q.shape[3]
    return row_descriptor(q, block_m, d), row_descriptor(k, block_n, d), row_descriptor(v, block_n, d)


def row_descriptor(t: torch.Tensor, rows: int, d: int) -> TensorDescriptor:
    """A host TMA descriptor over the (B, S, nh * d) view of ``t`` ((B, S, nh, d) or (B, S, nh * d), viewed, never
    copied) with (1, ``rows``, d) boxes: a load's rows past S are zeros, a store's are dropped (not the next item's)."""
    view = t.view(t.shape[0], t.shape[1], -1)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [1, rows, d], nvmma_layout((1, rows, d)))


WS_MAXNREG = 168  # the launch's register limit a thread: 12 warps x 168 = the 64K registers of an SM


@gluon.jit
def _tile(t, m_tiles, H, stride_b, D: gl.constexpr, ROWS: gl.constexpr):
    """Tile ``t`` (query blocks of one (batch, head) adjacent, as a (m_tiles, B * H) grid orders them): (bh, b,
    head column, base offset of (b, head), first query row)."""
    bh = t // m_tiles
    b = bh // H
    col = (bh % H) * D
    return bh, b, col, b.to(gl.int64) * stride_b + col, (t % m_tiles) * ROWS


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, turn, o_ptr,
                 o_desc, lse_ptr, ord_ptr, tile_map, S, H, n_tiles, m_tiles, qk_scale, stride_b, stride_s,
                 C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 EXP2: gl.constexpr, FMA: gl.constexpr, ORDERED: gl.constexpr,
                 TMA_STORE: gl.constexpr):  # fmt: skip
    """This consumer's 64 query rows of every tile the program walks (tiles ``pid``, ``pid + programs``, ...)."""
    n_blocks = gl.cdiv(S, BLOCK_N)
    tile_i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        _consume_tile(q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, turn, o_ptr,
                      o_desc, lse_ptr, ord_ptr, tile_map, S, H, t, m_tiles, qk_scale, stride_b, stride_s, tile_i,
                      n_blocks, C, BLOCK_M, BLOCK_N, D, STAGES, EXP2, FMA, ORDERED, TMA_STORE)  # fmt: skip
        tile_i += 1  # noqa: SIM113 - Gluon loops have no enumerate
    if TMA_STORE:
        tma.store_wait(0)  # the last tile's output has left shared memory before the program ends


@gluon.jit
def _consume_tile(q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, turn, o_ptr,
                  o_desc, lse_ptr, ord_ptr, tile_map, S, H, t, m_tiles, qk_scale, stride_b, stride_s, tile_i, n_blocks,
                  C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr, ORDERED: gl.constexpr,
                  TMA_STORE: gl.constexpr):  # fmt: skip
    """One tile: the program's ``tile_i``-th, so its K/V steps are the ring's ``tile_i * n_blocks + j`` and its turns
    the ``tile_i * (n_blocks - 1) + j``-th (both consumers take the same number of turns a tile)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    step0 = tile_i * n_blocks
    turn0 = tile_i * (n_blocks - 1)
    mbarrier.wait(q_bar, tile_i & 1)
    q_tile = q_smem.reshape([2 * BLOCK_M, D]).slice(C * BLOCK_M, BLOCK_M)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    offs_n0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(k_full.index(step0 % STAGES), (step0 // STAGES) & 1)
    qk = warpgroup_mma(q_tile, k_smem.index(step0 % STAGES).reshape([BLOCK_N, D]).permute((1, 0)), zero_s,
                       is_async=True)  # fmt: skip
    qk = warpgroup_mma_wait(0, deps=(qk,))
    mbarrier.arrive(k_empty.index(step0 % STAGES), count=1)
    p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, 0, offs_n0, S, qk_scale, BLOCK_N, EXP2, FMA)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    for j in range(0, n_blocks - 1):
        cur = (step0 + j) % STAGES
        nxt = (step0 + j + 1) % STAGES
        mbarrier.wait(turn.index(C), (turn0 + j) & 1)  # this consumer's turn to issue MMAs
        mbarrier.wait(k_full.index(nxt), ((step0 + j + 1) // STAGES) & 1)
        qk_next = warpgroup_mma(q_tile, k_smem.index(nxt).reshape([BLOCK_N, D]).permute((1, 0)), zero_s,
                                is_async=True)  # fmt: skip
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        mbarrier.wait(v_full.index(cur), ((step0 + j) // STAGES) & 1)
        pv = warpgroup_mma(p_op, v_smem.index(cur).reshape([BLOCK_N, D]), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - C), count=1)  # the other consumer's turn
        qk = warpgroup_mma_wait(1, deps=(qk_next,))
        mbarrier.arrive(k_empty.index(nxt), count=1)
        p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, (j + 1) * BLOCK_N, offs_n0, S, qk_scale, BLOCK_N, EXP2,
                                            FMA)  # fmt: skip
        acc, p_op = warpgroup_mma_wait(0, deps=(pv, p_op))
        mbarrier.arrive(v_empty.index(cur), count=1)
    mbarrier.arrive(q_empty, count=1)  # every q k^T of this tile has retired: the producer may load the next q
    last = (step0 + n_blocks - 1) % STAGES
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    mbarrier.wait(v_full.index(last), ((step0 + n_blocks - 1) // STAGES) & 1)
    pv = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(pv, p_op))
    mbarrier.arrive(v_empty.index(last), count=1)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = gl.div_rn(acc, gl.expand_dims(l_o, 1)).to(gl.bfloat16)
    bh, b, col, base, row0 = _tile(t, m_tiles, H, stride_b, D, 2 * BLOCK_M)
    first = row0 + C * BLOCK_M
    offs_l = first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + bh.to(gl.int64) * S + offs_l, m_i + libdevice.log2(l_i), mask=offs_l < S)
    if TMA_STORE and not ORDERED:
        _store_tma(o_desc, o_smem, out, C, b, first, col, BLOCK_M, D)
    elif TMA_STORE and tile_map is not None:
        src = gl.load(tile_map + t % m_tiles)
        if src >= 0:  # the tile is consecutive packed rows from src (a partial last one ends at S)
            _store_tma(o_desc, o_smem, out, C, b, src + C * BLOCK_M, col, BLOCK_M, D)
        else:
            _store_rows(out, o_ptr, ord_ptr, base, first, S, stride_s, o_layout, BLOCK_M, D, ORDERED)
    else:
        _store_rows(out, o_ptr, ord_ptr, base, first, S, stride_s, o_layout, BLOCK_M, D, ORDERED)


@gluon.jit
def _store_tma(o_desc, o_smem, out, C: gl.constexpr, b, row, col, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """Consumer ``C``'s bf16 output rows by TMA from its half of ``o_smem``: packed rows ``row ...`` of item ``b``,
    columns ``col ...`` (rows past S are dropped by the box). The store runs on while the next tile is walked; this
    consumer's previous store must have read its half first."""
    half = o_smem.index(C)
    tma.store_wait(0)
    half.reshape([BLOCK_M, D]).store(out)
    fence_async_shared()
    _tma_store(o_desc, [b, row, col], half)


@gluon.jit
def _store_rows(out, o_ptr, ord_ptr, base, first, S, stride_s, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                D: gl.constexpr, ORDERED: gl.constexpr):  # fmt: skip
    """Canonical rows ``first ...`` stored from registers, each to its packed row (``order[i]`` when ``ORDERED``)."""
    offs_m = first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    if ORDERED:
        rows = gl.load(ord_ptr + offs_m, mask=offs_m < S, other=0)
    else:
        rows = offs_m.to(gl.int64)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + base + gl.expand_dims(rows, 1) * stride_s + gl.expand_dims(cols, 0), out,
             mask=gl.expand_dims(offs_m < S, 1))  # fmt: skip


@gluon.jit
def _load_with(desc, ring, bars, slot, coord0, coord1, coord2, row_desc, row_ring, row, row_col):
    """:func:`_load` into ``ring``'s ``slot`` (signalled on ``bars``' ``slot``), and with ``row_desc`` (not None) the
    tile's per-row (1, rows) FP32 box at (``row``, ``row_col``) into ``row_ring``'s ``slot`` on the same barrier."""
    if row_desc is None:
        _load(desc, ring.index(slot), bars.index(slot), coord0, coord1, coord2)
    else:
        mbarrier.expect(bars.index(slot), desc.block_type.nbytes + row_desc.block_type.nbytes)
        _tma_load(desc, [coord0, coord1, coord2], bars.index(slot), ring.index(slot))
        _tma_load(row_desc, [row, row_col], bars.index(slot), row_ring.index(slot))


@gluon.jit
def _load_tile(desc, copy_desc, tile_map, ring, bars, slot, b, j, col, STEP: gl.constexpr, row_desc, row_ring, row):
    """Tile ``j`` of a walk in canonical order (rows ``j * STEP`` ...): from ``desc`` at that row, or with a
    ``tile_map`` (:mod:`h3gate.kernels.attention_sources`) from the packed ``desc`` at row ``tile_map[j]`` or from
    ``copy_desc`` at row ``(-1 - tile_map[j]) * STEP``; the per-row statistics stay at canonical row ``j * STEP``."""
    if tile_map is None:
        _load_with(desc, ring, bars, slot, b, j * STEP, col, row_desc, row_ring, row, j * STEP)
    else:
        src = gl.load(tile_map + j)
        if src >= 0:
            _load_with(desc, ring, bars, slot, b, src, col, row_desc, row_ring, row, j * STEP)
        else:
            _load_with(copy_desc, ring, bars, slot, b, (-1 - src) * STEP, col, row_desc, row_ring, row, j * STEP)


@gluon.jit
def walk_producer(a_desc, b_desc, a_smem, b_smem, a_full, b_full, a_empty, b_empty, S, b, col, STEP: gl.constexpr,
                  STAGES: gl.constexpr, step0=0, la_desc=None, lb_desc=None, la_smem=None, lb_smem=None,
                  row=0, tile_map=None, a_copy=None, b_copy=None):  # fmt: skip
    """Two walked operands' ``STEP``-row tiles (K / V here, q / dout or k / v in the backward), ascending, into a ring
    of ``STAGES`` buffers: a slot is reloaded once both consumers released it (``*_empty``). ``step0``: the ring steps
    this program loaded before (its earlier tiles). With ``la_desc`` / ``lb_desc`` each tile's per-row statistics
    (row ``row`` of a (rows, S) FP32 array: the backward's lse2 / delta) come into ``la_smem`` / ``lb_smem`` with it.
    With ``tile_map`` the operands are the packed tensors and ``a_copy`` / ``b_copy`` their copied tiles
    (:func:`_load_tile`)."""
    for j in range(0, gl.cdiv(S, STEP)):
        slot = (step0 + j) % STAGES
        free = (((step0 + j) // STAGES) & 1) ^ 1  # a fresh barrier passes parity 1: the first STAGES loads do not wait
        mbarrier.wait(a_empty.index(slot), free)
        _load_tile(a_desc, a_copy, tile_map, a_smem, a_full, slot, b, j, col, STEP, la_desc, la_smem, row)
        mbarrier.wait(b_empty.index(slot), free)
        _load_tile(b_desc, b_copy, tile_map, b_smem, b_full, slot, b, j, col, STEP, lb_desc, lb_smem, row)


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, S,
                 H, n_tiles, m_tiles, tile_map, q_copy, k_copy, v_copy, D: gl.constexpr, ROWS: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Per tile: its query rows once both consumers retired the last tile's ``q k^T``, then its K/V walk; the ring
    runs on across tiles. Canonical rows: with a walk order, whole canonical copies, or with ``tile_map`` the packed
    tensors and their copied tiles (:mod:`h3gate.kernels.attention_sources`)."""
    n_blocks = gl.cdiv(S, BLOCK_N)
    tile_i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        bh, b, col, base, row0 = _tile(t, m_tiles, H, 0, D, ROWS)
        mbarrier.wait(q_empty, (tile_i & 1) ^ 1)
        if tile_map is None:
            _load(q_desc, q_smem, q_bar, b, row0, col)
        else:  # the query tile is tile row0 / ROWS of the same map (ROWS == BLOCK_N)
            src = gl.load(tile_map + t % m_tiles)
            if src >= 0:
                _load(q_desc, q_smem, q_bar, b, src, col)
            else:
                _load(q_copy, q_smem, q_bar, b, (-1 - src) * ROWS, col)
        walk_producer(k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, S, b, col, BLOCK_N, STAGES,
                      tile_i * n_blocks, tile_map=tile_map, a_copy=k_copy, b_copy=v_copy)  # fmt: skip
        tile_i += 1  # noqa: SIM113 - Gluon loops have no enumerate


@gluon.jit
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, ord_ptr, tile_map, q_copy, k_copy, v_copy, o_desc, S,
                        H, n_tiles, m_tiles, qk_scale, stride_b, stride_s, D: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EXP2: gl.constexpr, FMA: gl.constexpr,
                        ORDERED: gl.constexpr, TMA_STORE: gl.constexpr, REGS_C: gl.constexpr,
                        REGS_P: gl.constexpr):  # fmt: skip
    """``BLOCK_M`` rows per consumer, 2 * BLOCK_M per tile; ``n_tiles`` = ``m_tiles`` query blocks x B x H, walked
    ``pid``, ``pid + programs``, ...; ``num_warps`` = 4 (one consumer warpgroup)."""
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 2 * BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, BLOCK_N, D], v_desc.layout)
    if TMA_STORE:  # each consumer's output rows on their way out by TMA
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 1, BLOCK_M, D], o_desc.layout)
    else:
        o_smem = q_smem  # unused: stored from registers
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0), count=1)  # consumer 0 issues first
    gl.warp_specialize(
        [
            (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, turn,
                            o_ptr, o_desc, lse_ptr, ord_ptr, tile_map, S, H, n_tiles, m_tiles, qk_scale, stride_b,
                            stride_s, 0, BLOCK_M, BLOCK_N, D, STAGES, EXP2, FMA, ORDERED, TMA_STORE)),
            (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, turn,
                            o_ptr, o_desc, lse_ptr, ord_ptr, tile_map, S, H, n_tiles, m_tiles, qk_scale, stride_b,
                            stride_s, 1, BLOCK_M, BLOCK_N, D, STAGES, EXP2, FMA, ORDERED, TMA_STORE)),
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full, k_empty,
                            v_empty, S, H, n_tiles, m_tiles, tile_map, q_copy, k_copy, v_copy, D, 2 * BLOCK_M,
                            BLOCK_N, STAGES)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def forward_gluon_ws(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttnConfig,
    order: torch.Tensor | None = None,
    launch: AttnLaunch = PRODUCTION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`h3gate.kernels.attention.forward` on Hopper (contiguous bfloat16 q, k, v of D = 128, packed rows):
    (out, lse2). 2 x 64 query rows a program (``cfg.fwd_m`` unused); ``launch`` the program count, register split,
    ring depth and output store (:class:`h3gate.kernels.attention_config.AttnLaunch`). With a walk order, q, k and v
    are read in canonical order through their tile sources (``launch.tile_sources``; otherwise whole canonical
    copies), and each output row is stored to its packed row through ``order[i]``."""
    b, s, h, d = q.shape
    rows = 64
    out = torch.empty((b, s, h * d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b * h, s), dtype=torch.float32, device=q.device)
    tile_map = copies = None
    if order is not None and launch.tile_sources and cfg.fwd_n == 2 * rows:
        src = tile_sources(order, 2 * rows)
        tile_map = src.tile_map
        copies = descriptors(*(copied_tiles(t, src) for t in (q, k, v)), 2 * rows, cfg.fwd_n)
    elif order is not None:  # whole canonical copies (TMA has no row gather on Hopper)
        q, k, v = (gather_rows(t, order) for t in (q, k, v))
    q_desc, k_desc, v_desc = descriptors(q, k, v, 2 * rows, cfg.fwd_n)
    o_desc = row_descriptor(out, rows, d)
    m_tiles = triton.cdiv(s, 2 * rows)
    n_tiles = m_tiles * b * h
    programs = min(n_tiles, num_sms(q.device)) if launch.persistent else n_tiles
    _attn_fwd_ws_kernel[(programs,)](
        q_desc, k_desc, v_desc, out, lse, q if order is None else order, tile_map, *(copies or (None,) * 3), o_desc,
        s, h, n_tiles, m_tiles, qk_scale(d), q.stride(0), q.stride(1), D=d, BLOCK_M=rows, BLOCK_N=cfg.fwd_n,
        STAGES=launch.stages, EXP2=cfg.exp2_code, FMA=cfg.fwd_fma, ORDERED=order is not None,
        TMA_STORE=s >= launch.tma_store_from, REGS_C=launch.regs[0], REGS_P=launch.regs[1], num_warps=4,
        maxnreg=WS_MAXNREG, **STRICT_LAUNCH,
    )  # fmt: skip
    return out, lse
