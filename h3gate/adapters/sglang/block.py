"""SGLang's ``MiniMaxH3DiTBlock`` (``model.blocks[i]``) on h3gate's block inputs, captured at the 17 block nodes.

h3gate's block inputs (:func:`h3gate.graph.inputs.build_block_inputs`: ``hidden_states`` (B, S, H) bf16, ``temb``
(T, E) fp32, ``adaln_indices`` (S,), ``rope_cos`` / ``rope_sin`` (S, R) fp32, ``attention_order`` (S,)) become the
block's forward arguments as SGLang's model forward prepares them for its block stack:

    x                 (L, H) bf16: item b's rows at packed rows b S .. b S + S - 1, padding rows zero (L = B S
                      rounded up to ``align``, 64 as the model pads); a fresh tensor (SGLang may write into x)
    adaln_input       ``silu(temb).to(bf16)`` (T, E): the model forward's own expression
    combined_indices  (L,) ``adaln_indices`` per item; padding rows ``3 * (adaln_indices[attention_order[0]] // 3)``:
                      the text rows' timestep at tag 0 (the model pads with the text timestep, tag -1 clamped to 0)
    rope_cache        ``(cos_sin_cache (L, R) bf16, arange(L))``. SGLang's ``_rope_cos_sin_cache`` is
                      ``cat(cos(f[:, :R/2]), sin(f[:, :R/2])).to(bf16)`` of its angles f = [t | h | w] twice, h3gate's
                      tables are ``cos(f)``, ``sin(f)`` of the same angles, so the cache is exactly
                      ``cat(rope_cos[:, :R/2], rope_sin[:, :R/2]).to(bf16)`` (tables whose halves differ are refused);
                      padding rows at position 0: cos 1, sin 0
    cu_seqlens        ``[0, S, 2S, .., B S, L]`` int32 and its host tuple; ``max_seqlen`` S

Points (:func:`block_points`): the model map's block rows (:mod:`.capture`) under the block graph's own node names
(``adaln_projection``, ``norm1``, ... ``residual_mlp``), hooked on ``model.blocks[i]``'s modules. Packed values come
back as (B, S, ...) (padding dropped), ``adaln_projection`` as (T, 18 H).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

from h3gate.adapters.sglang.capture import Capture, Point, Recorder, body_points, collect, hooks
from h3gate.adapters.sglang.forcing import Forcing, isolation_gaps
from h3gate.adapters.sglang.inputs import ALIGN, Packing
from h3gate.adapters.sglang.runtime import degrees
from h3gate.errors import InputError
from h3gate.graph.block import BLOCK_NODES, build_block_graph
from h3gate.graph.core import Graph
from h3gate.manifests.model_config import ModelConfig

ROWS = {n: ("timestep" if n == "adaln_projection" else "packed") for n in BLOCK_NODES}


def block_points(layer: int) -> list[Point]:
    """The 17 points of block ``layer`` (module paths from the model's root), in the block graph's order."""
    adaln = Point("adaln_projection", f"blocks.{layer}.adaln_proj.linear", "out")
    return [adaln, *body_points("", f"blocks.{layer}", rope=True)]


def block_packing(items: int, seq_len: int, align: int = ALIGN) -> Packing:
    """``items`` block inputs of ``seq_len`` rows packed one after another, padded to a multiple of ``align``."""
    if items < 1 or align < 1:
        raise InputError(f"sglang block packing: items {items}, align {align}: must be >= 1")
    total = -(-items * seq_len // align) * align
    return Packing(items, seq_len, total, serving=True, trusted_layout=False, mask_condition=False, condition_rows=0)


def rope_cache(cos: torch.Tensor, sin: torch.Tensor, pack: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    """h3gate's (S, R) FP32 tables -> SGLang's ``(cos_sin_cache (L, R) bf16, positions (L,))`` (module docstring)."""
    half = cos.shape[-1] // 2
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        raise InputError("sglang block: rope_cos/rope_sin: the two halves differ (SGLang's cache holds one half)")
    rows = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).to(torch.bfloat16)
    pad = torch.cat((torch.ones(half), torch.zeros(half))).to(torch.bfloat16).to(cos.device)
    pad = pad.expand(pack.total - pack.batch * pack.seq_len, -1)
    cache = torch.cat([rows] * pack.batch + [pad]).contiguous()
    return cache, torch.arange(pack.total, device=cos.device, dtype=torch.long)


def block_arguments(
    tensors: Mapping[str, torch.Tensor], hidden: torch.Tensor, pack: Packing
) -> tuple[torch.Tensor, dict[str, object]]:
    """``(x, keyword arguments)`` of ``MiniMaxH3DiTBlock.forward`` for ``hidden`` (B, S, H) (module docstring)."""
    used, width, device = pack.batch * pack.seq_len, hidden.shape[-1], hidden.device
    x = torch.zeros(pack.total, width, dtype=hidden.dtype, device=device)
    x[:used] = hidden.reshape(used, width)
    idx = tensors["adaln_indices"].to(torch.long)
    pad = (idx[tensors["attention_order"][0]] // 3 * 3).reshape(1).expand(pack.total - used)
    cu = pack.cu_seqlens
    return x, {
        "adaln_input": torch.nn.functional.silu(tensors["temb"]).to(torch.bfloat16),
        "combined_indices": torch.cat([idx] * pack.batch + [pad]),
        "rope_cache": rope_cache(tensors["rope_cos"], tensors["rope_sin"], pack),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=device),
        "cu_seqlens_host": cu,
        "max_seqlen": pack.seq_len,
    }


def capture_block(
    model: torch.nn.Module,
    cfg: ModelConfig,
    layer: int,
    tensors: Mapping[str, torch.Tensor],
    hidden: torch.Tensor | None = None,
    align: int = ALIGN,
    provider: Mapping[str, torch.Tensor] | None = None,
    before: Callable[[], contextlib.AbstractContextManager] | None = None,
    graph: Graph | None = None,
) -> Capture:
    """One forward of ``model.blocks[layer]`` on the block inputs ``tensors``, every block node captured (B, S, ...)
    in h3gate's dtypes; ``hidden`` (B, S, H) replaces ``tensors["hidden_states"]`` (several items packed one after
    another). ``before()`` is entered first (e.g. :func:`.capture.row_fault`: its hook runs before the capture's).
    With ``provider`` (block node -> the provider's value, batch 1) the isolated view by teacher forcing
    (:mod:`.forcing`); ``uncovered`` names the nodes without an exact isolated value and why."""
    if any(d != 1 for d in degrees().values()):
        raise InputError(f"sglang block capture: degrees {degrees()}: the node map reads TP 1 / SP 1 values only")
    if not 0 <= layer < len(model.blocks):
        raise InputError(f"sglang block capture: block {layer}: the model has {len(model.blocks)} blocks")
    hidden = tensors["hidden_states"] if hidden is None else hidden
    if provider is not None and hidden.shape[0] != 1:
        raise InputError(f"sglang block capture: isolated view of {hidden.shape[0]} items: one item only")
    pack = block_packing(hidden.shape[0], hidden.shape[1], align)
    points = block_points(layer)
    forcing = None if provider is None else Forcing(points, provider, ROWS, cfg)
    model._resolve_attention_backend_once()  # the backend instance the varlen points wrap
    rec = Recorder(forcing)
    x, kwargs = block_arguments(tensors, hidden, pack)
    with contextlib.ExitStack() as stack, torch.no_grad():
        if before is not None:
            stack.enter_context(before())
        stack.enter_context(hooks(model, points, rec))
        out = model.blocks[layer](x, **kwargs)
    values, uncovered = collect(points, rec, ROWS, pack, cfg)
    if forcing is not None:
        uncovered = isolation_gaps((graph or build_block_graph(cfg, layer)).nodes, uncovered, forcing)
    return Capture(values, uncovered, {"residual_mlp": pack.unpack(out)})
