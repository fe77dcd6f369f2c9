"""The node functions the transformer block and the token-refiner block share, op for op (diffusers 0.42.1).

Both blocks run the same attention and FFN body on their pre-norm output ``norm1`` / ``norm2``::

    q/k/v_proj     q = n1 @ Wq.T (no bias)                 (B, S, nh*D)
    q_norm/k_norm  rmsnorm over D per head, qk_norm_eps    (B, S, nh, D)
    attention      SDPA(q, k, v_proj unflattened to (nh, D)), non-causal, unmasked, scale 1/sqrt(D); the
                   transformer block also passes its ``attention_order`` (the strict kernel's canonical walk
                   order; the provider ignores it), the refiner none (its text stream is never permuted)
    o_proj         a @ Wo.T                                (B, S, H)
    ffn_gate_up    u = n2 @ W1.T                           (B, S, 2F)
    swiglu         s = u[..., :F] * silu(u[..., F:])       (B, S, F)
    ffn_down       d = s @ W2.T                            (B, S, H)

Only the attention's q and k sources differ: the transformer block rotates them first (``rope_q``/``rope_k``), the
refiner reads ``q_norm``/``k_norm``. No cast anywhere: every op runs at its operands' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from h3gate.graph.core import OpTable

Inputs = Mapping[str, torch.Tensor]
NodeFn = Callable[[OpTable, Inputs, Inputs], torch.Tensor]
BodySpec = tuple[str, tuple[str, ...], NodeFn]  # (op, inputs, fn)
# The body's parameters, block-relative diffusers names, in checkpoint order (both blocks start with these).
BODY_PARAMS: tuple[str, ...] = (
    "norm1.weight",
    "attn.to_q.weight",
    "attn.to_k.weight",
    "attn.to_v.weight",
    "attn.norm_q.weight",
    "attn.norm_k.weight",
    "attn.to_out.0.weight",
    "norm2.weight",
    "ff.net.0.proj.weight",
    "ff.net.2.weight",
)


@dataclass(frozen=True)
class Gemm:
    """A bias-free linear node function, ``ops[op](x[source], p[weight])``. Nodes whose functions are Gemms of one
    operator on one source (q, k, v) may run as one grouped launch (:func:`h3gate.graph.execute.sibling_gemms`)."""

    op: str
    source: str
    weight: str

    def __call__(self, ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops[self.op](x[self.source], p[self.weight])


def gemm(op: str, source: str, weight: str) -> NodeFn:
    """``ops[op](x[source], p[weight])``: a bias-free linear (a :class:`Gemm`)."""
    return Gemm(op, source, weight)


def body_specs(heads: int, qk_eps: float, q: str, k: str, order: str | None = None) -> dict[str, BodySpec]:
    """Node name -> (op, inputs, fn) for the shared body; ``attention`` reads its q and k from nodes ``q`` and ``k``
    and, with ``order``, its walk order from that input (else ``order=None``: packed order)."""

    def qk_norm(source: str, weight: str) -> NodeFn:
        def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
            return ops["h3_qk_rmsnorm_d128"](x[source], p[weight], heads, qk_eps)

        return fn

    def attention(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        walk = None if order is None else x[order]
        return ops["h3_full_attention"](x[q], x[k], x["v_proj"].unflatten(-1, (heads, -1)), order=walk)

    def swiglu(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["h3_swiglu"](x["ffn_gate_up"])

    qkv, o, up, down = "h3_qkv_gemm", "h3_attention_o_gemm", "h3_ffn_gate_up_gemm", "h3_ffn_down_gemm"
    return {
        "q_proj": (qkv, ("norm1",), gemm(qkv, "norm1", "attn.to_q.weight")),
        "k_proj": (qkv, ("norm1",), gemm(qkv, "norm1", "attn.to_k.weight")),
        "v_proj": (qkv, ("norm1",), gemm(qkv, "norm1", "attn.to_v.weight")),
        "q_norm": ("h3_qk_rmsnorm_d128", ("q_proj",), qk_norm("q_proj", "attn.norm_q.weight")),
        "k_norm": ("h3_qk_rmsnorm_d128", ("k_proj",), qk_norm("k_proj", "attn.norm_k.weight")),
        "attention": ("h3_full_attention", (q, k, "v_proj", *((order,) if order else ())), attention),
        "o_proj": (o, ("attention",), gemm(o, "attention", "attn.to_out.0.weight")),
        "ffn_gate_up": (up, ("norm2",), gemm(up, "norm2", "ff.net.0.proj.weight")),
        "swiglu": ("h3_swiglu", ("ffn_gate_up",), swiglu),
        "ffn_down": (down, ("swiglu",), gemm(down, "swiglu", "ff.net.2.weight")),
    }
