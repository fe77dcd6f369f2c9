"""The node map: SGLang's values at h3gate's model-graph nodes, captured with forward hooks during one forward.

Each h3gate node of :func:`h3gate.graph.model.build_model_graph` is read at one SGLang module boundary (``out``: the
module's output, the first element of a parallel linear's ``(output, bias)``; ``in``: its first positional input,
through a forward pre-hook) or, where the value crosses no module boundary, at the attention backend's
``forward_varlen(q, k, v, ...)`` call, wrapped on each attention module's own backend instance (``varlen``). ``i``
is the block, ``r`` the refiner block; ``nd = heads * head_dim``, ``F = ffn_dim``:

    h3gate node               SGLang point                                    transform
    embed.video               video_patch_proj out                            rows in img_pos order, per request
    embed.audio               audio_patch_proj out                            rows in audio_pos order, per request
    embed.text                condition_proj out                              one call per request, stacked
    refiner.r.norm1           token_refiner.blocks.r.attn in                  (text rows: one call per request)
    refiner.r.q_proj          token_refiner.blocks.r.attn.qkv_proj out        fused [q | k | v]: columns 0 .. nd
    refiner.r.k_proj          token_refiner.blocks.r.attn.qkv_proj out        columns nd .. 2 nd
    refiner.r.v_proj          token_refiner.blocks.r.attn.qkv_proj out        columns 2 nd .. 3 nd
    refiner.r.q_norm          token_refiner.blocks.r.attn.q_norm out          (N, heads, D) as h3gate
    refiner.r.k_norm          token_refiner.blocks.r.attn.k_norm out          (N, heads, D)
    refiner.r.attention       token_refiner.blocks.r.attn.out_proj in         -
    refiner.r.o_proj          token_refiner.blocks.r.attn.out_proj out        -
    refiner.r.residual_attn   token_refiner.blocks.r.norm2 in                 (x + o has no module of its own)
    refiner.r.norm2           token_refiner.blocks.r.mlp in                   -
    refiner.r.ffn_gate_up     token_refiner.blocks.r.mlp.fc1 out              [gate | value] -> [value | gate]
    refiner.r.swiglu          token_refiner.blocks.r.mlp.fc2 in               -
    refiner.r.ffn_down        token_refiner.blocks.r.mlp.fc2 out              -
    refiner.r.residual_mlp    token_refiner.blocks.r out                      -
    refiner.final_norm        token_refiner.final_norm out                    -
    embed.pack                blocks.0 in                                     packed rows: unpadded, per request
    time.sinusoid             time_embedder.proj_in in                        -
    time.linear_1             time_embedder.proj_in out                       -
    time.silu                 time_embedder.proj_out in                       -
    time.linear_2             time_embedder.proj_out out                      -
    block.i.adaln_projection  blocks.i.adaln_proj.linear out                  (T, 18H), before SGLang's view
    block.i.norm1             blocks.i.attn in                                the modulated rows (rmsnorm + AdaLN)
    block.i.q_proj            blocks.i.attn.qkv_proj out                      fused [q | k | v]: columns 0 .. nd
    block.i.k_proj            blocks.i.attn.qkv_proj out                      columns nd .. 2 nd
    block.i.v_proj            blocks.i.attn.qkv_proj out                      columns 2 nd .. 3 nd
    block.i.q_norm            blocks.i.attn.q_norm out                        (N, heads, D)
    block.i.k_norm            blocks.i.attn.k_norm out                        (N, heads, D)
    block.i.rope_q            blocks.i.attn varlen q                          (N, heads, D), rotated
    block.i.rope_k            blocks.i.attn varlen k                          (N, heads, D), rotated
    block.i.attention         blocks.i.attn.out_proj in                       -
    block.i.o_proj            blocks.i.attn.out_proj out                      -
    block.i.residual_attn     blocks.i.norm2 in                               (gated residual has no module)
    block.i.norm2             blocks.i.mlp in                                 -
    block.i.ffn_gate_up       blocks.i.mlp.fc1 out                            [gate | value] -> [value | gate]
    block.i.swiglu            blocks.i.mlp.fc2 in                             -
    block.i.ffn_down          blocks.i.mlp.fc2 out                            -
    block.i.residual_mlp      blocks.i out                                    -
    final.projection          final_layer.adaln_proj.linear out               (T, 2H)
    final.norm_out            final_layer.video_out in                        FP32 copy of BF16 rows: cast back
    heads.video_proj          final_layer.video_out out                       -
    heads.video_select        model output 0                                  (B Nv, Cv) -> (B, Nv, Cv)
    heads.audio_proj          final_layer.audio_out out                       -
    heads.audio_select        model output 1                                  (B Na, Ca) -> (B, Na, Ca)

Packed-row values (``meta["rows"] == "packed"``) come in SGLang's packed order (request b at rows b S ..; padding
after) and are unpacked to (B, S, ...); text rows come one refiner call per request and are stacked; video and
audio rows come request after request. On the CPU every node is captured. A point that does not fire leaves its
node in ``uncovered`` with the reason :data:`ABSENT` gives (on CUDA SGLang's fused paths skip these modules:
QK-norm + RoPE in one JIT kernel, the RMSNorm + AdaLN site under ``quality="lossless"``). Captures run at TP 1 and
SP 1 (a sharded rank holds column or row shards that h3gate's nodes do not).

With ``provider`` (the provider's node values), :func:`capture_forward` is the isolated view by teacher forcing:
each point's value is recorded and then overwritten in place by the provider's value of its node, mapped back into
SGLang's layout (:mod:`.forcing`), so every later point reads the provider's upstream and one forward yields every
node's isolated value; a node whose inputs were not all replaced is listed in ``uncovered`` with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from h3gate.adapters.sglang.forcing import Forcing, isolation_gaps
from h3gate.adapters.sglang.inputs import Packing, forward_kwargs, unpack_outputs
from h3gate.adapters.sglang.points import Key, Point, point_key
from h3gate.adapters.sglang.runtime import degrees
from h3gate.errors import InputError
from h3gate.graph.core import Graph
from h3gate.graph.model import RawMetadata, build_model_graph
from h3gate.manifests.model_config import ModelConfig

ABSENT = {
    "q_norm": "fused QK-norm + RoPE (SGLang on CUDA): normalised q/k never leave the JIT kernel",
    "k_norm": "fused QK-norm + RoPE (SGLang on CUDA): normalised q/k never leave the JIT kernel",
    "residual_attn": "fused RMSNorm + AdaLN site (quality lossless/high on CUDA): norm2 is not called",
    "rope_q": "the attention backend's forward_varlen was not called (Ulysses head-group pipelining fills q/k itself)",
    "rope_k": "the attention backend's forward_varlen was not called (Ulysses head-group pipelining fills q/k itself)",
}


def body_points(prefix: str, module: str, rope: bool) -> list[Point]:
    """The points of one attention + FFN body: SGLang's block ``module`` (a transformer block with ``rope``, a
    refiner block without), nodes named ``prefix`` + the block graph's names."""
    pts = [
        Point(f"{prefix}norm1", f"{module}.attn", "in"),
        *(Point(f"{prefix}{w}_proj", f"{module}.attn.qkv_proj", "out", w) for w in "qkv"),
        Point(f"{prefix}q_norm", f"{module}.attn.q_norm", "out"),
        Point(f"{prefix}k_norm", f"{module}.attn.k_norm", "out"),
    ]
    if rope:
        pts += [Point(f"{prefix}rope_{w}", f"{module}.attn", "varlen", w) for w in "qk"]
    return pts + [
        Point(f"{prefix}attention", f"{module}.attn.out_proj", "in"),
        Point(f"{prefix}o_proj", f"{module}.attn.out_proj", "out"),
        Point(f"{prefix}residual_attn", f"{module}.norm2", "in"),
        Point(f"{prefix}norm2", f"{module}.mlp", "in"),
        Point(f"{prefix}ffn_gate_up", f"{module}.mlp.fc1", "out", "swap"),
        Point(f"{prefix}swiglu", f"{module}.mlp.fc2", "in"),
        Point(f"{prefix}ffn_down", f"{module}.mlp.fc2", "out"),
        Point(f"{prefix}residual_mlp", module, "out"),
    ]


def node_map(cfg: ModelConfig) -> list[Point]:
    """Every point of the map for ``cfg`` (module docstring), in h3gate's graph order."""
    pts = [
        Point("embed.video", "video_patch_proj", "out"),
        Point("embed.audio", "audio_patch_proj", "out"),
        Point("embed.text", "condition_proj", "out"),
    ]
    for r in range(cfg.num_refiner_layers):
        pts += body_points(f"refiner.{r}.", f"token_refiner.blocks.{r}", rope=False)
    pts += [
        Point("refiner.final_norm", "token_refiner.final_norm", "out"),
        Point("embed.pack", "blocks.0", "in"),
        Point("time.sinusoid", "time_embedder.proj_in", "in"),
        Point("time.linear_1", "time_embedder.proj_in", "out"),
        Point("time.silu", "time_embedder.proj_out", "in"),
        Point("time.linear_2", "time_embedder.proj_out", "out"),
    ]
    for i in range(cfg.num_layers):
        pts += [Point(f"block.{i}.adaln_projection", f"blocks.{i}.adaln_proj.linear", "out")]
        pts += body_points(f"block.{i}.", f"blocks.{i}", rope=True)
    return pts + [
        Point("final.projection", "final_layer.adaln_proj.linear", "out"),
        Point("final.norm_out", "final_layer.video_out", "in", "bf16"),
        Point("heads.video_proj", "final_layer.video_out", "out"),
        Point("heads.video_select", "", "model", "0"),
        Point("heads.audio_proj", "final_layer.audio_out", "out"),
        Point("heads.audio_select", "", "model", "1"),
    ]


@dataclass
class Capture:
    """One forward's values at h3gate's nodes, in h3gate's shapes and dtypes."""

    values: dict[str, torch.Tensor]
    uncovered: dict[str, str]
    outputs: dict[str, torch.Tensor]


def _first(value: object) -> torch.Tensor:
    return value[0] if isinstance(value, tuple | list) else value  # type: ignore[return-value]


def _slice(value: torch.Tensor, point: Point, cfg: ModelConfig) -> torch.Tensor:
    """The point's transform: a third of the fused q/k/v output, the fc1 halves swapped, the exact BF16 cast."""
    nd, f = cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    if point.where == "out" and point.part in ("q", "k", "v"):
        j = "qkv".index(point.part)
        return value[..., j * nd : (j + 1) * nd]
    if point.part == "swap":
        return torch.cat((value[..., f:], value[..., :f]), dim=-1)
    if point.part == "bf16":
        return value.to(torch.bfloat16)
    return value


Force = Callable[[Key, torch.Tensor], None]  # overwrites a point's value in place (teacher forcing)


class Recorder:
    """Hooks that append a clone of each point's value, per call, under the point's key, and then hand the value
    to ``force`` (when set), which may overwrite it in place."""

    def __init__(self, force: Force | None = None) -> None:
        self.calls: dict[Key, list[torch.Tensor]] = {}
        self.force = force

    def put(self, key: Key, value: torch.Tensor) -> None:
        self.calls.setdefault(key, []).append(value.detach().clone())
        if self.force is not None and key[1] != "model":
            self.force(key, value)


def _wrap_varlen(impl, module: str, rec: Recorder) -> None:
    """Record (and force) q and k of every ``forward_varlen`` call of this attention backend instance (an instance
    attribute shadowing the class's method, or the one a binding set; :func:`hooks` puts back what was there)."""
    call = impl.forward_varlen

    def varlen(q, k, v, *args, **kwargs):
        rec.put((module, "varlen", "q"), q)
        rec.put((module, "varlen", "k"), k)
        return call(q, k, v, *args, **kwargs)

    impl.forward_varlen = varlen


@contextlib.contextmanager
def hooks(model: torch.nn.Module, points: list[Point], rec: Recorder) -> Iterator[None]:
    """Every point of ``points`` hooked into ``model`` (module paths from the model's root) while the context is
    open: ``out`` a forward hook, ``in`` a forward pre-hook on the first positional argument (the tensor itself, so
    an in-place overwrite reaches every reader of it), ``varlen`` the backend's call, ``model`` the outputs."""
    handles, wrapped = [], []

    def outputs(m, args, out) -> None:
        for j, value in enumerate(out):
            rec.put(("", "model", str(j)), value)

    try:
        for module, where in sorted({(p.module, p.where) for p in points}):
            key = (module, where, "")
            if where == "model":
                handles.append(model.register_forward_hook(outputs))
            elif where == "out":
                mod = model.get_submodule(module)
                handles.append(mod.register_forward_hook(lambda m, a, o, _k=key: rec.put(_k, _first(o))))
            elif where == "in":
                mod = model.get_submodule(module)
                handles.append(mod.register_forward_pre_hook(lambda m, a, _k=key: rec.put(_k, a[0])))
            else:
                impl = model.get_submodule(module)._attention_impl
                wrapped.append((impl, vars(impl).get("forward_varlen")))
                _wrap_varlen(impl, module, rec)
        yield
    finally:
        for h in handles:
            h.remove()
        for impl, before in wrapped:
            if before is None:
                del impl.forward_varlen
            else:
                impl.forward_varlen = before


def _assemble(node: str, rows: str, calls: list[torch.Tensor], pack: Packing) -> torch.Tensor:
    """One node's value from its calls: packed rows unpacked, text/video/audio rows per request, timestep as is."""
    if rows in ("packed", "timestep"):
        if len(calls) != 1:
            raise RuntimeError(f"sglang capture: {node}: read {len(calls)} times in one forward, expected once")
        return pack.unpack(calls[0]) if rows == "packed" else calls[0]
    value = torch.cat(calls)  # text: one refiner call per request; video/audio: request after request
    return value.reshape(pack.batch, -1, *value.shape[1:])


def collect(
    points: list[Point], rec: Recorder, rows: Mapping[str, str], pack: Packing, cfg: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(values, uncovered): each point's calls assembled into its node's value in h3gate's shape (``rows``: the
    node's row kind), or the node uncovered with :data:`ABSENT`'s reason when its point did not fire; model output
    points are left to the caller."""
    values, uncovered = {}, {}
    for p in points:
        calls = rec.calls.get(point_key(p))
        if not calls:
            suffix = p.node.rsplit(".", 1)[-1]
            uncovered[p.node] = ABSENT.get(suffix, f"{p.module or 'model'} {p.where}: not called in this forward")
            continue
        if p.where != "model":
            values[p.node] = _slice(_assemble(p.node, rows[p.node], calls, pack), p, cfg)
    return values, uncovered


def capture_forward(
    model: torch.nn.Module,
    cfg: ModelConfig,
    inputs: Mapping[str, torch.Tensor],
    raw: RawMetadata,
    pack: Packing,
    graph: Graph | None = None,
    before: Callable[[], contextlib.AbstractContextManager] | None = None,
    provider: Mapping[str, torch.Tensor] | None = None,
) -> Capture:
    """One SGLang forward (the serving path's text refinement and RoPE cache included) with every point of
    :func:`node_map` hooked; ``before()`` (e.g. :func:`row_fault`) is entered first, so its hooks run before the
    capture's. With ``provider`` (node -> the provider's value, h3gate's shapes, batch ``pack.batch``), the isolated
    view by teacher forcing (module docstring): ``uncovered`` then also names every node whose inputs were not all
    the provider's."""

    if any(d != 1 for d in degrees().values()):
        raise InputError(f"sglang capture: degrees {degrees()}: the node map reads TP 1 / SP 1 values only")
    graph = graph or build_model_graph(cfg)
    points = node_map(cfg)
    rows = {n.name: n.meta["rows"] for n in graph.nodes}
    forcing = None if provider is None else Forcing(points, provider, rows, cfg)
    model._resolve_attention_backend_once()  # the backend instances the varlen points wrap
    rec = Recorder(forcing)
    with contextlib.ExitStack() as stack, torch.no_grad():
        if before is not None:
            stack.enter_context(before())
        stack.enter_context(hooks(model, points, rec))
        out = model(**forward_kwargs(model, inputs, raw, pack))
    values, uncovered = collect(points, rec, rows, pack, cfg)
    outputs = unpack_outputs(out, pack, int(raw.video_indices.numel()), int(raw.audio_indices.numel()))
    values.update({k: v for k, v in outputs.items() if k not in uncovered})
    missing = [n.name for n in graph.nodes if n.name not in values and n.name not in uncovered]
    for name in missing:
        uncovered[name] = "no SGLang point in the node map"
    if forcing is not None:
        uncovered = isolation_gaps(graph.nodes, uncovered, forcing)
    return Capture(values, uncovered, outputs)


@contextlib.contextmanager
def row_fault(model: torch.nn.Module, module: str, row: int, factor: float = 1.0 + 2.0**-6) -> Iterator[None]:
    """A negative control: ``module``'s output row ``row`` (first dimension) scaled by ``factor`` in its dtype,
    by a forward hook that runs before any other hook of that module."""

    def hook(m, args, out):
        first = _first(out).clone()
        first[row] = first[row] * factor
        return (first, *out[1:]) if isinstance(out, tuple) else first

    handle = model.get_submodule(module).register_forward_hook(hook, prepend=True)
    try:
        yield
    finally:
        handle.remove()
