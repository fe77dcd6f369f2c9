"""The three executions of a graph and what each node is bound to.

* provider  - :func:`provider_table`: ``registry.reference`` for every op (the diffusers replay);
* candidate - :func:`bind_graph` then :func:`candidate_table`: ``registry.bind(op, mode, device)`` for every op of
  every node, bound once up front so strict mode fails closed (naming the node) before anything runs;
* golden    - the provider table on ``to_float64`` inputs and parameters (the references take their dtypes from
  their inputs, so the same code is the float64 golden).

A node's ``actual`` backend is ``triton`` only when every op of the node runs a Triton kernel; a node with any op
on the reference is labelled ``reference`` (evidence never calls a reference a strict kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from h3gate.errors import InputError
from h3gate.graph.core import Graph, OpTable
from h3gate.manifests.operators import Contract
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.ops import registry
from h3gate.ops.golden import attention_golden, sinusoid_fp64
from h3gate.ops.registry import Binding


def provider_table(overrides: Mapping[str, Callable] | None = None) -> OpTable:
    """Operator name -> the provider reference (also the golden's table, on float64 tensors)."""
    return OpTable(registry.reference, overrides)


def golden_table() -> OpTable:
    """The provider references for float64 tensors, attention chunked over queries where the dense float64 score
    matrix would not fit (``h3gate.ops.golden.attention_golden``; same maths, float64 rounding apart), and the
    timestep sinusoid at float64 (the reference casts to float32, as diffusers does)."""

    return provider_table({"h3_full_attention": attention_golden, "timestep_sinusoid_h3": sinusoid_fp64})


def _forward_contract(b: Binding) -> Contract:
    """The contract whose forward promise holds for ``b``: the operator's own where its bound twin declares
    ``forward_as_single`` (the same forward bytes), else the bound kernel's."""
    twin = registry.spec(b.bound).contract if b.bound else None
    return registry.spec(b.op).contract if twin is None or twin.forward_as_single else twin


@dataclass(frozen=True)
class NodeBinding:
    """Every op binding of one node, summarised the way evidence reports a node."""

    node: str
    owner_row: str
    bindings: tuple[Binding, ...]

    @property
    def requested(self) -> str:
        return "triton" if any(b.requested == "triton" for b in self.bindings) else "provider"

    @property
    def actual(self) -> str:
        return "triton" if all(b.actual == "triton" for b in self.bindings) else "provider"

    @property
    def label(self) -> str:
        if self.actual != "triton":
            return "reference"
        return "interim" if any(b.label == "interim" for b in self.bindings) else "row"

    @property
    def fallback(self) -> bool:
        return any(b.fallback for b in self.bindings)

    @property
    def failing_fallback(self) -> bool:
        """A fallback its mode counts as a failing finding (:func:`h3gate.ops.registry.fallback_fails`)."""
        return any(b.fallback and registry.fallback_fails(b.mode) for b in self.bindings)

    @property
    def kernel_id(self) -> str:
        return "+".join(b.kernel_id for b in self.bindings)

    @property
    def single_forward(self) -> bool:
        """Whether every op's forward is its own single-walk kernel's (or the reference's): no merge twin bound, or
        a twin whose contract declares ``forward_as_single``. A device-measured forward promise needs this."""
        return all(
            b.actual == "provider" or not b.bound or registry.spec(b.bound).contract.forward_as_single
            for b in self.bindings
        )

    @property
    def provider_bitwise(self) -> bool:
        """Whether every op's forward runs the reference or a kernel whose contract declares ``provider_bitwise`` (a
        twin declaring ``forward_as_single`` forwards as its operator's kernel: that contract's promise)."""
        return all(b.actual == "provider" or _forward_contract(b).provider_bitwise for b in self.bindings)

    def record(self) -> dict:
        return {
            "requested": self.requested,
            "actual": self.actual,
            "kernel_id": self.kernel_id,
            "label": self.label,
            "fallback": self.fallback,
            "provider_bitwise_contract": self.provider_bitwise,
            "ops": [b.record() for b in self.bindings],
        }


def bind_graph(graph: Graph, mode: str, device: str, merge: str = DEFAULT_MERGE_ORDER) -> dict[str, NodeBinding]:
    """Bind every op of every node for ``mode`` on ``device`` in merge order ``merge``; strict mode raises naming the
    first node that would run anything but its declared strict kernel."""
    registry.check_merge(merge)
    out: dict[str, NodeBinding] = {}
    for node in graph.nodes:
        bound = []
        for op in node.ops:
            try:
                bound.append(registry.bind(op, mode, device, merge))
            except InputError as exc:
                raise InputError(f"node {node.name}: {exc}") from None
        out[node.name] = NodeBinding(node.name, node.owner_row, tuple(bound))
    return out


def candidate_table(bindings: Mapping[str, NodeBinding], overrides: Mapping[str, Callable] | None = None) -> OpTable:
    """Operator name -> the bound callable (the same operator binds identically in every node)."""
    fns: dict[str, Callable] = {}
    for nb in bindings.values():
        for b in nb.bindings:
            fns.setdefault(b.op, b.fn)

    def resolve(op: str) -> Callable:
        if op not in fns:
            raise InputError(f"operator {op!r}: not bound in this run")
        return fns[op]

    return OpTable(resolve, overrides)
