"""Tensors parked in host memory while a device is full, handed back one at a time as they are read.

A gate that must keep a large set of tensors (the FP64 golden's node gradients of a 768p block: 41 GB) while other
work runs on the device moves them to host memory as they are made (:func:`to_host`) and reads them through
:class:`Fetched`, a mapping that copies one back to the device per lookup and keeps nothing. Copies are exact: the
bytes read are the bytes parked. Host copies are pageable: torch's page-locked pool rounds a block up to a power of
two (a 768p block's 41 GB of FP64 gradients would lock about 68 GB), so copies run at pageable speed instead and the
host holds what is parked, no more.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous, pageable host copy of ``t`` (module docstring); a host ``t`` is copied too, so that the caller
    owns the result whatever the device."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.copy_(t.detach())


def park(tensors: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Every tensor of ``tensors`` in host memory (:func:`to_host`), same keys, same order (``None`` kept)."""
    return {k: None if v is None else to_host(v) for k, v in tensors.items()}


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
