"""Content hashes of tensors: the one definition every report and layout uses."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# Hashing threads for sha256_later: hashlib releases the GIL while it hashes a large buffer, so a worker hashes one
# stage's outputs while the main thread enqueues the next stage's kernels.
_WORKERS = 2
_pool: ThreadPoolExecutor | None = None


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's contiguous, row-major, little-endian bytes (any dtype, bfloat16 included; any device)."""
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()  # the buffer itself: no copy of a multi-GB value


def sha256_later(tensor: torch.Tensor, background: bool | None = None) -> Future[str]:
    """:func:`tensor_sha256` of ``tensor``'s bytes as they are at this call, as a future.

    ``background`` (default: a device tensor): the bytes are copied to the host here (the copy waits for the kernels
    that write them) and hashed on a worker thread; otherwise hashed at once (a host tensor has no device work to
    overlap)."""
    if background is None:
        background = tensor.device.type != "cpu"
    if not background:
        done: Future[str] = Future()
        done.set_result(tensor_sha256(tensor))
        return done
    return _workers().submit(tensor_sha256, tensor.detach().to("cpu", copy=True))


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="h3gate-sha256")
    return _pool


def resolved(hashes: dict) -> dict:
    """``hashes`` (nested dicts) with every :func:`sha256_later` future replaced by its hex digest."""
    return {k: resolved(v) if isinstance(v, dict) else v.result() if isinstance(v, Future) else v
            for k, v in hashes.items()}  # fmt: skip
