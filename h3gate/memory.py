"""Memory estimates checked before allocating: a request the machine cannot hold is bad input (exit 2), not a crash.

``require(nbytes, what)`` compares an estimate with what the host has available (``MemAvailable`` of
``/proc/meminfo``; on CUDA, the device's free memory) and raises :class:`~h3gate.errors.InputError` naming the
request, the estimate and the limit. Estimates are lower bounds of what the request allocates at once.
"""

from __future__ import annotations

from h3gate.errors import InputError

GIB = float(2**30)
# A model above this many parameters is real-size: the ablation rows bound their work to its first and last block.
BIG_MODEL_PARAMS = 2_000_000_000


def host_available_bytes() -> int | None:
    """``MemAvailable`` in bytes (None where ``/proc/meminfo`` or the field is absent)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_available_bytes(device: str) -> int | None:
    """Free memory of a CUDA device (None on the CPU or without CUDA)."""
    if not device.startswith("cuda"):
        return host_available_bytes()
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def require(nbytes: int, what: str, device: str = "cpu", hint: str = "") -> None:
    """Refuse ``what`` when its estimate ``nbytes`` exceeds the memory available on ``device``."""
    available = device_available_bytes(device)
    if available is not None and nbytes > available:
        where = "GPU" if device.startswith("cuda") else "host"
        raise InputError(
            f"{what}: needs at least {nbytes / GIB:.1f} GiB, {available / GIB:.1f} GiB of {where} memory available"
            + (f"; {hint}" if hint else "")
        )
