"""Compile every strict row kernel, and the GEMM's block-layer variants, for sm_90 (H200) ahead of time, without a GPU:
``python -m tests.triton_kernels.rows_aot``
(must run with TRITON_INTERPRET unset, so the compiled code path - libdevice, ``cvt.rn``, no FMA - is the one built).

Prints one JSON line per kernel variant: ``{"kernel", "ok", "error", "fma_free"}``. ``fma_free`` checks that no
``fma`` instruction appears in the PTX outside libdevice's own transcendental routines (kernels without
transcendentals must have none: strict launches disable contraction).
"""

from __future__ import annotations

import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("rows_aot: unset TRITON_INTERPRET (the compiled path is what this checks)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from h3gate.kernels import elementwise, gather, gemm_swapped, gemm_triton, norms, packed, rope, timestep  # noqa: E402
from h3gate.kernels.common import STRICT_LAUNCH  # noqa: E402
from h3gate.kernels.gemm_merge import _seg8_kernel  # noqa: E402
from h3gate.kernels.rows_dw import _rows_colsum_kernel, _rows_dw_kernel  # noqa: E402

B, F, I64, I32, PF = "*bf16", "*fp32", "*i64", "*i32", "fp32"
TARGET = GPUTarget("cuda", 90, 32)


def variants():
    """(name, kernel, {arg: type}, {constexpr: value}, has_transcendental)."""
    g, n, e = gather, norms, elementwise
    seg = dict(a_ptr=B, c_ptr=B, order_ptr=I64, cstart_ptr=I64, cend_ptr=I64, part_ptr=F, H="i32", a_bs="i32",
               a_rs="i32", c_bs="i32", c_rs="i32", part_bs="i32", n_sub="i32")  # fmt: skip
    gat = dict(src_ptr=F, idx_ptr=I64, out_ptr=B, N="i32", C="i32", src_bs="i64", src_rs="i32", out_bs="i64",
               out_rs="i32")  # fmt: skip
    fwd = dict(x_ptr=B, w_ptr=B, out_ptr=B, rstd_ptr=F, shift_ptr=B, scale_ptr=B, idx_ptr=I64, M="i32", H="i32",
               S="i32", shift_rs="i32", scale_rs="i32", h_f=PF, eps=PF)  # fmt: skip
    bwd = dict(x_ptr=B, w_ptr=B, g_ptr=B, rstd_ptr=F, scale_ptr=B, idx_ptr=I64, dx_ptr=B, n_ptr=B, dwp_ptr=F,
               seg_ptr=I64, M="i32", H="i32", S="i32", HR="i32", scale_rs="i32", h_f=PF)  # fmt: skip
    yield "gather.cast", g._gather_kernel, gat, dict(BLOCK_N=2, BLOCK_C=1024, CAST=True, SUM1=False), False
    yield (
        "gather.sum1",
        g._gather_kernel,
        {**gat, "src_ptr": B},
        dict(BLOCK_N=2, BLOCK_C=1024, CAST=False, SUM1=True),
        False,
    )
    yield "segment.partial", g._segment_partial_kernel, seg, dict(SUB=32, BLOCK_H=128, PRODUCT=True), False
    yield "segment.reduce", g._segment_reduce_kernel, dict(part_ptr=F, seg_cstart_ptr=I64, out_ptr=B, H="i32",
          num_segments="i32", max_chunks="i32", part_bs="i32", out_bs="i32", out_rs="i32"),\
        dict(BLOCK_S=1, BLOCK_H=128), False  # fmt: skip
    for mod, rf in ((True, False), (False, True)):
        yield f"rms.fwd.mod{mod:d}", n._rms_fwd_kernel, fwd, dict(BLOCK_M=16, BLOCK_H=128, NCH=1, MODULATE=mod,
              ROUND_FIRST=rf, SAVE_RSTD=True), False  # fmt: skip
        yield f"rms.fwd.chunked.mod{mod:d}", n._rms_fwd_kernel, fwd, dict(BLOCK_M=1, BLOCK_H=2048, NCH=3,
              MODULATE=mod, ROUND_FIRST=rf, SAVE_RSTD=True), False  # fmt: skip
        yield f"rms.bwd.mod{mod:d}", n._rms_bwd_kernel, bwd, dict(ROWS=32, BLOCK_M=16, BLOCK_H=128, MODULATE=mod,
              ROUND_FIRST=rf, NEED_N=mod, SEGMENTED=False, NSEG=1), False  # fmt: skip
    # the seg8 norms' backward, every segment in one launch: the modulated norm's 8 row segments (H = 5376), the QK
    # norm's 64 (head group, row segment) blocks (D = 128)
    yield "rms.bwd.segmented", n._rms_bwd_kernel, bwd, dict(ROWS=32, BLOCK_M=1, BLOCK_H=8192, MODULATE=True,
          ROUND_FIRST=False, NEED_N=True, SEGMENTED=True, NSEG=8), False, dict(num_warps=8)  # fmt: skip
    yield "rms.bwd.segmented.qk", n._rms_bwd_kernel, bwd, dict(ROWS=32, BLOCK_M=16, BLOCK_H=128, MODULATE=False,
          ROUND_FIRST=False, NEED_N=False, SEGMENTED=True, NSEG=64), False  # fmt: skip
    ts = dict(t_ptr=F, out_ptr=F, half="i32", half_f=PF, neg_log=PF)
    yield "timestep.fwd", timestep._sinusoid_fwd_kernel, ts, dict(BLOCK=128), True
    yield "timestep.bwd", timestep._sinusoid_bwd_kernel, dict(t_ptr=F, g_ptr=F, dt_ptr=F, half="i32", half_f=PF,
          neg_log=PF), dict(BLOCK=128), True  # fmt: skip
    for bwd_ in (False, True):
        yield (
            f"silu.bwd{bwd_:d}",
            e._silu_kernel,
            dict(x_ptr=F, out_ptr=B, g_ptr=F, N="i32"),
            dict(MID=triton.language.float32, BWD=bwd_, BLOCK=1024),
            True,
        )
        yield f"swiglu.bwd{bwd_:d}", e._swiglu_kernel, dict(h_ptr=B, out_ptr=B, g_ptr=B, dh_ptr=B, M="i32",
              F="i32"), dict(BWD=bwd_, BLOCK_M=2, BLOCK_F=1024), True  # fmt: skip
        yield f"gate.bwd{bwd_:d}", e._gate_kernel, dict(x_ptr=B, y_ptr=B, gate_ptr=B, idx_ptr=I64, out_ptr=B,
              M="i32", H="i32", S="i32", gate_rs="i32"), dict(BWD=bwd_, BLOCK_M=2, BLOCK_H=1024), False  # fmt: skip
        yield f"mix.bwd{bwd_:d}", e._mix_kernel, dict(s_ptr=F, n_ptr=F, t_ptr=F, out_ptr=F, out2_ptr=F, N="i32",
              inner="i32"), dict(BWD=bwd_, BLOCK=1024), False  # fmt: skip
        yield f"rope.bwd{bwd_:d}", rope._rope_kernel, dict(x_ptr=B, cos_ptr=F, sin_ptr=F, out_ptr=B, M="i32",
              S="i32", NH="i32", R="i32"), dict(BWD=bwd_, BLOCK_M=16, D=128), False  # fmt: skip
    yield "add", e._add_kernel, dict(x_ptr=B, y_ptr=B, out_ptr=B, N="i32"), dict(BLOCK=1024), False
    sc = dict(t_ptr=B, v_ptr=F, a_ptr=F, kind_ptr=I32, src_ptr=I64, out_ptr=B, S="i32", H="i32", t_bs="i32",
              v_bs="i32", a_bs="i32")  # fmt: skip
    yield "packed.scatter", packed._scatter_kernel, sc, dict(BLOCK_M=2, BLOCK_H=1024), False
    # The GEMM (tensor-core MMAs, not FMAs): the block forward's persistent pointer / TMA variants, with and without
    # the narrow tail tiles, and the dW layout (A stored transposed).
    mm = dict(a_ptr=B, b_ptr=B, c_ptr=B, bias_ptr=B, M="i32", N="i32", R="i32", stride_am="i32", stride_ar="i32",
              stride_br="i32", stride_bn="i32", stride_cm="i32", NUM_PROGS="i32", N_SPLIT="i32")  # fmt: skip
    base = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, TAIL_N=0, GROUP_M=16, HAS_BIAS=False, EVEN_R=True,
                A_TRANS=False, B_TRANS=True, USE_TMA=True, FLATTEN=True, INTERPRET=False)  # fmt: skip
    opts = dict(num_warps=8, num_stages=3)
    yield "gemm.fwd.tma", gemm_triton._gemm_kernel, mm, base, False, opts
    yield "gemm.fwd.tma.tail128", gemm_triton._gemm_kernel, mm, {**base, "TAIL_N": 128}, False, opts
    yield "gemm.fwd.ptr.tail128", gemm_triton._gemm_kernel, mm, {**base, "TAIL_N": 128, "USE_TMA": False}, False, opts
    dw = {**base, "A_TRANS": True, "B_TRANS": False, "GROUP_M": 8}
    yield "gemm.dw.tma", gemm_triton._gemm_kernel, mm, dw, False, opts
    # The swapped small-M forward (Y^T = W @ X^T) as shipped: 64 weight rows x (256 + 16) tokens on 4 warps (M < 512),
    # 128 weight rows x (256 + 64) tokens on 8 warps (512 <= M < 1024); TMA and pointer loads.
    sw = dict(x_ptr=B, w_ptr=B, c_ptr=B, bias_ptr=B, M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32",
              stride_cm="i32")  # fmt: skip
    swb = dict(BLOCK_N=64, BLOCK_M=256, TAIL_M=16, BLOCK_K=64, HAS_BIAS=True, EVEN_K=True, USE_TMA=True,
               INTERPRET=False)  # fmt: skip
    w4 = dict(num_warps=4, num_stages=4)
    yield "gemm.swap.tma.tail16", gemm_swapped._gemm_swapped_kernel, sw, swb, False, w4
    yield "gemm.swap.ptr.tail16", gemm_swapped._gemm_swapped_kernel, sw, {**swb, "USE_TMA": False}, False, w4
    sw128 = {**swb, "BLOCK_N": 128, "TAIL_M": 64}
    yield "gemm.swap.tma.tail64", gemm_swapped._gemm_swapped_kernel, sw, sw128, False, opts
    # The fused row-segment dW (all 8 segments, the tree in scratch slots, rounded in the epilogue; a CP rank's FP32
    # subtree of 2 segments) and its colsum (db).
    rd = dict(g_ptr=B, x_ptr=B, out_ptr=B, scratch_ptr=F, N="i32", K="i32", S_LOC="i32", BATCH="i32", L="i32",
              S_GLOB="i32", LO="i32", SEG0="i32", stride_g="i32", stride_x="i32", stride_o="i32",
              NUM_PROGS="i32")  # fmt: skip
    rdc = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, C=8, FINISH=True, BATCHED=False, USE_TMA=False,
               INTERPRET=False)  # fmt: skip
    yield "gemm.rows_dw", _rows_dw_kernel, rd, rdc, False, opts
    yield "gemm.rows_dw.tma", _rows_dw_kernel, rd, {**rdc, "USE_TMA": True}, False, opts
    cp4 = {**rdc, "C": 2, "FINISH": False}
    # The seg8 GEMM forward (its tree fold is the dW's helper): all 8 segments rounded with the bias, pointer loads.
    sg = dict(a_ptr=B, b_ptr=B, out_ptr=B, bias_ptr=B, scratch_ptr=F, M="i32", N="i32", R_LOC="i32", SEG="i32",
              stride_am="i32", stride_ar="i32", stride_br="i32", stride_bn="i32", stride_om="i32",
              NUM_PROGS="i32")  # fmt: skip
    sgc = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, C=8, FINISH=True, HAS_BIAS=True, EVEN_R=True,
               B_TRANS=True, USE_TMA=False, INTERPRET=False)  # fmt: skip
    yield "gemm.seg8", _seg8_kernel, sg, sgc, False, opts
    yield "gemm.rows_dw.cp4", _rows_dw_kernel, {**rd, "out_ptr": F}, cp4, False, opts
    cs = dict(g_ptr=B, out_ptr=B, N="i32", S_LOC="i32", BATCH="i32", L="i32", S_GLOB="i32", LO="i32", SEG0="i32",
              stride_g="i32")  # fmt: skip
    csc = dict(BLOCK_R=32, BLOCK_N=128, C=8, FINISH=True, BATCHED=False, INTERPRET=False)
    yield "rows_dw.colsum", _rows_colsum_kernel, cs, csc, False, dict(num_warps=4)


def main() -> int:
    failed = 0
    for name, kernel, sig, const, transcendental, *options in variants():
        if "INTERPRET" in kernel.arg_names:
            const = {**const, "INTERPRET": False}
        signature = {**sig, **{k: "constexpr" for k in const}}
        rec = {"kernel": name, "ok": False, "error": None, "fma_free": None}
        try:
            src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=const)
            compiled = triton.compile(src, target=TARGET, options={**STRICT_LAUNCH, **(options[0] if options else {})})
            ptx = compiled.asm["ptx"]
            rec["ok"] = True
            rec["fma_free"] = transcendental or not any(line.strip().startswith("fma") for line in ptx.splitlines())
            if name.startswith("gemm."):  # Hopper's asynchronous warp-group MMA shapes (n128 = the tail tiles)
                rec["wgmma"] = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
        except Exception as exc:  # noqa: BLE001 - report every compile failure by name
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        failed += not (rec["ok"] and rec["fma_free"])
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
