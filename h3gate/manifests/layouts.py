"""Packed-layout geometries (``manifests/layouts.yaml``): the numbers ``h3gate.layout.build_layout`` packs.

A layout is ``[text | keyframe conditions | target audio | target video]`` (diffusers'
``MiniMaxH3PrepareLayoutStep.build_packed_sequence``). Its row count is
``S = text_tokens + len(anchors) * rows_per_frame + 2 * audio_latents + latent_frames * rows_per_frame`` with
``rows_per_frame = (latent_height / 2) * (latent_width / 2)``; ``seq_len`` declares it and ``build_layout`` checks it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, StrictInt, ValidationInfo, field_validator

from h3gate.errors import InputError
from h3gate.manifests.loader import read_yaml, validate
from h3gate.manifests.model_config import Strict
from h3gate.paths import MANIFESTS, display

LAYOUTS_FILE = MANIFESTS / "layouts.yaml"
# The transformer's spatial patch (its (1, 2, 2) patch_size): latent height and width must be multiples of it.
SPATIAL_PATCH = 2
# The video VAE encodes 17n + 5 pixel frames to 5n + 2 latent frames.
VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK = 17, 5

PositiveCount = Annotated[StrictInt, Field(gt=0)]


class LayoutSpec(Strict):
    """One packed geometry; ``text_vision_rows`` are half-open ``[start, end)`` text rows tagged video (tag 0)."""

    text_tokens: PositiveCount
    latent_frames: PositiveCount
    latent_height: PositiveCount
    latent_width: PositiveCount
    audio_latents: PositiveCount
    anchors: list[Literal["first", "last"]] = []
    text_vision_rows: list[tuple[StrictInt, StrictInt]] = []
    seq_len: PositiveCount | None = None
    description: str = ""

    @field_validator("latent_frames")
    @classmethod
    def _frame_grid(cls, value: int) -> int:
        if value % VAE_LATENTS_PER_CHUNK != 2:
            raise ValueError(
                f"must be of the form 5n+2 (the video VAE encodes its {VAE_FRAMES_PER_CHUNK}n+"
                f"{VAE_LATENTS_PER_CHUNK} pixel-frame grid to 5n+2 latent frames), got {value}"
            )
        return value

    @field_validator("latent_height", "latent_width")
    @classmethod
    def _patch_multiple(cls, value: int) -> int:
        if value % SPATIAL_PATCH:
            raise ValueError(f"must be a multiple of the spatial patch {SPATIAL_PATCH}, got {value}")
        return value

    @field_validator("text_vision_rows")
    @classmethod
    def _vision_rows(cls, value: list[tuple[int, int]], info: ValidationInfo) -> list[tuple[int, int]]:
        text_tokens = info.data.get("text_tokens")
        for index, (start, end) in enumerate(value):
            if start < 0:
                raise ValueError(f"entry {index} ({start}:{end}): start must be >= 0")
            if start >= end:
                raise ValueError(f"entry {index} ({start}:{end}): start must be < end")
            if text_tokens is not None and end > text_tokens:
                raise ValueError(f"entry {index} ({start}:{end}): must lie inside the {text_tokens} text rows")
        ordered = sorted(value)
        for (s0, e0), (s1, e1) in zip(ordered, ordered[1:], strict=False):
            if s1 < e0:
                raise ValueError(f"{s0}:{e0} and {s1}:{e1} overlap")
        return value

    @property
    def rows_per_frame(self) -> int:
        """Patched rows of one latent frame: ``(latent_height / 2) * (latent_width / 2)``."""
        return (self.latent_height // SPATIAL_PATCH) * (self.latent_width // SPATIAL_PATCH)


class LayoutsFile(Strict):
    layouts: dict[str, LayoutSpec]


def load_layouts(path: Path | None = None) -> dict[str, LayoutSpec]:
    """Every layout of ``path`` (default ``manifests/layouts.yaml``), validated with ``file: layouts.NAME.field``
    breadcrumbs."""
    path = Path(path) if path is not None else LAYOUTS_FILE
    return dict(validate(read_yaml(path), LayoutsFile, display(path)).layouts)


def layout_names(path: Path | None = None) -> list[str]:
    return sorted(load_layouts(path))


def load_layout(name: str, path: Path | None = None) -> LayoutSpec:
    """One named layout; an unknown name lists the known ones."""
    layouts = load_layouts(path)
    if name not in layouts:
        raise InputError(f"layout {name!r}: unknown (known: {', '.join(sorted(layouts)) or 'none'})")
    return layouts[name]
