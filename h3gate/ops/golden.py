"""Float64 goldens for references whose dense float64 run does not fit in device memory.

:func:`attention_fp64` is the maths of :func:`h3gate.ops.reference.attention` (non-causal, unmasked
``softmax(q k^T / sqrt(D)) v`` per head over one packed document) in float64, but computed over query chunks of
``C`` rows so that no (B, nh, S, S) matrix exists (at 768p that matrix is 680 GB in float64):

* forward, per chunk: ``s = q_c k^T / sqrt(D)``, ``m = max(s)``, ``p = exp(s - m)``, ``l = sum(p)``,
  ``o_c = (p v) / l``; the row log-sum-exp ``m + log(l)`` is kept for the backward;
* backward, per chunk, probabilities recomputed from the log-sum-exp: ``p = exp(s - lse)``, ``dv += p^T do_c``,
  ``dp = do_c v^T``, ``ds = p * (dp - rowsum(do_c * o_c))``, ``dq_c = ds k / sqrt(D)``, ``dk += ds^T q_c / sqrt(D)``.

``C`` keeps one (B, nh, C, S) float64 block under :data:`CHUNK_BYTES`. Every operation is float64; the result
differs from the dense float64 reference by float64 rounding only (~1e-16 relative), far below any bound it judges.
"""

from __future__ import annotations

import torch

from h3gate.ops import reference

CHUNK_BYTES = 2 << 30


def _chunk_rows(b: int, nh: int, s: int) -> int:
    return max(1, CHUNK_BYTES // (b * nh * s * 8))


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (B, nh, S, D)
        b, nh, s, d = qh.shape
        scale = d**-0.5
        out = torch.empty_like(qh)
        lse = torch.empty((b, nh, s), dtype=qh.dtype, device=qh.device)
        step = _chunk_rows(b, nh, s)
        kt = kh.transpose(-1, -2)
        for c0 in range(0, s, step):
            c1 = min(s, c0 + step)
            sc = (qh[:, :, c0:c1] @ kt) * scale
            m = sc.amax(-1, keepdim=True)
            p = torch.exp(sc - m)
            den = p.sum(-1, keepdim=True)
            out[:, :, c0:c1] = (p @ vh) / den
            lse[:, :, c0:c1] = (m + torch.log(den)).squeeze(-1)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        return out.permute(0, 2, 1, 3).flatten(2, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qh, kh, vh, out, lse = ctx.saved_tensors
        b, nh, s, d = qh.shape
        scale = d**-0.5
        g = grad.reshape(b, s, nh, d).permute(0, 2, 1, 3)
        rowdot = (g * out).sum(-1)  # (B, nh, S)
        dq = torch.empty_like(qh)
        dk = torch.zeros_like(kh)
        dv = torch.zeros_like(vh)
        kt, vt = kh.transpose(-1, -2), vh.transpose(-1, -2)
        step = _chunk_rows(b, nh, s)
        for c0 in range(0, s, step):
            c1 = min(s, c0 + step)
            q_c, g_c = qh[:, :, c0:c1], g[:, :, c0:c1]
            p = torch.exp((q_c @ kt) * scale - lse[:, :, c0:c1, None])
            dv += p.transpose(-1, -2) @ g_c
            ds = p * ((g_c @ vt) - rowdot[:, :, c0:c1, None])
            dq[:, :, c0:c1] = (ds @ kh) * scale
            dk += (ds.transpose(-1, -2) @ q_c) * scale
        return tuple(t.permute(0, 2, 1, 3) for t in (dq, dk, dv))


def attention_fp64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, S, nh, D) float64 x3 -> (B, S, nh*D): chunked float64 attention with a chunked backward (``order``, the
    strict kernel's walk order, ignored: the golden's maths does not depend on it)."""
    return _ChunkedAttention.apply(q, k, v)


# Above this many bytes for one float64 (B, nh, S, S) score matrix the golden attention runs chunked.
DENSE_ATTENTION_GOLDEN_BYTES = 16 << 30


def attention_golden(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor | None = None
) -> torch.Tensor:
    """The golden table's attention: the dense reference while its float64 score matrix fits
    :data:`DENSE_ATTENTION_GOLDEN_BYTES`, else :func:`attention_fp64` (same maths, query chunks); ``order``
    ignored."""

    b, s, nh, _ = q.shape
    if q.dtype != torch.float64 or b * nh * s * s * 8 <= DENSE_ATTENTION_GOLDEN_BYTES:
        return reference.attention(q, k, v)
    return attention_fp64(q, k, v)


def sinusoid_fp64(timestep: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """:func:`h3gate.ops.reference.timestep_sinusoid` (cos first) at the timestep's own dtype: the reference casts to
    float32 as diffusers does, which would make the golden's sinusoid the provider's FP32 value."""
    import math

    half = dim // 2
    dtype = timestep.dtype if timestep.is_floating_point() else torch.float64
    exponent = -math.log(10000) * torch.arange(0, half, dtype=dtype, device=timestep.device) / half
    emb = timestep[:, None].to(dtype) * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1)
    return torch.nn.functional.pad(emb, (0, 1, 0, 0)) if dim % 2 == 1 else emb
