"""The 17-node block graph: structure, ownership, parameters, inputs and the three executions' tables."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.graph.block import BLOCK_NODES, BLOCK_PARAMS, GRAPH_INPUTS, block_params, build_block_graph
from h3gate.graph.core import to_float64
from h3gate.graph.execute import run_chained, run_node
from h3gate.graph.executions import bind_graph, candidate_table, provider_table
from h3gate.graph.inputs import TimestepPlan, build_block_inputs
from h3gate.inventory import block_tensor_names
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry
from h3gate.synth import SyntheticSource

SMALL = LayoutSpec(text_tokens=9, latent_frames=2, latent_height=4, latent_width=6, audio_latents=3, anchors=["first"])


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny").config
    source = SyntheticSource(cfg, 0)
    layout = build_layout(SMALL, "small-test")
    return cfg, source, layout, block_params(source, 0), build_block_inputs(layout, cfg, source, 0, "cpu")


def test_graph_has_the_17_nodes_in_issue_order():
    graph = build_block_graph(load_config("tiny").config)
    assert [n.name for n in graph.nodes] == list(BLOCK_NODES)
    assert len(graph.nodes) == 17
    assert graph.inputs == GRAPH_INPUTS
    assert graph.output == "residual_mlp"
    assert {n.layer for n in graph.nodes} == {0}


def test_every_node_declares_owner_ops_dtypes_and_casts():
    graph = build_block_graph(load_config("tiny").config)
    for node in graph.nodes:
        for op in node.ops:
            registry.spec(op)  # declared in manifests/operators/
        # The owning row is the RFC row of the node's last (arithmetic-bearing) operator.
        assert node.owner_row == registry.spec(node.ops[-1]).rfc_row, node.name
        assert {"dtype", "casts", "maths"} <= set(node.meta), node.name
        assert all(node.meta[k] for k in ("dtype", "casts", "maths"))
    assert graph.node("adaln_projection").ops == ("adaln_silu_cast", "adaln_projection_3mod")
    assert graph.node("adaln_projection").row_dim is None
    assert graph.node("norm1").inputs == ("hidden_states", "adaln_projection", "adaln_indices")
    assert graph.node("residual_mlp").inputs == ("residual_attn", "ffn_down", "adaln_projection", "adaln_indices")


def test_block_params_are_the_inventory_block_tensors(tiny):
    cfg, source, *_ = tiny
    params = block_params(source, 0)
    prefix = "transformer_blocks.0."
    assert sorted(prefix + k for k in params) == sorted(block_tensor_names(cfg, 0))
    assert tuple(params) == BLOCK_PARAMS and len(params) == 12
    assert all(t.dtype == torch.bfloat16 for t in params.values())


class _Without:
    """A weight source with one tensor removed, or one tensor replaced."""

    def __init__(self, source, drop=None, replace=None):
        self.source, self.drop, self.replace = source, drop, replace or {}

    def names(self):
        return [n for n in self.source.names() if n != self.drop]

    def load(self, name, device="cpu", check_finite=False):
        return self.replace[name] if name in self.replace else self.source.load(name, device)

    def config(self):
        return self.source.config()


def test_block_params_missing_or_misshapen_tensor_is_an_input_error(tiny):
    cfg, source, *_ = tiny
    with pytest.raises(InputError, match=r"transformer_blocks\.0\.attn\.to_k\.weight: missing"):
        block_params(_Without(source, drop="transformer_blocks.0.attn.to_k.weight"), 0)
    bad = {"transformer_blocks.0.norm2.weight": torch.ones(7, dtype=torch.bfloat16)}
    with pytest.raises(InputError, match=r"transformer_blocks\.0\.norm2\.weight: \(7,\) bfloat16, expected \(192,\)"):
        block_params(_Without(source, replace=bad), 0)
    with pytest.raises(InputError, match="block 5: outside"):
        block_params(source, 5)


def test_inputs_follow_the_layout_schedule_and_time_embedder(tiny):
    cfg, source, layout, _, inputs = tiny
    x = inputs.tensors
    assert x["hidden_states"].shape == (1, layout.seq_len, cfg.hidden_size)
    assert x["hidden_states"].dtype == torch.bfloat16
    assert x["temb"].dtype == torch.float32 and x["temb"].shape == (inputs.timestep.numel(), cfg.time_embed_dim)
    assert x["rope_cos"].shape == (layout.seq_len, 6 * cfg.rope_freq_dim)
    # anchor rows sit at their noise-augmentation level: three distinct timesteps, conditioning rows at >= 0.999
    plan = inputs.plan
    assert inputs.timestep.numel() == 3
    assert plan["cond_video_t"] == max(plan["video_t"], 0.999) and plan["cond_audio_t"] == 1.0
    assert torch.equal(x["adaln_indices"], inputs.timestep_indices * 3 + layout.token_tags)
    cond_rows = layout.video_indices[: layout.num_condition_video_rows]
    assert torch.all(inputs.timestep[inputs.timestep_indices[cond_rows]] >= 0.999)
    # the same seed gives the same stand-in; another seed another
    again = build_block_inputs(layout, cfg, source, 0, "cpu").tensors["hidden_states"]
    other = build_block_inputs(layout, cfg, source, 1, "cpu").tensors["hidden_states"]
    assert torch.equal(again, x["hidden_states"]) and not torch.equal(other, x["hidden_states"])
    with pytest.raises(InputError, match="step 99"):
        TimestepPlan(step=99).resolve()


def test_golden_runs_in_float64_and_isolated_on_provider_feed_is_provider(tiny):
    cfg, _, _, params, inputs = tiny
    graph = build_block_graph(cfg)
    prov = run_chained(graph, inputs.tensors, params, provider_table())
    gold = run_chained(graph, to_float64(inputs.tensors), to_float64(params), provider_table())
    for name in BLOCK_NODES:
        assert prov[name].dtype == torch.bfloat16, name
        assert gold[name].dtype == torch.float64, name
        assert gold[name].shape == prov[name].shape
    rel = (gold["residual_mlp"] - prov["residual_mlp"].double()).norm() / gold["residual_mlp"].norm()
    assert 0 < float(rel) < 0.05
    iso = {node.name: run_node(node, provider_table(), prov, params) for node in graph.nodes}
    assert all(torch.equal(iso[n], prov[n]) for n in BLOCK_NODES)


def test_bindings_record_requested_actual_and_label(tiny):
    cfg, *_ = tiny
    graph = build_block_graph(cfg)
    off = bind_graph(graph, "off", "cpu")
    assert all(nb.actual == "provider" and nb.label == "reference" and not nb.fallback for nb in off.values())
    assert all(nb.requested == "provider" for nb in off.values())
    audit = bind_graph(graph, "audit", "cpu")
    for name, nb in audit.items():
        rec = nb.record()
        assert [o["op"] for o in rec["ops"]] == list(graph.node(name).ops)
        if nb.actual == "provider":  # a reference is never called a strict kernel
            assert nb.label == "reference" and nb.kernel_id.startswith("provider:")
        else:
            assert all(b.actual == "triton" for b in nb.bindings) and nb.label in ("row", "interim")
    table = candidate_table(audit)
    with pytest.raises(InputError, match="not bound"):
        table["h3_rmsnorm"]
    with pytest.raises(InputError, match="--mode 'bogus'"):
        bind_graph(graph, "bogus", "cpu")
