"""The fused row-segment weight gradient (kernels/rows_dw.py, ``rows_seg8.linear_row_grads`` v2) under Triton's
interpreter: dW and db byte-equal to v1 (the single-walk dW and colsum kernels launched once per weight-gradient
segment, the 4 pairs of row segments, and the torch tree; ``rows_dw_reference.py``) for bfloat16 and float32, S with
uneven and empty segments, batch items, N / K off the tile, with and without bias; every CP rank's FP32 subtree combined
in rank order = one device's bytes; and negative controls: another segment order or a row moved between segments is not
those bytes."""

from __future__ import annotations

import os

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels.merge_tree import combine, finish
from h3gate.kernels.row_merge import RowGroup, cp_row_bounds, dw_bounds, local_spans, one_device
from h3gate.kernels.rows_dw import fused_dw_config, rows_colsum, rows_dw
from h3gate.kernels.rows_seg8 import linear_row_grads
from tests.triton_kernels.rows_dw_reference import dw_spans, linear_row_grads_v1

BF16, F32 = torch.bfloat16, torch.float32
# CPU under the interpreter (tests/conftest.py); ``TRITON_INTERPRET=0`` on a GPU host runs these compiled on CUDA.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def case(batch: int, s: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """dY (B, S, N) and X (B, S, K), seeded normal values drawn on the CPU, cast to ``dtype``, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    gy, x = torch.randn(batch, s, n, generator=gen), torch.randn(batch, s, k, generator=gen)
    return gy.to(dtype).to(DEVICE), x.to(dtype).to(DEVICE)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# (B, S, N, K, bias): S = 83 in segments of 22 (the last 17); S = 5 < 8 rows (segments of 2, the last empty); S = 17
# (L' = 6, the last segment empty); two batch items of 37 rows (L' = 10, the last segment 7 rows); N, K off the tile,
# K > 128 (the fused tile's BLOCK_N 128 against v1's 256).
CASES = [(1, 83, 48, 40, True), (1, 5, 20, 24, True), (1, 17, 16, 16, False), (2, 37, 33, 130, True)]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", CASES, ids=lambda c: "x".join(map(str, c[:4])) + ("+b" if c[4] else ""))
def test_fused_dw_and_db_are_v1s_bytes(shape, dtype) -> None:
    batch, s, n, k, bias = shape
    gy, x = case(batch, s, n, k, dtype)
    got = linear_row_grads(gy, x, (n, k), (n, k), one_device(s), bias)
    want = linear_row_grads_v1(gy, x, (n, k), (n, k), one_device(s), bias)
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert got[0].dtype == dtype and (not bias or got[1].shape == (n,))


def subtrees(gy, x, degree: int, bias: bool) -> list[torch.Tensor]:
    """Every CP``degree`` rank's FP32 subtree (dW flat, then db) from its own rows alone, in rank order."""
    s, n = x.shape[-2], gy.shape[-1]
    cfg = fused_dw_config((n, x.shape[-1]), x.dtype)
    bounds, out = cp_row_bounds(s, degree), []
    for r in range(degree):
        g, xs, group = gy[:, bounds[r] : bounds[r + 1]], x[:, bounds[r] : bounds[r + 1]], RowGroup(degree, r, s, None)
        parts = [rows_dw(g.contiguous(), xs.contiguous(), group, cfg, None).reshape(-1)]
        out.append(torch.cat(parts + ([rows_colsum(g.contiguous(), group, None)] if bias else [])))
    return out


def check_cp(gy, x, bias: bool, degrees=(2, 4)) -> None:
    """Per degree: the combined subtrees rounded are one device's bytes, and every rank's ``linear_row_grads``
    (its rows, the all-gather answering every rank's subtree) sends its own subtree and returns them too."""
    s, n, k = x.shape[-2], gy.shape[-1], x.shape[-1]
    one = linear_row_grads(gy, x, (n, k), (n, k), one_device(s), bias)
    for degree in degrees:
        parts = subtrees(gy, x, degree, bias)
        total = combine(parts, degree, op="row seg8")
        assert same(finish(total[: n * k].view(n, k), None, x.dtype), one[0]), degree
        bounds = cp_row_bounds(s, degree)
        for r in range(degree):
            sent = []

            def gather(t, parts=parts, sent=sent):
                sent.append(t)
                return parts

            rows = slice(bounds[r], bounds[r + 1])
            got = linear_row_grads(gy[:, rows], x[:, rows], (n, k), (n, k), RowGroup(degree, r, s, gather), bias)
            assert same(sent[0], parts[r]) and same(got[0], one[0]) and same(got[1], one[1]), (degree, r)


def test_cp_ranks_subtrees_combine_to_one_devices_bytes() -> None:
    """S = 83, float32 (every bit of the FP32 sums shows): CP2 / CP4, dW and db; CP8 would split a segment pair and
    is refused, naming the degree."""
    gy, x = case(1, 83, 24, 20, F32, seed=3)
    check_cp(gy, x, True)
    bounds = cp_row_bounds(83, 8)
    with pytest.raises(InputError, match="CP degree 8 splits a row segment pair"):
        linear_row_grads(gy[:, : bounds[1]], x[:, : bounds[1]], (24, 20), (24, 20), RowGroup(8, 0, 83, None), True)


def _permuted(group: RowGroup) -> list[tuple[int, int]]:
    """Segments 1 and 2 swapped: (q0 + q2) + (q1 + q3) (a sibling swap would add the same values)."""
    spans = dw_spans(group)
    return [spans[0], spans[2], spans[1], *spans[3:]]


def _shifted(group: RowGroup) -> list[tuple[int, int]]:
    """Segment 2's first row moved to the end of segment 1."""
    spans = dw_spans(group)
    (lo1, hi1), (lo2, hi2) = spans[1], spans[2]
    return [spans[0], (lo1, hi1 + 1), (lo2 + 1, hi2), *spans[3:]]


def crafted(dtype: torch.dtype):
    """S = 83 (weight-gradient segments of 22 rows, the last 17) of random values, but dY's columns 0 and 1 crafted
    over X's column of ones: the sums in dW[0:2, 0] see the row order even after a rounding to bfloat16. Column 0:
    1, 1, 2^25, -2^25 as the first row of segments 0-3: declared (1 + 1) + (2^25 - 2^25) = 2, segments 1 and 2
    swapped (1 + 2^25) + (1 - 2^25) = 0. Column 1: 1 in segments 0 and 1, 2^25 at segment 2's first row and -2^25
    three rows later: declared 2, with that first row in segment 1 (1 + (1 + 2^25)) + (-2^25) = 0."""
    gy, x = case(1, 83, 48, 40, dtype, seed=5)
    gy[..., :2], x[..., 0] = 0, 1
    assert dw_bounds(83) == (0, 22, 44, 66, 83)
    for col, rows in ((0, (0, 22, 44, 66)), (1, (0, 22, 44, 47))):
        for row, value in zip(rows, (1.0, 1.0, 2.0**25, -(2.0**25)), strict=True):
            gy[0, row, col] = value
    return gy, x


@pytest.mark.parametrize("dtype", [BF16, pytest.param(F32, marks=pytest.mark.slow)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("control", [_permuted, _shifted], ids=["segments-1-2-swapped", "row-shifted"])
def test_negative_control_another_row_order_is_not_the_bytes(control, dtype) -> None:
    """The bitwise comparison can fail: v1 with segments 1 and 2 swapped, or one row moved from segment 2 to 1,
    differs from the fused kernel, which equals v1 in the declared order (dW[0:2, 0] = 2 and db[0:2] = 2)."""
    s, n, k = 83, 48, 40
    gy, x = crafted(dtype)
    got = linear_row_grads(gy, x, (n, k), (n, k), one_device(s), True)
    want = linear_row_grads_v1(gy, x, (n, k), (n, k), one_device(s), True)
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert got[0][:2, 0].tolist() == [2.0, 2.0] and got[1][:2].tolist() == [2.0, 2.0]
    wrong = linear_row_grads_v1(gy, x, (n, k), (n, k), one_device(s), True, spans_of=control)
    assert not same(got[0], wrong[0]) and not same(got[1], wrong[1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_fused_dw_sweep_and_cp_at_every_degree(dtype) -> None:
    """More S (1 row; below, at and around 8 and whole chunks; a 3-item batch), N / K off the tiles, every CP degree
    with and without bias."""
    for batch, s, n, k in [(1, 1, 8, 8), (1, 7, 17, 9), (1, 8, 16, 16), (1, 9, 40, 24), (1, 65, 20, 136),
                           (3, 29, 18, 36), (1, 264, 70, 150), (1, 513, 33, 20)]:  # fmt: skip
        gy, x = case(batch, s, n, k, dtype, seed=s)
        for bias in (False, True):
            got = linear_row_grads(gy, x, (n, k), (n, k), one_device(s), bias)
            want = linear_row_grads_v1(gy, x, (n, k), (n, k), one_device(s), bias)
            assert same(got[0], want[0]) and same(got[1], want[1]), (batch, s, n, k, bias)
        if s >= 8:  # every rank holds rows (run ws2 refuses a plan that leaves one without)
            check_cp(gy, x, True)


@pytest.mark.slow  # 3 s of interpreted launches; the tool prints the whole block's counts
def test_one_launch_per_weight_gradient_where_v1_launched_four() -> None:
    """tools/count_seg8_launches.py's counter on one seg8 linear's backward (dX and dW, bias): v1 launched the dW
    kernel and the colsum once per weight-gradient segment (4 + 4) and added with torch; now one dW and one colsum
    launch."""
    import importlib.util
    import sys
    from pathlib import Path

    from h3gate.kernels.gemm_merge import h3_attention_o_gemm_seg8

    if DEVICE != "cpu":
        pytest.skip("launches are counted in Triton's interpreter")
    path = Path(__file__).resolve().parents[2] / "tools" / "count_seg8_launches.py"
    spec = importlib.util.spec_from_file_location("count_seg8_launches", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("count_seg8_launches", tool)
    spec.loader.exec_module(tool)
    gy, x = case(1, 83, 24, 16, BF16, seed=7)
    w = torch.randn(24, 16, generator=torch.Generator().manual_seed(8)).to(BF16).to(DEVICE)
    counts = {}
    for version in ("v1", "v2"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, w[:, 0].contiguous())]
        with tool.weight_grads(version), tool.counting() as counts[version]:
            h3_attention_o_gemm_seg8(*leaves).backward(gy)
    v1, v2 = counts["v1"], counts["v2"]
    assert (v1["triton._gemm_kernel"], v1["triton._colsum_kernel"], v1["triton._rows_dw_kernel"]) == (4, 4, 0)
    assert (v2["triton._gemm_kernel"], v2["triton._colsum_kernel"], v2["triton._rows_dw_kernel"]) == (0, 0, 1)
    assert v2["triton._rows_colsum_kernel"] == 1 and v1["triton._seg8_kernel"] == v2["triton._seg8_kernel"] == 1
    # v1's per-segment rows (4 concatenations, stacked) added by row_merge.subtree: one add a level, 2 levels
    assert v1["aten.cat"] == 4 and v1["aten.add"] == 2 and v2["aten.cat"] == v2["aten.add"] == 0


def norm_case(batch: int, s: int, h: int, seed: int = 0):
    """The modulated norm's inputs (x, weight, shift, scale, idx over 6 table rows) and a cotangent, bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(batch, s, h, generator=gen), torch.randn(batch, s, h, generator=gen)
    w, tab = 1 + 0.1 * torch.randn(h, generator=gen), 0.1 * torch.randn(6, 2 * h, generator=gen)
    idx = torch.randint(0, 6, (s,), generator=gen).to(DEVICE)
    x, g, w, tab = (t.to(BF16).to(DEVICE) for t in (x, g, w, tab))
    return (x, w, tab[:, :h].contiguous(), tab[:, h:].contiguous(), idx), g


def check_norm(batch: int, s: int, h: int, degree: int = 1, rank: int = 0) -> None:
    """The seg8 modulated norm's backward (one segmented launch) = v1's (a launch per row segment), every gradient,
    on CP``degree`` rank ``rank``'s rows (its subtrees through the same stand-in all-gather)."""
    from h3gate.kernels.norms import rms_forward
    from h3gate.kernels.row_merge import packed_rows
    from h3gate.kernels.rows_seg8 import h3_rmsnorm_modulate_seg8
    from tests.triton_kernels.rows_dw_reference import rmsnorm_rows_backward_v1

    (x, w, shift, scale, idx), g = norm_case(batch, s, h, seed=s + h)
    lo, hi = cp_row_bounds(s, degree)[rank : rank + 2]
    x, g, idx = x[:, lo:hi].contiguous(), g[:, lo:hi].contiguous(), idx[lo:hi].contiguous()
    group = RowGroup(degree, rank, s, lambda t: [t] * degree)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, shift, scale)]
    with packed_rows(group):
        h3_rmsnorm_modulate_seg8(*leaves, idx, 1e-6).backward(g)
    rstd = rms_forward(x, w, shift, scale, idx, 1e-6, True)[1]
    want = rmsnorm_rows_backward_v1(x, w, rstd, g, scale, idx, group)
    for i, (leaf, ref) in enumerate(zip(leaves, want, strict=True)):
        assert same(leaf.grad, ref), (batch, s, h, degree, rank, i)


def test_seg8_norm_backward_in_one_launch_is_v1s_bytes() -> None:
    """Two batch items of 9 rows (segments of 2, the last one 1 row, three empty), 16 wide; more in the slow sweep
    (CP ranks in test_row_merge.py)."""
    check_norm(2, 9, 16)


@pytest.mark.slow
def test_seg8_norm_backward_sweep() -> None:
    """Several programs and sum_rows chunks per segment (3000 rows of 16: 375-row segments), every CP degree."""
    for batch, s, h in [(2, 21, 16), (1, 83, 64), (2, 37, 48), (1, 5, 32), (1, 3000, 16), (3, 29, 40), (1, 264, 128)]:
        for degree in (1, 2, 4, 8):
            for rank in range(degree):
                if cp_row_bounds(s, degree)[rank] < cp_row_bounds(s, degree)[rank + 1]:
                    check_norm(batch, s, h, degree, rank)


def check_qk(batch: int, s: int, heads: int, degree: int = 1, rank: int = 0, tp: int = 1, tp_rank: int = 0) -> None:
    """The seg8 QK norm's backward (one launch over every (head group, row segment)) = v1's (a launch per pair), on
    CP``degree`` rank ``rank``'s rows and TP``tp`` rank ``tp_rank``'s heads (subtrees through stand-in gathers)."""
    from h3gate.kernels.norms import rms_forward
    from h3gate.kernels.row_merge import packed_rows
    from h3gate.kernels.tp_layers import MergeGroup, QkNormGrouped
    from tests.triton_kernels.rows_dw_reference import qk_norm_backward_v1

    gen = torch.Generator().manual_seed(s + heads)
    h_r, lo, hi = heads // tp, *cp_row_bounds(s, degree)[rank : rank + 2]
    x = torch.randn(batch, hi - lo, h_r * 128, generator=gen).to(BF16).to(DEVICE)
    g = torch.randn(batch, hi - lo, h_r, 128, generator=gen).to(BF16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(128, generator=gen)).to(BF16).to(DEVICE)
    group, rows = MergeGroup(tp, tp_rank, lambda t: [t] * tp), RowGroup(degree, rank, s, lambda t: [t] * degree)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w)]
    with packed_rows(rows):
        QkNormGrouped.apply(leaves[0], leaves[1], heads, tp_rank * h_r, 1e-6, group).backward(g)
    xv = x.view(batch, hi - lo, h_r, 128)
    rstd = rms_forward(xv, w, None, None, None, 1e-6, True)[1]
    dx, dw = qk_norm_backward_v1(xv, w, rstd, g, heads, tp_rank * h_r, rows, group)
    assert same(leaves[0].grad, dx) and same(leaves[1].grad, dw), (batch, s, heads, degree, rank, tp, tp_rank)


def test_seg8_qk_norm_backward_in_one_launch_is_v1s_bytes() -> None:
    """12 heads (groups of 2, the last two empty), 9 rows (segments of 2, the last one 1 row, three empty)."""
    check_qk(1, 9, 12)


@pytest.mark.slow
def test_seg8_qk_norm_backward_sweep() -> None:
    """Batch items, 8 and 56 heads, CP and TP ranks (TP2 rank 1: its 4 of 8 groups; CP4 rank 2)."""
    cases = [(1, 19, 12), (2, 29, 8), (1, 83, 56), (1, 83, 16, 4, 2), (1, 37, 16, 1, 0, 2, 1), (2, 40, 8, 2, 1, 2, 0)]
    for args in cases:
        check_qk(*args)


def test_negative_control_norm_segments_shifted_is_not_the_bytes() -> None:
    """The norm comparison can fail: the one-launch backward with segment 1 starting one row late (that row in
    segment 0) gives another float32 weight gradient than v1, while the declared segments give v1's bytes."""
    from h3gate.kernels.norms import rms_backward_segments, rms_forward
    from h3gate.kernels.row_merge import row_sum
    from h3gate.kernels.rows_seg8 import weight_partials
    from tests.triton_kernels.rows_dw_reference import rmsnorm_rows_backward_v1

    (x, w, shift, scale, idx), g = norm_case(1, 83, 16, seed=11)
    x, w, shift, scale, g = (t.float() for t in (x, w, shift, scale, g))
    rows = one_device(83)
    rstd = rms_forward(x, w, shift, scale, idx, 1e-6, True)[1]
    want = rmsnorm_rows_backward_v1(x, w, rstd, g, scale, idx, rows, (True, False, False))[1]
    spans = local_spans(rows)
    shifted = [(spans[0][0], spans[0][1] + 1), (spans[1][0] + 1, spans[1][1]), *spans[2:]]
    got = {}
    for name, sp in (("declared", spans), ("shifted", shifted)):
        _, dwp, _, firsts = rms_backward_segments(x, w, rstd, g, scale, idx, [(a, b - a, 0, 1) for a, b in sp])
        got[name] = finish(row_sum(rows, None, [], x.device, [weight_partials(dwp, firsts)])[0], None, F32)
    assert same(got["declared"], want) and not same(got["shifted"], want)
