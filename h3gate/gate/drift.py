"""First drift: the first entry, in a given execution order, whose comparison is not bitwise.

Forward drifts walk the graph in node order; gradient drifts walk it in backward execution order (the last node's
gradient is computed first), so "first" always means "first to be computed".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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
