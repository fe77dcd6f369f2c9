"""The one error type the CLI turns into a one-line message and exit code 2.

Exit codes are a contract: 0 = gate passed, 1 = gate failed (evidence still written), 2 = bad input or usage,
3 = internal error (an unexpected exception: one line, the traceback in a file; never reported as a verdict).
Every bad input raises :class:`InputError` with a message that names the thing (a file, a dotted manifest path,
a tensor name, a node) and says what is wrong with it, on one line.
"""

from __future__ import annotations

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INPUT = 2
EXIT_INTERNAL = 3

# Where an internal error's traceback goes: the run's --out folder once a command has validated it (else a
# temporary file). Set through :func:`set_crash_folder`.
_crash_folder: list = [None]


def set_crash_folder(folder) -> None:
    """Record the validated evidence folder of the running command (the traceback of a crash is written there)."""
    _crash_folder[0] = folder


def crash_folder():
    return _crash_folder[0]


class InputError(Exception):
    """Bad input or usage: printed as one line, exit code 2, nothing half-written."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
