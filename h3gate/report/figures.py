"""One function per figure, each drawing plain series (``extract`` / ``series``) into a new matplotlib Figure.

matplotlib is the optional extra ``h3gate[report]``: it is imported here lazily, and figures are drawn on an Agg
canvas of their own (no pyplot, no global backend switch, no GUI). Every figure carries its title, axis labels and
a legend; what the evidence does not record is drawn as "not recorded", never filled in.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from h3gate.report.extract import Grid, NodeMap, RowFacts, Track

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


def draw_rows(facts: RowFacts, title: str) -> Figure:
    """The rows the evidence names for the first-drift node, per view, coloured by their modality."""
    fig = new_figure(11.0, 1.8 + 0.7 * max(1, len(facts.tracks)), title)
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
    ax.set_title(
        "Per-row errors are not recorded in this evidence: only the rows drawn here (first differing, worst, "
        "first over bound) are.",
        fontsize=9,
        loc="left",
        style="italic",
    )
    _row_legend(ax, facts)
    return fig
