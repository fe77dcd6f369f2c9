"""The expected tensor inventory of a MiniMax-H3 transformer checkpoint, derived from its config alone.

Names are diffusers' state-dict keys; shapes follow ``MiniMaxH3Transformer3DModel.__init__``; dtypes follow the
checkpoint's precision map (FP32 boundary modules, BF16 elsewhere). ``fingerprint`` and ``synth-checkpoint`` both
read this one function, so a checkpoint h3gate writes is by construction the inventory it checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from h3gate.manifests.checkpoint_manifest import PrecisionMap
from h3gate.manifests.model_config import ModelConfig

DEFAULT_PRECISION = PrecisionMap(
    default_dtype="bfloat16",
    fp32_modules=["proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"],
    computed_fp32=["rope.inv_freq"],
)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str  # "boundary" | "refiner" | "block" | "head"

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _attention(prefix: str, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, inner, d = cfg.hidden_size, cfg.inner_dim, cfg.attention_head_dim
    return [
        (f"{prefix}.to_q.weight", (inner, h)),
        (f"{prefix}.to_k.weight", (inner, h)),
        (f"{prefix}.to_v.weight", (inner, h)),
        (f"{prefix}.norm_q.weight", (d,)),
        (f"{prefix}.norm_k.weight", (d,)),
        (f"{prefix}.to_out.0.weight", (h, inner)),
    ]


def _block_body(prefix: str, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, f = cfg.hidden_size, cfg.ffn_dim
    return [
        (f"{prefix}.norm1.weight", (h,)),
        *_attention(f"{prefix}.attn", cfg),
        (f"{prefix}.norm2.weight", (h,)),
        (f"{prefix}.ff.net.0.proj.weight", (2 * f, h)),
        (f"{prefix}.ff.net.2.weight", (h, f)),
    ]


def block_tensor_names(cfg: ModelConfig, layer: int) -> list[str]:
    """The 12 parameters of transformer block ``layer`` (10 body tensors + the AdaLN weight and bias)."""
    return [n for n, _ in _block_body(f"transformer_blocks.{layer}", cfg)] + [
        f"transformer_blocks.{layer}.adaln_proj.linear.weight",
        f"transformer_blocks.{layer}.adaln_proj.linear.bias",
    ]


def expected_inventory(cfg: ModelConfig, precision: PrecisionMap = DEFAULT_PRECISION) -> list[TensorSpec]:
    """Every stored tensor, in diffusers' state-dict order."""
    h = cfg.hidden_size
    rows: list[tuple[str, tuple[int, ...], str]] = [
        ("proj_in.weight", (h, cfg.video_patch_dim), "boundary"),
        ("proj_in.bias", (h,), "boundary"),
        ("audio_proj_in.weight", (h, cfg.audio_in_channels), "boundary"),
        ("audio_proj_in.bias", (h,), "boundary"),
        ("context_embedder.weight", (h, cfg.text_dim), "boundary"),
        ("context_embedder.bias", (h,), "boundary"),
        ("time_embedder.linear_1.weight", (cfg.time_embed_hidden_dim, cfg.freq_dim), "boundary"),
        ("time_embedder.linear_1.bias", (cfg.time_embed_hidden_dim,), "boundary"),
        ("time_embedder.linear_2.weight", (cfg.time_embed_dim, cfg.time_embed_hidden_dim), "boundary"),
        ("time_embedder.linear_2.bias", (cfg.time_embed_dim,), "boundary"),
    ]
    for i in range(cfg.num_refiner_layers):
        rows += [(n, s, "refiner") for n, s in _block_body(f"token_refiner.refiner_blocks.{i}", cfg)]
    if cfg.num_refiner_layers:
        rows.append(("token_refiner.final_norm.weight", (h,), "refiner"))
    for i in range(cfg.num_layers):
        p = f"transformer_blocks.{i}"
        rows += [(n, s, "block") for n, s in _block_body(p, cfg)]
        rows += [
            (f"{p}.adaln_proj.linear.weight", (cfg.adaln_width, cfg.time_embed_dim), "block"),
            (f"{p}.adaln_proj.linear.bias", (cfg.adaln_width,), "block"),
        ]
    rows += [
        ("norm_out.norm.weight", (h,), "head"),
        ("norm_out.linear.weight", (2 * h, cfg.time_embed_dim), "head"),
        ("norm_out.linear.bias", (2 * h,), "head"),
        ("proj_out.weight", (cfg.video_patch_dim, h), "head"),
        ("proj_out.bias", (cfg.video_patch_dim,), "head"),
        ("audio_proj_out.weight", (cfg.audio_in_channels, h), "head"),
        ("audio_proj_out.bias", (cfg.audio_in_channels,), "head"),
    ]
    return [TensorSpec(n, s, precision.dtype_of(n), g) for n, s, g in rows]
