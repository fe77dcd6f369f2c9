"""First drift: the first entry, in a given execution order, whose comparison is not bitwise.

Forward drifts walk the graph in node order; gradient drifts walk it in backward execution order (the last node's
gradient is computed first), so "first" always means "first to be computed".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def gradient_operator(nodes: Iterable, value: str) -> str | None:
    """The node(s) whose backward produced the gradient of ``value``: the nodes reading it (``+``-joined when
    several, whose contributions are summed); None when no node reads it (a graph output: its gradient is the
    cotangent) or ``value`` is no node input (a parameter)."""
    readers = [n.name for n in nodes if value in n.inputs]
    return "+".join(readers) if readers else None


def first_drift(order: Sequence[str], records: Mapping[str, Mapping | None]) -> dict | None:
    """``{"node", "first_row", "first_modality"}`` of the first name in ``order`` whose record is not bitwise.

    A record is an agreement dict (``bitwise``, ``first_row``, ``first_modality``) or None (not checked: skipped).
    Returns None when every checked entry is bitwise.
    """
    for name in order:
        rec = records.get(name)
        if rec is None or rec.get("bitwise", True):
            continue
        return {"node": name, "first_row": rec.get("first_row"), "first_modality": rec.get("first_modality")}
    return None
