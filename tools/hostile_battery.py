"""Hostile battery: absurd sizes, deep or huge JSON/YAML, failing writes and bad output paths, each run as a
subprocess under a memory cap; prints every case's exit code and peak resident memory.

    python tools/hostile_battery.py [--checkout DIR] [--cap-gib 1.0] [--as-gib 3.0] [--timeout 120] [-k SUBSTRING]

Each case runs ``sys.executable -m h3gate ...`` with ``PYTHONPATH=CHECKOUT`` (default: this file's repository) and
``TRITON_INTERPRET=1`` in a fresh folder of one temporary directory (fixtures: a tiny synthetic checkpoint and
variants of it with absurd config fields, deeply nested JSON and YAML files, a sealed evidence folder). Its peak
RSS comes from ``os.wait4`` (the kernel's ``ru_maxrss`` of that child); a watchdog also polls ``/proc/PID/status``
and kills a case whose resident memory passes the cap (reported as ``KILLED``), so a regression never takes the
host down. Each case also runs under ``RLIMIT_AS`` (``--as-gib``, default 3: about 2.3 GiB above what torch maps at
import), which h3gate's memory checks honour: its estimates are judged against that, not the host's size.
``RLIMIT_FSIZE`` simulates a full disk for the write cases (``SIGXFSZ`` ignored: writes fail with EFBIG).

Exit 0 when every case exited with the code it expects (0, 1 or 2; never 3, never a signal) below the cap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOWHERE = "/proc/h3gate-nowhere"  # a folder nobody, root included, can create
DEEP = 100_000  # nesting levels of the deep JSON/YAML files (far past any recursion limit)


@dataclass(frozen=True)
class Case:
    """``h3gate ARGV`` (``{d}``: the fixtures' folder, ``{w}``: this case's own empty folder) expecting ``expect``;
    ``fsize``: an RLIMIT_FSIZE in bytes (a disk that fills after that many bytes per file)."""

    name: str
    argv: tuple[str, ...]
    expect: int = 2
    fsize: int | None = None
    must_not_exist: tuple[str, ...] = field(default=())


def _deep_json(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def _deep_yaml(depth: int = DEEP) -> str:
    return "a: " + "[" * depth + "]" * depth + "\n"


def _h3(d: Path, *argv: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-m", "h3gate", "--quiet", *argv], cwd=d, env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip


def _checkpoint_variant(d: Path, name: str, **fields: object) -> None:
    """A copy of the tiny checkpoint (hard links) whose config.json has ``fields`` replaced."""
    src, dst = d / "ckpt", d / name
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.link(f, dst / f.name)
    body = json.loads((src / "config.json").read_text())
    body.update(fields)
    (dst / "config.json").write_text(json.dumps(body))


def fixtures(d: Path) -> None:
    """The files the cases read (built with the checkout under test, once)."""
    _h3(d, "synth-checkpoint", "--out", "ckpt", "--config", "tiny")
    _checkpoint_variant(d, "layers-1e9", num_layers=1_000_000_000)
    _checkpoint_variant(d, "hidden-1e9", hidden_size=1_000_000_000)
    _checkpoint_variant(d, "heads-1e9", num_attention_heads=1_000_000_000)
    deep = d / "deep-config"
    deep.mkdir()
    for f in (d / "ckpt").iterdir():
        if f.name != "config.json":
            os.link(f, deep / f.name)
    (deep / "config.json").write_text(_deep_json())
    hdr = d / "deep-header"
    hdr.mkdir()
    (hdr / "config.json").write_text((d / "ckpt" / "config.json").read_text())
    blob = _deep_json(50_000).encode()
    (hdr / "diffusion_pytorch_model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob)
    idx = d / "deep-index"
    idx.mkdir()
    (idx / "config.json").write_text((d / "ckpt" / "config.json").read_text())
    (idx / "diffusion_pytorch_model.safetensors.index.json").write_text(_deep_json())
    (d / "deep.yaml").write_text(_deep_yaml())
    (d / "deep.json").write_text(_deep_json())
    levels = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)]
    (d / "laughs.yaml").write_text("\n".join(levels) + "\n")
    big = d / "huge-config"
    big.mkdir()
    (big / "config.json").write_text('{"pad": "' + "x" * 20_000_000 + '"}')
    (d / "huge.yaml").write_text("a: [" + "0, " * 20_000_000 + "0]\n")
    _h3(d, "run", "ws1-ops", "--op", "h3_rmsnorm", "--out", "ev")
    ev = d / "ev-deep"
    ev.mkdir()
    for f in (d / "ev").iterdir():
        (ev / f.name).write_bytes(f.read_bytes())
    evidence = next(p for p in ev.glob("*.json") if p.name != "SEAL.json")
    evidence.write_text(_deep_json())
    (d / "a-file").write_text("x")


CASES: tuple[Case, ...] = (
    # controls: at the limits, accepted
    Case("control-schedule-steps-10000", ("schedule", "--steps", "10000", "--json"), expect=0),
    Case("control-synth-tiny", ("synth-checkpoint", "--config", "tiny", "--out", "{w}/c"), expect=0),
    Case("control-layout-save", ("layout", "tiny", "--save", "{w}/l.safetensors"), expect=0),
    # 1. sizes
    Case("schedule-steps-1e9", ("schedule", "--steps", "1000000000")),
    Case("ws1-trajectory-steps-1e9", ("run", "ws1-trajectory", "--steps", "1000000000", "--out", "{w}/t")),
    Case("arms-steps-1e9", ("run", "arms", "--steps", "1000000000", "--out", "{w}/a")),
    Case("arms-batch-1e9", ("run", "arms", "--batch", "1000000000", "--out", "{w}/a")),
    Case("fingerprint-layers-1e9", ("fingerprint", "--checkpoint", "{d}/layers-1e9", "--out", "{w}/f")),
    Case("fingerprint-hidden-1e9", ("fingerprint", "--checkpoint", "{d}/hidden-1e9", "--out", "{w}/f")),
    Case("ws1-model-layers-1e9", ("run", "ws1-model", "--checkpoint", "{d}/layers-1e9", "--out", "{w}/m")),
    Case("ws1-model-hidden-1e9", ("run", "ws1-model", "--checkpoint", "{d}/hidden-1e9", "--out", "{w}/m")),
    Case("ws1-model-heads-1e9", ("run", "ws1-model", "--checkpoint", "{d}/heads-1e9", "--out", "{w}/m")),
    Case("ws1-block-hidden-1e9", ("run", "ws1-block", "--checkpoint", "{d}/hidden-1e9", "--out", "{w}/b")),
    Case("ws1-ops-real-768p", ("run", "ws1-ops", "--config", "real", "--layouts", "768p", "--out", "{w}/o")),
    Case("vae-real", ("run", "vae", "--modality", "video", "--geometry", "real", "--out", "{w}/v")),
    Case("synth-real", ("synth-checkpoint", "--config", "real", "--out", "{w}/c"), must_not_exist=("{w}/.c.*",)),
    Case(
        "layout-frames-1e9",
        (
            "layout",
            "--text-tokens",
            "8",
            "--latent-frames",
            "1000000002",
            "--latent-height",
            "4",
            "--latent-width",
            "4",
            "--audio-latents",
            "4",
        ),
    ),  # fmt: skip
    # 2. parsers and writes
    Case("fingerprint-deep-config", ("fingerprint", "--checkpoint", "{d}/deep-config", "--out", "{w}/f")),
    Case("fingerprint-deep-header", ("fingerprint", "--checkpoint", "{d}/deep-header", "--out", "{w}/f")),
    Case("fingerprint-deep-index", ("fingerprint", "--checkpoint", "{d}/deep-index", "--out", "{w}/f")),
    Case("ws1-model-deep-config", ("run", "ws1-model", "--checkpoint", "{d}/deep-config", "--out", "{w}/m")),
    Case("ws1-block-deep-tolerance", ("run", "ws1-block", "--tolerance", "{d}/deep.yaml", "--out", "{w}/o")),
    Case("ws1-ops-deep-config", ("run", "ws1-ops", "--config", "{d}/deep.yaml", "--out", "{w}/o")),
    Case("ws1-ops-alias-bomb-config", ("run", "ws1-ops", "--config", "{d}/laughs.yaml", "--out", "{w}/o")),
    Case("fingerprint-huge-config-json", ("fingerprint", "--checkpoint", "{d}/huge-config", "--out", "{w}/f")),
    Case("ws1-ops-huge-config", ("run", "ws1-ops", "--config", "{d}/huge.yaml", "--out", "{w}/o")),
    Case("seal-deep-evidence", ("seal", "{d}/ev-deep")),
    Case("report-deep-evidence", ("report", "{d}/ev-deep", "--out", "{w}/r")),
    Case("compare-deep", ("compare", "{d}/deep.json", "{d}/deep.json")),
    Case(
        "synth-disk-full",
        ("synth-checkpoint", "--config", "tiny", "--out", "{w}/c"),
        fsize=100_000,
        must_not_exist=("{w}/c", "{w}/.c.*"),
    ),  # fmt: skip
    Case("ws1-trajectory-disk-full", ("run", "ws1-trajectory", "--steps", "3", "--out", "{w}/t"), fsize=6_000),
    # 3. output paths and indices
    Case("ws1-block-save-tensors-file", ("run", "ws1-block", "--save-tensors", "{d}/a-file/x", "--out", "{w}/b")),
    Case("ws1-block-save-tensors-proc", ("run", "ws1-block", "--save-tensors", NOWHERE + "/x", "--out", "{w}/b")),
    Case("ws1-model-save-tensors-proc", ("run", "ws1-model", "--save-tensors", NOWHERE + "/x", "--out", "{w}/m")),
    Case("layout-save-proc", ("layout", "tiny", "--save", NOWHERE + "/x.safetensors")),
    Case("schedule-save-proc", ("schedule", "--steps", "4", "--save", NOWHERE + "/x.safetensors")),
    Case("keygen-out-proc", ("keygen", "--out", NOWHERE + "/key")),
    Case("report-out-file", ("report", "{d}/ev", "--out", "{d}/a-file")),
    Case("ws1-trajectory-until-99", ("run", "ws1-trajectory", "--steps", "3", "--until", "99", "--out", "{w}/t")),
    Case("ws1-model-layers-past-end", ("run", "ws1-model", "--layers", "0:999", "--out", "{w}/m")),
    Case("ws1-model-layers-reversed", ("run", "ws1-model", "--layers", "1:0", "--out", "{w}/m")),
)


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_case(case: Case, d: Path, w: Path, checkout: Path, cap: int, timeout: float, address_space: int | None) -> dict:
    """Run one case; its exit code, peak RSS (bytes), wall seconds, stderr's last line, whether it was killed."""
    argv = [a.format(d=d, w=w) for a in case.argv]
    # GIT_OPTIONAL_LOCKS=0: provenance's ``git status`` leaves the checkout's index alone (under RLIMIT_FSIZE a
    # refresh would die holding index.lock)
    env = {**os.environ, "PYTHONPATH": str(checkout), "TRITON_INTERPRET": "1", "GIT_OPTIONAL_LOCKS": "0"}
    env.pop("H3GATE_HOME", None)

    def limits() -> None:
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if case.fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))

    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "h3gate", *argv], cwd=w, env=env, preexec_fn=limits,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    why: list[str] = []

    def watchdog() -> None:
        while proc.returncode is None:
            if _rss_bytes(proc.pid) > cap:
                why.append("KILLED (memory cap)")
                proc.kill()
                return
            if time.perf_counter() - started > timeout:
                why.append("KILLED (timeout)")
                proc.kill()
                return
            time.sleep(0.05)

    threading.Thread(target=watchdog, daemon=True).start()
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    leftovers = [str(p) for pattern in case.must_not_exist for p in Path("/").glob(pattern.format(d=d, w=w)[1:])]
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    return {
        "case": case.name,
        "expect": case.expect,
        "rc": proc.returncode,
        "peak_mib": usage.ru_maxrss / 1024,
        "seconds": time.perf_counter() - started,
        "killed": why[0] if why else "",
        "leftovers": leftovers,
        "stderr": last[:200],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument("--cap-gib", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--as-gib", type=float, default=3.0, help="RLIMIT_AS of each case (0: none).")
    parser.add_argument("-k", default="", help="Run only the cases whose name contains this.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results to this file.")
    args = parser.parse_args()
    cap = int(args.cap_gib * 2**30)
    address_space = int(args.as_gib * 2**30) if args.as_gib > 0 else None
    results = []
    with tempfile.TemporaryDirectory(prefix="h3gate-battery-") as tmp:
        d = Path(tmp) / "fixtures"
        d.mkdir()
        os.environ["PYTHONPATH"] = str(args.checkout.resolve())
        fixtures(d)
        for i, case in enumerate(c for c in CASES if args.k in c.name):
            w = Path(tmp) / f"case-{i}"
            w.mkdir()
            r = run_case(case, d, w, args.checkout.resolve(), cap, args.timeout, address_space)
            r["ok"] = r["rc"] == r["expect"] and not r["killed"] and not r["leftovers"]
            results.append(r)
            flag = "ok  " if r["ok"] else "FAIL"
            print(f"{flag} {r['case']:<30} exit {r['rc']:>3} (want {r['expect']})  peak {r['peak_mib']:7.0f} MiB  "
                  f"{r['seconds']:6.1f} s  {r['killed']}{' LEFT ' + ' '.join(r['leftovers']) if r['leftovers'] else ''}"
                  f"  | {r['stderr']}", flush=True)  # fmt: skip
    bad = [r for r in results if not r["ok"]]
    peak = max((r["peak_mib"] for r in results), default=0.0)
    print(f"{len(results)} cases, {len(results) - len(bad)} as the contract says, peak {peak:.0f} MiB "
          f"(cap {args.cap_gib:g} GiB)")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
