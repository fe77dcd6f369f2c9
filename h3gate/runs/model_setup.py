"""One setup for the whole-model engines (``run ws1-model``): everything checked before any weight is read.

Order: device and mode; config (named, a YAML path, or the checkpoint's ``config.json``); layout; ``--layers``; the
weight source holds every tensor the selected stages read, with the inventory's shape and dtype (a checkpoint
missing a layer is named here, nothing loaded); a lower bound on memory against the device; the graph is bound
(strict mode fails closed naming the node). Weights are then read one stage at a time by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gate.errors import InputError
from h3gate.graph.core import Graph
from h3gate.graph.executions import NodeBinding, bind_graph
from h3gate.graph.model import build_model_graph
from h3gate.graph.stages import Stage, split_stages
from h3gate.inventory import expected_inventory
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.layouts import LAYOUTS_FILE, load_layout
from h3gate.manifests.model_config import ModelConfig
from h3gate.ops.registry import check_mode
from h3gate.paths import MANIFESTS
from h3gate.runs.model_stages import StageWeights, model_inputs
from h3gate.runs.setup import check_device, config_for

UNRELATED_ITEMS = 2  # batch placements need at most two unrelated requests (a batch of 3)


@dataclass
class ModelSetup:
    config_name: str
    cfg: ModelConfig
    layout: PackedLayout
    layers: tuple[int, int]
    graph: Graph
    stages: list[Stage]
    weights: StageWeights
    checkpoint: dict
    device: str
    mode: str
    bindings: dict[str, NodeBinding]
    inputs: dict[str, torch.Tensor]
    unrelated: list[dict[str, torch.Tensor]]
    manifests: list[Path] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.layers == (0, self.cfg.num_layers)


def parse_layers(spec: str | None, cfg: ModelConfig) -> tuple[int, int]:
    """``A:B`` -> blocks ``A .. B-1`` (default all); outside the model -> InputError naming it."""
    if spec is None:
        return 0, cfg.num_layers
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InputError(f"--layers {spec!r}: expected A:B (blocks A .. B-1), e.g. 0:{cfg.num_layers}")
    a, b = int(parts[0]), int(parts[1])
    if not 0 <= a < b <= cfg.num_layers:
        raise InputError(f"--layers {spec}: outside the model (0 <= A < B <= {cfg.num_layers} blocks)")
    return a, b


def check_weights(source, stages: list[Stage], cfg: ModelConfig, what: str) -> int:
    """Every tensor the stages read is in ``source`` with its inventory shape and dtype; returns the count."""
    have = set(source.names())
    specs = {s.name: s for s in expected_inventory(cfg)}
    count = 0
    for stage in stages:
        for name in stage.param_names(list(specs)):
            if name not in have:
                layer = "" if stage.layer is None else f" (layer {stage.layer})"
                raise InputError(f"{what}: {name}: missing{layer}")
            shape, dtype = source.meta(name)
            spec = specs[name]
            if tuple(shape) != tuple(spec.shape) or dtype != spec.dtype:
                raise InputError(f"{what}: {name}: {tuple(shape)} {dtype}, expected {tuple(spec.shape)} {spec.dtype}")
            count += 1
    return count


def model_lower_bound_bytes(cfg: ModelConfig, seq_len: int, stages: int, lanes: int, backward: bool) -> int:
    """A lower bound on what a ws1-model run holds at once: one block's weights in bf16 + FP64 (twice under the
    backward: parameter gradients); one block's node values at FP64 (golden) + bf16 for the provider, the
    candidate and a batch of three; each lane's stage boundaries ``S x H`` (bf16, golden FP64), kept for every
    stage when the backward runs."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8) * (2 if backward else 1)
    values = seq_len * (6 * h + 8 * nd + 3 * f) * (8 + 2 * (1 + 1 + 3))
    boundaries = seq_len * h * (8 + 2 * lanes) * (stages if backward else 2)
    return weights + values + boundaries


def saved_values_bytes(cfg: ModelConfig, seq_len: int, stages: list[Stage]) -> int:
    """A lower bound on ``--save-tensors``' host memory: every block's and refiner block's node values (six nodes
    ``H`` wide, eight ``N D``, gate-up ``2F`` and swiglu ``F`` per packed row) at bf16 (provider, candidate) plus
    float64 (golden)."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    blocks = sum(1 for s in stages if s.label.startswith(("block.", "refiner.")))
    return blocks * seq_len * (6 * h + 8 * nd + 3 * f) * (2 + 2 + 8)


def prepare_model(
    layout: str,
    config: str | None,
    checkpoint: Path | None,
    device: str,
    seed: int,
    mode: str,
    layers: str | None = None,
    backward: bool = True,
    lanes: int = 12,
    save_tensors: bool = False,
    merge: str = "single",
) -> ModelSetup:
    """Resolve and check everything (bad input -> InputError before any weight is read or memory allocated)."""
    from h3gate.memory import require

    device = check_device(device)
    check_mode(mode)
    spec = load_layout(layout)
    config_name, cfg, source, ckpt, manifests = config_for(config, checkpoint, seed, spec.kind)
    packed = build_layout(spec, layout)
    span = parse_layers(layers, cfg)
    graph = build_model_graph(cfg, span)
    stages = split_stages(graph)
    what = f"--checkpoint {checkpoint}" if checkpoint is not None else "synthetic weights"
    check_weights(source, stages, cfg, what)
    need = model_lower_bound_bytes(cfg, packed.seq_len, len(stages), lanes, backward)
    require(need, f"ws1-model --layout {layout} --config {config_name} (S={packed.seq_len})", device,
            hint="use a smaller layout, --layers or --no-backward")  # fmt: skip
    if save_tensors:
        require(saved_values_bytes(cfg, packed.seq_len, stages), f"--save-tensors at --layout {layout} "
                f"--config {config_name} (every node's values, three executions)", "cpu",
                hint="bound it with --layers")  # fmt: skip
    bindings = bind_graph(graph, mode, device, merge)
    if ckpt["kind"] == "synthetic" and device != "cpu":
        # Drawn on the device's own generator (a 33B model is not drawn on the CPU); values are per device kind.
        source = source.drawn_on(device)
        ckpt = source.record()
    inputs, _ = model_inputs(packed, cfg, seed, device)
    unrelated = []
    for item in range(1, UNRELATED_ITEMS + 1):
        other, _ = model_inputs(packed, cfg, seed, device, item)
        unrelated.append({k: other[k] for k in ("video_rows", "audio_rows", "text")})
    manifests += [LAYOUTS_FILE, *sorted((MANIFESTS / "operators").glob("*.yaml"))]
    return ModelSetup(
        config_name, cfg, packed, span, graph, stages, StageWeights(source, device), ckpt, device, mode, bindings,
        inputs, unrelated, manifests,
    )  # fmt: skip
