"""Tensors parked in host memory while a device is full, handed back one at a time as they are read.

A gate that must keep a large set of tensors (the FP64 golden's node gradients of a 768p block: 41 GB) while other
work runs on the device moves them to host memory as they are made (:func:`to_host`) and reads them through
:class:`Fetched`, a mapping that copies one back to the device per lookup and keeps nothing. Copies are exact: the
bytes read are the bytes parked. A tensor read back many times is parked page-locked (``pinned``): copies then run
at the copy engines' speed, but torch's page-locked pool rounds each block up to a power of two, so the host locks up
to twice what is parked (the golden's 41 GB at 768p: about 68 GB) and keeps it cached for the next stage. A tensor
parked once and read back once stays pageable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """A contiguous host copy of ``t``, page-locked with ``pinned`` when ``t`` is on a CUDA device (module docstring);
    a host ``t`` is copied too, so that the caller owns the result whatever the device."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned and t.is_cuda)
    return out.copy_(t.detach())


def park(tensors: Mapping[str, torch.Tensor | None], pinned: bool = False) -> dict[str, torch.Tensor | None]:
    """Every tensor of ``tensors`` in host memory (:func:`to_host`), same keys, same order (``None`` kept)."""
    return {k: None if v is None else to_host(v, pinned) for k, v in tensors.items()}


def unpark(tensors: Mapping[str, torch.Tensor | None], device: torch.device | str) -> dict[str, torch.Tensor | None]:
    """Every tensor of ``tensors`` on ``device``, same keys, same order (``None`` kept)."""
    return {k: None if v is None else v.to(device) for k, v in tensors.items()}


class Fetched(Mapping[str, torch.Tensor]):
    """Host tensors read on ``device``: each lookup returns a fresh device copy of one of them (a host tensor as is
    when ``device`` is the CPU), nothing cached, so the device holds only what its reader keeps."""

    def __init__(self, host: Mapping[str, torch.Tensor], device: torch.device | str) -> None:
        self.host = host
        self.device = torch.device(device)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.host[key].to(self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.host)

    def __len__(self) -> int:
        return len(self.host)
