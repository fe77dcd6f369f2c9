"""SGLang's own tensor parallelism (two gloo ranks, one process each) under the strict binding with ``merge="seg8"``:
SGLang's shards are h3gate's TP ownership, its column- and row-parallel layers run h3gate's TP layers over its TP
group, and both outputs of TP2 are byte-equal to TP1 under the same binding and to h3gate's own graph on the seg8
candidate table (the ws2-tiny config: heads and FFN channels on the segmented-8 boundaries). SGLang's Ulysses (two
gloo ranks) under the strict binding is the one-device binding byte for byte."""

from __future__ import annotations

import pytest

from h3gate.errors import InputError
from h3gate.graph.model import OUTPUTS, build_model_graph, load_model_params
from h3gate.manifests.model_config import load_config
from h3gate.synth import SyntheticSource
from tests.sglang.helpers import (
    MARKS,
    STRICT_SP,
    STRICT_TP,
    Tiny,
    batch_inputs,
    max_error,
    run_ranks,
    same_bytes,
    strict_graph,
)

pytestmark = MARKS


def test_tp2_on_gloo_is_bytewise_tp1_under_the_strict_seg8_binding(tiny, tmp_path):
    from safetensors.torch import load_file

    from h3gate.adapters.sglang.build import build_model
    from h3gate.adapters.sglang.inputs import packing, run_forward
    from h3gate.adapters.sglang.strict_bind import bind_strict

    out = tmp_path / "tp2.safetensors"
    run_ranks(
        tmp_path, f"from tests.sglang.helpers import strict_rank; strict_rank({{rank}}, 2, {{port}}, {str(out)!r})"
    )
    tp2 = load_file(str(out))
    assert int(tp2["tp"]) == 2 and bool(tp2["shards_match"]) and int(tp2["tp_layers"]) == 3

    config, layout_name, batch = STRICT_TP
    cfg = load_config(config).config
    source = SyntheticSource(cfg, 0)
    model = build_model(source)
    tensors, raw, layout = batch_inputs(layout_name, cfg, batch)
    with bind_strict(model, "strict", merge="seg8") as session:
        tp1 = run_forward(model, tensors, raw, packing(batch, layout.seq_len, raw.text_indices))
    assert {r.get("bound") for r in session.trace if r["op"] == "h3_attention_o_gemm"} == {"h3_attention_o_gemm_seg8"}
    graph = strict_graph(Tiny(cfg, source, load_model_params(source, cfg), build_model_graph(cfg), model), tensors,
                         "seg8")  # fmt: skip
    for name in OUTPUTS:
        assert same_bytes(tp2[name], tp1[name]), f"{name}: TP2 vs TP1 max |error| {max_error(tp2[name], tp1[name])}"
        assert same_bytes(tp1[name], graph[name]), f"{name}: TP1 vs h3gate's graph (seg8)"


def test_tp_needs_the_seg8_order_and_aligned_widths(tiny):
    """TPn under the single-walk order, or on widths whose segments do not fall on the ranks' heads (the tiny
    config's 2 heads at TP2), is refused before anything runs."""
    from h3gate.adapters.sglang.strict_bind import SglangSession, _check_tp
    from h3gate.adapters.sglang.strict_ops import TpPlan
    from h3gate.kernels.tp_layers import MergeGroup

    plan = TpPlan(2, 0, MergeGroup(2, 0, lambda t: [t, t]))
    ws2 = load_config("ws2-tiny").config
    with pytest.raises(InputError, match="TP2: merge order 'single' is not TP-invariant; bind with merge='seg8'"):
        _check_tp(SglangSession(tiny.model, "strict", "single", ws2, plan, {}))
    with pytest.raises(InputError, match="TP2 rank 0: .* do not fall on segment boundaries|QK-norm head groups"):
        _check_tp(SglangSession(tiny.model, "strict", "seg8", tiny.cfg, plan, {}))
    _check_tp(SglangSession(tiny.model, "strict", "seg8", ws2, plan, {}))  # aligned: accepted


def test_ulysses2_on_gloo_is_bytewise_one_device_under_the_strict_binding(tiny, tmp_path):
    """Ulysses inside SGLang: each rank holds S/2 packed rows; SGLang's all-to-all hands a rank every row of its
    heads, whose segments the bound attention walks whole. Every other operator is row-local, so Ulysses 2 is the
    one-device binding byte for byte (in the single-walk order: no reduction is split)."""
    from safetensors.torch import load_file

    from h3gate.adapters.sglang.inputs import packing, run_forward
    from h3gate.adapters.sglang.strict_bind import bind_strict

    out = tmp_path / "sp2.safetensors"
    run_ranks(tmp_path, f"from tests.sglang.helpers import strict_rank; "
                        f"strict_rank({{rank}}, 2, {{port}}, {str(out)!r}, 'ulysses')")  # fmt: skip
    sp2 = load_file(str(out))
    assert int(sp2["ulysses"]) == 2 and int(sp2["tp"]) == 1 and int(sp2["tp_layers"]) == 0
    _, layout_name, batch = STRICT_SP  # the tiny config, as the package fixture's model
    tensors, raw, layout = batch_inputs(layout_name, tiny.cfg, batch)
    with bind_strict(tiny.model):
        one = run_forward(tiny.model, tensors, raw, packing(batch, layout.seq_len, raw.text_indices, serving=False))
    graph = strict_graph(tiny, tensors)
    for name in OUTPUTS:
        assert same_bytes(sp2[name], one[name]), f"{name}: Ulysses 2 vs one device {max_error(sp2[name], one[name])}"
        assert same_bytes(one[name], graph[name])
