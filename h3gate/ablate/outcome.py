"""What a check or multi-rank ablation observed (an arm-pair row's observation is its stream comparison)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    """The observed result, its reason or first-drift signature, and what the row's evidence should carry."""

    result: str
    reason: str | None = None
    signature: dict | None = None
    comparison: object | None = None
    notes: list[str] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
