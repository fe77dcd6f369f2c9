"""Teacher forcing: the isolated view of SGLang's nodes in one forward.

At every point of a node map (:mod:`.capture`, :mod:`.block`), once its value is recorded, :class:`Forcing`
overwrites it in place with the provider's value of the point's node mapped back into SGLang's layout (the inverse
of the capture's transform), so every later point reads the provider's upstream values and records the node's own
arithmetic on the provider's inputs:

    capture (SGLang -> h3gate)                      inverse (h3gate -> SGLang), written in place
    qkv_proj out: columns j nd .. (j + 1) nd        the provider's q / k / v into those columns (re-fused)
    fc1 out [gate | value] -> [value | gate]        [u[..., F:] | u[..., :F]] (the swap is its own inverse)
    video_out in: the FP32 copy cast to BF16        the BF16 value widened to FP32 (exact) into the FP32 copy
    packed rows (L, ...) -> [:B S] -> (B, S, ...)   (B, S, ...) -> (B S, ...) into rows 0 .. B S - 1 (padding kept)
    text / video / audio rows, calls concatenated   (B, N, ...) flattened, each call takes its next rows
    timestep rows (T, ...)                          as they are

The overwrite is in place, not a replaced return value, so it reaches every reader of the tensor: a block's gated
residual reads the very tensor that is norm2's input (``residual_mlp`` reads the provider's ``residual_attn``), the
final layer's FP32 copy feeds both heads (``heads.audio_proj`` reads the provider's ``final.norm_out``), a forward
pre-hook's argument is the caller's tensor. A node's isolated value is exact when every node it reads was replaced
whole; :func:`isolation_gaps` names the others with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from h3gate.adapters.sglang.points import Key, Point, point_key
from h3gate.errors import InputError
from h3gate.graph.core import Node
from h3gate.manifests.model_config import ModelConfig


def _region(value: torch.Tensor, p: Point, cfg: ModelConfig) -> torch.Tensor:
    """The view of the point's value that holds the node: a third of the fused q/k/v columns, else all of it."""
    if p.where == "out" and p.part in ("q", "k", "v"):
        nd = cfg.num_attention_heads * cfg.attention_head_dim
        j = "qkv".index(p.part)
        return value[..., j * nd : (j + 1) * nd]
    return value


def _inverse(rows: torch.Tensor, p: Point, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """h3gate's columns in SGLang's order and dtype: the fc1 halves swapped back, the BF16 rows widened."""
    if p.part == "swap":
        f = cfg.ffn_dim
        return torch.cat((rows[..., f:], rows[..., :f]), dim=-1)
    return rows.to(dtype) if p.part == "bf16" else rows


class Forcing:
    """The in-place overwrite of every point whose node has a provider value (a :class:`~.capture.Recorder`'s
    ``force``); ``rows`` gives each node's row kind (``packed``, ``timestep``, ``text``, ``video``, ``audio``)."""

    def __init__(
        self,
        points: Sequence[Point],
        provider: Mapping[str, torch.Tensor],
        rows: Mapping[str, str],
        cfg: ModelConfig,
    ) -> None:
        self.provider, self.rows, self.cfg = provider, rows, cfg
        self.by_key: dict[Key, list[Point]] = {}
        for p in points:
            if p.where != "model" and p.node in provider:
                self.by_key.setdefault(point_key(p), []).append(p)
        self.written: dict[str, int] = {}  # node -> rows of its provider value written so far

    def __call__(self, key: Key, value: torch.Tensor) -> None:
        for p in self.by_key.get(key, ()):
            self._write(p, value)

    def _write(self, p: Point, value: torch.Tensor) -> None:
        src, kind = self.provider[p.node], self.rows[p.node]
        region = _region(value, p, self.cfg)
        if kind == "timestep":
            start, rows, target = 0, src, region
        else:
            flat = src.reshape(-1, *src.shape[2:])
            start = 0 if kind == "packed" else self.written.get(p.node, 0)
            rows = flat if kind == "packed" else flat[start : start + region.shape[0]]
            target = region[: rows.shape[0]]
        want = torch.bfloat16 if p.part == "bf16" else region.dtype
        if src.dtype != want or rows.shape != target.shape:
            have = f"{tuple(src.shape)} {src.dtype}"
            raise InputError(
                f"sglang isolated: {p.node}: the provider's value ({have}) does not fit SGLang's {p.module} "
                f"{p.where} ({tuple(region.shape)} {region.dtype}, rows {kind})"
            )
        target.copy_(_inverse(rows, p, self.cfg, region.dtype))
        self.written[p.node] = start + rows.shape[0]

    def complete(self, node: str) -> bool:
        """Whether the provider's whole value of ``node`` was written."""
        src = self.provider.get(node)
        if src is None or node not in self.written:
            return False
        total = src.shape[0] if self.rows[node] == "timestep" else src.shape[0] * src.shape[1]
        return self.written[node] == total

    def why(self, node: str, uncovered: Mapping[str, str]) -> str:
        if node not in self.provider:
            return "no provider value was given"
        if node in uncovered:
            return f"its point did not fire: {uncovered[node]}"
        return "its point took only part of the provider's value"


def isolation_gaps(nodes: Sequence[Node], uncovered: Mapping[str, str], forcing: Forcing) -> dict[str, str]:
    """Node -> why its isolated value is not available exactly, in graph order: the capture's own reasons, and every
    node reading a node that was not replaced whole (its value then carries that input's drift)."""
    names = {n.name for n in nodes}
    gaps: dict[str, str] = {}
    for node in nodes:
        if node.name in uncovered:
            gaps[node.name] = uncovered[node.name]
            continue
        bad = next((k for k in node.inputs if k in names and not forcing.complete(k)), None)
        if bad is not None:
            gaps[node.name] = f"input {bad} is not the provider's value ({forcing.why(bad, uncovered)})"
    return gaps
