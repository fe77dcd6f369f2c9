"""The deterministic dual-scheduler trajectory (diffusers 0.42.1 ``MiniMaxH3SetTimestepsStep`` + ``MiniMaxH3Denoise
Step``), as a stream of named, step-tagged tensors.

* Schedules: video ``build_schedule(steps, 12.0)``, audio ``build_schedule(steps, 3.0)`` (separate grids and step
  indices); ``min`` of their evaluation counts model calls (the pipeline zips the two timestep lists).
* Row plan of step ``i`` (``build_row_timesteps``): every row at ``t_video``; video condition rows at
  ``max(t_video, 0.999)``; generated audio rows at ``t_audio``; audio reference rows at 1.0; reduced to sorted
  distinct values and per-row indices (``PackedLayout.row_timesteps``).
* Initial state: condition rows ``t * x0 + (1 - t) * noise`` at ``t = 0.999`` (``scale_noise``, float32; it commutes
  with the patchify permutation, so it runs on rows), then the generated video noise rows; audio noise rows.
* Step ``i``: one model call on ``latents[None]`` / ``audio_latents[None]`` with the step's plan; then each modality's
  own Euler step (``h3gate.schedule.euler_step``: ``x0 = x + (1 - t) v`` at float32, ``r = sigma_next / sigma``,
  ``x_next = r x + (1 - r) x0``) on its generated rows only; condition rows are held by construction.

Every tensor is yielded as ``(node, value)`` where ``node.step`` is the step (``None`` for ``init.*``): model nodes
carry the model graph's names, then ``scheduler.video_step`` / ``scheduler.audio_step`` (the full row tensors after
the update). ``run_trajectory`` collects the sealed per-step velocity and latent hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from h3gate.errors import InputError
from h3gate.gate.compare import tensor_sha256
from h3gate.graph.core import Graph, Node, OpTable
from h3gate.graph.execute import NodeOverride, iter_graph
from h3gate.graph.inputs import seeded_normal
from h3gate.graph.model import (
    METADATA,
    OUTPUTS,
    RawMetadata,
    derive_metadata,
    metadata_nodes,
    raw_metadata,
)
from h3gate.layout import PackedLayout
from h3gate.manifests.model_config import ModelConfig
from h3gate.schedule import AUDIO_SHIFT, VIDEO_SHIFT, Schedule, build_schedule, euler_step, scale_noise, sigma_hash

KEYFRAME_NOISE_AUG = 0.999
AUDIO_REFERENCE_T = 1.0


def h3_timesteps(schedule: Schedule) -> torch.Tensor:
    """H3's convention: ``t = 1 - sigma`` over the grid without its terminal 0 (``t = 1`` is clean)."""
    return schedule.timesteps


@dataclass(frozen=True)
class Recipe:
    """Every factor of the sampler the ablation matrix may change, defaulting to the released H3 sampler."""

    steps: int = 4
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT
    grid: Callable[[int, float], Schedule] = build_schedule
    share_schedule: bool = False  # True: the audio rows use the video grid and index (H12's probe)
    timesteps_of: Callable[[Schedule], torch.Tensor] = h3_timesteps
    euler: Callable = euler_step
    condition_mix: Callable = scale_noise
    keyframe_noise_aug: float = KEYFRAME_NOISE_AUG
    audio_reference_t: float = AUDIO_REFERENCE_T

    def schedules(self) -> tuple[Schedule, Schedule]:
        video = self.grid(self.steps, self.video_shift)
        audio = video if self.share_schedule else self.grid(self.steps, self.audio_shift)
        return video, audio

    def record(self) -> dict:
        video, audio = self.schedules()
        return {
            "steps": self.steps,
            "video_shift": self.video_shift,
            "audio_shift": None if self.share_schedule else self.audio_shift,
            "shared_schedule": self.share_schedule,
            "video_sigma_sha256": sigma_hash(video),
            "audio_sigma_sha256": sigma_hash(audio),
            "video_sigmas": [float(s) for s in video.sigmas.tolist()],
            "audio_sigmas": [float(s) for s in audio.sigmas.tolist()],
            "grid": getattr(self.grid, "__name__", str(self.grid)),
            "euler": getattr(self.euler, "__name__", str(self.euler)),
            "condition_mix": getattr(self.condition_mix, "__name__", str(self.condition_mix)),
            "keyframe_noise_aug": self.keyframe_noise_aug,
        }


def row_timestep_plan(
    layout: PackedLayout, recipe: Recipe, video: Schedule, audio: Schedule
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(timestep, timestep_indices)`` pair per model evaluation (diffusers ``row_timestep_plan``)."""
    vt, at = recipe.timesteps_of(video), recipe.timesteps_of(audio)
    plan = []
    for t_video, t_audio in zip(vt.tolist(), at.tolist(), strict=False):
        plan.append(
            layout.row_timesteps(
                float(t_video), float(t_audio), max(float(t_video), recipe.keyframe_noise_aug), recipe.audio_reference_t
            )
        )
    return plan


@dataclass
class Request:
    """One request's sealed tensors: text features, condition latents and their noise, initial noise (float32 rows).

    Values are ``seeded_normal(seed, tag)`` draws: ``text:{item}`` (rounded once to bf16), ``condition_x0:{item}``,
    ``condition_noise:{item}``, ``video_noise:{item}``, ``audio_noise:{item}``.
    """

    text: torch.Tensor  # (1, Nt, text_dim) bf16
    condition_x0: torch.Tensor  # (Ncond, Cv) fp32
    condition_noise: torch.Tensor  # (Ncond, Cv) fp32
    video_noise: torch.Tensor  # (Nv - Ncond, Cv) fp32
    audio_noise: torch.Tensor  # (Na, Ca) fp32
    seed: int = 0
    item: int = 0
    tags: dict = field(default_factory=dict)


def make_request(layout: PackedLayout, cfg: ModelConfig, seed: int, item: int = 0, device="cpu") -> Request:
    nc = layout.num_condition_video_rows
    nv, na, nt = (
        int(layout.video_indices.numel()),
        int(layout.audio_indices.numel()),
        int(layout.text_indices.numel()),
    )
    cv, ca = cfg.video_patch_dim, cfg.audio_in_channels

    def draw(tag: str, shape: tuple[int, ...]) -> torch.Tensor:
        return seeded_normal(seed, f"{tag}:{item}", shape).to(device)

    return Request(
        text=draw("text", (1, nt, cfg.text_dim)).to(torch.bfloat16),
        condition_x0=draw("condition_x0", (nc, cv)),
        condition_noise=draw("condition_noise", (nc, cv)),
        video_noise=draw("video_noise", (nv - nc, cv)),
        audio_noise=draw("audio_noise", (na, ca)),
        seed=seed,
        item=item,
    )


def _node(name: str, rows: str, step: int | None, ops: tuple[str, ...] = ()) -> Node:
    return Node(
        name,
        "h3_ode_step" if name.startswith("scheduler") else "conditioning_noise_mix",
        ops,
        (),
        lambda *a: None,
        row_dim=0,
        step=step,
        meta={"rows": rows, "stage": name.split(".")[0]},
    )


def initial_latents(request: Request, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(condition_rows, video_latents, audio_latents)``: condition rows noised to the keyframe level first."""
    cond = recipe.condition_mix(request.condition_x0, recipe.keyframe_noise_aug, request.condition_noise)
    return cond, torch.cat([cond, request.video_noise]), request.audio_noise.clone()


def iter_trajectory(
    graph: Graph,
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    cfg: ModelConfig,
    layout: PackedLayout,
    request: Request,
    recipe: Recipe,
    device: str | torch.device = "cpu",
    overrides: Mapping[str, NodeOverride] | None = None,
    raw_hook: Callable[[RawMetadata], RawMetadata] | None = None,
    adaln_rule=None,
    start: int = 0,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    emit_metadata: bool = False,
) -> Iterator[tuple[Node, torch.Tensor]]:
    """Yield every tensor of the trajectory in execution order (see the module docstring). ``start`` / ``state``
    resume at step ``start`` from ``(video_latents, audio_latents)`` - the only state a step hands to the next."""
    video, audio = recipe.schedules()
    plan = row_timestep_plan(layout, recipe, video, audio)
    if not plan:
        raise InputError(f"trajectory: {recipe.steps} grid points give no model evaluation")
    vt, at = recipe.timesteps_of(video), recipe.timesteps_of(audio)
    nc, nca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    if state is None:
        cond, latents, audio_latents = initial_latents(request, recipe)
        if nc:
            yield _node("init.condition_rows", "video", None, ("conditioning_noise_mix",)), cond
    else:
        latents, audio_latents = state
    derive = {} if adaln_rule is None else {"adaln_rule": adaln_rule}
    for i, (timestep, timestep_indices) in enumerate(plan):
        if i < start:
            continue
        raw = raw_metadata(layout, timestep, timestep_indices)
        raw = raw_hook(raw) if raw_hook is not None else raw
        inputs = {
            "video_rows": latents[None],
            "audio_rows": audio_latents[None],
            "text": request.text,
            **derive_metadata(raw, cfg, device, **derive),
        }
        if emit_metadata:
            yield from metadata_nodes({k: inputs[k] for k in METADATA}, i)
        outputs: dict[str, torch.Tensor] = {}
        for node, value in iter_graph(graph, inputs, params, ops, overrides):
            if node.name in OUTPUTS:
                outputs[node.name] = value
            yield replace(node, step=i), value
        v_pred, a_pred = outputs[OUTPUTS[0]], outputs[OUTPUTS[1]]
        latents = latents.clone()
        latents[nc:] = recipe.euler(v_pred[0, nc:].float(), vt[i], latents[nc:], video.sigmas[i], video.sigmas[i + 1])
        yield _node("scheduler.video_step", "video", i, ("h3_ode_step",)), latents
        audio_latents = audio_latents.clone()
        audio_latents[nca:] = recipe.euler(
            a_pred[0, nca:].float(), at[i], audio_latents[nca:], audio.sigmas[i], audio.sigmas[i + 1]
        )
        yield _node("scheduler.audio_step", "audio", i, ("h3_ode_step",)), audio_latents


@dataclass
class TrajectoryResult:
    steps: list[dict]
    video_latents: torch.Tensor
    audio_latents: torch.Tensor
    velocities: list[tuple[torch.Tensor, torch.Tensor]]
    recipe: dict

    def record(self) -> dict:
        return {
            "recipe": self.recipe,
            "steps": self.steps,
            "final_video_sha256": tensor_sha256(self.video_latents),
            "final_audio_sha256": tensor_sha256(self.audio_latents),
        }


def step_hashes(stream: Iterator[tuple[Node, torch.Tensor]]) -> Iterator[tuple[Node, torch.Tensor, dict | None]]:
    """Pass ``stream`` through, adding a per-step hash record after each ``scheduler.audio_step``."""
    current: dict = {}
    for node, value in stream:
        if node.name == "init.condition_rows":
            current["condition_rows_sha256"] = tensor_sha256(value)
        elif node.name == OUTPUTS[0]:
            current["video_velocity_sha256"] = tensor_sha256(value)
        elif node.name == OUTPUTS[1]:
            current["audio_velocity_sha256"] = tensor_sha256(value)
        elif node.name == "scheduler.video_step":
            current["video_latents_sha256"] = tensor_sha256(value)
        elif node.name == "scheduler.audio_step":
            current["audio_latents_sha256"] = tensor_sha256(value)
            yield node, value, {"step": node.step, **current}
            current = {}
            continue
        yield node, value, None


def run_trajectory(
    graph: Graph,
    params: Mapping[str, torch.Tensor],
    ops: OpTable,
    cfg: ModelConfig,
    layout: PackedLayout,
    request: Request,
    recipe: Recipe,
    device: str | torch.device = "cpu",
) -> TrajectoryResult:
    """The whole trajectory with its sealed per-step hashes (velocities before, latents after each update)."""
    steps: list[dict] = []
    velocities: list[tuple[torch.Tensor, torch.Tensor]] = []
    video = audio = v_pred = None
    with torch.no_grad():
        stream = iter_trajectory(graph, params, ops, cfg, layout, request, recipe, device)
        for node, value, record in step_hashes(stream):
            if node.name == OUTPUTS[0]:
                v_pred = value
            elif node.name == OUTPUTS[1]:
                velocities.append((v_pred, value))
            elif node.name == "scheduler.video_step":
                video = value
            elif node.name == "scheduler.audio_step":
                audio = value
            if record is not None:
                steps.append(record)
    return TrajectoryResult(steps, video, audio, velocities, recipe.record())
