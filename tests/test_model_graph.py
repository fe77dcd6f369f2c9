"""The whole-model graph: stage/node structure, streaming execution, metadata derivation and parameter loading."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3gate.errors import InputError
from h3gate.graph.block import BLOCK_NODES
from h3gate.graph.execute import NodeOverride, iter_graph, run_chained
from h3gate.graph.executions import provider_table
from h3gate.graph.inputs import TimestepPlan
from h3gate.graph.model import (
    MODEL_INPUTS,
    OUTPUTS,
    PrefixParams,
    build_model_graph,
    derive_metadata,
    load_model_params,
    raw_metadata,
)
from h3gate.graph.refiner import REFINER_NODES
from h3gate.graph.stages import split_stages
from h3gate.layout import build_layout
from h3gate.manifests.layouts import load_layout
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry
from h3gate.synth import SyntheticSource
from h3gate.trajectory import Recipe, initial_latents, make_request

CFG = load_config("tiny").config
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_params):
    layout = build_layout(load_layout("tiny"), "tiny")
    plan = TimestepPlan().resolve()
    ts, ti = layout.row_timesteps(plan["video_t"], plan["audio_t"], plan["cond_video_t"], plan["cond_audio_t"])
    request = make_request(layout, CFG, 0)
    _, video, audio = initial_latents(request, Recipe())
    inputs = {"video_rows": video[None], "audio_rows": audio[None], "text": request.text}
    inputs.update(derive_metadata(raw_metadata(layout, ts, ti), CFG, "cpu"))
    return build_model_graph(CFG), inputs, tiny_params, layout


def test_stages_and_node_names_follow_the_forward(model):
    graph, _, _, _ = model
    names = [n.name for n in graph.nodes]
    per_block, per_refiner = 17, 14
    assert len(names) == 3 + per_refiner * CFG.num_refiner_layers + 1 + 1 + 4 + per_block * CFG.num_layers + 2 + 4
    assert names[:3] == ["embed.video", "embed.audio", "embed.text"]
    assert names[3 : 3 + per_refiner] == [f"refiner.0.{n}" for n in REFINER_NODES] and "refiner.final_norm" in names
    assert names[names.index("block.0.adaln_projection") :][:per_block] == [f"block.0.{n}" for n in BLOCK_NODES]
    assert names.index("embed.pack") < names.index("time.sinusoid") < names.index("block.0.adaln_projection")
    assert names[-4:] == ["heads.video_proj", "heads.video_select", "heads.audio_proj", "heads.audio_select"]
    labels = [s.label for s in split_stages(graph)]
    assert labels == ["embed", "refiner.0", "refiner", "embed.pack", "time", "block.0", "block.1", "final", "heads"]
    assert graph.inputs == MODEL_INPUTS
    for node in graph.nodes:
        assert node.meta["rows"] in ("packed", "text", "video", "audio", "timestep"), node.name
        for op in node.ops:
            registry.spec(op)  # every op is a declared operator
        if node.name.startswith("block."):
            assert node.layer == int(node.name.split(".")[1])
        else:
            assert node.layer is None
    assert graph.node("block.1.norm1").inputs[0] == "block.0.residual_mlp"
    assert graph.node("block.0.norm1").inputs[0] == "embed.pack"
    assert graph.node("refiner.0.residual_attn").ops == ("residual_add",)


def test_streaming_run_equals_chained_run_and_frees_values(model):
    graph, inputs, params, _ = model
    with torch.no_grad():
        chained = run_chained(graph, inputs, params, provider_table())
        streamed = list(iter_graph(graph, inputs, params, provider_table()))
    assert [n.name for n, _ in streamed] == [n.name for n in graph.nodes]
    for node, value in streamed:
        assert torch.equal(value, chained[node.name]), node.name
    assert chained[OUTPUTS[0]].shape == (1, 128, CFG.video_patch_dim)
    assert chained[OUTPUTS[1]].shape == (1, 16, CFG.audio_in_channels)
    assert chained[OUTPUTS[0]].dtype == torch.float32 and chained["embed.pack"].dtype == torch.bfloat16
    # the generator keeps only live values: after block 1 starts, block 0's attention is gone
    gen = iter_graph(graph, inputs, params, provider_table())
    for node, _ in gen:
        if node.name == "block.1.norm1":
            live = gen.gi_frame.f_locals["values"]
            assert "block.0.attention" not in live and "block.0.residual_mlp" in live
            break
    gen.close()


def test_node_override_sees_values_and_keeps_what_it_reads(model):
    graph, inputs, params, _ = model
    seen = {}

    def fn(ops, values, p, node):
        seen["q"] = values["block.0.q_proj"].shape
        return node.fn(ops, {k: values[k] for k in node.inputs}, p) * 0

    override = {"block.0.residual_attn": NodeOverride(fn, reads=("block.0.q_proj",))}
    with torch.no_grad():
        out = dict((n.name, v) for n, v in iter_graph(graph, inputs, params, provider_table(), override))
    assert seen["q"] == (1, 264, CFG.inner_dim)
    assert not out["block.0.residual_attn"].any()


def test_metadata_and_params_errors_name_the_tensor(model):
    _, _, params, layout = model
    ts, ti = layout.row_timesteps(0.1, 0.2, 0.999, 1.0)
    raw = raw_metadata(layout, ts, ti)
    with pytest.raises(InputError, match="position_ids: must be"):
        derive_metadata(replace(raw, position_ids=raw.position_ids[:, :2]), CFG, "cpu")
    with pytest.raises(InputError, match="token_tags: must be"):
        derive_metadata(replace(raw, token_tags=raw.token_tags[:-1]), CFG, "cpu")
    meta = derive_metadata(raw, CFG, "cpu")
    assert torch.equal(meta["adaln_indices"], ti * 3 + layout.token_tags)
    assert meta["rope_cos"].dtype == torch.float32 and meta["rope_cos"].shape == (264, 6 * CFG.rope_freq_dim)

    class Wrong(SyntheticSource):
        def load(self, name, device="cpu", check_finite=False):
            t = super().load(name, device)
            return t.to(torch.bfloat16) if name == "proj_in.weight" else t

    with pytest.raises(InputError, match="proj_in.weight: .* bfloat16, expected .* float32"):
        load_model_params(Wrong(CFG, 0), CFG)
    view = PrefixParams(params, "transformer_blocks.1.")
    assert view["norm1.weight"] is params["transformer_blocks.1.norm1.weight"] and len(view) == 12
