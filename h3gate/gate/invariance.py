"""Invariance probes: repeat (same inputs, run twice) and batch-row (one item inside batches with unrelated items).

RFC section 4 rules 2 and 6: a strict execution is bitwise repeatable and one batch item's bytes do not depend on
the batch size, its position in the batch, or the other items. The batch probe places the probed item at
``position`` of a batch of ``size`` (``PLACEMENTS``: alone, first of 2, last of 3; ``GRAD_PLACEMENTS`` for
gradients: alone, second of 2) and compares that item's slice of every tensor with the batch-of-1 run, bitwise.
Tensors without a batch axis (e.g. the AdaLN table) are compared whole; gradients that sum over the batch
(parameters, temb) have no per-row check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from h3gate.gate.compare import agreement

# (batch size, position of the probed item): alone, first of two, last of three.
PLACEMENTS: tuple[tuple[int, int], ...] = ((1, 0), (2, 0), (3, 2))
# Gradients (forward + backward, the costly probe): alone, and second of two.
GRAD_PLACEMENTS: tuple[tuple[int, int], ...] = ((1, 0), (2, 1))


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


def slices(values: Mapping[str, torch.Tensor | None], batch_dims: Mapping[str, int | None], position: int) -> dict:
    """The probed item's slice of every (non-None) tensor, cloned so the full batch can be freed."""
    return {k: select(v, batch_dims.get(k), position).clone() for k, v in values.items() if v is not None}


def batch_records(
    names: Sequence[str],
    reference: Mapping[str, torch.Tensor],
    placements: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]],
    row_dims: Mapping[str, int | None],
    modalities: Sequence[str] | None,
) -> dict[str, dict]:
    """Per name: ``{"bitwise", "first_row", "first_modality", "placements": [...]}``.

    ``reference`` holds the batch-of-1 values; ``placements`` holds ``(size, position, slices)`` where ``slices``
    are the probed item's slices (:func:`slices`). Each placement record is the agreement of its slice with the
    reference, bitwise.
    """
    per_placement = [
        placement_records(names, reference, size, pos, values, row_dims, modalities) for size, pos, values in placements
    ]
    return merge_placements(names, per_placement)


def placement_records(
    names: Sequence[str],
    reference: Mapping[str, torch.Tensor],
    size: int,
    position: int,
    values: Mapping[str, torch.Tensor],
    row_dims: Mapping[str, int | None],
    modalities: Sequence[str] | None,
) -> dict[str, dict]:
    """Per name: one placement's record (its slice against the batch-of-1 reference), so that a caller can drop
    the batch's values right after (at 768p one batch of 3 holds tens of GB)."""
    return {n: placement_record(values[n], reference[n], size, position, row_dims.get(n), modalities) for n in names}


def placement_record(
    value: torch.Tensor,
    reference: torch.Tensor,
    size: int,
    position: int,
    row_dim: int | None,
    modalities: Sequence[str] | None,
) -> dict:
    """One value's record in one placement: the probed item's slice against its batch-of-1 value, bitwise."""
    return {"batch": size, "position": position, **agreement(value, reference, row_dim, modalities)}


def filler_slots(placements: Sequence[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """Unrelated item ``j`` -> ``(placement index, batch index)`` of every placement holding it, for the items more
    than one placement holds (:func:`place`'s order: the unrelated items in order, the request inserted at its
    position)."""
    slots: dict[int, list[tuple[int, int]]] = {}
    for k, (size, position) in enumerate(placements):
        for j in range(size - 1):
            slots.setdefault(j, []).append((k, j if j < position else j + 1))
    return {j: s for j, s in slots.items() if len(s) > 1}


def filler_records(
    batches: Sequence[torch.Tensor | None],
    placements: Sequence[tuple[int, int]],
    batch_dim: int | None,
    row_dim: int | None,
    modalities: Sequence[str] | None,
) -> list[dict]:
    """Batch-row invariance of the unrelated items (fillers): one value of each placement's whole batch
    (``batches``, in ``placements``' order; None where a placement gave none), each filler's slice in every later
    placement holding it against its slice in the first, bitwise. Nothing for a value without a batch axis."""
    if batch_dim is None:
        return []
    out = []
    for j, slots in filler_slots(placements).items():
        (k0, i0), rest = slots[0], slots[1:]
        if batches[k0] is None:
            continue
        ref = select(batches[k0], batch_dim, i0)
        for k, i in rest:
            if batches[k] is None:
                continue
            agree = agreement(select(batches[k], batch_dim, i), ref, row_dim, modalities)
            out.append({"filler": j, "first": [*placements[k0], i0], "second": [*placements[k], i],
                        **{key: agree[key] for key in ("bitwise", "first_row", "first_modality")}})  # fmt: skip
    return out


def with_fillers(record: dict, fillers: list[dict]) -> dict:
    """A batch-row record (:func:`merge_placements`) with its fillers' records: bitwise only when they are too (the
    first row named is the request's where it differs, else the first differing filler's)."""
    bad = next((f for f in fillers if not f["bitwise"]), None)
    out = {**record, "fillers": fillers}
    if record["bitwise"] and bad is not None:
        out.update(bitwise=False, first_row=bad["first_row"], first_modality=bad["first_modality"])
    return out


def merge_placements(names: Sequence[str], per_placement: Sequence[Mapping[str, dict]]) -> dict[str, dict]:
    """The :func:`batch_records` result from per-placement records."""
    out: dict[str, dict] = {}
    for n in names:
        recs = [p[n] for p in per_placement]
        bad = next((p for p in recs if not p["bitwise"]), None)
        out[n] = {
            "bitwise": bad is None,
            "first_row": None if bad is None else bad["first_row"],
            "first_modality": None if bad is None else bad["first_modality"],
            "placements": recs,
        }
    return out
