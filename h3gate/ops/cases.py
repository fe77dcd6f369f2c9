"""The case builders of every operator (``CASES``: op -> builder; the protocol is :mod:`h3gate.ops.case`): the
non-GEMM rows in :mod:`h3gate.ops.cases_rows`, the GEMM, LoRA and attention rows in :mod:`h3gate.ops.cases_gemm`."""

from __future__ import annotations

import torch

from h3gate.errors import InputError
from h3gate.manifests.model_config import ModelConfig
from h3gate.ops import cases_gemm, cases_rows
from h3gate.ops.case import CaseBuilder, OpCase


def _merged() -> dict[str, CaseBuilder]:
    clash = sorted(set(cases_rows.CASES) & set(cases_gemm.CASES))
    if clash:
        raise RuntimeError(f"case builders declared twice: {', '.join(clash)}")
    return {**cases_rows.CASES, **cases_gemm.CASES}


CASES: dict[str, CaseBuilder] = _merged()


def build_case(op: str, rows: int, cfg: ModelConfig, device: str | torch.device, seed: int) -> OpCase:
    if op not in CASES:
        raise InputError(f"operator {op!r}: no case builder (known: {', '.join(sorted(CASES))})")
    if rows < 1:
        raise InputError(f"operator {op}: rows must be >= 1, got {rows}")
    return CASES[op](rows, cfg, device, seed)
