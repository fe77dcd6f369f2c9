"""Plain series from evidence documents, one function per figure kind; nothing here plots.

Every number comes from the document as written; what a kind does not record is ``None`` (drawn as "not recorded"),
never estimated. The worst error-to-bound ratio of a tensor is the largest ``rows.<view>.ratio`` of the row rule
over its views (isolated, chained); a ratio above 1 fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

LAYERED = re.compile(r"^(refiner|block)\.(\d+)$")
PARAMETERS = "parameters (worst)"
MODALITIES = ("text", "video", "audio")


@dataclass
class Mark:
    """A cell to outline: ``kind`` is ``drift`` (first bitwise difference) or ``failure`` (first row over bound)."""

    row: str
    col: str
    kind: str
    text: str


@dataclass
class Grid:
    """A node x column map of worst ratios (None: not recorded), with marked cells."""

    title: str
    rows: list[str]
    cols: list[str]
    values: dict[tuple[str, str], float | None]
    marks: list[Mark] = field(default_factory=list)


@dataclass
class NodeMap:
    """The node x layer maps of one gate (forward, backward), and what lies outside the layers by stage."""

    grids: list[Grid]
    outside: list[Grid]
    notes: list[str] = field(default_factory=list)


def worst_ratio(entry: Any) -> float | None:
    """The largest row-rule ratio of a tensor record (``rows`` holds one check or one per view); None if none."""
    rows = entry.get("rows") if isinstance(entry, dict) else None
    if not isinstance(rows, dict):
        return None
    checks = [rows] if "ratio" in rows else [v for v in rows.values() if isinstance(v, dict)]
    ratios = [c["ratio"] for c in checks if isinstance(c.get("ratio"), int | float)]
    return max(ratios) if ratios else None


def _worst(current: float | None, new: float | None) -> float | None:
    if new is None:
        return current
    return new if current is None else max(current, new)


def _layer_label(stage: str) -> str:
    m = LAYERED.match(stage)
    assert m is not None
    return f"R{m[2]}" if m[1] == "refiner" else m[2]


def _column_key(col: str) -> tuple[int, int]:
    """Refiner layers (R0, R1, ...) first, then the blocks in order."""
    return (0, int(col[1:])) if col.startswith("R") else (1, int(col))


def _model_grid(title: str, entries: list[dict], outside_title: str, order: list[str]) -> tuple[Grid, Grid]:
    """(layers grid, outside-the-layers grid) of ws1-model tensor records (nodes, or gradients with parameters);
    rows follow ``order`` (a block's nodes in execution order), columns run from the first layer to the last."""
    cols: list[str] = []
    rows: list[str] = []
    values: dict[tuple[str, str], float | None] = {}
    out_rows: list[str] = []
    out_values: dict[tuple[str, str], float | None] = {}
    for e in entries:
        stage, name, ratio = str(e.get("stage")), str(e.get("name")), worst_ratio(e)
        if LAYERED.match(stage):
            col = _layer_label(stage)
            row = PARAMETERS if e.get("kind") == "parameter" else name.removeprefix(f"{stage}.")
            cols += [col] if col not in cols else []
            rows += [row] if row not in rows else []
            values[(row, col)] = _worst(values.get((row, col)), ratio)
        else:
            row = stage if e.get("kind") != "input" else "request inputs"
            out_rows += [row] if row not in out_rows else []
            out_values[(row, "worst")] = _worst(out_values.get((row, "worst")), ratio)
    block_rows = [r for r in rows if r != PARAMETERS]
    rank = {name: i for i, name in enumerate(order)}
    block_rows.sort(key=lambda r: rank.get(r, len(rank)))
    rows = block_rows + ([PARAMETERS] if PARAMETERS in rows else [])
    cols.sort(key=_column_key)
    return Grid(title, rows, cols, values), Grid(outside_title, out_rows, ["worst"], out_values)


def _block_order(entries: list[dict]) -> list[str]:
    """Node names in execution order of the first block stage (blocks have every node a refiner has, and more)."""
    first = next((str(e["stage"]) for e in entries if str(e.get("stage", "")).startswith("block.")), None)
    names = [str(e["name"]).removeprefix(f"{first}.") for e in entries if e.get("stage") == first]
    return sorted(dict.fromkeys(names), key=names.index) if names else []


def _model_mark(grid: Grid, outside: Grid, where: dict | None, kind: str, text: str) -> None:
    if not where:
        return
    stage, node = str(where.get("stage")), str(where.get("node"))
    if LAYERED.match(stage):
        row = node.removeprefix(f"{stage}.")
        grid.marks.append(Mark(row if row in grid.rows else PARAMETERS, _layer_label(stage), kind, text))
    elif stage in outside.rows:
        outside.marks.append(Mark(stage, "worst", kind, text))


def describe(where: dict | None) -> str:
    """``node row N (modality)`` of a drift / failure record."""
    if not where:
        return "none"
    row = where.get("row", where.get("first_row"))
    text = str(where.get("node"))
    text += f" row {row}" if row is not None else ""
    modality = where.get("modality", where.get("first_modality"))
    text += f" ({modality})" if modality else ""
    return text + (f", check {where['check']}" if where.get("check") else "")


def model_map(doc: dict) -> NodeMap:
    """ws1-model: forward nodes and backward gradients by node and layer (refiner layers R0.., blocks 0..)."""
    nodes = doc.get("nodes") or []
    order = _block_order(nodes)
    fwd, fwd_out = _model_grid("forward", nodes, "forward, outside the layers", order)
    grids, outside, notes = [fwd], [fwd_out], []
    drifts = doc.get("drifts") or {}
    drift = drifts.get("forward_chained") or doc.get("first_drift")
    _model_mark(fwd, fwd_out, drift, "drift", f"forward, first drift: {describe(drift)}")
    backward = doc.get("backward")
    if isinstance(backward, dict):
        grads = list((backward.get("gradients") or {}).values()) + list((backward.get("leaves") or {}).values())
        bwd, bwd_out = _model_grid("backward (gradients)", grads, "backward, outside the layers", order)
        drift = drifts.get("backward_chained")
        _model_mark(bwd, bwd_out, drift, "drift", f"backward, first drift: {describe(drift)}")
        grids.append(bwd)
        outside.append(bwd_out)
    else:
        notes.append("No backward in this evidence (run without --backward): only the forward is mapped.")
    failure = doc.get("first_row_failure") or doc.get("first_failure")
    if failure:
        index = 0 if failure.get("direction", "forward") == "forward" else len(grids) - 1
        text = f"{failure.get('direction', 'forward')}, first failure: {describe(failure)}"
        _model_mark(grids[index], outside[index], failure, "failure", text)
    return NodeMap(grids, outside, notes)


def _block_columns(doc: dict) -> list[tuple[str, dict[str, float | None]]]:
    """(column, node -> worst ratio) for the one-block gate's views."""
    nodes = doc.get("nodes") or []

    def view(name: str) -> dict[str, float | None]:
        out = {}
        for n in nodes:
            check = (n.get("rows") or {}).get(name)
            out[n["name"]] = check.get("ratio") if isinstance(check, dict) else None
        return out

    cols = [("forward isolated", view("isolated")), ("forward chained", view("chained"))]
    backward = doc.get("backward")
    if isinstance(backward, dict):
        grads = {k: worst_ratio(v) for k, v in (backward.get("nodes") or {}).items()}
        leaves = [worst_ratio(v) for v in (backward.get("leaves") or {}).values()]
        grads[PARAMETERS] = max((x for x in leaves if x is not None), default=None)
        vjp: dict[str, float | None] = {}
        for rec in (backward.get("vjp") or {}).values():
            vjp[rec["node"]] = _worst(vjp.get(rec["node"]), worst_ratio(rec))
        cols += [("backward gradient", grads), ("backward VJP", vjp)]
    return cols


def _block_failure_col(failure: dict) -> str:
    view = str(failure.get("view", ""))
    if failure.get("where") == "forward":
        return f"forward {view}"
    return "backward VJP" if view.startswith("vjp") else "backward gradient"


def block_map(doc: dict) -> NodeMap:
    """ws1-block: the block's nodes by view (one layer): forward isolated/chained, backward gradient and VJP."""
    cols = _block_columns(doc)
    rows = [n["name"] for n in doc.get("nodes") or []]
    if len(cols) > 2:
        rows.append(PARAMETERS)
    values = {(r, c): col.get(r) for c, col in cols for r in rows}
    grid = Grid(f"layer {doc.get('layer', 0)}", rows, [c for c, _ in cols], values)
    notes = [] if len(cols) > 2 else ["No backward in this evidence (run with --no-backward): forward views only."]
    for col, key in (("forward chained", "first_drift"), ("forward isolated", "first_isolated_drift")):
        where = doc.get(key)
        if where and where.get("node") in rows:
            grid.marks.append(Mark(where["node"], col, "drift", f"first drift ({col}): {describe(where)}"))
    grad = (doc.get("backward") or {}).get("first_grad_drift") if isinstance(doc.get("backward"), dict) else None
    if grad:
        row = grad["node"] if grad.get("kind") == "node" and grad.get("node") in rows else PARAMETERS
        grid.marks.append(Mark(row, "backward gradient", "drift", f"first gradient drift: {describe(grad)}"))
    failure = doc.get("first_row_failure")
    if failure and failure.get("node") in rows + [PARAMETERS]:
        text = f"first failure ({failure.get('where')} {failure.get('view')}): {describe(failure)}"
        grid.marks.append(Mark(failure["node"], _block_failure_col(failure), "failure", text))
    return NodeMap([grid], [], notes)


@dataclass
class Track:
    """What the evidence records about the rows of one tensor of one node, in one view."""

    label: str
    rows: int | None
    first_diff: int | None = None
    first_diff_modality: str | None = None
    rows_differing: int | None = None
    worst_row: int | None = None
    worst_modality: str | None = None
    worst_ratio: float | None = None
    first_over: int | None = None
    first_over_modality: str | None = None
    rows_over: int | None = None


def _track(label: str, compare: Any, check: Any) -> Track | None:
    compare = compare if isinstance(compare, dict) else {}
    if not isinstance(check, dict) and not compare:
        return None
    check = check if isinstance(check, dict) else {}
    return Track(
        label,
        check.get("rows"),
        compare.get("first_row"),
        compare.get("first_modality"),
        compare.get("rows_differing"),
        check.get("worst_row"),
        check.get("worst_modality"),
        check.get("ratio"),
        check.get("first_over_row"),
        check.get("first_over_modality"),
        check.get("rows_over"),
    )


def _tracks_of(prefix: str, entry: dict | None) -> list[Track]:
    if not isinstance(entry, dict):
        return []
    rows = entry.get("rows") or {}
    if "ratio" in rows:  # one check (a ws1-block node-output gradient): compared chained
        found = [_track(f"{prefix}", entry.get("chained"), rows)]
    else:
        found = [_track(f"{prefix} {v}", entry.get(v), rows.get(v)) for v in ("isolated", "chained")]
    return [t for t in found if t is not None]


@dataclass
class RowFacts:
    """The recorded rows of the first-drift node (and of the first failing node, when another)."""

    node: str
    seq_len: int | None
    modality_rows: dict[str, int]
    tracks: list[Track]
    failing: str | None = None  # the first failing node, when it is not the first-drift node


def _node_tracks(doc: dict, name: str, prefix: str) -> list[Track]:
    """The forward and gradient tracks of one node (ws1-model gradients, or ws1-block node-output gradients)."""
    nodes = {n["name"]: n for n in doc.get("nodes") or []}
    bwd = doc.get("backward") if isinstance(doc.get("backward"), dict) else {}
    grads = bwd.get("gradients") if doc.get("kind") == "ws1-model" else bwd.get("nodes")
    return _tracks_of(f"{prefix}forward", nodes.get(name)) + _tracks_of(f"{prefix}gradient", (grads or {}).get(name))


def first_drift_rows(doc: dict) -> RowFacts | None:
    """ws1-block / ws1-model: what is recorded about the rows of the first node whose bits drift, and of the first
    failing node when it is another one."""
    layout = doc.get("layout") or {}
    drift = doc.get("first_drift")
    if not drift or not drift.get("node"):
        return None
    name = str(drift["node"])
    failure = doc.get("first_row_failure") or doc.get("first_failure") or {}
    failing = str(failure.get("node")) if failure.get("node") and failure.get("node") != name else None
    tracks = _node_tracks(doc, name, f"{name} " if failing else "")
    if failing:
        tracks += _node_tracks(doc, failing, f"{failing} (first failure) ")
    mods = {k: int(v) for k, v in (layout.get("rows") or {}).items() if isinstance(v, int)}
    return RowFacts(name, layout.get("seq_len"), mods, tracks, failing)


@dataclass
class Profile:
    """Every row's error and bound of the first-drift node, as the evidence's ``first_drift_profile`` records them
    (one view, the row rule's), with each row's modality and what the figure marks."""

    node: str
    where: str  # the layer (or stage) of the node, in words
    view: str
    error: list[float | None]
    bound: list[float | None]
    runs: list[tuple[str, int, int]]  # (modality, first row, row count) in row order
    first_row: int | None = None  # the first row whose bits differ from the provider's
    first_modality: str | None = None

    @property
    def rows(self) -> int:
        return len(self.error)

    @property
    def ratio(self) -> list[float | None]:
        """error / bound per row; None where either is not recorded (not finite) or the bound is not positive."""
        pairs = zip(self.error, self.bound, strict=True)
        return [e / b if e is not None and b is not None and b > 0 else None for e, b in pairs]

    def modality_of(self, row: int) -> str:
        return next((m for m, start, n in self.runs if start <= row < start + n), "-")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m, _, n in self.runs:
            out[m] = out.get(m, 0) + n
        return out


def _profile_where(doc: dict, drift: dict) -> str:
    if doc.get("kind") != "ws1-model":
        return f"layer {doc.get('layer', 0)}"
    stage = str(drift.get("stage"))
    m = LAYERED.match(stage)
    if m is None:
        return f"stage {stage}, outside the layers"
    return f"token refiner layer {m[2]}" if m[1] == "refiner" else f"block {m[2]}"


def first_drift_profile(doc: dict) -> Profile | None:
    """ws1-block / ws1-model: the first-drift node's per-row profile, or None when the evidence holds none (older
    evidence, no drift) or one whose lengths do not agree (not drawn rather than guessed)."""
    rec = doc.get("first_drift_profile")
    if not isinstance(rec, dict):
        return None
    error, bound, runs = rec.get("error"), rec.get("bound"), rec.get("modality_runs") or []
    if not isinstance(error, list) or not isinstance(bound, list):
        return None
    if not error or len(error) != len(bound) or len(error) != rec.get("rows"):
        return None
    spans, start = [], 0
    for modality, count in runs:
        spans.append((str(modality), start, int(count)))
        start += int(count)
    if start != len(error):
        spans = [("-", 0, len(error))]  # modalities not recorded row by row
    drift = (doc.get("drifts") or {}).get("forward_chained") or doc.get("first_drift") or {}
    node = str(rec.get("node"))
    same = drift.get("node", drift.get("name")) == node
    row = drift.get("row", drift.get("first_row")) if same else None
    row = row if isinstance(row, int) and 0 <= row < len(error) else None
    modality = drift.get("modality", drift.get("first_modality")) if same else None
    return Profile(node, _profile_where(doc, drift), str(rec.get("view")), error, bound, spans, row, modality)
