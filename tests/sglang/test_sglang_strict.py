"""h3gate's strict operators bound into SGLang's DiT (``bind_strict``): SGLang + strict kernels is byte-equal to
h3gate's own graph on the strict candidate table at every captured node and at both outputs (one request on the
direct path; three packed with padding on the serving path), the trace names every operator call with its kernel,
a deliberately perturbed row in one node is the first drift, at that node, and on exit the module is SGLang's
again."""

from __future__ import annotations

import pytest
import torch

from h3gate.graph.model import OUTPUTS
from tests.sglang.helpers import MARKS, batch_inputs, max_error, provider, same_bytes, strict_graph

pytestmark = MARKS
SELECT = {"heads.video_select", "heads.audio_select"}  # SGLang's own row selection (a copy), not an h3gate call


def _bound_capture(tiny, batch: int, serving: bool, merge: str = "single", faults=None):
    from h3gate.adapters.sglang.capture import capture_forward
    from h3gate.adapters.sglang.inputs import packing
    from h3gate.adapters.sglang.strict_bind import bind_strict

    tensors, raw, layout = batch_inputs("micro", tiny.cfg, batch)
    pack = packing(batch, layout.seq_len, raw.text_indices, serving=serving)
    with bind_strict(tiny.model, "strict", merge=merge) as session:
        session.faults.update(faults or {})
        cap = capture_forward(tiny.model, tiny.cfg, tensors, raw, pack, tiny.graph)
    return cap, session, tensors, layout, pack


@pytest.fixture(scope="module")
def graph_values(tiny):
    """h3gate's strict graph per request count and merge order (computed once)."""
    cache: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def get(batch: int, merge: str = "single") -> dict[str, torch.Tensor]:
        if (batch, merge) not in cache:
            cache[batch, merge] = strict_graph(tiny, batch_inputs("micro", tiny.cfg, batch)[0], merge)
        return cache[batch, merge]

    return get


def _differs(cap, ours, graph) -> dict[str, float]:
    return {n.name: max_error(cap.values[n.name], ours[n.name])
            for n in graph.nodes if not same_bytes(cap.values[n.name], ours[n.name])}  # fmt: skip


@pytest.mark.parametrize(("batch", "serving", "merge"), [(1, False, "single"), (3, True, "single"), (2, True, "seg8")])
def test_bound_sglang_is_bytewise_h3gates_strict_graph(tiny, graph_values, batch, serving, merge):
    cap, session, _, layout, pack = _bound_capture(tiny, batch, serving, merge)
    assert pack.total % 64 == 0 and pack.total > batch * layout.seq_len  # padded rows follow the requests
    assert set(cap.values) == {n.name for n in tiny.graph.nodes} and cap.uncovered == {}
    ours = graph_values(batch, merge)
    assert _differs(cap, ours, tiny.graph) == {}, "nodes where bound SGLang is not h3gate's strict graph"
    assert all(same_bytes(cap.outputs[k], ours[k]) for k in OUTPUTS)
    unbound = provider(tiny, batch_inputs("micro", tiny.cfg, batch)[0])
    assert not all(same_bytes(ours[n], unbound[n]) for n in ours)  # the strict kernels are not the provider's bytes
    assert session.calls == 1


def test_the_trace_names_every_operator_call_and_its_kernel(tiny):
    cap, session, _, layout, pack = _bound_capture(tiny, 3, True)
    record = session.record()
    assert record["mode"] == "strict" and record["merge_order"] == "single" and record["tp"]["degree"] == 1
    assert not any(b["fallback"] for b in record["bindings"].values()) and record["findings"] == []
    want = {(n.name, op) for n in tiny.graph.nodes if n.name not in SELECT for op in n.ops}
    assert {(r["node"], r["op"]) for r in session.trace} == want
    for r in session.trace:
        b = session.bindings[r["node"]]
        kernel = next(x.kernel_id for x in b.bindings if x.op == r["op"])
        assert r["kernel_id"] == kernel and r["requested"] == r["actual"] == "triton" and r["call"] == 0
    # per block: one attention call per cu_seqlens segment (3 requests, then the padding segment)
    segments = [r["segment"] for r in session.trace if r["node"] == "block.0.attention"]
    s = layout.seq_len
    assert segments == [[b * s, (b + 1) * s] for b in range(3)] + [[3 * s, pack.total]]
    assert sum(r["node"] == "refiner.0.norm1" for r in session.trace) == 3  # SGLang refines one request a call
    assert set(record["not_bound"]) == SELECT and "blocks.1.attn.qkv_proj.forward" in record["replaced"]
    assert record["fused_paths"]["qkv_single_gemm"] == {"switched_on": True, "runs_while_bound": False}
    assert record["launches"]  # the kernels' launch records, by node


@pytest.mark.parametrize(("node", "request_row"), [("block.1.ffn_down", (1, 30)), ("block.0.attention", (2, 5))])
def test_a_perturbed_row_in_one_node_is_the_first_drift(tiny, graph_values, node, request_row):
    from h3gate.adapters.sglang.strict_ops import scale_row

    b, s = request_row
    packed = b * batch_inputs("micro", tiny.cfg, 3)[2].seq_len + s
    cap, session, *_ = _bound_capture(tiny, 3, True, faults={node: scale_row(packed)})
    ours = graph_values(3)
    differs = _differs(cap, ours, tiny.graph)
    first = next(n.name for n in tiny.graph.nodes if n.name in differs)
    assert first == node and set(OUTPUTS) & set(differs)  # the drift reaches an output
    moved = (cap.values[node] != ours[node]).flatten(2).any(-1).nonzero().tolist()
    assert {tuple(r) for r in moved} == {request_row}


def test_on_exit_the_module_is_sglangs_again(tiny):
    from h3gate.adapters.sglang.inputs import packing, run_forward

    _bound_capture(tiny, 1, True)
    assert not [n for n, m in tiny.model.named_modules() if "forward" in vars(m)]
    assert "_embed" not in vars(tiny.model)
    assert not [n for n, m in tiny.model.named_modules() if "forward_varlen" in vars(getattr(m, "_attention_impl", m))]
    tensors, raw, layout = batch_inputs("micro", tiny.cfg, 1)
    theirs = run_forward(tiny.model, tensors, raw, packing(1, layout.seq_len, raw.text_indices))
    ours = provider(tiny, tensors)
    assert all(same_bytes(theirs[k], ours[k]) for k in OUTPUTS)  # SGLang's own forward: the provider replay


def test_the_runtime_record_says_the_binding_ran_with_the_fused_site_mounted(tiny, graph_values):
    """A mounted fused RMSNorm + AdaLN site (quality lossless) is read only by the block forward the binding replaces:
    bound, the bytes stay h3gate's, and the records say so."""
    from h3gate.adapters.sglang.inputs import packing, run_forward
    from h3gate.adapters.sglang.runtime import runtime_record, set_quality
    from h3gate.adapters.sglang.strict_bind import bind_strict

    tensors, raw, layout = batch_inputs("micro", tiny.cfg, 1)
    try:
        assert set_quality(tiny.model, "lossless")
        with bind_strict(tiny.model) as session:
            bound = run_forward(tiny.model, tensors, raw, packing(1, layout.seq_len, raw.text_indices))
            during = runtime_record(tiny.model, "lossless")["strict_binding"]
        after = runtime_record(tiny.model, "lossless")["strict_binding"]
    finally:
        assert not set_quality(tiny.model, "exact")
    assert during == {"active": True, "mode": "strict", "merge_order": "seg8", "tp": 1, "ulysses": 1,
                      "forwards": 1, "findings": 0}  # fmt: skip
    assert after["active"] is False and after["forwards"] == 1
    site = session.record()["fused_paths"]["rmsnorm_adaln_site_mounted"]
    assert site == {"switched_on": True, "runs_while_bound": False}
    ours = graph_values(1)
    assert all(same_bytes(bound[k], ours[k]) for k in OUTPUTS)


def test_h3gate_strict_takes_sglangs_model(tiny):
    import h3gate.strict
    from h3gate.adapters.sglang.strict_bind import SglangSession

    with h3gate.strict(tiny.model, "audit") as session:
        assert isinstance(session, SglangSession) and session.mode == "audit" and session.findings == []
