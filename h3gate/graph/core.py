"""Nodes, graphs and op tables (the executor is :mod:`h3gate.graph.execute`).

A :class:`Node` does not know which execution runs it, and an execution does not know which node it runs: a node's
``fn`` receives an :class:`OpTable` (operator name -> callable) and its input values; the execution decides what
the table holds:

* provider  - ``registry.reference`` for every op (the diffusers replay);
* candidate - ``registry.bind(op, mode, device).fn`` (strict kernels, or recorded fallbacks);
* golden    - the provider references on float64 copies of every floating input and parameter.

``h3gate.graph.execute.run_chained`` feeds each node its own upstream; ``run_node`` on another execution's values
(normally the provider's) runs a node isolated, which separates its own drift from drift it inherited.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

Values = dict[str, torch.Tensor]


class OpTable:
    """Operator name -> callable. ``overrides`` replace single ops (ablation probes, deliberate perturbations)."""

    def __init__(self, resolve: Callable[[str], Callable], overrides: Mapping[str, Callable] | None = None) -> None:
        self._resolve = resolve
        self._cache: dict[str, Callable] = dict(overrides or {})

    def __getitem__(self, op: str) -> Callable:
        if op not in self._cache:
            self._cache[op] = self._resolve(op)
        return self._cache[op]

    def with_overrides(self, overrides: Mapping[str, Callable]) -> OpTable:
        table = OpTable(self._resolve, {**self._cache, **overrides})
        return table


@dataclass(frozen=True)
class Node:
    """One named boundary of the graph.

    ``fn(ops, inputs, params)`` returns the node's output tensor; ``inputs`` maps each name in ``self.inputs`` to a
    tensor (graph inputs or upstream node outputs); ``params`` is the graph's parameter mapping.
    ``row_dim`` is the dimension of the output that indexes packed rows (for first-row localisation), or None.
    """

    name: str
    owner_row: str
    ops: tuple[str, ...]
    inputs: tuple[str, ...]
    fn: Callable[[OpTable, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], torch.Tensor]
    row_dim: int | None = 1
    layer: int | None = None
    step: int | None = None
    meta: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Graph:
    name: str
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    output: str

    def __post_init__(self) -> None:
        seen = set(self.inputs)
        for node in self.nodes:
            missing = [i for i in node.inputs if i not in seen]
            if missing:
                raise ValueError(f"graph {self.name}: node {node.name} reads {missing} before they exist")
            if node.name in seen:
                raise ValueError(f"graph {self.name}: duplicate name {node.name}")
            seen.add(node.name)
        if self.output not in seen:
            raise ValueError(f"graph {self.name}: output {self.output} is not produced")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def to_float64(values: Mapping[str, torch.Tensor]) -> Values:
    """Golden inputs: floating tensors upcast to float64 (detached), integer tensors unchanged."""
    return {k: (v.detach().double() if v.is_floating_point() else v) for k, v in values.items()}
