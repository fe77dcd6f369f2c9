"""Provider variants: the same provider replay under the backend choices a device offers.

The row rule (:mod:`h3gate.gate.rows`) bounds a candidate's per-row error by what the provider itself shows when
run under each variant, so its envelope is calibrated from provider behaviour, never from a candidate failure.

* ``default`` - the provider as the run is configured (always present);
* CPU: ``threads-1`` (one intra-op thread: other reduction splits in BLAS and reductions), ``mkldnn-off`` (the
  native matmul path instead of oneDNN);
* CUDA: ``sdpa-cudnn``, ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-math`` (SDPA pinned to one backend),
  ``blas-cublas`` / ``blas-cublaslt`` (torch's preferred BLAS library).

A variant the device cannot run (no such backend in this torch, or not on this device) is reported as skipped with
the reason, never silently dropped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from h3gate import numerics
from h3gate.graph import determinism
from h3gate.manifests.tolerances import CPU_VARIANTS, CUDA_VARIANTS


@dataclass(frozen=True)
class Variant:
    name: str
    enter: Callable[[], contextlib.AbstractContextManager]


@contextlib.contextmanager
def _blas(library: str) -> Iterator[None]:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@contextlib.contextmanager
def _mkldnn_off() -> Iterator[None]:
    """oneDNN off; torch's warning about oneDNN TF32 on Intel GPUs (raised when the flags are set) is silenced."""
    flags = torch.backends.mkldnn.flags(enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flags.__enter__()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flags.__exit__(None, None, None)


def _sdpa(backend: str) -> Callable[[], contextlib.AbstractContextManager]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    return lambda: sdpa_kernel([chosen])


def _make(name: str, device: str) -> Variant | str:
    """The variant, or the reason it cannot run on ``device``."""
    cuda = device.startswith("cuda")
    if name == "default":
        return Variant(name, contextlib.nullcontext)
    if name in CPU_VARIANTS and cuda:
        return "a CPU variant; this run is on CUDA"
    if name in CUDA_VARIANTS and not cuda:
        return "a CUDA variant; this run is on the CPU"
    if name == "threads-1":
        return Variant(name, lambda: numerics.threads(1))
    if name == "mkldnn-off":
        if not torch.backends.mkldnn.is_available():
            return "oneDNN is not available in this torch build"
        return Variant(name, _mkldnn_off)
    if name.startswith("sdpa-"):
        return Variant(name, _sdpa(name.removeprefix("sdpa-")))
    if name.startswith("blas-"):
        library = name.removeprefix("blas-")
        return Variant(name, lambda: _blas(library))
    raise ValueError(f"unknown provider variant {name!r}")


def refusal(exc: RuntimeError) -> str:
    """The skipped-variant reason of a backend that refused at run time (its error's first line, 200 characters)."""
    return f"refused at run time: {str(exc).splitlines()[0][:200]}"


def provider_lanes(names: list[str], device: str) -> int:
    """How many provider lanes (``default`` and each variant ``device`` can run) a gate evaluates: what the memory
    plans count."""
    return len(provider_variants(names, device)[0])


def provider_variants(names: list[str], device: str) -> tuple[list[Variant], list[dict]]:
    """(variants to run, ``default`` first; skipped ``{"name", "reason"}`` records) for ``device``."""
    run: list[Variant] = [Variant("default", contextlib.nullcontext)]
    skipped: list[dict] = []
    for name in names:
        if name == "default":
            continue
        made = _make(name, device)
        if isinstance(made, str):
            skipped.append({"name": name, "reason": made})
        else:
            run.append(Variant(made.name, _keyed(made.name, made.enter)))
    return run, skipped


def _keyed(name: str, enter: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """``enter`` that also keys the evaluations under it by the variant (:func:`h3gate.graph.determinism.setting`):
    a variant may change the provider's bytes, so its evaluations are never paired with the default's."""

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with determinism.setting(name), enter():
            yield

    return entered
