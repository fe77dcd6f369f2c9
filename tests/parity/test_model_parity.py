"""The whole-model graph's provider execution bitwise against diffusers' MiniMaxH3Transformer3DModel.forward (CPU).

The diffusers model is built from the tiny config and loaded (``assign=True``, so the FP32 keep-list tensors stay
FP32 and everything else BF16) with h3gate's synthetic weights; both run on the same packed inputs.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from h3gate.graph.execute import run_chained
from h3gate.graph.executions import provider_table
from h3gate.graph.inputs import TimestepPlan
from h3gate.graph.model import OUTPUTS, build_model_graph, derive_metadata, raw_metadata
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec, load_layout
from h3gate.manifests.model_config import load_config
from h3gate.trajectory import Recipe, initial_latents, make_request

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]
CFG = load_config("tiny").config
ANCHORED = LayoutSpec(
    text_tokens=37, latent_frames=2, latent_height=8, latent_width=12, audio_latents=5,
    anchors=["first", "last"], text_vision_rows=[(3, 9)],
)  # fmt: skip


@pytest.fixture(scope="module")
def weights(tiny_params):
    kwargs = {k: v for k, v in CFG.diffusers_config().items() if not k.startswith("_")}
    oracle = MiniMaxH3Transformer3DModel(**kwargs)
    oracle.load_state_dict(tiny_params, strict=True, assign=True)
    return tiny_params, oracle.eval()


@pytest.mark.parametrize(("name", "batch"), [("tiny", 1), ("anchored", 1), ("anchored", 2)])
def test_model_forward_bitwise_equals_diffusers(weights, name, batch):
    params, oracle = weights
    layout = build_layout(load_layout("tiny"), "tiny") if name == "tiny" else build_layout(ANCHORED, name)
    plan = TimestepPlan().resolve()
    ts, ti = layout.row_timesteps(plan["video_t"], plan["audio_t"], plan["cond_video_t"], plan["cond_audio_t"])
    assert ts.numel() == (3 if layout.num_condition_video_rows else 2)
    states = [initial_latents(make_request(layout, CFG, 0, item), Recipe()) for item in range(batch)]
    video = torch.stack([s[1] for s in states])
    audio = torch.stack([s[2] for s in states])
    text = torch.cat([make_request(layout, CFG, 0, item).text for item in range(batch)])
    inputs = {"video_rows": video, "audio_rows": audio, "text": text}
    inputs.update(derive_metadata(raw_metadata(layout, ts, ti), CFG, "cpu"))
    with torch.no_grad():
        ours = run_chained(build_model_graph(CFG), inputs, params, provider_table())
        ref_video, ref_audio = oracle(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, timestep=ts,
            timestep_indices=ti, token_tags=layout.token_tags, position_ids=layout.position_ids,
            video_indices=layout.video_indices, audio_indices=layout.audio_indices,
            text_indices=layout.text_indices, return_dict=False,
        )  # fmt: skip
    for mine, ref in ((ours[OUTPUTS[0]], ref_video), (ours[OUTPUTS[1]], ref_audio)):
        assert mine.dtype == ref.dtype == torch.float32 and mine.shape == ref.shape
        assert torch.equal(mine.view(torch.int32), ref.view(torch.int32))
    # the packed residual stream really is BF16 and the heads FP32, as in the checkpoint
    assert ours["embed.pack"].dtype == torch.bfloat16 and ours["heads.video_proj"].dtype == torch.float32
