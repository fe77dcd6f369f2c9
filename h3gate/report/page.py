"""One self-contained HTML page: inline CSS, figures as base64 ``data:`` PNGs, no script, no font, no external
resource (a Content-Security-Policy meta tag forbids every load but inline style and ``data:`` images)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

from h3gate.paths import display
from h3gate.report import extract
from h3gate.report.loader import RUN_PARTS, Document, Inventory, SealStatus
from h3gate.report.plan import Entry, Section, slug

GENERATOR = "h3gate report"
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0 auto;max-width:1280px;
padding:0 24px 48px;color:#1b1b1b;line-height:1.45;background:#fff}
h1{margin:24px 0 4px;font-size:28px}h2{margin-top:40px;border-bottom:2px solid #ddd;padding-bottom:4px}
h3{margin:28px 0 6px;font-size:18px}.muted{color:#555}.small{font-size:13px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f4f4f4}
td.mono,span.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12px}
.pass{background:#d9f0d3;color:#0b5d1e;font-weight:600}.fail{background:#fbd5d5;color:#8b0000;font-weight:600}
.warn{background:#fff3cd;color:#6b4e00;font-weight:600}.badge{padding:1px 8px;border-radius:10px;white-space:nowrap}
figure{margin:12px 0 24px}figure img{max-width:100%;height:auto;border:1px solid #e4e4e4}
figcaption{font-size:13px;color:#444}.note{background:#f7f7f7;border-left:4px solid #999;padding:6px 10px;margin:6px 0;
font-size:14px}.empty{background:#fff3cd;border-left:4px solid #c99a00;padding:10px 14px;font-size:16px}
nav ul{columns:2;font-size:14px}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 14px;font-size:14px}
dl.facts dt{color:#555}dl.facts dd{margin:0}
"""


@dataclass
class Rendered:
    """A drawn figure: its PNG bytes and pixel size."""

    png: bytes
    width: int
    height: int


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _badge(verdict: str | None) -> str:
    if verdict is None:
        return '<span class="badge muted">-</span>'
    classes = {"pass": "pass", "fail": "fail", "verified": "pass", "failed": "fail", "complete": "pass"}
    cls = classes.get(verdict, "warn")
    return f'<span class="badge {cls}">{_e(verdict)}</span>'


def _table(head: list[str], rows: list[list[str]]) -> str:
    """An HTML table; cells are already HTML."""
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _key_result(d: Document) -> str:
    doc = d.doc
    if d.kind in ("ws1-model", "ws1-block"):
        text = f"first drift: {extract.describe(doc.get('first_drift'))}"
        failure = doc.get("first_row_failure") or doc.get("first_failure")
        return text + (f"; first failure: {extract.describe(failure)}" if failure else "")
    if d.kind == "trajectory-compare":
        step = doc.get("first_drift_step")
        return "bitwise at every step" if step is None else f"first drift at step {step}"
    if d.kind == "arms":
        return _arms_result(doc)
    if d.kind == "ablation":
        s = doc.get("summary") or {}
        return f"{s.get('passed')} of {s.get('requested')} rows as expected"
    if d.kind == "bench":
        ops = doc.get("operators") or []
        return f"{sum(1 for o in ops if o.get('verdict') == 'pass')} of {len(ops)} operators meet their target"
    if d.kind == "ws1-ops":
        ops = doc.get("operators") or []
        return f"{sum(1 for o in ops if o.get('verdict') == 'pass')} of {len(ops)} operators pass"
    if d.kind in ("bench-ws1-block", "bench-ws1-model"):
        res = doc.get("results") or {}
        ratios = {k: (v or {}).get("strict_over_provider") for k, v in res.items() if isinstance(v, dict)}
        parts = [f"{k.replace('_', ' + ')} {1 / r:.3g}x" for k, r in ratios.items() if isinstance(r, int | float) and r]
        return "strict speed vs provider: " + ", ".join(parts) if parts else ""
    if d.kind == "ws1-trajectory":
        return f"{doc.get('steps_saved')} of {doc.get('evaluations')} steps saved"
    if d.kind == "ws2":
        yes = {True: "byte-equal", False: "drift"}
        fwd, bwd = yes.get(doc.get("forward_byte_equal")), yes.get(doc.get("backward_byte_equal"))
        return f"{doc.get('topology')}, {doc.get('world_size')} ranks: forward {fwd}, backward {bwd}"
    return ""


def _arms_result(doc: dict) -> str:
    """``byte-equal: R/R; first drift at step 0: P/P, R/P, P/R`` (arms grouped by what they show)."""
    groups: dict[str, list[str]] = {}
    for arm in doc.get("arms") or []:
        step = arm.get("first_drift_step")
        key = "byte-equal" if arm.get("byte_equal") else ("drift" if step is None else f"first drift at step {step}")
        groups.setdefault(key, []).append(str(arm.get("arm")))
    return "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items())


def _glance(inv: Inventory) -> str:
    rows = []
    for d in inv.documents:
        if d.kind in RUN_PARTS:
            continue
        _, state = inv.seal_of(d)
        seal_cls = "pass" if state == "sealed, verified" else ("muted" if state == "not sealed" else "fail")
        rows.append([
            f'<span class="mono">{_e(d.where)}</span>', _e(d.kind), _badge(d.verdict), _e(_key_result(d)),
            f'<span class="badge {seal_cls}">{_e(state)}</span>',
        ])  # fmt: skip
    return _table(["document", "kind", "verdict", "key result", "seal"], rows)


def _seal_block(status: SealStatus) -> str:
    where = f'<span class="mono">{_e(display(status.folder))}/SEAL.json</span>'
    if status.report is None:
        return f"<p>{where}: {_badge('unverifiable')} {_e(status.error)}</p>"
    r = status.report
    lines = [
        f"<p>{where}: {_badge(status.state())} &middot; {len(r.files)} files &middot; {_e(status.signature())}</p>"
    ]
    if r.seal_sha256:
        lines.append(f'<p class="small mono">root {_e(r.root)}<br>seal_sha256 {_e(r.seal_sha256)}</p>')
    findings = [("changed", r.changed), ("added", r.added), ("removed", r.removed)]
    findings += [("schema", r.schema_errors), ("seal", r.seal_errors)]
    items = [f"<li>{_e(name)}: {_e(item)}</li>" for name, group in findings for item in group[:20]]
    if items:
        lines.append(f'<ul class="small">{"".join(items)}</ul>')
    return "".join(lines)


def _seals(inv: Inventory) -> str:
    parts = [_seal_block(s) for s in inv.seals.values()]
    unsealed = [d for d in inv.documents if d.seal is None]
    if unsealed:
        parts.append(f"<p>{len(unsealed)} document(s) lie in no sealed folder: their integrity is not checked.</p>")
    if not parts:
        parts.append("<p>No documents, no seals.</p>")
    return "".join(parts)


def _inputs(inv: Inventory) -> str:
    rows = []
    for i in inv.inputs:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(i.kinds.items())) or "none"
        skipped = "; ".join(f"{rel}: {why}" for rel, why in i.skipped) or "-"
        held = _e(kinds) if i.documents else '<span class="badge warn">no evidence documents</span>'
        rows.append([f'<span class="mono">{_e(display(i.path))}</span>', _e(i.label), held, _e(skipped)])
    return _table(["input", "label", "evidence documents by kind", "skipped files"], rows)


def _figure(spec_id: str, title: str, fig: Rendered) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (
        f'<figure id="fig-{_e(spec_id)}"><img src="data:image/png;base64,{data}" alt="{_e(title)}" '
        f'width="{fig.width}" height="{fig.height}"><figcaption>{_e(title)} &middot; '
        f'<a href="{_e(spec_id)}.png">{_e(spec_id)}.png</a></figcaption></figure>'
    )


def _entry(entry: Entry, inv: Inventory, rendered: dict[str, Rendered]) -> str:
    d = entry.documents[0]
    seal, state = inv.seal_of(d)
    where = ", ".join(x.where for x in entry.documents if x.kind not in RUN_PARTS)
    out = [f'<h3 id="{_e(slug(d.where))}">{_e(entry.heading)}</h3>']
    out.append(f'<p class="small muted"><span class="mono">{_e(where)}</span> &middot; seal: {_e(state)}</p>')
    facts = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in entry.facts)
    out.append(f'<dl class="facts">{facts}</dl>' if facts else "")
    out += [f'<p class="note">{_e(n)}</p>' for n in entry.notes]
    out += [_figure(f.id, f.title, rendered[f.id]) for f in entry.figures if f.id in rendered]
    if entry.table is not None:
        head, rows = entry.table
        out.append(_table(head, [[_e(c) for c in row] for row in rows]))
    return "".join(out)


def _provenance_row(label: str, docs: list[Document]) -> list[str]:
    def values(key: str, width: int | None = None) -> str:
        found = dict.fromkeys(str((x.doc.get("provenance") or {}).get(key, "-")) for x in docs)
        return ", ".join(v[:width] if width else v for v in found)

    rev = values("git_revision", 12)
    dirty = {str((x.doc.get("provenance") or {}).get("git_dirty")) for x in docs}
    rev += " (dirty)" if "True" in dirty else ""
    cells = [label, values("code_sha256", 16), rev, values("device_name"), values("torch"), values("triton")]
    cells += [values("python"), values("h3gate_version"), values("time_utc")]
    return [f'<span class="mono">{_e(cells[0])}</span>'] + [_e(c) for c in cells[1:3]] + [_e(c) for c in cells[3:]]


def _provenance(inv: Inventory) -> str:
    rows = []
    groups: dict[Path, list[Document]] = {}
    for d in inv.documents:
        if d.kind in RUN_PARTS:
            groups.setdefault(d.path.parent, []).append(d)
        else:
            rows.append(_provenance_row(f"{d.where} ({d.kind})", [d]))
    for docs in groups.values():
        label = f"{docs[0].label}/{Path(docs[0].rel).parent.as_posix()}/ ({len(docs)} {docs[0].kind} records)"
        rows.append(_provenance_row(label, docs))
    head = ["document", "code_sha256", "git revision", "device", "torch", "triton", "python", "h3gate", "written"]
    return _table(head, rows)


def render_page(
    inv: Inventory,
    sections: list[Section],
    others: list[Entry],
    rendered: dict[str, Rendered],
    generated: str,
) -> str:
    """The page as HTML text (see the module docstring)."""
    inputs = ", ".join(display(i.path) for i in inv.inputs)
    body = [f"<h1>h3gate evidence report</h1><p class='muted'>{_e(inputs)} &middot; generated {_e(generated)} by "
            f"{GENERATOR}</p>"]  # fmt: skip
    if not inv.documents:
        body.append(
            '<p class="empty">No evidence found: the inputs hold no evidence document (a <code>.json</code> file '
            "with a string <code>kind</code>, as <code>h3gate run</code>, <code>bench</code>, <code>ablate</code> "
            "and <code>compare</code> write). Nothing to draw; the inputs table says what each one held.</p>"
        )
    toc = [("inputs", "Inputs"), ("glance", "At a glance"), ("seals", "Seals")]
    toc += [(slug(s.heading), s.heading) for s in sections]
    toc += [("others", "Other evidence")] if others else []
    toc.append(("provenance", "Provenance"))
    body.append("<nav><ul>" + "".join(f'<li><a href="#{_e(a)}">{_e(t)}</a></li>' for a, t in toc) + "</ul></nav>")
    body.append(
        '<p class="note">How to read it: a ratio is a tensor\'s worst row error divided by its bound under the row '
        "rule (error against the FP64 golden; bound from provider variants); above 1 fails. A drift is the first "
        "place the candidate's bits differ from the provider's, which the bound allows; a failure is a row over its "
        "bound.</p>"
    )
    body.append(f'<h2 id="inputs">Inputs</h2>{_inputs(inv)}')
    body.append(f'<h2 id="glance">At a glance</h2>{_glance(inv)}')
    body.append(f'<h2 id="seals">Seals</h2>{_seals(inv)}')
    for s in sections:
        entries = "".join(_entry(e, inv, rendered) for e in s.entries)
        body.append(f'<h2 id="{_e(slug(s.heading))}">{_e(s.heading)}</h2><p>{_e(s.intro)}</p>{entries}')
    if others:
        body.append('<h2 id="others">Other evidence</h2>' + "".join(_entry(e, inv, rendered) for e in others))
    body.append(f'<h2 id="provenance">Provenance</h2>{_provenance(inv)}')
    title = f"h3gate report: {inputs}"
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f'<meta name="generator" content="{GENERATOR}"><meta name="viewport" content="width=device-width">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
