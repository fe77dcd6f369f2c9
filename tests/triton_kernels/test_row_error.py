"""The one-pass row-error kernel (kernels/row_error.py) against its torch reference, under the interpreter: the
row rule's norms for every dtype pair the gates feed it (a bf16 / fp32 / fp64 candidate against an fp64 golden, and
like against like), at row and column counts off its blocks; the finite flag per row; one changed element changes
its own row only; two launches give the same bytes."""

from __future__ import annotations

import math

import pytest
import torch

from h3gate.gate.rows import row_errors
from h3gate.kernels.row_error import (
    BLOCK_C,
    BLOCK_R,
    MAX_KERNEL_COLS,
    kernel_walks,
    row_error_norms_kernel,
    row_error_norms_reference,
)
from tests.triton_kernels.test_sm90_compile import lowering_facts

SHAPES = [(1, 1), (BLOCK_R + 1, BLOCK_C + 3), (9, 2 * BLOCK_C + 45), (3, 17)]
PAIRS = [(torch.bfloat16, torch.float64), (torch.float32, torch.float64), (torch.float64, torch.float64),
         (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]  # fmt: skip


def _pair(shape, cdt, gdt, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64) * 3.0
    c = g + 0.05 * torch.randn(shape, generator=gen, dtype=torch.float64)
    return c.to(cdt), g.to(gdt)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float64 sums in two orders: equal to a few float64 ulps of the row's size."""
    return torch.allclose(a, b, rtol=1e-13, atol=0.0)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{c}-{g}".replace("torch.", "") for c, g in PAIRS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_the_kernel_gives_the_reference_norms(pair, shape) -> None:
    c, g = _pair(shape, *pair, seed=shape[1])
    num, den, finite = row_error_norms_kernel(c, g)
    want = row_error_norms_reference(c, g)
    assert num.dtype == den.dtype == torch.float64 and finite.dtype == torch.bool
    assert _close(num, want[0]) and _close(den, want[1]) and torch.equal(finite, want[2])
    assert (num > 0).all() and (den > 0).all()  # the rows really differ: the comparison is not of zeros


def test_non_finite_candidate_rows_are_flagged_and_the_golden_is_not_checked() -> None:
    c, g = _pair((BLOCK_R + 2, BLOCK_C + 5), torch.bfloat16, torch.float64, 3)
    c[1, BLOCK_C + 2] = math.inf
    c[BLOCK_R, 0] = math.nan
    g[2, 4] = math.inf  # the rule checks the candidate's values only
    _, _, finite = row_error_norms_kernel(c, g)
    assert torch.equal(finite, row_error_norms_reference(c, g)[2])
    assert (~finite).nonzero().flatten().tolist() == [1, BLOCK_R]


def test_a_strided_view_reads_its_own_elements() -> None:
    c, g = _pair((6, 2 * BLOCK_C), torch.float32, torch.float64, 4)
    cv, gv = c[::2, 3 : 3 + BLOCK_C + 7], g[::2, 3 : 3 + BLOCK_C + 7]
    got, want = row_error_norms_kernel(cv, gv), row_error_norms_kernel(cv.contiguous(), gv.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_one_changed_element_changes_its_row_only_and_launches_repeat() -> None:
    """Negative control: one candidate element moved changes exactly that row's norm; the same input twice gives
    the same bytes."""
    c, g = _pair((BLOCK_R + 3, BLOCK_C + 9), torch.bfloat16, torch.float64, 5)
    bent = c.clone()
    bent[BLOCK_R, BLOCK_C + 1] += 1.0
    a, b = row_error_norms_kernel(c, g)[0], row_error_norms_kernel(bent, g)[0]
    assert (a != b).nonzero().flatten().tolist() == [BLOCK_R]
    assert torch.equal(a, row_error_norms_kernel(c, g)[0])


def test_no_rows_or_no_columns() -> None:
    for shape in ((0, 5), (4, 0)):
        c, g = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.float64)
        got, want = row_error_norms_kernel(c, g), row_error_norms_reference(c, g)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_row_errors_on_the_kernel_equal_the_rule_on_torch(monkeypatch) -> None:
    """row_errors with the kernel's norms (as on a GPU) against its torch path: the same rows within float64
    rounding, inf for the non-finite row and for a nonzero row against a zero golden row, 0 for zero against zero."""
    c, g = _pair((3, 7, 40), torch.bfloat16, torch.float64, 6)
    c[0, 2, 5] = math.nan
    g[:, 5], c[:, 5] = 0.0, 0.0  # row 5: zero against zero
    g[:, 6] = 0.0  # row 6: nonzero against zero
    want = row_errors(c, g, row_dim=1)
    monkeypatch.setattr("h3gate.gate.rows.row_error_norms", row_error_norms_kernel)
    got = row_errors(c, g, row_dim=1)
    assert want[2] == math.inf and want[5] == 0.0 and want[6] == math.inf
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and _close(got[want.isfinite()], want[want.isfinite()])


def test_a_row_too_wide_for_one_program_takes_the_torch_norms() -> None:
    """A whole weight judged as one row (5376 x 21504 elements at released widths) is not left to one program."""
    assert kernel_walks(5376) and kernel_walks(21504) and kernel_walks(MAX_KERNEL_COLS)
    assert not kernel_walks(MAX_KERNEL_COLS + 1) and not kernel_walks(5376 * 21504)


@pytest.mark.slow
def test_the_kernel_lowers_for_hopper_in_float64() -> None:
    """Compiled for sm_90 on the CPU, for each candidate dtype against a float64 golden: float64 multiply-adds and
    no register spills."""
    got = lowering_facts("--row-error")
    assert sorted(got) == ["bf16-f64", "f32-f64", "f64-f64"], got
    assert all(f["f64 fma/mul"] > 0 and f["spill_bytes"] == 0 for f in got.values()), got
