"""Real tensor parallelism of the block and refiner bodies: sharded weights, divided GEMMs, merged reductions.

Rank ``r`` of TP``n`` owns heads ``[r nh/n, (r+1) nh/n)`` and FFN channels ``[r F/n, (r+1) F/n)`` (chunk r; a plan
may permute the chunks over the ranks, the merges then combine them in chunk order) and holds only those shards of
the split weights (:func:`shard_params`):

    q/k/v_proj   ColumnLinear on W rows of its heads          (B, S, nh/n * D), no communication
    q/k_norm     QkNormGrouped on its heads (weight gradient: its head groups, all-gathered, the fixed tree)
    rope, attention, swiglu   on its heads / channels, unchanged kernels
    o_proj       RowLinear on W columns of its heads: segmented-8 subtree, all-gather (FP32), tree, one rounding
    ffn_gate_up  ColumnLinear (halves) on W rows [value chunk | gate chunk]
    ffn_down     RowLinear on W columns of its channels

Everything else (embeddings, AdaLN projections, norms, residuals, timestep MLP, heads) is replicated: every rank
runs it on identical bytes. Every GEMM's FLOPs of Q/K/V, O, gate/up and down are divided by n. The merge order is
the one-device ``seg8`` operators' (:mod:`h3gate.kernels.tp_layers`), so TPn equals TP1 byte for byte by
construction. :class:`Shard` names the slice of every node value and parameter a rank holds, for the comparison.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from h3gate.graph.execute import NodeOverride
from h3gate.kernels.tp_layers import ColumnLinear, MergeGroup, QkNormGrouped, RowLinear

HEAD_NODES = ("q_norm", "k_norm", "rope_q", "rope_k")  # (B, S, heads, D)
FLAT_HEAD_NODES = ("q_proj", "k_proj", "v_proj", "attention")  # (B, S, heads * D)
COLUMN_WEIGHTS = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")


@dataclass(frozen=True)
class Shard:
    """Which slice of a value or parameter a rank holds: ``kind`` in ``full``, ``cols`` (last dim), ``heads``
    (dim -2), ``pairs`` (the last dim's value and gate halves, ``half`` wide each), ``rows`` / ``wcols`` / ``wpairs``
    (a weight's dim 0 / dim 1 / dim 0 in halves); ``[lo, hi)`` the logical range."""

    kind: str = "full"
    lo: int = 0
    hi: int = 0
    half: int = 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This shard of the full tensor ``t`` (a contiguous copy)."""
        k, lo, hi, f = self.kind, self.lo, self.hi, self.half
        if k == "full":
            return t
        if k in ("cols", "wcols"):
            return t[..., lo:hi].contiguous()
        if k == "heads":
            return t[..., lo:hi, :].contiguous()
        if k == "rows":
            return t[lo:hi].contiguous()
        if k == "pairs":
            return torch.cat([t[..., lo:hi], t[..., f + lo : f + hi]], dim=-1)
        if k == "wpairs":
            return torch.cat([t[lo:hi], t[f + lo : f + hi]], dim=0)
        raise ValueError(f"shard kind {k!r}")


@dataclass(frozen=True)
class TpRank:
    """Rank ``rank`` of TP``degree`` for a config: its heads and FFN channels (those of its chunk, ``group.chunk``:
    its rank unless the plan permutes them), and the merge group of its TP group."""

    degree: int
    rank: int
    heads: int
    head_dim: int
    hidden: int
    ffn: int
    group: MergeGroup

    @property
    def chunk(self) -> int:
        return self.group.chunk

    @property
    def head_range(self) -> tuple[int, int]:
        return self.chunk * self.heads // self.degree, (self.chunk + 1) * self.heads // self.degree

    @property
    def ffn_range(self) -> tuple[int, int]:
        return self.chunk * self.ffn // self.degree, (self.chunk + 1) * self.ffn // self.degree

    def value_shard(self, local_name: str) -> Shard:
        h0, h1 = self.head_range
        f0, f1 = self.ffn_range
        if self.degree == 1:
            return Shard()
        if local_name in FLAT_HEAD_NODES:
            return Shard("cols", h0 * self.head_dim, h1 * self.head_dim)
        if local_name in HEAD_NODES:
            return Shard("heads", h0, h1)
        if local_name == "ffn_gate_up":
            return Shard("pairs", f0, f1, self.ffn)
        if local_name == "swiglu":
            return Shard("cols", f0, f1)
        return Shard()

    def param_shard(self, local_name: str) -> Shard:
        """The shard of a block-relative parameter name (``attn.to_q.weight``, ...)."""
        h0, h1 = self.head_range
        f0, f1 = self.ffn_range
        d = self.head_dim
        if self.degree == 1:
            return Shard()
        if local_name in COLUMN_WEIGHTS:
            return Shard("rows", h0 * d, h1 * d)
        if local_name == "attn.to_out.0.weight":
            return Shard("wcols", h0 * d, h1 * d)
        if local_name == "ff.net.0.proj.weight":
            return Shard("wpairs", f0, f1, self.ffn)
        if local_name == "ff.net.2.weight":
            return Shard("wcols", f0, f1)
        return Shard()


def body_prefix(name: str) -> tuple[str, str] | None:
    """``(node prefix, local name)`` of a block or refiner body node (``block.3.q_proj`` -> ``block.3.``,
    ``q_proj``; a block-scope graph's ``q_proj`` -> ``""``, ``q_proj``), or None for any other node."""
    stage, _, local = name.rpartition(".")
    if stage and not (stage.startswith(("block.", "refiner.")) and stage[-1].isdigit()):
        return None
    return (stage + "." if stage else ""), local


def param_local_name(name: str) -> str:
    """A parameter's block-relative name (``transformer_blocks.3.attn.to_q.weight`` -> ``attn.to_q.weight``)."""
    for root in ("transformer_blocks.", "token_refiner.refiner_blocks."):
        if name.startswith(root):
            return name[len(root) :].split(".", 1)[1]
    return name


def shard_params(params: Mapping[str, torch.Tensor], tp: TpRank) -> dict[str, torch.Tensor]:
    """The rank's parameters: its shards of the split weights (contiguous copies), the rest as they are."""
    return {k: tp.param_shard(param_local_name(k)).take(v) for k, v in params.items()}


def _fns(tp: TpRank, eps: float) -> dict:
    nh, d, (h0, h1) = tp.heads, tp.head_dim, tp.head_range
    nd, hidden, f = nh * d, tp.hidden, tp.ffn

    def weight(p, node, name):
        return p[node.meta.get("param_prefix", "") + name]

    def column(source: str, name: str, halves: bool):
        full = (2 * f, hidden) if halves else (nd, hidden)

        def fn(ops, v, p, node):
            pre = node.name[: -len(node.name.rpartition(".")[2])]
            return ColumnLinear.apply(v[pre + source], weight(p, node, name), full, halves, tp.group)

        return fn

    def row(source: str, name: str, full: tuple[int, int]):
        def fn(ops, v, p, node):
            pre = node.name[: -len(node.name.rpartition(".")[2])]
            return RowLinear.apply(v[pre + source], weight(p, node, name), full, tp.group)

        return fn

    def qk_norm(which: str):
        def fn(ops, v, p, node):
            pre = node.name[: -len(node.name.rpartition(".")[2])]
            return QkNormGrouped.apply(
                v[f"{pre}{which}_proj"], weight(p, node, f"attn.norm_{which}.weight"), nh, h0, eps, tp.group
            )

        return fn

    def attention(ops, v, p, node):
        q, k, vv, *order = (v[i] for i in node.inputs)  # a block's attention also reads its attention_order
        return ops["h3_full_attention"](q, k, vv.unflatten(-1, (h1 - h0, -1)), order=order[0] if order else None)

    return {
        "q_proj": column("norm1", "attn.to_q.weight", False),
        "k_proj": column("norm1", "attn.to_k.weight", False),
        "v_proj": column("norm1", "attn.to_v.weight", False),
        "q_norm": qk_norm("q"),
        "k_norm": qk_norm("k"),
        "attention": attention,
        "o_proj": row("attention", "attn.to_out.0.weight", (hidden, nd)),
        "ffn_gate_up": column("norm2", "ff.net.0.proj.weight", True),
        "ffn_down": row("swiglu", "ff.net.2.weight", (hidden, f)),
    }


def tp_overrides(graph, tp: TpRank, eps: float) -> dict[str, NodeOverride]:
    """The rank-local functions of every sharded body node of ``graph`` (block scope or the whole model)."""
    table = _fns(tp, eps)
    out = {}
    for node in graph.nodes:
        split = body_prefix(node.name)
        if split is not None and split[1] in table:
            out[node.name] = NodeOverride(table[split[1]], label=f"TP{tp.degree} {split[1]}")
    return out


def value_shard(tp: TpRank, node_name: str) -> Shard:
    split = body_prefix(node_name)
    return Shard() if split is None else tp.value_shard(split[1])
