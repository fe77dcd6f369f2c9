"""MM-RoPE (partial, rotate-half on 96 of 128 channels) and the timestep sinusoid under the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import rope, timestep
from h3gate.ops import reference as R

from .rows_support import BF16, FP32, batch_rows_invariant, bits_equal, check_backward, grads, randn, rel


def tables(s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.rand((s, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 300
    return R.rope_tables(pos, 16, 10000.0)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_rope_bitwise_forward_and_backward(dtype):
    s = 7
    x = randn((2, s, 3, 128), dtype)
    cos, sin = tables(s)
    assert cos.shape == (s, 96)
    out = rope.mm_rope(x, cos, sin)
    assert bits_equal(out, R.mm_rope(x, cos, sin))
    assert bits_equal(out[..., 96:], x[..., 96:])  # 32 channels pass through
    gout = randn(out.shape, dtype, 2)
    _, (gk,) = grads(lambda a: rope.mm_rope(a, cos, sin), (x,), (0,), gout)
    gold64 = grads(lambda a: R.mm_rope(a, cos.double(), sin.double()), (x,), (0,), gout, float64=True)[1][0]
    assert rel(gk, gold64) < (2e-2 if dtype == BF16 else 1e-6)
    assert bits_equal(gk, grads(lambda a: rope.mm_rope(a, cos, sin), (x,), (0,), gout)[1][0])
    batch_rows_invariant(lambda a: rope.mm_rope(a, cos, sin), (x[:1],), (0,), (0,))


def test_rope_full_rotation_differs_from_partial():
    """Rotating all 128 channels (a plausible implementation error, RFC H5) changes the bytes."""
    x = randn((1, 5, 2, 128), FP32)
    cos, sin = tables(5)
    full = rope.mm_rope(
        x, torch.cat([cos, cos[:, :32]], -1).contiguous(), torch.cat([sin, sin[:, :32]], -1).contiguous()
    )
    assert not bits_equal(full, rope.mm_rope(x, cos, sin))


def test_rope_invalid_inputs():
    cos, sin = tables(5)
    x = randn((1, 5, 2, 128), BF16)
    with pytest.raises(
        InputError, match=r"^h3_mm_rope_3axis_partial: x: head dim 64 unsupported \(this kernel is D = 128"
    ):
        rope.mm_rope(randn((1, 5, 2, 64), BF16), cos, sin)
    with pytest.raises(InputError, match=r"^h3_mm_rope_3axis_partial: cos: rotary width 130 unsupported"):
        rope.mm_rope(x, randn((5, 130), FP32), randn((5, 130), FP32))
    with pytest.raises(
        InputError, match=r"^h3_mm_rope_3axis_partial: cos/sin: shapes \(4, 96\)/\(4, 96\) do not match"
    ):
        rope.mm_rope(x, cos[:4], sin[:4])
    with pytest.raises(
        InputError, match=r"^h3_mm_rope_3axis_partial: sin: dtype bfloat16 not supported \(expected float32\)$"
    ):
        rope.mm_rope(x, cos, sin.bfloat16())
    with pytest.raises(InputError, match=r"^h3_mm_rope_3axis_partial: cos: gradients w.r.t. the RoPE tables"):
        rope.mm_rope(x, cos.clone().requires_grad_(), sin)


def test_timestep_sinusoid():
    t = torch.tensor([0.0, 0.3, 0.999, 1.0, 0.5])
    out = timestep.timestep_sinusoid(t, 256)
    ref = R.timestep_sinusoid(t, 256)
    assert out.dtype == FP32 and out.shape == (5, 256)
    assert rel(out, ref) < 1e-6 and float((out - ref).abs().max()) < 1e-6  # exp/sin/cos: numpy vs SLEEF, last ulp
    # f_0 = exp(0) = 1 exactly: column 0 is cos(t), column 128 sin(t) (the interpreter's functions are numpy's)
    assert torch.equal(out[:, 0], torch.from_numpy(np.cos(t.numpy())))
    assert torch.equal(out[:, 128], torch.from_numpy(np.sin(t.numpy())))
    check_backward(timestep.timestep_sinusoid, R.timestep_sinusoid, (t, 256), (0,))
    with pytest.raises(InputError, match=r"^timestep_sinusoid_h3: dim: 255 unsupported"):
        timestep.timestep_sinusoid(t, 255)
    with pytest.raises(InputError, match=r"^timestep_sinusoid_h3: timestep: expected 1 dims, got shape \(5, 1\)$"):
        timestep.timestep_sinusoid(t[:, None], 256)
