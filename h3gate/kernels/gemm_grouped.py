"""Sibling projections as one launch: ``[linear(x, w) for w in weights]`` for two or three weights of one shape on
the same ``x`` (q, k and v of a block), with the same bytes.

Where :func:`h3gate.kernels.gemm_configs.grouped_tiling` names a tiling (a Hopper GPU, bfloat16, a layer listed in
``GROUPED_LAYERS`` at an M in its range) and no autograd graph is to be built, one persistent Gluon launch
(:func:`h3gate.kernels.gemm_gluon.matmul_ws_grouped`) computes every output: the tiles of the weights' concatenation,
each output element ``y[i, j] = sum_k x[i, k] w[j, k]`` the FP32 sum over ascending BLOCK_K chunks of that layer's
contract, one rounding to bfloat16 - the walk of each weight's own launch; only which program holds a tile differs,
and the last wave of one weight's tiles is filled by the next weight's. Otherwise each weight is one
:func:`h3gate.kernels.gemm.linear` call. The graph executor groups sibling nodes through the bound operator's
``grouped`` attribute (:func:`h3gate.graph.execute.sibling_gemms`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from h3gate.kernels import launches
from h3gate.kernels.common import aligned, needs_graph, num_sms
from h3gate.kernels.gemm import _check, launch_record, linear
from h3gate.kernels.gemm_configs import grouped_tiling


def linear_grouped(x: torch.Tensor, weights: Sequence[torch.Tensor], *, op: str = "linear") -> list[torch.Tensor]:
    """``[linear(x, w, op=op) for w in weights]``, bitwise: one grouped launch where :func:`grouped_tiling` allows it
    (and no argument needs an autograd graph), else one call per weight. Inputs are checked as :func:`linear` checks
    them, naming ``op``."""
    weights = tuple(weights)
    cfg = None if needs_graph(x, *weights) else grouped_tiling(x, weights)
    if cfg is None:
        return [linear(x, w, op=op) for w in weights]
    for w in weights:
        _check(op, x, w, None)
    from h3gate.kernels.gemm_gluon import matmul_ws_grouped

    def record() -> dict:
        forward = {"tiling": cfg.tag, "tma": True, "kernel": "gluon_grouped"}
        return {**launch_record(x, weights[0]), "forward": forward, "grouped": f"{len(weights)} weights, one launch"}

    launches.note(op, record)
    n, k = weights[0].shape
    x2 = aligned(x.reshape(-1, k).contiguous())
    ws = [aligned(w.contiguous()) for w in weights]
    ys = [torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device) for _ in ws]
    matmul_ws_grouped(x2, ws, ys, cfg, num_sms(x.device))
    return [y.view(*x.shape[:-1], n) for y in ys]
