"""The whole MiniMax-H3 transformer as named stages of named nodes (diffusers 0.42.1
``MiniMaxH3Transformer3DModel.forward``, op for op, in its execution order).

Graph inputs (``MODEL_INPUTS``): the request - ``video_rows`` (B, Nv, C*prod(patch)) and ``audio_rows`` (B, Na, Ca)
at any float dtype, ``text`` (B, Nt, text_dim) - and the layout metadata :func:`derive_metadata` builds -
``timestep`` (T,) fp32, ``timestep_indices`` / ``adaln_indices`` (S,) int64, ``rope_cos`` / ``rope_sin`` (S, R) fp32,
the three scatter index tensors, the two output-selection index tensors (normally the same as the scatter ones;
kept apart so that a stale selection index is a perturbation of its own) and ``attention_order`` (S,) int64, the
canonical row order derived once from the scatter indices (:func:`h3gate.layout.canonical_order`), which every
block's strict attention walks (the provider ignores it). Stages and the maths of their nodes::

    embed.video      linear(video.to(W.dtype), W, b)      FP32 module (proj_in)          (B, Nv, H) fp32
    embed.audio      linear(audio.to(W.dtype), W, b)      FP32 module (audio_proj_in)    (B, Na, H) fp32
    embed.text       linear(text.to(W.dtype), W, b)       BF16 (context_embedder)        (B, Nt, H) bf16
    refiner.i.*      token refiner block i (refiner.py, 14 nodes); refiner.final_norm = rmsnorm(final_norm_eps)
    embed.pack       zeros(B, S, H) at the text dtype; index_copy text, then video and audio cast to it
    time.sinusoid    [cos(t f), sin(t f)], f_i = exp(-ln(1e4) i / 128)                   (T, 256) fp32
    time.linear_1 / time.silu / time.linear_2   FP32 timestep MLP (input cast to the module dtype first)
    block.i.*        transformer block i (block.py, 17 nodes) with temb = time.linear_2
    final.projection linear(silu(temb).to(W.dtype), W, b) -> shift | scale                 (T, 2H) bf16
    final.norm_out   rmsnorm(x) * (1 + scale[t_idx]) + shift[t_idx]                         (B, S, H) bf16
    heads.video_proj linear(x.to(W.dtype), W, b) over every packed row; heads.video_select = index_select(1, idx)
    heads.audio_proj / heads.audio_select   the same for audio

Each node's ``meta["rows"]`` names its row space (``packed``, ``text``, ``video``, ``audio``, ``timestep``) so that a
first-drift row maps back to a packed row and modality; ``row_dim == 1`` nodes carry the batch on dim 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.graph.block import build_block_graph
from h3gate.graph.body_nodes import Gemm
from h3gate.graph.core import Graph, Node, OpTable
from h3gate.graph.refiner import build_refiner_graph
from h3gate.inventory import expected_inventory
from h3gate.layout import canonical_order
from h3gate.manifests.model_config import MODALITY_NUM, ModelConfig
from h3gate.ops import reference

MODEL_INPUTS: tuple[str, ...] = (
    "video_rows",
    "audio_rows",
    "text",
    "timestep",
    "timestep_indices",
    "adaln_indices",
    "rope_cos",
    "rope_sin",
    "text_indices",
    "video_indices",
    "audio_indices",
    "video_select",
    "audio_select",
    "attention_order",
)
METADATA: tuple[str, ...] = MODEL_INPUTS[3:]
OUTPUTS: tuple[str, str] = ("heads.video_select", "heads.audio_select")

Inputs = Mapping[str, torch.Tensor]
NodeFn = Callable[[OpTable, Inputs, Inputs], torch.Tensor]


class PrefixParams(Mapping):
    """Read-only view of ``params`` under ``prefix`` (``norm1.weight`` -> ``transformer_blocks.3.norm1.weight``)."""

    def __init__(self, params: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._params, self._prefix = params, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._params[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        return (k[n:] for k in self._params if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _embed(sub: Graph, prefix: str, param_prefix: str, rename: Mapping[str, str], layer: int | None, rows: str):
    """``sub``'s nodes renamed ``prefix + name``, inputs wired via ``rename``, params read under ``param_prefix``."""
    out = []
    for node in sub.nodes:
        inputs = tuple(rename.get(i, prefix + i) for i in node.inputs)

        def fn(ops, x, p, _fn=node.fn, _local=node.inputs, _global=inputs):
            return _fn(ops, {lo: x[gl] for lo, gl in zip(_local, _global, strict=True)}, PrefixParams(p, param_prefix))

        if isinstance(node.fn, Gemm):  # the same call on global names, still a Gemm (grouped launches)
            fn = Gemm(node.fn.op, inputs[node.inputs.index(node.fn.source)], param_prefix + node.fn.weight)

        meta = {**node.meta, "rows": rows if node.row_dim is not None else "timestep", "stage": prefix[:-1]}
        meta["param_prefix"] = param_prefix
        out.append(replace(node, name=prefix + node.name, inputs=inputs, fn=fn, layer=layer, meta=meta))
    return out


def _node(name, owner, ops, inputs, fn, rows, row_dim=1, maths="", stage=None) -> Node:
    stage = stage or name.split(".")[0]
    return Node(name, owner, ops, inputs, fn, row_dim=row_dim, meta={"rows": rows, "maths": maths, "stage": stage})


def build_model_graph(cfg: ModelConfig, layers: tuple[int, int] | None = None) -> Graph:
    """Every node of the forward, in diffusers' execution order (rope tables and adaln indices are metadata):
    the input embeddings, the text refiner and its final norm, the packing, the time embedding, the transformer
    blocks, then the final AdaLN and both heads. ``layers=(a, b)`` keeps transformer blocks ``a .. b-1`` only
    (their own names and weights; the final AdaLN reads block ``b-1``): a truncated model, never the default."""
    nodes = _embedding_nodes()
    refined, text = _refiner_nodes(cfg, "embed.text")
    nodes += refined
    nodes.append(_pack_node(text))
    nodes += _time_nodes(cfg)
    blocks, hidden = _block_nodes(cfg, "embed.pack", layers or (0, cfg.num_layers))
    nodes += blocks
    nodes += _head_nodes(cfg, hidden)
    return Graph("model", tuple(nodes), MODEL_INPUTS, OUTPUTS[1])


def _proj(op: str, source: str, prefix: str) -> NodeFn:
    """``op(x[source].to(W.dtype), W, b)`` with ``W``, ``b`` = ``prefix.weight``, ``prefix.bias``."""

    def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        w = p[f"{prefix}.weight"]
        return ops[op](x[source].to(w.dtype), w, p[f"{prefix}.bias"])

    return fn


def _embedding_nodes() -> list[Node]:
    """proj_in (video, FP32), audio_proj_in (audio, FP32), context_embedder (text, BF16)."""
    specs = (
        ("embed.video", "video_input_projection_fp32", "video_rows", "proj_in", "video", "proj_in, FP32"),
        ("embed.audio", "audio_input_projection_fp32", "audio_rows", "audio_proj_in", "audio", "audio_proj_in, FP32"),
        ("embed.text", "text_context_projection", "text", "context_embedder", "text", "context_embedder, BF16"),
    )
    return [
        _node(name, op, (op,), (source,), _proj(op, source, prefix), rows, maths=maths)
        for name, op, source, prefix, rows, maths in specs
    ]


def _refiner_nodes(cfg: ModelConfig, stream: str) -> tuple[list[Node], str]:
    """The refiner blocks on the text stream, then its final RMSNorm; (nodes, name of the refined text)."""
    nodes: list[Node] = []
    refiner = build_refiner_graph(cfg)
    for i in range(cfg.num_refiner_layers):
        prefix = f"refiner.{i}."
        nodes += _embed(refiner, prefix, f"token_refiner.refiner_blocks.{i}.", {"hidden_states": stream}, None, "text")
        stream = prefix + refiner.output
    source = stream

    def final_norm(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["h3_rmsnorm"](x[source], p["token_refiner.final_norm.weight"], cfg.final_norm_eps)

    nodes.append(
        _node("refiner.final_norm", "h3_rmsnorm", ("h3_rmsnorm",), (source,), final_norm, "text",
              maths="rmsnorm(final_norm_eps)")
    )  # fmt: skip
    return nodes, "refiner.final_norm"


def _pack_node(text: str) -> Node:
    """zeros at the text dtype, then index_copy of text, video and audio rows into the packed sequence."""
    pack_in = (text, "embed.video", "embed.audio", "text_indices", "video_indices", "audio_indices", "rope_cos")

    def pack(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["packed_index_copy"](
            x[text], x["embed.video"], x["embed.audio"], x["text_indices"], x["video_indices"], x["audio_indices"],
            x["rope_cos"].shape[0],
        )  # fmt: skip

    return _node("embed.pack", "packed_index_copy", ("packed_index_copy",), pack_in, pack, "packed",
                 maths="zeros at text dtype; index_copy text, video, audio")  # fmt: skip


def _time_nodes(cfg: ModelConfig) -> list[Node]:
    """timestep sinusoid (cos first, FP32), linear_1, SiLU, linear_2 (the FP32 time embedder)."""

    def sinusoid(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["timestep_sinusoid_h3"](x["timestep"], cfg.freq_dim)

    def t_linear(source: str, k: int) -> NodeFn:
        def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
            w = p[f"time_embedder.linear_{k}.weight"]
            return ops["timestep_mlp_fp32"](x[source].to(w.dtype), w, p[f"time_embedder.linear_{k}.bias"])

        return fn

    def t_silu(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        return ops["timestep_mlp_silu"](x["time.linear_1"])

    mlp = "timestep_mlp_fp32"
    return [
        _node("time.sinusoid", "timestep_sinusoid_h3", ("timestep_sinusoid_h3",), ("timestep",), sinusoid,
              "timestep", row_dim=0, maths="cos first, FP32"),
        _node("time.linear_1", mlp, (mlp,), ("time.sinusoid",), t_linear("time.sinusoid", 1), "timestep",
              row_dim=0, maths="FP32"),
        _node("time.silu", mlp, ("timestep_mlp_silu",), ("time.linear_1",), t_silu, "timestep", row_dim=0),
        _node("time.linear_2", mlp, (mlp,), ("time.silu",), t_linear("time.silu", 2), "timestep",
              row_dim=0, maths="FP32"),
    ]  # fmt: skip


def _block_nodes(cfg: ModelConfig, hidden: str, layers: tuple[int, int]) -> tuple[list[Node], str]:
    """The transformer blocks ``layers[0] .. layers[1]-1`` on the packed stream; (nodes, last block's output)."""
    a, b = layers
    if not 0 <= a < b <= cfg.num_layers:
        raise InputError(f"--layers {a}:{b}: must satisfy 0 <= A < B <= {cfg.num_layers} (the model's blocks)")
    nodes: list[Node] = []
    for i in range(a, b):
        block = build_block_graph(cfg, i)
        rename = {
            "hidden_states": hidden,
            "temb": "time.linear_2",
            "adaln_indices": "adaln_indices",
            "rope_cos": "rope_cos",
            "rope_sin": "rope_sin",
            "attention_order": "attention_order",
        }
        nodes += _embed(block, f"block.{i}.", f"transformer_blocks.{i}.", rename, i, "packed")
        hidden = f"block.{i}.{block.output}"
    return nodes, hidden


def _head_nodes(cfg: ModelConfig, hidden: str) -> list[Node]:
    """final AdaLN (projection of silu(temb) -> shift | scale, modulated RMSNorm), the FP32 heads over every packed
    row, then the video and audio row selections."""

    def final_projection(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        w = p["norm_out.linear.weight"]
        return ops["final_adaln_projection"](
            ops["adaln_silu_cast"](x["time.linear_2"], w.dtype), w, p["norm_out.linear.bias"]
        )

    def norm_out(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
        shift, scale = x["final.projection"].chunk(2, dim=-1)
        return ops["final_adaln_out"](
            x[hidden], p["norm_out.norm.weight"], shift, scale, x["timestep_indices"], cfg.final_norm_eps
        )

    def select(source: str, index: str) -> NodeFn:
        def fn(ops: OpTable, x: Inputs, p: Inputs) -> torch.Tensor:
            return ops["packed_index_select"](x[source], x[index])

        return fn

    video, audio, sel = "video_output_projection_fp32", "audio_output_projection_fp32", "packed_index_select"
    return [
        _node("final.projection", "final_adaln_out", ("adaln_silu_cast", "final_adaln_projection"),
              ("time.linear_2",), final_projection, "timestep", row_dim=0,
              maths="linear(silu(temb).to(W.dtype)) -> shift | scale"),
        _node("final.norm_out", "final_adaln_out", ("final_adaln_out",), (hidden, "final.projection",
              "timestep_indices"), norm_out, "packed", maths="rmsnorm(x) * (1 + scale[t_idx]) + shift[t_idx]"),
        _node("heads.video_proj", video, (video,), ("final.norm_out",), _proj(video, "final.norm_out", "proj_out"),
              "packed", maths="proj_out over every row, FP32"),
        _node("heads.video_select", sel, (sel,), ("heads.video_proj", "video_select"),
              select("heads.video_proj", "video_select"), "video", stage="heads"),
        _node("heads.audio_proj", audio, (audio,), ("final.norm_out",),
              _proj(audio, "final.norm_out", "audio_proj_out"), "packed", maths="audio_proj_out, FP32"),
        _node("heads.audio_select", sel, (sel,), ("heads.audio_proj", "audio_select"),
              select("heads.audio_proj", "audio_select"), "audio", stage="heads"),
    ]  # fmt: skip


# -- metadata ------------------------------------------------------------------------------------------------------


def adaln_rule_h3(timestep_indices: torch.Tensor, token_tags: torch.Tensor, num_timesteps: int) -> torch.Tensor:
    """diffusers: ``timestep_indices * 3 + token_tags`` (the (3T, H) table is timestep-major)."""
    return timestep_indices * MODALITY_NUM + token_tags


@dataclass(frozen=True)
class RawMetadata:
    """What a packed layout and a timestep plan give the model before derivation (all on the CPU or run device)."""

    position_ids: torch.Tensor  # (S, 3) float64
    token_tags: torch.Tensor  # (S,) int64
    timestep: torch.Tensor  # (T,) float32
    timestep_indices: torch.Tensor  # (S,) int64
    text_indices: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    video_select: torch.Tensor
    audio_select: torch.Tensor


def raw_metadata(layout, timestep: torch.Tensor, timestep_indices: torch.Tensor) -> RawMetadata:
    """The layout's tensors and a ``(timestep, timestep_indices)`` pair; selection indices = scatter indices."""
    return RawMetadata(
        layout.position_ids,
        layout.token_tags,
        timestep,
        timestep_indices,
        layout.text_indices,
        layout.video_indices,
        layout.audio_indices,
        layout.video_indices,
        layout.audio_indices,
    )


def derive_metadata(
    raw: RawMetadata,
    cfg: ModelConfig,
    device: str | torch.device,
    adaln_rule: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = adaln_rule_h3,
) -> dict[str, torch.Tensor]:
    """The graph's metadata inputs: MM-RoPE tables (FP32 from float64 positions), AdaLN rows, indices and the
    canonical attention order (from the scatter indices) on ``device``."""
    s = raw.position_ids.shape[0]
    if raw.position_ids.ndim != 2 or raw.position_ids.shape[-1] != 3:
        raise InputError(f"position_ids: must be (S, 3), got {tuple(raw.position_ids.shape)}")
    for name in ("token_tags", "timestep_indices"):
        if tuple(getattr(raw, name).shape) != (s,):
            raise InputError(f"{name}: must be ({s},) to match position_ids, got {tuple(getattr(raw, name).shape)}")
    cos, sin = reference.rope_tables(raw.position_ids.to(device), cfg.rope_freq_dim, cfg.rope_theta)
    ti = raw.timestep_indices.to(device)
    return {
        "timestep": raw.timestep.to(device),
        "timestep_indices": ti,
        "adaln_indices": adaln_rule(ti, raw.token_tags.to(device), int(raw.timestep.numel())),
        "rope_cos": cos,
        "rope_sin": sin,
        "text_indices": raw.text_indices.to(device),
        "video_indices": raw.video_indices.to(device),
        "audio_indices": raw.audio_indices.to(device),
        "video_select": raw.video_select.to(device),
        "audio_select": raw.audio_select.to(device),
        "attention_order": canonical_order(raw.text_indices, raw.video_indices, raw.audio_indices).to(device),
    }


# -- metadata as pseudo-nodes (compared, and reported apart from the nodes, by the ablation engine) ----------------

META_ROWS = {
    "timestep": ("timestep", None),
    "timestep_indices": ("packed", None),
    "adaln_indices": ("packed", None),
    "rope_cos": ("packed", None),
    "rope_sin": ("packed", None),
    "text_indices": ("text", "row_ids"),
    "video_indices": ("video", "row_ids"),
    "audio_indices": ("audio", "row_ids"),
    "video_select": ("video", "row_ids"),
    "audio_select": ("audio", "row_ids"),
    "attention_order": ("none", "row_ids"),  # entry i: canonical row i (not a packed row); values: packed rows
}


def metadata_nodes(meta: Mapping[str, torch.Tensor], step: int | None) -> Iterator[tuple[Node, torch.Tensor]]:
    """``meta.<name>`` pseudo-nodes (``meta["kind"] == "metadata"``) for every graph metadata input, in order."""
    for name in METADATA:
        rows, values = META_ROWS[name]
        node_meta = {"kind": "metadata", "rows": rows, "stage": "meta"}
        if values:
            node_meta["values"] = values
        node = Node(f"meta.{name}", "packed_layout", (), (), lambda *a: None, row_dim=0, step=step, meta=node_meta)
        yield node, meta[name]


# -- parameters ----------------------------------------------------------------------------------------------------


def load_model_params(source, cfg: ModelConfig, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every inventory tensor of ``cfg`` from ``source``, checked for shape and dtype (InputError naming it)."""
    have = set(source.names())
    params: dict[str, torch.Tensor] = {}
    for spec in expected_inventory(cfg):
        if spec.name not in have:
            raise InputError(f"weight source: {spec.name}: missing")
        tensor = source.load(spec.name, device, check_finite=True)
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != getattr(torch, spec.dtype):
            raise InputError(
                f"{spec.name}: {tuple(tensor.shape)} {dtype_name(tensor.dtype)}, expected "
                f"{tuple(spec.shape)} {spec.dtype}"
            )
        params[spec.name] = tensor
    return params
