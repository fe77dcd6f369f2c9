"""Integer fingerprints in one pass: per row, and of a whole tensor (the determinism check's hash,
:mod:`h3gate.graph.fingerprints`).

Maths: for a 2-D integer tensor ``m`` (the bits of a tensor's elements: int16 for 2-byte dtypes, int32, int64, uint8)
and odd int64 weights ``w`` (one per column), ``out[r] = sum_c int64(m[r, c]) * w[c]`` in int64, every multiply and
add wrapping mod 2^64. Integer addition mod 2^64 is associative and commutative, so the value does not depend on the
reduction order: this kernel (BLOCK_C columns at a time, a tree inside each chunk) gives the bytes of the torch
reference :func:`row_sums_reference` (chunks of rows converted to int64, multiplied, summed) on every device.

Cast points: each element widened to int64 once (sign-extended from int16 / int32, zero-extended from uint8); no
floating point anywhere. It reads ``m`` once (2 bytes an element for 16-bit dtypes); the reference writes and
reads int64 temporaries (about 40 bytes an element), which is what the determinism record cost at released widths.

Whole tensor: the flat bits ``f`` cut into rows of :data:`WIDTH`, ``sum_i int64(f[i]) * w[i % WIDTH] * v[i // WIDTH]``
(``v``: a second set of odd weights, one per row), the same mod-2^64 value as the row sums of that cut weighted by
``v`` (:func:`whole_sum_reference`). :func:`whole_sum_kernel` reads each element once: a program sums :data:`CHUNK`
elements into its own int64 partial, and the partials are added by torch (a single program for up to CHUNK elements:
one launch, where the reference takes five).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3gate.kernels.common import INTERPRET
from h3gate.kernels.exact import zeros

_CHUNK = 1 << 22  # elements the reference converts to int64 at a time
BLOCK_R = 8  # rows per program
BLOCK_C = 512  # columns a step (an 8 x 512 int64 accumulator: 64 registers a thread)
WIDTH = 4096  # the row width of a whole-tensor fingerprint
BLOCK = 2048  # elements a whole-sum program reads a step
CHUNK = 16 * BLOCK  # elements a whole-sum program sums


def row_sums_reference(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out[r] = sum_c int64(m[r, c]) * w[c]`` (wrapping int64) with torch ops, a chunk of rows at a time."""
    rows, cols = m.shape
    step = max(1, _CHUNK // max(cols, 1))
    parts = [(m[i : i + step].to(torch.int64) * w).sum(1) for i in range(0, rows, step)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=m.device)


@triton.jit
def _row_sums_kernel(m_ptr, w_ptr, out_ptr, rows, cols, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    base = m_ptr + r.to(tl.int64)[:, None] * stride_r
    acc = zeros([BLOCK_R, BLOCK_C], dtype=tl.int64)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        inside = c < cols
        bits = tl.load(base + c[None, :], mask=live[:, None] & inside[None, :], other=0)
        wc = tl.load(w_ptr + c, mask=inside, other=0)
        acc += bits.to(tl.int64) * wc[None, :]
    tl.store(out_ptr + r, tl.sum(acc, axis=1), mask=live)


def row_sums_kernel(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`row_sums_reference`'s values by :func:`_row_sums_kernel` (a GPU, or Triton's interpreter)."""
    rows, cols = m.shape
    out = torch.zeros(rows, dtype=torch.int64, device=m.device)
    if rows == 0 or cols == 0:
        return out
    m = m if m.stride(1) == 1 else m.contiguous()
    _row_sums_kernel[(triton.cdiv(rows, BLOCK_R),)](m, w.contiguous(), out, rows, cols, m.stride(0),
                                                    BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)  # fmt: skip
    return out


def row_sums(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fingerprint sums: :func:`row_sums_kernel` on a GPU, :func:`row_sums_reference` elsewhere (the same
    values; on the CPU the interpreter would cost more than the torch ops it replaces)."""
    return row_sums_kernel(m, w) if m.is_cuda and not INTERPRET else row_sums_reference(m, w)


def whole_sum_reference(flat: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``sum_i int64(flat[i]) * w[i % WIDTH] * v[i // WIDTH]`` (wrapping int64, a 0-d tensor) as the row sums of the
    WIDTH-wide cut (its last row shorter) weighted by ``v`` (``w``: at least ``min(n, WIDTH)`` weights, ``v`` one a
    row)."""
    body = flat.numel() - flat.numel() % WIDTH
    rows = [row_sums_reference(flat[:body].view(-1, WIDTH), w[:WIDTH])] if body else []
    if body < flat.numel():
        rows.append(row_sums_reference(flat[body:].reshape(1, -1), w[: flat.numel() - body]))
    sums = torch.cat(rows) if rows else torch.zeros(1, dtype=torch.int64, device=flat.device)
    return (sums * v[: sums.numel()]).sum()


@triton.jit
def _whole_sum_kernel(f_ptr, w_ptr, v_ptr, out_ptr, n, WIDTH: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * STEPS)
    acc = zeros([BLOCK], dtype=tl.int64)
    for s in range(STEPS):
        i = start + s * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        bits = tl.load(f_ptr + i, mask=live, other=0)
        wv = tl.load(w_ptr + i % WIDTH, mask=live, other=0) * tl.load(v_ptr + i // WIDTH, mask=live, other=0)
        acc += bits.to(tl.int64) * wv
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def whole_sum_kernel(flat: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`whole_sum_reference`'s value by :func:`_whole_sum_kernel` (a GPU, or Triton's interpreter)."""
    n = flat.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    programs = triton.cdiv(n, CHUNK)
    out = torch.empty(programs, dtype=torch.int64, device=flat.device)
    _whole_sum_kernel[(programs,)](flat.contiguous(), w.contiguous(), v.contiguous(), out, n,
                                   WIDTH=WIDTH, BLOCK=BLOCK, STEPS=CHUNK // BLOCK)  # fmt: skip
    return out.reshape(()) if programs == 1 else out.sum()


def whole_sum(flat: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The whole-tensor sum: :func:`whole_sum_kernel` on a GPU, :func:`whole_sum_reference` elsewhere (the same
    value)."""
    return whole_sum_kernel(flat, w, v) if flat.is_cuda and not INTERPRET else whole_sum_reference(flat, w, v)
