"""Packed layouts: row identity, modality tags and float64 ``(t, h, w)`` rotary positions of one packed sequence.

The sequence is ``[text | keyframe conditions | target audio | target video]`` and this module reproduces diffusers
0.42.1's ``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` bitwise (``t2va`` / ``fl2va``), written from its maths
(``ref2va``: see :func:`build_ref2va_layout`):

* patch ``(1, 2, 2)``; ``rows_per_frame = (H/2) * (W/2)``; audio is stereo, packed channel-major (``2 * A`` rows).
* tags: text 1 (0 on ``text_vision_rows``), every video row 0 (conditions included), audio 2.
* text row ``i`` sits at ``(i, 0, 0)``; media time starts at ``T = text_tokens``.
* spatial axis of length ``n`` (``n`` = H or W latents): ``ratio = n / sqrt(H*W)`` (numpy float64 sqrt),
  ``left = (1 - ratio) / 2``, ``numpy.linspace(left, left + ratio, n/2, endpoint=False) * 32`` (numpy's
  ``start + i * ((stop - start) / num)``, not torch's linspace); a frame's ``(h, w)`` grid is their ``ij`` meshgrid,
  row-major.
* video frame ``f`` time: ``T + cumsum`` (float64, sequential) of ``5/3 * (1, 4, 4, 4, 4)[f % 5]`` over earlier
  frames.
* keyframe anchor time: ``"first"`` -> ``T``; ``"last"`` -> ``(T + sum(spans)) - 5/3`` where ``spans`` is the same
  per-frame series summed by numpy's pairwise ``sum`` (differs from the sequential sum in the last ulp from 16
  frames on, so the order is part of the contract).
* audio latent ``k`` of channel ``c``: ``(T + k, 0, w_grid[0] if c == 0 else w_grid[-1])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from h3gate.errors import InputError
from h3gate.hashing import tensor_sha256
from h3gate.manifests.layouts import AUDIO_CHANNELS, LayoutSpec, ReferenceSpec, load_layout
from h3gate.memory import require

PATCH = (1, 2, 2)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
MODALITY_NUM = 3
FRAME_RESCALE = 5.0 / 3.0
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
SPATIAL_SCALE = 32

Modality = Literal["text", "video", "audio"]


@dataclass(frozen=True)
class PackedLayout:
    """One built layout. Index tensors are int64 and 1-D; ``position_ids`` is float64 ``(S, 3)``."""

    name: str
    spec: LayoutSpec
    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int

    @property
    def seq_len(self) -> int:
        return int(self.position_ids.shape[0])

    def rows_per_modality(self) -> dict[str, int]:
        """Rows by index tensor (keyframe condition rows count as video; vision-tagged text rows as text)."""
        return {
            "text": int(self.text_indices.numel()),
            "video": int(self.video_indices.numel()),
            "audio": int(self.audio_indices.numel()),
        }

    def row_modality_codes(self) -> torch.Tensor:
        """(S,) int64: 0 video, 1 text, 2 audio, by which index tensor holds each row."""
        codes = torch.full((self.seq_len,), -1, dtype=torch.int64)
        codes[self.text_indices] = TEXT_TAG
        codes[self.video_indices] = VIDEO_TAG
        codes[self.audio_indices] = AUDIO_TAG
        return codes

    def row_modalities(self) -> list[Modality]:
        names: dict[int, Modality] = {VIDEO_TAG: "video", TEXT_TAG: "text", AUDIO_TAG: "audio"}
        return [names[int(c)] for c in self.row_modality_codes().tolist()]

    def modality_of_row(self, row: int) -> Modality:
        if not 0 <= row < self.seq_len:
            raise InputError(f"layout {self.name!r}: row {row} outside [0, {self.seq_len})")
        for modality, indices in (("text", self.text_indices), ("video", self.video_indices)):
            if bool((indices == row).any()):
                return modality  # type: ignore[return-value]
        if bool((self.audio_indices == row).any()):
            return "audio"
        raise InputError(f"layout {self.name!r}: row {row} is in no index tensor")

    def row_timesteps(
        self, video_t: float, audio_t: float, cond_video_t: float, cond_audio_t: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row timesteps reduced to ``(timestep float32 (T,), timestep_indices int64 (S,))``.

        Every row starts at ``video_t`` (text rows inherit it); video condition rows get ``cond_video_t``, generated
        audio rows ``audio_t``, audio reference rows ``cond_audio_t`` (each value rounded once to float32), then the
        distinct values are sorted and every row indexes into them (diffusers ``build_row_timesteps``).
        """
        rows = torch.full((self.seq_len,), float(video_t), dtype=torch.float32)
        rows[self.video_indices[: self.num_condition_video_rows]] = float(cond_video_t)
        rows[self.audio_indices[self.num_condition_audio_rows :]] = float(audio_t)
        rows[self.audio_indices[: self.num_condition_audio_rows]] = float(cond_audio_t)
        timestep, timestep_indices = torch.unique(rows, sorted=True, return_inverse=True)
        return timestep, timestep_indices

    def adaln_indices(self, timestep_indices: torch.Tensor) -> torch.Tensor:
        """Row of the ``(T * 3, ...)`` AdaLN table every packed row reads: ``timestep_index * 3 + token_tag``."""
        return timestep_indices * MODALITY_NUM + self.token_tags.to(timestep_indices.device)

    def canonical_order(self) -> torch.Tensor:
        """(S,) int64 :func:`canonical_order` of this layout's index tensors."""
        return canonical_order(self.text_indices, self.video_indices, self.audio_indices)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "position_ids": self.position_ids,
            "token_tags": self.token_tags,
            "video_indices": self.video_indices,
            "audio_indices": self.audio_indices,
            "text_indices": self.text_indices,
        }

    def tensor_hashes(self) -> dict[str, str]:
        """sha256 of each tensor's contiguous little-endian bytes."""
        return {key: tensor_sha256(value) for key, value in self.tensors().items()}


def _spatial_axis(size: int, patch: int, sqrt_area: np.float64) -> torch.Tensor:
    ratio = size / sqrt_area
    left = (1.0 - ratio) / 2.0
    grid = np.linspace(left, left + ratio, size // patch, endpoint=False) * SPATIAL_SCALE
    return torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float64))


def _frame_spans(num_frames: int) -> list[float]:
    """Rotary duration of each latent frame: ``5/3 * (1, 4, 4, 4, 4)[f % 5]`` in float64."""
    return [FRAME_RESCALE * FRAMES_PER_LATENT[f % len(FRAMES_PER_LATENT)] for f in range(num_frames)]


def _frame_times(num_frames: int, origin: float) -> torch.Tensor:
    """Start time of each latent frame: ``origin + [0, cumsum(spans)[:-1]]``, sequential float64 sums."""
    spans = torch.tensor(_frame_spans(num_frames), dtype=torch.float64)
    starts = torch.zeros(num_frames, dtype=torch.float64)
    starts[1:] = spans[:-1].cumsum(0)
    return origin + starts


def _sequential_span(num_frames: int) -> float:
    """Rotary time ``num_frames`` latent frames occupy, summed left to right in float64 (how a ``ref2va`` video
    reference advances the clock; the ``"last"`` anchor sums the same series pairwise, see :func:`_anchor_time`)."""
    total = 0.0
    for span in _frame_spans(num_frames):
        total += span
    return total


def _anchor_time(anchor: str, num_frames: int, origin: float) -> float:
    if anchor == "first":
        return origin
    if anchor == "last":
        pairwise = float(np.sum(np.asarray(_frame_spans(num_frames), dtype=np.float64)))
        return origin + pairwise - FRAME_RESCALE
    raise InputError(f"anchor {anchor!r}: must be 'first' or 'last'")


def packed_rows(spec: LayoutSpec, name: str = "custom") -> int:
    """S, the packed sequence length of ``spec``, without building the layout: text + condition frames + reference
    rows + audio rows (``audio_latents x AUDIO_CHANNELS``) + video rows; a declared ``seq_len`` must match."""
    _, patch_h, patch_w = PATCH
    per_frame = (spec.latent_height // patch_h) * (spec.latent_width // patch_w)
    seq = spec.text_tokens + (len(spec.anchors) + spec.latent_frames) * per_frame + spec.audio_latents * AUDIO_CHANNELS
    seq += sum(spec.reference_rows)
    _check_seq_len(spec, name, seq)
    return seq


def parse_layouts(layouts: str) -> list[tuple[str, int]]:
    """``"tiny,small"`` -> [(name, seq_len)] of layouts in ``manifests/layouts.yaml`` (no layout is built)."""
    names = [n.strip() for n in layouts.split(",") if n.strip()]
    if not names:
        raise InputError("--layouts: give at least one layout name")
    return [(n, packed_rows(load_layout(n), n)) for n in names]


def _frame_grid(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(h, w)`` rotary coordinates of one latent frame (``(rows, 2)``, row-major ``ij`` grid) and its width
    axis."""
    _, patch_h, patch_w = PATCH
    sqrt_area = np.sqrt(height * width)
    h_axis = _spatial_axis(height, patch_h, sqrt_area)
    w_axis = _spatial_axis(width, patch_w, sqrt_area)
    grid = torch.stack(
        [
            h_axis[:, None].expand(-1, w_axis.numel()).reshape(-1),
            w_axis[None, :].expand(h_axis.numel(), -1).reshape(-1),
        ],
        dim=1,
    )
    return grid, w_axis


def _place_audio(pos: torch.Tensor, start: int, latents: int, origin: float, w_axis: torch.Tensor) -> int:
    """Channel-major stereo audio rows from ``start``: latent ``k`` at ``(origin + k, 0, w_axis[0] | w_axis[-1])``
    by channel. Returns the row after the block."""
    latent_time = origin + torch.arange(latents, dtype=torch.float64)
    for channel in range(AUDIO_CHANNELS):
        rows = slice(start + channel * latents, start + (channel + 1) * latents)
        pos[rows, 0] = latent_time
        pos[rows, 2] = w_axis[0] if channel == 0 else w_axis[-1]
    return start + AUDIO_CHANNELS * latents


def _place_frames(pos: torch.Tensor, start: int, frames: int, grid: torch.Tensor, origin: float) -> int:
    """``frames`` latent frames of ``grid`` rows from ``start`` on the frame clock from ``origin``. Returns the row
    after the block."""
    stop = start + frames * grid.shape[0]
    block = pos[start:stop].view(frames, grid.shape[0], 3)
    block[:, :, 0] = _frame_times(frames, origin)[:, None]
    block[:, :, 1:] = grid[None]
    return stop


def _tags(spec: LayoutSpec, seq: int, video_indices: torch.Tensor, audio_indices: torch.Tensor) -> torch.Tensor:
    """(S,) int64 tags: the text rows' own (1, 0 on vision rows), 2 on every audio row, 0 on every video row."""
    tags = torch.empty(seq, dtype=torch.int64)
    tags[: spec.text_tokens] = text_token_tags(spec)
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return tags


def _check_seq_len(spec: LayoutSpec, name: str, seq: int) -> None:
    """A declared ``seq_len`` must be the built one."""
    if spec.seq_len is not None and spec.seq_len != seq:
        raise InputError(f"layout {name!r}: seq_len: declared {spec.seq_len} but the built layout has {seq}")


def canonical_order(
    text_indices: torch.Tensor, video_indices: torch.Tensor, audio_indices: torch.Tensor
) -> torch.Tensor:
    """The canonical (logical) row order as a permutation of packed rows: entry ``i`` is the packed row holding
    logical row ``i``; logical rows are ``[text | audio | video]``, each modality in its index tensor's order (video:
    conditions first, as ``video_indices`` lists them). Derived from the three index tensors alone - what the
    transformer's forward receives - so every engine and the strict adapter derive the same order, and a consistent
    row permutation (index tensors remapped) names the same logical rows. Identity on a layout packed ``[text |
    audio | video]`` (t2va without keyframes); keyframe and reference rows, packed before the target audio, move.
    The strict attention walks its rows in this order (``h3gate.kernels.attention``)."""
    return torch.cat([text_indices, audio_indices, video_indices])


def build_layout(spec: LayoutSpec, name: str = "custom") -> PackedLayout:
    """Pack ``spec`` into index tensors, tags and float64 positions (bitwise = diffusers build_packed_sequence, or
    build_ref2va_packed_sequence for a ``ref2va`` spec)."""
    if spec.task == "ref2va":
        return build_ref2va_layout(spec, name)
    text = spec.text_tokens
    per_frame = spec.rows_per_frame
    n_cond = len(spec.anchors) * per_frame
    cond_start = text
    audio_start = cond_start + n_cond
    video_start = audio_start + spec.audio_latents * AUDIO_CHANNELS
    seq = video_start + spec.latent_frames * per_frame
    # Per packed row: float64 positions (3), int64 index / tag tensors and their intermediates (~12 x 8 bytes).
    require(128 * seq, f"layout {name} (S={seq})", hint="ask for a smaller layout")
    origin = float(text)
    frame_hw, w_axis = _frame_grid(spec.latent_height, spec.latent_width)

    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:text, 0] = torch.arange(text, dtype=torch.float64)
    for block, anchor in enumerate(spec.anchors):
        rows = slice(cond_start + block * per_frame, cond_start + (block + 1) * per_frame)
        pos[rows, 0] = _anchor_time(anchor, spec.latent_frames, origin)
        pos[rows, 1:] = frame_hw
    _place_audio(pos, audio_start, spec.audio_latents, origin, w_axis)
    _place_frames(pos, video_start, spec.latent_frames, frame_hw, origin)

    video_indices = torch.cat([torch.arange(cond_start, audio_start), torch.arange(video_start, seq)])
    audio_indices = torch.arange(audio_start, video_start)
    layout = PackedLayout(
        name=name,
        spec=spec,
        position_ids=pos,
        token_tags=_tags(spec, seq, video_indices, audio_indices),
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=torch.arange(text),
        num_condition_video_rows=n_cond,
        num_condition_audio_rows=0,
    )
    _check_seq_len(spec, name, layout.seq_len)
    return layout


@dataclass(frozen=True)
class ReferenceBlock:
    """Where one ``ref2va`` reference sits: its audio and video row ranges and the rotary time it starts at."""

    kind: str
    audio_rows: tuple[int, int]
    video_rows: tuple[int, int]
    clock: float


def _place_reference(
    pos: torch.Tensor, cursor: int, clock: float, ref: ReferenceSpec, target_w_axis: torch.Tensor
) -> tuple[ReferenceBlock, float]:
    """Fill one reference block's positions at ``cursor``; returns the block and the clock after it.

    An image is one frame on one integer slot (clock + 1). An audio clip sits on the target's width extremes (clock +
    its latents). A video's soundtrack rows come first, on the video's own width extremes, both from the same clock;
    the clock then advances by ``max(soundtrack latents, frame span)``, the span summed sequentially."""
    if ref.kind == "audio":
        latents = ref.audio_latents or 0
        stop = _place_audio(pos, cursor, latents, clock, target_w_axis)
        return ReferenceBlock("audio", (cursor, stop), (stop, stop), clock), clock + float(latents)
    grid, w_axis = _frame_grid(ref.latent_height or 0, ref.latent_width or 0)
    if ref.kind == "image":
        stop = cursor + grid.shape[0]
        pos[cursor:stop, 0] = clock
        pos[cursor:stop, 1:] = grid
        return ReferenceBlock("image", (cursor, cursor), (cursor, stop), clock), clock + 1.0
    latents = ref.audio_latents or 0
    video_start = _place_audio(pos, cursor, latents, clock, w_axis)
    stop = _place_frames(pos, video_start, ref.frames, grid, clock)
    advance = max(float(latents), _sequential_span(ref.frames))
    return ReferenceBlock("video", (cursor, video_start), (video_start, stop), clock), clock + advance


def reference_blocks(layout: PackedLayout) -> list[ReferenceBlock]:
    """The reference blocks of a ``ref2va`` layout in packed order (empty for any other layout)."""
    if layout.spec.task != "ref2va":
        return []
    pos = torch.zeros(packed_rows(layout.spec, layout.name), 3, dtype=torch.float64)
    return _reference_pass(pos, layout.spec)[0]


def _reference_pass(pos: torch.Tensor, spec: LayoutSpec) -> tuple[list[ReferenceBlock], int, float]:
    """Place every reference after the text rows; returns the blocks, the next row and the clock the target starts
    at."""
    _, target_w_axis = _frame_grid(spec.latent_height, spec.latent_width)
    cursor, clock, blocks = spec.text_tokens, float(spec.text_tokens), []
    for ref in spec.references:
        block, clock = _place_reference(pos, cursor, clock, ref, target_w_axis)
        blocks.append(block)
        cursor = block.video_rows[1]
    return blocks, cursor, clock


def build_ref2va_layout(spec: LayoutSpec, name: str = "custom") -> PackedLayout:
    """Pack a ``ref2va`` spec: ``[text | reference blocks | target audio | target video]`` on one rotary clock
    (bitwise = diffusers ``MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence``).

    The clock starts at ``T = text_tokens`` and every reference block advances it (see :func:`_place_reference`);
    target audio and target video both start where the references left it. Video indices list the reference video
    rows (in packed order) before the target's, audio indices the reference audio rows before the target's; the
    leading counts are ``num_condition_video_rows`` / ``num_condition_audio_rows``.
    """
    if spec.task != "ref2va" or spec.anchors:
        raise InputError(f"layout {name!r}: a ref2va layout has task ref2va and no keyframe anchors")
    seq = packed_rows(spec, name)
    require(128 * seq, f"layout {name} (S={seq})", hint="ask for a smaller layout")
    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[: spec.text_tokens, 0] = torch.arange(spec.text_tokens, dtype=torch.float64)
    blocks, audio_start, clock = _reference_pass(pos, spec)
    frame_hw, w_axis = _frame_grid(spec.latent_height, spec.latent_width)
    video_start = _place_audio(pos, audio_start, spec.audio_latents, clock, w_axis)
    _place_frames(pos, video_start, spec.latent_frames, frame_hw, clock)

    ranges = [torch.arange(*b.video_rows) for b in blocks] + [torch.arange(video_start, seq)]
    video_indices = torch.cat(ranges)
    audio_indices = torch.cat([torch.arange(*b.audio_rows) for b in blocks] + [torch.arange(audio_start, video_start)])
    n_video, n_audio = spec.reference_rows
    return PackedLayout(
        name=name,
        spec=spec,
        position_ids=pos,
        token_tags=_tags(spec, seq, video_indices, audio_indices),
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=torch.arange(spec.text_tokens),
        num_condition_video_rows=n_video,
        num_condition_audio_rows=n_audio,
    )


def text_token_tags(spec: LayoutSpec) -> torch.Tensor:
    """(text_tokens,) int64 tags of the text rows: 1, and 0 on every ``text_vision_rows`` range."""
    tags = torch.full((spec.text_tokens,), TEXT_TAG, dtype=torch.int64)
    for start, end in spec.text_vision_rows:
        tags[start:end] = VIDEO_TAG
    return tags


def _check_patch(name: str, shape: tuple[int, ...], patch: tuple[int, int, int]) -> None:
    if len(patch) != 3 or any(p <= 0 for p in patch):
        raise InputError(f"{name}: patch {tuple(patch)} must be three positive ints")
    if len(shape) != 5:
        raise InputError(f"{name}: expected (B, C, T, H, W), got shape {tuple(shape)}")
    if any(size % p for size, p in zip(shape[2:], patch, strict=True)):
        raise InputError(f"{name}: (T, H, W) {tuple(shape[2:])} not divisible by the patch {tuple(patch)}")


def patchify_video_latents(latents: torch.Tensor, patch: tuple[int, int, int] = PATCH) -> torch.Tensor:
    """(B, C, T, H, W) -> (B * rows, C * pt * ph * pw): rows frame-major then row-major, each row ordered
    ``(c, dt, dh, dw)`` with ``dw`` fastest. A pure permutation (no arithmetic)."""
    _check_patch("video latents", tuple(latents.shape), patch)
    b, c, t, h, w = latents.shape
    pt, ph, pw = patch
    blocks = latents.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return blocks.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify_video_latents(
    rows: torch.Tensor, shape: tuple[int, int, int, int, int], patch: tuple[int, int, int] = PATCH
) -> torch.Tensor:
    """Exact inverse of :func:`patchify_video_latents`: (B * rows, C * prod(patch)) -> ``shape`` (B, C, T, H, W)."""
    shape = tuple(int(s) for s in shape)
    _check_patch("video rows", shape, patch)
    b, c, t, h, w = shape
    pt, ph, pw = patch
    expected = (b * (t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)
    if tuple(rows.shape) != expected:
        raise InputError(f"video rows: shape {tuple(rows.shape)} does not pack {shape} (expected {expected})")
    blocks = rows.reshape(b, t // pt, h // ph, w // pw, c, pt, ph, pw)
    return blocks.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape).contiguous()
