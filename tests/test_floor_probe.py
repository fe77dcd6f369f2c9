"""``tools/gpu_floor_probe.py`` (an H200 probe): its cached arms, checked on the tiny block on the CPU. Each cached
node hands back the very tensor the real forward computed (no work for it, real data downstream), every other node
still runs, and the block's output is the real forward's. And the probes' shared ``records_file``: the JSON is
written even when the probe fails part way."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from h3gate.graph.execute import run_chained
from h3gate.graph.executions import candidate_table, provider_table
from h3gate.numerics import strict_numerics
from h3gate.runs.setup import RunSpec, prepare

_TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(_TOOLS))  # the probes import gpu_probe_common from their own folder, as `python3 tools/X.py`
_spec = importlib.util.spec_from_file_location("gpu_floor_probe", _TOOLS / "gpu_floor_probe.py")
floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floor)
import gpu_probe_common  # noqa: E402 - on the path inserted above


def test_a_probe_that_fails_part_way_still_writes_what_it_recorded(tmp_path):
    out = tmp_path / "probe.json"
    probe = gpu_probe_common.records_file(str(out), layout="tiny")
    with pytest.raises(RuntimeError, match="second section"), probe as records:
        records.append({"section": "first"})
        raise RuntimeError("second section")
    doc = json.loads(out.read_text())
    assert doc["records"] == [{"section": "first"}]
    assert doc["meta"]["layout"] == "tiny" and doc["meta"]["torch"] == torch.__version__


@pytest.mark.slow  # 6-9 s on two cores: make test-slow (.ci/run runs both); make test's budget
def test_the_cached_arms_skip_exactly_the_named_nodes_and_keep_the_output():
    with strict_numerics("cpu"):
        setup = prepare(RunSpec("block", "tiny"))
        graph, x, params = setup.graph, setup.inputs.tensors, setup.params
        names = {node.name for node in graph.nodes}
        assert set(floor.FUSABLE) < set(floor.ELEMENTWISE) < names  # a renamed node would fail here, not run
        for table in (provider_table(), candidate_table(setup.bindings)):
            with torch.no_grad():
                real = run_chained(graph, x, params, table)
                for cached in (floor.ELEMENTWISE, floor.FUSABLE):
                    overrides = floor._cached(real, cached)
                    assert set(overrides) == set(cached)
                    free = run_chained(graph, x, params, table, overrides)
                    assert all(free[name] is real[name] for name in cached)  # handed back, not recomputed
                    ran = names - set(cached)
                    assert all(free[name] is not real[name] for name in ran)  # the others ran again
                    assert torch.equal(floor._arm(graph, x, params, table, overrides)(), real[graph.output])
