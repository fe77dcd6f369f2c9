"""Compile the strict attention's kernels for Hopper (sm_90) on a machine without a GPU and report what their PTX
holds; run as a script with the interpreter off (``TRITON_INTERPRET=0``) by ``test_sm90_compile.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

from h3gate.kernels import (
    attention,
    attention_bwd,
    attention_bwd_gluon,
    attention_config,
    attention_gluon,
    attention_tma,
    fingerprint,
    gemm_configs,
    gemm_gluon,
    gemm_gluon_plan,
    gemm_gluon_rows_dw,
    gemm_gluon_seg8,
    row_error,
)

FACTS = ("cp.async.bulk.tensor", "wgmma.mma_async", "ex2.approx.ftz.f32", "fma.rn.f32", "setmaxnreg",
         "cp.async.bulk.tensor.3d.global.shared")  # fmt: skip

_TYPES = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "ord_ptr": "*i64",
          "S": "i32", "H": "i32", "n_tiles": "i32", "m_tiles": "i32", "qk_scale": "fp32",
          "sm_scale": "fp32", "stride_b": "i32", "stride_s": "i32",
          **dict.fromkeys(("M", "N", "stride_cm", "num_tiles", "num_pid_a", "num_pid_b", "n_split", "num_narrow",
                           "num_pid_n", "per_group", "k_tiles", "cps"), "i32"), "scratch_ptr": "*fp32"}  # fmt: skip


def ptx_facts(kernel, consts: dict, warps: int, stages: int, ptxas: bool = False) -> dict:
    sig = {n: "constexpr" if n in consts else _TYPES.get(n, "*bf16") for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts)
    opts = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]
    return {**{w: ptx.count(w) for w in FACTS}, **(ptxas_report(ptx) if ptxas else {})}


def ptxas_report(ptx: str) -> dict:
    """ptxas -v on ``ptx`` for sm_90a: spilled bytes and whether it serialised the wgmma (warnings C7510-C7520)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas Triton itself compiles sm_90 with (3.9 ships two)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx, encoding="utf-8")
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True)  # fmt: skip
    log = done.stdout + done.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return {"spill_bytes": sum(spills), "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log}


def _gluon_ptx(kernel, args: dict, consts: dict, maxnreg: int, patterns: dict | None = None,
               aligned: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """A Gluon kernel compiled for sm_90 (host descriptors over CPU tensors of the right shape): PTX facts, ptxas;
    ``patterns``: more counts, of regular expressions, by name; ``aligned``: arguments specialised as multiples of 16
    (pointers: 16-byte aligned), as a launch specialises them."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {
        n: "constexpr" if n in consts else (mangle_type(args[n]) if n in args else _TYPES.get(n, "*bf16"))
        for n in kernel.arg_names
    }
    opts = {"num_warps": 4, "num_stages": 1, "maxnreg": maxnreg, "enable_fp_fusion": False}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 64), options=opts)  # fmt: skip
    ptx = compiled.asm["ptx"]
    more = {name: len(re.findall(pattern, ptx)) for name, pattern in (patterns or {}).items()}
    return {**{w: ptx.count(w) for w in FACTS}, **more, **ptxas_report(ptx), "shared": compiled.metadata.shared}


def _sources(args: dict, consts: dict, copies: dict, mapped: bool) -> None:
    """A walk through tile sources (``mapped``: a tile map and the copies' descriptors) or none (None constants)."""
    if mapped:
        args.update(tile_map=torch.empty(1, dtype=torch.int32), **copies)
    else:
        consts.update(tile_map=None, **dict.fromkeys(copies))


def gluon_facts(ordered: bool, mapped: bool = False, tma_store: bool | None = None) -> dict:
    """The warp-specialised Gluon forward (``mapped``: walking its tile sources; ``tma_store`` None: production's at
    the medium and 768p layouts' S, the output by TMA)."""
    tma_store = attention_config.PRODUCTION.tma_store_from <= 3160 if tma_store is None else tma_store
    cfg = attention.attn_config(128, torch.bfloat16)
    q = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    descs = dict(zip(("q_desc", "k_desc", "v_desc"), attention_gluon.descriptors(q, q, q, 128, cfg.fwd_n), strict=True))
    args = {**descs, "o_ptr": q, "lse_ptr": torch.empty(1), "ord_ptr": torch.empty(1, dtype=torch.int64),
            "o_desc": attention_gluon.row_descriptor(q, 64, 128)}  # fmt: skip
    consts = {"D": 128, "BLOCK_M": 64, "BLOCK_N": cfg.fwd_n, "STAGES": 2, "EXP2": cfg.exp2_code, "FMA": cfg.fwd_fma,
              "ORDERED": ordered, "TMA_STORE": tma_store, "REGS_C": attention_config.PRODUCTION.regs[0],
              "REGS_P": attention_config.PRODUCTION.regs[1]}  # fmt: skip
    _sources(args, consts, {"q_copy": descs["q_desc"], "k_copy": descs["k_desc"], "v_copy": descs["v_desc"]}, mapped)
    return _gluon_ptx(attention_gluon._attn_fwd_ws_kernel, args, consts, attention_gluon.WS_MAXNREG)


def gluon_bwd_facts(dq: bool, ordered: bool, mapped: bool = False) -> dict:
    """The warp-specialised Gluon backward: the dK/dV walk (lse2 / delta by the producer's TMA) or the pipelined dQ
    walk; ``mapped``: walking tile sources."""
    cfg = attention.attn_config(128, torch.bfloat16)
    t = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    a_desc, b_desc, _ = attention_gluon.descriptors(t, t, t, 64, 64)
    la_desc, lb_desc = attention_bwd_gluon.stats_descriptors(torch.empty(2, 300), torch.empty(2, 300), 64)
    args = {"a_desc": a_desc, "b_desc": b_desc, "la_desc": la_desc, "lb_desc": lb_desc,
            "ord_ptr": torch.empty(1, dtype=torch.int64)}  # fmt: skip
    consts = {"D": 128, "STEP": 64, "STAGES": cfg.kv_stages, "EXP2": cfg.bwd_exp2_code, "FMA": cfg.bwd_fma,
              "ORDERED": ordered, "DQ": dq}  # fmt: skip
    _sources(args, consts, {"a_copy": a_desc, "b_copy": b_desc}, mapped)
    return _gluon_ptx(attention_bwd_gluon._bwd_ws_kernel, args, consts, attention_bwd_gluon.WS_MAXNREG)


def gemm_gluon_facts(cfg, bias: bool, groups: int = 1, one_chunk: bool = False) -> dict:
    """The warp-specialised Gluon GEMM forward with tiling ``cfg`` (a production ``GLUON_BUCKETS`` entry); ``groups``
    > 1: the grouped launch of that many weights (``matmul_ws_grouped``); ``one_chunk``: K within one chunk."""
    x, w = torch.empty(300, 256, dtype=torch.bfloat16), torch.empty(512, 256, dtype=torch.bfloat16)
    y = torch.empty(300, 512, dtype=torch.bfloat16)
    split = bool(cfg.tail_block_n) and groups == 1
    descs = gemm_gluon.descriptors(x, w, y, cfg, split)
    if groups > 1:
        descs.update(b1_desc=descs["b_desc"], b2_desc=descs["b_desc"], c1_desc=descs["c_desc"],
                     c2_desc=descs["c_desc"])  # fmt: skip
    args = {"c_ptr": y, "bias_ptr": y, **{n: d for n, d in descs.items() if d is not None}}
    consts = {n: None for n, d in descs.items() if d is None}
    consts.update(gemm_gluon.launch_constants(cfg, split, bias, groups), **({"k_tiles": 1} if one_chunk else {}))
    return _gluon_ptx(gemm_gluon._gemm_ws_kernel, args, consts, consts.pop("maxnreg"))


# Instructions the strict kernels must not emit (FMA contraction, atomics), the tree's FP32 adds and slot traffic, and
# the wgmma reading both operands, or B alone, MN-major from shared memory (its last two immediates: trans-a, trans-b).
SEG8_PATTERNS = {"fma": r"\bfma\.", "atomics": r"\b(?:atom|red)\.", "add.rn.f32": r"\badd\.rn\.f32\b",
                 "ld.global": r"\bld\.global\.", "st.global": r"\bst\.global\.", "libdevice": r"__nv_",
                 "ld.shared.v2": r"\bld\.shared\.v2\.", "st.shared.v2": r"\bst\.shared\.v2\.",
                 "wgmma.mn_major": r"\bwgmma\.mma_async\.[^;]*,\s*1,\s*1;",
                 "wgmma.b_mn_major": r"\bwgmma\.mma_async\.[^;]*,\s*0,\s*1;"}  # fmt: skip


# A launch specialises every integer argument equal to 1 as a constant: one tile of one chunk, one segment a chunk.
ONE_CHUNK = {"num_tiles": 1, "num_pid_a": 1, "num_pid_b": 1, "k_tiles": 1, "cps": 1}


def gemm_seg8_facts(cfg, bias: bool, dx: bool = False, one_chunk: bool = False, one_mma: bool = False) -> dict:
    """The warp-specialised segmented-8 Gluon forward (``gemm_gluon_seg8``) with tiling ``cfg`` (``dx``: its dX,
    dY (M, N) W (N, K), into the FP32 sum the column-parallel layers round after), its output, bias and scratch
    16-byte aligned, N and the output's row stride multiples of 16 (as the block's layers launch it); ``one_chunk``:
    specialised as a launch of one tile of one chunk is (:data:`ONE_CHUNK`); ``one_mma``: B as one MMA of all
    ``cfg.block_n`` columns with the tree on chip, also at 256 (which production runs as two halves with the slots
    in global scratch)."""
    x, w = torch.empty(300, 256, dtype=torch.bfloat16), torch.empty(*((256, 512) if dx else (512, 256)))
    y = torch.empty(300, 512, dtype=torch.float32 if dx else torch.bfloat16)
    descs = gemm_gluon_seg8.seg8_descriptors(x, w.bfloat16(), y, cfg, dx)
    consts = gemm_gluon_seg8.seg8_constants(cfg, bias, dx)
    if one_mma:
        descs.update(b_desc=gemm_gluon_plan.desc(w.bfloat16(), [cfg.block_n, cfg.block_k]), bt_desc=None, c_desc=None)
        consts.update(BLOCK_B=cfg.block_n, B_TAIL=0)
    args = {"bias_ptr": y, "c_ptr": y, **{n: d for n, d in descs.items() if d is not None}}
    consts.update({n: None for n, d in descs.items() if d is None}, **(ONE_CHUNK if one_chunk else {}))
    return _gluon_ptx(gemm_gluon_seg8._seg8_ws_kernel, args, consts, consts.pop("maxnreg"), SEG8_PATTERNS,
                      ("bias_ptr", "scratch_ptr", "c_ptr", "N", "stride_cm"))  # fmt: skip


def gemm_rows_dw_facts(seq_len: int = 300) -> dict:
    """The warp-specialised row-segment weight gradient (``gemm_gluon_rows_dw``, production tiling) over ``seq_len``
    rows, its output and scratch 16-byte aligned, the output's width and row stride multiples of 16 (the block's)."""
    g, x = torch.empty(seq_len, 512, dtype=torch.bfloat16), torch.empty(seq_len, 256, dtype=torch.bfloat16)
    out = torch.empty(512, 256, dtype=torch.bfloat16)
    args = gemm_gluon_rows_dw.launch_args(g, x, out, gemm_gluon_rows_dw.ROWS_DW_GLUON, 132)
    consts = {n: args.pop(n) for n in ("BLOCK_K", "GROUP", "STAGES", "REGS_C", "REGS_P", "maxnreg", "grid")}
    maxnreg = consts.pop("maxnreg")
    del consts["grid"]
    return _gluon_ptx(gemm_gluon_rows_dw._rows_dw_ws_kernel, args, consts, maxnreg, SEG8_PATTERNS,
                      ("scratch_ptr", "c_ptr", "N", "stride_cm"))  # fmt: skip


def register_wall_facts() -> dict:
    """The seg8 forward's on-chip tree (level 1 in registers, level 2 in shared memory) with one MMA of all the
    tile's columns: at 128 (production, a ring of 4) and at 256, the single walk's tile, whose accumulator and
    level-1 subtree need 2 x 128 FP32 registers a consumer thread, over the 255 a thread may have (a ring of 2, to fit
    the shared memory). With the consumers' register limit."""
    out = {}
    for block_n, stages in ((128, 4), (256, 2)):
        cfg = replace(gemm_gluon_seg8.SEG8_GLUON, block_n=block_n, num_stages=stages)
        out[str(block_n)] = {**gemm_seg8_facts(cfg, bias=True, one_mma=True), "regs_c": gemm_gluon_plan.REGS[0]}
    return out


def one_chunk_facts() -> dict:
    """The Gluon GEMMs specialised as a launch of one chunk is (K <= BLOCK_K): every one must compile."""
    single = gemm_configs.GLUON_BUCKETS[0][1]
    return {
        "gemm_gluon": gemm_gluon_facts(next(iter(single.values())), bias=True, one_chunk=True),
        "gemm_gluon_seg8": gemm_seg8_facts(gemm_gluon_seg8.SEG8_GLUON, bias=True, one_chunk=True),
        "gemm_gluon_seg8_dx": gemm_seg8_facts(gemm_gluon_seg8.SEG8_GLUON, bias=False, dx=True, one_chunk=True),
    }


def fingerprint_facts() -> dict:
    """The fingerprint kernels (``kernels/fingerprint.py``: per row, and whole) for each bit width they read: their
    integer widening and multiply-adds, and no floating-point instruction."""
    from triton.compiler import ASTSource

    out = {}
    for bits in ("i16", "i32", "i64", "u8"):
        sig = {"m_ptr": f"*{bits}", "w_ptr": "*i64", "out_ptr": "*i64", "rows": "i32", "cols": "i32",
               "stride_r": "i32", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}  # fmt: skip
        consts = {"BLOCK_R": fingerprint.BLOCK_R, "BLOCK_C": fingerprint.BLOCK_C}
        rows = ASTSource(fn=fingerprint._row_sums_kernel, signature=sig, constexprs=consts)
        sig = {"f_ptr": f"*{bits}", "w_ptr": "*i64", "v_ptr": "*i64", "out_ptr": "*i64", "n": "i64",
               **dict.fromkeys(("WIDTH", "BLOCK", "STEPS"), "constexpr")}  # fmt: skip
        consts = {
            "WIDTH": fingerprint.WIDTH,
            "BLOCK": fingerprint.BLOCK,
            "STEPS": fingerprint.CHUNK // fingerprint.BLOCK,
        }
        whole = ASTSource(fn=fingerprint._whole_sum_kernel, signature=sig, constexprs=consts)
        for name, src in (("rows", rows), ("whole", whole)):
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
            out[f"{name}-{bits}"] = {"cvt.s64.s16": ptx.count("cvt.s64.s16"), "mad.lo.s64": ptx.count("mad.lo.s64"),
                                     "mul.lo.s64": ptx.count("mul.lo.s64"),
                                     "float": len(re.findall(r"\.f(?:16|32|64)\b", ptx))}  # fmt: skip
    return out


def row_error_facts() -> dict:
    """The row-error kernel (``kernels/row_error.py``) for each candidate dtype against a float64 golden: its
    float64 multiply-adds and ptxas's spilled bytes."""
    from triton.compiler import ASTSource

    out = {}
    for cand in ("bf16", "f32", "f64"):
        sig = {"c_ptr": f"*{cand.replace('f32', 'fp32').replace('f64', 'fp64')}", "g_ptr": "*fp64",
               "num_ptr": "*fp64", "den_ptr": "*fp64", "bad_ptr": "*i32", "rows": "i32", "cols": "i32",
               "stride_c": "i32", "stride_g": "i32",
               **dict.fromkeys(("BLOCK_R", "BLOCK_C", "INTERPRET"), "constexpr")}  # fmt: skip
        consts = {"BLOCK_R": row_error.BLOCK_R, "BLOCK_C": row_error.BLOCK_C, "INTERPRET": False}
        src = ASTSource(fn=row_error._row_error_kernel, signature=sig, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
        found = len(re.findall(r"\b(?:fma\.rn|mul\.rn|mul)\.f64\b", ptx))
        out[f"{cand}-f64"] = {"f64 fma/mul": found, **ptxas_report(ptx)}
    return out


def main() -> None:
    if sys.argv[1:] == ["--one-chunk"]:
        json.dump(one_chunk_facts(), sys.stdout)
        return
    if sys.argv[1:] == ["--fingerprint"]:
        json.dump(fingerprint_facts(), sys.stdout)
        return
    if sys.argv[1:] == ["--register-wall"]:
        json.dump(register_wall_facts(), sys.stdout)
        return
    if sys.argv[1:] == ["--row-error"]:
        json.dump(row_error_facts(), sys.stdout)
        return
    cfg = attention.attn_config(128, torch.bfloat16)
    fwd = {"D": 128, "EXP2": cfg.exp2_code, "FMA": cfg.fwd_fma, "INTERPRET": False, "BLOCK_M": 64, "BLOCK_N": cfg.fwd_n}
    bwd = {"D": 128, "EXP2": cfg.bwd_exp2_code, "FMA": cfg.bwd_fma, "INTERPRET": False, "ORDERED": True}
    out = {}
    for ordered in (False, True):
        out[f"fwd_tma_ordered={ordered}"] = ptx_facts(
            attention_tma._attn_fwd_tma_kernel, {**fwd, "ORDERED": ordered}, 4, 3
        )
    for tma in (False, True):
        kv = {**bwd, "USE_TMA": tma, "BLOCK_N": cfg.kv_n, "BLOCK_M": cfg.kv_m}
        out[f"dkdv_tma={tma}"] = ptx_facts(attention_bwd._dkdv_kernel, kv, cfg.kv_warps, cfg.kv_stages)
        dq = {**bwd, "USE_TMA": tma, "BLOCK_M": cfg.q_m, "BLOCK_N": cfg.q_n}
        out[f"dq_tma={tma}"] = ptx_facts(attention_bwd._dq_kernel, dq, cfg.q_warps, cfg.q_stages)
    for ordered in (False, True):
        out[f"fwd_gluon_ordered={ordered}"] = gluon_facts(ordered)
        out[f"dkdv_gluon_ordered={ordered}"] = gluon_bwd_facts(False, ordered)
        out[f"dq_gluon_ordered={ordered}"] = gluon_bwd_facts(True, ordered)
    out["fwd_gluon_sources"] = gluon_facts(True, mapped=True)
    out["fwd_gluon_regstore"] = gluon_facts(False, tma_store=False)
    out["dkdv_gluon_sources"] = gluon_bwd_facts(False, True, mapped=True)
    out["dq_gluon_sources"] = gluon_bwd_facts(True, True, mapped=True)
    tilings = {cfg.tag: cfg for _, table in gemm_configs.GLUON_BUCKETS for cfg in table.values()}
    for i, (tag, cfg) in enumerate(sorted(tilings.items())):
        out[f"gemm_gluon:{tag}"] = gemm_gluon_facts(cfg, bias=i == 0)
    out["gemm_gluon:grouped_qkv"] = gemm_gluon_facts(gemm_configs.GLUON_GROUPED, bias=False, groups=3)
    out["gemm_gluon_seg8"] = gemm_seg8_facts(gemm_gluon_seg8.SEG8_GLUON, bias=True)
    out["gemm_gluon_rows_dw"] = gemm_rows_dw_facts()
    out["gemm_gluon_seg8_dx"] = gemm_seg8_facts(gemm_gluon_seg8.SEG8_GLUON, bias=False, dx=True)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
