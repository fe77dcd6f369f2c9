"""One rank of the parallel harness (``python -m h3gate.parallel.worker --rank R --world W --dir D``; gloo).

Reads ``D/spec.json`` and ``D/inputs``, draws the synthetic weights of the spec's seed, binds the op table for its
mode, runs the graph once per plan with that plan's node overrides and, on rank 0, writes ``D/<plan>.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from h3gate.parallel.launch import rank_main
from h3gate.parallel.overrides import overrides_for
from h3gate.parallel.plans import plan_from_record


def run_rank(rank: int, world: int, folder: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from h3gate.graph.execute import iter_graph
    from h3gate.graph.executions import bind_graph, candidate_table, provider_table
    from h3gate.graph.model import build_model_graph, load_model_params
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import SyntheticSource

    spec = json.loads((folder / "spec.json").read_text(encoding="utf-8"))
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world)
    cfg = load_config(spec["config"]).config
    params = load_model_params(SyntheticSource(cfg, spec["seed"]), cfg)
    graph = build_model_graph(cfg)
    ops = provider_table() if spec["mode"] == "off" else candidate_table(bind_graph(graph, spec["mode"], "cpu"))
    inputs = load_file(str(folder / "inputs"))
    for name, record in spec["plans"].items():
        overrides, report = overrides_for(cfg, graph, plan_from_record(record), rank, inputs)
        out, local_shapes = {}, {}
        with torch.no_grad():
            for node, value in iter_graph(graph, inputs, params, ops, overrides):
                if node.name in overrides and (".0." in node.name or node.name.startswith("heads.")):
                    local_shapes[node.name] = list(value.shape)
                full = report(node, value)
                if rank == 0:
                    out[node.name] = full.clone().contiguous()
        if rank == 0:
            info = {"overridden_nodes": str(len(overrides)), "rank0_local_shapes": json.dumps(local_shapes)}
            save_file(out, str(folder / f"{name}.safetensors"), metadata=info)
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, "h3gate.parallel.worker", "one gloo harness rank", run_rank)


if __name__ == "__main__":
    sys.exit(main())
