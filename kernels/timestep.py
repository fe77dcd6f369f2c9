"""``timestep_sinusoid_h3``: (T,) timesteps -> (T, dim) float32 ``[cos(t * f_i) | sin(t * f_i)]``.

The provider's op sequence (diffusers ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)``), every step
in float32 with one rounding each: ``e_i = fp32(-ln 1e4) * i``; ``e_i = e_i / half`` (IEEE division);
``f_i = exp(e_i)``; ``a_i = t * f_i``; output ``[cos(a) | sin(a)]`` (cos first). One program per timestep; no
reduction. ``exp/sin/cos`` are libdevice's ``__nv_expf/__nv_sinf/__nv_cosf`` on CUDA (the functions PyTorch's eager
CUDA kernels call) and numpy's under the interpreter, so provider-bitwise equality is measured, not promised: on
CPU numpy and PyTorch's SLEEF differ in the last ulp.

Backward (float32): ``dt = sum_i f_i * (g_sin_i * cos(a_i) - g_cos_i * sin(a_i))`` - one ``tl.sum`` tree over the
row's ``BLOCK`` lanes per timestep (row-local, deterministic), cast once to the timestep dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3gate.errors import InputError
from h3gate.kernels import exact
from h3gate.kernels.common import INTERPRET, STRICT_LAUNCH, check_tensor, next_pow2

_OP = "timestep_sinusoid_h3"
_NEG_LOG = -math.log(10000)


@exact.helper
def _angles(t_ptr, ti, half, half_f, neg_log, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.arange(0, BLOCK)
    f = exact.exp(tl.div_rn(i.to(tl.float32) * neg_log, half_f), INTERPRET)
    t = exact.f32(tl.load(t_ptr + ti), INTERPRET)
    return i, f, t * f


@triton.jit
def _sinusoid_fwd_kernel(t_ptr, out_ptr, half, half_f, neg_log, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    ti = tl.program_id(0).to(tl.int64)
    i, f, a = _angles(t_ptr, ti, half, half_f, neg_log, BLOCK, INTERPRET)
    m = i < half
    tl.store(out_ptr + ti * 2 * half + i, exact.cos(a, INTERPRET), mask=m)
    tl.store(out_ptr + ti * 2 * half + half + i, exact.sin(a, INTERPRET), mask=m)


@triton.jit
def _sinusoid_bwd_kernel(t_ptr, g_ptr, dt_ptr, half, half_f, neg_log, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    ti = tl.program_id(0).to(tl.int64)
    i, f, a = _angles(t_ptr, ti, half, half_f, neg_log, BLOCK, INTERPRET)
    m = i < half
    g_cos = tl.load(g_ptr + ti * 2 * half + i, mask=m, other=0.0)
    g_sin = tl.load(g_ptr + ti * 2 * half + half + i, mask=m, other=0.0)
    d = f * (g_sin * exact.cos(a, INTERPRET) - g_cos * exact.sin(a, INTERPRET))
    d = tl.where(m, d, 0.0)
    dt = tl.sum(d, axis=0)
    tl.store(dt_ptr + ti, exact.rne(dt, dt_ptr.dtype.element_ty, INTERPRET))


class _Sinusoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timestep: torch.Tensor, dim: int) -> torch.Tensor:
        half = dim // 2
        out = torch.empty((timestep.shape[0], dim), dtype=torch.float32, device=timestep.device)
        _sinusoid_fwd_kernel[(timestep.shape[0],)](
            timestep,
            out,
            half,
            float(half),
            _NEG_LOG,
            BLOCK=next_pow2(half),
            INTERPRET=INTERPRET,
            num_warps=4,
            **STRICT_LAUNCH,
        )
        ctx.save_for_backward(timestep)
        ctx.half = half
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (timestep,) = ctx.saved_tensors
        g = grad.contiguous().float()
        dt = torch.empty_like(timestep)
        half = ctx.half
        _sinusoid_bwd_kernel[(timestep.shape[0],)](
            timestep,
            g,
            dt,
            half,
            float(half),
            _NEG_LOG,
            BLOCK=next_pow2(half),
            INTERPRET=INTERPRET,
            num_warps=4,
            **STRICT_LAUNCH,
        )
        return dt, None


def timestep_sinusoid(timestep: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """(T,) float32/bfloat16 timesteps -> (T, dim) float32, cos half first (even ``dim`` only)."""
    check_tensor(_OP, "timestep", timestep, (torch.float32, torch.bfloat16), ndim=1)
    if not isinstance(dim, int) or dim < 2 or dim % 2:
        raise InputError(f"{_OP}: dim: {dim!r} unsupported (even and >= 2; the odd-width zero pad is not kernelised)")
    return _Sinusoid.apply(timestep, dim)
