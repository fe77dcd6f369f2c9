"""Gathers and scatters under the interpreter: adaln_row_gather, packed_index_copy, packed_index_select, and the
fixed-order segment sums that replace the provider's atomic index_add in their backward."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import gather, packed
from h3gate.kernels.common import check_table
from h3gate.ops import reference as R

from .rows_support import BF16, FP32, batch_rows_invariant, bits_equal, check_backward, grads, randn, rel


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_row_gather(dtype):
    table = R.adaln_table(randn((2, 18 * 40), dtype), 40)[4]  # strided chunk, read in place
    idx = torch.tensor([5, 0, 5, 5, 2, 1, 5, 0, 3])  # duplicates: several rows feed one table row's gradient
    assert bits_equal(gather.adaln_row_gather(table, idx), R.adaln_row_gather(table, idx))
    check_backward(gather.adaln_row_gather, R.adaln_row_gather, (table, idx), (0,))


def test_segment_sum_multi_chunk_determinism():
    """A segment longer than one chunk (256 rows): ascending chunk merge, repeat-bitwise, accurate vs float64;
    segments no row maps to are +0.0."""
    m, h = 700, 24
    seg = torch.cat([torch.full((600,), 2), torch.randint(0, 2, (100,), generator=torch.Generator().manual_seed(1))])
    seg = seg[torch.randperm(m, generator=torch.Generator().manual_seed(2))]
    a = randn((1, m, h), FP32)
    plan = gather.segment_plan(seg, 4)
    assert plan.num_chunks >= 4 and plan.max_chunks == 3
    out1 = gather.segment_sum(a, plan, FP32)
    out2 = gather.segment_sum(a, gather.segment_plan(seg, 4), FP32)
    assert bits_equal(out1, out2)
    gold = torch.zeros(4, h, dtype=torch.float64).index_add_(0, seg, a[0].double())
    assert rel(out1[0], gold) < 1e-6
    assert torch.equal(out1[0, 3], torch.zeros(h)) and not torch.signbit(out1[0, 3]).any()


def test_segment_sum_is_the_same_bytes_whatever_the_segments_a_program_reduces(monkeypatch):
    """The reduce takes SEGMENTS_PER_PROGRAM segments a program (a tile shape): 70 segments (a ragged last program,
    empty segments), two batch items, one segment a program and 32 give the same bytes, accurate vs float64."""
    m, h, n = 600, 8, 70
    seg = torch.randint(0, n - 5, (m,), generator=torch.Generator().manual_seed(3))  # the last 5 segments empty
    seg[:280] = 7  # one segment over two chunks
    a = randn((2, m, h), FP32)
    plan = gather.segment_plan(seg, n)
    outs = {}
    for per in (1, 32):
        monkeypatch.setattr(gather, "SEGMENTS_PER_PROGRAM", per)
        outs[per] = gather.segment_sum(a, plan, BF16)
    assert bits_equal(outs[1], outs[32])
    gold = torch.zeros(2, n, h, dtype=torch.float64).index_add_(1, seg, a.double())
    assert rel(outs[32].double(), gold) < 1e-2 and torch.equal(outs[32][:, n - 5 :], torch.zeros(2, 5, h, dtype=BF16))


def test_index_select_gradient_with_duplicates_is_deterministic():
    x = randn((2, 20, 33), BF16)
    sel = torch.tensor([3, 5, 3, 19, 0, 5, 5, 3, 3])
    assert bits_equal(packed.packed_index_select(x, sel), R.packed_index_select(x, sel))
    check_backward(packed.packed_index_select, R.packed_index_select, (x, sel), (0,))


def test_index_select_unique_backward_is_provider_bitwise():
    """Unique indices: each row's gradient is a one-term sum, equal to the provider's index_add bytes."""
    x = randn((2, 20, 33), FP32)
    sel = torch.tensor([4, 0, 19, 7, 8])
    gout = randn((2, 5, 33), FP32, 3)
    gout[0, 0, 0] = -0.0  # index_add into zeros gives +0.0 here; so must the kernel
    _, (gk,) = grads(packed.packed_index_select, (x, sel), (0,), gout)
    _, (gp,) = grads(R.packed_index_select, (x, sel), (0,), gout)
    assert bits_equal(gk, gp)
    batch_rows_invariant(packed.packed_index_select, (x[:1], sel), (0,), (0,))


def _partition(s: int, seed: int = 0):
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(seed))
    return perm[:5].sort().values, perm[5:14], perm[14:18]  # video rows out of order; rows 18.. stay zero


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_index_copy(dtype):
    s, h = 21, 40
    ti, vi, ai = _partition(s)
    text, video, audio = randn((2, 5, h), dtype), randn((2, 9, h), FP32, 1), randn((2, 4, h), FP32, 2)
    args = (text, video, audio, ti, vi, ai, s)
    assert bits_equal(packed.packed_index_copy(*args), R.packed_index_copy(*args))
    gout = randn((2, s, h), dtype, 4)
    _, gk = grads(packed.packed_index_copy, args, (0, 1, 2), gout)
    _, gp = grads(R.packed_index_copy, args, (0, 1, 2), gout)
    assert all(bits_equal(a, b) for a, b in zip(gk, gp, strict=True))
    one = (text[:1], video[:1], audio[:1], ti, vi, ai, s)
    batch_rows_invariant(packed.packed_index_copy, one, (0, 1, 2), (0, 1, 2))


def test_invalid_inputs():
    s, h = 21, 8
    ti, vi, ai = _partition(s)
    text, video, audio = randn((1, 5, h), BF16), randn((1, 9, h), FP32), randn((1, 4, h), FP32)
    dup = vi.clone()
    dup[3] = ti[1]
    with pytest.raises(InputError, match=rf"^packed_index_copy: video_indices: row {int(ti[1])} written twice"):
        packed.packed_index_copy(text, video, audio, ti, dup, ai, s)
    with pytest.raises(InputError, match=r"^packed_index_copy: audio_indices: length 3, expected 4$"):
        packed.packed_index_copy(text, video, audio, ti, vi, ai[:3], s)
    with pytest.raises(
        InputError, match=r"^packed_index_copy: text_indices: index out of range \[\d+, \d+\] for size 10$"
    ):
        packed.packed_index_copy(text, video, audio, ti, vi, ai, 10)
    with pytest.raises(InputError, match=r"^packed_index_copy: video: shape \(1, 9, 4\) does not match text"):
        packed.packed_index_copy(text, video[..., :4].contiguous(), audio, ti, vi, ai, s)
    with pytest.raises(InputError, match=r"^packed_index_select: indices: empty tensor \(0,\)$"):
        packed.packed_index_select(randn((1, 4, 8), FP32), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(InputError, match=r"^packed_index_select: x: expected 3 dims, got shape \(4, 8\)$"):
        packed.packed_index_select(randn((4, 8), FP32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(InputError, match=r"^adaln_row_gather: table: width 8, expected"):
        check_table("adaln_row_gather", "table", randn((6, 8), BF16), (BF16,), 16, torch.device("cpu"))
    with pytest.raises(InputError, match=r"^adaln_row_gather: adaln_indices: index out of range \[0, 6\] for size 6$"):
        gather.adaln_row_gather(randn((6, 8), BF16), torch.tensor([0, 6]))


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_index_select_fast_path_is_bitwise_the_autograd_path(dtype, monkeypatch):
    x = randn((2, 20, 33), dtype)
    sel = torch.tensor([3, 5, 3, 19, 0, 5])
    with torch.no_grad():
        fast = packed.packed_index_select(x.requires_grad_(True), sel)
    plain = packed.packed_index_select(x.detach(), sel)  # grad mode on, x needs no grad: also the direct launch
    slow = packed.packed_index_select(x, sel)
    assert fast.grad_fn is None and plain.grad_fn is None and slow.grad_fn is not None
    assert (
        bits_equal(fast, slow.detach()) and bits_equal(plain, fast) and bits_equal(fast, R.packed_index_select(x, sel))
    )
    (gx,) = torch.autograd.grad(slow, (x,), torch.ones_like(slow))
    assert bits_equal(gx, torch.zeros_like(x).index_add_(1, sel, torch.ones_like(slow)))

    def boom(*_):
        raise AssertionError("autograd.Function.apply called without a graph to build")

    monkeypatch.setattr(packed._IndexSelect, "apply", boom)
    with torch.no_grad():
        assert bits_equal(packed.packed_index_select(x, sel), fast)
    with torch.inference_mode():
        assert bits_equal(packed.packed_index_select(x.detach(), sel), fast)
    with pytest.raises(AssertionError, match="apply called"):
        packed.packed_index_select(x, sel)
