"""Helpers of the SGLang tests (the fixture is in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from h3gate.graph.core import Graph
from h3gate.graph.execute import run_chained
from h3gate.graph.executions import provider_table
from h3gate.graph.model import RawMetadata
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.layouts import load_layout
from h3gate.manifests.model_config import ModelConfig
from h3gate.runs.model_stages import model_inputs
from h3gate.synth import SyntheticSource

REQUIRE = "H3GATE_REQUIRE_SGLANG"
MARKS = [pytest.mark.sglang, pytest.mark.xdist_group("sglang")]  # every module here: pytestmark = MARKS


@dataclass
class Tiny:
    cfg: ModelConfig
    source: SyntheticSource
    params: dict[str, torch.Tensor]
    graph: Graph
    model: torch.nn.Module


def batch_inputs(
    layout_name: str, cfg: ModelConfig, batch: int
) -> tuple[dict[str, torch.Tensor], RawMetadata, PackedLayout]:
    """h3gate's graph inputs for ``batch`` requests (items 0 .. batch-1 of seed 0) on one layout, its raw metadata and
    the layout."""
    layout = build_layout(load_layout(layout_name), layout_name)
    items = [model_inputs(layout, cfg, 0, "cpu", item=i) for i in range(batch)]
    tensors = dict(items[0][0])
    for key in ("video_rows", "audio_rows", "text"):
        tensors[key] = torch.cat([inputs[key] for inputs, _ in items])
    return tensors, items[0][1]["raw"], layout


def provider(t: Tiny, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """h3gate's provider replay (diffusers 0.42.1 op for op): every node's value."""
    with torch.no_grad():
        return run_chained(t.graph, tensors, t.params, provider_table())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf")


def tp_rank(rank: int, world: int, port: int, out: str) -> None:
    """One TP rank of SGLang's DiT on gloo (``python -c``, one process a rank): torch.distributed first (TCP store on
    127.0.0.1), then the adapter's runtime at ``tp=world``, the tiny model by SGLang's loader (each rank loads its
    shards), one forward on the micro layout; rank 0 writes the outputs and the degrees to ``out`` (safetensors)."""
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    from h3gate.adapters.sglang import build, inputs, runtime
    from h3gate.manifests.model_config import load_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = load_config("tiny").config
    runtime.init_runtime(tp=world)
    model = build.build_model(SyntheticSource(cfg, 0))
    tensors, raw, layout = batch_inputs("micro", cfg, 1)
    out_values = inputs.run_forward(model, tensors, raw, inputs.packing(1, layout.seq_len, raw.text_indices))
    if rank == 0:
        tp = torch.tensor([runtime.degrees()["tp"]])
        save_file({**{k: v.contiguous() for k, v in out_values.items()}, "tp": tp}, out)
    dist.destroy_process_group()


def downstream(graph: Graph, names: set[str]) -> set[str]:
    """``names`` and every node of ``graph`` that reads one of them, directly or not."""
    out = set(names)
    for node in graph.nodes:
        if any(k in out for k in node.inputs):
            out.add(node.name)
    return out


def moved_rows(a: torch.Tensor, b: torch.Tensor) -> set[tuple[int, int]]:
    """(item, row) of every row where two (B, rows, ...) values differ."""
    return {tuple(r) for r in (a != b).flatten(2).any(-1).nonzero().tolist()}
