"""Packed layouts, row timesteps and patch packing bitwise against diffusers 0.42.1 (the oracle)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    patchify_video_latents as provider_patchify,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from h3gate.layout import PackedLayout, build_layout, patchify_video_latents, text_token_tags
from h3gate.manifests.layouts import LayoutSpec, layout_names, load_layout
from h3gate.schedule import build_schedule

pytestmark = pytest.mark.parity
FIELDS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")


def provider_layout(spec: LayoutSpec) -> tuple:
    # Components of the released pipeline: patch (1, 2, 2), stereo audio, audio tag 2, video tag 0.
    return MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags(spec),
        spec.latent_frames,
        spec.latent_height,
        spec.latent_width,
        spec.audio_latents,
        (1, 2, 2),
        2,
        2,
        0,
        tuple(spec.anchors),
    )


def assert_bitwise(layout: PackedLayout, reference: tuple) -> None:
    for field, expected in zip(FIELDS, reference[:5], strict=True):
        mine = getattr(layout, field)
        assert mine.dtype == expected.dtype and mine.shape == expected.shape, field
        assert torch.equal(mine, expected), field
    assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == reference[5:]


@pytest.mark.parametrize("name", ["micro", "tiny", "small", "medium", "768p"])
def test_named_layouts_bitwise(name: str) -> None:
    assert name in layout_names()
    spec = load_layout(name)
    assert_bitwise(build_layout(spec, name), provider_layout(spec))


def test_last_anchor_sum_order_is_observable() -> None:
    """At 37 frames the pairwise and sequential span sums give different anchor times, and we match pairwise."""
    spec = LayoutSpec(
        text_tokens=1, latent_frames=37, latent_height=4, latent_width=4, audio_latents=1, anchors=["last"]
    )
    spans = [5.0 / 3.0 * (1, 4, 4, 4, 4)[f % 5] for f in range(37)]
    sequential = 0.0
    for span in spans:
        sequential += span
    assert 1.0 + sequential - 5.0 / 3.0 != 1.0 + float(np.sum(np.asarray(spans))) - 5.0 / 3.0
    reference = provider_layout(spec)
    assert_bitwise(build_layout(spec), reference)
    assert reference[0][1, 0].item() == 1.0 + float(np.sum(np.asarray(spans))) - 5.0 / 3.0


@st.composite
def geometries(draw) -> LayoutSpec:
    text = draw(st.integers(1, 300))
    cuts = sorted(draw(st.sets(st.integers(0, text), max_size=6)))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return LayoutSpec(
        text_tokens=text,
        latent_frames=5 * draw(st.integers(0, 12)) + 2,
        latent_height=2 * draw(st.integers(1, 13)),
        latent_width=2 * draw(st.integers(1, 13)),
        audio_latents=draw(st.integers(1, 97)),
        anchors=draw(st.lists(st.sampled_from(["first", "last"]), max_size=2)),
        text_vision_rows=draw(st.permutations(ranges)),
    )


@settings(max_examples=60, deadline=None)
@given(spec=geometries())
def test_generated_geometries_bitwise(spec: LayoutSpec) -> None:
    assert_bitwise(build_layout(spec), provider_layout(spec))


@pytest.mark.parametrize("name", ["small", "medium"])
@pytest.mark.parametrize("cond_audio_rows", [0, 5])
def test_row_timesteps_bitwise(name: str, cond_audio_rows: int) -> None:
    layout = dataclasses.replace(build_layout(load_layout(name), name), num_condition_audio_rows=cond_audio_rows)
    video, audio = build_schedule(9, 12.0), build_schedule(9, 3.0)
    checked = 0
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
        assert timestep.dtype == torch.float32 and indices.dtype == torch.int64
        assert torch.equal(timestep, expected[0]) and torch.equal(indices, expected[1])
        checked += 1
    assert checked == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("shape", "patch"), [((2, 24, 3, 8, 12), (1, 2, 2)), ((1, 5, 4, 6, 2), (2, 3, 1))])
def test_patchify_matches_provider(dtype: torch.dtype, shape: tuple, patch: tuple) -> None:
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows = patchify_video_latents(latents, patch)
    assert torch.equal(rows, provider_patchify(latents, patch)) and rows.dtype == dtype
