"""Tensor- and context-parallel plans: who owns which heads / packed rows, and the ownership check.

* TP (``owners``: heads per rank; channel chunk ``c`` of every column-split weight goes with head ``c``).
* CP (``hidden_rows`` per rank, contiguous): the packed hidden state is sliced at the first block together with the
  row metadata (``ROW_META``) per the plan's ownership map. ``metadata_rows=None`` declares no metadata ownership
  (hidden state sharded alone): ranks then read metadata by local position.

Plans travel to the workers as JSON (:func:`plan_record` / :func:`plan_from_record`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_META = ("adaln_indices", "rope_cos", "rope_sin", "timestep_indices")


class NotAvailable(Exception):
    """The harness cannot run the requested configuration (a caller reports N/A with this reason)."""


class OwnershipError(Exception):
    """A plan's declared metadata rows are not its hidden rows (or its hidden rows do not tile the sequence)."""


@dataclass(frozen=True)
class CpPlan:
    world: int
    hidden_rows: tuple[tuple[int, ...], ...]
    metadata_rows: dict[str, tuple[tuple[int, ...], ...]] | None


@dataclass(frozen=True)
class TpPlan:
    world: int
    owners: tuple[tuple[int, ...], ...]  # heads (and channel chunks) of each rank, merged by logical id


Plan = CpPlan | TpPlan


def cp_plan(seq_len: int, world: int) -> CpPlan:
    """Contiguous near-equal row shards (``tensor_split``: the first ``S % world`` ranks hold one more row)."""
    rows = tuple(tuple(int(i) for i in part) for part in torch.arange(seq_len).tensor_split(world))
    return CpPlan(world, rows, {name: rows for name in ROW_META})


def hidden_only_plan(seq_len: int, world: int) -> CpPlan:
    plan = cp_plan(seq_len, world)
    return CpPlan(world, plan.hidden_rows, None)


def misowned_plan(seq_len: int, world: int) -> CpPlan:
    """Rank 0's ``adaln_indices`` rows hold rank 1's first row instead of its own last row."""
    plan = cp_plan(seq_len, world)
    n = len(plan.hidden_rows[0])
    adaln = list(plan.hidden_rows)
    adaln[0] = (*adaln[0][:-1], n)
    adaln[1] = (n - 1, *adaln[1][1:])
    return CpPlan(world, plan.hidden_rows, {**plan.metadata_rows, "adaln_indices": tuple(adaln)})


def tp_plan(heads: int, world: int, swapped: bool = False) -> TpPlan:
    if heads % world:
        raise NotAvailable(f"TP{world}: {heads} heads are not divisible by {world}")
    k = heads // world
    owners = [tuple(range(r * k, (r + 1) * k)) for r in range(world)]
    return TpPlan(world, tuple(reversed(owners)) if swapped else tuple(owners))


def check_ownership(plan: CpPlan, seq_len: int) -> None:
    """Hidden rows tile ``[0, S)`` once; every declared metadata shard holds exactly its rank's hidden rows.

    Raises :class:`OwnershipError` naming the first rank and tensor that break ownership."""
    seen = sorted(r for rows in plan.hidden_rows for r in rows)
    if seen != list(range(seq_len)):
        raise OwnershipError(f"CP{plan.world} plan: hidden rows do not cover the {seq_len} packed rows exactly once")
    for name, shards in (plan.metadata_rows or {}).items():
        for rank, (rows, hidden) in enumerate(zip(shards, plan.hidden_rows, strict=True)):
            if tuple(rows) != tuple(hidden):
                foreign = sorted(set(rows) - set(hidden))
                raise OwnershipError(
                    f"rank {rank}: {name} holds packed row(s) {foreign} owned by another rank (its hidden rows are "
                    f"{hidden[0]}..{hidden[-1]}): metadata mis-owned, arms not comparable"
                )


def describe_plan(plan: Plan) -> dict:
    """A short JSON description (evidence): TP degree and owners, or CP degree, row ranges and metadata."""
    if isinstance(plan, TpPlan):
        return {"tp": plan.world, "owners": [list(o) for o in plan.owners]}
    return {
        "cp": plan.world,
        "hidden_rows": [[r[0], r[-1]] for r in plan.hidden_rows],
        "metadata": "co-sharded" if plan.metadata_rows else "not sharded (read by local position)",
    }


def plan_record(plan: Plan) -> dict:
    """The whole plan as JSON (what a worker receives)."""
    if isinstance(plan, TpPlan):
        return {"kind": "tp", "world": plan.world, "owners": [list(o) for o in plan.owners]}
    meta = None if plan.metadata_rows is None else {k: [list(r) for r in v] for k, v in plan.metadata_rows.items()}
    return {"kind": "cp", "world": plan.world, "hidden_rows": [list(r) for r in plan.hidden_rows], "metadata": meta}


def plan_from_record(record: dict) -> Plan:
    def rows(shards: list) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(i) for i in r) for r in shards)

    if record["kind"] == "tp":
        return TpPlan(int(record["world"]), rows(record["owners"]))
    meta = record["metadata"]
    return CpPlan(
        int(record["world"]),
        rows(record["hidden_rows"]),
        None if meta is None else {k: rows(v) for k, v in meta.items()},
    )
