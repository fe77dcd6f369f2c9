"""Deliberate one-row faults: the negative controls every gate must catch and locate.

A fault is a node override (the gate's own ``node_overrides`` mechanism, as the ablation probes use; no
environment backdoor) that corrupts ONE packed row of one node, on the candidate only:

* ``scale``: the row times ``1 + 2^-6`` (rounded once to the tensor's dtype: 2 to 4 BF16 ulps);
* ``zero_tail``: the row's last 16 columns set to zero.

``forward`` faults corrupt the node's output; ``backward`` faults leave the forward intact and corrupt the
gradient the node's backward hands to its first (activation) input, as a wrong backward kernel would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from h3gate.graph.core import Node, OpTable

SCALE = 1.0 + 2.0**-6
TAIL = 16
KINDS = ("scale", "zero_tail")
DIRECTIONS = ("forward", "backward")


def fault_axis(t: torch.Tensor, row_dim: int | None) -> int | None:
    """The axis :func:`corrupt` faults along: ``row_dim``, else dim 0 of a 2-d+ tensor; None: the whole tensor."""
    return row_dim if row_dim is not None else (0 if t.ndim >= 2 else None)


def row_slice(t: torch.Tensor, row: int, row_dim: int | None) -> torch.Tensor:
    """Row ``row`` of ``t`` as a one-row view along :func:`fault_axis` (the whole tensor when it has no row axis);
    ``corrupt(row_slice(t, r, d), 0, d, kind)`` holds the bytes of row ``r`` of ``corrupt(t, r, d, kind)``."""
    dim = fault_axis(t, row_dim)
    return t if dim is None else t.narrow(dim, row, 1)


def corrupt(t: torch.Tensor, row: int, row_dim: int | None, kind: str) -> torch.Tensor:
    """A copy of ``t`` with one row corrupted (differentiable through the untouched rows)."""
    dim = fault_axis(t, row_dim)
    out = t.clone()
    view = out.reshape(1, -1) if dim is None else out.movedim(dim, 0)
    target = view[0 if dim is None else row]
    if kind == "scale":
        target.copy_((target.double() * SCALE).to(t.dtype))
    elif kind == "zero_tail":
        flat = target.reshape(-1).clone()
        flat[-TAIL:] = 0
        target.copy_(flat.view(target.shape))
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
    return out


class _GradFault(torch.autograd.Function):
    """Identity forward; the backward corrupts one row of the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, row: int, row_dim: int | None, kind: str) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = (row, row_dim, kind)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        row, row_dim, kind = ctx.spec
        return corrupt(grad, row, row_dim, kind), None, None, None


def grad_fault(x: torch.Tensor, row: int, row_dim: int | None, kind: str) -> torch.Tensor:
    """``x`` unchanged forward; in the backward, the gradient reaching ``x`` corrupted on ``row``."""
    return _GradFault.apply(x, row, row_dim, kind)


@dataclass(frozen=True)
class RowFault:
    """Corrupt packed row ``row`` of ``node`` (``forward``: its output; ``backward``: its input gradient)."""

    node: str
    row: int
    kind: str = "scale"
    direction: str = "forward"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: must be one of {KINDS}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"fault direction {self.direction!r}: must be one of {DIRECTIONS}")

    def label(self) -> str:
        return f"{self.direction}:{self.node}:row {self.row}:{self.kind}"

    def override(self, node: Node, row_dims: Mapping[str, int | None]) -> Callable:
        """The node override: ``fn(ops, inputs, params)`` with this fault applied. ``row_dims`` gives the row axis
        of every graph value (the faulted input's, for a backward fault)."""
        fn, row, kind = node.fn, self.row, self.kind
        if self.direction == "forward":

            def faulted(ops: OpTable, x: Mapping[str, torch.Tensor], p: Mapping[str, torch.Tensor]) -> torch.Tensor:
                return corrupt(fn(ops, x, p), row, node.row_dim, kind)

            return faulted
        source = node.inputs[0]
        source_dim = row_dims.get(source)

        def faulted_grad(ops: OpTable, x: Mapping[str, torch.Tensor], p: Mapping[str, torch.Tensor]) -> torch.Tensor:
            x = dict(x)
            if x[source].requires_grad:
                x[source] = grad_fault(x[source], row, source_dim, kind)
            return fn(ops, x, p)

        return faulted_grad
