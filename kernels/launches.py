"""Which schedules the strict kernels launched, by graph node: one small mechanism, on only inside
:func:`recording` (an engine wraps its candidate's pass in it, ``h3gate.strict`` each forward of the user's module),
so a kernel call otherwise costs one lookup.

Kernels whose contract runs as several schedules with the same bytes (the attention's Gluon / TMA / pointer walks,
a GEMM's tiling by M bucket) call :func:`note` with their ``launch_record``; :func:`h3gate.graph.execute.run_node`
names the node around each node function. The log maps node -> operator -> the distinct records seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Log = dict[str, dict[str, list[dict]]]

_LOG: ContextVar[Log | None] = ContextVar("h3gate_launch_log", default=None)
_NODE: ContextVar[tuple[str, ...]] = ContextVar("h3gate_launch_node", default=("",))


@contextmanager
def recording() -> Iterator[Log]:
    """Within the block, every noted launch goes to the yielded log under the current node's name."""
    log: Log = {}
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


@contextmanager
def node(*names: str) -> Iterator[None]:
    """Launches noted within the block belong to node ``names[0]`` (and to every further name: nodes one grouped
    launch computes together)."""
    token = _NODE.set(names)
    try:
        yield
    finally:
        _NODE.reset(token)


def current_nodes() -> tuple[str, ...]:
    """The node names launches noted now belong to (several inside a grouped call; ``("",)`` outside any node)."""
    return _NODE.get()


def note(op: str, describe: Callable[[], dict]) -> None:
    """Record ``describe()`` for ``op`` under the current node when a log is recording (otherwise nothing runs)."""
    log = _LOG.get()
    if log is None:
        return
    record = describe()
    for name in _NODE.get():
        seen = log.setdefault(name, {}).setdefault(op, [])
        if record not in seen:
            seen.append(record)


def merge(into: Log, log: Log) -> None:
    """Add ``log``'s records to ``into`` (node -> op -> distinct records), keeping each distinct record once."""
    for node_name, ops in log.items():
        for op, records in ops.items():
            seen = into.setdefault(node_name, {}).setdefault(op, [])
            seen += [r for r in records if r not in seen]
