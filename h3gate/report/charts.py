"""Step, arms, operator, ablation and benchmark figures (the maps and row figures are in ``figures``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from h3gate.report.figures import MODALITY_COLOURS, new_figure
from h3gate.report.series import (
    OPERATORS,
    AblationRow,
    ArmDrift,
    GateSpeeds,
    NodeTimes,
    OpError,
    ProbeGrid,
    SpeedBar,
    StepDrift,
    drift_text,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PASS_COLOUR = "#1a9850"
FAIL_COLOUR = "#d7191c"
NONE_COLOUR = "#e6e6e6"
MODALITY_MARKERS = {"text": "^", "video": "o", "audio": "s"}
RESULT_COLOURS = {"PASS": "#a6dba0", "EXPECTED_DRIFT": "#fdb863", "REJECTED": "#b2abd2", "NA": "#d9d9d9"}


def _floor(values: list[float]) -> float:
    """A decade below the smallest positive value (where exact zeros are drawn on a log axis)."""
    positive = [v for v in values if v > 0]
    return 10 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-9


def draw_steps(drift: StepDrift, title: str) -> Figure:
    """trajectory-compare: rel L2 of run B against run A per step and modality (log), zeros on a 'bitwise' line."""
    fig = new_figure(11.0, 5.2, title)
    ax = fig.subplots()
    values = [v for s in drift.series.values() for v in s if v is not None]
    floor = _floor(values)
    for name, series in drift.series.items():
        modality, what = name.split("_")
        style = {"color": MODALITY_COLOURS[modality], "linestyle": "-" if what == "velocity" else "--"}
        xs = [s for s, v in zip(drift.steps, series, strict=True) if v is not None and v > 0]
        ys = [v for v in series if v is not None and v > 0]
        ax.plot(xs, ys, marker="o" if what == "velocity" else "s", markersize=3, label=f"{modality} {what}", **style)
        zeros = [s for s, v in zip(drift.steps, series, strict=True) if v == 0]
        ax.scatter(zeros, [floor] * len(zeros), marker="|", s=60, color=style["color"])
    ax.axhline(floor, color="#999999", linewidth=0.8, linestyle=":")
    ax.text(0.005, floor, " bitwise equal (0)", transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
    if not any(v > 0 for v in values):
        ax.set_ylim(floor / 10, 1.0)
    ax.set_yscale("log")
    ax.set_xlabel("denoising step (model evaluation)")
    ax.set_ylabel("relative L2 drift, run B vs run A")
    if not any(v > 0 for v in values):
        ax.text(0.5, 0.6, f"bitwise equal at every one of {len(drift.steps)} steps", transform=ax.transAxes,
                ha="center", fontsize=13, color=PASS_COLOUR)  # fmt: skip
    if drift.first_step is not None:
        ax.axvline(drift.first_step, color=FAIL_COLOUR, linestyle="--", linewidth=1.5, label="first drifting step")
        where = drift.first_drift or {}
        text = f"first drift: step {drift.first_step}, node {where.get('node')}"
        text += f", row {where['row']}" if where.get("row") is not None else ""
        text += f" ({where['modality']})" if where.get("modality") else ""
        ax.annotate(text, (drift.first_step, 0.45), xycoords=("data", "axes fraction"), xytext=(8, 0),
                    textcoords="offset points", va="center", fontsize=9, color=FAIL_COLOUR,
                    bbox={"facecolor": "white", "edgecolor": FAIL_COLOUR, "alpha": 0.9})  # fmt: skip
    ax.set_title(f"run A: {drift.run_a}   |   run B: {drift.run_b}", fontsize=9, loc="left")
    ax.legend(loc="lower right" if any(v > 0 for v in values) else "upper right", fontsize=8, ncols=3)
    ax.grid(True, which="major", alpha=0.3)
    return fig


def _arm_first_drift(ax: Axes, arm: ArmDrift) -> None:
    """The arm's first drifting step as a dashed line, named (step, composition, node, packed row, modality)."""
    step = arm.first_step
    ax.axvline(step, color=FAIL_COLOUR, linestyle="--", linewidth=1.5, zorder=1)
    right = not arm.steps or step <= (min(arm.steps) + max(arm.steps)) / 2
    text = "first drift at " + drift_text(arm.first_drift or {"step": step}).replace(": ", ":\n", 1)
    ax.annotate(text, (step, 0.42), xycoords=("data", "axes fraction"), xytext=(8 if right else -8, 0),
                textcoords="offset points", va="center", ha="left" if right else "right", fontsize=8.5,
                color=FAIL_COLOUR, bbox={"facecolor": "white", "edgecolor": FAIL_COLOUR, "alpha": 0.9})  # fmt: skip


def _arm_panel(ax: Axes, arm: ArmDrift, floor: float) -> None:
    """One arm: its worst drift per step and modality (log), byte-equal steps on the 0 line, its first drift."""
    count = len(arm.series)
    for i, (modality, values) in enumerate(arm.series.items()):
        colour = MODALITY_COLOURS.get(modality, "#555555")
        cells = list(zip(arm.steps, values, arm.differs[modality], strict=True))
        shift = (i - (count - 1) / 2) * 0.12  # modalities side by side on the 0 line (and at a lone step)
        lone = shift if len(arm.steps) == 1 else 0.0
        xs = [s + lone for s, v, _ in cells if v is not None and v > 0]
        ys = [v for _, v, _ in cells if v is not None and v > 0]
        marker = MODALITY_MARKERS.get(modality, "o")
        ax.plot(xs, ys, color=colour, marker=marker, markersize=4 if len(xs) > 1 else 7, linewidth=1.5, zorder=3)
        equal = [s + shift for s, v, d in cells if not d and v == 0]
        ax.scatter(equal, [floor] * len(equal), marker="|", s=90, color=colour, linewidths=2, zorder=3)
        unsized = [s + shift for s, v, d in cells if d and not v]
        ax.scatter(unsized, [floor] * len(unsized), marker="x", s=50, color=FAIL_COLOUR, zorder=3)
    ax.axhline(floor, color="#999999", linewidth=0.8, linestyle=":")
    ax.annotate("byte-equal (0)", (0.0, floor), xycoords=ax.get_yaxis_transform(), xytext=(3, 6),
                textcoords="offset points", va="bottom", fontsize=8)  # fmt: skip
    if arm.first_step is None and arm.byte_equal:
        ax.text(0.5, 0.6, f"byte-equal at every one of {len(arm.steps)} steps", transform=ax.transAxes,
                ha="center", fontsize=12, color=PASS_COLOUR)  # fmt: skip
    if arm.first_step is not None:
        _arm_first_drift(ax, arm)
    train, roll = OPERATORS.get(arm.training, "?"), OPERATORS.get(arm.rollout, "?")
    ax.set_title(f"{arm.arm}: training {arm.training} ({train}), rollout {arm.rollout} ({roll})", fontsize=10,
                 loc="left")  # fmt: skip
    ax.grid(True, which="major", alpha=0.3)


def _arms_legend(fig: Figure, arms: list[ArmDrift]) -> None:
    from matplotlib.lines import Line2D

    modalities = dict.fromkeys(m for a in arms for m in a.series)
    handles = [
        Line2D([], [], color=MODALITY_COLOURS.get(m, "#555555"), marker=MODALITY_MARKERS.get(m, "o"), markersize=4,
               label=f"{m} velocity (worst over requests and compositions)")
        for m in modalities
    ]  # fmt: skip
    handles += [
        Line2D([], [], color="#777777", marker="|", linestyle="", markersize=10, markeredgewidth=2,
               label="byte-equal at that step (every request and composition), on the 0 line"),
        Line2D([], [], color=FAIL_COLOUR, linestyle="--", linewidth=1.5, label="first drift, located node by node"),
    ]  # fmt: skip
    if any(d and not v for a in arms for m in a.series for v, d in zip(a.series[m], a.differs[m], strict=True)):
        handles.append(Line2D([], [], color=FAIL_COLOUR, marker="x", linestyle="",
                              label="bits differ, rel L2 0 or not recorded"))  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8.5, frameon=False)


def _zero_axis(ax: Axes, floor: float, top: float) -> None:
    """A log y axis from below ``floor`` to ``top`` whose tick at ``floor`` (the byte-equal line) reads 0."""
    from matplotlib.ticker import FuncFormatter, LogFormatterSciNotation

    ax.set_yscale("log")
    ax.set_ylim(floor / 2.5, top)
    base = LogFormatterSciNotation()
    base.set_axis(ax.yaxis)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, pos: "0" if math.isclose(y, floor) else base(y, pos)))


def draw_arms(arms: list[ArmDrift], title: str) -> Figure:
    """arms: per arm, the training side's velocity against the rollout's per denoising step and modality (rel L2,
    worst over requests and compositions; log), byte-equal steps on a '0' line, the first drift named."""
    cols = 1 if len(arms) <= 1 else 2
    rows = max(1, math.ceil(len(arms) / cols))
    fig = new_figure(11.0 if cols == 1 else 13.0, 1.9 + 3.1 * rows, title)
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    values = [v for a in arms for s in a.series.values() for v in s if v is not None]
    floor = _floor(values)
    flat = [ax for row in axes for ax in row]
    for ax, arm in zip(flat, arms, strict=False):
        _arm_panel(ax, arm, floor)
    for ax in flat[len(arms) :]:
        ax.set_visible(False)
    steps = sorted({s for a in arms for s in a.steps}) or [0]
    _zero_axis(flat[0], floor, max([v for v in values if v > 0], default=0.1) * 3)
    flat[0].set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    flat[0].set_xticks(steps)
    for ax in axes[-1]:
        ax.set_xlabel("denoising step (model evaluation)")
    fig.supylabel("relative L2 drift, training velocity vs the rollout's", fontsize=10)
    _arms_legend(fig, arms)
    return fig


def _positive(value: float | None, floor: float) -> float | None:
    if value is None:
        return None
    return max(value, floor)


def draw_op_errors(cases: list[OpError], title: str) -> Figure:
    """ws1-ops: each operator's worst case, the kernel's and the provider's error against the golden, and the bound."""
    fig = new_figure(11.0, 1.6 + 0.26 * max(1, len(cases)), title)
    ax = fig.subplots()
    floor = _floor([v for c in cases for v in (c.kernel, c.provider, c.bound) if v is not None])
    for y, c in enumerate(cases):
        ok = c.kernel is not None and c.bound is not None and c.kernel <= c.bound
        if c.bound is not None:
            ax.scatter(c.bound, y, marker="|", s=260, color="black", linewidths=2, zorder=2)
        if c.provider is not None:
            ax.scatter(_positive(c.provider, floor), y, marker="D", s=40, facecolors="none", edgecolors="#444444")
        if c.kernel is not None:
            ax.scatter(_positive(c.kernel, floor), y, marker="o", s=45, color=PASS_COLOUR if ok else FAIL_COLOUR)
    ax.set_xscale("log")
    ax.set_yticks(range(len(cases)), labels=[f"{c.op} {c.direction} [{c.layout}]" for c in cases], fontsize=8)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.set_xlabel(f"relative L2 error against the FP64 golden (log; exact 0 drawn at {floor:.0e})")
    ax.grid(True, axis="x", which="major", alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], marker="o", linestyle="", color=PASS_COLOUR, label="strict kernel, within bound"),
        Line2D([], [], marker="o", linestyle="", color=FAIL_COLOUR, label="strict kernel, over bound"),
        Line2D([], [], marker="D", linestyle="", markerfacecolor="none", color="#444444", label="provider"),
        Line2D([], [], marker="|", linestyle="", color="black", markersize=12, markeredgewidth=2, label="bound"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    return fig


def _cell(
    ax: Axes, x: float, y: float, w: float, text: str, face: str, edge: str = "white", bold: bool = False
) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(
        Rectangle((x, y - 0.45), w, 0.9, facecolor=face, edgecolor=edge, linewidth=2 if edge != "white" else 1)
    )
    ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=8, fontweight="bold" if bold else "normal")


def draw_probe_grid(grid: ProbeGrid, title: str) -> Figure:
    """ws1-ops: invariance probes (bitwise or not) per operator over every layout, as a pass grid."""
    fig = new_figure(2.8 + 1.05 * max(1, len(grid.probes)), 1.4 + 0.3 * max(1, len(grid.ops)), title)
    ax = fig.subplots()
    for y, op in enumerate(grid.ops):
        for x, probe in enumerate(grid.probes):
            value, n = grid.cells.get((op, probe)), grid.counts.get((op, probe), 0)
            if value is None:
                _cell(ax, x, y, 1, "-", NONE_COLOUR)
            else:
                _cell(ax, x, y, 1, f"ok ({n})" if value else "FAIL", PASS_COLOUR if value else FAIL_COLOUR)
    ax.set_xlim(0, max(1, len(grid.probes)))
    ax.set_ylim(len(grid.ops) - 0.5, -0.5)
    ax.set_xticks([x + 0.5 for x in range(len(grid.probes))], labels=grid.probes, fontsize=9)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(grid.ops)), labels=grid.ops, fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel("ok (n): every one of n probes bitwise, over all layouts; FAIL: one was not; -: not run")
    return fig


def draw_ablation(rows: list[AblationRow], title: str) -> Figure:
    """ablation: expected vs observed result per row, and each row's observed first-drift signature."""
    fig = new_figure(13.0, 1.3 + 0.32 * max(1, len(rows)), title)
    ax = fig.subplots()
    widths = (0.9, 2.2, 2.2, 7.7)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    for y, r in enumerate(rows):
        bad = r.verdict != "pass" or r.expected != r.observed
        ax.text(starts[0] + 0.05, y, r.id, va="center", fontsize=9, fontweight="bold")
        _cell(ax, starts[1], y, widths[1], r.expected, RESULT_COLOURS.get(r.expected, "white"))
        edge = FAIL_COLOUR if bad else "white"
        _cell(ax, starts[2], y, widths[2], r.observed, RESULT_COLOURS.get(r.observed, "white"), edge, bold=bad)
        text = r.observed_signature if r.observed_signature != "-" else (r.reason or "-")
        text = text if len(text) < 110 else text[:107] + "..."
        ax.text(starts[3] + 0.1, y, f"{r.factor}: {text}", va="center", fontsize=8)
    for x, label in zip(starts, ("row", "expected", "observed", "factor: observed first-drift signature"), strict=True):
        ax.text(x + 0.05, -0.9, label, fontsize=9, fontweight="bold", va="center")
    ax.set_xlim(0, sum(widths))
    ax.set_ylim(len(rows) - 0.5, -1.3)
    ax.axis("off")
    return fig


SPEED_TICKS = (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0)


def _speed_axes(ax: Axes, bars: list[SpeedBar], labels: list[str]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    values = [1.0] + [v for b in bars for v in (b.ratio, b.target) if v is not None]
    for y, b in enumerate(bars):
        colour = "#666666" if b.passed is None else (PASS_COLOUR if b.passed else FAIL_COLOUR)
        if b.ratio is not None:
            ax.barh(y, b.ratio - 1.0, left=1.0, height=0.6, color=colour, alpha=0.85)
            right = b.ratio >= 1.0
            text = f" {b.ratio:.3g}x" if right else f"{b.ratio:.3g}x "
            ax.text(b.ratio, y, text, va="center", ha="left" if right else "right", fontsize=8)
        if b.target is not None:
            ax.plot([b.target, b.target], [y - 0.4, y + 0.4], color="black", linewidth=2.2)
    ax.axvline(1.0, color="#444444", linewidth=1)
    ax.set_xscale("log", base=2)
    low, high = min(values) / 1.4, max(values) * 1.4
    ax.set_xlim(low, high)
    ax.xaxis.set_major_locator(FixedLocator([t for t in SPEED_TICKS if low <= t <= high]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yticks(range(len(bars)), labels=labels, fontsize=8)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.grid(True, axis="x", alpha=0.3)


def draw_op_speeds(bars: list[SpeedBar], title: str) -> Figure:
    """bench --op: each operator's speed against its baseline, with its declared target or the not-slower floor, and
    the ungated timings the record holds (grey)."""
    fig = new_figure(11.0, 1.7 + 0.3 * max(1, len(bars)), title)
    ax = fig.subplots()
    _speed_axes(ax, bars, [f"{b.label} vs {b.baseline} ({b.target_kind})" for b in bars])
    ax.set_xlabel("speed relative to the baseline = baseline median / strict median (log2; > 1 is faster)")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=PASS_COLOUR, label="meets its target"),
        Patch(color=FAIL_COLOUR, label="misses its target"),
        Patch(color="#666666", label="recorded, not gated"),
        Line2D([], [], color="black", linewidth=2.2, label="target (declared, or 1 - noise)"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    return fig


def draw_gate_speeds(groups: list[GateSpeeds], title: str) -> Figure:
    """bench-ws1-block / bench-ws1-model: strict speed against the provider, forward and forward + backward."""
    bars = [b for g in groups for b in g.bars]
    labels = [f"{g.label}: {b.label}" for g in groups for b in g.bars]
    fig = new_figure(11.0, 1.7 + 0.32 * max(1, len(bars)), title)
    ax = fig.subplots()
    _speed_axes(ax, bars, labels)
    ax.set_xlabel("speed relative to the provider = provider median / strict median (log2; > 1 is faster)")
    ax.set_title("No speed target is recorded in these records: the line at 1 is parity with the provider.",
                 fontsize=9, loc="left", style="italic")  # fmt: skip
    return fig


def draw_node_times(times: NodeTimes, title: str) -> Figure:
    """bench-ws1-block: the forward's device milliseconds node by node, the provider's beside the strict path's."""
    n = len(times.nodes)
    fig = new_figure(11.0, 1.6 + 0.3 * n, title)
    ax = fig.subplots()
    ys = list(range(n))
    ax.barh([y - 0.2 for y in ys], times.provider, height=0.4, color="#9e9e9e", label="provider")
    ax.barh([y + 0.2 for y in ys], times.strict, height=0.4, color="#2c7bb6", label="strict")
    ax.set_yticks(ys, times.nodes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median device milliseconds of the node (CUDA events between nodes, L2 flushed before the forward)")
    ax.set_title(f"sum of the nodes: provider {times.provider_sum:.3f} ms, strict {times.strict_sum:.3f} ms",
                 fontsize=9, loc="left", style="italic")  # fmt: skip
    ax.legend(loc="lower right", fontsize=8)
    return fig
