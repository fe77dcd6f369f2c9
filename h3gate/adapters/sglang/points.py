"""A point of the node map: where one h3gate node is read in SGLang's DiT (:mod:`.capture` lists them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """Where one h3gate node is read: SGLang module ``module``, ``where`` in ``out`` / ``in`` / ``varlen`` /
    ``model``, ``part`` picks a slice (``q``/``k``/``v`` of the fused projection or of the varlen call, ``swap`` the
    fc1 halves, ``bf16`` the exact cast back, ``0``/``1`` the model's outputs)."""

    node: str
    module: str
    where: str
    part: str = ""


Key = tuple[str, str, str]  # (module, where, part for varlen / model points, else "")


def point_key(p: Point) -> Key:
    return (p.module, p.where, p.part if p.where in ("varlen", "model") else "")
