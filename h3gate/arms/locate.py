"""First drift of an arm: the drifting step re-run on both sides with every node value observed.

A :class:`Side` is one forward that hands every node's value to an observer. On the diffusers module both sides run
under ``h3gate.strict`` (:func:`diffusers_side`; ``P`` as ``mode="off"``: the provider references, op for op
diffusers' forward; ``R`` as ``mode="strict"``, in the stack's merge order): the rollout side as the rollout ran it
(the B requests, no grad), the training side in the composition that drifted (alone, or the shuffled batch; grad
enabled, the same fault if one was injected). With an SGLang rollout its side is SGLang's forward with every node
captured (:func:`h3gate.arms.sglang_side.sglang_side`). The re-runs' outputs are checked against what the arm
recorded (``replay_faithful``: false means a side's replay is not what ran, and the location below is not trusted).
Every node output is reduced to one exact integer digest per row (the value's bits as int64 times fixed odd weights,
summed with wrap-around: integer sums have no order), so the two sides need not be held at once; the first node
(the rollout side's order) whose rows of the request differ is then captured on both sides to name the packed row,
modality and drift size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import h3gate.strict
from h3gate.arms.sides import State, call
from h3gate.arms.stack import Stack
from h3gate.gate.compare import agreement, bitwise_equal
from h3gate.graph.core import Node
from h3gate.runs.model_lanes import row_labels

INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Observer = Callable[[Node, torch.Tensor], None]


@dataclass
class Side:
    """One side of the location: ``run(observe)`` is one forward of the requests ``rows`` (request indices in batch
    order) calling ``observe(node, value)`` on every node value, returning the velocities; ``recorded``: the
    velocities that side produced in the arm, the located request's slice; ``uncovered``: nodes the side cannot
    observe, with the reason."""

    run: Callable[[Observer], State]
    rows: list[int]
    recorded: State
    uncovered: dict[str, str] = field(default_factory=dict)


def row_digests(value: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """One int64 per row (``(B, rows)`` for batched values, ``(rows,)`` or ``(1,)`` otherwise): exact, order-free."""
    t = value.detach().contiguous()
    bits = t.view(INT_VIEW[t.element_size()]).to(torch.int64)
    if row_dim == 1 and bits.ndim >= 2:
        bits = bits.reshape(bits.shape[0], bits.shape[1], -1)
    elif row_dim == 0 and bits.ndim >= 1:
        bits = bits.reshape(bits.shape[0], -1)
    else:
        bits = bits.reshape(1, -1)
    n = bits.shape[-1]
    weights = torch.arange(n, device=bits.device, dtype=torch.int64) * 2654435761 + 40503
    return (bits * (weights | 1)).sum(-1)


def diffusers_side(
    stack: Stack, mode: str, step: int, inputs: State, rows: list[int], grad: bool, overrides: dict | None,
    recorded: State,
) -> Side:  # fmt: skip
    """The user's module under the binding in ``mode`` on ``rows`` of ``inputs``, observed node by node."""

    def run(observe: Observer) -> State:
        device = stack.device
        idx = torch.tensor(rows, device=device)
        x, a = inputs[0].to(device).index_select(0, idx), inputs[1].to(device).index_select(0, idx)
        with h3gate.strict(stack.model, mode=mode, merge=stack.settings.merge) as session:
            session.observer = observe
            session.overrides = overrides or {}
            with torch.set_grad_enabled(grad):
                v, u = call(stack, step, x, a, stack.text().index_select(0, idx))
        return v.detach().cpu(), u.detach().cpu()

    return Side(run, list(rows), recorded)


def locate(stack: Stack, step: int, request: int, sides: tuple[Side, Side]) -> dict:
    """The first-drift record of request ``request`` at ``step`` between the rollout side and the training side
    (module docstring)."""
    digests: list[dict[str, torch.Tensor]] = [{}, {}]
    nodes: dict[str, Node] = {}
    faithful = []
    for k, side in enumerate(sides):
        pos = side.rows.index(request)

        def observe(node: Node, value: torch.Tensor, _k=k, _pos=pos) -> None:
            d = row_digests(value, node.row_dim)
            digests[_k][node.name] = (d[_pos] if node.row_dim == 1 else d).cpu()
            nodes.setdefault(node.name, node)

        v, u = side.run(observe)
        got = (v[pos : pos + 1], u[pos : pos + 1])
        faithful.append(all(bitwise_equal(g, r) for g, r in zip(got, side.recorded, strict=True)))
    first = next((n for n in digests[0] if not torch.equal(digests[0][n], digests[1].get(n, torch.empty(0)))), None)
    record = {"step": step, "request": request, "replay_faithful": {"rollout": faithful[0], "training": faithful[1]}}
    uncovered = {**sides[0].uncovered, **sides[1].uncovered}
    if uncovered:
        record["uncovered"] = uncovered
    if first is None:
        return {**record, "node": None, "layer": None, "stage": None, "row": None, "modality": None,
                "max_abs": None, "rel_l2": None}  # fmt: skip
    node = nodes[first]
    captured: list[torch.Tensor] = []
    for side in sides:
        pos = side.rows.index(request)

        def grab(n: Node, value: torch.Tensor, _pos=pos) -> None:
            if n.name == first:
                captured.append((value.narrow(0, _pos, 1) if n.row_dim == 1 else value).detach().cpu())

        side.run(grab)
    packed = list(stack.layout.row_modalities())
    mods = row_labels(node.meta["rows"], captured[0], node.row_dim, packed)
    agree = agreement(captured[1], captured[0], node.row_dim, mods)
    return {**record, "node": first, "layer": node.layer, "stage": node.meta["stage"], "row": agree["first_row"],
            "modality": agree["first_modality"], "max_abs": agree["max_abs"], "rel_l2": agree["rel_l2"]}  # fmt: skip
