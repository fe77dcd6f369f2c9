"""Sequence parallelism inside a TP group: the row-local nodes on each rank's own row segments.

Under SP the world's ``tp * cp`` ranks (TP-innermost, ``w = c * tp + t``) each hold the packed rows of their row
segments, :func:`h3gate.kernels.row_merge.cp_row_bounds` at degree ``tp * cp`` (CP rank c's rows are the union of its
TP group's). Per block, with ``[lo_w, hi_w)`` the rank's SP rows and ``[lo_c, hi_c)`` its CP rows:

    norm1, residual_attn, norm2, residual_mlp   on the SP rows; their row-sum gradients (norm weights, AdaLN tables)
                                                in the row-segment order over the WORLD group (rank w's segments)
    q/k/v_proj, ffn_gate_up    input all-gathered over the TP group to the CP rows (one gather per input, shared by
                               Q, K and V); its backward keeps the SP rows of the merged dX (every TP rank holds the
                               merged dX: a slice, never a sum)
    q/k_norm, rope, attention, swiglu   on the CP rows as under CP (Ulysses over the CP group)
    o_proj, ffn_down           RowLinear on the CP rows (the merged FP32 tree, one rounding), then the SP rows kept;
                               backward: the cotangent all-gathered over the TP group. (A reduce-scatter of the FP32
                               subtrees would move less; the tree is elementwise, so its bytes are these.)
    GEMM weight gradients      the row-segment order over the CP group (their inputs hold the CP rows)

In the whole model ``embed.pack`` is scattered to the SP rows and ``final.norm_out`` runs on them; the heads gather
every row. Every movement is bytes (:class:`h3gate.parallel.ulysses._Move`), so SP equals TP1 byte for byte by the
same argument as TP and CP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from h3gate.errors import InputError
from h3gate.graph.execute import NodeOverride, run_node
from h3gate.kernels.row_merge import RowGroup, cp_row_bounds, packed_rows
from h3gate.parallel.collectives import ROW_META, group_gather
from h3gate.parallel.ulysses import CpRank, _Move, all_to_all

SP_NODES = ("norm1", "residual_attn", "norm2", "residual_mlp", "o_proj", "ffn_down")
GATHERED_INPUTS = {"q_proj": "norm1", "k_proj": "norm1", "v_proj": "norm1", "ffn_gate_up": "norm2"}


def sp_node(scope: str, name: str) -> bool:
    """Whether node ``name``'s value holds the rank's SP rows (else the CP rows, or replicated)."""
    if scope == "model" and name == "final.norm_out":
        return True
    stage, _, local = name.rpartition(".")
    return local in SP_NODES and (scope == "block" or stage.startswith("block."))


@dataclass
class SpRank(CpRank):
    """A CP rank (``degree`` may be 1) whose row-local nodes are further split over its TP group."""

    tp_degree: int = 1
    tp_rank: int = 0
    tp_group: object = None
    world_rows: RowGroup | None = None
    sp_bounds: tuple[int, ...] = field(default_factory=tuple)
    _gathered: dict = field(default_factory=dict)

    @classmethod
    def build_sp(cls, scope, inputs, rank: int, tp: int, cp: int, tp_group, cp_group, world_group) -> SpRank:

        seq_len = inputs["rope_cos"].shape[0]
        c = rank // tp
        rows = RowGroup(cp, c, seq_len, group_gather(cp_group))
        world = RowGroup(tp * cp, rank, seq_len, group_gather(world_group))
        return cls(cp, c, cp_row_bounds(seq_len, cp), cp_group, scope.name, rows, tp, rank % tp, tp_group, world,
                   cp_row_bounds(seq_len, tp * cp))  # fmt: skip

    @property
    def world_rank(self) -> int:
        return self.rank * self.tp_degree + self.tp_rank

    @property
    def sp_lo(self) -> int:
        return self.sp_bounds[self.world_rank]

    @property
    def sp_hi(self) -> int:
        return self.sp_bounds[self.world_rank + 1]

    def span(self, name: str) -> tuple[int, int] | None:
        """The packed rows ``[lo, hi)`` node ``name``'s value holds here (None: replicated)."""
        if sp_node(self.scope, name):
            return self.sp_lo, self.sp_hi
        return (self.lo, self.hi) if self.sharded(name) else None

    # ------------------------------------------------------------------------------------------- data movement

    def tp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The TP group's SP rows (dim 1) in packed order: the CP rows, on every TP rank."""
        b, rest = x.shape[0], tuple(x.shape[2:])
        first = self.rank * self.tp_degree
        shapes = [(b, self.sp_bounds[first + j + 1] - self.sp_bounds[first + j], *rest) for j in range(self.tp_degree)]
        return torch.cat(all_to_all([x] * self.tp_degree, shapes, self.tp_group), dim=1)

    def tp_own(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's SP rows of a value holding the CP rows."""
        return x[:, self.sp_lo - self.lo : self.sp_hi - self.lo].contiguous()

    def world_own(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.sp_lo : self.sp_hi].contiguous()

    def world_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's SP rows in packed order (dim 1), over the whole world (the heads of the model)."""
        import torch.distributed as dist

        b, rest, world = x.shape[0], tuple(x.shape[2:]), self.tp_degree * self.degree
        shapes = [(b, self.sp_bounds[j + 1] - self.sp_bounds[j], *rest) for j in range(world)]
        return torch.cat(all_to_all([x] * world, shapes, dist.group.WORLD), dim=1)

    # -------------------------------------------------------------------------------------------------- overrides

    def overrides(self, graph, tp_overrides: Mapping) -> dict[str, NodeOverride]:
        out = super().overrides(graph, tp_overrides) if self.degree > 1 else dict(tp_overrides)
        self._gathered = {}
        for node in graph.nodes:
            local = node.name.rpartition(".")[2]
            base = tp_overrides.get(node.name)
            if sp_node(self.scope, node.name):
                fn = self._row_parallel(base) if local in ("o_proj", "ffn_down") else self._sp_local(base)
                out[node.name] = NodeOverride(fn, label=f"SP{self.tp_degree}")
            elif local in GATHERED_INPUTS and self.sharded(node.name):
                out[node.name] = NodeOverride(self._gathered_input_of(base), label=f"SP{self.tp_degree} gather")
            elif self.scope == "model" and node.name in ("heads.video_proj", "heads.audio_proj"):
                heads = self._gathered_input(self.world_gather, self.world_own)  # every rank's SP rows
                out[node.name] = NodeOverride(heads, label="SP gather rows")
        return out

    def _meta(self, values, node, lo: int, hi: int, base_lo: int) -> dict:
        return {k: values[k][lo - base_lo : hi - base_lo] for k in node.inputs if k in ROW_META}

    def _sp_local(self, base):
        """A norm or gated residual on the SP rows; row-sums over the world group."""

        def fn(ops, values, params, node):
            base_lo = self.lo if self.scope == "block" else 0
            local = self._meta(values, node, self.sp_lo, self.sp_hi, base_lo)
            if "embed.pack" in node.inputs:
                local["embed.pack"] = _Move.apply(values["embed.pack"], self.world_own, self.world_gather)
            with packed_rows(self.world_rows):
                return run_node(node, ops, {**values, **local}, params, base)

        return fn

    def _gathered_input_of(self, base):
        """Q/K/V or gate/up on the CP rows: its SP input all-gathered once over the TP group (shared by Q, K, V)."""

        def fn(ops, values, params, node):
            local_name = node.name.rpartition(".")[2]
            source = node.name[: len(node.name) - len(local_name)] + GATHERED_INPUTS[local_name]
            x = values[source]
            key = (source, id(x))
            if key not in self._gathered:
                self._gathered[key] = (x, _Move.apply(x, self.tp_gather, self.tp_own))
            local = self._cp_meta(values, node)
            with packed_rows(self.rows):
                return run_node(node, ops, {**values, **local, source: self._gathered[key][1]}, params, base)

        return fn

    def _cp_meta(self, values, node) -> dict:
        return {} if self.scope == "block" else self._meta(values, node, self.lo, self.hi, 0)

    def _row_parallel(self, base):
        """O or down: RowLinear on the CP rows (merged on every TP rank), then this rank's SP rows."""

        def fn(ops, values, params, node):
            with packed_rows(self.rows):
                y = run_node(node, ops, values, params, base)
            return _Move.apply(y, self.tp_own, self.tp_gather)

        return fn

    # -------------------------------------------------------------------------------------------------- comparison

    def local_inputs(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().local_inputs(inputs) if self.degree > 1 else dict(inputs)
        if self.scope == "block":
            out["hidden_states"] = inputs["hidden_states"][:, self.sp_lo : self.sp_hi]
        return out

    def rows_of(self, name: str, t: torch.Tensor) -> torch.Tensor:
        span = self.span(name)
        return t if span is None else t[:, span[0] : span[1]].contiguous()

    def input_rows(self, key: str, ref: torch.Tensor) -> torch.Tensor:
        if self.scope == "block" and key == "hidden_states":
            return ref[:, self.sp_lo : self.sp_hi].contiguous()
        return ref

    def local_row(self, node: str, row: int) -> int:

        span = self.span(node)
        if span is None:
            return row
        if not span[0] <= row < span[1]:
            raise InputError(f"--fault: rank {self.world_rank} holds packed rows "
                             f"[{span[0]}, {span[1]}) of {node}, not row {row}")  # fmt: skip
        return row - span[0]

    def global_row(self, name: str, row: int) -> int:
        span = self.span(name)
        return row if span is None else row + span[0]

    def global_input_row(self, key: str, row: int) -> int:
        return row + self.sp_lo if self.scope == "block" and key == "hidden_states" else row

    def record(self) -> dict:
        rec = super().record() if self.degree > 1 else {"cp_rank": 0, "packed_rows": [self.lo, self.hi]}
        rec["sp_rows"] = [self.sp_lo, self.sp_hi]
        rec["sp"] = (f"norms, AdaLN modulation and gated residuals on the rank's row segments over the TP group of "
                     f"{self.tp_degree}; their row-sums merged over the world group")  # fmt: skip
        return rec
