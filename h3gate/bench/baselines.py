"""Bench baselines other than the provider itself, named by an operator's declared ``bench.baseline``.

* ``sdpa_flash`` - the provider reference with PyTorch's scaled-dot-product attention pinned to its flash backend
  (``torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION])``); PyTorch raises if flash cannot run the case,
  so the baseline is never silently another backend.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa_flash(reference: Callable) -> Callable:
    """``reference`` run with SDPA restricted to the flash-attention backend."""

    def run(*args, **kwargs):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return reference(*args, **kwargs)

    run.__name__ = f"{getattr(reference, '__name__', 'reference')}[sdpa_flash]"
    return run


BASELINES: dict[str, Callable[[Callable], Callable]] = {"sdpa_flash": sdpa_flash}
