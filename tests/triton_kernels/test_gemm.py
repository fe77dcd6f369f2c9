"""Strict GEMM under Triton's interpreter: accuracy vs float64, backward, repeat and row invariance, RNE epilogue,
M-independent tiling, input validation, registry binding and the per-operator case builders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3gate.errors import InputError
from h3gate.kernels import gemm, gemm_configs, gemm_triton
from h3gate.kernels.gemm_configs import BF16_SKINNY, GemmConfig, gemm_config
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry

BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: 5e-3, FP32: 1e-5}  # rel-L2 vs float64: one bf16 rounding of the output (~2e-3); FP32 accumulate
SMALL = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2)  # many tiles: multi-tile grids and K tails
VARIANTS = [
    pytest.param(None, id="default"),
    pytest.param(SMALL, id="small"),
    pytest.param(GemmConfig(16, 32, 32, group_m=2, persistent=True), id="persistent"),
    pytest.param(GemmConfig(16, 32, 32, group_m=2, persistent=True, tma=True), id="tma"),
]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def make(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, b


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: GemmConfig | None) -> torch.Tensor:
    if cfg is None:
        return gemm.linear(x, w, b)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    return gemm.matmul(x, w, out, b, cfg, a_trans=False, b_trans=True)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (5, 130, 96), (37, 96, 130)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_forward_accuracy_vs_float64(dtype, m, k, n, bias) -> None:
    x, w, b = make(m, k, n, dtype, bias=bias)
    y = gemm.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_backward_accuracy_vs_float64(dtype) -> None:
    x, w, b = make(2 * 37, 130, 96, dtype)
    x = x.view(2, 37, 130)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    golden = [t.double().requires_grad_() for t in (x, w, b)]
    gy = torch.randn(2, 37, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    gemm.h3_qkv_gemm(*leaves).backward(gy)
    F.linear(*golden).backward(gy.double())
    for got, want, name in zip(leaves, golden, ("dx", "dw", "db"), strict=True):
        assert got.grad.dtype == dtype and got.grad.shape == got.shape, name
        assert rel(got.grad, want.grad) < TOL[dtype], name


def test_repeat_bitwise_forward_and_backward() -> None:
    x, w, b = make(37, 130, 96, BF16)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = gemm.linear(*leaves)
        y.backward(torch.ones_like(y))
        runs.append([y.detach(), *(t.grad for t in leaves)])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg", VARIANTS)
def test_row_bytes_do_not_depend_on_m_or_other_rows(dtype, cfg) -> None:
    x, w, b = make(37, 130, 96, dtype)
    full = run(x, w, b, cfg)
    g = torch.Generator().manual_seed(7)
    for r in (0, 3, 20, 36):
        assert torch.equal(run(x[r : r + 1].clone(), w, b, cfg)[0], full[r]), f"row {r} alone (M=1)"
        others = torch.randn(5, 130, generator=g).to(dtype)
        others[2] = x[r]  # the row at position 2 among unrelated rows (M=5)
        assert torch.equal(run(others, w, b, cfg)[2], full[r]), f"row {r} inside M=5"


def test_dx_rows_are_invariant_too() -> None:
    x, w, _ = make(37, 130, 96, BF16, bias=False)
    gy = torch.randn(37, 96, generator=torch.Generator().manual_seed(3)).to(BF16)

    def dx(rows: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        leaf = rows.clone().requires_grad_()
        gemm.linear(leaf, w).backward(g)
        return leaf.grad

    full = dx(x, gy)
    for r in (0, 17, 36):
        assert torch.equal(dx(x[r : r + 1], gy[r : r + 1])[0], full[r])


def test_variants_are_scheduling_only() -> None:
    """Same BLOCK sizes: grouped order, persistence and TMA loads change who computes a tile, not the bytes."""
    x, w, b = make(37, 130, 96, FP32)
    outs = [run(x, w, b, p.values[0]) for p in VARIANTS[1:]]
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


def test_bf16_epilogue_is_one_rne_rounding_after_the_bias() -> None:
    """Integer data: the FP32 sum is exact, so the output must be float64's value rounded once to bf16 (RNE)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-8, 9, (37, 130), generator=g).to(BF16)
    w = torch.randint(-8, 9, (96, 130), generator=g).to(BF16)
    b = (torch.randint(-64, 65, (96,), generator=g) + 0.5).to(BF16)
    exact = F.linear(x.double(), w.double(), b.double())
    assert (exact.abs() > 256).any()  # needs rounding: bf16 holds 8 significant bits
    for cfg in (None, SMALL):
        assert torch.equal(run(x, w, b, cfg), exact.to(BF16))
    # The rounding is observable: a truncating cast or a cast before the bias would differ.
    assert not torch.equal(exact.float().view(torch.int32).bitwise_and(-65536).view(FP32).to(BF16), exact.to(BF16))


def test_dbias_is_the_fixed_order_column_sum() -> None:
    g = torch.Generator().manual_seed(2)
    gy = torch.randint(-4, 5, (300, 96), generator=g).to(FP32) / 8  # exact sums: any order gives the same value
    assert torch.equal(gemm.colsum(gy, FP32), gy.double().sum(0).float())


def test_config_is_chosen_without_m(monkeypatch) -> None:
    """Forward, dX and dW run with one config per role whatever M is (calls come as fwd, dx, dw per M) for a layer
    without a small-M entry."""
    seen: list[GemmConfig] = []
    real = gemm.matmul

    def spy(a, b, out, bias, cfg, **kw):
        seen.append(cfg)
        return real(a, b, out, bias, cfg, **kw)

    monkeypatch.setattr(gemm, "matmul", spy)
    for m in (1, 5, 37):
        x, w, b = make(m, 130, 96, BF16)
        gemm.linear(x.requires_grad_(), w.requires_grad_(), b).sum().backward()
    assert len(seen) == 9
    for j, role in enumerate(("fwd", "dx", "dw")):
        assert seen[j::3] == [gemm_config(role, 96, 130, BF16)] * 3, role
    # The AdaLN projection keeps a GEMV-style tiling (one 16-row tile covers the timesteps; N/K/warps are tuned).
    assert gemm_config("fwd", 96768, 2688, BF16).block_m == BF16_SKINNY.block_m


def test_m_buckets_change_tile_shape_never_k_tiling_nor_bytes() -> None:
    """A layer listed in M_BUCKETS takes the first bucket whose bound exceeds M, TABLE from the last bound on; every
    tiling shares BLOCK_K; a row's bytes are the same whichever bucket's tiling computes it (interpreter here; the
    H200 probe and ws1-ops check the compiled MMA)."""
    large = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    tiny = GemmConfig(16, 64, 32, group_m=1, num_warps=4, num_stages=3, persistent=True)
    mid = GemmConfig(64, 16, 32, group_m=4, num_warps=4, num_stages=2, persistent=True)
    key = ("fwd", 96, 130, "bfloat16")
    tables = {"buckets": ((8, {key: tiny}), (24, {key: mid})), "table": {key: large}}
    assert gemm_config("fwd", 96, 130, BF16, 7, **tables) == tiny
    assert gemm_config("fwd", 96, 130, BF16, 8, **tables) == mid == gemm_config("fwd", 96, 130, BF16, 23, **tables)
    assert gemm_config("fwd", 96, 130, BF16, 24, **tables) == large == gemm_config("fwd", 96, 130, BF16, **tables)
    assert gemm_config("dx", 96, 130, BF16, 7, **tables) == gemm_config("dx", 96, 130, BF16)  # forward-only buckets
    x, w, b = make(37, 130, 96, BF16)

    def run(rows: int, cfg: GemmConfig) -> torch.Tensor:
        out = torch.empty(rows, 96, dtype=BF16)
        return gemm_triton.matmul(x[:rows], w, out, b, cfg, a_trans=False, b_trans=True)

    y_large = run(37, large)
    assert torch.equal(run(5, tiny), y_large[:5]) and torch.equal(run(17, mid), y_large[:17])
    # The import-time check refuses a bucket entry that would change the K tiling, and bounds out of order.
    with pytest.raises(AssertionError, match=r"M_BUCKETS\[M < 24\].*BLOCK_K must equal"):
        gemm_configs._check_m_buckets(((8, {key: tiny}), (24, {key: GemmConfig(16, 64, 64)})), tables["table"])
    with pytest.raises(AssertionError, match="bounds must strictly ascend"):
        gemm_configs._check_m_buckets(((24, {key: mid}), (8, {key: tiny})), tables["table"])
    with pytest.raises(AssertionError, match="every bucket must list the same layers"):  # M < 8 would skip to TABLE
        gemm_configs._check_m_buckets(((8, {}), (24, {key: mid})), tables["table"])


def test_shipped_m_buckets_keep_the_k_tiling() -> None:
    assert [bound for bound, _ in gemm_configs.M_BUCKETS] == [512, gemm_configs.SMALL_M]
    lower = 0
    for bound, table in gemm_configs.M_BUCKETS:
        assert table, "the block's forward GEMMs have small-M tilings"
        for key, cfg in table.items():
            role, n, k, _ = key
            assert cfg.block_k == gemm_configs.TABLE[key].block_k, key
            assert gemm_config(role, n, k, BF16, lower) == cfg == gemm_config(role, n, k, BF16, bound - 1)
            assert gemm_config(role, n, k, BF16, gemm_configs.SMALL_M) == gemm_configs.TABLE[key]
        lower = bound


class _LaunchSpy:
    """Wraps ``_gemm_kernel`` and records each launch's TAIL_N (the kernel really runs)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.tails = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.tails.append(kwargs["TAIL_N"])
            return launch(*args, **kwargs)

        return run


@pytest.mark.parametrize(
    ("a_trans", "b_trans", "dtype", "n", "split", "bias"),
    [
        (False, True, BF16, 160, 128, True),  # 2 x 5 wide tiles on 3 programs: columns 128..159 in tail tiles
        (False, False, FP32, 160, 128, False),  # the dX operand layout, no bias
        (True, False, BF16, 160, 128, True),  # the dW operand layout (A stored transposed)
        (False, True, BF16, 64, 32, False),  # fewer wide tiles (2) than programs (3)
    ],
)
def test_tail_split_covers_every_column_with_the_same_bytes(monkeypatch, a_trans, b_trans, dtype, n, split, bias):
    """A persistent launch whose last columns go to narrower tail tiles writes every column, with the bytes of the
    wide-only launch; K = 70 is not a multiple of BLOCK_K, so the masked K tail runs too."""
    wide = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2, persistent=True)
    tailed = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2, persistent=True, tail_block_n=16)
    m, k = 20, 70  # 2 row tiles
    assert gemm_configs.tail_split(2, n, 32, 16, 3) == split
    spy = _LaunchSpy(gemm_triton._gemm_kernel)
    monkeypatch.setattr(gemm_triton, "_gemm_kernel", spy)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(k, m, generator=g).to(dtype) if a_trans else torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, k, generator=g).to(dtype) if b_trans else torch.randn(k, n, generator=g).to(dtype)
    b_vec = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    outs = []
    for cfg in (wide, tailed):
        out = torch.full((m, n), float("nan"), dtype=dtype)
        outs.append(gemm_triton.matmul(a, b, out, b_vec, cfg, a_trans=a_trans, b_trans=b_trans))
    assert spy.tails == [0, 16]  # the second launch really ran the tail phase
    assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1])
    a64 = a.double().T if a_trans else a.double()
    b64 = b.double().T if b_trans else b.double()
    ref = a64 @ b64 + (b_vec.double() if bias else 0)
    assert rel(outs[1], ref) < TOL[dtype]


def test_tail_split_model() -> None:
    """The split is used only below TAIL_MAX_WAVES waves of wide tiles with an idle part in the last wave, and only
    where the modelled makespan shrinks; a tail needs a persistent launch and 16 <= tail < BLOCK_N dividing it."""
    tail_split = gemm_configs.tail_split
    assert tail_split(25, 7168, 256, 128, 132) == 6656  # qkv at the medium layout: 700 wide tiles, 5.3 waves
    assert tail_split(24, 7168, 256, 128, 132) == 6912  # M = 3072 (perf-probe-10 measured both)
    assert tail_split(25, 5376, 256, 128, 132) is None  # o at medium: 525 tiles, 3.98 waves, little idle
    assert tail_split(305, 7168, 256, 128, 132) is None  # 768p: 64.7 waves
    assert tail_split(33, 4 * 256, 256, 128, 132) is None  # exactly one wave
    assert tail_split(25, 7168 + 8, 256, 128, 132) is None  # N not a multiple of BLOCK_N
    for bad in dict(tail_block_n=128), dict(tail_block_n=96, persistent=True), dict(tail_block_n=8, persistent=True):
        with pytest.raises(ValueError, match="tail_block_n needs a persistent launch"):
            GemmConfig(128, 256, 64, **bad)
    for bad_tail in (-128, 256):
        with pytest.raises(ValueError, match="16 <= tail_block_n < block_n"):
            GemmConfig(128, 256, 64, persistent=True, tail_block_n=bad_tail)


def test_skinny_adaln_tiling_small_m() -> None:
    x, w, b = make(3, 256, 200, BF16)
    full = run(x, w, b, BF16_SKINNY)
    assert rel(full, F.linear(x.double(), w.double(), b.double())) < TOL[BF16]
    for r in range(3):
        assert torch.equal(run(x[r : r + 1].clone(), w, b, BF16_SKINNY)[0], full[r])


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda x, w, b: (x.half(), w, b), "h3_qkv_gemm: x: dtype float16 not supported (expected bfloat16, float32)"),
        (lambda x, w, b: (x, w.float(), b), "h3_qkv_gemm: weight: dtype float32 does not match x dtype bfloat16"),
        (lambda x, w, b: (x[:, :64], w, b), "h3_qkv_gemm: x: non-contiguous tensor"),
        (lambda x, w, b: (x[:, :64].contiguous(), w, b), "h3_qkv_gemm: weight: in_features 130 != x last dim 64"),
        (lambda x, w, b: (x, w, b[:5]), "h3_qkv_gemm: bias: length 5 != out_features 96"),
        (lambda x, w, b: (x[:0], w, b), "h3_qkv_gemm: x: empty tensor (0, 130)"),
        (lambda x, w, b: (x, w.to("meta"), b), "h3_qkv_gemm: weight: on meta, expected cpu (mixed devices)"),
        (lambda x, w, b: (x, w[None], b), "h3_qkv_gemm: weight: expected 2 dims, got shape (1, 96, 130)"),
    ],
)
def test_invalid_inputs_name_operator_and_argument(mutate, message) -> None:
    with pytest.raises(InputError) as err:
        gemm.h3_qkv_gemm(*mutate(*make(5, 130, 96, BF16)))
    assert str(err.value).startswith(message)


GEMM_OPS = [
    "h3_qkv_gemm",
    "h3_attention_o_gemm",
    "h3_ffn_gate_up_gemm",
    "h3_ffn_down_gemm",
    "adaln_projection_3mod",
    "text_context_projection",
    "final_adaln_projection",
    "video_input_projection_fp32",
    "audio_input_projection_fp32",
    "timestep_mlp_fp32",
    "video_output_projection_fp32",
    "audio_output_projection_fp32",
]


@pytest.mark.parametrize("op", GEMM_OPS)
def test_strict_binding_and_case_on_tiny_config(op) -> None:
    """Every GEMM row binds to its strict kernel in strict mode, and matches the float64 golden on its case."""
    from h3gate.ops.cases_gemm import CASES

    bound = registry.bind(op, "strict", "cpu")
    assert (bound.actual, bound.label, bound.kernel_id) == ("triton", "row", gemm.KERNEL_ID)
    assert bound.fn is getattr(gemm, op)
    case = CASES[op](6, load_config("tiny").config, "cpu", 0)
    got = case.call(bound.fn)
    golden = case.golden_call(registry.reference(op))
    assert got.dtype == case.args[0].dtype and got.shape == golden.shape
    assert rel(got, golden) < TOL[got.dtype]


def test_no_grad_calls_skip_autograd_but_not_the_kernel(monkeypatch) -> None:
    """Without a graph to build, linear launches directly (no autograd.Function); same bytes as the autograd path."""
    x, w, b = make(5, 130, 96, BF16)
    with_graph = gemm.linear(x, w.clone().requires_grad_(), b)
    assert with_graph.grad_fn is not None

    def refuse(*args, **kwargs):
        raise AssertionError("autograd.Function used without a graph to build")

    monkeypatch.setattr(gemm._Linear, "apply", refuse)
    direct = gemm.linear(x, w, b)
    with torch.no_grad():
        direct_ng = gemm.linear(x, w.clone().requires_grad_(), b)
    assert direct.grad_fn is None and torch.equal(direct, with_graph.detach())
    assert torch.equal(direct_ng, direct)
    with pytest.raises(AssertionError, match="without a graph"):
        gemm.linear(x.clone().requires_grad_(), w, b)


def test_ws1_ops_prefix_probe_crosses_the_m_bucket() -> None:
    """ws1-ops runs a GEMM case's first rows alone (M = 7) against the full call (M = 20): bitwise for a kernel whose
    tiling follows an M bucket (the two calls really take two tilings of one K walk), and caught when a kernel's bytes
    depend on M."""
    from h3gate.runs import ws1_ops as opsgate

    cfg = load_config("tiny").config
    large, small = GemmConfig(32, 32, 32, group_m=2, num_stages=2), GemmConfig(16, 64, 32, group_m=1, persistent=True)
    op = "h3_attention_o_gemm"
    seen: list[tuple[int, GemmConfig]] = []

    def bucketed(x, weight, bias=None):  # the strict forward's launch with a tiling chosen by M (bucket bound 16)
        rows = x.numel() // x.shape[-1]
        tile = small if rows < 16 else large
        seen.append((rows, tile))
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        gemm_triton.matmul(x.reshape(rows, -1), weight, out, bias, tile, a_trans=False, b_trans=True)
        return out.view(*x.shape[:-1], -1)

    result = opsgate.run_case(op, 20, cfg, "cpu", seed=1, backward=False, kernel=bucketed)
    prefix = result.record["invariance"]["prefix"]
    assert prefix == {"rows": 7, "forward": True} and not result.failures
    assert (20, large) in seen and (7, small) in seen  # the two calls really took the two tilings

    def m_dependent(x, weight, bias=None):  # the strict kernel, one ulp off below 16 rows
        y = gemm.linear(x, weight, bias, op=op)
        return y if x.numel() // x.shape[-1] >= 16 else torch.nextafter(y, torch.full_like(y, float("inf")))

    result = opsgate.run_case(op, 20, cfg, "cpu", seed=1, backward=False, kernel=m_dependent)
    assert result.record["invariance"]["prefix"]["forward"] is False
    assert any("invariance prefix.forward not bitwise" in f for f in result.failures)
