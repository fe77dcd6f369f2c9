"""One MiniMax-H3 transformer block as 17 named nodes (diffusers 0.42.1 ``MiniMaxH3TransformerBlock``, op for op).

Graph inputs: ``hidden_states`` (B, S, H) bf16, ``temb`` (T, E) fp32, ``adaln_indices`` (S,) int64 (row of the
(3T, H) AdaLN tables = ``timestep_index * 3 + token_tag``), ``rope_cos``/``rope_sin`` (S, R) fp32,
``attention_order`` (S,) int64 (the packed row of canonical row i, :func:`h3gate.layout.canonical_order`; only the
strict attention reads it, the provider's SDPA ignores it). Parameters are
keyed by block-relative diffusers names (``norm1.weight``, ``attn.to_q.weight``, ...). Output: ``residual_mlp``.

Maths (``tab[k]`` is the k-th (3T, H) view of the AdaLN projection, rows gathered by ``adaln_indices``)::

    adaln_projection  P = linear(silu(temb).to(W.dtype), W, b)             (T, 18H)
    norm1             n1 = rmsnorm(x) * (1 + scale_msa[idx]) + shift_msa[idx]
    q/k/v_proj        q = n1 @ Wq.T  (no bias)                               (B, S, nh*D)
    q_norm/k_norm     rmsnorm over D per head                                (B, S, nh, D)
    rope_q/rope_k     rotate-half MM-RoPE on the first R of D channels
    attention         SDPA, non-causal, unmasked, scale 1/sqrt(D)            (B, S, nh*D); strict: rows walked
                      in attention_order (gathered, attended, scattered back: copies)
    o_proj            a @ Wo.T                                               (B, S, H)
    residual_attn     h = x + gate_msa[idx] * o
    norm2             n2 = rmsnorm(h) * (1 + scale_mlp[idx]) + shift_mlp[idx]
    ffn_gate_up       u = n2 @ W1.T                                          (B, S, 2F)
    swiglu            s = u[..., :F] * silu(u[..., F:])                      (B, S, F)
    ffn_down          d = s @ W2.T                                           (B, S, H)
    residual_mlp      y = h + gate_mlp[idx] * d

Every cast is the provider's: the only explicit one is ``silu(temb)`` (FP32) -> the projection dtype (BF16); the
RoPE tables are cast to the activation dtype inside ``mm_rope``; everything else stays at the operands' dtype.
The golden runs the same nodes on float64 tensors (the references take every dtype from their inputs).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.graph.body_nodes import BODY_PARAMS, body_specs
from h3gate.graph.core import Graph, Node, OpTable
from h3gate.inventory import expected_inventory
from h3gate.manifests.model_config import ModelConfig
from h3gate.ops import reference
from h3gate.paths import display

GRAPH_INPUTS: tuple[str, ...] = ("hidden_states", "temb", "adaln_indices", "rope_cos", "rope_sin", "attention_order")
BLOCK_NODES: tuple[str, ...] = (
    "adaln_projection",
    "norm1",
    "q_proj",
    "k_proj",
    "v_proj",
    "q_norm",
    "k_norm",
    "rope_q",
    "rope_k",
    "attention",
    "o_proj",
    "residual_attn",
    "norm2",
    "ffn_gate_up",
    "swiglu",
    "ffn_down",
    "residual_mlp",
)
BLOCK_PARAMS: tuple[str, ...] = (
    *BODY_PARAMS,
    "adaln_proj.linear.weight",
    "adaln_proj.linear.bias",
)
# Order of the six (3T, H) views of the AdaLN projection (diffusers' chunk order).
SHIFT_MSA, SCALE_MSA, GATE_MSA, SHIFT_MLP, SCALE_MLP, GATE_MLP = range(6)

Inputs = Mapping[str, torch.Tensor]


def _meta(dtype: str, casts: str, maths: str) -> dict[str, str]:
    return {"dtype": dtype, "casts": casts, "maths": maths}


def _table(x: Inputs, k: int, hidden: int) -> torch.Tensor:
    """The k-th (3T, H) view of the AdaLN projection."""
    return reference.adaln_table(x["adaln_projection"], hidden)[k]


def _adaln_projection(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
    w = p["adaln_proj.linear.weight"]
    act = ops["adaln_silu_cast"](x["temb"], w.dtype)
    return ops["adaln_projection_3mod"](act, w, p["adaln_proj.linear.bias"])


def _norm(source: str, weight: str, shift: int, scale: int, hidden: int, eps: float):
    def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        shift_t, scale_t = _table(x, shift, hidden), _table(x, scale, hidden)
        return ops["h3_rmsnorm_modulate"](x[source], p[weight], shift_t, scale_t, x["adaln_indices"], eps)

    return fn


def _rope_node(w: str) -> Node:
    """rope_q / rope_k on q_norm / k_norm."""
    source = f"{w}_norm"

    def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["h3_mm_rope_3axis_partial"](x[source], x["rope_cos"], x["rope_sin"])

    rope = "h3_mm_rope_3axis_partial"
    return Node(f"rope_{w}", rope, (rope,), (source, "rope_cos", "rope_sin"), fn, meta=_meta(_BF16, *_ROPE))


def _residual(source: str, branch: str, gate: int, hidden: int):
    def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["adaln_gate_residual"](x[source], x[branch], _table(x, gate, hidden), x["adaln_indices"])

    return fn


_BF16, _ACC = "activation dtype (BF16)", "accumulate wider, one rounding to BF16"
_MOD = "(3T, H) AdaLN views of adaln_projection gathered by adaln_indices"
_NORM_CASTS = "none: nn.RMSNorm at BF16, modulation at BF16"
_ROPE = ("FP32 cos/sin cast to BF16 first", "x*cos + rotate_half(x)*sin on R of D, rest copied")
_GATE_CASTS = "none: gate * y rounded, then the add rounded (BF16)"


def _attention_half(cfg: ModelConfig, shared) -> tuple[Node, ...]:
    """adaln_projection .. residual_attn: the AdaLN projection, norm1, q/k/v, their norms and RoPE, attention, o."""
    hidden, eps = cfg.hidden_size, cfg.norm_eps
    qk_norm = "unflatten to (nh, D), rmsnorm over D"
    return (
        Node(
            "adaln_projection",
            "adaln_projection_3mod",
            ("adaln_silu_cast", "adaln_projection_3mod"),
            ("temb",),
            _adaln_projection,
            row_dim=None,
            meta=_meta(
                "temb FP32 in, (T, 18H) at the projection dtype (BF16) out",
                "silu at FP32, one cast to the projection dtype, then the BF16 linear with bias",
                "linear(silu(temb).to(W.dtype), W, b), viewed as six (3T, H) tables",
            ),
        ),
        Node(
            "norm1",
            "h3_rmsnorm",
            ("h3_rmsnorm_modulate",),
            ("hidden_states", "adaln_projection", "adaln_indices"),
            _norm("hidden_states", "norm1.weight", SHIFT_MSA, SCALE_MSA, hidden, eps),
            meta=_meta(_BF16, _NORM_CASTS, f"rmsnorm(x) * (1 + scale) + shift; {_MOD}"),
        ),
        shared("q_proj", _meta(_BF16, _ACC, "n1 @ Wq.T, H -> nh*D")),
        shared("k_proj", _meta(_BF16, _ACC, "n1 @ Wk.T, H -> nh*D")),
        shared("v_proj", _meta(_BF16, _ACC, "n1 @ Wv.T, H -> nh*D")),
        shared("q_norm", _meta(_BF16, "none: nn.RMSNorm over D at BF16", qk_norm)),
        shared("k_norm", _meta(_BF16, "none: nn.RMSNorm over D at BF16", qk_norm)),
        _rope_node("q"),
        _rope_node("k"),
        shared(
            "attention",
            _meta(
                _BF16,
                "the SDPA backend's own; output type_as(q)",
                "softmax(q k^T / sqrt(D)) v over all S rows (strict: walked in attention_order)",
            ),
        ),
        shared("o_proj", _meta(_BF16, _ACC, "a @ Wo.T, nh*D -> H")),
        Node(
            "residual_attn",
            "adaln_gate_residual",
            ("adaln_gate_residual",),
            ("hidden_states", "o_proj", "adaln_projection", "adaln_indices"),
            _residual("hidden_states", "o_proj", GATE_MSA, hidden),
            meta=_meta(_BF16, _GATE_CASTS, f"x + gate_msa * o; {_MOD}"),
        ),
    )


def _mlp_half(cfg: ModelConfig, shared) -> tuple[Node, ...]:
    """norm2 .. residual_mlp: the modulated norm, the SwiGLU feed-forward and the gated residual."""
    hidden, eps = cfg.hidden_size, cfg.norm_eps
    return (
        Node(
            "norm2",
            "h3_rmsnorm",
            ("h3_rmsnorm_modulate",),
            ("residual_attn", "adaln_projection", "adaln_indices"),
            _norm("residual_attn", "norm2.weight", SHIFT_MLP, SCALE_MLP, hidden, eps),
            meta=_meta(_BF16, _NORM_CASTS, f"rmsnorm(h) * (1 + scale) + shift; {_MOD}"),
        ),
        shared("ffn_gate_up", _meta(_BF16, _ACC, "n2 @ W1.T, H -> 2F (value | gate)")),
        shared("swiglu", _meta(_BF16, "none: silu and product each rounded to BF16", "u[:F] * silu(u[F:])")),
        shared("ffn_down", _meta(_BF16, _ACC, "s @ W2.T, F -> H")),
        Node(
            "residual_mlp",
            "adaln_gate_residual",
            ("adaln_gate_residual",),
            ("residual_attn", "ffn_down", "adaln_projection", "adaln_indices"),
            _residual("residual_attn", "ffn_down", GATE_MLP, hidden),
            meta=_meta(_BF16, _GATE_CASTS, f"h + gate_mlp * d; {_MOD}"),
        ),
    )


def build_block_graph(cfg: ModelConfig, layer: int = 0) -> Graph:
    """The 17-node graph of block ``layer`` for ``cfg``; the node functions close over widths and epsilons."""
    body = body_specs(cfg.num_attention_heads, cfg.qk_norm_eps, "rope_q", "rope_k", "attention_order")

    def shared(name: str, meta: dict[str, str]) -> Node:
        op, inputs, fn = body[name]
        return Node(name, op, (op,), inputs, fn, meta=meta)

    nodes = (*_attention_half(cfg, shared), *_mlp_half(cfg, shared))
    nodes = tuple(Node(n.name, n.owner_row, n.ops, n.inputs, n.fn, n.row_dim, layer, n.step, n.meta) for n in nodes)
    return Graph(f"block{layer}", nodes, GRAPH_INPUTS, "residual_mlp")


def row_widths(cfg: ModelConfig) -> dict[str, int]:
    """Elements per packed row of every value of the block graph (``hidden_states`` and each node output; the AdaLN
    projection has timestep rows, 0 here): what a streamed execution holds per row (``runs/setup.py``)."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    wide = {"q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "rope_q", "rope_k", "attention"}
    widths = {"hidden_states": h, "adaln_projection": 0, "ffn_gate_up": 2 * f, "swiglu": f}
    return {**widths, **{n: (nd if n in wide else h) for n in BLOCK_NODES if n not in widths}}


def block_param_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """Block-relative name -> (shape, dtype) from the checkpoint inventory of ``cfg``."""
    prefix = f"transformer_blocks.{layer}."
    found = {s.name[len(prefix) :]: (s.shape, s.dtype) for s in expected_inventory(cfg) if s.name.startswith(prefix)}
    return {k: found[k] for k in BLOCK_PARAMS}


def block_params(source, layer: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The 12 parameters of block ``layer`` from a weight source, keyed by block-relative name.

    Each tensor is read lazily (one at a time) and checked against the inventory's shape and dtype for the
    source's config; a missing or mismatched tensor is an :class:`InputError` naming it.
    """
    cfg = source.config()
    if cfg is None:
        raise InputError("weight source: no config to check block tensors against")
    if layer < 0 or layer >= cfg.num_layers:
        raise InputError(f"block {layer}: outside the config's {cfg.num_layers} transformer blocks")
    expected = block_param_shapes(cfg, layer)
    have = set(source.names())
    where = getattr(source, "path", None)
    origin = f"checkpoint {display(where)}" if where is not None else "synthetic weights"
    missing = [f"transformer_blocks.{layer}.{k}" for k in BLOCK_PARAMS if f"transformer_blocks.{layer}.{k}" not in have]
    if missing:
        raise InputError(f"{origin}: {missing[0]}: missing (block {layer} needs all {len(BLOCK_PARAMS)} block tensors)")
    params: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in expected.items():
        name = f"transformer_blocks.{layer}.{key}"
        tensor = source.load(name, device, check_finite=True)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != getattr(torch, dtype):
            raise InputError(
                f"{origin}: {name}: {tuple(tensor.shape)} {dtype_name(tensor.dtype)}, expected {tuple(shape)} {dtype}"
            )
        params[key] = tensor
    return params
