"""Elementwise rows under the interpreter: SiLU paths, SwiGLU, AdaLN gated residual, conditioning noise mix.

Provider-bitwise where promised (gated residual, noise mix: no transcendental), accuracy vs float64 where not (the
SiLU rows use numpy's exp under the interpreter). Backward vs float64 autograd, repeat-bitwise, batch-row invariance.
"""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import elementwise as E
from h3gate.ops import reference as R

from .rows_support import BF16, FP32, FWD_TOL, batch_rows_invariant, bits_equal, check_backward, randn, rel


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_silu_rows(dtype):
    x = randn((3, 97), dtype)
    out = E.silu(x)
    assert out.dtype == dtype and rel(out, R.silu(x.double())) < FWD_TOL[dtype]
    check_backward(E.silu, R.silu, (x,), (0,))
    temb = randn((3, 96), FP32, 4)
    cast = E.silu_cast(temb, dtype)
    assert cast.dtype == dtype and rel(cast, R.silu(temb.double())) < FWD_TOL[dtype]
    check_backward(lambda t: E.silu_cast(t, dtype), lambda t: R.silu_cast(t, t.dtype), (temb,), (0,))


def test_silu_cast_rounds_at_temb_precision_then_casts():
    """bf16 temb: SiLU rounds to bf16 first, then the cast to float32 is exact (the provider's order)."""
    temb = randn((2, 64), BF16, 5)
    out = E.silu_cast(temb, FP32)
    assert out.dtype == FP32
    assert bits_equal(out, E.silu(temb).float())


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_swiglu(dtype):
    h = randn((2, 7, 2 * 48), dtype)
    out = E.swiglu(h)
    assert out.shape == (2, 7, 48) and rel(out, R.swiglu(h.double())) < FWD_TOL[dtype]
    check_backward(E.swiglu, R.swiglu, (h,), (0,))
    batch_rows_invariant(E.swiglu, (h[:1],), (0,), (0,))


def test_swiglu_chunk_order_value_first():
    """First half value, second half gate: a gate of zeros gives zeros whatever the value (silu(0) = 0)."""
    h = torch.cat([randn((1, 3, 8), FP32), torch.zeros(1, 3, 8)], dim=-1)
    assert torch.equal(E.swiglu(h), torch.zeros(1, 3, 8))


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_gate_residual_bitwise_and_backward(dtype):
    hdim = 64
    x, y = randn((2, 7, hdim), dtype), randn((2, 7, hdim), dtype, 1)
    gate = R.adaln_table(randn((2, 18 * hdim), dtype, 2, 0.5), hdim)[2]  # strided (3T, H) view
    idx = torch.tensor([0, 5, 0, 2, 0, 5, 1])
    assert bits_equal(E.gate_residual(x, y, gate, idx), R.gate_residual(x, y, gate, idx))
    g = check_backward(E.gate_residual, R.gate_residual, (x, y, gate, idx), (0, 1, 2))
    gout = randn((2, 7, hdim), dtype, 1)  # check_backward's seed: dy is the provider's bf16/fp32 product, bitwise
    assert bits_equal(g[1], (gout * gate.index_select(0, idx)).to(dtype))
    batch_rows_invariant(E.gate_residual, (x[:1], y[:1], gate, idx), (0, 1), (0, 1))


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_noise_mix_bitwise(dtype):
    s, n = randn((3, 5, 9), dtype), randn((3, 5, 9), dtype, 1)
    for t in (0.3, torch.tensor(0.7), torch.rand(3, generator=torch.Generator().manual_seed(0)), torch.rand(3, 5)):
        assert bits_equal(E.conditioning_noise_mix(s, t, n), R.conditioning_noise_mix(s, t, n))
    t = torch.tensor([0.25, 0.5, 0.9])
    check_backward(lambda a, b: E.conditioning_noise_mix(a, t, b), lambda a, b: R.conditioning_noise_mix(a, t, b),
                   (s, n), (0, 1))  # fmt: skip
    batch_rows_invariant(lambda a, tt, b: E.conditioning_noise_mix(a, tt, b), (s[:1], t[:1], n[:1]), (0, 1, 2), (0, 2))


def test_residual_add():
    x, y = randn((2, 5, 64), BF16), randn((2, 5, 64), BF16, 1)
    assert bits_equal(E.residual_add(x, y), R.residual_add(x, y))
    check_backward(E.residual_add, R.residual_add, (x, y), (0, 1))
    with pytest.raises(InputError, match=r"^residual_add: y: shape \(2, 4, 64\) differs from x \(2, 5, 64\)$"):
        E.residual_add(x, y[:, :4].contiguous())


def test_invalid_inputs():
    x = randn((1, 5, 64), BF16)
    gate = randn((6, 64), BF16)
    idx = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(InputError, match=r"^h3_swiglu: h: last dim 7 is odd \(expected 2F\)$"):
        E.swiglu(randn((2, 7), BF16))
    with pytest.raises(InputError, match=r"^timestep_mlp_silu: x: dtype int64 not supported"):
        E.silu(torch.ones(3, dtype=torch.int64))
    with pytest.raises(InputError, match=r"^adaln_silu_cast: dtype: torch.float16 not supported"):
        E.silu_cast(randn((2, 4), FP32), torch.float16)
    with pytest.raises(InputError, match=r"^adaln_gate_residual: y: shape \(1, 4, 64\) differs from x \(1, 5, 64\)$"):
        E.gate_residual(x, x[:, :4], gate, idx)
    with pytest.raises(InputError, match=r"^adaln_gate_residual: gate: dtype float32 differs from x \(bfloat16\)"):
        E.gate_residual(x, x, gate.float(), idx)
    with pytest.raises(
        InputError, match=r"^adaln_gate_residual: adaln_indices: index out of range \[-1, 0\] for size 6$"
    ):
        E.gate_residual(x, x, gate, torch.tensor([0, 0, -1, 0, 0]))
    s = randn((2, 3), FP32)
    t = torch.tensor([0.5, 0.5], requires_grad=True)
    with pytest.raises(InputError, match=r"^conditioning_noise_mix: t: gradients w.r.t. the schedule value"):
        E.conditioning_noise_mix(s, t, s)
    with pytest.raises(InputError, match=r"^conditioning_noise_mix: noise: dtype bfloat16 differs from sample"):
        E.conditioning_noise_mix(s, 0.5, s.bfloat16())
    with pytest.raises(InputError, match=r"^conditioning_noise_mix: t: shape \(3,\) does not broadcast over sample"):
        E.conditioning_noise_mix(s, torch.rand(3), s)
    with pytest.raises(InputError, match=r"^conditioning_noise_mix: t: on meta, expected cpu \(mixed devices\)$"):
        E.conditioning_noise_mix(s, torch.empty(2, device="meta"), s)


def _mix_ts(dtype):
    g = torch.Generator().manual_seed(5)
    return (
        0.3,
        1,
        torch.rand(3, generator=g),  # float32 (B,): a cast for bf16 samples, passed as is for fp32
        torch.rand(3, generator=g).to(dtype),  # (B,) at the sample dtype: no copy
        torch.rand(3, 1, 1, generator=g).to(dtype),  # broadcasting (B, 1, 1): no copy
        torch.rand(3, 5, 1, generator=g).to(dtype),  # (B, S, 1): no copy
        torch.rand(1, 5, generator=g).to(dtype),  # broadcasts over B: expanded copy
        torch.rand(3, 1, 1, generator=g, dtype=torch.float64),  # float64: cast (RNE) first
        torch.rand(3, 5, 9, generator=g).to(dtype)[:, :, ::2].contiguous()[..., :1],  # non-contiguous (B, S, 1)
    )


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_noise_mix_fast_path_is_bitwise_the_autograd_path(dtype, monkeypatch):
    s, n = randn((3, 5, 9), dtype), randn((3, 5, 9), dtype, 1)
    taken = []
    apply = E._NoiseMix.apply
    monkeypatch.setattr(E._NoiseMix, "apply", lambda *a: taken.append(1) or apply(*a))
    for t in _mix_ts(dtype):
        ref = R.conditioning_noise_mix(s, t, n)
        with torch.no_grad():
            fast = E.conditioning_noise_mix(s, t, n)
        plain = E.conditioning_noise_mix(s, t, n)  # grad mode on, nothing requires grad: also the direct launch
        assert not taken and fast.grad_fn is None and plain.grad_fn is None
        sg, ng = s.detach().requires_grad_(True), n.detach().requires_grad_(True)
        slow = E.conditioning_noise_mix(sg, t, ng)
        assert taken.pop() and slow.grad_fn is not None
        assert bits_equal(fast, ref) and bits_equal(plain, ref) and bits_equal(slow.detach(), ref), t
        gs, gn = torch.autograd.grad(slow, (sg, ng), torch.ones_like(slow))
        tt = (t if isinstance(t, torch.Tensor) else torch.tensor(t)).to(dtype)
        tt = tt.reshape(*tt.shape, *([1] * (s.ndim - tt.ndim)))
        assert bits_equal(gs, tt.expand(s.shape).contiguous()) and bits_equal(gn, (1 - tt).expand(s.shape).contiguous())
        only_noise = E.conditioning_noise_mix(s, t, ng)  # one input requiring grad is enough for the autograd path
        assert taken.pop() and only_noise.grad_fn is not None


def test_noise_mix_fast_path_never_calls_apply(monkeypatch):
    def boom(*_):
        raise AssertionError("autograd.Function.apply called without a graph to build")

    monkeypatch.setattr(E._NoiseMix, "apply", boom)
    s, n = randn((3, 5, 9), BF16), randn((3, 5, 9), BF16, 1)
    with torch.no_grad():
        E.conditioning_noise_mix(s.requires_grad_(True), 0.5, n)
    with torch.inference_mode():
        assert bits_equal(E.conditioning_noise_mix(s, 0.5, n), R.conditioning_noise_mix(s, 0.5, n))
    with pytest.raises(AssertionError, match="apply called"):
        E.conditioning_noise_mix(s, 0.5, n)


def test_noise_mix_skips_no_op_copies_and_caches_number_t(monkeypatch):
    seen = []
    launch = E._mix_launch
    monkeypatch.setattr(E, "_mix_launch", lambda s, t, n: seen.append(t) or launch(s, t, n))
    s, n = randn((3, 5, 9), BF16), randn((3, 5, 9), BF16, 1)
    for t in (torch.rand(3), torch.rand(3, 1, 1), torch.rand(3, 5), torch.tensor(0.5), torch.rand(1, 1)):
        t = t.to(BF16)
        E.conditioning_noise_mix(s, t, n)
        assert seen.pop() is t  # passed as is: no cast, expand or copy
    E.conditioning_noise_mix(s, torch.rand(1, 5).bfloat16(), n)
    assert seen.pop().shape == (3, 5)  # a real broadcast is still materialised
    E.conditioning_noise_mix(s, 0.3, n)
    E.conditioning_noise_mix(s, 0.3, n)
    first, second = seen
    assert first is second and bits_equal(first.reshape(1), torch.tensor([0.3], dtype=BF16))
    E.conditioning_noise_mix(s.float(), 0.3, n.float())
    assert seen.pop().dtype == FP32  # keyed by dtype


def test_noise_mix_number_cache_keeps_signed_zero():
    """t = +0.0 and -0.0 compare (and hash) equal but differ in bytes: rnd(t * 1) + rnd(1 * -0.0) is +0.0 vs -0.0."""
    s, n = torch.ones(2, 4), torch.full((2, 4), -0.0)
    for t in (0.0, -0.0, 0.0):
        got = E.conditioning_noise_mix(s, t, n)
        assert bits_equal(got, R.conditioning_noise_mix(s, t, n))
        assert bool(torch.signbit(got).all()) == (str(t) == "-0.0")


def test_noise_mix_number_t_cached_in_inference_mode_serves_autograd():
    """A number t first seen under inference mode is cached as a normal tensor, so a later autograd call can save it."""
    s, n = randn((2, 3, 4), FP32), randn((2, 3, 4), FP32, 1)
    with torch.inference_mode():
        E.conditioning_noise_mix(s, 0.4375, n)
    sg = s.detach().requires_grad_(True)
    out = E.conditioning_noise_mix(sg, 0.4375, n)
    (gs,) = torch.autograd.grad(out, (sg,), torch.ones_like(out))
    assert bits_equal(out.detach(), R.conditioning_noise_mix(s, 0.4375, n))
    assert bits_equal(gs, torch.full_like(s, 0.4375))
