"""What the page shows: sections by kind, per document its key facts, its figures (id, title, how to draw it) and
what its kind does not record. Planning reads documents only; drawing happens when a figure's ``draw`` is called,
so the figure set (ids and titles) is known without matplotlib (the tests' golden of it)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import PurePosixPath
from typing import Any

from h3gate.report import charts, extract, figures, series
from h3gate.report.loader import RUN_PARTS, Document, Inventory

GENERIC_STEMS = {"ablation", "bench-ops", "trajectory", "manifest"}
SECTIONS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("Whole-model gate (ws1-model)", ("ws1-model",), "Every node of every layer, forward and backward, against the "
     "row rule's bound; the first node whose bits differ from the provider is outlined."),
    ("One-block gate (ws1-block)", ("ws1-block",), "The 17 nodes of one block in each view, against the row rule's "
     "bound; the first drift and the first failure are outlined."),
    ("Operators (ws1-ops)", ("ws1-ops",), "Each operator's error against the FP64 golden beside its bound, and its "
     "invariance probes (repeat, batch position, row mutation, prefix) as a pass grid."),
    ("Trajectory comparisons (trajectory-compare)", ("trajectory-compare",), "Two trajectory runs step by step: how "
     "far the velocities and latents of run B are from run A's, per modality, and the first drifting step."),
    ("Trajectories (ws1-trajectory)", ("ws1-trajectory",), "Saved trajectory runs. A run records digests of each "
     "step, not drift: drift per step comes from comparing two runs (h3gate compare)."),
    ("Train / rollout arms (arms)", ("arms",), "The RFC's arms P/P, R/P, P/R, R/R (training operators / rollout "
     "operators; P = diffusers as it is, R = h3gate.strict) on diffusers' own module and scheduler: per denoising "
     "step, how far the training side's velocity is from the rollout's at the same state, per modality, worst over "
     "the requests and the compositions (alone, then two shuffled batch passes); each arm's first drift located node "
     "by node, whether its gradients repeat bitwise, the LoRA gate and its speed."),
    ("Tensor / context parallel ranks (ws2)", ("ws2",), "Each rank of a TP / CP topology against TP1, the one-device "
     "strict path in the seg8 merge order: every value and gradient a rank holds, byte for byte, and the first drift "
     "by rank, node, packed row and modality."),
    ("Ablations (ablation)", ("ablation",), "The RFC section 6 matrix: each row's expected and observed result and "
     "its observed first-drift signature."),
    ("Operator benchmarks (bench)", ("bench",), "Strict kernels timed beside their baseline in one run, against "
     "their declared targets (or the not-slower criterion)."),
    ("Block and model benchmarks", ("bench-ws1-block", "bench-ws1-model"), "The block and the whole model timed "
     "beside the provider."),
)  # fmt: skip


@dataclass
class FigureSpec:
    """One figure: a stable id (its PNG's file name), its title, and how to draw it."""

    id: str
    title: str
    draw: Callable[[], Any]


@dataclass
class Entry:
    """One document (or a group of them) on the page."""

    heading: str
    documents: list[Document]
    facts: list[tuple[str, str]] = field(default_factory=list)
    figures: list[FigureSpec] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    table: tuple[list[str], list[list[str]]] | None = None  # plain-text cells, shown under the figures


@dataclass
class Section:
    heading: str
    intro: str
    entries: list[Entry]


def name_of(d: Document) -> str:
    """A short name for a document: its folder name when the file name is the kind's usual one."""
    rel = PurePosixPath(d.rel)
    parent = rel.parent.name or d.path.parent.name
    return parent if rel.stem == d.kind or rel.stem in GENERIC_STEMS else f"{parent}/{rel.stem}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _layout_text(doc: dict) -> str:
    layout = doc.get("layout")
    if not isinstance(layout, dict):
        return _fmt(layout)
    rows = layout.get("rows")
    parts = ", ".join(f"{k} {v}" for k, v in rows.items()) if isinstance(rows, dict) else _fmt(rows)
    return f"{layout.get('name')} (S = {layout.get('seq_len', '-')}; {parts})"


def _config(doc: dict) -> str:
    config = doc.get("config")
    return str(config.get("name")) if isinstance(config, dict) else _fmt(config)


def _gate_facts(d: Document) -> list[tuple[str, str]]:
    doc = d.doc
    summary = doc.get("summary") or {}
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("layout", _layout_text(doc)),
        ("config / mode / device", f"{_config(doc)} / {doc.get('mode')} / {doc.get('device')}"),
        ("first bitwise drift", extract.describe(doc.get("first_drift"))),
        ("first failure", extract.describe(doc.get("first_row_failure") or doc.get("first_failure"))),
    ]
    if summary.get("worst_ratio") is not None:
        at = summary.get("worst_ratio_at") or {}
        facts.append(("worst error / bound", f"{summary['worst_ratio']:.3f} at {at.get('name')} ({at.get('view')})"))
    if doc.get("injected_fault"):
        facts.append(("injected fault (negative control)", _fmt(doc["injected_fault"])))
    matrix = doc.get("fault_matrix")
    if isinstance(matrix, dict):
        facts.append(("fault matrix", f"{matrix.get('caught')} of {matrix.get('total')} faults caught and located"))
    facts.append(("failing checks", str(len(doc.get("failing_checks") or []))))
    return facts


def _gate_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    name, doc = name_of(d), d.doc
    model = d.kind == "ws1-model"
    entry = Entry(name, [d], _gate_facts(d))
    node_map = extract.model_map(doc) if model else extract.block_map(doc)
    where = "node and layer" if model else f"node and view (layer {doc.get('layer', 0)})"
    title = f"{name}: worst error / bound per {where} - {doc.get('layout', {}).get('name')}, {doc.get('verdict')}"
    entry.figures.append(FigureSpec(ids("node-map"), title, partial(figures.draw_node_map, node_map, title, model)))
    entry.notes += node_map.notes
    _first_drift_figures(entry, name, doc, ids)
    return entry


ROWS_PROFILED = (
    "Every row of {node} ({view} forward) is in the profile figure; other views keep only the rows drawn here."
)


def _first_drift_figures(entry: Entry, name: str, doc: dict, ids: Callable[[str], str]) -> None:
    """The first-drift node's row profile (every row, from ``first_drift_profile``) when the evidence records it,
    then the rows recorded per view (first differing, worst, first over bound); only the latter for older evidence."""
    facts = extract.first_drift_rows(doc)
    if facts is None or not facts.tracks:
        entry.notes.append("No node drifts (candidate bitwise equal to the provider): no first-drift row figure.")
        return
    profile = extract.first_drift_profile(doc)
    subtitle = figures.ROWS_UNPROFILED
    if profile is not None:
        title = (f"{name}: per-row error / bound of the first-drift node {profile.node} ({profile.where}, "
                 f"{profile.view} view), by modality")  # fmt: skip
        entry.figures.append(
            FigureSpec(ids("first-drift-profile"), title, partial(figures.draw_profile, profile, title))
        )
        subtitle = ROWS_PROFILED.format(view=profile.view, node=profile.node)
        entry.notes.append(
            f"The first-drift profile draws every one of the {profile.rows} rows of {profile.node} ({profile.view} "
            "view): its error against the FP64 golden and its row-rule bound, coloured by modality, the first row "
            "whose bits differ from the provider marked. The rows figure after it keeps what the evidence records "
            "for the other views (and the first failing node): first differing, worst and first over-bound rows."
        )
    else:
        entry.notes.append(
            "Per-row errors are not recorded in this evidence (no first_drift_profile, as in evidence from before "
            "the engines kept one: each tensor keeps its first differing, worst and first over-bound rows with their "
            "modality), so the first-drift figure draws those rows, not a full profile."
        )
    title = f"{name}: rows recorded for the first-drift node {facts.node}"
    title += f" and the first failing node {facts.failing}" if facts.failing else ""
    entry.figures.append(FigureSpec(ids("first-drift-rows"), title, partial(figures.draw_rows, facts, title, subtitle)))


def _ops_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    name, doc = name_of(d), d.doc
    layouts = "/".join(str(x.get("name")) for x in doc.get("layouts") or [])
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("config / device", f"{_config(doc)} / {doc.get('device')}"),
        ("layouts", layouts),
        ("operators", str(len(doc.get("operators") or []))),
        ("failures", ", ".join(str(f) for f in doc.get("failures") or []) or "none"),
        ("not run", ", ".join(str(f.get("op", f)) for f in doc.get("not_run") or []) or "none"),
    ]
    entry = Entry(name, [d], facts)
    cases = series.op_errors(doc)
    title = f"{name}: error vs bound per operator (worst layout) - {layouts}"
    entry.figures.append(FigureSpec(ids("error-vs-bound"), title, partial(charts.draw_op_errors, cases, title)))
    grid = series.probe_grid(doc)
    if grid.probes:
        title = f"{name}: invariance probes per operator"
        entry.figures.append(FigureSpec(ids("invariance"), title, partial(charts.draw_probe_grid, grid, title)))
    else:
        entry.notes.append("No invariance probe is recorded for these operators.")
    return entry


def _compare_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    name, doc = name_of(d), d.doc
    drift = series.step_drift(doc)
    first = "bitwise at every step" if drift.first_step is None else f"first drift at step {drift.first_step}"
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("steps compared", _fmt(doc.get("steps_compared"))),
        ("run A", drift.run_a),
        ("run B", drift.run_b),
        ("first drift", first if drift.first_step is None else f"step {drift.first_step}: "
         f"{extract.describe(drift.first_drift)}"),
    ]  # fmt: skip
    entry = Entry(name, [d], facts)
    title = f"{name}: drift per step and modality - {first}"
    entry.figures.append(FigureSpec(ids("drift-per-step"), title, partial(charts.draw_steps, drift, title)))
    return entry


def _arms_facts(d: Document) -> list[tuple[str, str]]:
    doc, run = d.doc, d.doc.get("run") or {}
    layout, config = run.get("layout") or {}, run.get("config") or {}
    training = run.get("training") or {}
    rank = f", rank {training['lora_rank']}" if training.get("lora_rank") is not None else ""
    blocks = f" ({config['num_layers']} blocks)" if isinstance(config, dict) and config.get("num_layers") else ""
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("failing checks", ", ".join(str(c) for c in doc.get("failing_checks") or []) or "none"),
        ("layout / config / device", f"{layout.get('name')} (S = {layout.get('seq_len', '-')}) / {_config(run)}"
         f"{blocks} / {run.get('device')}"),
        ("denoising steps / batch / seed", f"{(run.get('schedule') or {}).get('evaluations')} / {run.get('batch')} / "
         f"{run.get('seed')}"),
        ("training", f"{training.get('mode')}{rank}, {training.get('trainable_tensors')} trainable tensors, gradient "
         f"checkpointing {'on' if training.get('gradient_checkpointing') else 'off'}"),
        ("loss", _fmt(training.get("loss"))),
    ]  # fmt: skip
    if run.get("injected_fault"):
        facts.append(("injected fault (negative control)", _fmt(run["injected_fault"])))
    return facts


def _arms_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    name, doc = name_of(d), d.doc
    arms = series.arm_drifts(doc)
    entry = Entry(name, [d], _arms_facts(d))
    head = ["arm", "byte-equal", "first drift", "gradients repeat", "LoRA gate", "s / rollout step",
            "s / training step"]  # fmt: skip
    entry.table = (head, [[a.arm, {True: "yes", False: "NO"}.get(a.byte_equal, "-"), series.drift_text(a.first_drift),
                           a.gradients, a.lora_gate, _fmt(a.seconds_rollout, 4), _fmt(a.seconds_training, 4)]
                          for a in arms])  # fmt: skip
    mode = ((doc.get("run") or {}).get("training") or {}).get("mode")
    title = f"{name}: training vs rollout velocity drift per step, per arm - {mode} training, {d.verdict}"
    entry.figures.append(FigureSpec(ids("arms-drift"), title, partial(charts.draw_arms, arms, title)))
    entry.notes.append(
        "Drift is the relative L2 of the training side's velocity against the rollout's at the same state; each "
        "point is the worst over the requests and the compositions (alone, batch pass 1, batch pass 2). Steps where "
        "every one is byte-equal lie on the 0 line. Seconds are medians over the steps (host clock)."
    )
    return entry


def _ws2_drift(drift: dict | None) -> str:
    if not drift:
        return "none (byte-equal)"
    return (f"{drift.get('name')} (layer {drift.get('layer')}), rank {drift.get('owner_rank')}, packed row "
            f"{drift.get('logical_row')} ({drift.get('modality')}), {drift.get('rows_differing')} rows")  # fmt: skip


def _ws2_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    """``run ws2``: facts and a per-rank table (no figure: the verdict is bytes, not a curve)."""
    doc = d.doc
    lay, cfg = doc.get("layout") or {}, doc.get("config") or {}
    yes = {True: "yes", False: "NO"}
    facts = [("verdict", _fmt(d.verdict)), ("topology", f"{doc.get('topology')}: {doc.get('world_size')} "
             f"{doc.get('backend')} ranks on {doc.get('device')}, scope {doc.get('scope')}"),
             ("config / layout", f"{cfg.get('name')} / {lay.get('name')} (S = {lay.get('seq_len')})"),
             ("forward byte-equal", yes.get(doc.get("forward_byte_equal"), "-")),
             ("backward byte-equal", yes.get(doc.get("backward_byte_equal"), "-")),
             ("gradients compared", str(doc.get("gradients_compared"))),
             ("first drift", _ws2_drift(doc.get("first_drift"))),
             ("first backward drift", _ws2_drift(doc.get("first_backward_drift")))]  # fmt: skip
    entry = Entry(name_of(d), [d], facts)
    head = ["rank", "device", "heads", "FFN channels", "packed rows", "values checked / differing",
            "gradients checked / differing"]  # fmt: skip
    entry.table = (head, [[str(r.get("rank")), str(r.get("device")), str(r.get("heads")), str(r.get("ffn_channels")),
                           str(r.get("packed_rows", "all")), f"{r.get('values_checked')} / {r.get('values_differing')}",
                           f"{r.get('grads_checked')} / {r.get('grads_differing')}"]
                          for r in doc.get("ranks") or []])  # fmt: skip
    return entry


def _trajectory_entry(d: Document, parts: list[Document]) -> Entry:
    doc, run = d.doc, d.doc.get("run") or {}
    inv = doc.get("invocation") or {}
    counts = {k: sum(1 for p in parts if p.kind == k) for k in RUN_PARTS}
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("layout / config / mode", f"{(run.get('layout') or {}).get('name')} / {_config(run)} / {run.get('mode')}"),
        ("evaluations / saved / complete", f"{doc.get('evaluations')} / {doc.get('steps_saved')} / "
         f"{doc.get('complete')}"),
        ("seconds per step (last invocation)", _fmt(inv.get("seconds_per_step"))),
        ("records in the run folder", f"{counts['trajectory-step']} step, {counts['trajectory-manifest']} manifest"),
    ]  # fmt: skip
    note = "A single trajectory records per-step digests, not drift: no drift figure. Compare two runs with "
    note += "`h3gate compare RUN_A RUN_B` (trajectory-compare evidence) to see drift per step."
    return Entry(name_of(d), [d, *parts], facts, notes=[note])


def _ablation_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    name, doc = name_of(d), d.doc
    rows = series.ablation_rows(doc)
    summary = doc.get("summary") or {}
    passed = f"{summary.get('passed')} of {summary.get('requested')} rows as expected"
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("layout / config / device", f"{_fmt(doc.get('layout'))} / {_config(doc)} / {doc.get('device')}"),
        ("rows", passed),
    ]
    entry = Entry(name, [d], facts)
    head = ["row", "factor", "run", "expected", "observed", "expected signature", "observed signature", "verdict"]
    entry.table = (head, [[r.id, r.factor, r.run, r.expected, r.observed, r.expected_signature,
                           r.observed_signature if r.observed_signature != "-" else (r.reason or "-"), r.verdict]
                          for r in rows])  # fmt: skip
    title = f"{name}: ablation matrix, expected vs observed - {passed}"
    entry.figures.append(FigureSpec(ids("matrix"), title, partial(charts.draw_ablation, rows, title)))
    return entry


def _bench_entry(d: Document, ids: Callable[[str], str]) -> Entry:
    name, doc = name_of(d), d.doc
    bars = series.op_speeds(doc)
    layout = doc.get("layout") or {}
    facts = [
        ("verdict", _fmt(d.verdict)),
        ("layout", f"{layout.get('name')} ({layout.get('rows')} rows), config {_config(doc)}"),
        ("copy bandwidth", f"{_fmt(doc.get('copy_bandwidth_gbs'), 4)} GB/s"),
    ]
    entry = Entry(name, [d], facts)
    title = f"{name}: strict / baseline speed per operator - {layout.get('name')}, {d.verdict}"
    entry.figures.append(FigureSpec(ids("speed"), title, partial(charts.draw_op_speeds, bars, title)))
    return entry


def _gate_bench_entry(docs: list[Document], ids: Callable[[str], str]) -> Entry:
    groups = [series.gate_speeds(d.doc, f"{name_of(d)}") for d in docs]
    facts = []
    for d in docs:
        res = d.doc.get("results") or {}
        text = "; ".join(
            f"{phase}: strict {_fmt((r.get('strict') or {}).get('median_ms'), 4)} ms, provider "
            f"{_fmt((r.get('provider') or {}).get('median_ms'), 4)} ms"
            for phase, r in res.items()
            if isinstance(r, dict)
        )
        facts.append((name_of(d), text))
    entry = Entry("block and model benchmarks", docs, facts)
    entry.notes.append("These records carry no speed target: the figure shows the ratio to the provider only.")
    title = "block and model benchmarks: strict / provider speed, forward and forward + backward"
    entry.figures.append(FigureSpec(ids("speed"), title, partial(charts.draw_gate_speeds, groups, title)))
    for d in docs:
        steady = series.sustained_text(d.doc)
        if steady is not None:
            entry.facts.append((f"{name_of(d)}: the forward at the power cap", steady))
        times = series.node_times(d.doc, name_of(d))
        if times is None:
            continue
        label = f"{name_of(d)}: where the forward's time goes, node by node"
        entry.facts.append(
            (label, f"sum of the nodes: strict {times.strict_sum:.3f} ms, provider {times.provider_sum:.3f} ms")
        )
        entry.figures.append(
            FigureSpec(ids(f"nodes-{slug(name_of(d))}"), label, partial(charts.draw_node_times, times, label))
        )
    return entry


def _id_maker(used: set[str], base: str) -> Callable[[str], str]:
    def make(suffix: str) -> str:
        candidate, n = f"{base}.{suffix}", 2
        while candidate in used:
            candidate, n = f"{base}.{suffix}-{n}", n + 1
        used.add(candidate)
        return candidate

    return make


def _entries(inv: Inventory, kinds: tuple[str, ...], used: set[str]) -> list[Entry]:
    docs = inv.of_kind(*kinds)
    if not docs:
        return []

    def ids(d: Document) -> Callable[[str], str]:
        name = name_of(d)
        return _id_maker(used, slug(name if name == d.label else f"{d.label}/{name}"))

    if kinds[0] == "bench-ws1-block":
        return [_gate_bench_entry(docs, _id_maker(used, "benchmarks-block-model"))]
    if kinds[0] == "ws1-trajectory":
        parts = inv.of_kind(*RUN_PARTS)
        return [_trajectory_entry(d, [p for p in parts if p.path.parent.resolve() in _run_dirs(d)]) for d in docs]
    build = {"ws1-model": _gate_entry, "ws1-block": _gate_entry, "ws1-ops": _ops_entry, "ablation": _ablation_entry,
             "trajectory-compare": _compare_entry, "arms": _arms_entry, "bench": _bench_entry,
             "ws2": _ws2_entry}[kinds[0]]  # fmt: skip
    return [build(d, ids(d)) for d in docs]


def _run_dirs(d: Document) -> set:
    folder = d.path.parent.resolve()
    return {folder, folder / "steps"}


def plan(inv: Inventory) -> tuple[list[Section], list[Entry]]:
    """The sections of the page in a fixed order, and the documents no section draws (listed, with why)."""
    used: set[str] = set()
    sections = []
    for heading, kinds, intro in SECTIONS:
        entries = _entries(inv, kinds, used)
        if entries:
            sections.append(Section(heading, intro, entries))
    drawn = {id(d) for s in sections for e in s.entries for d in e.documents}
    others = [
        Entry(name_of(d), [d], [("kind", d.kind), ("verdict", _fmt(d.verdict))], notes=[_no_figure(d.kind)])
        for d in inv.documents
        if id(d) not in drawn
    ]
    return sections, others


def _no_figure(kind: str) -> str:
    if kind in RUN_PARTS:
        return "Part of a trajectory run folder without its ws1-trajectory record: listed only."
    return f"No figure for kind {kind}: it records digests and settings, which the provenance table lists."


def figure_set(sections: list[Section]) -> list[dict[str, str]]:
    """``[{"id", "title"}]`` of every planned figure, in page order (the golden the tests keep)."""
    return [{"id": f.id, "title": f.title} for s in sections for e in s.entries for f in e.figures]
