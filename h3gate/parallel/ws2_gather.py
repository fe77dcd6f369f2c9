"""``run ws2 --save-tensors``: every rank's node values and gradients put back together, un-sharded, in the parent.

A rank writes what it computed (``v:<node>``, ``g:<name>``) and, for each tensor, where its elements sit in the full
tensor (``p:v:<node>``, ``p:g:<name>``: flat indices): the rank plan's own slicing (``local_value`` /
``local_grad``, the slices the byte comparison reads) applied to ``arange(numel)`` of the full shape. The parent
scatters every rank's elements into full tensors in rank order: an element several ranks hold (a replicated value,
a gradient every TP rank holds whole) is the lowest such rank's, and a higher rank whose copy differs in any byte is
named; an element no rank holds is an internal error. Only shapes are read from TP1's file, never its values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHARDS = "rank-{rank}.safetensors"


def _positions(take, name: str, shape: list[int]) -> torch.Tensor:
    """Flat indices into a ``shape`` tensor of the elements ``take(name, full)`` holds, in its order."""
    numel = math.prod(shape)
    index = torch.arange(numel, dtype=torch.int32 if numel < 2**31 else torch.int64).reshape(shape)
    return take(name, index).contiguous().flatten()


def write_shards(
    plan, values: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], ref, folder: Path
) -> None:
    """Rank side: this rank's values and gradients (on the CPU) with their positions, to ``folder/rank-R``;
    ``ref`` the open TP1 file (shapes only)."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for kind, held, take in (("v", values, plan.local_value), ("g", grads, plan.local_grad)):
        for name, t in held.items():
            key = f"{kind}:{name}"
            out[key] = t.detach().contiguous().cpu()
            out["p:" + key] = _positions(take, name, list(ref.get_slice(key).get_shape()))
            if out["p:" + key].numel() != out[key].numel():
                raise RuntimeError(f"run ws2: rank {plan.rank} holds {out[key].numel()} elements of {key}, its plan "
                                   f"{out['p:' + key].numel()}")  # fmt: skip
    save_file(out, str(folder / SHARDS.format(rank=plan.rank)))


@dataclass
class Gather:
    """The full tensors being filled: elements so far, which are held, and the ranks whose copy of an element a
    lower rank holds differs from it (``key -> ranks``)."""

    shapes: dict[str, list[int]]
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    covered: dict[str, torch.Tensor] = field(default_factory=dict)
    replicas_differing: dict[str, list[int]] = field(default_factory=dict)

    def add(self, rank: int, key: str, local: torch.Tensor, where: torch.Tensor) -> None:
        if key not in self.full:
            numel = math.prod(self.shapes[key])
            self.full[key] = torch.empty(numel, dtype=local.dtype)
            self.covered[key] = torch.zeros(numel, dtype=torch.bool)
        full, covered = self.full[key], self.covered[key]
        if local.dtype != full.dtype:
            raise RuntimeError(f"run ws2: rank {rank} holds {key} as {local.dtype}, a lower rank {full.dtype}")
        local, where = local.flatten(), where.long()
        new = ~covered[where]
        held = where[~new]
        if held.numel() and not full[held].view(torch.uint8).equal(local[~new].view(torch.uint8)):
            self.replicas_differing.setdefault(key, []).append(rank)
        full[where[new]] = local[new]
        covered[where] = True


def gather(folder: Path, world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, list[int]]]:
    """Parent side: (node values, gradients, replicas differing) of the whole topology from every ``rank-R`` file
    in ``folder``: an element several ranks hold is the lowest such rank's, and a higher rank whose copy differs is
    named under the tensor's key (``v:<node>`` / ``g:<name>``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(folder / "reference"), framework="pt") as ref:
        shapes = {k: list(ref.get_slice(k).get_shape()) for k in ref.keys()}  # noqa: SIM118
    state = Gather(shapes)
    for rank in range(world):
        shard = load_file(str(folder / SHARDS.format(rank=rank)))
        for key, local in shard.items():
            if not key.startswith("p:"):
                state.add(rank, key, local, shard["p:" + key])
    missing = sorted(k for k, c in state.covered.items() if not bool(c.all()))
    if missing:
        raise RuntimeError(f"run ws2: no rank holds every element of {', '.join(missing[:4])}")
    tensors = {k: t.reshape(shapes[k]) for k, t in state.full.items()}
    values = {k[2:]: t for k, t in tensors.items() if k.startswith("v:")}
    grads = {k[2:]: t for k, t in tensors.items() if k.startswith("g:")}
    return values, grads, state.replicas_differing
