#!/usr/bin/env python3
"""H200 probe of the attention backward's variants (the warp-specialised Gluon ``attention_bwd_gluon``), from the
repo root:

    python3 tools/gpu_attention_bwd.py --out $OUT/attention-bwd.json

* ``bytes``: dq, dk and dv of every variant (the Gluon kernels, path ``gluon_warp_specialised``) against the
  three Triton kernels of the same tiling (``triton_pointer`` / ``triton_tma``), byte for byte, at (B, S, walk
  order) cases with partial last blocks, a batch of 2 and a permuted walk; each variant run twice must repeat
  bitwise.
* ``time``: backward-only medians (``triton.testing.do_bench``, the same forward's out / lse2 / gradient) at S = 264,
  925, 3160 and 38974 (B = 1, 56 heads): the three Triton kernels, every variant, and SDPA's backward
  pinned to cuDNN and to flash (``torch.autograd.grad`` of its forward, graph retained); at 3160 and 38974 every
  variant also walking a layout's order (``NAME@layout``).

A variant that fails to compile or run is recorded with its error, never fatal. Prints one line per result.
"""

from __future__ import annotations

import dataclasses
import json
import traceback

import torch
from gpu_probe_common import SMALL_CASES, best_over, bits_equal, error_text, probe_main, time_into, walk_order

from h3gate.kernels import attention
from h3gate.kernels.attention import backward
from h3gate.kernels.attention_config import PRODUCTION

HEADS, D = 56, 128
# name -> the backward path, AttnConfig overrides on top of the production tiling at that S, and AttnLaunch fields
# (perf-probe-18 / -18b / -21 measured the dK/dV kernel's EARLY_DV, COMPACT, REGS and DKDV_SPLIT, since removed).
VARIANTS = {
    "gluon": {"path": "gluon_warp_specialised"},
    "gluon_s3": {"path": "gluon_warp_specialised", "kv_stages": 3, "q_stages": 3},
    "gluon_streams": {"path": "gluon_warp_specialised", "side_stream": True},
    "gluon_one_stream": {"path": "gluon_warp_specialised", "side_stream": False},
    # the walked operands in canonical order as whole copies first (sessions 13-15), not through tile sources
    "gluon_copies": {"path": "gluon_warp_specialised", "sources": False},
}
# variant key -> the AttnLaunch field it sets
_LAUNCH_FIELDS = {"side_stream": "side_stream", "sources": "tile_sources"}


def _variant(args: tuple, cfg, name: str, order=None):
    """A call of the backward with variant ``name``'s path, tiling and launch."""
    over = dict(VARIANTS[name])
    path = over.pop("path")
    launch = dataclasses.replace(PRODUCTION, **{_LAUNCH_FIELDS[key]: over.pop(key) for key in list(over)
                                                if key in _LAUNCH_FIELDS})  # fmt: skip
    vcfg = dataclasses.replace(cfg, **over)
    return lambda: backward(*args, vcfg, order, launch, path)


CASES = [(1, 264, False), (2, 925, False), (1, 3160, False), (1, 3160, True), (2, 300, True), (1, 38974, False),
         (1, 3160, "layout"), (2, 3160, "layout"), (1, 38974, "layout")]  # fmt: skip
TIMED = (264, 925, 3160, 38974)
ORDERED_TIMED = (3160, 38974)  # also timed with the "layout" walk order


def _inputs(b: int, s: int, seed: int, ordered: bool):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    grad = torch.randn(b, s, HEADS * D, device="cuda", dtype=torch.bfloat16, generator=g)
    order = torch.randperm(s, device="cuda", generator=g) if ordered is True else walk_order(ordered, s)
    cfg = attention.attn_config(D, torch.bfloat16, s)
    out, lse = attention.forward(q, k, v, cfg, order)
    return (q, k, v, out, lse, grad), order, cfg


def triton_path(s: int) -> str:
    """The three Triton kernels as a GPU without the Gluon kernels runs them at S = ``s``: pointer loads below 2048,
    TMA from there (the declared paths of ``cuda-other``, manifests/operators/attention.yaml)."""
    return "triton_tma" if s >= 2048 else "triton_pointer"


def probe_bytes(records: list[dict], variants: list[str], cases: list[tuple]) -> None:
    for b, s, ordered in cases:
        args, order, cfg = _inputs(b, s, seed=s + 7 * b, ordered=ordered)
        ref = backward(*args, cfg, order, path=triton_path(s))
        for name in variants:
            rec = {"section": "bytes", "variant": name, "B": b, "S": s, "ordered": ordered}
            try:
                call = _variant(args, cfg, name, order)
                got, again = call(), call()
                torch.cuda.synchronize()
                for label, g, a, r in zip(("dq", "dk", "dv"), got, again, ref, strict=True):
                    diff = (g.float() - r.float()).abs()
                    rec[label] = {"bitwise": bits_equal(g, r), "repeat_bitwise": bits_equal(g, a),
                                  "max_abs": float(diff.max()), "rows_differing": int((diff.amax(-1) > 0).sum()),
                                  "finite": bool(torch.isfinite(g).all())}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
                rec["error"] = error_text(exc, 400)
                rec["traceback"] = traceback.format_exc()[-2000:]
            print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
            records.append(rec)


def _sdpa_backward(q, k, v, grad, backend):
    from torch.nn.attention import sdpa_kernel

    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([backend]):
        y = torch.nn.functional.scaled_dot_product_attention(*leaves)
    g4 = grad.view(q.shape).transpose(1, 2)
    return lambda: torch.autograd.grad(y, leaves, g4, retain_graph=True)


def probe_time(records: list[dict], variants: list[str]) -> None:
    from torch.nn.attention import SDPBackend

    for s in TIMED:
        args, _, cfg = _inputs(1, s, seed=11, ordered=False)
        flops = 10.0 * s * s * D * HEADS  # five matmuls of 2 S^2 D flops per head (what cuDNN counts)
        fns = {"three_kernel": lambda a=args, c=cfg, s=s: backward(*a, c, path=triton_path(s))}
        for name in variants:
            fns[name] = _variant(args, cfg, name)
        rec = {"section": "time", "S": s}
        for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                fns[label] = _sdpa_backward(*args[:3], args[5], backend)
            except Exception as exc:  # noqa: BLE001
                rec.setdefault("errors", {})[label] = error_text(exc)
        time_into(rec, fns, flops, warmup=100, rep=600 if s < 10000 else 5000)
        rec["best_variant_vs_cudnn"] = best_over(rec, variants, "cudnn")
        rec["best_variant_vs_three_kernel"] = best_over(rec, variants, "three_kernel")
        if s in ORDERED_TIMED:  # the same tensors walked in a layout's order (the block's case)
            largs, order, lcfg = _inputs(1, s, seed=11, ordered="layout")
            layout_fns = {f"{name}@layout": _variant(largs, lcfg, name, order) for name in variants}
            time_into(rec, layout_fns, flops, warmup=100, rep=600 if s < 10000 else 5000)
        print(json.dumps(rec), flush=True)
        records.append(rec)


def _split_fns(s: int) -> dict:
    """The Gluon backward's kernels alone at S = ``s`` (B = 1): dK/dV, dQ, and the whole backward (delta pre-pass
    included)."""
    import math

    from h3gate.kernels import attention_bwd_gluon as gb

    (q, k, v, out, lse, grad), _, cfg = _inputs(1, s, seed=11, ordered=False)
    do = grad.view(q.shape)
    delta = (out.float() * grad.float()).view(1, s, HEADS, D).sum(-1).transpose(1, 2).reshape(HEADS, s).contiguous()
    sm, c = 1.0 / math.sqrt(D), attention.qk_scale(D)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def dq_call():
        gb.dq_gluon(q, k, v, do, lse, delta, dq, None, cfg, sm, c)

    def dkdv_call():
        gb.dkdv_gluon(q, k, v, do, lse, delta, dk, dv, None, cfg, sm, c)

    return {
        "dkdv": dkdv_call,
        "dq": dq_call,
        "whole": lambda: backward(q, k, v, out, lse, grad, cfg, path="gluon_warp_specialised"),
    }


def probe_split(records: list[dict], variants: list[str]) -> None:
    """Where the Gluon backward's time goes, at S = 3160 and 38974 (``_split_fns``)."""
    for s in (3160, 38974):
        rec = {"section": "split", "S": s}
        time_into(rec, _split_fns(s), 10.0 * s * s * D * HEADS, warmup=100, rep=600 if s < 10000 else 5000)
        print(json.dumps(rec), flush=True)
        records.append(rec)


def main() -> int:
    return probe_main(
        VARIANTS,
        {
            "bytes": lambda records, variants, small: probe_bytes(records, variants, SMALL_CASES if small else CASES),
            "time": lambda records, variants, small: probe_time(records, variants),
            "split": lambda records, variants, small: probe_split(records, variants),
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
