"""The whole-model gate streamed over ranges of blocks (:mod:`h3gate.runs.ws1_model`, run in three phases).

A range ``A:B`` is transformer blocks ``A .. B-1``; the range from 0 also carries the stages before the blocks
(embeddings, refiner, packing, time), the range to ``num_layers`` the stages after them (final AdaLN, heads). A
boundary sits before each range but the first, and one after the last stage (``end``).

Phase 1 (:func:`phase1`) runs every lane of the gate (:func:`~h3gate.runs.ws1_model.make_lanes`: the FP64
golden, the provider under every variant, the candidate, its repeat, its batch placements) once through the model
without judging and stores, at every boundary, each lane's live values (what later stages read:
:func:`h3gate.graph.stages.last_readers`) and, going back, each saving lane's incoming gradients (what
:func:`h3gate.runs.model_backward.backward` holds in ``incoming`` there). Its backward recomputes one range at a
time from the range's stored forward boundary, in segments of :data:`SEGMENT` stages whose starting values a first
pass keeps in host memory (checkpointing), so the device holds one segment's stage inputs per saving lane, never
the range's or the model's. Under torch's launcher phase 1 is split by lane (:class:`Share`): each rank runs its
lanes and writes their files; rank 0 joins each boundary's sidecar, which names every lane's seconds.

Phase 2 (:func:`run_range`) gates one range on its own: the gate's own ``forward`` / ``backward`` over the range's
stages, every lane started from the stored boundary; its node and gradient records are those an unsharded run
makes. At the range's end every lane's recomputed values must equal the stored boundary's bytes (the cross-phase
check: a candidate lane's mismatch fails the gate naming lane and tensor; golden and provider ones are reported).
Phase 3 is :mod:`h3gate.runs.model_merge`. Each phase resumes from its last finished unit.

Disk (:func:`boundary_bytes`), per boundary, lanes ``l`` with batch ``m_l`` (1, or the placement's size) and
element size ``e_l`` (hidden states: 2 bytes bf16, 8 for the FP64 golden; FP32 values: 4, golden 8)::

    forward_l  = m_l S H e_l + T H f_l + S (2 D f_l + 6 x 8)      hidden state + time embedding + metadata
    backward_l = m_l S H e_l + T H f_l                           (saving lanes only)

At 768p (S = 38974, H = 5376, D = 128) a bf16 lane's hidden state is 0.42 GB (FP64 golden 1.68 GB).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gate.gate.compare import bits, bitwise_equal
from h3gate.graph import determinism
from h3gate.graph.core import to_float64
from h3gate.graph.stages import Keep, Stage, accumulate, last_readers
from h3gate.manifests.model_config import ModelConfig
from h3gate.memory import device_peak_record
from h3gate.runs import stream_files as files
from h3gate.runs.block_rows import RowContext
from h3gate.runs.model_backward import backward, lane_vjp, model_incoming
from h3gate.runs.model_clock import Clock, device_sync, synced_now, totals
from h3gate.runs.model_forward import Findings, forward
from h3gate.runs.ws1_model import ModelGate, first_profile, lane_records, make_lanes, new_recorder

Span = tuple[int, int]
SEGMENT = 6  # stages phase 1's backward recomputes and holds at once (a longer range: host checkpoints between)
INPUTS_ONLY = Keep(forward=False, nodes=False)  # phase 1 hands on the stage inputs' gradients, nothing else


@dataclass(frozen=True)
class StreamPlan:
    """Ranges of blocks, their stage spans (indices into the model's stages) and the boundaries between them."""

    ranges: list[tuple[int, int]]
    spans: list[Span]

    @property
    def boundaries(self) -> list[int | None]:
        """Boundary ``j`` sits before range ``j`` (``j >= 1``); the last, ``None``, after the last stage."""
        return [a for a, _ in self.ranges[1:]] + [None]

    def index(self, a: int, b: int) -> int:
        return self.ranges.index((a, b))


def build_plan(stages: list[Stage], ranges: list[tuple[int, int]]) -> StreamPlan:
    """The stage spans of ``ranges`` (contiguous, covering the model's blocks, checked by the caller)."""
    labels = [s.label for s in stages]
    spans = []
    for i, (a, _) in enumerate(ranges):
        start = 0 if i == 0 else labels.index(f"block.{a}")
        end = len(stages) if i == len(ranges) - 1 else labels.index(f"block.{ranges[i + 1][0]}")
        spans.append((start, end))
    return StreamPlan(list(ranges), spans)


def boundary_bytes(cfg: ModelConfig, seq_len: int, timesteps: int, lanes: list[dict]) -> int:
    """Bytes of one stored boundary (module docstring), ``lanes`` as the report's lane records."""
    total = 0
    for lane in lanes:
        golden = lane["kind"] == "golden"
        e, f = (8, 8) if golden else (2, 4)
        m = 1 if lane["batch"] is None else lane["batch"][0]
        grads = m * seq_len * cfg.hidden_size * e + timesteps * cfg.hidden_size * f
        total += grads + seq_len * (2 * cfg.attention_head_dim * f + 6 * 8)
        if lane["saved_for_backward"]:
            total += grads
    return total


def _load_forward(gate: ModelGate, rundir: Path, block: int | None, lanes: list) -> None:
    """Every lane's values (and refusal) from a stored forward boundary."""
    values, refused = files.read_boundary(rundir, block, "forward", gate.device, [lane.name for lane in lanes])
    for lane in lanes:
        lane.values = dict(values[lane.name])
        lane.refused = refused.get(lane.name)


def _store(rundir: Path, block: int | None, direction: str, tensors: dict, refused: dict, spent: dict,
           share: Share, order: list[str]) -> None:  # fmt: skip
    """A boundary's lanes: written by this process alone, or by every rank its own lanes, then joined by rank 0 in
    the lanes' ``order`` (between two barriers, so that every rank sees the boundary stored before it goes on)."""
    seconds = {k: round(v, 4) for k, v in spent.items()}
    if share.world == 1:
        files.write_boundary(rundir, block, direction, tensors, refused, seconds)
        return
    files.write_boundary_part(rundir, block, direction, tensors, refused, seconds, share.rank)
    share.barrier()
    if share.rank == 0:
        files.join_boundary(rundir, block, direction, share.world, order)
    share.barrier()


def _advance(gate: ModelGate, lanes: list, span: Span, last: dict[str, int], spent: dict | None = None) -> None:
    """The lanes through stages ``span`` without judging (saving stage inputs where ``lane.save``); with ``spent``,
    each lane's seconds are added to it."""
    sync = device_sync(gate.device)
    for i in range(*span):
        stage = gate.stages[i]
        params = gate.weights.load(stage)
        gparams = to_float64(params)
        for lane in lanes:
            t0 = synced_now(sync) if spent is not None else 0.0
            lane.run(stage, lane.params(params, gparams))
            if spent is not None:
                spent[lane.name] = spent.get(lane.name, 0.0) + synced_now(sync) - t0
        done = [name for name, reader in last.items() if reader == i]
        for lane in lanes:
            lane.release(done)
        del params, gparams


@dataclass(frozen=True)
class Share:
    """This process's part of phase 1 under torch's launcher. Phase 1 judges nothing, so every lane's chain is
    independent of the others': each rank runs the lanes :func:`lane_ranks` gives it, writes their files of every
    boundary, and rank 0 joins the sidecars (:func:`h3gate.runs.stream_files.join_boundary`) in the lanes' order.
    The bytes of every file are those one process writes."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None)


# the FP64 golden's phase-1 work against a bf16 lane's, for the split: measured on an H100 at medium, the golden's
# lane took 7.2 s of phase 1's 15.3 lane-seconds, each other lane 0.3-1.6 s (docs/measurements/h100/phase1-split-*)
GOLDEN_WEIGHT = 6


def lane_weight(lane) -> int:
    """A lane's declared phase-1 cost: its batch size, times :data:`GOLDEN_WEIGHT` for the golden."""
    return (1 if lane.batch is None else lane.batch[0]) * (GOLDEN_WEIGHT if lane.golden else 1)


def lane_ranks(lanes: list, world: int) -> dict[str, int]:
    """Each lane's rank in phase 1: heaviest first (:func:`lane_weight`; equal weights in lane order) onto the least
    loaded rank (equal loads: the lowest rank). A function of the lanes and ``world`` alone."""
    load = [0] * world
    out: dict[str, int] = {}
    for lane in sorted(lanes, key=lambda x: -lane_weight(x)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[lane.name] = r
        load[r] += lane_weight(lane)
    return out


def phase1(gate: ModelGate, ctx: RowContext, rundir: Path, plan: StreamPlan, progress=None,
           share: Share | None = None) -> dict:  # fmt: skip
    """Store every boundary (module docstring), continuing after the last stored one, this rank's lanes
    (``share``); wall seconds per direction."""
    share = share or Share()
    step = progress or (lambda label: None)
    every = make_lanes(gate, ctx).all()
    order = [lane.name for lane in every]
    mine = lane_ranks(every, share.world)
    lanes = [lane for lane in every if mine[lane.name] == share.rank]
    saving = [lane for lane in lanes if lane.save]
    last = last_readers(gate.stages)
    blocks = plan.boundaries
    seconds = {"forward_s": 0.0, "backward_s": 0.0}
    t0 = time.perf_counter()
    done = [j for j, b in enumerate(blocks) if files.stored(rundir, b, "forward")]
    first = len(done)
    if done != list(range(first)):
        raise ValueError(f"{rundir}: forward boundaries stored out of order ({done})")
    for lane in lanes:
        lane.save = False
    if 0 < first < len(plan.ranges):
        _load_forward(gate, rundir, blocks[first - 1], lanes)
    for r in range(first, len(plan.ranges)):
        step(f"phase 1 forward: blocks {plan.ranges[r][0]}:{plan.ranges[r][1]}")
        spent: dict[str, float] = {}
        _advance(gate, lanes, plan.spans[r], last, spent)
        _store(rundir, blocks[r], "forward", {lane.name: lane.values for lane in lanes},
               {lane.name: lane.refused for lane in lanes}, spent, share, order)  # fmt: skip
    seconds["forward_s"] = time.perf_counter() - t0
    if gate.backward:
        t0 = time.perf_counter()
        _phase1_backward(gate, rundir, plan, saving, last, step, share, order)
        seconds["backward_s"] = time.perf_counter() - t0
    return {k: round(v, 4) for k, v in seconds.items()}


def _phase1_backward(gate: ModelGate, rundir: Path, plan: StreamPlan, saving: list, last, step, share: Share,
                     order: list[str]) -> None:  # fmt: skip
    """Each saving lane's incoming gradients at every boundary between ranges, last range first."""
    blocks = plan.boundaries
    if len(blocks) == 1:  # one range: phase 2 starts its backward from the model's cotangents
        return
    names = [lane.name for lane in saving]
    stored = [j for j in range(len(blocks) - 1) if files.stored(rundir, blocks[j], "backward")]
    if stored:
        j = min(stored)
        if j == 0:
            return
        grads, refused = files.read_boundary(rundir, blocks[j], "backward", gate.device, names)
        incoming = {lane.name: dict(grads[lane.name]) for lane in saving}
        start = j  # range j's backward is stored at boundary j - 1
    else:
        _load_forward(gate, rundir, None, saving)
        incoming = model_incoming(gate.seed, saving)
        refused = {lane.name: lane.refused for lane in saving}
        start = len(plan.ranges) - 1
    for r in range(start, 0, -1):
        step(f"phase 1 backward: blocks {plan.ranges[r][0]}:{plan.ranges[r][1]}")
        spent: dict[str, float] = {}
        _load_forward(gate, rundir, blocks[r - 1], saving)  # recompute the range from its stored start
        for lane in saving:
            lane.save = False
            lane.refused = lane.refused or refused.get(lane.name)
        segments = [(i, min(i + SEGMENT, plan.spans[r][1])) for i in range(*plan.spans[r], SEGMENT)]
        marks = []
        for seg in segments:  # each segment's start kept in host memory; the last one's stays in the lanes
            marks.append({lane.name: {k: v.to("cpu") for k, v in lane.values.items()} for lane in saving})
            if seg != segments[-1]:
                _advance(gate, saving, seg, last, spent)
        for seg, mark in reversed(list(zip(segments, marks, strict=True))):
            for lane in saving:
                lane.values = {k: v.to(gate.device) for k, v in mark[lane.name].items()}
                lane.save, lane.saved = True, {}
            _advance(gate, saving, seg, last, spent)
            _vjps(gate, saving, seg, incoming, spent)
        refused = {lane.name: lane.refused for lane in saving}
        _store(rundir, blocks[r - 1], "backward", incoming, refused, spent, share, order)


def _vjps(gate: ModelGate, saving: list, span: Span, incoming: dict, spent: dict) -> None:
    """Every saving lane's stage backward over ``span``, last stage first, summing into ``incoming``; each lane's
    seconds added to ``spent``."""
    sync = device_sync(gate.device)
    for stage in reversed(gate.stages[slice(*span)]):
        params = gate.weights.load(stage)
        gparams = to_float64(params)
        for lane in saving:
            t0 = synced_now(sync)
            overrides = gate.node_overrides if lane.kind == "candidate" else None
            got = lane_vjp(lane, stage, lane.params(params, gparams), incoming[lane.name], overrides, INPUTS_ONLY)
            if got is not None:
                accumulate(incoming[lane.name], got.inputs)
            for k in stage.outputs:
                incoming[lane.name].pop(k, None)
            lane.saved.pop(stage.label, None)
            del got
            spent[lane.name] = spent.get(lane.name, 0.0) + synced_now(sync) - t0
        del params, gparams


def _boundary_check(gate: ModelGate, rundir: Path, lanes: list, block: int | None, where: dict, findings) -> list:
    """Every lane's values at the range's end vs the stored boundary, bitwise (module docstring)."""
    stored_values, _ = files.read_boundary(rundir, block, "forward", gate.device, [lane.name for lane in lanes])
    out = []
    for lane in lanes:
        saved = stored_values[lane.name]
        for name in sorted(set(saved) | set(lane.values)):
            got, want = lane.values.get(name), saved.get(name)
            if got is not None and want is not None and bitwise_equal(got, want):
                continue
            rec = {"lane": lane.name, "kind": lane.kind, "tensor": name, "row": _first_row(got, want),
                   "fails": lane.kind == "candidate"}  # fmt: skip
            out.append(rec)
            if rec["fails"]:
                row = "" if rec["row"] is None else f", row {rec['row']}"
                detail = f"{lane.name}: {name} recomputed differs from phase 1's stored boundary{row}"
                findings.failing.append(f"stream.boundary.{lane.name}.{name}.bitwise ({detail})")
                if findings.first_failure is None:
                    findings.first_failure = {**where, "node": name, "row": rec["row"], "modality": None,
                                              "check": "stream_boundary_bitwise", "detail": detail}  # fmt: skip
    return out


def _first_row(got: torch.Tensor | None, want: torch.Tensor | None) -> int | None:
    """The first differing row (dim 1 of a batched value, dim 0 of a table) of two same-shaped tensors."""
    if got is None or want is None or got.shape != want.shape or got.dtype != want.dtype or got.dim() == 0:
        return None
    dim = 1 if got.dim() > 2 else 0
    diff = (bits(got) != bits(want.to(got.device))).movedim(dim, 0).reshape(got.shape[dim], -1).any(dim=1)
    hit = diff.nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def _findings(f: Findings) -> dict:
    return {"failing": f.failing, "first_failure": f.first_failure, "first_row_failure": f.first_row_failure,
            "drift": f.drift}  # fmt: skip


def _det(recorder: determinism.Recorder, since: dict | None = None) -> dict:
    """The recorder's counts and mismatches (since a previous snapshot), from its record."""
    record = recorder.record()
    now = {k: record[k] for k in ("evaluations", "keys", "pairs")} | {"mismatches": list(record["mismatches"])}
    if since is None:
        return now
    return {
        "evaluations": now["evaluations"] - since["evaluations"],
        "keys": now["keys"] - since["keys"],
        "pairs": {k: v - since["pairs"].get(k, 0) for k, v in now["pairs"].items()},
        "mismatches": now["mismatches"][len(since["mismatches"]) :],
    }


def run_range(gate: ModelGate, ctx: RowContext, rundir: Path, plan: StreamPlan, r: int) -> dict:
    """Phase 2 of range ``r``: its partial report (module docstring)."""
    started = time.perf_counter()
    span, blocks = plan.spans[r], plan.boundaries
    lanes = make_lanes(gate, ctx)
    if r > 0:
        _load_forward(gate, rundir, blocks[r - 1], lanes.all())
    base_rule = ctx.record()
    gate.clock = Clock(running=True, sync=device_sync(gate.device))
    recorder = new_recorder(gate)
    fwd, bwd = Findings(), Findings()
    bw, incoming = None, None
    with determinism.recording(recorder):
        nodes, stage_records = forward(gate, ctx, lanes, fwd, span)
        det_fwd = _det(recorder)
        last = gate.stages[span[1] - 1]
        where = {"direction": "forward", "stage": last.label, "layer": last.layer}
        checked = _boundary_check(gate, rundir, lanes.all(), blocks[r], where, fwd)
        forward_s = time.perf_counter() - started
        refused_forward = {lane.name: lane.refused for lane in lanes.all()}
        if gate.backward:
            if r < len(plan.ranges) - 1:
                saving = [lane.name for lane in lanes.all() if lane.save]
                grads, refused = files.read_boundary(rundir, blocks[r], "backward", gate.device, saving)
                incoming = {k: dict(v) for k, v in grads.items()}
                for lane in lanes.all():
                    lane.refused = lane.refused or refused.get(lane.name)
            bw = backward(gate, ctx, lanes, bwd, span, incoming)
    a, b = plan.ranges[r]
    return {
        "range": [a, b],
        "stages": [s.label for s in gate.stages[slice(*span)]],
        "nodes": nodes,
        "stage_records": stage_records,
        "backward": bw,
        "findings": {"forward": _findings(fwd), "backward": _findings(bwd)},
        "determinism": {"forward": det_fwd, "backward": _det(recorder, det_fwd)},
        "lanes": lane_records(lanes),
        "refused": {"forward": refused_forward, "backward": {lane.name: lane.refused for lane in lanes.all()}},
        "row_rule": base_rule,
        "first_drift_profile": first_profile(ctx, fwd.drift.get("forward_chained")),
        "boundary_check": {"boundary": files.boundary_name(blocks[r]), "mismatches": checked},
        "timing": {
            "forward_s": round(forward_s, 4),
            "backward_s": round(time.perf_counter() - started - forward_s, 4),
            "total_s": round(time.perf_counter() - started, 4),
            "blocks": b - a,
            **device_peak_record(gate.device),
            "held": "host" if gate.hold_on_host else "device",
            "parts": totals(gate.clock.stages),
            "stages": gate.clock.stages,
        },
    }
