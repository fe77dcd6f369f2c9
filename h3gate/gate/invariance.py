"""Invariance probes: repeat (same inputs, run twice) and batch-row (one item inside batches with unrelated items).

RFC section 4 rules 2 and 6: a strict execution is bitwise repeatable and one batch item's bytes do not depend on
the batch size, its position in the batch, or the other items. The batch probe places the probed item at
``position`` of a batch of ``size`` (``PLACEMENTS``: alone; first of 2; last of 3) and compares that item's slice of
every tensor with the batch-of-1 run, bitwise. Tensors without a batch axis (e.g. the AdaLN table, parameter
gradients) are compared whole for forward values and skipped (``None``) where they sum over the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from h3gate.gate.compare import agreement

# (batch size, position of the probed item): alone, first of two, last of three.
PLACEMENTS: tuple[tuple[int, int], ...] = ((1, 0), (2, 0), (3, 2))


def place(item: torch.Tensor, others: Sequence[torch.Tensor], size: int, position: int) -> torch.Tensor:
    """A batch of ``size`` along dim 0 with ``item`` (batch 1) at ``position`` and ``others`` filling the rest."""
    if len(others) < size - 1:
        raise ValueError(f"need {size - 1} unrelated items, got {len(others)}")
    fill = list(others[: size - 1])
    parts = fill[:position] + [item] + fill[position:]
    return torch.cat(parts, dim=0)


def select(t: torch.Tensor, batch_dim: int | None, position: int) -> torch.Tensor:
    """The probed item's slice (batch axis kept, length 1); the whole tensor when it has no batch axis."""
    return t if batch_dim is None else t.narrow(batch_dim, position, 1)


def repeat_records(
    names: Sequence[str],
    first: Mapping[str, torch.Tensor],
    second: Mapping[str, torch.Tensor],
    row_dims: Mapping[str, int | None],
    modalities: Sequence[str] | None,
) -> dict[str, dict]:
    """Per name: the agreement of the second run with the first."""
    return {n: agreement(second[n], first[n], row_dims.get(n), modalities) for n in names}


def batch_records(
    names: Sequence[str],
    runs: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]],
    row_dims: Mapping[str, int | None],
    batch_dims: Mapping[str, int | None],
    modalities: Sequence[str] | None,
    skip: Callable[[str], bool] = lambda name: False,
) -> dict[str, dict | None]:
    """Per name: ``{"bitwise", "first_row", "first_modality", "placements": [...]}`` or None when skipped.

    ``runs`` holds ``(size, position, values)``; the first entry is the reference (normally the batch of 1). Each
    placement record is the agreement of the probed item's slice with the reference's slice.
    """
    (_, ref_pos, ref), rest = runs[0], runs[1:]
    out: dict[str, dict | None] = {}
    for n in names:
        if skip(n):
            out[n] = None
            continue
        bd = batch_dims.get(n)
        base = select(ref[n], bd, ref_pos)
        placements = []
        for size, pos, values in rest:
            rec = agreement(select(values[n], bd, pos), base, row_dims.get(n), modalities)
            placements.append({"batch": size, "position": pos, **rec})
        bad = next((p for p in placements if not p["bitwise"]), None)
        out[n] = {
            "bitwise": bad is None,
            "first_row": None if bad is None else bad["first_row"],
            "first_modality": None if bad is None else bad["first_modality"],
            "placements": placements,
        }
    return out
