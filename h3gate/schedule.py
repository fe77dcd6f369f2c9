"""MiniMax-H3 rectified-flow schedule: sigma grid, Euler step and noise mix (bitwise = ``MiniMaxH3Scheduler``).

* grid: ``base = linspace(1, 0, steps)`` in float32 (CPU), ``sigma = s * base / (1 + (s - 1) * base)`` evaluated
  left to right in float32 (``s`` a Python float), consecutive float32 duplicates collapsed; the terminal 0 is part
  of the ``steps`` points. ``timesteps = 1 - sigmas[:-1]`` (float32; ``t = 1`` is clean), one model evaluation each.
* step (eta = 0): ``x0 = x + (1 - t) * v`` at the sample's dtype (data-ward velocity, note the ``+``; the sigma here
  comes from the timestep, not the grid), then ``r = sigma_next / sigma`` and ``x_next = r * x + (1 - r) * x0`` in
  float32 for float16/bfloat16 samples (the sample's dtype otherwise), cast back to the sample's dtype once.
* noise mix: ``t * x0 + (1 - t) * noise`` at the sample's dtype.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.memory import require, require_steps
from h3gate.ops.reference import conditioning_noise_mix

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0


@dataclass(frozen=True)
class Schedule:
    """One modality's grid: ``sigmas`` (N,) float32 ending at 0, ``timesteps`` (N-1,) float32."""

    shift: float
    steps: int
    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def num_evaluations(self) -> int:
        """Model evaluations: ``len(sigmas) - 1`` (can be below ``steps - 1`` when the shift collapses points)."""
        return int(self.timesteps.numel())


def build_schedule(steps: int, shift: float) -> Schedule:
    """The shifted float32 sigma grid of ``steps`` points (terminal 0 included) and its timesteps."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 2:
        raise InputError(f"--steps {steps}: must be an integer >= 2 (the grid includes the terminal sigma 0)")
    steps = int(steps)
    require_steps(steps)
    # linspace, the shifted grid, its unique copy and the timesteps: four float32 tensors of ``steps`` values.
    require(16 * steps, f"--steps {steps}", hint="ask for fewer steps")
    shift = float(shift)
    if not math.isfinite(shift) or shift <= 0:
        raise InputError(f"--shift {shift}: must be a finite number > 0")
    base = torch.linspace(1.0, 0.0, steps, dtype=torch.float32)
    sigmas = torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))
    finite = torch.isfinite(sigmas)
    if not bool(finite.all()):
        index = int((~finite).nonzero()[0, 0])
        raise InputError(
            f"--shift {shift}: sigma {index} of the float32 grid is not finite (the shift overflows float32)"
        )
    return Schedule(shift=shift, steps=steps, sigmas=sigmas, timesteps=1.0 - sigmas[:-1])


def sigma_hash(schedule: Schedule) -> str:
    """sha256 of the float32 sigma grid's little-endian bytes."""
    return hashlib.sha256(schedule.sigmas.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _broadcast(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    while value.ndim < like.ndim:
        value = value.unsqueeze(-1)
    return value


def euler_step(
    model_output: torch.Tensor,
    timestep: float | torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
) -> torch.Tensor:
    """One eta = 0 Euler step; ``sigma``/``sigma_next`` are grid entries (Python floats are rounded to float32 first,
    as the scheduler's grid is float32)."""
    if isinstance(timestep, int) or (isinstance(timestep, torch.Tensor) and not timestep.is_floating_point()):
        raise InputError("timestep: must be a float value of the schedule's timesteps, not an integer index")
    if not isinstance(timestep, torch.Tensor):
        timestep = torch.tensor(timestep, dtype=sample.dtype)
    sigma_t = _broadcast(1 - timestep.to(device=sample.device, dtype=sample.dtype), sample)
    denoised = sample + sigma_t * model_output
    compute = torch.float32 if sample.dtype in (torch.float16, torch.bfloat16) else sample.dtype
    grid = [s if isinstance(s, torch.Tensor) else torch.tensor(s, dtype=torch.float32) for s in (sigma, sigma_next)]
    s_now, s_next = (s.to(device=sample.device, dtype=compute) for s in grid)
    ratio = s_next / s_now
    blended = ratio * sample.to(dtype=compute) + (1.0 - ratio) * denoised.to(dtype=compute)
    return blended.to(dtype=sample.dtype)


def step_at(schedule: Schedule, index: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Step ``index`` of ``schedule``: timestep ``timesteps[index]``, ratio ``sigmas[index + 1] / sigmas[index]``."""
    if not 0 <= index < schedule.num_evaluations:
        raise InputError(f"step index {index}: outside [0, {schedule.num_evaluations}) for this schedule")
    return euler_step(
        model_output, schedule.timesteps[index], sample, schedule.sigmas[index], schedule.sigmas[index + 1]
    )


def scale_noise(sample: torch.Tensor, t: float | torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Forward process ``t * sample + (1 - t) * noise`` at the sample's dtype (``t`` taken at face value)."""
    return conditioning_noise_mix(sample, t, noise)
