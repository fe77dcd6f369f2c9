"""SGLang's ``MiniMaxH3DiTBlock`` as a block-gate candidate (:class:`SglangCandidate`, scope ``block``): chained
values bitwise h3gate's provider replay of the 17-node block graph on the CPU, isolated values (teacher forcing)
bitwise h3gate's isolated replay on the same fed values, a one-row fault located at its node in the isolated view
(and smeared downstream in the chained one), repeat and batch placements bitwise."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.gate.invariance import PLACEMENTS
from h3gate.graph.block import block_params, build_block_graph
from h3gate.graph.execute import iter_isolated, run_chained
from h3gate.graph.executions import provider_table
from h3gate.graph.inputs import build_block_inputs, stand_in
from h3gate.layout import build_layout
from h3gate.manifests.layouts import load_layout
from tests.sglang.helpers import MARKS, downstream, max_error, moved_rows, same_bytes

pytestmark = MARKS


@pytest.fixture(scope="module")
def block(tiny):
    layout = build_layout(load_layout("micro"), "micro")
    inputs = build_block_inputs(layout, tiny.cfg, tiny.source, 0, "cpu")
    return layout, inputs, {layer: block_params(tiny.source, layer) for layer in range(tiny.cfg.num_layers)}


def _candidate(tiny, layer: int = 0):
    from h3gate.adapters.sglang.candidate import SglangCandidate

    return SglangCandidate(tiny.model, tiny.cfg, scope="block", layer=layer)


def _provider(tiny, block, layer: int, hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    _, inputs, params = block
    tensors = dict(inputs.tensors) if hidden is None else {**inputs.tensors, "hidden_states": hidden}
    with torch.no_grad():
        values = run_chained(build_block_graph(tiny.cfg, layer), tensors, params[layer], provider_table())
    return {n.name: values[n.name] for n in build_block_graph(tiny.cfg, layer).nodes}


def _differs(ours: dict, theirs: dict) -> dict[str, float]:
    return {k: max_error(v, theirs[k]) for k, v in ours.items() if not same_bytes(v, theirs[k])}


@pytest.mark.parametrize("layer", [0, 1])
def test_chained_values_are_the_provider_replay_at_every_node(tiny, block, layer):
    cand = _candidate(tiny, layer)
    values = cand.chained(block[1].tensors)
    assert list(values) == [n.name for n in cand.graph.nodes] and cand.uncovered == {}
    assert _differs(values, _provider(tiny, block, layer)) == {}
    assert [node.name for node, _ in cand.lane(values)] == list(values)


def test_the_rope_cache_is_sglangs_own(tiny, block):
    from h3gate.adapters.sglang.block import block_packing, rope_cache

    layout, inputs, _ = block
    pack = block_packing(2, layout.seq_len)
    cache, positions = rope_cache(inputs.tensors["rope_cos"], inputs.tensors["rope_sin"], pack)
    theirs, _ = tiny.model.build_rope_cache(layout.position_ids[None], device=torch.device("cpu"))
    s = layout.seq_len
    assert same_bytes(cache[:s], theirs) and same_bytes(cache[s : 2 * s], theirs)
    padding, _ = tiny.model.build_rope_cache(torch.zeros(1, pack.total - 2 * s, 3, dtype=torch.float64), device="cpu")
    assert same_bytes(cache[2 * s :], padding) and torch.equal(positions, torch.arange(pack.total))
    bent = inputs.tensors["rope_sin"].clone()
    bent[:, -1] += 1.0
    with pytest.raises(InputError, match="the two halves differ"):
        rope_cache(inputs.tensors["rope_cos"], bent, pack)


def test_isolated_values_are_the_nodes_on_the_fed_values(tiny, block):
    """Fed provider values from no one execution (node k from hidden_states item 1 or 2 by its parity), every node's
    isolated value is h3gate's provider node on exactly those values (its graph inputs the request's own): each
    SGLang point read the forced upstream, none its own."""
    _, inputs, params = block
    cand = _candidate(tiny)
    shape = inputs.tensors["hidden_states"].shape[1:]
    one, two = (_provider(tiny, block, 0, stand_in(0, "hidden_states", i, *shape, "cpu")) for i in (1, 2))
    fed = {n.name: (one if k % 2 == 0 else two)[n.name] for k, n in enumerate(cand.graph.nodes)}
    values, uncovered = cand.isolated(inputs.tensors, fed)
    assert uncovered == {} and list(values) == [n.name for n in cand.graph.nodes]
    feed = lambda node, reads: {**inputs.tensors, **fed}  # noqa: E731
    expected = {node.name: out for node, _, out in iter_isolated(cand.graph.nodes, provider_table(), feed, params[0])}
    assert _differs(values, expected) == {}
    assert _differs(cand.isolated(inputs.tensors, _provider(tiny, block, 0))[0], _provider(tiny, block, 0)) == {}


@pytest.mark.parametrize(
    ("module", "nodes"),
    [
        ("blocks.0.attn.qkv_proj", {"q_proj", "k_proj", "v_proj"}),
        ("blocks.0.attn.q_norm", {"q_norm"}),
        ("blocks.0.attn.out_proj", {"o_proj"}),
        ("blocks.0.mlp.fc1", {"ffn_gate_up"}),
        ("blocks.0.mlp.fc2", {"ffn_down"}),
    ],
)
def test_a_fault_shows_isolated_at_its_node_only(tiny, block, module, nodes):
    from h3gate.adapters.sglang.block import capture_block
    from h3gate.adapters.sglang.capture import row_fault

    inputs, row = block[1].tensors, 7
    provider = _provider(tiny, block, 0)
    fault = lambda: row_fault(tiny.model, module, row)  # noqa: E731
    chained = capture_block(tiny.model, tiny.cfg, 0, inputs, before=fault).values
    isolated = capture_block(tiny.model, tiny.cfg, 0, inputs, provider=provider, before=fault).values
    graph = build_block_graph(tiny.cfg, 0)
    assert set(_differs(chained, provider)) == downstream(graph, nodes)  # inherited drift
    assert set(_differs(isolated, provider)) == nodes  # the isolated view localises it
    assert all(moved_rows(isolated[n], provider[n]) == {(0, row)} for n in nodes)


def test_repeat_and_batch_placements_are_bitwise(tiny, block):
    cand = _candidate(tiny)
    inputs = block[1].tensors
    first = cand.chained(inputs)
    assert _differs(cand.repeat(inputs), first) == {}
    for size, position in PLACEMENTS:
        placed = cand.placed(inputs, None, size, position)
        assert cand.last_packing.batch == size
        assert _differs(placed, first) == {}, (size, position)
    unrelated = [first["residual_mlp"], inputs["hidden_states"] * 2]
    assert _differs(cand.placed(inputs, unrelated, 3, 1), first) == {}  # the caller's unrelated items
    with pytest.raises(InputError, match="a batch of 3 needs 2 unrelated items, got 1"):
        cand.placed(inputs, unrelated[:1], 3, 0)


def test_the_record_says_what_ran(tiny, block):
    cand = _candidate(tiny, 1)
    cand.placed(block[1].tensors, None, 2, 1)
    record = cand.record()
    assert record["scope"] == "block" and record["layer"] == 1 and record["quality"] == "exact"
    assert record["packing"]["cu_seqlens"] == [0, 84, 168, 192]
    assert [p["node"] for p in record["node_map"]] == [n.name for n in cand.graph.nodes]
    assert record["node_map"][1] == {"node": "norm1", "module": "blocks.1.attn", "where": "in", "part": ""}
