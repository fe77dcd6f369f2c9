"""Per-row norms of the row rule's error in one pass (:func:`h3gate.gate.rows.row_errors`).

Maths: for a candidate ``c`` and a golden ``g`` viewed as (rows, cols), in float64: the L2 norms
``num[r] = sqrt(sum_j (c[r, j] - g[r, j])^2)`` and ``den[r] = sqrt(sum_j g[r, j]^2)``, and ``finite[r]`` (every
``c[r, j]`` finite); the row error is ``num / den`` (:func:`h3gate.gate.rows.row_errors`).

Cast points: each element widened to float64 once (bfloat16 through float32, both exact). Reduction order: each
program owns BLOCK_R rows and walks their columns in ascending BLOCK_C chunks, adding every chunk into a
(BLOCK_R, BLOCK_C) float64 accumulator, element by element; the accumulator's columns are then summed by Triton's
tree, and the square roots taken once. The order is fixed by the launch (the same bytes on every run of one device),
and it is not torch's: the norms differ from :func:`row_error_norms_reference`'s in the last float64 bits. It reads
``c`` and ``g`` once; the torch reference writes and reads float64 temporaries (about 60 bytes an element).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.kernels.common import INTERPRET
from h3gate.kernels.exact import f32, helper, zeros

BLOCK_R = 4  # rows per program
BLOCK_C = 256  # columns a step (two 4 x 256 float64 accumulators: 64 registers a thread at 4 warps)
MAX_KERNEL_COLS = 1 << 16  # the widest row the kernel walks (256 steps); wider rows: torch's norms


def row_error_norms_reference(c: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num, den, finite)`` of the module docstring with torch ops (float64 norms, bool)."""
    cc, gg = c.to(torch.float64), g.to(torch.float64)
    num = torch.linalg.vector_norm(cc - gg, dim=1)
    return num, torch.linalg.vector_norm(gg, dim=1), torch.isfinite(cc).all(dim=1)


@helper
def _f64(x, INTERPRET: tl.constexpr):
    if x.dtype == tl.float64:
        return x
    else:
        return f32(x, INTERPRET).to(tl.float64)


@triton.jit
def _row_error_kernel(c_ptr, g_ptr, num_ptr, den_ptr, bad_ptr, rows, cols, stride_c, stride_g,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    c_row = c_ptr + r.to(tl.int64)[:, None] * stride_c
    g_row = g_ptr + r.to(tl.int64)[:, None] * stride_g
    num = zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    den = zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    bad = zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for c0 in range(0, cols, BLOCK_C):
        j = c0 + tl.arange(0, BLOCK_C)
        mask = live[:, None] & (j < cols)[None, :]
        x = tl.load(c_row + j[None, :], mask=mask, other=0.0)
        y = tl.load(g_row + j[None, :], mask=mask, other=0.0)
        x = _f64(x, INTERPRET)
        y = _f64(y, INTERPRET)
        d = x - y
        num += d * d
        den += y * y
        bad += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    tl.store(num_ptr + r, tl.sum(num, axis=1), mask=live)
    tl.store(den_ptr + r, tl.sum(den, axis=1), mask=live)
    tl.store(bad_ptr + r, tl.sum(bad, axis=1), mask=live)


def row_error_norms_kernel(c: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's ``(num, den, finite)`` by :func:`_row_error_kernel` (a GPU, or Triton's interpreter);
    ``c`` and ``g`` are (rows, cols) of one shape, any floating dtypes."""
    rows, cols = c.shape
    num = torch.zeros(rows, dtype=torch.float64, device=c.device)
    den = torch.zeros(rows, dtype=torch.float64, device=c.device)
    bad = torch.zeros(rows, dtype=torch.int32, device=c.device)
    if rows and cols:
        c = c if c.stride(1) == 1 else c.contiguous()
        g = g if g.stride(1) == 1 else g.contiguous()
        grid = (triton.cdiv(rows, BLOCK_R),)
        _row_error_kernel[grid](c, g, num, den, bad, rows, cols, c.stride(0), g.stride(0),
                                BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, INTERPRET=INTERPRET)  # fmt: skip
    return num.sqrt(), den.sqrt(), bad == 0


def kernel_walks(cols: int) -> bool:
    """Whether rows of ``cols`` elements go to the kernel: one program walks a row alone, so a row wider than
    :data:`MAX_KERNEL_COLS` (a whole weight judged as one row: up to 1.2e8 elements at released widths) takes
    torch's norms, which spread it over the device."""
    return cols <= MAX_KERNEL_COLS


def row_error_norms(c: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_error_norms_kernel` on a GPU for rows the kernel walks (:func:`kernel_walks`),
    :func:`row_error_norms_reference` otherwise (on the CPU the interpreter would cost more than the torch ops it
    replaces)."""
    if c.is_cuda and not INTERPRET and kernel_walks(c.shape[1]):
        return row_error_norms_kernel(c, g)
    return row_error_norms_reference(c, g)
