"""``h3gate.bench.clocks`` and what the block and model benches record beside their times: the host's enqueue time
per call, the device's clocks during each arm's calls (NVML faked), and the model's forward stage by stage (CUDA
faked: a device clock each stage advances; the real tiny model runs on the CPU)."""

from __future__ import annotations

import time

import jsonschema
import pytest
import torch

from h3gate.bench import clocks, timing
from h3gate.evidence.schema import read_schema, schema_path


def _validator(kind: str, ref: str) -> jsonschema.Draft202012Validator:
    """A validator of one ``$defs`` entry or property of ``kind``'s schema, resolving ``common.schema.json``."""
    from h3gate.evidence.schema import registry

    assert read_schema(schema_path(kind))  # the file parses
    return jsonschema.Draft202012Validator({"$ref": f"{kind}.schema.json#{ref}"}, registry=registry())


def test_attribute_counts_only_the_samples_inside_each_arms_calls():
    t0 = 100.0
    samples = [
        clocks.Sample(100.0005, 1980, 400, 0),  # inside a's first call (0 .. 1 ms)
        clocks.Sample(100.0015, 1000, 100, 0x1),  # between calls: nobody's
        clocks.Sample(100.0025, 1700, 700, 0x4),  # inside b's call (2 .. 3 ms)
        clocks.Sample(100.0028, 1650, 690, 0x4 | 0x20),  # inside b's call
        clocks.Sample(100.0045, 1900, 450, 0),  # inside a's second call (4 .. 5 ms)
    ]
    out = clocks.attribute(samples, t0, {"a": [(0.0, 1.0), (4.0, 5.0)], "b": [(2.0, 3.0)], "c": [(9.0, 9.5)]})
    assert out["a"] == {
        "samples": 2, "sm_mhz": {"median": 1940, "min": 1900, "max": 1980},
        "power_w": {"median": 425, "min": 400, "max": 450}, "reasons": {},
    }  # fmt: skip
    assert out["b"]["samples"] == 2 and out["b"]["sm_mhz"]["median"] == 1675
    assert out["b"]["reasons"] == {"sw_power_cap": 2, "sw_thermal_slowdown": 1}
    assert out["c"] == {"samples": 0}


def test_sampler_reads_until_stopped_and_skips_failed_readings():
    calls = {"n": 0}

    def read():
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            raise RuntimeError("NVML hiccup")
        return 1800.0, 500.0, 0x4

    sampler = clocks.ClockSampler(clocks.Reader(read, "fake"), period_s=0.002)
    sampler.start()
    time.sleep(0.05)
    sampler.stop()
    n = len(sampler.samples)
    assert n >= 3 and calls["n"] >= 2 * n - 1  # every other reading failed and was dropped
    assert all(s.sm_mhz == 1800.0 and s.reasons == 0x4 for s in sampler.samples)
    assert [s.t for s in sampler.samples] == sorted(s.t for s in sampler.samples)
    time.sleep(0.01)
    assert len(sampler.samples) == n  # stopped: no more readings


def test_no_nvml_binding_is_one_line():
    import sys

    saved = sys.modules.get("pynvml")
    sys.modules["pynvml"] = None  # import fails
    try:
        assert clocks.nvml_reader("cuda:0") == "nvidia-ml-py (pynvml) is not installed"
    finally:
        if saved is None:
            del sys.modules["pynvml"]
        else:
            sys.modules["pynvml"] = saved


def _fake_cuda(monkeypatch, module):
    """Events read the host clock in ms (so device windows are the calls' host windows); no device work."""

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter() * 1e3

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    class Flush:
        def zero_(self):
            pass

    monkeypatch.setattr(module.torch, "empty", lambda *a, **k: Flush())
    monkeypatch.setattr(module.torch.cuda, "Event", Event)
    monkeypatch.setattr(module.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(module.torch.cuda, "current_device", lambda: 0)


def test_side_by_side_observes_host_time_and_each_arms_clocks(monkeypatch):
    """Arm a runs at 1500 MHz, arm b at 1900 MHz (the fake NVML answers by who is running): each arm's record gets
    its own clock; host_ms is the time the call took to return (30 and 10 ms of host work)."""
    _fake_cuda(monkeypatch, timing)
    running = {"arm": None}
    mhz = {"a": 1500.0, "b": 1900.0, None: 1000.0}
    reader = clocks.Reader(lambda: (mhz[running["arm"]], 300.0, 0x4 if running["arm"] == "a" else 0), "fake NVML")
    monkeypatch.setattr(timing.clocks, "nvml_reader", lambda device: reader)

    def arm(name: str, seconds: float):
        def run():
            running["arm"] = name
            time.sleep(seconds)
            running["arm"] = None

        return run

    observe: dict = {}
    stats = timing.side_by_side({"a": arm("a", 0.03), "b": arm("b", 0.01)}, iters=4, warmup=1, warmup_s=0.0,
                                observe=observe)  # fmt: skip
    assert 30 <= stats["a"]["host_ms"]["median_ms"] < 300 and 10 <= stats["b"]["host_ms"]["median_ms"] < 30
    assert stats["a"]["host_ms"]["max_ms"] >= stats["a"]["host_ms"]["median_ms"]
    assert observe["source"] == "fake NVML" and observe["period_ms"] == clocks.PERIOD_S * 1e3
    a, b = observe["arms"]["a"], observe["arms"]["b"]
    assert a["samples"] >= 4 and a["sm_mhz"]["median"] == 1500.0 and a["reasons"].get("sw_power_cap", 0) >= 1
    assert b["samples"] >= 1 and b["sm_mhz"]["median"] == 1900.0
    # Without observe the record is what it always was.
    plain = timing.side_by_side({"a": arm("a", 0.0)}, iters=1, warmup=1, warmup_s=0.0)
    assert set(plain["a"]) == {"median_ms", "min_ms", "max_ms", "iters"}


def test_side_by_side_without_nvml_says_why(monkeypatch):
    _fake_cuda(monkeypatch, timing)
    monkeypatch.setattr(timing.clocks, "nvml_reader", lambda device: "NVML unavailable: NVMLError: no driver")
    observe: dict = {}
    stats = timing.side_by_side({"a": lambda: None}, iters=2, warmup=1, warmup_s=0.0, observe=observe)
    assert observe == {"unavailable": "NVML unavailable: NVMLError: no driver"}
    assert "host_ms" in stats["a"]


@pytest.mark.parametrize("kind", ["bench-ws1-block", "bench-ws1-model"])
def test_the_bench_schemas_take_host_time_and_clocks_and_refuse_malformed_ones(kind):
    check = _validator(kind, "/$defs/phase")
    timing_rec = {
        "median_ms": 2.0,
        "min_ms": 1.9,
        "max_ms": 2.2,
        "iters": 3,
        "host_ms": {"median_ms": 0.4, "max_ms": 0.9},
    }
    arm = {"samples": 3, "sm_mhz": {"median": 1700, "min": 1650, "max": 1980},
           "power_w": {"median": 690, "min": 600, "max": 700}, "reasons": {"sw_power_cap": 3}}  # fmt: skip
    clocks_rec = {"source": "NVML", "period_ms": 10.0, "method": "m", "arms": {"provider": arm, "strict": arm}}
    phase = {"provider": timing_rec, "strict": timing_rec, "strict_over_provider": 1.0, "device_clocks": clocks_rec}
    if kind == "bench-ws1-model":
        phase["max_memory_allocated_bytes"] = {"provider": 1, "strict": 1}
    check.validate(phase)
    check.validate({**phase, "device_clocks": {"unavailable": "nvidia-ml-py (pynvml) is not installed"}})
    check.validate({**phase, "device_clocks": {**clocks_rec, "arms": {"provider": arm, "strict": {"samples": 0}}}})
    bad_arms = (
        {**arm, "reasons": {"overclocked": 1}},  # not an NVML reason
        {"samples": 2, "sm_mhz": arm["sm_mhz"]},  # a clock without power and reasons
        {**arm, "samples": -1},
    )
    bads = [{**phase, "device_clocks": {**clocks_rec, "arms": {"provider": arm, "strict": a}}} for a in bad_arms]
    bads += [
        {**phase, "device_clocks": {**clocks_rec, "arms": {"strict": arm}}},  # the provider arm is required
        {**phase, "device_clocks": {"unavailable": ""}},
        {**phase, "device_clocks": {**clocks_rec, "unavailable": "both"}},
        {**phase, "strict": {**timing_rec, "host_ms": {"median_ms": 0.4}}},
    ]
    for bad in bads:
        with pytest.raises(jsonschema.ValidationError):
            check.validate(bad)


@pytest.fixture(scope="module")
def tiny_model(tiny_params):
    from h3gate.graph.core import OpTable
    from h3gate.graph.executions import provider_table
    from h3gate.graph.model import build_model_graph
    from h3gate.graph.stages import split_stages
    from h3gate.layout import build_layout
    from h3gate.manifests.layouts import load_layout
    from h3gate.manifests.model_config import load_config
    from h3gate.ops import registry
    from h3gate.runs.model_stages import model_inputs

    cfg = load_config("tiny").config
    graph = build_model_graph(cfg)
    inputs, _ = model_inputs(build_layout(load_layout("tiny"), "tiny"), cfg, 0, "cpu")
    # Timing bookkeeping only: the second arm is another table of the references (fast on the CPU), told apart by
    # identity; what the strict kernels compute is the gates' business.
    tables = {"provider": provider_table(), "strict": OpTable(lambda op: registry.reference(op))}
    return split_stages(graph), inputs, tiny_params, tables


def test_stage_times_are_the_gaps_between_stage_events(tiny_model, monkeypatch):
    """Each stage advances a fake device clock by a known amount (blocks 1.0 + 0.5 i ms, other stages 0.1 ms; the
    provider twice that): the record's stages, block spread, rest and whole follow, and the schema takes it."""
    from h3gate.bench import model as bench_model
    from h3gate.bench import nodes as bench_nodes
    from h3gate.graph import stages as ms

    stages, inputs, params, tables = tiny_model
    clock = {"t": 0.0}

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["t"]

        def query(self):
            return False

        def elapsed_time(self, other):
            return other.t - self.t

    names = {id(t): arm for arm, t in tables.items()}
    real = ms.run_stage

    def cost(label: str) -> float:
        return 1.0 + 0.5 * int(label.split(".")[1]) if label.startswith("block.") else 0.1

    def run_stage(stage, values, p, table, *rest):
        clock["t"] += cost(stage.label) * (2.0 if names[id(table)] == "provider" else 1.0)
        return real(stage, values, p, table, *rest)

    monkeypatch.setattr(ms, "run_stage", run_stage)
    monkeypatch.setattr(bench_nodes, "_l2_flush_buffer", lambda: type("F", (), {"zero_": lambda self: None})())
    monkeypatch.setattr(bench_nodes.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench_nodes.torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(bench_nodes.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_nodes, "spin_cycles", lambda us: int(us))
    out = bench_model.stage_times(stages, inputs, params, tables, iters=3, warmup=1)
    labels = [s.label for s in stages]
    blocks = [lab for lab in labels if lab.startswith("block.")]
    assert len(blocks) == 2 and len(labels) > len(blocks)
    for arm, scale in (("strict", 1.0), ("provider", 2.0)):
        rec = out["arms"][arm]
        assert list(rec["stages"]) == labels
        assert rec["stages"] == pytest.approx({lab: cost(lab) * scale for lab in labels})
        assert rec["blocks"] == pytest.approx({"count": 2, "median_ms": 1.25 * scale, "min_ms": 1.0 * scale,
                                               "max_ms": 1.5 * scale, "sum_ms": 2.5 * scale})  # fmt: skip
        assert rec["other_ms"] == pytest.approx(0.1 * scale * (len(labels) - 2))
        assert rec["whole_ms"] == pytest.approx(rec["sum_ms"]) and rec["host_behind_rounds"] == 0
    _validator("bench-ws1-model", "/properties/forward_stages").validate(out)
    with pytest.raises(jsonschema.ValidationError):
        _validator("bench-ws1-model", "/properties/forward_stages").validate(
            {**out, "arms": {"strict": out["arms"]["strict"]}}
        )


def test_stage_times_refuse_a_forward_that_marks_the_wrong_number_of_steps(monkeypatch):
    from h3gate.bench import nodes as bench_nodes

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def query(self):
            return False

    monkeypatch.setattr(bench_nodes, "_l2_flush_buffer", lambda: type("F", (), {"zero_": lambda self: None})())
    monkeypatch.setattr(bench_nodes.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench_nodes.torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(bench_nodes, "spin_cycles", lambda us: 1)
    with pytest.raises(RuntimeError, match="strict: 1 steps marked, expected 2"):
        bench_nodes.step_times({"strict": lambda mark: mark()}, ["x", "y"], iters=1, warmup=0)


def test_the_bench_tables_print_clocks_and_stages():
    from h3gate.commands.bench_cmd import _clock_table, _stage_table

    arm = {"samples": 4, "sm_mhz": {"median": 1710.4, "min": 1600.0, "max": 1980.0},
           "power_w": {"median": 690.2, "min": 500.0, "max": 700.0}, "reasons": {"sw_power_cap": 4}}  # fmt: skip
    results = {
        "forward": {"device_clocks": {"source": "s", "period_ms": 10, "method": "m",
                                      "arms": {"provider": arm, "strict": {"samples": 0}}}},
        "forward_backward": {"device_clocks": {"unavailable": "nvidia-ml-py (pynvml) is not installed"}},
    }  # fmt: skip
    cells = [list(col.cells) for col in _clock_table(results).columns]
    assert cells[0] == ["forward", "forward", "forward_backward"]
    assert cells[1] == ["provider", "strict", "-"]
    assert cells[3] == ["1710 (1600)", "-", "-"] and cells[4] == ["690 (700)", "-", "-"]
    assert cells[5] == ["sw_power_cap 4", "-", "nvidia-ml-py (pynvml) is not installed"]
    assert _clock_table({"forward": {}}) is None
    rec = {"stages": {}, "other_ms": 1.0, "sum_ms": 9.0, "whole_ms": 9.5, "host_behind_rounds": 0}
    arms = {
        "provider": {**rec, "blocks": {"count": 2, "median_ms": 4.0, "min_ms": 3.0, "max_ms": 5.0, "sum_ms": 8.0}},
        "strict": {**rec, "blocks": {"count": 2, "median_ms": 2.0, "min_ms": 1.5, "max_ms": 2.5, "sum_ms": 4.0}},
    }
    cells = [list(col.cells) for col in _stage_table({"method": "m", "arms": arms}).columns]
    assert cells[0][0] == "block median (2 blocks)" and cells[1][0] == "4.000" and cells[3][0] == "0.50x"
    assert cells[0][-1] == "whole forward" and cells[2][-1] == "9.500" and cells[3][-1] == "1.00x"


def test_forward_stages_calls_after_once_per_stage_in_order(tiny_model):
    from h3gate.graph.stages import forward_stages, stage_params

    stages, inputs, params, tables = tiny_model
    seen: list[str] = []
    with torch.no_grad():
        forward_stages(stages, inputs, stage_params(stages, params), tables["provider"], after=lambda s: seen.append(
            s.label))  # fmt: skip
    assert seen == [s.label for s in stages]


def test_nvml_reader_reads_clock_power_and_reasons_from_the_binding(monkeypatch):
    """A fake nvidia-ml-py: the UUID torch reports is unknown to it (the index is used), only the older reasons
    call exists, power comes in mW."""
    import sys
    import types

    fake = types.ModuleType("pynvml")
    fake.__version__ = "12.0-fake"

    class NVMLError(Exception):
        pass

    def by_uuid(uuid):
        raise NVMLError(f"unknown {uuid}")

    fake.NVMLError = NVMLError
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByUUID = by_uuid
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    fake.nvmlDeviceGetClockInfo = lambda h, which: {("h1", clocks.NVML_CLOCK_SM): 1755}[(h, which)]
    fake.nvmlDeviceGetPowerUsage = lambda h: 612_500
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = types.SimpleNamespace(uuid="0a1b2c3d-0000-1111-2222-333344445555")
    monkeypatch.setattr(clocks.torch.cuda, "get_device_properties", lambda index: props)
    reader = clocks.nvml_reader("cuda:1")
    assert reader.source == "NVML via nvidia-ml-py 12.0-fake: NVIDIA H200"
    assert reader.read() == (1755.0, 612.5, 0x4)
    fake.nvmlDeviceGetClockInfo = lambda h, which: (_ for _ in ()).throw(NVMLError("GPU is lost"))
    assert clocks.nvml_reader("cuda:1") == "NVML unavailable: NVMLError: GPU is lost"


class _FakeNvml:
    """A stand-in nvidia-ml-py: a counter in mJ, a clock and power, or an error from every call (``broken``)."""

    __version__ = "fake"

    class NVMLError(Exception):
        pass

    def __init__(self, broken: bool = False) -> None:
        self.broken, self.mj = broken, 12_345

    def _answer(self, value):
        if self.broken:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlInit(self):
        pass

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._answer(self.mj)

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self._answer(1755)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._answer(690_500)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._answer(0x4)

    def nvmlDeviceGetName(self, handle):
        return b"Fake H200"


@pytest.mark.parametrize("broken", [False, True])
def test_the_nvml_readers_answer_or_say_why_in_one_line(monkeypatch, broken):
    """Both readers open the device the same way: with answers, joules from the mJ counter and the clock reader's
    (MHz, W, reasons); with an NVML error on the probe call, one line naming what is unavailable and the error."""
    import sys

    fake = _FakeNvml(broken)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(clocks, "_handle", lambda pynvml, device: "h0")
    energy, reader = clocks.nvml_energy("cuda:0"), clocks.nvml_reader("cuda:0")
    if broken:
        assert energy == "NVML energy counter unavailable: NVMLError: Not Supported"
        assert reader == "NVML unavailable: NVMLError: Not Supported"
        return
    assert energy() == 12.345
    fake.mj += 2_000
    assert energy() == 14.345
    assert reader.read() == (1755.0, 690.5, 0x4) and reader.source == "NVML via nvidia-ml-py fake: Fake H200"
