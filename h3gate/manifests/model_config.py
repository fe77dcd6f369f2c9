"""The transformer architecture: every ``MiniMaxH3Transformer3DModel`` config field, strictly validated."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from h3gate.manifests.loader import load_yaml, resolve
from h3gate.memory import GIB, host_available_bytes
from h3gate.paths import MANIFESTS

# Rows of the AdaLN table per timestep: video = 0, text = 1, audio = 2.
MODALITY_NUM = 3
ARCHITECTURE = "MiniMaxH3Transformer3DModel"
# Declared sizes refused whatever the memory (H3: 5376 wide, 7168 attention width, ~60 blocks).
MAX_LAYERS = 10_000  # num_layers + num_refiner_layers
MAX_WIDTH = 2**20  # hidden_size, ffn_dim, text_dim, num_attention_heads * attention_head_dim, ...
# Host memory a block costs before any weight is read: its inventory entries (~4 KB measured), graph nodes and
# per-layer records of fingerprint and the gates.
LAYER_STRUCTURE_BYTES = 64 * 1024


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
    def _sizes(self) -> ModelConfig:
        """Absurd declared sizes, and a block count whose bookkeeping alone exceeds host memory, are refused."""
        widths = {"hidden_size": self.hidden_size, "ffn_dim": self.ffn_dim, "text_dim": self.text_dim,
                  "num_attention_heads * attention_head_dim": self.inner_dim, "in_channels": self.in_channels,
                  "audio_in_channels": self.audio_in_channels, "freq_dim": self.freq_dim,
                  "time_embed_hidden_dim": self.time_embed_hidden_dim, "time_embed_dim": self.time_embed_dim,
                  "video patch width": self.video_patch_dim}  # fmt: skip
        for name, width in widths.items():
            if width > MAX_WIDTH:
                raise ValueError(f"{name} {width}: above the limit of {MAX_WIDTH:,}")
        layers = self.num_layers + self.num_refiner_layers
        if layers > MAX_LAYERS:
            raise ValueError(f"num_layers + num_refiner_layers {layers}: above the limit of {MAX_LAYERS:,} blocks")
        need, available = layers * LAYER_STRUCTURE_BYTES, host_available_bytes()
        if available is not None and need > available:
            raise ValueError(f"num_layers {self.num_layers}: needs at least {need / GIB:.1f} GiB of host memory for "
                             f"its blocks' bookkeeping, {available / GIB:.1f} GiB available")  # fmt: skip
        return self

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
