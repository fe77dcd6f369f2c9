"""The provider replay of block 0 against diffusers 0.42.1's ``MiniMaxH3TransformerBlock`` (the oracle), bit for bit.

Forward: the block output and all 17 node outputs (captured from the diffusers modules with hooks, and RoPE by
wrapping ``_apply_rotary_emb``). Backward: the gradients of the block input, temb, all 12 parameters and the gradient
reaching every node. CPU, tiny config, the ``tiny`` layout and a custom layout with both anchors and vision rows.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_minimax_h3 as dmod
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

from h3gate.gate.compare import bitwise_equal
from h3gate.graph.block import BLOCK_NODES, BLOCK_PARAMS, block_params, build_block_graph
from h3gate.graph.execute import run_chained
from h3gate.graph.executions import provider_table
from h3gate.graph.inputs import build_block_inputs, stand_in
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec, load_layout
from h3gate.manifests.model_config import load_config
from h3gate.ops.reference import adaln_table
from h3gate.synth import SyntheticSource

pytestmark = pytest.mark.parity

ANCHORED = LayoutSpec(
    text_tokens=21,
    latent_frames=2,
    latent_height=6,
    latent_width=8,
    audio_latents=5,
    anchors=["first", "last"],
    text_vision_rows=[(3, 7)],
)


def _layout(name: str):
    if name == "anchored":
        return build_layout(ANCHORED, "anchored")
    return build_layout(load_layout(name), name)


def _diffusers_block(cfg, params):
    blk = MiniMaxH3TransformerBlock(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.attention_head_dim,
        cfg.ffn_dim,
        cfg.time_embed_dim,
        cfg.norm_eps,
        cfg.qk_norm_eps,
    )
    blk = blk.to(torch.bfloat16).eval()
    blk.load_state_dict(params, strict=True)
    for name, p in blk.named_parameters():
        assert p.dtype == params[name].dtype, name
    return blk


def _capture(blk, monkeypatch) -> dict[str, torch.Tensor]:
    """Hook every diffusers tensor that corresponds to a node output; each one retains its gradient."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, t: torch.Tensor) -> None:
        assert name not in seen, f"{name} captured twice"
        if t.requires_grad:
            t.retain_grad()
        seen[name] = t

    def out_hook(name):
        return lambda mod, args, out: keep(name, out)

    def in_hook(name):
        return lambda mod, args: keep(name, args[0])

    attn, ff = blk.attn, blk.ff
    blk.adaln_proj.linear.register_forward_hook(out_hook("adaln_projection"))
    attn.register_forward_pre_hook(in_hook("norm1"))
    attn.to_q.register_forward_hook(out_hook("q_proj"))
    attn.to_k.register_forward_hook(out_hook("k_proj"))
    attn.to_v.register_forward_hook(out_hook("v_proj"))
    attn.norm_q.register_forward_hook(out_hook("q_norm"))
    attn.norm_k.register_forward_hook(out_hook("k_norm"))
    attn.to_out[0].register_forward_pre_hook(in_hook("attention"))
    attn.to_out[0].register_forward_hook(out_hook("o_proj"))
    blk.norm2.register_forward_pre_hook(in_hook("residual_attn"))
    ff.register_forward_pre_hook(in_hook("norm2"))
    ff.net[0].proj.register_forward_hook(out_hook("ffn_gate_up"))
    ff.net[0].register_forward_hook(out_hook("swiglu"))
    ff.net[2].register_forward_hook(out_hook("ffn_down"))
    blk.register_forward_hook(out_hook("residual_mlp"))

    original = dmod._apply_rotary_emb
    rope_names = iter(("rope_q", "rope_k"))

    def rope(hidden_states, cos, sin):
        out = original(hidden_states, cos, sin)
        keep(next(rope_names), out)
        return out

    monkeypatch.setattr(dmod, "_apply_rotary_emb", rope)
    return seen


@pytest.mark.parametrize("layout_name", ["tiny", "anchored"])
def test_provider_replay_is_bitwise_diffusers(layout_name, monkeypatch):
    cfg = load_config("tiny").config
    layout = _layout(layout_name)
    source = SyntheticSource(cfg, 3)
    params = block_params(source, 0)
    inputs = build_block_inputs(layout, cfg, source, 3, "cpu")
    x = inputs.tensors
    if layout_name == "anchored":  # conditioning rows get their own timestep: 3 distinct timesteps
        assert inputs.timestep.numel() == 3
    blk = _diffusers_block(cfg, params)
    with torch.no_grad():
        six = blk.adaln_proj(x["temb"])
    seen = _capture(blk, monkeypatch)

    # Batch of 2 (unrelated second item) so the replay is checked on a real batch axis too.
    hidden = torch.cat([x["hidden_states"], stand_in(3, "other", 1, layout.seq_len, cfg.hidden_size, "cpu")])
    cot = torch.cat([stand_in(3, "cot", i, layout.seq_len, cfg.hidden_size, "cpu") for i in range(2)])

    d_hidden = hidden.clone().requires_grad_(True)
    d_temb = x["temb"].clone().requires_grad_(True)
    d_out = blk(d_hidden, d_temb, x["adaln_indices"], (x["rope_cos"], x["rope_sin"]))
    assert set(seen) == set(BLOCK_NODES)
    d_out.backward(cot)

    r_hidden = hidden.clone().requires_grad_(True)
    r_temb = x["temb"].clone().requires_grad_(True)
    r_params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    graph = build_block_graph(cfg)
    values = run_chained(graph, {**x, "hidden_states": r_hidden, "temb": r_temb}, r_params, provider_table())
    for name in BLOCK_NODES:
        values[name].retain_grad()
    values["residual_mlp"].backward(cot)

    for name in BLOCK_NODES:
        assert bitwise_equal(values[name], seen[name]), f"forward {name}"
        assert bitwise_equal(values[name].grad, seen[name].grad), f"gradient reaching {name}"
    for mine, theirs in zip(adaln_table(values["adaln_projection"], cfg.hidden_size), six, strict=True):
        assert bitwise_equal(mine, theirs)
    assert bitwise_equal(r_hidden.grad, d_hidden.grad)
    assert bitwise_equal(r_temb.grad, d_temb.grad)
    named = dict(blk.named_parameters())
    assert set(named) == set(BLOCK_PARAMS)
    for name in BLOCK_PARAMS:
        assert bitwise_equal(r_params[name].grad, named[name].grad), f"gradient of {name}"
    # The check can fail: the replay is not trivially equal to anything (a one-ulp change is caught).
    nudged = values["residual_mlp"].detach().clone()
    nudged.view(torch.int16)[0, 0, 0] += 1
    assert not bitwise_equal(nudged, d_out)
