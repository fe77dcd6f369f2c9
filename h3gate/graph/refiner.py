"""One token-refiner block as 14 named nodes (diffusers 0.42.1 ``MiniMaxH3TokenRefinerBlock``, op for op).

A plain pre-norm block over the projected text stream: no AdaLN, no rotary embedding, no gate. Graph input
``hidden_states`` (B, Nt, H) bf16; parameters keyed block-relative like the transformer block's body
(``norm1.weight``, ``attn.to_q.weight``, ..., ``ff.net.2.weight``). Output ``residual_mlp``::

    norm1          n1 = rmsnorm(x, eps)                         (B, Nt, H)
    q/k/v_proj     q = n1 @ Wq.T (no bias)                      (B, Nt, nh*D)
    q_norm/k_norm  rmsnorm over D per head                      (B, Nt, nh, D)
    attention      SDPA over the Nt text rows, no mask, no RoPE (B, Nt, nh*D)
    o_proj         a @ Wo.T                                     (B, Nt, H)
    residual_attn  h = x + o
    norm2          n2 = rmsnorm(h, eps)
    ffn_gate_up    u = n2 @ W1.T                                (B, Nt, 2F)
    swiglu         s = u[..., :F] * silu(u[..., F:])
    ffn_down       d = s @ W2.T
    residual_mlp   y = h + d

Every op runs at the operands' dtype (BF16 in the checkpoint); no explicit cast anywhere in the block.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from h3gate.graph.body_nodes import BODY_PARAMS, body_specs
from h3gate.graph.core import Graph, Node, OpTable
from h3gate.manifests.model_config import ModelConfig
from h3gate.ops.registry import spec as spec_of

REFINER_INPUTS: tuple[str, ...] = ("hidden_states",)
REFINER_NODES: tuple[str, ...] = (
    "norm1",
    "q_proj",
    "k_proj",
    "v_proj",
    "q_norm",
    "k_norm",
    "attention",
    "o_proj",
    "residual_attn",
    "norm2",
    "ffn_gate_up",
    "swiglu",
    "ffn_down",
    "residual_mlp",
)
REFINER_PARAMS: tuple[str, ...] = BODY_PARAMS

Inputs = Mapping[str, torch.Tensor]


def build_refiner_graph(cfg: ModelConfig) -> Graph:
    """The 14-node graph of one token-refiner block for ``cfg``."""
    heads, eps, qk_eps = cfg.num_attention_heads, cfg.norm_eps, cfg.qk_norm_eps

    def norm(source: str, weight: str):
        def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
            return ops["h3_rmsnorm"](x[source], p[weight], eps)

        return fn

    def add(source: str, branch: str):
        def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
            return ops["residual_add"](x[source], x[branch])

        return fn

    body = body_specs(heads, qk_eps, "q_norm", "k_norm")
    spec = (
        ("norm1", "h3_rmsnorm", ("hidden_states",), norm("hidden_states", "norm1.weight"), "rmsnorm(x)"),
        ("q_proj", *body["q_proj"], "n1 @ Wq.T"),
        ("k_proj", *body["k_proj"], "n1 @ Wk.T"),
        ("v_proj", *body["v_proj"], "n1 @ Wv.T"),
        ("q_norm", *body["q_norm"], "rmsnorm over D"),
        ("k_norm", *body["k_norm"], "rmsnorm over D"),
        ("attention", *body["attention"], "SDPA over text rows"),
        ("o_proj", *body["o_proj"], "a @ Wo.T"),
        ("residual_attn", "residual_add", ("hidden_states", "o_proj"), add("hidden_states", "o_proj"), "x + o"),
        ("norm2", "h3_rmsnorm", ("residual_attn",), norm("residual_attn", "norm2.weight"), "rmsnorm(h)"),
        ("ffn_gate_up", *body["ffn_gate_up"], "n2 @ W1.T"),
        ("swiglu", *body["swiglu"], "u[:F] * silu(u[F:])"),
        ("ffn_down", *body["ffn_down"], "s @ W2.T"),
        ("residual_mlp", "residual_add", ("residual_attn", "ffn_down"), add("residual_attn", "ffn_down"), "h + d"),
    )
    nodes = tuple(
        Node(name, spec_of(op).rfc_row, (op,), inputs, fn, meta={"dtype": "activation dtype (BF16)", "maths": maths})
        for name, op, inputs, fn, maths in spec
    )
    return Graph("refiner", nodes, REFINER_INPUTS, "residual_mlp")
