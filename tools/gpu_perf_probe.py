#!/usr/bin/env python3
"""H200 probe for the open bench criteria of issues #4 and #5 (run from the repo root, PYTHONPATH=$PWD):

    python3 tools/gpu_perf_probe.py --out $OUT/perf-probe.json [--sections gemm,norm,launch]

* ``gemm``: for the block's four BF16 GEMM shapes at M in {264, 3160, 38974}, tile candidates that all keep the
  production K tiling (BLOCK_K = 64, ascending) timed next to cuBLAS (``F.linear``); every candidate's output is
  compared byte for byte with the production config's output at the same M (does the tile shape change the bytes?).
* ``norm``: modulated RMSNorm at 768p rows (S = 38974, H = 5376): the production forward kernel at several launch
  geometries - the whole-row tile (v1: BLOCK_H = 8192, 4/8/16 warps) and the chunked two-pass form (BLOCK_H =
  1024/2048 column chunks, 4/8 warps; v2 ships 2048 at 4 warps) - each next to the provider; bytes compared with
  the production output. (Run 1, ``perf-probe-1.json``, timed the chunked form as a standalone prototype kernel
  before it moved into ``norms``.)
* ``attn``: attention forward query-block heights (same KV walk) at S = 264 / 925 / 3160, bitwise vs production,
  timed next to SDPA-flash.
* ``launch``: host overhead of the small ops (packed_index_select, conditioning_noise_mix): the registry binding,
  the autograd-free launch and the provider, timed as the bench times them, plus host-only microseconds per call,
  and gather tilings for C = 96.

Every timing here is ``triton.testing.do_bench`` median unless said otherwise. Failures are recorded, never fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from h3gate.kernels import norms
from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, tma_allocator
from h3gate.kernels.gemm_configs import GemmConfig, gemm_config
from h3gate.kernels.gemm_triton import matmul

SHAPES = {"qkv": (5376, 7168), "o_proj": (7168, 5376), "ffn_gate_up": (5376, 28672), "ffn_down": (14336, 5376)}
MS = (264, 3160, 38974)
C = GemmConfig
CANDIDATES = [
    C(128, 256, 64, 8, 8, 3, persistent=True),
    C(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    C(128, 256, 64, 8, 8, 4, persistent=False, tma=True),
    C(128, 128, 64, 8, 8, 4, persistent=True, tma=True),
    C(128, 128, 64, 8, 8, 4, persistent=False),
    C(128, 128, 64, 8, 4, 4, persistent=False, tma=True),
    C(128, 128, 64, 8, 4, 4, persistent=True, tma=True),
    C(256, 128, 64, 8, 8, 3, persistent=True, tma=True),
    C(256, 128, 64, 8, 8, 4, persistent=False, tma=True),
    C(64, 256, 64, 8, 4, 4, persistent=False, tma=True),
    C(64, 128, 64, 8, 4, 4, persistent=False, tma=True),
    C(64, 128, 64, 8, 4, 5, persistent=False),
    C(128, 64, 64, 8, 4, 5, persistent=False),
    C(64, 64, 64, 8, 4, 6, persistent=False),
    C(64, 128, 64, 1, 4, 4, persistent=True, tma=True),
]
# Round 2 (after round 1 found every tile shape bitwise equal to production): tile-order groups (GROUP_M up to the
# whole M so the weight streams from DRAM once) and deeper pipelines for the small-M tiles.
ROUND2 = [
    C(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    C(128, 256, 64, 16, 8, 3, persistent=True, tma=True),
    C(128, 256, 64, 32, 8, 3, persistent=True, tma=True),
    C(128, 256, 64, 64, 8, 3, persistent=True, tma=True),
    C(128, 256, 64, 32, 8, 3, persistent=True),
    C(128, 256, 64, 32, 8, 3, persistent=False, tma=True),
    C(128, 128, 64, 32, 8, 4, persistent=True, tma=True),
    C(128, 128, 64, 32, 8, 5, persistent=True, tma=True),
    C(64, 256, 64, 8, 4, 4, persistent=False, tma=True),
    C(64, 256, 64, 8, 4, 5, persistent=False, tma=True),
    C(64, 256, 64, 8, 4, 3, persistent=True, tma=True),
    C(64, 256, 64, 1, 4, 4, persistent=False, tma=True),
    C(64, 128, 64, 8, 4, 6, persistent=False, tma=True),
]
# Round 3 (Triton's Hopper warp specialisation, perf-probe-6/7) ran at commits 90e586c / fcffb56 with a
# `warp_spec` knob in the kernel; it gave no device-side gain and the knob was removed (gemm-gap-profile.md).


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"


# Round 4: tail tiles (GemmConfig.tail_block_n) for the persistent qkv forward at M = 3072 / 3160 (5.1 / 5.3 waves of
# 256-wide tiles); gate-up (21 waves, where gemm_configs.tail_split declines) as the control.
ROUND4 = [
    C(128, 256, 64, 16, 8, 3, persistent=True, tma=True),
    C(128, 256, 64, 16, 8, 3, persistent=True, tma=True, tail_block_n=128),
    C(128, 256, 64, 16, 8, 3, persistent=True, tma=True, tail_block_n=64),
    C(128, 256, 64, 8, 8, 3, persistent=True),
    C(128, 256, 64, 8, 8, 3, persistent=True, tail_block_n=128),
]


# Round 5: swapped operands for few rows (GemmConfig.swap_ab: Y^T = W @ X^T, a tile = block_n weight rows x a chunk of
# block_m + tail_m tokens). M = 264 = 256 + 16 = 2 x (128 + 16) = 3 x (64 + 32) tokens; M = 925 <= 3 x (256 + 64),
# 5 x (128 + 64), 4 x 256, 8 x 128. Each M also times its production bucket tiling.
def _swaps(chunks: tuple[tuple[int, int], ...], tma: tuple[bool, ...]) -> list[GemmConfig]:
    return [
        C(bm, bn, 64, 1, w, st, swap_ab=True, tail_m=tm, tma=t)
        for bm, tm in chunks
        for bn, w, st in ((64, 4, 4), (128, 8, 3))
        for t in tma
    ]


ROUND5 = {
    264: _swaps(((256, 16), (128, 16), (64, 32)), (False, True)),
    925: _swaps(((256, 64), (128, 64), (256, 0), (128, 0)), (True,)),
}


def graph_bench(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))


def gemm_section(
    deadline: float,
    candidates: list[GemmConfig] | dict[int, list[GemmConfig]],
    m_list: tuple[int, ...] = MS,
    graph: bool = False,
) -> dict:
    """``candidates`` per M (a dict: the M's production bucket tiling is timed first) or one list for every M."""
    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
        prod = gemm_config("fwd", n, k, torch.bfloat16)
        out[name] = {"production": prod.tag, "by_m": {}}
        for m in m_list:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            ref = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            matmul(x, w, ref, None, prod, a_trans=False, b_trans=True)
            cublas_ms = bench(lambda x=x, w=w: F.linear(x, w))
            cub = F.linear(x, w)
            rec = {"cublas_ms": cublas_ms, "production_bitwise_cublas": bool(torch.equal(ref, cub)), "cands": {}}
            if graph:
                rec["cublas_graph_ms"] = graph_bench(lambda x=x, w=w: F.linear(x, w))
            cands = candidates
            if isinstance(candidates, dict):
                cands = [gemm_config("fwd", n, k, torch.bfloat16, m), *candidates[m]]
            for cfg in cands:
                if time.time() > deadline:
                    rec["cands"][cfg.tag] = {"skipped": "deadline"}
                    continue
                y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                try:
                    matmul(x, w, y, None, cfg, a_trans=False, b_trans=True)
                    torch.cuda.synchronize()
                    ms = bench(lambda x=x, w=w, y=y, cfg=cfg: matmul(x, w, y, None, cfg, a_trans=False, b_trans=True))
                    rec["cands"][cfg.tag] = {
                        "ms": ms,
                        "ratio_to_cublas": cublas_ms / ms,
                        "bitwise_production": bool(torch.equal(y, ref)),
                    }
                    if graph:
                        gms = graph_bench(lambda x=x, w=w, y=y, cfg=cfg: matmul(x, w, y, None, cfg, a_trans=False,
                                                                                b_trans=True))  # fmt: skip
                        rec["cands"][cfg.tag].update(graph_ms=gms, graph_ratio=rec["cublas_graph_ms"] / gms)
                except Exception as exc:  # noqa: BLE001 - recorded
                    rec["cands"][cfg.tag] = {"error": err(exc)}
                print(" ", name, m, cfg.tag, json.dumps(rec["cands"][cfg.tag]), flush=True)
            good = {t: c for t, c in rec["cands"].items() if "ms" in c and c["bitwise_production"]}
            if good:
                best = max(good, key=lambda t: good[t]["ratio_to_cublas"])
                rec["best"] = {"tag": best, **good[best]}
            out[name]["by_m"][str(m)] = rec
            print(name, m, "cublas", round(cublas_ms, 4), "best", rec.get("best"), flush=True)
            del x, ref
    return out


def norm_section() -> dict:
    from h3gate.bench.timing import copy_bandwidth_gbs, side_by_side
    from h3gate.ops import reference

    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, t = 38974, 5376, 3
    x = torch.randn(1, s, h, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    proj = (0.2 * torch.randn(t, 18 * h, device="cuda", generator=g)).bfloat16()
    shift, scale = reference.adaln_table(proj, h)[:2]
    idx = torch.randint(0, 3 * t, (s,), device="cuda", generator=g)
    copy_gbs = copy_bandwidth_gbs("cuda")
    moved = 4 * s * h + 8 * s + 2 * h
    round_first = norms.provider_rounds_first(x.device)
    res: dict = {"copy_gbs": copy_gbs, "round_first": round_first, "variants": {}}
    base = norms.rmsnorm_modulate(x, w, shift, scale, idx, 1e-5)

    def variant(block_h: int, warps: int):
        """The production forward kernel at one launch geometry: BLOCK_H = 8192 is the whole-row tile (v1),
        BLOCK_H < H the chunked form (v2 ships 2048 at 4 warps); each geometry is its own reduction tree."""

        def run():
            out = torch.empty_like(x)
            norms._rms_fwd_kernel[(s,)](
                x, w, out, out, shift, scale, idx, s, h, s, shift.stride(0), scale.stride(0), float(h), 1e-5,
                BLOCK_M=1, BLOCK_H=block_h, NCH=triton.cdiv(h, block_h), MODULATE=True, ROUND_FIRST=round_first,
                SAVE_RSTD=False, INTERPRET=INTERPRET, num_warps=warps, **STRICT_LAUNCH,
            )  # fmt: skip
            return out

        return run

    variants = {f"whole_row_w{wp}": variant(8192, wp) for wp in (4, 8, 16)}
    for chunk in (1024, 2048):
        for warps in (4, 8):
            variants[f"chunk{chunk}_w{warps}"] = variant(chunk, warps)
    provider = lambda: reference.rmsnorm_modulate(x, w, shift, scale, idx, 1e-5)  # noqa: E731
    fns = {"provider": provider}
    for name, fn in variants.items():
        try:
            y = fn()
            torch.cuda.synchronize()
            res["variants"][name] = {"bitwise_production": bool(torch.equal(y, base))}
            fns[name] = fn
        except Exception as exc:  # noqa: BLE001
            res["variants"][name] = {"error": err(exc)}
    with torch.no_grad():
        timing = side_by_side(fns, iters=50)
    for name, tm in timing.items():
        rec = res["variants"].setdefault(name, {})
        rec.update(tm)
        rec["fraction_of_copy"] = moved / (tm["median_ms"] * 1e-3) / 1e9 / copy_gbs
    return res


def launch_section(ops: tuple[str, ...] = ("packed_index_select", "conditioning_noise_mix"), rows: int = 38974) -> dict:
    from h3gate.bench.timing import side_by_side
    from h3gate.kernels import gather
    from h3gate.manifests.model_config import load_config
    from h3gate.ops import registry
    from h3gate.ops.cases import build_case

    cfg = load_config("real").config
    res: dict = {}
    for op in ops:
        case = build_case(op, rows, cfg, "cuda", seed=0)
        strict = registry.bind(op, "strict", "cuda").fn
        ref = registry.reference(op)
        fns = {
            "strict": lambda strict=strict, case=case: case.call(strict),
            "provider": lambda ref=ref, case=case: case.call(ref),
        }
        if op == "packed_index_select":
            x, idx = case.args
            fns["raw_gather"] = lambda x=x, idx=idx: gather.gather_rows(x, idx)
            for bn in (16, 32, 64):

                def tiled(bn=bn, x=x, idx=idx):
                    out = torch.empty((x.shape[0], idx.shape[0], x.shape[2]), dtype=x.dtype, device="cuda")
                    gather._gather_kernel[(triton.cdiv(idx.shape[0], bn), 1, x.shape[0])](
                        x, idx, out, idx.shape[0], x.shape[2], x.stride(0), x.stride(1), out.stride(0),
                        out.stride(1), BLOCK_N=bn, BLOCK_C=128, CAST=False, SUM1=False, INTERPRET=False, num_warps=4,
                        **STRICT_LAUNCH,
                    )  # fmt: skip
                    return out

                fns[f"gather_bn{bn}"] = tiled
        rec: dict = {"shape": case.shape}
        with torch.no_grad():
            rec["bench_style"] = side_by_side(fns, iters=100)
            host = {}
            for name, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                host[name] = (time.perf_counter() - t0) / 200 * 1e6
                torch.cuda.synchronize()
            rec["host_us_per_call"] = host
        res[op] = rec
        print(op, json.dumps(rec)[:800], flush=True)
    return res


SKINNY = {  # name: (N, K, dtype, Ms, candidates) - layers outside the block (no issue target), timed cold (L2 flushed)
    "final_adaln_projection": (10752, 2688, torch.bfloat16, (1, 3), [
        C(16, 128, 128, 1, 4, 4), C(16, 64, 128, 1, 4, 4), C(16, 32, 128, 1, 4, 4), C(16, 64, 128, 1, 4, 6),
        C(16, 32, 128, 1, 2, 4), C(16, 16, 128, 1, 1, 4)]),
    "adaln_projection_3mod": (96768, 2688, torch.bfloat16, (3,), [C(16, 64, 128, 1, 4, 4), C(16, 128, 128, 1, 4, 4)]),
    "video_output_projection_fp32": (96, 5376, torch.float32, (3160, 38974), [
        C(64, 64, 32, 8, 4, 3), C(16, 64, 32, 8, 4, 3), C(32, 32, 32, 8, 4, 3), C(16, 32, 32, 8, 2, 3),
        C(32, 128, 32, 8, 4, 3), C(16, 128, 64, 8, 4, 3)]),
    "audio_output_projection_fp32": (32, 5376, torch.float32, (3160, 38974), [
        C(64, 64, 32, 8, 4, 3), C(16, 32, 32, 8, 2, 3), C(32, 32, 32, 8, 4, 3), C(16, 32, 64, 8, 4, 3)]),
    "video_input_projection_fp32": (5376, 96, torch.float32, (3160, 38974), [
        C(128, 128, 32, 8, 8, 2), C(64, 128, 32, 8, 4, 2), C(64, 64, 32, 8, 4, 2), C(128, 64, 32, 8, 4, 2),
        C(32, 128, 32, 8, 4, 2)]),
}  # fmt: skip


def skinny_section() -> dict:
    """Non-block projections: candidate tilings vs F.linear (bias), interleaved, L2 flushed; bytes vs production."""
    from h3gate.bench.timing import side_by_side

    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {}
    for name, (n, k, dt, ms, cands) in SKINNY.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dt)
        b = (0.1 * torch.randn(n, device="cuda", generator=g)).to(dt)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(dt)
            prod = gemm_config("fwd", n, k, dt, m)
            ref = torch.empty(m, n, dtype=dt, device="cuda")
            matmul(x, w, ref, b, prod, a_trans=False, b_trans=True)
            fns = {"cublas": lambda x=x, w=w, b=b: F.linear(x, w, b)}
            rec: dict = {"production": prod.tag, "cands": {}}
            for cfg in cands:
                y = torch.empty(m, n, dtype=dt, device="cuda")
                try:
                    matmul(x, w, y, b, cfg, a_trans=False, b_trans=True)
                    torch.cuda.synchronize()
                    rec["cands"][cfg.tag] = {"bitwise_production": bool(torch.equal(y, ref))}
                    fns[cfg.tag] = lambda x=x, w=w, b=b, y=y, cfg=cfg: matmul(x, w, y, b, cfg, a_trans=False,
                                                                             b_trans=True)  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    rec["cands"][cfg.tag] = {"error": err(exc)}
            tm = side_by_side(fns, iters=30)
            rec["cublas_ms"] = tm.pop("cublas")["median_ms"]
            for tag, t in tm.items():
                rec["cands"][tag].update(ms=t["median_ms"], ratio_to_cublas=rec["cublas_ms"] / t["median_ms"])
            out[f"{name}@M{m}"] = rec
            print(name, m, json.dumps(rec)[:600], flush=True)
    return out


def profile_section() -> dict:
    """What is left of the GEMM gap: device-only time (CUDA graph replay, no host launch cost) vs eager time, at M
    just below/at a BLOCK_M multiple (256 / 3072) and at the layouts' M (264 / 3160), for the production path
    (``gemm.linear``, no grad) and cuBLAS; plus the tile count / wave arithmetic of the production tiling."""
    from h3gate.kernels import gemm

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {"sms": sms, "shapes": {}}
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
        rec: dict = {}
        for m in (256, 264, 3072, 3160):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            cfg = gemm_config("fwd", n, k, torch.bfloat16, m)
            with torch.no_grad():
                ours = lambda x=x, w=w: gemm.linear(x, w)  # noqa: E731
                cub = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
                r = {
                    "config": cfg.tag,
                    "tiles": triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),
                    "eager_ours_ms": bench(ours),
                    "eager_cublas_ms": bench(cub),
                }
                try:
                    r["graph_ours_ms"] = float(triton.testing.do_bench_cudagraph(ours, rep=60, return_mode="median"))
                    r["graph_cublas_ms"] = float(triton.testing.do_bench_cudagraph(cub, rep=60, return_mode="median"))
                    r["graph_ratio"] = r["graph_cublas_ms"] / r["graph_ours_ms"]
                except Exception as exc:  # noqa: BLE001
                    r["graph_error"] = err(exc)
            r["waves"] = r["tiles"] / sms
            r["eager_ratio"] = r["eager_cublas_ms"] / r["eager_ours_ms"]
            rec[str(m)] = r
            print(name, m, json.dumps(r), flush=True)
        out["shapes"][name] = rec
    return out


def cublas_kernels_section(m_list: tuple[int, ...] = (264, 925, 3160)) -> dict:
    """Which kernels cuBLAS runs for the block's four shapes (``F.linear``, bf16, TF32 off) and how long each takes on
    the device (torch.profiler, 20 calls, L2 not flushed), next to the strict ``gemm.linear``: the kernel names say
    the tile shape and whether K is split (cuBLAS's ``splitK`` / ``segment_k_on`` / reduction kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from h3gate.kernels import gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {}
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
        for m in m_list:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            rec: dict = {}
            calls = {"cublas": lambda x=x, w=w: F.linear(x, w), "strict": lambda x=x, w=w: gemm.linear(x, w)}
            for who, fn in calls.items():
                with torch.no_grad():
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            fn()
                        torch.cuda.synchronize()
                rec[who] = [
                    {"kernel": e.key[:240], "calls": e.count, "device_us_per_call": e.device_time_total / 20.0}
                    for e in prof.key_averages()
                    if e.device_time_total > 0
                ]
            out[f"{name}@M{m}"] = rec
            print(name, m, json.dumps(rec)[:800], flush=True)
    return out


def hostcost_section(calls: int = 300) -> dict:
    """Where the host time of one strict GEMM call goes at M = 264 (qkv: pointer path, ffn_down: TMA path): each
    stage of ``gemm.linear`` timed alone over back-to-back calls (no sync inside), plus a cProfile of the whole call."""
    import cProfile
    import io
    import pstats

    from h3gate.kernels import gemm

    def per_call(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        return dt

    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {}
    for name in ("qkv", "ffn_down"):
        k, n = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
        x = torch.randn(264, k, device="cuda", generator=g).bfloat16()
        y = torch.empty(264, n, dtype=torch.bfloat16, device="cuda")
        cfg = gemm_config("fwd", n, k, torch.bfloat16, 264)
        with torch.no_grad():
            rec = {
                "config": cfg.tag,
                "linear_us": per_call(lambda x=x, w=w: gemm.linear(x, w)),
                "F.linear_us": per_call(lambda x=x, w=w: F.linear(x, w)),
                "check_us": per_call(lambda x=x, w=w: gemm.check_linear("op", x, w, None)),
                "gemm_config_us": per_call(lambda n=n, k=k: gemm_config("fwd", n, k, torch.bfloat16, 264)),
                "empty_us": per_call(lambda n=n: torch.empty((264, n), dtype=torch.bfloat16, device="cuda")),
                "matmul_us": per_call(lambda x=x, w=w, y=y, cfg=cfg: matmul(x, w, y, None, cfg, a_trans=False,
                                                                           b_trans=True)),
                "set_allocator_us": per_call(lambda: triton.set_allocator(tma_allocator)),
            }  # fmt: skip
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                gemm.linear(x, w)
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            rec["cprofile_tottime"] = buf.getvalue()[-6000:]
        out[name] = rec
        print(name, json.dumps({k2: v for k2, v in rec.items() if k2 != "cprofile_tottime"}), flush=True)
        print(rec["cprofile_tottime"][:3000], flush=True)
    return out


def attn_section(seqs: tuple[int, ...] = (264, 925, 3160)) -> dict:
    """Attention forward query-block heights at small S: the production tiling and variants that keep its KV walk
    (fwd_n = 64, same exp2/fma forms) but change BLOCK_M / warps / stages, each compared byte for byte with the
    production output, timed side by side with the provider under SDPA-flash (h3gate.bench.timing, head start)."""
    from dataclasses import replace

    from h3gate.bench.baselines import sdpa_flash
    from h3gate.bench.timing import side_by_side
    from h3gate.kernels import attention
    from h3gate.ops import reference

    prod = attention.attn_config(128, torch.bfloat16)
    PTR = "triton_pointer"  # noqa: N806 - the pointer kernel's query-block heights are what is measured
    cands = {
        "production": prod,
        "m128_w8_s2": replace(prod, fwd_stages=2),
        "m64_w4_s3": replace(prod, fwd_m=64, fwd_warps=4, fwd_stages=3),
        "m64_w4_s4": replace(prod, fwd_m=64, fwd_warps=4, fwd_stages=4),
        "m64_w4_s2": replace(prod, fwd_m=64, fwd_warps=4, fwd_stages=2),
        "m64_w8_s3": replace(prod, fwd_m=64, fwd_warps=8, fwd_stages=3),
    }
    flash = sdpa_flash(reference.attention)
    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in seqs:
        q, k, v = (torch.randn(1, s, 56, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
        ref = attention.forward(q, k, v, prod, path=PTR)[0]
        rec: dict = {"cands": {}}
        fns = {"sdpa_flash": lambda q=q, k=k, v=v: flash(q, k, v)}
        for name, cfg in cands.items():
            try:
                y = attention.forward(q, k, v, cfg, path=PTR)[0]
                torch.cuda.synchronize()
                rec["cands"][name] = {"tag": cfg.tag, "bitwise_production": bool(torch.equal(y, ref))}
                fns[name] = lambda q=q, k=k, v=v, cfg=cfg: attention.forward(q, k, v, cfg, path=PTR)
            except Exception as exc:  # noqa: BLE001 - recorded
                rec["cands"][name] = {"tag": cfg.tag, "error": err(exc)}
        stats = side_by_side(fns, iters=50, head_start_us=300.0)
        rec["sdpa_flash_ms"] = stats["sdpa_flash"]["median_ms"]
        for name in rec["cands"]:
            if name in stats:
                ms = stats[name]["median_ms"]
                rec["cands"][name].update(ms=ms, min_ms=stats[name]["min_ms"], ratio_to_flash=rec["sdpa_flash_ms"] / ms)
            print(" attn", s, name, json.dumps(rec["cands"][name]), flush=True)
        out[str(s)] = rec
    return out


def attn_tma_section(seqs: tuple[int, ...] = (264, 925, 3160, 38974)) -> dict:
    """Attention forward with TMA tile loads (path ``triton_tma``) next
    to the production pointer kernel, SDPA-cuDNN and SDPA-flash, every candidate's out and lse2 compared byte for
    byte with production; and, on a permuted packing, the walk order read in place (production) against the
    session-10 form (gather copies of q, k, v, the kernel, a scatter copy of the output), forward and backward."""
    from dataclasses import replace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from h3gate.bench.timing import side_by_side
    from h3gate.kernels import attention, attention_bwd

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

        return run

    cudnn, flash = sdpa(SDPBackend.CUDNN_ATTENTION), sdpa(SDPBackend.FLASH_ATTENTION)
    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in seqs:
        prod = attention.attn_config(128, torch.bfloat16, s)
        # name -> (tiling, path; None: the declared one)
        cands = {"production": (prod, None), "pointer_m128": (replace(prod, fwd_m=128, fwd_warps=8), "triton_pointer")}
        for m, n, w, st in ((64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3)):
            c = replace(prod, fwd_m=m, fwd_n=n, fwd_warps=w, fwd_stages=st)
            cands.setdefault(f"{c.tag}_tma", (c, "triton_tma"))
        q, k, v = (torch.randn(1, s, 56, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
        ref, ref_lse = attention.forward(q, k, v, prod)
        rec: dict = {"production_tag": prod.tag, "cands": {}}
        fp32 = None
        if s <= 4096:  # an FP32 reference (SDPA math in float32) where the scores fit
            with sdpa_kernel([SDPBackend.MATH]):
                fp32 = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
            fp32 = fp32.reshape(1, s, -1)
        fns = {"sdpa_cudnn": lambda q=q, k=k, v=v: cudnn(q, k, v), "sdpa_flash": lambda q=q, k=k, v=v: flash(q, k, v)}
        for name, (cfg, path) in cands.items():
            try:
                y, lse = attention.forward(q, k, v, cfg, path=path)
                torch.cuda.synchronize()
                rec["cands"][name] = {
                    "tag": cfg.tag, "bitwise_production": bool(torch.equal(y, ref) and torch.equal(lse, ref_lse)),
                    "max_abs_vs_production": float((y.float() - ref.float()).abs().max()),
                }  # fmt: skip
                if fp32 is not None:
                    rec["cands"][name]["rel_l2_vs_fp32"] = float((y.float() - fp32).norm() / fp32.norm())
                fns[name] = lambda q=q, k=k, v=v, cfg=cfg, path=path: attention.forward(q, k, v, cfg, path=path)
            except Exception as exc:  # noqa: BLE001 - recorded
                rec["cands"][name] = {"tag": cfg.tag, "error": err(exc)}
        stats = side_by_side(fns, iters=10 if s > 20000 else 40, head_start_us=300.0)
        rec["ms"] = {name: st["median_ms"] for name, st in stats.items()}
        rec["tflops"] = {name: 4 * s * s * 128 * 56 / (ms * 1e9) for name, ms in rec["ms"].items()}
        print(" attn_tma", s, json.dumps(rec), flush=True)
        rec["backward"] = _bwd_variants(q, k, v, prod, side_by_side, attention, attention_bwd, cudnn, flash)
        print(" attn_bwd", s, json.dumps(rec["backward"]), flush=True)
        if s in (3160, 38974):
            rec["order"] = _order_costs(q, k, v, prod, side_by_side, attention, attention_bwd)
            print(" attn_order", s, json.dumps(rec["order"]), flush=True)
        out[str(s)] = rec
    return out


def _bwd_variants(q, k, v, prod, side_by_side, attention, attention_bwd, cudnn, flash) -> dict:
    """The backward (delta, dK/dV, dQ) with TMA loads of the walked tiles (path ``triton_tma``) and a few tilings, each
    compared byte for byte with production's dq, dk, dv, timed next to SDPA-cuDNN's and SDPA-flash's backward."""
    from dataclasses import replace

    s = q.shape[1]
    out, lse = attention.forward(q, k, v, prod)
    grad = torch.randn(1, s, 56 * 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    grad = grad.bfloat16()
    ref = attention.backward(q, k, v, out, lse, grad, prod)
    cands = {"production": (prod, None), "tma": (prod, "triton_tma")}  # name -> (tiling, path; None: declared)
    tilings = ((128, 64, 8, 2, 128, 64, 8, 2), (64, 64, 4, 3, 64, 64, 4, 3), (128, 32, 8, 3, 128, 128, 8, 2),
               (128, 64, 8, 4, 128, 64, 8, 4))  # fmt: skip
    for kv_n, kv_m, kw, ks, q_m, q_n, qw, qs in tilings:
        c = replace(prod, kv_n=kv_n, kv_m=kv_m, kv_warps=kw, kv_stages=ks, q_m=q_m, q_n=q_n, q_warps=qw, q_stages=qs)
        cands.setdefault(f"{c.tag}_tma", (c, "triton_tma"))
    rec: dict = {"cands": {}}
    fns = {}
    for name, (cfg, path) in cands.items():
        try:
            got = attention.backward(q, k, v, out, lse, grad, cfg, path=path)
            torch.cuda.synchronize()
            rec["cands"][name] = {"tag": cfg.tag, "bitwise_production": all(map(torch.equal, got, ref))}
            fns[name] = lambda cfg=cfg, path=path: attention.backward(q, k, v, out, lse, grad, cfg, path=path)
        except Exception as exc:  # noqa: BLE001 - recorded
            rec["cands"][name] = {"tag": cfg.tag, "error": err(exc)}
    for label, sdpa in (("sdpa_cudnn", cudnn), ("sdpa_flash", flash)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        y = sdpa(*leaves)
        g4 = grad.view(1, s, 56, 128).transpose(1, 2)
        fns[label] = lambda y=y, leaves=leaves, g4=g4: torch.autograd.grad(y, leaves, g4, retain_graph=True)
    stats = side_by_side(fns, iters=6 if s > 20000 else 30, head_start_us=300.0)
    rec["ms"] = {name: st["median_ms"] for name, st in stats.items()}
    return rec


def _order_costs(q, k, v, cfg, side_by_side, attention, attention_bwd) -> dict:
    """A permuted packing: forward and backward with the walk order (production: walked operands copied, own rows
    indexed) vs the session-10 form (every operand gathered, every output scattered)."""
    s = q.shape[1]
    order = torch.randperm(s, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    grad = torch.randn(1, s, 56 * 128, device="cuda").bfloat16()
    gat = lambda t: t.index_select(1, order)  # noqa: E731
    sca = lambda t: torch.empty_like(t).index_copy_(1, order, t)  # noqa: E731
    fwd_inplace, lse = attention.forward(q, k, v, cfg, order)
    fwd_copies, lse_c = attention.forward(gat(q), gat(k), gat(v), cfg)
    rec = {"forward_bitwise_copies": bool(torch.equal(fwd_inplace, sca(fwd_copies)) and torch.equal(lse, lse_c))}

    def bwd_inplace():
        return attention.backward(q, k, v, fwd_inplace, lse, grad, cfg, order)

    def bwd_copies():
        g = attention.backward(gat(q), gat(k), gat(v), gat(fwd_inplace), lse, gat(grad), cfg)
        return tuple(sca(t) for t in g)

    rec["backward_bitwise_copies"] = all(torch.equal(a, b) for a, b in zip(bwd_inplace(), bwd_copies(), strict=True))
    fns = {
        "fwd_packed": lambda: attention.forward(q, k, v, cfg),
        "fwd_order": lambda: attention.forward(q, k, v, cfg, order),
        "fwd_order_copies": lambda: sca(attention.forward(gat(q), gat(k), gat(v), cfg)[0]),
        "bwd_packed": lambda: attention.backward(q, k, v, fwd_inplace, lse, grad, cfg),
        "bwd_order": bwd_inplace,
        "bwd_order_copies": bwd_copies,
    }
    stats = side_by_side(fns, iters=6 if s > 20000 else 30, head_start_us=300.0)
    rec["ms"] = {name: st["median_ms"] for name, st in stats.items()}
    return rec


def main() -> None:
    """Run the requested sections, rewriting the JSON after each; ``--shapes`` restricts the GEMM sections."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "perf-probe.json"))
    ap.add_argument("--sections", default="norm,launch,gemm")
    ap.add_argument("--gemm-seconds", type=float, default=300)
    ap.add_argument("--round", type=int, default=1, help="GEMM candidates: 1 shapes, 2 orders, 4 tails, 5 swap")
    ap.add_argument("--ms", default="", help="GEMM rows for rounds 1/2 (default 264,3160,38974); attn: S")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="GEMM shapes to probe (qkv,o_proj,ffn_gate_up,ffn_down)")
    args = ap.parse_args()
    for name in set(SHAPES) - set(args.shapes.split(",")):
        del SHAPES[name]
    torch.backends.cuda.matmul.allow_tf32 = False
    body: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for sec in args.sections.split(","):
        t0 = time.time()
        try:
            if sec == "gemm" and args.round == 5:
                body[sec] = gemm_section(time.time() + args.gemm_seconds, ROUND5, m_list=tuple(ROUND5), graph=True)
            elif sec == "gemm" and args.round == 4:
                body[sec] = gemm_section(time.time() + args.gemm_seconds, ROUND4, m_list=(3072, 3160), graph=True)
            elif sec == "gemm":
                m_list = tuple(int(m) for m in args.ms.split(",")) if args.ms else MS
                cands = ROUND2 if args.round == 2 else CANDIDATES
                body[sec] = gemm_section(time.time() + args.gemm_seconds, cands, m_list=m_list, graph=True)
            elif sec == "attn":
                body[sec] = attn_section(tuple(int(m) for m in args.ms.split(",")) if args.ms else (264, 925, 3160))
            elif sec == "attn_tma":
                seqs = tuple(int(m) for m in args.ms.split(",")) if args.ms else (264, 925, 3160, 38974)
                body[sec] = attn_tma_section(seqs)
            elif sec == "cublas_kernels":
                body[sec] = cublas_kernels_section()
            elif sec == "hostcost":
                body[sec] = hostcost_section()
            elif sec == "norm":
                body[sec] = norm_section()
            elif sec == "profile":
                body[sec] = profile_section()
            elif sec == "skinny":
                body[sec] = skinny_section()
            elif sec == "launch":
                body[sec] = launch_section()
            elif sec == "launch_gemm":
                gemm_ops = ("timestep_mlp_fp32", "final_adaln_projection", "h3_qkv_gemm", "h3_ffn_down_gemm")
                body[sec] = launch_section(gemm_ops, rows=264)
        except Exception:  # noqa: BLE001
            body[sec] = {"error": traceback.format_exc()[-2000:]}
        body.setdefault("seconds", {})[sec] = time.time() - t0
        print(f"section {sec}: {time.time() - t0:.1f}s", flush=True)
        with open(args.out + ".tmp", "w") as fh:
            json.dump(body, fh, indent=1)
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
