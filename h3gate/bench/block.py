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
from rich.table import Table

from h3gate.bench.timing import side_by_side
from h3gate.commands.console import stdout_console
from h3gate.errors import EXIT_PASS, InputError
from h3gate.evidence.writer import write_evidence
from h3gate.graph.block import build_block_graph
from h3gate.graph.core import OpTable, run_chained
from h3gate.graph.executions import bind_graph, candidate_table, provider_table
from h3gate.graph.inputs import stand_in
from h3gate.paths import LOCAL_EVIDENCE, display

KIND = "bench-ws1-block"
WARMUP = 3
WARMUP_S = 0.5
ITERS = 20


def bench_block(
    layout: str, config: str, device: str, out: Path | None, json_: bool, progress: Callable[[str], None] | None = None
) -> int:
    """Time the strict block and the provider block side by side; write ``bench-ws1-block.json``.

    ``progress(label)`` is called before each timed phase.
    """
    from h3gate.commands.run_cmd import LAYER, prepare_ws1_block

    if not device.startswith("cuda"):
        raise InputError(f"--device {device}: bench needs --device cuda (CUDA-event timings)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    setup = prepare_ws1_block(layout, config, None, device, 0, "strict")
    graph = build_block_graph(setup.cfg, LAYER)
    bindings = bind_graph(graph, "strict", device)
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
            out = run_chained(graph, {**x, "hidden_states": hs, "temb": temb}, leaves, table)[graph.output]
            out.backward(cot)
            return hs.grad

        return run

    results: dict[str, dict] = {}
    for phase, make in (("forward", forward), ("forward_backward", forward_backward)):
        if progress is not None:
            progress(f"{phase} (provider and strict, {ITERS} rounds)")
        stats = side_by_side({who: make(t) for who, t in tables.items()}, iters=ITERS, warmup=WARMUP, warmup_s=WARMUP_S)
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
    folder = Path(out) if out is not None else LOCAL_EVIDENCE / "bench" / f"ws1-block-{setup.config_name}-{layout}"
    path = write_evidence(folder, f"{KIND}.json", KIND, body, manifests=setup.manifests, device=device)
    if json_:
        print(path.read_text(encoding="utf-8"), end="")
        return EXIT_PASS
    table = Table(title=f"bench ws1-block {setup.config_name} / {layout} (S={setup.layout.seq_len}) on {device}")
    for col in ("phase", "provider ms", "strict ms", "strict / provider"):
        table.add_column(col)
    for phase, r in results.items():
        table.add_row(
            phase,
            f"{r['provider']['median_ms']:.3f}",
            f"{r['strict']['median_ms']:.3f}",
            f"{r['strict_over_provider']:.2f}x",
        )
    console = stdout_console()
    console.print(table)
    console.print(f"evidence: {display(path)}")
    return EXIT_PASS
