"""Tile configurations of the strict GEMM: the K tiling keyed by ``(role, N, K, dtype)`` alone, never by M. Which
kernel path runs a call is declared in the operators' manifests (:mod:`h3gate.kernels.selection`); these tables give
each path its tiling: ``TABLE`` and ``M_BUCKETS`` the Triton kernel's (swapped where the path is ``triton_swapped``),
``GLUON_BUCKETS`` and ``GLUON_GROUPED`` the Gluon kernel's.

``N`` and ``K`` are always the *forward* layer's ``out_features`` and ``in_features`` (the nn.Linear weight is
(N, K)); ``role`` says which product of that layer runs:

* ``fwd`` - ``Y (M, N) = X (M, K) @ W^T``, reduction over K;
* ``dx``  - ``dX (M, K) = dY (M, N) @ W``, reduction over N;
* ``dw``  - ``dW (N, K) = dY^T @ X``, reduction over the M rows.

Why a row's bytes do not depend on M: the reduction is walked in ascending BLOCK_K chunks by one program, and
BLOCK_K is a function of ``(role, N, K, dtype)`` alone; M is never a compile-time constant (``do_not_specialize``),
so it only decides how many tiles are launched and which rows are masked. Which program (or persistent iteration)
computes a tile is launch geometry, not arithmetic.

One more knob is M-dependent, declared here: the forward of a layer listed in ``M_BUCKETS`` takes, for a call with
fewer rows than a bucket's bound (the first such bucket, in ascending order), that bucket's tile *shape and order*
(BLOCK_M/N, GROUP_M, warps, stages, variant) instead of the large-M one; at ``M >= SMALL_M`` (the last bound) it takes
``TABLE``'s. Every bucket's entry for a layer shares that layer's BLOCK_K (checked at import), so the K chunking and
its order are the same for every M; what changes is how many output rows/columns one program owns and the MMA
instruction's M/N extent, and each output element's FP32 accumulation ``acc += a[m, k0:k0+BLOCK_K] .
b[k0:k0+BLOCK_K, n]`` over ascending k0 does not depend on those. Measured, not assumed: on the H200 every tile shape
probed (25 tilings that compiled - 3 of the 28 candidates exceed shared memory -, BLOCK_M 64..256, BLOCK_N 64..256,
pointer/TMA, persistent or not, at M = 264, 925, 3160 and 38974) gave bytes identical to the production tiling for the
block's four shapes (and the production tiling's bytes equal cuBLAS's there). ws1-ops checks it on every run with its
prefix probe: a case's first 7 rows run alone (the first bucket) must equal the same rows of the full call (another
bucket, or the large tiling, at layouts of >= 512 rows): ``evidence/h200/ws1-ops-gemm-*``.

A small-M bucket entry may swap the operands (``swap_ab``: ``Y^T = W @ X^T``, :mod:`h3gate.kernels.gemm_swapped`):
the tile is then ``block_n`` weight rows by ``block_m + tail_m`` tokens, the same BLOCK_K walk per element; every
swapped tiling probed (88 runs at M = 264 / 925 on the H200) gave bytes identical to the production tiling.

A persistent config may also name ``tail_block_n``: :func:`tail_split` then covers the last columns with narrower
tiles where the wide tiles would leave the last wave part idle (qkv at M = 3160: 700 wide tiles on 132 SMs). Like the
bucket, this picks which tile holds an element, never its K walk (bitwise on the H200, and in ws1-ops / ws1-block at
the medium layout).

Measured winners from ``tools/gpu_gemm_attention.py`` (H200) go into ``TABLE``; a shape absent from it gets the
dtype default below. The ``tma`` variant needs 16-byte aligned row strides; :func:`gemm_config` drops it
(deterministically, from N and K only) where the layer's widths do not allow it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError

ROLES: tuple[str, ...] = ("fwd", "dx", "dw")


@dataclass(frozen=True)
class GemmConfig:
    """One fixed tiling. ``block_k`` fixes the reduction chunking; the rest is scheduling."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # GROUP_M swizzle of the tile order (L2 reuse), no effect on arithmetic
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False  # grid = #SMs, each program walks tiles tile_id, tile_id + #SMs, ...
    tma: bool = False  # TMA tensor-descriptor loads/stores instead of pointer loads
    # Persistent launches only: when the BLOCK_N-wide tiles would leave the last wave partly idle, the last columns
    # are covered by tail_block_n-wide tiles (see :func:`tail_split`); 0 = never. Scheduling, like the tile shape.
    tail_block_n: int = 0
    # Forward only: run Y^T = W @ X^T (h3gate.kernels.gemm_swapped): a tile is block_n weight rows x a chunk of
    # block_m + tail_m tokens (tail_m = 0 or a power of two in [16, block_m]), so a chunk need not be a power of two.
    swap_ab: bool = False
    tail_m: int = 0
    # Forward, bfloat16, Hopper: run by the warp-specialised Gluon kernel (h3gate.kernels.gemm_gluon; same K walk and
    # bytes), always persistent, block_m 128 (two consumers of 64 rows); tail_m there (swapped tiles only) is a second
    # MMA of tail_m more B rows (8 ... block_n, a power of two), so a wide tile is block_n + tail_m tokens.
    gluon: bool = False

    def __post_init__(self) -> None:
        if self.gluon:
            self._check_gluon()
            return
        t = self.tail_block_n
        if t and (not self.persistent or not 16 <= t < self.block_n or self.block_n % t):
            raise ValueError(
                f"GemmConfig {self.tag}: tail_block_n needs a persistent launch, 16 <= tail_block_n < block_n, "
                "and must divide block_n"
            )
        u = self.tail_m
        if u and (not self.swap_ab or not 16 <= u <= self.block_m or u & (u - 1)):
            raise ValueError(f"GemmConfig {self.tag}: tail_m needs swap_ab and a power of two in [16, block_m]")
        if self.swap_ab and (self.persistent or t or self.group_m != 1):
            raise ValueError(f"GemmConfig {self.tag}: swap_ab launches one program per tile (group_m 1, no tails)")

    def _check_gluon(self) -> None:
        u, n, t = self.tail_m, self.block_n, self.tail_block_n
        pow2 = all(v & (v - 1) == 0 for v in (n, u, t))
        if (
            self.block_m != 128
            or (self.num_warps, self.persistent, self.tma) != (4, True, True)
            or not pow2
            or not 8 <= n <= 256
            or (u and (not self.swap_ab or not 8 <= u <= n))
            or (t and (self.swap_ab or not 16 <= t < n))
        ):
            raise ValueError(
                f"GemmConfig {self.tag}: a Gluon tiling is persistent TMA on 4 warps a partition, block_m 128 (two "
                "consumers of 64 rows), block_n a power of two in [8, 256], tail_m 0 or (swapped only) a power of two "
                "in [8, block_n], and tail_block_n only unswapped (16 <= it < block_n)"
            )

    @property
    def tag(self) -> str:
        variant = ("tma" if self.tma else "ptr") + ("_pers" if self.persistent else "")
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}_g{self.group_m}_w{self.num_warps}_s{self.num_stages}_"
            f"{variant}{f'_t{self.tail_block_n}' if self.tail_block_n else ''}"
            f"{('_swap' + (str(self.tail_m) if self.tail_m else '')) if self.swap_ab else ''}"
            f"{('_tail' + str(self.tail_m)) if self.tail_m and not self.swap_ab else ''}"
            f"{'_gluon' if self.gluon else ''}"
        )


@dataclass(frozen=True)
class GemmLaunch:
    """Launch choices of the GEMM family outside its tilings: none changes an element's K walk or bytes.
    ``PRODUCTION`` is the only instance product code passes; GPU checks build variants with ``dataclasses.replace``."""

    # The segmented-8 kernel (h3gate.kernels.gemm_merge) loads its tiles by TMA where both operands' bases and row
    # strides are 16-byte aligned (False: the pointer walk always; the same chunks, values and MMA).
    seg8_tma: bool = True
    # The segmented-8 one-device forward runs the warp-specialised Gluon kernel (h3gate.kernels.gemm_gluon_seg8) on
    # Hopper in bfloat16 where its tiling applies (False: the Triton seg8 kernel; the same chunks, MMA, tree and bytes,
    # measured equal on an H100: docs/measurements/h100/seg8-gluon-check.json).
    seg8_gluon: bool = True
    # The fused row-segment dW (h3gate.kernels.rows_dw) loads its tiles by TMA for one batch item with 16-byte aligned
    # operands (False: the pointer walk; the same chunks, values and MMA). Off until measured on the H200
    # (tools/gpu_seg8_dw_check.py compares both walks' bytes and times).
    rows_dw_tma: bool = False
    # The one-device row-segment dW (all 4 segments, rounded once) runs the warp-specialised Gluon kernel
    # (h3gate.kernels.gemm_gluon_rows_dw) on Hopper in bfloat16 for one batch item where its tiling applies (False:
    # rows_dw; the same chunks, MMA, tree and bytes, measured equal on an H100 at the block's four weights and
    # M = 3160, 38974, and 1.4-2.0x faster: docs/measurements/h100/seg8-gluon-dw4-check.json).
    rows_dw_gluon: bool = True
    # The one-device seg8 dX (dY W, the column-parallel layers' backward) runs the Gluon seg8 kernel with W's boxes of
    # reduction rows (h3gate.kernels.gemm_gluon_seg8, ``dx``) on Hopper in bfloat16 where its tiling applies (False: the
    # Triton seg8 kernel; the same chunks, MMA, tree and bytes, measured equal on an H100 at the block's dX shapes and
    # 1.3-1.7x faster at M >= 3160: docs/measurements/h100/seg8-gluon-dw-check.json).
    seg8_gluon_dx: bool = True


# Measurement only: ``H3GATE_GEMM_LAUNCH="rows_dw_gluon,rows_dw_tma=0"`` sets GemmLaunch knobs of this process's
# PRODUCTION (name: on, name=0 / name=1), so that a bench can time a knob before its default changes. No knob changes
# bytes; the bench record lists the knobs set (:func:`launch_overrides`) and launch records name the paths that ran.
LAUNCH_ENV = "H3GATE_GEMM_LAUNCH"


def parse_launch(spec: str) -> dict[str, bool]:
    """``name[=0|1],...`` -> {GemmLaunch field: value}; an unknown field or value is an InputError."""
    known, out = {f.name for f in fields(GemmLaunch)}, {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in known or value not in ("", "0", "1"):
            raise InputError(f"{LAUNCH_ENV}: {item!r}, expected name[=0|1] with name one of {sorted(known)}")
        out[name] = value != "0"
    return out


PRODUCTION = replace(GemmLaunch(), **parse_launch(os.environ.get(LAUNCH_ENV, "")))


def launch_overrides() -> dict[str, bool]:
    """The knobs where this process's PRODUCTION differs from the defaults (set by ``H3GATE_GEMM_LAUNCH``)."""
    default = GemmLaunch()
    return {f.name: getattr(PRODUCTION, f.name) for f in fields(GemmLaunch)
            if getattr(PRODUCTION, f.name) != getattr(default, f.name)}  # fmt: skip


_BF16 = "bfloat16"
_FP32 = "float32"

# Plain-kernel baseline measured in /work/shared/anchors/triton-probes-h200.json (row invariant, 0.69-0.77x cuBLAS).
BF16_LARGE = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
# GEMV-style tiling for layers whose rows are distinct timesteps (M = 1..3): one 16-row tile covers every row, so
# each weight byte is read once; many narrow N tiles keep every SM streaming.
BF16_SKINNY = GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
# True FP32 (input_precision="ieee"): FMA dot, no tensor cores, smaller tiles.
FP32_LARGE = GemmConfig(64, 128, 32, group_m=8, num_warps=8, num_stages=3)
FP32_SKINNY = GemmConfig(16, 64, 64, group_m=1, num_warps=4, num_stages=3)

# (role, N, K, dtype) -> config. Layers whose M is a handful of timesteps take the skinny tiling in every role whose
# output rows are those timesteps (fwd, dx); their dW (output N x K, reduction over the few rows) takes the default.
TABLE: dict[tuple[str, int, int, str], GemmConfig] = {
    # Winners measured by tools/gpu_gemm_attention.py on the H200 (docs/measurements/gemm_attention-tuning-{1,2}.*):
    # one config per (role, N, K, dtype), chosen to maximise the worst ratio to cuBLAS over M in {264, 925, 3160,
    # 38974}; every candidate was checked row-invariant (M = 1, 7, prefix of each M) and repeat-bitwise there.
    # Where the two runs disagree, the config with the better worst-case ratio across both runs is kept (run 1 for
    # o_proj, ffn_gate_up, ffn_down; run 2 for the skinny AdaLN/final projections). The block shapes' dX/dW rows are
    # the winners of the backward-only run (docs/measurements/gemm_attention-tuning-3-backward.*).
    # The block's four forward shapes at M >= SMALL_M (below it: M_BUCKETS): re-picked from a later tiling sweep at
    # M = 3160 / 38974 (same-run ratios to cuBLAS; GROUP_M by the better of 2 runs).
    # qkv adds 128-wide tail tiles where the 256-wide ones leave the last wave part idle (M = 3160: 5.3 waves).
    ("fwd", 7168, 5376, _BF16): GemmConfig(128, 256, 64, 16, 8, 3, persistent=True, tma=True, tail_block_n=128),
    ("fwd", 5376, 7168, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    ("fwd", 28672, 5376, _BF16): GemmConfig(128, 256, 64, 32, 8, 3, persistent=True, tma=True),
    ("fwd", 5376, 14336, _BF16): GemmConfig(128, 256, 64, 16, 8, 3, persistent=True, tma=True),
    ("fwd", 96768, 2688, _BF16): GemmConfig(16, 64, 128, 1, 4, 4, persistent=False, tma=False),
    # final AdaLN, audio-out and video-in re-picked with the L2 flushed (cold weights, as in the model).
    ("fwd", 10752, 2688, _BF16): GemmConfig(16, 32, 128, 1, 4, 4, persistent=False, tma=False),
    ("fwd", 5376, 96, _FP32): GemmConfig(128, 64, 32, 8, 4, 2, persistent=False, tma=False),
    ("fwd", 5376, 32, _FP32): GemmConfig(128, 128, 32, 8, 8, 2, persistent=False, tma=False),
    ("fwd", 5376, 256, _FP32): GemmConfig(16, 64, 64, 1, 4, 3, persistent=False, tma=False),
    ("fwd", 2688, 5376, _FP32): GemmConfig(16, 32, 128, 1, 4, 3, persistent=False, tma=False),
    ("fwd", 96, 5376, _FP32): GemmConfig(64, 64, 32, 8, 4, 3, persistent=False, tma=False),
    ("fwd", 32, 5376, _FP32): GemmConfig(32, 32, 32, 8, 4, 3, persistent=False, tma=False),
    ("dx", 7168, 5376, _BF16): GemmConfig(128, 128, 64, 8, 8, 4, persistent=False, tma=False),
    ("dw", 7168, 5376, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    ("dx", 5376, 7168, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=False),
    ("dw", 5376, 7168, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    ("dx", 28672, 5376, _BF16): GemmConfig(128, 128, 64, 8, 8, 4, persistent=True, tma=True),
    ("dw", 28672, 5376, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    ("dx", 5376, 14336, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=False),
    ("dw", 5376, 14336, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    ("dx", 96768, 2688, _BF16): GemmConfig(16, 32, 128, 1, 4, 4, persistent=False, tma=False),
    ("dw", 96768, 2688, _BF16): GemmConfig(128, 256, 64, 8, 8, 3, persistent=False, tma=False),
    # Not in the tuning runs: skinny tilings for the rows-are-timesteps layers' dX.
    ("dx", 10752, 2688, _BF16): BF16_SKINNY,
    ("dx", 5376, 256, _FP32): FP32_SKINNY,
    ("dx", 2688, 5376, _FP32): FP32_SKINNY,
}


# Forward tile shape/order by M bucket for the block's four layers (same BLOCK_K as the layer's TABLE entry):
# (bound, table) in ascending bound order; a call with M < bound takes the first matching bucket's entry.
# * M < 512 (the tiny layout's 264 rows; few row tiles, so wave quantisation rules): winners at M = 264, unswapped
#   and swapped (``swap_ab``): qkv and gate-up take 64 weight rows x (256 + 16) tokens per program (device-only 0.86 /
#   0.81 of cuBLAS there against 0.65 / 0.75 for the unswapped tiling); o/down keep 64x256 (no swapped tiling beat it:
#   0.73 vs 0.74, 0.77 vs 0.79).
# * 512 <= M < 1024 (the small layout's 925 rows): winners at M = 925 by device-only (CUDA graph) time: swapped 128
#   weight rows x 256 tokens for qkv (0.91 vs 0.89), x (256 + 64) tokens
#   for o/down (0.90 / 0.91 against 0.80 / 0.81 for 128x128 TMA persistent); gate-up keeps 128x256 persistent (0.91;
#   its best swapped tiling read 0.87).
_BUCKET_264: dict[tuple[str, int, int, str], GemmConfig] = {
    ("fwd", 7168, 5376, _BF16): GemmConfig(256, 64, 64, 1, 4, 4, tma=True, swap_ab=True, tail_m=16),
    ("fwd", 5376, 7168, _BF16): GemmConfig(64, 256, 64, 8, 4, 4, persistent=False, tma=True),
    ("fwd", 28672, 5376, _BF16): GemmConfig(256, 64, 64, 1, 4, 4, tma=True, swap_ab=True, tail_m=16),
    ("fwd", 5376, 14336, _BF16): GemmConfig(64, 256, 64, 8, 4, 4, persistent=False, tma=True),
}
_BUCKET_925: dict[tuple[str, int, int, str], GemmConfig] = {
    ("fwd", 7168, 5376, _BF16): GemmConfig(256, 128, 64, 1, 8, 3, tma=True, swap_ab=True),
    ("fwd", 5376, 7168, _BF16): GemmConfig(256, 128, 64, 1, 8, 3, tma=True, swap_ab=True, tail_m=64),
    ("fwd", 28672, 5376, _BF16): GemmConfig(128, 256, 64, 16, 8, 3, persistent=True, tma=True),
    ("fwd", 5376, 14336, _BF16): GemmConfig(256, 128, 64, 1, 8, 3, tma=True, swap_ab=True, tail_m=64),
}
M_BUCKETS: tuple[tuple[int, dict[tuple[str, int, int, str], GemmConfig]], ...] = (
    (512, _BUCKET_264),
    (1024, _BUCKET_925),
)
SMALL_M = M_BUCKETS[-1][0]  # at M >= SMALL_M every layer takes TABLE


def _check_m_buckets(buckets: tuple = M_BUCKETS, table: dict = TABLE) -> None:
    """Bounds ascend, every bucket lists the same layers (so a call never skips a bucket for a later one), and every
    bucket entry keeps its layer's K tiling (the only part that shapes arithmetic)."""
    bounds = [bound for bound, _ in buckets]
    if bounds != sorted(set(bounds)):
        raise AssertionError(f"gemm_configs.M_BUCKETS: bounds must strictly ascend, got {bounds}")
    if len({frozenset(entries) for _, entries in buckets}) > 1:
        raise AssertionError("gemm_configs.M_BUCKETS: every bucket must list the same layers")
    for bound, entries in buckets:
        for key, small in entries.items():
            large = table.get(key)
            if large is None or large.block_k != small.block_k:
                raise AssertionError(
                    f"gemm_configs.M_BUCKETS[M < {bound}]{key}: BLOCK_K must equal TABLE's (K tiling fixed for every M)"
                )


_check_m_buckets()


# The tilings of the warp-specialised Gluon forward (h3gate.kernels.gemm_gluon; the path gluon_warp_specialised, Hopper,
# bfloat16): (bound, table) in ascending bound order as M_BUCKETS (the last bound None: every larger M). Where the path
# runs is declared in the manifest; every declared (layer, M) has its entry here and every entry is declared somewhere
# (gemm.check_paths). Every entry keeps its layer's BLOCK_K (checked at import). The winners on the H200 (device-only
# ratios to cuBLAS; every variant's bytes equal the Triton kernel's at M = 264, 925, 3160, 38974 and with a bias),
# against the Triton tilings in the same run, which is where each layer's declared path comes from:
# * M < 512: 128 weight rows x (128 + 8) tokens (qkv 0.90 vs 0.87, gate-up 0.83 vs 0.83) or x (64 + 32) tokens (o 0.90
#   vs 0.77, down 0.88 vs 0.78): 264 tokens are two or three tiles, 84-126 programs, one wave;
# * 512 <= M < 1024: 128 tokens x 256 weight rows for qkv (0.93 vs 0.90) and gate-up (0.93 vs 0.90); o / down keep the
#   Triton swapped tiling (0.90 / 0.93; the Gluon ones read 0.85 / 0.86);
# * 1024 <= M < 8192 (M = 3160): o (1.03 vs 1.00), gate-up (0.97 vs 0.96), down (1.03 vs 1.03); qkv keeps the Triton
#   tiling with its 128-wide tail (0.95 vs 0.95; the Gluon tail split read 0.94);
# * M >= 8192 (M = 38974): 128 x 256 with 128-wide narrow tiles at the end (qkv 0.99 vs 0.97, o 1.00 vs 0.99, gate-up
#   1.01 vs 0.99, down 1.00 vs 0.99).
_GLUON_WIDE = GemmConfig(128, 256, 64, 16, 4, 3, persistent=True, tma=True, gluon=True)
_GLUON_SWAP8 = GemmConfig(128, 128, 64, 1, 4, 5, persistent=True, tma=True, swap_ab=True, tail_m=8, gluon=True)
_GLUON_SWAP32 = replace(_GLUON_SWAP8, block_n=64, tail_m=32, num_stages=6)
_QKV, _O, _GATE_UP, _DOWN = (("fwd", 7168, 5376, _BF16), ("fwd", 5376, 7168, _BF16), ("fwd", 28672, 5376, _BF16),
                             ("fwd", 5376, 14336, _BF16))  # fmt: skip
GLUON_BUCKETS: tuple[tuple[int | None, dict[tuple[str, int, int, str], GemmConfig]], ...] = (
    (512, {_QKV: _GLUON_SWAP8, _GATE_UP: _GLUON_SWAP8, _O: _GLUON_SWAP32, _DOWN: _GLUON_SWAP32}),
    (1024, {_QKV: _GLUON_WIDE, _GATE_UP: _GLUON_WIDE}),
    (8192, {_O: _GLUON_WIDE, _GATE_UP: _GLUON_WIDE, _DOWN: _GLUON_WIDE}),
    (None, {key: replace(_GLUON_WIDE, tail_block_n=128) for key in (_QKV, _O, _GATE_UP, _DOWN)}),
)


# Sibling projections (q, k, v: weights of one shape on the same X) as one grouped Gluon launch
# (h3gate.kernels.gemm_gluon.matmul_ws_grouped; the path gluon_grouped, declared for qkv at 1024 <= M < 8192): 128 x 256
# tiles over the weights' concatenation, the same BLOCK_K walk as each weight's own tiling, so the same bytes (equal on
# the H200 at M = 925, 1000, 3160, 3163, 38974). It exists for the waves: q, k, v at M = 3160 are 700 tiles each, 5.3
# waves on 132 SMs, 2100 together, 15.9; measured device-only against cuBLAS called three times 1.012x (GROUP_M 16;
# one launch a weight 0.939x in the same run; cuBLAS on the weights concatenated 1.016x). Not at 925 (0.914 vs
# 0.924) nor at 38974 (0.953-0.976 vs 0.981, where each weight's launch ends in narrow tiles).
GLUON_GROUPED = _GLUON_WIDE


def _check_gluon_buckets(buckets: tuple = GLUON_BUCKETS, table: dict = TABLE) -> None:
    """Bounds ascend (the last None), every entry is a Gluon forward tiling of a layer in TABLE with its BLOCK_K, and
    the layer's rows are 16-byte aligned (TMA)."""
    bounds = [bound for bound, _ in buckets]
    if bounds[-1] is not None or bounds[:-1] != sorted(set(bounds[:-1])):
        raise AssertionError(f"gemm_configs.GLUON_BUCKETS: bounds must strictly ascend and end with None, got {bounds}")
    for bound, entries in buckets:
        for key, cfg in entries.items():
            large = table.get(key)
            _, n, k, dtype = key
            aligned = (n * 2) % 16 == 0 and (k * 2) % 16 == 0
            if key[0] != "fwd" or dtype != _BF16 or not cfg.gluon or large is None or large.block_k != cfg.block_k:
                raise AssertionError(f"gemm_configs.GLUON_BUCKETS[M < {bound}]{key}: a bf16 forward Gluon tiling with "
                                     "its layer's BLOCK_K")  # fmt: skip
            if not aligned:
                raise AssertionError(f"gemm_configs.GLUON_BUCKETS[M < {bound}]{key}: rows not 16-byte aligned (TMA)")


_check_gluon_buckets()


def gluon_config(n: int, k: int, dtype: torch.dtype, m: int) -> GemmConfig | None:
    """The Gluon tiling of the forward of the layer with weight (N, K) at ``dtype`` with ``m`` rows, or None (no
    Gluon tiling for that layer and M). Whether it runs is the layer's declared path (``manifests/operators``)."""
    key = ("fwd", n, k, dtype_name(dtype))
    table = next(t for bound, t in GLUON_BUCKETS if bound is None or m < bound)
    return table.get(key)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def default_config(role: str, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The dtype default, narrowed (from N and K only) so tiny layers do not launch mostly-empty tiles."""
    base = BF16_LARGE if dtype == torch.bfloat16 else FP32_LARGE
    out_cols = {"fwd": n, "dx": k, "dw": k}[role]
    return replace(base, block_n=min(base.block_n, _pow2_at_least(out_cols, 16, base.block_n)))


def _tma_ok(role: str, n: int, k: int, dtype: torch.dtype) -> bool:
    """TMA needs every non-last stride 16-byte aligned: rows of X/dX (K wide) and of W/dY/Y (N or K wide)."""
    size = torch.finfo(dtype).bits // 8
    return (n * size) % 16 == 0 and (k * size) % 16 == 0


def gemm_config(
    role: str,
    n: int,
    k: int,
    dtype: torch.dtype,
    m: int | None = None,
    *,
    buckets: tuple = M_BUCKETS,
    table: dict = TABLE,
) -> GemmConfig:
    """The Triton config for ``role`` of the layer with weight (N, K) at ``dtype`` with ``m`` output rows, from
    ``table`` and the small-M ``buckets`` (the shipped ones unless a test passes its own).

    BLOCK_K never depends on ``m``; ``m`` only selects a tile shape/order from ``buckets`` (forward, M < SMALL_M)."""
    if role not in ROLES:
        raise ValueError(f"gemm role {role!r}: expected one of {ROLES}")
    name = dtype_name(dtype)
    key = (role, n, k, name)
    small = None
    if m is not None:
        small = next((entries.get(key) for bound, entries in buckets if m < bound), None)
    cfg = small or table.get(key) or default_config(role, n, k, dtype)
    if cfg.tma and not _tma_ok(role, n, k, dtype):
        cfg = replace(cfg, tma=False)
    return cfg


# Tail split (persistent launches with ``tail_block_n``): TAIL_COST is a narrow tile's cost per output element
# relative to a wide one's, and a split must shorten the modelled makespan by TAIL_MIN_GAIN to be used. TAIL_COST is
# fitted to the one measured point, qkv at M = 3160 on the H200 (device time 0.3888 -> 0.3824 ms with 128-wide tails,
# -1.7 %, which the model gives at TAIL_COST = 1.8). The ratio of 128x128 to 128x256 tiles timed alone, 1.1, models
# -7.5 % there: the narrow tail tiles, all running at once at the end, are slower than alone.
TAIL_COST = 1.8
TAIL_MIN_GAIN = 0.01
TAIL_MAX_WAVES = 8


@functools.cache
def tail_split(m_tiles: int, n: int, block_n: int, tail_n: int, programs: int) -> int | None:
    """The column N_SPLIT where narrow tail tiles take over, or None to launch wide tiles only.

    Model: every wide tile costs 1, a tail tile ``TAIL_COST * tail_n / block_n``; wide tiles go round robin over the
    ``programs`` persistent programs, then tail tiles continue the round robin from the next program (as the kernel
    deals them). The makespan is the busiest program's cost. Wide-only costs ceil(tiles / programs); the split column
    (a multiple of block_n) with the smallest makespan is used when it is at least TAIL_MIN_GAIN shorter. Only below
    TAIL_MAX_WAVES waves of wide tiles, where the idle part of the last wave matters (``programs`` is at most the wide
    tile count: the launch sizes its grid from it). Pure scheduling: which tile shape covers a column never changes
    an element's K walk."""
    if tail_n <= 0 or n % block_n:
        return None
    cols = n // block_n
    tiles = m_tiles * cols
    if tiles // programs >= TAIL_MAX_WAVES or tiles % programs == 0:
        return None
    plain = -(-tiles // programs)
    per_wide = block_n // tail_n
    best, best_cost = None, plain * (1 - TAIL_MIN_GAIN)
    for wide_cols in range(cols - 1, 0, -1):
        t1 = m_tiles * wide_cols
        t2 = m_tiles * (cols - wide_cols) * per_wide
        start = t1 % programs
        cost = 0.0
        for p in range(programs):
            n1 = t1 // programs + (1 if p < start else 0)
            j0 = (p - start) % programs
            n2 = -(-(t2 - j0) // programs) if j0 < t2 else 0
            cost = max(cost, n1 + n2 * TAIL_COST / per_wide)
        if cost < best_cost:
            best, best_cost = wide_cols * block_n, cost
    return best
