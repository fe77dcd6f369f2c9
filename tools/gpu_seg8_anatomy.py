#!/usr/bin/env python3
"""On a Hopper GPU: where the seg8 merge order's cost over the single walk goes (issue 46), from the repo root.

    python3 tools/gpu_seg8_anatomy.py --json OUT.json [--sections block gemm] [--layouts medium] [--rows 3160 38974]
                                      [--sustained]

``block``: the strict block (real widths) in both orders, forward and forward + backward, timed twice by
:func:`h3gate.bench.timing.side_by_side` as ``bench ws1-block`` times them: as the bench does (the host enqueues each
call as the device runs it), and with the device held ahead by a spin (``--head-start-us``) so that the device time
is the kernels' alone; with the host's enqueue milliseconds, and a cProfile of each order's forward + backward
(behind a spin, top functions by own time). An arm whose host time is near its device time in the first timing is
host-bound there, and the second timing says what its kernels cost.

``dw``: the row-segment weight gradient (the Gluon kernel, one launch) next to the single-walk dW (the Triton
kernel the single order runs) at the block's four weights and ``--rows``, and the Gluon kernel at other ring depths
and tile swizzles (``DW_TILINGS``, each checked byte-equal to the production tiling); run under Nsight Compute with
``-k`` to see one alone.

``kernels``: the device time of each kernel of the block's forward + backward in both orders (``torch.profiler``,
CUDA activity, 5 calls after warm-up): per kernel name, its milliseconds a call and its launches a call, the
largest first, and the kernels whose time differs most between the orders.

``gemm``: the two GEMMs whose reduction a TP layout splits (O with its bias, FFN-down) at ``--rows``: cuBLAS, the
single walk (production tiling, 128 x 256), the single walk on the seg8 kernel's 128 x 128 tile, the seg8 forward
(production: the tree's pending subtrees in registers, shared memory and global scratch) and this file's
``_seq_kernel``: the seg8 kernel's segments, each restarted from zero and drained, added into one running total in
registers (no slots; another summation order, timed only). Tile, restart and slot costs are the differences of
consecutive columns. CUDA events over ``--reps`` back-to-back calls after warm-up, the median of 5 such spans;
``--sustained`` adds each variant's milliseconds and joules a call in a stream at the power cap, the variants
interleaved round by round (:func:`h3gate.bench.energy.sustained`), where a variant's clocks are its own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import traceback
from dataclasses import replace

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from h3gate.bench import energy
from h3gate.bench.block import STRICT_ORDER, arm_tables, block_calls
from h3gate.bench.timing import side_by_side, spin_cycles
from h3gate.kernels import gemm, gemm_merge
from h3gate.kernels.common import STRICT_LAUNCH, num_sms
from h3gate.kernels.gemm_configs import gemm_config
from h3gate.kernels.gemm_gluon import _producer, _store, _tile_coords, matmul_ws
from h3gate.kernels.gemm_gluon_plan import REGS, WS_MAXNREG, desc, plan
from h3gate.kernels.gemm_gluon_rows_dw import ROWS_DW_GLUON, rows_dw_ws
from h3gate.kernels.gemm_gluon_seg8 import SEG8_GLUON, SEGMENTS, _segment, matmul_seg8_ws
from h3gate.kernels.gemm_triton import matmul
from h3gate.numerics import strict_numerics
from h3gate.runs.setup import RunSpec, prepare

LAYERS = {"o": (5376, 7168, True), "down": (5376, 14336, False)}  # (N, K, bias)


@gluon.jit
def _seq_consumer(a_ring, b_ring, full, empty, c_ptr, bias_ptr, M, N, stride_cm, num_tiles, num_pid_a, num_pid_b,
                  k_tiles, cps, C: gl.constexpr, NB: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                  HAS_BIAS: gl.constexpr):  # fmt: skip
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
    layout_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    step = gl.program_id(0) * 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_a, pid_b = _tile_coords(t, num_pid_a, num_pid_b, GROUP)
        total = gl.zeros([64, NB], gl.float32, layout)
        for j in range(SEGMENTS):
            acc, acc_t, step = _segment(a_ring, b_ring, b_ring, full, empty, step, k_tiles, cps, j, layout, layout_t,
                                        C, NB, 0, 8, STAGES)  # fmt: skip
            total = total + acc
        offs_i = pid_a * 128 + C * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        _store(total, c_ptr, bias_ptr, offs_i, pid_b * NB, M, N, stride_cm, NB, False, HAS_BIAS)


@gluon.jit
def _seq_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, stride_cm, num_tiles, num_pid_a, num_pid_b, k_tiles, cps,
                BLOCK_B: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                HAS_BIAS: gl.constexpr, REGS_C: gl.constexpr, REGS_P: gl.constexpr):  # fmt: skip
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_B, BLOCK_K], b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    zero = gl.program_id(0) * 0
    gl.warp_specialize(
        [
            (_seq_consumer, (a_ring, b_ring, full, empty, c_ptr, bias_ptr, M, N, stride_cm, num_tiles, num_pid_a,
                             num_pid_b, k_tiles, cps, 0, BLOCK_B, GROUP, STAGES, HAS_BIAS)),
            (_seq_consumer, (a_ring, b_ring, full, empty, c_ptr, bias_ptr, M, N, stride_cm, num_tiles, num_pid_a,
                             num_pid_b, k_tiles, cps, 1, BLOCK_B, GROUP, STAGES, HAS_BIAS)),
            (_producer, (a_desc, b_desc, b_desc, b_desc, b_desc, b_desc, a_ring, b_ring, b_ring, full, empty,
                         num_tiles, num_pid_a, num_pid_b, zero, zero, zero, zero, k_tiles, BLOCK_B, 0, 0, BLOCK_K,
                         GROUP, STAGES, 128, 1)),
        ],
        [4, 1],
        [REGS_C, REGS_P],
    )  # fmt: skip


def seq_fold(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The seg8 kernel's segments added into one running total (``_seq_kernel``), SEG8_GLUON's tiling."""
    m, k = x.shape
    n = w.shape[0]
    cfg = SEG8_GLUON
    seg = gemm_merge.segment_size(k, gemm_merge.pinned_config("fwd", (n, k), x.dtype).block_k)
    p = plan(m, n, k, cfg, num_sms(x.device))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _seq_kernel[(p.grid,)](
        a_desc=desc(x, [128, cfg.block_k]), b_desc=desc(w, [cfg.block_n, cfg.block_k]), c_ptr=y,
        bias_ptr=b if b is not None else y, M=m, N=n, stride_cm=y.stride(0), num_tiles=p.tiles, num_pid_a=p.pid_a,
        num_pid_b=p.pid_b, k_tiles=p.k_tiles, cps=seg // cfg.block_k, BLOCK_B=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP=cfg.group_m, STAGES=cfg.num_stages, HAS_BIAS=b is not None, REGS_C=REGS[0], REGS_P=REGS[1],
        maxnreg=WS_MAXNREG, num_warps=4, **STRICT_LAUNCH,
    )  # fmt: skip
    return y


def span_ms(fn, reps: int) -> float:
    """Median over 5 spans of the milliseconds a call, ``reps`` calls back to back a span (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    spans = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        spans.append(start.elapsed_time(end) / reps)
    return statistics.median(spans)


def gemm_section(rows: list[int], reps: int, steady: bool = False) -> list[dict]:
    """Per layer and M: each variant's milliseconds a call back to back (:func:`span_ms`) and, ``steady``, the
    variants' sustained milliseconds and joules a call in one interleaved set of rounds
    (:func:`h3gate.bench.energy.sustained`): at the power cap, the number to compare."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for m in rows:
        for name, (n, k, bias) in LAYERS.items():
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
            b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
            path, cfg = gemm.forward_plan(x, w)
            y = torch.empty((m, n), dtype=x.dtype, device="cuda")
            seg = gemm_merge.segment_size(k, gemm_merge.pinned_config("fwd", (n, k), x.dtype).block_k)
            calls = {
                "cublas": lambda x=x, w=w, b=b: F.linear(x, w, b),
                "single": lambda x=x, w=w, b=b: gemm.forward(x, w, b),
                "single_128x128": lambda x=x, w=w, b=b, y=y, cfg=cfg: matmul_ws(
                    x, w, y, b, replace(cfg, block_n=128, tail_block_n=0, num_stages=4), num_sms(x.device)),
                "seg8": lambda x=x, w=w, b=b, y=y, seg=seg: matmul_seg8_ws(x, w, y, b, SEG8_GLUON, seg,
                                                                           num_sms(x.device)),
                "seg8_running_total": lambda x=x, w=w, b=b: seq_fold(x, w, b),
            }  # fmt: skip
            rec: dict = {"layer": name, "m": m, "n": n, "k": k, "single_path": path, "single_tiling": cfg.tag, "ms": {}}
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            for label, fn in calls.items():
                try:
                    got = fn().float()
                    rec.setdefault("rel_err", {})[label] = float((got - ref).norm() / ref.norm())
                    rec["ms"][label] = span_ms(fn, reps)
                except Exception as exc:  # noqa: BLE001 - a variant that fails to build is recorded, not fatal
                    rec.setdefault("failed", {})[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
            ms = rec["ms"]
            if steady:
                rec["sustained"] = energy.sustained({label: calls[label] for label in ms})
                arms = rec["sustained"]["arms"]
                rec["sustained_over_single"] = {
                    key: {u: a[u] / arms["single"][u] for u in ("ms_per_call", "j_per_call") if u in a}
                    for key, a in arms.items() if "single" in arms
                }  # fmt: skip
            rec["over_single"] = {key: v / ms["single"] for key, v in ms.items() if "single" in ms}
            print(json.dumps(rec), flush=True)
            out.append(rec)
            del x, w, b, y
            torch.cuda.empty_cache()
    return out


DW = {"q/k/v": (7168, 5376), "o": (5376, 7168), "gate_up": (28672, 5376), "down": (5376, 14336)}  # (N, K)


# The row-segment dW's ring depth and tile swizzle (scheduling only: the bytes must equal the production tiling's).
DW_TILINGS = {"s5_g8": (5, 8), "s4_g16": (4, 16), "s5_g16": (5, 16), "s3_g8": (3, 8)}


def _dw_times(m: int, n: int, k: int, gen: torch.Generator, reps: int) -> dict:
    g = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    dw, single, other = (torch.empty((n, k), dtype=torch.bfloat16, device="cuda") for _ in range(3))
    scfg = gemm_config("dw", n, k, torch.bfloat16)
    sms = num_sms(g.device)
    ms = {"single": span_ms(lambda: matmul(g, x, single, None, scfg, a_trans=True, b_trans=False), reps),
          "rows_dw_gluon": span_ms(lambda: rows_dw_ws(g, x, dw, sms), reps)}  # fmt: skip
    rec: dict = {"single_tiling": scfg.tag, "ms": ms, "same_bytes": {}}
    for label, (stages, group) in DW_TILINGS.items():
        cfg = replace(ROWS_DW_GLUON, num_stages=stages, group_m=group)
        try:
            ms[label] = span_ms(lambda cfg=cfg: rows_dw_ws(g, x, other, sms, cfg), reps)
            rec["same_bytes"][label] = bool(torch.equal(other.view(torch.int16), dw.view(torch.int16)))
        except Exception as exc:  # noqa: BLE001 - a tiling that fails to build is recorded, not fatal
            rec.setdefault("failed", {})[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec["over_single"] = {key: v / ms["single"] for key, v in ms.items()}
    return rec


def dw_section(rows: list[int], reps: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for m in rows:
        for name, (n, k) in DW.items():
            rec = {"weight": name, "m": m, "n": n, "k": k, **_dw_times(m, n, k, gen, reps)}
            print(json.dumps(rec), flush=True)
            out.append(rec)
            torch.cuda.empty_cache()
    return out


def _profile(fn, cycles: int, calls: int, top: int) -> dict:
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda._sleep(cycles)
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
    rows = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        lines = buf.getvalue().splitlines()
        head = next(i for i, line in enumerate(lines) if "ncalls" in line)
        rows[key] = lines[head : head + top + 1]
    return rows


def _block_arms(layout: str) -> tuple:
    """The real block at ``layout`` (the one run setup) and its strict tables in both orders."""
    setup = prepare(RunSpec("block", layout, "real", None, "cuda", 0, "strict", merge=STRICT_ORDER))
    tables, _ = arm_tables(setup.graph, setup.bindings, "cuda", "seg8")
    del tables["provider"]
    return setup, tables


def block_section(layout: str, head_start_us: float) -> dict:
    setup, tables = _block_arms(layout)
    rec: dict = {"layout": layout, "seq_len": setup.layout.seq_len, "head_start_us": head_start_us, "phases": {}}
    cycles = spin_cycles(head_start_us)
    for phase, make in block_calls(setup).items():
        fns = {who: make(t) for who, t in tables.items()}
        plain = side_by_side(fns, iters=20, warmup=3, observe={})
        ahead = side_by_side(fns, iters=20, warmup=3, head_start_us=head_start_us, observe={})
        row = {who: {"device_ms": plain[who]["median_ms"], "host_ms": plain[who]["host_ms"]["median_ms"],
                     "device_ms_host_ahead": ahead[who]["median_ms"]} for who in fns}  # fmt: skip
        row["seg8_over_single"] = plain["strict_seg8"]["median_ms"] / plain["strict"]["median_ms"]
        row["seg8_over_single_host_ahead"] = ahead["strict_seg8"]["median_ms"] / ahead["strict"]["median_ms"]
        if phase == "forward_backward":
            row["profile"] = {who: _profile(fn, cycles, 10, 30) for who, fn in fns.items()}
        print(json.dumps({phase: {k: v for k, v in row.items() if k != "profile"}}), flush=True)
        rec["phases"][phase] = row
    return rec


def _kernel_ms(fn, calls: int) -> dict[str, dict]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, dict] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = out.setdefault(ev.name[:160], {"ms": 0.0, "launches": 0})
        row["ms"] += ev.time_range.elapsed_us() / 1e3 / calls
        row["launches"] += 1
    for row in out.values():
        row["launches"] /= calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def kernel_section(layout: str, calls: int = 5) -> dict:
    setup, tables = _block_arms(layout)
    make = block_calls(setup)["forward_backward"]
    arms = {who: _kernel_ms(make(t), calls) for who, t in tables.items()}
    totals = {who: {"ms": sum(r["ms"] for r in rows.values()), "launches": sum(r["launches"] for r in rows.values())}
              for who, rows in arms.items()}  # fmt: skip
    names = set(arms["strict"]) | set(arms["strict_seg8"])
    delta = {n: arms["strict_seg8"].get(n, {"ms": 0.0})["ms"] - arms["strict"].get(n, {"ms": 0.0})["ms"] for n in names}
    top = dict(sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:25])
    rec = {"layout": layout, "calls": calls, "totals": totals, "seg8_minus_single_ms": top,
           "arms": {who: dict(list(rows.items())[:30]) for who, rows in arms.items()}}  # fmt: skip
    print(json.dumps({"kernels": {"totals": totals, "delta": top}}), flush=True)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--sections", nargs="+", default=["block", "gemm"], choices=["block", "gemm", "kernels", "dw"])
    ap.add_argument("--layouts", nargs="+", default=["medium"])
    ap.add_argument("--rows", type=int, nargs="+", default=[3160, 38974])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--head-start-us", type=float, default=60000.0)
    ap.add_argument("--sustained", action="store_true", help="gemm: also the variants' sustained ms and J a call")
    args = ap.parse_args()
    doc: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with strict_numerics():
        for section in args.sections:
            try:
                if section == "block":
                    doc["block"] = [block_section(layout, args.head_start_us) for layout in args.layouts]
                elif section == "dw":
                    doc["dw"] = dw_section(args.rows, args.reps)
                elif section == "kernels":
                    doc["kernels"] = [kernel_section(layout) for layout in args.layouts]
                else:
                    doc["gemm"] = gemm_section(args.rows, args.reps, args.sustained)
            except Exception:  # noqa: BLE001 - the other section still runs; the traceback is recorded
                doc.setdefault("errors", {})[section] = traceback.format_exc()[-3000:]
                print(doc["errors"][section], file=sys.stderr, flush=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    return 1 if "errors" in doc else 0


if __name__ == "__main__":
    sys.exit(main())
