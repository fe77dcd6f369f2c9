"""One way to start ranks: torch's own launcher, ``python -m torch.distributed.run --standalone --nproc-per-node W
-m MODULE --dir D``, each rank's output in its own log under ``D/rank-logs``, waited on as one; and the one ``main``
of such a module (``run_rank(rank, world, folder)``, the rank and world as the launcher sets them in ``RANK`` and
``WORLD_SIZE``; a bad input is exit 2 in one line ``h3gate: error: ...``)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h3gate
from h3gate.errors import InputError

ERROR_PREFIX = "h3gate: error: "
# torch.distributed.run's failure summary: "rank      : 1 (local_rank: 1)" then "exitcode  : 2 (pid: ...)"
_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
POLL_S = 1.0  # how often the wait looks for finished ranks
HEARTBEAT_S = 15.0  # with a progress callback: a line at least this often while ranks run


def run_ranks(
    module: str,
    world: int,
    folder: Path | str,
    threads: int,
    timeout_s: int,
    progress: Callable[[str], None] | None = None,
    result: Callable[[int], Path] | None = None,
    args: list[str] | None = None,
) -> list[str]:
    """Start ``world`` ranks of ``module`` (its arguments ``args``, default ``--dir folder``; rank logs under
    ``folder`` either way) through torch's launcher and wait for all: one line per
    failed rank (``rank R exit C: its last error line``), empty when every rank exited 0; past ``timeout_s`` the
    launcher is stopped (it stops its ranks) and the one line says so. The launcher stops every rank at the first
    failure, so which of several failing ranks exits with its own code is a race: those come first, the ranks a
    signal ended after them. The ranks import this very h3gate. ``progress`` (a label callback) hears ``rank R of W
    finished`` as each rank's ``result(R)`` file appears, and a line at least every :data:`HEARTBEAT_S` seconds; the
    launcher's own output goes to ``rank-logs/launcher.log``."""
    folder = Path(folder)
    logs = folder / "rank-logs"
    root = str(Path(h3gate.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "--log-dir", str(logs), "--redirects", "3", "-m", module,
               *(["--dir", str(folder)] if args is None else args)]  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    launcher = logs / "launcher.log"
    with launcher.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
        code = _wait(proc, world, timeout_s, progress, result)
    if code is None:
        return [f"{world} ranks ran past {timeout_s} s"]
    summary = launcher.read_text(encoding="utf-8", errors="replace")
    if code == 0:
        return []
    codes = {int(r): int(c) for r, c in _FAILURE.findall(summary)}
    # ranks that exited first, then those a signal ended (the launcher stops the others at the first failure)
    errors = [f"rank {r} exit {c}: {_last_error(logs, r)}" for r, c in sorted(codes.items()) if c > 0]
    errors += [f"rank {r} ended by signal {-c}: {_last_error(logs, r)}" for r, c in sorted(codes.items()) if c < 0]
    tail = " | ".join(line.strip() for line in summary.splitlines()[-6:])
    return errors or [f"torch.distributed.run exit {code}: {tail}"]


def _wait(
    proc: subprocess.Popen,
    world: int,
    timeout_s: float,
    progress: Callable[[str], None] | None,
    result: Callable[[int], Path] | None,
) -> int | None:
    """The launcher's exit code (None: stopped past ``timeout_s``), reporting finished ranks while it runs."""
    deadline = time.monotonic() + timeout_s
    finished: set[int] = set()
    beat = time.monotonic()
    while True:
        try:
            code: int | None = proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        if progress is not None:
            new = [r for r in range(world) if r not in finished and result is not None and result(r).is_file()]
            for r in new:
                finished.add(r)
                progress(f"rank {r} of {world} finished")
            if code is None and not new and time.monotonic() - beat >= HEARTBEAT_S:
                progress(f"{world - len(finished)} of {world} ranks running")
            beat = time.monotonic() if new or time.monotonic() - beat >= HEARTBEAT_S else beat
        if code is not None:
            return code
        if time.monotonic() > deadline:
            proc.terminate()
            proc.wait(timeout=60)
            return None


def _last_error(logs: Path, rank: int) -> str:
    """The rank's last line naming an error (its last line when none does), from its log."""
    text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"**/attempt_*/{rank}/stderr.log")))
    lines = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln] or text.splitlines() or [""]
    return lines[-1].strip()


def rank_main(argv: list[str] | None, module: str, what: str, run_rank: Callable[[int, int, Path], None]) -> int:
    """The ``__main__`` of a rank module under torch's launcher: parse ``--dir``, run, exit 0 (2: a bad input)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=what)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.dir)
    except InputError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
        return 2
    return 0
