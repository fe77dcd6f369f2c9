"""Helpers of the SGLang tests (the fixture is in conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from h3gate.graph.core import Graph
from h3gate.graph.execute import run_chained
from h3gate.graph.executions import bind_graph, candidate_table, provider_table
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


def strict_graph(t: Tiny, tensors: dict[str, torch.Tensor], merge: str = "single") -> dict[str, torch.Tensor]:
    """h3gate's own graph with the strict candidate table (``merge`` order): every node's value."""
    with torch.no_grad():
        return run_chained(t.graph, tensors, t.params, candidate_table(bind_graph(t.graph, "strict", "cpu", merge)))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf")


def run_ranks(tmp_path: Path, call: str, world: int = 2, timeout: float = 240) -> None:
    """``python -c "from tests.sglang.helpers import ...; <call>"`` once per rank (``{rank}``, ``{port}``: a free
    local port, formatted into ``call``), all at once; fails with every rank's log tail when one exits non-zero."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    logs = [(tmp_path / f"rank{r}.log").open("w") for r in range(world)]
    procs = [
        subprocess.Popen([sys.executable, "-c", call.format(rank=r, port=port)], cwd=root, stdout=log,
                         stderr=subprocess.STDOUT)
        for r, log in enumerate(logs)
    ]  # fmt: skip
    for p, log in zip(procs, logs, strict=True):
        p.wait(timeout=timeout)
        log.close()
    tails = [f"rank {r} (exit {p.returncode}): " + (tmp_path / f"rank{r}.log").read_text()[-2000:]
             for r, p in enumerate(procs)]  # fmt: skip
    assert all(p.returncode == 0 for p in procs), "\n".join(tails)


def _init_rank(rank: int, world: int, port: int) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _end_rank() -> None:
    """Every rank waits for the others (rank 0 writes the outputs last) before the process group goes: a rank that
    tears down its gloo pairs while a peer still holds them can die in teardown (``terminate called``) after its work
    is done, as the launcher's ranks would without :func:`torch.distributed.barrier` (h3gate/arms/sglang_tp.py)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def tp_rank(rank: int, world: int, port: int, out: str) -> None:
    """One TP rank of SGLang's DiT on gloo (``python -c``, one process a rank): torch.distributed first (TCP store on
    127.0.0.1), then the adapter's runtime at ``tp=world``, the tiny model by SGLang's loader (each rank loads its
    shards), one forward on the micro layout; rank 0 writes the outputs and the degrees to ``out`` (safetensors)."""
    from safetensors.torch import save_file

    from h3gate.adapters.sglang import build, inputs, runtime
    from h3gate.manifests.model_config import load_config

    _init_rank(rank, world, port)
    cfg = load_config("tiny").config
    runtime.init_runtime(tp=world)
    model = build.build_model(SyntheticSource(cfg, 0))
    tensors, raw, layout = batch_inputs("micro", cfg, 1)
    out_values = inputs.run_forward(model, tensors, raw, inputs.packing(1, layout.seq_len, raw.text_indices))
    if rank == 0:
        tp = torch.tensor([runtime.degrees()["tp"]])
        save_file({**{k: v.contiguous() for k, v in out_values.items()}, "tp": tp}, out)
    _end_rank()


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


STRICT_TP = ("ws2-tiny", "micro", 2)  # config (heads and FFN channels on seg8 boundaries at TP2), layout, requests
STRICT_SP = ("tiny", "micro", 1)  # Ulysses: 2 heads, one a rank; the single-walk order; the direct path (B = 1)


def strict_rank(rank: int, world: int, port: int, out: str, kind: str = "tp") -> None:
    """One rank of SGLang's DiT under the strict binding on gloo, ``kind`` ``"tp"`` (TP``world``, ``merge="seg8"``,
    :data:`STRICT_TP`, requests packed with padding on the serving path) or ``"ulysses"`` (Ulysses ``world``,
    ``merge="single"``, :data:`STRICT_SP`, the direct path: SGLang's forward slices a rank's rows itself, while the
    adapter's serving kwargs are world-size-1's). The model comes from SGLang's loader (a TP rank loads its shards); a
    TP rank checks that its shards of q|k|v, fc1, out_proj and fc2 are h3gate's TP ownership of the full weights
    (:class:`h3gate.parallel.tp.TpRank`: heads and FFN channels of chunk ``rank``; fc1 as SGLang's [gate | value] of
    h3gate's [value | gate] pairs). Rank 0 writes the outputs, the degrees, the TP layers the trace names and the
    shard check to ``out`` (safetensors)."""
    from safetensors.torch import save_file

    from h3gate.adapters.sglang import build, inputs, runtime
    from h3gate.adapters.sglang.strict_bind import bind_strict
    from h3gate.graph.model import load_model_params
    from h3gate.kernels.tp_layers import ONE_DEVICE
    from h3gate.manifests.model_config import load_config
    from h3gate.parallel.tp import TpRank

    _init_rank(rank, world, port)
    tp = kind == "tp"
    config, layout_name, batch = STRICT_TP if tp else STRICT_SP
    cfg = load_config(config).config
    runtime.init_runtime(tp=world if tp else 1, sp=1 if tp else world)
    source = SyntheticSource(cfg, 0)
    model = build.build_model(source)
    shards_match = True
    if tp:
        full = load_model_params(source, cfg)
        own = TpRank(world, rank, cfg.num_attention_heads, cfg.attention_head_dim, cfg.hidden_size, cfg.ffn_dim,
                     ONE_DEVICE)  # fmt: skip
        shards_match = all(_shards_match(model, full, own, i) for i in range(cfg.num_layers))
    tensors, raw, layout = batch_inputs(layout_name, cfg, batch)
    with bind_strict(model, "strict", merge="seg8" if tp else "single") as session:
        pack = inputs.packing(batch, layout.seq_len, raw.text_indices, serving=tp)  # serving kwargs: SP 1 only
        values = inputs.run_forward(model, tensors, raw, pack)
    layers = sorted({r["tp_layer"] for r in session.trace if "tp_layer" in r})
    if rank == 0:
        flags = {k: torch.tensor([v]) for k, v in runtime.degrees().items()}
        flags.update(shards_match=torch.tensor([shards_match]), tp_layers=torch.tensor([len(layers)]))
        save_file({**{k: v.contiguous() for k, v in values.items()}, **flags}, out)
    _end_rank()


def _shards_match(model: torch.nn.Module, full: dict[str, torch.Tensor], tp, layer: int) -> bool:
    block, p = model.blocks[layer], f"transformer_blocks.{layer}."
    f = tp.ffn // tp.degree
    qkv = torch.cat([tp.param_shard(f"attn.to_{w}.weight").take(full[f"{p}attn.to_{w}.weight"]) for w in "qkv"])
    pairs = tp.param_shard("ff.net.0.proj.weight").take(full[f"{p}ff.net.0.proj.weight"])  # [value_r | gate_r]
    return (
        torch.equal(block.attn.qkv_proj.weight, qkv)
        and torch.equal(block.mlp.fc1.weight, torch.cat([pairs[f:], pairs[:f]]))
        and torch.equal(
            block.attn.out_proj.weight, tp.param_shard("attn.to_out.0.weight").take(full[f"{p}attn.to_out.0.weight"])
        )
        and torch.equal(block.mlp.fc2.weight, tp.param_shard("ff.net.2.weight").take(full[f"{p}ff.net.2.weight"]))
    )
