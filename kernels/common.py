"""Shared launcher helpers for the strict Triton kernels."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.numerics import interpreter_problem

T = TypeVar("T")

# Triton's CPU interpreter computes tl.dot on bf16 operands wrongly; kernels upcast dot operands when this is set.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

# Compile options every strict kernel launches with: no FMA contraction (each mul/add rounds on its own, as PyTorch's
# eager ops do; ptxas --fmad=false) and no flush-to-zero inside libdevice transcendentals. The interpreter ignores them.
STRICT_LAUNCH: dict = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

# Rows per program are a fixed function of the row width and the backend, never of the row count. The interpreter
# pays Python overhead per program, so it gives each program this many times more rows; a row's own arithmetic and
# reduction order do not depend on how many rows share its program.
ROW_SCALE: int = 8 if INTERPRET else 1


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
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise InputError(f"{op}: {arg}: dtype {dtype_name(t.dtype)} not supported (expected {names})")
    if ndim is not None and t.ndim != ndim:
        raise InputError(f"{op}: {arg}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise InputError(f"{op}: {arg}: on {t.device}, expected {device} (mixed devices)")
    if contiguous and not t.is_contiguous():
        raise InputError(f"{op}: {arg}: non-contiguous tensor (strides {t.stride()}); pass .contiguous() explicitly")
    if t.device.type == "cpu" and not INTERPRET:
        raise InputError(f"{op}: {arg}: CPU tensor needs TRITON_INTERPRET=1 (strict kernels run on CUDA)")
    if t.device.type == "cpu" and (problem := interpreter_problem()) is not None:
        raise InputError(f"{op}: {arg}: CPU tensor: {problem}")


def check_indices(op: str, arg: str, idx: torch.Tensor, length: int | None, upper: int, device: torch.device) -> None:
    """int64 1-D index tensor of the given length with every value in [0, upper).

    The range check reads two values back to the host; it runs once per (tensor, in-place version, bound) - an index
    tensor reused by every block (``adaln_indices``) or every bench iteration is checked the first time only."""
    check_tensor(op, arg, idx, (torch.int64,), ndim=1, device=device)
    if length is not None and idx.shape[0] != length:
        raise InputError(f"{op}: {arg}: length {idx.shape[0]}, expected {length}")

    def bounds() -> tuple[int, int]:
        return int(idx.min()), int(idx.max())

    lo, hi = cached("index-bounds", (idx,), (), bounds)
    if lo < 0 or hi >= upper:
        raise InputError(f"{op}: {arg}: index out of range [{lo}, {hi}] for size {upper}")


_CACHE: dict[tuple, tuple] = {}


def cached(tag: str, tensors: Sequence[torch.Tensor], extra: tuple, compute: Callable[[], T]) -> T:
    """``compute()`` memoised on the identity, storage and in-place version of ``tensors`` (plus ``extra``).

    For host-side facts derived from index tensors (bounds, row maps, segment plans) that would otherwise cost a
    device synchronisation per call. An entry is only reused for the very same tensor objects, unmodified since;
    entries die with their tensors. Tensors without a version counter (inference mode) are never cached."""
    try:
        state = tuple((t._version, t.data_ptr()) for t in tensors)
    except RuntimeError:
        return compute()
    key = (tag, *(id(t) for t in tensors), extra)
    hit = _CACHE.get(key)
    if hit is not None and hit[1] == state and all(r() is t for r, t in zip(hit[0], tensors, strict=True)):
        return hit[2]
    value = compute()
    _CACHE[key] = (tuple(weakref.ref(t) for t in tensors), state, value)
    for t in tensors:
        weakref.finalize(t, _CACHE.pop, key, None)
    return value


def check_table(
    op: str, arg: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], width: int | None, device: torch.device
) -> None:
    """A (rows, width) table whose rows may be strided (a chunk of a wider projection) but each row contiguous."""
    check_tensor(op, arg, t, dtypes, ndim=2, device=device, contiguous=False)
    width = t.shape[1] if width is None else width
    if t.shape[1] != width:
        raise InputError(f"{op}: {arg}: width {t.shape[1]}, expected {width}")
    if t.stride(1) != 1 or t.stride(0) < width:
        raise InputError(f"{op}: {arg}: unsupported layout (strides {t.stride()}); each row must be contiguous")


def check_dtype_as(op: str, arg: str, t: torch.Tensor, dtype: torch.dtype, other: str) -> None:
    """``t`` must have the dtype of argument ``other`` (strict kernels do not promote types)."""
    if t.dtype != dtype:
        got, want = dtype_name(t.dtype), dtype_name(dtype)
        raise InputError(f"{op}: {arg}: dtype {got} differs from {other} ({want}); strict kernels do not promote")


def needs_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through its ``autograd.Function`` (grad mode on and some input requires grad).

    Otherwise operators launch their forward directly: the same launch and bytes, less host time per call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.cache
def hopper(index: int | None) -> bool:
    """Whether CUDA device ``index`` (None: the current one) is a Hopper GPU (sm_90): where the Gluon kernels run."""
    return torch.cuda.get_device_capability(index)[0] == 9


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 3  # interpreter: a few programs, so a persistent loop really iterates
    return torch.cuda.get_device_properties(torch.device(device_type, index)).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the program count of a persistent launch (3 under the interpreter)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _sm_count(device.type, index)


def tma_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch for device-side TMA descriptors (``triton.set_allocator``: a context variable, set on every launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def aligned(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a 16-byte aligned base: a misaligned view is copied (same bytes) to a fresh allocation."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _interpreter_index_shim() -> None:
    """Triton 3.6's interpreter turns loop bounds into ints with ``int(array)`` on 1-element arrays, which NumPy >=
    2.4 refuses ("only 0-dimensional arrays can be converted"); re-install ``__index__`` with ``.item()``.
    Interpreter-only: nothing changes on CUDA."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_h3gate_shim", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._h3gate_shim = True
    interpreter._patch_lang_tensor = patched


def _interpreter_exact_dot() -> None:
    """The interpreter runs ``tl.dot`` as ``np.matmul`` at float32, whose summation order inside one tile follows
    OpenBLAS's kernel for that tile's shape: the same row then gets other bits under another M bucket (measured:
    o_proj / ffn_gate_up rows in a batch of 2 vs alone), which the GPU's fixed K walk never does. For float32
    operands (the kernels upcast BF16 dot operands in the interpreter) compute each tile's dot in float64 and round
    it once to float32: BF16 x BF16 products are exact there and a tile's sum is exact or within float64 rounding,
    so the float32 result no longer depends on the tile's shape. The accumulator add stays the kernel's own.
    Interpreter-only: nothing changes on CUDA."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_h3gate_shim", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
            tile = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
            return interpreter.TensorHandle(tile + d.data, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._h3gate_shim = True
    builder.create_dot = create_dot


def _single_threaded_blas() -> None:
    """Pin numpy's BLAS to one thread for the whole process: the interpreter runs ``tl.dot`` as a numpy matmul, and
    a multi-threaded OpenBLAS splits a matmul by its shape and thread count, so the bytes of one row would depend on
    how many rows share the launch (measured: q_proj's row 92 drifts by one ulp in a batch of 3 with 2 threads)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


if INTERPRET:
    _interpreter_index_shim()
    _interpreter_exact_dot()
    _single_threaded_blas()
