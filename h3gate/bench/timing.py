"""CUDA-event timing: interleaved side-by-side medians, and the device's measured copy bandwidth.

* :func:`side_by_side` - several callables timed in one run: after untimed warm-up rounds (at least ``warmup`` of
  them and at least ``warmup_s`` seconds of them, each after an L2 flush like the timed calls; added after the first
  operator timed on a freshly started H200 host, the M = 264 QKV GEMM, read 0.106 ms against 0.063 ms in an earlier
  run with 5 warm-up rounds; git history of ``evidence/h200/PROVENANCE.md``), ``iters`` rounds
  each call every callable once in turn (interleaved, so clock and thermal drift hit all alike), each timed call
  preceded by zeroing a 256 MiB buffer (the H200's L2 is 50 MiB), so inputs never sit in L2 - no input rotation
  needed; per callable the median / min / max of its ``iters`` event timings. With ``head_start_us`` the device
  also spins that long (``torch.cuda._sleep``, calibrated once) between the flush and the start event, so the host
  has enqueued the call before the device reaches it: the events then time the device's work, not a host that
  launches slower than the device runs (for a ~50 us kernel a slow host showed as a bimodal median, e.g. the M = 264
  QKV GEMM read min 0.059 / median 0.119 ms in ``bench-ops-gemm-tiny`` at ``7e52a4b``, docs/measurements).
* :func:`copy_bandwidth_gbs` - a 1 GiB device-to-device ``copy_`` timed the same way: ``2 * bytes / median``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from h3gate.bench import clocks

FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30


def spin_cycles(us: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the current device busy for about ``us`` microseconds (measured)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # first call: module load, not timed
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return max(1, int(probe * us / (start.elapsed_time(end) * 1e3)))


def side_by_side(
    fns: Mapping[str, Callable[[], object]],
    iters: int = 50,
    warmup: int = 5,
    warmup_s: float = 0.5,
    head_start_us: float = 0.0,
    observe: dict | None = None,
) -> dict[str, dict]:
    """Interleaved CUDA-event timings of every callable (L2 flushed before each timed call; with ``head_start_us``
    a device-side spin between the flush and the start event).

    With ``observe`` (a dict, filled in place): each callable's stats also get ``host_ms`` (median / max host
    milliseconds from the call to its return, the enqueue time: as long as the device time, the arm is host-bound),
    and ``observe`` receives the device's clocks during each callable's calls (:class:`h3gate.bench.clocks.Watch`)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    cycles = spin_cycles(head_start_us) if head_start_us > 0 else 0
    rounds, start_s = 0, time.perf_counter()
    while rounds < warmup or time.perf_counter() - start_s < warmup_s:
        for fn in fns.values():
            flush.zero_()
            fn()
        torch.cuda.synchronize()
        rounds += 1
    events: dict[str, list] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    watch = clocks.Watch.begin() if observe is not None else None
    for _ in range(iters):
        for name, fn in fns.items():
            flush.zero_()
            if cycles:
                torch.cuda._sleep(cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            fn()
            host[name].append((time.perf_counter() - t) * 1e3)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    out = {}
    for name, pairs in events.items():
        samples = [float(s.elapsed_time(e)) for s, e in pairs]
        out[name] = {
            "median_ms": statistics.median(samples),
            "min_ms": min(samples),
            "max_ms": max(samples),
            "iters": len(samples),
        }
        if observe is not None:
            out[name]["host_ms"] = {"median_ms": statistics.median(host[name]), "max_ms": max(host[name])}
    if watch is not None:
        observe.update(watch.end(events))
    return out


def copy_bandwidth_gbs(device: str, nbytes: int = COPY_BYTES, iters: int = 20) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second, in GB/s = 1e9 B/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    stats = side_by_side({"copy": lambda: dst.copy_(src)}, iters=iters)
    return 2 * nbytes / (stats["copy"]["median_ms"] * 1e-3) / 1e9
