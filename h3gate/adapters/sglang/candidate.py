"""SGLang as a gate candidate: the node values a gate engine asks of a candidate, from SGLang's own modules.

::

    cand = SglangCandidate(model, cfg, scope="block", layer=0)     # or scope="model", raw=RawMetadata of the layout
    cand.chained(inputs)                        -> {node: value}   SGLang on its own upstream (one forward)
    cand.repeat(inputs)                         -> {node: value}   chained again: a second, independent forward
    cand.isolated(inputs, provider)             -> ({node: value}, {node: reason})   teacher-forced (:mod:`.forcing`)
    cand.placed(inputs, unrelated, size, pos)   -> {node: value}   the request as item ``pos`` of a batch of ``size``
    cand.lane(values)                           -> (Node, value or None) in graph order: a lane's stream
    cand.uncovered                              -> {node: reason} of the latest call: nodes absent from its values
    cand.record()                               -> what ran (``runtime_record``, scope, node map, packing)

``inputs``: block scope, the block graph's inputs (``build_block_inputs(...).tensors``: ``hidden_states`` (1, S, H)
bf16, ``temb``, ``adaln_indices``, ``rope_cos``, ``rope_sin``, ``attention_order``), run on ``model.blocks[layer]``
(:mod:`.block`); model scope, one request's model-graph inputs (``video_rows``, ``audio_rows``, ``text``, batch 1) on
the layout whose metadata is ``raw``, run on the whole model (:func:`.capture.capture_forward`, SGLang's serving path
by default). Values are keyed by the scope's graph node names (block: ``norm1`` .. ``residual_mlp``; model:
``block.0.norm1``, ...), in h3gate's dtypes and shapes with batch 1, computed under ``no_grad``.

``isolated``: ``provider`` maps node -> the provider's value (batch 1); each node's value is SGLang's arithmetic of
that node on the provider's values of its inputs, all nodes in one forward; the second element names the nodes
without an exact isolated value and why (on the CPU, none). ``placed``: ``unrelated`` are the other items, block
scope: ``hidden_states`` stand-ins (1, S, H) (None: ``stand_in(seed, "hidden_states", i, ...)`` for i = 1 ..
size - 1, the block gate's own), model scope: request inputs (``video_rows``, ``audio_rows``, ``text``, batch 1) on
the same layout. SGLang packs the items one after another into one ``cu_seqlens`` sequence; the request's rows are
returned (batch axis kept, length 1), values without a batch axis (time embedding, AdaLN projections) whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from h3gate.adapters.sglang.block import ROWS, block_packing, block_points, capture_block
from h3gate.adapters.sglang.capture import Capture, capture_forward, node_map
from h3gate.adapters.sglang.inputs import ALIGN, Packing, packing
from h3gate.adapters.sglang.runtime import runtime_record, set_quality
from h3gate.errors import InputError
from h3gate.graph.block import build_block_graph
from h3gate.graph.core import Graph, Node
from h3gate.graph.inputs import stand_in
from h3gate.graph.model import RawMetadata, build_model_graph
from h3gate.manifests.model_config import ModelConfig

SCOPES = ("block", "model")
BATCHED_ROWS = ("packed", "text", "video", "audio")  # model-graph row kinds with a batch axis (dim 0)
REQUEST_INPUTS = ("video_rows", "audio_rows", "text")


class SglangCandidate:
    """SGLang's DiT ``model`` as a candidate at ``scope`` (module docstring). ``quality`` is set on the model
    (``"exact"``: the reference chain); ``align`` pads the packed sequence (64, as SGLang's model); block scope:
    ``layer`` and ``seed`` (the default unrelated stand-ins); model scope: ``raw`` (required), ``serving`` (SGLang's
    serving path: text refined per request, RoPE cache prepared) and ``mask_condition`` / ``condition_rows``."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        scope: str = "block",
        layer: int = 0,
        raw: RawMetadata | None = None,
        quality: str = "exact",
        align: int = ALIGN,
        seed: int = 0,
        serving: bool = True,
        mask_condition: bool = False,
        condition_rows: int = 0,
    ) -> None:
        if scope not in SCOPES:
            raise InputError(f"sglang candidate: scope {scope!r}: must be one of {', '.join(SCOPES)}")
        if scope == "model" and raw is None:
            raise InputError("sglang candidate: scope model: needs the layout's raw metadata (raw=)")
        self.model, self.cfg, self.scope, self.layer, self.raw = model, cfg, scope, layer, raw
        self.quality, self.align, self.seed = quality, align, seed
        self.serving, self.mask_condition, self.condition_rows = serving, mask_condition, condition_rows
        self.graph: Graph = build_block_graph(cfg, layer) if scope == "block" else build_model_graph(cfg)
        self.rows = dict(ROWS) if scope == "block" else {n.name: n.meta["rows"] for n in self.graph.nodes}
        self.uncovered: dict[str, str] = {}
        self.last_packing: Packing | None = None
        set_quality(model, quality)

    # --- the engine's calls -------------------------------------------------------------------------------------

    def chained(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every captured node's value with SGLang on its own upstream (batch 1)."""
        return self._values(self._capture(inputs, 1, 0))

    def repeat(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`chained` again, a second forward from scratch (the engine compares the two bitwise)."""
        return self.chained(inputs)

    def isolated(
        self, inputs: Mapping[str, torch.Tensor], provider: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(node -> SGLang's value of the node on the provider's inputs, node -> why it has no exact isolated
        value): one teacher-forced forward; nodes in the second mapping are absent from the first."""
        cap = self._capture(inputs, 1, 0, provider=provider)
        values = {k: v for k, v in self._values(cap).items() if k not in cap.uncovered}
        return values, dict(self.uncovered)

    def placed(
        self, inputs: Mapping[str, torch.Tensor], unrelated: Sequence[Any] | None, size: int, position: int
    ) -> dict[str, torch.Tensor]:
        """The request's node values with the request as item ``position`` of a batch of ``size`` (the other items
        ``unrelated[: size - 1]`` in order around it)."""
        if not 0 <= position < size:
            raise InputError(f"sglang candidate: position {position} outside a batch of {size}")
        cap = self._capture(inputs, size, position, unrelated=unrelated)
        return {k: self._select(k, v, position) for k, v in self._values(cap).items()}

    def lane(self, values: Mapping[str, torch.Tensor]) -> Iterator[tuple[Node, torch.Tensor | None]]:
        """``(node, value)`` in graph order (None where the node is uncovered): a stream for the engines' lanes."""
        for node in self.graph.nodes:
            yield node, values.get(node.name)

    def record(self) -> dict[str, Any]:
        """What ran: SGLang's runtime record, the scope, the packing of the latest call and the node map."""
        points = block_points(self.layer) if self.scope == "block" else node_map(self.cfg)
        return {
            **runtime_record(self.model, self.quality),
            "scope": self.scope,
            "layer": self.layer if self.scope == "block" else None,
            "packing": self._packing_record(),
            "node_map": [{"node": p.node, "module": p.module, "where": p.where, "part": p.part} for p in points],
            "uncovered": dict(self.uncovered),
        }

    # --- internals ----------------------------------------------------------------------------------------------

    def _packing_record(self) -> dict[str, Any] | None:
        if self.last_packing is None:
            return None
        record = self.last_packing.record()
        block = ("batch", "rows_per_request", "packed_rows", "cu_seqlens")  # the rest describes the model's path
        return {k: record[k] for k in block} if self.scope == "block" else record

    def _capture(self, inputs, size: int, position: int, unrelated=None, provider=None) -> Capture:
        if self.scope == "block":
            hidden = self._block_hidden(inputs["hidden_states"], unrelated, size, position)
            cap = capture_block(self.model, self.cfg, self.layer, inputs, hidden, self.align, provider,
                                graph=self.graph)  # fmt: skip
            self.last_packing = block_packing(size, hidden.shape[1], self.align)
        else:
            batch = self._model_batch(inputs, unrelated, size, position)
            raw = self.raw
            pack = packing(size, int(raw.position_ids.shape[0]), raw.text_indices, self.align, self.serving,
                           self.mask_condition, self.condition_rows)  # fmt: skip
            cap = capture_forward(self.model, self.cfg, batch, raw, pack, self.graph, provider=provider)
            self.last_packing = pack
        self.uncovered = dict(cap.uncovered)
        return cap

    def _values(self, cap: Capture) -> dict[str, torch.Tensor]:
        return {n.name: cap.values[n.name] for n in self.graph.nodes if n.name in cap.values}

    def _block_hidden(self, x: torch.Tensor, unrelated, size: int, position: int) -> torch.Tensor:
        if size == 1:
            return x
        if unrelated is None:
            s, h = x.shape[1], x.shape[2]
            unrelated = [stand_in(self.seed, "hidden_states", i, s, h, x.device) for i in range(1, size)]
        return _place(x, list(unrelated), size, position)

    def _model_batch(self, inputs, unrelated, size: int, position: int) -> dict[str, torch.Tensor]:
        batch = dict(inputs)
        if size == 1:
            return batch
        if unrelated is None:
            raise InputError("sglang candidate: scope model: placements need the unrelated requests' inputs")
        for key in REQUEST_INPUTS:
            batch[key] = _place(inputs[key], [u[key] for u in unrelated], size, position)
        return batch

    def _select(self, name: str, value: torch.Tensor, position: int) -> torch.Tensor:
        """The request's item of a batched value (a copy, so the batch can be freed); values without a batch axis
        whole."""
        return value.narrow(0, position, 1).clone() if self.rows[name] in BATCHED_ROWS else value


def _place(item: torch.Tensor, others: list[torch.Tensor], size: int, position: int) -> torch.Tensor:
    """A batch of ``size`` along dim 0: ``item`` (batch 1) at ``position``, ``others`` filling the rest in order."""
    if len(others) < size - 1:
        raise InputError(f"sglang candidate: a batch of {size} needs {size - 1} unrelated items, got {len(others)}")
    fill = others[: size - 1]
    return torch.cat([*fill[:position], item, *fill[position:]])
