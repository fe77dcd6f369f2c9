"""The one graph executor: every engine runs a :class:`~h3gate.graph.core.Graph` through these functions, and no other
module iterates a graph's nodes to run them (``tests/test_architecture.py`` fails if one does).

* :func:`run_node` - the shared core: one node on the values computed so far (or on another execution's: isolated),
  or its override;
* :func:`run_nodes` - the node loop: sibling GEMMs (:func:`sibling_gemms`: consecutive
  :class:`~h3gate.graph.body_nodes.Gemm` nodes of one operator on one source, q / k / v, none overridden) run as one
  call of the bound operator's ``grouped`` where it has one (the strict GEMM: one grouped launch, the same bytes as
  one a node), every other node by :func:`run_node`; :class:`Hooks` see each node before it runs and its output;
* :func:`run_chained` - every node on its own upstream (all values kept);
* :func:`iter_graph` - streaming: node by node, each output dropped after its last consumer (a 50-layer model on a
  GPU), with overrides that may read any earlier value;
* :func:`run_backward` - a chained forward under autograd on the caller's leaves, then ``out.backward(g)``;
* :func:`iter_isolated` / :func:`iter_node_vjps` - each node alone on values the caller feeds (normally another
  execution's: the isolated view, forward and backward), :func:`node_vjp` one node's backward;
* :func:`node_calls` - a no-argument call per node on fixed values (the bench times nodes alone).

Stages (:mod:`h3gate.graph.stages`) run through :func:`run_chained` on a stage's sub-graph.

Every evaluation (:func:`run_node`, a grouped sibling, :func:`node_vjp`) is reported to the determinism recorder a
gate entered (:mod:`h3gate.graph.determinism`; nothing when none is), which compares evaluations on bit-identical
inputs; under one, :func:`iter_isolated` and :func:`iter_node_vjps` evaluate each node twice so that the isolated
view has a partner.

Overrides replace a node's function and come in two shapes: a plain callable ``fn(ops, inputs, params)`` (the node's
own signature: negative controls, row faults) or a :class:`NodeOverride` ``fn(ops, values, params, node)`` that sees
every value computed so far (the ablation probes and run ws2's rank-local nodes, which call :func:`run_node` on the
node they wrap).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from h3gate.errors import InputError
from h3gate.graph import determinism
from h3gate.graph.body_nodes import Gemm
from h3gate.graph.core import Graph, Node, OpTable, Values
from h3gate.kernels import launches


@dataclass(frozen=True)
class NodeOverride:
    """Replaces one node's function: ``fn(ops, values, params, node)`` sees every value computed so far (graph
    inputs included) and the full parameter mapping; ``reads`` names the earlier node outputs it needs beyond the
    node's own inputs, so that streaming execution keeps them alive."""

    fn: Callable[[OpTable, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Node], torch.Tensor]
    reads: tuple[str, ...] = ()
    label: str = ""


Override = Callable | NodeOverride


@dataclass(frozen=True)
class Hooks:
    """What a node loop tells its caller: ``before(node)`` right before the node runs (the strict adapter names the
    node its trace records belong to), ``after(node, out)`` with each output as it is made (observers, the bench's
    per-node events). Both are called for every node in order; grouped siblings run in one call at the first one's
    turn, so the first one's ``before`` precedes that call and the others' come after it."""

    before: Callable[[Node], None] | None = None
    after: Callable[[Node, torch.Tensor], None] | None = None


NO_HOOKS = Hooks()


def run_node(
    node: Node,
    ops: OpTable,
    values: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    override: Override | None = None,
) -> torch.Tensor:
    """``node``'s output from ``values`` (which hold at least its inputs), through ``override`` when given; kernel
    launches noted meanwhile belong to ``node`` (:mod:`h3gate.kernels.launches`)."""
    reads = (*node.inputs, *getattr(override, "reads", ()))
    seen = determinism.reading(params)
    with launches.node(node.name):
        if isinstance(override, NodeOverride):
            out = override.fn(ops, values, seen, node)
        else:
            fn = node.fn if override is None else override
            x = determinism.inject_backward(node.name, {k: values[k] for k in node.inputs}, node.row_dim, ops)
            out = fn(ops, x, seen)
    out = determinism.inject_forward(node.name, out, node.row_dim, ops)
    inputs = {k: values[k] for k in dict.fromkeys(reads)}
    used = determinism.read_of(seen)
    determinism.observe(node.name, "forward", ops, override, inputs, used, {"out": (out, node.row_dim)})
    return out


def sibling_gemms(nodes: Sequence[Node], k: int, ops: OpTable, overrides: Mapping[str, Override]) -> tuple[Node, ...]:
    """``nodes[k]`` and the one or two nodes right after it when one grouped call may compute them: each a
    :class:`Gemm` of the same operator on the same source, none overridden, and the table's callable for that
    operator has a ``grouped`` (``fn(x, weights) -> outputs``, bitwise the calls one by one); else ()."""
    first = nodes[k].fn
    if not isinstance(first, Gemm) or getattr(ops[first.op], "grouped", None) is None:
        return ()
    group: list[Node] = []
    for node in nodes[k : k + 3]:
        fn = node.fn
        if not isinstance(fn, Gemm) or (fn.op, fn.source) != (first.op, first.source) or node.name in overrides:
            break
        group.append(node)
    return tuple(group) if len(group) > 1 else ()


def _run_siblings(
    nodes: Sequence[Node],
    k: int,
    ops: OpTable,
    values: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    overrides: Mapping[str, Override],
) -> dict[str, torch.Tensor]:
    """The outputs of :func:`sibling_gemms` ``(nodes, k)`` by one grouped call, by node name (launches noted for each
    of them: :func:`h3gate.kernels.launches.current_nodes` names them during the call), or {} where there are none."""
    group = sibling_gemms(nodes, k, ops, overrides)
    if not group or determinism.injects_backward(n.name for n in group):
        return {}
    fns = [node.fn for node in group]
    with launches.node(*(node.name for node in group)):
        outs = ops[fns[0].op].grouped(values[fns[0].source], [params[fn.weight] for fn in fns])
    out: dict[str, torch.Tensor] = {}
    for node, y in zip(group, outs, strict=True):
        out[node.name] = determinism.inject_forward(node.name, y, node.row_dim, ops)
        source, weight = {k: values[k] for k in node.inputs}, {node.fn.weight: params[node.fn.weight]}
        determinism.observe(node.name, "forward", ops, None, source, weight, {"out": (out[node.name], node.row_dim)})
    return out


def run_nodes(
    nodes: Sequence[Node],
    ops: OpTable,
    values: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    overrides: Mapping[str, Override],
    hooks: Hooks = NO_HOOKS,
) -> Iterator[tuple[Node, torch.Tensor]]:
    """``(node, output)`` for each of ``nodes`` in order, reading ``values``, which the caller updates with each
    output before asking for the next: sibling GEMMs by one grouped call (:func:`sibling_gemms`), every other node
    by :func:`run_node`; ``hooks`` see each node before it runs and each output."""
    grouped: dict[str, torch.Tensor] = {}
    for k, node in enumerate(nodes):
        if hooks.before is not None:
            hooks.before(node)
        if node.name not in grouped:
            grouped = _run_siblings(nodes, k, ops, values, params, overrides)
        out = grouped.pop(node.name, None)
        out = run_node(node, ops, values, params, overrides.get(node.name)) if out is None else out
        if hooks.after is not None:
            hooks.after(node, out)
        yield node, out


def without_grouped(table: OpTable, ops: Iterable[str]) -> OpTable:
    """``table`` with each of ``ops`` whose callable offers ``grouped`` wrapped so that it does not: sibling GEMMs
    launched one by one, the same bytes (a bench arm's comparison); ``table`` itself when none of them groups."""

    def plain(fn: Callable) -> Callable:
        def run(*args, **kwargs):
            return fn(*args, **kwargs)

        return run

    plain_ops = {op: plain(table[op]) for op in ops if getattr(table[op], "grouped", None) is not None}
    return table.with_overrides(plain_ops) if plain_ops else table


def run_chained(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    node_overrides: Mapping[str, Override] | None = None,
    hooks: Hooks = NO_HOOKS,
) -> Values:
    """Execute every node on its own upstream. Returns graph inputs plus every node output, by name."""
    values: Values = dict(inputs)
    overrides = node_overrides or {}
    for node, out in run_nodes(graph.nodes, ops, values, params, overrides, hooks):
        values[node.name] = out
    return values


def last_uses(graph: Graph, overrides: Mapping[str, Override] | None = None) -> dict[str, int]:
    """Index of the last node reading each value (node inputs and overrides' ``reads``); a value no node reads
    (the graph's output) has none. :func:`iter_graph` drops a node output right after that node has run."""
    overrides = overrides or {}
    last_use: dict[str, int] = {}
    for k, node in enumerate(graph.nodes):
        for name in (*node.inputs, *getattr(overrides.get(node.name), "reads", ())):
            last_use[name] = k
    return last_use


def live_at(graph: Graph, k: int, overrides: Mapping[str, Override] | None = None) -> list[str]:
    """The node outputs :func:`iter_graph` holds when it yields node ``k``: its output, every earlier output node
    ``k`` or a later node still reads, and the outputs no node reads (never dropped)."""
    last = last_uses(graph, overrides)
    return [n.name for n in graph.nodes[: k + 1] if last.get(n.name, k) >= k]


def iter_graph(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    overrides: Mapping[str, Override] | None = None,
    hooks: Hooks = NO_HOOKS,
) -> Iterator[tuple[Node, torch.Tensor]]:
    """Run ``graph`` node by node, yielding ``(node, output)``; an output is dropped after its last consumer, so
    memory stays at the live set (what a 50-layer model needs on a GPU)."""
    overrides = overrides or {}
    missing = [k for k in graph.inputs if k not in inputs]
    if missing:
        raise InputError(f"graph {graph.name}: input {missing[0]} missing")
    last_use = last_uses(graph, overrides)
    values: dict[str, torch.Tensor] = dict(inputs)
    for k, (node, out) in enumerate(run_nodes(graph.nodes, ops, values, params, overrides, hooks)):
        values[node.name] = out
        yield node, out
        for name in [n for n, last in last_use.items() if last == k and n not in graph.inputs]:
            values.pop(name, None)
            del last_use[name]


def run_backward(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    cotangent: torch.Tensor,
    node_overrides: Mapping[str, Override] | None = None,
    retain_node_grads: bool = False,
) -> Values:
    """The gradient of ``<output, cotangent>``: a chained forward under autograd, then
    ``out.backward(cotangent.to(out.dtype))``. The caller owns the leaves (inputs and parameters it made
    ``requires_grad``) and reads their ``.grad``; with ``retain_node_grads`` every node output that requires grad
    keeps its ``.grad`` too. Returns the forward values."""
    with torch.enable_grad():
        values = run_chained(graph, inputs, params, ops, node_overrides)
        if retain_node_grads:
            for node in graph.nodes:
                if values[node.name].requires_grad:
                    values[node.name].retain_grad()
        out = values[graph.output]
        out.backward(cotangent.to(out.dtype))
    return values


Feed = Callable[[Node, tuple[str, ...]], Mapping[str, torch.Tensor]]


def iter_isolated(
    nodes: Iterable[Node],
    ops: OpTable,
    feed: Feed,
    params: Mapping[str, torch.Tensor],
    overrides: Mapping[str, Override] | None = None,
    repeat: bool = True,
) -> Iterator[tuple[Node, Mapping[str, torch.Tensor], torch.Tensor]]:
    """``(node, fed values, output)``: each of ``nodes`` alone under ``no_grad`` on ``feed(node, reads)`` (values
    holding at least its inputs and, for a :class:`NodeOverride`, the earlier values it ``reads``), normally another
    execution's values: the isolated view, which separates a node's own drift from the drift it inherited. Under a
    determinism recorder each node runs twice unless ``repeat`` is False (the caller's node VJPs recompute the same
    forward on the same values: its partner)."""
    overrides = overrides or {}
    for node in nodes:
        override = overrides.get(node.name)
        fed = feed(node, getattr(override, "reads", ()))
        with torch.no_grad():
            out = run_node(node, ops, fed, params, override)
            if repeat and determinism.active() is not None:  # the isolated evaluation's partner (compared)
                with determinism.again():
                    run_node(node, ops, fed, params, override)
        yield node, fed, out


class _Leaves(Mapping):
    """``params`` as gradient leaves: each a detached clone that requires grad, made when the node first reads it
    (``made``: the ones it read, in reading order), so a node's VJP copies only its own parameters."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params, self.made = params, {}

    def __getitem__(self, k: str) -> torch.Tensor:
        if k not in self.made:
            self.made[k] = self.params[k].detach().clone().requires_grad_(True)
            determinism.copies({k: self.made[k]}, self.params)
        return self.made[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def node_vjp(
    node: Node,
    ops: OpTable,
    feed: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    cotangent: torch.Tensor,
    wrt_inputs: Sequence[str],
    override: Override | None = None,
) -> dict[str, torch.Tensor]:
    """The gradients ``node``'s backward returns for ``wrt_inputs`` and its parameters, given ``cotangent`` (cast to
    the output's dtype): ``{"<node>:d<input or parameter>": gradient}``, unused leaves left out."""
    x = {k: (v.detach().clone().requires_grad_(True) if k in wrt_inputs else v) for k, v in feed.items()}
    p = _Leaves(params)
    seen = determinism.reading(p)
    with torch.enable_grad():
        out = run_node(node, ops, x, seen, override)
        used = [k for k in params if k in p.made]
        leaves = [*(x[k] for k in wrt_inputs), *(p.made[k] for k in used)]
        grads = torch.autograd.grad(out, leaves, cotangent.to(out.dtype), allow_unused=True)
    keys = [*wrt_inputs, *used]
    result = {f"{node.name}:d{k}": g for k, g in zip(keys, grads, strict=True) if g is not None}
    dims = {f"{node.name}:d{k}": (node.row_dim if k in wrt_inputs else None) for k in keys}
    fed = {**{k: feed[k] for k in node.inputs if k in feed}, "cotangent": cotangent}
    outs = {k: (g, dims[k]) for k, g in result.items()}
    determinism.observe(node.name, "vjp:" + ",".join(wrt_inputs), ops, override, fed, determinism.read_of(seen), outs)
    return result


def iter_node_vjps(
    nodes: Iterable[Node],
    ops: OpTable,
    feed: Callable[[Node], tuple[Mapping[str, torch.Tensor], Sequence[str]]],
    params: Mapping[str, torch.Tensor],
    cotangent: Callable[[Node], torch.Tensor],
    overrides: Mapping[str, Override] | None = None,
) -> Iterator[tuple[Node, Mapping[str, torch.Tensor], Sequence[str], dict[str, torch.Tensor]]]:
    """``(node, fed values, wrt, gradients)``: each of ``nodes`` alone, its backward (:func:`node_vjp`) of
    ``cotangent(node)`` on the values and inputs ``feed(node)`` names: the isolated view of the backward."""
    overrides = overrides or {}
    for node in nodes:
        fed, wrt = feed(node)
        override = overrides.get(node.name)
        grads = node_vjp(node, ops, fed, params, cotangent(node), wrt, override)
        if determinism.active() is not None:  # the isolated VJP's partner (the recorder compares them)
            with determinism.again():
                node_vjp(node, ops, fed, params, cotangent(node), wrt, override)
        yield node, fed, wrt, grads


def node_calls(
    graph: Graph, ops: OpTable, values: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> dict[str, Callable[[], torch.Tensor]]:
    """Node name -> a call running that node alone on ``values`` (every sibling its own launch): what a bench
    times one node at a time."""
    return {node.name: partial(run_node, node, ops, values, params) for node in graph.nodes}
