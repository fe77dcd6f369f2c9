"""Ref2VA packed layouts bitwise against diffusers 0.42.1's ``build_ref2va_packed_sequence`` (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import h3gate.layout as layout_module
from h3gate.layout import PackedLayout, build_layout, text_token_tags
from h3gate.manifests.layouts import LayoutSpec, load_layout
from h3gate.schedule import build_schedule

pytestmark = pytest.mark.parity
FIELDS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")
PIXEL = np.zeros((2, 2, 3), dtype=np.uint8)  # media the layout never reads (it reads kinds and latent shapes)
SOUND = torch.zeros(2, 4)


def provider_inputs(spec: LayoutSpec) -> tuple[list[MiniMaxH3Reference], list[torch.Tensor], list[torch.Tensor]]:
    """What the reference encoder hands the layout step: references, visual latents and audio rows, packed order."""
    refs: list[MiniMaxH3Reference] = []
    visual, audio = [], []
    for ref in spec.references:
        if ref.kind == "image":
            refs.append(MiniMaxH3ImageReference(image=PIXEL))
            visual.append(torch.empty(1, 1, 1, ref.latent_height, ref.latent_width))
        elif ref.kind == "video":
            soundtrack = None if ref.audio_latents is None else SOUND
            refs.append(MiniMaxH3VideoReference(frames=PIXEL[None], audio=soundtrack))
            visual.append(torch.empty(1, 1, ref.latent_frames, ref.latent_height, ref.latent_width))
        else:
            refs.append(MiniMaxH3AudioReference(audio=SOUND))
        if ref.audio_latents is not None:
            audio.append(torch.empty(2 * ref.audio_latents, 1))
    return refs, visual, audio


def provider_layout(spec: LayoutSpec) -> tuple:
    # Components of the released pipeline: patch (1, 2, 2), stereo audio, audio tag 2, video tag 0.
    refs, visual, audio = provider_inputs(spec)
    return MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        text_token_tags(spec),
        refs,
        visual,
        audio,
        spec.latent_frames,
        spec.latent_height,
        spec.latent_width,
        spec.audio_latents,
        (1, 2, 2),
        2,
        2,
        0,
    )


def assert_bitwise(layout: PackedLayout, reference: tuple) -> None:
    for field, expected in zip(FIELDS, reference[:5], strict=True):
        mine = getattr(layout, field)
        assert mine.dtype == expected.dtype and mine.shape == expected.shape, field
        assert torch.equal(mine, expected), field
    assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == reference[5:]


def ref2va(references: list[dict], frames: int = 7, text: int = 13, **kw) -> LayoutSpec:
    geometry = {"latent_height": 6, "latent_width": 10, "audio_latents": 9, **kw}
    return LayoutSpec(task="ref2va", text_tokens=text, latent_frames=frames, references=references, **geometry)


IMAGE = {"kind": "image", "latent_height": 4, "latent_width": 8}


def video(frames: int, height: int = 4, width: int = 6, audio: int | None = None) -> dict:
    extra = {} if audio is None else {"audio_latents": audio}
    return {"kind": "video", "latent_frames": frames, "latent_height": height, "latent_width": width, **extra}


def sound(latents: int) -> dict:
    return {"kind": "audio", "audio_latents": latents}


@pytest.mark.parametrize("name", ["ref2va-tiny", "ref2va-768p"])
def test_named_ref2va_layouts_bitwise(name: str) -> None:
    spec = load_layout(name)
    assert spec.task == "ref2va"
    assert_bitwise(build_layout(spec, name), provider_layout(spec))


FIXED = {
    "one image": ref2va([IMAGE]),
    "portrait image, square target": ref2va([{"kind": "image", "latent_height": 12, "latent_width": 4}], 2, 1, **{
        "latent_height": 8, "latent_width": 8}),
    "silent video 17 frames": ref2va([video(17)], 17),
    "video 37 frames, short soundtrack": ref2va([video(37, audio=50)], 42),
    "video, soundtrack longer than its frames": ref2va([video(7, audio=40)], 7),
    "audio then image then video": ref2va([sound(11), IMAGE, video(22, 2, 2, audio=3)], 22),
    "every limit": ref2va([IMAGE] * 6 + [video(2, audio=1), video(52, 6, 2), video(17, audio=29)] + [sound(1)] * 3, 52),
    "vision-tagged text": ref2va([video(2), IMAGE], 2, 40, text_vision_rows=[(30, 40), (1, 5)]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FIXED))
def test_fixed_reference_lists_bitwise(case: str) -> None:
    spec = FIXED[case]
    assert_bitwise(build_layout(spec, case), provider_layout(spec))


@pytest.mark.parametrize("frames", [17, 37])
def test_both_clock_summation_orders_from_16_latent_frames(frames: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A video reference advances the clock by its frame span summed left to right; fl2va's ``"last"`` anchor sums the
    same series pairwise (numpy). From 16 latent frames on the two differ in the last ulp, and h3gate keeps both."""
    spans = [5.0 / 3.0 * (1, 4, 4, 4, 4)[f % 5] for f in range(frames)]
    sequential = 0.0
    for span in spans:
        sequential += span
    pairwise = float(np.sum(np.asarray(spans)))
    assert sequential != pairwise

    spec = ref2va([video(frames)], frames, text=5)  # no soundtrack: the span alone moves the clock
    reference = provider_layout(spec)
    assert_bitwise(build_layout(spec), reference)
    target_video_start = int(reference[2][spec.reference_rows[0]])
    assert reference[0][target_video_start, 0].item() == 5.0 + sequential

    anchored = LayoutSpec(
        text_tokens=5, latent_frames=frames, latent_height=6, latent_width=10, audio_latents=9, anchors=["last"]
    )
    expected = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags(anchored), frames, 6, 10, 9, (1, 2, 2), 2, 2, 0, ("last",)
    )
    mine = build_layout(anchored)
    assert torch.equal(mine.position_ids, expected[0])
    assert expected[0][5, 0].item() == 5.0 + pairwise - 5.0 / 3.0

    # Summing the video span pairwise instead is caught by the oracle.
    monkeypatch.setattr(layout_module, "_sequential_span", lambda n: float(np.sum(np.asarray(spans[:n]))))
    assert not torch.equal(build_layout(spec).position_ids, reference[0])


@st.composite
def reference_lists(draw) -> LayoutSpec:
    frames = 5 * draw(st.integers(0, 8)) + 2
    text = draw(st.integers(1, 120))
    cuts = sorted(draw(st.sets(st.integers(0, text), max_size=4)))
    even = st.integers(1, 9).map(lambda n: 2 * n)
    kinds = draw(st.lists(st.sampled_from(["image", "video", "audio"]), min_size=1, max_size=7))
    kinds = [k for i, k in enumerate(kinds) if k == "image" or kinds[:i].count(k) < 3]
    if set(kinds) == {"audio"}:
        kinds.append(draw(st.sampled_from(["image", "video"])))
    references = []
    for kind in draw(st.permutations(kinds)):
        if kind == "image":
            references.append({"kind": "image", "latent_height": draw(even), "latent_width": draw(even)})
        elif kind == "video":
            soundtrack = draw(st.none() | st.integers(1, 80))
            ref_frames = 5 * draw(st.integers(0, (frames - 2) // 5)) + 2
            references.append(video(ref_frames, draw(even), draw(even), soundtrack))
        else:
            references.append(sound(draw(st.integers(1, 80))))
    return LayoutSpec(
        task="ref2va",
        text_tokens=text,
        latent_frames=frames,
        latent_height=draw(even),
        latent_width=draw(even),
        audio_latents=draw(st.integers(1, 97)),
        text_vision_rows=[(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)],
        references=references,
    )


@settings(max_examples=60, deadline=None)
@given(spec=reference_lists())
def test_generated_reference_lists_bitwise(spec: LayoutSpec) -> None:
    assert_bitwise(build_layout(spec), provider_layout(spec))


def test_ref2va_row_timesteps_bitwise() -> None:
    """Reference video rows at the keyframe level, reference audio rows clean, as diffusers' build_row_timesteps."""
    layout = build_layout(load_layout("ref2va-tiny"), "ref2va-tiny")
    assert layout.num_condition_audio_rows > 0 and layout.num_condition_video_rows > 0
    video, audio = build_schedule(9, 12.0), build_schedule(9, 3.0)
    for t_video, t_audio in zip(video.timesteps.tolist(), audio.timesteps.tolist(), strict=True):
        args = (float(t_video), float(t_audio), max(float(t_video), 0.999), 1.0)
        expected = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_indices,
            layout.audio_indices,
            layout.num_condition_video_rows,
            layout.num_condition_audio_rows,
            layout.text_indices.numel(),
            *args,
        )
        timestep, indices = layout.row_timesteps(*args)
        assert torch.equal(timestep, expected[0]) and torch.equal(indices, expected[1])
