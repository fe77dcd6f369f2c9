"""One verdict language (issue 42): every verb's last stdout line is ``verdict: pass|fail|complete|incomplete (...)``,
the lines above it say what was compared, no Python repr leaks into human output, and the main tables keep their
verdict columns and whole words in an 80-column terminal.

Cheap verbs run through the command line in-process (``run ws1-ops`` and ``ablate A0`` in test_cli_manners's progress
test, a failing ``validate`` in test_validate); the gates whose runs take long (ws1-block, ws2, arms, vae,
trajectories, bench) are rendered from committed evidence documents of their kind by the very functions the verbs
print with, and run through the command line in the ``slow`` test at the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from h3gate.commands import console
from h3gate.paths import CHECKOUT

VERDICT = re.compile(r"^verdict: (pass|fail|complete|incomplete) \(.+\)$")
REPR = re.compile(r"\bNone\b|\bTrue\b|\bFalse\b|\(row None")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
EVIDENCE = (CHECKOUT or Path.cwd()) / "evidence"


def verdict_of(out: str) -> str:
    """The verdict word of ``out``'s last line; fails on a missing verdict line or a Python repr in any line."""
    lines = out.rstrip("\n").splitlines()
    assert lines, "no stdout"
    match = VERDICT.match(lines[-1])
    assert match, f"last stdout line is not a verdict: {lines[-1]!r}"
    leaks = [line for line in lines if REPR.search(line)]
    assert leaks == [], f"Python reprs in human output: {leaks}"
    return match[1]


def test_the_verdict_check_fails_where_it_should():
    """Negative controls of :func:`verdict_of`: the old outputs it must refuse."""
    for bad in (
        "steps compared: 1; all equal: False; first drift step: 0\nevidence: x\n",  # compare, no verdict line
        "verdict: pass; evidence: x\n",  # ws1-trajectory's old line
        "1/1 rows match their expectation in 0.1 s\nevidence: x\n",  # ablate
        "first_drift: q_proj (row None, -)\nverdict: pass (0 failing checks)\n",  # a repr above the verdict
    ):
        with pytest.raises(AssertionError):
            verdict_of(bad)
    assert verdict_of("compared: a vs b\nverdict: fail (1 step compared; first difference at step 0)\n") == "fail"


def test_print_verdict_refuses_an_unknown_word_or_an_empty_reason(capsys):
    with pytest.raises(ValueError, match="not one of"):
        console.print_verdict("ok", "x")
    with pytest.raises(ValueError, match="reason"):
        console.print_verdict("pass", " ")
    console.print_verdict("incomplete", "1/6 steps saved", ["saved: a line above"])
    assert capsys.readouterr().out.splitlines() == ["saved: a line above", "verdict: incomplete (1/6 steps saved)"]


@pytest.fixture
def ablated(run_cli, tmp_path) -> Path:
    code, out, _ = run_cli("--quiet", "ablate", "H5", "--out", tmp_path / "ab")
    assert code == 0 and verdict_of(out) == "pass", out
    return tmp_path / "ab"


CHEAP = [
    (["schedule", "--steps", "3"], 0, "complete"),
    (["layout"], 0, "complete"),
    (["fingerprint", "--out", "{tmp}/fp"], 0, "complete"),
    (["synth-checkpoint", "--out", "{tmp}/ck"], 0, "complete"),
    (["keygen", "--out", "{tmp}/keys/seal.key"], 0, "complete"),
    (["ablate", "--list"], 0, "complete"),
    (["validate"], 0, "pass"),
]


@pytest.mark.parametrize(("args", "code", "verdict"), CHEAP, ids=[" ".join(a[:2]) for a, _, _ in CHEAP])
def test_every_cheap_verb_ends_with_its_verdict(run_cli, tmp_path, args, code, verdict):
    got, out, err = run_cli("--quiet", *(a.format(tmp=tmp_path) for a in args))
    assert got == code, out + err
    assert verdict_of(out) == verdict


def test_ablate_seal_verify_and_report_end_with_their_verdicts(run_cli, ablated, tmp_path):
    code, out, _ = run_cli("seal", ablated)
    assert code == 0 and verdict_of(out) == "complete" and "1 file sealed, unsigned" in out
    code, out, _ = run_cli("seal", ablated, "--verify")
    assert code == 0 and verdict_of(out) == "pass" and out.endswith("(seal verified: integrity)\n")
    assert "compared: every file under" in out
    code, out, _ = run_cli("--quiet", "report", ablated, "--out", tmp_path / "page")
    assert code == 0 and verdict_of(out) == "complete"
    (ablated / "ablation.json").write_text("{}", encoding="utf-8")  # negative control: a changed file
    code, out, _ = run_cli("seal", ablated, "--verify")
    assert code == 1 and verdict_of(out) == "fail"


def test_ablate_explains_what_a_row_compares(ablated, run_cli):
    code, out, _ = run_cli("--quiet", "ablate", "H5", "--out", ablated.parent / "again")
    lines = out.splitlines()
    assert lines[-1].startswith("verdict: pass (1/1 rows match their expectation in ")
    above = " ".join(lines[-5:-1])
    assert "each row's probe" in above and "the provider's ops" in above
    assert "synthetic seeded weights (seed 0)" in above


def _committed(kind: str) -> tuple[dict, Path]:
    """The newest committed evidence document of ``kind`` (by its provenance time), and its path."""
    docs = [(json.loads(p.read_text(encoding="utf-8")), p) for p in EVIDENCE.rglob(f"{kind}.json")]
    assert docs, f"no committed {kind}.json under {EVIDENCE}"
    return max(docs, key=lambda d: (d[0]["provenance"]["time_utc"], str(d[1])))


def _printers():
    from h3gate.commands import arms_cmd, bench_cmd, model_cmd, run_cmd, trajectory_cmd, vae_cmd, ws2_cmd

    return {
        "ws1-block": lambda d, p: run_cmd.print_table(d, p),
        "ws1-model": lambda d, p: model_cmd.print_summary(d, p),
        "ws2": lambda d, p: ws2_cmd._summary(d, p),
        "arms": lambda d, p: arms_cmd._summary(d, p),
        "vae": lambda d, p: vae_cmd._print(d, p),
        "ws1-trajectory": lambda d, p: trajectory_cmd._summary(d, p),
        "bench-ws1-block": lambda d, p: bench_cmd._print_phases("ws1-block", d, p, False),
        "bench-ops": lambda d, p: bench_cmd._table(d, p),
    }


@pytest.mark.parametrize("kind", list(_printers()))
def test_the_long_gates_print_their_verdict_last(kind, capsys):
    doc, path = _committed(kind)
    _printers()[kind](doc, path)
    out = capsys.readouterr().out
    word = verdict_of(out)
    if kind == "ws1-trajectory":  # nothing compared unless --verify-last ran or a determinism pair was
        pairs = sum(doc.get("determinism", {}).get("pairs", {}).values())
        compared = doc["invocation"]["verify_last"] is not None or pairs > 0
        assert word == (doc["verdict"] if compared else ("complete" if doc["complete"] else "incomplete"))
    elif kind != "bench-ws1-block":
        assert word == doc["verdict"]
    if kind in ("ws1-block", "ws1-model"):
        above = out.splitlines()[-3:-1]
        assert above[0].startswith("compared: ") and "vs the FP64 golden" in above[0], above
        assert "diffusers 0.42.1" in above[0] and above[1].startswith("first drift: "), above


def test_gate_lines_follow_the_runs_settings():
    from h3gate.commands.explain import gate_lines

    doc = {"mode": "strict", "checkpoint": {"kind": "synthetic", "seed": 3}, "first_drift": {"node": "q_proj"}}
    compared, drift = gate_lines(doc)
    assert "h3gate's strict kernels vs the provider" in compared and "synthetic seeded weights (seed 3)" in compared
    assert "allowed while every packed row stays within its bound" in drift
    real = {**doc, "checkpoint": {"kind": "diffusers", "path": "/ckpt/transformer"}, "first_drift": None}
    real["candidate"] = {"versions": {"sglang": "0.5.23"}, "quality": "exact"}
    compared, drift = gate_lines(real)
    assert "SGLang 0.5.23's DiT (quality exact)" in compared and "the checkpoint /ckpt/transformer" in compared
    assert "synthetic" not in compared and drift.startswith("first drift: none")


def test_trajectory_says_pass_only_when_it_compared():
    from h3gate.commands.trajectory_cmd import trajectory_verdict

    body = {"steps_saved": 2, "evaluations": 6, "complete": False, "verdict": "pass",
            "invocation": {"verify_last": None}}  # fmt: skip
    assert trajectory_verdict(body) == ("incomplete", "2/6 steps saved; --resume continues, nothing compared")
    done = {**body, "steps_saved": 6, "complete": True}
    assert trajectory_verdict(done) == ("complete", "6/6 steps saved; nothing compared")
    verified = {**done, "invocation": {"verify_last": {"step": 5, "bitwise": True}}}
    assert trajectory_verdict(verified) == ("pass", "step 5 recomputed bitwise; 6/6 steps saved")
    differs = {**done, "verdict": "fail", "invocation": {"verify_last": {"step": 5, "bitwise": False}}}
    assert trajectory_verdict(differs)[0] == "fail"
    # a run that evaluated its first step twice compared every node's pair; one that evaluated nothing did not
    paired = {**body, "determinism": {"pairs": {"candidate": 63}}}
    assert trajectory_verdict(paired) == ("pass", "63 determinism pairs; 2/6 steps saved")
    idle = {**done, "verdict": "complete", "determinism": {"pairs": {}}}
    assert trajectory_verdict(idle) == ("complete", "6/6 steps saved; nothing compared")


def test_compare_fails_naming_the_first_difference():
    from h3gate.commands.compare_cmd import _verdict

    drift = {"step": 2, "node": "block.0.o_proj", "stage": "block.0", "layer": 0, "row": 7, "modality": "video"}
    body = {"steps_compared": 4, "all_equal": False, "first_drift_step": 2, "first_drift": drift}
    assert _verdict(body) == (
        "fail", "4 steps compared; first difference at step 2, block.0.o_proj (stage block.0, layer 0, row 7, video)"
    )  # fmt: skip
    whole = {**body, "first_drift": {**drift, "layer": None, "row": None}}
    assert "None" not in _verdict(whole)[1] and "whole tensor" in _verdict(whole)[1]
    assert _verdict({**body, "all_equal": True}) == ("pass", "4 steps compared, all byte-equal")


# ---- 80 columns -----------------------------------------------------------------------------------------------------


@pytest.fixture
def terminal_80(monkeypatch, capsys):
    """Call it first in the test: stdout (capsys's, active only in the test's body) becomes an 80-column terminal
    (rich reads COLUMNS on a TTY); returns the reader of the captured text, escape codes removed."""
    import sys

    def start():
        monkeypatch.setenv("COLUMNS", "80")
        monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
        assert console.stdout_console().width == 80
        return lambda: ANSI.sub("", capsys.readouterr().out)

    console.set_wide(False)
    yield start
    console.set_wide(False)


def _header(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("┃"))


@pytest.mark.parametrize(
    ("kind", "verdict_columns", "optional"),
    [
        ("ws1-block", ("node", "repeat", "batch", "worst row / bound", "ok"), "owner row"),
        ("ws1-model", ("stage", "failing nodes", "failing grads", "worst row / bound"), "params"),
    ],
)
def test_gate_tables_fit_80_columns_and_keep_their_verdict_columns(terminal_80, kind, verdict_columns, optional):
    read = terminal_80()
    doc, path = _committed(kind)
    _printers()[kind](doc, path)
    out = read()
    header = _header(out)
    for col in verdict_columns:
        assert f" {col} " in header, (col, header)
    assert f" {optional} " not in header and "--wide shows every column" in out
    assert [line for line in out.splitlines() if len(line) > 80] == []
    verdict_of(out)
    console.set_wide(True)  # --wide: every column, past the terminal's edge (the negative control of the fit)
    _printers()[kind](doc, path)
    wide = read()
    assert f" {optional} " in _header(wide) and max(len(line) for line in wide.splitlines()) > 80


def test_ablate_table_fits_80_columns_with_whole_words(terminal_80, run_cli, tmp_path):
    terminal_80()
    code, out, _ = run_cli("--quiet", "ablate", "H5", "--out", tmp_path / "ab")  # run_cli reads the capture
    out = ANSI.sub("", out)
    assert code == 0
    header = _header(out)
    for col in ("row", "observed", "first drift / reason", "verdict"):
        assert f" {col} " in header, (col, header)
    assert [line for line in out.splitlines() if len(line) > 80] == []
    row = next(line for line in out.splitlines() if line.startswith("│ H5 "))
    assert " EXPECTED_DRIFT " in row and " pass " in row, row  # whole words, the verdict column drawn
    verdict_of(out)


def test_piped_output_keeps_its_wide_width(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert console.stdout_console().width == console.PIPE_WIDTH


@pytest.mark.slow
def test_the_long_verbs_end_with_their_verdict(run_cli, tmp_path):
    """The gates the cheap tests render from committed evidence, run for real (CPU, tiny shapes)."""
    runs = [
        (["run", "ws1-block", "--no-backward", "--mode", "off", "--out", "{tmp}/b"], "pass"),
        (["run", "ws1-trajectory", "--steps", "2", "--out", "{tmp}/t1"], "pass"),  # its step and the step's repeat
        (["run", "ws1-trajectory", "--steps", "2", "--out", "{tmp}/t2", "--mode", "off"], "pass"),
        (["compare", "{tmp}/t1", "{tmp}/t2", "--out", "{tmp}/c"], "fail"),
        (["run", "vae", "--modality", "audio", "--out", "{tmp}/v"], "pass"),
        (["run", "ws2", "--topology", "tp2", "--out", "{tmp}/w"], "pass"),
    ]
    for args, verdict in runs:
        code, out, err = run_cli("--quiet", *(a.format(tmp=tmp_path) for a in args))
        assert code in (0, 1), out + err
        assert verdict_of(out) == verdict, args
