"""The canonical row order as a value of the graphs (RFC numerical rule 7, H-C3): derived from the index tensors, fed
to every transformer block's attention, identity where the packing is canonical; at block scope the strict path is
byte-equal under a consistent permutation of the packed rows, forward and backward, and drifts when the order is
wrong."""

from __future__ import annotations

import pytest
import torch

from h3gate.ablate.probes import permuted_layout
from h3gate.graph.block import BLOCK_NODES, GRAPH_INPUTS, block_params, build_block_graph
from h3gate.graph.execute import run_backward, run_chained
from h3gate.graph.executions import bind_graph, candidate_table, provider_table
from h3gate.graph.inputs import build_block_inputs
from h3gate.graph.model import METADATA, build_model_graph, derive_metadata, raw_metadata
from h3gate.layout import build_layout, canonical_order
from h3gate.manifests.layouts import LayoutSpec, load_layout
from h3gate.manifests.model_config import load_config
from h3gate.synth import SyntheticSource

CFG = load_config("tiny").config
ANCHORED = LayoutSpec(
    text_tokens=9, latent_frames=2, latent_height=4, latent_width=6, audio_latents=3, anchors=["first"]
)
TWO_BLOCKS = LayoutSpec(
    text_tokens=24, latent_frames=2, latent_height=12, latent_width=12, audio_latents=6, anchors=["first"]
)
LEAVES = ("hidden_states", "temb")


def _perm(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def test_the_rule_is_identity_on_canonical_t2va_and_follows_a_permutation() -> None:
    tiny = build_layout(load_layout("tiny"), "tiny")  # [text | audio | video], no keyframe
    assert torch.equal(tiny.canonical_order(), torch.arange(tiny.seq_len))
    anchored = build_layout(ANCHORED, "anchored")  # [text | keyframe | audio | video]: the keyframe rows move
    order = anchored.canonical_order()
    want = torch.cat([anchored.text_indices, anchored.audio_indices, anchored.video_indices])
    assert torch.equal(order, want) and not torch.equal(order, torch.arange(anchored.seq_len))
    assert torch.equal(canonical_order(anchored.text_indices, anchored.video_indices, anchored.audio_indices), want)
    perm = _perm(anchored.seq_len)
    permuted = permuted_layout(anchored, perm)
    assert torch.equal(perm[permuted.canonical_order()], order)  # the same logical rows, at their new packed rows
    ts, ti = permuted.row_timesteps(0.5, 0.5, 0.999, 1.0)
    meta = derive_metadata(raw_metadata(permuted, ts, ti), CFG, "cpu")
    assert torch.equal(meta["attention_order"], permuted.canonical_order()) and "attention_order" in METADATA


def test_every_transformer_block_attention_reads_the_order_and_the_refiner_none() -> None:
    graph = build_model_graph(CFG)
    assert "attention_order" in graph.inputs and "attention_order" in GRAPH_INPUTS
    for i in range(CFG.num_layers):
        assert graph.node(f"block.{i}.attention").inputs[-1] == "attention_order"
    assert "attention_order" not in graph.node("refiner.0.attention").inputs
    readers = {n.name for n in graph.nodes if "attention_order" in n.inputs}
    assert readers == {f"block.{i}.attention" for i in range(CFG.num_layers)}


@pytest.fixture(scope="module")
def block():
    source = SyntheticSource(CFG, 0)
    # S = 144: two KV blocks of the bf16 walk (128 keys since kernel id v2; micro's 84 rows fit in one), a keyframe
    layout = build_layout(TWO_BLOCKS, "two-blocks")
    perm = _perm(layout.seq_len)
    canonical = build_block_inputs(layout, CFG, source, 0, "cpu").tensors
    permuted = build_block_inputs(permuted_layout(layout, perm), CFG, source, 0, "cpu").tensors
    permuted["hidden_states"] = canonical["hidden_states"][:, perm]  # the stand-in rows follow their packing
    for key in ("adaln_indices", "rope_cos", "rope_sin"):
        assert torch.equal(permuted[key], canonical[key][perm]), key
    assert torch.equal(permuted["temb"], canonical["temb"])
    graph = build_block_graph(CFG)
    ops = candidate_table(bind_graph(graph, "strict", "cpu"))
    return graph, block_params(source, 0), canonical, permuted, perm, ops


def _backward(graph, params, inputs, ops, cotangent):
    x = {k: (v.detach().requires_grad_() if k in LEAVES else v) for k, v in inputs.items()}
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    values = run_backward(graph, x, p, ops, cotangent, retain_node_grads=True)
    return values, x, p


@pytest.mark.slow  # 10 s on two idle cores: make test-slow; the attention's own permutation tests stay in make test
def test_block_strict_path_is_byte_equal_under_a_consistent_permutation(block) -> None:
    """Every row-resolved node value and node gradient and the hidden-state gradient are byte-equal after the
    inverse permutation. Gradients that sum over packed rows (every dW, the AdaLN tables into temb) sum in packed
    order, so a permutation reorders their sums: close, and not claimed bitwise here."""
    graph, params, canonical, permuted, perm, ops = block
    inv = torch.argsort(perm)
    cot = torch.randn(canonical["hidden_states"].shape, generator=torch.Generator().manual_seed(7))
    a, xa, pa = _backward(graph, params, canonical, ops, cot)
    b, xb, pb = _backward(graph, params, permuted, ops, cot[:, perm])
    for name in BLOCK_NODES:
        if graph.node(name).row_dim is None:
            continue
        assert torch.equal(b[name][:, inv], a[name]), name
        assert torch.equal(b[name].grad[:, inv], a[name].grad), f"{name}.grad"
    assert torch.equal(xb["hidden_states"].grad[:, inv], xa["hidden_states"].grad)
    for key in ("temb", *params):
        ga, gb = (xa[key].grad, xb[key].grad) if key == "temb" else (pa[key].grad, pb[key].grad)
        torch.testing.assert_close(gb.float(), ga.float(), rtol=0.05, atol=1e-2, msg=key)


def test_block_negative_control_identity_order_on_the_permuted_rows_drifts(block) -> None:
    graph, params, canonical, permuted, perm, ops = block
    strict = ops["h3_full_attention"]
    packed = ops.with_overrides(
        {"h3_full_attention": lambda q, k, v, order=None: strict(q, k, v, order=torch.arange(q.shape[1]))}
    )
    inv = torch.argsort(perm)
    with torch.no_grad():
        right = run_chained(graph, canonical, params, ops)
        wrong = run_chained(graph, permuted, params, packed)
    assert torch.equal(wrong["rope_k"][:, inv], right["rope_k"])  # everything before attention still agrees
    assert not torch.equal(wrong["attention"][:, inv], right["attention"])


def test_provider_block_ignores_the_order(block) -> None:
    """The provider replay (diffusers op for op) is unchanged by the order: it attends in packed order."""
    graph, params, canonical, *_ = block
    with torch.no_grad():
        plain = run_chained(graph, canonical, params, provider_table())
        flipped = run_chained(
            graph,
            {**canonical, "attention_order": _perm(canonical["attention_order"].shape[0], 9)},
            params,
            provider_table(),
        )
    assert all(torch.equal(plain[n], flipped[n]) for n in BLOCK_NODES)
    assert canonical["attention_order"].shape == (144,)
