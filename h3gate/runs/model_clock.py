"""Where the whole-model gate's time goes: seconds per stage and direction, split into the gate's own parts.

Parts (forward and backward alike): ``golden`` (the FP64 chained lane), ``provider`` (the default provider lane),
``variants`` (the provider under every other row-rule variant), ``candidate`` (chained), ``repeat`` and ``batch``
(the invariance passes), ``isolated`` (the candidate on the provider's inputs: per node forward, per stage
backward with its FP64 and variant partners), ``isolated_envelope`` (forward: the node-local FP64 golden and the
provider variants of the isolated view) and ``judging`` (what is left of the stage: row rule, errors, records).
A stopped clock (the default) measures nothing; a running one synchronises the device around every part, so that
a part's seconds are its own kernels'.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

PARTS = ("golden", "provider", "variants", "candidate", "repeat", "batch", "isolated", "isolated_envelope", "judging")


@dataclass
class Clock:
    """Per ``(stage, direction)``: seconds by part (module docstring); ``sync`` waits for the device."""

    running: bool = False
    sync: Callable[[], None] | None = None
    stages: list[dict] = field(default_factory=list)
    _current: dict | None = None

    def _now(self) -> float:
        return synced_now(self.sync)

    @contextlib.contextmanager
    def stage(self, label: str, direction: str) -> Iterator[None]:
        if not self.running:
            yield
            return
        rec = {"stage": label, "direction": direction, "parts": dict.fromkeys(PARTS, 0.0)}
        self._current = rec
        t0 = self._now()
        try:
            yield
        finally:
            total = self._now() - t0
            rec["seconds"] = round(total, 6)
            rec["parts"]["judging"] = max(total - sum(rec["parts"].values()), 0.0)
            rec["parts"] = {k: round(v, 6) for k, v in rec["parts"].items()}
            self.stages.append(rec)
            self._current = None

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        rec = self._current
        if not self.running or rec is None:
            yield
            return
        t0 = self._now()
        try:
            yield
        finally:
            rec["parts"][name] += self._now() - t0


def synced_now(sync: Callable[[], None] | None) -> float:
    """Seconds (``time.perf_counter``) once ``sync`` (the device's queue, :func:`device_sync`) has returned."""
    if sync is not None:
        sync()
    return time.perf_counter()


def device_sync(device: str) -> Callable[[], None] | None:
    """What a running clock waits on: the CUDA device's queue (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.synchronize


def lane_part(kind: str, name: str, variant: object | None, batch: object | None) -> str:
    """The part a lane's pass belongs to."""
    if kind in ("golden", "provider") and variant is None:
        return kind
    if kind == "provider":
        return "variants"
    if batch is not None:
        return "batch"
    return "repeat" if name.endswith("repeat") else "candidate"


def totals(stages: list[dict]) -> dict[str, dict[str, float]]:
    """Seconds by direction and part, summed over ``stages`` records (and ``seconds``: the stages' own)."""
    out: dict[str, dict[str, float]] = {}
    for rec in stages:
        acc = out.setdefault(rec["direction"], {"seconds": 0.0, **dict.fromkeys(PARTS, 0.0)})
        acc["seconds"] += rec["seconds"]
        for k, v in rec["parts"].items():
            acc[k] += v
    return {d: {k: round(v, 6) for k, v in acc.items()} for d, acc in out.items()}
