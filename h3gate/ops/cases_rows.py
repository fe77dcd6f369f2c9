"""Case builders for the non-GEMM WS1 rows (protocol: :mod:`h3gate.ops.cases`).

Each builder makes one operator's inputs at ``rows`` packed rows with ``cfg``'s widths and the provider's dtypes
(block stack bfloat16; timestep path, heads and latents float32), seeded on the CPU. AdaLN tables are the strided
chunks ``reference.adaln_table`` returns (T = 2 distinct timesteps, 3 modalities); index tensors are seeded random
rows (a partition of the packed rows for the index copy, a sorted subset for the row selection).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from h3gate.manifests.model_config import MODALITY_NUM, ModelConfig
from h3gate.ops import reference
from h3gate.ops.case import CaseBuilder, OpCase, randint, randn

BF16, FP32 = torch.bfloat16, torch.float32
TIMESTEPS = 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _size(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _fresh_rows(t: torch.Tensor, rows: torch.Tensor, dim: int, gen: torch.Generator) -> torch.Tensor:
    """``t`` with the listed rows (along ``dim``) replaced by fresh random values."""
    out = t.detach().clone()
    if rows.numel():
        fresh = randn(out.index_select(dim, rows.to(out.device)).shape, out.dtype, out.device, gen)
        out.index_copy_(dim, rows.to(out.device), fresh)
    return out


def _others(size: int, used: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool)
    mask[used.cpu()] = False
    return torch.nonzero(mask).flatten()


def _timestep(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    t = min(rows, 3)
    ts = torch.rand(t, generator=_gen(seed)).to(device)
    return OpCase(
        "timestep_sinusoid_h3", (ts,), {"dim": cfg.freq_dim}, grad_args=(0,), row_dims={0: 0}, out_row_dim=0,
        bytes_moved=4 * (t + t * cfg.freq_dim), flops=6 * t * cfg.freq_dim, shape=f"T={t} dim={cfg.freq_dim}",
    )  # fmt: skip


def _silu(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    t = min(rows, 3)
    x = randn((t, cfg.time_embed_hidden_dim), FP32, device, _gen(seed))
    n = x.numel()
    return OpCase(
        "timestep_mlp_silu", (x,), grad_args=(0,), row_dims={0: 0}, out_row_dim=0, bytes_moved=8 * n, flops=4 * n,
        shape=f"T={t} width={cfg.time_embed_hidden_dim} float32",
    )  # fmt: skip


def _silu_cast(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    t = min(rows, 3)
    x = randn((t, cfg.time_embed_dim), FP32, device, _gen(seed))
    n = x.numel()
    return OpCase(
        "adaln_silu_cast", (x,), {"dtype": BF16}, grad_args=(0,), row_dims={0: 0}, out_row_dim=0,
        golden_kwargs={"dtype": torch.float64}, bytes_moved=6 * n, flops=4 * n,
        shape=f"T={t} width={cfg.time_embed_dim} float32 -> bfloat16",
    )  # fmt: skip


def _tables(cfg: ModelConfig, device, gen: torch.Generator, scale: float = 0.1) -> tuple[torch.Tensor, ...]:
    """The six (3T, H) AdaLN views of one BF16 projection output (strided chunks, as the provider gathers them)."""
    proj = randn((TIMESTEPS, 6 * MODALITY_NUM * cfg.hidden_size), BF16, device, gen, scale=scale)
    return reference.adaln_table(proj, cfg.hidden_size)


def _adaln_idx(rows: int, device, gen: torch.Generator) -> torch.Tensor:
    return randint(TIMESTEPS * MODALITY_NUM, (rows,), device, gen)


def _gather_mutator(table_pos: int, idx_pos: int):
    """Unrelated rows of a gathered table: every table row no kept output row reads."""

    def mutate(args: tuple, keep: Sequence[int], gen: torch.Generator) -> tuple:
        out = list(args)
        used = args[idx_pos][torch.as_tensor(list(keep), device=args[idx_pos].device)]
        table = args[table_pos]
        fresh = _fresh_rows(table, _others(table.shape[0], used), 0, gen)
        out[table_pos] = fresh
        return tuple(out)

    return mutate


def _row_gather(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    table = _tables(cfg, device, gen)[1]
    idx = _adaln_idx(rows, device, gen)
    h = cfg.hidden_size
    return OpCase(
        "adaln_row_gather", (table, idx), grad_args=(0,), out_row_dim=0, mutate=_gather_mutator(0, 1),
        bytes_moved=2 * rows * h + 8 * rows, shape=f"S={rows} H={h} table={table.shape[0]} bfloat16 (strided)",
    )  # fmt: skip


def _norm_weight(h: int, device, gen: torch.Generator) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(BF16).to(device)


def _rmsnorm(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    h = cfg.hidden_size
    x = randn((1, rows, h), BF16, device, gen)
    return OpCase(
        "h3_rmsnorm", (x, _norm_weight(h, device, gen), cfg.norm_eps), grad_args=(0, 1), batch_dims={0: 0},
        out_batch_dim=0, row_dims={0: 1}, out_row_dim=1, bytes_moved=4 * rows * h + 2 * h, flops=4 * rows * h,
        shape=f"S={rows} H={h} bfloat16",
    )  # fmt: skip


def _modulate(rows: int, cfg: ModelConfig, device, seed: int, op: str = "h3_rmsnorm_modulate") -> OpCase:
    gen = _gen(seed)
    h = cfg.hidden_size
    x = randn((1, rows, h), BF16, device, gen)
    w = _norm_weight(h, device, gen)
    shift, scale = _tables(cfg, device, gen)[:2]
    idx = _adaln_idx(rows, device, gen)
    return OpCase(
        op, (x, w, shift, scale, idx, cfg.norm_eps), grad_args=(0, 1, 2, 3), batch_dims={0: 0},
        out_batch_dim=0, row_dims={0: 1}, out_row_dim=1, bytes_moved=4 * rows * h + 8 * rows + 2 * h,
        flops=7 * rows * h, shape=f"S={rows} H={h} tables=3x{TIMESTEPS} bfloat16 (strided)",
    )  # fmt: skip


def _final(rows: int, cfg: ModelConfig, device, seed: int, op: str = "final_adaln_out") -> OpCase:
    gen = _gen(seed)
    h = cfg.hidden_size
    x = randn((1, rows, h), BF16, device, gen)
    w = _norm_weight(h, device, gen)
    shift, scale = randn((TIMESTEPS, 2 * h), BF16, device, gen, scale=0.1).chunk(2, dim=-1)
    idx = randint(TIMESTEPS, (rows,), device, gen)
    return OpCase(
        op, (x, w, shift, scale, idx, cfg.final_norm_eps), grad_args=(0, 1, 2, 3), batch_dims={0: 0},
        out_batch_dim=0, row_dims={0: 1}, out_row_dim=1, bytes_moved=4 * rows * h + 8 * rows + 2 * h,
        flops=7 * rows * h, shape=f"S={rows} H={h} tables={TIMESTEPS} bfloat16 (strided)",
    )  # fmt: skip


def _qk(rows: int, cfg: ModelConfig, device, seed: int, op: str = "h3_qk_rmsnorm_d128") -> OpCase:
    gen = _gen(seed)
    nh, d = cfg.num_attention_heads, cfg.attention_head_dim
    x = randn((1, rows, nh * d), BF16, device, gen)
    return OpCase(
        op, (x, _norm_weight(d, device, gen), nh, cfg.qk_norm_eps), grad_args=(0, 1),
        batch_dims={0: 0}, out_batch_dim=0, row_dims={0: 1}, out_row_dim=1, bytes_moved=4 * rows * nh * d + 2 * d,
        flops=4 * rows * nh * d, shape=f"S={rows} heads={nh} D={d} bfloat16",
    )  # fmt: skip


def _rope(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    nh, d = cfg.num_attention_heads, cfg.attention_head_dim
    x = randn((1, rows, nh, d), BF16, device, gen)
    pos = (torch.rand((rows, 3), generator=gen, dtype=torch.float64) * 300).to(device)
    cos, sin = reference.rope_tables(pos, cfg.rope_freq_dim, cfg.rope_theta)
    r = cos.shape[-1]
    return OpCase(
        "h3_mm_rope_3axis_partial", (x, cos, sin), grad_args=(0,), batch_dims={0: 0}, out_batch_dim=0,
        row_dims={0: 1, 1: 0, 2: 0}, out_row_dim=1, bytes_moved=4 * rows * nh * d + 8 * rows * r,
        flops=3 * rows * nh * r, shape=f"S={rows} heads={nh} D={d} R={r} bfloat16",
    )  # fmt: skip


def _gate(rows: int, cfg: ModelConfig, device, seed: int, op: str = "adaln_gate_residual") -> OpCase:
    gen = _gen(seed)
    h = cfg.hidden_size
    x = randn((1, rows, h), BF16, device, gen)
    y = randn((1, rows, h), BF16, device, gen)
    gate = _tables(cfg, device, gen)[2]
    idx = _adaln_idx(rows, device, gen)
    return OpCase(
        op, (x, y, gate, idx), grad_args=(0, 1, 2), batch_dims={0: 0, 1: 0}, out_batch_dim=0,
        row_dims={0: 1, 1: 1}, out_row_dim=1, bytes_moved=6 * rows * h + 8 * rows, flops=2 * rows * h,
        shape=f"S={rows} H={h} bfloat16 (strided gate)",
    )  # fmt: skip


def _residual_add(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    h = cfg.hidden_size
    x, y = randn((1, rows, h), BF16, device, gen), randn((1, rows, h), BF16, device, gen)
    return OpCase(
        "residual_add", (x, y), grad_args=(0, 1), batch_dims={0: 0, 1: 0}, out_batch_dim=0, row_dims={0: 1, 1: 1},
        out_row_dim=1, bytes_moved=6 * rows * h, flops=rows * h, shape=f"S={rows} H={h} bfloat16",
    )  # fmt: skip


def _swiglu(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    f = cfg.ffn_dim
    h = randn((1, rows, 2 * f), BF16, device, _gen(seed))
    return OpCase(
        "h3_swiglu", (h,), grad_args=(0,), batch_dims={0: 0}, out_batch_dim=0, row_dims={0: 1}, out_row_dim=1,
        bytes_moved=6 * rows * f, flops=6 * rows * f, shape=f"S={rows} F={f} bfloat16",
    )  # fmt: skip


def _split(rows: int) -> tuple[int, int, int]:
    """Text / video / audio row counts of a synthetic packed sequence (each >= 1 when rows >= 3)."""
    text = max(1, rows // 4) if rows >= 3 else 1
    audio = max(1, rows // 10) if rows >= 3 else (1 if rows == 2 else 0)
    return text, rows - text - audio, audio


def _copy_mutator(args: tuple, keep: Sequence[int], gen: torch.Generator) -> tuple:
    out = list(args)
    keep_t = torch.as_tensor(list(keep))
    for pos in range(3):
        idx = args[3 + pos].cpu()
        unrelated = torch.nonzero(~torch.isin(idx, keep_t)).flatten()
        out[pos] = _fresh_rows(args[pos], unrelated, 1, gen)
    return tuple(out)


def _index_copy(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    h = cfg.hidden_size
    nt, nv, na = _split(rows)
    perm = torch.randperm(rows, generator=gen)
    ti, vi, ai = (p.sort().values.to(device) for p in (perm[:nt], perm[nt : nt + nv], perm[nt + nv :]))
    text = randn((1, nt, h), BF16, device, gen)
    video = randn((1, nv, h), FP32, device, gen)
    audio = randn((1, na, h), FP32, device, gen)
    grads = tuple(i for i, n in enumerate((nt, nv, na)) if n)
    return OpCase(
        "packed_index_copy", (text, video, audio, ti, vi, ai, rows), grad_args=grads,
        batch_dims={0: 0, 1: 0, 2: 0}, out_batch_dim=0, out_row_dim=1, mutate=_copy_mutator,
        bytes_moved=2 * nt * h + 4 * (nv + na) * h + 2 * rows * h + 8 * rows,
        shape=f"S={rows} text={nt} video={nv} audio={na} H={h} (text bfloat16, video/audio float32)",
    )  # fmt: skip


def _index_select(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    c = cfg.video_patch_dim
    n = max(1, (2 * rows) // 3)
    idx = torch.randperm(rows, generator=gen)[:n].sort().values.to(device)
    x = randn((1, rows, c), FP32, device, gen)
    return OpCase(
        "packed_index_select", (x, idx), grad_args=(0,), batch_dims={0: 0}, out_batch_dim=0, out_row_dim=1,
        mutate=_select_mutator, bytes_moved=8 * n * c + 8 * n, shape=f"S={rows} N={n} C={c} float32",
    )  # fmt: skip


def _select_mutator(args: tuple, keep: Sequence[int], gen: torch.Generator) -> tuple:
    x, idx = args
    used = idx[torch.as_tensor(list(keep), device=idx.device)]
    return (_fresh_rows(x, _others(x.shape[1], used), 1, gen), idx)


def _noise_mix(rows: int, cfg: ModelConfig, device, seed: int) -> OpCase:
    gen = _gen(seed)
    c = cfg.video_patch_dim
    sample = randn((1, rows, c), FP32, device, gen)
    noise = randn((1, rows, c), FP32, device, gen)
    t = torch.rand(1, generator=gen).to(device)
    return OpCase(
        "conditioning_noise_mix", (sample, t, noise), grad_args=(0, 2), batch_dims={0: 0, 1: 0, 2: 0},
        out_batch_dim=0, row_dims={0: 1, 2: 1}, out_row_dim=1, bytes_moved=12 * rows * c, flops=4 * rows * c,
        shape=f"S={rows} C={c} float32, t per batch item",
    )  # fmt: skip


CASES: dict[str, CaseBuilder] = {
    "timestep_sinusoid_h3": _timestep,
    "timestep_mlp_silu": _silu,
    "adaln_silu_cast": _silu_cast,
    "adaln_row_gather": _row_gather,
    "h3_rmsnorm": _rmsnorm,
    "h3_rmsnorm_modulate": _modulate,
    "final_adaln_out": _final,
    "h3_qk_rmsnorm_d128": _qk,
    "h3_qk_rmsnorm_d128_seg8": lambda rows, cfg, device, seed: _qk(rows, cfg, device, seed, "h3_qk_rmsnorm_d128_seg8"),
    "h3_rmsnorm_modulate_seg8": lambda r, c, d, s: _modulate(r, c, d, s, "h3_rmsnorm_modulate_seg8"),
    "final_adaln_out_seg8": lambda r, c, d, s: _final(r, c, d, s, "final_adaln_out_seg8"),
    "adaln_gate_residual_seg8": lambda r, c, d, s: _gate(r, c, d, s, "adaln_gate_residual_seg8"),
    "h3_mm_rope_3axis_partial": _rope,
    "adaln_gate_residual": _gate,
    "residual_add": _residual_add,
    "h3_swiglu": _swiglu,
    "packed_index_copy": _index_copy,
    "packed_index_select": _index_select,
    "conditioning_noise_mix": _noise_mix,
}
