"""The row-segment merge order (kernels/row_merge.py, rows_seg8.py) under Triton's interpreter: boundaries a
function of S alone, the ``*_seg8`` row operators' forward and dx bitwise their single-device operators', every
row-sum gradient equal at CP1, CP2, CP4 and CP8 with simulated ranks (each rank's rows and subtree, the subtrees
merged in rank order), the order observable on a crafted row, and the refusal of a shard that is not the group's."""

from __future__ import annotations

import os

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels.elementwise import gate_residual
from h3gate.kernels.gather import table_grad
from h3gate.kernels.gemm import linear
from h3gate.kernels.gemm_configs import gemm_config
from h3gate.kernels.gemm_merge import h3_attention_o_gemm_seg8
from h3gate.kernels.gemm_triton import matmul
from h3gate.kernels.norms import rmsnorm_modulate
from h3gate.kernels.row_merge import RowGroup, cp_row_bounds, dw_bounds, one_device, packed_rows, row_bounds
from h3gate.kernels.rows_seg8 import (
    adaln_gate_residual_seg8,
    h3_rmsnorm_modulate_seg8,
    linear_row_grads,
    table_partials,
)
from h3gate.kernels.tp_layers import h3_ffn_gate_up_gemm_seg8, h3_qk_rmsnorm_d128_seg8, h3_qkv_gemm_seg8

BF16 = torch.bfloat16
S, H, T = 83, 64, 2  # 83 rows: segments of 11, the last one 6 rows
# CPU under the interpreter (tests/conftest.py); ``TRITON_INTERPRET=0`` on a GPU host runs these compiled on CUDA.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def rand(shape, seed: int, scale: float = 1.0, dtype=BF16) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (the same bytes for every device), scaled, cast, moved to DEVICE."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def indices(high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, (S,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_row_bounds_depend_on_s_alone_and_cp_shards_are_whole_segments() -> None:
    assert row_bounds(83) == (0, 11, 22, 33, 44, 55, 66, 77, 83)
    assert row_bounds(3160) == (0, 395, 790, 1185, 1580, 1975, 2370, 2765, 3160)
    assert row_bounds(38974)[1] == 4872 and row_bounds(38974)[-2:] == (34104, 38974)
    assert row_bounds(17) == (0, 3, 6, 9, 12, 15, 17, 17, 17)  # tiny S: trailing segments empty
    for s in (1, 7, 17, 83, 264, 925, 3160, 38974):
        b = row_bounds(s)
        assert b[0] == 0 and b[-1] == s and all(b[i + 1] - b[i] == -(-s // 8) for i in range(8) if b[i + 1] < s)
        for n in (1, 2, 4, 8):
            cp = cp_row_bounds(s, n)
            assert cp[0] == 0 and cp[-1] == s and set(cp) <= set(b)
    assert cp_row_bounds(83, 2) == (0, 44, 83) and cp_row_bounds(3160, 4) == (0, 790, 1580, 2370, 3160)


def _norm_case():
    x, g = rand((1, S, H), 1), rand((1, S, H), 2)
    w = (1 + rand((H,), 3, 0.1).float()).to(BF16)
    tab = rand((3 * T, 2 * H), 4, 0.1)
    idx = indices(3 * T, 5)
    return (x, w, tab[:, :H], tab[:, H:], idx, 1e-6), g, (0, 1, 2, 3)


def _gate_case():
    x, y, g = rand((1, S, H), 6), rand((1, S, H), 7), rand((1, S, H), 8)
    gate = rand((3 * T, 2 * H), 9, 0.1)[:, :H]
    idx = indices(3 * T, 10)
    return (x, y, gate, idx), g, (0, 1, 2)


def _linear_case(n: int = 48, k: int = 32):
    return (rand((1, S, k), 11), rand((n, k), 12, 0.2)), rand((1, S, n), 13), (0, 1)


def _qk_case(heads: int = 8):
    w = (1 + rand((128,), 15, 0.1).float()).to(BF16)
    return (rand((1, S, heads * 128), 14), w, heads, 1e-6), rand((1, S, heads, 128), 16), (0, 1)


CASES = {
    "h3_rmsnorm_modulate_seg8": (h3_rmsnorm_modulate_seg8, rmsnorm_modulate, _norm_case),
    "adaln_gate_residual_seg8": (adaln_gate_residual_seg8, gate_residual, _gate_case),
    "h3_attention_o_gemm_seg8": (h3_attention_o_gemm_seg8, None, _linear_case),
    "h3_qkv_gemm_seg8": (h3_qkv_gemm_seg8, linear, _linear_case),
    "h3_ffn_gate_up_gemm_seg8": (h3_ffn_gate_up_gemm_seg8, linear, _linear_case),
    "h3_qk_rmsnorm_d128_seg8": (h3_qk_rmsnorm_d128_seg8, None, _qk_case),
}


def _run(fn, args, g, grad_args, rows: slice = slice(None)):
    """Forward on the packed rows ``rows`` of every activation argument (dim 1 of 3-d tensors, dim 0 of the (S,)
    index), the backward of ``g``'s same rows; (output, gradients of ``grad_args``)."""
    local = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.ndim == 3:
            a = a[:, rows]
        elif isinstance(a, torch.Tensor) and a.ndim == 1 and a.dtype == torch.int64:
            a = a[rows]
        local.append(a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a)
    out = fn(*local)
    gy = g[:, rows].contiguous()
    out.backward(gy)
    return out.detach(), [local[i].grad for i in grad_args]


def simulated_cp(fn, args, g, grad_args, degree: int):
    """Every CP``degree`` rank's output and gradients: ranks run in turn on their rows; pass 1 records each rank's
    subtree, pass 2 runs again with every subtree known (the all-gather in rank order)."""
    bounds = cp_row_bounds(S, degree)
    subtrees: dict[int, torch.Tensor] = {}
    results = []
    for _ in range(2):
        results = []
        for r in range(degree):
            if bounds[r] == bounds[r + 1]:  # a rank without rows (run ws2 refuses such a plan)
                results.append(None)
                continue

            def gather(t, r=r):
                subtrees[r] = t.clone()
                return [subtrees.get(j, torch.zeros_like(t)) for j in range(degree)]

            with packed_rows(RowGroup(degree, r, S, gather)):
                results.append(_run(fn, args, g, grad_args, slice(bounds[r], bounds[r + 1])))
    return bounds, results


@pytest.mark.parametrize("op", list(CASES))
def test_forward_and_row_gradients_equal_at_every_cp_degree(op: str) -> None:
    fn, single, case = CASES[op]
    args, g, grad_args = case()
    out, grads = _run(fn, args, g, grad_args)
    if single is not None:  # forward and the per-row input gradient are the single-device operator's bytes
        out1, grads1 = _run(single, args, g, grad_args)
        assert torch.equal(out, out1) and torch.equal(grads[0], grads1[0])
    gemm = "gemm" in op  # a GEMM weight gradient's 4 row segments: CP8 would split a pair, refused
    if gemm:
        with pytest.raises(InputError, match="CP degree 8 splits a row segment pair"):
            simulated_cp(fn, args, g, grad_args, 8)
    for degree in (2, 4) if gemm else (2, 4, 8):
        bounds, ranks = simulated_cp(fn, args, g, grad_args, degree)
        for r, result in enumerate(ranks):
            if result is None:
                continue
            (o, gr), lo, hi = result, bounds[r], bounds[r + 1]
            assert torch.equal(o, out[:, lo:hi]), (op, degree, r)
            for i, (got, want) in enumerate(zip(gr, grads, strict=True)):
                local = grad_args[i] == 0 or args[grad_args[i]].ndim == 3
                assert torch.equal(got, want[:, lo:hi] if local else want), (op, degree, r, i)


def test_the_row_order_is_observable_on_a_crafted_column() -> None:
    """dW column 0 = sum over rows of g[r, 0] * 1 at 1024 rows (the weight gradient's 4 segments of 256): 1 in
    segment 0, +2^25 and then -2^25 in segment 1, each in its own dW chunk. The tree gives
    (1 + (2^25 - 2^25)) + (0 + 0) = 1; one ascending walk over all rows gives 0, and so does a CP2 "merge" that walks
    each rank's rows and adds the two sums."""
    f32, rows = torch.float32, 1024
    assert dw_bounds(rows) == (0, 256, 512, 768, 1024)
    x, w = torch.ones((1, rows, 16), dtype=f32, device=DEVICE), torch.zeros((16, 16), dtype=f32, device=DEVICE)
    gy = torch.zeros((1, rows, 16), dtype=f32, device=DEVICE)
    gy[0, 0, 0], gy[0, 256, 0], gy[0, 384, 0] = 1.0, 2.0**25, -(2.0**25)
    _, (dw,) = _run(h3_attention_o_gemm_seg8, (x, w), gy, (1,))
    _, (dw_single,) = _run(linear, (x, w), gy, (1,))
    naive = sum(_run(linear, (x, w), gy, (1,), slice(lo, hi))[1][0] for lo, hi in ((0, 512), (512, rows)))
    assert (dw[0, 0].item(), dw_single[0, 0].item(), naive[0, 0].item()) == (1.0, 0.0, 0.0)


def test_the_weight_gradient_is_the_tree_of_its_four_pair_segments() -> None:
    """One device, FP32 (the kernel's sums unrounded): dW is ``(q0 + q1) + (q2 + q3)`` of the single-walk dW kernel
    on each pair of row segments (``dw_bounds``: 83 rows as 22, 22, 22, 17). Control, a crafted column at 1024 rows:
    1 in row segment 0, +2^25 then -2^25 in row segment 1 (one pair, each in its own chunk); the pair's walk loses
    the 1 (dW 0), where a tree over the 8 row segments keeps it ((1 + 0) + ... = 1)."""
    f32, (n, k) = torch.float32, (48, 32)
    x, gy = rand((1, S, k), 30, dtype=f32), rand((1, S, n), 31, dtype=f32)
    got, _ = linear_row_grads(gy, x, (n, k), (n, k), one_device(S), False)
    bounds, cfg = dw_bounds(S), gemm_config("dw", n, k, f32)
    assert bounds == (0, 22, 44, 66, 83)
    q = [matmul(gy[0, a:b], x[0, a:b], torch.empty((n, k), dtype=f32, device=DEVICE), None, cfg, a_trans=True,
                b_trans=False) for a, b in zip(bounds, bounds[1:], strict=False)]  # fmt: skip
    assert torch.equal(got, (q[0] + q[1]) + (q[2] + q[3]))
    rows = 1024
    xc, gc = torch.ones((1, rows, 16), dtype=f32, device=DEVICE), torch.zeros((1, rows, 16), dtype=f32, device=DEVICE)
    gc[0, 0, 0], gc[0, 128, 0], gc[0, 192, 0] = 1.0, 2.0**25, -(2.0**25)
    dw, _ = linear_row_grads(gc, xc, (16, 16), (16, 16), one_device(rows), False)
    b8, cfg = row_bounds(rows), gemm_config("dw", 16, 16, f32)
    p = [matmul(gc[0, a:b], xc[0, a:b], torch.empty((16, 16), dtype=f32, device=DEVICE), None, cfg, a_trans=True,
                b_trans=False) for a, b in zip(b8, b8[1:], strict=False)]  # fmt: skip
    tree8 = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    assert b8[:3] == (0, 128, 256) and (dw[0, 0].item(), tree8[0, 0].item()) == (0.0, 1.0)


def test_a_shard_that_is_not_the_groups_rows_is_refused() -> None:
    args, g, grad_args = _norm_case()
    with packed_rows(RowGroup(2, 1, S, lambda t: [t, t])), pytest.raises(InputError, match="holds \\[44, 83\\)"):
        _run(h3_rmsnorm_modulate_seg8, args, g, grad_args, slice(0, 40))


def test_a_segment_partial_is_the_single_walk_dw_kernel_on_its_rows() -> None:
    """At the released tiling (128 x 256 x 64; the FP32 output runs 2 pipeline stages instead of 3 on CUDA), the
    segment partial rounded once is the single-walk dW kernel's bytes on the segment's rows: CP4 rank 0 of 160 rows
    holds the weight gradient's segment 0 alone (rows 0-39, the pair of row segments 0 and 1), and the other ranks'
    subtrees are zeros."""
    n, k = 1024, 5376
    assert dw_bounds(160) == (0, 40, 80, 120, 160)
    x, gy = rand((1, 40, k), 20), rand((1, 40, n), 21)
    group = RowGroup(4, 0, 160, lambda t: [t] + [torch.zeros_like(t)] * 3)
    got, _ = linear_row_grads(gy, x, (n, k), (n, k), group, False)
    want = torch.empty((n, k), dtype=BF16, device=DEVICE)
    matmul(gy[0], x[0], want, None, gemm_config("dw", n, k, BF16), a_trans=True, b_trans=False)
    assert torch.equal(got, want)


def test_the_one_pass_table_partials_are_the_per_segment_table_sums() -> None:
    """``table_partials`` (one plan for every segment) gives each segment exactly ``gather.table_grad`` of its rows
    alone: 4099 rows, 2 batch items, 3 table rows, so a (segment, table row) pair spans several 256-row chunks."""
    s, h, rows = 4099, 16, 3
    g, y = rand((2, s, h), 30), rand((2, s, h), 31)
    idx = torch.randint(0, rows, (s,), generator=torch.Generator().manual_seed(32)).to(DEVICE)
    spans = [(lo, hi) for lo, hi in zip(row_bounds(s), row_bounds(s)[1:], strict=False)]
    for other in (None, y):
        got = table_partials(g, idx, rows, spans, other=other)
        for k, (lo, hi) in enumerate(spans):
            o = None if other is None else other[:, lo:hi].contiguous()
            want = table_grad(g[:, lo:hi].contiguous(), idx[lo:hi], rows, torch.float32, other=o)
            assert torch.equal(got[k], want), k


@pytest.mark.parametrize("degree", [1, 2, 4, 8])
def test_the_stacked_row_sum_is_the_declared_tree(degree: int) -> None:
    """row_sum over stacked partials alone (the production callers) and over per-segment partials: the bytes of the
    declared tree written out here, ``((p0 + p1) + (p2 + p3)) + ...`` over the rank's segments, then the merge, at
    every CP degree, for a non-contiguous stack and a stack of two. The control: another pairing of the same
    partials, ``(p0 + p2) + (p1 + p3)``, gives other bytes on this data, so the comparison sees the order."""
    from h3gate.kernels import row_merge

    owned = 8 // degree
    group = RowGroup(degree, degree - 1, S, lambda t: [t * (j + 1) for j in range(degree)])
    a = rand((5, owned, 3), 7, 1e3, torch.float32).transpose(0, 1)  # (owned, 5, 3), not contiguous
    b = rand((owned, 4), 8, 1e-3, torch.float32)

    def declared(rows: list[torch.Tensor]) -> torch.Tensor:
        while len(rows) > 1:
            rows = [rows[j] + rows[j + 1] for j in range(0, len(rows), 2)]
        return rows[0]

    for stacked in ([a], [a, b]):
        rows = [torch.cat([t[k].reshape(-1) for t in stacked]) for k in range(owned)]
        want = group.merge(declared(rows))
        got = row_merge.row_sum(group, None, [], DEVICE, stacked)
        assert [tuple(t.shape) for t in got] == [tuple(t.shape[1:]) for t in stacked]
        assert torch.equal(torch.cat([t.reshape(-1) for t in got]), want)
    starts = [lo for lo, _ in row_merge.local_spans(group)]
    for stacked in ([a], [a, b]):
        rows = [torch.cat([t[k].reshape(-1) for t in stacked]) for k in range(owned)]
        per = row_merge.row_sum(group, lambda lo, hi, rows=rows: [rows[starts.index(lo)]], [rows[0].shape], DEVICE)
        assert torch.equal(per[0], group.merge(declared(rows)))  # the per-segment path, the same tree
    if owned >= 4:
        r = a.reshape(owned, -1)
        assert not torch.equal((r[0] + r[2]) + (r[1] + r[3]), declared([r[0], r[1], r[2], r[3]]))
