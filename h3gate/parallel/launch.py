"""One way to start ranks: ``python -m MODULE --rank R --world W --dir D`` processes, waited on together, and the one
``main`` of such a module (its ``run_rank(rank, world, folder)``; a bad input is exit 2 in one line)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from h3gate.errors import InputError


def run_ranks(module: str, world: int, folder: Path | str, threads: int, timeout_s: int) -> list[str]:
    """Start ``world`` ranks of ``module`` on ``folder`` and wait for all: one line per failed rank (``rank R exit
    C: its last error line``), empty when every rank exited 0; past ``timeout_s`` every rank is killed and the one
    line says which rank was waited on."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", module, "--world", str(world), "--dir", str(folder)]
    procs = [subprocess.Popen([*command, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for r in range(world)]  # fmt: skip
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return [f"rank {r} ran past {timeout_s} s"]
        if p.returncode:
            lines = [ln for ln in err.splitlines() if "Error" in ln or "error:" in ln] or err.splitlines() or [""]
            errors.append(f"rank {r} exit {p.returncode}: {lines[-1].strip()}")
    return errors


def rank_main(argv: list[str] | None, module: str, what: str, run_rank: Callable[[int, int, Path], None]) -> int:
    """The ``__main__`` of a rank module: parse ``--rank --world --dir``, run, exit 0 (2: a bad input, one line)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=what)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        run_rank(args.rank, args.world, args.dir)
    except InputError as exc:
        print(f"h3gate: error: {exc}", file=sys.stderr)
        return 2
    return 0
