"""``h3gate.bench.nodes``: the forward node by node, timed with CUDA events between nodes (CUDA faked: a device clock
that each node advances by a known amount; the real tiny block runs on the CPU)."""

from __future__ import annotations

import jsonschema
import pytest

from h3gate.bench import nodes as bench_nodes
from h3gate.commands.bench_cmd import _node_table
from h3gate.evidence.schema import read_schema, schema_path
from h3gate.graph import execute
from h3gate.graph.core import OpTable
from h3gate.graph.executions import provider_table
from h3gate.ops import registry
from h3gate.runs.setup import RunSpec, prepare


def _schema() -> dict:
    return read_schema(schema_path("bench-ws1-block"))["properties"]["forward_nodes"]


@pytest.fixture(scope="module")
def tiny():
    setup = prepare(RunSpec("block", "tiny", "tiny"))
    # Timing bookkeeping only: the second arm is another table of the references (fast on the CPU), told apart by
    # identity; what the strict kernels compute is the gates' business.
    tables = {"provider": provider_table(), "strict": OpTable(lambda op: registry.reference(op))}
    return setup, tables


def _fake_cuda(monkeypatch, tables, cost, left_spin):
    """Events read a device clock; node ``k`` of arm ``a`` advances it by ``cost(a, k, round)`` ms. ``left_spin``
    is what the spin's event answers to ``query()`` (True: the device finished the spin before the host was done)."""
    clock = {"t": 0.0, "round": -1}
    log: list = []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["t"]
            log.append("event")

        def query(self):
            return left_spin

        def elapsed_time(self, other):
            return other.t - self.t

    class Flush:
        def zero_(self):
            clock["round"] += 1
            log.append("flush")

    real = execute.run_node
    names = {id(t._resolve): arm for arm, t in tables.items()}  # node_times runs each arm's table ungrouped

    def run_node(node, table, values, params, override=None):
        k = [n.name for n in node_order].index(node.name)
        clock["t"] += cost(names[id(table._resolve)], k, clock["round"])
        log.append(node.name)
        return real(node, table, values, params, override)

    node_order: list = []
    monkeypatch.setattr(bench_nodes, "_l2_flush_buffer", Flush)
    monkeypatch.setattr(bench_nodes.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench_nodes.torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)))
    monkeypatch.setattr(bench_nodes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_nodes, "spin_cycles", lambda us: int(us))
    monkeypatch.setattr(execute, "run_node", run_node)  # the executor's node loop calls it for every node
    return log, node_order


def test_node_times_are_the_gaps_between_node_events(tiny, monkeypatch):
    setup, tables = tiny
    graph = setup.graph

    def cost(arm, k, rnd):  # strict: 0.1 ms a node plus 0.01 k; provider twice that; round 3 an outlier (median)
        base = (0.1 + 0.01 * k) * (2.0 if arm == "provider" else 1.0)
        return base * (50.0 if rnd == 3 else 1.0)

    log, order = _fake_cuda(monkeypatch, tables, cost, left_spin=False)
    order.extend(graph.nodes)
    out = bench_nodes.node_times(graph, setup.inputs.tensors, setup.params, tables, iters=5, warmup=1,
                                 head_start_us=1234.0)  # fmt: skip
    names = [n.name for n in graph.nodes]
    for arm, scale in (("strict", 1.0), ("provider", 2.0)):
        rec = out["arms"][arm]
        assert list(rec["nodes"]) == names
        for k, name in enumerate(names):
            assert rec["nodes"][name] == pytest.approx((0.1 + 0.01 * k) * scale)
        assert rec["sum_ms"] == pytest.approx(sum(rec["nodes"].values()))
        assert rec["whole_ms"] == pytest.approx(rec["sum_ms"])
        assert rec["host_behind_rounds"] == 0
    # Each forward: flush, the spin and its end event, then an event before the first node and one after each node.
    one = ["flush", ("spin", 1234), "event", "event"] + [x for name in names for x in (name, "event")]
    assert log == one * 2 * 6
    jsonschema.validate(out, _schema())


def test_node_times_count_rounds_where_the_host_fell_behind(tiny, monkeypatch):
    setup, tables = tiny
    _, order = _fake_cuda(monkeypatch, tables, lambda arm, k, rnd: 0.5, left_spin=True)
    order.extend(setup.graph.nodes)
    out = bench_nodes.node_times(setup.graph, setup.inputs.tensors, setup.params, tables, iters=3, warmup=2)
    assert {arm: rec["host_behind_rounds"] for arm, rec in out["arms"].items()} == {"provider": 3, "strict": 3}
    bad = dict(out, arms={"strict": out["arms"]["strict"]})  # the provider arm is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _schema())


def test_node_table_prints_each_node_and_the_sums():
    arms = {
        "provider": {"nodes": {"a": 2.0, "b": 1.0}, "sum_ms": 3.0, "whole_ms": 3.1, "host_behind_rounds": 0},
        "strict": {"nodes": {"a": 1.0, "b": 1.0}, "sum_ms": 2.0, "whole_ms": 2.05, "host_behind_rounds": 0},
    }
    table = _node_table({"method": "m", "arms": arms})
    cells = [list(col.cells) for col in table.columns]
    assert cells[0] == ["a", "b", "sum (whole)"]
    assert cells[1] == ["2.000", "1.000", "3.000 (3.100)"]
    assert cells[2] == ["1.000", "1.000", "2.000 (2.050)"]
    assert cells[3] == ["0.50x", "1.00x", "0.67x"]
