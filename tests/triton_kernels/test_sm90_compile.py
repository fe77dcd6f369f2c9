"""The attention kernels' CUDA-only paths (TMA loads, the walk order's indexed rows, the warp-specialised Gluon
forward) compiled for Hopper (sm_90) on the CPU: the interpreter never runs TMA or Gluon, so this is where CI sees
those paths lower to PTX with TMA copies, wgmma and the declared exp2 / fma instructions, and ptxas keep the Gluon
kernel's wgmma asynchronous without spills (their bytes are compared with the pointer kernels on the H200:
``tools/gpu_perf_probe.py --sections attn_tma``, ``tools/gpu_attention_gluon.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")
# The compiles take ~35 s of one core: make test-slow and make test-newest (every kernel test) run them, not make test.
pytestmark = pytest.mark.slow


# Spills of the Gluon forward with its output stored by TMA (attention_gluon.TMA_STORE_FROM), bounds set from compiles
# before any H200 run: the TMA store's elected-thread predicate, one 4-byte value kept from the program's start and
# reloaded once a tile, 8 bytes under Triton 3.7.1 and 3.9 (12 with tile sources under 3.7.1, 76 under 3.9: the
# branch between the TMA store of an in-place tile and the row stores of a copied one). The row-stored forward (the
# knob off) spills nothing.
TMA_STORE_SPILL = 8
TMA_STORE_SPILL_SOURCES = 80
# The shared memory a block may have on an H100 / H200 (227 KB).
BLOCK_SHARED = 232448


def lowering_facts(*flags: str) -> dict:
    """What ``sm90_lowering.py FLAGS`` prints, run with the interpreter off (its own process)."""
    script = Path(__file__).with_name("sm90_lowering.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, str(script), *flags], env=env, capture_output=True, text=True,
                          timeout=420)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def facts() -> dict:
    return lowering_facts()


def test_tma_forward_lowers_to_tma_copies_wgmma_and_the_declared_math(facts) -> None:
    for ordered in (False, True):
        got = facts[f"fwd_tma_ordered={ordered}"]
        assert got["cp.async.bulk.tensor"] and got["wgmma.mma_async"], got
        assert got["ex2.approx.ftz.f32"] and got["fma.rn.f32"], got  # ex2ftz + the explicit fma of the contract


def test_backward_kernels_use_tma_only_when_asked(facts) -> None:
    for kernel in ("dkdv", "dq"):
        with_tma, without = facts[f"{kernel}_tma=True"], facts[f"{kernel}_tma=False"]
        assert with_tma["cp.async.bulk.tensor"] and not without["cp.async.bulk.tensor"], kernel
        assert with_tma["wgmma.mma_async"] and without["wgmma.mma_async"], kernel


def test_gluon_forward_keeps_its_mmas_asynchronous_and_the_declared_math(facts) -> None:
    """Both consumer warpgroups' MMAs (2 x 32 wgmma with the 128-key walk of kernel id v2; the persistent tile loop of
    session 15 around them adds none), the producer's TMA loads (Q, K, V; with a walk order Q is a canonical copy too),
    register reallocation between partitions, the contract's ex2.approx.ftz + fma; ptxas never serialises the wgmma (it
    does when an MMA group stays in flight across the loop's back edge, warning C7514). Spills: none. (Session 13's
    one-tile kernel spilled 176 bytes under Triton 3.9's ptxas, and the bound was 256 from 3.8 on; the persistent
    kernel with 240 / 24 registers spills nothing under 3.6, 3.7 and 3.9, so the bound is 0 again, tightened in
    session 15.)"""
    for ordered in (False, True):
        got = facts[f"fwd_gluon_ordered={ordered}"]
        assert got["wgmma.mma_async"] == 64 and got["setmaxnreg"] >= 4 and got["cp.async.bulk.tensor"] >= 3, got
        assert got["ex2.approx.ftz.f32"] and got["fma.rn.f32"], got
        # the output by TMA (one store site a consumer) without a walk order; with whole canonical copies, by rows
        assert got["cp.async.bulk.tensor.3d.global.shared"] == (0 if ordered else 2), got
        assert got["wgmma_serialized"] is False and got["spill_bytes"] <= TMA_STORE_SPILL, got
    regs = facts["fwd_gluon_regstore"]
    assert regs["cp.async.bulk.tensor.3d.global.shared"] == 0 and regs["spill_bytes"] == 0, regs


def test_gluon_backward_keeps_its_mmas_asynchronous_and_the_declared_math(facts) -> None:
    """The warp-specialised Gluon backward (``attention_bwd_gluon``, in production from S = 2048): per consumer
    warpgroup the dK/dV walk issues 8 + 8 score and 4 + 4 gradient k-steps (2 x 24 wgmma), the software-pipelined dQ
    walk 8 + 8 + 4 with a prologue and an epilogue (80), two TMA loads in the producer (four in the dK/dV walk: its
    lse2 / delta beside q and dout), the contract's ex2.approx.ftz + fma, never serialised. Spills: the dQ walk none;
    the dK/dV walk holds two 64 x 128 FP32 accumulators a thread and spills 20 bytes under Triton 3.6 (the H200 host's:
    the timings include them), none under 3.7 and 3.9; the bound 32, set from these compiles before any run, guards
    against growth."""
    for ordered in (False, True):
        dkdv, dq = facts[f"dkdv_gluon_ordered={ordered}"], facts[f"dq_gluon_ordered={ordered}"]
        assert dkdv["wgmma.mma_async"] == 48 and dq["wgmma.mma_async"] == 80, (dkdv, dq)
        for got in (dkdv, dq):
            assert got["cp.async.bulk.tensor"] >= 2 and got["setmaxnreg"] >= 4, got
            assert got["ex2.approx.ftz.f32"] and got["fma.rn.f32"], got
            assert got["wgmma_serialized"] is False, got
        assert dkdv["cp.async.bulk.tensor"] >= 4 and dkdv["spill_bytes"] <= 32 and dq["spill_bytes"] == 0, (dkdv, dq)


def test_gluon_walks_through_tile_sources_keep_their_mmas(facts) -> None:
    """With a walk order the Gluon kernels read the packed operands through their tile sources (``tile_map``: each
    tile from the packed tensor or from the copied tiles; :mod:`h3gate.kernels.attention_sources`): twice the TMA
    load sites (one a source), the same wgmma, never serialised. Spills when written (session 16): the forward and
    the dQ walk none under Triton 3.6, 3.7 and 3.9; the dK/dV walk 36 / 16 / 0 bytes (20 / 0 / 0 without the map),
    bound 64 set from these compiles before any run."""
    fwd, dkdv, dq = facts["fwd_gluon_sources"], facts["dkdv_gluon_sources"], facts["dq_gluon_sources"]
    assert (fwd["wgmma.mma_async"], dkdv["wgmma.mma_async"], dq["wgmma.mma_async"]) == (64, 48, 80)
    stores = fwd["cp.async.bulk.tensor.3d.global.shared"]  # in-place tiles' output by TMA, one site a consumer
    assert stores == 2 and fwd["cp.async.bulk.tensor"] - stores == 2 * facts["fwd_gluon_ordered=True"][
        "cp.async.bulk.tensor"], fwd  # fmt: skip
    assert dq["cp.async.bulk.tensor"] == 2 * facts["dq_gluon_ordered=True"]["cp.async.bulk.tensor"], dq
    assert dkdv["cp.async.bulk.tensor"] > facts["dkdv_gluon_ordered=True"]["cp.async.bulk.tensor"], dkdv
    for got in (fwd, dkdv, dq):
        assert got["wgmma_serialized"] is False and got["ex2.approx.ftz.f32"] and got["fma.rn.f32"], got
    assert fwd["spill_bytes"] <= TMA_STORE_SPILL_SOURCES and dq["spill_bytes"] == 0 and dkdv["spill_bytes"] <= 64, (
        fwd, dq, dkdv)  # fmt: skip


def test_gluon_gemm_tilings_keep_their_mmas_asynchronous(facts) -> None:
    """Every production Gluon GEMM tiling (gemm_configs.GLUON_BUCKETS) lowers for sm_90 with TMA loads (A, B, and the
    B tail or the narrow tiles' B where it has them), both consumers' wgmma (4 k16 steps a chunk a consumer, twice
    that with a B tail MMA or narrow tiles), register reallocation, no spill, and ptxas keeps the wgmma asynchronous;
    so does the grouped q / k / v launch (three weights' B loads and C stores)."""
    from h3gate.kernels import gemm_configs

    tilings = {f"gemm_gluon:{cfg.tag}": cfg for _, table in gemm_configs.GLUON_BUCKETS for cfg in table.values()}
    assert len(tilings) >= 3
    for tag, cfg in tilings.items():
        got = facts[tag]
        two = cfg.tail_m or cfg.tail_block_n
        consumers = cfg.block_m // 64
        assert got["wgmma.mma_async"] == consumers * (8 if two else 4), (tag, got)
        assert got["cp.async.bulk.tensor"] >= (3 if two else 2) and got["setmaxnreg"] >= 4, (tag, got)
        assert got["wgmma_serialized"] is False and got["spill_bytes"] == 0, (tag, got)
    # q, k, v in one launch: the A load, and the B load and C store of whichever weight a tile is. Triton 3.7 emits
    # one TMA instruction per weight in each branch (1 + 3 + 3), 3.9 selects the descriptor first and emits one of
    # each; the 3.7 count is kept where it is known, the three distinct copies everywhere else
    import triton

    tma_copies = 7 if triton.__version__.startswith("3.7.") else 3
    grouped = facts["gemm_gluon:grouped_qkv"]
    assert grouped["wgmma.mma_async"] == 8 and grouped["cp.async.bulk.tensor"] >= tma_copies, grouped
    assert grouped["wgmma_serialized"] is False and grouped["spill_bytes"] == 0, grouped


def test_gluon_seg8_forward_lowers_without_fma_atomics_or_spills(facts) -> None:
    """The segmented-8 Gluon forward (``gemm_gluon_seg8``, production tiling, with a bias) lowers for sm_90, ptxas
    keeping its wgmma asynchronous without spills, with no FMA (STRICT_LAUNCH, no libdevice call) and no atomics: per
    consumer one n128 MMA of 4 k16 steps a chunk, the producer's A and B TMA loads, register reallocation, the tree's
    IEEE adds at its three fold sites plus the bias add (64 registers, 2 consumers: 512 ``add.rn.f32``), its level-2
    slot in shared memory (a store and a load site, 32 v2 accesses a consumer) and its level-4 slot and the output
    as its only global stores (32 v2 and 32 bf16 pairs a thread a consumer: 128)."""
    got = facts["gemm_gluon_seg8"]
    assert got["wgmma.mma_async"] == 8 and got["cp.async.bulk.tensor"] >= 2 and got["setmaxnreg"] >= 4, got
    assert got["add.rn.f32"] == 512 and got["st.global"] == 128, got
    assert got["ld.shared.v2"] >= 64 and got["st.shared.v2"] >= 64, got
    assert got["fma"] == got["fma.rn.f32"] == got["atomics"] == got["libdevice"] == 0, got
    assert got["wgmma_serialized"] is False and got["spill_bytes"] == 0, got


def test_gluon_rows_dw_lowers_mn_major_without_fma_atomics_or_spills(facts) -> None:
    """The row-segment Gluon weight gradient (``gemm_gluon_rows_dw``, production tiling) lowers for sm_90, ptxas
    keeping its wgmma asynchronous without spills, no FMA, no libdevice call, no atomics: per consumer one m64n128k16
    MMA of 4 k16 steps a chunk, both operands read MN-major from shared memory (trans-a and trans-b set: the form the
    Triton ``rows_dw`` pointer walk lowers to), the producer's per-segment TMA loads (4 segments x (two dY boxes + the
    X box, two copies of 64 columns): 16), the tree's IEEE adds at its two fold sites (no bias: 256), the level-2
    slot in shared memory and the output as its only global traffic (no level-4 slot with 4 segments: no global
    load). The forward's wgmma (K-major operands) counts no MN-major MMA: the pattern tells the two apart."""
    got = facts["gemm_gluon_rows_dw"]
    assert got["wgmma.mma_async"] == got["wgmma.mn_major"] == 8 and got["cp.async.bulk.tensor"] == 16, got
    assert got["setmaxnreg"] >= 4 and got["add.rn.f32"] == 256, got
    assert got["st.global"] == 64 and got["ld.global"] == 0, got
    assert got["ld.shared.v2"] >= 64 and got["st.shared.v2"] >= 64, got
    assert got["fma"] == got["fma.rn.f32"] == got["atomics"] == got["libdevice"] == 0, got
    assert got["wgmma_serialized"] is False and got["spill_bytes"] == 0, got
    assert facts["gemm_gluon_seg8"]["wgmma.mn_major"] == 0, facts["gemm_gluon_seg8"]


def test_gluon_seg8_dx_lowers_with_b_mn_major_without_fma_atomics_or_spills(facts) -> None:
    """The segmented-8 Gluon kernel's dX (``dx``: B = W's boxes of BLOCK_K reduction rows; into the FP32 sum, as the
    column-parallel layers take it) lowers for sm_90 as the forward does but for the B operand: read MN-major
    (trans-b set, trans-a not: the form of the Triton seg8 kernel's TMA dX walk), two TMA copies for its 128 columns,
    the tree's adds without a bias (384), the level-4 slot and the FP32 output (v2) the only global stores. The
    forward reads no MN-major B (the pattern's negative control)."""
    got, fwd = facts["gemm_gluon_seg8_dx"], facts["gemm_gluon_seg8"]
    assert got["wgmma.mma_async"] == got["wgmma.b_mn_major"] == 8 and fwd["wgmma.b_mn_major"] == 0, (got, fwd)
    assert got["cp.async.bulk.tensor"] == 3 and got["add.rn.f32"] == 384 and got["st.global"] == 128, got
    assert got["fma"] == got["fma.rn.f32"] == got["atomics"] == got["libdevice"] == 0, got
    assert got["wgmma_serialized"] is False and got["spill_bytes"] == 0, got


def test_seg8_ptx_patterns_see_what_they_forbid() -> None:
    """Negative control of the counts above: the patterns find an FMA and atomics in PTX text, and do not take the
    ``shared.`` of a state space for a reduction."""
    import re

    from tests.triton_kernels.sm90_lowering import SEG8_PATTERNS

    ptx = "fma.rn.f32 %r1, %r2, %r3, %r4;\natom.global.add.f32 %r5, [%rd1], %r6;\nred.global.add.f32 [%rd1], %r6;\n"
    assert len(re.findall(SEG8_PATTERNS["fma"], ptx)) == 1 and len(re.findall(SEG8_PATTERNS["atomics"], ptx)) == 2
    assert not re.findall(SEG8_PATTERNS["atomics"], "ld.shared.v2.f32 {%r1, %r2}, [%r3];\nst.shared.b32 [%r3], %r1;")


def test_gluon_gemms_compile_for_a_launch_of_one_chunk() -> None:
    """A launch specialises integer arguments equal to 1 as constants: with K within one chunk (``k_tiles`` = 1, as
    the column-parallel dX of a 72-wide layer is) the ring step the producer and consumers carry must stay a tensor,
    or the warp-specialised kernels do not compile (the single walk, the seg8 forward and its dX)."""
    got = lowering_facts("--one-chunk")
    assert sorted(got) == ["gemm_gluon", "gemm_gluon_seg8", "gemm_gluon_seg8_dx"], got
    for name, facts in got.items():
        assert facts["wgmma.mma_async"] > 0 and facts["cp.async.bulk.tensor"] >= 2, (name, facts)


def test_the_on_chip_tree_fits_128_columns_and_spills_at_the_single_walks_256() -> None:
    """Why the seg8 forward's tile is 128 columns where the single walk's is 256 (docs/ws2-merge-order.md): with the
    tree's level-1 subtree in registers beside the accumulator, 128 columns compile without spills (production), and
    the same kernel at 256 columns (a ring of 2, to fit the shared memory) spills, since the accumulator and the
    subtree alone are 2 x 128 FP32 registers a consumer thread, over the 255 a thread may have."""
    got = lowering_facts("--register-wall")
    narrow, wide = got["128"], got["256"]
    assert narrow["spill_bytes"] == 0 and not narrow["wgmma_serialized"], narrow
    assert wide["spill_bytes"] > 0, wide
    assert narrow["wgmma.mma_async"] == wide["wgmma.mma_async"] == 8, (narrow, wide)
    assert wide["add.rn.f32"] == 2 * narrow["add.rn.f32"], (narrow, wide)  # the same tree over twice the columns
    assert wide["shared"] <= BLOCK_SHARED and wide["regs_c"] == narrow["regs_c"] < 256, wide
