"""The whole model as a sequence of stages: how a model graph's nodes group, what each group reads and hands on.

A :class:`Stage` is a maximal run of consecutive graph nodes of one ``meta["stage"]`` (``embed``, ``refiner.0``,
``refiner``, ``embed.pack``, ``time``, ``block.i``, ``final``, ``heads``) with the parameters it reads
(:data:`STAGE_PARAMS` and the embedded blocks' ``param_prefix``). Its sub-graph reads ``external`` values (graph
inputs or earlier stages' outputs) and hands ``outputs`` to later stages (and the model's two velocities). This is
the one place nodes are grouped into stages: the gates, the bench, the ablation streams and the strict adapter's
per-block activation checkpointing all run :func:`split_stages`' stages through :mod:`h3gate.graph.execute`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from h3gate.graph import determinism
from h3gate.graph.core import Graph, Node, OpTable, Values
from h3gate.graph.execute import NO_HOOKS, Hooks, Override, iter_graph, run_chained
from h3gate.graph.model import METADATA, OUTPUTS
from h3gate.graph.parked import Fetched, park, to_host

# Parameter prefixes of the stages that are not embedded blocks (those read ``meta["param_prefix"]``).
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "embed": ("proj_in.", "audio_proj_in.", "context_embedder."),
    "refiner": ("token_refiner.final_norm.",),
    "embed.pack": (),
    "time": ("time_embedder.",),
    "final": ("norm_out.",),
    "heads": ("proj_out.", "audio_proj_out."),
}


@dataclass(frozen=True)
class Stage:
    """Consecutive nodes of one ``meta["stage"]``; ``checkpointable``: a transformer or token-refiner block (the unit
    diffusers' gradient checkpointing recomputes)."""

    label: str
    graph: Graph
    external: tuple[str, ...]
    outputs: tuple[str, ...]
    param_prefixes: tuple[str, ...]
    layer: int | None

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.graph.nodes

    @property
    def checkpointable(self) -> bool:
        return self.label.startswith(("block.", "refiner.")) and self.label[-1].isdigit()

    def param_names(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n.startswith(self.param_prefixes)]


def split_stages(graph: Graph) -> list[Stage]:
    """The stages of a model graph in execution order (labels unique: the second ``embed`` run is ``embed.pack``).

    A node's output is a stage output when a node of a later stage reads it or it is one of the model's
    :data:`~h3gate.graph.model.OUTPUTS`."""
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


def last_readers(stages: Sequence[Stage]) -> dict[str, int]:
    """Value name -> index of the last stage that reads it (graph inputs and stage outputs alike)."""
    last: dict[str, int] = {}
    for i, stage in enumerate(stages):
        for name in stage.external:
            last[name] = i
    return last


def stage_params(stages: Sequence[Stage], params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Stage label -> the parameters that stage reads (the same tensors, nothing copied)."""
    names = list(params)
    return {s.label: {n: params[n] for n in s.param_names(names)} for s in stages}


# -- execution: every stage's nodes run through h3gate.graph.execute ------------------------------------------------


def run_stage(
    stage: Stage,
    values: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    overrides: Mapping[str, Override] | None = None,
    hooks: Hooks = NO_HOOKS,
) -> Values:
    """Every node of ``stage`` chained on ``values`` (which hold its external inputs); the stage's node outputs."""
    local = run_chained(stage.graph, {k: values[k] for k in stage.external}, params, ops, overrides, hooks)
    return {n.name: local[n.name] for n in stage.nodes}


def _checkpointed(
    stage: Stage, values: Mapping[str, torch.Tensor], params, ops, overrides, hooks: Hooks
) -> dict[str, torch.Tensor]:
    """The stage's outputs with its activations recomputed in the backward (``torch.utils.checkpoint``,
    non-reentrant): the external inputs go in as tensors, the outputs come back."""

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = run_stage(stage, dict(zip(stage.external, tensors, strict=True)), params, ops, overrides, hooks)
        return tuple(out[k] for k in stage.outputs)

    outs = checkpoint(run, *(values[k] for k in stage.external), use_reentrant=False)
    return dict(zip(stage.outputs, outs, strict=True))


def iter_stages(
    stages: Sequence[Stage],
    values: dict[str, torch.Tensor],
    ops: OpTable,
    params_of: Callable[[Stage], Mapping[str, torch.Tensor]],
    overrides: Mapping[str, Override] | None = None,
    hooks: Hooks = NO_HOOKS,
    checkpointed: Callable[[Stage], bool] | None = None,
    saved: dict[str, Values] | None = None,
    release: bool = False,
) -> Iterator[tuple[Stage, Values]]:
    """``(stage, outputs)`` in order, ``values`` updated in place with each stage's outputs (the values later
    stages read and the model's velocities). ``params_of(stage)``: the parameters it reads; ``checkpointed(stage)``:
    run it under activation checkpointing (:func:`_checkpointed`); ``saved``: each stage's external inputs kept
    under its label (what a per-stage backward recomputes from); ``release``: drop a value once its last reader
    ran (the velocities stay)."""
    last = last_readers(stages)
    for i, stage in enumerate(stages):
        if saved is not None:
            saved[stage.label] = {k: values[k] for k in stage.external}
        params = params_of(stage)
        if checkpointed is not None and checkpointed(stage):
            outputs = _checkpointed(stage, values, params, ops, overrides, hooks)
        else:
            out = run_stage(stage, values, params, ops, overrides, hooks)
            outputs = {k: out[k] for k in stage.outputs}
            del out
        values.update(outputs)
        if release:
            for name in [k for k in values if last.get(k, -1) <= i and k not in OUTPUTS]:
                del values[name]
        yield stage, outputs


def forward_stages(
    stages: Sequence[Stage],
    inputs: Mapping[str, torch.Tensor],
    per_stage: Mapping[str, Mapping[str, torch.Tensor]],
    table: OpTable,
    saved: dict[str, Values] | None = None,
    after: Callable[[Stage], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The two velocity outputs, stage by stage, keeping only what later stages read (:func:`iter_stages` with
    ``release``). With ``saved``, each stage's external inputs are kept under its label; ``after(stage)`` is called
    once each stage is enqueued (the bench's events)."""
    values = dict(inputs)
    for stage, _ in iter_stages(stages, values, table, lambda s: per_stage[s.label], saved=saved, release=True):
        if after is not None:
            after(stage)
    return {k: values[k] for k in OUTPUTS}


@dataclass
class StageGrads:
    """What one stage's backward returns: gradients of its node outputs, its differentiable inputs and params."""

    nodes: Values
    inputs: Values
    params: Values
    forward: Values  # the recomputed forward (detached): equals the no_grad forward when autograd is sound


@dataclass(frozen=True)
class Keep:
    """What :func:`stage_vjp` keeps of the stage it recomputes, and where. ``forward``: every node value (else the
    stage's outputs only: the others are dropped after their last reader in the stage, as
    :func:`~h3gate.graph.execute.iter_graph` does, so autograd alone holds what it saved); ``nodes``: every node
    output's gradient (else none: the inputs' and the parameters' only); ``host``: each node and parameter gradient
    moved to page-locked host memory as it is made (:mod:`h3gate.graph.parked`; its readers fetch it back many
    times). None of them changes an operation or its order:
    the gradients' bytes are those of ``Keep()``."""

    forward: bool = True
    nodes: bool = True
    host: bool = False


KEEP_ALL = Keep()


class _Observed(Mapping):
    """``name -> (tensor, row axis)`` read lazily, for :func:`h3gate.graph.determinism.observe` to fingerprint
    parked gradients one at a time on the device."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dims: Mapping[str, int | None]) -> None:
        self.tensors, self.dims = tensors, dims

    def __getitem__(self, key: str) -> tuple[torch.Tensor, int | None]:
        return self.tensors[key], self.dims.get(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _kept_grad(into: dict[str, torch.Tensor], name: str, host: bool) -> Callable[[torch.Tensor], None]:
    """A tensor hook keeping the gradient it sees as ``retain_grad`` would (a contiguous copy: the engine may reuse
    the tensor it passes), on the host with ``host``. Unlike ``retain_grad`` it outlives the tensor's Python object,
    so a dropped node value still reports its gradient."""

    def hook(grad: torch.Tensor) -> None:
        into[name] = to_host(grad, pinned=True) if host else grad.detach().clone(memory_format=torch.contiguous_format)

    return hook


def _recomputed(stage: Stage, x: Values, p: Values, ops: OpTable, overrides, every: bool) -> Iterator[tuple]:
    """``(name, value)`` of each node of ``stage`` recomputed on ``x`` (every value held until the end with
    ``every``, else each dropped after its last reader)."""
    if every:
        yield from run_stage(stage, x, p, ops, overrides).items()
        return
    for node, out in iter_graph(stage.graph, {k: x[k] for k in stage.external}, p, ops, overrides):
        yield node.name, out


def stage_vjp(
    stage: Stage,
    saved: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    incoming: Mapping[str, torch.Tensor],
    overrides: Mapping[str, Override] | None = None,
    keep: Keep = KEEP_ALL,
) -> StageGrads:
    """Recompute ``stage`` under autograd from ``saved`` and back-propagate ``incoming`` (output -> gradient, cast to
    the output's dtype); ``keep``: what is kept, and where (:class:`Keep`). With ``keep.host`` the node and
    parameter gradients come back in host memory; the inputs' stay on the device (the next stage reads them)."""
    wrt = differentiable(stage, saved)
    x = {k: (v.detach().requires_grad_(True) if k in wrt else v) for k, v in saved.items() if k in stage.external}
    p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    determinism.copies(p, params)
    kept: dict[str, torch.Tensor] = {}
    forward: dict[str, torch.Tensor] = {}
    outs, cots = [], []
    with torch.enable_grad():
        for name, v in _recomputed(stage, x, p, ops, overrides, keep.forward):
            if keep.nodes and v.requires_grad:
                v.register_hook(_kept_grad(kept, name, keep.host))
            if keep.forward or name in stage.outputs:
                forward[name] = v
            if name in stage.outputs and name in incoming and v.requires_grad:
                outs.append(v)
                cots.append(incoming[name].to(v.dtype))
            del v
        if outs:
            torch.autograd.backward(outs, cots)
        del outs, cots
    pgrads = {k: v.grad for k, v in p.items() if v.grad is not None}
    grads = StageGrads(
        nodes={n.name: kept[n.name] for n in stage.nodes if n.name in kept},
        inputs={k: x[k].grad for k in wrt if x[k].grad is not None},
        params=park(pgrads, pinned=True) if keep.host else pgrads,
        forward={k: v.detach() for k, v in forward.items()},
    )
    del pgrads, p
    dims = {n.name: n.row_dim for n in stage.nodes}
    tensors = {k: g for part in (grads.nodes, grads.inputs, grads.params) for k, g in part.items()}
    device = next(v.device for v in (*saved.values(), *params.values()) if isinstance(v, torch.Tensor))
    observed = _Observed(Fetched(tensors, device) if keep.host else tensors, dims)
    fed = {**{k: saved[k] for k in stage.external if k in saved}, **{f"d{k}": v for k, v in incoming.items()}}
    determinism.observe(stage.label, "stage_vjp", ops, overrides or None, fed, params, observed)
    return grads


def accumulate(acc: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor]) -> None:
    """Add a stage's input gradients into ``acc`` (the declared order: called in reverse stage order)."""
    for k, g in grads.items():
        acc[k] = g if k not in acc else acc[k] + g


def backward_stages(
    stages: Sequence[Stage],
    saved: dict[str, Values],
    per_stage: Mapping[str, Mapping[str, torch.Tensor]],
    table: OpTable,
    incoming: dict[str, torch.Tensor],
    param_grads: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-stage recomputation, last stage first: each stage's :func:`stage_vjp` from its ``saved`` inputs (popped)
    and the gradients its outputs received in ``incoming``, which then holds the gradients of its inputs instead
    (a value read by several stages summed in its dtype, last reader first). Parameter gradients are dropped after
    each stage unless ``param_grads`` receives them. Returns ``incoming``."""
    for stage in reversed(stages):
        g = stage_vjp(stage, saved.pop(stage.label), per_stage[stage.label], table, incoming)
        for name in stage.outputs:
            incoming.pop(name, None)
        accumulate(incoming, g.inputs)
        if param_grads is not None:
            param_grads.update(g.params)
        del g
    return incoming
