"""Where the whole-model backward holds what it keeps (:mod:`h3gate.runs.model_backward`): on the device, or, when a
stage's backward does not fit it (:func:`h3gate.runs.model_memory.hold_on_host`: a 768p block on one H200), the
golden's gradients and, while the other lanes run, the provider's stage backward in host memory
(:mod:`h3gate.graph.parked`). Every lane but the default provider drops its node values after their last reader in
the stage (the isolated node views read the provider's; the candidate's autograd-forward check reads its stage
outputs, which every lane keeps). Only where tensors wait changes, never an operation: the bytes are the same.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from h3gate.graph.parked import Fetched, park, unpark
from h3gate.graph.stages import KEEP_ALL, Keep, StageGrads
from h3gate.runs.model_lanes import Lane

LEAN = Keep(forward=False)  # a lane whose node values nothing reads after its stage backward


def golden_keep(hold: bool) -> Keep:
    """The golden's stage backward: node values dropped after their last reader; node and parameter gradients in
    host memory when the gate holds on the host."""
    return Keep(forward=False, host=hold)


def lane_keep(hold: bool, lane: Lane, provider: Lane) -> Keep:
    """What a chained lane's stage backward keeps (module docstring); ``provider``: the default provider lane."""
    if lane.golden:
        return golden_keep(hold)
    return KEEP_ALL if lane is provider else LEAN


def golden_read(grads: Mapping[str, torch.Tensor], hold: bool, device: str) -> Mapping[str, torch.Tensor]:
    """The golden's gradients as the judges read them: on ``device``, one at a time when they are parked."""
    return Fetched(grads, device) if hold else grads


def parked(got: StageGrads) -> StageGrads:
    """A stage backward moved to host memory (the provider's while the other lanes run)."""
    return StageGrads(park(got.nodes), park(got.inputs), park(got.params), park(got.forward))


def unparked(got: StageGrads, device: str) -> StageGrads:
    """A parked stage backward back on ``device``."""
    return StageGrads(*(unpark(part, device) for part in (got.nodes, got.inputs, got.params, got.forward)))
