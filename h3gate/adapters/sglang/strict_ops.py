"""The strict binding's operator calls, the metadata of one forward, and its tensor-parallel merge group.

* :class:`OpCaller` - every operator call of the binding: ``ops(node, op, *args)`` runs the callable
  :func:`h3gate.ops.registry.bind` gave ``op`` (through :func:`h3gate.graph.executions.candidate_table`: the same table
  h3gate's graph runs), names the node around it for the launch log, appends one trace record and applies a
  deliberate fault registered for the node (a negative control) to the node's last operator's output.
  :meth:`OpCaller.tp` records a call of a TP layer (:mod:`h3gate.kernels.tp_layers`) the same way.
* :class:`Segment` / :func:`segments` - SGLang's packed sequence cut by ``cu_seqlens``: per non-empty segment the
  text, video and audio rows it holds (from the position lists SGLang's forward reads) and, for a request, h3gate's
  canonical walk order :func:`h3gate.layout.canonical_order` (``[text | audio | video]`` by index tensor, rows
  relative to the segment), derived exactly as :func:`h3gate.graph.model.derive_metadata` derives
  ``attention_order`` for one request. A segment that holds no row of any modality is padding (order None).
* :class:`ForwardMeta` - what one bound forward derives before SGLang's own forward runs: h3gate's MM-RoPE tables
  (:func:`h3gate.ops.reference.rope_tables` on SGLang's float64 ``img_position_ids``: FP32 cos / sin, the tables
  h3gate's graph reads) and the ``cu_seqlens`` bounds; the segments follow from SGLang's ``_embed`` arguments.
* :class:`TpPlan` - the TP degree and rank of SGLang's TP group, h3gate's :class:`~h3gate.kernels.tp_layers.MergeGroup`
  over it (``gather``: an all-gather of raw bytes in rank order, a copy, never arithmetic), and the full weights of
  the layers h3gate runs replicated (gathered once from SGLang's shards; at TP1 the module's own tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from h3gate.errors import InputError
from h3gate.graph.core import OpTable
from h3gate.graph.executions import NodeBinding
from h3gate.kernels import launches
from h3gate.kernels.tp_layers import KERNEL_ID as TP_KERNEL_ID
from h3gate.kernels.tp_layers import ONE_DEVICE, MergeGroup
from h3gate.layout import canonical_order
from h3gate.ops import reference

Fault = Callable[[torch.Tensor], torch.Tensor]


def scale_row(row: int, factor: float = 1.0 + 2.0**-6) -> Fault:
    """A negative control: row ``row`` (dim 0: SGLang's packed row) of a node's output scaled by ``factor`` in its
    dtype (a copy; the rest of the value unchanged)."""

    def fault(value: torch.Tensor) -> torch.Tensor:
        out = value.clone()
        out[row] = out[row] * factor
        return out

    return fault


class OpCaller:
    """The binding's operator calls (module docstring). ``trace`` and ``faults`` are the session's."""

    def __init__(
        self,
        table: OpTable,
        bindings: Mapping[str, NodeBinding],
        last_op: Mapping[str, str],
        trace: list[dict],
        faults: dict[str, Fault],
        call_index: Callable[[], int],
    ) -> None:
        self.table, self.bindings, self.last_op = table, bindings, last_op
        self.trace, self.faults, self.call_index = trace, faults, call_index

    def binding(self, node: str, op: str):
        nb = self.bindings.get(node)
        found = None if nb is None else next((b for b in nb.bindings if b.op == op), None)
        if found is None:
            raise InputError(f"sglang strict binding: node {node}: operator {op} is not one of the node's operators")
        return found

    def note(self, node: str, op: str, **extra: Any) -> None:
        b = self.binding(node, op)
        rec = {"call": self.call_index(), "node": node, "op": op, "kernel_id": b.kernel_id, "requested": b.requested,
               "actual": b.actual}  # fmt: skip
        if b.bound and b.bound != op:
            rec["bound"] = b.bound
        self.trace.append({**rec, **extra})

    def fault(self, node: str, op: str, value: torch.Tensor) -> torch.Tensor:
        fn = self.faults.get(node)
        return value if fn is None or self.last_op.get(node) != op else fn(value)

    def __call__(
        self,
        node: str,
        op: str,
        *args: Any,
        trace: Mapping[str, Any] | None = None,
        view: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fault: bool = True,
        **kwargs: Any,
    ):
        """``op`` as the node's binding runs it (kwargs go to the operator, ``trace`` into the record), its output
        through ``view`` (SGLang's shape: the node's packed rows on dim 0), then the node's fault unless ``fault`` is
        False (a caller assembling the node's value from several calls applies it to the whole)."""
        self.note(node, op, **(trace or {}))
        with launches.node(node):
            out = self.table[op](*args, **kwargs)
        out = out if view is None else view(out)
        return self.fault(node, op, out) if fault else out

    def grouped(self, nodes: tuple[str, ...], op: str, x: torch.Tensor, weights: list[torch.Tensor]):
        """Sibling GEMMs of one operator on one input (q, k, v): one call of the bound callable's ``grouped`` where it
        has one (bitwise the calls one by one), one record a node."""
        fn = self.table[op]
        group = getattr(fn, "grouped", None)
        if group is None:
            return [self(node, op, x, w) for node, w in zip(nodes, weights, strict=True)]
        for node in nodes:
            self.note(node, op, grouped=len(nodes))
        with launches.node(*nodes):
            outs = group(x, weights)
        return [self.fault(node, op, out) for node, out in zip(nodes, outs, strict=True)]

    def tp(self, node: str, op: str, layer: str, fn: Callable, *args: Any) -> torch.Tensor:
        """A TP layer's call (``fn = ColumnLinear.apply`` ...) standing for ``op`` on a rank's shard."""
        self.binding(node, op)  # the node's operator must be bound (strict: its seg8 twin, a Triton kernel)
        rec = {"call": self.call_index(), "node": node, "op": op, "kernel_id": TP_KERNEL_ID, "requested": "triton",
               "actual": "triton", "tp_layer": layer}  # fmt: skip
        self.trace.append(rec)
        with launches.node(node):
            out = fn(*args)
        return self.fault(node, op, out)


# -- one forward's metadata ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Packed rows ``[start, stop)`` of one ``cu_seqlens`` segment. Per modality (text, video, audio): ``src`` the
    positions in SGLang's position list (the rows of its embedding) and ``rows`` the packed rows relative to
    ``start``; ``order`` the canonical walk order (None: padding)."""

    start: int
    stop: int
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    order: torch.Tensor | None = None

    @property
    def request(self) -> bool:
        return self.order is not None


def segments(bounds: tuple[int, ...], text: torch.Tensor, video: torch.Tensor, audio: torch.Tensor) -> list[Segment]:
    """Every non-empty segment of ``bounds`` with its rows (module docstring); a request's rows must cover its
    segment exactly once (the strict attention walks a permutation), else InputError naming the segment."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b <= a:
            continue
        src = tuple(torch.nonzero((pos >= a) & (pos < b)).view(-1) for pos in (text, video, audio))
        if not any(s.numel() for s in src):
            out.append(Segment(a, b))
            continue
        rows = tuple(pos.index_select(0, s) - a for pos, s in zip((text, video, audio), src, strict=True))
        order = canonical_order(*rows)
        every = torch.arange(b - a, device=order.device)
        if order.numel() != b - a or not torch.equal(torch.sort(order).values, every):
            raise InputError(
                f"sglang strict binding: packed segment [{a}, {b}): its text, video and audio rows do not cover it "
                f"exactly once (h3gate's attention walks a permutation of a request's rows)"
            )
        out.append(Segment(a, b, src, rows, order))
    return out


@dataclass
class ForwardMeta:
    """One bound forward's h3gate metadata (module docstring); ``temb`` is set by the bound time embedder."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    bounds: tuple[int, ...]
    row_start: int = 0
    segments: list[Segment] = field(default_factory=list)
    temb: torch.Tensor | None = None

    def segment(self, start: int, stop: int) -> Segment:
        for seg in self.segments:
            if (seg.start, seg.stop) == (start, stop):
                return seg
        raise InputError(f"sglang strict binding: attention segment [{start}, {stop}) is not a cu_seqlens segment")

    def rope(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's rows of the RoPE tables (``row_start`` .. ``row_start + rows``)."""
        end = self.row_start + rows
        return self.rope_cos[self.row_start : end], self.rope_sin[self.row_start : end]


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


def _positions(kwargs: Mapping[str, Any], key: str, device: torch.device) -> torch.Tensor:
    ids = _field(kwargs.get(key), "position_ids")
    if ids is None:
        raise InputError(f"sglang strict binding: forward kwargs: {key}.position_ids is required")
    return ids.view(-1).to(device=device, dtype=torch.long)


def forward_meta(kwargs: Mapping[str, Any], freq_dim: int, theta: float, row_start: int = 0) -> ForwardMeta:
    """h3gate's RoPE tables and the segments from SGLang's forward kwargs (its text rows cut to the live text length
    as its ``_embed`` cuts them: ``refined_prompt_embeds_length``, else the refiner's ``cu_seqlens[1]``)."""
    pos, psp = kwargs.get("img_position_ids"), kwargs.get("packed_seq_params")
    if pos is None or psp is None:
        raise InputError("sglang strict binding: forward kwargs: img_position_ids and packed_seq_params are required")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[-1] != 3:
        raise InputError(f"sglang strict binding: img_position_ids: must be [1, S, 3], got {list(pos.shape)}")
    host = _field(psp, "cu_seqlens_q_host")
    bounds = tuple(int(b) for b in (host if host is not None else _field(psp, "cu_seqlens_q").tolist()))
    device = kwargs["x"].device if torch.is_tensor(kwargs.get("x")) else pos.device
    length = kwargs.get("refined_prompt_embeds_length")
    if length is None:
        length = _field(kwargs.get("refiner_packed_seq_params"), "cu_seqlens_q")[1]
    text = _positions(kwargs, "text_pos_info", device)[: int(length)]
    video, audio = (_positions(kwargs, k, device) for k in ("img_pos_info", "audio_pos_info"))
    cos, sin = reference.rope_tables(pos[0].to(device), freq_dim, theta)
    return ForwardMeta(cos, sin, bounds, row_start, segments(bounds, text, video, audio))


# -- tensor parallelism ----------------------------------------------------------------------------------------------


def byte_gather(group) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """All-gather within ``group`` (rank order) as raw bytes, exact for every dtype (gloo ranks on GPUs stage the
    bytes through host memory: a copy) - the contract of ``h3gate.parallel.collectives.group_gather``, which this
    room may not import."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        x = t.contiguous()
        host = x.is_cuda and dist.get_backend(group) == "gloo"
        raw = (x.cpu() if host else x).reshape(-1).view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, raw, group=group)
        return [(p.to(x.device) if host else p).view(x.dtype).reshape(x.shape) for p in parts]

    return gather


@dataclass
class TpPlan:
    """SGLang's TP group as h3gate sees it (module docstring)."""

    degree: int
    rank: int
    group: MergeGroup
    gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None
    full: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    def full_weights(self, name: str, layer: torch.nn.Module, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full (weight, bias) of replicated layer ``name``: its own tensors at TP1; at TPn its shards gathered
        once along ``dim`` (0: column-parallel, weight and bias; 1: row-parallel, the bias is whole)."""
        if name not in self.full:
            w, b = layer.weight, getattr(layer, "bias", None)
            if self.degree > 1:
                w = torch.cat(self.gather(w.detach()), dim=dim)
                if b is not None and dim == 0:
                    b = torch.cat(self.gather(b.detach()), dim=0)
            self.full[name] = (w, b)
        return self.full[name]

    def columns(self, value: torch.Tensor) -> torch.Tensor:
        """The rank's share of the last dim of a replicated layer's full output (SGLang gathers it back)."""
        if self.degree == 1:
            return value
        width = value.shape[-1] // self.degree
        return value[..., self.rank * width : (self.rank + 1) * width].contiguous()


def tp_plan() -> TpPlan:
    """The TP plan of SGLang's TP group in this process (TP1: h3gate's one-device group)."""
    from sglang.multimodal_gen.runtime.distributed import get_tp_world_size
    from sglang.multimodal_gen.runtime.distributed.parallel_state import get_tp_group

    degree = get_tp_world_size()
    if degree == 1:
        return TpPlan(1, 0, ONE_DEVICE)
    coordinator = get_tp_group()
    gather = byte_gather(coordinator.device_group)
    return TpPlan(degree, coordinator.rank_in_group, MergeGroup(degree, coordinator.rank_in_group, gather), gather)


@dataclass
class Bound:
    """What every bound forward reads: the operator caller, the TP plan and the running forward's metadata."""

    ops: OpCaller
    tp: TpPlan
    meta: ForwardMeta | None = None

    def live(self, what: str) -> ForwardMeta:
        if self.meta is None:
            raise InputError(f"sglang strict binding: {what}: runs only inside the bound model's forward")
        return self.meta
