"""The transformer architecture: every ``MiniMaxH3Transformer3DModel`` config field, strictly validated."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from h3gate.manifests.loader import load_yaml, resolve
from h3gate.paths import MANIFESTS

# Rows of the AdaLN table per timestep: video = 0, text = 1, audio = 2.
MODALITY_NUM = 3
ARCHITECTURE = "MiniMaxH3Transformer3DModel"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(Strict):
    """Field names, meanings and defaults are diffusers 0.42.1's ``MiniMaxH3Transformer3DModel.__init__``."""

    num_attention_heads: PositiveInt
    attention_head_dim: PositiveInt
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_refiner_layers: int = Field(ge=0)
    ffn_dim: PositiveInt
    in_channels: PositiveInt
    audio_in_channels: PositiveInt
    patch_size: tuple[PositiveInt, PositiveInt, PositiveInt]
    text_dim: PositiveInt
    freq_dim: PositiveInt
    time_embed_hidden_dim: PositiveInt
    time_embed_dim: PositiveInt
    rope_freq_dim: PositiveInt
    rope_theta: PositiveFloat
    norm_eps: PositiveFloat
    qk_norm_eps: PositiveFloat
    final_norm_eps: PositiveFloat

    @model_validator(mode="after")
    def _geometry(self) -> ModelConfig:
        if self.attention_head_dim % 2:
            raise ValueError("attention_head_dim must be even (rotate-half RoPE)")
        if self.rotary_dim > self.attention_head_dim:
            raise ValueError(
                f"rope_freq_dim: 6 * rope_freq_dim = {self.rotary_dim} exceeds attention_head_dim "
                f"{self.attention_head_dim}"
            )
        if self.freq_dim % 2:
            raise ValueError("freq_dim must be even")
        return self

    @property
    def inner_dim(self) -> int:
        """Attention width num_heads * head_dim (7168 for H3, wider than the 5376 residual stream)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        """Head channels MM-RoPE rotates: 2 * 3 axes * rope_freq_dim (96 of 128 for H3)."""
        return 6 * self.rope_freq_dim

    @property
    def video_patch_dim(self) -> int:
        """Flattened video patch width: in_channels * prod(patch_size) (96 for H3)."""
        t, h, w = self.patch_size
        return self.in_channels * t * h * w

    @property
    def adaln_width(self) -> int:
        """Output width of one block's AdaLN projection: 6 * 3 * hidden (96768 for H3)."""
        return 6 * MODALITY_NUM * self.hidden_size

    def diffusers_config(self) -> dict:
        """The ``config.json`` body diffusers writes for this architecture."""
        body = self.model_dump()
        body["patch_size"] = list(self.patch_size)
        return {"_class_name": ARCHITECTURE, "_diffusers_version": "0.42.1", **body}


class ConfigManifest(Strict):
    name: str
    description: str
    config: ModelConfig


def load_config(name_or_path: str | Path) -> ConfigManifest:
    """A named config (``manifests/configs/NAME.yaml``) or a YAML path."""
    return load_yaml(resolve(name_or_path, MANIFESTS / "configs", "config"), ConfigManifest)


def config_names() -> list[str]:
    return sorted(p.stem for p in (MANIFESTS / "configs").glob("*.yaml"))
