"""``h3gate bench --op NAME``: each strict kernel timed next to its provider op in one run.

For every operator the case builder (``h3gate.ops.cases``) makes the inputs at the layout's rows and the config's
widths; the strict kernel (``registry.bind(op, "strict", device)``) and the provider reference are timed side by
side (:func:`h3gate.bench.timing.side_by_side`, interleaved, L2 flushed, a device-side head start of HEAD_START_US
so the host's launch cost is not timed, medians), forward (under ``no_grad``) and
forward + backward (gradients of every grad argument). The copy bandwidth of the same device is measured in the
same run.

Criteria (forward only; forward + backward is recorded, not gated). An operator whose manifest entry declares a
``bench`` target (:class:`h3gate.manifests.operators.BenchTarget`) is gated by that target alone:

* ``target``: baseline median / kernel median >= the declared ``min_ratio`` (``small_rows.min_ratio`` when the case
  has fewer than ``small_rows.below`` rows); the baseline is the provider, or a declared variant of it
  (:mod:`h3gate.bench.baselines`) timed in the same interleaved run next to kernel and provider. ``kind: compute``
  marks the copy-bandwidth check not applicable.

An operator whose strict entry point groups sibling calls (``fn.grouped``: q, k, v of the qkv GEMM) is also timed
as one grouped call on the case's weight and two more of its shape (``kernel.grouped``), next to the kernel and the
provider called once a weight and the provider on the three weights concatenated beforehand (one product, its output
columns side by side), and recorded under ``grouped`` with whether its outputs equal the one-by-one kernel's; it
gates nothing.

A case's ``bench_variants`` (attention: the walk order given as the identity and as a seeded permutation, i.e.
the row gathers and scatters of the canonical order) are timed as ``kernel.<label>`` in the same interleaved runs
and recorded under ``variants`` with their ratio to the plain kernel; they gate nothing.

Every other operator is gated by the defaults, declared here before measuring:

* ``not_slower``: kernel median <= provider median * (1 + NOISE), NOISE = 0.05 (timing noise allowance);
* ``bandwidth``: for operators whose case moves >= MEMORY_BOUND_MIN_BYTES (256 MiB, where launch latency is under a
  few percent), achieved bytes/s >= 70% of the measured copy bandwidth; smaller cases record it as not applicable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from h3gate.bench.baselines import BASELINES
from h3gate.bench.timing import copy_bandwidth_gbs, side_by_side
from h3gate.errors import InputError
from h3gate.kernels import launches
from h3gate.ops import registry
from h3gate.ops.case import OpCase, randn
from h3gate.ops.cases import build_case

MIN_COPY_FRACTION = 0.70
MEMORY_BOUND_MIN_BYTES = 256 << 20
NOISE = 0.05
# Device-side head start before each timed call (timing.side_by_side), added after the tiny-layout bench at 7e52a4b
# timed the host: the host must not be timed (kernel and baselines alike). Recorded in the body's ``timing``.
HEAD_START_US = 300.0


def _forward(case: OpCase, fn):
    return _no_grad(lambda: case.call(fn))


def _grad_leaves(case: OpCase) -> tuple[list, list[torch.Tensor]]:
    """The case's arguments with its differentiated ones as fresh leaves, and those leaves."""
    args = list(case.args)
    for i in case.grad_args:
        args[i] = args[i].detach().requires_grad_(True)
    return args, [args[i] for i in case.grad_args]


def _forward_backward(case: OpCase, fn, gout: torch.Tensor):
    args, leaves = _grad_leaves(case)

    def run():
        out = fn(*args, **case.kwargs)
        return torch.autograd.grad(out, leaves, gout, allow_unused=True)

    return run


def _backward(case: OpCase, fn, gout: torch.Tensor):
    """The backward alone: one forward under autograd, outside the timing; each call is its graph's VJP (retained)."""
    args, leaves = _grad_leaves(case)
    out = fn(*args, **case.kwargs)

    def run():
        return torch.autograd.grad(out, leaves, gout, retain_graph=True, allow_unused=True)

    return run


def _gradient_timings(case: OpCase, kernel, ref, baseline, variants: dict, iters: int) -> tuple[dict, dict]:
    """Forward + backward (kernel, provider, declared baseline, bench variants) and the backward alone (kernel,
    provider, baseline), each set timed side by side in one interleaved run."""
    with torch.no_grad():
        out = case.call(ref)
    gout = randn(out.shape, out.dtype, out.device, torch.Generator(device=out.device).manual_seed(1))
    execs = {"kernel": kernel, "provider": ref, **({"baseline": baseline} if baseline is not None else {})}
    fb_fns = {name: _forward_backward(case, fn, gout) for name, fn in execs.items()}
    fb_fns.update({name: _forward_backward(c, kernel, gout) for name, c in variants.items()})
    fb = side_by_side(fb_fns, iters=max(10, iters // 2), head_start_us=HEAD_START_US)
    bwd_fns = {name: _backward(case, fn, gout) for name, fn in execs.items()}
    bwd = side_by_side(bwd_fns, iters=max(10, iters // 2), head_start_us=HEAD_START_US)
    return fb, bwd


def _backward_record(bwd: dict) -> dict:
    """The backward alone: timings, provider / kernel and (with a declared baseline) baseline / kernel."""
    k_ms = bwd["kernel"]["median_ms"]
    rec = {**bwd, "speedup": _ratio(bwd["provider"]["median_ms"], k_ms)}
    if "baseline" in bwd:
        rec["baseline_speedup"] = _ratio(bwd["baseline"]["median_ms"], k_ms)
    return rec


def _bucket(target, small: bool) -> str:
    """Which of the target's ratios applied: ``rows < B`` / ``rows >= B`` with a small-rows bound, else ``all rows``."""
    if target.small_rows is None:
        return "all rows"
    return f"rows {'<' if small else '>='} {target.small_rows.below}"


def _variant_cases(case: OpCase) -> dict[str, OpCase]:
    """``kernel.<label>`` -> the case with that bench variant's keyword arguments."""
    return {f"kernel.{k}": replace(case, kwargs={**case.kwargs, **kw}) for k, kw in case.bench_variants.items()}


def _ratio(ms: float, base_ms: float) -> float | None:
    return ms / base_ms if base_ms > 0 else None


def _variants_record(case: OpCase, fwd: dict, fb: dict | None) -> dict:
    """Each bench variant's forward (and forward + backward) timing and its median over the plain kernel's."""
    out = {}
    for label in case.bench_variants:
        f, b = fwd[f"kernel.{label}"], None if fb is None else fb[f"kernel.{label}"]
        out[label] = {
            "forward": f,
            "forward_backward": b,
            "forward_vs_kernel": _ratio(f["median_ms"], fwd["kernel"]["median_ms"]),
            "forward_backward_vs_kernel": None if b is None else _ratio(b["median_ms"], fb["kernel"]["median_ms"]),
        }
    return out


GROUPED_TIMINGS = ("kernel.grouped", "kernel.one_by_one", "provider.one_by_one", "provider.concatenated")


def _grouped_fns(case: OpCase, grouped: Callable, kernel: Callable, ref: Callable) -> tuple[dict, list]:
    """Timed callables for the grouped record and its weights: the case's and two more of its shape (seeded)."""
    x, w = case.args[0], case.args[1]
    gen = torch.Generator(device=w.device).manual_seed(2)
    ws = [w, *(randn(tuple(w.shape), w.dtype, w.device, gen) for _ in range(2))]
    cat = torch.cat(ws)

    def one_by_one(fn: Callable) -> Callable:
        return lambda: [fn(x, v) for v in ws]

    fns = (lambda: grouped(x, ws), one_by_one(kernel), one_by_one(ref), lambda: ref(x, cat))
    return {name: _no_grad(fn) for name, fn in zip(GROUPED_TIMINGS, fns, strict=True)}, ws


def _no_grad(fn: Callable) -> Callable:
    def run():
        with torch.no_grad():
            return fn()

    return run


def _grouped_record(fwd: dict, bitwise: bool) -> dict:
    """The grouped call's timing next to the one-by-one calls and the concatenated provider product, and its ratios."""
    g = fwd["kernel.grouped"]["median_ms"]
    return {
        "weights": 3,
        **{name.replace(".", "_"): fwd[name] for name in GROUPED_TIMINGS},
        "speedup": _ratio(fwd["provider.one_by_one"]["median_ms"], g),
        "vs_provider_concatenated": _ratio(fwd["provider.concatenated"]["median_ms"], g),
        "vs_kernel_one_by_one": _ratio(fwd["kernel.one_by_one"]["median_ms"], g),
        "bitwise_one_by_one": bitwise,
    }


def bench_op(op: str, rows: int, cfg, device: str, copy_gbs: float, iters: int = 50) -> dict:
    """One operator's record: forward (gated), forward + backward and the backward alone (recorded; next to the
    declared baseline too, when there is one) timings, achieved bandwidth."""
    case = build_case(op, rows, cfg, device, seed=0)
    binding = registry.bind(op, "strict", device)
    ref = registry.reference(op)
    target = registry.spec(op).bench
    variants = _variant_cases(case)
    baseline = BASELINES[target.baseline](ref) if target is not None and target.baseline != "provider" else None
    grouped_fns, bitwise = {}, False
    if getattr(binding.fn, "grouped", None) is not None:
        grouped_fns, ws = _grouped_fns(case, binding.fn.grouped, binding.fn, ref)
    with launches.recording() as launched, torch.no_grad():  # one untimed call: the schedules the kernel notes
        case.call(binding.fn)
        if grouped_fns:
            outs = grouped_fns["kernel.grouped"]()
            bitwise = all(torch.equal(o, binding.fn(case.args[0], w)) for o, w in zip(outs, ws, strict=True))
    fns = {"kernel": _forward(case, binding.fn), "provider": _forward(case, ref), **grouped_fns}
    if baseline is not None:
        fns["baseline"] = _forward(case, baseline)
    fns.update({name: _forward(c, binding.fn) for name, c in variants.items()})
    fwd = side_by_side(fns, iters=iters, head_start_us=HEAD_START_US)
    fb = bwd = None
    if case.grad_args:
        fb, bwd = _gradient_timings(case, binding.fn, ref, baseline, variants, iters)
    k_ms, p_ms = fwd["kernel"]["median_ms"], fwd["provider"]["median_ms"]
    k_gbs = case.bytes_moved / (k_ms * 1e-3) / 1e9 if case.bytes_moved else None
    p_gbs = case.bytes_moved / (p_ms * 1e-3) / 1e9 if case.bytes_moved else None
    memory_bound = case.bytes_moved >= MEMORY_BOUND_MIN_BYTES if target is None else target.kind == "memory"
    fraction = None if k_gbs is None else k_gbs / copy_gbs
    bandwidth_ok = (fraction is not None and fraction >= MIN_COPY_FRACTION) if memory_bound else None
    if target is None:
        checks = {"not_slower": k_ms <= p_ms * (1 + NOISE), "bandwidth": bandwidth_ok}
        declared = None
    else:
        base_ms = fwd["baseline"]["median_ms"] if "baseline" in fwd else p_ms
        small = target.small_rows is not None and rows < target.small_rows.below
        min_ratio = target.small_rows.min_ratio if small else target.min_ratio
        ratio = base_ms / k_ms if k_ms > 0 else 0.0
        checks = {"not_slower": None, "bandwidth": bandwidth_ok, "target": ratio >= min_ratio}
        declared = {
            "baseline": target.baseline,
            "baseline_timing": fwd.get("baseline", fwd["provider"]),
            "ratio": ratio,
            "min_ratio": min_ratio,
            "rows_bucket": _bucket(target, small),
            "source": target.source,
        }
    return {
        "op": op,
        "binding": binding.record(),
        "shape": case.shape,
        "bytes_moved": case.bytes_moved,
        "flops": case.flops,
        "memory_bound": memory_bound,
        "forward": {
            "kernel": fwd["kernel"],
            "provider": fwd["provider"],
            "speedup": p_ms / k_ms if k_ms > 0 else None,
            "kernel_gbs": k_gbs,
            "provider_gbs": p_gbs,
            "fraction_of_copy": fraction,
        },
        "forward_backward": None if fb is None else {k: fb[k] for k in ("kernel", "provider", "baseline") if k in fb},
        "backward": None if bwd is None else _backward_record(bwd),
        "target": declared,
        **({"variants": _variants_record(case, fwd, fb)} if variants else {}),
        **({"grouped": _grouped_record(fwd, bitwise)} if grouped_fns else {}),
        **({"launch": launched[""][op]} if op in launched.get("", {}) else {}),
        "checks": checks,
        "verdict": "pass" if all(v is not False for v in checks.values()) else "fail",
    }


def bench_ops(
    ops: list[str], rows: int, cfg, device: str, progress: Callable[[str], None] | None = None
) -> tuple[float, list[dict]]:
    """Copy bandwidth and one record per operator (strict binds checked before anything is timed).

    ``progress(label)`` is called before each operator is timed.
    """
    if not device.startswith("cuda"):
        raise InputError("bench needs --device cuda")
    for op in ops:
        registry.bind(op, "strict", device)
    copy_gbs = copy_bandwidth_gbs(device)
    records = []
    for op in ops:
        if progress is not None:
            progress(f"--op {op} (rows {rows})")
        records.append(bench_op(op, rows, cfg, device, copy_gbs))
        torch.cuda.empty_cache()
    return copy_gbs, records
