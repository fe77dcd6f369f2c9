"""Inputs of one block: a seeded stand-in hidden state, the real temb path, AdaLN indices and MM-RoPE tables.

* ``hidden_states`` (B, S, H) bf16: item ``i`` is ``N(0, 1)`` drawn in float32 on the CPU from a generator seeded
  with 63 bits of ``sha256(f"{seed}:hidden_states:{i}")`` and rounded once to bf16 (a stand-in: the input
  projections and the refiner belong to other rows). The batch probes use items 1, 2, ... as unrelated rows.
* ``temb`` (T, E) fp32: ``timestep_mlp(timestep_sinusoid(t))`` with the weight source's FP32 ``time_embedder``
  tensors (diffusers ``time_proj`` + ``time_embedder``), on the run device.
* timesteps: the video schedule ``build_schedule(steps, 12.0)`` and the audio schedule ``build_schedule(steps,
  3.0)`` at the same step; conditioning video rows at ``max(t_video, 0.999)`` (the pipeline's keyframe noise
  augmentation), audio reference rows at 1.0 (as ``MiniMaxH3SetTimestepsStep``); reduced to distinct values and
  per-row indices by ``layout.row_timesteps``; ``adaln_indices = timestep_index * 3 + token_tag``.
* ``rope_cos``/``rope_sin`` (S, 6 * rope_freq_dim) fp32 from the layout's float64 position ids, on the run device.
* ``attention_order`` (S,) int64: the layout's canonical row order (:func:`h3gate.layout.canonical_order`, from its
  index tensors), the strict attention's walk order, on the run device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.layout import PackedLayout
from h3gate.manifests.model_config import ModelConfig
from h3gate.ops import reference
from h3gate.schedule import AUDIO_SHIFT, VIDEO_SHIFT, build_schedule
from h3gate.synth import tensor_seed

KEYFRAME_NOISE_AUG = 0.999
AUDIO_REFERENCE_T = 1.0
TIME_EMBEDDER = (
    "time_embedder.linear_1.weight",
    "time_embedder.linear_1.bias",
    "time_embedder.linear_2.weight",
    "time_embedder.linear_2.bias",
)


def seeded_normal(seed: int, tag: str, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 ``N(0, 1)`` on the CPU from 63 bits of ``sha256(f"{seed}:{tag}")`` (device-independent values)."""
    g = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, tag))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def stand_in(seed: int, tag: str, item: int, seq_len: int, width: int, device: str | torch.device) -> torch.Tensor:
    """(1, S, width) bf16 seeded unit-variance rows (item ``item`` of stream ``tag``)."""
    return seeded_normal(seed, f"{tag}:{item}", (1, seq_len, width)).to(torch.bfloat16).to(device)


def block_cotangent(seed: int, seq_len: int, width: int, device: str | torch.device) -> torch.Tensor:
    """The ``g`` of the one-block backward ``<output, g>`` (``run ws1-block`` and ``run ws2 --scope block``):
    item 0 of the ``cotangent`` stand-in stream, (1, S, width) bf16."""
    return stand_in(seed, "cotangent", 0, seq_len, width, device)


@dataclass(frozen=True)
class TimestepPlan:
    """Which schedule step the block input is taken at, and the conditioning rows' levels."""

    steps: int = 50
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT
    step: int | None = None  # None: the middle evaluation, num_evaluations // 2

    def resolve(self) -> dict:
        video = build_schedule(self.steps, self.video_shift)
        audio = build_schedule(self.steps, self.audio_shift)
        n = min(video.num_evaluations, audio.num_evaluations)
        step = n // 2 if self.step is None else self.step
        if not 0 <= step < n:
            raise InputError(f"timestep plan: step {step} outside [0, {n})")
        video_t = float(video.timesteps[step])
        audio_t = float(audio.timesteps[step])
        return {
            "steps": self.steps,
            "video_shift": self.video_shift,
            "audio_shift": self.audio_shift,
            "step": step,
            "video_t": video_t,
            "audio_t": audio_t,
            "cond_video_t": max(video_t, KEYFRAME_NOISE_AUG),
            "cond_audio_t": AUDIO_REFERENCE_T,
            "rule": (
                "video/audio rows at their schedules' timestep of this step; conditioning video rows at "
                f"max(t_video, {KEYFRAME_NOISE_AUG}) (keyframe noise augmentation); audio reference rows at "
                f"{AUDIO_REFERENCE_T}; text rows inherit t_video"
            ),
        }


@dataclass
class BlockInputs:
    """What the provider block consumes, plus how it was made."""

    tensors: dict[str, torch.Tensor]
    timestep: torch.Tensor
    timestep_indices: torch.Tensor
    plan: dict
    modalities: list[str]
    seed: int

    def record(self) -> dict:
        return {
            **self.plan,
            "timestep": [float(t) for t in self.timestep.tolist()],
            "distinct_timesteps": int(self.timestep.numel()),
            "seed": self.seed,
            "hidden_states": "stand-in: N(0, 1) float32 from sha256(seed:hidden_states:item), rounded once to bf16",
            "temb": "timestep_mlp(timestep_sinusoid(timestep)) with the weight source's FP32 time_embedder",
        }


def timestep_embedding(source, timestep: torch.Tensor, cfg: ModelConfig, device: str | torch.device) -> torch.Tensor:
    """(T,) float32 timesteps -> (T, E) float32 temb through the source's FP32 time embedder (on ``device``)."""
    have = set(source.names())
    missing = [n for n in TIME_EMBEDDER if n not in have]
    if missing:
        raise InputError(f"weight source: {missing[0]}: missing (temb needs the FP32 time_embedder)")
    w1, b1, w2, b2 = (source.load(n, device, check_finite=True) for n in TIME_EMBEDDER)
    for name, t in zip(TIME_EMBEDDER, (w1, b1, w2, b2), strict=True):
        if t.dtype != torch.float32:
            raise InputError(f"{name}: {dtype_name(t.dtype)}, expected float32 (an FP32 module)")
    sinusoid = reference.timestep_sinusoid(timestep.to(device), cfg.freq_dim)
    return reference.timestep_mlp(sinusoid, w1, b1, w2, b2)


def build_block_inputs(
    layout: PackedLayout,
    cfg: ModelConfig,
    source,
    seed: int,
    device: str | torch.device,
    plan: TimestepPlan | None = None,
) -> BlockInputs:
    """The six graph inputs of a block for ``layout`` (batch of 1)."""
    resolved = (plan or TimestepPlan()).resolve()
    timestep, timestep_indices = layout.row_timesteps(
        resolved["video_t"], resolved["audio_t"], resolved["cond_video_t"], resolved["cond_audio_t"]
    )
    with torch.no_grad():
        temb = timestep_embedding(source, timestep, cfg, device)
        cos, sin = reference.rope_tables(layout.position_ids.to(device), cfg.rope_freq_dim, cfg.rope_theta)
    tensors = {
        "hidden_states": stand_in(seed, "hidden_states", 0, layout.seq_len, cfg.hidden_size, device),
        "temb": temb,
        "adaln_indices": layout.adaln_indices(timestep_indices).to(device),
        "rope_cos": cos,
        "rope_sin": sin,
        "attention_order": layout.canonical_order().to(device),
    }
    return BlockInputs(tensors, timestep, timestep_indices, resolved, list(layout.row_modalities()), seed)
