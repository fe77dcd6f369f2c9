"""Strict full attention under Triton's interpreter: forward/backward accuracy vs float64, repeat bitwise, batch-row
and head invariance, tilings with many programs, input validation and registry binding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import attention as attn
from h3gate.kernels import attention_config, selection
from h3gate.ops import reference, registry

BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: 1e-2, FP32: 1e-5}
# Many programs in every kernel (S = 70: 5 query blocks, 5 KV blocks, masked tails everywhere).
SMALL = attn.AttnConfig(16, 16, 4, 2, 16, 32, 4, 1, 32, 16, 4, 1)
# The declared forward and backward variants (explicit ex2.approx.ftz / fma; tl.exp2 / tl.fma under the interpreter).
FAST = attn.AttnConfig(
    16, 16, 4, 2, 16, 32, 4, 1, 32, 16, 4, 1, fwd_exp2="ex2ftz", fwd_fma=True, bwd_exp2="ex2ftz", bwd_fma=True
)


def qkv(b: int, s: int, h: int = 2, dtype: torch.dtype = BF16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, 128, generator=g).to(dtype) for _ in range(3)]


def fwd_bwd(q, k, v, grad, cfg: attn.AttnConfig | None = None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn.attention(*leaves) if cfg is None else attn.attention_with(*leaves, cfg)
    out.backward(grad)
    return out.detach(), *(t.grad for t in leaves)


def golden(q, k, v, grad):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = reference.attention(*leaves)
    out.backward(grad.double())
    return out.detach(), *(t.grad for t in leaves)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def test_the_interpreter_runs_the_pointer_walks_at_every_length() -> None:
    """The declared paths (manifests/operators/attention.yaml) on the CPU interpreter: the Triton pointer kernels for
    the forward and the backward at every S (TMA and Gluon exist on CUDA only); the Gluon kernels' own bytes are
    compared on the H200 and their sm_90 build in ``test_sm90_compile``."""
    for s in (1, 511, 512, 2047, 2048, 38974):
        assert attn.paths(torch.empty(1, s, 1, 128, dtype=BF16, device="meta")) == ("triton_pointer", "triton_pointer")
    assert attn.launch_record(torch.empty(1, 9, 1, 128, dtype=BF16))["forward"] == "triton_pointer"


def test_the_dkdv_walks_statistics_reach_tma_as_16_byte_rows_with_zeros_past_s() -> None:
    """The Gluon dK/dV walk reads each query step's lse2 and delta by TMA ((1, 64) boxes of the (B * nh, S) FP32
    arrays). TMA needs 16-byte row strides, so where S is not a multiple of 4 the rows are a zero-padded copy; the
    descriptor's shape stays S, so the box past S is zero-filled either way (the masked loads' ``other=0``)."""
    from h3gate.kernels.attention_bwd_gluon import stats_descriptors

    lse = torch.arange(2 * 301, dtype=torch.float32).view(2, 301) - 300.0
    la, lb = stats_descriptors(lse, lse * 2, 64)
    for desc, want in ((la, lse), (lb, lse * 2)):
        assert desc.shape == [2, 301] and desc.strides == [304, 1] and desc.block_shape == [1, 64]
        assert torch.equal(desc.base[:, :301], want) and not desc.base[:, 301:].any()
    even = lse[:, :300].contiguous()
    la, _ = stats_descriptors(even, even, 64)
    assert la.base is even and la.strides == [300, 1]  # 1200-byte rows: no copy


@pytest.mark.parametrize("side", [False, True], ids=["one_stream", "side_stream"])
def test_the_gluon_walks_join_before_the_backward_returns(monkeypatch, side) -> None:
    """``both_walks``: with ``side_stream`` (``AttnLaunch``) the dQ walk is enqueued on a side stream that first waits
    for the caller's queue, after the dK/dV walk was enqueued on the caller's stream, and the caller's stream waits for
    the side stream before returning (CUDA streams faked: the order of the calls is what is checked); without it, the
    two walks run in order on the caller's stream and no stream is touched."""
    import contextlib

    from h3gate.kernels import attention_bwd_gluon as gb

    log: list = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    main, other = Stream("main"), Stream("side")

    @contextlib.contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    monkeypatch.setattr(gb.torch.cuda, "current_stream", lambda device: main)
    monkeypatch.setattr(gb.torch.cuda, "stream", on)
    monkeypatch.setattr(gb, "_side_stream", lambda device: other)
    gb.both_walks(lambda: log.append("dkdv"), lambda: log.append("dq"), torch.device("cpu"), side)
    if side:
        assert log == ["side waits main", "dkdv", "on side", "dq", "off side", "main waits side"]
    else:
        assert log == ["dkdv", "dq"]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("s", [17, 70])
@pytest.mark.parametrize("cfg", [None, SMALL, FAST], ids=["default", "small", "fast"])
def test_forward_backward_accuracy_vs_float64(dtype, s, cfg) -> None:
    q, k, v = qkv(1, s, dtype=dtype)
    grad = torch.randn(1, s, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = fwd_bwd(q, k, v, grad, cfg)
    want = golden(q, k, v, grad)
    assert got[0].shape == (1, s, 256) and got[0].dtype == dtype
    for g, w, name in zip(got, want, ("out", "dq", "dk", "dv"), strict=True):
        assert rel(g, w) < TOL[dtype], name


def test_single_row_document() -> None:
    """S = 1: softmax is constant, so out = v and dq = dk = 0 up to the delta = rowsum(dO * O) rounding."""
    q, k, v = qkv(1, 1, dtype=FP32)
    grad = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(1))
    out, dq, dk, dv = fwd_bwd(q, k, v, grad)
    assert torch.equal(out, v.flatten(2))
    assert torch.equal(dv, grad.view_as(dv))
    assert dq.abs().max() < 1e-4 * q.abs().max() * grad.abs().max() * 128
    assert dk.abs().max() < 1e-4 * q.abs().max() * grad.abs().max() * 128


def test_repeat_bitwise() -> None:
    q, k, v = qkv(2, 70)
    grad = torch.randn(2, 70, 256, generator=torch.Generator().manual_seed(2)).to(BF16)
    first, second = fwd_bwd(q, k, v, grad), fwd_bwd(q, k, v, grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_declared_fwd_variants_invariant_and_checked() -> None:
    """The fma/ex2 forward is repeat-bitwise and batch-row invariant; an unknown exp2 variant fails closed."""
    q, k, v = qkv(1, 37)
    other = qkv(1, 37, seed=6)
    alone, _ = attn.forward(q, k, v, FAST)
    again, _ = attn.forward(q, k, v, FAST)
    batched, _ = attn.forward(*(torch.cat([o, t]) for o, t in zip(other, (q, k, v), strict=True)), FAST)
    assert torch.equal(alone, again) and torch.equal(alone[0], batched[1])
    assert FAST.tag.startswith("fwd16x16w4s2_ex2ftz_fma_") and "_ex2" not in SMALL.tag
    with pytest.raises(InputError, match="fwd_exp2: 'fast' not one of"):
        attn.forward(q, k, v, attn.AttnConfig(fwd_exp2="fast"))


def test_declared_bwd_variants_invariant_and_checked() -> None:
    """The fma/ex2 backward is repeat-bitwise and batch-row invariant; an unknown exp2 variant fails closed."""
    q, k, v = qkv(1, 37)
    other = qkv(1, 37, seed=6)
    grad = torch.randn(1, 37, 256, generator=torch.Generator().manual_seed(4)).to(BF16)
    ograd = torch.randn(1, 37, 256, generator=torch.Generator().manual_seed(5)).to(BF16)
    alone, again = fwd_bwd(q, k, v, grad, FAST), fwd_bwd(q, k, v, grad, FAST)
    cat = [torch.cat([o, t]) for o, t in zip(other, (q, k, v), strict=True)]
    batched = fwd_bwd(*cat, torch.cat([ograd, grad]), FAST)
    for a, b, c in zip(alone, again, batched, strict=True):
        assert torch.equal(a, b) and torch.equal(a[0], c[1])
    assert FAST.tag.endswith("q32x16w4s1_ex2ftz_fma") and SMALL.tag.endswith("q32x16w4s1")
    with pytest.raises(InputError, match="bwd_exp2: 'fast' not one of"):
        fwd_bwd(q, k, v, grad, attn.AttnConfig(bwd_exp2="fast"))


@pytest.mark.parametrize("position", [0, 1, 2])
def test_batch_row_invariance(position) -> None:
    """One document alone and inside a batch of 3 with unrelated documents: out and dq/dk/dv bitwise equal."""
    q, k, v = qkv(1, 37)
    grad = torch.randn(1, 37, 256, generator=torch.Generator().manual_seed(3)).to(BF16)
    alone = fwd_bwd(q, k, v, grad)
    others = qkv(2, 37, seed=4) + [torch.randn(2, 37, 256, generator=torch.Generator().manual_seed(5)).to(BF16)]

    def widen(t: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        parts = [o[:1], o[1:]]
        parts.insert(position, t)
        return torch.cat(parts)

    batched = fwd_bwd(*(widen(t, o) for t, o in zip((q, k, v, grad), others, strict=True)))
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a[0], b[position])


def test_head_count_invariance() -> None:
    """Heads are independent programs: head 1 of a 3-head call equals the same head run as a 1-head call."""
    q, k, v = qkv(1, 70, h=3)
    out3 = attn.attention(q, k, v).view(1, 70, 3, 128)
    out1 = attn.attention(*(t[:, :, 1:2].contiguous() for t in (q, k, v)))
    assert torch.equal(out3[:, :, 1], out1.view(1, 70, 128))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda q, k, v: (q[..., :64].contiguous(),) * 3, "h3_full_attention: q: head_dim 64 not supported"),
        (lambda q, k, v: (q, k[:, :5].contiguous(), v), "h3_full_attention: k: shape (1, 5, 2, 128) != q shape"),
        (lambda q, k, v: (q, k, v.float()), "h3_full_attention: v: dtype float32 does not match q dtype bfloat16"),
        (lambda q, k, v: (q.transpose(1, 2), k, v), "h3_full_attention: q: non-contiguous tensor"),
        (lambda q, k, v: (q.flatten(2), k, v), "h3_full_attention: q: expected 4 dims, got shape (1, 17, 256)"),
        (lambda q, k, v: (q.half(), k, v), "h3_full_attention: q: dtype float16 not supported"),
    ],
)
def test_invalid_inputs(mutate, message) -> None:
    with pytest.raises(InputError) as err:
        attn.attention(*mutate(*qkv(1, 17)))
    assert str(err.value).startswith(message)


def test_strict_binding_and_case() -> None:
    from h3gate.manifests.model_config import load_config
    from h3gate.ops.cases_gemm import CASES

    bound = registry.bind("h3_full_attention", "strict", "cpu")
    assert (bound.actual, bound.label, bound.kernel_id) == ("triton", "row", attn.KERNEL_ID)
    case = CASES["h3_full_attention"](19, load_config("tiny").config, "cpu", 0)
    assert rel(case.call(bound.fn), case.golden_call(registry.reference("h3_full_attention"))) < TOL[BF16]


@pytest.mark.parametrize("chunk_bytes", [8 * 2 * 37 * 5, 1 << 30], ids=["5-row-chunks", "one-chunk"])
def test_chunked_float64_golden_matches_the_dense_reference(monkeypatch, chunk_bytes) -> None:
    """The 768p attention golden (query chunks, recomputed backward) equals the dense float64 reference to float64
    rounding, forward and all three gradients, including a ragged last chunk."""
    from h3gate.ops import golden

    monkeypatch.setattr(golden, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 37, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    gout = torch.randn(1, 37, 32, generator=g, dtype=torch.float64)
    got = golden.attention_fp64(q, k, v)
    want = reference.attention(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), gout), torch.autograd.grad(want, (q, k, v), gout), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_attention_case_switches_to_the_chunked_golden_only_when_dense_is_too_big(monkeypatch) -> None:
    from h3gate.manifests.model_config import load_config
    from h3gate.ops import cases_gemm, golden

    real = load_config("real").config
    # The real threshold: medium's dense float64 scores (56 x 3160^2 x 8 B = 4.5 GB) fit, 768p's (680 GB) do not.
    assert 56 * 3160**2 * 8 <= cases_gemm.DENSE_ATTENTION_GOLDEN_BYTES < 56 * 38974**2 * 8
    monkeypatch.setattr(cases_gemm, "DENSE_ATTENTION_GOLDEN_BYTES", 56 * 20 * 20 * 8)
    assert cases_gemm.CASES["h3_full_attention"](20, real, "cpu", 0).golden_fn is None
    assert cases_gemm.CASES["h3_full_attention"](21, real, "cpu", 0).golden_fn is golden.attention_fp64


def test_ws1_ops_attention_case_runs_with_the_chunked_golden(monkeypatch) -> None:
    """The 768p path end to end at a tiny size: ws1-ops judges the kernel (forward and all gradients) against the
    chunked float64 golden, and passes."""
    from h3gate.manifests.model_config import load_config
    from h3gate.ops import cases_gemm, golden
    from h3gate.runs import ws1_ops as opsgate

    monkeypatch.setattr(cases_gemm, "DENSE_ATTENTION_GOLDEN_BYTES", 0)
    monkeypatch.setattr(golden, "CHUNK_BYTES", 1 * 2 * 9 * 8 * 4)  # B=1, 2 heads, S=9, float64: 4-row chunks
    calls = []
    real = golden.attention_fp64
    monkeypatch.setattr(cases_gemm, "attention_fp64", lambda *a: calls.append(1) or real(*a))
    result = opsgate.run_case("h3_full_attention", 9, load_config("tiny").config, "cpu", seed=2)
    assert calls and not result.failures, result.failures
    rec = result.record
    assert rec["forward"]["accuracy_ok"] and len(rec["backward"]) == 3
    assert all(g["accuracy_ok"] for g in rec["backward"])
    # the evidence names the schedule that ran: here the interpreted Triton pointer walks of the S < 2048 tiling
    tiling = attn.attn_config(128, BF16, 9).tag
    assert rec["launch"] == [{"tiling": tiling, "forward": "triton_pointer", "backward": "triton_pointer",
                              "interpreted": attn.INTERPRET}]  # fmt: skip
    # a substituted kernel (a negative control's) launches nothing of the strict kernel's, so none is named
    substituted = opsgate.run_case("h3_full_attention", 9, load_config("tiny").config, "cpu", seed=2,
                                   kernel=reference.attention)  # fmt: skip
    assert "launch" not in substituted.record


@pytest.mark.parametrize(
    ("device", "s", "forward", "backward"),
    [
        ("cuda-sm90", 264, "triton_pointer", "triton_pointer"),
        ("cuda-sm90", 511, "triton_pointer", "triton_pointer"),
        ("cuda-sm90", 512, "gluon_warp_specialised", "triton_pointer"),
        ("cuda-sm90", 925, "gluon_warp_specialised", "triton_pointer"),
        ("cuda-sm90", 2048, "gluon_warp_specialised", "gluon_warp_specialised"),
        ("cuda-sm90", 38974, "gluon_warp_specialised", "gluon_warp_specialised"),
        ("cuda-other", 2047, "triton_pointer", "triton_pointer"),
        ("cuda-other", 2048, "triton_tma", "triton_tma"),
        ("cpu-interpreter", 38974, "triton_pointer", "triton_pointer"),
    ],
)
def test_launch_record_names_the_declared_paths(monkeypatch, device, s, forward, backward) -> None:
    """``launch_record`` names the paths the dispatch runs: the ones the manifest declares for the device class and
    S (the device class stubbed: no GPU here); float32 (no declared table) runs the pointer walks everywhere."""
    monkeypatch.setattr(selection, "device_class", lambda dev: device)
    q = torch.empty(1, s, 56, 128, dtype=BF16, device="meta")
    rec = attn.launch_record(q)
    assert (rec["forward"], rec["backward"]) == attn.paths(q) == (forward, backward)
    assert rec["tiling"] == attn.attn_config(128, BF16, s).tag
    assert attn.paths(torch.empty(1, s, 56, 128, dtype=FP32, device="meta")) == ("triton_pointer", "triton_pointer")


def test_launch_by_sequence_length(monkeypatch) -> None:
    """S_BUCKETS changes only launch fields (block heights, warps, stages), never the forward's KV walk or the
    exp2/fma forms; the bucketed call and a 128-row pointer tiling give the same bytes, forward and backward (S = 70:
    one 128-row block vs two 64-row blocks; the H200 probe checks the compiled MMAs at S = 264..38974)."""
    table = attn.attn_config(128, BF16)
    small = attn.attn_config(128, BF16, 264)
    assert (small.fwd_m, small.fwd_warps, small.fwd_stages) == (128, 8, 3)
    assert small.fwd_n == table.fwd_n == 128 and attn.KERNEL_ID.endswith(":v2")  # the 128-key walk of kernel id v2
    assert (table.kv_stages, small.kv_stages) == (4, 3)
    assert replace(small, fwd_m=64, kv_stages=4, q_stages=4) == table
    assert attn.attn_config(128, BF16, 2047) == small and attn.attn_config(128, BF16, 2048) == table
    assert attn.attn_config(128, FP32, 264) == attn.attn_config(128, FP32)  # no bucket declared for float32
    # heights of the rows a program owns (the interpreter sums a whole MMA tile before adding the accumulator, so the
    # reduction-step heights kv_m / q_n, bitwise on the GPU by the MMA's k-step chain, are compared there only)
    tall = replace(small, fwd_m=64, fwd_warps=4, kv_n=64, q_m=64)
    seen = []
    real = attn._Attention.apply
    monkeypatch.setattr(attn._Attention, "apply", lambda *a: seen.append(a[4]) or real(*a))  # (q, k, v, order, cfg)
    q, k, v = qkv(1, 70)
    grad = torch.randn(1, 70, 256, generator=torch.Generator().manual_seed(9)).to(BF16)
    bucketed = fwd_bwd(q, k, v, grad)
    assert seen == [small]
    for got, want, name in zip(bucketed, fwd_bwd(q, k, v, grad, tall), ("out", "dq", "dk", "dv"), strict=True):
        assert torch.equal(got, want), name
    key = (128, "bfloat16")
    with pytest.raises(AssertionError, match="power-of-two blocks"):
        attention_config._check_s_buckets({key: ((8192, {"fwd_m": 48}),)})
    with pytest.raises(AssertionError, match=">= 64 rows"):  # mma.sync: other bytes
        attention_config._check_s_buckets({key: ((8192, {"fwd_m": 32}),)})
    with pytest.raises(AssertionError, match="ascending bounds"):
        attention_config._check_s_buckets({key: ((8192, {}), (512, {}))})
    with pytest.raises(AssertionError, match=r"\['fwd_n'\] are not launch fields"):
        attention_config._check_s_buckets({key: ((8192, {"fwd_n": 128}),)})
