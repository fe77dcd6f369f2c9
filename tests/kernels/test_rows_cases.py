"""The row case builders (h3gate.ops.cases_rows) against their kernels at a small odd row count: every case runs
through the provider and the strict kernel with identical shapes and dtypes, bitwise where the contract promises it."""

from __future__ import annotations

import pytest
import torch

from h3gate.manifests.model_config import load_config
from h3gate.ops import cases_rows, registry
from h3gate.ops.cases import CASES, build_case

CFG = load_config("tiny").config


def test_cases_cover_every_row_and_merge_with_gemm():
    declared = {op for op, s in registry.specs().items() if s.family not in ("gemm", "attention")}
    assert declared <= set(cases_rows.CASES)
    assert set(cases_rows.CASES) <= set(CASES)


@pytest.mark.parametrize("op", sorted(cases_rows.CASES))
def test_case_runs_kernel_and_provider(op):
    case = build_case(op, 7, CFG, "cpu", seed=3)
    binding = registry.bind(op, "strict", "cpu")
    assert (
        binding.actual == "triton"
        and binding.label == "row"
        and binding.kernel_id == f"triton.{op}.v1"
        or (op == "final_adaln_out" and binding.kernel_id == "triton.h3_rmsnorm_modulate.v1")
    )
    with torch.no_grad():
        k, p = case.call(binding.fn), case.call(registry.reference(op))
    assert k.shape == p.shape and k.dtype == p.dtype
    if registry.spec(op).contract.provider_bitwise:
        assert torch.equal(k, p)
    for pos in case.grad_args:
        assert case.args[pos].is_floating_point()
    assert case.bytes_moved > 0
