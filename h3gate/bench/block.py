"""``h3gate bench ws1-block``: the strict block next to the provider block, forward and forward + backward.

Both executions run in one process on the same inputs (synthetic weights of ``--config``, the ``--layout`` block
inputs) and are timed side by side by :func:`h3gate.bench.timing.side_by_side` (warm-up, then interleaved rounds,
L2 flushed before each call, CUDA events per call); the report gives the median / min / max in milliseconds and the
strict / provider ratio of the medians. Forward runs under ``no_grad``; forward + backward is one
``out.backward(g)`` with a seeded cotangent into fresh leaves. Strict mode fails closed before anything is timed
when a node has no strict kernel. TF32 is off for both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from h3gate.bench.timing import side_by_side
from h3gate.errors import InputError
from h3gate.graph.core import OpTable
from h3gate.graph.execute import run_backward, run_chained
from h3gate.graph.executions import candidate_table, provider_table
from h3gate.graph.inputs import stand_in
from h3gate.numerics import strict_numerics
from h3gate.runs.setup import prepare

KIND = "bench-ws1-block"
WARMUP = 3
WARMUP_S = 0.5
ITERS = 20


def bench_block(
    layout: str, config: str, device: str, progress: Callable[[str], None] | None = None
) -> tuple[dict, list[Path]]:
    """Time the strict block and the provider block side by side: the ``bench-ws1-block`` body and the manifests
    read (the caller, ``h3gate bench ws1-block``, writes and prints; this runs under its numerics switch).

    ``progress(label)`` is called before each timed phase.
    """
    if not device.startswith("cuda"):
        raise InputError(f"--device {device}: bench needs --device cuda (CUDA-event timings)")
    with strict_numerics(device):
        setup = prepare(layout, config, None, device, 0, "strict")
        graph, bindings = setup.graph, setup.bindings
        tables: dict[str, OpTable] = {"provider": provider_table(), "strict": candidate_table(bindings)}
        x, params = setup.inputs.tensors, setup.params
        h = x["hidden_states"]
        cot = stand_in(0, "cotangent", 0, h.shape[1], h.shape[2], h.device)

        def forward(table: OpTable) -> Callable[[], object]:
            def run() -> object:
                with torch.no_grad():
                    return run_chained(graph, x, params, table)[graph.output]

            return run

        def forward_backward(table: OpTable) -> Callable[[], object]:
            leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}

            def run() -> object:
                hs = h.detach().clone().requires_grad_(True)
                temb = x["temb"].detach().clone().requires_grad_(True)
                for p in leaves.values():
                    p.grad = None
                run_backward(graph, {**x, "hidden_states": hs, "temb": temb}, leaves, table, cot)
                return hs.grad

            return run

        results: dict[str, dict] = {}
        for phase, make in (("forward", forward), ("forward_backward", forward_backward)):
            if progress is not None:
                progress(f"{phase} (provider and strict, {ITERS} rounds)")
            stats = side_by_side(
                {who: make(t) for who, t in tables.items()}, iters=ITERS, warmup=WARMUP, warmup_s=WARMUP_S
            )
            ratio = stats["strict"]["median_ms"] / stats["provider"]["median_ms"]
            results[phase] = {**stats, "strict_over_provider": ratio}
        body = {
            "config": setup.config_name,
            "layout": {"name": layout, "seq_len": setup.layout.seq_len, "rows": setup.layout.rows_per_modality()},
            "device": device,
            "method": (
                f"h3gate.bench.timing.side_by_side: warm-up rounds (at least {WARMUP} and {WARMUP_S} s), then {ITERS} "
                "interleaved rounds (provider, strict), L2 flushed before each call, CUDA events per call; "
                "median / min / max"
            ),
            "bindings": {name: nb.record() for name, nb in bindings.items()},
            "results": results,
        }
    return body, setup.manifests
