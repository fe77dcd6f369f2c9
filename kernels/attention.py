"""Strict full attention: non-causal, unmasked, one packed document. This module holds the contract, the pointer
forward kernel and the dispatch of both passes to the declared kernel paths.

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
  put there, so the bytes are those of the kernels on gathered copies scattered back (tested), with two of four
  forward copies (and four of eight backward ones): on the H200 indexed loads in the inner loop ran 1.46x (medium) /
  1.6x (768p) the packed-order kernel, slower than copying.
  The Gluon kernels (Hopper) copy less: each walked tile of consecutive packed rows is loaded in place by TMA and
  only the other tiles are copied (:mod:`h3gate.kernels.attention_sources`; the same tiles in shared memory).
  Forward and gradients of a logical row are byte-equal under any consistent permutation of the packed rows.
  ``order=None`` walks packed order; an identity order takes the plain kernels without copies (decided once per
  order tensor: ``common.cached``, one host read, not per call).
* invariance - a query row's bytes depend only on its own q row and the whole K/V of its (batch, head), read in the
  fixed block order above (over the canonical rows when an order is given); batch elements and heads are separate
  programs (batch-row invariant); the KV walk (fwd_n, exp2/fma forms; 128 keys a step for bfloat16 D = 128 since kernel
  id v2, 64 in v1) and the backward tilings are functions of (D, dtype) only, never of S or B
  (:mod:`h3gate.kernels.attention_config`). What may depend on S: the launch fields of ``S_BUCKETS`` (block heights,
  warps, stages), which decide which program owns a row; and the kernel path, declared per device class and S in the
  operator's manifest (``paths``; :func:`paths`): ``triton_pointer`` (this module's pointer kernel and
  :mod:`h3gate.kernels.attention_bwd`), ``triton_tma`` (the same kernels with TMA loads of the same tiles,
  :mod:`h3gate.kernels.attention_tma`) or ``gluon_warp_specialised`` (Hopper: :mod:`h3gate.kernels.attention_gluon` and
  :mod:`h3gate.kernels.attention_bwd_gluon` issue the same instructions on the same tiles in another order - a TMA
  producer warp, two consumer warpgroups of 64 rows). Each row's scores, softmax and sums are the same on every path
  and launch: bitwise equal on the H200 at S = 264, 925, 3160 and 38974, batch 2 with a partial last block and
  permuted walk orders. Repeat runs are bitwise equal. No split-KV, no atomics.
* backward - delta, then the dK/dV and dQ walks (:mod:`h3gate.kernels.attention_bwd`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.kernels import attention_bwd, attention_tma, launches, selection
from h3gate.kernels.attention_bwd_gluon import both_walks, check_tiling, dkdv_gluon, dq_gluon
from h3gate.kernels.attention_config import (
    ATTN_TABLE,
    OP,
    PRODUCTION,
    SUPPORTED_HEAD_DIMS,
    AttnConfig,
    AttnLaunch,
    attn_config,
    qk_scale,
)
from h3gate.kernels.attention_gluon import forward_gluon_ws
from h3gate.kernels.attention_math import fwd_step, gather_rows, log2, packed_rows
from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, cached, check_tensor
from h3gate.kernels.exact import helper, rne, zeros
from h3gate.manifests.operators import DEVICE_CLASSES, PathTable

KERNEL_ID = "triton:h3gate.full_attention_fa2_fixedkv:v2"
_DTYPES = (torch.bfloat16, torch.float32)


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
    l_i = zeros((BLOCK_M,), tl.float32)
    acc = zeros((BLOCK_M, D), tl.float32)
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


# The kernel paths this module implements, by product: what ``manifests/operators/attention.yaml`` may name.
PATHS: dict[str, frozenset[str]] = {
    "forward": frozenset({"triton_pointer", "triton_tma", "gluon_warp_specialised"}),
    "backward": frozenset({"triton_pointer", "triton_tma", "gluon_warp_specialised"}),
}
# The device classes a path runs on, where not every class (TMA and Gluon are CUDA's; Gluon bfloat16 D = 128 only).
DEVICES: dict[str, frozenset[str]] = {
    "triton_tma": frozenset({"cuda-sm90", "cuda-other"}),
    "gluon_warp_specialised": frozenset({"cuda-sm90"}),
}


def paths(q: torch.Tensor) -> tuple[str, str]:
    """The declared forward and backward paths (:mod:`h3gate.kernels.selection`) of a call with queries like ``q``
    (B, S, nh, D) here."""
    key = ("head_dim", q.shape[3], dtype_name(q.dtype))
    device, s = selection.device_class(q.device), q.shape[1]
    fwd, bwd = (selection.path("attention", key, p, device, s, "triton_pointer") for p in ("forward", "backward"))
    return fwd, bwd


def check_paths(table: PathTable) -> None:
    """Every declared path is one this module implements, on device classes it runs on, and the Gluon kernels only
    for bfloat16 D = 128 with the backward tiling they run (kv 128 x 64, q 128 x 64): a ValueError names the first
    declaration that is not."""
    d, dtype = table.scope.head_dim, table.scope.dtype
    if d is None or (d, dtype) not in ATTN_TABLE:
        raise ValueError(f"scope: no tiling for head_dim {d} {dtype} (attention_config.ATTN_TABLE)")
    for i, rule in enumerate(table.rules):
        where = f"rules[{i}]: {rule.product} path {rule.path!r}"
        if rule.path not in PATHS.get(rule.product, ()):
            raise ValueError(f"{where} is not one of {sorted(PATHS.get(rule.product, ()))}")
        if not set(rule.devices) <= DEVICES.get(rule.path, set(DEVICE_CLASSES)):
            raise ValueError(f"{where} runs on {sorted(DEVICES[rule.path])} only")
        if rule.path == "gluon_warp_specialised" and (d, dtype) != (128, "bfloat16"):
            raise ValueError(f"{where} runs bfloat16 D = 128 only")
        if rule.product == "backward" and rule.path == "gluon_warp_specialised":
            check_tiling(attn_config(d, getattr(torch, dtype), rule.size[0]))
    if table.otherwise not in PATHS["forward"] & PATHS["backward"] or table.otherwise in DEVICES:
        raise ValueError(f"otherwise: {table.otherwise!r} is not a forward and backward path of every device class")


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttnConfig,
    order: torch.Tensor | None = None,
    launch: AttnLaunch = PRODUCTION,
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, nh*D) at q's dtype, packed rows; lse2 (B*nh, S) float32 in the log2 domain, canonical rows) by
    ``path`` (None: the declared one, :func:`paths`); ``launch``: how the Gluon kernel is launched
    (:class:`AttnLaunch`)."""
    path = path or paths(q)[0]
    if path == "gluon_warp_specialised":  # reads packed q, k and v in canonical order itself
        return forward_gluon_ws(q, k, v, cfg, order, launch)
    k, v = gather_rows(k, order), gather_rows(v, order)  # the walked operands, canonical and contiguous
    if path == "triton_tma":
        return attention_tma.forward_tma(q, k, v, cfg, order)
    if path != "triton_pointer":
        raise InputError(f"{OP}: forward path {path!r}: not one of {sorted(PATHS['forward'])}")
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


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    cfg: AttnConfig,
    order: torch.Tensor | None = None,
    launch: AttnLaunch = PRODUCTION,
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (B, S, nh, D) at q's dtype (packed rows), from the forward's ``out`` and FP32 ``lse2`` (canonical
    rows) and ``grad`` = dL/dout, walking ``order`` (None: packed order): delta, then the dK/dV and dQ walks by
    ``path`` (None: the declared one) - the Triton kernels (:mod:`h3gate.kernels.attention_bwd`, pointer or TMA loads)
    or the Gluon kernels (:mod:`h3gate.kernels.attention_bwd_gluon`, launched as ``launch`` says)."""
    path = path or paths(q)[1]
    if path not in PATHS["backward"]:
        raise InputError(f"{OP}: backward path {path!r}: not one of {sorted(PATHS['backward'])}")
    d = q.shape[3]
    delta = attention_bwd.delta(out, grad, order, q.shape[2])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if path == "gluon_warp_specialised":
        sm_scale, c = 1.0 / math.sqrt(d), qk_scale(d)
        both_walks(  # the walked operands packed: the kernels read them in canonical order themselves
            lambda: dkdv_gluon(q, k, v, grad, lse, delta, dk, dv, order, cfg, sm_scale, c, launch),
            lambda: dq_gluon(q, k, v, grad, lse, delta, dq, order, cfg, sm_scale, c, launch),
            q.device,
            launch.side_stream,
        )
    else:
        attention_bwd.walks(q, k, v, grad, lse, delta, (dq, dk, dv), cfg, order, path == "triton_tma")
    return dq, dk, dv


def launch_record(q: torch.Tensor) -> dict:
    """Which kernels run the forward and the backward of a call with queries like ``q`` (B, S, nh, D) here (the
    declared paths), and the tiling: evidence names what executed (every path has this contract's bytes)."""
    fwd, bwd = paths(q)
    cfg = attn_config(q.shape[3], q.dtype, q.shape[1])
    return {"tiling": cfg.tag, "forward": fwd, "backward": bwd, "interpreted": INTERPRET}


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
    def forward(ctx, q, k, v, order: torch.Tensor | None, cfg: AttnConfig, launch: AttnLaunch) -> torch.Tensor:
        out, lse = forward(q, k, v, cfg, order, launch)
        ctx.save_for_backward(q, k, v, out, lse, order)
        ctx.cfg, ctx.launch = cfg, launch
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, order = ctx.saved_tensors
        if grad.dtype != q.dtype:
            raise InputError(f"{OP}: grad_output: dtype {grad.dtype} != output dtype {q.dtype}")
        dq, dk, dv = backward(q, k, v, out, lse, grad.contiguous(), ctx.cfg, order, ctx.launch)
        return dq, dk, dv, None, None, None


def attention_with(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttnConfig,
    order: torch.Tensor | None = None,
    launch: AttnLaunch = PRODUCTION,
) -> torch.Tensor:
    """The strict attention with an explicit tiling and launch (tests and the GPU probes); validates like
    :func:`attention`."""
    _check(q, k, v)
    launches.note(OP, lambda: launch_record(q))
    return _Attention.apply(q, k, v, walk_order(order, q), cfg, launch)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Strict :func:`h3gate.ops.reference.attention`: (B, S, nh, D) x3 -> (B, S, nh*D), scale 1/sqrt(D); rows
    walked in ``order`` (int64 (S,): packed row of canonical row i; None: packed order)."""
    _check(q, k, v)
    launches.note(OP, lambda: launch_record(q))
    return _Attention.apply(q, k, v, walk_order(order, q), attn_config(q.shape[3], q.dtype, q.shape[1]), PRODUCTION)


h3_full_attention = attention
