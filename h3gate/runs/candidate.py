"""The candidate a gate judges against the provider replay and the FP64 golden (``--candidate``).

* ``h3gate`` (the default) - the run's bound operators (strict kernels, or what the mode binds) through the one
  executor, forward and backward;
* ``sglang`` - SGLang 0.5.23's MiniMax-H3 DiT (``sglang/multimodal_gen/.../minimax_h3.py``), built on the run's own
  weights and fed the same packed inputs (:mod:`h3gate.adapters.sglang`): its node values are read by hooks at the
  points of the adapter's node map (chained: SGLang on its own upstream; isolated: every point's value captured,
  then replaced by the provider's, so each node runs on the provider's inputs; repeat; the request packed beside
  unrelated requests). Forward only: SGLang serves rollouts; the gates' backward judges h3gate's candidate. The
  request quality (``exact``: the reference chain; ``lossless``, SGLang's default: its fused RMSNorm + AdaLN site
  where the device runs it; ``high``) and the attention backend are SGLang's own settings, recorded with what SGLang
  actually ran (:meth:`~h3gate.adapters.sglang.candidate.SglangCandidate.record`).

The block gate runs SGLang's ``blocks[0]`` alone on the gate's block inputs (a model of the config's first block:
the same tensors as block 0 of the run's weights); the model gate runs SGLang's whole model (``--layers 0:B``: a
model of the first B blocks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from h3gate.adapters.sglang.runtime import QUALITIES, init_runtime, require_sglang
from h3gate.errors import InputError
from h3gate.gate.faults import RowFault
from h3gate.graph.core import Graph, Values
from h3gate.manifests.model_config import ModelConfig

if TYPE_CHECKING:
    from h3gate.runs.setup import Run, RunSpec

CANDIDATES = ("h3gate", "sglang")
FAULT_KINDS = ("scale",)


def check_candidate(spec: RunSpec) -> None:
    """The candidate options, before anything is read: a known candidate; for ``sglang``, SGLang installed (one line
    saying how, otherwise), a known quality, and a model that starts at block 0."""
    if spec.candidate not in CANDIDATES:
        raise InputError(f"--candidate {spec.candidate!r}: must be one of {', '.join(CANDIDATES)}")
    if spec.candidate != "sglang":
        if spec.sglang_attention is not None:
            raise InputError("--sglang-attention-backend: only with --candidate sglang")
        return
    require_sglang("--candidate sglang")
    if spec.sglang_quality not in QUALITIES:
        raise InputError(f"--sglang-quality {spec.sglang_quality!r}: must be one of {', '.join(QUALITIES)}")
    if spec.scope == "model" and spec.layers is not None:
        if not spec.layers.startswith("0:"):
            raise InputError(f"--layers {spec.layers} --candidate sglang: SGLang runs its model from block 0; "
                             "use --layers 0:B (a model of the first B blocks)")  # fmt: skip
        if spec.checkpoint is not None:
            raise InputError("--layers with --candidate sglang --checkpoint: SGLang loads the whole checkpoint; "
                             "drop --layers or use synthetic weights")  # fmt: skip


@dataclass
class SglangRun:
    """The SGLang candidate of one gate run (block or model scope), its negative control and what it left
    uncaptured. ``unrelated``: the other items of a batch placement (block: stand-ins of the block input; model:
    requests' inputs)."""

    candidate: Any
    graph: Graph
    inputs: Values
    unrelated: list
    fault: tuple[str, int] | None = None  # (SGLang module, packed row) of an injected one-row fault
    uncovered: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def _faulted(self) -> Iterator[None]:
        if self.fault is None:
            yield
            return
        from h3gate.adapters.sglang.capture import row_fault

        module, row = self.fault
        with row_fault(self.candidate.model, module, row):
            yield

    def _noted(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, reason in self.candidate.uncovered.items():
            self.uncovered.setdefault(name, reason)
        return values

    def chained(self) -> dict[str, torch.Tensor]:
        """Every captured node's value, SGLang on its own upstream (absent: not captured)."""
        with self._faulted(), torch.no_grad():
            return self._noted(self.candidate.chained(self.inputs))

    def repeat(self) -> dict[str, torch.Tensor]:
        with self._faulted(), torch.no_grad():
            return self._noted(self.candidate.repeat(self.inputs))

    def placed(self, size: int, position: int) -> dict[str, torch.Tensor]:
        """The request's node values (batch of 1) with its block input at ``position`` of a batch of ``size``."""
        with self._faulted(), torch.no_grad():
            return self._noted(self.candidate.placed(self.inputs, self.unrelated, size, position))

    def isolated(self, provider: Values) -> dict[str, torch.Tensor]:
        """Every covered node on the provider's inputs (one teacher-forced forward)."""
        with self._faulted(), torch.no_grad():
            values, gaps = self.candidate.isolated(self.inputs, provider)
        for name, reason in gaps.items():
            self.uncovered.setdefault(name, f"isolated: {reason}")
        return values

    def record(self) -> dict:
        return {"kind": "sglang", **self.candidate.record(), "uncovered": dict(self.uncovered)}

    def binding(self, node: str) -> dict:
        """A node's binding record: what computed it (SGLang's module at the node map's point)."""
        cand = self.candidate
        point = next(p for p in _points(cand.scope, cand.cfg, cand.layer) if p.node == node)
        where = f"{point.module} {point.where}" + (f" {point.part}" if point.part else "")
        return {"requested": "sglang", "actual": "sglang", "kernel_id": f"sglang:{where}", "label": "sglang",
                "fallback": False, "provider_bitwise_contract": False, "ops": []}  # fmt: skip


def _points(scope: str, cfg: ModelConfig, layer: int) -> list:
    """The node map of ``scope``: block 0's points, or the whole model's."""
    from h3gate.adapters.sglang.block import block_points
    from h3gate.adapters.sglang.capture import node_map

    return block_points(layer) if scope == "block" else node_map(cfg)


def fault_point(
    scope: str, cfg: ModelConfig, layer: int, fault: RowFault, flag: str = "--candidate sglang"
) -> tuple[str, int]:
    """The SGLang module whose output carries ``fault``'s node (a point read at a module's output, unsliced); ``flag``
    names the option that put SGLang there in the messages."""

    if fault.kind not in FAULT_KINDS or fault.direction != "forward":
        raise InputError(f"--fault {fault.label()} {flag}: only forward scale faults (SGLang serves "
                         "rollouts: no backward)")  # fmt: skip
    points = {p.node: p for p in _points(scope, cfg, layer)}
    point = points.get(fault.node)
    if point is None or point.where != "out" or point.part:
        usable = sorted(n for n, p in points.items() if p.where == "out" and not p.part)
        raise InputError(f"--fault {fault.node} {flag}: the node is not a whole SGLang module output "
                         f"(faults go on: {', '.join(usable)})")  # fmt: skip
    return point.module, fault.row


def check_forward_only(spec: RunSpec, backward: bool, fault_matrix: bool = False) -> None:
    """A gate of an ``sglang`` candidate runs forward only: the backward (and the fault matrix, which perturbs
    h3gate's own candidate) are refused up front, naming the way out."""
    if spec.candidate != "sglang" or not (backward or fault_matrix):
        return
    what = "--backward" if backward else "--fault-matrix"
    raise InputError(f"{what} --candidate sglang: SGLang serves rollouts, the gate judges it forward only "
                     "(use --no-backward; --fault NODE:ROW is its negative control)")  # fmt: skip


def _weights(run: Run, blocks: int) -> Any:
    """The weights SGLang's model holds: a checkpoint folder as it is; synthetic weights of the config cut to its
    first ``blocks`` blocks (the same tensors by name)."""
    if run.checkpoint["kind"] != "synthetic":
        return run.spec.checkpoint
    return run.source.with_config(run.cfg.model_copy(update={"num_layers": blocks}))


def sglang_candidate(run: Run, layer: int) -> Any:
    """The SGLang candidate of a prepared run whose candidate is ``sglang`` (else None): SGLang's runtime initialised
    for this process (world size 1), its DiT built on the run's weights on the run's device, request quality set."""
    if run.spec.candidate != "sglang":
        return None
    from h3gate.adapters.sglang.build import build_model
    from h3gate.adapters.sglang.candidate import SglangCandidate

    init_runtime(attention_backend=run.spec.sglang_attention, hidden_size=run.cfg.hidden_size)
    quality = run.spec.sglang_quality
    if run.spec.scope == "block":
        model = build_model(_weights(run, layer + 1), run.device)
        return SglangCandidate(model, run.cfg, "block", layer, quality=quality, seed=run.spec.seed)
    blocks = run.layers[1]
    cfg = run.cfg.model_copy(update={"num_layers": blocks})
    model = build_model(_weights(run, blocks), run.device)
    return SglangCandidate(model, cfg, "model", raw=run.model.raw, quality=quality, seed=run.spec.seed)
