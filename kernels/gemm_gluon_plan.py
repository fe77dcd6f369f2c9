"""Host side of the Gluon GEMM (:mod:`h3gate.kernels.gemm_gluon`): a launch's geometry, its TMA descriptors and its
compile-time constants, from a ``GemmConfig`` (``gluon``) and the operands' shapes. Scheduling only: nothing here
changes which FP32 sum an output element is."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from h3gate.kernels.gemm_configs import GemmConfig, tail_split

# Registers a thread (setmaxnreg): (worker consumer, producer) and the launch's limit; the default consumer gets what
# the limit leaves. Warp specialisation reserves a warpgroup for the one-warp producer, so the two consumers are 12
# warps (12 x 168 = the 64K registers of an SM; the attention forward's split too).
REGS = (240, 24)
WS_MAXNREG = 168


@functools.lru_cache(maxsize=64)
def nvmma_layout(block: tuple[int, ...]) -> gl.NVMMASharedLayout:
    """The default bf16 NVMMA shared layout of a ``block`` box, built once (about 14 us of host time a descriptor)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor over all of ``t`` (its shape and strides) with ``block`` boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, nvmma_layout(tuple(block)))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers."""
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    """One launch's geometry: A is X (or W swapped), B the other; a wide tile is ``block_m`` A rows x (block_b +
    b_tail) B rows; with ``n_split`` set, B rows from it on are ``narrow``-wide tiles dealt after the wide ones."""

    grid: int
    tiles: int
    pid_a: int
    pid_b: int
    n_split: int | None
    narrow_tiles: int
    pid_n: int
    k_tiles: int


def plan(m: int, n: int, k: int, cfg: GemmConfig, programs: int) -> Launch:
    """The launch of ``cfg`` (``gluon``) for Y (m, n) = X (m, k) W (n, k)^T on ``programs`` SMs: the persistent grid
    is sized from the wide tiles as :func:`h3gate.kernels.gemm_triton.matmul` sizes it, the narrow split from
    :func:`h3gate.kernels.gemm_configs.tail_split` (normal orientation without a B tail only)."""
    a_rows, b_rows = (n, m) if cfg.swap_ab else (m, n)
    pid_a = cdiv(a_rows, cfg.block_m)
    width = cfg.block_n + cfg.tail_m
    grid = min(pid_a * cdiv(b_rows, width), programs)
    n_split = None
    if cfg.tail_block_n and not cfg.swap_ab and not cfg.tail_m:
        n_split = tail_split(pid_a, b_rows, cfg.block_n, cfg.tail_block_n, grid)
    split = b_rows if n_split is None else n_split
    pid_b = cdiv(split, width)
    pid_n = 0 if n_split is None else cdiv(b_rows - split, cfg.tail_block_n)
    return Launch(grid, pid_a * pid_b, pid_a, pid_b, n_split, pid_a * pid_n, pid_n, cdiv(k, cfg.block_k))


def descriptors(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: GemmConfig, split: bool) -> dict:
    """Host TMA descriptors by kernel argument: A, B, B tail, B narrow, C (a consumer's 64 rows of a wide tile; only
    for TMA-stored, i.e. unswapped, tiles), and the grouped launch's further B and C (``b1_desc`` ...): None where
    unused."""
    a, b = (w, x) if cfg.swap_ab else (x, w)
    bk = cfg.block_k
    stored = not cfg.swap_ab
    return {
        "a_desc": desc(a, [cfg.block_m, bk]),
        "b_desc": desc(b, [cfg.block_n, bk]),
        "b1_desc": None,
        "b2_desc": None,
        "bt_desc": desc(b, [cfg.tail_m, bk]) if cfg.tail_m else None,
        "bn_desc": desc(b, [cfg.tail_block_n, bk]) if split else None,
        "c_desc": desc(y, [64, cfg.block_n]) if stored else None,
        "c1_desc": None,
        "c2_desc": None,
    }


def launch_constants(cfg: GemmConfig, split: bool, bias: bool, groups: int = 1) -> dict:
    """The kernel's compile-time constants for ``cfg`` (``split``: narrow tiles launched; ``bias``: a bias added;
    ``groups``: operands of a grouped launch) and the launch's register limit (``maxnreg``): everything
    :func:`matmul_ws` and :func:`matmul_ws_grouped` pass but the tensors and sizes."""
    return {"BLOCK_B": cfg.block_n, "B_TAIL": cfg.tail_m, "NARROW": cfg.tail_block_n if split else 0,
            "BLOCK_K": cfg.block_k, "GROUP": cfg.group_m, "STAGES": cfg.num_stages, "SWAP": cfg.swap_ab,
            "HAS_BIAS": bias, "TMA_STORE": not cfg.swap_ab, "A_ROWS": cfg.block_m, "GROUPS": groups,
            "REGS_C": REGS[0], "REGS_P": REGS[1], "maxnreg": WS_MAXNREG}  # fmt: skip


def groupable(cfg: GemmConfig, n: int, groups: int) -> bool:
    """Whether :func:`matmul_ws_grouped` runs ``groups`` weights of ``n`` rows with ``cfg``: unswapped, no B tail,
    two or three operands, ``n`` a multiple of ``block_n`` (no tile straddles two weights)."""
    return not cfg.swap_ab and not cfg.tail_m and groups in (2, 3) and n % cfg.block_n == 0
