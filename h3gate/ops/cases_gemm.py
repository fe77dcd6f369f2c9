"""Case builders for the GEMM rows and full attention (protocol: :mod:`h3gate.ops.cases`).

Each builder makes one operator's inputs at ``rows`` packed rows with ``cfg``'s real widths and the provider's
dtypes, seeded on the CPU. Weights are scaled by ``1/sqrt(in_features)`` so outputs stay O(1). Layers whose rows are
distinct timesteps (the AdaLN projections, the timestep MLP) take ``T = min(rows, 3)`` rows: a rollout step sees at
most three distinct timesteps there, never the packed sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h3gate.dtypes import dtype_name
from h3gate.manifests.model_config import ModelConfig
from h3gate.ops.case import CaseBuilder, OpCase, randn
from h3gate.ops.golden import DENSE_ATTENTION_GOLDEN_BYTES, attention_fp64

BF16, FP32 = torch.bfloat16, torch.float32
MAX_TIMESTEPS = 3
# Above this many bytes of float64 scores the attention golden is the chunked float64 implementation (768p: 680 GB
# dense); tiny ... medium keep the dense float64 reference.
PREFIX_ROWS = 7  # rows run alone by the prefix probe: the first M bucket, so layouts of >= 512 rows cross a bucket


def _linear_case(
    op: str, rows: int, k: int, n: int, dtype: torch.dtype, bias: bool, packed: bool, device, seed: int
) -> OpCase:
    """x (1, rows, K) when ``packed`` (batch dim 0, row dim 1), else (rows, K) (row dim 0); weight (N, K)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, rows, k) if packed else (rows, k)
    x = randn(shape, dtype, device, gen)
    w = randn((n, k), dtype, device, gen, scale=k**-0.5)
    args: tuple = (x, w, randn((n,), dtype, device, gen, scale=0.1)) if bias else (x, w)
    size = torch.finfo(dtype).bits // 8
    row_dim = 1 if packed else 0
    return OpCase(
        op=op,
        args=args,
        grad_args=tuple(range(len(args))),
        batch_dims={0: 0} if packed else {},
        out_batch_dim=0 if packed else None,
        row_dims={0: row_dim},
        out_row_dim=row_dim,
        prefix_rows=min(rows, PREFIX_ROWS),
        bytes_moved=size * (rows * k + n * k + rows * n + (n if bias else 0)),
        flops=2 * rows * n * k,
        shape=f"M={rows} K={k} N={n} {dtype_name(dtype)}{' +bias' if bias else ''}",
    )


def _gemm(op: str, widths: Callable[[ModelConfig], tuple[int, int]], dtype, bias: bool, timestep_rows: bool = False):
    def build(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
        k, n = widths(cfg)
        m = min(rows, MAX_TIMESTEPS) if timestep_rows else rows
        return _linear_case(op, m, k, n, dtype, bias, not timestep_rows, device, seed)

    return build


# The LoRA case: PEFT's LoRA on the attention's Q projection (to_q, H -> nh*D: the usual LoRA target), rank 16,
# lora_alpha 24 (scaling 1.5: the multiply really rounds), float32 adapter weights on the bfloat16 activations
# (PEFT's default, autocast_adapter_dtype=True). lora_B is non-zero, as after training (PEFT initialises it to zero,
# which would zero every gradient of lora_A).
LORA_RANK = 16
LORA_ALPHA = 24.0


def lora_update_case(rows: int, cfg: ModelConfig, device, seed: int, adapter_dtype: torch.dtype = FP32) -> OpCase:
    """x (1, rows, H) bfloat16, lora_a (r, H) and lora_b (nh*D, r) at ``adapter_dtype``, scaling lora_alpha / r."""
    gen = torch.Generator().manual_seed(seed)
    k, n, r = cfg.hidden_size, cfg.inner_dim, LORA_RANK
    x = randn((1, rows, k), BF16, device, gen)
    lora_a = randn((r, k), adapter_dtype, device, gen, scale=k**-0.5)
    lora_b = randn((n, r), adapter_dtype, device, gen, scale=r**-0.5)
    size = torch.finfo(adapter_dtype).bits // 8
    return OpCase(
        op="h3_lora_update",
        args=(x, lora_a, lora_b, LORA_ALPHA / r),
        grad_args=(0, 1, 2),
        batch_dims={0: 0},
        out_batch_dim=0,
        row_dims={0: 1},
        out_row_dim=1,
        prefix_rows=min(rows, PREFIX_ROWS),
        bytes_moved=2 * rows * k + size * (r * k + n * r + 2 * rows * r + rows * n),
        flops=2 * rows * r * (k + n) + rows * n,
        shape=f"M={rows} K={k} r={r} N={n} x bfloat16, adapter {dtype_name(adapter_dtype)}, scaling {LORA_ALPHA / r}",
    )


def _attention(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = torch.Generator().manual_seed(seed)
    h, d = cfg.num_attention_heads, cfg.attention_head_dim
    q, k, v = (randn((1, rows, h, d), BF16, device, gen) for _ in range(3))
    dense = h * rows * rows * 8 <= DENSE_ATTENTION_GOLDEN_BYTES  # one float64 (nh, S, S) score matrix
    orders = {  # the walk order's cost: identity (no copies) and a seeded permutation (row gathers and scatters)
        "order_identity": {"order": torch.arange(rows).to(device)},
        "order_permuted": {"order": torch.randperm(rows, generator=gen).to(device)},
    }
    return OpCase(
        golden_fn=None if dense else attention_fp64,
        op="h3_full_attention",
        args=(q, k, v),
        grad_args=(0, 1, 2),
        batch_dims={0: 0, 1: 0, 2: 0},
        out_batch_dim=0,
        bytes_moved=2 * 4 * rows * h * d,
        flops=4 * rows * rows * h * d,
        bench_variants=orders,
        shape=f"S={rows} heads={h} D={d} bfloat16",
    )


CASES: dict[str, CaseBuilder] = {
    "h3_qkv_gemm": _gemm("h3_qkv_gemm", lambda c: (c.hidden_size, c.inner_dim), BF16, False),
    "h3_attention_o_gemm": _gemm("h3_attention_o_gemm", lambda c: (c.inner_dim, c.hidden_size), BF16, False),
    "h3_ffn_gate_up_gemm": _gemm("h3_ffn_gate_up_gemm", lambda c: (c.hidden_size, 2 * c.ffn_dim), BF16, False),
    "h3_ffn_down_gemm": _gemm("h3_ffn_down_gemm", lambda c: (c.ffn_dim, c.hidden_size), BF16, False),
    # WS2 segmented-8 merge order (kernels/gemm_merge.py) on the row-parallel block shapes, same inputs.
    "h3_attention_o_gemm_seg8": _gemm("h3_attention_o_gemm_seg8", lambda c: (c.inner_dim, c.hidden_size), BF16, False),
    "h3_ffn_down_gemm_seg8": _gemm("h3_ffn_down_gemm_seg8", lambda c: (c.ffn_dim, c.hidden_size), BF16, False),
    "h3_qkv_gemm_seg8": _gemm("h3_qkv_gemm_seg8", lambda c: (c.hidden_size, c.inner_dim), BF16, False),
    "h3_ffn_gate_up_gemm_seg8": _gemm(
        "h3_ffn_gate_up_gemm_seg8", lambda c: (c.hidden_size, 2 * c.ffn_dim), BF16, False
    ),
    "adaln_projection_3mod": _gemm(
        "adaln_projection_3mod", lambda c: (c.time_embed_dim, c.adaln_width), BF16, True, timestep_rows=True
    ),
    "final_adaln_projection": _gemm(
        "final_adaln_projection", lambda c: (c.time_embed_dim, 2 * c.hidden_size), BF16, True, timestep_rows=True
    ),
    "text_context_projection": _gemm("text_context_projection", lambda c: (c.text_dim, c.hidden_size), BF16, True),
    "video_input_projection_fp32": _gemm(
        "video_input_projection_fp32", lambda c: (c.video_patch_dim, c.hidden_size), FP32, True
    ),
    "audio_input_projection_fp32": _gemm(
        "audio_input_projection_fp32", lambda c: (c.audio_in_channels, c.hidden_size), FP32, True
    ),
    "timestep_mlp_fp32": _gemm(
        "timestep_mlp_fp32", lambda c: (c.freq_dim, c.time_embed_hidden_dim), FP32, True, timestep_rows=True
    ),
    "video_output_projection_fp32": _gemm(
        "video_output_projection_fp32", lambda c: (c.hidden_size, c.video_patch_dim), FP32, True
    ),
    "audio_output_projection_fp32": _gemm(
        "audio_output_projection_fp32", lambda c: (c.hidden_size, c.audio_in_channels), FP32, True
    ),
    "h3_full_attention": _attention,
    "h3_lora_update": lora_update_case,
}
