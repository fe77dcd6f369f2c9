"""Exact integer fingerprints of tensors and of their rows, the same values on every device.

Fingerprint of a tensor row: its elements' bits as integers (``int16`` for 2-byte dtypes, ``int32``, ``int64``),
times fixed pseudo-random odd 64-bit weights (one per column), summed in ``int64`` (arithmetic mod 2^64, so the
order of the additions does not matter). A change of one element by ``d != 0`` changes the sum by
``d * w mod 2^64 != 0`` (``w`` odd), so any single-element change is seen; on a GPU one Triton pass a tensor
(:mod:`h3gate.kernels.fingerprint`), elsewhere torch ops, the same values.
"""

from __future__ import annotations

import torch

from h3gate.kernels.fingerprint import WIDTH, row_sums, whole_sum

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}
MASK = (1 << 64) - 1  # an int64 fingerprint read as an unsigned 64-bit integer


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A splitmix64-style finaliser on int64 tensors (wrapping arithmetic; arithmetic shifts, same on every device)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    x = torch.bitwise_xor(x, x >> 30) * -4658895280553007687
    x = torch.bitwise_xor(x, x >> 27) * -7723592293110705685
    return torch.bitwise_xor(x, x >> 31)


_WEIGHTS: dict[tuple[int, str, int], torch.Tensor] = {}


def weights(n: int, device: torch.device, salt: int = 0) -> torch.Tensor:
    """``n`` fixed pseudo-random odd int64 weights on ``device`` (cached)."""
    key = (n, str(device), salt)
    if key not in _WEIGHTS:
        j = torch.arange(n, dtype=torch.int64, device=device) + (salt << 40)
        _WEIGHTS[key] = torch.bitwise_or(_mix(_mix(j)), 1)
    return _WEIGHTS[key]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_BITS[t.element_size()])


def _row_sums(m: torch.Tensor) -> torch.Tensor:
    """Per-row weighted sums (int64) of a 2-D integer tensor (:func:`h3gate.kernels.fingerprint.row_sums`: one
    pass on a GPU, torch ops elsewhere; the same values)."""
    return row_sums(m, weights(m.shape[1], m.device))


def whole(t: torch.Tensor) -> torch.Tensor:
    """One int64 fingerprint of the whole of ``t`` (a 0-d tensor on its device): its flat bits cut into rows of
    :data:`~h3gate.kernels.fingerprint.WIDTH`, each row's sum weighted by a second set of odd weights (element
    weight: a product of odd numbers, so still odd); :func:`h3gate.kernels.fingerprint.whole_sum`. The row weights
    are asked for a power-of-two count (fewer cached sizes): :func:`weights` of ``n`` is a prefix of any longer."""
    with torch.no_grad():
        flat = bits(t).reshape(-1)
        rows = max(1, -(-flat.numel() // WIDTH))
        return whole_sum(flat, weights(WIDTH, flat.device), weights(1 << (rows - 1).bit_length(), flat.device, salt=1))


def row_fingerprints(t: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """Per-row exact integer fingerprint (module docstring): int64 of length ``t.shape[row_dim]``, on ``t``'s
    device; one entry (:func:`whole`) when ``row_dim`` is None or beyond ``t``'s axes."""
    if row_dim is None or t.ndim <= row_dim:
        return whole(t).reshape(1)
    with torch.no_grad():
        b = bits(t)
        return _row_sums(b.movedim(row_dim, 0).reshape(b.shape[row_dim], -1))
