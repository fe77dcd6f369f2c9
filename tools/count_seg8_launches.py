"""Launches of the seg8 block's backward on the CPU (Triton's interpreter), before and after the fused row-segment
weight gradient (kernels/rows_dw.py): every Triton kernel launch and every aten op that computes (a device kernel on
CUDA; views and allocations left out), by name, counted while autograd runs the backward. ``v1`` runs the seg8
GEMMs' weight gradients and the seg8 norms' backward as before (tests/triton_kernels/rows_dw_reference.py: a launch
per row segment (the QK norm: per head group and row segment), the torch tree); ``v2`` as shipped. Also checks
that both give every gradient (inputs and parameters) byte for byte.

    TRITON_INTERPRET=1 PYTHONPATH=. python tools/count_seg8_launches.py [--layout tiny] [--config tiny] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing on a device: views, metadata, allocations without a fill
NO_LAUNCH = frozenset({"view", "_unsafe_view", "reshape", "alias", "as_strided", "slice", "select", "t", "transpose",
                       "permute", "expand", "detach", "empty", "empty_strided", "empty_like", "unsqueeze", "squeeze",
                       "split", "split_with_sizes", "unbind", "_reshape_alias", "lift_fresh", "set_", "resize_",
                       "is_same_size", "_to_copy_meta"})  # fmt: skip


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class _AtenCount(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts
        self.in_kernel = 0  # the interpreter's own tensor copies around a launch are not launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if in_backward() and not self.in_kernel and name not in NO_LAUNCH:
            self.counts[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[Counter]:
    """Within the block, the backward's launches by name: ``triton.<kernel>`` and ``aten.<op>`` (interpreter only)."""
    from triton.runtime.interpreter import InterpretedFunction

    counts: Counter = Counter()
    original = InterpretedFunction.run
    aten = _AtenCount(counts)

    def run(self, *args, **kwargs):
        if in_backward():
            counts[f"triton.{self.fn.__name__}"] += 1
        aten.in_kernel += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            aten.in_kernel -= 1

    with mock.patch.object(InterpretedFunction, "run", run), aten:
        yield counts


def _norm_backward_v1(ctx, grad):
    """v1's ``_RmsNormRows.backward``: a norm backward launch per row segment."""
    from h3gate.kernels.norms import rms_backward
    from tests.triton_kernels.rows_dw_reference import rmsnorm_rows_backward_v1

    x, weight, rstd, scale = ctx.saved_tensors
    need, g = tuple(ctx.needs_input_grad[1:4]), grad.contiguous()
    if not any(need):
        return rms_backward(x, weight, rstd, g, scale, ctx.idx)[0], None, None, None, None, None, None
    return *rmsnorm_rows_backward_v1(x, weight, rstd, g, scale, ctx.idx, ctx.rows, need), None, None, None


def _qk_backward_v1(ctx, grad):
    """v1's ``QkNormGrouped.backward``: a norm backward launch per (head group, row segment)."""
    from tests.triton_kernels.rows_dw_reference import qk_norm_backward_v1

    xv, weight, rstd = ctx.saved_tensors
    dx, dw = qk_norm_backward_v1(xv, weight, rstd, grad.contiguous(), ctx.heads, ctx.first, ctx.rows, ctx.group)
    return dx, dw, None, None, None, None


@contextmanager
def weight_grads(version: str) -> Iterator[None]:
    """``v1``: the seg8 GEMMs' weight gradients by the reference (8 launches per weight, the torch tree), the seg8
    modulated norms' backward by a launch per row segment, the QK norms' by a launch per (head group, row segment)."""
    with ExitStack() as stack:
        if version == "v1":
            from h3gate.kernels import gemm_merge, rows_seg8, tp_layers
            from tests.triton_kernels.rows_dw_reference import linear_row_grads_v1

            for module in (gemm_merge, tp_layers):
                stack.enter_context(mock.patch.object(module, "linear_row_grads", linear_row_grads_v1))
            norm, qk = rows_seg8._RmsNormRows, tp_layers.QkNormGrouped
            stack.enter_context(mock.patch.object(norm, "backward", staticmethod(_norm_backward_v1)))
            stack.enter_context(mock.patch.object(qk, "backward", staticmethod(_qk_backward_v1)))
        yield


def block_backward(layout: str, config: str, version: str) -> tuple[Counter, dict[str, torch.Tensor]]:
    """The launches of one backward of the seg8 block at ``layout`` / ``config`` on the CPU, and its gradients."""
    from h3gate.graph.execute import run_backward
    from h3gate.graph.executions import bind_graph, candidate_table
    from h3gate.graph.inputs import stand_in
    from h3gate.numerics import strict_numerics
    from h3gate.runs.setup import RunSpec, prepare

    with strict_numerics():
        setup = prepare(RunSpec("block", layout, config, None, "cpu", 0, "strict"))
        table = candidate_table(bind_graph(setup.graph, "strict", "cpu", "seg8"))
        x, h = setup.inputs.tensors, setup.inputs.tensors["hidden_states"]
        cot = stand_in(0, "cotangent", 0, h.shape[1], h.shape[2], h.device)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in setup.params.items()}
        inputs = {**x, "hidden_states": h.detach().clone().requires_grad_(True),
                  "temb": x["temb"].detach().clone().requires_grad_(True)}  # fmt: skip
        with weight_grads(version), counting() as counts:
            run_backward(setup.graph, inputs, leaves, table, cot)
    grads = {k: t.grad for k, t in {**inputs, **leaves}.items() if isinstance(t, torch.Tensor) and t.grad is not None}
    return counts, grads


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("count_seg8_launches: set TRITON_INTERPRET=1 (launches are counted in Triton's interpreter)")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="tiny")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs = {v: block_backward(args.layout, args.config, v) for v in ("v1", "v2")}
    counts = {v: c for v, (c, _) in runs.items()}
    g1, g2 = runs["v1"][1], runs["v2"][1]
    differ = [k for k in g1 if k not in g2 or not torch.equal(g1[k].view(torch.uint8), g2[k].view(torch.uint8))]
    print(f"gradients: {len(g1)} tensors, v2 {'byte-equal to v1' if not differ and len(g1) == len(g2) else differ}")
    names = sorted(set(counts["v1"]) | set(counts["v2"]))
    print(f"{'launch':40s} {'v1':>6s} {'v2':>6s}")
    for name in names:
        print(f"{name:40s} {counts['v1'][name]:6d} {counts['v2'][name]:6d}")
    for kind in ("triton.", "aten."):
        print(f"{kind + '*':40s} " + " ".join(f"{sum(c for n, c in counts[v].items() if n.startswith(kind)):6d}"
                                             for v in ("v1", "v2")))  # fmt: skip
    print(f"{'total':40s} {sum(counts['v1'].values()):6d} {sum(counts['v2'].values()):6d}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"layout": args.layout, "config": args.config, "gradients": len(g1), "differ": differ,
                       **{v: dict(c) for v, c in counts.items()}}, f)  # fmt: skip
    return 1 if differ or len(g1) != len(g2) else 0


if __name__ == "__main__":
    sys.exit(main())
