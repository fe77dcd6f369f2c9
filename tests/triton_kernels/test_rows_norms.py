"""RMSNorm rows under the interpreter: h3_rmsnorm, h3_rmsnorm_modulate / final_adaln_out, h3_qk_rmsnorm_d128.

Forward: bitwise vs the provider on exact-sum inputs (where the sum's order cannot matter, so every rounding point is
tested), accuracy vs float64 on random inputs. Backward vs float64 autograd, repeat-bitwise, batch-row invariance.
Input validation with exact messages.
"""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import norms
from h3gate.ops import reference as R

from .rows_support import (
    BF16,
    FP32,
    FWD_TOL,
    batch_rows_invariant,
    bits_equal,
    check_backward,
    exact_sum_rows,
    randn,
    rel,
)

EPS = 1e-5


def tables(h: int, dtype: torch.dtype, t: int = 2, seed: int = 3) -> tuple[torch.Tensor, ...]:
    """The provider's strided (3T, H) views of one projection output."""
    return R.adaln_table(randn((t, 18 * h), dtype, seed, 0.1), h)


def weight(h: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    return (1 + 0.1 * randn((h,), FP32, seed)).to(dtype)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("s", [1, 33])
def test_forward_bitwise_on_exact_sums(dtype, s):
    h = 192
    x = exact_sum_rows((2, s, h), dtype)
    w = weight(h, dtype)
    shift, scale = tables(h, dtype)[:2]
    idx = torch.randint(0, 6, (s,), generator=torch.Generator().manual_seed(s))
    assert bits_equal(norms.rmsnorm(x, w, EPS), R.rmsnorm(x, w, EPS))
    assert bits_equal(
        norms.rmsnorm_modulate(x, w, shift, scale, idx, EPS), R.rmsnorm_modulate(x, w, shift, scale, idx, EPS)
    )
    fs, fc = randn((2, 2 * h), dtype, 5, 0.1).chunk(2, dim=-1)
    t_idx = idx % 2
    assert bits_equal(norms.final_adaln_out(x, w, fs, fc, t_idx, EPS), R.rmsnorm_modulate(x, w, fs, fc, t_idx, EPS))
    xq = exact_sum_rows((2, s, 3 * 128), dtype, 1)
    wq = weight(128, dtype)
    assert bits_equal(norms.qk_rmsnorm(xq, wq, 3, EPS), R.qk_rmsnorm(xq, wq, 3, EPS))


@pytest.mark.parametrize("h", [2049, 4100])
def test_wide_rows_take_the_chunked_forward(h):
    """Rows wider than CHUNK_H are reduced in CHUNK_H column chunks (two passes): every rounding point still matches
    the provider on exact-sum inputs, accuracy vs float64 holds on random ones, and a chunk count > 1 is really used."""
    assert norms._fwd_config(h)[2] == -(-h // norms.CHUNK_H) > 1
    assert norms._fwd_config(norms.CHUNK_H)[2] == 1
    x = exact_sum_rows((1, 3, h), BF16)
    w = weight(h, BF16)
    shift, scale = tables(h, BF16)[:2]
    idx = torch.tensor([5, 0, 3])
    assert bits_equal(norms.rmsnorm(x, w, EPS), R.rmsnorm(x, w, EPS))
    assert bits_equal(
        norms.rmsnorm_modulate(x, w, shift, scale, idx, EPS), R.rmsnorm_modulate(x, w, shift, scale, idx, EPS)
    )
    xr = randn((1, 3, h), BF16, 4)
    gold = R.rmsnorm_modulate(*(a.double() for a in (xr, w, shift, scale)), idx, EPS)
    assert rel(norms.rmsnorm_modulate(xr, w, shift, scale, idx, EPS), gold) < FWD_TOL[BF16]
    check_backward(norms.rmsnorm, R.rmsnorm, (randn((1, 3, h), FP32, 6), weight(h, FP32), EPS), (0, 1))


def test_rounding_rule_is_what_makes_it_bitwise(monkeypatch):
    """The measured rounding order matters: forcing the other order breaks bitwise equality on the same inputs."""
    h = 192
    x = exact_sum_rows((1, 33, h), BF16)
    w = randn((h,), BF16, 9)  # a weight far from 1 so the two orders round differently
    assert bits_equal(norms.rmsnorm(x, w, EPS), R.rmsnorm(x, w, EPS))
    measured = norms.provider_rounds_first(x.device)
    monkeypatch.setattr(norms, "provider_rounds_first", lambda device: not measured)
    assert not bits_equal(norms.rmsnorm(x, w, EPS), R.rmsnorm(x, w, EPS))


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_forward_accuracy_random(dtype):
    h = 192
    x = randn((1, 7, h), dtype)
    w = weight(h, dtype)
    shift, scale = tables(h, dtype)[:2]
    idx = torch.tensor([0, 5, 3, 3, 1, 2, 4])
    out = norms.rmsnorm_modulate(x, w, shift, scale, idx, EPS)
    args64 = [a.double() for a in (x, w, shift, scale)]
    gold = R.rmsnorm_modulate(*args64, idx, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel(out, gold) < FWD_TOL[dtype]


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_modulate_backward(dtype):
    h = 64
    x = randn((2, 7, h), dtype)
    shift, scale = tables(h, dtype)[:2]
    idx = torch.tensor([0, 5, 0, 0, 1, 5, 4])  # duplicate table rows: segment sums with several terms
    args = (x, weight(h, dtype), shift, scale, idx, EPS)
    check_backward(norms.rmsnorm_modulate, R.rmsnorm_modulate, args, (0, 1, 2, 3))


def test_plain_and_qk_backward():
    check_backward(norms.rmsnorm, R.rmsnorm, (randn((3, 5, 96), BF16), weight(96, BF16), EPS), (0, 1))
    qk = (randn((1, 7, 2 * 128), FP32), weight(128, FP32), 2, EPS)
    check_backward(norms.qk_rmsnorm, R.qk_rmsnorm, qk, (0, 1))


def test_batch_row_invariance():
    h = 192
    shift, scale = tables(h, BF16)[:2]
    idx = torch.tensor([1, 4, 2, 0, 5, 3, 1])
    args = (randn((1, 7, h), BF16), weight(h, BF16), shift, scale, idx, EPS)
    batch_rows_invariant(norms.rmsnorm_modulate, args, batch_pos=(0,), grad_pos=(0,))
    batch_rows_invariant(norms.qk_rmsnorm, (randn((1, 7, 256), BF16), weight(128, BF16), 2, EPS), (0,), (0,))


def test_weight_gradient_order_is_fixed_across_row_counts():
    """dweight is a fixed-order sum: repeat-bitwise at a row count spanning several backward programs."""
    x = randn((1, 97, 64), FP32)
    w = weight(64, FP32)
    outs = []
    for _ in range(2):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        norms.rmsnorm(xr, wr, EPS).sum().backward()
        outs.append(wr.grad)
    assert bits_equal(outs[0], outs[1])
    gold = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)).sum((0, 1))
    assert rel(outs[0], gold) < 1e-6


def test_invalid_inputs():
    h = 64
    x = randn((1, 5, h), BF16)
    w = weight(h, BF16)
    shift, scale = tables(h, BF16)[:2]
    idx = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(
        InputError, match=r"^h3_rmsnorm: x: dtype float16 not supported \(expected float32, bfloat16\)$"
    ):
        norms.rmsnorm(x.half(), w, EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm: weight: dtype float32 differs from x \(bfloat16\)"):
        norms.rmsnorm(x, w.float(), EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm: x: non-contiguous tensor"):
        norms.rmsnorm(x.transpose(1, 2), w, EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm: x: empty tensor \(1, 0, 64\)$"):
        norms.rmsnorm(x[:, :0], w, EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm: weight: on meta, expected cpu \(mixed devices\)$"):
        norms.rmsnorm(x, torch.empty(h, dtype=BF16, device="meta"), EPS)
    with pytest.raises(
        InputError, match=r"^h3_rmsnorm_modulate: adaln_indices: index out of range \[0, 6\] for size 6$"
    ):
        norms.rmsnorm_modulate(x, w, shift, scale, torch.tensor([0, 1, 2, 3, 6]), EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm_modulate: adaln_indices: length 4, expected 5$"):
        norms.rmsnorm_modulate(x, w, shift, scale, idx[:4], EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm_modulate: adaln_indices: dtype int32 not supported"):
        norms.rmsnorm_modulate(x, w, shift, scale, idx.int(), EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm_modulate: scale: unsupported layout \(strides \(1, 6\)\)"):
        norms.rmsnorm_modulate(x, w, shift, torch.empty(h, 6, dtype=BF16).t(), idx, EPS)
    with pytest.raises(
        InputError, match=r"^h3_qk_rmsnorm_d128: x: head dim 64 unsupported \(this kernel is D = 128 only\)$"
    ):
        norms.qk_rmsnorm(randn((1, 5, 128), BF16), weight(64, BF16), 2, EPS)
    with pytest.raises(InputError, match=r"^h3_rmsnorm: eps: must be a positive number, got 0$"):
        norms.rmsnorm(x, w, 0)
