"""What the one-block gate records per value: a check, a failing-check line, and the record of one compared value
(a forward node output or a gradient), shared by the forward and backward halves of :mod:`h3gate.runs.ws1_block`."""

from __future__ import annotations

import torch

from h3gate.dtypes import dtype_name
from h3gate.gate.compare import tensor_sha256
from h3gate.gate.invariance import GRAD_PLACEMENTS, PLACEMENTS
from h3gate.graph.inputs import BlockInputs, stand_in


def check(name: str, ok: bool, detail: str = "") -> dict:
    return {"check": name, "pass": bool(ok), "detail": detail}


def bound_check(bound: dict) -> dict:
    """The ``error_bound`` check of an :func:`h3gate.gate.tolerance.error_check` / ``leaf_check`` result."""
    return check("error_bound", bound["pass"], f"{bound['metric']} {bound['candidate']} <= {bound['bound']}")


def failure(where: str, item: dict) -> str:
    return f"{where}.{item['check']}" + (f" ({item['detail']})" if item["detail"] else "")


def value_record(
    like: torch.Tensor,
    candidate: torch.Tensor,
    provider: torch.Tensor,
    *,
    repeat: dict,
    batch_row: dict | None,
    provider_repeat_bitwise: bool | None,
    provider_batch_row_bitwise: bool | None,
    chained: dict,
    error: dict,
    rows: dict | None,
    checks: list[dict],
    head: dict | None = None,
    after_dtype: dict | None = None,
    after_chained: dict | None = None,
) -> dict:
    """The record of one compared value (a node output or a gradient), in the key order evidence has: ``head``,
    shape and dtype of ``like``, ``after_dtype``, the invariance results, ``chained``, ``after_chained``, the error
    and rows, the sha256 of both executions, the checks and the verdict."""
    return {
        **(head or {}),
        "shape": list(like.shape),
        "dtype": dtype_name(like.dtype),
        **(after_dtype or {}),
        "repeat": repeat,
        "batch_row": batch_row,
        "provider_repeat_bitwise": provider_repeat_bitwise,
        "provider_batch_row_bitwise": provider_batch_row_bitwise,
        "chained": chained,
        **(after_chained or {}),
        "error": error,
        "rows": rows,
        "sha256": {"provider": tensor_sha256(provider), "candidate": tensor_sha256(candidate)},
        "checks": checks,
        "pass": all(c["pass"] for c in checks),
    }


def unrelated(inputs: BlockInputs, tag: str) -> list[torch.Tensor]:
    """Seeded stand-ins shaped like the block input: the unrelated items of every batch placement."""
    h = inputs.tensors["hidden_states"]
    n = max(size for size, _ in (*PLACEMENTS, *GRAD_PLACEMENTS)) - 1
    return [stand_in(inputs.seed, tag, i, h.shape[1], h.shape[2], h.device) for i in range(1, n + 1)]
