"""The bound forwards of SGLang's composite modules: they keep SGLang's call structure (every submodule is still called
as a module, so its forward hooks fire; packing, cu_seqlens, SGLang's attention core and TP collectives stay in
place) and compute h3gate's nodes in h3gate's order (:mod:`h3gate.graph.block`, :mod:`h3gate.graph.refiner`,
:mod:`h3gate.graph.model`), every operator through the session's :class:`~h3gate.adapters.sglang.strict_ops.OpCaller`:

    MiniMaxH3DiTModel._embed  text refined (SGLang's refine_prompt_embeds) or taken refined; video / audio rows through
                              the bound patch projections; then per request segment ``packed_index_copy`` (zeros at
                              the text dtype, text / video / audio rows copied, video and audio cast to it) into the
                              packed rows, padding rows +0.0; ``t_emb`` by the bound time embedder
    MiniMaxH3TimeEmbedder     timestep_sinusoid_h3 -> proj_in -> timestep_mlp_silu -> proj_out (FP32)
    MiniMaxH3TokenRefinerBlock  norm1 -> attn -> residual_add -> norm2 -> mlp -> residual_add
    MiniMaxH3DiTBlock         SGLang's AdaLN views (shift, scale, gate: (3T, H) chunks of the projection, h3gate's
                              adaln_table) -> norm1 (h3_rmsnorm_modulate) -> attn -> adaln_gate_residual -> norm2 ->
                              mlp -> adaln_gate_residual, rows indexed by SGLang's combined indices
                              (``tag + 3 timestep_index``: h3gate's adaln_indices)
    MiniMaxH3Attention        qkv_proj -> q / k (T, h, D) -> q_norm / k_norm -> (blocks) h3_mm_rope_3axis_partial
                              with h3gate's FP32 tables -> SGLang's attention core (its Ulysses exchange; the
                              backend's ``forward_varlen`` bound below) -> out_proj
    attention backend         ``forward_varlen``: per non-empty cu_seqlens segment, h3_full_attention on its rows
    forward_varlen            (B = 1), a request walked in its canonical order, padding in packed order: no row
                              attends outside its segment, so padding never touches a request's bytes
    MiniMaxH3MLP              fc1 ([gate | value]) -> halves swapped to [value | gate] (a copy) -> h3_swiglu
                              (value * silu(gate)) -> fc2
    MiniMaxH3FinalLayer       SGLang's (shift, scale) views -> final_adaln_out -> .to(FP32) -> video_out, audio_out

Not bound (copies, no arithmetic): SGLang's selection of the live video / audio rows (``index_select``, h3gate's
packed_index_select), its TP all-gather of output columns and its ``update_mask`` product (``skip_mask_out_condition``
skips it).
"""

from __future__ import annotations

import torch

from h3gate.adapters.sglang.strict_layers import Forward
from h3gate.adapters.sglang.strict_ops import Bound
from h3gate.errors import InputError


def _first(value: torch.Tensor) -> torch.Tensor:
    return value[0]


def attention(b: Bound, attn: torch.nn.Module, prefix: str, rotate: bool) -> Forward:
    def forward(x, *, rope_cache, cu_seqlens, cu_seqlens_host=None, max_seqlen, subblock_sparse_query_block_mask=None,
                ulysses_active=False, ring_active=False, x_prequant=None):  # fmt: skip
        from sglang.multimodal_gen.runtime.models.dits.minimax_h3 import _minimax_h3_attention_core_impl

        if ring_active or x_prequant is not None:
            raise InputError(f"sglang strict binding: {prefix}attention: ring attention / MXFP8 input: not covered")
        total, heads, d = x.shape[0], attn.num_heads, attn.head_dim
        qkv, _ = attn.qkv_proj(x)
        q, k, v = (qkv[:, j * heads * d : (j + 1) * heads * d].contiguous().view(total, heads, d) for j in range(3))
        q, k = attn.q_norm(q), attn.k_norm(k)
        if rotate:
            cos, sin = b.live(f"{prefix}rope_q").rope(total)
            q = b.ops(f"{prefix}rope_q", "h3_mm_rope_3axis_partial", q[None], cos, sin, view=_first)
            k = b.ops(f"{prefix}rope_k", "h3_mm_rope_3axis_partial", k[None], cos, sin, view=_first)
        out = _minimax_h3_attention_core_impl(
            attn, q, k, v, cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host, max_seqlen=max_seqlen,
            subblock_sparse_query_block_mask=subblock_sparse_query_block_mask, ulysses_active=ulysses_active,
            ring_active=False, gate_compress=None,
        )  # fmt: skip
        out, _ = attn.out_proj(out.reshape(total, heads * d))
        return out

    return forward


def varlen(b: Bound, prefix: str, ordered: bool):
    """The attention backend's ``forward_varlen`` (module docstring); ``ordered``: a transformer block's (its request
    segments walked in their canonical order), else the refiner's (packed order)."""
    node = f"{prefix}attention"

    def forward_varlen(query, key, value, *, cu_seqlens, max_seqlen, cu_seqlens_host=None, **extra):
        if extra:
            raise InputError(f"sglang strict binding: {node}: backend arguments {sorted(extra)}: not covered")
        bounds = cu_seqlens_host if cu_seqlens_host is not None else tuple(int(i) for i in cu_seqlens.tolist())
        out = torch.zeros_like(query)
        for a, z in zip(bounds[:-1], bounds[1:], strict=True):
            if z <= a:
                continue
            order = b.live(node).segment(a, z).order if ordered else None
            q, k, v = (t[a:z].contiguous()[None] for t in (query, key, value))
            o = b.ops(node, "h3_full_attention", q, k, v, order=order, trace={"segment": [a, z]}, fault=False)
            out[a:z] = o[0].view(z - a, *query.shape[1:])
        return b.ops.fault(node, "h3_full_attention", out)

    return forward_varlen


def mlp(b: Bound, module: torch.nn.Module, prefix: str) -> Forward:
    def forward(x):
        u, _ = module.fc1(x)
        f = u.shape[-1] // 2
        s = b.ops(f"{prefix}swiglu", "h3_swiglu", torch.cat((u[..., f:], u[..., :f]), dim=-1))
        out, _ = module.fc2(s)
        return out

    return forward


def dit_block(b: Bound, block: torch.nn.Module, prefix: str) -> Forward:
    def forward(x, *, adaln_input, combined_indices, rope_cache, cu_seqlens, cu_seqlens_host=None, max_seqlen,
                subblock_sparse_query_block_mask=None, ulysses_active=False, ring_active=False,
                adaln_params=None):  # fmt: skip
        if adaln_params is None:
            adaln_params = block.adaln_proj(adaln_input)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params
        idx = combined_indices
        h = block.norm1(x, shift_msa, scale_msa, idx)
        h = block.attn(h, rope_cache=rope_cache, cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host,
                       max_seqlen=max_seqlen, subblock_sparse_query_block_mask=subblock_sparse_query_block_mask,
                       ulysses_active=ulysses_active, ring_active=ring_active)  # fmt: skip
        x = b.ops(f"{prefix}residual_attn", "adaln_gate_residual", x, h, gate_msa, idx)
        h = block.mlp(block.norm2(x, shift_mlp, scale_mlp, idx))
        return b.ops(f"{prefix}residual_mlp", "adaln_gate_residual", x, h, gate_mlp, idx)

    return forward


def refiner_block(b: Bound, block: torch.nn.Module, prefix: str) -> Forward:
    def forward(x, *, cu_seqlens, cu_seqlens_host=None, max_seqlen):
        h = block.attn(block.norm1(x), rope_cache=None, cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host,
                       max_seqlen=max_seqlen)  # fmt: skip
        x = b.ops(f"{prefix}residual_attn", "residual_add", x, h)
        h = block.mlp(block.norm2(x))
        return b.ops(f"{prefix}residual_mlp", "residual_add", x, h)

    return forward


def time_embedder(b: Bound, module: torch.nn.Module) -> Forward:
    def forward(t):
        s = b.ops("time.sinusoid", "timestep_sinusoid_h3", t, module.frequency_embedding_size)
        h, _ = module.proj_in(s)
        out, _ = module.proj_out(b.ops("time.silu", "timestep_mlp_silu", h))
        b.live("time.linear_2").temb = out
        return out

    return forward


def final_layer(b: Bound, module: torch.nn.Module) -> Forward:
    def forward(x, *, adaln_input, inverse_indices, adaln_params=None):
        if adaln_params is None:
            adaln_params = module.adaln_proj(adaln_input)
        shift, scale = adaln_params
        h = module.norm(x, shift, scale, inverse_indices).to(torch.float32)
        video, _ = module.video_out(h)
        audio, _ = module.audio_out(h)
        return video, audio

    return forward


def _text(model: torch.nn.Module, selected, refiner_cu, length, device) -> torch.Tensor:
    """SGLang's ``_embed`` text: taken refined (``refined_prompt_embeds_length``) or refined here."""
    if length is None:
        return model.refine_prompt_embeds(selected, refiner_cu, device=device)
    n = int(length.item()) if torch.is_tensor(length) else int(length)
    return selected[:n].to(device=device, dtype=torch.bfloat16)


def _rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SGLang's ``_embed`` latent rows: ``x``'s packed rows at ``positions``, FP32."""
    return x.view(-1, x.shape[-1]).index_select(0, positions).to(torch.float32)


def embed(b: Bound, model: torch.nn.Module) -> Forward:
    """``MiniMaxH3DiTModel._embed`` (module docstring): writes ``embeddings`` (the rank's rows) and ``t_emb``."""

    def forward(*, x, audio_x, text_embeddings_selected, unique_timesteps, img_pos, audio_pos, text_pos,
                refiner_cu_seqlens, refiner_max_seqlen, row_start, row_stop, device, refined_prompt_embeds_length=None,
                local_embedding_layout=None, embeddings, t_emb):  # fmt: skip
        meta = b.live("embed.pack")
        text = _text(model, text_embeddings_selected, refiner_cu_seqlens, refined_prompt_embeds_length, device)
        video, _ = model.video_patch_proj(_rows(x, img_pos))
        audio, _ = model.audio_patch_proj(_rows(audio_x, audio_pos))
        packed = torch.zeros((x.shape[1], text.shape[-1]), dtype=text.dtype, device=device)
        for seg in meta.segments:
            if not seg.request:
                continue
            parts = [src.index_select(0, i)[None] for src, i in zip((text, video, audio), seg.src, strict=True)]
            rows = b.ops("embed.pack", "packed_index_copy", *parts, *seg.rows, seg.stop - seg.start, fault=False)
            packed[seg.start : seg.stop] = rows[0]
        embeddings.copy_(b.ops.fault("embed.pack", "packed_index_copy", packed)[row_start:row_stop])
        t_emb.copy_(model._time_embedding(unique_timesteps))

    return forward
