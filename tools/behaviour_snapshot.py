"""Behaviour snapshot: run a fixed battery of h3gate commands on a checkout, then compare canonical evidence.

    python tools/behaviour_snapshot.py run CHECKOUT --out DIR        # the battery (CPU, tiny config)
    python tools/behaviour_snapshot.py extract DIR --out SNAP.json    # canonical snapshot of what it wrote
    python tools/behaviour_snapshot.py compare A.json B.json          # exit 0 identical, 1 otherwise

``run`` executes :data:`CASES` with ``sys.executable -m h3gate`` and ``PYTHONPATH=CHECKOUT`` (cwd ``DIR``,
``TRITON_INTERPRET=1``, ``H3GATE_HOME`` unset), each case writing under ``DIR/evidence/<case>/``; a case's
``--json`` stdout is kept as ``DIR/evidence/<case>/stdout.json``. ``DIR/runs.json`` records per case the argv,
the expected and actual exit code, the wall time and the stdout/stderr tails. A failing case is recorded, not fatal.
Every verb runs at least once: ``bench`` needs CUDA (exit 2 here, recorded); ``report`` is kept for its exit code
only (its HTML and PNGs are not evidence); ``keygen`` writes a key, not evidence, and is left out. DIR must be new.

``extract`` reads every ``*.json`` under ``DIR/evidence`` and ``DIR/checkpoint-tiny`` (evidence, the trajectory
RUNDIRs' ``manifest.json`` and ``steps/step-*.json``, the ``--json`` stdouts, the synthetic checkpoint's config and
index) and writes, per file, the canonical body, its sha256 (``body_sha256``), every value whose key contains
``sha256`` with its JSON path (``sha256``), and the manifests its provenance says were read (``manifests_read``);
per ``*.safetensors`` file (checkpoint shards, trajectory steps) the sha256 of its bytes; per case the exit code.
The canonical body is the JSON with exactly these things taken out, each of which legitimately differs between two
runs of identical code, or between two checkouts of it:

* the key ``provenance`` (every evidence file): h3gate version, git revision/dirty files, ``code_sha256``,
  interpreter versions, host name, the command line (holds ``--out`` paths) and ``time_utc``. Only its
  ``manifests`` map (manifest path relative to the data root -> content sha256) is kept, as ``manifests_read``,
  and compared: which manifests a run read is behaviour, and it does not move with the repository layout.
* times: keys named ``timing``, keys ending in ``_s``, ``_ms`` or ``_us`` and keys containing ``seconds``
  (``seconds``, ``seconds_per_step`` of trajectory steps and invocations): wall and device times; keys named
  ``time_utc``, ``started_utc``, ``finished_utc``, ``created_utc``: wall-clock stamps;
* process ids: ``pid`` and keys ending in ``_pid`` (``ranks[].host_pid`` of ``run ws2`` and the multi-rank
  ablation rows);
* ``available_gib`` / ``host_available_gib`` / ``free_gib``: memory free at the moment of the run (none of the
  battery's files holds one at 799809f; the memory plan's estimates, ``device_gib`` / ``host_gib``, are kept);
* the code's identity, which a comparison between checkouts changes on purpose: ``git_revision``, ``git_dirty``,
  ``dirty_files`` and keys ending in ``code_sha256`` (a RUNDIR's ``run.code_sha256``, ``rerun_code_sha256``);
* in a seal (``kind: seal``): each file's ``sha256`` and ``bytes``, ``root`` and ``seal_sha256``. They hash whole
  files, provenance included, so they vary with it; ``seal --verify`` (a battery case) checks them instead.
* paths: in every string value, the battery folder ``DIR`` becomes ``<DIR>`` and the checkout ``CHECKOUT`` becomes
  ``<CHECKOUT>`` (``out``, ``saved_tensors``, checkpoint and RUNDIR paths keep their shape, not the machine's
  folders).

Nothing that reflects arithmetic is removed: errors, rows, verdicts, bindings, kernel ids, bounds, tensor hashes.
``compare`` matches files by their path under ``DIR`` exactly (a renamed file kind shows as one file missing on
each side) and reports, per file, the differing JSON paths separately for ``sha256`` keys and for other keys.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "h3gate-behaviour-snapshot/1"
TAIL = 2000
CKPT = "checkpoint-tiny"


@dataclass(frozen=True)
class Case:
    """One CLI call, ``h3gate --quiet`` + ``cmd`` (``{ev}``: this case's folder, ``{dir}``: the battery's)."""

    name: str
    cmd: str
    expect: int = 0
    stdout_json: bool = False


TRAJ = "{dir}/evidence/ws1-trajectory"
CASES: tuple[Case, ...] = (
    Case("validate", "validate --json", stdout_json=True),
    Case("layout-tiny", "layout tiny --json", stdout_json=True),
    Case("layout-medium", "layout medium --json", stdout_json=True),
    Case("schedule-6", "schedule --steps 6 --json", stdout_json=True),
    Case("fingerprint", "fingerprint --json --out {ev}", stdout_json=True),
    Case("synth-checkpoint", f"synth-checkpoint --out {{dir}}/{CKPT}"),
    Case("fingerprint-checkpoint", f"fingerprint --checkpoint {{dir}}/{CKPT} --hash-tensors --out {{ev}}"),
    Case("ws1-block-checkpoint", f"run ws1-block --checkpoint {{dir}}/{CKPT} --out {{ev}}"),
    Case("ws1-ops", "run ws1-ops --out {ev}"),
    Case("ws1-block", "run ws1-block --out {ev}"),
    Case("ws1-block-fault", "run ws1-block --no-backward --fault q_proj:5 --out {ev}", expect=1),
    Case("ws1-block-seg8", "run ws1-block --merge-order seg8 --no-backward --out {ev}"),
    Case("ws1-block-fault-matrix", "run ws1-block --fault-matrix --out {ev}"),  # evidence/cpu/PROVENANCE.md
    Case("ws1-model", "run ws1-model --out {ev}"),
    Case("ws1-model-fault", "run ws1-model --layers 0:1 --no-backward --fault block.0.o_proj:50 --out {ev}", expect=1),
    Case("ws1-trajectory", f"run ws1-trajectory --out {TRAJ}"),
    Case("ws1-trajectory-off", f"run ws1-trajectory --mode off --out {TRAJ}-off"),
    Case("ws1-trajectory-until", f"run ws1-trajectory --until 1 --out {TRAJ}-resumed"),
    Case("ws1-trajectory-resume", f"run ws1-trajectory --resume --out {TRAJ}-resumed"),
    Case("ws1-trajectory-verify", f"run ws1-trajectory --verify-last --out {TRAJ}-resumed"),
    Case("compare-strict-off", f"compare {TRAJ} {TRAJ}-off --out {{ev}}", expect=1),
    Case("compare-strict-resumed", f"compare {TRAJ} {TRAJ}-resumed --out {{ev}}"),
    Case("arms", "run arms --out {ev}"),
    Case("ws2-tp2", "run ws2 --topology tp2 --out {ev}"),
    Case("ablate-H5", "ablate H5 --out {ev}"),
    Case("ablate-A1", "ablate A1 --out {ev}"),
    Case("ablate-C0", "ablate C0 --out {ev}"),
    Case("vae-video", "run vae --modality video --out {ev}"),
    Case("vae-audio", "run vae --modality audio --out {ev}"),
    Case("bench-op-cpu", "bench --op h3_rmsnorm --config tiny --layout tiny --device cpu --out {ev}", expect=2),
    Case("seal", "seal {dir}/evidence/ws1-block"),
    Case("seal-verify", "seal --verify {dir}/evidence/ws1-block"),
    Case("report", "report {dir}/evidence/ws1-block --out {dir}/report"),
)


def _tail(text: str) -> str:
    return text[-TAIL:]


def run_case(case: Case, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one case; its folder is ``out/evidence/<name>``; returns its ``runs.json`` record."""
    ev = out / "evidence" / case.name
    argv = [a.format(ev=ev, dir=out) for a in shlex.split(case.cmd)]
    (out / "evidence").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "h3gate", "--quiet", *argv]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, check=False)
    wall = round(time.monotonic() - start, 2)
    if case.stdout_json:
        ev.mkdir(parents=True, exist_ok=True)
        (ev / "stdout.json").write_text(done.stdout, encoding="utf-8")
    return {"name": case.name, "argv": ["h3gate", "--quiet", *argv], "expect": case.expect, "rc": done.returncode,
            "wall_s": wall, "stdout_tail": _tail(done.stdout), "stderr_tail": _tail(done.stderr)}  # fmt: skip


def run_battery(checkout: Path, out: Path, only: list[str] | None = None) -> int:
    """Run :data:`CASES` (or those named in ``only``) on ``checkout``; write ``out/runs.json``; 0 if all as expected."""
    checkout, out = checkout.resolve(), out.resolve()
    if not (checkout / "h3gate" / "__init__.py").is_file():
        raise SystemExit(f"{checkout}: no h3gate package there")
    if not only and out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: not empty (the trajectory cases need fresh RUNDIRs)")
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "H3GATE_HOME"}
    env.update(PYTHONPATH=str(checkout), TRITON_INTERPRET="1", COLUMNS="160")
    records = []
    for case in CASES:
        if only and case.name not in only:
            continue
        rec = run_case(case, out, env)
        flag = "ok" if rec["rc"] == case.expect else f"UNEXPECTED (expected {case.expect})"
        print(f"{case.name:<26} rc={rec['rc']} {rec['wall_s']:8.1f} s  {flag}", flush=True)
        records.append(rec)
        _write_json(out / "runs.json", {"checkout": str(checkout), "dir": str(out), "python": sys.executable,
                                        "cases": records})  # fmt: skip
    total = sum(r["wall_s"] for r in records)
    print(f"{len(records)} cases, {total:.0f} s; {out / 'runs.json'}")
    return 0 if all(r["rc"] == r["expect"] for r in records) else 1


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


# --- extract -------------------------------------------------------------------------------------------------------

VOLATILE_KEYS = frozenset({
    "provenance", "timing", "time_utc", "started_utc", "finished_utc", "created_utc",
    "available_gib", "host_available_gib", "free_gib",
    "git_revision", "git_dirty", "dirty_files", "pid",
})  # fmt: skip
VOLATILE_SUFFIXES = ("_s", "_ms", "_us", "_pid", "code_sha256")
SEAL_VOLATILE = frozenset({"sha256", "bytes", "root", "seal_sha256"})


def is_volatile(key: str) -> bool:
    """A key whose value varies between two runs of identical code (see the module docstring)."""
    return key in VOLATILE_KEYS or key.endswith(VOLATILE_SUFFIXES) or "seconds" in key


def canonical(obj: Any, subs: list[tuple[str, str]], seal: bool = False) -> Any:
    """``obj`` without volatile keys, every string with the folders of ``subs`` replaced by their placeholders."""
    if isinstance(obj, dict):
        return {k: canonical(v, subs, seal) for k, v in obj.items()
                if not is_volatile(k) and not (seal and k in SEAL_VOLATILE)}  # fmt: skip
    if isinstance(obj, list):
        return [canonical(v, subs, seal) for v in obj]
    if isinstance(obj, str):
        for folder, mark in subs:
            obj = obj.replace(folder, mark)
    return obj


def child(path: str, key: str) -> str:
    """``path.key``, or ``path["key"]`` for a key that holds ``.``, ``[``, ``]``, ``"`` or a space (tensor names)."""
    return f"{path}[{json.dumps(key)}]" if re.search(r'[.\[\]" ]', key) else f"{path}.{key}"


def sha256_fields(obj: Any, path: str = "$") -> dict[str, Any]:
    """Every value under a key containing ``sha256`` (lists and dicts of hashes included), by JSON path."""
    found: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = child(path, k)
            if "sha256" in k.lower() and (isinstance(v, str) or v is None):
                found[sub] = v
            elif "sha256" in k.lower():
                found.update({p: x for p, x in leaves(v, sub)})
            else:
                found.update(sha256_fields(v, sub))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found.update(sha256_fields(v, f"{path}[{i}]"))
    return found


def leaves(obj: Any, path: str = "$") -> list[tuple[str, Any]]:
    """``(JSON path, scalar)`` for every leaf; an empty dict or list is a leaf of its own."""
    if isinstance(obj, dict) and obj:
        return [pair for k, v in obj.items() for pair in leaves(v, child(path, k))]
    if isinstance(obj, list) and obj:
        return [pair for i, v in enumerate(obj) for pair in leaves(v, f"{path}[{i}]")]
    return [(path, obj)]


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def snapshot_file(path: Path, subs: list[tuple[str, str]], bodies: bool) -> dict[str, Any]:
    """One file's snapshot record: canonical body digest, sha256 fields, manifests read (JSON); bytes' sha256 else."""
    if path.suffix != ".json":
        return {"file_sha256": file_sha256(path)}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return {"invalid_json": str(exc).split(":")[0], "file_sha256": file_sha256(path)}
    seal = isinstance(raw, dict) and raw.get("kind") == "seal"
    body = canonical(raw, subs, seal)
    rec: dict[str, Any] = {"kind": raw.get("kind") if isinstance(raw, dict) else None, "body_sha256": digest(body),
                           "sha256": sha256_fields(body)}  # fmt: skip
    prov = raw.get("provenance") if isinstance(raw, dict) else None
    if isinstance(prov, dict) and "manifests" in prov:
        rec["manifests_read"] = prov["manifests"]
    if bodies:
        rec["body"] = body
    return rec


def extract(folder: Path, bodies: bool = True) -> dict[str, Any]:
    """The canonical snapshot of a battery folder (``runs.json`` names the checkout and the cases)."""
    folder = folder.resolve()
    runs = json.loads((folder / "runs.json").read_text(encoding="utf-8"))
    subs = [(str(folder), "<DIR>"), (runs["dir"], "<DIR>"), (runs["checkout"], "<CHECKOUT>")]
    files: dict[str, Any] = {}
    for top in ("evidence", CKPT):
        for path in sorted((folder / top).rglob("*")):
            if path.is_file() and path.suffix in (".json", ".safetensors"):
                files[path.relative_to(folder).as_posix()] = snapshot_file(path, subs, bodies)
    cases = {r["name"]: {"rc": r["rc"], "expect": r["expect"]} for r in runs["cases"]}
    return {"format": FORMAT, "cases": cases, "files": files}


# --- compare -------------------------------------------------------------------------------------------------------


def diff_paths(a: Any, b: Any) -> list[str]:
    """JSON paths where ``a`` and ``b`` differ (a leaf's value, or a path present on one side only)."""
    la, lb = dict(leaves(a)), dict(leaves(b))
    return [p for p in sorted(la.keys() | lb.keys(), key=_path_key) if la.get(p, la) != lb.get(p, lb)]


def _keys_differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys of two flat maps (JSON path -> hash, manifest -> hash) whose values differ or that one side lacks."""
    return sorted((k for k in a.keys() | b.keys() if a.get(k, a) != b.get(k, b)), key=_path_key)


def _path_key(path: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def compare_file(a: dict[str, Any], b: dict[str, Any], limit: int = 20) -> list[str]:
    """Lines describing how two records of one file differ (empty when identical)."""
    lines: list[str] = []
    if a.get("file_sha256") != b.get("file_sha256"):
        lines.append(f"  bytes: {a.get('file_sha256')} != {b.get('file_sha256')}")
    for p in _keys_differing(a.get("manifests_read") or {}, b.get("manifests_read") or {})[:limit]:
        lines.append(f"  manifests_read {p}")
    if a.get("body_sha256") == b.get("body_sha256"):
        return lines
    shas = _keys_differing(a.get("sha256", {}), b.get("sha256", {}))
    if "body" in a and "body" in b:
        others = [p for p in diff_paths(a["body"], b["body"]) if "sha256" not in p.lower()]
    else:
        others = ["(bodies not stored: body_sha256 differs)"]
    lines.append(f"  body differs: {len(shas)} sha256 paths, {len(others)} other paths")
    lines += [f"    sha256 {p}" for p in shas[:limit]] + [f"    other  {p}" for p in others[:limit]]
    return lines


def compare(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Print per case and per file whether ``a`` and ``b`` agree; 0 when everything is identical, 1 otherwise."""
    same = True
    for name in sorted(a["cases"].keys() | b["cases"].keys()):
        ra, rb = a["cases"].get(name, {}).get("rc"), b["cases"].get(name, {}).get("rc")
        if ra != rb:
            same = False
            print(f"case {name}: exit code {ra} != {rb}")
    for name in sorted(a["files"].keys() | b["files"].keys()):
        if name not in a["files"] or name not in b["files"]:
            same = False
            print(f"{name}: only in {'A' if name in a['files'] else 'B'}")
            continue
        lines = compare_file(a["files"][name], b["files"][name])
        same = same and not lines
        print(f"{name}: {'identical' if not lines else 'DIFFERS'}", *lines, sep="\n")
    print(f"{len(a['files'])} / {len(b['files'])} files, {len(a['cases'])} / {len(b['cases'])} cases: "
          f"{'all identical' if same else 'DIFFERENT'}")  # fmt: skip
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the battery on CHECKOUT into DIR")
    r.add_argument("checkout", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", action="append", help="run only this case (repeatable; for debugging)")
    e = sub.add_parser("extract", help="write the canonical snapshot of a battery folder")
    e.add_argument("folder", type=Path)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--no-bodies", action="store_true", help="keep digests and sha256 lists only")
    c = sub.add_parser("compare", help="compare two snapshots")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run_battery(args.checkout, args.out, args.only)
    if args.cmd == "extract":
        _write_json(args.out, extract(args.folder, bodies=not args.no_bodies))
        return 0
    load = [json.loads(p.read_text(encoding="utf-8")) for p in (args.a, args.b)]
    return compare(*load)


if __name__ == "__main__":
    sys.exit(main())
