"""Shared launcher helpers for the strict Triton kernels."""

from __future__ import annotations

import os

import torch

from h3gate.errors import InputError

# Triton's CPU interpreter computes tl.dot on bf16 operands wrongly; kernels upcast dot operands when this is set.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"


def check_tensor(
    op: str,
    arg: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    ndim: int | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
) -> None:
    """Validate one kernel argument; raise a one-line InputError naming the operator and argument."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{op}: {arg}: expected a tensor, got {type(t).__name__}")
    if t.numel() == 0:
        raise InputError(f"{op}: {arg}: empty tensor {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InputError(f"{op}: {arg}: dtype {str(t.dtype).replace('torch.', '')} not supported (expected {names})")
    if ndim is not None and t.ndim != ndim:
        raise InputError(f"{op}: {arg}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise InputError(f"{op}: {arg}: on {t.device}, expected {device} (mixed devices)")
    if contiguous and not t.is_contiguous():
        raise InputError(f"{op}: {arg}: non-contiguous tensor (strides {t.stride()}); pass .contiguous() explicitly")
    if t.device.type == "cpu" and not INTERPRET:
        raise InputError(f"{op}: {arg}: CPU tensor needs TRITON_INTERPRET=1 (strict kernels run on CUDA)")


def check_indices(op: str, arg: str, idx: torch.Tensor, length: int | None, upper: int, device: torch.device) -> None:
    """int64 1-D index tensor of the given length with every value in [0, upper)."""
    check_tensor(op, arg, idx, (torch.int64,), ndim=1, device=device)
    if length is not None and idx.shape[0] != length:
        raise InputError(f"{op}: {arg}: length {idx.shape[0]}, expected {length}")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= upper:
        raise InputError(f"{op}: {arg}: index out of range [{lo}, {hi}] for size {upper}")
