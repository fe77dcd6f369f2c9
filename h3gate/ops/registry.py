"""The operator registry and the one place runtime modes are decided.

``bind(name, mode, device)`` returns what a node will actually run:

* ``strict`` - the operator's declared strict kernel, or an :class:`InputError` naming the operator (fail closed);
* ``audit``  - the kernel when it can run, otherwise the reference, recorded as a fallback the gate reports;
* ``auto``   - the kernel when it can run, otherwise the reference (recorded, not reported as a finding);
* ``off``    - the provider reference only.

``merge`` picks the merge order of the reductions tensor parallelism splits: ``single`` (the one-walk kernels) or
``seg8`` - every operator with a declared ``<name>_seg8`` twin binds that twin (the segmented-8 order TP1, TP2, TP4
and TP8 share: :mod:`h3gate.kernels.tp_layers`); the binding keeps the graph's operator name and records the twin.

A kernel can run on CUDA tensors, or on CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Literal

from h3gate.errors import InputError
from h3gate.manifests.operators import OperatorSpec, load_operator_specs
from h3gate.merge_order import MERGE_ORDERS
from h3gate.numerics import interpreter_problem

Mode = Literal["strict", "audit", "auto", "off"]
MODES: tuple[str, ...] = ("strict", "audit", "auto", "off")


@dataclass(frozen=True)
class Binding:
    """What one operator resolves to for one run; evidence records every field."""

    op: str
    rfc_row: str
    mode: str
    requested: str  # "triton" | "provider"
    actual: str  # "triton" | "provider"
    kernel_id: str  # the kernel's id, or "provider:<reference path>"
    label: str  # "row" | "interim" | "reference"
    fallback: bool
    reason: str
    fn: Callable
    bound: str = ""  # the declared operator that runs, when a merge order bound ``op``'s twin

    def record(self) -> dict:
        twin = {"bound": self.bound, "merge_order": "seg8"} if self.bound and self.bound != self.op else {}
        return {
            **twin,
            "op": self.op,
            "rfc_row": self.rfc_row,
            "mode": self.mode,
            "requested": self.requested,
            "actual": self.actual,
            "kernel_id": self.kernel_id,
            "label": self.label,
            "fallback": self.fallback,
            "reason": self.reason,
        }


def import_path(path: str) -> Callable:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"operator binding {path}: cannot import ({exc})") from None


@cache
def specs() -> dict[str, OperatorSpec]:
    return load_operator_specs()


def spec(name: str) -> OperatorSpec:
    table = specs()
    if name not in table:
        raise InputError(f"operator {name!r}: not declared in manifests/operators/ (known: {', '.join(sorted(table))})")
    return table[name]


def reference(name: str) -> Callable:
    return import_path(spec(name).reference)


def kernel_runnable(device: str) -> tuple[bool, str]:
    """Whether a Triton kernel can execute on ``device`` in this process, and why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    if device.startswith("cuda"):
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        problem = interpreter_problem()
        return (True, "") if problem is None else (False, problem)
    return False, f"device {device} needs TRITON_INTERPRET=1 for Triton kernels"


def check_paths(spec: OperatorSpec) -> None:
    """The operator's declared selection table (``paths``) names only kernel paths its kernel module implements (the
    module's ``PATHS``), and the module's own ``check_paths`` (a tiling for every declared path) passes. Raises an
    InputError whose message starts with the failing field (``paths.rules[2].path: ...``)."""
    if spec.paths is None:
        return
    if spec.kernel is None:
        raise InputError("paths: declared without a kernel")
    module = importlib.import_module(spec.kernel.partition(":")[0])
    implemented: dict[str, frozenset[str]] = getattr(module, "PATHS", {})
    for i, rule in enumerate(spec.paths.rules):
        known = implemented.get(rule.product, frozenset())
        if rule.path not in known:
            raise InputError(
                f"paths.rules[{i}].path: {rule.path!r} is not a {rule.product} path of {module.__name__} "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
    if spec.paths.otherwise not in implemented.get("forward", frozenset()):
        raise InputError(f"paths.otherwise: {spec.paths.otherwise!r} is not a forward path of {module.__name__}")
    check = getattr(module, "check_paths", None)
    try:
        if check is not None:
            check(spec.paths)
    except ValueError as exc:
        raise InputError(f"paths: {exc}") from None


def check_mode(mode: str) -> str:
    """The one check of ``--mode`` (strict, audit, auto or off)."""
    if mode not in MODES:
        raise InputError(f"--mode {mode!r}: must be one of {', '.join(MODES)}")
    return mode


def refuses_fallback(mode: str) -> bool:
    """Whether ``mode`` refuses to run anything but a strict kernel (strict), where audit and auto fall back to the
    provider and record it, and off runs only the provider."""
    return check_mode(mode) == "strict"


def fails_closed(mode: str) -> bool:
    """Whether ``mode`` refuses what h3gate does not cover before anything runs (strict and audit), rather than
    running the provider for it (auto) or running only the provider (off)."""
    return check_mode(mode) in ("strict", "audit")


def fallback_fails(mode: str) -> bool:
    """Whether a fallback (an op bound to the provider reference instead of its strict kernel) is a failing finding
    in ``mode``: in audit mode (strict refuses to fall back; auto records it; off runs the references)."""
    return check_mode(mode) == "audit"


def check_merge(merge: str) -> str:
    """The one check of ``--merge-order`` (single or seg8)."""
    if merge not in MERGE_ORDERS:
        raise InputError(f"--merge-order {merge!r}: must be one of {', '.join(MERGE_ORDERS)}")
    return merge


def merge_twin(name: str, merge: str) -> str:
    """The operator that runs for ``name`` under ``merge``: its declared ``_seg8`` twin, or itself."""
    twin = f"{name}_seg8"
    return twin if check_merge(merge) == "seg8" and twin in specs() else name


def bind(name: str, mode: str, device: str, merge: str = "single") -> Binding:
    """What operator ``name`` runs in ``mode`` on ``device``: the named operator itself by default (``bench --op``,
    ``ws1-ops`` cases), or its declared twin under ``merge="seg8"`` (a graph bound in a run's merge order,
    :func:`h3gate.graph.executions.bind_graph`, whose default is :data:`h3gate.merge_order.DEFAULT_MERGE_ORDER`)."""
    check_mode(mode)
    target = merge_twin(name, merge)
    if target != name:
        spec(name)  # the graph's own operator is declared too
        b = bind(target, mode, device)
        return Binding(name, *(getattr(b, f) for f in _FIELDS[1:]), bound=target)
    s = spec(name)
    ref_id = f"provider:{s.reference}"
    if mode == "off":
        return Binding(
            name, s.rfc_row, mode, "provider", "provider", ref_id, "reference", False, "mode off", reference(name)
        )
    ok, why = kernel_runnable(device)
    if s.kernel is None:
        why = "no strict kernel declared"
        ok = False
    if ok:
        return Binding(
            name, s.rfc_row, mode, "triton", "triton", s.kernel_id or "", s.label, False, "", import_path(s.kernel)
        )
    if refuses_fallback(mode):
        raise InputError(f"strict mode: operator {name} ({s.rfc_row}): {why}; refusing to fall back")
    return Binding(name, s.rfc_row, mode, "triton", "provider", ref_id, "reference", True, why, reference(name))


_FIELDS = ("op", "rfc_row", "mode", "requested", "actual", "kernel_id", "label", "fallback", "reason", "fn")
