"""Strict deterministic GEMM: ``linear(x, weight, bias)`` forward and backward, one fixed K order, no split. This
module holds the contract, the dispatch to the declared kernel paths and the operators' entry points; the kernels are
in :mod:`h3gate.kernels.gemm_triton`, :mod:`h3gate.kernels.gemm_swapped` and :mod:`h3gate.kernels.gemm_gluon`.

Contract (restated in ``manifests/operators/gemm.yaml``):

* maths - ``Y = X @ W^T + b`` with X (M, K) (any leading dims flattened), W (N, K) as nn.Linear, b (N,);
  output dtype = X's dtype (bfloat16 or float32).
* accumulation - FP32. BF16 operands go to tensor-core MMAs with an FP32 accumulator; FP32 operands use
  ``input_precision="ieee"`` (FMA dot, never TF32).
* reduction order - one program owns one (BLOCK_M x BLOCK_N) output tile and walks the reduction dimension in
  ascending BLOCK_K chunks, ``acc = dot(a_chunk, b_chunk, acc)``; inside a chunk the order is the MMA's / FMA dot's
  fixed order for that block shape. No split-K, no Stream-K, no atomics; a masked K tail contributes exact zeros.
* row invariance - the K tiling (BLOCK_K, ascending) comes from :func:`h3gate.kernels.gemm_configs.gemm_config`
  ``(role, N, K, dtype)``, never from M, and M is never a compile-time constant (``do_not_specialize``); the forward
  of the block's layers picks its tile *shape/order* from an M bucket (``gemm_configs.M_BUCKETS``: M < 512,
  M < 1024), and a persistent launch may cover its last columns with narrower tail tiles (``gemm_configs.tail_split``,
  chosen from the tile counts and the SM count); both leave each element's K walk unchanged (declared and measured
  in ``gemm_configs``); the swapped forward (``Y^T = W @ X^T``, :mod:`h3gate.kernels.gemm_swapped`) moves an element
  to another tile position, not its K walk. Triton still
  specialises on pointer alignment, which changes load vectorisation, never the maths. So row r's bytes do not
  depend on M, on its position, or on the other rows (they only share a program, never a sum).
* cast points - one rounding to the output dtype in the epilogue, after the bias is added in FP32
  (``out = cast(acc + float(b))``; the bf16 rounding is round-to-nearest-even).
* backward - ``dX = dY @ W`` (reduction over N, ascending chunks, same row invariance), ``dW = dY^T @ X``
  (reduction over the M rows in one ascending order inside one program, no split, no atomics),
  ``db = sum_m dY[m]`` (rows in ascending BLOCK_R chunks, each chunk summed by a fixed tree), all FP32-accumulated
  with one rounding to the parameter's dtype. Every operand (dY^T, W^T in the forward) is loaded as a tile of its
  stored row-major layout (coalesced along the contiguous axis; TMA descriptors in the ``tma`` variant) and
  transposed on chip; ``persistent``/``group_m`` only change which program owns a tile.
* kernel paths - which kernel runs a product is declared per layer, device class and M in the operator's manifest
  (``paths``; :func:`forward_plan`): ``triton`` (:mod:`h3gate.kernels.gemm_triton`), ``triton_swapped`` (the swapped
  forward for few rows), ``gluon_warp_specialised`` (Hopper, bfloat16: :mod:`h3gate.kernels.gemm_gluon`, the same
  per-element K walk - ascending BLOCK_K chunks of the same MMA instruction steps onto an FP32 accumulator from zero -,
  bias and rounding, its tiles and their order scheduled differently) and, for sibling projections (q, k, v) called
  together, ``gluon_grouped`` (one launch of that kernel over the weights' concatenation, :func:`linear_grouped`);
  the backward is always ``triton``. Every path's bytes equal the Triton kernel's on the H200; each path's tiling
  comes from ``gemm_configs`` (:func:`tiling`), and ``launch_record`` names the path that ran.
* compilation - every launch uses :data:`h3gate.kernels.common.STRICT_LAUNCH` (no FMA contraction, no FTZ).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.kernels import launches, selection
from h3gate.kernels.common import INTERPRET, aligned, check_tensor, needs_graph, num_sms
from h3gate.kernels.gemm_configs import GLUON_BUCKETS, GLUON_GROUPED, M_BUCKETS, GemmConfig, gemm_config, gluon_config
from h3gate.kernels.gemm_gluon import matmul_ws, matmul_ws_grouped
from h3gate.kernels.gemm_triton import colsum, matmul
from h3gate.manifests.operators import DEVICE_CLASSES, PathTable

KERNEL_ID = "triton:h3gate.gemm_fixedk_fp32acc:v1"
_DTYPES = (torch.bfloat16, torch.float32)


# -------------------------------------------------------------------------------------------------- the operator


def check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``x (..., K)``, ``weight (N, K)`` and ``bias (N,)`` of one dtype (bfloat16 or float32) on one device, each
    contiguous: a one-line InputError naming ``op`` and the argument otherwise."""
    check_tensor(op, "x", x, _DTYPES)
    if x.ndim < 1:
        raise InputError(f"{op}: x: expected at least 1 dim, got a scalar")
    check_tensor(op, "weight", weight, _DTYPES, ndim=2, device=x.device)
    if weight.dtype != x.dtype:
        raise InputError(f"{op}: weight: dtype {dtype_name(weight.dtype)} does not match x dtype {dtype_name(x.dtype)}")
    if weight.shape[1] != x.shape[-1]:
        raise InputError(
            f"{op}: weight: in_features {weight.shape[1]} != x last dim {x.shape[-1]} "
            f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})"
        )
    if bias is not None:
        check_tensor(op, "bias", bias, _DTYPES, ndim=1, device=x.device)
        if bias.dtype != x.dtype:
            raise InputError(f"{op}: bias: dtype {dtype_name(bias.dtype)} does not match x dtype {dtype_name(x.dtype)}")
        if bias.shape[0] != weight.shape[0]:
            raise InputError(f"{op}: bias: length {bias.shape[0]} != out_features {weight.shape[0]}")


# ------------------------------------------------------------------------------------------------- path selection

# The kernel paths this module implements, by product: what ``manifests/operators/gemm.yaml`` may name.
PATHS: dict[str, frozenset[str]] = {
    "forward": frozenset({"triton", "triton_swapped", "gluon_warp_specialised"}),
    "backward": frozenset({"triton"}),
    "grouped": frozenset({"gluon_grouped"}),
}
# The device classes a path runs on, where not every class: the Gluon kernels are Hopper's.
DEVICES: dict[str, frozenset[str]] = {
    "gluon_warp_specialised": frozenset({"cuda-sm90"}),
    "gluon_grouped": frozenset({"cuda-sm90"}),
}


def _tiling(path: str, n: int, k: int, dtype: torch.dtype, m: int) -> GemmConfig | None:
    if path == "gluon_warp_specialised":
        return gluon_config(n, k, dtype, m)
    if path == "gluon_grouped":
        return GLUON_GROUPED if n % GLUON_GROUPED.block_n == 0 and dtype == torch.bfloat16 else None
    cfg = gemm_config("fwd", n, k, dtype, m)
    return cfg if path in PATHS["forward"] and cfg.swap_ab == (path == "triton_swapped") else None


def tiling(path: str, n: int, k: int, dtype: torch.dtype, m: int) -> GemmConfig:
    """The tiling of ``path`` for the forward of the layer with weight (N, K) at ``dtype`` with ``m`` rows: the Gluon
    bucket's (``gluon_warp_specialised``), the grouped launch's (``gluon_grouped``), else the Triton tiling of
    :func:`h3gate.kernels.gemm_configs.gemm_config`, swapped exactly when the path is ``triton_swapped``. A declared
    path without its tiling is an InputError (the manifest and the tiling tables disagree)."""
    cfg = _tiling(path, n, k, dtype, m)
    if cfg is None:
        raise InputError(
            f"manifests/operators: gemm path {path!r} for weight ({n}, {k}) {dtype_name(dtype)} at M = {m}: "
            "no such tiling in h3gate.kernels.gemm_configs"
        )
    return cfg


def _path(x: torch.Tensor, weight: torch.Tensor, product: str) -> str | None:
    n, k = weight.shape
    key = ("weight", n, k, dtype_name(x.dtype))
    return selection.path("gemm", key, product, selection.device_class(x.device), x.numel() // k, "triton")


def forward_plan(x: torch.Tensor, weight: torch.Tensor) -> tuple[str, GemmConfig]:
    """The declared path (:mod:`h3gate.kernels.selection`) and its tiling for the forward of ``x (..., K) @ weight
    (N, K)^T`` here."""
    path = _path(x, weight, "forward")
    n, k = weight.shape
    return path, tiling(path, n, k, x.dtype, x.numel() // k)


def grouped_plan(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> GemmConfig | None:
    """The grouped launch's tiling where the layer declares ``gluon_grouped`` for two or three sibling weights of one
    shape and dtype at this M here, else None (one forward call a weight)."""
    if len(weights) not in (2, 3) or any(w.shape != weights[0].shape or w.dtype != x.dtype for w in weights):
        return None
    path = _path(x, weights[0], "grouped")
    n, k = weights[0].shape
    return None if path is None else tiling(path, n, k, x.dtype, x.numel() // k)


def _backward_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    path = _path(x, weight, "backward")
    if path not in PATHS["backward"]:
        raise InputError(f"manifests/operators: gemm backward path {path!r}: not one of {sorted(PATHS['backward'])}")
    return path


def check_paths(table: PathTable) -> None:
    """Every declared path of ``table`` runs on the device classes it is declared for and has its tiling at every M
    there (the path and the tiling are piecewise constant between the rules' and the tiling tables' bounds, so those
    bounds are the M checked); a ValueError names the first that does not."""
    if table.scope.weight is None:
        raise ValueError("scope: a GEMM table is scoped by its layer's weight (N, K)")
    n, k = table.scope.weight
    dtype = getattr(torch, table.scope.dtype)
    bounds = {1, *(b for b, _ in M_BUCKETS), *(b for b, _ in GLUON_BUCKETS if b is not None)}
    bounds |= {b for r in table.rules for b in r.size if b}
    for device in DEVICE_CLASSES:
        for product in ("forward", "grouped"):
            for m in sorted(bounds):
                path = table.path(device, product, m)
                if path is None:
                    continue
                if path not in PATHS[product]:
                    raise ValueError(f"{product} path {path!r} is not one of {sorted(PATHS[product])}")
                if device not in DEVICES.get(path, DEVICE_CLASSES):
                    raise ValueError(f"{device} {product} at M = {m}: {path!r} runs on {sorted(DEVICES[path])} only")
                if _tiling(path, n, k, dtype, m) is None:
                    raise ValueError(f"{device} {product} at M = {m}: {path!r} has no tiling for this layer there")
    check_tilings()


def check_tilings() -> None:
    """Every layer the small-M and Gluon tiling tables list is scoped by a declared table, and every Gluon tiling is
    reachable (a declared ``gluon_warp_specialised`` rule meets its M bucket): a ValueError names the first that is
    not."""
    found, _ = selection.tables("gemm")
    for buckets, kind in ((M_BUCKETS, "M_BUCKETS"), (GLUON_BUCKETS, "GLUON_BUCKETS")):
        lower = 0
        for bound, table in buckets:
            for _, n, k, dtype in table:
                paths = found.get(("weight", n, k, dtype))
                if paths is None:
                    raise ValueError(f"gemm_configs.{kind}: layer ({n}, {k}) {dtype} has no declared paths table")
                meets = (r.size[0] < (bound or r.size[0] + 1) and (r.size[1] is None or r.size[1] > lower)
                         for r in paths.rules if r.path == "gluon_warp_specialised")  # fmt: skip
                if kind == "GLUON_BUCKETS" and not any(meets):
                    raise ValueError(f"gemm_configs.GLUON_BUCKETS[M < {bound}]: ({n}, {k}) is never declared Gluon")
            lower = bound or lower


# ------------------------------------------------------------------------------------------------------ launches


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The one forward launch (autograd and no-grad paths): ``x (..., K) -> (..., N)``, by the declared path."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    path, cfg = forward_plan(x, weight)
    if path == "gluon_warp_specialised":  # contiguous, 16-byte aligned copies where needed: the same bytes
        x2, w2 = (aligned(t.contiguous()) for t in (x2, weight))
        matmul_ws(x2, w2, y, bias, cfg, num_sms(x.device))
    else:
        matmul(x2, weight, y, bias, cfg, a_trans=False, b_trans=True)
    return y.view(*x.shape[:-1], n)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str) -> torch.Tensor:
        y = forward(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        if gy.dtype != x.dtype:
            raise InputError(
                f"{ctx.op}: grad_output: dtype {dtype_name(gy.dtype)} != output dtype {dtype_name(x.dtype)}"
            )
        g2 = gy.reshape(-1, n).contiguous()  # a contiguous copy changes layout, never values
        x2 = x.reshape(-1, k)
        _backward_path(x, weight)  # the Triton kernel's: the only backward path
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx2 = torch.empty((g2.shape[0], k), dtype=x.dtype, device=x.device)
            matmul(g2, weight, dx2, None, gemm_config("dx", n, k, x.dtype), a_trans=False, b_trans=False)
            dx = dx2.view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = torch.empty((n, k), dtype=weight.dtype, device=x.device)
            matmul(g2, x2, dw, None, gemm_config("dw", n, k, x.dtype), a_trans=True, b_trans=False)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = colsum(g2, weight.dtype)
        return dx, dw, db, None


def launch_record(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The tilings :func:`linear` launches for ``x (..., K)`` and ``weight (N, K)`` here, per product (forward, dx,
    dw; every M bucket and load path has this contract's K walk, so the same bytes), the declared path that runs
    each (``kernel``) and whether TMA loads them."""
    n, k = weight.shape
    path, cfg = forward_plan(x, weight)
    bwd = _backward_path(x, weight)
    runs = {"forward": (path, cfg), "dx": (bwd, gemm_config("dx", n, k, x.dtype)),
            "dw": (bwd, gemm_config("dw", n, k, x.dtype))}  # fmt: skip
    cuda = x.device.type == "cuda"
    record: dict = {name: {"tiling": c.tag, "tma": bool(c.tma and cuda), "kernel": p} for name, (p, c) in runs.items()}
    return {**record, "interpreted": INTERPRET}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, op: str = "linear"):
    """Strict ``F.linear``: same signature, shapes and output dtype as :func:`h3gate.ops.reference.linear`.

    Without an autograd graph to build (grad mode off, or no argument requiring grad) the forward is launched
    directly, skipping ``autograd.Function.apply``: the same launch and bytes, less host time per call."""
    check_linear(op, x, weight, bias)
    launches.note(op, lambda: launch_record(x, weight))
    if needs_graph(x, weight, bias):
        return _Linear.apply(x, weight, bias, op)
    return forward(x, weight, bias)


def _operator(op: str, impl=None, what: str = "the strict deterministic GEMM"):
    """A module-level entry point per operator of ``impl`` (default :func:`linear`), so a bad input names the
    operator that received it."""

    target = linear if impl is None else impl

    @functools.wraps(target)
    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return target(x, weight, bias, op=op)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"``{op}``: {what} (see the module docstring for the contract)."
    return fn


h3_qkv_gemm = _operator("h3_qkv_gemm")


def linear_grouped(x: torch.Tensor, weights: Sequence[torch.Tensor], *, op: str = "linear") -> list[torch.Tensor]:
    """``[linear(x, w, op=op) for w in weights]`` for two or three sibling weights of one shape on the same ``x`` (q, k
    and v of a block), bitwise: one grouped Gluon launch where the layer declares ``gluon_grouped`` at this M here
    (:func:`grouped_plan`) and no argument needs an autograd graph, else one call per weight. The grouped launch
    (:func:`h3gate.kernels.gemm_gluon.matmul_ws_grouped`) computes the tiles of the weights' concatenation, each
    output element ``y[i, j] = sum_k x[i, k] w[j, k]`` the FP32 sum over ascending BLOCK_K chunks of that layer's
    contract, one rounding to bfloat16 - the walk of each weight's own launch; only which program holds a tile
    differs. Inputs are checked as :func:`linear` checks them, naming ``op``."""
    weights = tuple(weights)
    cfg = None if needs_graph(x, *weights) else grouped_plan(x, weights)
    if cfg is None:
        return [linear(x, w, op=op) for w in weights]
    for w in weights:
        check_linear(op, x, w, None)

    def record() -> dict:
        forward_ = {"tiling": cfg.tag, "tma": True, "kernel": "gluon_grouped"}
        return {**launch_record(x, weights[0]), "forward": forward_, "grouped": f"{len(weights)} weights, one launch"}

    launches.note(op, record)
    n, k = weights[0].shape
    x2 = aligned(x.reshape(-1, k).contiguous())
    ws = [aligned(w.contiguous()) for w in weights]
    ys = [torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device) for _ in ws]
    matmul_ws_grouped(x2, ws, ys, cfg, num_sms(x.device))
    return [y.view(*x.shape[:-1], n) for y in ys]


def _grouped(op: str):
    """``fn(x, weights)``: operator ``op`` on sibling weights (:func:`linear_grouped`); the graph executor groups
    sibling nodes through the bound operator's ``grouped`` attribute (:func:`h3gate.graph.execute.sibling_gemms`)."""

    def fn(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return linear_grouped(x, weights, op=op)

    return fn


h3_qkv_gemm.grouped = _grouped("h3_qkv_gemm")  # q, k, v (h3gate.graph.execute.sibling_gemms)
h3_attention_o_gemm = _operator("h3_attention_o_gemm")
h3_ffn_gate_up_gemm = _operator("h3_ffn_gate_up_gemm")
h3_ffn_down_gemm = _operator("h3_ffn_down_gemm")
adaln_projection_3mod = _operator("adaln_projection_3mod")
text_context_projection = _operator("text_context_projection")
final_adaln_projection = _operator("final_adaln_projection")
video_input_projection_fp32 = _operator("video_input_projection_fp32")
audio_input_projection_fp32 = _operator("audio_input_projection_fp32")
timestep_mlp_fp32 = _operator("timestep_mlp_fp32")
video_output_projection_fp32 = _operator("video_output_projection_fp32")
audio_output_projection_fp32 = _operator("audio_output_projection_fp32")
