"""What the whole-model engines share beyond the graph's stages (:mod:`h3gate.graph.stages`): the request's leaves,
the declared loss and its seeded cotangents, the model inputs of a request, and a stage's weights read on demand.

Backward by per-stage recomputation (:func:`h3gate.graph.stages.stage_vjp`): the stage's forward is recomputed
under autograd from its saved external inputs, then ``torch.autograd.backward(outputs, incoming)`` with the
gradient each output received from later stages. The gradient of a value read by several stages (``time.linear_2``
by every block and the final AdaLN) is summed in its own dtype in reverse stage order: the last reader's
contribution first, ``g = ((g_final + g_49) + g_48) ...``. So memory holds one stage's activations and parameters
at a time, plus each stage's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from h3gate.graph.inputs import TimestepPlan, seeded_normal
from h3gate.graph.model import OUTPUTS, derive_metadata, raw_metadata
from h3gate.graph.stages import Stage
from h3gate.trajectory import Recipe, initial_latents, make_request

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


def timestep_count(layout) -> int:
    """The distinct timesteps of a request's metadata at the default one-step plan (:func:`model_inputs`' ``T``):
    the rows of the timestep-space nodes, known before anything is read."""
    plan = TimestepPlan().resolve()
    ts, _ = layout.row_timesteps(plan["video_t"], plan["audio_t"], plan["cond_video_t"], plan["cond_audio_t"])
    return int(ts.numel())


def model_inputs(layout, cfg, seed: int, device: str, item: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """(graph inputs, raw metadata record) of request ``item``: seeded latents and text (``make_request`` and the
    default recipe's first latents, as the trajectory draws them), and the layout's metadata at the default
    one-step timestep plan (``TimestepPlan().resolve()``)."""

    plan = TimestepPlan().resolve()
    ts, ti = layout.row_timesteps(plan["video_t"], plan["audio_t"], plan["cond_video_t"], plan["cond_audio_t"])
    raw = raw_metadata(layout, ts, ti)
    request = make_request(layout, cfg, seed, item, device)
    _, video, audio = initial_latents(request, Recipe())
    tensors = {"video_rows": video.unsqueeze(0), "audio_rows": audio.unsqueeze(0), "text": request.text}
    tensors.update(derive_metadata(raw, cfg, device))
    return tensors, {"plan": plan, "raw": raw}
