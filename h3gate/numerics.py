"""The one numerics switch every engine runs under: no TF32, Triton's interpreter on CPU, a fixed thread count.

``with strict_numerics(device=None, threads=None, deterministic=False):`` turns TF32 off for CUDA matmuls and cuDNN
(``torch.backends.cuda.matmul.allow_tf32`` / ``torch.backends.cudnn.allow_tf32``), sets the intra-op thread
count when ``threads`` is given, with ``deterministic`` turns on torch's deterministic algorithms (and cuBLAS's
deterministic workspace), and restores all of it on exit (nested switches restore to the enclosing state). It is
entered in two places: the command line's one boundary (:func:`h3gate.cli.main`, around every verb) and
``h3gate.strict`` (around a user's own forward); a Python caller of an engine enters it once itself.
:func:`threads` and :func:`deterministic_algorithms` change one setting inside it; :func:`torch_defaults` puts
TF32 back to torch's defaults for a run that replays a user's own numerics.

Triton's interpreter is the exception: Triton decides between compiling and interpreting when a kernel is
decorated, i.e. when ``h3gate.kernels`` is first imported, so ``TRITON_INTERPRET=1`` must be in the environment
before that (:func:`select_interpreter`, called by the CLI before it imports a command) and is never unset.
``h3gate.kernels.common.INTERPRET`` records what the kernels saw.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from h3gate.errors import InputError

INTERPRETER_TOO_LATE = (
    "Triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run h3gate's kernels on the "
    "CPU in this process: set TRITON_INTERPRET=1 in the environment before Python starts (or before anything "
    "imports triton), or run on a CUDA device"
)


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run kernels in this process (None when it can, or Triton is not loaded yet).

    Triton picks interpreting or compiling for each ``@triton.jit`` function when it is decorated; its own library
    functions (``triton.language.standard``) are decorated when ``triton`` is first imported. A process that
    imported Triton without ``TRITON_INTERPRET=1`` and set it later would mix the two and fail inside a kernel."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton.language" not in sys.modules:
        return None
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return None if isinstance(standard.cdiv, InterpretedFunction) else INTERPRETER_TOO_LATE


def select_interpreter(device: str) -> None:
    """CPU runs need Triton's interpreter: set ``TRITON_INTERPRET=1`` (unless already set) for a CPU device; an
    InputError when Triton was already imported without it (:func:`interpreter_problem`)."""
    if device == "cpu":
        if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise InputError(f"--device cpu: {INTERPRETER_TOO_LATE}")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        problem = interpreter_problem()
        if problem is not None:
            raise InputError(f"--device cpu: {problem}")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; check the name and CUDA; select the interpreter for CPU.

    Must run before Triton is imported for the interpreter to take effect (the CLI calls it first).
    """
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InputError(f"--device {device!r}: must be cpu, cuda or auto")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
    select_interpreter(device)
    return device


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads (``None``: unchanged), restoring the count on exit."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True) -> Iterator[None]:
    """torch's deterministic algorithms on (``on``; cuBLAS's deterministic workspace chosen unless the environment
    already chose one), restored on exit; unchanged when ``on`` is false."""
    import torch

    if not on:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def torch_defaults() -> Iterator[None]:
    """TF32 as torch ships it (CUDA matmuls off, cuDNN on), restored on exit: a provider run "as a user calls it"
    (``run vae --mode off``) inside the switch."""
    import torch

    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


@contextlib.contextmanager
def strict_numerics(
    device: str | None = None, threads: int | None = None, deterministic: bool = False
) -> Iterator[None]:
    """TF32 off (matmul and cuDNN), the interpreter selected for a CPU ``device``, ``threads`` intra-op threads,
    deterministic algorithms when asked; restored on exit.

    The interpreter selection only helps when Triton has not been imported yet (see the module docstring).
    """
    import torch

    if device is not None:
        select_interpreter(device)
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        with _threads(threads), deterministic_algorithms(deterministic):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


_threads = threads
