"""SGLang's MiniMax-H3 DiT on h3gate's weights and inputs: loaded as the checkpoint stores it, its outputs bitwise
h3gate's provider replay (diffusers 0.42.1 op for op) on one request, several packed requests and padding, and the
record of what it ran."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.graph.model import OUTPUTS
from tests.sglang.helpers import MARKS, batch_inputs, max_error, provider, run_ranks, same_bytes

pytestmark = MARKS


def test_weights_are_the_checkpoints_in_its_dtypes(tiny):
    from sglang.multimodal_gen.runtime.models.dits.minimax_h3 import MINIMAX_H3_FP32_PARAM_NAMES

    from h3gate.adapters.sglang.build import rope_inv_freq

    state = tiny.model.state_dict()
    fp32 = {n for n, t in state.items() if t.dtype == torch.float32}
    assert fp32 == set(MINIMAX_H3_FP32_PARAM_NAMES) | {"rope.inv_freq"}
    assert all(t.dtype == torch.bfloat16 for n, t in state.items() if n not in fp32)
    p = tiny.params
    qkv = torch.cat([p[f"transformer_blocks.1.attn.to_{w}.weight"] for w in "qkv"])
    assert torch.equal(state["blocks.1.attn.qkv_proj.weight"], qkv)
    value, gate = p["token_refiner.refiner_blocks.0.ff.net.0.proj.weight"].chunk(2)
    assert torch.equal(state["token_refiner.blocks.0.mlp.fc1.weight"], torch.cat([gate, value]))
    assert torch.equal(state["final_layer.video_out.weight"], p["proj_out.weight"])
    assert torch.equal(state["rope.inv_freq"], rope_inv_freq(tiny.cfg))


def test_a_checkpoint_folder_loads_the_same_model(tiny, tiny_checkpoint, tmp_path):
    from h3gate.adapters.sglang.build import build_model

    folder = tiny_checkpoint(tmp_path, "ckpt", 0)
    state = build_model(folder).state_dict()
    ours = tiny.model.state_dict()
    assert state.keys() == ours.keys()
    assert all(same_bytes(state[k], ours[k]) for k in state)


@pytest.mark.parametrize(
    ("layout", "batch", "serving", "align"),
    [("micro", 1, False, 1), ("micro", 1, True, 64), ("micro", 3, True, 64), ("tiny", 2, True, 64)],
)
def test_outputs_bitwise_the_provider_replay(tiny, layout, batch, serving, align):
    from h3gate.adapters.sglang.inputs import packing, run_forward

    tensors, raw, built = batch_inputs(layout, tiny.cfg, batch)
    pack = packing(batch, built.seq_len, raw.text_indices, align=align, serving=serving)
    assert pack.total % align == 0 and pack.cu_seqlens[-2] == batch * built.seq_len
    ours = provider(tiny, tensors)
    theirs = run_forward(tiny.model, tensors, raw, pack)
    for name in OUTPUTS:
        assert theirs[name].dtype == torch.float32
        assert same_bytes(theirs[name], ours[name]), f"{name}: max |error| {max_error(theirs[name], ours[name])}"


def test_update_mask_zeroes_the_condition_rows(tiny):
    from h3gate.adapters.sglang.inputs import packing, run_forward

    tensors, raw, layout = batch_inputs("micro", tiny.cfg, 2)
    n = layout.num_condition_video_rows
    assert n > 0
    pack = packing(2, layout.seq_len, raw.text_indices, mask_condition=True, condition_rows=n)
    video = run_forward(tiny.model, tensors, raw, pack)["heads.video_select"]
    ours = provider(tiny, tensors)["heads.video_select"]
    assert bool((video[:, :n] == 0).all()) and not bool((ours[:, :n] == 0).all())
    assert same_bytes(video[:, n:], ours[:, n:])


def test_the_runtime_record_says_what_ran(tiny):
    from h3gate.adapters.sglang.inputs import packing, run_forward
    from h3gate.adapters.sglang.runtime import SGLANG_VERSION, runtime_record, set_quality

    tensors, raw, layout = batch_inputs("micro", tiny.cfg, 1)
    pack = packing(1, layout.seq_len, raw.text_indices)
    ours = provider(tiny, tensors)
    try:
        assert set_quality(tiny.model, "lossless")  # SGLang's default request quality mounts the fused site
        theirs = run_forward(tiny.model, tensors, raw, pack)
        record = runtime_record(tiny.model, "lossless")
    finally:
        assert not set_quality(tiny.model, "exact")
    assert record["versions"]["sglang"] == SGLANG_VERSION
    assert record["distributed_backend"] == "gloo" and record["degrees"] == {"tp": 1, "ulysses": 1, "ring": 1}
    assert record["attention_backend"] == {"requested": None, "resolved": "torch_sdpa"}
    fused = record["fused_paths"]
    assert fused["rmsnorm_adaln_site_mounted"] and not fused["rmsnorm_adaln_site_runs"]  # its guards want CUDA
    assert not any(
        v for k, v in fused.items() if k not in ("qkv_single_gemm", "fc1_single_gemm", "rmsnorm_adaln_site_mounted")
    )
    assert all(same_bytes(theirs[k], ours[k]) for k in OUTPUTS)  # so the CPU forward stays the reference chain


def test_runtime_refuses_other_degrees_and_qualities(tiny):
    from h3gate.adapters.sglang.runtime import init_runtime, set_quality

    assert init_runtime(hidden_size=tiny.cfg.hidden_size).tp == 1  # idempotent
    with pytest.raises(InputError, match="tp 1, sp 1 in this process, not 2/1"):
        init_runtime(tp=2)
    with pytest.raises(InputError, match="must be one of exact, lossless, high"):
        set_quality(tiny.model, "fast")


def test_tp2_on_gloo_runs_sglangs_row_parallel_sums(tiny, tmp_path):
    """SGLang's own TP (no h3gate binding): two processes on gloo. Its row-parallel layers all-reduce BF16 partial
    products, so TP2 is TP1 up to rounding, not byte for byte (under the strict binding it is:
    test_sglang_strict_tp.py)."""
    from safetensors.torch import load_file

    from h3gate.adapters.sglang.inputs import packing, run_forward

    out = tmp_path / "tp2.safetensors"
    run_ranks(tmp_path, f"from tests.sglang.helpers import tp_rank; tp_rank({{rank}}, 2, {{port}}, {str(out)!r})")
    tp2 = load_file(str(out))
    tensors, raw, layout = batch_inputs("micro", tiny.cfg, 1)
    tp1 = run_forward(tiny.model, tensors, raw, packing(1, layout.seq_len, raw.text_indices))
    assert int(tp2["tp"]) == 2
    for name in OUTPUTS:
        assert tp2[name].shape == tp1[name].shape and torch.isfinite(tp2[name]).all()
        assert max_error(tp2[name], tp1[name]) < 0.05  # a few BF16 ulps of O(1) values through two blocks
