"""``--backward-only`` sections of ``tools/gpu_gemm_attention.py``: backward candidates only, next to torch.

``bwd_gemm``: dX = dY @ W and dW = dY^T @ X for the block's four shapes at M in {264, 3160, 38974}; per
candidate (the current table config first, then pointer and TMA-descriptor variants, persistent and not): median
time at every M next to cuBLAS (``torch.mm``, what autograd's linear backward calls), relative error vs an FP32
reference at M = 3160, repeat bitwise, and for dX row invariance (every M's rows equal the largest M's prefix; a row
alone at M = 1 and among unrelated rows at M = 7). ``bwd_attention``: the three backward kernels at S in {925,
3160, 38974} (56 heads, D = 128) next to cuDNN's / flash's backward (``torch.autograd.grad`` through SDPA), repeat
bitwise, error vs FP32 SDPA-math gradients at S <= 3160. One config per (role, N, K) and per (D, dtype) for every
M / S. The summary picks the config maximising the worst ratio to torch and prints paste-ready lines.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import torch
from gpu_gemm_attention import GEO, NAMES, PTR, SMOKE, Section, _gemm_call, bench, err, randn, rel, sdpa

SECTIONS_BWD = {"bwd_gemm": 95, "bwd_attention": 70}  # s; both together stay under 3 minutes
BWD_MS = [5, 37, 70] if SMOKE else [264, 3160, 38974]
BWD_SEQS = [17, 70] if SMOKE else [925, 3160, 38974]


def gemm_candidates(role: str, n: int, k: int) -> list:
    from h3gate.kernels.gemm_configs import GemmConfig, gemm_config

    current = gemm_config(role, n, k, torch.bfloat16)
    if SMOKE:
        return list(dict.fromkeys([current, GemmConfig(16, 32, 32), GemmConfig(32, 64, 64, persistent=True, tma=True)]))
    common = [
        GemmConfig(128, 256, 64, 8, 8, 3, tma=True),
        GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
        GemmConfig(128, 128, 64, 8, 8, 4, persistent=True, tma=True),
        GemmConfig(128, 128, 64, 8, 8, 4),
    ]
    if role == "dw":  # the reduction runs over the tokens; natural (BLOCK_K, BLOCK_M) dY tiles, then tl.trans
        common += [GemmConfig(128, 256, 64, 8, 8, 3, persistent=True), GemmConfig(128, 128, 64, 8, 8, 4, tma=True)]
    return list(dict.fromkeys([current, *common]))


def _launch(role: str, gy, w, x, cfg):
    from h3gate.kernels import gemm as G

    n, k = w.shape
    if role == "dx":
        out = torch.empty((gy.shape[0], k), dtype=gy.dtype, device=gy.device)
        return G.matmul(gy, w, out, None, cfg, a_trans=False, b_trans=False)
    out = torch.empty((n, k), dtype=gy.dtype, device=gy.device)
    return G.matmul(gy, x, out, None, cfg, a_trans=True, b_trans=False)


def probe_bwd(role: str, gy, w, x, cfg, ref, ref_m: int) -> dict:
    rec: dict = {"cfg": asdict(cfg), "by_m": {}}
    mmax = max(BWD_MS)
    full = _launch(role, gy, w, x, cfg)
    rec["repeat_bitwise"] = bool(torch.equal(full, _launch(role, gy, w, x, cfg)))
    prefix_ok = True
    for m in BWD_MS:
        got = _launch(role, gy[:m], w, x[:m], cfg)
        if role == "dx" and m != mmax:
            prefix_ok &= bool(torch.equal(got, full[:m]))
        if m == ref_m:
            rec["rel_err_vs_fp32"] = rel(got, ref)
        rec["by_m"][str(m)] = {"ms": bench(_launch, role, gy[:m], w, x[:m], cfg)}
    ok = rec["repeat_bitwise"] and rec["rel_err_vs_fp32"] < 2e-2
    if role == "dx":
        rows = [0, 1, mmax // 2, mmax - 1]
        others = randn((6, gy.shape[1]), gy.dtype, 99)
        m1 = all(torch.equal(_launch(role, gy[r : r + 1], w, x, cfg)[0], full[r]) for r in rows)
        m7 = all(
            torch.equal(_launch(role, torch.cat([others[:3], gy[r : r + 1], others[3:]]), w, x, cfg)[3], full[r])
            for r in rows
        )
        rec.update(rows_prefix_invariant=prefix_ok, rows_invariant_M1=m1, rows_invariant_M7=m7)
        ok = ok and prefix_ok and m1 and m7
    rec["ok"] = bool(ok)
    return rec


def section_bwd_gemm(sec: Section) -> None:
    dt = torch.bfloat16
    ref_m = BWD_MS[1]
    for k, n in GEO["shapes"]:
        key = f"bwd_{NAMES.get((k, n), f'{k}x{n}')}"
        entry = sec.data.setdefault(key, {"K": k, "N": n, "torch": {}, "dx": {}, "dw": {}})
        w = randn((n, k), dt, 2, k**-0.5)
        gy, x = randn((max(BWD_MS), n), dt, 4), randn((max(BWD_MS), k), dt, 1)
        for m in BWD_MS:
            entry["torch"][str(m)] = {"dx_ms": bench(torch.mm, gy[:m], w), "dw_ms": bench(torch.mm, gy[:m].t(), x[:m])}
        refs = {
            "dx": torch.mm(gy[:ref_m].float(), w.float()),
            "dw": torch.mm(gy[:ref_m].float().t(), x[:ref_m].float()),
        }
        for role in ("dx", "dw"):
            for cfg in gemm_candidates(role, n, k):
                if sec.late():
                    entry[role][cfg.tag] = {"error": "skipped: section time budget"}
                    continue
                try:
                    entry[role][cfg.tag] = probe_bwd(role, gy, w, x, cfg, refs[role], ref_m)
                except Exception as exc:  # a failing config is recorded, not fatal
                    entry[role][cfg.tag] = {"cfg": asdict(cfg), "error": err(exc)}
                sec.save()
        del w, gy, x, refs
        if not SMOKE:
            torch.cuda.empty_cache()


def attn_bwd_candidates() -> list:
    from h3gate.kernels.attention import AttnConfig, attn_config

    cur = attn_config(128, torch.bfloat16)
    if SMOKE:
        cur = AttnConfig(16, 16, 4, 2, 16, 32, 4, 1, 32, 16, 4, 1)
    fast = replace(cur, bwd_exp2="ex2ftz", bwd_fma=True)
    if SMOKE:
        return [cur, fast]
    return [
        cur,
        replace(cur, bwd_exp2="ex2ftz"),
        fast,
        replace(fast, kv_stages=3, q_stages=3),
        replace(fast, kv_m=32, kv_warps=4, kv_stages=3, q_n=32, q_warps=4, q_stages=3),
        replace(fast, kv_n=64, kv_warps=4, q_m=64, q_warps=4),
    ]


def section_bwd_attention(sec: Section) -> None:
    from torch.nn.attention import SDPBackend

    from h3gate.kernels import attention as A
    from h3gate.kernels.attention import backward

    heads = 2 if SMOKE else 56
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    cands = attn_bwd_candidates()
    for s in BWD_SEQS:
        if sec.late():
            sec.data[f"S{s}"] = {"error": "skipped: section time budget"}
            continue
        q, k, v = (randn((1, s, heads, 128), torch.bfloat16, 10 + i) for i in range(3))
        grad = randn((1, s, heads * 128), torch.bfloat16, 20)
        entry = sec.data.setdefault(f"S{s}", {"S": s, "heads": heads, "bwd": {}, "torch": {}})
        refs = None
        if s <= 3160:
            try:
                qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
                sdpa(qf, kf, vf, SDPBackend.MATH).transpose(1, 2).flatten(2).backward(grad.float())
                refs = {"dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
                del qf, kf, vf
            except Exception as exc:
                entry["reference"] = f"failed: {err(exc)}"
        for name, bk in backends.items():
            try:
                qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
                o = sdpa(qs, ks, vs, bk)
                g4 = grad.view(1, s, heads, 128).transpose(1, 2)
                entry["torch"][name] = {"bwd_ms": bench(torch.autograd.grad, o, (qs, ks, vs), g4, retain_graph=True)}
                del o, qs, ks, vs
            except Exception as exc:
                entry["torch"][name] = {"error": err(exc)}
            sec.save()
        fwd_cfg = cands[0]  # the backward reads the forward's out/lse2: one forward for every candidate
        out, lse = A.forward(q, k, v, fwd_cfg, path=PTR)
        for cfg in cands:
            if sec.late():
                entry["bwd"][cfg.tag] = {"error": "skipped: section time budget"}
                continue
            try:
                first = backward(q, k, v, out, lse, grad, cfg, path=PTR)
                rec = {"cfg": asdict(cfg), "ms": bench(backward, q, k, v, out, lse, grad, cfg, path=PTR)}
                again = backward(q, k, v, out, lse, grad, cfg, path=PTR)
                rec["repeat_bitwise"] = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
                if refs is not None:
                    rec["rel_err_vs_fp32"] = {n_: rel(g_, refs[n_]) for n_, g_ in zip(refs, first, strict=True)}
                entry["bwd"][cfg.tag] = rec
                del first, again
            except Exception as exc:
                entry["bwd"][cfg.tag] = {"cfg": asdict(cfg), "error": err(exc)}
            sec.save()
        del q, k, v, grad, out, lse, refs
        if not SMOKE:
            torch.cuda.empty_cache()


def summarize_bwd(merged: dict) -> dict:
    """Per (role, N, K): the checked config maximising min over M of torch ms / ours ms; attention likewise."""
    summary: dict = {"gemm": {}, "attention": {}}
    lines = []
    print("\nGEMM backward (one config for every M; ratio = cuBLAS ms / ours ms)")
    for key, e in merged.get("bwd_gemm", {}).items():
        if not isinstance(e, dict) or "torch" not in e:
            continue
        for role in ("dx", "dw"):
            scored = {}
            for tag, rec in e[role].items():
                if rec.get("ok") and all(m in rec["by_m"] for m in e["torch"]):
                    scored[tag] = min(e["torch"][m][f"{role}_ms"] / rec["by_m"][m]["ms"] for m in e["torch"])
            best = max(scored, key=scored.get) if scored else None
            cur = next(iter(e[role]), None)  # the current table config is probed first
            row = {"best": best, "worst_ratio": scored.get(best), "current": cur, "current_ratio": scored.get(cur)}
            summary["gemm"][f"{key}_{role}"] = row
            if best is None:
                print(f"  {key:20s} {role} no config passed every check: {list(e[role])}")
                continue
            ratios = " ".join(
                f"M{m}:{e['torch'][m][f'{role}_ms']:.3f}/{e[role][best]['by_m'][m]['ms']:.3f}" for m in e["torch"]
            )
            print(f"  {key:20s} {role} {best:36s} worst {scored[best]:.2f} (current {cur}: {scored.get(cur)}) {ratios}")
            lines.append(f'    ("{role}", {e["N"]}, {e["K"]}, _BF16): {_gemm_call(e[role][best]["cfg"])},')
    print("\nPaste into kernels/gemm_configs.py TABLE (backward rows):")
    print("\n".join(lines) if lines else "    (none)")
    att = {k: v for k, v in merged.get("bwd_attention", {}).items() if isinstance(v, dict) and "bwd" in v}
    # cuDNN is the provider's backend; flash stands in only where cuDNN did not run (the CPU --smoke).
    ref = "cudnn" if any("bwd_ms" in e["torch"].get("cudnn", {}) for e in att.values()) else "flash"
    print(f"\nAttention backward (ms; ratio = {ref} bwd / ours)")
    scores = {}
    for tag in {t for e in att.values() for t in e["bwd"]}:
        recs = [e["bwd"].get(tag, {}) for e in att.values()]
        ok = all("ms" in r and r["repeat_bitwise"] for r in recs) and all(
            max(r.get("rel_err_vs_fp32", {"x": 0.0}).values()) < 2e-2 for r in recs
        )
        ratios = [e["torch"][ref]["bwd_ms"] / e["bwd"][tag]["ms"] for e in att.values() if "bwd_ms" in
                  e["torch"].get(ref, {}) and "ms" in e["bwd"].get(tag, {})]  # fmt: skip
        if ok and ratios:
            scores[tag] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    best = max(scores, key=scores.get) if scores else None
    summary["attention"] = {"best_bwd": best, "ratio_to": ref, "geomean_ratio": scores.get(best), "scores": scores}
    for key, e in att.items():
        tor = " ".join(f"{n} {r['bwd_ms']:.3f}" for n, r in e["torch"].items() if "bwd_ms" in r)
        print(f"  {key}: torch {tor}")
        for t, r in e["bwd"].items():
            flags = "" if r.get("repeat_bitwise") else "  NOT repeat-bitwise"
            print(f"    {t:64s} {r['ms']:.3f}{flags}" if "ms" in r else f"    {t:64s} {r.get('error')}")
    if best:
        cfg = next(e["bwd"][best]["cfg"] for e in att.values() if "cfg" in e["bwd"].get(best, {}))
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.items() if not k.startswith("fwd"))
        print(f"  best attention backward: {best} (geomean {ref}/ours {scores[best]:.2f})")
        print("Paste into kernels/attention.py ATTN_TABLE (keep the entry's fwd_* fields; replace these):")
        print(f'    (128, "bfloat16"): AttnConfig(<fwd fields>, {args}),')
    summary["paste"] = lines
    return summary


def run_section(name: str, sec: Section) -> None:
    {"bwd_gemm": section_bwd_gemm, "bwd_attention": section_bwd_attention}[name](sec)
