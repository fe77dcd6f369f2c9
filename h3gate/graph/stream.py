"""Streaming execution of a graph: node by node, each output dropped after its last consumer, with optional
per-node overrides (the ablation probes' and the distributed replays' hook). Re-exported by :mod:`h3gate.graph.model`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.graph.core import Graph, Node, OpTable


@dataclass(frozen=True)
class NodeOverride:
    """Replaces one node's function: ``fn(ops, values, params, node)`` sees every value computed so far (graph
    inputs included) and the full parameter mapping; ``reads`` names the earlier node outputs it needs beyond the
    node's own inputs, so that streaming execution keeps them alive."""

    fn: Callable[[OpTable, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Node], torch.Tensor]
    reads: tuple[str, ...] = ()
    label: str = ""


def iter_graph(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    overrides: Mapping[str, NodeOverride] | None = None,
) -> Iterator[tuple[Node, torch.Tensor]]:
    """Run ``graph`` node by node, yielding ``(node, output)``; an output is dropped after its last consumer, so
    memory stays at the live set (what a 50-layer model needs on a GPU)."""
    overrides = overrides or {}
    missing = [k for k in graph.inputs if k not in inputs]
    if missing:
        raise InputError(f"graph {graph.name}: input {missing[0]} missing")
    last_use: dict[str, int] = {}
    for k, node in enumerate(graph.nodes):
        extra = overrides[node.name].reads if node.name in overrides else ()
        for name in (*node.inputs, *extra):
            last_use[name] = k
    values: dict[str, torch.Tensor] = dict(inputs)
    for k, node in enumerate(graph.nodes):
        override = overrides.get(node.name)
        if override is None:
            out = node.fn(ops, {name: values[name] for name in node.inputs}, params)
        else:
            out = override.fn(ops, values, params, node)
        values[node.name] = out
        yield node, out
        for name in [n for n, last in last_use.items() if last == k and n not in graph.inputs]:
            values.pop(name, None)
            del last_use[name]
