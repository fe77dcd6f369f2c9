"""Shared test helpers (keep minimal: several suites use this file)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def run_cli(capsys):
    """Run ``h3gate.cli.main(args)``; returns ``(exit_code, stdout, stderr)``."""

    def run(*args: str) -> tuple[int, str, str]:
        from h3gate.cli import main

        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        captured = capsys.readouterr()
        return exc.value.code, captured.out, captured.err

    return run
