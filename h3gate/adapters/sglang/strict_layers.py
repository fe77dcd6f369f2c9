"""The bound forwards of SGLang's leaf layers: its parallel linears and its RMSNorm modules, on its own parameters.

Each factory returns the function that stands as the module instance's ``forward`` while bound, with the module's
call contract (a linear returns ``(output, None)``), so that SGLang's callers and forward hooks see what they see
unbound. ``w`` is the module's weight, ``x`` its input, ``n`` the TP degree, ``r`` this rank:

    fused q|k|v (qkv_proj)   q, k, v = h3_qkv_gemm(x, w[j nd_r : (j+1) nd_r]) for j = 0, 1, 2 (row views of the fused
                             weight, one grouped call where the kernel has one), output cat(q, k, v); TPn:
                             ColumnLinear per slice with the full (nd, H) layer
    fc1 [gate | value]       h3_ffn_gate_up_gemm(x, w) on SGLang's own [gate | value] rows (the MLP swaps the output
                             halves for h3gate's [value | gate]: an element's K walk depends on the layer's (N, K), not
                             on the row's position); TPn: ColumnLinear, full (2F, H)
    out_proj, fc2            h3_attention_o_gemm / h3_ffn_down_gemm; TPn: RowLinear on the rank's K columns, full
                             (H, K): the segmented-8 subtree, gathered, the fixed tree, one rounding - every rank
                             holds the full output (SGLang's all-reduce does not run)
    patch / condition proj,  the node's operator on ``x.to(w.dtype)`` with the layer's full weight and bias (TPn: the
    time MLP, output heads   shards gathered once); SGLang's column-sharded outputs (heads) get the rank's columns
    AdaLN projections        ``op(adaln_silu_cast(temb, w.dtype), w, b)`` with h3gate's time embedding of this forward
                             (SGLang's own silu(t_emb).to(bf16) argument is not read); rank's columns at TPn
    RMSNorm                  h3_rmsnorm (refiner norms, final norm); block norm1 / norm2 and the final norm take
                             ``(x, shift, scale, indices)``: h3_rmsnorm_modulate / final_adaln_out in one op
    q_norm / k_norm          (T, h, D) -> h3_qk_rmsnorm_d128 on (T, h D); TPn: QkNormGrouped on the rank's heads

Every operator call goes through :class:`~h3gate.adapters.sglang.strict_ops.OpCaller` under its h3gate node name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h3gate.adapters.sglang.strict_ops import Bound
from h3gate.errors import InputError
from h3gate.kernels.tp_layers import ColumnLinear, QkNormGrouped, RowLinear

Forward = Callable[..., object]


def node_prefix(module: str) -> str:
    """h3gate's node prefix of an SGLang body module (``blocks.3`` -> ``block.3.``, ``token_refiner.blocks.0`` ->
    ``refiner.0.``)."""
    parts = module.split(".")
    if parts[0] == "blocks":
        return f"block.{parts[1]}."
    if parts[:2] == ["token_refiner", "blocks"]:
        return f"refiner.{parts[2]}."
    raise InputError(f"sglang strict binding: {module}: not a transformer or refiner block")


def qkv(b: Bound, layer: torch.nn.Module, prefix: str) -> Forward:
    nodes = (f"{prefix}q_proj", f"{prefix}k_proj", f"{prefix}v_proj")

    def forward(x: torch.Tensor):
        w = layer.weight
        n = w.shape[0] // 3
        weights = [w[j * n : (j + 1) * n] for j in range(3)]
        x = x.contiguous()
        if b.tp.degree == 1:
            outs = b.ops.grouped(nodes, "h3_qkv_gemm", x, weights)
        else:
            full = (n * b.tp.degree, w.shape[1])
            outs = [b.ops.tp(node, "h3_qkv_gemm", "ColumnLinear", ColumnLinear.apply, x, wj, full, False, b.tp.group)
                    for node, wj in zip(nodes, weights, strict=True)]  # fmt: skip
        return torch.cat(outs, dim=-1), None

    return forward


def column(b: Bound, layer: torch.nn.Module, node: str, op: str) -> Forward:
    def forward(x: torch.Tensor):
        w, x = layer.weight, x.contiguous()
        if b.tp.degree == 1:
            return b.ops(node, op, x, w), None
        full = (w.shape[0] * b.tp.degree, w.shape[1])
        return b.ops.tp(node, op, "ColumnLinear", ColumnLinear.apply, x, w, full, True, b.tp.group), None

    return forward


def row(b: Bound, layer: torch.nn.Module, node: str, op: str) -> Forward:
    def forward(x: torch.Tensor):
        w, x = layer.weight, x.contiguous()
        if b.tp.degree == 1:
            return b.ops(node, op, x, w), None
        full = (w.shape[0], w.shape[1] * b.tp.degree)
        return b.ops.tp(node, op, "RowLinear", RowLinear.apply, x, w, full, b.tp.group), None

    return forward


def replicated(b: Bound, name: str, layer: torch.nn.Module, node: str, op: str, dim: int, local: bool) -> Forward:
    """A layer h3gate runs replicated (module docstring); ``dim`` its shard dimension, ``local`` whether SGLang
    expects the rank's output columns."""

    def forward(x: torch.Tensor):
        w, bias = b.tp.full_weights(name, layer, dim)
        out = b.ops(node, op, x.to(w.dtype).contiguous(), w, bias)
        return (b.tp.columns(out) if local else out), None

    return forward


def adaln(b: Bound, name: str, layer: torch.nn.Module, node: str, op: str) -> Forward:
    def forward(x: torch.Tensor):
        temb = b.live(node).temb
        if temb is None:
            raise InputError(f"sglang strict binding: {node}: no time embedding from the bound time embedder")
        w, bias = b.tp.full_weights(name, layer, 0)
        act = b.ops(node, "adaln_silu_cast", temb, w.dtype)
        return b.tp.columns(b.ops(node, op, act, w, bias)), None

    return forward


def _eps(norm: torch.nn.Module, x: torch.Tensor) -> float:
    return float(norm.eps) if norm.eps is not None else float(torch.finfo(x.dtype).eps)


def rms(b: Bound, norm: torch.nn.Module, node: str) -> Forward:
    def forward(x: torch.Tensor):
        return b.ops(node, "h3_rmsnorm", x.contiguous(), norm.weight, _eps(norm, x))

    return forward


def modulated(b: Bound, norm: torch.nn.Module, node: str, op: str) -> Forward:
    def forward(x: torch.Tensor, shift=None, scale=None, indices=None):
        if shift is None or scale is None or indices is None:
            raise InputError(f"sglang strict binding: {node}: the bound modulated norm needs shift, scale, indices")
        return b.ops(node, op, x.contiguous(), norm.weight, shift, scale, indices, _eps(norm, x))

    return forward


def qk(b: Bound, norm: torch.nn.Module, node: str, total_heads: int) -> Forward:
    def forward(x: torch.Tensor):
        heads = x.shape[-2]
        flat = x.reshape(*x.shape[:-2], heads * x.shape[-1]).contiguous()
        if b.tp.degree == 1:
            return b.ops(node, "h3_qk_rmsnorm_d128", flat, norm.weight, heads, _eps(norm, x))
        first = b.tp.rank * total_heads // b.tp.degree
        args = (flat[None], norm.weight, total_heads, first, _eps(norm, x), b.tp.group)
        return b.ops.tp(node, "h3_qk_rmsnorm_d128", "QkNormGrouped", lambda *a: QkNormGrouped.apply(*a)[0], *args)

    return forward
