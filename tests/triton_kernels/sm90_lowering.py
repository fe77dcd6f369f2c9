"""Compile the strict attention's kernels for Hopper (sm_90) on a machine without a GPU and report what their PTX
holds; run as a script with the interpreter off (``TRITON_INTERPRET=0``) by ``test_sm90_compile.py``."""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

from h3gate.kernels import attention, attention_bwd, attention_tma

_TYPES = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "ord_ptr": "*i64", "S": "i32", "H": "i32", "qk_scale": "fp32",
          "sm_scale": "fp32", "stride_b": "i32", "stride_s": "i32"}  # fmt: skip


def ptx_facts(kernel, consts: dict, warps: int, stages: int) -> dict:
    sig = {n: "constexpr" if n in consts else _TYPES.get(n, "*bf16") for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts)
    opts = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]
    return {w: ptx.count(w) for w in ("cp.async.bulk.tensor", "wgmma.mma_async", "ex2.approx.ftz.f32", "fma.rn.f32")}


def main() -> None:
    cfg = attention.attn_config(128, torch.bfloat16)
    fwd = {"D": 128, "EXP2": cfg.exp2_code, "FMA": cfg.fwd_fma, "INTERPRET": False, "BLOCK_M": 64, "BLOCK_N": 64}
    bwd = {"D": 128, "EXP2": cfg.bwd_exp2_code, "FMA": cfg.bwd_fma, "INTERPRET": False, "ORDERED": True}
    out = {}
    for ordered in (False, True):
        out[f"fwd_tma_ordered={ordered}"] = ptx_facts(
            attention_tma._attn_fwd_tma_kernel, {**fwd, "WS": False, "ORDERED": ordered}, 4, 3
        )
    for tma in (False, True):
        kv = {**bwd, "USE_TMA": tma, "BLOCK_N": cfg.kv_n, "BLOCK_M": cfg.kv_m}
        out[f"dkdv_tma={tma}"] = ptx_facts(attention_bwd._dkdv_kernel, kv, cfg.kv_warps, cfg.kv_stages)
        dq = {**bwd, "USE_TMA": tma, "BLOCK_M": cfg.q_m, "BLOCK_N": cfg.q_n}
        out[f"dq_tma={tma}"] = ptx_facts(attention_bwd._dq_kernel, dq, cfg.q_warps, cfg.q_stages)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
