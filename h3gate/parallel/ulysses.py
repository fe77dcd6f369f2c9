"""Context parallelism: packed rows sharded over CP ranks, Ulysses all-to-all attention, metadata co-sharded.

CP rank c holds the contiguous packed rows of its row segments (:func:`h3gate.kernels.row_merge.cp_row_bounds`: the
8 segments fixed by S, rank c owning ``[c * 8/cp, (c + 1) * 8/cp)``; any S) and the same rows of every row-metadata
tensor (AdaLN indices, RoPE tables, timestep indices). Every block node is row-local and runs on those rows unchanged
(inside :func:`~h3gate.kernels.row_merge.packed_rows`, so the ``*_seg8`` operators sum their row-sum gradients in
the row-segment order and merge them over the CP group), except attention:

    q, k, v (B, S_c, h, D)  --all-to-all-->  (B, S, h / cp, D): every row of the rank's head chunk, in packed order
    attention (the strict kernel, its fixed KV walk over all S rows)
    out (B, S, h / cp, D)   --all-to-all-->  (B, S_c, h, D)

(``h`` the TP rank's heads under TP x CP.) The all-to-alls move bytes only (their backward is the reverse move), so
each head sees exactly the one-device K/V in the one-device order: forward values and every gradient along the
hidden path equal TP1 byte for byte by construction. In the whole model the rows are sharded at ``embed.pack``
(its backward all-gathers the row gradients, so everything upstream - embeddings, refiner - is replicated and exact)
and gathered again after ``final.norm_out`` (the heads run replicated).

The gradients that are sums over packed rows split across CP ranks (every GEMM's dW, the RMSNorm weights, the AdaLN
tables' and the QK norms' weight gradients) are each rank's subtree of the row-segment tree, all-gathered over the
CP group and finished identically on every rank, so they too equal TP1 byte for byte, and with them everything
downstream of the tables (the AdaLN projections, ``temb``, the time MLP, the final projection).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.graph.execute import NodeOverride, run_node
from h3gate.kernels.row_merge import RowGroup, packed_rows
from h3gate.parallel.collectives import ROW_META, cp_bounds, group_gather, staged


def all_to_all(chunks: list[torch.Tensor], shapes: list[tuple[int, ...]], group) -> list[torch.Tensor]:
    """Send ``chunks[j]`` to rank j of ``group``; receive one tensor of ``shapes[j]`` from each (raw bytes: exact for
    every dtype; gloo ranks on GPUs stage through host memory)."""
    import torch.distributed as dist

    first = chunks[0]
    host = staged(first)
    dev = "cpu" if host else first.device
    send = torch.cat([c.contiguous().to(dev).reshape(-1).view(torch.uint8) for c in chunks])
    size = first.element_size()
    out_splits = [int(torch.Size(s).numel()) * size for s in shapes]
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv, send, out_splits, [c.numel() * size for c in chunks], group=group)
    parts = recv.split(out_splits)
    return [p.view(first.dtype).reshape(s).to(first.device) for p, s in zip(parts, shapes, strict=True)]


class _Move(torch.autograd.Function):
    """A pure data movement ``there(x)`` (an all-to-all, a row slice, a row gather); its backward is the adjoint
    movement ``back(g)``: bytes moved, never added."""

    @staticmethod
    def forward(ctx, x, there, back):
        ctx.back = back
        return there(x.contiguous())

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g.contiguous()), None, None


def row_sharded(scope: str, name: str) -> bool:
    """Whether node ``name``'s value holds only a CP rank's rows (every block node but the AdaLN projection; in the
    whole model also ``final.norm_out``)."""
    if scope == "block":
        return name != "adaln_projection"
    return (name.startswith("block.") and not name.endswith(".adaln_projection")) or name == "final.norm_out"


@dataclass
class CpRank:
    degree: int
    rank: int
    bounds: tuple[int, ...]  # degree + 1 row boundaries
    group: object
    scope: str
    rows: RowGroup

    @classmethod
    def build(cls, scope, inputs, cp_rank: int, cp: int, cp_group) -> CpRank:

        seq_len = inputs["rope_cos"].shape[0]
        rows = RowGroup(cp, cp_rank, seq_len, group_gather(cp_group))
        return cls(cp, cp_rank, cp_bounds(seq_len, cp), cp_group, scope.name, rows)

    @property
    def lo(self) -> int:
        return self.bounds[self.rank]

    @property
    def hi(self) -> int:
        return self.bounds[self.rank + 1]

    # ------------------------------------------------------------------------------------------- data movement

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, d = x.shape
        hc = h // self.degree
        chunks = [x[:, :, j * hc : (j + 1) * hc] for j in range(self.degree)]
        shapes = [(b, self.bounds[j + 1] - self.bounds[j], hc, d) for j in range(self.degree)]
        return torch.cat(all_to_all(chunks, shapes, self.group), dim=1)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        b, _, hc, d = x.shape
        chunks = [x[:, self.bounds[j] : self.bounds[j + 1]] for j in range(self.degree)]
        shapes = [(b, self.hi - self.lo, hc, d)] * self.degree
        return torch.cat(all_to_all(chunks, shapes, self.group), dim=2)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's packed rows (dim 1) of a replicated value."""
        return x[:, self.lo : self.hi].contiguous()

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (dim 1) in packed order: an all-to-all sending this rank's rows to everyone."""
        b, rest = x.shape[0], tuple(x.shape[2:])
        shapes = [(b, self.bounds[j + 1] - self.bounds[j], *rest) for j in range(self.degree)]
        return torch.cat(all_to_all([x] * self.degree, shapes, self.group), dim=1)

    # -------------------------------------------------------------------------------------------------- overrides

    def sharded(self, name: str) -> bool:
        """Whether node ``name``'s value holds this rank's rows only."""
        return row_sharded(self.scope, name)

    def overrides(self, graph, tp_overrides: Mapping) -> dict[str, NodeOverride]:
        out = dict(tp_overrides)
        for node in graph.nodes:
            if node.name.rpartition(".")[2] == "attention" and self.sharded(node.name):
                out[node.name] = NodeOverride(self._attention(tp_overrides.get(node.name)), label="Ulysses")
            elif self.sharded(node.name):
                out[node.name] = NodeOverride(self._local(tp_overrides.get(node.name)), label=f"CP{self.degree}")
            if self.scope == "model" and node.name in ("heads.video_proj", "heads.audio_proj"):
                out[node.name] = NodeOverride(self._gathered_input(), label="CP gather rows")
        return out

    def _local(self, base):
        """A row-sharded node on this rank's rows, its row-sums in the CP group's row segments; in the whole model
        ``embed.pack`` scattered and the row metadata sliced (block scope: the inputs are local already)."""

        def fn(ops, values, params, node):
            local = {}
            for k in node.inputs if self.scope == "model" else ():
                if k in ROW_META:
                    local[k] = values[k][self.lo : self.hi]
                elif k == "embed.pack":
                    local[k] = _Move.apply(values[k], self.own_rows, self.gather_rows)
            with packed_rows(self.rows):
                return run_node(node, ops, {**values, **local}, params, base)

        return fn

    def _attention(self, base):
        def fn(ops, values, params, node):
            # attention_order (a block's 4th input) is the full (S,) value, never row-sharded: after the all-to-all
            # every rank holds all S rows of its heads in packed order, so the one global order applies unchanged.
            q, k, v, *order = (values[i] for i in node.inputs)
            heads = q.shape[2]
            q, k, v = (_Move.apply(t, self.seq_to_heads, self.heads_to_seq)
                       for t in (q, k, v.unflatten(-1, (heads, -1))))  # fmt: skip
            out = ops["h3_full_attention"](q, k, v, order=order[0] if order else None)
            out = out.unflatten(-1, (heads // self.degree, -1))  # (B, S, h / cp, D)
            return _Move.apply(out, self.heads_to_seq, self.seq_to_heads).flatten(-2)

        return fn

    def _gathered_input(self, gather=None, own=None):
        """A head on every row: ``final.norm_out`` gathered (by ``gather``, default this CP group's rows)."""
        gather, own = gather or self.gather_rows, own or self.own_rows

        def fn(ops, values, params, node):
            rows = _Move.apply(values["final.norm_out"], gather, own)
            return run_node(node, ops, {**values, "final.norm_out": rows}, params)

        return fn

    # -------------------------------------------------------------------------------------------------- comparison

    def local_inputs(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(inputs)
        if self.scope == "block":
            for k in ("hidden_states", *ROW_META):
                if k in out:
                    out[k] = out[k][:, self.lo : self.hi] if k == "hidden_states" else out[k][self.lo : self.hi]
        return out

    def rows_of(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t[:, self.lo : self.hi].contiguous() if self.sharded(name) else t

    def input_rows(self, key: str, ref: torch.Tensor) -> torch.Tensor:
        return ref[:, self.lo : self.hi].contiguous() if self.scope == "block" and key == "hidden_states" else ref

    def local_row(self, node: str, row: int) -> int:

        if not self.sharded(node):
            return row
        if not self.lo <= row < self.hi:
            raise InputError(f"--fault: CP rank {self.rank} holds packed rows [{self.lo}, {self.hi}), not row {row}")
        return row - self.lo

    def global_row(self, name: str, row: int) -> int:
        return row + self.lo if self.sharded(name) else row

    def global_input_row(self, key: str, row: int) -> int:
        return row + self.lo if self.scope == "block" and key == "hidden_states" else row

    def record(self) -> dict:
        return {
            "cp_rank": self.rank,
            "packed_rows": [self.lo, self.hi],
            "row_metadata": "co-sharded " + ", ".join(ROW_META),
            "row_segments": list(self.rows.bounds),
            "row_merge": "row-segment tree over the CP group (h3gate.kernels.row_merge)",
            "attention": "Ulysses all-to-all (sequence <-> heads), the strict kernel over all rows",
        }
