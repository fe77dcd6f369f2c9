"""Segmented-8 GEMM under Triton's interpreter: TP1 = TP2 = TP4 = TP8 bitwise with simulated ranks (row-parallel
forward, column-parallel dX, and the unsplit sides with the pinned tiling), the one-device operator equal to TP1, each
segment equal to the single-walk kernel on its K-slice, accuracy vs float64, row invariance, repeat, negative controls
(merge order, boundary, single walk), empty segments, bad inputs, the declared boundaries, and the ws1-ops case."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from h3gate.errors import InputError
from h3gate.kernels import gemm, gemm_merge, gemm_triton
from h3gate.kernels.gemm_merge import linear_merge, rank_slice, segment_partials
from h3gate.kernels.merge_tree import combine, finish, owned_segments
from h3gate.kernels.row_merge import one_device
from h3gate.kernels.rows_seg8 import linear_row_grads
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry

BF16, FP32 = torch.bfloat16, torch.float32
# CPU under the interpreter (the default: tests/conftest.py); ``TRITON_INTERPRET=0`` on a GPU host runs the kernel
# tests compiled on CUDA (the engine/registry tests, which build CPU cases, are then skipped).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
cpu_engine = pytest.mark.skipif(not INTERPRETED, reason="builds CPU cases: interpreter only")
TOL = {BF16: 5e-3, FP32: 1e-5}  # rel-L2 vs float64, as tests/triton_kernels/test_gemm.py
DEGREES = (1, 2, 4, 8)
# (M, K, N, dtype): K = 520 fills all 8 segments (S = 128, the last one 8 wide); K = 200 leaves 4 segments empty;
# K = 70 < 8 * BLOCK_K leaves 6 empty (bounds 0, 64, 70, 70, ...). DX_SHAPES: the same reductions over N for dX.
SHAPES = [(19, 520, 72, BF16), (19, 200, 96, FP32), (5, 70, 72, BF16)]
DX_SHAPES = [(19, 72, 520, BF16), (19, 96, 200, FP32), (5, 40, 72, BF16)]


def ids(shapes: list) -> list[str]:
    return ["x".join(str(v) for v in s[:3]) + ("-bf16" if s[3] == BF16 else "-fp32") for s in shapes]


SEG8_OPS = ("h3_attention_o_gemm_seg8", "h3_ffn_down_gemm_seg8")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (the same bytes for every device), scaled, cast, moved to DEVICE."""
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = gen(seed)
    return rand((m, k), dtype, g), rand((n, k), dtype, g, k**-0.5), rand((n,), dtype, g, 0.1)


def tp_forward(x: torch.Tensor, w: torch.Tensor, degree: int) -> list[torch.Tensor]:
    """Row-parallel forward on ``degree`` simulated ranks: rank r holds X[:, K_r] and W[:, K_r]; returns the
    gathered subtrees in rank order."""
    n, k = w.shape
    subtrees = []
    for rank in range(degree):
        cols = rank_slice("fwd", (n, k), x.dtype, degree, rank)
        owned = owned_segments(degree, rank)
        subtrees.append(segment_partials(x[:, cols].contiguous(), w[:, cols].contiguous(), owned, (n, k), "fwd"))
    return subtrees


def tp_dx(gy: torch.Tensor, w: torch.Tensor, degree: int) -> list[torch.Tensor]:
    """Column-parallel dX on ``degree`` simulated ranks: rank r holds dY[:, N_r] and W[N_r, :]."""
    n, k = w.shape
    subtrees = []
    for rank in range(degree):
        rows = rank_slice("dx", (n, k), gy.dtype, degree, rank)
        owned = owned_segments(degree, rank)
        subtrees.append(segment_partials(gy[:, rows].contiguous(), w[rows].contiguous(), owned, (n, k), "dx"))
    return subtrees


def grads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gy: torch.Tensor):
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = gemm_merge.h3_ffn_down_gemm_seg8(*leaves)
    y.backward(gy)
    return y.detach(), [t.grad for t in leaves]


def test_segment_boundaries_are_declared_and_degree_free() -> None:
    """b_i = min(i * S, R), S = BLOCK_K * ceil(ceil(R / 8) / BLOCK_K); TP ranks own aligned blocks of them; on the
    H3 block's split reductions the segments are equal and fall on the TP8 head/channel boundaries."""
    assert gemm_merge.segment_bounds(1000, 64) == (0, 128, 256, 384, 512, 640, 768, 896, 1000)
    assert gemm_merge.segment_bounds(70, 64) == (0, 64, 70, 70, 70, 70, 70, 70, 70)
    assert gemm_merge.segment_bounds(5376, 64) == (0, 704, 1408, 2112, 2816, 3520, 4224, 4928, 5376)
    assert [list(owned_segments(4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    real = load_config("real").config
    split = {  # (role, full weight (N, K)): the reduction TP splits, and its TP8 unit (heads or channels)
        ("fwd", (real.hidden_size, real.inner_dim)): real.inner_dim // 8,  # o: 7 heads of 128
        ("fwd", (real.hidden_size, real.ffn_dim)): real.ffn_dim // 8,  # down
        ("dx", (real.inner_dim, real.hidden_size)): real.inner_dim // 8,  # q/k/v dX
        ("dx", (2 * real.ffn_dim, real.hidden_size)): real.ffn_dim // 4,  # gate/up dX
    }
    for (role, shape), unit in split.items():
        for degree in DEGREES:
            for rank in range(degree):
                s = rank_slice(role, shape, BF16, degree, rank)
                width = unit * 8 // degree
                assert (s.start, s.stop) == (rank * width, (rank + 1) * width), (role, shape, degree, rank)


@pytest.mark.parametrize(("m", "k", "n", "dtype"), SHAPES, ids=ids(SHAPES))
def test_row_parallel_forward_tp1_tp2_tp4_tp8_bitwise(m, k, n, dtype) -> None:
    x, w, b = make(m, k, n, dtype)
    totals = [combine(tp_forward(x, w, d), d) for d in DEGREES]
    outs = [finish(t, b, dtype) for t in totals]
    for d, total, out in zip(DEGREES, totals, outs, strict=True):
        assert torch.equal(total, totals[0]) and torch.equal(out, outs[0]), f"TP{d}"
    assert torch.equal(linear_merge(x, w, b), outs[0])  # the one-device operator is TP1
    assert rel(outs[0], F.linear(x.double(), w.double(), b.double())) < TOL[dtype]


@pytest.mark.parametrize(("m", "k", "n", "dtype"), DX_SHAPES, ids=ids(DX_SHAPES))
def test_column_parallel_dx_tp1_tp2_tp4_tp8_bitwise(m, k, n, dtype) -> None:
    """dX = dY @ W reduces over N, which column parallelism splits: every degree gives the autograd dX's bytes."""
    x, w, _ = make(m, k, n, dtype)
    gy = rand((m, n), dtype, gen(3))
    leaf = x.clone().requires_grad_()  # dX only (no dW launch)
    linear_merge(leaf, w).backward(gy)
    dx = leaf.grad
    for d in DEGREES:
        assert torch.equal(finish(combine(tp_dx(gy, w, d), d), None, dtype), dx), f"TP{d}"
    assert rel(dx, gy.double() @ w.double()) < TOL[dtype]


@pytest.mark.parametrize(("m", "k", "n", "dtype"), DX_SHAPES, ids=ids(DX_SHAPES))
def test_one_device_total_and_column_slices_keep_the_bytes(m, k, n, dtype) -> None:
    """``segment_total`` (the whole tree rounded in the kernel) is ``finish`` of TP1's subtree, for dX and the
    forward; a column slice of a wider dY (strided rows, as the gate/up halves are read) gives its contiguous copy's
    bytes, whole and on a TP2 rank's segments. Control: the slice's neighbour columns give other bytes."""
    x, w, _ = make(m, k, n, dtype)
    wide = rand((m, 2 * n + 8), dtype, gen(4))
    gy = wide[:, n + 8 :]  # strided rows: the second half of a fused (value | gate) gradient
    assert not gy.is_contiguous() and gy.stride(-1) == 1
    whole = segment_partials(gy.contiguous(), w, range(8), (n, k), "dx").clone()
    assert torch.equal(segment_partials(gy, w, range(8), (n, k), "dx"), whole)
    assert torch.equal(gemm_merge.segment_total(gy, w, (n, k), "dx", out_dtype=dtype), finish(whole, None, dtype))
    half = rank_slice("dx", (n, k), dtype, 2, 1)
    sub = segment_partials(gy[:, half].contiguous(), w[half], range(4, 8), (n, k), "dx").clone()
    assert torch.equal(segment_partials(gy[:, half], w[half], range(4, 8), (n, k), "dx"), sub)
    assert not torch.equal(segment_partials(wide[:, :n], w, range(8), (n, k), "dx"), whole)
    xf, wf, b = make(m, n, k, dtype)
    assert torch.equal(gemm_merge.segment_total(xf, wf, (k, n), "fwd", out_dtype=dtype),
                       finish(segment_partials(xf, wf, range(8), (k, n)), None, dtype))  # fmt: skip


def test_unsplit_sides_use_the_pinned_tiling() -> None:
    """The other side of each layer: a column-parallel forward (N_r output columns, all 8 K segments), a row-parallel
    dX (K_r output columns, all 8 N segments) and a rank's dW (the row-segment order over M, the full layer's dw
    tiling) are column slices of the one-device result."""
    m, k, n = 19, 200, 96
    x, w, _ = make(m, k, n, BF16)
    gy = rand((m, n), BF16, gen(4))
    y, (dx, dw) = grads(x, w, None, gy)
    for degree in (4,):
        for rank in range(degree):
            nc = slice(rank * n // degree, (rank + 1) * n // degree)
            kc = slice(rank * k // degree, (rank + 1) * k // degree)
            y_r = segment_partials(x, w[nc].contiguous(), range(8), (n, k), "fwd")
            assert torch.equal(finish(y_r, None, BF16), y[:, nc]), ("column-parallel forward", degree, rank)
            dx_r = segment_partials(gy, w[:, kc].contiguous(), range(8), (n, k), "dx")
            assert torch.equal(finish(dx_r, None, BF16), dx[:, kc]), ("row-parallel dX", degree, rank)
            xs = x[:, kc].contiguous()
            dw_r = linear_row_grads(gy, xs, (n, kc.stop - kc.start), (n, k), one_device(m), False)[0]
            assert torch.equal(dw_r, dw[:, kc]), ("dW columns", degree, rank)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_each_segment_is_the_single_walk_kernel_on_its_slice(dtype) -> None:
    """Segment j's FP32 partial is the single-walk kernel (unrounded FP32 output) on the K-slice; the one-device
    total is ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)) of those partials."""
    m, k, n = 19, 520, 72
    x, w, _ = make(m, k, n, dtype)
    cfg = gemm_merge.pinned_config("fwd", (n, k), dtype)
    bounds = gemm_merge.segment_bounds(k, cfg.block_k)
    p = []
    for j in range(8):
        xs, ws = x[:, bounds[j] : bounds[j + 1]].contiguous(), w[:, bounds[j] : bounds[j + 1]].contiguous()
        part = segment_partials(xs, ws, range(j, j + 1), (n, k), "fwd")
        single = gemm_triton.matmul(
            xs, ws, torch.empty((m, n), dtype=FP32, device=DEVICE), None, cfg, a_trans=False, b_trans=True
        )
        assert torch.equal(part, single), f"segment {j}"
        p.append(part)
    tree = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    assert torch.equal(combine(tp_forward(x, w, 1), 1), tree)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_backward_accuracy_vs_float64(dtype) -> None:
    x, w, b = make(2 * 19, 200, 72, dtype)
    x = x.view(2, 19, 200)
    gy = rand((2, 19, 72), dtype, gen(1))
    y, got = grads(x, w, b, gy)
    golden = [t.double().requires_grad_() for t in (x, w, b)]
    F.linear(*golden).backward(gy.double())
    assert y.shape == (2, 19, 72) and rel(y, F.linear(*(t.detach() for t in golden))) < TOL[dtype]
    for g, want, name in zip(got, golden, ("dx", "dw", "db"), strict=True):
        assert g.dtype == dtype and g.shape == want.shape, name
        assert rel(g, want.grad) < TOL[dtype], name


def test_rows_do_not_depend_on_m_or_other_rows() -> None:
    x, w, b = make(19, 200, 72, BF16)
    gy = rand((19, 72), BF16, gen(5))
    y, (dx, _, _) = grads(x, w, b, gy)
    g = gen(7)
    for r in (0, 18):
        y1, (dx1, _, _) = grads(x[r : r + 1], w, b, gy[r : r + 1])
        assert torch.equal(y1[0], y[r]) and torch.equal(dx1[0], dx[r]), f"row {r} alone (M=1)"
        others, g_others = rand((5, 200), BF16, g), rand((5, 72), BF16, g)
        others[2], g_others[2] = x[r], gy[r]
        y5, (dx5, _, _) = grads(others, w, b, g_others)
        assert torch.equal(y5[2], y[r]) and torch.equal(dx5[2], dx[r]), f"row {r} inside M=5"


def test_repeat_bitwise_forward_and_backward() -> None:
    x, w, b = make(19, 200, 72, BF16)
    gy = torch.ones(19, 72, dtype=BF16, device=DEVICE)
    first, second = (grads(x, w, b, gy) for _ in range(2))
    assert torch.equal(first[0], second[0])
    for a, c in zip(first[1], second[1], strict=True):
        assert torch.equal(a, c)


def test_merge_order_and_boundaries_are_observable(monkeypatch) -> None:
    """Negative controls. Row 0 has 1 in segment 0 and +-2^25 in segments 2 and 3 (W = ones): the declared tree
    cancels the large values first, ((1 + 0) + (2^25 - 2^25)) = 1; another combine order, a moved boundary, or the
    single walk add 1 to 2^25 first (absorbed in FP32) and give 0 - in the bf16 output bytes."""
    k, n = 512, 8  # BLOCK_K 64: S = 64, one chunk per segment
    x = torch.zeros(2, k, dtype=BF16, device=DEVICE)
    x[0, 0], x[0, 128], x[0, 192] = 1.0, 2.0**25, -(2.0**25)
    x[1] = rand((k,), BF16, gen(0))
    w = torch.ones(n, k, dtype=BF16, device=DEVICE)
    y = linear_merge(x, w)
    assert (y[0] == 1).all()
    p = tp_forward(x, w, 8)
    swapped = ((p[0] + p[2]) + (p[1] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    assert (finish(swapped, None, BF16)[0] == 0).all()  # another merge order
    assert (gemm.linear(x, w)[0] == 0).all()  # the single walk: not bitwise with it, by design
    monkeypatch.setattr(gemm_merge, "segment_size", lambda r, block_k: 3 * block_k)
    assert gemm_merge.segment_bounds(k, 64) == (0, 192, 384, 512, 512, 512, 512, 512, 512)
    assert (linear_merge(x, w)[0] == 0).all()  # a moved boundary


def test_another_combine_order_changes_fp32_bytes_on_random_data() -> None:
    x, w, _ = make(19, 520, 72, FP32, seed=11)
    p = tp_forward(x, w, 8)
    declared = combine(p, 8)
    left_fold = p[0]
    for s in p[1:]:
        left_fold = left_fold + s
    assert not torch.equal(left_fold, declared)
    assert torch.equal(combine([p[0] + p[1], p[2] + p[3], p[4] + p[5], p[6] + p[7]], 4), declared)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda x, w, b: gemm_merge.h3_attention_o_gemm_seg8(x.half(), w, b),
            "h3_attention_o_gemm_seg8: x: dtype float16",
        ),
        (
            lambda x, w, b: gemm_merge.h3_attention_o_gemm_seg8(x, w.float(), b),
            "h3_attention_o_gemm_seg8: weight: dtype",
        ),
        (lambda x, w, b: gemm_merge.h3_ffn_down_gemm_seg8(x[:, :64], w, b), "h3_ffn_down_gemm_seg8: x: non-contiguous"),
        (
            lambda x, w, b: gemm_merge.h3_ffn_down_gemm_seg8(x, w[:5], b),
            "h3_ffn_down_gemm_seg8: bias: length 96 != out",
        ),
        (
            lambda x, w, b: segment_partials(x, w, range(1, 3), (96, 130)),
            "gemm_seg8: owned: range(1, 3) is not an aligned",
        ),
        (lambda x, w, b: segment_partials(x, w, range(8), (96, 130), "dw"), "gemm_seg8: role: 'dw'"),
        (lambda x, w, b: segment_partials(x, w, range(8), (96, 0)), "gemm_seg8: full_shape: (96, 0)"),
        (
            lambda x, w, b: segment_partials(x.T.contiguous().T, w, range(8), (96, 130)),
            "gemm_seg8: a_local: non-contiguous tensor",
        ),
        (lambda x, w, b: segment_partials(x, w, range(2), (96, 130)), "gemm_seg8: a_local: last dim 130, expected 128"),
        (
            lambda x, w, b: segment_partials(x, w.T.contiguous(), range(8), (96, 130)),
            "gemm_seg8: b_local: shape (130, 96)",
        ),
        (lambda x, w, b: segment_partials(x, w.float(), range(8), (96, 130)), "gemm_seg8: b_local: dtype float32"),
        (lambda x, w, b: combine([x.float()] * 3, 3), "gemm_seg8: degree: 3"),
        (lambda x, w, b: combine([x.float()], 2), "gemm_seg8: subtrees: 1 given, expected one per rank (2)"),
        (lambda x, w, b: combine([x.float(), x], 2), "gemm_seg8: subtrees[1]: dtype bfloat16 not supported"),
        (lambda x, w, b: finish(x.float(), b, torch.float16), "gemm_seg8: dtype: float16 not supported"),
        (lambda x, w, b: owned_segments(8, 8), "gemm seg8: TP degree 8 rank 8"),
    ],
)
def test_invalid_inputs_name_the_operator(call, message) -> None:
    with pytest.raises(InputError) as err:
        call(*make(5, 130, 96, BF16))
    assert str(err.value).startswith(message), str(err.value)


@cpu_engine
@pytest.mark.parametrize("op", SEG8_OPS)
def test_binding_and_case_on_tiny_config(op) -> None:
    """Each entry binds to its strict kernel (rfc row ws2_tp2_tp4_tp8) and matches the float64 golden on its case."""
    from h3gate.ops.cases_gemm import CASES

    bound = registry.bind(op, "strict", "cpu")
    assert (bound.actual, bound.label, bound.kernel_id, bound.rfc_row) == (
        "triton",
        "row",
        gemm_merge.KERNEL_ID,
        "ws2_tp2_tp4_tp8",
    )
    assert bound.fn is getattr(gemm_merge, op) and not registry.spec(op).contract.provider_bitwise
    case = CASES[op](6, load_config("tiny").config, "cpu", 0)
    got = case.call(bound.fn)
    assert rel(got, case.golden_call(registry.reference(op))) < TOL[BF16]


@cpu_engine
def test_ws1_ops_engine_passes_forward_and_backward() -> None:
    """The ws1-ops engine on the O-projection entry: accuracy, row rule, repeat/batch/mutation/prefix invariance."""
    from h3gate.runs.ws1_ops import run_case

    result = run_case("h3_attention_o_gemm_seg8", 12, load_config("tiny").config, "cpu", seed=1, backward=True)
    assert result.failures == [] and result.record["verdict"] == "pass"
    assert result.record["invariance"]["prefix"]["forward"] is True


@cpu_engine
def test_bench_entry_runs_with_its_declared_target(monkeypatch) -> None:
    """``h3gate bench --op h3_ffn_down_gemm_seg8`` builds its case, really runs kernel and provider (forward and
    forward + backward; timings faked here, no GPU) and is gated by the target declared in the manifest."""
    from h3gate.bench import ops as bench_ops

    def fake(fns, iters=50, warmup=5, head_start_us=0.0):
        for fn in fns.values():
            fn()
        ms = {"kernel": 1.1, "provider": 1.0}
        return {k: {"median_ms": ms[k], "min_ms": ms[k], "max_ms": ms[k], "iters": iters} for k in fns}

    real_case = bench_ops.build_case
    monkeypatch.setattr(
        bench_ops, "build_case", lambda op, rows, cfg, device, seed: real_case(op, 9, cfg, device, seed)
    )
    monkeypatch.setattr(bench_ops, "side_by_side", fake)
    rec = bench_ops.bench_op("h3_ffn_down_gemm_seg8", 264, load_config("tiny").config, "cpu", copy_gbs=1.0)
    assert rec["binding"]["kernel_id"] == gemm_merge.KERNEL_ID and rec["forward_backward"] is not None
    assert (rec["target"]["rows_bucket"], rec["target"]["min_ratio"]) == ("rows < 1024", 0.8)
    assert "issue 18" in rec["target"]["source"] and rec["verdict"] == "pass"  # 1 / 1.1 = 0.91 >= 0.8
