"""The row case builders (h3gate.ops.cases_rows) through the ws1-ops engine at a small odd row count: for every row
operator, kernel vs provider vs float64 golden forward and backward, the contract's provider-bitwise promise and
accuracy bounds, repeat / batch-position / batch-size / unrelated-row-mutation invariance - all must hold."""

from __future__ import annotations

import pytest

from h3gate.manifests.model_config import load_config
from h3gate.ops import cases_rows, registry
from h3gate.ops.cases import CASES
from h3gate.runs.ws1_ops import run_case

CFG = load_config("tiny").config


def test_cases_cover_every_row_and_merge_with_gemm():
    declared = {op for op, s in registry.specs().items() if s.family not in ("gemm", "attention")}
    assert declared <= set(cases_rows.CASES)
    assert set(cases_rows.CASES) <= set(CASES)


@pytest.mark.parametrize("op", sorted(cases_rows.CASES))
def test_every_promise_holds_at_small_odd_rows(op):
    binding = registry.bind(op, "strict", "cpu")
    assert binding.actual == "triton" and binding.label == "row" and not binding.fallback
    result = run_case(op, 7, CFG, "cpu", seed=3)
    assert result.failures == [], result.failures
    rec = result.record
    assert rec["verdict"] == "pass"
    if registry.spec(op).contract.provider_bitwise:
        assert rec["forward"]["provider_bitwise"]
    assert rec["backward"] and all(not g["missing"] for g in rec["backward"])
    inv = rec["invariance"]
    assert inv["repeat"] == {"forward": True, "backward": True}
    assert inv["mutation"] is not None and inv["mutation"]["forward"]
    assert all(p["forward"] and p["backward"] is not False for p in inv["batch"])
