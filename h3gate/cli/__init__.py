"""The command line: thin verbs that parse options, call one function, and return an exit code.

Exit codes: 0 gate passed, 1 gate failed (evidence still written), 2 bad input or usage (one line naming the
thing), 3 internal error (one line; the traceback goes to a file, or to stderr with ``--debug``).

Only this package knows about Typer (``base``: the app and the shared options; ``verbs`` and ``run_verbs``: the
verbs), and :func:`main` is the one error boundary: an :class:`~h3gate.errors.InputError` anywhere below becomes one
line on stderr and exit code 2; any other exception becomes exit 3, never 1.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

import click
import typer

from h3gate.cli import run_verbs, verbs  # noqa: F401 - importing them registers the verbs
from h3gate.cli.base import DEBUG, app, global_flags_first
from h3gate.errors import EXIT_INPUT, EXIT_INTERNAL, InputError, crash_folder
from h3gate.numerics import strict_numerics

__all__ = ["app", "main"]


def _click_errors() -> tuple[type[BaseException], ...]:
    """Usage-error classes of Typer's bundled click copy and of click itself (whichever is in use)."""
    classes: list[type[BaseException]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as TyperClickException

        classes.append(TyperClickException)
    except ImportError:  # older Typer uses click directly
        pass
    return tuple(classes)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: the single error boundary."""
    args = global_flags_first(list(sys.argv[1:] if argv is None else argv))
    try:
        with strict_numerics():  # every verb runs under the one numerics switch (TF32 off), entered here once
            code = app(args=args, prog_name="h3gate", standalone_mode=False)
    except InputError as exc:
        print(f"h3gate: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except (click.exceptions.Exit, typer.Exit) as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except (click.exceptions.Abort, typer.Abort):
        print("h3gate: aborted", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except _click_errors() as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # help was printed: not an error
            sys.exit(0)
        print(f"h3gate: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except Exception as exc:  # noqa: BLE001 - the one boundary: every other exception is exit 2 (memory) or 3
        if _out_of_memory(exc):
            # A request too large for the machine that slipped past the estimates: one line, exit 2.
            print(f"h3gate: error: out of memory ({type(exc).__name__}): {_first_line(exc)}", file=sys.stderr)
            sys.exit(EXIT_INPUT)
        where = _save_traceback()
        print(f"h3gate: internal error: {type(exc).__name__}: {_first_line(exc)} ({where})", file=sys.stderr)
        sys.exit(EXIT_INTERNAL)
    sys.exit(code if isinstance(code, int) else 0)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _out_of_memory(exc: BaseException) -> bool:
    """Host or device allocation failures (torch raises RuntimeError / OutOfMemoryError for them)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _save_traceback() -> str:
    """Write the active exception's traceback (to stderr with --debug, else to --out or a temp file)."""
    text = traceback.format_exc()
    if DEBUG[0]:
        sys.stderr.write(text)
        return "traceback above"
    folder = crash_folder()
    try:
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            path = Path(folder) / "h3gate-traceback.txt"
            path.write_text(text, encoding="utf-8")
        else:
            fd, name = tempfile.mkstemp(prefix="h3gate-traceback-", suffix=".txt")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            path = Path(name)
    except OSError:
        sys.stderr.write(text)
        return "traceback above: it could not be written to a file"
    return f"traceback in {path}"
