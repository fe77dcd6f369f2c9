"""``with h3gate.strict(model) as session:`` - h3gate's kernels inside the user's own diffusers
``MiniMaxH3Transformer3DModel``, on its own parameters (no copy), for rollout (no_grad) and training (autograd).

Inside the block, ``model(...)`` (and ``model.forward``) runs h3gate's whole-model graph
(:func:`h3gate.graph.model.build_model_graph`, op for op diffusers 0.42.1's forward) with every operator bound by
:func:`h3gate.ops.registry.bind` in ``mode`` (``strict``: the Triton kernels, failing closed; ``off``: the provider
references, bitwise diffusers' own forward). Gradients flow to the module's own ``nn.Parameter`` objects. On exit
the instance's ``forward`` is removed again: the module computes the plain diffusers forward, bit for bit.

Before binding, strict and audit modes refuse (``InputError`` naming what) a module h3gate does not cover: another
class, parameters that do not match the inventory of the module's own config (names, shapes, dtypes: any size of
the architecture, a PEFT/LoRA wrapper's extra tensors included), a submodule the architecture does not have, a
forward or backward hook, an attention processor other than diffusers' default one, or attention kwargs.
``session.trace`` lists every operator call that ran: node, op, kernel id, requested and actual implementation;
``session.launches`` the schedules the kernels launched, by node (:mod:`h3gate.kernels.launches`). As the graph
executor does, the adapter runs a block's q, k and v projections as one grouped call of the strict GEMM (one
launch from 1024 to 8191 rows on a Hopper GPU, the same bytes; one trace record a node); not with LoRA layers.
With ``scheduler=`` (a ``MiniMaxH3Scheduler`` or a pipeline holding its video and audio schedulers) their ``step`` is
h3gate's Euler step for the block, bitwise diffusers' (:func:`euler_steps` binds it alone). ``merge="seg8"`` binds
every operator's segmented-8 twin (:func:`h3gate.ops.registry.bind`), the merge order TP ranks share. PEFT LoRA
layers on the block projections run their update through the ``h3_lora_update`` operator in the same mode
(:mod:`h3gate.strict_lora`). With the module's gradient
checkpointing on (``enable_gradient_checkpointing()``) and grad enabled, every transformer and refiner block runs
under ``torch.utils.checkpoint`` (non-reentrant), as diffusers' forward does; the strict kernels make the
recomputation bitwise the first forward. ``session.observer`` (``fn(node, value)``) sees every node output of the
forward (not of the recomputation); ``session.overrides`` replaces node functions (the gates' row faults).
The block runs under h3gate's one numerics switch (:func:`h3gate.numerics.strict_numerics`: TF32 off), restored
on exit.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from h3gate.checkpoint import parse_diffusers_config
from h3gate.errors import InputError
from h3gate.evidence.writer import write_evidence
from h3gate.graph.core import Node, OpTable
from h3gate.graph.execute import Hooks
from h3gate.graph.executions import NodeBinding, bind_graph, candidate_table
from h3gate.graph.model import OUTPUTS, RawMetadata, build_model_graph, derive_metadata
from h3gate.graph.stages import Stage, iter_stages, split_stages
from h3gate.inventory import expected_inventory
from h3gate.kernels import launches
from h3gate.manifests.model_config import ModelConfig
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.numerics import strict_numerics
from h3gate.ops.registry import Binding, bind, check_merge, fails_closed
from h3gate.schedule import euler_step
from h3gate.strict_lora import (
    UPDATE_OP,
    LoraSlot,
    canonical_parameters,
    find_lora,
    lora_modules,
    lora_record,
    with_lora,
)

CLASS_NAME = "MiniMaxH3Transformer3DModel"
PROCESSOR = "MiniMaxH3AttnProcessor"


@dataclass
class StrictSession:
    """What one ``with h3gate.strict(...)`` block bound and ran."""

    model: torch.nn.Module
    mode: str
    cfg: ModelConfig
    bindings: dict[str, NodeBinding]
    lora: dict[str, LoraSlot] = field(default_factory=dict)
    lora_binding: Binding | None = None
    merge: str = DEFAULT_MERGE_ORDER
    trace: list[dict] = field(default_factory=list)
    calls: int = 0
    observer: Callable[[Node, torch.Tensor], None] | None = None
    overrides: dict[str, Callable] = field(default_factory=dict)
    checkpointed: int = 0
    launches: launches.Log = field(default_factory=dict)  # node -> op -> schedules the kernels launched (forwards)
    table: OpTable | None = None  # the op table every forward of the session runs (a determinism recorder's key)

    def record(self) -> dict:
        """Evidence: the binding of every node (requested / actual kernel), the schedules the kernels launched, the
        LoRA layers and the trace."""
        return {
            "mode": self.mode,
            "merge_order": self.merge,
            "calls": self.calls,
            "bindings": {n: b.record() for n, b in self.bindings.items()},
            **({"launches": self.launches} if self.launches else {}),
            "lora": lora_record(self.lora),
            "checkpointed_segments": self.checkpointed,
            "trace": list(self.trace),
        }

    def write(self, folder) -> Path:
        """``FOLDER/strict-session.json`` (evidence kind ``strict-session``, schema-validated, provenance stamped)."""

        return write_evidence(Path(folder), "strict-session.json", "strict-session", self.record())


def _config(model: torch.nn.Module) -> ModelConfig:
    body = {k: v for k, v in dict(model.config).items() if not str(k).startswith("_")}
    return parse_diffusers_config(body, f"{type(model).__name__}.config")


def check_module(model: torch.nn.Module, cfg: ModelConfig, lora: Mapping[str, LoraSlot] | None = None) -> None:
    """Refuse what the strict binding does not cover (module docstring); the message names it."""
    if type(model).__name__ != CLASS_NAME:
        raise InputError(f"h3gate.strict: {type(model).__name__}: not a {CLASS_NAME}")
    lora = find_lora(model) if lora is None else lora
    expected = {s.name: s for s in expected_inventory(cfg)}
    have = canonical_parameters(model, lora)
    extra = sorted(set(have) - set(expected))
    if extra:
        raise InputError(f"h3gate.strict: parameter {extra[0]}: not in the MiniMax-H3 inventory of this config")
    missing = sorted(set(expected) - set(have))
    if missing:
        raise InputError(f"h3gate.strict: parameter {missing[0]}: missing")
    for name, p in have.items():
        spec = expected[name]
        if tuple(p.shape) != tuple(spec.shape) or p.dtype != getattr(torch, spec.dtype):
            raise InputError(
                f"h3gate.strict: parameter {name}: {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}, expected "
                f"{tuple(spec.shape)} {spec.dtype} (the module's own config)"
            )
    _check_submodules(model, lora_modules(lora))


def _check_submodules(model: torch.nn.Module, lora: set[str]) -> None:
    with torch.device("meta"):
        reference = type(model)(**{k: v for k, v in dict(model.config).items() if not str(k).startswith("_")})
    known = {n: type(m).__name__ for n, m in reference.named_modules()}
    for name, module in model.named_modules():
        where = name or "<root>"
        owner = next((m for m in lora if name == m or name.startswith(m + ".")), None)
        if owner is None:
            expected = known.get(name)
        elif name == f"{owner}.base_layer":  # a LoRA layer stands where the architecture's Linear stands
            expected = known.get(owner)
        else:  # the LoRA layer itself and its adapter modules (find_lora checked them)
            expected = type(module).__name__
        if expected != type(module).__name__:
            raise InputError(f"h3gate.strict: submodule {where} ({type(module).__name__}): not in the architecture")
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, hooks, None):
                raise InputError(f"h3gate.strict: submodule {where}: has {hooks.strip('_')} (not covered)")
        processor = getattr(module, "processor", None)
        if processor is not None and type(processor).__name__ != PROCESSOR:
            raise InputError(f"h3gate.strict: {where}.processor: {type(processor).__name__} (only {PROCESSOR})")


class _Tracing(OpTable):
    """An op table that appends one trace record per operator call (the node being run is set by the caller) and
    adds the LoRA update to the body GEMMs whose weight is a LoRA layer's base."""

    def __init__(self, base: OpTable, session: StrictSession) -> None:
        super().__init__(lambda op: base[op])
        self.session, self.node, self.phase = session, "", "forward"
        self.update_binding = session.lora_binding
        self.by_id = {id(slot.base): slot for slot in session.lora.values()}

    def _record(self, op: str, binding) -> None:
        rec = {"call": self.session.calls, "node": self.node, "op": op, "phase": self.phase}
        if binding is not None:
            rec.update(kernel_id=binding.kernel_id, requested=binding.requested, actual=binding.actual)
        self.session.trace.append(rec)

    def __getitem__(self, op: str):
        fn = super().__getitem__(op)
        binding = next((b for b in self.session.bindings[self.node].bindings if b.op == op), None)

        def traced(*args: Any, **kwargs: Any):
            self._record(op, binding)
            return fn(*args, **kwargs)

        if self.update_binding is None:
            if getattr(fn, "grouped", None) is not None:  # sibling GEMMs (q, k, v) in one call: one record a node
                traced.grouped = self._traced_grouped(op, binding, fn.grouped)
            return traced
        update = self.update_binding.fn
        return with_lora(op, traced, self.by_id, update, lambda a: self._record(UPDATE_OP, self.update_binding))

    def _traced_grouped(self, op: str, binding, grouped: Callable) -> Callable:
        """``grouped(x, weights)`` recording one trace record for each node it computes (the nodes
        :func:`h3gate.graph.execute.run_nodes` names around the call). With LoRA layers nothing is grouped."""

        def run(x: torch.Tensor, weights) -> list[torch.Tensor]:
            node = self.node
            for name in launches.current_nodes():
                self.node = name
                self._record(op, binding)
            self.node = node
            return grouped(x, weights)

        return run


def _run_graph(session: StrictSession, stages: list[Stage], ops: _Tracing, values: dict, params: Mapping) -> None:
    """Every stage in order (:func:`h3gate.graph.stages.iter_stages`); a transformer or refiner block under
    ``torch.utils.checkpoint`` when the module checkpoints and grad is enabled."""
    checkpointing = torch.is_grad_enabled() and bool(getattr(session.model, "gradient_checkpointing", False))

    def name(node: Node) -> None:
        ops.node = node.name

    def observe(node: Node, out: torch.Tensor) -> None:
        if session.observer is not None and ops.phase == "forward":
            session.observer(node, out)

    def checkpointed(stage: Stage) -> bool:
        return checkpointing and stage.checkpointable

    hooks = Hooks(before=name, after=observe)
    for stage, _ in iter_stages(stages, values, ops, lambda stage: params, session.overrides, hooks, checkpointed):
        session.checkpointed += int(checkpointed(stage))
    ops.phase = "recompute"  # what runs after the forward returned is a checkpoint's recomputation


def _forward(session: StrictSession, table: _Tracing):
    stages = split_stages(build_model_graph(session.cfg))
    model = session.model

    def forward(
        self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices, token_tags,
        position_ids, video_indices, audio_indices, text_indices, attention_kwargs=None, return_dict=True,
    ):  # fmt: skip
        if attention_kwargs:
            raise InputError("h3gate.strict: attention_kwargs (a LoRA scale): not covered")
        raw = RawMetadata(position_ids, token_tags, timestep, timestep_indices, text_indices, video_indices,
                          audio_indices, video_indices, audio_indices)  # fmt: skip
        values = {"video_rows": hidden_states, "audio_rows": audio_hidden_states, "text": encoder_hidden_states}
        values.update(derive_metadata(raw, session.cfg, hidden_states.device))
        params = canonical_parameters(model, session.lora)
        table.phase = "forward"
        with launches.recording() as launched:  # the kernels note their schedules, node by node
            _run_graph(session, stages, table, values, params)
        launches.merge(session.launches, launched)
        session.calls += 1
        video, audio = values[OUTPUTS[0]], values[OUTPUTS[1]]
        if not return_dict:
            return video, audio
        # The output class of the user's own diffusers module (already imported: h3gate never imports diffusers).
        output = sys.modules[type(self).__module__].MiniMaxH3TransformerOutput
        return output(sample=video, audio_sample=audio)

    return forward


SCHEDULER_NAME = "MiniMaxH3Scheduler"


def _scheduler_step(trace: list[dict], calls: Callable[[], int]):
    """``scheduler.step`` as h3gate's Euler step (:func:`h3gate.schedule.euler_step`: ``x0 = x + (1 - t) v``, then
    ``r x + (1 - r) x0`` with ``r = sigma_{i+1} / sigma_i``, float32 for half-precision samples), on the scheduler's
    own grid and step index; one record per call appended to ``trace`` (``calls()``: the model calls so far)."""

    def step(self, model_output, timestep, sample, return_dict=True):
        if isinstance(timestep, int) or (isinstance(timestep, torch.Tensor) and not timestep.is_floating_point()):
            raise InputError("h3gate.strict: scheduler.step: timestep must be one of scheduler.timesteps, not an index")
        if self._step_index is None:
            self._step_index = self.index_for_timestep(timestep) if self._begin_index is None else self._begin_index
        i = self._step_index
        prev = euler_step(model_output, timestep, sample, self.sigmas[i], self.sigmas[i + 1])
        self._step_index += 1
        trace.append({"call": calls(), "node": f"scheduler.step[{i}]", "op": "h3_ode_step",
                      "kernel_id": "h3gate.schedule.euler_step", "requested": "provider",
                      "actual": "provider"})  # fmt: skip
        if not return_dict:
            return (prev,)
        return sys.modules[type(self).__module__].MiniMaxH3SchedulerOutput(prev_sample=prev)

    return step


def _schedulers(scheduler: Any) -> list[Any]:
    """The MiniMax-H3 schedulers of ``scheduler``: itself, or a pipeline's ``scheduler`` / ``audio_scheduler``."""
    found = [scheduler] if type(scheduler).__name__ == SCHEDULER_NAME else []
    for attr in ("scheduler", "audio_scheduler"):
        inner = getattr(scheduler, attr, None)
        if inner is not None and type(inner).__name__ == SCHEDULER_NAME:
            found.append(inner)
    if not found:
        raise InputError(f"h3gate.strict: scheduler {type(scheduler).__name__}: no {SCHEDULER_NAME} in it")
    return found


@contextlib.contextmanager
def euler_steps(
    scheduler: Any, trace: list[dict] | None = None, calls: Callable[[], int] = lambda: 0
) -> Iterator[list[dict]]:
    """h3gate's Euler step as the ``step`` of ``scheduler`` (a MiniMaxH3Scheduler or a pipeline holding its video
    and audio schedulers) for the ``with`` block, whatever computes the velocities; yields the trace (``trace``, or a
    new list) that gets one record per step."""
    trace = [] if trace is None else trace
    schedulers = _schedulers(scheduler)
    if any("step" in vars(s) for s in schedulers):
        raise InputError("h3gate.strict: the scheduler's step is already replaced (a nested or foreign binding)")
    for s in schedulers:
        s.step = types.MethodType(_scheduler_step(trace, calls), s)
    try:
        yield trace
    finally:
        for s in schedulers:
            del s.step


@contextlib.contextmanager
def strict(
    model: torch.nn.Module, mode: str = "strict", device: str | None = None, scheduler: Any = None,
    merge: str = DEFAULT_MERGE_ORDER,
) -> Iterator[StrictSession]:  # fmt: skip
    """Bind h3gate's kernels into ``model`` (and h3gate's Euler step into ``scheduler``: a MiniMaxH3Scheduler or a
    pipeline holding them) for the ``with`` block (module docstring); yields the session. ``merge``: the merge order
    of :func:`h3gate.ops.registry.bind` (``seg8``: every operator's segmented-8 twin, the order TP ranks share)."""
    if type(model).__name__ != CLASS_NAME:
        raise InputError(f"h3gate.strict: {type(model).__name__}: not a {CLASS_NAME}")
    check_merge(merge)
    cfg = _config(model)
    lora = find_lora(model)  # in every mode: a LoRA layer h3gate cannot replay is refused, naming it
    if fails_closed(mode):
        check_module(model, cfg, lora)
    if "forward" in vars(model):
        raise InputError("h3gate.strict: the model's forward is already replaced (a nested or foreign binding)")
    first = next(model.parameters())
    device = device or ("cuda" if first.is_cuda else "cpu")
    graph = build_model_graph(cfg)
    bindings = bind_graph(graph, mode, device, merge)
    update = bind(UPDATE_OP, mode, device, merge) if lora else None
    session = StrictSession(model, mode, cfg, bindings, lora, update, merge=merge)
    session.table = table = _Tracing(candidate_table(bindings), session)
    steps = contextlib.nullcontext() if scheduler is None else euler_steps(scheduler, session.trace,
                                                                           lambda: session.calls)  # fmt: skip
    with steps:
        model.forward = types.MethodType(_forward(session, table), model)
        try:
            with strict_numerics(device):  # TF32 off inside the block, restored on exit
                yield session
        finally:
            del model.forward


SGLANG_CLASS = "MiniMaxH3DiTModel"


class _CallableModule(types.ModuleType):
    """``import h3gate.strict`` then ``with h3gate.strict(model):`` - the module itself is the entry point. SGLang's
    ``MiniMaxH3DiTModel`` goes to :func:`h3gate.adapters.sglang.strict_bind.bind_strict` (in ``merge`` order); it has
    no diffusers scheduler to bind (:func:`euler_steps` binds h3gate's Euler step alone)."""

    def __call__(
        self, model: torch.nn.Module, mode: str = "strict", device: str | None = None, scheduler: Any = None,
        merge: str = DEFAULT_MERGE_ORDER,
    ):  # fmt: skip
        if type(model).__name__ == SGLANG_CLASS:
            if scheduler is not None:
                raise InputError("h3gate.strict: scheduler=: SGLang's DiT is bound without a diffusers scheduler")
            from h3gate.adapters.sglang.strict_bind import bind_strict

            return bind_strict(model, mode, device, merge)
        return strict(model, mode, device, scheduler, merge)


sys.modules[__name__].__class__ = _CallableModule
