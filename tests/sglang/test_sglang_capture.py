"""The node map: SGLang's value at every node of h3gate's model graph (forward hooks, h3gate's shapes and dtypes),
bitwise the provider replay's value there; complete (captured, or uncovered with a reason); and a one-row fault
injected into one SGLang module shows at exactly that node and row, and nowhere upstream."""

from __future__ import annotations

import pytest
import torch

from tests.sglang.helpers import MARKS, batch_inputs, max_error, provider, same_bytes

pytestmark = MARKS


def _capture(tiny, batch: int, serving: bool = True, before=None):
    from h3gate.adapters.sglang.capture import capture_forward
    from h3gate.adapters.sglang.inputs import packing

    tensors, raw, layout = batch_inputs("micro", tiny.cfg, batch)
    pack = packing(batch, layout.seq_len, raw.text_indices, serving=serving)
    return capture_forward(tiny.model, tiny.cfg, tensors, raw, pack, tiny.graph, before), tensors, layout


@pytest.mark.parametrize(("batch", "serving"), [(1, False), (2, True)])
def test_every_node_bitwise_the_provider_replay(tiny, batch, serving):
    cap, tensors, _ = _capture(tiny, batch, serving)
    ours = provider(tiny, tensors)
    assert set(cap.values) == {n.name for n in tiny.graph.nodes} and cap.uncovered == {}  # the CPU: every node
    differs = {n.name: max_error(cap.values[n.name], ours[n.name])
               for n in tiny.graph.nodes if not same_bytes(cap.values[n.name], ours[n.name])}  # fmt: skip
    assert differs == {}, f"nodes where SGLang's CPU value is not h3gate's provider value (max |error|): {differs}"


def test_a_point_that_does_not_fire_is_uncovered_with_its_reason(tiny, monkeypatch):
    import sglang.multimodal_gen.runtime.models.dits.minimax_h3 as dit

    def fused_qk_norm(q, k, q_norm, k_norm, head_dim):  # as SGLang's fused CUDA path: the norm modules are not called
        rms = torch.nn.functional.rms_norm
        return rms(q, (head_dim,), q_norm.weight, q_norm.eps), rms(k, (head_dim,), k_norm.weight, k_norm.eps)

    monkeypatch.setattr(dit, "_apply_qk_norm", fused_qk_norm)
    cap, tensors, _ = _capture(tiny, 1)
    norms = {n.name for n in tiny.graph.nodes if n.name.endswith(("q_norm", "k_norm"))}
    assert set(cap.uncovered) == norms and all("fused QK-norm" in why for why in cap.uncovered.values())
    ours = provider(tiny, tensors)
    assert all(same_bytes(v, ours[k]) for k, v in cap.values.items())


def test_a_node_without_a_point_is_uncovered(tiny, monkeypatch):
    from h3gate.adapters.sglang import capture

    full = capture.node_map
    monkeypatch.setattr(capture, "node_map", lambda cfg: [p for p in full(cfg) if p.node != "block.1.swiglu"])
    cap, _, _ = _capture(tiny, 1)
    assert cap.uncovered == {"block.1.swiglu": "no SGLang point in the node map"}


@pytest.mark.parametrize(
    ("module", "row", "node", "rows"),
    [
        ("blocks.1.mlp.fc2", ("packed", 1, 30), "block.1.ffn_down", {(1, 30)}),
        ("blocks.0.attn.qkv_proj", ("packed", 0, 7), "block.0.q_proj", {(0, 7)}),
        ("token_refiner.blocks.0.mlp.fc2", ("call", 5), "refiner.0.ffn_down", {(0, 5), (1, 5)}),
        ("final_layer.video_out", ("packed", 1, 40), "heads.video_proj", {(1, 40)}),
    ],
)
def test_a_one_row_fault_is_located_at_its_node_and_row(tiny, module, row, node, rows):
    from h3gate.adapters.sglang.capture import row_fault

    clean, _, layout = _capture(tiny, 2)
    packed_row = row[1] * layout.seq_len + row[2] if row[0] == "packed" else row[1]  # a refiner call is one request
    faulty, _, _ = _capture(tiny, 2, before=lambda: row_fault(tiny.model, module, packed_row))
    names = [n.name for n in tiny.graph.nodes]
    first = next(name for name in names if not same_bytes(clean.values[name], faulty.values[name]))
    assert first == node  # nothing upstream of it moved
    moved = (clean.values[node] != faulty.values[node]).flatten(2).any(-1).nonzero().tolist()
    assert {tuple(r) for r in moved} == rows
