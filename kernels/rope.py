"""``h3_mm_rope_3axis_partial``: rotate-half MM-RoPE on the first R (= 96) of D = 128 head channels.

Inputs: ``x`` (B, S, nh, 128) contiguous; ``cos``/``sin`` (S, R) float32 tables from ``reference.rope_tables``
(frequencies built once per layout in float32 by the provider's own ops; the kernel consumes them as the provider's
``_apply_rotary_emb`` does). Per channel ``j < R`` with ``h = R/2``, at ``x``'s dtype, rounding after each op:

``c = cast(cos[s, j])``, ``sn = cast(sin[s, j])``, ``rot_j = -x[j+h] (j < h) | x[j-h] (j >= h)``,
``out_j = rnd(rnd(x_j * c) + rnd(rot_j * sn))``; channels ``j >= R`` are copied. No reduction, no transcendental:
provider-bitwise on every device. One program per ``BLOCK_M`` (x, head) rows (fixed by D and the backend), row
``r -> s = (r // nh) % S``.

Backward (float32, cast once, row-local): ``dx_j = g_j * c_j + (g_{j+h} * sn_{j+h} if j < h else -g_{j-h} * sn_{j-h})``
for ``j < R``; ``dx_j = g_j`` otherwise. The tables take no gradient (they are position data): passing tables that
require grad is an input error rather than a silently missing gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.errors import InputError
from h3gate.kernels import exact
from h3gate.kernels.common import INTERPRET, ROW_SCALE, STRICT_LAUNCH, check_tensor

_OP = "h3_mm_rope_3axis_partial"
HEAD_DIM = 128
BLOCK_M = 16 * ROW_SCALE


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, M, S, NH, R,
    BWD: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    rm = rows < M
    half = R // 2
    rot = cols < R
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)
    s = (rows // NH) % S
    m = rm[:, None] & (cols < D)[None, :]
    mr = rm[:, None] & rot[None, :]
    x = exact.f32(tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0), INTERPRET)
    if BWD:  # x_ptr holds the output gradient; the rotation pairs read the partner channel's table entry
        xp = exact.f32(tl.load(x_ptr + rows[:, None] * D + partner[None, :], mask=mr, other=0.0), INTERPRET)
        c = exact.rnd(tl.load(cos_ptr + s[:, None] * R + cols[None, :], mask=mr, other=0.0), DT, INTERPRET)
        snp = exact.rnd(tl.load(sin_ptr + s[:, None] * R + partner[None, :], mask=mr, other=0.0), DT, INTERPRET)
        y = x * c + tl.where(first[None, :], xp * snp, -(xp * snp))
    else:
        xp = exact.f32(tl.load(x_ptr + rows[:, None] * D + partner[None, :], mask=mr, other=0.0), INTERPRET)
        c = exact.rnd(tl.load(cos_ptr + s[:, None] * R + cols[None, :], mask=mr, other=0.0), DT, INTERPRET)
        sn = exact.rnd(tl.load(sin_ptr + s[:, None] * R + cols[None, :], mask=mr, other=0.0), DT, INTERPRET)
        rot_x = tl.where(first[None, :], -xp, xp)
        y = exact.rnd(exact.rnd(x * c, DT, INTERPRET) + exact.rnd(rot_x * sn, DT, INTERPRET), DT, INTERPRET)
    y = tl.where(rot[None, :], y, x)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], exact.rne(y, DT, INTERPRET), mask=m)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bwd: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    b, s, nh, d = x.shape
    m = b * s * nh
    _rope_kernel[(triton.cdiv(m, BLOCK_M),)](
        x,
        cos,
        sin,
        out,
        m,
        s,
        nh,
        cos.shape[-1],
        BWD=bwd,
        BLOCK_M=BLOCK_M,
        D=d,
        INTERPRET=INTERPRET,
        num_warps=4,
        **STRICT_LAUNCH,
    )
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, bwd=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad.contiguous(), cos, sin, bwd=True), None, None


def mm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, S, nh, 128) x, (S, R) float32 cos/sin -> rotate-half on channels [0, R), channels [R, 128) copied."""
    check_tensor(_OP, "x", x, (torch.float32, torch.bfloat16), ndim=4)
    if x.shape[-1] != HEAD_DIM:
        raise InputError(f"{_OP}: x: head dim {x.shape[-1]} unsupported (this kernel is D = {HEAD_DIM} only)")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(_OP, name, t, (torch.float32,), ndim=2, device=x.device)
        if t.requires_grad:
            raise InputError(f"{_OP}: {name}: gradients w.r.t. the RoPE tables are not supported")
    if cos.shape != sin.shape or cos.shape[0] != x.shape[1]:
        raise InputError(
            f"{_OP}: cos/sin: shapes {tuple(cos.shape)}/{tuple(sin.shape)} do not match (S={x.shape[1]}, R)"
        )
    r = cos.shape[1]
    if r % 2 or r > HEAD_DIM:
        raise InputError(f"{_OP}: cos: rotary width {r} unsupported (even and <= {HEAD_DIM})")
    return _Rope.apply(x, cos, sin)
