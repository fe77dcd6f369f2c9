"""The strict GEMM's swapped-operand forward (``Y^T = W @ X^T``, token chunks of BLOCK_M + TAIL_M) under Triton's
interpreter: accuracy vs float64, row invariance, bytes equal to the unswapped tiling where the interpreter's sums are
exact, its dispatch from an M bucket through autograd, and config validation. The compiled MMA's bytes are checked on
the H200 (``docs/measurements/perf-probe-11.json``, ws1-ops' prefix probe) and its sm_90 build in ``rows_aot``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from h3gate.kernels import gemm, gemm_configs, gemm_swapped, gemm_triton
from h3gate.kernels.gemm_configs import GemmConfig, gemm_config

BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: 5e-3, FP32: 1e-5}
SWAPS = [
    pytest.param(GemmConfig(16, 32, 32, 1, 4, 2, swap_ab=True, tail_m=16), id="chunk16+16"),
    pytest.param(GemmConfig(32, 16, 32, 1, 4, 2, swap_ab=True), id="chunk32"),
    pytest.param(GemmConfig(32, 64, 32, 1, 4, 2, swap_ab=True, tail_m=16, tma=True), id="chunk32+16-tma"),
]
UNSWAPPED = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def make(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0, integer: bool = False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: every partial sum is exact in FP32, so any summation order gives the same bytes
        x, w = torch.randint(-8, 9, (m, k), generator=g), torch.randint(-8, 9, (n, k), generator=g)
        return x.to(dtype), w.to(dtype), (torch.randint(-64, 65, (n,), generator=g) + 0.5).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    return x, w, (torch.randn(n, generator=g) * 0.1).to(dtype)


def run(x, w, b, cfg: GemmConfig) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)
    return gemm_triton.matmul(x, w, out, b, cfg, a_trans=False, b_trans=True)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (37, 130, 33), (48, 96, 130)])
@pytest.mark.parametrize("cfg", SWAPS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_swapped_forward_accuracy_vs_float64(dtype, m, k, n, cfg, bias) -> None:
    """Odd shapes: a K tail (130), N not a multiple of the weight block (33, 130), M inside and across chunks; every
    output element written (the output starts as NaN)."""
    x, w, b = make(m, k, n, dtype)
    b = b if bias else None
    y = run(x, w, b, cfg)
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert not y.isnan().any()
    assert rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg", SWAPS)
def test_swapped_row_bytes_do_not_depend_on_m_or_other_rows(dtype, cfg) -> None:
    """A row alone, or among other rows, in the main or the tail block of a chunk: the same bytes. FP32 uses integer
    data: the interpreter runs a dot as numpy's FP32 matmul, whose summation order follows the operand *shapes* (a
    main and a tail block differ), unlike the compiled IEEE FMA dot's per-element loop; BF16 products are exact and
    its random-data case passes as is. The swapped tiling ships for BF16 only (``gemm_configs.M_BUCKETS``)."""
    x, w, b = make(37, 130, 96, dtype, integer=dtype == FP32)
    full = run(x, w, b, cfg)
    g = torch.Generator().manual_seed(7)
    for r in (0, 15, 16, 31, 36):  # main block, tail block, and a second chunk
        assert torch.equal(run(x[r : r + 1].clone(), w, b, cfg)[0], full[r]), f"row {r} alone (M=1)"
        others = torch.randint(-8, 9, (21, 130), generator=g).to(dtype)
        others[18] = x[r]  # at position 18: the tail block of the first chunk for the 16 + 16 chunk
        assert torch.equal(run(others, w, b, cfg)[18], full[r]), f"row {r} inside M=21"


@pytest.mark.parametrize("cfg", SWAPS)
def test_swapped_equals_unswapped_bytes_and_rounds_once(cfg) -> None:
    """Integer data makes the FP32 sums exact, so both tilings must give float64's value rounded once to bf16 (RNE),
    after the bias; on the H200 the compiled MMAs are compared on random data (perf-probe-11)."""
    x, w, b = make(37, 130, 96, BF16, integer=True)
    exact = F.linear(x.double(), w.double(), b.double())
    assert (exact.abs() > 256).any()  # needs rounding: bf16 holds 8 significant bits
    assert torch.equal(run(x, w, b, cfg), exact.to(BF16))
    assert torch.equal(run(x, w, b, cfg), run(x, w, b, UNSWAPPED))


def test_the_swapped_path_runs_the_swapped_forward_and_an_unswapped_backward(monkeypatch) -> None:
    """The declared path ``triton_swapped`` (the block's layers at few rows off Hopper: manifests/operators/gemm.yaml)
    runs the swapped kernel for the forward only (dX/dW keep their roles' tilings); forward and gradients match
    float64, and the rows equal the unswapped call's rows. The plan is stubbed to a small layer (the real ones are too
    large for the interpreter); the real qkv layer's plan at 264 rows is that path with a swapped tiling."""
    qkv = SimpleNamespace(shape=(7168, 5376), dtype=BF16), SimpleNamespace(device=torch.device("cpu"), dtype=BF16)
    path, tiling = gemm.forward_plan(SimpleNamespace(numel=lambda: 264 * 5376, **vars(qkv[1])), qkv[0])
    assert path == "triton_swapped" and tiling.swap_ab
    swapped = GemmConfig(16, 32, 32, 1, 4, 2, swap_ab=True, tail_m=16)

    def plan(x, weight):
        return ("triton_swapped", swapped) if x.numel() // x.shape[-1] < 24 else ("triton", UNSWAPPED)

    monkeypatch.setattr(gemm, "forward_plan", plan)
    calls: list[int] = []  # TAIL_M of each swapped launch
    real = gemm_swapped._gemm_swapped_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(kwargs["TAIL_M"])
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(gemm_swapped, "_gemm_swapped_kernel", Spy())
    x, w, b = make(20, 130, 96, BF16, integer=True)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    golden = [t.double().requires_grad_() for t in (x, w, b)]
    gy = torch.randn(20, 96, generator=torch.Generator().manual_seed(1)).to(BF16)
    y = gemm.h3_qkv_gemm(*leaves)
    y.backward(gy)
    F.linear(*golden).backward(gy.double())
    assert calls == [16]  # the forward ran swapped, once; the backward launched the unswapped kernel
    assert torch.equal(y.detach(), F.linear(*golden).detach().to(BF16))
    for got, want, name in zip(leaves, golden, ("dx", "dw", "db"), strict=True):
        assert rel(got.grad, want.grad) < TOL[BF16], name
    big = torch.cat([x, make(30, 130, 96, BF16, seed=4, integer=True)[0]])  # 50 rows: the unswapped tiling
    assert torch.equal(gemm.linear(big, w, b)[:20], y.detach())


def test_swapped_config_validation() -> None:
    with pytest.raises(ValueError, match="tail_m needs swap_ab"):
        GemmConfig(32, 32, 32, 1, tail_m=16)
    for bad in (8, 48, 64):  # below 16, not a power of two, above block_m
        with pytest.raises(ValueError, match=r"a power of two in \[16, block_m\]"):
            GemmConfig(32, 32, 32, 1, swap_ab=True, tail_m=bad)
    for bad in (dict(persistent=True), dict(group_m=8), dict(persistent=True, tail_block_n=16)):
        with pytest.raises(ValueError, match="swap_ab launches one program per tile"):
            GemmConfig(32, 32, 32, **{"group_m": 1, **bad}, swap_ab=True)
    x, w, b = make(5, 64, 32, BF16)
    with pytest.raises(ValueError, match="swap_ab is a forward tiling"):
        gemm_triton.matmul(x, w.T.contiguous(), torch.empty(5, 32, dtype=BF16), None, SWAPS[0].values[0], a_trans=False,
                    b_trans=False)  # fmt: skip
    assert GemmConfig(256, 64, 64, 1, 4, 4, tma=True, swap_ab=True, tail_m=16).tag == "256x64x64_g1_w4_s4_tma_swap16"


def test_shipped_swapped_buckets_cover_the_layouts_rows() -> None:
    """The shipped swapped tilings: tiny's 264 rows fit one 256 + 16 chunk (3 % padding), and every swapped entry
    sits in a bucket below SMALL_M."""
    qkv = ("fwd", 7168, 5376, "bfloat16")
    tiny = gemm_config(*qkv[:3], BF16, 264)
    assert tiny.swap_ab and tiny.block_m + tiny.tail_m == 272
    for bound, table in gemm_configs.M_BUCKETS:
        assert bound <= gemm_configs.SMALL_M
        for key, cfg in table.items():
            assert not cfg.swap_ab or (key[0] == "fwd" and key[3] == "bfloat16" and cfg.block_k == 64), key
    assert not any(cfg.swap_ab for cfg in gemm_configs.TABLE.values())  # large M: unswapped tiles
