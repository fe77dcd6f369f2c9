"""The checkpoint fingerprint manifest (RFC #420 section 2): architecture, precision map, scheduler, variants."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, model_validator

from h3gate.manifests.loader import load_yaml, resolve
from h3gate.manifests.model_config import ARCHITECTURE, ModelConfig, Strict
from h3gate.paths import MANIFESTS

DType = Literal["float32", "bfloat16", "float16"]


class PrecisionMap(Strict):
    """Which tensors are FP32 in the mixed checkpoint.

    A stored tensor is ``fp32_dtype`` when one of the dot-separated parts of its name equals an entry of
    ``fp32_modules`` (diffusers' ``_keep_in_fp32_modules`` rule at load time); every other tensor is
    ``default_dtype``. ``computed_fp32`` lists buffers that are computed in FP32 at run time and never stored.
    """

    default_dtype: DType
    fp32_dtype: Literal["float32"] = "float32"
    fp32_modules: list[str] = Field(min_length=1)
    computed_fp32: list[str] = []

    def dtype_of(self, name: str) -> str:
        parts = name.split(".")
        return self.fp32_dtype if any(m in parts for m in self.fp32_modules) else self.default_dtype


class SchedulerContract(Strict):
    family: Literal["rectified-flow-euler"]
    eta: Literal[0, 0.0]
    video_shift: PositiveFloat
    audio_shift: PositiveFloat
    sigma_transform: str
    grid: str
    timestep_convention: str
    velocity_convention: str
    euler_update: str
    euler_compute_dtype: Literal["float32"]


class Variant(Strict):
    subfolder: str
    input_mode: str


class Upstream(Strict):
    repo: str
    revision: str = Field(pattern=r"^[0-9a-f]{40}$")
    references: list[str]


class CheckpointManifest(Strict):
    name: str
    architecture: Literal["MiniMaxH3Transformer3DModel"]
    model_family: str
    config: ModelConfig
    precision: PrecisionMap
    scheduler: SchedulerContract
    variants: dict[str, Variant] = Field(min_length=1)
    upstream: Upstream

    @model_validator(mode="after")
    def _architecture(self) -> CheckpointManifest:
        assert self.architecture == ARCHITECTURE
        return self


def load_checkpoint_manifest(name_or_path: str | Path) -> CheckpointManifest:
    return load_yaml(resolve(name_or_path, MANIFESTS / "checkpoints", "checkpoint manifest"), CheckpointManifest)
