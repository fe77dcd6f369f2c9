"""The rollout on SGLang's DiT (``run arms --rollout sglang``) and SGLang's side of a first-drift location.

SGLang's ``MiniMaxH3DiTModel`` is loaded by SGLang's own loader from a diffusers-layout folder of the run's weights
(:func:`h3gate.adapters.sglang.build.build_model`: a ``--checkpoint`` folder as it is, synthetic weights written as
one), with SGLang's request quality (``--sglang-quality``) and attention backend as requested. The denoise loop is
:func:`h3gate.arms.sides.rollout`'s (the same schedulers, the same row timestep plan); each evaluation packs the B
requests as SGLang packs them: one ``cu_seqlens`` sequence, request b at packed rows ``b S .. b S + S - 1``, padding
to a multiple of 64, on SGLang's serving path (:func:`h3gate.adapters.sglang.inputs.packing`; under ``--ulysses``
its direct path, one request). ``P``: SGLang as shipped, stepped by diffusers' ``MiniMaxH3Scheduler``; ``R``:
inside ``bind_strict(model, "strict", merge=...)``, stepped by h3gate's Euler step (:func:`h3gate.strict.euler_steps`,
the rule of ``h3gate.strict(..., scheduler=)``).

``--fault NODE:ROW`` (a negative control): row ``ROW`` of the SGLang module whose output is the node (packed nodes:
request b's row s at ``b S + s``; text nodes: the row of every request's refiner call) scaled by 1 + 2^-6 in its
dtype in every rollout forward, by a forward hook that runs first (:func:`~h3gate.adapters.sglang.capture.row_fault`;
under ``R`` inside the binding, whose replaced forwards keep the module boundary).

First drift (:func:`sglang_side`): the drifting step's SGLang forward re-run with every node captured at h3gate's
node names (:func:`~h3gate.adapters.sglang.capture.capture_forward`, TP1), in the letter's operators and with the
fault, as the rollout side of :func:`h3gate.arms.locate.locate`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from h3gate.adapters.sglang.build import build_model
from h3gate.adapters.sglang.capture import capture_forward, row_fault
from h3gate.adapters.sglang.inputs import Packing, packing, run_forward
from h3gate.adapters.sglang.runtime import init_runtime, runtime_record, set_quality
from h3gate.adapters.sglang.strict_bind import SESSION_ATTR, bind_strict
from h3gate.arms.locate import Observer, Side
from h3gate.arms.sides import State, trace_summary
from h3gate.arms.stack import Stack
from h3gate.errors import InputError
from h3gate.gate.faults import RowFault
from h3gate.graph.model import RawMetadata, build_model_graph, raw_metadata
from h3gate.runs.candidate import fault_point
from h3gate.strict import euler_steps

ENGINE = "sglang"


@dataclass(frozen=True)
class SglangFault:
    """A one-row fault on SGLang's module ``module`` (whose output is node ``node``), row ``row`` of its output."""

    node: str
    module: str
    row: int


def sglang_fault(fault: RowFault, stack: Stack) -> SglangFault:
    """``--fault`` on SGLang's rollout module: a forward scale fault at a node read at a whole module output, its row
    inside that output (InputError naming what is wrong)."""
    module, row = fault_point("model", stack.cfg, 0, fault, "--rollout sglang")
    node = next(n for n in build_model_graph(stack.cfg).nodes if n.name == fault.node)
    layout, batch = stack.layout, len(stack.requests)
    per = layout.rows_per_modality()
    rows = {
        "packed": batch * layout.seq_len,
        "text": per["text"],
        "video": batch * per["video"],
        "audio": batch * per["audio"],
        "timestep": min(int(t.numel()) for t, _ in stack.plan),
    }.get(node.meta["rows"])
    if rows is not None and row >= rows:
        raise InputError(f"--fault {fault.node}:{row} --rollout sglang: {module}'s output has {rows} rows "
                         f"({node.meta['rows']} rows of {batch} requests as SGLang packs them)")  # fmt: skip
    return SglangFault(fault.node, module, row)


def build_sglang(stack: Stack, source: Any, tp: int = 1, ulysses: int = 1) -> Any:
    """SGLang's DiT on the run's weights on the stack's device, its request quality set; kept as ``stack.sglang``.
    This process's SGLang runtime: world size 1, or (``tp`` or ``ulysses`` > 1) this rank of an initialised
    torch.distributed world (a TP rank loads its shards)."""
    s = stack.settings
    init_runtime(tp=tp if tp > 1 else None, sp=ulysses if ulysses > 1 else None, attention_backend=s.sglang_attention,
                 hidden_size=stack.cfg.hidden_size)  # fmt: skip
    model = build_model(source, stack.device)
    set_quality(model, s.sglang_quality)
    stack.sglang = model
    return model


@dataclass
class SglangEngine:
    """SGLang's DiT as the rollout engine of :func:`h3gate.arms.sides.rollout` (module docstring)."""

    stack: Stack
    fault: SglangFault | None = None
    source: Any = None  # the weights, when the model is built on first use (a location after TP ranks rolled out)
    name: str = ENGINE
    letters: dict[str, dict] = field(default_factory=dict)  # per rollout letter: the binding and what ran

    @property
    def model(self) -> Any:
        if self.stack.sglang is None:
            build_sglang(self.stack, self.source)
        return self.stack.sglang

    def packing(self) -> Packing:
        """SGLang's serving path; under Ulysses its direct path (one request: SGLang's forward splits the rows)."""
        stack = self.stack
        serving = stack.settings.ulysses == 1
        return packing(len(stack.requests), stack.layout.seq_len, stack.layout.text_indices, serving=serving)

    def raw(self, step: int) -> RawMetadata:
        return raw_metadata(self.stack.layout, *self.stack.plan[step])

    @contextlib.contextmanager
    def binding(self, letter: str, schedulers: SimpleNamespace | None = None) -> Iterator[Any]:
        """``R``: the strict binding (and h3gate's Euler step into ``schedulers``); ``P``: SGLang as shipped; the
        fault's hook either way. Yields the binding's session, or None."""
        s = self.stack.settings
        with contextlib.ExitStack() as es:
            session = None
            if letter == "R":
                session = es.enter_context(bind_strict(self.model, "strict", self.stack.device, s.merge))
                if schedulers is not None:
                    es.enter_context(euler_steps(schedulers, session.trace, lambda: session.calls))
            if self.fault is not None:
                es.enter_context(row_fault(self.model, self.fault.module, self.fault.row))
            yield session

    @contextlib.contextmanager
    def bound(self, letter: str, schedulers: SimpleNamespace) -> Iterator[Any]:
        """:meth:`binding` for a rollout, recording per letter what ran (the binding's summary while active)."""
        with self.binding(letter, schedulers) as session:
            yield session
            self.letters[letter] = {
                "operators": "h3gate strict binding" if letter == "R" else "sglang as shipped",
                "strict_binding": None if session is None else dict(getattr(self.model, SESSION_ATTR)),
                "trace_ops": {} if session is None else trace_summary(session.trace),
            }

    def forward(self, step: int, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor) -> State:
        out = run_forward(self.model, {"video_rows": video, "audio_rows": audio, "text": text}, self.raw(step),
                          self.packing())  # fmt: skip
        return out["heads.video_select"], out["heads.audio_select"]

    def record(self) -> dict:
        """The rollout record: the engine, SGLang's runtime record, the packing, per letter the binding."""
        s = self.stack.settings
        runtime = runtime_record(self.model, s.sglang_quality)
        runtime.pop("strict_binding", None)  # per letter below
        return {"engine": ENGINE, "sglang": runtime, "packing": self.packing().record(), "letters": self.letters,
                "fault": None if self.fault is None else vars(self.fault).copy()}  # fmt: skip


def sglang_side(engine: SglangEngine, letter: str, step: int, inputs: State, recorded: State) -> Side:
    """The rollout side of a location: SGLang's forward of the B requests at ``step`` on ``inputs`` in ``letter``'s
    operators (with the fault), every node captured (module docstring)."""
    stack = engine.stack
    graph = build_model_graph(stack.cfg)
    uncovered: dict[str, str] = {}

    def run(observe: Observer) -> State:
        device = stack.device
        tensors = {"video_rows": inputs[0].to(device), "audio_rows": inputs[1].to(device), "text": stack.text()}
        with engine.binding(letter):
            cap = capture_forward(engine.model, stack.cfg, tensors, engine.raw(step), engine.packing(), graph)
        uncovered.update(cap.uncovered)
        for node in graph.nodes:
            if node.name in cap.values:
                observe(node, cap.values[node.name])
        return cap.outputs["heads.video_select"].cpu(), cap.outputs["heads.audio_select"].cpu()

    return Side(run, list(range(len(stack.requests))), recorded, uncovered)
