"""The forward half of the one-block gate (:mod:`h3gate.runs.ws1_block`), node by node.

Every execution is a :class:`Lane` streamed through :func:`h3gate.graph.execute.iter_graph`: each node output is
reduced to its records as soon as it exists and dropped after its last reader, so the gate holds each lane's live
values (at most 3F + 2H per row in the block, at ``swiglu``), not its 17 outputs. Three passes:

1. chained, the lanes in lockstep: the FP64 golden, the provider under every variant (default first) and the
   candidate. Per node: candidate vs provider (chained agreement), both against the golden (error), and the row
   errors of every provider variant and of the candidate against the golden. The chained row rule is judged once
   every lane has run through, so a variant refused at run time (``sdpa-math`` out of memory at a long S) drops out
   of every node's envelope, as when it ran whole. The provider's and candidate's outputs go to the value store.
2. isolated, one node at a time on the stored provider inputs: the candidate's node vs the provider's output
   (isolated agreement) and vs the node-local FP64 golden, under the envelope of the provider's node under every
   variant.
3. invariance, the provider's and then the candidate's: repeated and placed in batches of 2 and 3 beside unrelated
   items (``gate.invariance.PLACEMENTS``), in lockstep, each node against its stored output, bitwise.

The :class:`ValueStore` keeps the provider's and candidate's node values (the golden's too for ``--save-tensors``)
on the device or, where the memory plan (:func:`h3gate.runs.setup.plan_block_memory`) finds the device too small
for them beside pass 1, in host memory (moved to the device one node at a time). The backward and the fault matrix
read every stored value on the device, so a host store runs forward only. The arithmetic of every lane is its
chained execution's: streaming changes what is kept, never what is computed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from h3gate.gate.compare import agreement, error
from h3gate.gate.invariance import (
    PLACEMENTS,
    filler_records,
    merge_placements,
    place,
    placement_record,
    select,
    with_fillers,
)
from h3gate.gate.rows import row_errors
from h3gate.gate.variants import Variant, refusal
from h3gate.graph import determinism
from h3gate.graph.core import Node, Values
from h3gate.graph.execute import iter_isolated
from h3gate.kernels import launches
from h3gate.kernels.launches import Log
from h3gate.runs.block_records import unrelated
from h3gate.runs.block_rows import RowContext, isolated_envelope

if TYPE_CHECKING:
    from h3gate.runs.ws1_block import BlockGate, _Executions

PASSES = (
    "golden, provider under every variant and candidate, chained node by node",
    "candidate isolated and node-local goldens",
    "provider repeat and batch placements",
    "candidate repeat and batch placements",
)


@dataclass
class Lane:
    """One streamed execution: ``step()`` runs the next node (under ``variant`` when given) and returns its output;
    a variant refused at run time (a ``RuntimeError``: no such backend, out of memory) is recorded and yields None
    from then on."""

    name: str
    stream: Iterator[tuple[Node, torch.Tensor]]
    variant: Variant | None = None
    refused: str | None = None
    label: str = "chained"  # the pass its evaluations belong to (h3gate.graph.determinism)

    def step(self) -> torch.Tensor | None:
        if self.refused is not None:
            return None
        entered = self.variant.enter() if self.variant is not None else contextlib.nullcontext()
        try:
            with entered, torch.no_grad(), determinism.evaluation(self.label):
                return next(self.stream)[1]
        except RuntimeError as exc:
            if self.variant is None:
                raise
            self.refused = refusal(exc)
            self.stream.close()
            return None


@dataclass
class ValueStore:
    """Node values of the provider and the candidate (and the golden, when ``keep`` names it), kept on ``where``
    (the run's device, or ``cpu``: host memory) and handed out on ``device``."""

    device: str
    where: str
    inputs: Mapping[str, torch.Tensor]
    keep: tuple[str, ...] = ("provider", "candidate")
    kept: dict[str, Values] = field(default_factory=dict)

    def put(self, who: str, name: str, value: torch.Tensor) -> None:
        if who in self.keep:
            self.kept.setdefault(who, {})[name] = value.to(self.where)

    def get(self, who: str, name: str) -> torch.Tensor:
        """``who``'s value of ``name`` on the device (a copy when the store is in host memory)."""
        return self.kept[who][name].to(self.device)

    def stored(self, who: str, name: str) -> torch.Tensor:
        """``who``'s value of ``name`` where it is kept (records read shapes and hashes from it)."""
        return self.kept[who][name]

    def feed(self, node: Node, reads: tuple[str, ...] = ()) -> Values:
        """The graph inputs and provider values ``node`` reads (``reads``: an override's extra ones) and the
        provider's own output of ``node``, on the device."""
        names = dict.fromkeys((*node.inputs, *reads, node.name))
        return {k: (self.inputs[k] if k in self.inputs else self.get("provider", k)) for k in names}

    def values(self, who: str) -> Values:
        """Graph inputs and every stored node value of ``who`` (as stored: the backward reads a device store)."""
        return {**self.inputs, **self.kept.get(who, {})}


@dataclass
class Forward:
    """The forward records of one gate run, per node name."""

    store: ValueStore
    chained: dict[str, dict]  # candidate vs provider
    isolated: dict[str, dict]  # candidate's node on the provider's inputs vs provider
    errors: dict[str, tuple[dict, dict]]  # (candidate, provider) vs the chained golden
    rows: dict[str, dict]  # {"chained": row check, "isolated": row check}
    prov_rep: dict[str, dict]
    cand_rep: dict[str, dict]
    prov_batch: dict[str, dict]
    cand_batch: dict[str, dict]
    ctx: RowContext
    seconds: float
    launches: Log = field(default_factory=dict)  # node -> op -> schedules the candidate's chained pass launched


def forward(gate: BlockGate, ex: _Executions, ctx: RowContext, store: ValueStore) -> Forward:
    """The three passes (module docstring) into ``store``; progress one step per pass."""
    t0 = time.perf_counter()
    ex.step(f"forward: {PASSES[0]}")
    with launches.recording() as launched:  # the candidate's kernels note their schedules (the chained pass only)
        chained, errors, chained_rows = _chained(gate, ex, ctx, store)
    ex.step(f"forward: {PASSES[1]}")
    isolated, isolated_rows = _isolated(gate, ex, ctx, store)
    ex.step(f"forward: {PASSES[2]}")
    prov_rep, prov_batch = _invariance(gate, ex, store, "provider")
    ex.step(f"forward: {PASSES[3]}")
    cand_rep, cand_batch = _invariance(gate, ex, store, "candidate")
    rows = {n: {"chained": chained_rows[n], "isolated": isolated_rows[n]} for n in chained}
    return Forward(store, chained, isolated, errors, rows, prov_rep, cand_rep, prov_batch, cand_batch, ctx,
                   time.perf_counter() - t0, launched)  # fmt: skip


def _chained(
    gate: BlockGate, ex: _Executions, ctx: RowContext, store: ValueStore
) -> tuple[dict[str, dict], dict[str, tuple[dict, dict]], dict[str, dict]]:
    """Pass 1: per node (chained agreement, (candidate, provider) errors vs the golden, chained row check)."""
    mods = gate.inputs.modalities
    golden, provider, candidate = (ex.lane(who) for who in ("golden", "provider", "candidate"))
    variants = [ex.lane("provider", variant=v) for v in ctx.variants[1:]]
    agree: dict[str, dict] = {}
    errors: dict[str, tuple[dict, dict]] = {}
    envelopes: dict[str, dict[str, torch.Tensor]] = {}
    measured: dict[str, tuple[torch.Tensor, torch.dtype]] = {}
    for node in gate.graph.nodes:
        n, rd = node.name, node.row_dim
        gold, prov, cand = golden.step(), provider.step(), candidate.step()
        cand = prov if cand is None else cand  # a node SGLang did not capture: failed as such (runs/block_sglang.py)
        envelopes[n] = {"default": row_errors(prov, gold, rd)}
        for lane in variants:
            out = lane.step()
            if out is not None:
                envelopes[n][lane.name] = row_errors(out, gold, rd)
            del out
        measured[n] = (row_errors(cand, gold, rd), cand.dtype)
        agree[n] = agreement(cand, prov, rd, mods)
        errors[n] = (error(cand, gold), error(prov, gold))
        for who, value in (("golden", gold), ("provider", prov), ("candidate", cand)):
            store.put(who, n, value)
        del gold, prov, cand
    refused = {lane.name for lane in variants if lane.refused is not None}
    ctx.skipped += [{"name": lane.name, "reason": lane.refused} for lane in variants if lane.name in refused]
    rows = {}
    for n, (errs, dtype) in measured.items():
        env = {k: v for k, v in envelopes[n].items() if k not in refused}
        rows[n] = ctx.judge_errors(errs, dtype, env, key=f"forward.chained.{n}")
    return agree, errors, rows


def _isolated(
    gate: BlockGate, ex: _Executions, ctx: RowContext, store: ValueStore
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Pass 2: per node (isolated agreement, isolated row check); with ``ctx.keep`` the node-local golden and
    envelope are kept for the fault matrix."""
    agree: dict[str, dict] = {}
    rows: dict[str, dict] = {}
    for node, feed, iso in _isolated_stream(gate, ex, store):
        n = node.name
        agree[n] = agreement(iso, feed[n], node.row_dim, gate.inputs.modalities)
        with determinism.evaluation("isolated envelope"):
            local, envelope = isolated_envelope(ctx, node, feed, gate.params, ex.golden_params)
        rows[n] = ctx.judge(iso, envelope, local, node.row_dim)
        if ctx.keep:  # the candidate's own output too, unless an override made it (the matrix then re-runs it)
            own = None if n in (gate.node_overrides or {}) else iso
            ctx.kept.setdefault("forward", {})[n] = (local, envelope, own)
        del iso, local, feed
    return agree, rows


def _isolated_stream(
    gate: BlockGate, ex: _Executions, store: ValueStore
) -> Iterator[tuple[Node, Values, torch.Tensor]]:
    """``(node, the provider's values it reads, the candidate's node on them)`` in graph order: the executor's
    isolated pass, or SGLang's teacher-forced forward (a node it did not capture: the provider's value, failed)."""
    if gate.sglang is None:
        # with the backward, each node VJP's forward on the same provider values is the isolated evaluation's partner
        table, repeat = ex.tables["candidate"], not gate.backward
        stream = iter_isolated(gate.graph.nodes, table, store.feed, gate.params, gate.node_overrides, repeat)
        while True:
            with determinism.evaluation("isolated"):
                got = next(stream, None)
            if got is None:
                return
            yield got
    values = gate.sglang.isolated(store.values("provider"))
    for node in gate.graph.nodes:
        feed = store.feed(node)
        yield node, feed, values.get(node.name, feed[node.name])


def _placed_lanes(gate: BlockGate, ex: _Executions, who: str) -> tuple[Lane, list[tuple[int, int, Lane]], bool]:
    """The repeat lane and one lane per batch placement, and whether those yield the whole batch (h3gate's lanes;
    SGLang's yield the request's item alone)."""
    if who == "candidate" and gate.sglang is not None:
        sg, nodes = gate.sglang, gate.graph.nodes

        def lane(values: Values) -> Lane:
            return Lane(who, iter([(n, values.get(n.name)) for n in nodes]))

        return lane(sg.repeat()), [(s, p, lane(sg.placed(s, p))) for s, p in PLACEMENTS[1:]], False
    x0 = gate.inputs.tensors["hidden_states"]
    others = unrelated(gate.inputs, "hidden_states")

    def batch(size: int, pos: int) -> Lane:
        lane = ex.lane(who, hidden=place(x0, others, size, pos))
        return Lane(lane.name, lane.stream, label=f"batch {size} at {pos}")

    repeat = ex.lane(who)
    repeat.label = "repeat"
    return repeat, [(size, pos, batch(size, pos)) for size, pos in PLACEMENTS[1:]], True


def _invariance(gate: BlockGate, ex: _Executions, store: ValueStore, who: str) -> tuple[dict, dict]:
    """Pass 3 for ``who``: per node (repeat agreement, batch-row record), each against the stored output; the
    unrelated items a batch shares with another placement, against each other (:func:`filler_records`)."""
    mods = gate.inputs.modalities
    repeat, batches, whole = _placed_lanes(gate, ex, who)
    repeats: dict[str, dict] = {}
    placed: list[dict[str, dict]] = [{} for _ in batches]
    fillers: dict[str, list[dict]] = {}
    where = [(size, pos) for size, pos, _ in batches]
    for node in gate.graph.nodes:
        n, rd = node.name, node.row_dim
        bd = 0 if rd is not None else None
        ref = store.get(who, n)
        again = repeat.step()
        repeats[n] = agreement(ref if again is None else again, ref, rd, mods)
        full = [lane.step() for _, _, lane in batches]
        for records, (size, pos, _), value in zip(placed, batches, full, strict=True):
            picked = select(value, bd, pos) if whole and value is not None else value
            records[n] = placement_record(ref if picked is None else picked, ref, size, pos, rd, mods)
        if whole:
            fillers[n] = filler_records(full, where, bd, rd, mods)
        del ref, full
    merged = merge_placements([n.name for n in gate.graph.nodes], placed)
    return repeats, {n: with_fillers(rec, fillers[n]) if n in fillers else rec for n, rec in merged.items()}
