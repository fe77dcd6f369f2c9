"""The TP layers (kernels/tp_layers.py) under Triton's interpreter: the column-parallel twins (Q/K/V, gate/up)
forward bitwise the single walk, their dX and the QK-norm weight gradient equal at TP1, TP2, TP4 and TP8 with
simulated ranks (every rank's subtree computed, then merged in rank order), dW (one row segment here) the single
walk's, accuracy against float64, and the alignment check's refusals. The row-segment order: test_row_merge.py."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels.gemm import linear
from h3gate.kernels.gemm_merge import segment_partials
from h3gate.kernels.merge_tree import owned_segments
from h3gate.kernels.norms import qk_rmsnorm
from h3gate.kernels.tp_layers import (
    ColumnLinear,
    MergeGroup,
    QkNormGrouped,
    check_alignment,
    h3_ffn_gate_up_gemm_seg8,
    h3_qk_rmsnorm_d128_seg8,
    h3_qkv_gemm_seg8,
    head_groups,
)

BF16 = torch.bfloat16
DEGREES = (1, 2, 4, 8)


def rand(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def grads(fn, x, w, gy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(x, w).backward(gy)
    return x.grad, w.grad


def rank_rows(n_full: int, degree: int, rank: int, halves: bool) -> torch.Tensor:
    if not halves:
        return torch.arange(rank * n_full // degree, (rank + 1) * n_full // degree)
    f = n_full // 2
    part = torch.arange(rank * f // degree, (rank + 1) * f // degree)
    return torch.cat([part, part + f])


def simulated_column_dx(x, w, gy, degree: int, halves: bool) -> torch.Tensor:
    """dX of a column-parallel layer as TP``degree`` ranks compute it: each rank's subtree from its rows, merged."""
    n, k = w.shape
    g2 = gy.reshape(-1, n)
    subs: list[list[torch.Tensor]] = []
    for r in range(degree):
        rows = rank_rows(n, degree, r, halves)
        ga, wa = g2[:, rows].contiguous(), w[rows].contiguous()
        if halves:
            f = len(rows) // 2
            subs.append([segment_partials(ga[:, s].contiguous(), wa[s], owned_segments(degree, r), (n // 2, k), "dx")
                         .clone() for s in (slice(0, f), slice(f, 2 * f))])  # fmt: skip
        else:
            subs.append([segment_partials(ga, wa, owned_segments(degree, r), (n, k), "dx").clone()])
    calls = iter(range(len(subs[0])))  # the value half's all-gather first, then the gate half's

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        i = next(calls)
        return [s[i] for s in subs]

    group = MergeGroup(degree, 0, gather)
    rows = rank_rows(n, degree, 0, halves)
    xr = x.clone().requires_grad_()
    ColumnLinear.apply(xr, w[rows].contiguous(), (n, k), halves, group).backward(gy[..., rows])
    return xr.grad


@pytest.mark.parametrize(("op", "halves"), [(h3_qkv_gemm_seg8, False), (h3_ffn_gate_up_gemm_seg8, True)])
def test_column_twins_forward_bitwise_single_walk_and_dx_equal_at_every_degree(op, halves) -> None:
    x, w = rand((2, 9, 192), 0), rand((1024, 192), 1, 192**-0.5)
    gy = rand((2, 9, 1024), 2)
    assert torch.equal(op(x, w), linear(x, w))
    dx, dw = grads(op, x, w, gy)
    _, dw_single = grads(linear, x, w, gy)
    assert torch.equal(dw, dw_single)  # dW in the row-segment order: 9 rows are one segment, the single walk's bytes
    for degree in DEGREES:
        assert torch.equal(simulated_column_dx(x, w, gy, degree, halves), dx), degree
    ref = gy.double().reshape(-1, 1024) @ w.double()
    assert float((dx.double().reshape(-1, 192) - ref).norm() / ref.norm()) < 5e-3


def test_a_column_forward_is_the_single_walk_whole_or_on_a_rank_s_rows_with_or_without_a_graph() -> None:
    """TP1's forward with a graph runs the operator's declared path, a rank's by the Triton kernel on its rows with
    the full layer's tiling: both the single walk's bytes, column for column."""
    x, w = rand((2, 9, 192), 3), rand((1024, 192), 4, 192**-0.5)
    plain = linear(x, w)
    whole = ColumnLinear.apply(x.clone().requires_grad_(), w, (1024, 192), False, MergeGroup(1, 0, lambda t: [t]))
    assert torch.equal(whole.detach(), plain)
    for degree in (2, 8):
        rows = rank_rows(1024, degree, degree - 1, False)
        group = MergeGroup(degree, degree - 1, lambda t, n=degree: [t] * n)
        part = ColumnLinear.apply(x.clone().requires_grad_(), w[rows].contiguous(), (1024, 192), False, group)
        assert torch.equal(part.detach(), plain[..., rows]), degree


def test_the_qkv_twin_groups_siblings_without_a_graph_and_keeps_its_backward_with_one(monkeypatch) -> None:
    """q, k, v by one grouped call of the single walk when nothing needs a graph (bitwise the calls one by one); with
    a graph, the twin a weight at a time, so the dX stays in the segmented-8 order."""
    from h3gate.kernels import tp_layers

    calls: list[int] = []
    real = tp_layers.linear_grouped
    monkeypatch.setattr(tp_layers, "linear_grouped", lambda x, ws, op: calls.append(len(ws)) or real(x, ws, op=op))
    x = rand((2, 9, 192), 5)
    ws = [rand((256, 192), 6 + i, 192**-0.5) for i in range(3)]
    outs = h3_qkv_gemm_seg8.grouped(x, ws)
    assert calls == [3] and all(torch.equal(o, h3_qkv_gemm_seg8(x, w)) for o, w in zip(outs, ws, strict=True))
    xg = x.clone().requires_grad_()
    sum(o.float().sum() for o in h3_qkv_gemm_seg8.grouped(xg, ws)).backward()
    assert calls == [3]  # the graph path never grouped
    x1 = x.clone().requires_grad_()
    sum(h3_qkv_gemm_seg8(x1, w).float().sum() for w in ws).backward()
    assert torch.equal(xg.grad, x1.grad)


def test_the_gate_up_halves_are_their_own_trees() -> None:
    """Negative control: the gate/up dX is two trees (value half, gate half) added once, not one seg8 tree over the
    fused N. A crafted row (N = 640, F = 320): 1 at n = 0, +2^25 at n = 300 (value half) and -2^25 at n = 330 (gate
    half, index 10). The fused order cancels the two large terms inside one segment first (dX = 1); the halves add
    1 to 2^25 first, which loses it (dX = 0)."""
    x = torch.zeros(1, 1, 64, dtype=torch.float32)
    w = torch.ones(640, 64, dtype=torch.float32)
    gy = torch.zeros(1, 1, 640, dtype=torch.float32)
    gy[0, 0, 0], gy[0, 0, 300], gy[0, 0, 330] = 1.0, 2.0**25, -(2.0**25)
    fused, _ = grads(h3_qkv_gemm_seg8, x, w, gy)
    pairs, _ = grads(h3_ffn_gate_up_gemm_seg8, x, w, gy)
    assert float(fused[0, 0, 0]) == 1.0 and float(pairs[0, 0, 0]) == 0.0


@pytest.mark.parametrize("degree", DEGREES)
def test_qk_norm_weight_gradient_in_head_groups_equal_at_every_degree(degree) -> None:
    heads = 8
    x, w = rand((2, 7, heads * 128), 6), rand((128,), 7)
    gy = rand((2, 7, heads, 128), 8)
    out = h3_qk_rmsnorm_d128_seg8(x, w, heads, 1e-5)
    assert torch.equal(out, qk_rmsnorm(x, w, heads, 1e-5))
    dx, dw = grads(lambda a, b: h3_qk_rmsnorm_d128_seg8(a, b, heads, 1e-5), x, w, gy)
    dx_plain, dw_plain = grads(lambda a, b: qk_rmsnorm(a, b, heads, 1e-5), x, w, gy)
    assert torch.equal(dx, dx_plain)
    assert (dw.float() - dw_plain.float()).abs().max() <= 2e-2 * dw_plain.float().abs().max()
    if degree == 1:
        return  # TP1 is the operator itself (above)
    per = heads // degree
    subs, dxs = [], []
    for r in range(degree):
        xl = x[..., r * per * 128 : (r + 1) * per * 128].contiguous().requires_grad_()
        wl = w.clone().requires_grad_()
        seen: list[torch.Tensor] = []  # the rank's subtree, as it hands it to the all-gather
        group = MergeGroup(degree, r, lambda t, seen=seen: seen.append(t.clone()) or [t] * degree)
        QkNormGrouped.apply(xl, wl, heads, r * per, 1e-5, group).backward(gy[..., r * per : (r + 1) * per, :])
        subs.append(seen[0])
        dxs.append(xl.grad)
    merged = MergeGroup(degree, 0, lambda t: subs)
    xl = x[..., : per * 128].contiguous().requires_grad_()
    wl = w.clone().requires_grad_()
    QkNormGrouped.apply(xl, wl, heads, 0, 1e-5, merged).backward(gy[..., :per, :])
    assert torch.equal(wl.grad, dw) and torch.equal(torch.cat(dxs, dim=-1), dx)


def test_head_groups_and_alignment_refusals() -> None:
    assert head_groups(56) == (0, 7, 14, 21, 28, 35, 42, 49, 56)
    assert head_groups(2) == (0, 1, 2, 2, 2, 2, 2, 2, 2)
    check_alignment(8, 56, 128, 5376, 14336, BF16)  # the released widths: every degree aligns
    with pytest.raises(InputError, match="TP2 rank 0: attention O forward: its segments cover"):
        check_alignment(2, 2, 128, 192, 384, BF16)  # the tiny config: 2 heads, one segment each
    with pytest.raises(InputError, match="must both divide by 8"):
        check_alignment(8, 12, 128, 192, 512, BF16)
