"""What ``run ws2`` executes, the same in the parent (TP1) and in every rank: the graph of a scope, its parameters and
inputs, one forward under autograd and the backward of the seeded cotangents, and the byte comparison of a value.

Scopes: ``block`` - transformer block 0 (17 nodes; leaves ``hidden_states`` and ``temb``; cotangent
``block_cotangent`` on ``residual_mlp``, the one ``run ws1-block`` starts its backward from); ``model`` - the whole
transformer (refiner, every block, heads; leaves the video, audio and text rows; the declared loss's cotangents
``model_cotangents``).
Every float parameter is a leaf too. Faults (negative controls) are the gates' own one-row faults
(:mod:`h3gate.gate.faults`): forward scales the node's output row, backward the gradient its first input receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from h3gate.gate.faults import corrupt, grad_fault
from h3gate.graph import determinism
from h3gate.graph.core import Graph
from h3gate.graph.execute import NodeOverride, iter_isolated, run_chained, run_node
from h3gate.graph.inputs import block_cotangent
from h3gate.graph.model import OUTPUTS, load_model_params
from h3gate.runs.model_stages import model_cotangents
from h3gate.runs.setup import Run

SCOPES = ("block", "model")
BLOCK_LEAVES = ("hidden_states", "temb")
MODEL_LEAVES = ("video_rows", "audio_rows", "text")
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


@dataclass
class Scope:
    name: str
    graph: Graph
    params: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    leaves: tuple[str, ...]
    outputs: tuple[str, ...]


def build_scope(run: Run) -> Scope:
    """The graph, parameters and inputs of a prepared run's scope (:func:`h3gate.runs.setup.prepare` with
    ``scope`` and its draw, :data:`h3gate.runs.setup.SCOPE_DRAW`): block 0 with its parameters and inputs, or the
    whole model with every parameter read."""
    if run.spec.scope == "block":
        return Scope("block", run.graph, run.params, dict(run.inputs.tensors), BLOCK_LEAVES, (run.graph.output,))

    params = load_model_params(run.source, run.cfg, run.device)
    return Scope("model", run.graph, params, dict(run.inputs), MODEL_LEAVES, OUTPUTS)


def cotangents(scope: Scope, values: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The seeded cotangent of every output (FP32 draws on the CPU, cast to the output's dtype and device)."""

    if scope.name == "block":
        out = values[scope.graph.output]
        if out.dim() != 3 or out.shape[0] != 1:
            raise RuntimeError(f"run ws2: block output of shape {tuple(out.shape)}, expected (1, S, H)")
        cots = {scope.graph.output: block_cotangent(seed, out.shape[1], out.shape[2], "cpu")}
    else:
        cots = model_cotangents(seed, values)
    return {k: c.to(values[k].dtype).to(values[k].device) for k, c in cots.items()}


@dataclass(frozen=True)
class Fault:
    """A one-row negative control on one rank: ``phase`` forward or backward, packed row ``row`` of ``node``."""

    rank: int
    node: str
    row: int
    phase: str = "forward"

    def record(self) -> dict:
        return {"rank": self.rank, "node": self.node, "row": self.row, "phase": self.phase, "kind": "scale"}


def with_fault(node, base, fault: Fault, local_row: int) -> NodeOverride:
    """``node``'s function (or override ``base``) with ``fault`` applied at local row ``local_row``."""

    def fn(ops, values, params, nd):
        if fault.phase == "backward":
            source = nd.inputs[0]
            if values[source].requires_grad:
                values = {**values, source: grad_fault(values[source], local_row, 1, "scale")}
            return run_node(nd, ops, values, params, base)
        return corrupt(run_node(nd, ops, values, params, base), local_row, nd.row_dim, "scale")

    return NodeOverride(fn, label=f"fault {fault.phase} row {fault.row}")


def forward_backward(
    scope: Scope,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops,
    overrides: Mapping | None,
    cotangent_fn,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One chained forward under autograd and the backward of ``cotangent_fn(values)``: (node values, gradients of
    ``node:<name>`` (every node output that takes one), ``input:<leaf>`` and ``param:<name>``)."""
    leaf_params = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in params.items()}
    leaf_inputs = {k: (v.detach().requires_grad_() if k in scope.leaves else v) for k, v in inputs.items()}
    with torch.enable_grad():
        values = run_chained(scope.graph, leaf_inputs, leaf_params, ops, overrides)
        for node in scope.graph.nodes:
            if values[node.name].requires_grad:
                values[node.name].retain_grad()
        cots = cotangent_fn(values)
        outs = [values[name] for name in scope.outputs]
        torch.autograd.backward(outs, [cots[name] for name in scope.outputs])
    grads = {f"node:{n.name}": values[n.name].grad for n in scope.graph.nodes}
    grads.update({f"input:{k}": leaf_inputs[k].grad for k in scope.leaves})
    grads.update({f"param:{k}": p.grad for k, p in leaf_params.items() if p.grad is not None})
    nodes = {node.name: values[node.name].detach() for node in scope.graph.nodes}
    return nodes, {k: g for k, g in grads.items() if g is not None}


def repeat_forward(
    scope: Scope,
    inputs: Mapping[str, torch.Tensor],
    values: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops,
    overrides: Mapping | None,
) -> None:
    """Under a determinism recorder, every node once more alone on the values its forward read (``inputs`` and the
    forward's node ``values``), in graph order (each rank's collectives in the same order): each node's pair, which
    the recorder compares with its forward (:mod:`h3gate.graph.determinism`). Nothing without a recorder."""
    if determinism.active() is None:
        return
    fed = {**inputs, **values}
    with determinism.evaluation("forward repeat"):
        for _ in iter_isolated(scope.graph.nodes, ops, lambda node, reads: fed, params, overrides, repeat=False):
            pass


def byte_diff(got: torch.Tensor, want: torch.Tensor, row_dim: int | None) -> dict | None:
    """None when ``got`` and ``want`` hold the same bytes; else the differing rows along ``row_dim`` (count, first),
    the first differing column of that row, and the largest absolute difference."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"rows_differing": None, "first_row": None, "first_col": None, "max_abs": None,
                "why": f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"}  # fmt: skip
    view = _INT_VIEW[got.element_size()]
    neq = got.detach().contiguous().cpu().view(view) != want.detach().contiguous().cpu().view(view)
    if not bool(neq.any()):
        return None
    dim = row_dim if (row_dim is not None and got.ndim > row_dim) else 0
    per_row = neq.movedim(dim, 0).reshape(neq.shape[dim], -1) if got.ndim else neq.reshape(1, 1)
    rows = per_row.any(dim=1).nonzero().flatten()
    first = int(rows[0])
    col = int(per_row[first].nonzero()[0]) if got.ndim else 0
    diff = (got.detach().double().cpu() - want.detach().double().cpu()).abs().max()
    return {"rows_differing": int(rows.numel()), "first_row": first, "first_col": col, "max_abs": float(diff)}
