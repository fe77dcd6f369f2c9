"""Tilings and declared math forms of the strict attention (:mod:`h3gate.kernels.attention`), by (head_dim, dtype).

An :class:`AttnConfig` fixes the forward's KV walk (``fwd_n`` keys a step, ascending) and its exp2 / fma forms, and the
backward's walks (``kv_n`` x ``kv_m`` for dK/dV, ``q_m`` x ``q_n`` for dQ) and their exp2 / fma forms: functions of
(D, dtype) only, never of S or B. ``S_BUCKETS`` may override its ``LAUNCH_FIELDS`` by sequence length (which program
owns a row, warps, pipeline depth, load path); those change no row's sums (the contract of
``manifests/operators/attention.yaml``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError

OP = "h3_full_attention"
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (128,)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """Tilings of the three attention kernels (a function of head_dim and dtype only)."""

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    kv_n: int = 128  # dK/dV kernel: KV rows per program
    kv_m: int = 64  # dK/dV kernel: query rows per step of its ascending loop
    kv_warps: int = 8
    kv_stages: int = 2
    q_m: int = 128  # dQ kernel: query rows per program
    q_n: int = 64  # dQ kernel: KV rows per step of its ascending loop
    q_warps: int = 8
    q_stages: int = 2
    fwd_exp2: str = "libdevice"  # forward exp2: "libdevice" (__nv_exp2f), "ex2" or "ex2ftz" (explicit PTX)
    fwd_fma: bool = False  # forward exponent as one explicit fma(q k^T, c, -m') instead of (q k^T * c) - m'
    bwd_exp2: str = "libdevice"  # backward recomputation's exp2 (dK/dV and dQ kernels), same codes as fwd_exp2
    bwd_fma: bool = False  # backward exponent as one explicit fma(q k^T, c, -lse2) instead of (q k^T * c) - lse2

    @property
    def tag(self) -> str:
        math_ = ("" if self.fwd_exp2 == "libdevice" else f"_{self.fwd_exp2}") + ("_fma" if self.fwd_fma else "")
        bmath = ("" if self.bwd_exp2 == "libdevice" else f"_{self.bwd_exp2}") + ("_fma" if self.bwd_fma else "")
        return (
            f"fwd{self.fwd_m}x{self.fwd_n}w{self.fwd_warps}s{self.fwd_stages}{math_}_"
            f"kv{self.kv_n}x{self.kv_m}w{self.kv_warps}s{self.kv_stages}_"
            f"q{self.q_m}x{self.q_n}w{self.q_warps}s{self.q_stages}{bmath}"
        )

    @property
    def exp2_code(self) -> int:
        """The forward kernel's ``EXP2`` constexpr: 0 libdevice, 1 ``ex2.approx.f32``, 2 ``ex2.approx.ftz.f32``."""
        return _exp2_code("fwd_exp2", self.fwd_exp2)

    @property
    def bwd_exp2_code(self) -> int:
        """The backward kernels' ``EXP2`` constexpr (same codes as :attr:`exp2_code`)."""
        return _exp2_code("bwd_exp2", self.bwd_exp2)


def _exp2_code(field: str, value: str) -> int:
    codes = {"libdevice": 0, "ex2": 1, "ex2ftz": 2}
    if value not in codes:
        raise InputError(f"{OP}: config {field}: {value!r} not one of {sorted(codes)}")
    return codes[value]


# (head_dim, dtype) -> tiling, measured on the H200 (tools/gpu_gemm_attention.py measures candidates). bfloat16 D = 128:
# the declared ex2.approx.ftz + explicit FMA forms in the forward and in the backward's p recompute; a KV walk of 128
# keys a step (kernel id v2: in the Gluon forward 17 / 20 % faster than 64 keys at S = 3160 / 38974, a contract change
# with its own evidence); 64-row forward blocks (the TMA kernel's) and 4 backward stages from S = 2048 on (S_BUCKETS).
ATTN_TABLE: dict[tuple[int, str], AttnConfig] = {
    (128, "bfloat16"): AttnConfig(
        fwd_m=64,
        fwd_n=128,
        fwd_warps=8,
        fwd_stages=3,
        kv_n=128,
        kv_m=64,
        kv_warps=8,
        kv_stages=4,
        q_m=128,
        q_n=64,
        q_warps=8,
        q_stages=4,
        fwd_exp2="ex2ftz",
        fwd_fma=True,
        bwd_exp2="ex2ftz",
        bwd_fma=True,
    ),
    (128, "float32"): AttnConfig(64, 32, 4, 2, 64, 32, 4, 1, 64, 32, 4, 1),
}


# Launch fields by sequence length, per (head_dim, dtype): ((bound, {field: value}), ...) in ascending bound order;
# S < bound takes the first matching entry's overrides of the ATTN_TABLE tiling, S >= the last bound the table entry.
# Only LAUNCH_FIELDS may be overridden: which program owns a row (query / KV block heights), warps and pipeline depth -
# never the forward's KV walk (fwd_n) or the exp2 / fma forms, so no row's sums change (every override was measured
# bitwise equal on the H200). Which kernel runs is the operator's declared path (manifests/operators/attention.yaml).
# bfloat16 D = 128, below S = 2048 (where the pointer kernels run on CUDA): 128-row forward blocks on 8 warps (0.032 /
# 0.105 ms at S = 264 / 925 against 0.037 / 0.150 for 64-row blocks; 8 warps spill 584 bytes against 7.6 KB on 4) and
# 3 backward stages. Blocks are at least 64 rows: below 64 Triton issues mma.sync, not wgmma, and the bytes differ.
LAUNCH_FIELDS = frozenset(
    {"fwd_m", "fwd_warps", "fwd_stages", "kv_n", "kv_m", "kv_warps", "kv_stages", "q_m", "q_n", "q_warps", "q_stages"}
)
S_BUCKETS: dict[tuple[int, str], tuple[tuple[int, dict], ...]] = {
    (128, "bfloat16"): ((2048, {"fwd_m": 128, "kv_stages": 3, "q_stages": 3}),),
}


def _check_s_buckets(table: dict = S_BUCKETS) -> None:
    """Every override names a known tiling, bounds ascend, and block heights are powers of two of >= 64 rows
    (bfloat16: below 64 Triton issues mma.sync, other bytes); only launch fields are overridden."""
    for key, buckets in table.items():
        bounds = [b[0] for b in buckets]
        heights = [o.get(f, 64) for _, o in buckets for f in ("fwd_m", "kv_n", "kv_m", "q_m", "q_n")]
        fields = set().union(*(o for _, o in buckets))
        low = key[1] == "bfloat16" and min(heights, default=64) < 64  # below 64 rows: mma.sync, other bytes
        if key not in ATTN_TABLE or bounds != sorted(set(bounds)) or any(h & (h - 1) for h in heights) or low:
            raise AssertionError(
                f"attention.S_BUCKETS{key}: known tiling, ascending bounds, power-of-two blocks of >= 64 rows"
            )
        if not fields <= LAUNCH_FIELDS:
            raise AssertionError(f"attention.S_BUCKETS{key}: {sorted(fields - LAUNCH_FIELDS)} are not launch fields")


_check_s_buckets()


def qk_scale(head_dim: int) -> float:
    """``log2(e) / sqrt(D)``: scores are kept in the log2 domain (one FP32 constant shared by every kernel)."""
    return LOG2E / math.sqrt(head_dim)


def attn_config(head_dim: int, dtype: torch.dtype, seq_len: int | None = None) -> AttnConfig:
    """The (D, dtype) tiling; with ``seq_len`` its launch overrides from ``S_BUCKETS``."""
    key = (head_dim, dtype_name(dtype))
    cfg = ATTN_TABLE[key]
    if seq_len is not None:
        for bound, overrides in S_BUCKETS.get(key, ()):
            if seq_len < bound:
                return replace(cfg, **overrides)
    return cfg


@dataclass(frozen=True)
class AttnLaunch:
    """How the host launches the Gluon attention kernels: program count, register split, ring depth, where a walk's
    tiles are loaded from, how the output leaves, which stream. None of these changes a kernel's arithmetic: every
    choice gave the same bytes on the H200, and each production value below was the faster one there. ``PRODUCTION``
    is the only instance product code passes; the H200 probes build variants with ``dataclasses.replace``."""

    # Forward: one persistent program an SM walking tiles pid, pid + programs, ... (False: one program a tile). Was
    # 6.5 / 3.6 / 1.6 % faster than one program a tile at S = 3160 / 38974 / 925.
    persistent: bool = True
    # Forward: registers a thread of the worker consumer and the producer (setmaxnreg); the default consumer gets
    # what the launch's limit leaves (12 warps x 168 = the 64K registers of an SM). 240 / 24 was 3.3 / 2.8 % faster
    # than 232 / 40 at S = 3160 / 38974, no spills either way.
    regs: tuple[int, int] = (240, 24)
    # Forward: K/V ring depth (2, 3 and 4 measured equal).
    stages: int = 2
    # With a walk order: tiles that are consecutive packed rows are loaded in place and only the others from a copy
    # (:mod:`h3gate.kernels.attention_sources`; False: whole canonical copies first, which cost about 14 % of the
    # forward at S = 3160).
    tile_sources: bool = True
    # Forward: from this S on each consumer's output rows leave through shared memory by TMA while the next tile is
    # walked (a tile read through a copy still stores row by row through the order); below it from registers. By TMA
    # 0.508 vs 0.532 ms at S = 3160 and 70.98 vs 71.33 ms at 38974, but 0.0952 vs 0.0928 ms at 925.
    tma_store_from: int = 2048
    # Backward: the dQ walk on a second stream beside the dK/dV walk, filling the SMs the other's last wave leaves
    # idle (0.9 % faster at S = 3160, equal at 38974).
    side_stream: bool = True


PRODUCTION = AttnLaunch()
