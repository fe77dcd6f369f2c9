"""The ablation registries: what a row's ``probe`` / ``strict`` names, by the row's ``run``.

* ``forward`` / ``trajectory`` / ``backward`` rows name arm probes, ``fn(ctx, arm) -> Arm``
  (:data:`h3gate.ablate.probes.ARM_PROBES`);
* ``check`` rows name checks, ``fn(ctx, ablation) -> Outcome`` (:data:`h3gate.ablate.checks.CHECKS`; no ``strict``);
* ``distributed`` rows name parallel plans, ``fn(world) -> run ws2 settings`` (topology, partition)
  (:data:`h3gate.ablate.multirank.PLANS`; ``strict`` absent = TP1, ws2's one-device reference; ``ranks`` = the world).

Adding a row: its YAML entry, plus one registered function when it needs a new one.
"""

from __future__ import annotations

from collections.abc import Mapping

from h3gate.ablate.checks import CHECKS
from h3gate.ablate.multirank import PLANS
from h3gate.ablate.probes import ARM_PROBES
from h3gate.errors import InputError
from h3gate.manifests.ablations import ABLATIONS_FILE, AblationRow
from h3gate.paths import display

ARM_RUNS = ("forward", "trajectory", "backward")


def registry_for(run: str) -> tuple[str, Mapping]:
    """``(what the names are, the registry)`` for a row's ``run``."""
    if run in ARM_RUNS:
        return "an arm probe", ARM_PROBES
    if run == "check":
        return "a check", CHECKS
    return "a parallel plan", PLANS


def check_names(rows: Mapping[str, AblationRow], source: str | None = None) -> int:
    """Every row's ``probe`` / ``strict`` names a registered function of its run's kind (breadcrumb error otherwise);
    returns the number of rows checked."""
    source = source or display(ABLATIONS_FILE)
    for ablation_id, ablation in rows.items():
        kind, table = registry_for(ablation.run)
        where, probe, strict = f"{source}: rows.{ablation_id}", ablation.probe, ablation.strict
        if probe not in table:
            raise InputError(f"{where}.probe: {probe!r} is not {kind} (known: {', '.join(sorted(table))})")
        if strict is not None and ablation.run == "check":
            raise InputError(f"{where}.strict: a check row has no strict arm ({strict!r})")
        if strict is not None and strict not in table:
            raise InputError(f"{where}.strict: {strict!r} is not {kind} of a {ablation.run} row")
    return len(rows)


def describe(name: str, run: str) -> str:
    """The first docstring line of the function ``name`` names for a ``run`` row ("" if unknown)."""
    fn = registry_for(run)[1].get(name)
    lines = (fn.__doc__ or "").strip().splitlines() if fn is not None else []
    return lines[0] if lines else ""
