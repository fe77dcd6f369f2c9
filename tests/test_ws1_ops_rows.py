"""ws1-ops judges rows too: a kernel wrong on one row fails, even where the whole-tensor accuracy bound passes.

Negative controls on real strict kernels (CPU interpreter): the kernel's output or its input gradient corrupted on
one row (scaled by 1 + 2^-6, or its last 16 columns zeroed). At 40 rows a scaled row moves the whole-tensor rel_l2
by about 0.0156 / sqrt(40) = 0.0025, inside the contracts' BF16 bound of 1e-2; only the row rule can see it.
"""

from __future__ import annotations

import pytest

from h3gate.gate.faults import corrupt, grad_fault
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry
from h3gate.ops.cases import build_case
from h3gate.runs.ws1_ops import run_case

CFG = load_config("tiny").config
ROWS = 40


def _faulty(op: str, row: int, kind: str, direction: str):
    fn = registry.bind(op, "strict", "cpu").fn
    case = build_case(op, ROWS, CFG, "cpu", 3)
    if direction == "forward":
        return lambda *a, **k: corrupt(fn(*a, **k), row, case.out_row_dim, kind)
    dim = case.row_dims.get(0)
    return lambda x, *a, **k: fn(grad_fault(x, row, dim, kind) if x.requires_grad else x, *a, **k)


@pytest.mark.parametrize("op", ["h3_swiglu", "h3_rmsnorm_modulate"])
def test_sound_kernels_pass_the_row_rule(op):
    result = run_case(op, ROWS, CFG, "cpu", seed=3)
    assert result.failures == [], result.failures
    rec = result.record
    assert rec["forward"]["rows"]["pass"] and rec["forward"]["rows"]["rows"] == ROWS
    assert rec["row_rule"]["variants_run"][0] == "default"


@pytest.mark.parametrize("op", ["h3_swiglu", "h3_rmsnorm_modulate"])
@pytest.mark.parametrize(("direction", "kind", "row"), [("forward", "scale", 3), ("backward", "zero_tail", ROWS - 1)])
def test_a_kernel_wrong_on_one_row_fails_and_is_located(op, direction, kind, row):
    result = run_case(op, ROWS, CFG, "cpu", seed=3, kernel=_faulty(op, row, kind, direction))
    where = "forward row rule" if direction == "forward" else "grad of arg 0 row rule"
    located = [f for f in result.failures if where in f and f": row {row}: 1 of {ROWS} rows" in f]
    assert located, result.failures
    if direction == "forward" and kind == "scale":  # the whole-tensor bound alone would have passed it
        fwd = result.record["forward"]
        assert fwd["accuracy_ok"] and not fwd["rows"]["pass"]
