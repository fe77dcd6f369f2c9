"""Packed-layout geometries (``manifests/layouts.yaml``): the numbers ``h3gate.layout.build_layout`` packs.

A ``t2va`` / ``fl2va`` layout is ``[text | keyframe conditions | target audio | target video]`` (diffusers'
``MiniMaxH3PrepareLayoutStep.build_packed_sequence``); a ``ref2va`` layout is ``[text | reference blocks | target
audio | target video]`` (``MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence``), one block per reference
in packed order: an image (one latent frame), a video (its soundtrack's rows, if any, then its frames) or an audio
clip. The row count is ``S = text_tokens + len(anchors) * rows_per_frame + reference rows + 2 * audio_latents +
latent_frames * rows_per_frame`` with ``rows_per_frame = (latent_height / 2) * (latent_width / 2)``; ``seq_len``
declares it and ``build_layout`` checks it.

References follow the released ``ref2va`` request rules (``MiniMaxH3Ref2VASetupStep`` and its encoder): at most 9
images, 3 videos, 3 audio clips and 12 references in all, audio never alone, a video reference of ``5n+2`` latent
frames and no longer than the target (it is truncated to the generated duration), latent sizes on the spatial patch.
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
# Audio is stereo, packed channel-major: 2 rows per audio latent.
AUDIO_CHANNELS = 2
# The video VAE encodes 17n + 5 pixel frames to 5n + 2 latent frames.
VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK = 17, 5
# MiniMaxH3Ref2VASetupStep's limits for the released checkpoint.
MAX_REFERENCES = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES_TOTAL = 12

PositiveCount = Annotated[StrictInt, Field(gt=0)]
ReferenceKind = Literal["image", "video", "audio"]
# The fields each reference kind needs, and the ones it may carry besides.
REFERENCE_FIELDS: dict[str, tuple[str, ...]] = {
    "image": ("latent_height", "latent_width"),
    "video": ("latent_frames", "latent_height", "latent_width"),
    "audio": ("audio_latents",),
}
OPTIONAL_REFERENCE_FIELDS: dict[str, tuple[str, ...]] = {"image": (), "video": ("audio_latents",), "audio": ()}


def check_frame_grid(value: int) -> int:
    """A latent frame count the video VAE can produce: ``5n+2``."""
    if value % VAE_LATENTS_PER_CHUNK != 2:
        raise ValueError(
            f"must be of the form 5n+2 (the video VAE encodes its {VAE_FRAMES_PER_CHUNK}n+"
            f"{VAE_LATENTS_PER_CHUNK} pixel-frame grid to 5n+2 latent frames), got {value}"
        )
    return value


def check_patch_multiple(value: int) -> int:
    """A latent height or width on the spatial patch."""
    if value % SPATIAL_PATCH:
        raise ValueError(f"must be a multiple of the spatial patch {SPATIAL_PATCH}, got {value}")
    return value


class ReferenceSpec(Strict):
    """One ``ref2va`` reference block: ``image`` (latent_height, latent_width; one latent frame), ``video``
    (latent_frames, latent_height, latent_width, optional soundtrack audio_latents) or ``audio`` (audio_latents)."""

    kind: ReferenceKind
    latent_frames: PositiveCount | None = Field(default=None, validate_default=True)
    latent_height: PositiveCount | None = Field(default=None, validate_default=True)
    latent_width: PositiveCount | None = Field(default=None, validate_default=True)
    audio_latents: PositiveCount | None = Field(default=None, validate_default=True)

    @field_validator("latent_frames", "latent_height", "latent_width", "audio_latents")
    @classmethod
    def _fits_kind(cls, value: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("kind")
        field = info.field_name
        if kind is None or field is None:
            return value
        article = "an" if kind[0] in "aeiou" else "a"
        if value is None:
            if field in REFERENCE_FIELDS[kind]:
                raise ValueError(f"required for {article} {kind} reference")
            return value
        if field not in REFERENCE_FIELDS[kind] + OPTIONAL_REFERENCE_FIELDS[kind]:
            raise ValueError(f"not a field of {article} {kind} reference")
        if field == "latent_frames":
            return check_frame_grid(value)
        if field in ("latent_height", "latent_width"):
            return check_patch_multiple(value)
        return value

    @property
    def frames(self) -> int:
        """Latent frames of the block's video rows: 1 for an image, 0 for an audio clip."""
        return {"image": 1, "video": self.latent_frames or 0, "audio": 0}[self.kind]

    @property
    def video_rows(self) -> int:
        if self.kind == "audio":
            return 0
        return self.frames * (self.latent_height // SPATIAL_PATCH) * (self.latent_width // SPATIAL_PATCH)

    @property
    def audio_rows(self) -> int:
        """Stereo rows of the block's audio (the audio clip, or the video's soundtrack; 0 without one)."""
        return AUDIO_CHANNELS * (self.audio_latents or 0)

    def token(self) -> str:
        """The ``--ref`` spelling: ``image:H:W``, ``video:F:H:W[:A]`` or ``audio:A``."""
        fields = REFERENCE_FIELDS[self.kind] + OPTIONAL_REFERENCE_FIELDS[self.kind]
        values = [getattr(self, f) for f in fields]
        return ":".join([self.kind, *(str(v) for v in values if v is not None)])


def _check_references(references: list[ReferenceSpec], latent_frames: int | None) -> None:
    kinds = [ref.kind for ref in references]
    for kind, limit in MAX_REFERENCES.items():
        if kinds.count(kind) > limit:
            raise ValueError(f"at most {limit} {kind} references, got {kinds.count(kind)}")
    if len(kinds) > MAX_REFERENCES_TOTAL:
        raise ValueError(f"at most {MAX_REFERENCES_TOTAL} references in all, got {len(kinds)}")
    if set(kinds) == {"audio"}:
        raise ValueError("audio references need at least one image or video reference beside them")
    for index, ref in enumerate(references):
        if ref.kind == "video" and latent_frames is not None and ref.frames > latent_frames:
            raise ValueError(
                f"entry {index} ({ref.token()}): latent_frames {ref.frames} exceeds the {latent_frames} target latent "
                "frames (a video reference is truncated to the generated duration)"
            )


class LayoutSpec(Strict):
    """One packed geometry; ``text_vision_rows`` are half-open ``[start, end)`` text rows tagged video (tag 0).

    ``task`` is ``t2va`` (no anchors), ``fl2va`` (keyframe anchors) or ``ref2va`` (``references``, no anchors); left
    out, a layout is t2va or fl2va by its anchors."""

    task: Literal["t2va", "fl2va", "ref2va"] | None = None
    text_tokens: PositiveCount
    latent_frames: PositiveCount
    latent_height: PositiveCount
    latent_width: PositiveCount
    audio_latents: PositiveCount
    anchors: list[Literal["first", "last"]] = Field(default=[], validate_default=True)
    text_vision_rows: list[tuple[StrictInt, StrictInt]] = []
    references: list[ReferenceSpec] = Field(default=[], validate_default=True)
    seq_len: PositiveCount | None = None
    description: str = ""

    @field_validator("latent_frames")
    @classmethod
    def _frame_grid(cls, value: int) -> int:
        return check_frame_grid(value)

    @field_validator("latent_height", "latent_width")
    @classmethod
    def _patch_multiple(cls, value: int) -> int:
        return check_patch_multiple(value)

    @field_validator("anchors")
    @classmethod
    def _anchors_fit_task(cls, value: list[str], info: ValidationInfo) -> list[str]:
        task = info.data.get("task")
        if task in ("t2va", "ref2va") and value:
            raise ValueError(f"a {task} layout has no keyframe anchors (fl2va has)")
        if task == "fl2va" and not value:
            raise ValueError("an fl2va layout needs at least one keyframe anchor")
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

    @field_validator("references")
    @classmethod
    def _references_fit_task(cls, value: list[ReferenceSpec], info: ValidationInfo) -> list[ReferenceSpec]:
        if info.data.get("task") != "ref2va":
            if value:
                raise ValueError("only a ref2va layout (task: ref2va) has references")
            return value
        if not value:
            raise ValueError("a ref2va layout needs at least one reference")
        _check_references(value, info.data.get("latent_frames"))
        return value

    @property
    def rows_per_frame(self) -> int:
        """Patched rows of one latent frame: ``(latent_height / 2) * (latent_width / 2)``."""
        return (self.latent_height // SPATIAL_PATCH) * (self.latent_width // SPATIAL_PATCH)

    @property
    def kind(self) -> str:
        """The task this layout packs: ``task`` when given, else ``fl2va`` with anchors and ``t2va`` without."""
        if self.task is not None:
            return self.task
        return "fl2va" if self.anchors else "t2va"

    @property
    def reference_rows(self) -> tuple[int, int]:
        """``(video, audio)`` rows of every reference block together (the leading rows of each index tensor)."""
        return sum(r.video_rows for r in self.references), sum(r.audio_rows for r in self.references)


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
