"""Shared helpers of the ``test_rows_*`` kernel tests (CPU, Triton interpreter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

BF16, FP32 = torch.bfloat16, torch.float32
# rel-L2 vs float64: a few bf16 roundings (~2e-3 each) / float32 roundings (~6e-8 each).
FWD_TOL = {BF16: 1e-2, FP32: 1e-5}
BWD_TOL = {BF16: 2e-2, FP32: 1e-5}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape: Sequence[int], dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen(seed)) * scale).to(dtype)


def exact_sum_rows(shape: Sequence[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values k/4, |k| <= 16: squares and their row sums are exact in float32, so any summation order agrees."""
    return (torch.randint(-16, 17, tuple(shape), generator=gen(seed)).float() / 4).to(dtype)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((a.double() - ref).norm() / ref.norm())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def grads(
    fn: Callable, args: Sequence, grad_pos: Sequence[int], gout: torch.Tensor, float64: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients of ``fn(*args)`` w.r.t. ``args[grad_pos]`` (float64 copies of every float arg if asked)."""
    a = list(args)
    if float64:
        a = [x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in a]
    leaves = []
    for i in grad_pos:
        a[i] = a[i].detach().requires_grad_(True)
        leaves.append(a[i])
    out = fn(*a)
    g = torch.autograd.grad(out, leaves, gout.double() if float64 else gout)
    return out.detach(), [x.detach() for x in g]


def check_backward(kernel: Callable, reference: Callable, args: Sequence, grad_pos: Sequence[int], seed: int = 1):
    """Kernel gradients vs float64 autograd of the reference (tolerance by dtype) and repeat-bitwise."""
    out = kernel(*args)
    gout = randn(out.shape, out.dtype, seed)
    _, g1 = grads(kernel, args, grad_pos, gout)
    _, g2 = grads(kernel, args, grad_pos, gout)
    _, g64 = grads(reference, args, grad_pos, gout, float64=True)
    for pos, a, b, gold in zip(grad_pos, g1, g2, g64, strict=True):
        assert bits_equal(a, b), f"gradient of arg {pos} not repeatable"
        assert a.dtype == args[pos].dtype and a.shape == args[pos].shape
        assert rel(a, gold) < BWD_TOL[a.dtype], f"gradient of arg {pos}: rel_l2 {rel(a, gold)}"
    return g1


def batch_rows_invariant(kernel: Callable, args: Sequence, batch_pos: Sequence[int], grad_pos: Sequence[int]) -> None:
    """Item 0 of a batch of 1 vs the same item at every position of a batch of 3 (fresh random neighbours): forward
    bytes and the gradient bytes of every batched grad argument."""
    out1 = kernel(*args)
    gout1 = randn(out1.shape, out1.dtype, 7)
    _, g1 = grads(kernel, args, grad_pos, gout1)
    for position in range(3):
        wide = list(args)
        for p in batch_pos:
            parts = [randn(args[p].shape, args[p].dtype, 100 + i) for i in range(3)]
            parts[position] = args[p]
            wide[p] = torch.cat(parts, 0)
        gparts = [randn(gout1.shape, gout1.dtype, 200 + i) for i in range(3)]
        gparts[position] = gout1
        out3, g3 = grads(kernel, wide, grad_pos, torch.cat(gparts, 0))
        assert bits_equal(out3[position : position + 1], out1), f"forward bytes moved at position {position}"
        for pos, a, b in zip(grad_pos, g1, g3, strict=True):
            if pos in batch_pos:
                assert bits_equal(b[position : position + 1], a), f"grad of arg {pos} moved at position {position}"
