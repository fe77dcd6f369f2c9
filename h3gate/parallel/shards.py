"""One rank's plan in ``run ws2``: its TP shard (heads, FFN channels, weight shards) and CP shard (packed rows and
their metadata), the node overrides that run them, and the slice of every reference value it must reproduce.

Ranks are TP-innermost (``rank = cp_rank * tp + tp_rank``). A drift a rank reports is located to that rank and to
the logical (packed) row and column: the rank owns what it computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from h3gate.graph.execute import NodeOverride
from h3gate.kernels.tp_layers import MergeGroup, check_alignment
from h3gate.parallel.collectives import ROW_META, group_gather
from h3gate.parallel.sp import SpRank
from h3gate.parallel.tp import TpRank, param_local_name, shard_params, tp_overrides, value_shard
from h3gate.parallel.ulysses import CpRank
from h3gate.parallel.ws2_partition import Partition
from h3gate.parallel.ws2_scope import with_fault


@dataclass
class RankPlan:
    rank: int
    tp: TpRank
    cp_degree: int
    cp_rank: int
    params: dict[str, torch.Tensor]
    graph: object
    qk_eps: float
    row_dims: dict[str, int | None] = field(default_factory=dict)
    cp: object = None  # h3gate.parallel.ulysses.CpRank when cp_degree > 1
    partition: Partition = field(default_factory=Partition)

    @classmethod
    def build(cls, cfg, scope, inputs, rank: int, tp: int, cp: int, tp_group, cp_group, sp: bool = False,
              partition: Partition | None = None) -> RankPlan:  # fmt: skip
        dtype = torch.bfloat16
        check_alignment(tp, cfg.num_attention_heads, cfg.attention_head_dim, cfg.hidden_size, cfg.ffn_dim, dtype)
        part = partition or Partition()
        chunks = None if part.tp_chunks is None else part.chunks(tp)
        group = MergeGroup(tp, rank % tp, group_gather(tp_group), chunks, part.tp_merge == "rank")
        tpr = TpRank(tp, rank % tp, cfg.num_attention_heads, cfg.attention_head_dim, cfg.hidden_size, cfg.ffn_dim,
                     group)  # fmt: skip
        plan = cls(rank, tpr, cp, rank // tp, shard_params(scope.params, tpr), scope.graph, cfg.qk_norm_eps)
        plan.partition = part
        plan.row_dims = {n.name: n.row_dim for n in scope.graph.nodes}
        if sp:
            plan.cp = SpRank.build_sp(scope, inputs, rank, tp, cp, tp_group, cp_group, None)
        elif cp > 1:
            plan.cp = CpRank.build(scope, inputs, rank // tp, cp, cp_group)
        return plan

    # ------------------------------------------------------------------------------------------------ execution

    def overrides(self, faults) -> dict[str, NodeOverride]:
        out = tp_overrides(self.graph, self.tp, self.qk_eps) if self.tp.degree > 1 else {}
        if self.cp is not None:
            out = self.cp.overrides(self.graph, out)
        nodes = {n.name: n for n in self.graph.nodes}

        for fault in faults:
            local = self.local_row(fault.node, fault.row)
            out[fault.node] = with_fault(nodes[fault.node], out.get(fault.node), fault, local)
        return out

    def local_inputs(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(inputs) if self.cp is None else self.cp.local_inputs(inputs)
        if self.partition.cp_metadata == "local":  # the hidden rows sharded alone: metadata by local position
            out.update({k: inputs[k][: self.cp.hi - self.cp.lo] for k in ROW_META if k in inputs})
        return out

    def local_row(self, node: str, row: int) -> int:
        """The local index of packed row ``row`` in ``node``'s value on this rank (InputError if not held)."""
        return row if self.cp is None else self.cp.local_row(node, row)

    # ------------------------------------------------------------------------------------------------ comparison

    def local_value(self, name: str, ref: torch.Tensor) -> torch.Tensor:
        t = value_shard(self.tp, name).take(ref) if name in self.row_dims else ref
        return t if self.cp is None else self.cp.rows_of(name, t)

    def local_grad(self, name: str, ref: torch.Tensor) -> torch.Tensor:
        kind, _, key = name.partition(":")
        if kind == "node":
            return self.local_value(key, ref)
        if kind == "param":
            return self.tp.param_shard(param_local_name(key)).take(ref)
        return ref if self.cp is None else self.cp.input_rows(key, ref)

    def grad_row_dim(self, name: str) -> int | None:
        kind, _, key = name.partition(":")
        if kind == "node":
            return self.row_dims[key]
        return 1 if kind == "input" and key != "temb" else 0

    def locate(self, name: str, d: dict) -> dict:
        """Where a drift of node ``name`` sits: this rank, the packed row, and (sharded values) the logical column."""
        shard = value_shard(self.tp, name)
        row = d["first_row"]
        return {
            "owner_rank": self.rank,
            "logical_row": row if self.cp is None or row is None else self.cp.global_row(name, row),
            "sharded": shard.kind != "full" or self.cp is not None and self.cp.sharded(name),
        }

    def locate_grad(self, name: str, d: dict) -> dict:
        kind, _, key = name.partition(":")
        if kind == "node":
            return self.locate(key, d)
        row = d["first_row"]
        if kind == "input" and self.cp is not None and row is not None:
            row = self.cp.global_input_row(key, row)
        return {"owner_rank": self.rank, "logical_row": row}

    def record(self) -> dict:
        h0, h1 = self.tp.head_range
        f0, f1 = self.tp.ffn_range
        split = {k: list(v.shape) for k, v in self.params.items()
                 if self.tp.param_shard(param_local_name(k)).kind != "full"}  # fmt: skip
        rec = {"tp_rank": self.tp.rank, "heads": [h0, h1], "ffn_channels": [f0, f1], "sharded_param_shapes": split}
        if self.tp.group.chunks is not None:
            rec["tp_chunk"] = self.tp.chunk
            rec["tp_merge"] = "rank order" if self.tp.group.rank_order else "chunk (logical) order"
        if self.cp is not None:
            rec.update(self.cp.record())
        if self.partition.cp_metadata == "local":
            rec["row_metadata"] = f"read by local position: rows [0, {self.cp.hi - self.cp.lo}) (hidden rows only)"
        return rec
