"""Memory estimates checked before allocating: a request the machine cannot hold is bad input (exit 2), not a crash.

``require(nbytes, what)`` compares an estimate with what the host has available (``MemAvailable`` of
``/proc/meminfo``; on CUDA, the device's free memory) and raises :class:`~h3gate.errors.InputError` naming the
request, the estimate and the limit. Estimates are lower bounds of what the request allocates at once. The host's
available memory also honours the process's own limits: ``RLIMIT_AS`` (less the address space already mapped) and
the cgroup's ``memory.max`` (less its current usage). ``require_disk`` does the same for bytes to be written,
against the free space of the file system that will hold them (``shutil.disk_usage`` of the nearest existing
folder). ``MAX_STEPS`` bounds every sigma-grid size a user can type, whatever the memory.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from pathlib import Path

from h3gate.errors import InputError

GIB = float(2**30)
# A model above this many parameters is real-size: the ablation rows bound their work to its first and last block.
BIG_MODEL_PARAMS = 2_000_000_000
# Sigma grid points of any schedule (a real sampler takes ~50): more is refused before anything is built.
MAX_STEPS = 10_000


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of a ``/proc`` file, in bytes (None where absent)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_headroom() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2, else v1's limit - usage); None unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            return max(0, int(limit) - usage)
    return None


def host_available_bytes() -> int | None:
    """``MemAvailable`` in bytes, lowered to the headroom of ``RLIMIT_AS`` and of the cgroup's memory limit (None
    where none of them is known)."""
    bounds = [_proc_kib("/proc/meminfo", "MemAvailable"), _cgroup_headroom()]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _proc_kib("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        bounds.append(max(0, soft - mapped))
    known = [b for b in bounds if b is not None]
    return min(known) if known else None


def device_available_bytes(device: str) -> int | None:
    """Free memory of a CUDA device (None on the CPU or without CUDA)."""
    if not device.startswith("cuda"):
        return host_available_bytes()
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def device_peak_record(device: str) -> dict:
    """``{"peak_allocated_gib": ...}``: the most the CUDA caching allocator handed out in this process so far
    (``torch.cuda.max_memory_allocated``), to set beside a plan's bounds; ``{}`` on the CPU."""
    if not device.startswith("cuda"):
        return {}
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**30, 4)}


def require(nbytes: int, what: str, device: str = "cpu", hint: str = "") -> None:
    """Refuse ``what`` when its estimate ``nbytes`` exceeds the memory available on ``device``."""
    available = device_available_bytes(device)
    if available is not None and nbytes > available:
        where = "GPU" if device.startswith("cuda") else "host"
        raise InputError(
            f"{what}: needs at least {nbytes / GIB:.1f} GiB, {available / GIB:.1f} GiB of {where} memory available"
            + (f"; {hint}" if hint else "")
        )


def release_cached(device: str) -> None:
    """Hand the CUDA caching allocator's unused blocks back to the driver (another process on the GPU may need
    them); nothing on the CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def turns_to_fit(nbytes: int | None, sharing: int, available: int | None) -> int:
    """How many turns ``sharing`` processes on one device take to each hold ``nbytes`` (an upper estimate): 1 when
    all of them fit at once (or a size is unknown), else ``sharing``: one at a time."""
    if nbytes is None or available is None or sharing <= 1 or nbytes * sharing <= available:
        return 1
    return sharing


def free_disk_bytes(path: Path) -> int | None:
    """Free bytes of the file system that holds ``path`` (its nearest existing folder; None if unknown)."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here if here.is_dir() else here.parent).free
    except OSError:
        return None


def require_disk(nbytes: int, path: Path, what: str, hint: str = "") -> None:
    """Refuse writing ``nbytes`` under ``path`` when its file system has less free space."""
    free = free_disk_bytes(path)
    if free is not None and nbytes > free:
        raise InputError(
            f"{what}: writes at least {nbytes / GIB:.1f} GiB, {free / GIB:.1f} GiB free on the disk of {path}"
            + (f"; {hint}" if hint else "")
        )


def require_saved(host: int, disk: int, folder: Path, what: str, hint: str) -> None:
    """Refuse ``--save-tensors`` (``what``) when the copy it holds (``host`` bytes of host memory) or the files it
    writes (``disk`` bytes under ``folder``) do not fit."""
    require(host, what, "cpu", hint=hint)
    require_disk(disk, folder, what, hint=f"{hint} or another folder")


def require_steps(steps: int, flag: str = "--steps") -> None:
    """Refuse a sigma grid above :data:`MAX_STEPS` points."""
    if steps > MAX_STEPS:
        raise InputError(f"{flag} {steps}: above the limit of {MAX_STEPS:,} sigma grid points")


def check_writable(path: Path, what: str, folder: bool = False) -> None:
    """Refuse an output ``path`` that cannot be written, before any work: a file where a folder is wanted (or the
    reverse), a file among its parents, or a nearest existing folder that refuses a new file (probed with a
    temporary file, removed at once: a read-only mount or ``/proc`` refuses even root)."""
    p = Path(path)
    if p.exists() and folder != p.is_dir():
        why = "exists and is not a folder" if folder else "cannot write (a folder is there)"
        raise InputError(f"{what} {p}: {why}")
    here = p if folder and p.is_dir() else p.parent
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise InputError(f"{what} {p}: cannot create ({here} is a file, not a folder)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".h3gate-probe.", dir=here)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"{what} {p}: cannot write in {here} ({exc.strerror or exc})") from None
