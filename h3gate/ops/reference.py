"""Provider references: diffusers 0.42.1's MiniMax-H3 arithmetic, op for op, without importing diffusers.

Each function reproduces the provider's op sequence, dtypes and cast points exactly (so on the same device it is
bitwise equal to ``MiniMaxH3Transformer3DModel``'s code path), and takes every dtype from its inputs. Running a
function on float64 inputs (with ``dtype=torch.float64`` where a cast target is explicit) is the golden.
One reference is PEFT's rather than diffusers': :func:`lora_update`, the update term of a LoRA-wrapped linear.

Shapes: ``B`` batch, ``S`` packed rows, ``H`` hidden, ``T`` distinct timesteps, ``nh`` heads, ``D`` head dim,
``R`` rotary channels (6 * rope_freq_dim), ``F`` FFN width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MODALITY_NUM = 3


def timestep_sinusoid(timestep: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """(T,) -> (T, dim) float32: ``[cos(t * f_i), sin(t * f_i)]`` with ``f_i = exp(-ln(1e4) * i / (dim/2))``.

    diffusers ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)``: frequencies, product and sin/cos in
    float32; the flip puts cos first.
    """
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=timestep.device)
    exponent = exponent / (half - 0)
    emb = timestep[:, None].float() * torch.exp(exponent)[None, :]
    emb = 1 * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if dim % 2 == 1:
        emb = F.pad(emb, (0, 1, 0, 0))
    return emb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` at the operands' dtype (the provider's nn.Linear / cuBLAS path)."""
    return F.linear(x, weight, bias)


def lora_update(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's LoRA update term (not diffusers): ``lora_B(lora_A(x.to(lora_A.dtype))) * scaling``.

    PEFT 0.17 - 0.21 vanilla LoRA ``Linear.forward`` with dropout 0: ``x`` cast to the adapter dtype (a no-op when
    equal), two bias-free ``F.linear`` at the adapter dtype (lora_a (r, K), lora_b (N, r)), then the lora_B output
    times the Python float ``scaling`` (one rounding at the adapter dtype). The caller adds the base output and
    casts, ``(base + update).to(base.dtype)``, as PEFT does.
    """
    return F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scaling


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU at the input's precision (the timestep MLP's inner activation)."""
    return F.silu(x)


def silu_cast(temb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """AdaLN activation path: SiLU at ``temb``'s precision (FP32), then one cast to the projection dtype."""
    return F.silu(temb).to(dtype)


def timestep_mlp(sinusoid, w1, b1, w2, b2) -> torch.Tensor:
    """FP32 ``linear_2(silu(linear_1(x)))`` of ``TimestepEmbedding``; the input is cast to the module dtype first."""
    x = sinusoid.to(w1.dtype)
    return linear(silu(linear(x, w1, b1)), w2, b2)


def adaln_table(projection: torch.Tensor, hidden: int) -> tuple[torch.Tensor, ...]:
    """(T, 18H) -> six (3T, H) views in ``shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp`` order.

    Row ``t * 3 + m`` of each view is timestep ``t``, modality ``m`` (0 video, 1 text, 2 audio). No arithmetic.
    """
    return projection.view(-1, 6 * hidden).chunk(6, dim=-1)


def adaln_projection(temb, weight, bias, hidden: int) -> tuple[torch.Tensor, ...]:
    """``MiniMaxH3AdaLayerNormModulation``: silu_cast then the BF16 projection, viewed as the six-way table."""
    return adaln_table(linear(silu_cast(temb, weight.dtype), weight, bias), hidden)


def adaln_row_gather(table: torch.Tensor, adaln_indices: torch.Tensor) -> torch.Tensor:
    """(3T, H) table, (S,) int64 rows -> (S, H): ``table.index_select(0, adaln_indices)``."""
    return table.index_select(0, adaln_indices)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``nn.RMSNorm(H, eps)`` over the last dim, as the provider calls it."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rmsnorm_modulate(x, weight, shift, scale, adaln_indices, eps: float) -> torch.Tensor:
    """norm1/norm2 with modulation: ``rmsnorm(x) * (1 + scale[idx]) + shift[idx]`` in the provider's op order."""
    n = rmsnorm(x, weight, eps)
    return n * (1.0 + scale.index_select(0, adaln_indices)) + shift.index_select(0, adaln_indices)


def qk_rmsnorm(x: torch.Tensor, weight: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """(B, S, nh*D) -> (B, S, nh, D): unflatten into heads, then per-head RMSNorm over D (``attn.norm_q/norm_k``)."""
    return rmsnorm(x.unflatten(-1, (heads, -1)), weight, eps)


def rope_tables(position_ids: torch.Tensor, rope_freq_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, 3) positions -> cos, sin (S, 6F) float32 (``MiniMaxH3RotaryPosEmbed``): angles [t | h | w] twice."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32) / (2 * rope_freq_dim))).to(
        position_ids.device
    )
    pos = position_ids.to(torch.float32)
    freqs = pos.unsqueeze(-1) * inv_freq.view(1, 1, -1)
    ft, fh, fw = freqs.unbind(dim=1)
    freqs = torch.cat((ft, fh, fw), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def mm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, S, nh, D): rotate-half on the first R channels of every head, pass the other D - R through.

    cos/sin are cast to ``x``'s dtype first; ``x_rot * cos + cat(-x2, x1) * sin`` at ``x``'s dtype.
    """
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    c = cos.to(x.dtype)[None, :, None, :]
    s = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = xr.chunk(2, dim=-1)
    xr = xr * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((xr, xp), dim=-1).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S, nh, D) x3 -> (B, S, nh*D): non-causal unmasked SDPA over one packed document, scale 1/sqrt(D).
    ``order`` (the strict kernel's canonical walk order) is accepted and ignored: diffusers attends in packed order."""
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), dropout_p=0.0, is_causal=False
    )
    return out.permute(0, 2, 1, 3).flatten(2, 3).type_as(q)


def gate_residual(x, y, gate, adaln_indices) -> torch.Tensor:
    """``x + gate[idx] * y`` (residual first, gate times sublayer output)."""
    return x + gate.index_select(0, adaln_indices) * y


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain residual ``x + y`` at the operands' dtype (``MiniMaxH3TokenRefinerBlock``: no gate)."""
    return x + y


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """(.., 2F) -> (.., F): first half value, second half gate: ``value * silu(gate)``."""
    value, gate = h.chunk(2, dim=-1)
    return value * F.silu(gate)


def final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps: float) -> torch.Tensor:
    """``MiniMaxH3AdaLayerNormOut``: table (T, 2H) = linear(silu_cast(temb)) as shift|scale, then
    ``rmsnorm(x) * (1 + scale[t_idx]) + shift[t_idx]`` per packed row."""
    shift, scale = linear(silu_cast(temb, weight.dtype), weight, bias).chunk(2, dim=-1)
    n = rmsnorm(x, norm_weight, eps)
    return n * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)


def packed_index_copy(text, video, audio, text_indices, video_indices, audio_indices, seq_len: int) -> torch.Tensor:
    """Zero (B, S, H) at ``text``'s dtype, then index_copy text, video, audio rows (video/audio cast to it)."""
    out = text.new_zeros((text.shape[0], seq_len, text.shape[-1]))
    out = out.index_copy(1, text_indices, text)
    out = out.index_copy(1, video_indices, video.to(text.dtype))
    return out.index_copy(1, audio_indices, audio.to(text.dtype))


def packed_index_select(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, S, C) -> (B, N, C): ``x.index_select(1, indices)`` (output-row selection)."""
    return x.index_select(1, indices)


def conditioning_noise_mix(sample: torch.Tensor, t, noise: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3Scheduler.scale_noise``: ``t * x0 + (1 - t) * noise`` at the sample's dtype."""
    if not isinstance(t, torch.Tensor):
        t = torch.tensor(t, dtype=sample.dtype, device=sample.device)
    t = t.to(device=sample.device, dtype=sample.dtype)
    while t.ndim < sample.ndim:
        t = t.unsqueeze(-1)
    return t * sample + (1.0 - t) * noise
