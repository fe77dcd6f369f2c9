"""An ablation arm (everything one execution reads) and the named-tensor streams it produces.

An :class:`Arm` is the strict replay with some factors changed: layout, metadata hook, AdaLN row rule, weights, op
table, node overrides, batch composition, row permutation, sampler recipe, checkpointing. A stream yields
``(node, tensor)`` in execution order: metadata pseudo-nodes (``meta.*``, ``schedule.*``; ``meta["kind"] ==
"metadata"``), then the model's nodes (step-tagged inside a trajectory), the scheduler updates, or for the backward
stream the stage outputs followed by gradients in backward order (``grad.*``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from h3gate.graph.core import Graph, Node, OpTable
from h3gate.graph.execute import NodeOverride, iter_graph
from h3gate.graph.inputs import seeded_normal
from h3gate.graph.model import OUTPUTS, RawMetadata, adaln_rule_h3, derive_metadata, metadata_nodes, raw_metadata
from h3gate.graph.stages import iter_stages, split_stages
from h3gate.layout import PackedLayout
from h3gate.manifests.model_config import ModelConfig
from h3gate.schedule import Schedule
from h3gate.trajectory import Recipe, Request, initial_latents, iter_trajectory

Stream = Iterator[tuple[Node, torch.Tensor]]


@dataclass(frozen=True)
class Arm:
    """One execution. ``row_perm[p]`` is the logical (strict-layout) row that packed row ``p`` of ``layout`` holds;
    ``batch_row`` is the batch item compared against the strict arm's item 0."""

    layout: PackedLayout
    params: Mapping[str, torch.Tensor]
    ops: OpTable
    requests: tuple[Request, ...]
    recipe: Recipe
    overrides: Mapping[str, NodeOverride] = field(default_factory=dict)
    raw_hook: Callable[[RawMetadata], RawMetadata] | None = None
    adaln_rule: Callable = adaln_rule_h3
    batch_row: int = 0
    row_perm: torch.Tensor | None = None
    checkpointing: bool = False
    notes: tuple[str, ...] = ()
    diagnostics: Mapping[str, tuple[Arm, Arm]] = field(default_factory=dict)

    def with_notes(self, *notes: str, **changes) -> Arm:
        return replace(self, notes=(*self.notes, *notes), **changes)


def expand_overrides(graph: Graph, overrides: Mapping[str, NodeOverride]) -> dict[str, NodeOverride]:
    """Node-name patterns (fnmatch, e.g. ``block.*.attention``) -> the concrete nodes they select."""
    out: dict[str, NodeOverride] = {}
    for pattern, override in overrides.items():
        hits = [n.name for n in graph.nodes if fnmatch.fnmatchcase(n.name, pattern)]
        if not hits:
            raise ValueError(f"node override {pattern!r} matches no node of graph {graph.name}")
        out.update(dict.fromkeys(hits, override))
    return out


def schedule_nodes(video: Schedule, audio: Schedule) -> Stream:
    for name, schedule in (("schedule.video_sigmas", video), ("schedule.audio_sigmas", audio)):
        node_meta = {"kind": "metadata", "rows": "none", "stage": "schedule"}
        yield Node(name, "h3_sigma_schedule", (), (), lambda *a: None, row_dim=None, meta=node_meta), schedule.sigmas


def forward_inputs(arm: Arm, cfg: ModelConfig, plan: dict, device) -> tuple[dict, dict]:
    """The arm's request tensors (first latents, text) and derived row metadata at the one-step plan ``plan``."""
    ts, ti = arm.layout.row_timesteps(plan["video_t"], plan["audio_t"], plan["cond_video_t"], plan["cond_audio_t"])
    raw = raw_metadata(arm.layout, ts, ti)
    raw = arm.raw_hook(raw) if arm.raw_hook is not None else raw
    meta = derive_metadata(raw, cfg, device, arm.adaln_rule)
    states = [initial_latents(r, arm.recipe) for r in arm.requests]
    request = {
        "video_rows": torch.stack([s[1] for s in states]),
        "audio_rows": torch.stack([s[2] for s in states]),
        "text": torch.cat([r.text for r in arm.requests]),
    }
    return request, meta


# Streams run in lockstep with another arm's: grad mode is set per resumption by the decorator (a ``with`` block
# inside a suspended generator would leak into the caller and into the other stream).
@torch.no_grad()
def forward_stream(arm: Arm, graph: Graph, cfg: ModelConfig, plan: dict, device) -> Stream:
    """Metadata, then one model call at the one-step plan ``plan`` (``TimestepPlan.resolve()``)."""
    request, meta = forward_inputs(arm, cfg, plan, device)
    yield from metadata_nodes(meta, None)
    yield from iter_graph(graph, {**request, **meta}, arm.params, arm.ops, expand_overrides(graph, arm.overrides))


@torch.no_grad()
def trajectory_stream(arm: Arm, graph: Graph, cfg: ModelConfig, device) -> Stream:
    """Sigma grids, then the dual-scheduler trajectory of the arm's first request (metadata per step)."""
    video, audio = arm.recipe.schedules()
    yield from schedule_nodes(video, audio)
    overrides = expand_overrides(graph, arm.overrides)
    yield from iter_trajectory(
        graph,
        arm.params,
        arm.ops,
        cfg,
        arm.layout,
        arm.requests[0],
        arm.recipe,
        device,
        overrides,
        arm.raw_hook,
        arm.adaln_rule,
        emit_metadata=True,
    )


@torch.enable_grad()
def backward_stream(arm: Arm, graph: Graph, cfg: ModelConfig, plan: dict, device, grad_params=None) -> Stream:
    """Forward with autograd (each ``refiner.i`` / ``block.i`` stage under ``torch.utils.checkpoint`` when the arm
    says so, non-reentrant), yielding every stage's outputs; then ``loss = sum(v * cv) + sum(a * ca)`` with seeded
    FP32 cotangents, and the gradients of the request inputs and of ``grad_params`` (default: all), last layer
    first (backward execution order)."""
    request, meta = forward_inputs(arm, cfg, plan, device)
    yield from metadata_nodes(meta, None)
    names = list(arm.params) if grad_params is None else list(grad_params)
    params = dict(arm.params)
    for name in names:
        params[name] = arm.params[name].detach().clone().requires_grad_(True)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in request.items()}
    values: dict[str, torch.Tensor] = {**leaves, **meta}
    checkpointed = (lambda stage: stage.checkpointable) if arm.checkpointing else None
    stages = split_stages(graph)
    for _, outputs in iter_stages(stages, values, arm.ops, lambda stage: params, checkpointed=checkpointed):
        for name, value in outputs.items():
            yield graph.node(name), value.detach()
    video, audio = values[OUTPUTS[0]], values[OUTPUTS[1]]
    cv = seeded_normal(0, "cotangent:video", tuple(video.shape)).to(device)
    ca = seeded_normal(0, "cotangent:audio", tuple(audio.shape)).to(device)
    loss = (video.float() * cv).sum() + (audio.float() * ca).sum()
    loss.backward()
    for name in reversed(names):
        grad = params[name].grad
        node = Node(
            f"grad.{name}", "gradient", (), (), lambda *a: None, row_dim=None, meta={"rows": "none", "stage": "grad"}
        )
        yield node, grad if grad is not None else torch.zeros_like(params[name])
    for name in ("text", "audio_rows", "video_rows"):
        rows = {"text": "text", "audio_rows": "audio", "video_rows": "video"}[name]
        node = Node(
            f"grad.input.{name}", "gradient", (), (), lambda *a: None, row_dim=1, meta={"rows": rows, "stage": "grad"}
        )
        yield node, leaves[name].grad
