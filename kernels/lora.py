"""Strict PEFT LoRA update: ``h3_lora_update(x, lora_a, lora_b, scaling)``, forward and backward, on the strict GEMM.

A PEFT (0.17 - 0.21) vanilla LoRA ``Linear.forward`` computes, with dropout 0 (``nn.Identity``)::

    result = base_layer(x); x_a = x.to(lora_A.weight.dtype)
    result = result + lora_B(lora_A(x_a)) * scaling; result = result.to(base dtype)

This operator is the update term only; the base GEMM, the add and the final cast stay with the caller, who writes
``(base + update).to(base.dtype)`` with plain torch as PEFT does. Contract (restated in
``manifests/operators/gemm.yaml``, entry ``h3_lora_update``):

* maths - ``U = ((cast(X) @ A^T) @ B^T) * s`` with X (..., K), A = lora_A.weight (r, K), B = lora_B.weight (N, r),
  no biases, ``s`` a Python float (``lora_alpha / r``, or ``/ sqrt(r)`` for rsLoRA); output (..., N) in the
  adapter's dtype (bfloat16 or float32; PEFT keeps float32 adapters on a bfloat16 base by default).
* cast points - (1) ``x.to(A.dtype)`` exactly as PEFT (a no-op when the dtypes agree; an exact upcast for a
  bfloat16 x and a float32 adapter; one RNE rounding for a float32 x and a bfloat16 adapter); (2) GEMM A,
  ``H = X_a @ A^T`` (M, r), FP32 accumulator, one rounding to the adapter dtype; (3) GEMM B, ``Y = H @ B^T``, FP32
  accumulator, one rounding to the adapter dtype; (4) ``Y * s``: torch's elementwise multiply by the Python scalar,
  the very op PEFT runs (opmath FP32 for bfloat16, one rounding to the adapter dtype).
* reduction order - both GEMMs are :func:`h3gate.kernels.gemm.linear`: one program per output tile walks the
  reduction dimension (K for GEMM A, r for GEMM B) in ascending BLOCK_K chunks, ``acc = dot(chunk, chunk, acc)``,
  BLOCK_K from ``gemm_configs.gemm_config(role, N, K, dtype)`` of that GEMM (never from M); a masked K tail (r is
  usually below BLOCK_K) adds exact zeros. No split, no atomics. So a row's bytes do not depend on M or other rows.
* backward - autograd through the two strict GEMMs' Functions and torch's two elementwise ops: ``dY = dU * s``
  (one rounding), GEMM B: ``dH = dY @ B`` (reduction over N) and ``dB = dY^T @ H`` (reduction over the M rows, one
  program per tile, no split); GEMM A: ``dX_a = dH @ A`` (reduction over r) and ``dA = dH^T @ X_a`` (over the M
  rows); each FP32-accumulated, rounded once to the adapter dtype; ``dX = dX_a.to(x.dtype)`` (the cast's backward,
  one RNE rounding when x is bfloat16 and the adapter float32). dX rows are row invariant; dA, dB repeat bitwise.
"""

from __future__ import annotations

import math

import torch

from h3gate.errors import InputError
from h3gate.kernels.common import check_dtype_as, check_tensor
from h3gate.kernels.gemm import linear

OP = "h3_lora_update"
KERNEL_ID = "triton:h3gate.lora_update_gemm_fixedk_fp32acc:v1"
_DTYPES = (torch.bfloat16, torch.float32)


def _check(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
    """Bad input raises an InputError naming the operator and the argument (shape, dtype or device)."""
    check_tensor(OP, "x", x, _DTYPES)
    if x.ndim < 1:
        raise InputError(f"{OP}: x: expected at least 1 dim, got a scalar")
    check_tensor(OP, "lora_a", lora_a, _DTYPES, ndim=2, device=x.device)
    check_tensor(OP, "lora_b", lora_b, _DTYPES, ndim=2, device=x.device)
    check_dtype_as(OP, "lora_b", lora_b, lora_a.dtype, "lora_a")
    rank, k = lora_a.shape
    if k != x.shape[-1]:
        raise InputError(
            f"{OP}: lora_a: in_features {k} != x last dim {x.shape[-1]} "
            f"(x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)} = (r, K))"
        )
    if lora_b.shape[1] != rank:
        raise InputError(
            f"{OP}: lora_b: rank {lora_b.shape[1]} != lora_a rank {rank} "
            f"(lora_a {tuple(lora_a.shape)} = (r, K), lora_b {tuple(lora_b.shape)} = (N, r))"
        )
    if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not math.isfinite(scaling):
        raise InputError(f"{OP}: scaling: expected a finite Python float, got {scaling!r}")


def h3_lora_update(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``lora_b_linear(lora_a_linear(x.to(lora_a.dtype))) * scaling`` with the strict GEMM for both linears.

    Same signature, shapes and output dtype (``lora_a``'s) as :func:`h3gate.ops.reference.lora_update`.
    ``x`` (..., K) bfloat16 or float32; ``lora_a`` (r, K) and ``lora_b`` (N, r) of one dtype, bfloat16 or float32,
    on x's device, contiguous. Differentiable in ``x``, ``lora_a`` and ``lora_b`` (see the module docstring)."""
    _check(x, lora_a, lora_b, scaling)
    hidden = linear(x.to(lora_a.dtype), lora_a, op=OP)
    return linear(hidden, lora_b, op=OP) * scaling
