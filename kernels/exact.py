"""IEEE-exact building blocks shared by the strict kernels (Triton ``@jit`` helpers).

* ``f32(x, INTERPRET)`` - exact upcast of a loaded float32/bfloat16 value to float32.
* ``rne(x, DT, INTERPRET)`` - one round-to-nearest-even cast of a float32 value to ``DT`` (float32: no-op). On CUDA this
  is ``cvt.rn``; under the interpreter (whose float32 -> bfloat16 cast rounds half away and drops carries) it is the
  integer form ``(bits + 0x7FFF + lsb) >> 16`` that PyTorch's ``c10::BFloat16`` uses.
* ``exp/sin/cos`` - on CUDA libdevice's ``__nv_expf/__nv_sinf/__nv_cosf`` (the functions nvcc links for PyTorch's
  eager ``::exp``/``::sin``/``::cos``; Triton's ``tl.exp`` would be the approximate ``ex2.approx`` path); under the
  interpreter numpy's float32 functions (which differ from PyTorch's CPU SLEEF kernels in the last ulp).
* ``silu(x)`` - ``x / (1 + exp(-x))`` with an IEEE division (``div_rn``), PyTorch's formula on CPU and CUDA.
* ``mma(a, b, acc, INTERPRET)`` - ``acc + a @ b`` in FP32: BF16 operands on the tensor cores with an FP32 accumulator,
  FP32 operands as an IEEE FMA dot (never TF32); under the interpreter BF16 operands are upcast exactly first.

Strict kernels launch with :data:`h3gate.kernels.common.STRICT_LAUNCH` (no FMA contraction, no libdevice FTZ), and
use ``tl.div_rn`` / ``tl.sqrt_rn`` (never the approximate ``/`` and ``sqrt`` lowerings).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from h3gate.kernels.common import INTERPRET


def helper(fn):
    """``@triton.jit`` for compiled kernels; under the interpreter a plain function (the enclosing kernel's language
    patch is active while it runs), which avoids the interpreter re-patching Triton on every helper call."""
    return fn if INTERPRET else triton.jit(fn)


# triton.language.standard's cdiv, zeros and zeros_like, with the same bodies: Triton jit functions that the interpreter
# re-patches on every call (about a millisecond each); as helpers they cost nothing there and compile the same.
@helper
def cdiv(x, div):
    return (x + (div - 1)) // div


@helper
def zeros(shape, dtype):
    return tl.full(shape, 0, dtype)


@helper
def zeros_like(x):
    return tl.full(x.shape, 0, x.dtype)


@helper
def f32(x, INTERPRET: tl.constexpr):
    if x.dtype == tl.bfloat16:
        if INTERPRET:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)
    else:
        return x.to(tl.float32)


@helper
def rne(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    if DT == tl.bfloat16:  # noqa: SIM300 (a constexpr dtype, compared at compile time)
        if INTERPRET:
            bits = x.to(tl.uint32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            r = tl.where(x != x, 0x7FC0, r)
            return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16)
    else:
        return x.to(DT)


@helper
def mma(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` in FP32. FP32 operands: IEEE FMA dot. BF16 under the interpreter: exact upcast first."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif INTERPRET:
        return tl.dot(f32(a, INTERPRET), f32(b, INTERPRET), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@helper
def exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@helper
def sin(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.sin(x)
    else:
        return libdevice.sin(x)


@helper
def cos(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.cos(x)
    else:
        return libdevice.cos(x)


@helper
def silu(x, INTERPRET: tl.constexpr):
    """float32 ``x / (1 + exp(-x))`` (one IEEE division)."""
    return tl.div_rn(x, 1.0 + exp(-x, INTERPRET))


@helper
def dsilu(x, INTERPRET: tl.constexpr):
    """float32 derivative of SiLU: ``sig * (1 + x * (1 - sig))`` with ``sig = 1 / (1 + exp(-x))``."""
    sig = tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp(-x, INTERPRET))
    return sig * (1.0 + x * (1.0 - sig))


@helper
def rnd(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` rounded once to ``DT`` and read back as float32 (what a PyTorch op at dtype ``DT`` returns)."""
    return f32(rne(x, DT, INTERPRET), INTERPRET)


@helper
def fold_segment(acc, slots, j: tl.constexpr, last: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Segment ``j``'s FP32 partial ``acc`` folded into the segmented-8 tree
    ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` (:mod:`h3gate.kernels.merge_tree`): the pending subtrees of
    this program wait in its three scratch ``slots`` (level 1, 2, 4; BLOCK_M x BLOCK_N FP32 each); the left operand
    of every add is the older subtree, as the tree reads. Returns the subtree ending at ``j``; at ``j == last`` the
    whole tree. IEEE adds (the kernels launch without FMA contraction)."""
    tl.debug_barrier()  # the slots were written by other threads of this program
    if j % 2 == 1:
        acc = tl.load(slots) + acc
    if j % 4 == 3:
        acc = tl.load(slots + BLOCK_M * BLOCK_N) + acc
    if j % 8 == 7:
        acc = tl.load(slots + 2 * BLOCK_M * BLOCK_N) + acc
    if j != last:
        tl.debug_barrier()
        if j % 2 == 0:
            tl.store(slots, acc)
        elif j % 4 == 1:
            tl.store(slots + BLOCK_M * BLOCK_N, acc)
        else:
            tl.store(slots + 2 * BLOCK_M * BLOCK_N, acc)
    return acc
