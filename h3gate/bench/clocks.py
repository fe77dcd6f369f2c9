"""What the device's clocks did while timed calls ran: SM clock, board power and NVML's clock-event reasons.

A side-by-side ratio only compares two arms when both ran at the same clocks. On an H200 a long, dense run can hold
the board at its power cap, and the SM clock drops below boost for as long as it does; a 4 ms block timed alone and
the same block inside a 230 ms model then run at different clocks. :class:`ClockSampler` makes that visible.

A thread reads NVML (nvidia-ml-py, the module ``torch.cuda.clock_rate`` uses) every ``period_s``: host time
(``time.perf_counter``), SM clock (``nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)``, MHz), board power
(``nvmlDeviceGetPowerUsage``, mW) and the clock-event reasons bitmask (``nvmlDeviceGetCurrentClocksEventReasons``;
``...ThrottleReasons`` in older bindings). Samples are attributed to timed calls through one time base: after a
synchronize the host records an anchor event and reads ``perf_counter`` (``t0``); a call whose start and end events
read ``a`` and ``b`` ms after the anchor ran from ``t0 + a`` to ``t0 + b`` host seconds. Per arm the record gives the
samples that fell inside its calls: SM clock median / min / max, power median / max, and how many samples carried
each reason. Without NVML (no binding, no driver) the record says why, in one line, and nothing else changes.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

PERIOD_S = 0.01
METHOD = (
    "h3gate.bench.clocks: NVML read every period_ms in a host thread (SM clock, board power, clock-event reasons); "
    "a sample counts for an arm when its host time falls inside one of the arm's timed calls (CUDA events read "
    "against an anchor event recorded after a synchronize)"
)
NVML_CLOCK_SM = 1
REASONS = {  # nvmlClocksEventReason* bits (nvml.h)
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass(frozen=True)
class Sample:
    """One NVML reading: host time (s, ``perf_counter``), SM clock (MHz), power (W), clock-event reasons bitmask."""

    t: float
    sm_mhz: float
    power_w: float
    reasons: int


@dataclass
class Reader:
    """One device's NVML readings as plain callables (faked in tests); ``source`` names the binding."""

    read: Callable[[], tuple[float, float, int]]  # (SM MHz, W, reasons)
    source: str


def _open(device: str, probe: Callable, what: str) -> tuple | str:
    """``(pynvml, handle)`` of torch's ``device`` once ``probe(pynvml, handle)`` answered, or one line saying why
    not (no binding; ``what`` unavailable: the NVML error)."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
        handle = _handle(pynvml, device)
        probe(pynvml, handle)
    except Exception as exc:  # noqa: BLE001 - any NVML failure only means no record
        return f"{what} unavailable: {type(exc).__name__}: {str(exc).strip()[:120]}"
    return pynvml, handle


def nvml_reader(device: str) -> Reader | str:
    """An NVML :class:`Reader` for ``device`` (matched by UUID when torch knows it, else by index), or one line
    saying why there is none."""
    opened = _open(device, lambda nv, h: (_reasons_call(nv), nv.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)), "NVML")
    if isinstance(opened, str):
        return opened
    pynvml, handle = opened
    reasons = _reasons_call(pynvml)

    def read() -> tuple[float, float, int]:
        return (
            float(pynvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM)),
            pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            int(reasons(handle)),
        )

    version = getattr(pynvml, "__version__", None) or "?"
    try:
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - the name is only a label
        name = "device name unknown"
    return Reader(read, f"NVML via nvidia-ml-py {version}: {name}")


def nvml_energy(device: str) -> Callable[[], float] | str:
    """A callable returning the board's total energy in joules since the driver loaded
    (``nvmlDeviceGetTotalEnergyConsumption``, mJ; Volta and later), or one line saying why there is none."""
    opened = _open(device, lambda nv, h: nv.nvmlDeviceGetTotalEnergyConsumption(h), "NVML energy counter")
    if isinstance(opened, str):
        return opened
    pynvml, handle = opened
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0


def _reasons_call(pynvml) -> Callable:
    """``nvmlDeviceGetCurrentClocksEventReasons``, or its older name ``...ClocksThrottleReasons``."""
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if hasattr(pynvml, name):
            return getattr(pynvml, name)
    raise AttributeError("no clock-event reasons call in this nvidia-ml-py")


def _handle(pynvml, device: str):
    """The NVML handle of torch's ``device``: by UUID (``get_device_properties().uuid``) or by index."""
    index = torch.device(device).index or 0
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass  # a UUID NVML does not know: the index (right unless CUDA_VISIBLE_DEVICES reorders)
    return pynvml.nvmlDeviceGetHandleByIndex(index)


@dataclass
class ClockSampler:
    """Samples ``reader`` every ``period_s`` in a daemon thread between :meth:`start` and :meth:`stop`."""

    reader: Reader
    period_s: float = PERIOD_S
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="h3gate-clock-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                mhz, watts, bits = self.reader.read()
            except Exception:  # noqa: BLE001 - a failed reading is a missing sample, never a failed bench
                mhz = None
            if mhz is not None:
                self.samples.append(Sample(t, mhz, watts, bits))
            self._stop.wait(self.period_s)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def attribute(
    samples: Sequence[Sample], t0: float, windows: Mapping[str, Sequence[tuple[float, float]]]
) -> dict[str, dict]:
    """Per arm, the samples inside its calls: ``windows[arm]`` holds (start, end) ms after the anchor, ``t0`` the
    anchor's host time (s). An arm no sample fell in gets ``{"samples": 0}``."""
    out: dict[str, dict] = {}
    for arm, spans in windows.items():
        inside = [s for s in samples if any(t0 + a / 1e3 <= s.t <= t0 + b / 1e3 for a, b in spans)]
        rec: dict = {"samples": len(inside)}
        if inside:
            rec["sm_mhz"] = _spread([s.sm_mhz for s in inside])
            rec["power_w"] = _spread([s.power_w for s in inside])
            rec["reasons"] = {
                name: n for bit, name in REASONS.items() if (n := sum(1 for s in inside if s.reasons & bit))
            }
        out[arm] = rec
    return out


class Watch:
    """The sampler of one timed section and its time base (module docstring): :meth:`begin` before the timed calls,
    :meth:`end` with their (start, end) events after the caller's synchronize."""

    def __init__(self, reader, anchor=None, t0: float = 0.0) -> None:
        self.reader, self.anchor, self.t0 = reader, anchor, t0
        self.sampler = None if isinstance(reader, str) else ClockSampler(reader)

    @classmethod
    def begin(cls) -> Watch:
        """Synchronize, record the anchor event, read the host clock, start sampling (when NVML answers)."""
        reader = nvml_reader(str(torch.device("cuda", torch.cuda.current_device())))
        torch.cuda.synchronize()
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record()
        watch = cls(reader, anchor, time.perf_counter())
        if watch.sampler is not None:
            watch.sampler.start()
        return watch

    def end(self, events: dict[str, list]) -> dict:
        """Stop sampling (after the caller's synchronize) and attribute the samples to each callable's calls."""
        if self.sampler is None:
            return {"unavailable": self.reader}
        self.sampler.stop()
        windows = {
            name: [(float(self.anchor.elapsed_time(s)), float(self.anchor.elapsed_time(e))) for s, e in pairs]
            for name, pairs in events.items()
        }
        return {
            "source": self.reader.source,
            "period_ms": self.sampler.period_s * 1e3,
            "method": METHOD,
            "arms": attribute(self.sampler.samples, self.t0, windows),
        }
