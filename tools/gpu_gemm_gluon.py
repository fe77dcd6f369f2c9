#!/usr/bin/env python3
"""H200 probe of the warp-specialised Gluon GEMM forward (``kernels/gemm_gluon.py``), from the repo root:

    python3 tools/gpu_gemm_gluon.py --out $OUT/perf-probe-30.json [--variants a,b] [--sections bytes,time]

* ``bytes``: each variant's output against the production strict forward (``gemm.linear``, the Triton kernel),
  byte for byte, for the block's four layers at M = 264, 925, 3160 (and 38974 at ``time``), plus one case with a bias;
* ``time``: device-only medians (``triton.testing.do_bench_cudagraph``) and eager medians (``do_bench``) of cuBLAS
  (``F.linear``), the production strict forward and every variant at M = 264, 925, 3160 and 38974;
* ``grouped``: q, k, v (three (7168, 5376) weights on one X) by one grouped launch (``gemm_gluon.matmul_ws_grouped``,
  group_m 8 / 16 / 32) against the production strict forward called three times, byte for byte at M = 925, 1000,
  3160, 3163 (and 38974 when timed), and timed beside cuBLAS called three times and cuBLAS on the weights
  concatenated once beforehand (one (21504, 5376) product; its output columns are q, k, v side by side).

* ``sustained``: each arm back to back in the power-capped steady state (``h3gate.bench.energy.sustained``: SUST_S
  seconds a span, default 2, after 1 s of warm-up, 2 rounds): ms and joules per call of cuBLAS, the production strict
  forward and every variant, with the variants' bytes against the production forward.

A variant that fails to compile, launch or run is recorded with its error, never fatal. Prints one line per record.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
from gpu_probe_common import bits_equal, error_text, probe_main

from h3gate.bench import energy
from h3gate.kernels import gemm, gemm_gluon
from h3gate.kernels.gemm_configs import GemmConfig

LAYERS = {"qkv": (7168, 5376), "o_proj": (5376, 7168), "ffn_gate_up": (28672, 5376), "ffn_down": (5376, 14336)}
ROWS = (264, 925, 3160, 38974)
# name -> the Gluon tiling (GemmConfig with gluon=True: block_n = the wide tile's B rows, tail_m a second MMA's B rows,
# tail_block_n the narrow tiles of the last columns, group_m, num_stages the ring depth); "sw": Y^T = W X^T.
_N = GemmConfig(128, 256, 64, 16, 4, 3, persistent=True, tma=True, gluon=True)
_SW = GemmConfig(128, 128, 64, 1, 4, 5, persistent=True, tma=True, swap_ab=True, tail_m=8, gluon=True)
VARIANTS = {
    "n256_g8": replace(_N, group_m=8),
    "n256_g16": _N,
    "n256_g32": replace(_N, group_m=32),
    "n256_g16_t128": replace(_N, tail_block_n=128),
    "sw128t8_s5": _SW,
    "sw128t8_s6": replace(_SW, num_stages=6),
    "sw128t32_s5": replace(_SW, tail_m=32),
    "sw64t32_s6": replace(_SW, block_n=64, tail_m=32, num_stages=6),
    "sw128t16_s5": replace(_SW, tail_m=16),
    # (rounds 3 and 4 also ran unswapped tiles with a B tail of weight rows and three-consumer 192-row tiles; both
    # were slower than the shipped tilings and were removed from the kernel: git log -- evidence/h200/PROVENANCE.md)
}
# GEMM_LAYERS / GEMM_ROWS (comma lists) narrow a run to some layers and M
if os.environ.get("GEMM_LAYERS"):
    LAYERS = {k: v for k, v in LAYERS.items() if k in os.environ["GEMM_LAYERS"].split(",")}
if os.environ.get("GEMM_ROWS"):
    ROWS = tuple(int(r) for r in os.environ["GEMM_ROWS"].split(","))


def _inputs(m: int, n: int, k: int, seed: int, bias: bool = False) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    return x, w, b


def _variant(name: str):
    cfg = VARIANTS[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(x, w, b):
        y = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
        return gemm_gluon.matmul_ws(x, w, y, b, cfg, sms)

    return run


def _bytes(records: list, variants: list[str], small: bool) -> None:
    cases = [(layer, m, False) for layer in LAYERS for m in ROWS if m < 38974]
    with_bias = (("qkv", 925), ("o_proj", 300), ("ffn_gate_up", 3160))
    cases += [(layer, m, True) for layer, m in with_bias if layer in LAYERS]
    for layer, m, bias in cases[:2] if small else cases:
        n, k = LAYERS[layer]
        x, w, b = _inputs(m, n, k, seed=m + n, bias=bias)
        with torch.no_grad():
            ref = gemm.linear(x, w, b)
        rec = {"section": "bytes", "layer": layer, "m": m, "bias": bias, "equal": {}, "errors": {}}
        for name in variants:
            try:
                rec["equal"][name] = bits_equal(_variant(name)(x, w, b), ref)
            except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
                rec["equal"][name] = None
                rec["errors"][name] = error_text(exc)
        torch.cuda.synchronize()
        print(rec, flush=True)
        records.append(rec)


def _time_one(fn, graph: bool) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    return triton.testing.do_bench(fn, warmup=15, rep=60, return_mode="median")


def _time(records: list, variants: list[str], small: bool) -> None:
    for layer, (n, k) in LAYERS.items():
        for m in ROWS[:1] if small else ROWS:
            x, w, _ = _inputs(m, n, k, seed=7)
            fns = {"cublas": lambda x=x, w=w: F.linear(x, w), "strict": lambda x=x, w=w: gemm.linear(x, w)}
            ref = gemm.linear(x, w)
            for name in variants:
                run = _variant(name)
                fns[name] = lambda x=x, w=w, run=run: run(x, w, None)
            rec = {"section": "time", "layer": layer, "m": m, "tflops_per_ms": 2 * m * n * k / 1e9,
                   "graph_ms": {}, "eager_ms": {}, "equal": {}, "errors": {}}  # fmt: skip
            with torch.no_grad():
                for name, fn in fns.items():
                    try:
                        if name not in ("cublas", "strict"):
                            rec["equal"][name] = bits_equal(fn(), ref)
                        rec["graph_ms"][name] = _time_one(fn, True)
                        rec["eager_ms"][name] = _time_one(fn, False)
                    except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
                        rec["errors"][name] = error_text(exc)
            g = rec["graph_ms"]
            cb = g.get("cublas")
            rec["vs_cublas_graph"] = {nm: cb / t for nm, t in g.items() if cb and t}
            print({key: rec[key] for key in ("layer", "m", "vs_cublas_graph", "equal", "errors")}, flush=True)
            records.append(rec)
            del x, w, ref
            torch.cuda.empty_cache()


GROUPED = {f"grouped_g{g}": replace(_N, group_m=g) for g in (8, 16, 32)}


def _grouped_case(m: int) -> tuple:
    n, k = LAYERS.get("qkv", (7168, 5376))
    x, wq, _ = _inputs(m, n, k, seed=m)
    _, wk, _ = _inputs(1, n, k, seed=m + 1)
    _, wv, _ = _inputs(1, n, k, seed=m + 2)
    return x, (wq, wk, wv)


def _grouped_fn(cfg: GemmConfig, x: torch.Tensor, ws: tuple):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ys = [torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    return lambda: gemm_gluon.matmul_ws_grouped(x, ws, ys, cfg, sms)


def _grouped_fns(x: torch.Tensor, ws: tuple) -> dict:
    cat = torch.cat(ws)
    fns = {"cublas3": lambda: [F.linear(x, w) for w in ws], "cublas_cat": lambda: F.linear(x, cat),
           "strict3": lambda: [gemm.linear(x, w) for w in ws]}  # fmt: skip
    return {**fns, **{name: _grouped_fn(cfg, x, ws) for name, cfg in GROUPED.items()}}


def _grouped(records: list, variants: list[str], small: bool) -> None:
    for m in (925, 1000, 3160, 3163, 38974):
        if small and m != 3160:
            continue
        x, ws = _grouped_case(m)
        with torch.no_grad():
            ref = [gemm.linear(x, w) for w in ws]
            fns = _grouped_fns(x, ws)
            n, k = ws[0].shape
            rec = {"section": "grouped", "m": m, "tflops_per_ms": 3 * 2 * m * n * k / 1e9, "graph_ms": {},
                   "equal": {}, "errors": {}}  # fmt: skip
            for name, fn in fns.items():
                try:
                    if name.startswith("grouped"):
                        rec["equal"][name] = all(bits_equal(a, b) for a, b in zip(fn(), ref, strict=True))
                    if m in (925, 3160, 38974):
                        rec["graph_ms"][name] = _time_one(fn, True)
                except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
                    rec["errors"][name] = error_text(exc)
        g = rec["graph_ms"]
        rec["vs_cublas3_graph"] = {nm: g["cublas3"] / t for nm, t in g.items() if g.get("cublas3") and t}
        rec["vs_cublas_cat_graph"] = {nm: g["cublas_cat"] / t for nm, t in g.items() if g.get("cublas_cat") and t}
        keys = ("m", "vs_cublas3_graph", "vs_cublas_cat_graph", "equal", "errors")
        print({key: rec[key] for key in keys}, flush=True)
        records.append(rec)
        del x, ws, ref, fns
        torch.cuda.empty_cache()


def _sustained(records: list, variants: list[str], small: bool) -> None:
    seconds = float(os.environ.get("SUST_S", "2.0"))
    for layer, (n, k) in LAYERS.items():
        for m in ROWS[:1] if small else ROWS:
            x, w, _ = _inputs(m, n, k, seed=7)
            fns = {"cublas": lambda x=x, w=w: F.linear(x, w), "strict": lambda x=x, w=w: gemm.linear(x, w)}
            rec = {"section": "sustained", "layer": layer, "m": m, "seconds": seconds, "equal": {}, "errors": {}}
            with torch.no_grad():
                ref = gemm.linear(x, w)
                for name in variants:
                    run = _variant(name)
                    try:
                        rec["equal"][name] = bits_equal(run(x, w, None), ref)
                        fns[name] = lambda x=x, w=w, run=run: run(x, w, None)
                    except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
                        rec["errors"][name] = error_text(exc)
                out = energy.sustained(fns, seconds=seconds, warm_s=1.0, rounds=2)
            rec.update(out)
            base = out["arms"]["cublas"]
            rec["vs_cublas_ms"] = {nm: a["ms_per_call"] / base["ms_per_call"] for nm, a in out["arms"].items()}
            if "j_per_call" in base:
                rec["vs_cublas_j"] = {nm: a["j_per_call"] / base["j_per_call"] for nm, a in out["arms"].items()}
            print({key: rec.get(key) for key in ("layer", "m", "vs_cublas_ms", "vs_cublas_j", "equal", "errors")},
                  flush=True)  # fmt: skip
            records.append(rec)
            del x, w, ref, fns
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sections = {"bytes": _bytes, "time": _time, "grouped": _grouped, "sustained": _sustained}
    raise SystemExit(probe_main(VARIANTS, sections))
