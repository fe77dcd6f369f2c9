"""Segmented-8 strict GEMM: one declared merge order for a reduction that tensor parallelism splits across ranks.

Row-parallel layers (attention O, FFN down) split the forward's reduction dimension K across TP ranks; the dX of
column-parallel layers (Q/K/V, FFN gate/up) splits its reduction dimension N. The single-walk kernel
(:mod:`h3gate.kernels.gemm`) sums a whole reduction in one accumulator, which no split can reproduce; this family fixes
an order that every TP degree in {1, 2, 4, 8} evaluates identically, so TP1 = TP2 = TP4 = TP8 byte for byte by
construction. Contract (restated in ``manifests/operators/gemm.yaml``, entries ``*_seg8``):

* maths - ``Y = X @ W^T + b`` (role ``fwd``, reduction R = K) and ``dX = dY @ W`` (role ``dx``, R = N), X (M, K)
  (leading dims flattened), W (N, K) as nn.Linear, b (N,); output dtype = X's (bfloat16 or float32).
* segments - R is cut into SEGMENTS = 8 contiguous segments ``[b_i, b_i+1)``, ``b_i = min(i * S, R)`` with
  ``S = BLOCK_K * ceil(ceil(R / 8) / BLOCK_K)``; BLOCK_K is the full layer's (``gemm_config(role, N, K, dtype)``,
  never a slice's, never M's). So the boundaries depend on (role, N, K, dtype) only, never on the TP degree; every
  segment but the last non-empty one is whole BLOCK_K chunks; trailing segments may be short or empty (R < 8 * S).
  For the H3 block (R = 7168, 14336, 28672 with BLOCK_K 64) the segments are equal and fall on the TP8 head /
  channel boundaries (7 heads of 128; 1792 and 3584 channels).
* per segment - one program per BLOCK_M x BLOCK_N output tile (persistent: a program walks tiles pid, pid +
  #programs, ...) walks the owned segments in order, each in ascending BLOCK_K chunks from ``acc = 0`` in FP32,
  ``acc = dot(a_chunk, b_chunk, acc)`` (BF16: MMA with FP32 accumulator; FP32: ``input_precision="ieee"``), a masked
  tail adding exact zeros: the single-walk kernel's pointer-load walk (:func:`_walk`, the loads and MMA of
  :func:`h3gate.kernels.gemm._tile`) on the K-slice, unrounded FP32 partial ``p_i`` (an empty segment gives
  ``p_i = +0``). Which rank, or which local column offset, computes a segment does not change its bytes.
* tree - ``Y_acc = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``, elementwise IEEE FP32 adds (no FMA),
  evaluated in the same kernel as soon as a sibling is done: the program keeps its pending subtrees (at most three)
  in its own scratch slots, so no M x N partial buffer is written (v1 wrote 8 and summed them with torch: the same
  bytes, about 3x the forward's time on the H200). Rank r of TPn owns segments ``[r * 8/n, (r + 1) * 8/n)`` and
  evaluates the tree's lower levels on them (:func:`segment_partials`); after an all-gather in rank order
  :func:`combine` applies the upper log2(n) levels.
* cast points - the tree's FP32 sum, plus the FP32 bias (exact upcast) in one IEEE add, then one RNE rounding to the
  output dtype: in the kernel's epilogue when one device owns all 8 segments, else :func:`finish` after
  :func:`combine`. dX the same without bias.
* backward of :func:`linear_merge` - dX by the segmented-8 order over N; dW = dY^T @ X and db = sum_m dY (a sum over
  packed rows, which TP does not split but CP does) in a weight gradient's row-segment order
  (:func:`h3gate.kernels.row_merge.dw_bounds`: 4 segments, the pairs of the 8; CP degrees 1, 2, 4), every segment
  and the tree inside one program per dW tile (:mod:`h3gate.kernels.rows_dw`; kernel id v4, v3 had the 8 row
  segments); where ``GemmLaunch.rows_dw_gluon`` (on)
  the one-device bfloat16 dW on Hopper runs the warp-specialised Gluon kernel
  (:mod:`h3gate.kernels.gemm_gluon_rows_dw`, ``gluon_warp_specialised_rows_dw``; else ``triton_rows_dw``): the same
  chunks, wgmma steps, tree and rounding, its bytes equal to ``rows_dw``'s (measured on an H100 for the 8 and the 4
  segments: ``tools/gpu_seg8_gluon_dw_check.py``).
* row invariance - the tiling never depends on M (M is not specialised); the tree is elementwise.
* not bitwise with cuBLAS nor with the single-walk kernel (a different FP32 summation order).
* tiling - the full layer's pinned config (:func:`fused_config`: its BLOCK_K; BLOCK_N capped at 128 so the
  accumulator and a slot tile fit the registers), persistent, pointer or TMA loads (the same chunks); no swapped
  tilings.
* kernel paths (:func:`forward_plan`; ``launch_record`` names the one that ran) - ``triton_seg8``
  (:func:`_seg8_kernel`, every product) and, for the one-device forward in bfloat16 on Hopper where the layer's
  pinned BLOCK_K is its tiling's (:func:`gluon_tiling`), ``gluon_warp_specialised_seg8``
  (:mod:`h3gate.kernels.gemm_gluon_seg8`: the same chunks in the same wgmma k16 steps from zero per segment, the
  same tree with the same slots, bias and rounding; its bytes equal to the Triton seg8 kernel's on Hopper:
  ``tools/gpu_seg8_gluon_check.py``); the one-device dX (all 8 segments of the full layer, rounded or the
  FP32 sum) likewise where ``GemmLaunch.seg8_gluon_dx`` (on; W's (BLOCK_K x 128) boxes fed as an
  MN-major B, as the Triton kernel's TMA dX walk feeds them; ``tools/gpu_seg8_gluon_dw_check.py``). The interpreter
  and other devices run ``triton_seg8``.
* compilation - :data:`h3gate.kernels.common.STRICT_LAUNCH`: no FMA contraction, no FTZ; no TF32, no split beyond
  the 8 declared segments, no atomics.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.kernels import launches, selection
from h3gate.kernels.common import (
    INTERPRET,
    STRICT_LAUNCH,
    aligned,
    check_tensor,
    needs_graph,
    num_sms,
    tma_allocator,
)
from h3gate.kernels.exact import cdiv, fold_segment, helper, mma, rne, zeros
from h3gate.kernels.gemm import _operator as gemm_operator
from h3gate.kernels.gemm import check_linear
from h3gate.kernels.gemm_configs import PRODUCTION, GemmConfig, GemmLaunch, gemm_config
from h3gate.kernels.gemm_gluon_seg8 import SEG8_GLUON, matmul_seg8_ws
from h3gate.kernels.gemm_triton import tile_coords
from h3gate.kernels.merge_tree import DEGREES, SEGMENTS, finish, owned_segments
from h3gate.kernels.rows_seg8 import dw_record, linear_row_grads, linear_rows

KERNEL_ID = "triton:h3gate.gemm_seg8_fp32acc:v4"
ROLES = ("fwd", "dx")
TRITON, GLUON = "triton_seg8", "gluon_warp_specialised_seg8"  # the forward's kernel paths
_DTYPES = (torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------------- the declaration


def pinned_config(role: str, full_shape: tuple[int, int], dtype: torch.dtype) -> GemmConfig:
    """The tiling of ``role`` for the FULL layer (weight (N, K) = ``full_shape``), whatever slice a rank holds.

    No M: one tiling for every M, so BLOCK_K (and thus the segment boundaries) never move."""
    n, k = full_shape
    return gemm_config(role, n, k, dtype)


def reduction_width(role: str, full_shape: tuple[int, int]) -> int:
    """R: K for the forward, N for dX."""
    n, k = full_shape
    return k if role == "fwd" else n


def segment_size(r: int, block_k: int) -> int:
    """S = BLOCK_K * ceil(ceil(R / 8) / BLOCK_K): the smallest whole number of chunks that covers R in 8 segments."""
    per = -(-r // SEGMENTS)
    return block_k * -(-per // block_k)


def segment_bounds(r: int, block_k: int) -> tuple[int, ...]:
    """The 9 boundaries ``b_i = min(i * S, R)``: segment i is the reduction range ``[b_i, b_i+1)``."""
    s = segment_size(r, block_k)
    return tuple(min(i * s, r) for i in range(SEGMENTS + 1))


def rank_slice(role: str, full_shape: tuple[int, int], dtype: torch.dtype, degree: int, rank: int) -> slice:
    """The reduction columns a TP rank holds: of X and W's columns (``fwd``), or of dY's columns / W's rows (``dx``)."""
    bounds = segment_bounds(reduction_width(role, full_shape), pinned_config(role, full_shape, dtype).block_k)
    owned = owned_segments(degree, rank)
    return slice(bounds[owned.start], bounds[owned.stop])


# ---------------------------------------------------------------------------------------------------- the kernel


@helper
def _walk(a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, length, stride_am, stride_ar, stride_br, stride_bn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_R: tl.constexpr,
          B_TRANS: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One segment of one tile: ascending BLOCK_K chunks of ``[0, length)`` from acc = 0 (FP32), the single walk's
    loads and MMA (:func:`h3gate.kernels.gemm._tile`'s pointer path), a masked tail adding exact zeros."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ar
    if B_TRANS:  # stored (N, R): load the (BLOCK_N, BLOCK_K) tile
        b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :] * stride_br
    else:
        b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * stride_br + offs_n[None, :] * stride_bn
    acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(cdiv(length, BLOCK_K)):
        if EVEN_R:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            if B_TRANS:
                b = tl.trans(tl.load(b_ptrs, mask=mask_n[:, None], other=0.0))
            else:
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            in_k = offs_k < length - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            if B_TRANS:
                b = tl.trans(tl.load(b_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0))
            else:
                b = tl.load(b_ptrs, mask=in_k[:, None] & mask_n[None, :], other=0.0)
        acc = mma(a, b, acc, INTERPRET)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
    return acc


@helper
def _walk_tma(a_desc, b_desc, off_m, off_n, start, length, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """:func:`_walk` with TMA tile loads (the single walk's ``tma`` variant): the same chunks, values and MMA; rows or
    columns past the tensor are zero-filled by the TMA unit (a segment ends at a chunk boundary or at R)."""
    acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(cdiv(length, BLOCK_K)):
        off_k = start + ki * BLOCK_K
        a = a_desc.load([off_m, off_k])
        if B_TRANS:
            b = tl.trans(b_desc.load([off_n, off_k]))
        else:
            b = b_desc.load([off_k, off_n])
        acc = mma(a, b, acc, INTERPRET)
    return acc


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _seg8_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, scratch_ptr, M, N, R_LOC, SEG, stride_am, stride_ar, stride_br, stride_bn,
    stride_om, NUM_PROGS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    C: tl.constexpr, FINISH: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_R: tl.constexpr, B_TRANS: tl.constexpr,
    USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """OUT (M, N) = the tree over C consecutive local segments ``[j*SEG, min((j+1)*SEG, R_LOC))`` of A @ B, per
    output tile: each segment walked from acc = 0, the pending subtrees kept in this program's scratch slots (slot l
    holds a finished subtree of 2^l segments), merged as soon as their sibling is done - ``p0 + p1``, ``p2 + p3``,
    ``s01 + s23``, ... (commutative IEEE FP32 adds in the declared tree's pairing). ``FINISH``: + bias (FP32) and one
    RNE rounding to OUT's dtype; else OUT is the FP32 subtree. Persistent: program ``pid`` owns tiles pid, pid +
    NUM_PROGS, ..., and its three scratch slots."""
    pid = tl.program_id(0)
    num_pid_m = cdiv(M, BLOCK_M)
    num_pid_n = cdiv(N, BLOCK_N)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, R_LOC], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_TRANS:
            b_desc = tl.make_tensor_descriptor(b_ptr, [N, R_LOC], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, [R_LOC, N], [stride_br, 1], [BLOCK_K, BLOCK_N])
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    slots = scratch_ptr + pid.to(tl.int64) * (3 * BLOCK_M * BLOCK_N) + tile
    for tile_id in range(pid, num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(C):
            start = pid * 0 + j * SEG  # a scalar tensor in both the compiled kernel and the interpreter
            length = tl.maximum(tl.minimum(R_LOC - start, SEG), 0)
            if USE_TMA:
                acc = _walk_tma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, start, length, BLOCK_M, BLOCK_N,
                                BLOCK_K, B_TRANS, INTERPRET)  # fmt: skip
            else:
                acc = _walk(a_ptr + start.to(tl.int64) * stride_ar, b_ptr + start.to(tl.int64) * stride_br, offs_m,
                            offs_n, mask_m, mask_n, length, stride_am, stride_ar, stride_br, stride_bn, BLOCK_M,
                            BLOCK_N, BLOCK_K, EVEN_R, B_TRANS, INTERPRET)  # fmt: skip
            acc = fold_segment(acc, slots, j, C - 1, BLOCK_M, BLOCK_N)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        if FINISH:
            if HAS_BIAS:
                acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask_m[:, None] & mask_n[None, :])
        else:
            tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def fused_config(role: str, full_shape: tuple[int, int], dtype: torch.dtype) -> GemmConfig:
    """The fused kernel's tiling: the full layer's pinned config (its BLOCK_K fixes the segments and chunks) with
    BLOCK_N capped at 128, so the accumulator and one slot tile fit the registers (a tile shape, not arithmetic)."""
    cfg = pinned_config(role, full_shape, dtype)
    return replace(cfg, block_n=min(cfg.block_n, 128), persistent=True, tma=False, tail_block_n=0, swap_ab=False,
                   tail_m=0)  # fmt: skip


def _tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TMA loads on CUDA when both operands' bases and row strides are 16-byte aligned (else the pointer walk: the
    same values and MMA, a scheduling choice decided from the operands alone)."""
    size = a.element_size()
    return (a.is_cuda and not INTERPRET and all(t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
            and t.stride(-1) == 1 for t in (a, b)))  # fmt: skip


def _launch(a, b, out, bias, cfg: GemmConfig, seg: int, segments: int, finish_: bool, b_trans: bool,
            launch: GemmLaunch) -> None:  # fmt: skip
    """``out (M, Nout)`` = the tree over ``segments`` local segments of ``a (M, R_loc) @ b`` (``b`` (Nout, R_loc)
    row-major when ``b_trans`` (forward: W), else (R_loc, Nout) (dX: W)), rounded with ``bias`` when ``finish_``; TMA
    loads where ``launch.seg8_tma`` and the operands allow them."""
    m, n_out = out.shape
    stride_br, stride_bn = (1, b.stride(0)) if b_trans else (b.stride(0), 1)
    tiles = -(-m // cfg.block_m) * -(-n_out // cfg.block_n)
    progs = max(1, min(tiles, num_sms(out.device)))
    scratch = torch.empty((progs, 3, cfg.block_m, cfg.block_n), dtype=torch.float32, device=out.device)
    tma = launch.seg8_tma and _tma_fits(a, b)
    if tma:
        triton.set_allocator(tma_allocator)
    _seg8_kernel[(progs,)](
        a, b, out, bias if bias is not None else out, scratch, m, n_out, a.shape[1], seg, a.stride(0), 1, stride_br,
        stride_bn, out.stride(0), progs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, C=segments, FINISH=finish_, HAS_BIAS=bias is not None,
        EVEN_R=a.shape[1] % cfg.block_k == 0, B_TRANS=b_trans, USE_TMA=tma, INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **STRICT_LAUNCH,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------- the rank API


def _check_owned(op: str, owned: range) -> None:
    c = len(owned) if isinstance(owned, range) else 0
    if c not in DEGREES or owned.step != 1 or owned.start < 0 or owned.start % c or owned.stop > SEGMENTS:
        raise InputError(
            f"{op}: owned: {owned!r} is not an aligned block of 8/n consecutive segments (n in {DEGREES}), e.g. "
            "range(2, 4) for rank 1 of TP4"
        )


def _check_operand(op: str, arg: str, t: torch.Tensor, red_dim: int, device: torch.device | None,
                   column_slice: bool = False) -> None:  # fmt: skip
    """check_tensor, except that a zero-width slice (a rank whose owned segments are all empty) is accepted, and with
    ``column_slice`` a 2-D view of some of a matrix's columns (strided rows, unit stride along them)."""
    if isinstance(t, torch.Tensor) and -t.ndim <= red_dim < t.ndim and t.shape[red_dim] == 0:
        check_tensor(op, arg, torch.empty(1, dtype=t.dtype, device=t.device), _DTYPES, device=device)
        return
    sliced = column_slice and isinstance(t, torch.Tensor) and t.ndim == 2 and t.stride(-1) == 1
    check_tensor(op, arg, t, _DTYPES, device=device, contiguous=not sliced)


def _check_local(
    op: str, a: torch.Tensor, b: torch.Tensor, owned: range, full_shape: tuple[int, int], role: str
) -> int:
    """Validate one rank's operands against the full layer; returns the segment size S."""
    if role not in ROLES:
        raise InputError(f"{op}: role: {role!r}, expected one of {ROLES}")
    if (
        not isinstance(full_shape, tuple | list)
        or len(full_shape) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in full_shape)
    ):
        raise InputError(f"{op}: full_shape: {full_shape!r}, expected the full layer's weight shape (N, K) > 0")
    _check_owned(op, owned)
    _check_operand(op, "a_local", a, -1, None, column_slice=True)
    if a.ndim < 1 or a.shape[:-1].numel() == 0:
        raise InputError(f"{op}: a_local: no rows (shape {tuple(a.shape)})")
    red, other = (1, 0) if role == "fwd" else (0, 1)
    _check_operand(op, "b_local", b, red, a.device)
    if b.ndim != 2:
        raise InputError(f"{op}: b_local: expected 2 dims, got shape {tuple(b.shape)}")
    if b.dtype != a.dtype:
        raise InputError(f"{op}: b_local: dtype {dtype_name(b.dtype)} does not match a_local {dtype_name(a.dtype)}")
    n, k = full_shape = tuple(full_shape)
    cfg = pinned_config(role, full_shape, a.dtype)
    bounds = segment_bounds(reduction_width(role, full_shape), cfg.block_k)
    lo, hi = bounds[owned.start], bounds[owned.stop]
    where = f"segments [{owned.start}, {owned.stop}) = reduction columns [{lo}, {hi}) of {bounds[-1]}"
    if a.shape[-1] != hi - lo:
        raise InputError(f"{op}: a_local: last dim {a.shape[-1]}, expected {hi - lo} ({where})")
    if b.shape[red] != hi - lo or not 1 <= b.shape[other] <= (n if role == "fwd" else k):
        want = f"(<= {n}, {hi - lo})" if role == "fwd" else f"({hi - lo}, <= {k})"
        raise InputError(f"{op}: b_local: shape {tuple(b.shape)}, expected {want} for role {role} ({where})")
    return segment_size(bounds[-1], cfg.block_k)


def _subtree(
    a: torch.Tensor,
    b: torch.Tensor,
    owned: range,
    full_shape: tuple[int, int],
    role: str,
    seg: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    launch: GemmLaunch = PRODUCTION,
) -> torch.Tensor:
    """The owned segments reduced by the tree's lower levels (one fused launch): FP32 (M, Nout), or with
    ``out_dtype`` (all 8 segments owned) the finished output: + bias, one rounding. The one-device dX (all 8
    segments of the full layer) by :func:`forward_plan`'s "dx" path (a column slice of dY read in place where TMA
    can, else 16-byte aligned copies for the Gluon kernel's TMA: the same bytes)."""
    rows = a.shape[:-1].numel()
    n_out = b.shape[0] if role == "fwd" else b.shape[1]
    if a.shape[-1] == 0:  # every owned segment is empty: each partial, and their sum, is +0
        total = torch.zeros((rows, n_out), dtype=torch.float32, device=a.device)
        return total if out_dtype is None else finish(total, bias, out_dtype)
    a2 = a.reshape(rows, a.shape[-1])
    out = torch.empty((rows, n_out), dtype=out_dtype or torch.float32, device=a.device)
    if role == "dx" and len(owned) == SEGMENTS and tuple(b.shape) == tuple(full_shape):
        path, cfg = forward_plan(a2, b, launch, "dx")
        if path == GLUON:
            b = aligned(b.contiguous())
            a2 = a2 if _tma_fits(a2, b) else aligned(a2.contiguous())
            return matmul_seg8_ws(a2, b, out, None, cfg, seg, num_sms(a.device), dx=True)
    cfg = fused_config(role, tuple(full_shape), a.dtype)
    _launch(a2, b, out, bias, cfg, seg, len(owned), out_dtype is not None, role == "fwd", launch)
    return out


def segment_partials(
    a_local: torch.Tensor,
    b_local: torch.Tensor,
    owned: range,
    full_shape: tuple[int, int],
    role: str = "fwd",
    *,
    op: str = "gemm_seg8",
    launch: GemmLaunch = PRODUCTION,
) -> torch.Tensor:
    """One rank's FP32 subtree: the tree's value over its owned segments (lower levels applied locally).

    ``role="fwd"`` (row-parallel forward): ``a_local`` = X[..., K-slice] (..., w), ``b_local`` = W[:, K-slice]
    (N_loc, w) -> (M, N_loc). ``role="dx"`` (column-parallel dX): ``a_local`` = dY[..., N-slice] (..., w),
    ``b_local`` = W[N-slice, :] (w, K_loc) -> (M, K_loc). The slice is :func:`rank_slice`'s (width w = the owned
    segments' width, possibly 0); ``full_shape`` = the full layer's weight (N, K), which alone fixes the tiling and the
    boundaries. The non-reduced side may itself be a slice (N_loc <= N, K_loc <= K): output columns are independent.
    Returns a view of the rank's partial buffer (its first slot)."""
    seg = _check_local(op, a_local, b_local, owned, full_shape, role)
    return _subtree(a_local, b_local, owned, tuple(full_shape), role, seg, launch=launch)


def segment_total(a: torch.Tensor, b: torch.Tensor, full_shape: tuple[int, int], role: str = "dx", *,
                  out_dtype: torch.dtype, op: str = "gemm_seg8",
                  launch: GemmLaunch = PRODUCTION) -> torch.Tensor:  # fmt: skip
    """One device, the whole layer: all 8 segments, the whole tree and one rounding to ``out_dtype`` in the kernel's
    epilogue; the bytes of ``finish(segment_partials(a, b, range(8), full_shape, role), None, out_dtype)``."""
    seg = _check_local(op, a, b, range(SEGMENTS), full_shape, role)
    return _subtree(a, b, range(SEGMENTS), tuple(full_shape), role, seg, None, out_dtype, launch=launch)


# -------------------------------------------------------------------------------------------------- the operator


def gluon_tiling(n: int, k: int, dtype: torch.dtype, role: str = "fwd") -> GemmConfig | None:
    """The Gluon seg8 kernel's tiling for ``role`` of the layer with weight (N, K) at ``dtype``, or None where it does
    not apply: bfloat16, its BLOCK_K the layer's pinned one for the role (so the same segment boundaries and chunks),
    rows 16-byte aligned (TMA). Tile shape is scheduling; BLOCK_K is not."""
    if dtype != torch.bfloat16 or n % 8 or k % 8 or pinned_config(role, (n, k), dtype).block_k != SEG8_GLUON.block_k:
        return None
    return SEG8_GLUON


def forward_plan(x: torch.Tensor, weight: torch.Tensor, launch: GemmLaunch = PRODUCTION,
                 role: str = "fwd") -> tuple[str, GemmConfig]:  # fmt: skip
    """The one-device seg8 forward's path and tiling for ``x (..., K) @ weight (N, K)^T`` here (``role`` "dx": of the
    dX ``dY (..., N) @ weight``, ``x`` = dY): ``GLUON`` on a Hopper GPU (never under the interpreter) where
    :func:`gluon_tiling` applies and ``launch.seg8_gluon`` (dX: ``launch.seg8_gluon_dx``), else ``TRITON`` with
    :func:`fused_config`."""
    n, k = weight.shape
    cfg = gluon_tiling(n, k, x.dtype, role)
    on = launch.seg8_gluon if role == "fwd" else launch.seg8_gluon_dx
    if cfg is not None and on and x.numel() and selection.device_class(x.device) == "cuda-sm90":
        return GLUON, cfg
    return TRITON, fused_config(role, (n, k), x.dtype)


def launch_record(x: torch.Tensor, weight: torch.Tensor, launch: GemmLaunch = PRODUCTION,
                  op: str = "linear_merge") -> dict:  # fmt: skip
    """The forward's and, where a backward runs, dX's path and tiling (:func:`forward_plan`) and whether TMA loads
    them (dX's operands judged by x's), and the weight gradient's (:func:`h3gate.kernels.rows_seg8.dw_record`)."""
    n, k = weight.shape
    fits = launch.seg8_tma and _tma_fits(x.reshape(-1, k), weight)
    rec = {role: forward_plan(x, weight, launch, role) for role in ROLES}
    rec = {role: {"tiling": cfg.tag, "tma": path == GLUON or fits, "kernel": path} for role, (path, cfg) in rec.items()}
    rec = {"forward": rec["fwd"], "dx": rec["dx"], "dw": dw_record(x, (n, k), linear_rows(op, x), launch)}
    return {**rec, "interpreted": INTERPRET}


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: GemmLaunch) -> torch.Tensor:
    """TP1: all 8 segments on this device, the whole tree, the bias and the one rounding (by :func:`forward_plan`'s
    path; contiguous, 16-byte aligned copies for the Gluon kernel's TMA where needed: the same bytes)."""
    n, k = weight.shape
    seg = segment_size(k, pinned_config("fwd", (n, k), x.dtype).block_k)
    path, cfg = forward_plan(x, weight, launch)
    if path == GLUON:
        x2, w2 = (aligned(t.contiguous()) for t in (x.reshape(-1, k), weight))
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        matmul_seg8_ws(x2, w2, y, bias, cfg, seg, num_sms(x.device))
    else:
        y = _subtree(x, weight, range(SEGMENTS), (n, k), "fwd", seg, bias, x.dtype, launch)
    return y.view(*x.shape[:-1], n)


class _LinearSeg8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str,
                launch: GemmLaunch) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.op, ctx.rows, ctx.launch = bias is not None, op, linear_rows(op, x), launch
        return _forward(x, weight, bias, launch)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        if gy.dtype != x.dtype:
            raise InputError(
                f"{ctx.op}: grad_output: dtype {dtype_name(gy.dtype)} != output dtype {dtype_name(x.dtype)}"
            )
        g2 = gy.reshape(-1, n).contiguous()  # a contiguous copy changes layout, never values
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = segment_total(g2, weight, (n, k), "dx", out_dtype=x.dtype, op=ctx.op, launch=ctx.launch).view(x.shape)
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1] or want_db:
            dw, db = linear_row_grads(gy, x, (n, k), (n, k), ctx.rows, want_db, ctx.launch)
        return dx, dw if ctx.needs_input_grad[1] else None, db, None, None


def linear_merge(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    op: str = "linear_merge",
    launch: GemmLaunch = PRODUCTION,
) -> torch.Tensor:
    """The one-device (TP1) segmented-8 ``F.linear``: same signature, shapes and output dtype as the reference.

    Bytes equal :func:`combine` of any TP degree's :func:`segment_partials` followed by :func:`finish`."""
    check_linear(op, x, weight, bias)
    launches.note(op, lambda: launch_record(x, weight, launch, op))
    if needs_graph(x, weight, bias):
        return _LinearSeg8.apply(x, weight, bias, op, launch)
    return _forward(x, weight, bias, launch)


def _operator(op: str):
    """A module-level entry point per operator (``gemm._operator`` over :func:`linear_merge`)."""
    return gemm_operator(op, linear_merge, "the segmented-8 strict GEMM")


h3_attention_o_gemm_seg8 = _operator("h3_attention_o_gemm_seg8")
h3_ffn_down_gemm_seg8 = _operator("h3_ffn_down_gemm_seg8")
