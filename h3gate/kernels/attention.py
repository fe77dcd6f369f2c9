"""Strict full attention: non-causal, unmasked, one packed document; forward here, backward in ``attention_bwd``.

Contract (restated in ``manifests/operators/attention.yaml``):

* maths - q, k, v (B, S, nh, D) -> out (B, S, nh * D) at q's dtype: ``softmax(q k^T / sqrt(D)) v`` per (batch,
  head), no mask, no causality, no dropout. D = 128; any head count.
* forward (FA2-style online softmax) - one program per (BLOCK_M query rows, batch, head) walks the KV blocks
  j = 0, 1, ... in ascending order (a masked tail block last when S % BLOCK_N != 0). Per block, in FP32:
  ``s = (q k^T) * (log2(e) / sqrt(D))`` (MMA, FP32 accumulate), ``m' = max(m, rowmax s)``,
  ``p = exp2(s - m')``, ``alpha = exp2(m - m')``, ``l = l * alpha + rowsum p``, ``acc = acc * alpha +
  cast(p) @ v``. End: ``out = cast(acc / l)`` (IEEE division, one rounding), ``lse2 = m + log2(l)`` kept in FP32
  (log2 domain) for the backward.
* cast points - ``p`` is rounded to the input dtype (RNE) before the PV MMA (identity for float32 inputs); the
  output once, at the end. exp2/log2 are libdevice ``__nv_exp2f``/``__nv_log2f`` (the non-FTZ CUDA functions).
* declared forward variants (fields of the (D, dtype) config, so fixed per dtype and never chosen by S or B; the
  defaults are the strict forms above): ``fwd_exp2="ex2ftz"`` evaluates the forward's two exp2 with the explicit
  PTX instruction ``ex2.approx.ftz.f32`` (inline asm; subnormal results flush to +0, otherwise ``__nv_exp2f``'s
  ``ex2.approx`` value), ``"ex2"`` with ``ex2.approx.f32``; ``fwd_fma=True`` forms the exponent with one explicit
  ``fma``: ``m' = max(m, rowmax(q k^T) * c)`` (equal to the rowmax of the rounded products: rounding is monotonic)
  and ``p = exp2(fma(q k^T, c, -m'))`` (one rounding instead of two; the row maximum's p is ``exp2`` of that
  product's rounding error, not exactly 1). Both are written instructions, not compiler substitutions; the
  launch keeps ``enable_fp_fusion=False``. The interpreter evaluates them with ``tl.exp2`` / ``tl.fma``.
  ``bwd_exp2`` / ``bwd_fma`` are the same declared options for the backward's recomputation of p (default: the
  strict forms; see :mod:`h3gate.kernels.attention_bwd`).
* walk order (RFC numerical rule 7) - with ``order`` (int64 (S,), the packed row holding canonical row ``i``: the
  graph's ``attention_order``, :func:`h3gate.layout.canonical_order`) the kernels run over canonical rows: the
  operands a kernel walks in its inner loop (K/V in the forward and dQ, Q/dout in dK/dV) are gathered into canonical
  order (``gather_rows``, contiguous copies), and the rows a program owns (its query block, or its KV block in dK/dV)
  are read in place through ``order[i]`` (``packed_rows``), their outputs stored straight to their packed rows; the
  per-row statistics (``lse2``, ``delta``) are indexed canonically. Every tile holds the values a full gather would
  put there, so the bytes are those of the kernels on gathered copies scattered back (tested), with two of the old
  four forward copies (and four of eight backward ones): on the H200 indexed loads in the inner loop ran 1.46x
  (medium) / 1.6x (768p) the packed-order kernel, slower than copying (``docs/measurements/perf-probe-14.json``).
  The Gluon kernels (Hopper) copy less: each walked tile of consecutive packed rows is loaded in place by TMA and
  only the other tiles are copied (:mod:`h3gate.kernels.attention_sources`; the same tiles in shared memory).
  Forward and gradients of a logical row are byte-equal under any consistent permutation of the packed rows.
  ``order=None`` walks packed order; an identity order takes the plain kernels without copies (decided once per
  order tensor: ``common.cached``, one host read, not per call).
* invariance - a query row's bytes depend only on its own q row and the whole K/V of its (batch, head), read in the
  fixed block order above (over the canonical rows when an order is given); batch elements and heads are separate
  programs (batch-row invariant); the KV walk (fwd_n, exp2/fma forms; 128 keys a step for bfloat16 D = 128 since kernel
  id v2, 64 in v1) and the backward tilings are functions of (D, dtype) only, never of S or B. Launch knobs may depend
  on S, declared in ``S_BUCKETS`` (only ``LAUNCH_FIELDS``): block heights, warps, stages and the load path (``fwd_tma``
  / ``bwd_tma``: TMA or pointer loads of the same tiles, :mod:`h3gate.kernels.attention_tma`), which decide which
  program owns a row and which instruction fetches a tile - each row's scores, softmax and sums are the same (every
  launch probed was bitwise equal at S = 264, 925, 3160 and 38974 on the H200,
  ``docs/measurements/perf-probe-{12,13,14,15}.json``); and the forward's schedule, ``fwd_gluon``: the warp-specialised
  Gluon kernel (:mod:`h3gate.kernels.attention_gluon`, Hopper) issues the same instructions on the same tiles in another
  order (a TMA producer warp, two consumer warpgroups of 64 rows whose softmax overlaps the other's MMAs), bitwise equal
  to the Triton kernels at every S, batch and order probed (``perf-probe-16.json``); the backward's schedule,
  ``bwd_gluon``, likewise (:mod:`h3gate.kernels.attention_bwd_gluon`, ``perf-probe-18/19.json``). Repeat runs are
  bitwise equal. No split-KV, no atomics.
* backward - see :mod:`h3gate.kernels.attention_bwd`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.kernels import launches
from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, cached, check_tensor, hopper
from h3gate.kernels.exact import helper, mma, rne

KERNEL_ID = "triton:h3gate.full_attention_fa2_fixedkv:v2"
OP = "h3_full_attention"
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (128,)
_DTYPES = (torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """Tilings of the three attention kernels (a function of head_dim and dtype only)."""

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    kv_n: int = 128  # dK/dV kernel: KV rows per program
    kv_m: int = 64  # dK/dV kernel: query rows per step of its ascending loop
    kv_warps: int = 8
    kv_stages: int = 2
    q_m: int = 128  # dQ kernel: query rows per program
    q_n: int = 64  # dQ kernel: KV rows per step of its ascending loop
    q_warps: int = 8
    q_stages: int = 2
    fwd_exp2: str = "libdevice"  # forward exp2: "libdevice" (__nv_exp2f), "ex2" or "ex2ftz" (explicit PTX)
    fwd_fma: bool = False  # forward exponent as one explicit fma(q k^T, c, -m') instead of (q k^T * c) - m'
    bwd_exp2: str = "libdevice"  # backward recomputation's exp2 (dK/dV and dQ kernels), same codes as fwd_exp2
    bwd_fma: bool = False  # backward exponent as one explicit fma(q k^T, c, -lse2) instead of (q k^T * c) - lse2
    fwd_tma: bool = False  # forward tiles loaded by TMA on CUDA in packed order (attention_tma: same values, same step)
    fwd_gluon: bool = False  # forward by the warp-specialised Gluon kernel on Hopper (attention_gluon: same bytes)
    bwd_tma: bool = False  # backward inner-loop tiles loaded by TMA on CUDA (attention_bwd: same values)
    bwd_gluon: bool = False  # dK/dV by the warp-specialised Gluon kernel on Hopper (attention_bwd_gluon: same bytes)

    @property
    def tag(self) -> str:
        math_ = ("" if self.fwd_exp2 == "libdevice" else f"_{self.fwd_exp2}") + ("_fma" if self.fwd_fma else "")
        bmath = ("" if self.bwd_exp2 == "libdevice" else f"_{self.bwd_exp2}") + ("_fma" if self.bwd_fma else "")
        load = ("_tma" if self.fwd_tma else "") + ("_gluon" if self.fwd_gluon else "")
        bmath += "_tma" if self.bwd_tma else ""
        bmath += "_gluon" if self.bwd_gluon else ""
        return (
            f"fwd{self.fwd_m}x{self.fwd_n}w{self.fwd_warps}s{self.fwd_stages}{math_}{load}_"
            f"kv{self.kv_n}x{self.kv_m}w{self.kv_warps}s{self.kv_stages}_"
            f"q{self.q_m}x{self.q_n}w{self.q_warps}s{self.q_stages}{bmath}"
        )

    @property
    def exp2_code(self) -> int:
        """The forward kernel's ``EXP2`` constexpr: 0 libdevice, 1 ``ex2.approx.f32``, 2 ``ex2.approx.ftz.f32``."""
        return _exp2_code("fwd_exp2", self.fwd_exp2)

    @property
    def bwd_exp2_code(self) -> int:
        """The backward kernels' ``EXP2`` constexpr (same codes as :attr:`exp2_code`)."""
        return _exp2_code("bwd_exp2", self.bwd_exp2)


def _exp2_code(field: str, value: str) -> int:
    codes = {"libdevice": 0, "ex2": 1, "ex2ftz": 2}
    if value not in codes:
        raise InputError(f"{OP}: config {field}: {value!r} not one of {sorted(codes)}")
    return codes[value]


# (head_dim, dtype) -> config; tools/gpu_gemm_attention.py measures candidates on the H200.
ATTN_TABLE: dict[tuple[int, str], AttnConfig] = {
    # Measured winners on the H200 (docs/measurements/gemm_attention-tuning-2.json forward, -3-backward.json
    # backward): declared ex2.approx.ftz + explicit FMA in the forward and in the backward's p recompute; the
    # forward's 64-row TMA launch and the backward's TMA loads with 4 stages from perf-probe-14/15 (bitwise equal to
    # the launches they replaced; S_BUCKETS keeps those below S = 2048).
    (128, "bfloat16"): AttnConfig(
        kv_n=128,
        kv_m=64,
        kv_warps=8,
        kv_stages=4,
        q_m=128,
        q_n=64,
        q_warps=8,
        q_stages=4,
        bwd_tma=True,
        bwd_gluon=True,
        fwd_m=64,
        fwd_n=128,
        fwd_warps=8,
        fwd_stages=3,
        fwd_tma=True,
        fwd_gluon=True,
        fwd_exp2="ex2ftz",
        fwd_fma=True,
        bwd_exp2="ex2ftz",
        bwd_fma=True,
    ),
    (128, "float32"): AttnConfig(64, 32, 4, 2, 64, 32, 4, 1, 64, 32, 4, 1),
}


# Launch choices by sequence length, per (head_dim, dtype): ((bound, {field: value}), ...) in ascending bound order;
# S < bound takes the first matching entry's overrides of the ATTN_TABLE tiling, S >= the last bound the table entry.
# Only LAUNCH_FIELDS may be overridden: which program owns a row (query/KV block heights), warps, pipeline depth and
# the load path (TMA or pointer loads of the same tiles) - never the KV walk of the forward (fwd_n) or the exp2/fma
# forms, so no row's sums change (every override below was measured bitwise equal on the H200).
# bfloat16 D = 128: 64-row forward blocks on 4 warps were 11 / 4 / 5 % faster than 128-row ones at S = 264 / 925 /
# 3160 (perf-probe-{12,13}) and, with TMA loads, the fastest at 38974 too (82.5 ms against 94.7 for the 128-row
# pointer kernel, perf-probe-15); TMA and 4 pipeline stages in the backward were 3 / 4 % faster at 3160 / 38974
# (perf-probe-15). Both were slower at 264 / 925 (a program's descriptor set-up: forward 25 / 6 %, backward 8 / 2 %),
# so below the bound 2048 (between the measured 925 and 3160, a choice, not a measured crossover) the pointer
# kernels with 3 backward stages run. The warp-specialised Gluon forward (same bytes) was 6 % faster than the TMA
# kernel at 3160 and 38974 and slower at 264 (host descriptors and one wave of 128-row programs): from 2048 on as well
# (perf-probe-16). Persistent (one program an SM walking tiles), it is also faster than the pointer kernel at S = 925
# (0.085 against 0.105 ms) and still slower at 264 (0.089 against 0.032; perf-probe-22): so from 512 on (between the
# measured 264 and 925, a choice), while below 2048 the backward keeps the pointer kernels.
# The KV walk itself (fwd_n, not a launch field) is 128 keys since kernel id v2 (session 13): in the Gluon kernel it
# was 17 / 20 % faster than the 64-key walk at S = 3160 / 38974 (0.561 vs 0.528 ms cuDNN, 72.5 vs 75.8 ms cuDNN,
# perf-probe-17-fwd.json), where the Triton kernels had shown 1 % (perf-probe-14): a contract change (other bytes, new
# evidence for every gate). Below 2048 the pointer kernel walks the same 128 keys, on 8 warps (ptxas: 584 spilled bytes
# against 7.6 KB on 4 warps) and 128-row blocks: 0.032 / 0.105 ms at S = 264 / 925 against 0.037 / 0.150 for 64-row
# blocks (cuDNN 0.021 / 0.067; the 64-key walk read 0.025 / 0.092), bytes equal (perf-probe-17-small.json). There a
# 32-row block on 4 warps gave other bytes (Triton issues mma.sync below 64 rows, not wgmma): heights are >= 64.
# The backward's warp-specialised Gluon kernels (bwd_gluon, same bytes, perf-probe-18): from 2048 on; below, their
# host descriptors cost more than they save (the dK/dV kernel alone: 0.17 against 0.089 ms at S = 264).
LAUNCH_FIELDS = frozenset(
    {
        "fwd_m",
        "fwd_warps",
        "fwd_stages",
        "fwd_tma",
        "fwd_gluon",
        "bwd_tma",
        "bwd_gluon",
        "kv_n",
        "kv_m",
        "kv_warps",
        "kv_stages",
        "q_m",
        "q_n",
        "q_warps",
        "q_stages",
    }
)
_BWD_POINTER = {"bwd_tma": False, "bwd_gluon": False, "kv_stages": 3, "q_stages": 3}
S_BUCKETS: dict[tuple[int, str], tuple[tuple[int, dict], ...]] = {
    (128, "bfloat16"): (
        (512, {"fwd_m": 128, "fwd_tma": False, "fwd_gluon": False, **_BWD_POINTER}),
        (2048, {"fwd_m": 128, "fwd_tma": False, **_BWD_POINTER}),  # the Gluon forward (Hopper), else pointer
    ),
}


def _check_s_buckets() -> None:
    for key, buckets in S_BUCKETS.items():
        bounds = [b[0] for b in buckets]
        heights = [o.get(f, 64) for _, o in buckets for f in ("fwd_m", "kv_n", "kv_m", "q_m", "q_n")]
        fields = set().union(*(o for _, o in buckets))
        low = key[1] == "bfloat16" and min(heights, default=64) < 64  # below 64 rows: mma.sync, other bytes
        if key not in ATTN_TABLE or bounds != sorted(set(bounds)) or any(h & (h - 1) for h in heights) or low:
            raise AssertionError(
                f"attention.S_BUCKETS{key}: known tiling, ascending bounds, power-of-two blocks of >= 64 rows"
            )
        if not fields <= LAUNCH_FIELDS:
            raise AssertionError(f"attention.S_BUCKETS{key}: {sorted(fields - LAUNCH_FIELDS)} are not launch fields")


_check_s_buckets()


def qk_scale(head_dim: int) -> float:
    """``log2(e) / sqrt(D)``: scores are kept in the log2 domain (one FP32 constant shared by every kernel)."""
    return LOG2E / math.sqrt(head_dim)


def attn_config(head_dim: int, dtype: torch.dtype, seq_len: int | None = None) -> AttnConfig:
    """The (D, dtype) tiling; with ``seq_len`` its launch overrides from ``S_BUCKETS``."""
    key = (head_dim, dtype_name(dtype))
    cfg = ATTN_TABLE[key]
    if seq_len is not None:
        for bound, overrides in S_BUCKETS.get(key, ()):
            if seq_len < bound:
                return replace(cfg, **overrides)
    return cfg


@helper
def exp2(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp2(x)
    else:
        return libdevice.exp2(x)


@helper
def exp2_fwd(x, EXP2: tl.constexpr, INTERPRET: tl.constexpr):
    """exp2 of the forward / backward recomputation: libdevice (EXP2=0) or the declared PTX
    ``ex2.approx[.ftz].f32`` (1, 2)."""
    if INTERPRET:
        return tl.exp2(x)
    elif EXP2 == 2:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif EXP2 == 1:
        return tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return libdevice.exp2(x)


@helper
def log2(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.log2(x)
    else:
        return libdevice.log2(x)


@helper
def packed_rows(ord_ptr, offs, S, ORDERED: tl.constexpr):
    """The packed rows of canonical rows ``offs``: ``order[offs]`` (row 0 past S: those loads are masked), or
    ``offs`` itself without an order."""
    if ORDERED:
        return tl.load(ord_ptr + offs, mask=offs < S, other=0)
    else:
        return offs


@helper
def _fwd_block(q, m_i, l_i, acc, k_ptr, v_ptr, base, start, S, stride_s, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr,
               EXP2: tl.constexpr, FMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kv = base + offs_n[:, None] * stride_s + offs_d[None, :]
    if MASK:
        k = tl.load(k_ptr + kv, mask=offs_n[:, None] < S, other=0.0)
        v = tl.load(v_ptr + kv, mask=offs_n[:, None] < S, other=0.0)
    else:
        k = tl.load(k_ptr + kv)
        v = tl.load(v_ptr + kv)
    return fwd_step(q, k, v, m_i, l_i, acc, offs_n, S, qk_scale, BLOCK_M, BLOCK_N, MASK, EXP2, FMA, INTERPRET)


@helper
def fwd_step(q, k, v, m_i, l_i, acc, offs_n, S, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK: tl.constexpr, EXP2: tl.constexpr, FMA: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One KV block of the online softmax (module docstring) on loaded k, v tiles (rows past S zero, masked)."""
    if FMA:  # declared: one explicit fma per score (see the module docstring)
        qk = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET)
        if MASK:
            qk = tl.where(offs_n[None, :] < S, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = exp2_fwd(tl.fma(qk, qk_scale, -m_new[:, None]), EXP2, INTERPRET)
    else:
        s = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERPRET) * qk_scale
        if MASK:
            s = tl.where(offs_n[None, :] < S, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = exp2_fwd(s - m_new[:, None], EXP2, INTERPRET)
    alpha = exp2_fwd(m_i - m_new, EXP2, INTERPRET)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = mma(rne(p, v.dtype, INTERPRET), v, acc, INTERPRET)
    return m_new, l_i, acc


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, ord_ptr, S, H, qk_scale, stride_b, stride_s,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP2: tl.constexpr,
                     FMA: tl.constexpr, ORDERED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H) * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < S
    rows = base + packed_rows(ord_ptr, offs_m, S, ORDERED)[:, None] * stride_s + offs_d[None, :]
    q = tl.load(q_ptr + rows, mask=mask_m[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    n_full = S // BLOCK_N
    for j in range(0, n_full):
        m_i, l_i, acc = _fwd_block(q, m_i, l_i, acc, k_ptr, v_ptr, base, j * BLOCK_N, S, stride_s, qk_scale,
                                   BLOCK_M, BLOCK_N, D, False, EXP2, FMA, INTERPRET)  # fmt: skip
    if n_full * BLOCK_N < S:
        m_i, l_i, acc = _fwd_block(q, m_i, l_i, acc, k_ptr, v_ptr, base, n_full * BLOCK_N, S, stride_s, qk_scale,
                                   BLOCK_M, BLOCK_N, D, True, EXP2, FMA, INTERPRET)  # fmt: skip
    out = tl.div_rn(acc, l_i[:, None])
    tl.store(o_ptr + rows, rne(out, o_ptr.dtype.element_ty, INTERPRET), mask=mask_m[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * S + offs_m, m_i + log2(l_i, INTERPRET), mask=mask_m)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_tensor(OP, "q", q, _DTYPES, ndim=4)
    for name, t in (("k", k), ("v", v)):
        check_tensor(OP, name, t, _DTYPES, ndim=4, device=q.device)
        if t.dtype != q.dtype:
            raise InputError(f"{OP}: {name}: dtype {t.dtype} does not match q dtype {q.dtype}".replace("torch.", ""))
        if t.shape != q.shape:
            raise InputError(f"{OP}: {name}: shape {tuple(t.shape)} != q shape {tuple(q.shape)} (B, S, nh, D)")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"{OP}: q: head_dim {q.shape[3]} not supported (supported: {SUPPORTED_HEAD_DIMS})")


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttnConfig, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, nh*D) at q's dtype, packed rows; lse2 (B*nh, S) float32 in the log2 domain, canonical rows)."""
    from h3gate.kernels import attention_tma

    if uses_gluon(cfg, q):  # reads packed q, k and v in canonical order itself
        from h3gate.kernels.attention_gluon import forward_gluon_ws

        return forward_gluon_ws(q, k, v, cfg, order)
    k, v = gather_rows(k, order), gather_rows(v, order)  # the walked operands, canonical and contiguous
    if attention_tma.uses_tma(cfg, q):
        return attention_tma.forward_tma(q, k, v, cfg, order)
    b, s, h, d = q.shape
    out = torch.empty((b, s, h * d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b * h, s), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(s, cfg.fwd_m), b * h)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, q if order is None else order, s, h, qk_scale(d), q.stride(0), q.stride(1),
        D=d, BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, EXP2=cfg.exp2_code, FMA=cfg.fwd_fma, ORDERED=order is not None,
        INTERPRET=INTERPRET,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, **STRICT_LAUNCH,
    )  # fmt: skip
    return out, lse


def uses_gluon(cfg: AttnConfig, q: torch.Tensor, backward: bool = False) -> bool:
    """Whether this forward (``backward``: this dK/dV walk) runs its Gluon kernel: asked by the tiling, bfloat16 on a
    Hopper (sm_90) GPU, compiled."""
    asked = cfg.bwd_gluon if backward else cfg.fwd_gluon
    if not (asked and q.device.type == "cuda" and q.dtype == torch.bfloat16 and not INTERPRET):
        return False
    return hopper(q.device.index)


def launch_record(q: torch.Tensor) -> dict:
    """Which kernels run the forward and the backward of a call with queries like ``q`` (B, S, nh, D) here, and the
    tiling: evidence names what executed (every schedule has this contract's bytes)."""
    from h3gate.kernels import attention_bwd, attention_tma

    cfg = attn_config(q.shape[3], q.dtype, q.shape[1])
    if uses_gluon(cfg, q):
        fwd = "gluon_warp_specialised"
    else:
        fwd = "triton_tma" if attention_tma.uses_tma(cfg, q) else "triton_pointer"
    if uses_gluon(cfg, q, backward=True):
        bwd = "gluon_warp_specialised"
    else:
        bwd = "triton_tma" if attention_bwd.uses_tma(cfg, q) else "triton_pointer"
    return {"tiling": cfg.tag, "forward": fwd, "backward": bwd, "interpreted": INTERPRET}


def gather_rows(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A walked operand's rows (dim 1) in canonical order: ``t[:, order]``, a contiguous copy (``t`` without one)."""
    return t if order is None else t.index_select(1, order)


def _order_facts(order: torch.Tensor) -> tuple[bool, bool]:
    """(is a permutation of 0..S-1, is the identity): one host read."""
    ar = torch.arange(order.shape[0], device=order.device)
    facts = torch.stack([(torch.sort(order).values == ar).all(), (order == ar).all()])
    perm, identity = facts.tolist()
    return bool(perm), bool(identity)


def walk_order(order: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The order the kernels walk: ``None`` (packed order) for no order or the identity, else ``order`` checked to
    be an int64 (S,) permutation on q's device (memoised per order tensor, so one host read per tensor)."""
    if order is None:
        return None
    s = q.shape[1]
    check_tensor(OP, "order", order, (torch.int64,), ndim=1, device=q.device, contiguous=False)
    if order.shape[0] != s:
        raise InputError(f"{OP}: order: length {order.shape[0]}, expected S = {s} (q's rows)")
    perm, identity = cached("attention-order", (order,), (), lambda: _order_facts(order))
    if not perm:
        raise InputError(f"{OP}: order: not a permutation of the {s} packed rows")
    return None if identity else order


class _Attention(torch.autograd.Function):
    """The kernels walking ``order`` (None: packed order) in place; saves q, k, v, the output and ``lse2``."""

    @staticmethod
    def forward(ctx, q, k, v, order: torch.Tensor | None, cfg: AttnConfig) -> torch.Tensor:
        out, lse = forward(q, k, v, cfg, order)
        ctx.save_for_backward(q, k, v, out, lse, order)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from h3gate.kernels.attention_bwd import backward

        q, k, v, out, lse, order = ctx.saved_tensors
        if grad.dtype != q.dtype:
            raise InputError(f"{OP}: grad_output: dtype {grad.dtype} != output dtype {q.dtype}")
        dq, dk, dv = backward(q, k, v, out, lse, grad.contiguous(), ctx.cfg, order)
        return dq, dk, dv, None, None


def attention_with(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttnConfig, order: torch.Tensor | None = None
) -> torch.Tensor:
    """The strict attention with an explicit tiling (tests and the GPU bench); validates like :func:`attention`."""
    _check(q, k, v)
    launches.note(OP, lambda: launch_record(q))
    return _Attention.apply(q, k, v, walk_order(order, q), cfg)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Strict :func:`h3gate.ops.reference.attention`: (B, S, nh, D) x3 -> (B, S, nh*D), scale 1/sqrt(D); rows
    walked in ``order`` (int64 (S,): packed row of canonical row i; None: packed order)."""
    _check(q, k, v)
    launches.note(OP, lambda: launch_record(q))
    return _Attention.apply(q, k, v, walk_order(order, q), attn_config(q.shape[3], q.dtype, q.shape[1]))


h3_full_attention = attention
