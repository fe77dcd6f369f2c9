"""Content hashes of tensors: the one definition every report and layout uses."""

from __future__ import annotations

import hashlib

import torch


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's contiguous, row-major, little-endian bytes (any dtype, bfloat16 included; any device)."""
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()  # the buffer itself: no copy of a multi-GB value
