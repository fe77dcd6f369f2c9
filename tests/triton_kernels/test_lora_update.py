"""Strict LoRA update ``h3_lora_update`` under Triton's interpreter: forward and backward against the float64 golden
(the PEFT reference on float64 copies) for bf16 and float32 adapters on bf16 activations, ranks 1..64 as the first
GEMM's N and the second GEMM's K with odd M/K/N, the declared cast points, batch-row invariance of the output and dX,
repeat-bitwise dA/dB, bad inputs, the registry binding and the ws1-ops case through the gate engine."""

from __future__ import annotations

import pytest
import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.kernels import gemm_configs, lora
from h3gate.kernels.gemm_configs import gemm_config
from h3gate.manifests.model_config import load_config
from h3gate.ops import cases, cases_gemm, registry
from h3gate.ops.reference import lora_update
from h3gate.runs.ws1_ops import run_case

BF16, FP32 = torch.bfloat16, torch.float32
OP = "h3_lora_update"
CFG = load_config("tiny").config
ACC = registry.spec(OP).contract.accuracy  # rel_l2 bounds declared in the manifest, by compared dtype
SCALING = 24.0 / 9  # lora_alpha / r not representable in binary: the multiply rounds
DTYPES = [
    pytest.param(BF16, BF16, id="x_bf16-adapter_bf16"),
    pytest.param(BF16, FP32, id="x_bf16-adapter_fp32"),  # PEFT's default for a bf16 base (autocast_adapter_dtype)
    pytest.param(FP32, FP32, id="x_fp32-adapter_fp32"),
    pytest.param(FP32, BF16, id="x_fp32-adapter_bf16"),  # the cast to the adapter rounds x
]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def make(m: int, k: int, r: int, n: int, x_dtype, adapter_dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    a = (torch.randn(r, k, generator=g) * k**-0.5).to(adapter_dtype)
    b = (torch.randn(n, r, generator=g) * r**-0.5).to(adapter_dtype)
    return x, a, b


def grads(fn, x, a, b, gy, scaling=SCALING):
    """Output and (dX, dA, dB) of ``fn`` for the output gradient ``gy``."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    y = fn(*leaves, scaling)
    y.backward(gy)
    return y.detach(), [t.grad for t in leaves]


def golden(x, a, b, gy, scaling=SCALING):
    return grads(lora_update, x.double(), a.double(), b.double(), gy.double(), scaling)


def check_vs_golden(x, a, b, seed: int = 1) -> None:
    n = b.shape[0]
    gy = torch.randn(*x.shape[:-1], n, generator=torch.Generator().manual_seed(seed)).to(a.dtype)
    y, (dx, da, db) = grads(lora.h3_lora_update, x, a, b, gy)
    y64, (dx64, da64, db64) = golden(x, a, b, gy)
    assert y.dtype == a.dtype and y.shape == (*x.shape[:-1], n)
    assert rel(y, y64) < ACC.forward[dtype_name(a.dtype)]
    for got, want, src, name in ((dx, dx64, x, "dx"), (da, da64, a, "da"), (db, db64, b, "db")):
        assert got.dtype == src.dtype and got.shape == src.shape, name
        # dX of a float32 x on a bf16 adapter went through bf16 GEMMs: the coarser dtype's bound applies.
        bound = max(ACC.backward[dtype_name(got.dtype)], ACC.backward[dtype_name(a.dtype)])
        assert rel(got, want) < bound, name


@pytest.mark.parametrize(("x_dtype", "adapter_dtype"), DTYPES)
def test_forward_and_backward_match_float64_golden(x_dtype, adapter_dtype) -> None:
    x, a, b = make(37, 130, 4, 97, x_dtype, adapter_dtype)
    check_vs_golden(x.view(1, 37, 130), a, b)


@pytest.mark.parametrize("rank", [1, 2, 3, 16, 33, 64])
@pytest.mark.parametrize("adapter_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_rank_1_to_64_as_gemm_n_and_k_with_odd_shapes(rank, adapter_dtype) -> None:
    """r is the first GEMM's N and the second GEMM's K (below BLOCK_K: one masked chunk); M, K, N odd."""
    x, a, b = make(19, 67, rank, 45, BF16, adapter_dtype, seed=rank)
    check_vs_golden(x, a, b)


def test_cast_points_are_the_declared_roundings() -> None:
    """Integer data: every FP32 accumulation is exact, so the output must be exactly the float64 chain rounded (RNE)
    at the declared points: H once to bf16, Y once to bf16, Y * s in FP32 opmath once to bf16. Dropping a rounding
    (H or Y kept in FP32) gives other bytes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-8, 9, (37, 130), generator=g).to(BF16)
    a = torch.randint(-8, 9, (5, 130), generator=g).to(BF16)
    b = torch.randint(-8, 9, (97, 5), generator=g).to(BF16)
    scaling = 1.3
    h = (x.double() @ a.double().T).to(BF16)
    assert (h.double() != x.double() @ a.double().T).any()  # bf16 holds 8 significant bits: H really rounds
    y = (h.double() @ b.double().T).to(BF16)
    want = (y.float() * torch.tensor(scaling, dtype=FP32)).to(BF16)
    got = lora.h3_lora_update(x, a, b, scaling)
    assert torch.equal(got, want)
    unrounded_h = ((x.double() @ a.double().T) @ b.double().T).to(BF16)
    assert not torch.equal((unrounded_h.float() * scaling).to(BF16), want)


@pytest.mark.parametrize("adapter_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_row_bytes_of_output_and_dx_do_not_depend_on_other_rows_or_batch(adapter_dtype) -> None:
    x, a, b = make(37, 130, 16, 97, BF16, adapter_dtype)
    gy = torch.randn(37, 97, generator=torch.Generator().manual_seed(3)).to(adapter_dtype)
    y, (dx, _, _) = grads(lora.h3_lora_update, x, a, b, gy)
    g = torch.Generator().manual_seed(7)
    for r in (0, 17, 36):
        y1, (dx1, _, _) = grads(lora.h3_lora_update, x[r : r + 1], a, b, gy[r : r + 1])
        assert torch.equal(y1[0], y[r]) and torch.equal(dx1[0], dx[r]), f"row {r} alone (M=1)"
        xs = torch.randn(3, 5, 130, generator=g).to(BF16)  # a batch of 3 items of 5 rows, the row in item 1
        gys = torch.randn(3, 5, 97, generator=g).to(adapter_dtype)
        xs[1, 2], gys[1, 2] = x[r], gy[r]
        yb, (dxb, _, _) = grads(lora.h3_lora_update, xs, a, b, gys)
        assert torch.equal(yb[1, 2], y[r]) and torch.equal(dxb[1, 2], dx[r]), f"row {r} inside a batch of 3"


def test_repeat_bitwise_forward_and_every_gradient() -> None:
    x, a, b = make(37, 130, 16, 97, BF16, FP32)
    gy = torch.randn(37, 97, generator=torch.Generator().manual_seed(2))
    first = grads(lora.h3_lora_update, x, a, b, gy)
    second = grads(lora.h3_lora_update, x, a, b, gy)
    assert torch.equal(first[0], second[0])
    for one, two, name in zip(first[1], second[1], ("dx", "da", "db"), strict=True):
        assert torch.equal(one, two), name


def test_no_grad_call_gives_the_autograd_bytes() -> None:
    x, a, b = make(21, 67, 8, 45, BF16, BF16)
    with torch.no_grad():
        direct = lora.h3_lora_update(x, a, b, SCALING)
    graph = lora.h3_lora_update(x, a.clone().requires_grad_(), b, SCALING)
    assert graph.grad_fn is not None and torch.equal(direct, graph.detach())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x, a, b, s: (x.half(), a, b, s), "h3_lora_update: x: dtype float16 not supported"),
        (lambda x, a, b, s: (x, a.half(), b, s), "h3_lora_update: lora_a: dtype float16 not supported"),
        (lambda x, a, b, s: (x, a, b.float(), s), "h3_lora_update: lora_b: dtype float32 differs from lora_a"),
        (lambda x, a, b, s: (x[:, :64], a, b, s), "h3_lora_update: x: non-contiguous tensor"),
        (lambda x, a, b, s: (x[:, :64].contiguous(), a, b, s), "h3_lora_update: lora_a: in_features 130 != x last"),
        (lambda x, a, b, s: (x, a, b[:, :3].contiguous(), s), "h3_lora_update: lora_b: rank 3 != lora_a rank 4"),
        (lambda x, a, b, s: (x, a, b.T.contiguous(), s), "h3_lora_update: lora_b: rank 97 != lora_a rank 4"),
        (lambda x, a, b, s: (x[:0], a, b, s), "h3_lora_update: x: empty tensor (0, 130)"),
        (lambda x, a, b, s: (x, a.to("meta"), b, s), "h3_lora_update: lora_a: on meta, expected cpu"),
        (lambda x, a, b, s: (x, a, b.to("meta"), s), "h3_lora_update: lora_b: on meta, expected cpu"),
        (lambda x, a, b, s: (x, a[None], b, s), "h3_lora_update: lora_a: expected 2 dims"),
        (lambda x, a, b, s: (x, a, b, torch.tensor(1.5)), "h3_lora_update: scaling: expected a finite Python float"),
        (lambda x, a, b, s: (x, a, b, float("nan")), "h3_lora_update: scaling: expected a finite Python float"),
    ],
)
def test_invalid_inputs_name_operator_and_argument(mutate, message) -> None:
    with pytest.raises(InputError) as err:
        lora.h3_lora_update(*mutate(*make(5, 130, 4, 97, BF16, BF16), SCALING))
    assert str(err.value).startswith(message), str(err.value)


def test_gemm_tilings_for_lora_shapes_do_not_depend_on_m() -> None:
    """No tiling change was needed: the rank-sized GEMMs take the dtype defaults (narrowed from N and K only), in no
    M bucket, so every M gets one K walk; BLOCK_N of a rank-wide output is narrowed to >= 16 (tl.dot's minimum)."""
    h, inner = CFG.hidden_size, CFG.inner_dim
    for dtype in (BF16, FP32):
        for role, n, k in (("fwd", 16, h), ("fwd", inner, 16), ("dx", 16, h), ("dx", inner, 16), ("dw", inner, 16)):
            cfg = gemm_config(role, n, k, dtype)
            assert all(gemm_config(role, n, k, dtype, m) == cfg for m in (1, 7, 300, 900, 4000)), (role, n, k)
            assert not any((role, n, k, dtype_name(dtype)) in table for _, table in gemm_configs.M_BUCKETS)
        assert gemm_config("fwd", 1, h, dtype).block_n == 16


def test_strict_binding_manifest_and_case() -> None:
    spec = registry.spec(OP)
    assert (spec.rfc_row, spec.family, spec.reference) == (
        "h3_lora_gradient_gate",
        "gemm",
        "h3gate.ops.reference:lora_update",
    )
    assert spec.kernel == "h3gate.kernels.lora:h3_lora_update" and not spec.contract.provider_bitwise
    bound = registry.bind(OP, "strict", "cpu")
    assert (bound.actual, bound.label, bound.kernel_id, bound.fn) == (
        "triton",
        "row",
        lora.KERNEL_ID,
        lora.h3_lora_update,
    )
    case = cases.build_case(OP, 9, CFG, "cpu", 0)
    x, a, b, scaling = case.args
    assert x.shape == (1, 9, CFG.hidden_size) and a.shape == (16, CFG.hidden_size) and b.shape == (CFG.inner_dim, 16)
    assert (x.dtype, a.dtype, scaling) == (BF16, FP32, 1.5)
    got, want = case.call(bound.fn), case.golden_call(registry.reference(OP))
    assert got.dtype == FP32 and rel(got, want) < ACC.forward["float32"]


@pytest.mark.parametrize("adapter_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_ws1_ops_case_passes_every_promise(monkeypatch, adapter_dtype) -> None:
    """The ws1-ops engine on the case (odd rows, forward and backward): accuracy, the row rule, repeat, batch
    placements, unrelated-row mutation and the prefix probe all hold, for a float32 and a bf16 adapter."""
    builder = lambda rows, cfg, device, seed: cases_gemm.lora_update_case(rows, cfg, device, seed, adapter_dtype)  # noqa: E731
    monkeypatch.setitem(cases.CASES, OP, builder)
    result = run_case(OP, 21, CFG, "cpu", seed=3)
    assert result.failures == [], result.failures
    rec = result.record
    assert rec["forward"]["dtype"] == dtype_name(adapter_dtype) and rec["tolerance_source"] == "contract"
    assert [g["dtype"] for g in rec["backward"]] == ["bfloat16", dtype_name(adapter_dtype), dtype_name(adapter_dtype)]
    inv = rec["invariance"]
    assert inv["repeat"] == {"forward": True, "backward": True} and inv["prefix"] == {"rows": 7, "forward": True}
    assert len(inv["batch"]) == 5 and all(p["forward"] and p["backward"] for p in inv["batch"])
    assert inv["mutation"]["forward"] and inv["mutation"]["backward"]


def test_bench_op_record_validates(monkeypatch, tmp_path) -> None:
    """``h3gate bench --op h3_lora_update`` needs nothing beyond the case: its record (timings faked, no GPU here;
    kernel and provider really run forward and forward + backward) validates against the bench schema."""
    from h3gate.bench import ops as bench_ops
    from h3gate.commands.bench_cmd import bench_body
    from h3gate.evidence.writer import write_evidence

    def fake(fns, iters=50, warmup=5, head_start_us=0.0):
        for fn in fns.values():
            fn()
        return {k: {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "iters": iters} for k in fns}

    monkeypatch.setattr(bench_ops, "side_by_side", fake)
    rec = bench_ops.bench_op(OP, 9, CFG, "cpu", copy_gbs=1.0)
    assert rec["target"] is None and rec["checks"] == {"not_slower": True, "bandwidth": None}
    assert rec["forward_backward"] is not None and rec["flops"] > 0 and rec["bytes_moved"] > 0
    write_evidence(tmp_path, "bench-ops.json", "bench", bench_body("tiny", "t", 9, "cuda", 1.0, [rec]),
                   command=["test"], device="cpu")  # fmt: skip
