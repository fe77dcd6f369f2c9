#!/usr/bin/env python3
"""Each verb's memory estimate against the device peak of a small real run (on CUDA), from the repo root:

    python3 tools/gpu_estimates.py --device cuda --out $OUT/gpu-estimates.json [--verbs ws1-block,ws1-model]

Per verb, the estimate function the verb checks before it reads a weight (what ``memory.require`` compares with the
device's free memory), then the verb's engine on the same config and layout, measuring the device peak:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was allocated before (so the
weights the run reads count, the CUDA context does not). The record gives both and ``ratio = estimate / peak``:
for a *lower bound* (ws1-block, ws1-model, ws1-trajectory) a ratio above 1 means the bound refuses runs that fit;
for an *upper estimate* (ws1-ops, arms) a ratio below 1 means it lets through runs that do not.

* ``ws1-block``: :func:`h3gate.runs.memory_plan.plan_block_memory` (the plan ``prepare`` makes: its lower bound,
  and its upper estimate :func:`h3gate.runs.memory_plan.block_peak_estimate_bytes` as ``upper_bytes`` with
  ``upper_ratio = upper / peak``, which must be at least 1), then :func:`h3gate.runs.ws1_block.run_block_gate`
  (forward and backward, ``--mode``: default strict);
* ``ws1-model``: :func:`h3gate.runs.memory_plan.model_lower_bound_bytes` and the upper estimate
  :func:`h3gate.runs.model_memory.model_peak_estimate_bytes` (the plan ``prepare`` records), then
  :func:`h3gate.runs.ws1_model.run_model_gate` (forward and backward; ``--no-backward``: forward only);
* ``ws1-trajectory``: the same bound with two lanes, no backward, and the upper estimate
  :func:`h3gate.runs.model_memory.trajectory_peak_estimate_bytes` (``prepare_trajectory``), then one step;
* ``ws1-ops``: :func:`h3gate.runs.ws1_ops.case_bytes`, then :func:`h3gate.runs.ws1_ops.run_case` for each operator;
* ``arms``: :func:`h3gate.arms.stack.batch_bytes`, then ``run_arms`` (R/R, one step; needs diffusers, else skipped).

``run ws2`` is not measured here: its ranks are processes of their own (each rank's peak is one ws1-block-like run).

With several verbs (not ``--dry``) each is measured in a process of its own, so that what one verb left in the
allocator or the heap does not hide the next one's peak.

``--device cpu`` is the CPU twin (what the tests run): the same estimates and engines, the peak read as the process's
resident high-water mark (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), less the resident size
before. ``--dry`` computes the estimates only (no engine runs). Writes ``{"meta", "records"}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout on the GPU host: its own h3gate

from h3gate.manifests.model_config import load_config  # noqa: E402
from h3gate.manifests.tolerances import load_tolerance  # noqa: E402
from h3gate.numerics import strict_numerics  # noqa: E402

VERBS = ("ws1-block", "ws1-model", "ws1-trajectory", "ws1-ops", "arms")
OPS = ("h3_qkv_gemm", "h3_full_attention", "h3_swiglu")


class Meter:
    """The device's peak allocation since :meth:`start`, in bytes above what was allocated then."""

    def __init__(self, device: str) -> None:
        self.device, self.base = device, 0

    def start(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5", encoding="ascii")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return max(_status_kib("VmHWM") * 1024 - self.base, 0)

    @property
    def what(self) -> str:
        if self.device.startswith("cuda"):
            return "torch.cuda.max_memory_allocated above the allocation at the start"
        return "the process's VmHWM above its VmRSS at the start (the CPU twin)"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _block(device: str, layout: str, config: str | None, mode: str = "strict") -> tuple[int, str, str, Callable, int]:
    from h3gate.gate.variants import provider_variants
    from h3gate.runs.memory_plan import GateNeeds
    from h3gate.runs.setup import RunSpec, prepare, read_inputs
    from h3gate.runs.ws1_block import BlockGate, run_block_gate

    tol = load_tolerance("ws1-block")
    lanes = len(provider_variants(list(tol.row_rule.variants), device)[0])
    spec = RunSpec("block", layout, config, None, device, mode=mode, draw="device")
    setup = prepare(spec, GateNeeds(lanes), read=False)
    plan = setup.memory

    def run() -> object:
        return run_block_gate(BlockGate.of(read_inputs(setup), tol, True))

    what = f"plan_block_memory: {plan.estimate}; upper: block_peak_estimate_bytes"
    return plan.device_bytes, "lower bound", what, run, plan.upper_bytes


def _model(device: str, layout: str, config: str | None, backward: bool = True) -> tuple[int, str, str, Callable, int]:
    from h3gate.gate.variants import provider_variants
    from h3gate.runs.setup import ModelNeeds, RunSpec, prepare, read_inputs
    from h3gate.runs.ws1_model import ModelGate, run_model_gate

    tol = load_tolerance("ws1-model")
    providers = len(provider_variants(list(tol.row_rule.variants), device)[0])
    needs = ModelNeeds(backward=backward, providers=providers)
    setup = prepare(RunSpec("model", layout, config, None, device, draw="device"), needs, read=False)
    plan = setup.memory

    def run() -> object:
        return run_model_gate(ModelGate.of(read_inputs(setup), tol, backward))

    what = f"model_lower_bound_bytes ({needs.lanes} lanes); upper: model_peak_estimate_bytes ({plan.estimate})"
    return plan.device_bytes, "lower bound", what, run, plan.upper_bytes


def _trajectory(device: str, layout: str, config: str | None) -> tuple[int, str, str, Callable, int]:
    from h3gate.runs.ws1_trajectory import TrajectorySettings, evaluate, initial_state, prepare_trajectory

    traj = prepare_trajectory(TrajectorySettings(layout=layout, config=config, device=device, steps=2))
    plan = traj.setup.memory

    def run() -> object:
        return evaluate(traj, 0, initial_state(traj, traj.request), None)

    what = ("model_lower_bound_bytes (2 lanes, forward only: prepare_trajectory); upper: "
            f"trajectory_peak_estimate_bytes ({plan.estimate})")  # fmt: skip
    return plan.device_bytes, "lower bound", what, run, plan.upper_bytes


def _ops(device: str, layout: str, config: str | None, ops: tuple[str, ...] = OPS) -> tuple[int, str, str, Callable]:
    from h3gate.layout import packed_rows
    from h3gate.manifests.layouts import load_layout
    from h3gate.runs.ws1_ops import case_bytes, run_case

    cfg = load_config(config or "tiny").config
    rows = packed_rows(load_layout(layout))
    need = max(case_bytes(op, rows, cfg) for op in ops)

    def run() -> object:
        return [run_case(op, rows, cfg, device, 0) for op in ops]

    return need, "upper estimate", f"max case_bytes over {', '.join(ops)} at {rows} rows", run


def _arms(device: str, layout: str, config: str | None) -> tuple[int, str, str, Callable | None]:
    from h3gate.arms.stack import ArmsSettings, batch_bytes, plan_stack
    from h3gate.errors import InputError

    settings = ArmsSettings(arms=("R/R",), config=config, layout=layout, device=device, steps=2, batch=2)
    try:
        stack, source = plan_stack(settings)
    except InputError as exc:  # diffusers not installed: nothing to measure
        return 0, "upper estimate", f"skipped: {exc}", None
    need = batch_bytes(stack.cfg, stack.layout.seq_len, settings.batch, settings.steps)

    def run() -> object:
        from h3gate.arms.engine import run_arms

        with tempfile.TemporaryDirectory(prefix="h3gate-estimates-") as tmp:
            return run_arms(stack, source, Path(tmp))

    return need, "upper estimate", "batch_bytes (R/R, batch 2, one step)", run


PLANS = {"ws1-block": _block, "ws1-model": _model, "ws1-trajectory": _trajectory, "ws1-ops": _ops, "arms": _arms}


def measure(
    verb: str, device: str, layout: str, config: str | None, dry: bool, ops: tuple[str, ...] = OPS,
    mode: str = "strict", backward: bool = True,
) -> dict:  # fmt: skip
    """One verb's record: its estimate (and upper estimate, where the verb has both) and, unless ``dry``, the peak
    of its run and the ratios."""
    plan = PLANS[verb]
    if plan is _ops:
        need, kind, what, run, *upper = plan(device, layout, config, ops)
    elif plan is _block:
        need, kind, what, run, *upper = plan(device, layout, config, mode)
    elif plan is _model:
        need, kind, what, run, *upper = plan(device, layout, config, backward)
    else:
        need, kind, what, run, *upper = plan(device, layout, config)
    rec = {"verb": verb, "layout": layout, "config": config or "default", "device": device,
           "estimate_bytes": need, "estimate_kind": kind, "estimate": what, "peak_bytes": None, "ratio": None,
           "seconds": None}  # fmt: skip
    if plan is _block:
        rec["mode"] = mode
    if plan is _model:
        rec["backward"] = backward
    if upper:
        rec.update(upper_bytes=upper[0], upper_ratio=None)
    if dry or run is None:
        return rec
    meter = Meter(device)
    meter.start()
    started = time.perf_counter()
    run()
    peak = meter.peak()
    rec.update(peak_bytes=peak, ratio=None if peak <= 0 else round(need / peak, 4),
               seconds=round(time.perf_counter() - started, 3), peak=meter.what)  # fmt: skip
    if device.startswith("cuda"):  # what the caching allocator held: the allocated peak plus its fragments
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if rec.get("upper_bytes") is not None and peak > 0:
        rec["upper_ratio"] = round(rec["upper_bytes"] / peak, 4)
    return rec


def _measure_apart(verb: str, argv: list[str]) -> dict:
    """One verb measured in a process of its own (this tool, ``--verbs VERB``): what an earlier verb left in the
    allocator or the heap would otherwise hide the next one's peak."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--verbs", "--out"):
            skip = True
        elif not a.startswith(("--verbs=", "--out=")):
            rest.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *rest, "--verbs", verb, "--out", str(out)],
                       check=True)  # fmt: skip
        (rec,) = json.loads(out.read_text(encoding="utf-8"))["records"]
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (the CPU twin)")
    parser.add_argument("--verbs", default=",".join(VERBS), help=f"comma-separated, of {', '.join(VERBS)}")
    parser.add_argument("--layout", default="micro")
    parser.add_argument("--config", default=None, help="a config name (default: each verb's default, tiny)")
    parser.add_argument("--ops", default=",".join(OPS), help="ws1-ops' operators (comma-separated)")
    parser.add_argument(
        "--mode",
        default="strict",
        choices=("strict", "auto", "audit", "off"),
        help="ws1-block's candidate mode (off: no kernels, the CPU twin's fast case)",
    )
    parser.add_argument("--no-backward", action="store_true", help="ws1-model forward only (default: and backward)")
    parser.add_argument("--dry", action="store_true", help="the estimates only; no engine runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    verbs = [v for v in args.verbs.split(",") if v]
    unknown = [v for v in verbs if v not in PLANS]
    if unknown:
        parser.error(f"--verbs: unknown {unknown[0]!r} (known: {', '.join(VERBS)})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (the CPU twin is --device cpu)")
    if len(verbs) > 1 and not args.dry:
        records = [_measure_apart(verb, argv if argv is not None else sys.argv[1:]) for verb in verbs]
    else:
        records = []
        with strict_numerics(args.device):
            for verb in verbs:
                ops = tuple(o for o in args.ops.split(",") if o)
                records.append(measure(verb, args.device, args.layout, args.config, args.dry, ops, args.mode,
                                       not args.no_backward))  # fmt: skip
                print(json.dumps(records[-1]), flush=True)
    meta = {"torch": torch.__version__, "device": args.device, "dry": args.dry,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
