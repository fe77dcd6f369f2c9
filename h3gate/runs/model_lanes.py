"""Lanes: the executions of the whole-model gate, advanced together one stage at a time.

A :class:`Lane` is one execution of the model (the FP64 golden, the provider under one variant, the candidate, its
repeat, the candidate with the request placed in a batch) carrying the values later stages read. Every lane runs a
stage before the next stage starts, so the gate holds one stage's parameters and activations (per lane) at a time,
not the model's. With ``save`` a lane keeps each stage's inputs for the backward's per-stage recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from h3gate.gate.variants import Variant, refusal
from h3gate.graph import determinism
from h3gate.graph.core import OpTable, Values
from h3gate.graph.execute import Override
from h3gate.graph.model import OUTPUTS
from h3gate.graph.stages import Stage, run_stage
from h3gate.runs.ws1_ops import bounds

ROW_KINDS = ("packed", "text", "video", "audio")


@dataclass
class Lane:
    """One execution. ``batch = (size, position)``: the request is item ``position`` of a batch of ``size``."""

    name: str
    kind: str  # "golden", "provider" or "candidate"
    table: OpTable
    values: Values
    variant: Variant | None = None
    overrides: Mapping[str, Override] | None = None
    batch: tuple[int, int] | None = None
    save: bool = False
    saved: dict[str, Values] = field(default_factory=dict)
    refused: str | None = None

    @property
    def golden(self) -> bool:
        return self.kind == "golden"

    def params(self, params: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor]):
        return golden if self.golden else params

    def entered(self) -> contextlib.AbstractContextManager:
        return self.variant.enter() if self.variant is not None else contextlib.nullcontext()

    def run(self, stage: Stage, params: Mapping[str, torch.Tensor]) -> Values | None:
        """The stage's node outputs on this lane's values (None once a variant was refused at run time); the
        stage's outputs are kept for later stages."""
        if self.refused is not None:
            return None
        if self.save:
            self.saved[stage.label] = {k: self.values[k] for k in stage.external}
        try:
            with self.entered(), torch.no_grad(), determinism.evaluation(self.name):
                out = run_stage(stage, self.values, params, self.table, self.overrides)
        except RuntimeError as exc:
            if self.variant is None:
                raise
            self.refused = refusal(exc)
            self.saved.clear()
            return None
        for k in stage.outputs:
            self.values[k] = out[k]
        return out

    def release(self, names: list[str]) -> None:
        for k in names:
            if k not in OUTPUTS:
                self.values.pop(k, None)

    def item(self, value: torch.Tensor, row_dim: int | None) -> torch.Tensor:
        """This lane's request in one of its node values (the batch item of a placement lane)."""
        return value if self.batch is None else select_item(value, row_dim, self.batch[1])


@dataclass
class CapturedLane(Lane):
    """A lane whose node values another engine computed whole (SGLang's captured forward: the request's own values,
    a batch placement's item already selected); a stage hands out those of its nodes that were captured."""

    captured: Values = field(default_factory=dict)

    def run(self, stage: Stage, params: Mapping[str, torch.Tensor]) -> Values | None:
        out = {n.name: self.captured[n.name] for n in stage.nodes if n.name in self.captured}
        self.values.update({k: out[k] for k in stage.outputs if k in out})
        return out

    def item(self, value: torch.Tensor, row_dim: int | None) -> torch.Tensor:
        return value


def row_labels(kind: str, tensor: torch.Tensor, row_dim: int | None, packed: list[str]) -> list[str] | None:
    """The modality of each row of a value whose rows are ``kind`` (``packed``: the layout's per-row modality)."""
    if row_dim is None or kind not in ROW_KINDS:
        return None
    rows = tensor.shape[row_dim]
    if kind == "packed":
        return packed if len(packed) == rows else None
    return [kind] * rows


def select_item(t: torch.Tensor, row_dim: int | None, position: int) -> torch.Tensor:
    """Item ``position`` of a batched value: values with packed/text/video/audio rows (``row_dim == 1``) carry the
    batch on dim 0; timestep-space values (the time embedding, AdaLN tables) are shared by the batch."""
    return t.narrow(0, position, 1) if row_dim == 1 else t


def merged(recs: list[dict]) -> dict:
    """One value's batch-row record from its placements' agreements: bitwise when every placement is."""
    bad = next((r for r in recs if not r["bitwise"]), None)
    return {
        "bitwise": bad is None,
        "first_row": None if bad is None else bad["first_row"],
        "first_modality": None if bad is None else bad["first_modality"],
        "placements": [{k: r[k] for k in ("batch", "position", "bitwise", "first_row")} for r in recs],
    }


def contract_floor(floor_dtypes: Iterable[str], ops: Iterable[str], direction: str, dtype: torch.dtype) -> float:
    """The row bound's minimum for a tensor of ``dtype`` made by ``ops``: the largest rel_l2 their contracts
    declare for that dtype and direction (``run ws1-ops``'s bounds), when the profile's ``contract_floor`` lists
    the dtype; else 0."""
    name = str(dtype).removeprefix("torch.")
    if name not in floor_dtypes:
        return 0.0
    side = 0 if direction == "forward" else 1
    return max((bounds(op)[side].get(name, 0.0) for op in ops), default=0.0)
