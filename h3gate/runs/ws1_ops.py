"""The ws1-ops engine: per-operator evidence for the strict kernels against the provider and a float64 golden.

For one operator and one row count it runs, on the case's inputs (``h3gate.ops.cases``):

* forward and backward of the provider reference, the strict kernel (``registry.bind(op, "strict", device)``) and
  the golden (the reference - or the case's ``golden_fn`` - on float64 copies; gradients of the same seeded output
  gradient in float64);
* ``provider_bitwise`` - measured, kernel bytes vs provider bytes (forward and each input gradient);
* accuracy - ``rel_l2`` of kernel and provider against the golden; the kernel's must not exceed the bound the
  contract declares (``contract.accuracy``, keyed by the compared tensor's dtype; :data:`DEFAULT_ACCURACY` for an
  operator that declares none);
* invariance, bitwise, forward and backward: a repeat; the case's item inside batches of 2 and 3 at every position
  next to fresh random items; the bytes of kept output rows while every unrelated input row is mutated.

* rows - the row rule of the ``ws1-block`` tolerance profile (:mod:`h3gate.gate.rows`): every row of the output
  and of each gradient against the golden, bounded by the provider's own row errors under every provider variant the
  device offers (``forward.rows``, ``backward[i].rows``), so one wrong row fails however long the tensor.

``merge`` (``--merge-order``): under ``seg8`` an operator with a declared ``<op>_seg8`` twin runs the twin's case,
kernel and contract (what every seg8 gate, the default, binds for it); one without a twin runs its single kernel,
recorded as such (``merge``: the order requested, the one the kernel that ran is in, the operator that ran, why they
differ). The merge order never changes what a case checks.

A result passes when every promise held: ``provider_bitwise`` where the contract promises it (forward), accuracy
within the declared bound, every row within the row rule, every invariance probe bitwise. Tensors without a batch
(or row) dimension that sum over
it (parameter and table gradients) are compared on repeat only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.gate.compare import agreement, bitwise_equal, error
from h3gate.gate.rows import describe, row_errors
from h3gate.gate.variants import provider_variants
from h3gate.kernels import launches
from h3gate.manifests.model_config import ModelConfig
from h3gate.manifests.tolerances import load_tolerance
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.ops import registry
from h3gate.ops.case import OpCase, in_batch, mutate_rows, randn, to_float64
from h3gate.ops.cases import build_case
from h3gate.runs.block_rows import RowContext, run_variant

DEFAULT_ACCURACY = {
    "forward": {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-3},
    "backward": {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3},
}
PLACEMENTS: tuple[tuple[int, int], ...] = ((2, 0), (2, 1), (3, 0), (3, 1), (3, 2))


def bounds(op: str) -> tuple[dict, dict, str]:
    """(forward, backward) rel_l2 bounds by dtype and where they were declared."""
    acc = registry.spec(op).contract.accuracy
    if acc is None:
        return DEFAULT_ACCURACY["forward"], DEFAULT_ACCURACY["backward"], "ws1-ops default"
    return dict(acc.forward), dict(acc.backward), "contract"


def _leaves(case: OpCase, args: tuple) -> tuple[tuple, list[torch.Tensor]]:
    out, leaves = list(args), []
    for i in case.grad_args:
        a = args[i].detach().requires_grad_(True)
        out[i] = a
        leaves.append(a)
    return tuple(out), leaves


def _run(case: OpCase, fn: Callable, args: tuple, gout: torch.Tensor | None, golden: bool = False):
    """Forward output and (when ``gout`` is given) the gradients of every grad arg; ``golden`` runs on float64."""
    kwargs = case.kwargs
    if golden:
        args = tuple(to_float64(a) for a in args)
        kwargs = {k: to_float64(v) for k, v in kwargs.items()} | case.golden_kwargs
        fn = case.golden_fn or fn
    if gout is None or not case.grad_args:
        with torch.no_grad():
            return fn(*args, **kwargs).detach(), []
    args, leaves = _leaves(case, args)
    out = fn(*args, **kwargs)
    grads = torch.autograd.grad(out, leaves, gout.double() if golden else gout, allow_unused=True)
    return out.detach(), [None if d is None else d.detach() for d in grads]


def _widen(t: torch.Tensor, dim: int, size: int, position: int, gen: torch.Generator) -> torch.Tensor:
    """``t`` (batch 1 along ``dim``) at ``position`` of a batch of ``size``, fresh random items elsewhere."""
    parts = [t if i == position else randn(t.shape, t.dtype, t.device, gen) for i in range(size)]
    return torch.cat(parts, dim=dim)


def _acc_check(kernel: torch.Tensor, provider: torch.Tensor, golden: torch.Tensor, table: dict) -> dict:
    dt = dtype_name(kernel.dtype)
    bound = table.get(dt)
    k, p = error(kernel, golden), error(provider, golden)
    ok = bound is not None and k["rel_l2"] is not None and k["rel_l2"] <= bound
    return {
        "dtype": dt,
        "provider_bitwise": bitwise_equal(kernel, provider),
        "kernel_vs_golden": k,
        "provider_vs_golden": p,
        "bound_rel_l2": bound,
        "accuracy_ok": bool(ok),
    }


def _rows_of(t: torch.Tensor, dim: int | None, keep: Sequence[int]) -> torch.Tensor:
    if dim is None:
        return t
    return t.index_select(dim, torch.as_tensor(list(keep), device=t.device))


@dataclass
class OpResult:
    record: dict
    failures: list[str]


def row_context(device: str) -> RowContext:
    """The row rule ws1-ops judges by (the ``ws1-block`` profile's), with this device's provider variants."""
    rule = load_tolerance("ws1-block").row_rule
    variants, skipped = provider_variants(list(rule.variants), device)
    return RowContext(rule, variants, skipped, [], {})


def _row_checks(
    ctx: RowContext, case: OpCase, ref: Callable, gout, outs: tuple, row_dims: list, declared: tuple[dict, dict]
) -> list[dict]:
    """Row checks of the kernel's output and gradients (``outs``: kernel, provider and golden (output, grads)).

    A row's bound is the row rule's, raised to the operator contract's declared rel_l2 for the tensor's dtype
    (``declared``: forward and backward bounds), applied per row: an FP32 operator whose provider is exact to the
    last bit keeps the accuracy its contract declares, and a wrong row still fails."""
    (k_out, k_grads), (p_out, p_grads), (g_out, g_grads) = outs
    tensors = [(k_out, p_out, g_out, case.out_row_dim)]
    tensors += [(k, p, g, d) for k, p, g, d in zip(k_grads, p_grads, g_grads, row_dims, strict=True)]
    errs = [{"default": row_errors(p, g, d)} if None not in (p, g) else {} for _, p, g, d in tensors]
    for variant in ctx.variants[1:]:
        got = run_variant(variant, lambda: _run(case, ref, case.args, gout), ctx.skipped)
        if got is None:
            continue
        for i, t in enumerate([got[0], *got[1]]):
            if t is not None and tensors[i][2] is not None:
                errs[i][variant.name] = row_errors(t, tensors[i][2], tensors[i][3])
        del got
    fwd, bwd = declared
    least = [fwd.get(dtype_name(k.dtype)) if i == 0 else bwd.get(dtype_name(k.dtype)) if k is not None else None
             for i, (k, _, _, _) in enumerate(tensors)]  # fmt: skip
    return [
        ctx.judge(k, e, g, d, at_least=m or 0.0) if k is not None and e else None
        for (k, _, g, d), e, m in zip(tensors, errs, least, strict=True)
    ]


def run_case(
    op: str,
    rows: int,
    cfg: ModelConfig,
    device: str,
    seed: int,
    backward: bool = True,
    kernel: Callable | None = None,
    merge: str = DEFAULT_MERGE_ORDER,
) -> OpResult:
    """Everything ws1-ops records for one operator at one row count, in merge order ``merge`` (module docstring).
    ``kernel`` replaces the bound strict kernel (a negative control: a deliberately wrong kernel must fail)."""
    target = registry.merge_twin(op, merge)  # the operator that runs: op, or its declared seg8 twin
    case = build_case(target, rows, cfg, device, seed)
    binding = registry.bind(op, "strict", device, merge)
    kernel_fn = kernel or binding.fn
    ref = registry.reference(target)
    spec = registry.spec(target)
    fwd_bounds, bwd_bounds, source = bounds(target)
    gen = torch.Generator(device=device).manual_seed(seed + 7919)  # probe noise (output gradient, neighbours)
    failures: list[str] = []

    with torch.no_grad():
        probe_out = case.call(ref)
    gout = randn(probe_out.shape, probe_out.dtype, probe_out.device, gen) if backward and case.grad_args else None
    del probe_out
    with launches.recording() as launched:  # the schedules the kernel itself notes (none for a substituted one)
        k_out, k_grads = _run(case, kernel_fn, case.args, gout)  # kernel first: a bad input fails before the rest
    p_out, p_grads = _run(case, ref, case.args, gout)
    g_out, g_grads = _run(case, ref, case.args, gout, golden=True)
    ctx = row_context(device)
    grad_dims = [case.row_dims.get(pos) for pos in case.grad_args[: len(k_grads)]]
    outs = ((k_out, k_grads), (p_out, p_grads), (g_out, g_grads))
    row_checks = _row_checks(ctx, case, ref, gout, outs, grad_dims, (fwd_bounds, bwd_bounds))

    forward = _acc_check(k_out, p_out, g_out, fwd_bounds)
    forward["kernel_vs_provider"] = agreement(k_out, p_out, case.out_row_dim)
    forward["rows"] = row_checks[0]
    grads = []
    for pos, kg, pg, gg, rc in zip(case.grad_args, k_grads, p_grads, g_grads, row_checks[1:], strict=False):
        if kg is None or pg is None or gg is None:
            grads.append({"arg": pos, "missing": True})
            failures.append(f"{op} S={rows}: gradient of arg {pos} missing")
            continue
        grads.append({"arg": pos, "missing": False, **_acc_check(kg, pg, gg, bwd_bounds), "rows": rc})
    del p_out, g_out, p_grads, g_grads  # the invariance probes below need the device memory (768p, float64 golden)

    inv = _invariance(case, kernel_fn, k_out, k_grads, gout, gen)

    if spec.contract.provider_bitwise and not forward["provider_bitwise"]:
        failures.append(f"{op} S={rows}: promised provider-bitwise forward, kernel bytes differ from the provider")
    if not forward["accuracy_ok"]:
        failures.append(
            f"{op} S={rows}: forward rel_l2 {forward['kernel_vs_golden']['rel_l2']} > {forward['bound_rel_l2']}"
        )
    for g in grads:
        if not g["missing"] and not g["accuracy_ok"]:
            rel, bound = g["kernel_vs_golden"]["rel_l2"], g["bound_rel_l2"]
            failures.append(f"{op} S={rows}: grad of arg {g['arg']} rel_l2 {rel} > {bound}")
    for where, rc in [("forward", forward["rows"]), *((f"grad of arg {g['arg']}", g.get("rows")) for g in grads)]:
        if rc is not None and not rc["pass"]:
            failures.append(f"{op} S={rows}: {where} row rule: {describe(rc)}")
    for name, ok in _flatten_invariance(inv):
        if ok is False:
            failures.append(f"{op} S={rows}: invariance {name} not bitwise")

    record = {
        "layout_rows": rows,
        "shape": case.shape,
        "forward": forward,
        "backward": grads if gout is not None else None,
        "invariance": inv,
        "tolerance_source": source,
        "row_rule": ctx.record(),
        **({"launch": launched[""][target]} if target in launched.get("", {}) else {}),
        "verdict": "pass" if not failures else "fail",
    }
    return OpResult(record, failures)


def _grads_equal(a: list, b: list) -> bool | None:
    pairs = [bitwise_equal(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    return all(pairs) if pairs else None


def _invariance(case: OpCase, fn: Callable, out: torch.Tensor, grads: list, gout, gen: torch.Generator) -> dict:
    rep_out, rep_grads = _run(case, fn, case.args, gout)
    inv: dict = {
        "repeat": {
            "forward": bitwise_equal(rep_out, out),
            "backward": _grads_equal(grads, rep_grads) if gout is not None else None,
        }
    }
    placements = []
    if case.batch_dims and case.out_batch_dim is not None:
        for size, position in PLACEMENTS:
            args = in_batch(case, case.args, size, position, gen)
            g_b = None if gout is None else _widen(gout, case.out_batch_dim, size, position, gen)
            o_b, gr_b = _run(case, fn, args, g_b)
            bwd_ok = None
            if gout is not None:
                pairs = [
                    bitwise_equal(gb.narrow(case.batch_dims[p], position, 1), ga)
                    for p, ga, gb in zip(case.grad_args, grads, gr_b, strict=False)
                    if ga is not None and gb is not None and p in case.batch_dims
                ]
                bwd_ok = all(pairs) if pairs else None
            fwd_ok = bitwise_equal(o_b.narrow(case.out_batch_dim, position, 1), out)
            placements.append({"batch": size, "position": position, "forward": fwd_ok, "backward": bwd_ok})
    inv["batch"] = placements
    inv["mutation"] = _mutation(case, fn, out, grads, gout, gen)
    inv["prefix"] = _prefix(case, fn, out)
    return inv


def _prefix(case: OpCase, fn: Callable, out: torch.Tensor) -> dict | None:
    """The first ``case.prefix_rows`` rows run alone (forward) must equal the same rows of the full call."""
    if not case.prefix_rows or case.out_row_dim is None:
        return None
    p = case.prefix_rows
    args = list(case.args)
    for pos, dim in case.row_dims.items():
        args[pos] = args[pos].narrow(dim, 0, p).contiguous()
    with torch.no_grad():
        o_p = fn(*args, **case.kwargs)
    return {"rows": p, "forward": bitwise_equal(o_p, out.narrow(case.out_row_dim, 0, p))}


def _mutation(case: OpCase, fn: Callable, out: torch.Tensor, grads: list, gout, gen: torch.Generator) -> dict | None:
    if case.out_row_dim is None or (case.mutate is None and not case.row_dims):
        return None
    n = out.shape[case.out_row_dim]
    keep = sorted({0, n // 2, n - 1})
    args = mutate_rows(case, case.args, keep, gen)
    g_m = None
    if gout is not None:
        g_m = gout.detach().clone()
        fresh = randn(g_m.shape, g_m.dtype, g_m.device, gen)
        mask = torch.ones(n, dtype=torch.bool, device=g_m.device)
        mask[torch.as_tensor(keep, device=g_m.device)] = False
        shape = [1] * g_m.ndim
        shape[case.out_row_dim] = n
        g_m = torch.where(mask.view(shape), fresh, g_m)
    o_m, gr_m = _run(case, fn, args, g_m)
    fwd_ok = bitwise_equal(_rows_of(o_m, case.out_row_dim, keep), _rows_of(out, case.out_row_dim, keep))
    bwd_ok = None
    if gout is not None and case.mutate is None:  # row-local gradients only (gathers' gradients are sums)
        pairs = [
            bitwise_equal(_rows_of(gb, case.row_dims[p], keep), _rows_of(ga, case.row_dims[p], keep))
            for p, ga, gb in zip(case.grad_args, grads, gr_m, strict=False)
            if ga is not None and gb is not None and p in case.row_dims
        ]
        bwd_ok = all(pairs) if pairs else None
    return {"rows_kept": keep, "forward": fwd_ok, "backward": bwd_ok}


def _flatten_invariance(inv: dict) -> list[tuple[str, bool | None]]:
    out = [("repeat.forward", inv["repeat"]["forward"]), ("repeat.backward", inv["repeat"]["backward"])]
    for p in inv["batch"]:
        tag = f"batch{p['batch']}@{p['position']}"
        out += [(f"{tag}.forward", p["forward"]), (f"{tag}.backward", p["backward"])]
    if inv["mutation"] is not None:
        out += [("mutation.forward", inv["mutation"]["forward"]), ("mutation.backward", inv["mutation"]["backward"])]
    if inv.get("prefix") is not None:
        out.append(("prefix.forward", inv["prefix"]["forward"]))
    return out


# Live float64-sized copies of a case's inputs during run_case: per-row inputs (the input, its float64 golden, the
# kernel's, provider's and golden's outputs and gradients, provider variants, batch and mutation probes; h3_swiglu
# at real/tiny: 12 x 60 MB estimated, ~560 MB measured), and the other inputs (weights: the float64 golden copy,
# its gradient and the kernel's and provider's bf16 gradients).
ROW_COPIES, OTHER_COPIES = 12, 4


def case_bytes(op: str, rows: int, cfg: ModelConfig) -> int:
    """An estimate of what ``run_case(op, rows, ...)`` holds at once, from the case built on the meta device
    (shapes only, nothing allocated): 8 bytes a value times :data:`ROW_COPIES` for arguments with rows,
    :data:`OTHER_COPIES` for the others."""
    case = build_case(op, rows, cfg, "meta", 0)
    total = 0
    for i, t in enumerate(case.args):
        if isinstance(t, torch.Tensor):
            total += 8 * t.numel() * (ROW_COPIES if i in case.row_dims else OTHER_COPIES)
    return total + sum(8 * OTHER_COPIES * t.numel() for t in case.kwargs.values() if isinstance(t, torch.Tensor))


def is_twin(op: str) -> bool:
    """``op`` is a declared ``<name>_seg8`` twin of a declared operator ``<name>``."""
    return op.endswith("_seg8") and op.removesuffix("_seg8") in registry.specs()


def merge_record(op: str, merge: str) -> dict:
    """The merge order asked for, the order of the kernel that runs (``seg8`` for a twin, bound or named), the
    operator that runs, and why the two orders differ (empty when they agree)."""
    target = registry.merge_twin(op, merge)
    actual = "seg8" if is_twin(target) else "single"
    reason = ""
    if actual != merge:
        reason = (
            f"no declared {op}_seg8 twin: its single kernel runs, as every seg8 gate binds it"
            if merge == "seg8"
            else f"{op} is the declared seg8 twin of {op.removesuffix('_seg8')}, run by name"
        )
    return {"requested": merge, "actual": actual, "operator": target, "reason": reason}


def operator_header(op: str, device: str, merge: str = DEFAULT_MERGE_ORDER) -> dict:
    """The operator's binding in merge order ``merge``, the merge record, and the contract facts (of the operator
    that runs) evidence restates next to what was measured."""
    spec = registry.spec(registry.merge_twin(op, merge))
    binding = registry.bind(op, "strict", device, merge)
    c = spec.contract
    return {
        "op": op,
        "binding": binding.record(),
        "merge": merge_record(op, merge),
        "contract": {
            "provider_bitwise": c.provider_bitwise,
            "accumulator": c.accumulator,
            "atomics": c.atomics,
            "split_policy": c.split_policy,
            "dtypes": list(c.dtypes),
        },
    }


def default_ops(known: Sequence[str], merge: str = DEFAULT_MERGE_ORDER) -> tuple[list[str], list[dict]]:
    """Operators with a case builder and a declared kernel; the others, with the reason they do not run. Under
    ``seg8`` a twin runs as its operator's binding, not a second time by its own name."""
    run, skipped = [], []
    for op in sorted(registry.specs()):
        if merge == "seg8" and is_twin(op):
            skipped.append({"op": op, "reason": f"runs as {op.removesuffix('_seg8')} (merge order seg8)"})
        elif op not in known:
            skipped.append({"op": op, "reason": "no case builder"})
        elif registry.spec(op).kernel is None:
            skipped.append({"op": op, "reason": "no strict kernel declared"})
        else:
            run.append(op)
    return run, skipped


def check_ops(ops: Sequence[str], known: Sequence[str]) -> None:
    for op in ops:
        registry.spec(op)
        if op not in known:
            raise InputError(f"--op {op}: no case builder (known: {', '.join(sorted(known))})")
