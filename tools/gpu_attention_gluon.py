#!/usr/bin/env python3
"""H200 probe of the Gluon attention forward (``h3gate/kernels/attention_gluon.py``), from the repo root:

    python3 tools/gpu_attention_gluon.py --out $OUT/attention-gluon.json

* ``bytes``: the Gluon forward's output and lse2 against the Triton forward (``attention.forward`` on the path
  ``triton_pointer`` below S = 2048, ``triton_tma`` from there, as another GPU runs it; with the variant's KV walk
  width), byte for byte, for each number of K/V buffers and walk width, at several (B, S, walk order) cases: a
  batch of 2 with a partial last block (rows past S must be zeros, not the next item's), a random walk order (every
  tile copied) and a layout's walk order (most tiles read in place, ``gpu_probe_common.walk_order``).
* ``time``: forward medians (``triton.testing.do_bench``, the same inputs) at S = 264, 925, 3160 and 38974 (B = 1, 56
  heads): the Triton forward, every Gluon variant, SDPA pinned to cuDNN and to flash; at 3160 and 38974 every Gluon
  variant also walking a layout's order (``NAME@layout``: tile sources against whole canonical copies).

* ``sustained``: each arm back to back at the power cap (``h3gate.bench.energy.sustained``: 2 s spans after 1 s of
  warm-up, 2 rounds) at S = 3160 and 38974: ms and joules per call of cuDNN, the Triton forward and every variant.

(Session 12's first round also timed a single-partition Gluon kernel, ``perf-probe-16-round1.json``.)

A variant that fails to compile or run is recorded with its error, never fatal. Prints one line per result.
"""

from __future__ import annotations

import dataclasses
import json
import traceback

import torch
from gpu_probe_common import SMALL_CASES, best_over, bits_equal, error_text, probe_main, time_into, walk_order

from h3gate.kernels import attention
from h3gate.kernels.attention_config import PRODUCTION
from h3gate.kernels.attention_gluon import forward_gluon_ws

HEADS, D = 56, 128


def triton_path(s: int) -> str:
    """The Triton forward as a GPU without the Gluon kernels runs it at S = ``s``: pointer loads below 2048, TMA from
    there (the declared paths of ``cuda-other``, manifests/operators/attention.yaml)."""
    return "triton_tma" if s >= 2048 else "triton_pointer"


# name -> the warp-specialised kernel's K/V buffers, KV walk width (128 keys: kernel id v2's walk; 64: v1's, compared
# with the Triton forward of the same walk), launch (persistent: one program an SM walking tiles) and register split.
# (perf-probe-22 also ran session 14's kernel, `git show 659521a:h3gate/kernels/attention_gluon.py`, from an untracked
# copy under tools/: see the git history of evidence/h200/PROVENANCE.md, session 15.)
_V = {"stages": 2, "walk": 128, "persistent": False, "regs": (232, 40)}
VARIANTS = {
    "ws": _V,
    "ws_persistent": {**_V, "persistent": True},
    "ws_persistent_r240": {**_V, "persistent": True, "regs": (240, 24)},
    # production with a third K/V buffer: 32 KB of q + 3 x 2 x 32 KB of K/V tiles, the most that fits (227 KB)
    "ws_persistent_s3": {**_V, "persistent": True, "regs": (240, 24), "stages": 3},
    # production (tile sources: the packed q / k / v read in canonical order where tiles are consecutive packed rows)
    # and production with whole canonical copies first (sessions 12-15)
    "prod": {**_V, "persistent": True, "regs": (240, 24), "sources": True},
    "prod_copies": {**_V, "persistent": True, "regs": (240, 24), "sources": False},
    # production with the output stored through shared memory by TMA at every S / from registers at every S
    # (sessions 12-19); production switches at AttnLaunch.tma_store_from
    "prod_tma": {**_V, "persistent": True, "regs": (240, 24), "sources": True, "tma_store_from": 0},
    "prod_regstore": {**_V, "persistent": True, "regs": (240, 24), "sources": True, "tma_store_from": 1 << 62},
}
# 3100: the last tile's second half lies wholly past S (a box with no row to store)
CASES = [(1, 264, False), (2, 925, False), (1, 3160, False), (1, 3160, True), (2, 300, True), (1, 38974, False),
         (1, 3160, "layout"), (2, 3160, "layout"), (2, 925, "layout"), (1, 38974, "layout"),
         (2, 3100, False), (2, 3100, "layout")]  # fmt: skip
TIMED = (264, 925, 3160, 38974)
ORDERED_TIMED = (3160, 38974)  # also timed with the "layout" walk order


def _inputs(b: int, s: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))


def _gluon(q, k, v, name: str, order=None):
    var = VARIANTS[name]
    cfg = dataclasses.replace(attention.attn_config(D, torch.bfloat16), fwd_n=var["walk"])
    launch = dataclasses.replace(
        PRODUCTION, persistent=var["persistent"], regs=var["regs"], stages=var["stages"],
        tile_sources=var.get("sources", True), tma_store_from=var.get("tma_store_from", PRODUCTION.tma_store_from),
    )  # fmt: skip
    return forward_gluon_ws(q, k, v, cfg, order, launch)


def probe_bytes(records: list[dict], variants: list[str], cases: list[tuple]) -> None:
    for b, s, ordered in cases:
        q, k, v = _inputs(b, s, seed=s + 7 * b)
        order = walk_order(ordered, s)
        refs = {}
        for walk in sorted({VARIANTS[name]["walk"] for name in variants}):
            cfg = dataclasses.replace(attention.attn_config(D, torch.bfloat16, s), fwd_n=walk)
            refs[walk] = attention.forward(q, k, v, cfg, order, path=triton_path(s))
        for name in variants:
            ref_out, ref_lse = refs[VARIANTS[name]["walk"]]
            rec = {"section": "bytes", "variant": name, "B": b, "S": s, "ordered": ordered}
            try:
                out, lse = _gluon(q, k, v, name, order)
                torch.cuda.synchronize()
                diff = (out.float() - ref_out.float()).abs()
                rec.update(out_bitwise=bits_equal(out, ref_out), lse_bitwise=bits_equal(lse, ref_lse),
                           max_abs=float(diff.max()), rows_differing=int((diff.amax(-1) > 0).sum()),
                           finite=bool(torch.isfinite(out).all()))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
                rec["error"] = error_text(exc, 400)
                rec["traceback"] = traceback.format_exc()[-2000:]
            print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
            records.append(rec)


def probe_time(records: list[dict], variants: list[str]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def fn(q, k, v):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                )

        return fn

    def timed(q, k, v, cfg, s):
        return {
            "triton": lambda: attention.forward(q, k, v, cfg, path=triton_path(s)),
            **{name: (lambda name=name: _gluon(q, k, v, name)) for name in variants},
            "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v),
            "flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v),
        }

    for s in TIMED:
        q, k, v = _inputs(1, s, seed=11)
        flops = 4.0 * s * s * D * HEADS
        fns = timed(q, k, v, attention.attn_config(D, torch.bfloat16, s), s)
        rec = {"section": "time", "S": s}
        time_into(rec, fns, flops, warmup=200, rep=1000 if s < 10000 else 4000)
        rec["best_gluon_vs_cudnn"] = best_over(rec, variants, "cudnn")
        rec["best_gluon_vs_triton"] = best_over(rec, variants, "triton")
        if s in ORDERED_TIMED:  # the same inputs walked in a layout's order (the block's case)
            order = walk_order("layout", s)
            layout_fns = {
                f"{name}@layout": (lambda name=name, q=q, k=k, v=v, order=order: _gluon(q, k, v, name, order))
                for name in variants
            }
            time_into(rec, layout_fns, flops, warmup=200, rep=1000 if s < 10000 else 4000)
        print(json.dumps(rec), flush=True)
        records.append(rec)


def _sustained_at(s: int, variants: list[str]) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from h3gate.bench import energy

    q, k, v = _inputs(1, s, seed=11)
    cfg = attention.attn_config(D, torch.bfloat16, s)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                    v.transpose(1, 2))  # fmt: skip

    fns = {"cudnn": cudnn, "triton": lambda: attention.forward(q, k, v, cfg, path=triton_path(s))}
    fns.update({name: (lambda name=name: _gluon(q, k, v, name)) for name in variants})
    with torch.no_grad():
        return energy.sustained(fns, seconds=2.0, warm_s=1.0, rounds=2)


def probe_sustained(records: list[dict], variants: list[str]) -> None:
    for s in (3160, 38974):
        out = _sustained_at(s, variants)
        base = out["arms"]["cudnn"]
        rec = {"section": "sustained", "S": s, **out,
               "vs_cudnn_ms": {n: a["ms_per_call"] / base["ms_per_call"] for n, a in out["arms"].items()}}  # fmt: skip
        if "j_per_call" in base:
            rec["vs_cudnn_j"] = {n: a["j_per_call"] / base["j_per_call"] for n, a in out["arms"].items()}
        print(json.dumps({key: rec.get(key) for key in ("S", "vs_cudnn_ms", "vs_cudnn_j")}), flush=True)
        records.append(rec)
        torch.cuda.empty_cache()


def main() -> int:
    return probe_main(
        VARIANTS,
        {
            "bytes": lambda records, variants, small: probe_bytes(records, variants, SMALL_CASES if small else CASES),
            "time": lambda records, variants, small: probe_time(records, variants),
            "sustained": lambda records, variants, small: probe_sustained(records, variants),
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
