"""SGLang's whole DiT as a model-gate candidate (:class:`SglangCandidate`, scope ``model``): the isolated view by
teacher forcing (every node bitwise h3gate's isolated replay on the same fed values; a one-row fault located at its
node; a point that does not fire leaves its readers uncovered, with the reason), repeat and batch placements."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.gate.invariance import GRAD_PLACEMENTS, PLACEMENTS
from h3gate.graph.execute import iter_isolated
from h3gate.graph.executions import provider_table
from h3gate.layout import build_layout
from h3gate.manifests.layouts import load_layout
from h3gate.runs.model_stages import model_inputs
from tests.sglang.helpers import MARKS, downstream, max_error, moved_rows, provider, same_bytes

pytestmark = MARKS


def _request(tiny, layout_name: str, item: int = 0):
    layout = build_layout(load_layout(layout_name), layout_name)
    tensors, record = model_inputs(layout, tiny.cfg, 0, "cpu", item=item)
    return tensors, record["raw"], layout


def _candidate(tiny, raw):
    from h3gate.adapters.sglang.candidate import SglangCandidate

    return SglangCandidate(tiny.model, tiny.cfg, scope="model", raw=raw)


def _nodes(tiny, values) -> dict[str, torch.Tensor]:
    return {n.name: values[n.name] for n in tiny.graph.nodes}


def _differs(ours: dict, theirs: dict) -> dict[str, float]:
    return {k: max_error(v, theirs[k]) for k, v in ours.items() if not same_bytes(v, theirs[k])}


def _expected(tiny, tensors, fed):
    feed = lambda node, reads: {**tensors, **fed}  # noqa: E731
    return {node.name: out for node, _, out in iter_isolated(tiny.graph.nodes, provider_table(), feed, tiny.params)}


def _fed(tiny) -> dict[str, torch.Tensor]:
    """Provider values from no one execution: node k from request 1 (k even) or request 2 (k odd), so that no node's
    inputs agree with one another and SGLang's own upstream could not stand in for them."""
    one, two = (_nodes(tiny, provider(tiny, _request(tiny, "micro", item=i)[0])) for i in (1, 2))
    return {n.name: (one if k % 2 == 0 else two)[n.name] for k, n in enumerate(tiny.graph.nodes)}


def test_isolated_values_are_the_nodes_on_the_fed_values(tiny):
    """Fed other requests' provider values, every node's isolated value is h3gate's provider node on exactly those
    values: each SGLang point read the forced upstream, across the refiner, the blocks and the heads."""
    tensors, raw, _ = _request(tiny, "micro")
    fed = _fed(tiny)
    cand = _candidate(tiny, raw)
    values, uncovered = cand.isolated(tensors, fed)
    assert uncovered == {} and list(values) == [n.name for n in tiny.graph.nodes]
    assert _differs(values, _expected(tiny, tensors, fed)) == {}
    ours = _nodes(tiny, provider(tiny, tensors))
    assert _differs(cand.isolated(tensors, ours)[0], ours) == {}  # on the request's own provider values: the provider


@pytest.mark.parametrize(
    ("module", "row", "nodes", "last"),
    [
        ("blocks.1.attn.out_proj", 30, {"block.1.o_proj"}, "heads.video_select"),  # micro: row 30 video, 41 audio
        ("blocks.1.mlp.fc1", 41, {"block.1.ffn_gate_up"}, "heads.audio_select"),
        ("token_refiner.blocks.0.attn.qkv_proj", 5, {f"refiner.0.{w}_proj" for w in "qkv"}, "heads.audio_select"),
        ("final_layer.video_out", 30, {"heads.video_proj"}, "heads.video_select"),
    ],
)
def test_a_fault_shows_isolated_at_its_node_only(tiny, module, row, nodes, last):
    """Chained, the fault reaches the model's output (its row's head: the heads select rows); isolated, the
    downstream nodes read the provider's values and only the faulted node moves, at the faulted row."""
    from h3gate.adapters.sglang.capture import capture_forward, row_fault
    from h3gate.adapters.sglang.inputs import packing

    tensors, raw, layout = _request(tiny, "micro")
    ours = _nodes(tiny, provider(tiny, tensors))
    pack = packing(1, layout.seq_len, raw.text_indices)
    fault = lambda: row_fault(tiny.model, module, row)  # noqa: E731
    chained = capture_forward(tiny.model, tiny.cfg, tensors, raw, pack, tiny.graph, fault)
    isolated = capture_forward(tiny.model, tiny.cfg, tensors, raw, pack, tiny.graph, fault, provider=ours)
    assert chained.uncovered == isolated.uncovered == {}
    moved = set(_differs(chained.values, ours))
    assert nodes < moved <= downstream(tiny.graph, nodes) and last in moved
    assert set(_differs(isolated.values, ours)) == nodes
    assert all(moved_rows(isolated.values[n], ours[n]) == {(0, row)} for n in nodes)


def test_a_point_that_does_not_fire_leaves_its_readers_uncovered(tiny, monkeypatch):
    """As SGLang's fused QK-norm on CUDA: q_norm / k_norm are not captured, so neither can be replaced, and the nodes
    reading them (rope_q / rope_k, the refiner's attention) have no exact isolated value; every other node does."""
    import sglang.multimodal_gen.runtime.models.dits.minimax_h3 as dit

    def fused_qk_norm(q, k, q_norm, k_norm, head_dim):
        rms = torch.nn.functional.rms_norm
        return rms(q, (head_dim,), q_norm.weight, q_norm.eps), rms(k, (head_dim,), k_norm.weight, k_norm.eps)

    monkeypatch.setattr(dit, "_apply_qk_norm", fused_qk_norm)
    tensors, raw, _ = _request(tiny, "micro")
    fed = _fed(tiny)
    values, uncovered = _candidate(tiny, raw).isolated(tensors, fed)
    norms = {n.name for n in tiny.graph.nodes if n.name.endswith(("q_norm", "k_norm"))}
    readers = {n.name for n in tiny.graph.nodes if set(n.inputs) & norms}
    assert readers == {"refiner.0.attention", *(f"block.{i}.rope_{w}" for i in range(2) for w in "qk")}
    assert set(uncovered) == norms | readers and not set(values) & set(uncovered)
    assert all("fused QK-norm" in uncovered[n] for n in norms)
    assert uncovered["block.1.rope_q"].startswith("input block.1.q_norm is not the provider's value (its point did")
    assert _differs(values, _expected(tiny, tensors, fed)) == {}


def test_a_node_without_a_provider_value_leaves_its_readers_uncovered(tiny):
    tensors, raw, _ = _request(tiny, "micro")
    ours = _nodes(tiny, provider(tiny, tensors))
    values, uncovered = _candidate(tiny, raw).isolated(tensors, {k: v for k, v in ours.items() if k != "time.silu"})
    assert uncovered == {"time.linear_2": "input time.silu is not the provider's value (no provider value was given)"}
    assert set(values) == set(ours) - {"time.linear_2"} and _differs(values, ours) == {}


def test_repeat_and_batch_placements_are_bitwise(tiny):
    tensors, raw, _ = _request(tiny, "tiny")
    unrelated = [_request(tiny, "tiny", item=i)[0] for i in (1, 2)]
    cand = _candidate(tiny, raw)
    first = cand.chained(tensors)
    assert list(first) == [n.name for n in tiny.graph.nodes] and cand.uncovered == {}
    assert _differs(cand.repeat(tensors), first) == {}
    for size, position in sorted({*PLACEMENTS, *GRAD_PLACEMENTS}):
        placed = cand.placed(tensors, unrelated, size, position)
        assert cand.last_packing.batch == size
        assert _differs(placed, first) == {}, (size, position)
    record = cand.record()
    assert record["scope"] == "model" and record["packing"]["batch"] == 3 and record["uncovered"] == {}
    with pytest.raises(InputError, match="placements need the unrelated requests' inputs"):
        cand.placed(tensors, None, 2, 0)
