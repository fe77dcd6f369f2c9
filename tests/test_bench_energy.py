"""``h3gate.bench.energy``: milliseconds and joules per call in the steady state, each arm back to back (CUDA and
NVML faked: every call advances a device clock and an energy counter by known amounts; the real tiny block runs on
the CPU for the per-node record)."""

from __future__ import annotations

import time

import jsonschema
import pytest

from h3gate.bench import energy
from h3gate.evidence.schema import registry


def _check(ref: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"common.schema.json#/$defs/{ref}"}, registry=registry())


class _Device:
    """A device clock (ms) and an energy counter (J) that the fake calls advance; events read the clock."""

    def __init__(self) -> None:
        self.ms, self.joules, self.syncs = 0.0, 0.0, 0

    def patch(self, monkeypatch, counter: bool = True) -> None:
        dev = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = dev.ms

            def synchronize(self):
                dev.syncs += 1

            def elapsed_time(self, other):
                return other.t - self.t

        def sync():
            dev.syncs += 1

        monkeypatch.setattr(energy.torch.cuda, "Event", Event)
        monkeypatch.setattr(energy.torch.cuda, "synchronize", sync)
        monkeypatch.setattr(energy.torch.cuda, "current_device", lambda: 0)
        reading = (lambda: dev.joules) if counter else "NVML energy counter unavailable: NVMLError: Not Supported"
        monkeypatch.setattr(energy.clocks, "nvml_energy", lambda device: reading)

    def call(self, ms: float, joules: float, host_s: float = 0.0):
        def run():
            if host_s:
                time.sleep(host_s)
            self.ms += ms
            self.joules += joules

        return run


def test_sustained_gives_ms_and_joules_per_call_and_their_ratios(monkeypatch):
    dev = _Device()
    dev.patch(monkeypatch)
    fns = {"provider": dev.call(2.0, 1.0, 0.002), "strict": dev.call(1.5, 0.6, 0.002)}
    out = energy.sustained(fns, seconds=0.03, warm_s=0.01, rounds=2)
    p, s = out["arms"]["provider"], out["arms"]["strict"]
    assert p["ms_per_call"] == pytest.approx(2.0) and s["ms_per_call"] == pytest.approx(1.5)
    assert p["j_per_call"] == pytest.approx(1.0) and s["j_per_call"] == pytest.approx(0.6)
    assert p["mean_w"] == pytest.approx(500.0) and s["mean_w"] == pytest.approx(400.0)
    assert out["strict_over_provider_ms"] == pytest.approx(0.75)
    assert out["strict_over_provider_j"] == pytest.approx(0.6)
    # The count fills `seconds` at the warm-up's rate (2 ms of host sleep a call: about 15, never the minimum).
    assert energy.MIN_CALLS <= p["calls"] <= 16 and p["host_ms_per_call"] >= 2.0
    assert out["energy"] == {"source": "NVML nvmlDeviceGetTotalEnergyConsumption"}
    # 2 ms of host sleep a call against 2.0 / 1.5 ms of device: the host is the limit, and the record says so.
    assert p["enqueue_ms"] >= 2.0 and p["host_bound"] is True and s["host_bound"] is True
    _check("sustained").validate(out)


def test_an_arm_whose_span_read_zero_joules_leaves_the_energy_ratio_unmeasured(monkeypatch):
    """NVML's counter moves in steps: a node shorter than one step can read 0 J (768p, an H100: a ZeroDivisionError
    once). The record keeps the milliseconds, drops the joule ratio and says why; the control with joules keeps it."""
    dev = _Device()
    dev.patch(monkeypatch)
    fns = {"provider": dev.call(2.0, 0.0, 0.0), "strict": dev.call(1.0, 0.5, 0.0)}
    out = energy.sustained(fns, seconds=0.01, warm_s=0.0, rounds=1)
    assert out["strict_over_provider_ms"] == pytest.approx(0.5) and "strict_over_provider_j" not in out
    assert "did not advance" in out["strict_over_provider_j_unmeasured"]
    _check("sustained").validate(out)
    fns = {"provider": dev.call(2.0, 1.0, 0.0), "strict": dev.call(1.0, 0.5, 0.0)}
    out = energy.sustained(fns, seconds=0.01, warm_s=0.0, rounds=1)
    assert out["strict_over_provider_j"] == pytest.approx(0.5) and "strict_over_provider_j_unmeasured" not in out


def test_a_full_launch_queue_is_not_called_host_bound(monkeypatch):
    """A device-bound stream fills the launch queue, and then the host waits for a slot on every call: the span's host
    time approaches the device time, but the enqueue itself (timed on an idle device in the warm-up) stays small, and
    ``host_bound`` reads the enqueue (it read the span's host time before session 24: perf-probe-41 flagged the medium
    block, whose enqueue is 1.7-2.6 ms against 4.3-5.5 ms of device time)."""
    dev = _Device()
    dev.patch(monkeypatch)
    queue = {"synced": 0, "pending": 0}

    def run():
        if dev.syncs != queue["synced"]:
            queue["synced"], queue["pending"] = dev.syncs, 0
        queue["pending"] += 1
        if queue["pending"] > 2:  # the queue holds two calls: from the third on, wait a call's device time
            time.sleep(0.004)
        dev.ms += 4.0
        dev.joules += 1.0

    out = energy.sustained({"provider": run}, seconds=0.0, warm_s=0.01, rounds=1, min_calls=20)
    arm = out["arms"]["provider"]
    # The span's host time is the waits: what the old verdict read, and it would have said host-bound.
    assert arm["calls"] == 20 and arm["host_ms_per_call"] >= energy.HOST_BOUND * arm["ms_per_call"]
    assert arm["enqueue_ms"] < 1.0 and arm["host_bound"] is False
    _check("sustained").validate(out)


def test_the_joules_are_the_counter_difference_over_the_span_only(monkeypatch):
    """Energy spent outside the measured span (the warm-up's calls) is not charged to the calls."""
    dev = _Device()
    dev.patch(monkeypatch)
    warm = {"left": 3}

    def run():
        if warm["left"]:  # the first calls are the warm-up: expensive, and not measured
            warm["left"] -= 1
            dev.joules += 100.0
        else:
            dev.joules += 2.0
        dev.ms += 4.0

    out = energy.sustained({"provider": run}, seconds=0.0, warm_s=0.0, rounds=1, min_calls=3)
    # warm-up: 1 call (warm_s = 0); span: 3 calls, of which the first two still cost 100 J.
    assert out["arms"]["provider"]["calls"] == 3
    assert out["arms"]["provider"]["j_per_call"] == pytest.approx((100 + 100 + 2) / 3)
    assert "strict_over_provider_ms" not in out


def test_without_an_energy_counter_the_milliseconds_remain_and_the_record_says_why(monkeypatch):
    dev = _Device()
    dev.patch(monkeypatch, counter=False)
    out = energy.sustained({"provider": dev.call(2.0, 1.0), "strict": dev.call(1.0, 1.0)}, 0.0, 0.0, 1)
    assert out["energy"] == {"unavailable": "NVML energy counter unavailable: NVMLError: Not Supported"}
    assert set(out["arms"]["strict"]) == {"calls", "ms_per_call", "host_ms_per_call", "enqueue_ms", "host_bound"}
    assert out["arms"]["strict"]["host_bound"] is False  # no host work: the device is the limit
    assert out["strict_over_provider_ms"] == pytest.approx(0.5) and "strict_over_provider_j" not in out
    _check("sustained").validate(out)


def test_the_sustained_schema_refuses_malformed_records():
    arm = {"calls": 3, "ms_per_call": 1.0, "host_ms_per_call": 0.1, "j_per_call": 0.5, "mean_w": 500.0}
    good = {"arms": {"provider": arm}, "energy": {"source": "NVML"}, "strict_over_provider_ms": 0.8}
    check = _check("sustained")
    check.validate(good)
    check.validate({**good, "arms": {"provider": {**arm, "enqueue_ms": 0.1, "host_bound": False}}})
    bads = [
        {**good, "arms": {"provider": {k: v for k, v in arm.items() if k != "mean_w"}}},  # joules without watts
        {**good, "arms": {"provider": {**arm, "calls": 0}}},
        {**good, "arms": {"provider": {**arm, "ms_per_call": 0.0}}},
        {**good, "arms": {"provider": {**arm, "host_bound": "yes"}}},
        {**good, "arms": {"provider": {**arm, "enqueue_ms": 0.1}}},  # an enqueue time without its verdict
        {**good, "arms": {"provider": {**arm, "enqueue_ms": -0.1, "host_bound": False}}},
        {**good, "energy": {"source": "NVML", "unavailable": "both"}},
        {**good, "energy": {"unavailable": ""}},
        {**good, "strict_over_provider_j": 0.7, "strict_over_provider_ms": None},
        {k: v for k, v in good.items() if k != "energy"},
        {**good, "arms": {}},
    ]
    for bad in bads:
        with pytest.raises(jsonschema.ValidationError):
            check.validate(bad)


def test_per_node_runs_every_node_alone_and_sums_per_arm(monkeypatch):
    """The tiny block's 17 nodes, each on the CPU: the provider's node calls cost 1 ms / 0.5 J, the strict's 0.5 ms /
    0.2 J on the fake device; per node and summed, the record says so, and the schema takes it."""
    from h3gate.graph import execute
    from h3gate.graph.executions import candidate_table, provider_table
    from h3gate.runs.setup import RunSpec, prepare

    setup = prepare(RunSpec("block", "tiny", "tiny"))
    tables = {"provider": provider_table(), "strict": candidate_table(setup.bindings)}
    dev = _Device()
    dev.patch(monkeypatch)
    cost = {id(tables["provider"]): (1.0, 0.5), id(tables["strict"]): (0.5, 0.2)}
    real = execute.run_node
    seen: list[str] = []

    def run_node(node, table, values, params, override=None):
        ms, joules = cost[id(table)]
        dev.ms += ms
        dev.joules += joules
        seen.append(node.name)
        return real(node, table, values, params, override)

    monkeypatch.setattr(execute, "run_node", run_node)  # what the executor's node calls run
    out = energy.per_node(setup.graph, setup.inputs.tensors, setup.params, tables, seconds=0.0, warm_s=0.0,
                          min_calls=1)  # fmt: skip
    names = [n.name for n in setup.graph.nodes]
    assert list(out["nodes"]) == names and set(seen) == set(names)
    for rec in out["nodes"].values():
        assert rec["arms"]["strict"]["j_per_call"] == pytest.approx(0.2)
        assert rec["strict_over_provider_ms"] == pytest.approx(0.5)
    assert out["sums"]["provider"] == {"ms_per_call": pytest.approx(17.0), "j_per_call": pytest.approx(8.5)}
    assert out["sums"]["strict"]["j_per_call"] == pytest.approx(17 * 0.2)
    _check("sustained_nodes").validate(out)
    with pytest.raises(jsonschema.ValidationError):
        _check("sustained_nodes").validate({**out, "sums": {"strict": {"j_per_call": 1.0}}})  # no ms


def test_the_bench_table_shows_the_sustained_forward_and_nodes():
    from rich.console import Console

    from h3gate.commands.bench_cmd import _sustained_table

    arm = {"calls": 9, "ms_per_call": 230.0, "host_ms_per_call": 120.0, "j_per_call": 158.7, "mean_w": 690.0}
    looped = {**arm, "ms_per_call": 0.5, "host_ms_per_call": 0.5, "host_bound": True}
    node = {"arms": {"provider": {**arm, "ms_per_call": 1.0}, "strict": looped},
            "energy": {"source": "NVML"}, "strict_over_provider_ms": 0.5, "strict_over_provider_j": 0.9}  # fmt: skip
    steady = {
        "method": "m",
        "forward": {"arms": {"provider": arm, "strict": arm}, "energy": {"source": "NVML"},
                    "strict_over_provider_ms": 1.0, "strict_over_provider_j": 1.0},  # fmt: skip
        "forward_nodes": {"method": "m", "nodes": {"o_proj": node},
                          "sums": {"provider": {"ms_per_call": 1.0, "j_per_call": 2.0},
                                   "strict": {"ms_per_call": 0.5}}},
    }  # fmt: skip
    console = Console(width=200, record=True)
    console.print(_sustained_table(steady))
    text = console.export_text()
    assert "230 / 158.7 J (690 W)" in text and "o_proj" in text and "0.500x (0.900x)" in text
    assert "nodes, sum" in text and "1 / 2 J" in text
    assert text.count("host-bound") == 1 and "0.5 / 158.7 J (690 W) host-bound" in text
    blind = {**steady["forward"], "energy": {"unavailable": "NVML energy counter unavailable: X"}}
    console = Console(width=200, record=True)
    console.print(_sustained_table({"method": "m", "forward": blind}))
    assert "NVML energy counter unavailable: X" in console.export_text()
