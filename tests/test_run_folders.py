"""Run folders (:mod:`h3gate.evidence.runfolder`): no run replaces another's evidence without ``--force``; each default
run gets its own folder and ``latest``; a held lock refuses a second run; a killed run's temp files are cleaned by
the next run and never sealed; a refused run leaves nothing behind.

``fingerprint`` (the manifest alone, well under a second in process) stands in for every verb: they all get their
folder through the same ``enter_run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h3gate.commands import checkpoint_cmd
from h3gate.errors import InputError
from h3gate.evidence.runfolder import LATEST, LOCK_NAME, UNFINISHED_NAME, open_run, refuse_unfinished


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: files with their bytes, folders and links as None."""
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def local(tmp_path, monkeypatch) -> Path:
    """The default evidence root of this test (``fingerprint`` writes ``<root>/fingerprint/<run>/``)."""
    root = tmp_path / "local"
    monkeypatch.setattr(checkpoint_cmd, "LOCAL_EVIDENCE", root)
    return root


def _fingerprint(run_cli, *args) -> tuple[int, str, str]:
    return run_cli("--quiet", "fingerprint", *args)


def test_two_default_runs_keep_both_records_and_latest_points_at_the_second(run_cli, local):
    paths = []
    for _ in range(2):
        code, out, err = _fingerprint(run_cli, "--json")
        assert code == 0, err
        paths.append(Path(json.loads(out)["evidence"]))
    parent = local / "fingerprint"
    first, second = (p.parent for p in paths)
    assert first != second and first.parent == second.parent == parent
    assert all(p.is_file() for p in paths)  # both records kept
    runs = sorted(p.name for p in parent.iterdir() if p.name != LATEST)
    assert runs == sorted([first.name, second.name])
    assert (parent / LATEST).is_symlink() and os.readlink(parent / LATEST) == second.name  # relative, the second
    for run in (first, second):  # complete: no lock, no marker, no temp file left
        assert sorted(p.name for p in run.iterdir()) == ["fingerprint.json"]


def test_an_explicit_out_holding_evidence_is_refused_without_force_and_replaced_with_it(run_cli, local, tmp_path):
    out = tmp_path / "ev"
    assert _fingerprint(run_cli, "--out", out)[0] == 0
    (out / "SEAL.json.keep").write_text("x", encoding="utf-8")
    before, inode = _tree(out), (out / "fingerprint.json").stat().st_ino
    code, stdout, err = _fingerprint(run_cli, "--out", out)
    assert code == 2 and stdout == ""
    assert err == f"h3gate: error: --out {out}: holds h3gate evidence (fingerprint.json); --force replaces it (or " \
        "leave out --out: each run then writes a new folder)\n"  # fmt: skip
    assert _tree(out) == before  # the refused run touched nothing
    assert not local.exists()  # and wrote nowhere else
    code, stdout, err = _fingerprint(run_cli, "--out", out, "--force", "--json")
    assert code == 0, err
    assert json.loads(stdout)["evidence"] == str(out / "fingerprint.json")
    assert sorted(p.name for p in out.iterdir()) == ["SEAL.json.keep", "fingerprint.json"]
    assert (out / "fingerprint.json").stat().st_ino != inode  # a new record replaced the old one


def test_a_held_lock_refuses_a_second_run_naming_the_holder(run_cli, local, tmp_path):
    out = tmp_path / "busy"
    with open_run(out, local, force=False) as held:  # this process holds the lock through its own descriptor
        assert (out / LOCK_NAME).is_file() and (out / UNFINISHED_NAME).is_file()
        record = json.loads((out / LOCK_NAME).read_text(encoding="utf-8"))
        code, stdout, err = _fingerprint(run_cli, "--out", out, "--force")
        assert code == 2 and stdout == "" and err.count("\n") == 1
        assert err.startswith(f"h3gate: error: {out}: in use by pid {os.getpid()} ({record['command']}, started ")
        for verify in ([], ["--verify"]):  # seal refuses a folder a run is writing (negative control: held lock)
            code, _, err = run_cli("seal", out, *verify)
            assert code == 2 and f"in use by pid {os.getpid()}" in err and err.count("\n") == 1
        (held.path / "fingerprint.json").write_text("{}", encoding="utf-8")  # the holder's evidence
    assert sorted(p.name for p in out.iterdir()) == ["fingerprint.json"]  # lock and marker gone once complete
    assert not (local / LATEST).exists()  # an explicit --out is never linked as latest


HOLDER = """
import sys
from pathlib import Path
from h3gate.evidence.runfolder import open_run
with open_run(Path(sys.argv[1]), Path(sys.argv[1]).parent):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_run_in_another_process_holds_its_folder_until_it_ends(run_cli, local, tmp_path):
    out = tmp_path / "theirs"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        code, _, err = _fingerprint(run_cli, "--out", out, "--force")
        assert code == 2 and err.startswith(f"h3gate: error: {out}: in use by pid {holder.pid} (h3gate {out}, started ")
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0 and not out.exists()  # it wrote nothing: its folder went with it
    assert _fingerprint(run_cli, "--out", out)[0] == 0


def test_a_killed_runs_temp_files_are_refused_by_seal_and_cleaned_by_the_next_run(run_cli, local, tmp_path):
    out = tmp_path / "killed"
    assert _fingerprint(run_cli, "--out", out)[0] == 0
    (out / "steps").mkdir()
    (out / ".fingerprint.json.k3j2.tmp").write_text('{"half', encoding="utf-8")  # a write a kill cut short
    (out / "steps" / ".step-0001.safetensors.x.tmp").write_bytes(b"\x00" * 8)
    for verify in ([], ["--verify"]):  # negative control: seal never seals (or verifies) temp files
        code, stdout, err = run_cli("seal", out, *verify)
        assert code == 2 and stdout == "" and err.count("\n") == 1
        assert ".fingerprint.json.k3j2.tmp, steps/.step-0001.safetensors.x.tmp" in err and "unfinished run" in err
    assert not (out / "SEAL.json").exists()
    assert _fingerprint(run_cli, "--out", out, "--force")[0] == 0  # the next run into the folder cleans them
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["fingerprint.json", "steps"]
    code, _, err = run_cli("seal", out)
    assert code == 0, err
    assert run_cli("seal", out, "--verify")[0] == 0


def test_seal_refuses_a_folder_marked_unfinished(run_cli, tmp_path):
    out = tmp_path / "cut"
    assert _fingerprint(run_cli, "--out", out)[0] == 0
    (out / UNFINISHED_NAME).write_text("{}", encoding="utf-8")  # a run killed before its evidence was complete
    code, _, err = run_cli("seal", out)
    assert code == 2 and f"seal {out}: holds an unfinished run ({UNFINISHED_NAME})" in err
    with pytest.raises(InputError, match="unfinished run"):
        refuse_unfinished(out)
    (out / UNFINISHED_NAME).unlink()
    refuse_unfinished(out)  # the same folder without the marker is sealable
    assert run_cli("seal", out)[0] == 0


def test_a_refused_run_leaves_nothing_behind(run_cli, local, tmp_path):
    missing = tmp_path / "no-checkpoint"
    code, _, err = _fingerprint(run_cli, "--checkpoint", missing)  # refused after its run folder was made
    assert code == 2 and str(missing) in err
    assert not local.exists()  # the fresh run folder and the parents it made are gone
    out = tmp_path / "new" / "ev"
    code, _, _ = _fingerprint(run_cli, "--checkpoint", missing, "--out", out)
    assert code == 2 and not (tmp_path / "new").exists()
    (local / "fingerprint").mkdir(parents=True)
    assert _fingerprint(run_cli)[0] == 0  # a complete run; then a refused one keeps it and its latest link
    before = _tree(local)
    assert _fingerprint(run_cli, "--checkpoint", missing)[0] == 2
    assert _tree(local) == before


def test_an_exception_keeps_partial_evidence_marked_unfinished(tmp_path):
    root = tmp_path / "root"
    with pytest.raises(RuntimeError), open_run(None, root) as run:
        (run.path / "part.json").write_text("{}", encoding="utf-8")
        raise RuntimeError("killed half way")
    assert sorted(p.name for p in run.path.iterdir()) == [UNFINISHED_NAME, "part.json"]  # lock released
    assert not (root / LATEST).exists()  # never linked as latest
    with pytest.raises(InputError, match="unfinished run"):
        refuse_unfinished(run.path)
    with pytest.raises(RuntimeError), open_run(None, root) as empty:
        raise RuntimeError("before any evidence")
    assert not empty.path.exists()


def test_seal_given_a_default_parent_uses_its_latest_run(run_cli, local):
    assert _fingerprint(run_cli)[0] == 0
    parent = local / "fingerprint"
    code, _, err = run_cli("seal", parent)
    run = parent / os.readlink(parent / LATEST)
    assert code == 0 and err == f"h3gate: using {parent}/{LATEST} -> {run.name}\n"
    assert (run / "SEAL.json").is_file() and not (parent / "SEAL.json").exists()
    assert run_cli("seal", parent, "--verify")[0] == 0


@pytest.mark.parametrize(
    ("verb", "default"),
    [
        (["run", "ws1-block"], "evidence/local/ws1-block/<config>-<layout>/<UTC time>-<id>/"),
        (["run", "ws1-trajectory"], "evidence/local/ws1-trajectory/<config>-<layout>/<UTC time>-<id>/"),
        (["fingerprint"], "evidence/local/fingerprint/<UTC time>-<id>/"),
        (["ablate"], "evidence/local/ablate/<config>-<layout>/<UTC time>-<id>/"),
    ],
)
def test_out_help_names_the_run_folder_default(run_cli, monkeypatch, verb, default):
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = run_cli(*verb, "--help")
    assert code == 0
    assert default in " ".join(out.split()), out


@pytest.mark.parametrize("flag", ["--resume", "--verify-last"])
def test_a_trajectory_resumed_or_verified_needs_its_rundir(run_cli, flag):
    code, out, err = run_cli("run", "ws1-trajectory", flag)
    assert code == 2 and out == ""
    assert err == f"h3gate: error: {flag}: needs --out RUNDIR (the run's folder: manifest, step files, evidence)\n"


def test_a_trajectory_resumed_in_its_own_folder_needs_no_force(tmp_path, local):
    """``reuse`` (run ws1-trajectory --resume) continues the run in its folder; the run folder rules still hold: a
    held lock refuses it, a killed invocation's temp files are cleaned."""
    rundir = tmp_path / "run"
    with open_run(rundir, local):
        (rundir / "ws1-trajectory.json").write_text("{}", encoding="utf-8")
        with pytest.raises(InputError, match=f"in use by pid {os.getpid()}"), open_run(rundir, local, reuse=True):
            pass
    (rundir / ".step-0004.safetensors.x.tmp").write_bytes(b"half")
    with pytest.raises(InputError, match="--force replaces it"), open_run(rundir, local):
        pass
    with open_run(rundir, local, reuse=True) as run:
        assert sorted(p.name for p in rundir.iterdir()) == [LOCK_NAME, UNFINISHED_NAME, "ws1-trajectory.json"]
        (run.path / "ws1-trajectory.json").write_text('{"steps": 5}', encoding="utf-8")
    assert sorted(p.name for p in rundir.iterdir()) == ["ws1-trajectory.json"]


def test_compare_and_report_given_a_default_parent_use_its_latest_run(run_cli, local, tmp_path):
    assert _fingerprint(run_cli)[0] == 0
    parent = local / "fingerprint"
    run = parent / os.readlink(parent / LATEST)
    code, _, err = run_cli("compare", parent, parent, "--out", tmp_path / "cmp")
    lines = err.splitlines()
    assert code == 2 and lines[:2] == [f"h3gate: using {parent}/{LATEST} -> {run.name}"] * 2
    assert lines[2].startswith("h3gate: error: ") and run.name in lines[2]  # the run, not the parent, was read
    assert not (tmp_path / "cmp").exists()  # refused: its run folder went with it
    code, out, err = run_cli("report", parent, "--out", tmp_path / "page")
    assert code == 0 and err.splitlines()[0] == f"h3gate: using {parent}/{LATEST} -> {run.name}"
    assert "1 evidence document," in out
