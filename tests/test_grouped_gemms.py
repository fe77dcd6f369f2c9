"""Sibling GEMMs (q, k, v) as one grouped call: which nodes the executor groups, that the grouped outputs land on
their own nodes bitwise (and a wrong one is seen there), and when the strict GEMM's grouped launch applies.

The grouped Gluon launch itself runs on the H200 only (``tools/gpu_gemm_gluon.py --sections grouped``,
``docs/measurements/perf-probe-36.json``) and in the strict gates there; its sm_90 lowering is compiled in
``tests/triton_kernels/test_sm90_compile.py``."""

from __future__ import annotations

import json

import pytest
import torch

from h3gate.graph.block import block_params, build_block_graph
from h3gate.graph.body_nodes import Gemm
from h3gate.graph.execute import iter_graph, run_chained, sibling_gemms
from h3gate.graph.executions import bind_graph, candidate_table, provider_table
from h3gate.graph.inputs import build_block_inputs
from h3gate.graph.model import build_model_graph
from h3gate.kernels import gemm, gemm_configs, gemm_gluon, launches, selection
from h3gate.kernels.gemm import linear_grouped
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry
from h3gate.synth import SyntheticSource

QKV = ("q_proj", "k_proj", "v_proj")
LAYOUT = LayoutSpec(text_tokens=5, latent_frames=2, latent_height=2, latent_width=4, audio_latents=3, anchors=["first"])


@pytest.fixture(scope="module")
def block():
    cfg = load_config("tiny").config
    source = SyntheticSource(cfg, 0)
    inputs = build_block_inputs(build_layout(LAYOUT, "grouped-test"), cfg, source, 0, "cpu")
    return build_block_graph(cfg), block_params(source, 0), inputs.tensors


def _grouping_table(calls: list, fault: bool = False):
    """The provider's table whose qkv GEMM offers ``grouped`` (the references one by one, calls counted; ``fault``:
    the second output's first row perturbed)."""
    ref = registry.reference("h3_qkv_gemm")

    def qkv(x, w, b=None):
        return ref(x, w, b)

    def grouped(x, weights):
        calls.append(len(weights))
        launches.note("h3_qkv_gemm", lambda: {"interpreted": True, "grouped": f"{len(weights)} weights"})
        outs = [ref(x, w) for w in weights]
        if fault:
            outs[1] = outs[1].clone()
            outs[1][0, 0, 0] += 1.0
        return outs

    qkv.grouped = grouped
    return provider_table({"h3_qkv_gemm": qkv})


def _index(graph, name: str) -> int:
    return [n.name for n in graph.nodes].index(name)


def test_q_k_v_are_siblings_where_the_operator_groups_and_nothing_is_overridden(block) -> None:
    graph, _, _ = block
    k = _index(graph, "q_proj")
    table = _grouping_table([])
    assert [n.name for n in sibling_gemms(graph.nodes, k, table, {})] == list(QKV)
    assert sibling_gemms(graph.nodes, k, provider_table(), {}) == ()  # the provider's reference has no grouped call
    assert sibling_gemms(graph.nodes, _index(graph, "o_proj"), table, {}) == ()  # a Gemm of another operator, alone
    assert sibling_gemms(graph.nodes, k, table, {"k_proj": lambda *a: None}) == ()  # a fault on k: q alone, not grouped
    after_q = sibling_gemms(graph.nodes, k + 1, table, {"q_proj": lambda *a: None})
    assert [n.name for n in after_q] == ["k_proj", "v_proj"]


def test_the_model_graph_keeps_each_blocks_q_k_v_as_siblings_on_global_names() -> None:
    cfg = load_config("tiny").config
    graph = build_model_graph(cfg, layers=(0, 2))
    table = _grouping_table([])
    firsts = [i for i, n in enumerate(graph.nodes) if n.name.endswith(".q_proj") and n.layer is not None]
    assert len(firsts) == 2
    for k in firsts:
        group = sibling_gemms(graph.nodes, k, table, {})
        assert len(group) == 3 and all(isinstance(n.fn, Gemm) for n in group)
        layer = group[0].layer
        assert group[2].fn.weight == f"transformer_blocks.{layer}.attn.to_v.weight"
        assert group[0].fn.source == group[0].inputs[0]


def test_grouped_outputs_are_bitwise_the_node_by_node_run_and_logged_on_each_node(block) -> None:
    graph, params, inputs = block
    calls: list[int] = []
    plain = run_chained(graph, inputs, params, provider_table())
    with launches.recording() as log:
        chained = run_chained(graph, inputs, params, _grouping_table(calls))
    streamed = {node.name: out for node, out in iter_graph(graph, inputs, params, _grouping_table(calls))}
    assert calls == [3, 3]  # one grouped call a pass, for all three nodes
    for name in plain:
        assert torch.equal(chained[name], plain[name]), name
    for name in streamed:
        assert torch.equal(streamed[name], plain[name]), name
    assert all(log[name]["h3_qkv_gemm"] == [{"interpreted": True, "grouped": "3 weights"}] for name in QKV)


def test_a_wrong_grouped_output_reaches_its_own_node(block) -> None:
    """Negative control: the executor does not recompute or drop what the grouped call returned, so a gate
    comparing k_proj sees a fault the grouped launch made there, and nothing upstream of it."""
    graph, params, inputs = block
    plain = run_chained(graph, inputs, params, provider_table())
    bad = run_chained(graph, inputs, params, _grouping_table([], fault=True))
    assert torch.equal(bad["q_proj"], plain["q_proj"]) and torch.equal(bad["v_proj"], plain["v_proj"])
    assert not torch.equal(bad["k_proj"], plain["k_proj"])


def test_the_strict_qkv_operator_offers_grouped_calls_bitwise_one_by_one(block) -> None:
    graph, params, inputs = block
    table = candidate_table(bind_graph(graph, "strict", "cpu"))
    assert callable(table["h3_qkv_gemm"].grouped)
    assert getattr(table["h3_attention_o_gemm"], "grouped", None) is None
    x = run_chained(graph, inputs, params, provider_table())["norm1"]
    ws = [params[f"attn.to_{c}.weight"] for c in "qkv"]
    outs = linear_grouped(x, ws, op="h3_qkv_gemm")
    assert all(torch.equal(o, gemm.linear(x, w)) for o, w in zip(outs, ws, strict=True))


def test_grouped_plan_covers_q_k_v_where_the_manifest_declares_it(monkeypatch) -> None:
    """The qkv layer declares ``gluon_grouped`` on a Hopper GPU for 1024 <= M < 8192 (manifests/operators/gemm.yaml:
    measured 1.012x cuBLAS three times at M = 3160 against 0.939x one launch a weight; not at 925 or 38974). The rest
    runs one call a weight: another layer, other shapes or dtypes, one or four weights, another device class."""
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")  # as on the H200
    meta = {"device": "meta", "dtype": torch.bfloat16}
    w3 = tuple(torch.empty(7168, 5376, **meta) for _ in range(3))
    at = {m: gemm.grouped_plan(torch.empty(1, m, 5376, **meta), w3) for m in (925, 1024, 3160, 8191, 8192)}
    assert at == {925: None, 1024: gemm_configs.GLUON_GROUPED, 3160: gemm_configs.GLUON_GROUPED,
                  8191: gemm_configs.GLUON_GROUPED, 8192: None}  # fmt: skip
    x = torch.empty(3160, 5376, **meta)
    assert gemm.grouped_plan(x, w3[:2]) is gemm_configs.GLUON_GROUPED
    assert gemm.grouped_plan(x, w3[:1]) is None and gemm.grouped_plan(x, w3 + w3[:1]) is None
    o = tuple(torch.empty(5376, 5376, **meta) for _ in range(3))
    assert gemm.grouped_plan(x, o) is None  # no grouped rule for that layer
    assert gemm.grouped_plan(x, (w3[0], torch.empty(7168, 5376, device="meta"))) is None  # dtypes differ
    # qkv alone at 3160 runs the Triton tiling (its declared forward path there); the grouped launch is Gluon's
    assert gemm.forward_plan(x, w3[0])[0] == "triton"
    for other in ("cuda-other", "cpu-interpreter"):  # no Gluon there
        monkeypatch.setattr(selection, "device_class", lambda device, other=other: other)
        assert gemm.grouped_plan(x, w3) is None


def test_the_grouped_launch_refuses_what_it_cannot_group() -> None:
    wide, swapped = gemm_configs._GLUON_WIDE, gemm_configs._GLUON_SWAP8
    assert gemm_gluon.groupable(wide, 7168, 3) and gemm_gluon.groupable(wide, 7168, 2)
    assert not gemm_gluon.groupable(wide, 7168, 4) and not gemm_gluon.groupable(wide, 7000, 3)  # a straddling tile
    assert not gemm_gluon.groupable(swapped, 7168, 3)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    x, w = torch.empty(300, 256, **meta), torch.empty(512, 256, **meta)
    with pytest.raises(ValueError, match="matmul_ws_grouped"):
        gemm_gluon.matmul_ws_grouped(x, (w, torch.empty(256, 256, **meta)), (x, x), wide, 132)
    with pytest.raises(ValueError, match="matmul_ws_grouped"):
        gemm_gluon.matmul_ws_grouped(x, (w, w), (x,), wide, 132)


def test_launches_noted_for_a_group_belong_to_every_node_in_it() -> None:
    with launches.recording() as log, launches.node("a", "b"):
        launches.note("op", lambda: {"interpreted": True})
    assert log == {"a": {"op": [{"interpreted": True}]}, "b": {"op": [{"interpreted": True}]}}


def test_the_benches_time_q_k_v_one_by_one_beside_grouped_in_the_forward_only(block, tmp_path) -> None:
    """``strict_one_by_one``: the strict table with the qkv GEMM's grouped call hidden (the same bytes, one launch a
    weight), an arm of the forward phase only, its ratio to strict recorded and valid in both bench schemas."""
    from h3gate.bench.block import ONE_BY_ONE, phase_tables, ratios
    from h3gate.bench.model import KIND
    from h3gate.evidence.schema import validate_document
    from h3gate.evidence.writer import write_evidence

    graph, params, inputs = block
    tables = {"provider": provider_table(), "strict": candidate_table(bind_graph(graph, "strict", "cpu"))}
    forward = phase_tables(tables, graph, "forward")
    assert (
        list(forward) == ["provider", "strict", ONE_BY_ONE]
        and phase_tables(tables, graph, "forward_backward") is tables
    )
    alone = forward[ONE_BY_ONE]
    assert (
        getattr(alone["h3_qkv_gemm"], "grouped", None) is None and alone["h3_swiglu"] is tables["strict"]["h3_swiglu"]
    )
    assert sibling_gemms(graph.nodes, _index(graph, "q_proj"), alone, {}) == ()
    plain, grouped = (run_chained(graph, inputs, params, t) for t in (alone, tables["strict"]))
    assert all(torch.equal(plain[n], grouped[n]) for n in plain)
    no_group = {"provider": provider_table(), "strict": provider_table()}  # nothing groups: no arm to add
    assert ONE_BY_ONE not in phase_tables(no_group, graph, "forward")
    timing = {"median_ms": 2.0, "min_ms": 1.9, "max_ms": 2.2, "iters": 3}
    stats = {"provider": timing, "strict": timing, ONE_BY_ONE: {**timing, "median_ms": 2.2}}
    assert ratios(stats) == {"strict_over_provider": 1.0, "strict_one_by_one_over_strict": pytest.approx(1.1)}
    from tests.test_bench_model import _body

    body = _body()
    body["results"]["forward"] = {**body["results"]["forward"], **stats, **ratios(stats)}
    body["results"]["forward"]["max_memory_allocated_bytes"] = {"provider": 1, "strict": 1, ONE_BY_ONE: 1}
    validate_document(json.loads(write_evidence(tmp_path, f"{KIND}.json", KIND, body).read_text(encoding="utf-8")))
