"""``with bind_strict(sglang_model) as session:`` - h3gate's strict operators inside SGLang's own MiniMax-H3 DiT, at
operator level: SGLang's module structure, its packing (requests packed by cu_seqlens, padded to 64 rows), its
attention core and its TP layout stay in place; the forward of each of its modules (and its attention backend's
``forward_varlen``) is replaced on the instance for the block, by one that calls h3gate's operators in the order of
h3gate's graph, on SGLang's own parameters (row views of the fused q|k|v weight; no copy at TP1). On exit every
replaced forward is removed again: the module computes SGLang's forward.

So SGLang + strict kernels computes the bytes of h3gate's model graph run with the same bindings
(``run_chained(build_model_graph(cfg), inputs, params, candidate_table(bind_graph(graph, mode, device, merge)))``), at
every node and output, for one request or several packed ones. Which SGLang module runs which h3gate operator:
:mod:`.strict_layers` (linears, norms) and :mod:`.strict_forwards` (blocks, attention, MLP, embeddings, time embedder,
final layer). ``mode`` is :func:`h3gate.ops.registry.bind`'s (strict fails closed); ``merge`` its merge order.

Tensor parallelism (SGLang's TP group, gloo on CPU ranks): ``merge="seg8"`` is required. SGLang shards every head and
FFN channel contiguously in rank order (``MergedColumnParallelLinear`` shards q, k, v and gate, value each on its
own; ``RowParallelLinear`` its input columns), which is h3gate's ownership (rank r owns heads, channels and the
segmented-8 segments ``[r 8/n, (r+1) 8/n)``) when :func:`h3gate.kernels.tp_layers.check_tp_order` passes; the
binding refuses TPn otherwise. q|k|v and fc1 run :class:`~h3gate.kernels.tp_layers.ColumnLinear`, out_proj and fc2
:class:`~h3gate.kernels.tp_layers.RowLinear` (in place of SGLang's all-reduce), the QK norms
:class:`~h3gate.kernels.tp_layers.QkNormGrouped`, over a :class:`~h3gate.kernels.tp_layers.MergeGroup` whose gather
is a byte-exact all-gather over SGLang's TP group: so TPn is TP1 byte for byte. The layers h3gate runs replicated
(patch, condition and time projections, AdaLN projections, heads) run on their full weights, gathered once from
SGLang's shards (copies; TP1 reads the modules' own).

Ulysses (SGLang's sequence parallelism): every operator but attention is row-local (a rank runs its S/u rows, RoPE
tables from its first row), and after SGLang's all-to-all a rank attends whole segments on its heads, so Ulysses u is
the one-device binding byte for byte in either merge order. Ring attention is refused.

What cannot be bound is refused (strict) or reported (audit / auto / off), naming it: :mod:`.strict_checks`.
``session.trace`` holds one record per operator call (h3gate node, operator, kernel id, requested / actual, TP layer,
attention segment); ``session.faults[node] = fn`` perturbs a node's value (a negative control,
:func:`~.strict_ops.scale_row`); ``session.record()`` is the evidence of what ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from h3gate.adapters.sglang import strict_forwards as F
from h3gate.adapters.sglang import strict_layers as L
from h3gate.adapters.sglang.runtime import degrees, fused_paths, require_sglang
from h3gate.adapters.sglang.strict_checks import Refusals, check_forward, check_model, check_modules
from h3gate.adapters.sglang.strict_ops import Bound, Fault, OpCaller, TpPlan, forward_meta, tp_plan
from h3gate.checkpoint import parse_diffusers_config
from h3gate.errors import InputError
from h3gate.graph.executions import NodeBinding, bind_graph, candidate_table
from h3gate.graph.model import build_model_graph
from h3gate.kernels import launches
from h3gate.kernels.tp_layers import check_tp_order
from h3gate.manifests.model_config import ModelConfig
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.numerics import strict_numerics
from h3gate.ops.registry import check_merge, check_mode

SESSION_ATTR = "_h3gate_strict_binding"
NOT_BOUND = (
    "SGLang's index_select of the live {} rows (a copy: h3gate's packed_index_select), then its TP column gather"
)
TP_OPS = ("h3_qkv_gemm", "h3_ffn_gate_up_gemm", "h3_attention_o_gemm", "h3_ffn_down_gemm", "h3_qk_rmsnorm_d128")


@dataclass
class SglangSession:
    """What one ``with bind_strict(...)`` block bound and ran."""

    model: torch.nn.Module
    mode: str
    merge: str
    cfg: ModelConfig
    tp: TpPlan
    bindings: dict[str, NodeBinding]
    findings: list[dict] = field(default_factory=list)
    replaced: dict[str, str] = field(default_factory=dict)  # SGLang module (attribute) -> what it runs while bound
    trace: list[dict] = field(default_factory=list)
    faults: dict[str, Fault] = field(default_factory=dict)
    calls: int = 0
    launches: launches.Log = field(default_factory=dict)
    fused: dict[str, bool] = field(default_factory=dict)
    ulysses: int = 1

    def summary(self, active: bool) -> dict[str, Any]:
        return {"active": active, "mode": self.mode, "merge_order": self.merge, "tp": self.tp.degree,
                "ulysses": self.ulysses, "forwards": self.calls, "findings": len(self.findings)}  # fmt: skip

    def record(self) -> dict[str, Any]:
        """Evidence: mode, merge order, TP degree, per-node bindings, SGLang's fused paths (switched on for this model
        and device; none runs while bound: each lives in a replaced forward), what was replaced, the findings, the
        launch log and the trace."""
        return {
            "mode": self.mode,
            "merge_order": self.merge,
            "tp": {"degree": self.tp.degree, "rank": self.tp.rank},
            "ulysses": self.ulysses,
            "forwards": self.calls,
            "bindings": {n: b.record() for n, b in self.bindings.items()},
            "fused_paths": {k: {"switched_on": v, "runs_while_bound": False} for k, v in self.fused.items()},
            "replaced": dict(self.replaced),
            "findings": list(self.findings),
            "not_bound": {f"heads.{m}_select": NOT_BOUND.format(m) for m in ("video", "audio")},
            **({"launches": self.launches} if self.launches else {}),
            "trace": list(self.trace),
        }


def model_config(model: torch.nn.Module) -> ModelConfig:
    """h3gate's config of an SGLang DiT, from the diffusers config SGLang's loader kept (``hf_config``)."""
    if type(model).__name__ != "MiniMaxH3DiTModel":
        raise InputError(f"sglang strict binding: {type(model).__name__}: not SGLang's MiniMaxH3DiTModel")
    body = getattr(model, "hf_config", None)
    if not isinstance(body, dict):
        raise InputError("sglang strict binding: model.hf_config: missing (load the model with SGLang's loader)")
    return parse_diffusers_config({k: v for k, v in body.items() if not str(k).startswith("_")}, "model.hf_config")


class _Patches:
    """Instance attributes set for the block and removed on exit (a method shadowed by a function)."""

    def __init__(self, session: SglangSession) -> None:
        self.session, self.done = session, []

    def set(self, obj: object, attr: str, fn: Callable, name: str, what: str) -> None:
        if attr in vars(obj):
            raise InputError(f"sglang strict binding: {name}.{attr}: already replaced (a nested or foreign binding)")
        setattr(obj, attr, fn)
        self.done.append((obj, attr))
        self.session.replaced[f"{name}.{attr}" if name else attr] = what

    def undo(self) -> None:
        while self.done:
            obj, attr = self.done.pop()
            delattr(obj, attr)


def _check_tp(session: SglangSession) -> None:
    """TPn: seg8, aligned widths, TP layers standing for Triton bindings."""
    tp, cfg = session.tp, session.cfg
    if tp.degree == 1:
        return
    check_tp_order(tp.degree, session.merge, cfg, f"sglang strict binding: TP{tp.degree}", "bind with merge='seg8'")
    for nb in session.bindings.values():
        for b in nb.bindings:
            if b.op in TP_OPS and b.actual != "triton":
                raise InputError(f"sglang strict binding: TP{tp.degree}: node {nb.node}: {b.op} is bound to the "
                                 f"provider reference; TP ranks run h3gate's TP layers (Triton)")  # fmt: skip


def _body(p: _Patches, b: Bound, name: str, block: torch.nn.Module, transformer: bool, total_heads: int) -> None:
    """A transformer or refiner block and its submodules."""
    prefix = L.node_prefix(name)
    attn, mlp = block.attn, block.mlp
    p.set(attn.qkv_proj, "forward", L.qkv(b, attn.qkv_proj, prefix), f"{name}.attn.qkv_proj", "h3_qkv_gemm x3")
    for w in "qk":
        norm = getattr(attn, f"{w}_norm")
        p.set(norm, "forward", L.qk(b, norm, f"{prefix}{w}_norm", total_heads), f"{name}.attn.{w}_norm",
              "h3_qk_rmsnorm_d128")  # fmt: skip
    o, down, up = "h3_attention_o_gemm", "h3_ffn_down_gemm", "h3_ffn_gate_up_gemm"
    p.set(attn.out_proj, "forward", L.row(b, attn.out_proj, f"{prefix}o_proj", o), f"{name}.attn.out_proj", o)
    p.set(mlp.fc1, "forward", L.column(b, mlp.fc1, f"{prefix}ffn_gate_up", up), f"{name}.mlp.fc1", up)
    p.set(mlp.fc2, "forward", L.row(b, mlp.fc2, f"{prefix}ffn_down", down), f"{name}.mlp.fc2", down)
    p.set(mlp, "forward", F.mlp(b, mlp, prefix), f"{name}.mlp", "[gate|value] -> [value|gate], h3_swiglu")
    rope = ", h3_mm_rope_3axis_partial x2" if transformer else ""
    p.set(attn, "forward", F.attention(b, attn, prefix, transformer), f"{name}.attn", f"q/k/v views{rope}")
    p.set(attn._attention_impl, "forward_varlen", F.varlen(b, prefix, transformer), f"{name}.attn._attention_impl",
          "h3_full_attention per cu_seqlens segment" + (" (canonical order)" if transformer else ""))  # fmt: skip
    if transformer:
        mod = "h3_rmsnorm_modulate"
        for k in (1, 2):
            norm = getattr(block, f"norm{k}")
            p.set(norm, "forward", L.modulated(b, norm, f"{prefix}norm{k}", mod), f"{name}.norm{k}", mod)
        lin, where = block.adaln_proj.linear, f"{name}.adaln_proj.linear"
        fn = L.adaln(b, where, lin, f"{prefix}adaln_projection", "adaln_projection_3mod")
        p.set(lin, "forward", fn, where, "adaln_silu_cast, adaln_projection_3mod")
        p.set(block, "forward", F.dit_block(b, block, prefix), name, "adaln_gate_residual x2")
    else:
        for k in (1, 2):
            norm = getattr(block, f"norm{k}")
            p.set(norm, "forward", L.rms(b, norm, f"{prefix}norm{k}"), f"{name}.norm{k}", "h3_rmsnorm")
        p.set(block, "forward", F.refiner_block(b, block, prefix), name, "residual_add x2")


def _replicated(p: _Patches, b: Bound, model: torch.nn.Module, name: str, node: str, op: str, dim: int, local: bool):
    layer = model.get_submodule(name)
    p.set(layer, "forward", L.replicated(b, name, layer, node, op, dim, local), name, op)


def _edges(p: _Patches, b: Bound, model: torch.nn.Module, unbound: set[str]) -> None:
    """Embeddings, time embedder, refiner final norm, final layer (each unless its unit stays SGLang's)."""
    if "embed" not in unbound:
        _replicated(p, b, model, "video_patch_proj", "embed.video", "video_input_projection_fp32", 0, False)
        _replicated(p, b, model, "audio_patch_proj", "embed.audio", "audio_input_projection_fp32", 0, False)
        _replicated(p, b, model, "condition_proj", "embed.text", "text_context_projection", 0, False)
        p.set(model, "_embed", F.embed(b, model), "", "packed_index_copy per request segment")
    if "time" not in unbound:
        te = model.time_embedder
        _replicated(p, b, model, "time_embedder.proj_in", "time.linear_1", "timestep_mlp_fp32", 0, False)
        _replicated(p, b, model, "time_embedder.proj_out", "time.linear_2", "timestep_mlp_fp32", 1, False)
        p.set(te, "forward", F.time_embedder(b, te), "time_embedder", "timestep_sinusoid_h3, timestep_mlp_silu")
    if "refiner.final_norm" not in unbound:
        norm = model.token_refiner.final_norm
        p.set(norm, "forward", L.rms(b, norm, "refiner.final_norm"), "token_refiner.final_norm", "h3_rmsnorm")
    if "final" not in unbound:
        fl = model.final_layer
        lin, where = fl.adaln_proj.linear, "final_layer.adaln_proj.linear"
        fn = L.adaln(b, where, lin, "final.projection", "final_adaln_projection")
        p.set(lin, "forward", fn, where, "adaln_silu_cast, final_adaln_projection")
        p.set(fl.norm, "forward", L.modulated(b, fl.norm, "final.norm_out", "final_adaln_out"), "final_layer.norm",
              "final_adaln_out")  # fmt: skip
        _replicated(p, b, model, "final_layer.video_out", "heads.video_proj", "video_output_projection_fp32", 0, True)
        _replicated(p, b, model, "final_layer.audio_out", "heads.audio_proj", "audio_output_projection_fp32", 0, True)
        p.set(fl, "forward", F.final_layer(b, fl), "final_layer", "final AdaLN, FP32 heads")


def _row_start(kwargs: dict[str, Any]) -> int:
    """This Ulysses rank's first packed row (SGLang's row split: ``S / u`` rows a rank, in rank order)."""
    from sglang.multimodal_gen.runtime.distributed.parallel_state import get_ulysses_ctx

    degree, rank = get_ulysses_ctx()
    x = kwargs.get("x")
    return 0 if degree == 1 or not torch.is_tensor(x) else rank * (int(x.shape[1]) // degree)


def _root(session: SglangSession, b: Bound, refusals: Refusals) -> Callable:
    """The model's forward: h3gate's per-forward metadata around SGLang's own forward."""
    model, cfg = session.model, session.cfg
    forward = type(model).forward

    def bound_forward(**kwargs: Any):
        check_forward(model, refusals)
        b.meta = forward_meta(kwargs, cfg.rope_freq_dim, cfg.rope_theta, _row_start(kwargs))
        try:
            with launches.recording() as launched:
                out = forward(model, **kwargs)
            launches.merge(session.launches, launched)
        finally:
            b.meta = None
        session.calls += 1
        setattr(model, SESSION_ATTR, session.summary(True))
        return out

    return bound_forward


def _install(session: SglangSession, p: _Patches, b: Bound, refusals: Refusals) -> None:
    model, cfg = session.model, session.cfg
    heads = cfg.num_attention_heads
    _edges(p, b, model, refusals.unbound)
    for r, block in enumerate(model.token_refiner.blocks):
        if f"refiner.{r}" not in refusals.unbound:
            _body(p, b, f"token_refiner.blocks.{r}", block, False, heads)
    for i, block in enumerate(model.blocks):
        if f"block.{i}" not in refusals.unbound:
            _body(p, b, f"blocks.{i}", block, True, heads)
    p.set(model, "forward", _root(session, b, refusals), "", "h3gate metadata (RoPE tables, segments), SGLang forward")


@contextlib.contextmanager
def bind_strict(
    model: torch.nn.Module, mode: str = "strict", device: str | None = None, merge: str = DEFAULT_MERGE_ORDER
) -> Iterator[SglangSession]:
    """Bind h3gate's operators into SGLang's ``model`` for the ``with`` block (module docstring); yields the session.
    ``device`` defaults to the parameters' device type (``cuda`` / ``cpu``: Triton's interpreter)."""
    require_sglang("sglang strict binding")
    check_mode(mode)
    check_merge(merge)
    cfg = model_config(model)
    first = next(model.parameters())
    device = device or ("cuda" if first.is_cuda else "cpu")
    refusals = Refusals(mode)
    model._resolve_attention_backend_once()  # the backend instances whose forward_varlen the binding replaces
    blocks_and_final = (*(f"block.{i}" for i in range(cfg.num_layers)), "final")
    check_modules(model, cfg.num_refiner_layers, cfg.num_layers, refusals)
    check_model(model, refusals, blocks_and_final)
    if "time" in refusals.unbound:  # the AdaLN projections read the bound time embedder's embedding
        refusals.unbound.update(blocks_and_final)
    graph = build_model_graph(cfg)
    bindings = bind_graph(graph, mode, device, merge)
    session = SglangSession(model, mode, merge, cfg, tp_plan(), bindings, refusals.findings)
    _check_tp(session)
    session.fused = fused_paths(model, first.device)
    session.ulysses = int(degrees()["ulysses"])
    ops = OpCaller(candidate_table(bindings), bindings, {n.name: n.ops[-1] for n in graph.nodes}, session.trace,
                   session.faults, lambda: session.calls)  # fmt: skip
    bound = Bound(ops, session.tp)
    patches = _Patches(session)
    try:
        _install(session, patches, bound, refusals)
        setattr(model, SESSION_ATTR, session.summary(True))
        with strict_numerics(device):
            yield session
    finally:
        patches.undo()
        setattr(model, SESSION_ATTR, session.summary(False))
