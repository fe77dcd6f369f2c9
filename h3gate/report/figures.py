"""One function per figure, each drawing plain series (``extract`` / ``series``) into a new matplotlib Figure.

matplotlib is the optional extra ``h3gate[report]``: it is imported here lazily, and figures are drawn on an Agg
canvas of their own (no pyplot, no global backend switch, no GUI). Every figure carries its title, axis labels and
a legend; what the evidence does not record is drawn as "not recorded", never filled in.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from h3gate.report.extract import Grid, NodeMap, Profile, RowFacts, Track

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 80
MODALITY_COLOURS = {"text": "#7b3294", "video": "#1f78b4", "audio": "#e66101"}
MODALITIES_ORDER = ("text", "video", "audio")
UNKNOWN_COLOUR = "#555555"
OVER_COLOUR = "#e31a1c"
MISSING_COLOUR = "#e6e6e6"
MARK_COLOURS = {"drift": "#000000", "failure": "#e31a1c"}
MARK_LABELS = {
    "drift": "first bitwise drift (candidate vs provider)",
    "failure": "first failure (a row over its bound)",
}


class MissingMatplotlib(Exception):
    """matplotlib (the ``report`` extra) is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`MissingMatplotlib` unless matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingMatplotlib("needs matplotlib: pip install 'h3gate[report]'") from None


def new_figure(width: float, height: float, title: str) -> Figure:
    """A Figure on its own Agg canvas, constrained layout, with ``title`` as its suptitle."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    return fig


def to_png(fig: Figure, dpi: int = DPI) -> bytes:
    """The figure as PNG bytes, quantized to a 256-colour palette (a third of the size, same look), without
    timestamp or software metadata: the bytes depend on the drawing only."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    from PIL import Image  # matplotlib's own dependency, declared in the report extra

    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    palette = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _ratio_scale() -> tuple[Any, Any]:
    """viridis from 0 to 1 (how close to its bound a tensor comes), red above 1 (over the bound), grey unrecorded."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    cmap = colormaps["viridis"].with_extremes(over=OVER_COLOUR, bad=MISSING_COLOUR)
    return cmap, Normalize(vmin=0.0, vmax=1.0)


def _matrix(grid: Grid) -> Any:
    import numpy as np

    data = np.full((len(grid.rows), len(grid.cols)), np.nan)
    for (r, c), v in grid.values.items():
        if v is not None and r in grid.rows and c in grid.cols:
            data[grid.rows.index(r), grid.cols.index(c)] = v
    return np.ma.masked_invalid(data)


def _draw_grid(ax: Axes, grid: Grid, annotate: bool, xlabel: str) -> Any:
    from matplotlib.patches import Rectangle

    cmap, norm = _ratio_scale()
    image = ax.imshow(_matrix(grid), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    small = 7 if len(grid.cols) > 20 else 9
    ax.set_xticks(range(len(grid.cols)), labels=grid.cols, fontsize=small, rotation=90 if len(grid.cols) > 20 else 0)
    ax.set_yticks(range(len(grid.rows)), labels=grid.rows, fontsize=9)
    ax.set_xticks([i - 0.5 for i in range(1, len(grid.cols))], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, len(grid.rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(xlabel)
    ax.set_title(grid.title, fontsize=10, loc="left")
    if annotate:
        for (r, c), v in grid.values.items():
            if r in grid.rows and c in grid.cols:
                text = "n/r" if v is None else f"{v:.2f}"
                colour = "#555555" if v is None else ("black" if 0.55 <= v <= 1 else "white")
                ax.text(
                    grid.cols.index(c), grid.rows.index(r), text, ha="center", va="center", fontsize=8, color=colour
                )
    for mark in grid.marks:
        if mark.row in grid.rows and mark.col in grid.cols:
            xy = (grid.cols.index(mark.col) - 0.5, grid.rows.index(mark.row) - 0.5)
            for colour, width in (("white", 4.5), (MARK_COLOURS[mark.kind], 2.2)):  # visible on any colour
                ax.add_patch(Rectangle(xy, 1, 1, fill=False, edgecolor=colour, linewidth=width, clip_on=False))
    return image


def _mark_legend(fig: Figure, maps: list[Grid]) -> None:
    """One legend entry per marked cell (what it marks, in words), then 'not recorded'."""
    from matplotlib.patches import Patch

    texts = dict.fromkeys((m.kind, m.text) for g in maps for m in g.marks)
    handles = [Patch(facecolor="none", edgecolor=MARK_COLOURS[k], linewidth=2, label=t) for k, t in texts]
    handles.append(Patch(facecolor=MISSING_COLOUR, edgecolor="none", label="not recorded in this evidence"))
    fig.legend(handles=handles, loc="outside lower left", ncols=2, fontsize=9, frameon=False)


def draw_node_map(node_map: NodeMap, title: str, many_layers: bool) -> Figure:
    """ws1-model (many layers) or ws1-block (one layer, annotated): worst error/bound per node and column."""
    n = len(node_map.grids)
    heights = [max(2.2, 0.24 * len(g.rows) + 1.2) for g in node_map.grids]
    width = 15.0 if many_layers else 9.0
    lines = (len({m.text for g in node_map.grids + node_map.outside for m in g.marks}) + 2) // 2
    fig = new_figure(width, sum(heights) + 1.2 + 0.25 * lines, title)
    if node_map.outside:
        axes = fig.subplots(n, 2, squeeze=False, gridspec_kw={"width_ratios": [9, 1.3], "height_ratios": heights})
    else:
        axes = fig.subplots(n, 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    image = None
    for i, grid in enumerate(node_map.grids):
        xlabel = "layer (R = token refiner, then transformer blocks)" if many_layers else "view"
        image = _draw_grid(axes[i][0], grid, annotate=not many_layers, xlabel=xlabel)
        if node_map.outside:
            side = node_map.outside[i]
            _draw_grid(axes[i][1], side, annotate=True, xlabel="")
            axes[i][1].set_title("outside the layers", fontsize=9, loc="left")
            axes[i][1].yaxis.tick_right()
            axes[i][1].set_xticks([])
    fig.colorbar(image, ax=[a for row in axes for a in row], label="worst error / bound (> 1 fails)", shrink=0.8,
                 extend="max")  # fmt: skip
    _mark_legend(fig, node_map.grids + node_map.outside)
    return fig


def _modality_colour(modality: str | None) -> str:
    return MODALITY_COLOURS.get(str(modality), UNKNOWN_COLOUR)


def _row_legend(ax: Axes, facts: RowFacts) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], marker="v", linestyle="", color="black", markersize=9, label="first row whose bits differ"),
        Line2D([], [], marker="o", linestyle="", color="black", markersize=8, label="worst row (error / bound)"),
        Line2D(
            [],
            [],
            marker="X",
            linestyle="",
            color="black",
            markeredgecolor=OVER_COLOUR,
            markeredgewidth=1.5,
            markersize=11,
            label="first row over its bound",
        ),  # fmt: skip
    ]
    for name in MODALITIES_ORDER:
        count = facts.modality_rows.get(name)
        label = f"{name} ({count} packed rows)" if count else name
        handles.append(Line2D([], [], marker="s", linestyle="", color=_modality_colour(name), label=label))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _track_label(t: Track) -> str:
    differing = "n/r" if t.rows_differing is None else str(t.rows_differing)
    over = "n/r" if t.rows_over is None else str(t.rows_over)
    return f"{t.label}\n{differing} of {t.rows} rows differ\n{over} over bound"


ROWS_UNPROFILED = (
    "Per-row errors are not recorded in this evidence (no first_drift_profile): only the rows drawn here are."
)


def draw_rows(facts: RowFacts, title: str, subtitle: str = ROWS_UNPROFILED) -> Figure:
    """The rows the evidence names for the first-drift node, per view, coloured by their modality."""
    import textwrap

    fig = new_figure(11.0, 1.8 + 0.7 * max(1, len(facts.tracks)), textwrap.fill(title, 105))
    ax = fig.subplots()
    extent = max([t.rows or 1 for t in facts.tracks])
    for y, t in enumerate(facts.tracks):
        ax.plot([0, (t.rows or extent) - 1], [y, y], color="#bbbbbb", linewidth=1, zorder=1)
        if t.first_diff is not None:
            ax.scatter(t.first_diff, y, marker="v", s=90, color=_modality_colour(t.first_diff_modality), zorder=3)
        if t.worst_row is not None:
            ax.scatter(t.worst_row, y, marker="o", s=70, color=_modality_colour(t.worst_modality), zorder=3)
            ratio = "n/r" if t.worst_ratio is None else f"{t.worst_ratio:.2f}"
            ax.annotate(
                f"{ratio}", (t.worst_row, y), textcoords="offset points", xytext=(0, 7), fontsize=8, ha="center"
            )
        if t.first_over is not None:
            colour = _modality_colour(t.first_over_modality)
            ax.scatter(
                t.first_over, y, marker="X", s=170, color=colour, edgecolors=OVER_COLOUR, linewidths=1.5, zorder=4
            )
    ax.set_yticks(range(len(facts.tracks)), labels=[_track_label(t) for t in facts.tracks], fontsize=9)
    ax.set_ylim(len(facts.tracks) - 0.4, -0.6)
    ax.set_xlim(-0.01 * extent, extent * 1.01)
    ax.set_xlabel("row of the tensor (packed sequence order for per-token tensors)")
    ax.set_title(subtitle, fontsize=9, loc="left", style="italic")
    _row_legend(ax, facts)
    return fig


def _by_modality(profile: Profile, values: list[float | None]) -> dict[str, tuple[list[int], list[float]]]:
    """Per modality, the (rows, values) of the recorded values, in row order."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for modality, start, count in profile.runs:
        xs, ys = out.setdefault(modality, ([], []))
        for row in range(start, start + count):
            if values[row] is not None:
                xs.append(row)
                ys.append(values[row])
    return out


def _profile_points(
    ax: Axes, profile: Profile, values: list[float | None], floor: float | None, label: bool = False
) -> None:
    """The values as dots coloured by each row's modality over faint modality bands (named with ``label``); with
    ``floor`` (a log axis), zeros are drawn on it."""
    size = 5 if profile.rows > 600 else 14
    for modality, start, count in profile.runs:
        colour = _modality_colour(modality)
        ax.axvspan(start - 0.5, start + count - 0.5, color=colour, alpha=0.08, lw=0, zorder=0)
        if label and count >= 0.015 * profile.rows:  # name each run of rows where it is wide enough to read
            ax.text(start + count / 2, 0.97, modality, transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=8, color=colour, fontweight="bold")  # fmt: skip
    for modality, (xs, ys) in _by_modality(profile, values).items():
        ys = [floor if floor is not None and y <= 0 else y for y in ys]
        ax.scatter(xs, ys, s=size, color=_modality_colour(modality), linewidths=0, zorder=2)


def _scale(ax: Axes, values: list[float | None], lowest: float = 0.0) -> float | None:
    """A log y axis when the recorded values span two decades or more (returning where zeros go), else linear from
    0 up to at least ``lowest``."""
    finite = [v for v in values if v is not None]
    positive = [v for v in finite if v > 0]
    top = max(finite, default=0.0)
    if positive and top / min(positive) >= 100:
        ax.set_yscale("log")
        return min(positive) / 10
    ax.set_ylim(0.0, max(lowest, top) * 1.18 or 1.0)  # headroom for the modality names
    return None


def _profile_marks(axes: list[Axes], profile: Profile, ratio: list[float | None]) -> list[Any]:
    """The first drifting row (dashed, both panels), the worst row and the first row over its bound; their legend
    handles."""
    from matplotlib.lines import Line2D

    ax, handles = axes[0], []
    recorded = [(r, v) for r, v in enumerate(ratio) if v is not None]
    if recorded:
        worst, value = max(recorded, key=lambda rv: rv[1])
        ax.scatter(worst, value, s=90, facecolors="none", edgecolors="black", linewidths=1.5, zorder=4)
        ax.annotate(f"{value:.3f}", (worst, value), textcoords="offset points", xytext=(6, 6), fontsize=8)
        label = f"worst row: {worst} ({profile.modality_of(worst)}), error / bound {value:.3f}"
        handles.append(Line2D([], [], marker="o", ls="", mfc="none", mec="black", ms=9, label=label))
    over = next((r for r, v in recorded if v > 1), None)
    if over is not None:
        ax.scatter(over, ratio[over], marker="X", s=150, color=OVER_COLOUR, edgecolors="black", zorder=5)
        label = f"first row over its bound: {over} ({profile.modality_of(over)})"
        handles.append(Line2D([], [], marker="X", ls="", color=OVER_COLOUR, mec="black", ms=10, label=label))
    if profile.first_row is not None:
        for a in axes:
            a.axvline(profile.first_row, color="black", linestyle="--", linewidth=1.2, zorder=3)
        if ratio[profile.first_row] is not None:
            ax.scatter(profile.first_row, ratio[profile.first_row], marker="v", s=110, color="black", zorder=5)
        modality = profile.first_modality or profile.modality_of(profile.first_row)
        label = f"first row whose bits differ from the provider: {profile.first_row} ({modality})"
        handles.append(Line2D([], [], marker="v", ls="--", color="black", ms=9, label=label))
    return handles


def _profile_legend(fig: Figure, profile: Profile, handles: list[Any]) -> None:
    from matplotlib.lines import Line2D

    counts = profile.counts()
    names = [m for m in MODALITIES_ORDER if m in counts] + [m for m in counts if m not in MODALITIES_ORDER]
    mods = [Line2D([], [], marker="o", ls="", color=_modality_colour(m), label=f"{m} ({counts[m]} rows)")
            for m in names]  # fmt: skip
    bound = [Line2D([], [], color=OVER_COLOUR, ls="--", label="bound (error / bound = 1; above it fails)"),
             Line2D([], [], color="black", lw=1.2, label="bound (row rule), absolute")]  # fmt: skip
    fig.legend(handles=mods + bound + handles, loc="outside lower left", ncols=3, fontsize=8, frameon=False)


def draw_profile(profile: Profile, title: str) -> Figure:
    """ws1-block / ws1-model: every row's error / bound of the first-drift node (top) and its error beside its bound
    (bottom), coloured by modality, the first drifting row marked."""
    import math
    import textwrap

    ratio = profile.ratio
    fig = new_figure(12.0, 7.6, textwrap.fill(title, 115))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.25, 1]})
    _profile_points(top, profile, ratio, _scale(top, ratio, lowest=1.05), label=True)
    top.axhline(1.0, color=OVER_COLOUR, linestyle="--", linewidth=1.3, zorder=1)
    top.set_ylabel("error / bound (> 1 fails)")
    values = profile.error + profile.bound
    floor = _scale(bottom, values)
    _profile_points(bottom, profile, profile.error, floor)
    line = [math.nan if b is None else (floor if floor is not None and b <= 0 else b) for b in profile.bound]
    bottom.plot(range(profile.rows), line, color="black", linewidth=1.2, drawstyle="steps-mid", zorder=3)
    bottom.set_ylabel("error vs FP64 golden")
    bottom.set_xlabel(f"row of {profile.node}'s output ({profile.rows} rows, packed sequence order)")
    bottom.set_xlim(-0.5, profile.rows - 0.5)
    handles = _profile_marks([top, bottom], profile, ratio)
    recorded = [v for v in ratio if v is not None]
    over = sum(1 for v in recorded if v > 1)
    text = f"{profile.view} view, every row: {over} of {profile.rows} rows over the bound"
    if len(recorded) < profile.rows:
        text += f"; {profile.rows - len(recorded)} rows without a finite error / bound (not drawn)"
    top.set_title(text, fontsize=9, loc="left")
    for ax in (top, bottom):
        ax.grid(True, axis="y", alpha=0.3)
    _profile_legend(fig, profile, handles)
    return fig
