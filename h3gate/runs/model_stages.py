"""The whole model as a sequence of stages, run one stage at a time: the executor of ``h3gate run ws1-model`` and
``h3gate bench ws1-model``.

A :class:`Stage` is a maximal run of consecutive graph nodes of one ``meta["stage"]`` (``embed``, ``refiner.0``,
``refiner``, ``embed.pack``, ``time``, ``block.i``, ``final``, ``heads``) with the parameters it reads
(:data:`STAGE_PARAMS` and the embedded blocks' ``param_prefix``). Its sub-graph reads ``external`` values (graph
inputs or earlier stages' outputs) and hands ``outputs`` to later stages.

Forward: :func:`run_stage` on the values a lane carries. Backward (:func:`stage_vjp`), per-layer recomputation:
the stage's forward is recomputed under autograd from its saved external inputs, then
``torch.autograd.backward(outputs, incoming)`` with the gradient each output received from later stages. The
gradient of a value read by several stages (``time.linear_2`` by every block and the final AdaLN) is summed in
its own dtype in reverse stage order: the last reader's contribution first, ``g = ((g_final + g_49) + g_48) ...``.
So memory holds one stage's activations and parameters at a time, plus each stage's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from h3gate.graph.core import Graph, Node, OpTable, Values
from h3gate.graph.execute import Override, run_chained
from h3gate.graph.model import METADATA, OUTPUTS

# Parameter prefixes of the stages that are not embedded blocks (those read ``meta["param_prefix"]``).
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "embed": ("proj_in.", "audio_proj_in.", "context_embedder."),
    "refiner": ("token_refiner.final_norm.",),
    "embed.pack": (),
    "time": ("time_embedder.",),
    "final": ("norm_out.",),
    "heads": ("proj_out.", "audio_proj_out."),
}
LEAVES = ("video_rows", "audio_rows", "text")  # differentiable graph inputs (the request)
LOSS = (
    "loss = sum(video.float() * c_video) + sum(audio.float() * c_audio), the two velocity outputs against seeded "
    "N(0, 1) FP32 cotangents (sha256(seed:cotangent:video|audio))"
)
RECOMPUTATION = (
    "per-stage recomputation: each stage's forward is recomputed under autograd from its saved inputs and "
    "back-propagated alone; a value read by several stages gets its gradients summed in its dtype in reverse stage "
    "order (last reader first)"
)


@dataclass(frozen=True)
class Stage:
    label: str
    graph: Graph
    external: tuple[str, ...]
    outputs: tuple[str, ...]
    param_prefixes: tuple[str, ...]
    layer: int | None

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.graph.nodes

    def param_names(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n.startswith(self.param_prefixes)]


def model_stages(graph: Graph) -> list[Stage]:
    """The stages of a model graph in execution order (labels unique: the second ``embed`` run is ``embed.pack``)."""
    groups: list[list[Node]] = []
    for node in graph.nodes:
        if groups and groups[-1][0].meta["stage"] == node.meta["stage"]:
            groups[-1].append(node)
        else:
            groups.append([node])
    read_later: dict[str, int] = {}
    for gi, group in enumerate(groups):
        for node in group:
            for name in node.inputs:
                read_later[name] = gi
    stages, seen = [], set()
    for gi, group in enumerate(groups):
        label = group[0].meta["stage"]
        if label in seen:
            label = group[0].name
        seen.add(label)
        own = {n.name for n in group}
        external = tuple(dict.fromkeys(i for n in group for i in n.inputs if i not in own))
        outputs = tuple(n.name for n in group if read_later.get(n.name, -1) > gi or n.name in OUTPUTS)
        if label in STAGE_PARAMS:
            prefixes = STAGE_PARAMS[label]
        else:
            prefixes = tuple(dict.fromkeys(n.meta["param_prefix"] for n in group))
        sub = Graph(label, tuple(group), external, group[-1].name)
        stages.append(Stage(label, sub, external, outputs, prefixes, group[0].layer))
    return stages


def differentiable(stage: Stage, values: Mapping[str, torch.Tensor]) -> list[str]:
    """The stage's external inputs that carry a gradient: floating values that are not layout metadata."""
    return [k for k in stage.external if k not in METADATA and values[k].is_floating_point()]


def run_stage(
    stage: Stage,
    values: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    overrides: Mapping[str, Override] | None = None,
) -> Values:
    """Every node of ``stage`` chained on ``values`` (which hold its external inputs); the stage's node outputs."""
    local = run_chained(stage.graph, {k: values[k] for k in stage.external}, params, ops, overrides)
    return {n.name: local[n.name] for n in stage.nodes}


@dataclass
class StageGrads:
    """What one stage's backward returns: gradients of its node outputs, its differentiable inputs and params."""

    nodes: Values
    inputs: Values
    params: Values
    forward: Values  # the recomputed forward (detached): equals the no_grad forward when autograd is sound


def stage_vjp(
    stage: Stage,
    saved: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    incoming: Mapping[str, torch.Tensor],
    overrides: Mapping[str, Override] | None = None,
) -> StageGrads:
    """Recompute ``stage`` under autograd from ``saved`` and back-propagate ``incoming`` (output -> gradient)."""
    wrt = differentiable(stage, saved)
    x = {k: (v.detach().requires_grad_(True) if k in wrt else v) for k, v in saved.items() if k in stage.external}
    p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        values = run_stage(stage, x, p, ops, overrides)
        for v in values.values():
            if v.requires_grad:
                v.retain_grad()
        outs = [values[k] for k in stage.outputs if k in incoming and values[k].requires_grad]
        grads = [incoming[k].to(values[k].dtype) for k in stage.outputs if k in incoming and values[k].requires_grad]
        if outs:
            torch.autograd.backward(outs, grads)
    return StageGrads(
        nodes={k: v.grad for k, v in values.items() if v.grad is not None},
        inputs={k: x[k].grad for k in wrt if x[k].grad is not None},
        params={k: v.grad for k, v in p.items() if v.grad is not None},
        forward={k: v.detach() for k, v in values.items()},
    )


def accumulate(acc: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor]) -> None:
    """Add a stage's input gradients into ``acc`` (the declared order: called in reverse stage order)."""
    for k, g in grads.items():
        acc[k] = g if k not in acc else acc[k] + g


class StageWeights:
    """A stage's parameters read from a weight source on demand (a checkpoint is read one layer at a time)."""

    def __init__(self, source, device: str) -> None:
        self.source, self.device = source, device
        self.names = list(source.names())

    def load(self, stage: Stage) -> dict[str, torch.Tensor]:
        return {n: self.source.load(n, self.device, check_finite=True) for n in stage.param_names(self.names)}


def model_cotangents(
    seed: int, outputs: Mapping[str, torch.Tensor], batch: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """The seeded FP32 cotangents of the declared loss (:data:`LOSS`): ``cotangent:video|audio`` for the request;
    with ``batch = (size, position)`` the request is item ``position`` and item ``k`` gets its own, unrelated
    ``cotangent:video|audio:k``."""
    from h3gate.graph.inputs import seeded_normal

    out = {}
    for name, tag in zip(OUTPUTS, ("video", "audio"), strict=True):
        shape = (1, *outputs[name].shape[1:])
        mine = seeded_normal(seed, f"cotangent:{tag}", shape)
        if batch is not None:
            size, pos = batch
            mine = torch.cat([mine if k == pos else seeded_normal(seed, f"cotangent:{tag}:{k}", shape)
                              for k in range(size)])  # fmt: skip
        out[name] = mine.to(outputs[name].device)
    return out


def stage_params(stages: Sequence[Stage], params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Stage label -> the parameters that stage reads (the same tensors, nothing copied)."""
    names = list(params)
    return {s.label: {n: params[n] for n in s.param_names(names)} for s in stages}


def last_readers(stages: Sequence[Stage]) -> dict[str, int]:
    """Value name -> index of the last stage that reads it (graph inputs and stage outputs alike)."""
    last: dict[str, int] = {}
    for i, stage in enumerate(stages):
        for name in stage.external:
            last[name] = i
    return last


def forward_stages(
    stages: Sequence[Stage],
    inputs: Mapping[str, torch.Tensor],
    per_stage: Mapping[str, Mapping[str, torch.Tensor]],
    table: OpTable,
    saved: dict[str, dict[str, torch.Tensor]] | None = None,
    after: Callable[[Stage], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The two velocity outputs, stage by stage, keeping only what later stages read (a value is dropped after its
    last reader). With ``saved``, each stage's external inputs are kept under its label (what a per-stage
    backward recomputes from); ``after(stage)`` is called once each stage is enqueued (the bench's events)."""
    last = last_readers(stages)
    values = dict(inputs)
    for i, stage in enumerate(stages):
        if saved is not None:
            saved[stage.label] = {k: values[k] for k in stage.external}
        out = run_stage(stage, values, per_stage[stage.label], table)
        values.update({k: out[k] for k in stage.outputs})
        del out
        for name in [k for k in values if last.get(k, -1) <= i and k not in OUTPUTS]:
            del values[name]
        if after is not None:
            after(stage)
    return {k: values[k] for k in OUTPUTS}


def model_inputs(layout, cfg, seed: int, device: str, item: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """(graph inputs, raw metadata record) of request ``item``: seeded latents and text (``make_request`` and the
    default recipe's first latents, as the trajectory draws them), and the layout's metadata at the default
    one-step timestep plan (``TimestepPlan().resolve()``)."""
    from h3gate.graph.inputs import TimestepPlan
    from h3gate.graph.model import derive_metadata, raw_metadata
    from h3gate.trajectory import Recipe, initial_latents, make_request

    plan = TimestepPlan().resolve()
    ts, ti = layout.row_timesteps(plan["video_t"], plan["audio_t"], plan["cond_video_t"], plan["cond_audio_t"])
    raw = raw_metadata(layout, ts, ti)
    request = make_request(layout, cfg, seed, item, device)
    _, video, audio = initial_latents(request, Recipe())
    tensors = {"video_rows": video.unsqueeze(0), "audio_rows": audio.unsqueeze(0), "text": request.text}
    tensors.update(derive_metadata(raw, cfg, device))
    return tensors, {"plan": plan, "raw": raw}
