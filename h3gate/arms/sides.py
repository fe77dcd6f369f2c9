"""The two sides of an arm, on the user's diffusers module.

Rollout (operators ``P``: plain diffusers; ``R``: ``h3gate.strict(model, "strict", scheduler=...)``): the B requests
as one batch, no grad, the denoise loop of diffusers 0.42.1's pipeline - per step the transformer on
``(latents, audio_latents)`` at the step's row timestep plan, then ``scheduler.step`` on the generated video rows and
``audio_scheduler.step`` on the generated audio rows (condition rows held). Each step's inputs and velocities are
saved as a trajectory step file (``RUNDIR/rollout-<P|R>/steps``). The velocities come from a
:class:`RolloutEngine`: the module above (:class:`DiffusersEngine`) or SGLang's DiT
(:class:`h3gate.arms.sglang_side.SglangEngine`), in the same loop.

Training (operators per the arm's first letter), at a saved rollout state, with the module's gradient checkpointing
on: the velocity of each request alone (batch of one, grad enabled), then two identical passes over the B requests
in one shuffled batch, each followed by the flow-matching loss's backward::

    L = sum_b sum_{m in (video, audio)} mean((v_{b,m} - (x^final_{b,m} - x^0_{b,m}))^2)     float32, b in order

(the rectified-flow target of H3's convention, ``x_t = t x0 + (1 - t) noise`` with ``t = 1`` clean, is
``x0 - noise``; ``x0`` is the rollout's final latents, ``noise`` its initial latents). Gradients of the trainable
parameters and of both latent inputs are kept from each pass for the repeat check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch

import h3gate.strict
from h3gate.arms.stack import Stack
from h3gate.graph import determinism
from h3gate.runs.trajectory_files import write_step

State = tuple[torch.Tensor, torch.Tensor]  # (B, Nv, Cv), (B, Na, Ca) float32


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def bound(stack: Stack, letter: str, scheduler=None) -> Iterator[Any]:
    """The arm letter's operators on the module: ``R`` binds h3gate's strict kernels (in the stack's merge order;
    under a determinism recorder its op table is the judged ``candidate``), ``P`` leaves diffusers (None)."""
    if letter != "R":
        yield None
        return
    with h3gate.strict(stack.model, mode="strict", scheduler=scheduler, merge=stack.settings.merge) as session:
        recorder = determinism.active()
        if recorder is not None:
            recorder.role(session.table, "candidate")
        yield session


def call(stack: Stack, step: int, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor) -> State:
    return stack.model(
        hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, return_dict=False,
        **stack.layout_kwargs(step),
    )  # fmt: skip


class RolloutEngine(Protocol):
    """What drives the rollout's velocities: ``bound(letter, schedulers)`` binds the letter's operators (and, for
    ``R``, h3gate's Euler step into the schedulers) for a ``with`` block, yielding an object with a ``trace`` or
    None; ``forward`` is one model evaluation of the B requests."""

    name: str

    def bound(self, letter: str, schedulers: SimpleNamespace) -> contextlib.AbstractContextManager: ...

    def forward(self, step: int, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor) -> State: ...


@dataclass
class DiffusersEngine:
    """The rollout on the user's diffusers module (``P`` plain, ``R`` under ``h3gate.strict``)."""

    stack: Stack
    name: str = "diffusers"

    def bound(self, letter: str, schedulers: SimpleNamespace) -> contextlib.AbstractContextManager:
        return bound(self.stack, letter, schedulers)

    def forward(self, step: int, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor) -> State:
        return call(self.stack, step, video, audio, text)


@dataclass
class Rollout:
    letter: str
    states: list[State] = field(default_factory=list)  # inputs of each step
    velocities: list[State] = field(default_factory=list)
    final: State | None = None
    seconds: list[float] = field(default_factory=list)
    trace_ops: dict[str, int] = field(default_factory=dict)
    engine: Any = None  # the engine that ran it when not the diffusers module (its side of a location)


def rollout(
    stack: Stack,
    letter: str,
    rundir: Path,
    progress: Callable[[str], None] | None = None,
    engine: RolloutEngine | None = None,
) -> Rollout:
    """Drive the denoise loop for the B requests with the ``letter`` operators on ``engine`` (default: the diffusers
    module; module docstring)."""
    engine = DiffusersEngine(stack) if engine is None else engine
    schedulers = stack.schedulers()
    video_s, audio_s = schedulers.scheduler, schedulers.audio_scheduler
    nc, nca = stack.layout.num_condition_video_rows, stack.layout.num_condition_audio_rows
    x, a = stack.initial_state()
    text = stack.text()
    out = Rollout(letter, engine=None if isinstance(engine, DiffusersEngine) else engine)
    rundir.mkdir(parents=True, exist_ok=True)
    with engine.bound(letter, schedulers) as session, torch.no_grad():
        for i in range(stack.evaluations):
            t0 = time.perf_counter()
            with determinism.evaluation(f"rollout {letter} step {i}"):
                v, u = engine.forward(i, x, a, text)
            _sync(stack.device)
            seconds = time.perf_counter() - t0
            if i == 0 and session is not None and out.engine is None and determinism.active() is not None:
                with determinism.evaluation(f"rollout {letter} step {i} repeat"):  # its determinism pair
                    engine.forward(i, x, a, text)
            out.states.append((x.cpu(), a.cpu()))
            out.velocities.append((v.cpu(), u.cpu()))
            out.seconds.append(seconds)
            record = {
                "seconds": round(seconds, 4),
                "device": stack.device,
                "mode": "strict" if letter == "R" else "off",
            }
            tensors = {"video_latents": x, "audio_latents": a, "video_velocity": v, "audio_velocity": u}
            write_step(rundir, i, tensors, record)
            x, a = x.clone(), a.clone()
            x[:, nc:] = video_s.step(v[:, nc:].float(), video_s.timesteps[i], x[:, nc:], return_dict=False)[0]
            a[:, nca:] = audio_s.step(u[:, nca:].float(), audio_s.timesteps[i], a[:, nca:], return_dict=False)[0]
            if progress is not None:
                who = letter if engine.name == "diffusers" else f"{letter} ({engine.name})"
                progress(f"rollout {who}: step {i} of {stack.evaluations - 1} ({seconds:.2f} s)")
        if session is not None:
            out.trace_ops = trace_summary(session.trace)
    out.final = (x.cpu(), a.cpu())
    return out


def trace_summary(trace: list[dict]) -> dict[str, int]:
    """``"<op> <actual>" -> calls``: what actually ran."""
    counts: dict[str, int] = {}
    for rec in trace:
        key = f"{rec['op']} {rec.get('actual', '?')}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class TrainingPass:
    velocities: State  # in request order
    gradients: dict[str, torch.Tensor]  # trainable parameters and "input.video" / "input.audio", request order
    seconds: float


@dataclass
class TrainingStep:
    alone: list[State]  # per request, (1, N, C) each
    passes: list[TrainingPass]
    order: list[int]
    seconds_alone: float
    trace_ops: dict[str, int] = field(default_factory=dict)


def flow_matching_loss(v: torch.Tensor, u: torch.Tensor, target_v: torch.Tensor, target_u: torch.Tensor):
    """The module docstring's loss over the batch (requests summed in batch order)."""
    loss = torch.zeros((), dtype=torch.float32, device=v.device)
    for b in range(v.shape[0]):
        loss = loss + (v[b].float() - target_v[b]).square().mean() + (u[b].float() - target_u[b]).square().mean()
    return loss


def shuffled_order(batch: int, step: int, seed: int) -> list[int]:
    """A seeded permutation of the B requests that is never the identity when B > 1 (a rotation if it would be)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step + 17)
    order = torch.randperm(batch, generator=gen).tolist()
    return order if batch == 1 or order != list(range(batch)) else order[1:] + order[:1]


def train_step(
    stack: Stack, letter: str, step: int, state: State, targets: State, fault: Callable | None = None
) -> TrainingStep:
    """The training side at one saved rollout state (module docstring); ``fault`` (R only) is applied to the second
    shuffled pass (a kernel that misbehaves once: the negative control of the repeat and byte-equality checks)."""
    device = stack.device
    x, a = state[0].to(device), state[1].to(device)
    text = stack.text()
    order = shuffled_order(x.shape[0], step, stack.settings.seed)
    with bound(stack, letter) as session:
        t0 = time.perf_counter()
        alone = []
        for b in range(x.shape[0]):
            with torch.enable_grad(), determinism.evaluation(f"training {letter} step {step} alone {b}"):
                v, u = call(stack, step, x[b : b + 1], a[b : b + 1], text[b : b + 1])
            alone.append((v.detach().cpu(), u.detach().cpu()))
            del v, u
        _sync(device)
        seconds_alone = time.perf_counter() - t0
        passes = []
        for k in range(2):
            if session is not None:
                session.overrides = fault(session) if (fault is not None and k == 1) else {}
            with determinism.evaluation(f"training {letter} step {step} pass {k + 1}"):
                passes.append(_training_pass(stack, step, x, a, text, targets, order))
        ops = trace_summary(session.trace) if session is not None else {}
    return TrainingStep(alone, passes, order, seconds_alone, ops)


def _training_pass(stack: Stack, step: int, x, a, text, targets: State, order: list[int]) -> TrainingPass:
    device = stack.device
    for p in stack.trainable.values():
        p.grad = None
    idx = torch.tensor(order, device=device)
    xs = x.index_select(0, idx).clone().requires_grad_(True)
    as_ = a.index_select(0, idx).clone().requires_grad_(True)
    t0 = time.perf_counter()
    with torch.enable_grad():
        v, u = call(stack, step, xs, as_, text.index_select(0, idx))
        loss = flow_matching_loss(v, u, targets[0].to(device).index_select(0, idx),
                                  targets[1].to(device).index_select(0, idx))  # fmt: skip
        loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    inverse = torch.argsort(idx)
    grads = {n: p.grad.detach().clone() for n, p in stack.trainable.items() if p.grad is not None}
    grads["input.video"] = xs.grad.detach().index_select(0, inverse).cpu()
    grads["input.audio"] = as_.grad.detach().index_select(0, inverse).cpu()
    velocities = (v.detach().index_select(0, inverse).cpu(), u.detach().index_select(0, inverse).cpu())
    return TrainingPass(velocities, grads, seconds)


def base_gradients(stack: Stack) -> list[str]:
    """Frozen (non-trainable) parameters that received a gradient: must be none."""
    trainable = set(stack.trainable)
    return [n for n, p in stack.model.named_parameters() if n not in trainable and p.grad is not None]
