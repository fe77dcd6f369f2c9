"""``h3gate report``: the page a person reads, checked as a person would look at it.

* the figure set of the committed H200 evidence (ids and titles) against a small golden,
  ``tests/golden/report-h200-figures.json``; after a deliberate change (new evidence, a new figure, a new title)
  regenerate it with ``H3GATE_REGENERATE_GOLDEN=1 pytest tests/test_report.py -k figure_set`` and the committed page
  with ``make report``;
* a page built from small evidence (copies of committed H200 files, unsealed, beside the sealed CPU evidence): every
  PNG decodes and is not blank, the HTML references nothing outside itself;
* bad inputs: exit 2 and one line, nothing written; inputs without evidence: a page saying what is missing (exit 0);
* ``-m browser``: headless Chromium renders the committed H200 report and the fresh page with the network blocked;
  the screenshots are not blank and the network log shows no request made by the page. Skipped when Chromium is
  not installed, unless ``H3GATE_REQUIRE_CHROMIUM=1`` (CI sets it: there the skip is a failure).
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from h3gate.paths import CHECKOUT

pytest.importorskip("matplotlib")

ROOT = CHECKOUT if CHECKOUT is not None else Path(__file__).resolve().parents[1]
H200 = ROOT / "evidence" / "h200"
CPU = ROOT / "evidence" / "cpu"
COMMITTED = ROOT / "evidence" / "h200-report"
GOLDEN = Path(__file__).parent / "golden" / "report-h200-figures.json"
NEEDS_MATPLOTLIB = "h3gate: error: report: needs matplotlib: pip install 'h3gate[report]'"
# Small committed H200 files, one or two of every kind the page draws.
SMALL = [
    "ws1-block-real-medium-fault-fwd/ws1-block.json",
    "ws1-model-real-medium-fault/ws1-model.json",
    "ws1-ops-attention-768p/ws1-ops.json",
    "trajectory-compare-real-medium-A-P/trajectory-compare.json",
    "trajectory-compare-real-medium-A2-B2/trajectory-compare.json",
    "ws1-trajectory-real-medium-A/ws1-trajectory.json",
    "ws1-trajectory-real-medium-A/manifest.json",
    "arms-real-medium-fault/arms.json",
    "ablate-real-medium-controls/ablation.json",
    "bench-ops-gemm-768p/bench-ops.json",
    "bench-ws1-block-medium/bench-ws1-block.json",
]
EXTERNAL = [
    re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I),  # http(s):// or protocol-relative
    re.compile(r"<script", re.I),
    re.compile(r"@import", re.I),
    re.compile(r"url\(", re.I),
    re.compile(r"<link", re.I),
    re.compile(r"<iframe|<object|<embed", re.I),
]


def _cli(*args: object) -> tuple[int, str, str]:
    """``h3gate ARGS`` in this process: (exit code, stdout, stderr)."""
    from h3gate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(["--quiet", *(str(a) for a in args)])
    return exc.value.code, out.getvalue(), err.getvalue()


def _small_evidence(folder: Path) -> Path:
    for rel in SMALL:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(H200 / rel, folder / rel)
    (folder / "notes.json").write_text('{"not": "evidence"}', encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def small_report(tmp_path_factory) -> tuple[Path, str]:
    """(report folder, stdout) of ``h3gate report <small copies> evidence/cpu --out ...``."""
    base = tmp_path_factory.mktemp("report")
    evidence = _small_evidence(base / "h200-small")
    code, out, err = _cli("report", evidence, CPU, "--out", base / "out")
    assert (code, err) == (0, ""), out + err
    return base / "out", out


def _figures(page: str) -> list[dict[str, str]]:
    """``[{"id", "title"}]`` of the figures of a page, in page order."""
    found = re.findall(r'<figure id="fig-([^"]+)">.*?<figcaption>(.*?) &middot;', page, flags=re.S)
    return [{"id": html.unescape(i), "title": html.unescape(t)} for i, t in found]


def _assert_self_contained(page: str) -> None:
    for pattern in EXTERNAL:
        assert not pattern.search(page), f"the page references something outside itself: {pattern.pattern}"
    srcs = re.findall(r'<img src="([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def _assert_not_blank(png: bytes | Path) -> tuple[int, int]:
    """Decode a PNG; its pixels must not be uniform (a drawn figure, not a blank canvas). Returns its size."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png) if isinstance(png, bytes) else png) as img:
        rgb = img.convert("RGB")
    colours = len(rgb.getcolors(maxcolors=1 << 24) or [])
    pixels = np.asarray(rgb)
    inked = float((pixels.min(axis=2) < 200).mean())
    assert colours >= 8 and inked > 0.005, f"blank image: {colours} colours, {inked:.4f} of pixels inked"
    return pixels.shape[1], pixels.shape[0]


def test_the_figure_set_of_the_committed_h200_evidence_matches_the_golden():
    """Which figures the committed H200 evidence gets, and their titles (planning only: nothing is drawn)."""
    from h3gate.report.loader import load_inventory
    from h3gate.report.plan import figure_set, plan

    sections, _ = plan(load_inventory([H200], verify=False))
    got = figure_set(sections)
    if os.environ.get("H3GATE_REGENERATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n", encoding="utf-8")
        pytest.skip(f"regenerated {GOLDEN.name}")
    hint = "a deliberate change? H3GATE_REGENERATE_GOLDEN=1 pytest tests/test_report.py -k figure_set; make report"
    assert got == json.loads(GOLDEN.read_text(encoding="utf-8")), hint
    kinds = {f["id"].rsplit(".", 1)[1] for f in got}
    assert {
        "node-map",
        "first-drift-profile",
        "first-drift-rows",
        "error-vs-bound",
        "invariance",
        "drift-per-step",
        "arms-drift",
        "matrix",
        "speed",
    } <= kinds


def test_the_committed_h200_report_matches_the_golden_and_is_self_contained():
    page = (COMMITTED / "index.html").read_text(encoding="utf-8")
    figures = _figures(page)
    assert figures == json.loads(GOLDEN.read_text(encoding="utf-8")), "stale evidence/h200-report: run make report"
    _assert_self_contained(page)
    assert {p.name for p in COMMITTED.iterdir()} == {"index.html"} | {f"{f['id']}.png" for f in figures}
    assert sum(p.stat().st_size for p in COMMITTED.iterdir()) < 5 << 20  # a few MB at most
    assert "evidence/h200/SEAL.json" in page and "verified" in page


def test_a_page_from_small_evidence_draws_every_kind(small_report):
    out, stdout = small_report
    page = (out / "index.html").read_text(encoding="utf-8")
    figures = _figures(page)
    assert {f["id"].rsplit(".", 1)[1] for f in figures} == {
        "node-map", "first-drift-rows", "error-vs-bound", "invariance", "drift-per-step", "arms-drift", "matrix",
        "speed", "nodes-bench-ws1-block-medium",  # the block bench's forward node by node
    }  # fmt: skip
    assert sorted(p.name for p in out.glob("*.png")) == sorted(f"{f['id']}.png" for f in figures)
    embedded = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="[^"]*" width="(\d+)" height="(\d+)"', page)
    assert len(embedded) == len(figures)
    import base64

    for (data, width, height), figure in zip(embedded, figures, strict=True):
        png = base64.b64decode(data)
        assert png == (out / f"{figure['id']}.png").read_bytes()  # the inline figure is the PNG beside the page
        assert _assert_not_blank(png) == (int(width), int(height))
    _assert_self_contained(page)
    assert "report " in stdout and "12 evidence documents" in stdout and "seals: evidence/cpu verified" in stdout


def test_the_page_states_seals_provenance_and_what_is_missing(small_report):
    out, _ = small_report
    page = html.unescape((out / "index.html").read_text(encoding="utf-8"))
    assert "evidence/cpu/SEAL.json" in page and "unsigned (integrity only, origin not proven)" in page
    assert page.count("not sealed") >= 9 and "sealed, verified" in page  # the copies, and the CPU evidence
    assert "notes.json: not an evidence document" in page  # skipped, and said so
    assert "Per-row errors are not recorded in this evidence" in page
    assert "A single trajectory records per-step digests, not drift" in page
    assert "These records carry no speed target" in page
    assert "first failure" in page and "attention row 3159 (video)" in page  # the injected fault, located
    assert "code_sha256" in page and "NVIDIA H200" in page and "2.11.0+cu130" in page  # provenance
    assert "0 step, 1 manifest" in page  # the run folder's records (its steps were not copied)


def test_an_arms_document_gets_its_drift_figure_and_arms_table():
    """The committed LoRA arms: one figure (drift per step, per arm) and one table row per arm (planning only)."""
    from h3gate.report.loader import load_inventory
    from h3gate.report.plan import plan

    sections, others = plan(load_inventory([H200 / "arms-real-medium-lora"], verify=False))
    assert others == [] and [s.heading for s in sections] == ["Train / rollout arms (arms)"]
    (entry,) = sections[0].entries
    assert [(f.id, f.title) for f in entry.figures] == [(
        "arms-real-medium-lora.arms-drift",
        "arms-real-medium-lora: training vs rollout velocity drift per step, per arm - lora training, pass",
    )]  # fmt: skip
    head, rows = entry.table
    assert head == ["arm", "byte-equal", "first drift", "gradients repeat", "LoRA gate", "s / rollout step",
                    "s / training step"]  # fmt: skip
    assert rows == [
        ["P/P", "NO", "step 0, alone (request 0): refiner.0.k_proj, packed row 35 (text)",
         "no (step 0: 64 of 74 tensors differ)", "ok", "0.0554", "0.3951"],
        ["R/P", "NO", "step 0, alone (request 0): refiner.0.norm1, packed row 6 (text)", "yes", "ok", "0.0554",
         "0.4475"],
        ["P/R", "NO", "step 0, alone (request 0): refiner.0.norm1, packed row 6 (text)",
         "no (step 0: 64 of 74 tensors differ)", "ok", "0.0517", "0.4016"],
        ["R/R", "yes", "none", "yes", "ok", "0.0517", "0.4396"],
    ]  # fmt: skip


PROFILED = {
    "ws1-block-real-medium": ("norm1", "layer 0", 3160, 65, "text"),
    "ws1-model-real-medium": ("refiner.0.norm1", "token refiner layer 0", 206, 6, "text"),
}


def _gate_plan(folder: Path) -> tuple[object, object]:
    """(the one gate entry planned for ``folder``, its profile series or None) - planning only."""
    from h3gate.report.extract import first_drift_profile
    from h3gate.report.loader import load_inventory
    from h3gate.report.plan import plan

    sections, others = plan(load_inventory([folder], verify=False))
    assert others == [] and len(sections) == 1
    (entry,) = sections[0].entries
    return entry, first_drift_profile(entry.documents[0].doc)


@pytest.mark.parametrize("name", sorted(PROFILED))
def test_evidence_with_a_first_drift_profile_gets_the_profile_figure_drawn_from_every_row(name):
    """The committed medium gates record ``first_drift_profile``: the page plans the profile figure (before the
    recorded-rows figure), its series are the evidence's every row, and the page text no longer says per-row errors
    are not recorded."""
    node, where, rows, first_row, modality = PROFILED[name]
    entry, profile = _gate_plan(H200 / name)
    doc = entry.documents[0].doc
    assert [(f.id, f.title) for f in entry.figures][1] == (
        f"{name}.first-drift-profile",
        f"{name}: per-row error / bound of the first-drift node {node} ({where}, chained view), by modality",
    )
    assert [f.id.rsplit(".", 1)[1] for f in entry.figures] == ["node-map", "first-drift-profile", "first-drift-rows"]
    assert (profile.node, profile.rows, profile.first_row, profile.first_modality) == (node, rows, first_row, modality)
    assert profile.error == doc["first_drift_profile"]["error"] and profile.bound == doc["first_drift_profile"]["bound"]
    assert sum(n for _, _, n in profile.runs) == rows and profile.modality_of(first_row) == modality
    assert max(v for v in profile.ratio if v is not None) < 1  # both pass: every row under its bound
    notes = " ".join(entry.notes)
    assert f"every one of the {rows} rows of {node}" in notes and "Per-row errors are not recorded" not in notes


def test_the_profile_figure_is_drawn_from_the_profile_and_older_evidence_falls_back(tmp_path):
    """A copy of the committed medium block gate, three ways: as committed (profile figure), with one row's error
    raised over its bound (the drawn figure changes and marks it: it is drawn from the field), and without the
    field (older evidence: no profile figure, the recorded-rows figure and a page saying per-row errors are not
    recorded)."""
    from h3gate.report.figures import draw_profile, to_png

    doc = json.loads((H200 / "ws1-block-real-medium" / "ws1-block.json").read_text(encoding="utf-8"))
    over = json.loads(json.dumps(doc))
    over["first_drift_profile"]["error"][2000] = 3 * over["first_drift_profile"]["bound"][2000]
    old = {k: v for k, v in doc.items() if k != "first_drift_profile"}
    for label, body in (("as-committed", doc), ("over", over), ("older", old)):
        (tmp_path / "ev" / label).mkdir(parents=True)
        (tmp_path / "ev" / label / "ws1-block.json").write_text(json.dumps(body), encoding="utf-8")
    (entry, profile), (over_entry, over_profile) = (_gate_plan(tmp_path / "ev" / x) for x in ("as-committed", "over"))
    assert over_profile.error[2000] > over_profile.bound[2000] and over_profile.modality_of(2000) == "video"
    assert max(over_profile.ratio) == pytest.approx(3.0) and max(profile.ratio) < 1
    drawn = [to_png(draw_profile(p, "t")) for p in (profile, over_profile)]
    assert drawn[0] != drawn[1]  # negative control: a figure that ignored the profile would not change
    older, _ = _gate_plan(tmp_path / "ev" / "older")
    assert [f.id for f in older.figures] == ["older.node-map", "older.first-drift-rows"]
    assert "no first_drift_profile" in " ".join(older.notes)
    code, out, err = _cli("report", tmp_path / "ev", "--out", tmp_path / "out")
    assert (code, err) == (0, "") and "3 evidence documents, 8 figures" in out, out + err
    page = html.unescape((tmp_path / "out" / "index.html").read_text(encoding="utf-8"))
    assert "Per-row errors are not recorded in this evidence (no first_drift_profile" in page  # the older copy only
    assert page.count("The first-drift profile draws every one of the 3160 rows of norm1") == 2
    for label in ("as-committed", "over"):
        _assert_not_blank(tmp_path / "out" / f"ev-{label}.first-drift-profile.png")
    assert sorted(p.name for p in (tmp_path / "out").glob("ev-older.*")) == [
        "ev-older.first-drift-rows.png", "ev-older.node-map.png",
    ]  # fmt: skip


def _arms_document(folder: Path) -> Path:
    """A small arms document built from the committed fault run: one arm (R/R), four steps, byte-equal at steps 0
    and 1, a first drift at step 2, and at step 3 bits that differ with no rel_l2 recorded (a zero reference)."""
    doc = json.loads((H200 / "arms-real-medium-fault" / "arms.json").read_text(encoding="utf-8"))
    arm = doc["arms"][0]
    drifting = arm["steps"][0]
    equal = json.loads(json.dumps(drifting))
    for request in equal["requests"]:
        for cells in request.values():
            cells.update({c: {"bitwise": True, "max_abs": 0.0, "rel_l2": 0.0} for c in cells})
    equal["byte_equal"] = True
    equal["gradients"] = {"repeat_bitwise": True, "differing": 0, "first_differing": None, "finite": True, "count": 88}
    unsized = json.loads(json.dumps(equal))
    unsized["byte_equal"] = False
    unsized["requests"][1]["video"]["alone"] = {"bitwise": False, "max_abs": 1e-3, "rel_l2": None}
    arm["steps"] = [{**s, "step": i} for i, s in enumerate([equal, equal, drifting, unsized])]
    arm["first_drift_step"] = 2
    arm["first_drift"] = {**arm["first_drift"], "step": 2, "request": 1}
    path = folder / "arms-small" / "arms.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path.parent


def test_a_small_arms_document_draws_byte_equal_steps_on_the_zero_line_and_names_its_first_drift(tmp_path):
    from h3gate.report.series import arm_drifts

    evidence = _arms_document(tmp_path)
    (drift,) = arm_drifts(json.loads((evidence / "arms.json").read_text(encoding="utf-8")))
    assert drift.steps == [0, 1, 2, 3] and drift.first_step == 2
    assert drift.series["video"][:2] == [0.0, 0.0] and drift.series["video"][2] > 0 and drift.series["video"][3] is None
    assert drift.differs["video"] == [False, False, True, True] and drift.series["audio"][3] == 0.0
    code, out, err = _cli("report", evidence, "--out", tmp_path / "out")
    assert (code, err) == (0, "") and "1 evidence document, 1 figure" in out, out + err
    raw = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    page = html.unescape(raw)
    assert _figures(raw) == [{
        "id": "arms-small.arms-drift",
        "title": "arms-small: training vs rollout velocity drift per step, per arm - full training, fail",
    }]  # fmt: skip
    row = ("<td>R/R</td><td>NO</td><td>step 2, batch.pass2 (request 1): block.0.o_proj, packed row 300 (video)</td>"
           "<td>no (step 2: 88 of 88 tensors differ)</td><td>- (no LoRA: full training)</td><td>0.737</td>"
           "<td>0.7376</td>")  # fmt: skip
    assert row in page and "first drift at step 2: R/R" in page  # the table, and the at-a-glance key result
    assert "injected fault (negative control)" in page and "block.0.o_proj:300" in page
    _assert_not_blank(tmp_path / "out" / "arms-small.arms-drift.png")


def test_inputs_without_evidence_give_a_page_saying_so(tmp_path):
    (tmp_path / "empty").mkdir()
    code, out, err = _cli("report", tmp_path / "empty", "--out", tmp_path / "out")
    assert code == 0 and "0 evidence documents, 0 figures" in out
    assert out.splitlines()[-1] == "verdict: incomplete (no evidence found; the page says what is missing)"
    empty = tmp_path / "empty"
    assert err.strip() == f"h3gate: warning: report: no evidence found in {empty}; the page says what is missing"
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    assert "No evidence found" in page and "no evidence documents" in page and "<img" not in page
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.html"]


def _places(tmp: Path) -> dict[str, Path]:
    ev = _small_evidence(tmp / "ev") if not (tmp / "ev").exists() else tmp / "ev"
    (tmp / "afile").write_text("x", encoding="utf-8")
    (tmp / "notev.json").write_text('{"a": 1}', encoding="utf-8")
    for name, text in (("bad", "notjson{"), ("invalid", '{"kind": "ws1-block", "schema_version": 1}')):
        (tmp / name).mkdir(exist_ok=True)
        (tmp / name / "x.json").write_text(text, encoding="utf-8")
    (tmp / "bogus").mkdir(exist_ok=True)
    (tmp / "bogus" / "x.json").write_text('{"kind": "bogus"}', encoding="utf-8")
    (tmp / "busy").mkdir(exist_ok=True)
    (tmp / "busy" / "keep.txt").write_text("x", encoding="utf-8")
    return {"ev": ev, "afile": tmp / "afile", "notev": tmp / "notev.json", "bad": tmp / "bad", "busy": tmp / "busy",
            "invalid": tmp / "invalid", "bogus": tmp / "bogus", "missing": tmp / "missing", "out": tmp / "out",
            "cpu": CPU, "incpu": CPU / "report"}  # fmt: skip


BAD = [
    (["{missing}", "--out", "{out}"], "missing: no such evidence file or folder"),
    (["{afile}", "--out", "{out}"], "afile: not an evidence file (a .json evidence document, or a folder of them)"),
    (["{notev}", "--out", "{out}"], "notev.json: not an evidence document (a JSON object with a string 'kind')"),
    (["{bad}", "--out", "{out}"], "bad/x.json: malformed JSON"),
    (["{invalid}", "--out", "{out}"], "invalid/x.json: $: 'provenance' is a required property"),
    (["{bogus}", "--out", "{out}"], "bogus/x.json: kind 'bogus': no schema"),
    (["{ev}", "--out", "{afile}"], "--out {afile}: exists and is not a folder"),
    (["{ev}", "--out", "{ev}/report"], "--out {ev}/report: lies inside the input {ev}"),
    (["{ev}", "--out", "{busy}"], "--out {busy}: holds files that are not an h3gate report"),
    (["{ev}", "--out", "{incpu}"], "--out evidence/cpu/report: lies inside the sealed folder evidence/cpu"),
    (["--out", "{out}"], "Missing argument 'paths'"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_bad_inputs_are_exit_2_and_one_line_with_nothing_written(tmp_path, args, message):
    places = _places(tmp_path)
    code, out, err = _cli("report", *(a.format(**places) for a in args))
    assert (code, out) == (2, "")
    assert err.startswith("h3gate: error: ") and err.count("\n") == 1, err
    assert message.format(**places) in err, err
    assert not places["out"].exists() and not places["incpu"].exists() and not (places["ev"] / "report").exists()
    assert sorted(p.name for p in places["busy"].iterdir()) == ["keep.txt"]


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, out, err = _cli("report", CPU, "--out", tmp_path / "out")
    assert (code, out, err) == (2, "", NEEDS_MATPLOTLIB + "\n")
    assert not (tmp_path / "out").exists()


def test_a_previous_report_is_replaced_whole_and_open_opens_it(tmp_path, monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or False)
    out = tmp_path / "out"
    assert _cli("report", CPU, "--out", out)[0] == 0
    (out / "stale.png").write_bytes(b"x")  # a figure of an older report: gone after the next one
    code, _, err = _cli("report", CPU, "--out", out, "--open")
    assert (code, err) == (0, "") and not (out / "stale.png").exists()
    assert opened == [(out / "index.html").resolve().as_uri()]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it
    assert len(list(out.glob("*.png"))) == 2


def test_a_changed_sealed_file_shows_a_failed_seal_verified_in_the_worker_process(tmp_path, monkeypatch):
    monkeypatch.setattr("h3gate.report.loader.BACKGROUND_BYTES", 0)  # verify in a worker process, as for H200
    sealed = tmp_path / "cpu"
    shutil.copytree(CPU, sealed)
    doc = sealed / "ws1-block-tiny-fault-matrix" / "ws1-block.json"
    doc.write_text(doc.read_text(encoding="utf-8") + "\n", encoding="utf-8")  # still valid, no longer the sealed bytes
    code, out, err = _cli("report", sealed, "--out", tmp_path / "out")
    assert (code, err) == (0, "") and out.splitlines()[-2].endswith(f"seals: {sealed} failed"), out
    assert out.splitlines()[-1] == "verdict: complete (1 evidence document, 2 figures)"
    page = html.unescape((tmp_path / "out" / "index.html").read_text(encoding="utf-8"))
    assert "changed since sealing" in page and "changed: ws1-block-tiny-fault-matrix/ws1-block.json" in page


# ---- headless Chromium --------------------------------------------------------------------------------------------

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", "--net-log-capture-mode=Everything",
    "--window-size=1400,2000",
]  # fmt: skip


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("H3GATE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("H3GATE_REQUIRE_CHROMIUM=1 but chromium is not on PATH (apt-get install chromium)")
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    return found


def _page_requests(netlog: Path) -> list[str]:
    """URLs of the network requests a page made. The browser's own background requests carry no origin
    (``initiator: not an origin``); a page's carry its origin (``null`` for file://)."""
    text = netlog.read_text(encoding="utf-8")
    try:
        log = json.loads(text)
    except json.JSONDecodeError:  # a log not closed when the browser exited: close it
        log = json.loads(text.rstrip().rstrip(",") + "]}")
    types = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        started = types.get(event["type"]) == "URL_REQUEST_START_JOB" and "url" in params
        if started and params.get("initiator") != "not an origin":
            urls.append(str(params.get("url")))
    return [u for u in urls if not u.startswith(("file:", "data:"))]


def _render(chromium: str, page: Path, work: Path) -> tuple[Path, list[str]]:
    shot, netlog = work / f"{page.parent.name}.png", work / f"{page.parent.name}.netlog.json"
    args = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={work / 'profile'}", f"--log-net-log={netlog}"]
    done = subprocess.run([*args, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert shot.is_file() and netlog.is_file(), done.stderr[-2000:]
    return shot, _page_requests(netlog)


@pytest.mark.browser
def test_chromium_renders_the_pages_and_they_load_nothing_from_the_network(small_report, tmp_path):
    chromium = _chromium()
    probe = tmp_path / "probe" / "index.html"  # negative control: the check must see a page's external loads
    probe.parent.mkdir()
    probe.write_text('<p>probe</p><img src="https://example.com/x.png"><link rel="stylesheet" href="http://x.test/a">')
    _, urls = _render(chromium, probe, tmp_path)
    assert "https://example.com/x.png" in urls, urls
    for page in (COMMITTED / "index.html", small_report[0] / "index.html"):
        shot, urls = _render(chromium, page, tmp_path)
        assert urls == [], f"{page} made network requests: {urls}"
        assert _assert_not_blank(shot) == (1400, 2000)


def test_ws2_evidence_gets_its_section_with_one_row_per_rank():
    """``run ws2`` documents are planned in their own section (not listed as figure-less others): the topology, both
    byte-equality verdicts and one table row per rank, read from the document."""
    from h3gate.report.loader import load_inventory
    from h3gate.report.plan import plan

    folder = H200 / "ws2-tp8-real-block-medium"
    sections, others = plan(load_inventory([folder], verify=False))
    assert others == [] and [s.heading for s in sections] == ["Tensor / context parallel ranks (ws2)"]
    (entry,) = sections[0].entries
    facts = dict(entry.facts)
    doc = json.loads((folder / "ws2.json").read_text())
    assert facts["topology"].startswith("tp8: 8 gloo ranks") and facts["forward byte-equal"] == "yes"
    assert facts["backward byte-equal"] == ("yes" if doc["backward_byte_equal"] else "NO")
    head, rows = entry.table
    assert len(rows) == 8 and [r[0] for r in rows] == [str(i) for i in range(8)] and rows[7][2] == "[49, 56]"


def test_the_attention_bench_figure_holds_the_ungated_provider_and_backward_timings():
    """bench --op records time more than the gated ratio: the attention's forward against the provider (cuDNN on the
    H200) and its backward alone against the provider and the declared baseline. The figure draws them as grey
    (recorded, not gated) bars beside the declared target, with the record's own ratios."""
    from h3gate.report import series

    doc = json.loads((ROOT / "evidence" / "h200" / "bench-attention-768p" / "bench-ops.json").read_text())
    (op,) = doc["operators"]
    bars = {(b.label, b.baseline): b for b in series.op_speeds(doc)}
    gated = bars[("h3_full_attention", "sdpa_flash")]
    assert gated.target_kind == "declared target" and gated.ratio == op["target"]["ratio"] and gated.passed
    recorded = {
        ("h3_full_attention forward", "provider"): op["forward"]["speedup"],
        ("h3_full_attention backward", "provider"): op["backward"]["speedup"],
        ("h3_full_attention backward", "sdpa_flash"): op["backward"]["baseline_speedup"],
    }
    for key, ratio in recorded.items():
        assert bars[key].ratio == ratio and bars[key].target is None and bars[key].passed is None, key
    assert len(bars) == 4


def test_a_block_bench_with_its_forward_node_by_node_gets_the_node_figure():
    """``bench ws1-block`` records since session 16 hold the forward node by node: the page draws one figure per such
    record (provider and strict bars per node, in graph order, from the record's medians) and states the sums; a
    record without them (or with an arm missing) gets none."""
    from h3gate.report import charts, series
    from h3gate.report.loader import load_inventory
    from h3gate.report.plan import plan

    folder = H200 / "bench-ws1-block-medium"
    doc = json.loads((folder / "bench-ws1-block.json").read_text())
    times = series.node_times(doc, "medium")
    arms = doc["forward_nodes"]["arms"]
    assert times.nodes == list(arms["strict"]["nodes"]) and len(times.nodes) == 17
    assert times.strict == list(arms["strict"]["nodes"].values()) and times.provider_sum == arms["provider"]["sum_ms"]
    fig = charts.draw_node_times(times, "t")
    (ax,) = fig.axes
    assert len(ax.patches) == 2 * 17 and [t.get_text() for t in ax.get_yticklabels()] == times.nodes
    assert series.node_times({k: v for k, v in doc.items() if k != "forward_nodes"}, "x") is None
    one_arm = {**doc, "forward_nodes": {"arms": {"strict": arms["strict"]}}}
    assert series.node_times(one_arm, "x") is None
    sections, _ = plan(load_inventory([folder], verify=False))
    (entry,) = sections[0].entries
    assert [f.id for f in entry.figures] == [
        "benchmarks-block-model.speed",
        "benchmarks-block-model.nodes-bench-ws1-block-medium",
    ]
    assert any(text.startswith("sum of the nodes: strict ") for _, text in entry.facts)
    (steady,) = [text for label, text in entry.facts if label.endswith("the forward at the power cap")]
    fwd = doc["sustained"]["forward"]["arms"]
    assert f"strict {fwd['strict']['ms_per_call']:.3f} ms, provider {fwd['provider']['ms_per_call']:.3f} ms" in steady
    assert " J (" in steady and "looped alone" not in steady  # these records predate host_bound


def test_the_sustained_line_names_host_bound_nodes_and_says_nothing_without_a_record():
    from h3gate.report import series

    arm = {"calls": 3, "ms_per_call": 2.0, "host_ms_per_call": 0.5, "host_bound": False}
    node = {"arms": {"provider": arm, "strict": {**arm, "host_ms_per_call": 2.0, "host_bound": True}}}
    doc = {"sustained": {"forward": {"arms": {"provider": {**arm, "ms_per_call": 4.0}, "strict": arm},
                                     "energy": {"unavailable": "no NVML"}},
                         "forward_nodes": {"nodes": {"norm1": node, "o_proj": {"arms": {"strict": arm}}}}}}  # fmt: skip
    text = series.sustained_text(doc)
    assert "strict 2.000 ms, provider 4.000 ms a forward (0.500x)" in text and " J" not in text
    assert text.endswith("looped alone, the host was the limit for norm1")
    assert series.sustained_text({}) is None
    assert series.sustained_text({"sustained": {"forward": {"arms": {"strict": arm}}}}) is None
