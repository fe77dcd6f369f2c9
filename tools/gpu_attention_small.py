#!/usr/bin/env python3
"""H200 probe of the pointer attention forward's launch below S = 2048 with the 128-key walk (kernel id v2): forward
medians (do_bench) and bytes against the production launch, for query-block heights / warps / stages, at S = 264 and
925 (B = 1, 56 heads), next to SDPA cuDNN. Usage: python3 tools/gpu_attention_small.py --out FILE"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton

from h3gate.kernels import attention

LAUNCHES = [(64, 8, 3), (64, 4, 3), (64, 4, 2), (128, 8, 3), (128, 8, 2), (32, 4, 3), (64, 8, 2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    from torch.nn.attention import SDPBackend, sdpa_kernel

    records = []
    for s in (264, 925):
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(1, s, 56, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        prod = attention.attn_config(128, torch.bfloat16, s)
        ref, ref_lse = attention.forward(q, k, v, prod)
        rec = {"S": s, "production": prod.tag, "ms": {}, "bitwise": {}}
        for m, w, st in LAUNCHES:
            cfg = dataclasses.replace(prod, fwd_m=m, fwd_warps=w, fwd_stages=st)
            key = f"m{m}w{w}s{st}"
            try:
                o, lse = attention.forward(q, k, v, cfg)
                rec["bitwise"][key] = bool(torch.equal(o, ref) and torch.equal(lse, ref_lse))
                fn = lambda c=cfg, t=(q, k, v): attention.forward(*t, c)  # noqa: E731
                rec["ms"][key] = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")
            except Exception as exc:  # noqa: BLE001
                rec["ms"][key] = f"{type(exc).__name__}: {str(exc)[:200]}"
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def cudnn(t=(qt, kt, vt)):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(*t)

        rec["ms"]["cudnn"] = triton.testing.do_bench(cudnn, warmup=100, rep=500, return_mode="median")
        print(json.dumps(rec), flush=True)
        records.append(rec)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"meta": {"torch": torch.__version__, "triton": triton.__version__}, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
