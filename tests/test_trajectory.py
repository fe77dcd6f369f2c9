"""The dual-scheduler trajectory: bitwise against a diffusers-driven loop, sealed per-step hashes, held condition rows,
resumption from the latents alone, and the recipe's knobs."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.gate.compare import tensor_sha256
from h3gate.graph.executions import provider_table
from h3gate.graph.model import OUTPUTS, build_model_graph
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec
from h3gate.manifests.model_config import load_config
from h3gate.trajectory import Recipe, iter_trajectory, make_request, row_timestep_plan, run_trajectory

CFG = load_config("tiny").config
pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = LayoutSpec(text_tokens=29, latent_frames=2, latent_height=8, latent_width=10, audio_latents=6, anchors=["first"])


@pytest.fixture(scope="module")
def setup(tiny_params):
    layout = build_layout(SPEC, "anchored")
    return layout, tiny_params, build_model_graph(CFG), make_request(layout, CFG, 0)


@pytest.fixture(scope="module")
def result(setup):
    layout, params, graph, request = setup
    return run_trajectory(graph, params, provider_table(), CFG, layout, request, Recipe(steps=4))


@pytest.mark.parity
def test_trajectory_bitwise_equals_a_diffusers_loop(setup, result):
    from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    layout, params, _, request = setup
    oracle = MiniMaxH3Transformer3DModel(**{k: v for k, v in CFG.diffusers_config().items() if k[0] != "_"})
    oracle.load_state_dict(params, strict=True, assign=True)
    video_sched, audio_sched = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video_sched.set_timesteps(4)
    audio_sched.set_timesteps(4)
    nc = layout.num_condition_video_rows
    cond = video_sched.scale_noise(request.condition_x0, 0.999, request.condition_noise)
    latents, audio = torch.cat([cond, request.video_noise]), request.audio_noise.clone()
    steps = list(zip(video_sched.timesteps, audio_sched.timesteps, strict=True))
    assert len(steps) == len(result.steps) == 3
    with torch.no_grad():
        for i, (t, t_audio) in enumerate(steps):
            ts, ti = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout.video_indices, layout.audio_indices, nc, 0, layout.text_indices.numel(), float(t),
                float(t_audio), max(float(t), 0.999), 1.0,
            )  # fmt: skip
            v, a = oracle(
                hidden_states=latents[None], audio_hidden_states=audio[None], encoder_hidden_states=request.text,
                timestep=ts, timestep_indices=ti, token_tags=layout.token_tags, position_ids=layout.position_ids,
                video_indices=layout.video_indices, audio_indices=layout.audio_indices,
                text_indices=layout.text_indices, return_dict=False,
            )  # fmt: skip
            assert torch.equal(v, result.velocities[i][0]) and torch.equal(a, result.velocities[i][1]), i
            latents[nc:] = video_sched.step(v[0, nc:].float(), t, latents[nc:], return_dict=False)[0]
            audio[0:] = audio_sched.step(a[0, 0:].float(), audio_sched.timesteps[i], audio[0:], return_dict=False)[0]
            assert result.steps[i]["video_latents_sha256"] == tensor_sha256(latents), i
            assert result.steps[i]["audio_latents_sha256"] == tensor_sha256(audio), i
    assert torch.equal(latents, result.video_latents) and torch.equal(audio, result.audio_latents)


def test_sealed_step_hashes_and_held_condition_rows(setup, result):
    layout, _, _, _ = setup
    nc = layout.num_condition_video_rows
    assert nc == 20 and [s["step"] for s in result.steps] == [0, 1, 2]
    assert "condition_rows_sha256" in result.steps[0]
    hashes = {s["video_latents_sha256"] for s in result.steps}
    assert len(hashes) == 3  # every step moves the generated rows
    record = result.record()
    assert record["recipe"]["video_shift"] == 12.0 and record["recipe"]["audio_shift"] == 3.0
    assert record["recipe"]["video_sigma_sha256"] != record["recipe"]["audio_sigma_sha256"]
    assert record["final_video_sha256"] == tensor_sha256(result.video_latents)
    # condition rows are never written: they stay the noised anchors of step 0 (t = 0.999 mix)
    assert tensor_sha256(result.video_latents[:nc]) == result.steps[0]["condition_rows_sha256"]
    # the row plan: conditioning rows at max(t, 0.999), generated audio on its own schedule
    video, audio = Recipe(steps=4).schedules()
    plan = row_timestep_plan(layout, Recipe(steps=4), video, audio)
    ts, ti = plan[1]
    assert ts.numel() == 3 and float(ts[ti[layout.video_indices[0]]]) == pytest.approx(0.999)
    assert float(ts[ti[layout.audio_indices[0]]]) == float(audio.timesteps[1])


def test_resuming_from_the_latents_reproduces_the_rest(setup, result):
    layout, params, graph, request = setup
    state = None
    with torch.no_grad():
        for node, value in iter_trajectory(graph, params, provider_table(), CFG, layout, request, Recipe(steps=4)):
            if node.name == "scheduler.video_step" and node.step == 0:
                video0 = value
            if node.name == "scheduler.audio_step" and node.step == 0:
                state = (video0, value)
                break
        resumed = {
            (n.name, n.step): v
            for n, v in iter_trajectory(
                graph, params, provider_table(), CFG, layout, request, Recipe(steps=4), start=1, state=state
            )  # fmt: skip
            if n.name in OUTPUTS or n.name.startswith("scheduler.")
        }
    assert sorted({s for _, s in resumed}) == [1, 2]
    assert torch.equal(resumed[("scheduler.video_step", 2)], result.video_latents)
    assert torch.equal(resumed[("scheduler.audio_step", 2)], result.audio_latents)


def test_recipe_knobs_change_what_they_say(setup):
    shared = Recipe(steps=4, share_schedule=True)
    video, audio = shared.schedules()
    assert audio is video and shared.record()["audio_shift"] is None
    layout, params, graph, request = setup
    with pytest.raises(InputError, match="--steps 1"):
        list(iter_trajectory(graph, params, provider_table(), CFG, layout, request, Recipe(steps=1)))
