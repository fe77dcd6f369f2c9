"""The one-pass fingerprint kernel (kernels/fingerprint.py) against its torch reference, under the interpreter: the
same int64 values for every bit width the determinism check feeds it, at row and column counts off its blocks,
with sums that wrap; one changed element changes its own row's sum only."""

from __future__ import annotations

import pytest
import torch

from h3gate.graph.fingerprints import weights
from h3gate.kernels.fingerprint import BLOCK_C, BLOCK_R, row_sums_kernel, row_sums_reference
from tests.triton_kernels.test_sm90_compile import lowering_facts

SHAPES = [(1, 1), (BLOCK_R + 1, BLOCK_C + 3), (9, 2 * BLOCK_C + 452), (3, 17)]


def _bits(dtype: torch.dtype, shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int16:  # a bfloat16 tensor's bits, negative values included
        return (torch.randn(shape, generator=gen) * 1e3).bfloat16().view(torch.int16)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_the_kernel_gives_the_reference_values(dtype, shape) -> None:
    m = _bits(dtype, shape, 0)
    w = weights(shape[1], m.device)
    want = row_sums_reference(m, w)
    assert torch.equal(row_sums_kernel(m, w), want)


def test_sums_wrap_and_do_not_depend_on_the_order() -> None:
    """int64 elements near the limits: products and sums wrap mod 2^64, in any order the same value."""
    m = torch.full((2, BLOCK_C + 5), torch.iinfo(torch.int64).max, dtype=torch.int64)
    m[1, ::2] = torch.iinfo(torch.int64).min
    w = weights(m.shape[1], m.device)
    want = row_sums_reference(m, w)
    assert torch.equal(row_sums_kernel(m, w), want)
    assert torch.equal(row_sums_reference(m.flip(1), w.flip(0)), want)


def test_a_strided_view_reads_its_own_elements() -> None:
    base = _bits(torch.int16, (6, 2 * BLOCK_C), 1)
    view = base[::2, 3 : 3 + BLOCK_C + 7]  # rows two apart, an offset start
    w = weights(view.shape[1], view.device)
    assert torch.equal(row_sums_kernel(view, w), row_sums_reference(view.contiguous(), w))


def test_one_changed_element_changes_its_row_only() -> None:
    """Negative control: one element one bit off changes exactly that row's fingerprint."""
    m = _bits(torch.int16, (BLOCK_R + 3, BLOCK_C + 9), 2)
    w = weights(m.shape[1], m.device)
    bent = m.clone()
    bent[BLOCK_R, BLOCK_C + 1] ^= 1
    a, b = row_sums_kernel(m, w), row_sums_kernel(bent, w)
    assert (a != b).nonzero().flatten().tolist() == [BLOCK_R]


def test_no_rows_or_no_columns_give_zero_sums() -> None:
    for shape in ((0, 5), (4, 0)):
        m = torch.zeros(shape, dtype=torch.int16)
        w = weights(shape[1], m.device)
        assert torch.equal(row_sums_kernel(m, w), row_sums_reference(m, w))


@pytest.mark.slow
def test_the_kernel_lowers_for_hopper_with_integer_arithmetic_only() -> None:
    """Compiled for sm_90 on the CPU: per bit width, 64-bit multiply-adds, int16 widened with sign extension (as
    torch's ``.to(torch.int64)``), and no floating-point instruction."""
    got = lowering_facts("--fingerprint")
    assert sorted(got) == ["i16", "i32", "i64", "u8"], got
    assert all(f["mad.lo.s64"] > 0 and f["float"] == 0 for f in got.values()), got
    assert got["i16"]["cvt.s64.s16"] > 0, got
