"""CLI manners: piped tables keep whole words, every option has help, progress lines on stderr (and ``--quiet``),
fingerprint says which config fields differ from the manifest and why the checkpoint still matches, and every
command takes one settings object."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from h3gate.commands import console
from h3gate.manifests.ablations import load_ablations

PROGRESS = re.compile(r"^h3gate: (?P<verb>[\w -]+): (?P<label>.+) \((?:(?P<i>\d+)/(?P<n>\d+), )?\d+\.\d s\)$")


def _walk(command, path: str = "h3gate") -> Iterator[tuple[str, object]]:
    """Every (command path, parameter) of the click tree Typer builds, groups included."""
    for param in command.params:
        yield path, param
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, f"{path} {name}")


def test_every_option_and_argument_has_help():
    import typer

    from h3gate.cli import app

    tree = typer.main.get_command(app)
    params = list(_walk(tree))
    assert len(params) > 50 and any(p.name == "quiet" for _, p in params)
    missing = [f"{path}: {p.opts[0] if p.opts else p.name}" for path, p in params if not (p.help or "").strip()]
    assert missing == [], "options / arguments without help text:\n" + "\n".join(missing)


def _frozen_dataclasses(tree: ast.Module) -> set[str]:
    def frozen(d: ast.expr) -> bool:
        return isinstance(d, ast.Call) and any(
            k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True for k in d.keywords
        )

    return {n.name for n in tree.body if isinstance(n, ast.ClassDef) and any(frozen(d) for d in n.decorator_list)}


def test_every_command_takes_one_settings_object():
    """``commands/<verb>_cmd.py``: each ``*_command`` takes one argument, a frozen dataclass of its module, and
    returns an exit code (DESIGN.md, "Adding a verb")."""
    import h3gate.commands

    found, wrong = [], []
    for path in sorted(Path(h3gate.commands.__file__).parent.glob("*_cmd.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        settings = _frozen_dataclasses(tree)
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_command")):
            found.append(fn.name)
            args = fn.args
            one = len(args.args) == 1 and not (args.posonlyargs or args.kwonlyargs or args.vararg or args.kwarg)
            hint = ast.unparse(args.args[0].annotation) if one and args.args[0].annotation else None
            if not one or hint not in settings or fn.returns is None or ast.unparse(fn.returns) != "int":
                wrong.append(f"{path.name}: {fn.name}({ast.unparse(args)})")
    assert len(found) >= 18, found
    assert wrong == [], "commands not taking one frozen settings dataclass:\n" + "\n".join(wrong)


def test_ablate_list_piped_keeps_whole_words(run_cli):
    """Not a TTY (captured): the table renders at its natural width; no cell is folded mid-word."""
    code, out, err = run_cli("ablate", "--list")
    assert (code, err) == (0, "")
    rows = load_ablations()
    lines = out.splitlines()
    for row_id, row in rows.items():
        line = next((ln for ln in lines if ln.startswith(f"│ {row_id} ")), None)
        assert line is not None, f"row {row_id} is not on a line of its own"
        for cell in (row.factor, row.run, row.probe, row.expected.result):
            assert f" {cell} " in line, (row_id, cell, line)
    assert "EXPECTED_DRIFT" in out and "EXPECTED_DRI " not in out
    assert max(len(ln) for ln in lines) > 80  # wider than the 80 columns rich assumes for a pipe


def test_stdout_console_is_wide_when_piped(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert console.stdout_console().width == console.PIPE_WIDTH


def _progress_lines(err: str) -> list[re.Match]:
    matches = [PROGRESS.match(line) for line in err.splitlines()]
    assert all(matches), err
    return matches


@pytest.mark.parametrize(
    ("args", "verb", "first"),
    [
        (["run", "ws1-ops", "--device", "cpu", "--op", "conditioning_noise_mix"], "ws1-ops", "conditioning_noise_mix"),
        (["ablate", "A0"], "ablate", "row A0 (forward)"),
    ],
)
def test_progress_lines_on_stderr_and_quiet(run_cli, tmp_path, args, verb, first):
    code, out, err = run_cli(*args, "--out", tmp_path / "a")
    assert code == 0, out + err
    assert re.match(r"verdict: pass \(.+\)$", out.splitlines()[-1]), out  # the verdict line is stdout's last
    (m,) = _progress_lines(err)
    assert (m["verb"], m["i"], m["n"]) == (verb, "1", "1") and m["label"].startswith(first), err
    code, out, err = run_cli("--quiet", *args, "--out", tmp_path / "b", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["verdict"] == "pass"
    code, _, err = run_cli(*args, "--out", tmp_path / "c", "--json")  # progress is stderr: --json keeps it
    assert code == 0 and len(_progress_lines(err)) == 1


def test_line_reporter_counts_and_throttles(capsys):
    step = console.LineReporter("ws1-block", 3)
    for label in ("forward: provider", "forward: candidate", "backward: candidate"):
        step(label)
    lines = capsys.readouterr().err.splitlines()
    assert [PROGRESS.match(ln)["i"] for ln in lines] == ["1", "2", "3"]
    assert lines[1].startswith("h3gate: ws1-block: forward: candidate (2/3, ")
    throttled = console.LineReporter("fingerprint", None, every_s=3600)
    for i in range(5):
        throttled(f"sha256 t{i}")
    (line,) = capsys.readouterr().err.splitlines()  # the first step prints; the next ones fall in its hour
    assert PROGRESS.match(line) and line.startswith("h3gate: fingerprint: sha256 t0 (")


def test_quiet_silences_the_reporter(capsys):
    console.set_quiet(True)
    try:
        with console.progress("ws1-block", 2) as step:
            step("forward: provider")
    finally:
        console.set_quiet(False)
    assert capsys.readouterr().err == ""


def test_fingerprint_reports_differing_config_fields(run_cli, tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("manners", "ck", 0)
    code, out, _ = run_cli("fingerprint", "--checkpoint", ckpt, "--out", tmp_path / "ev")
    assert code == 0
    assert "config differs from the manifest" in out and "MATCH" in out
    section = out[out.index("config fields that differ from the manifest") :].split("└")[0]
    table = {m[1]: (m[2], m[3]) for m in re.finditer(r"│ (\w+) +│ +(\S+) │ +(\S+) │", section)}
    assert table["hidden_size"] == ("5376", "192") and table["num_layers"] == ("50", "2")
    assert "The expected inventory is computed from the config the checkpoint is checked with" in out
    assert "the manifest fixes the released sizes" in out
    code, out, _ = run_cli("fingerprint", "--checkpoint", ckpt, "--out", tmp_path / "ev", "--force", "--json")
    r = json.loads(out)["checkpoint"]
    diffs = {d["field"]: (d["manifest"], d["checkpoint"]) for d in r["config_differences"]}
    assert diffs["hidden_size"] == (5376, 192) and set(diffs) == set(table)
    assert r["config_note"].startswith(f"{len(diffs)} config field(s) differ from the manifest (")
    assert "config.json" in r["config_note"]
    evidence = json.loads((tmp_path / "ev" / "fingerprint.json").read_text(encoding="utf-8"))
    assert evidence["checkpoint"]["config_note"] == r["config_note"]
    code, out, _ = run_cli("fingerprint", "--checkpoint", ckpt, "--config", "real", "--out", tmp_path / "x", "--json")
    r = json.loads(out)["checkpoint"]
    assert code == 1 and r["config_differences"] == [] and r["config_note"] is None


# ---- issue 42.4: --version, completion, global flags after the verb, --json, keygen's folders, ranks' progress,
# h3gate.strict, Triton's interpreter selected too late


def test_version_names_h3gate_torch_and_triton(run_cli):
    import h3gate

    code, out, err = run_cli("--version")
    assert (code, err) == (0, "")
    assert re.fullmatch(rf"h3gate {re.escape(h3gate.__version__)} \(torch \S+, triton \S+, python \S+\)\n", out), out


def test_shell_completion_is_on_and_goes_through_the_boundary(run_cli, monkeypatch):
    import shellingham

    # Typer detects the shell from the process tree (an xdist worker's parent is no shell): pin it to bash.
    monkeypatch.setattr(shellingham, "detect_shell", lambda *a, **k: ("bash", "/bin/bash"))
    code, out, _ = run_cli("--show-completion", "bash")
    assert code == 0 and "_H3GATE_COMPLETE" in out  # the variable of the program name h3gate, not __main__.py


@pytest.mark.parametrize("flag", ["--quiet", "-q"])
def test_global_flags_are_accepted_after_the_verb(run_cli, tmp_path, flag):
    code, out, err = run_cli("ablate", "H5", "--out", tmp_path / "a", flag)
    assert (code, err) == (0, ""), err  # --quiet took effect: no progress line
    assert out.splitlines()[-1].startswith("verdict: pass (")
    code, _, err = run_cli("ablate", "H5", "--out", tmp_path / "b")
    assert code == 0 and _progress_lines(err)  # negative control: without the flag, progress prints


def test_global_flags_move_before_the_verb_but_not_past_a_double_dash():
    from h3gate.cli.base import global_flags_first

    assert global_flags_first(["run", "ws1-block", "--quiet", "--debug"]) == ["--quiet", "--debug", "run", "ws1-block"]
    after_dashes = ["ablate", "H5", "--wide", "--", "--quiet"]
    assert global_flags_first(after_dashes) == ["--wide", "ablate", "H5", "--", "--quiet"]
    assert global_flags_first(["--quiet", "schedule"]) == ["--quiet", "schedule"]


def test_json_on_keygen_synth_seal_and_report(run_cli, tmp_path):
    code, out, _ = run_cli("keygen", "--out", tmp_path / "k" / "seal.key", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "complete" and len(json.loads(out)["key_sha256"]) == 64
    code, out, _ = run_cli("synth-checkpoint", "--out", tmp_path / "ck", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "complete" and json.loads(out)["tensors"] > 0
    code, _, _ = run_cli("--quiet", "ablate", "H5", "--out", tmp_path / "ev")
    code, out, _ = run_cli("seal", tmp_path / "ev", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "complete" and json.loads(out)["files"]
    code, out, _ = run_cli("seal", tmp_path / "ev", "--verify", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "pass"
    code, out, _ = run_cli("--quiet", "report", tmp_path / "ev", "--out", tmp_path / "page", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "complete" and json.loads(out)["documents"] == 1


def test_keygen_makes_its_missing_folders_private(run_cli, tmp_path):
    import stat

    (tmp_path / "home").mkdir(mode=0o755)
    key = tmp_path / "home" / ".h3gate" / "keys" / "seal.key"
    code, _, err = run_cli("keygen", "--out", key)
    assert code == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (key.parent.parent, key.parent, tmp_path / "home")}
    assert modes == {".h3gate": 0o700, "keys": 0o700, "home": 0o755}  # an existing folder is left as it was
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli("keygen", "--out", tmp_path / "file" / "seal.key")
    assert code == 2 and err.startswith("h3gate: error: ") and "is not a folder" in err


def test_ranks_report_each_finished_rank_and_a_heartbeat(tmp_path, monkeypatch):
    import subprocess
    import sys

    from h3gate import ranks

    monkeypatch.setattr(ranks, "POLL_S", 0.02)
    monkeypatch.setattr(ranks, "HEARTBEAT_S", 0.05)
    (tmp_path / "rank-1.json").write_text("{}")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4)"])
    heard: list[str] = []
    assert ranks._wait(proc, 2, 30, heard.append, lambda r: tmp_path / f"rank-{r}.json") == 0
    assert heard[0] == "rank 1 of 2 finished" and "rank 0 of 2 finished" not in heard
    assert "1 of 2 ranks running" in heard  # the heartbeat while rank 0 has not finished


def test_import_h3gate_is_light_and_exposes_strict(monkeypatch):
    import h3gate

    tree = ast.parse(Path(h3gate.__file__).read_text(encoding="utf-8"))
    eager = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    eager |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert eager <= {"importlib", "__future__"}, eager  # `import h3gate` imports no torch, no triton
    monkeypatch.delattr(h3gate, "strict", raising=False)  # as in a fresh process: the submodule not yet imported
    assert callable(h3gate.strict) and h3gate.strict.__name__ == "h3gate.strict" and "strict" in dir(h3gate)
    with pytest.raises(AttributeError, match="no attribute 'strictt'"):
        h3gate.strictt  # noqa: B018


def test_cpu_kernels_after_triton_was_imported_without_the_interpreter(monkeypatch, run_cli):
    import triton.language  # noqa: F401 - the situation: Triton loaded before the interpreter was chosen
    from triton.language import standard

    from h3gate.errors import InputError
    from h3gate.numerics import INTERPRETER_TOO_LATE, interpreter_problem, select_interpreter
    from h3gate.ops.registry import kernel_runnable

    assert interpreter_problem() is None and kernel_runnable("cpu") == (True, "")  # negative control: this process
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(InputError, match="Triton was imported before TRITON_INTERPRET=1 was set"):
        select_interpreter("cpu")
    code, out, err = run_cli("run", "ws1-block", "--device", "cpu")
    assert (code, out) == (2, "") and err == f"h3gate: error: --device cpu: {INTERPRETER_TOO_LATE}\n"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # set after Triton compiled its own library: the mixed state
    monkeypatch.setattr(standard, "cdiv", object())
    assert interpreter_problem() == INTERPRETER_TOO_LATE
    assert kernel_runnable("cpu") == (False, INTERPRETER_TOO_LATE)  # strict mode refuses naming it (exit 2)
