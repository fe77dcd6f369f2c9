"""h3gate's model inputs as SGLang's ``MiniMaxH3DiTModel.forward`` keyword contract, and its outputs back.

h3gate's graph takes a batch of B requests on one layout: ``video_rows`` (B, Nv, Cv), ``audio_rows`` (B, Na, Ca),
``text`` (B, Nt, text_dim) and the layout's metadata (:class:`h3gate.graph.model.RawMetadata`: ``position_ids``
(S, 3) float64, ``token_tags`` (S,), ``timestep`` (T,) fp32, ``timestep_indices`` (S,), the text / video / audio
index tensors). SGLang's forward takes one packed sequence ``[1, L, C]`` whose attention segments are given by
``cu_seqlens``: request b occupies packed rows ``b S .. b S + S - 1`` (its own rows in h3gate's packed order) and
the rows ``B S .. L - 1`` are padding (``L = B S`` rounded up to ``align``, 64 as SGLang's
``minimax_h3_packed_sequence`` pads): ``cu_seqlens = [0, S, 2S, .., B S, L]``. Keyword by keyword:

    x / audio_x            (1, L, Cv) / (1, L, Ca) fp32 zeros, each request's rows index_copy'd to its positions
    img_position_ids       (1, L, 3) float64: each request's position_ids, padding rows zero
    unique_timesteps       timestep (T,) fp32
    inverse_indices        (L,) timestep_indices per request; padding rows take the text rows' index (SGLang:
                           text and padding inherit the video timestep)
    token_tags / block_token_tags   (L,) tags, padding -1 (clamped to 0 = video by SGLang); AdaLN row
                           ``inverse * 3 + tag``, h3gate's ``adaln_indices``
    img_pos_info / audio_pos_info / text_pos_info   {"position_ids": packed rows of each request's video /
                           audio / text rows, request after request}
    img_pos_for_infer_output_info   the video rows to return: all of them (h3gate's ``heads.video_select``)
    update_mask            (B Nv,): with ``mask_condition`` the first ``condition_rows`` video rows of each
                           request are False and SGLang zeroes them in the video output; otherwise all True and
                           ``skip_mask_out_condition`` (as SGLang's serving loop passes it)
    prompt_embeds          serving: the text refined per request by ``model.refine_prompt_embeds`` (SGLang's
                           ``_precompute_refined_prompt_embeds``), (B Nt, H) bf16, with
                           ``refined_prompt_embeds_length``; direct (B = 1): the raw text (Nt, text_dim), refined
                           inside the forward
    rope_cache             serving: ``model.build_rope_cache(img_position_ids)``; direct: built by the forward
    local_embedding_layout serving with B = 1 and text at rows 0 .. Nt-1: SGLang's trusted layout (embeddings
                           written by index_copy); otherwise the forward's zero-fill + index_add path
    packed_seq_params      {"cu_seqlens_q", "cu_seqlens_q_host", "max_seqlen_q": S}
    refiner_packed_seq_params   {"cu_seqlens_q": [0, Nt, Nt], ...}: one request's text (SGLang refines one
                           request's text per call)

Outputs: ``(video (B Nv, Cv), audio (B Na, Ca))`` fp32 -> :func:`unpack_outputs` -> (B, Nv, Cv), (B, Na, Ca),
h3gate's ``heads.video_select`` / ``heads.audio_select`` (condition rows zero under ``mask_condition``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from h3gate.errors import InputError
from h3gate.graph.model import RawMetadata

ALIGN = 64  # SGLang's MINIMAX_H3_PACKED_SEQUENCE_ALIGNMENT


@dataclass(frozen=True)
class Packing:
    """Where h3gate's (B, S) rows sit in SGLang's packed sequence of ``total`` rows."""

    batch: int
    seq_len: int
    total: int
    serving: bool
    trusted_layout: bool
    mask_condition: bool
    condition_rows: int

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        bounds = tuple(b * self.seq_len for b in range(self.batch + 1))
        return bounds + ((self.total,) if self.total > bounds[-1] else (bounds[-1],))

    def unpack(self, value: torch.Tensor) -> torch.Tensor:
        """(total, ...) SGLang rows -> (B, S, ...) h3gate rows (padding dropped)."""
        used = self.batch * self.seq_len
        return value[:used].reshape(self.batch, self.seq_len, *value.shape[1:])

    def record(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "rows_per_request": self.seq_len,
            "packed_rows": self.total,
            "cu_seqlens": list(self.cu_seqlens),
            "path": "serving" if self.serving else "direct",
            "embedding_layout": "trusted (index_copy)" if self.trusted_layout else "zero-fill + index_add",
            "condition_rows_zeroed": self.condition_rows if self.mask_condition else 0,
        }


def packing(
    batch: int,
    seq_len: int,
    text_indices: torch.Tensor,
    align: int = ALIGN,
    serving: bool = True,
    mask_condition: bool = False,
    condition_rows: int = 0,
) -> Packing:
    """The packing of ``batch`` requests of ``seq_len`` rows, padded to a multiple of ``align``."""
    if batch < 1 or align < 1:
        raise InputError(f"sglang packing: batch {batch}, align {align}: must be >= 1")
    if not serving and batch != 1:
        raise InputError("sglang packing: the direct path refines one request's text per forward (batch 1)")
    used = batch * seq_len
    total = -(-used // align) * align
    text_first = torch.equal(text_indices.cpu(), torch.arange(text_indices.numel()))
    return Packing(batch, seq_len, total, serving, serving and batch == 1 and text_first, mask_condition,
                   condition_rows)  # fmt: skip


def _scatter(rows: torch.Tensor, positions: torch.Tensor, total: int) -> torch.Tensor:
    """(B, N, C) rows -> (1, total, C) fp32 zeros with request b's rows at ``positions[b]``."""
    out = torch.zeros(1, total, rows.shape[-1], dtype=torch.float32, device=rows.device)
    out[0].index_copy_(0, positions.reshape(-1), rows.reshape(-1, rows.shape[-1]).to(torch.float32))
    return out


def _positions(index: torch.Tensor, pack: Packing) -> torch.Tensor:
    """(B, N) packed rows of each request's rows of one index tensor."""
    offsets = torch.arange(pack.batch, device=index.device)[:, None] * pack.seq_len
    return index[None, :] + offsets


def _per_row(value: torch.Tensor, pack: Packing, fill: int | float) -> torch.Tensor:
    """(S, ...) per-row metadata repeated per request, padding rows ``fill``."""
    pad = torch.full((pack.total - pack.batch * pack.seq_len, *value.shape[1:]), fill, dtype=value.dtype)
    return torch.cat([value.cpu()] * pack.batch + [pad]).to(value.device)


def _local_layout(pack: Packing, text_len: int, img: torch.Tensor, audio: torch.Tensor) -> dict[str, Any]:
    """SGLang's ``_build_local_embedding_layout`` for world size 1 (every row is local)."""
    return {
        "text_source_start": 0,
        "text_source_stop": text_len,
        "img_global_ids": img,
        "img_row_ids": img,
        "audio_global_ids": audio,
        "audio_row_ids": audio,
    }


def forward_kwargs(
    model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], raw: RawMetadata, pack: Packing
) -> dict[str, Any]:
    """SGLang's forward kwargs for h3gate's ``inputs`` (``video_rows``, ``audio_rows``, ``text``) on ``raw``'s layout
    (module docstring). The serving path calls ``model.refine_prompt_embeds`` and ``model.build_rope_cache``."""
    video, audio, text = inputs["video_rows"], inputs["audio_rows"], inputs["text"]
    if video.shape[0] != pack.batch or audio.shape[0] != pack.batch or text.shape[0] != pack.batch:
        raise InputError(
            f"sglang inputs: batch {video.shape[0]}/{audio.shape[0]}/{text.shape[0]}, packing {pack.batch}"
        )
    device = video.device
    img = _positions(raw.video_indices.to(device), pack)
    aud = _positions(raw.audio_indices.to(device), pack)
    txt = _positions(raw.text_indices.to(device), pack).reshape(-1)
    text_t = raw.timestep_indices[raw.text_indices[0]] if raw.text_indices.numel() else 0
    tags = _per_row(raw.token_tags.to(torch.long), pack, -1).to(device)
    update = torch.ones(img.shape, dtype=torch.bool, device=device)
    if pack.mask_condition:
        update[:, : pack.condition_rows] = False
    text_len = int(raw.text_indices.numel())
    kw: dict[str, Any] = {
        "x": _scatter(video, img, pack.total),
        "audio_x": _scatter(audio, aud, pack.total),
        "img_position_ids": _per_row(raw.position_ids, pack, 0.0)[None].to(device),
        "unique_timesteps": raw.timestep.to(device),
        "inverse_indices": _per_row(raw.timestep_indices.to(torch.long), pack, int(text_t)).to(device),
        "update_mask": update.reshape(-1),
        "skip_mask_out_condition": not pack.mask_condition,
        "img_pos_info": {"position_ids": img.reshape(-1)},
        "audio_pos_info": {"position_ids": aud.reshape(-1)},
        "text_pos_info": {"position_ids": txt},
        "img_pos_for_infer_output_info": {"position_ids": img.reshape(-1)},
        "packed_seq_params": {
            "cu_seqlens_q": torch.tensor(pack.cu_seqlens, dtype=torch.int32, device=device),
            "cu_seqlens_q_host": pack.cu_seqlens,
            "max_seqlen_q": pack.seq_len,
        },
        "refiner_packed_seq_params": {
            "cu_seqlens_q": torch.tensor([0, text_len, text_len], dtype=torch.int32, device=device),
            "cu_seqlens_q_host": (0, text_len, text_len),
            "max_seqlen_q": text_len,
        },
    }
    if not pack.serving:
        return {**kw, "token_tags": tags, "prompt_embeds": text[0]}
    refiner_cu = kw["refiner_packed_seq_params"]["cu_seqlens_q"]
    with torch.no_grad():
        refined = torch.cat([model.refine_prompt_embeds(t, refiner_cu, device=device) for t in text])
        rope_cache = model.build_rope_cache(kw["img_position_ids"], device=device)
    kw.update(
        block_token_tags=tags.clamp(min=0),
        prompt_embeds=refined,
        refined_prompt_embeds_length=int(refined.shape[0]),
        rope_cache=rope_cache,
    )
    if pack.trusted_layout:
        kw["local_embedding_layout"] = _local_layout(pack, text_len, img.reshape(-1), aud.reshape(-1))
    return kw


def unpack_outputs(
    outputs: tuple[torch.Tensor, torch.Tensor], pack: Packing, video_rows: int, audio_rows: int
) -> dict[str, torch.Tensor]:
    """SGLang's ``(video (B Nv, Cv), audio (B Na, Ca))`` -> h3gate's ``heads.video_select`` (B, Nv, Cv) and
    ``heads.audio_select`` (B, Na, Ca)."""
    video, audio = outputs
    return {
        "heads.video_select": video.reshape(pack.batch, video_rows, video.shape[-1]),
        "heads.audio_select": audio.reshape(pack.batch, audio_rows, audio.shape[-1]),
    }


def run_forward(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor],
    raw: RawMetadata,
    pack: Packing,
) -> dict[str, torch.Tensor]:
    """One SGLang forward on h3gate's inputs (no grad); h3gate's two output nodes."""
    kw = forward_kwargs(model, inputs, raw, pack)
    with torch.no_grad():
        out = model(**kw)
    return unpack_outputs(out, pack, int(raw.video_indices.numel()), int(raw.audio_indices.numel()))
