"""The one-pass fingerprint kernels (kernels/fingerprint.py) against their torch references, under the interpreter:
the same int64 values for every bit width the determinism check feeds them, at row, column and element counts off
their blocks, with sums that wrap; one changed element changes its own row's sum only, and the whole sum."""

from __future__ import annotations

import pytest
import torch

from h3gate.graph.fingerprints import weights
from h3gate.kernels.fingerprint import (
    BLOCK_C,
    BLOCK_R,
    CHUNK,
    WIDTH,
    row_sums_kernel,
    row_sums_reference,
    whole_sum_kernel,
    whole_sum_reference,
)
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


SIZES = [1, WIDTH - 1, WIDTH, WIDTH + 1, CHUNK + WIDTH + 7, 2 * CHUNK + 5]


def _whole_weights(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return weights(WIDTH, torch.device("cpu")), weights(max(1, -(-n // WIDTH)), torch.device("cpu"), salt=1)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("n", SIZES)
def test_the_whole_sum_kernel_gives_the_reference_value(dtype, n) -> None:
    flat = _bits(dtype, (1, n), 3).reshape(-1)
    w, v = _whole_weights(n)
    want = whole_sum_reference(flat, w, v)
    assert want.shape == () and torch.equal(whole_sum_kernel(flat, w, v), want)


def test_the_whole_sum_is_the_sum_over_elements_in_any_order() -> None:
    """The reference's row sums of the WIDTH-wide cut, weighted per row, equal the element-wise formula summed at
    once and summed backwards (mod 2^64), near the int64 limits."""
    n = CHUNK + 3 * WIDTH + 11
    flat = torch.full((n,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    flat[::3] = torch.iinfo(torch.int64).min
    w, v = _whole_weights(n)
    i = torch.arange(n)
    terms = flat * w[i % WIDTH] * v[i // WIDTH]
    assert torch.equal(whole_sum_reference(flat, w, v), terms.sum())
    assert torch.equal(whole_sum_kernel(flat, w, v), terms.flip(0).sum())


def test_one_changed_element_changes_the_whole_sum() -> None:
    """Negative controls: one bit of one element, and two unequal elements swapped, change the sum."""
    n = CHUNK + WIDTH + 7
    flat = _bits(torch.int16, (1, n), 4).reshape(-1)
    w, v = _whole_weights(n)
    base = whole_sum_kernel(flat, w, v)
    for at in (0, WIDTH, CHUNK + 1, n - 1):
        bent = flat.clone()
        bent[at] ^= 1
        assert not torch.equal(whole_sum_kernel(bent, w, v), base), at
    swapped = flat.clone()
    j = int((flat != flat[5]).nonzero()[0])
    swapped[5], swapped[j] = flat[j], flat[5]
    assert not torch.equal(whole_sum_kernel(swapped, w, v), base)


def test_no_elements_give_a_zero_sum() -> None:
    flat = torch.zeros(0, dtype=torch.int16)
    w, v = _whole_weights(0)
    assert torch.equal(whole_sum_kernel(flat, w, v), whole_sum_reference(flat, w, v))
    assert int(whole_sum_kernel(flat, w, v)) == 0


@pytest.mark.slow
def test_the_kernels_lower_for_hopper_with_integer_arithmetic_only() -> None:
    """Compiled for sm_90 on the CPU, per kernel and bit width: 64-bit multiply-adds (the whole sum: its weight
    product too), int16 widened with sign extension (as torch's ``.to(torch.int64)``), no floating point."""
    got = lowering_facts("--fingerprint")
    assert sorted(got) == [f"{k}-{b}" for k in ("rows", "whole") for b in ("i16", "i32", "i64", "u8")], got
    assert all(f["mad.lo.s64"] > 0 and f["float"] == 0 for f in got.values()), got
    assert all(got[f"whole-{b}"]["mul.lo.s64"] > 0 for b in ("i16", "i32", "i64", "u8")), got
    assert got["rows-i16"]["cvt.s64.s16"] > 0 and got["whole-i16"]["cvt.s64.s16"] > 0, got


def test_weights_of_n_are_a_prefix_of_any_longer() -> None:
    """What the whole fingerprint relies on when it asks for a power-of-two count of row weights."""
    for salt in (0, 1):
        longer = weights(5000, torch.device("cpu"), salt)
        assert all(torch.equal(weights(n, torch.device("cpu"), salt), longer[:n]) for n in (1, 7, 4096)), salt
    assert not torch.equal(weights(7, torch.device("cpu"), 0), weights(7, torch.device("cpu"), 1))
