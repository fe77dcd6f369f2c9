"""Elementwise rows: ``timestep_mlp_silu``, ``adaln_silu_cast``, ``h3_swiglu``, ``adaln_gate_residual``,
``conditioning_noise_mix`` and the token refiner's ungated ``residual_add``. No reductions except the AdaLN
gate-table gradient.

Every op computes in float32 and rounds once per PyTorch op, to that op's dtype, in the provider's order
(``rnd`` = round to the tensor dtype and read back; float32 ops round in the float32 arithmetic itself; launches
forbid FMA contraction so no two ops fuse):

* ``silu(x) = rnd(x / (1 + exp(-x)))`` (IEEE division; ``exp`` is libdevice ``__nv_expf`` on CUDA - PyTorch's
  eager formula and function - and numpy's under the interpreter);
* ``silu_cast(temb, dtype) = cast_dtype(rnd_temb(silu(temb)))`` (activation at temb precision, one cast after);
* ``swiglu(h) = rnd(value * rnd(silu(gate)))`` with ``value, gate = h.chunk(2, -1)`` (first half value);
* ``gate_residual(x, y, gate, idx) = rnd(x + rnd(gate[idx[s]] * y))`` (residual first);
* ``residual_add(x, y) = rnd(x + y)``;
* ``conditioning_noise_mix(s, t, n) = rnd(rnd(t * s) + rnd(rnd(1 - t) * n))`` with ``t`` cast to the sample dtype.

Provider-bitwise where the op has no transcendental (gate_residual, residual_add, noise mix) on every device; the
SiLU rows use ``exp`` and are bitwise only where the kernel's ``exp`` is PyTorch's (measured by ws1-ops on CUDA).

Backward (float32, cast once, row-local): ``dsilu = sig * (1 + x * (1 - sig))``; swiglu ``dvalue = rnd(g * s)``,
``dgate = g * value * dsilu(gate)``; gate_residual ``dx = g``, ``dy = rnd(g * gate[idx])``, ``dgate`` = fixed-order
segment sum of ``g * y`` (``gather.table_grad``); noise mix ``dsample = rnd(g * t)``, ``dnoise = rnd(g * (1 - t))``.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from h3gate.errors import InputError
from h3gate.kernels import exact
from h3gate.kernels.common import (
    INTERPRET,
    ROW_SCALE,
    STRICT_LAUNCH,
    check_dtype_as,
    check_indices,
    check_table,
    check_tensor,
    needs_graph,
    next_pow2,
)
from h3gate.kernels.gather import table_grad

BLOCK = 1024 * ROW_SCALE
_DTYPES = (torch.float32, torch.bfloat16)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


@triton.jit
def _silu_kernel(x_ptr, out_ptr, g_ptr, N, MID: tl.constexpr, BWD: tl.constexpr, BLOCK: tl.constexpr,
                 INTERPRET: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = exact.f32(tl.load(x_ptr + offs, mask=m, other=0.0), INTERPRET)
    if BWD:
        g = exact.f32(tl.load(g_ptr + offs, mask=m, other=0.0), INTERPRET)
        y = g * exact.dsilu(x, INTERPRET)
    else:
        y = exact.rnd(exact.silu(x, INTERPRET), MID, INTERPRET)
    tl.store(out_ptr + offs, exact.rne(y, out_ptr.dtype.element_ty, INTERPRET), mask=m)


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        mid = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32
        _silu_kernel[_grid(x.numel())](
            x, out, x, x.numel(), MID=mid, BWD=False, BLOCK=BLOCK, INTERPRET=INTERPRET, **STRICT_LAUNCH
        )
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        g = grad.contiguous()
        _silu_kernel[_grid(x.numel())](
            x, dx, g, x.numel(), MID=tl.float32, BWD=True, BLOCK=BLOCK, INTERPRET=INTERPRET, **STRICT_LAUNCH
        )
        return dx, None


def silu(x: torch.Tensor) -> torch.Tensor:
    """``timestep_mlp_silu``: SiLU at the input's precision (float32 in the timestep MLP)."""
    check_tensor("timestep_mlp_silu", "x", x, _DTYPES)
    return _Silu.apply(x, x.dtype)


def silu_cast(temb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``adaln_silu_cast``: SiLU at ``temb``'s precision, then one cast to ``dtype`` (the projection's)."""
    check_tensor("adaln_silu_cast", "temb", temb, _DTYPES)
    if dtype not in _DTYPES:
        raise InputError(f"adaln_silu_cast: dtype: {dtype} not supported (expected float32, bfloat16)")
    return _Silu.apply(temb, dtype)


@triton.jit
def _swiglu_kernel(
    h_ptr, out_ptr, g_ptr, dh_ptr, M, F,
    BWD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (rows < M)[:, None] & (cols < F)[None, :]
    DT: tl.constexpr = h_ptr.dtype.element_ty
    hv = rows[:, None] * 2 * F + cols[None, :]
    ho = rows[:, None] * F + cols[None, :]
    value = exact.f32(tl.load(h_ptr + hv, mask=m, other=0.0), INTERPRET)
    gate = exact.f32(tl.load(h_ptr + hv + F, mask=m, other=0.0), INTERPRET)
    s = exact.rnd(exact.silu(gate, INTERPRET), DT, INTERPRET)
    if BWD:
        g = exact.f32(tl.load(g_ptr + ho, mask=m, other=0.0), INTERPRET)
        tl.store(dh_ptr + hv, exact.rne(g * s, DT, INTERPRET), mask=m)
        dgate = g * value * exact.dsilu(gate, INTERPRET)
        tl.store(dh_ptr + hv + F, exact.rne(dgate, DT, INTERPRET), mask=m)
    else:
        tl.store(out_ptr + ho, exact.rne(value * s, DT, INTERPRET), mask=m)


def _swiglu_launch(h: torch.Tensor, out: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, bwd: bool) -> None:
    f = h.shape[-1] // 2
    rows = h.numel() // (2 * f)
    block_f = min(1024, next_pow2(f))
    block_m = max(1, 2048 // block_f) * ROW_SCALE
    _swiglu_kernel[(triton.cdiv(rows, block_m), triton.cdiv(f, block_f))](
        h, out, g, dh, rows, f, BWD=bwd, BLOCK_M=block_m, BLOCK_F=block_f, INTERPRET=INTERPRET, **STRICT_LAUNCH
    )


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty((*h.shape[:-1], h.shape[-1] // 2), dtype=h.dtype, device=h.device)
        _swiglu_launch(h, out, h, h, bwd=False)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (h,) = ctx.saved_tensors
        dh = torch.empty_like(h)
        _swiglu_launch(h, h, grad.contiguous(), dh, bwd=True)
        return dh


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``h3_swiglu``: (..., 2F) -> (..., F), ``value * silu(gate)`` with the first half the value."""
    check_tensor("h3_swiglu", "h", h, _DTYPES)
    if h.shape[-1] % 2:
        raise InputError(f"h3_swiglu: h: last dim {h.shape[-1]} is odd (expected 2F)")
    return _Swiglu.apply(h)


@triton.jit
def _gate_kernel(
    x_ptr, y_ptr, gate_ptr, idx_ptr, out_ptr, M, H, S, gate_rs,
    BWD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rm = rows < M
    m = rm[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    j = tl.load(idx_ptr + rows % S, mask=rm, other=0).to(tl.int64)
    gate = exact.f32(tl.load(gate_ptr + j[:, None] * gate_rs + cols[None, :], mask=m, other=0.0), INTERPRET)
    y = exact.f32(tl.load(y_ptr + offs, mask=m, other=0.0), INTERPRET)  # BWD: y_ptr holds the output gradient
    if BWD:
        out = gate * y
    else:
        x = exact.f32(tl.load(x_ptr + offs, mask=m, other=0.0), INTERPRET)
        out = x + exact.rnd(gate * y, DT, INTERPRET)
    tl.store(out_ptr + offs, exact.rne(out, DT, INTERPRET), mask=m)


def gate_launch(x, y, gate, idx, out, bwd: bool) -> None:
    h = x.shape[-1]
    m = x.numel() // h
    block_h = min(next_pow2(h), 1024)
    block_m = max(1, 2048 // block_h) * ROW_SCALE
    grid = (triton.cdiv(m, block_m), triton.cdiv(h, block_h))
    _gate_kernel[grid](
        x, y, gate, idx, out, m, h, idx.shape[0], gate.stride(0),
        BWD=bwd, BLOCK_M=block_m, BLOCK_H=block_h, INTERPRET=INTERPRET, **STRICT_LAUNCH,
    )  # fmt: skip


class _GateResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate, idx):
        out = torch.empty_like(x)
        gate_launch(x, y, gate, idx, out, bwd=False)
        ctx.save_for_backward(y, gate)
        ctx.idx = idx
        return out

    @staticmethod
    def backward(ctx, grad):
        y, gate = ctx.saved_tensors
        idx = ctx.idx
        g = grad.contiguous()
        dy = dgate = None
        if ctx.needs_input_grad[1]:
            dy = torch.empty_like(y)
            gate_launch(y, g, gate, idx, dy, bwd=True)
        if ctx.needs_input_grad[2]:
            dgate = table_grad(g, idx, gate.shape[0], gate.dtype, other=y)
        return g, dy, dgate, None


def check_gate_residual(op: str, x, y, gate, adaln_indices) -> None:
    """The gated residual's inputs (``adaln_gate_residual`` and its ``_seg8`` twin)."""
    check_tensor(op, "x", x, _DTYPES)
    if x.ndim not in (2, 3):
        raise InputError(f"{op}: x: expected (B, S, H) or (S, H), got shape {tuple(x.shape)}")
    check_tensor(op, "y", y, _DTYPES, device=x.device)
    check_dtype_as(op, "y", y, x.dtype, "x")
    if y.shape != x.shape:
        raise InputError(f"{op}: y: shape {tuple(y.shape)} differs from x {tuple(x.shape)}")
    check_table(op, "gate", gate, _DTYPES, x.shape[-1], x.device)
    check_dtype_as(op, "gate", gate, x.dtype, "x")
    check_indices(op, "adaln_indices", adaln_indices, x.shape[-2], gate.shape[0], x.device)


def gate_residual(x, y, gate, adaln_indices) -> torch.Tensor:
    """``adaln_gate_residual``: ``x + gate[idx] * y`` for (B, S, H) or (S, H) x/y and a (3T, H) row-strided table."""
    check_gate_residual("adaln_gate_residual", x, y, gate, adaln_indices)
    return _GateResidual.apply(x, y, gate, adaln_indices)


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, N, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = exact.f32(tl.load(x_ptr + offs, mask=m, other=0.0), INTERPRET)
    y = exact.f32(tl.load(y_ptr + offs, mask=m, other=0.0), INTERPRET)
    tl.store(out_ptr + offs, exact.rne(x + y, out_ptr.dtype.element_ty, INTERPRET), mask=m)


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        out = torch.empty_like(x)
        _add_kernel[_grid(x.numel())](x, y, out, x.numel(), BLOCK=BLOCK, INTERPRET=INTERPRET, **STRICT_LAUNCH)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``residual_add`` (token refiner, no gate): ``round(x + y)`` at the operands' dtype; backward ``(g, g)``."""
    op = "residual_add"
    check_tensor(op, "x", x, _DTYPES)
    check_tensor(op, "y", y, _DTYPES, device=x.device)
    check_dtype_as(op, "y", y, x.dtype, "x")
    if y.shape != x.shape:
        raise InputError(f"{op}: y: shape {tuple(y.shape)} differs from x {tuple(x.shape)}")
    return _ResidualAdd.apply(x, y)


@triton.jit
def _mix_kernel(s_ptr, n_ptr, t_ptr, out_ptr, out2_ptr, N, inner, BWD: tl.constexpr, BLOCK: tl.constexpr,
                INTERPRET: tl.constexpr):  # fmt: skip
    DT: tl.constexpr = out_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    t = exact.f32(tl.load(t_ptr + offs // inner, mask=m, other=0.0), INTERPRET)
    a = exact.f32(tl.load(s_ptr + offs, mask=m, other=0.0), INTERPRET)  # BWD: s_ptr holds the output gradient
    one_minus = exact.rnd(1.0 - t, DT, INTERPRET)
    if BWD:
        tl.store(out_ptr + offs, exact.rne(a * t, DT, INTERPRET), mask=m)
        tl.store(out2_ptr + offs, exact.rne(a * one_minus, DT, INTERPRET), mask=m)
    else:
        noise = exact.f32(tl.load(n_ptr + offs, mask=m, other=0.0), INTERPRET)
        out = exact.rnd(a * t, DT, INTERPRET) + exact.rnd(one_minus * noise, DT, INTERPRET)
        tl.store(out_ptr + offs, exact.rne(out, DT, INTERPRET), mask=m)


def _mix_launch(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The one forward launch of the noise mix (autograd and no-grad paths); ``t`` contiguous at the sample dtype,
    laid out over the sample's leading dims (``t[offs // inner]``, ``inner = sample.numel() // t.numel()``)."""
    out = torch.empty_like(sample)
    n = sample.numel()
    _mix_kernel[_grid(n)](
        sample, noise, t, out, out, n, n // t.numel(), BWD=False, BLOCK=BLOCK, INTERPRET=INTERPRET, **STRICT_LAUNCH
    )
    return out


class _NoiseMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sample, t, noise):
        ctx.save_for_backward(t)
        return _mix_launch(sample, t, noise)

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        g = grad.contiguous()
        ds, dn = torch.empty_like(g), torch.empty_like(g)
        _mix_kernel[_grid(g.numel())](
            g, g, t, ds, dn, g.numel(), g.numel() // t.numel(), BWD=True, BLOCK=BLOCK, INTERPRET=INTERPRET,
            **STRICT_LAUNCH,
        )  # fmt: skip
        return ds, None, dn


_T_CACHE: dict[tuple, torch.Tensor] = {}
_T_CACHE_MAX = 1024


def _number_t(t: int | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(t, dtype=dtype, device=device)``, memoised per (exact value, type, dtype, device): the very
    bytes the provider builds, without a host-to-device copy per call. Floats are keyed by their float64 bits (so
    -0.0 and 0.0, or NaN payloads, never share an entry). The tensor is internal and only ever read; it is built
    outside inference mode so an autograd call may save it for backward."""
    value = struct.pack("<d", t) if isinstance(t, float) else t
    key = (type(t), value, dtype, device)
    tt = _T_CACHE.get(key)
    if tt is None:
        with torch.inference_mode(False):
            tt = torch.tensor(t, dtype=dtype, device=device)
        if len(_T_CACHE) >= _T_CACHE_MAX:
            _T_CACHE.pop(next(iter(_T_CACHE)))  # oldest first
        _T_CACHE[key] = tt
    return tt


def _tensor_t(op: str, t: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Validated ``t`` cast to the sample dtype (RNE, ``.to``), laid out contiguously over the leading dims it covers.

    No copy when that is already so: ``t`` at the sample dtype, contiguous, and its elements exactly the sample's
    first ``k`` dims (``k`` = t's dims up to its last non-1 one; broadcast 1-dims after it index nothing), or a single
    element. Otherwise ``t.to(dtype).expand(lead).contiguous()`` as before - the same values either way."""
    check_tensor(op, "t", t, (torch.float32, torch.bfloat16, torch.float64), device=sample.device, contiguous=False)
    if t.requires_grad:
        raise InputError(f"{op}: t: gradients w.r.t. the schedule value are not supported")
    shape, lead = t.shape, sample.shape[: t.ndim]
    if t.ndim > sample.ndim or any(a != 1 and a != b for a, b in zip(shape, lead, strict=True)):
        raise InputError(f"{op}: t: shape {tuple(shape)} does not broadcast over sample {tuple(sample.shape)}")
    tt = t if t.dtype == sample.dtype else t.to(sample.dtype)
    k = len(shape)
    while k and shape[k - 1] == 1:
        k -= 1
    if tt.is_contiguous() and tt.numel() == math.prod(lead[:k]):
        return tt
    return tt.expand(lead).contiguous()


def conditioning_noise_mix(sample: torch.Tensor, t, noise: torch.Tensor) -> torch.Tensor:
    """``t * sample + (1 - t) * noise``; ``t`` a number or a tensor on the sample's device broadcasting over the
    sample's leading dims (cast to the sample dtype first, as the provider does). No gradient w.r.t. ``t``.

    Without an autograd graph to build (grad mode off, or neither sample nor noise requires grad) the launch is made
    directly, skipping ``autograd.Function.apply``: the same kernel and bytes, less host time."""
    op = "conditioning_noise_mix"
    check_tensor(op, "sample", sample, _DTYPES)
    check_tensor(op, "noise", noise, _DTYPES, device=sample.device)
    check_dtype_as(op, "noise", noise, sample.dtype, "sample")
    if noise.shape != sample.shape:
        raise InputError(f"{op}: noise: shape {tuple(noise.shape)} differs from sample {tuple(sample.shape)}")
    if isinstance(t, torch.Tensor):
        tt = _tensor_t(op, t, sample)
    elif isinstance(t, int | float) and not isinstance(t, bool):
        tt = _number_t(t, sample.dtype, sample.device)
    else:
        raise InputError(f"{op}: t: expected a number or a tensor, got {type(t).__name__}")
    if needs_graph(sample, noise):
        return _NoiseMix.apply(sample, tt, noise)
    return _mix_launch(sample, tt, noise)
