"""The one error type the CLI turns into a one-line message and exit code 2.

Exit codes are a contract: 0 = gate passed, 1 = gate failed (evidence still written), 2 = bad input or usage.
Every bad input raises :class:`InputError` with a message that names the thing (a file, a dotted manifest path,
a tensor name, a node) and says what is wrong with it, on one line.
"""

from __future__ import annotations

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INPUT = 2


class InputError(Exception):
    """Bad input or usage: printed as one line, exit code 2, nothing half-written."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
