"""The ablation engine: the shared context, the lockstep comparison of two arms' streams (first drift) and the
verdict against an ablation row (:mod:`h3gate.ablate.runner` runs a row).

First drift is the first tensor, in execution order, whose probe bytes differ from the strict bytes: over steps
(trajectory), stages and layers, nodes, then the first differing packed row and its modality. Before comparison the
probe value is aligned: its compared batch item is selected (``Arm.batch_row``), and under a row permutation its
packed rows are put back in logical order (``value[argsort(row_perm)]``; row-id metadata is mapped through
``row_perm``). Metadata tensors (``meta.*``, ``schedule.*``) are compared and reported separately: a row's observed
result is decided by the nodes, i.e. by what the model and the samplers computed.

Verdict: the observed result must equal the expected one; for ``EXPECTED_DRIFT`` every given signature field must
match (``node``/``modality`` exactly, ``layer``/``step`` exactly, ``row`` after resolving ``<group>[k]``); ``any``
and absent fields are recorded, not checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import zip_longest

import torch

from h3gate.ablate.arms import Arm, Stream
from h3gate.errors import InputError
from h3gate.gate.compare import bitwise_equal, differing_rows, error, tensor_sha256
from h3gate.graph.core import Graph, Node, OpTable
from h3gate.graph.inputs import TimestepPlan
from h3gate.graph.model import OUTPUTS, load_model_params
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.ablations import ANY, ROW_SYMBOL, AblationRow, Signature
from h3gate.manifests.model_config import ModelConfig
from h3gate.memory import BIG_MODEL_PARAMS
from h3gate.runs.setup import RunSpec, prepare
from h3gate.synth import SyntheticSource, layout_variant
from h3gate.trajectory import Recipe, Request, make_request

HASHED = (*OUTPUTS, "scheduler.video_step", "scheduler.audio_step", "init.condition_rows")


class NonComparable(Exception):
    """The arms cannot be compared (mis-owned metadata, different programs): the row's observed result is REJECTED."""


@dataclass
class Context:
    """What every arm of one invocation shares: config, layout, weights, base op table, sampler and request seeds."""

    cfg: ModelConfig
    layout: PackedLayout
    device: str
    seed: int
    graph: Graph
    params: dict[str, torch.Tensor]
    ops: OpTable
    recipe: Recipe
    plan: dict
    execution: dict
    config_name: str = "tiny"
    checkpoint: str | None = None
    source_factory: Callable[[int, str], object] | None = None
    cache: dict = field(default_factory=dict)
    variant: str = "transformer"
    manifests: list = field(default_factory=list)  # what the run's setup read (provenance)

    def variant_source(self, seed: int, variant: str | None = None):
        """Synthetic weights of the same config: ``seed`` of ``variant`` (default: this run's variant, the layout
        task's: ``transformer_ref`` for ref2va; ``transformer`` otherwise)."""
        if self.source_factory is None:
            raise InputError("this run has no second weight source for a variant probe")
        return self.source_factory(seed, variant or self.variant)

    def request(self, item: int = 0) -> Request:
        key = ("request", self.layout.name, item)
        if key not in self.cache:
            self.cache[key] = make_request(self.layout, self.cfg, self.seed, item, self.device)
        return self.cache[key]

    def base_arm(self) -> Arm:
        return Arm(self.layout, self.params, self.ops, (self.request(0),), self.recipe)

    def resolve_packed_row(self, row: int | str) -> int:
        return resolve_packed_row(self.layout, row)

    def with_anchors(self, anchors: list[str]) -> Context:
        """The same context on this layout with ``anchors`` (for rows that need condition rows), cached; a layout
        that already has video condition rows (keyframe anchors, or a Ref2VA layout's reference rows, which the
        pipeline noises the same way) is used as it is."""
        if not anchors or list(self.layout.spec.anchors) or self.layout.num_condition_video_rows > 0:
            return self
        key = ("anchors", tuple(anchors))
        if key not in self.cache:
            spec = self.layout.spec.model_copy(update={"anchors": list(anchors), "seq_len": None})
            layout = build_layout(spec, f"{self.layout.name}+{'+'.join(anchors)}")
            self.cache[key] = replace(self, layout=layout)
        return self.cache[key]


def resolve_packed_row(layout: PackedLayout, row: int | str) -> int:
    """A packed row: an integer, or ``<group>[k]`` against ``layout``'s index tensors (``*_target`` skip conditions)."""
    if isinstance(row, int):
        return row
    match = ROW_SYMBOL.match(row)
    if match is None:
        raise InputError(f"row {row!r}: expected an integer or <group>[k]")
    group, k = match.group(1), int(match.group(2))
    if group == "media":
        n_text = int(layout.text_indices.numel())
        if not 0 <= k < layout.seq_len - n_text:
            raise InputError(f"row {row!r}: layout {layout.name!r} has {layout.seq_len - n_text} rows after the text")
        return n_text + k
    skip = {"video_target": layout.num_condition_video_rows, "audio_target": layout.num_condition_audio_rows}
    indices = getattr(layout, f"{group.split('_')[0]}_indices")[skip.get(group, 0) :]
    if not -indices.numel() <= k < indices.numel():
        raise InputError(f"row {row!r}: layout {layout.name!r} has {indices.numel()} {group} rows")
    return int(indices[k])


# -- comparison ----------------------------------------------------------------------------------------------------


def align(node: Node, value: torch.Tensor, arm: Arm) -> torch.Tensor:
    """The arm's value in the strict arm's terms: compared batch item selected, permuted rows put back in order."""
    if node.row_dim == 1 and value.ndim >= 2:
        value = value[arm.batch_row : arm.batch_row + 1]
    if arm.row_perm is not None:
        perm = arm.row_perm.to(value.device)
        if node.meta.get("values") == "row_ids":
            value = perm[value]
        elif node.meta.get("rows") == "packed" and node.row_dim is not None:
            value = value.index_select(node.row_dim, torch.argsort(perm))
    return value


def _packed_row(layout: PackedLayout, space: str, local: int) -> int | None:
    if space == "packed":
        return local
    if space in ("text", "video", "audio"):
        return int(getattr(layout, f"{space}_indices")[local])
    return None


def localise(node: Node, strict: torch.Tensor, probe: torch.Tensor, layout: PackedLayout) -> dict:
    """Where ``probe`` first differs from ``strict`` at ``node``: packed row, modality, extent."""
    space = node.meta.get("rows", "none")
    record = {
        "node": node.name,
        "layer": node.layer,
        "step": node.step,
        "stage": node.meta.get("stage"),
        "row": None,
        "local_row": None,
        "row_space": space,
        "modality": None,
        "rows_differing": None,
        "max_abs": None,
        "rel_l2": None,
    }
    if strict.shape != probe.shape or strict.dtype != probe.dtype:
        record["why"] = f"shape/dtype {tuple(probe.shape)} {probe.dtype} vs {tuple(strict.shape)} {strict.dtype}"
        return record
    rows = differing_rows(probe, strict, node.row_dim)
    if rows is not None and rows.numel():
        local = int(rows[0])
        packed = _packed_row(layout, space, local)
        record.update(local_row=local, row=packed, rows_differing=int(rows.numel()))
        if packed is not None:
            record["modality"] = space if space in ("text", "video", "audio") else layout.row_modalities()[packed]
    record.update(error(probe, strict))
    return record


@dataclass
class Comparison:
    first_drift: dict | None = None
    nodes_compared: int = 0
    nodes_drifting: int = 0
    metadata_drift: list[dict] = field(default_factory=list)
    outputs: dict[str, dict] = field(default_factory=dict)
    hashes: dict[str, list[dict]] = field(default_factory=lambda: {"strict": [], "probe": []})

    def arm_sha256(self, side: str) -> str:
        """sha256 over the arm's hashed tensors (outputs, scheduler updates) in execution order."""
        h = hashlib.sha256()
        for entry in self.hashes[side]:
            h.update(f"{entry['step']}:{entry['node']}:{entry['sha256']};".encode())
        return h.hexdigest()


def compare_streams(strict: Stream, probe: Stream, strict_arm: Arm, probe_arm: Arm, layout: PackedLayout) -> Comparison:
    """Walk both streams in lockstep; the first non-bitwise node is the first drift (metadata reported apart)."""
    out = Comparison()
    for pair_s, pair_p in zip_longest(strict, probe, fillvalue=(None, None)):
        (ns, vs), (np_, vp) = pair_s, pair_p
        if ns is None or np_ is None or (ns.name, ns.step) != (np_.name, np_.step):
            where = lambda n: "end of run" if n is None else f"{n.name} (step {n.step})"  # noqa: E731
            raise NonComparable(f"the arms ran different programs: strict {where(ns)} vs probe {where(np_)}")
        a, b = align(ns, vs, strict_arm), align(np_, vp, probe_arm)
        same = a.shape == b.shape and bitwise_equal(b, a)
        if ns.name in HASHED:
            for side, value in (("strict", a), ("probe", b)):
                out.hashes[side].append({"node": ns.name, "step": ns.step, "sha256": tensor_sha256(value)})
        if ns.name in OUTPUTS or ns.name.startswith("scheduler.") or ns.name.startswith("grad.input"):
            key = ns.name if ns.step is None else f"{ns.name}@{ns.step}"
            rows = None if same or a.shape != b.shape else differing_rows(b, a, ns.row_dim)
            out.outputs[key] = {
                "bitwise": same,
                "rows_differing": 0 if same else (None if rows is None else int(rows.numel())),
                **({} if same or a.shape != b.shape else error(b, a)),
            }
        if ns.meta.get("kind") == "metadata":
            if not same:
                rec = localise(ns, a, b, layout)
                out.metadata_drift.append({k: rec[k] for k in ("node", "step", "row", "modality", "rows_differing")})
            continue
        out.nodes_compared += 1
        if not same:
            out.nodes_drifting += 1
            if out.first_drift is None:
                out.first_drift = localise(ns, a, b, layout)
    return out


# -- verdict -------------------------------------------------------------------------------------------------------


def signature_mismatches(expected: Signature, observed: dict, layout: PackedLayout) -> list[str]:
    """Each given, non-``any`` field of ``expected`` that ``observed`` does not match, as a sentence."""
    problems = []
    for name in ("node", "layer", "step", "modality"):
        want = getattr(expected, name)
        if want is not None and want != ANY and observed.get(name) != want:
            problems.append(f"{name}: expected {want!r}, observed {observed.get(name)!r}")
    if expected.row is not None and expected.row != ANY:
        want = resolve_packed_row(layout, expected.row)
        if observed.get("row") != want:
            problems.append(f"row: expected {expected.row} = packed row {want}, observed {observed.get('row')!r}")
    return problems


def judge(ablation: AblationRow, observed_result: str, observed_sig: dict | None, layout: PackedLayout) -> list[str]:
    """Every way the observation misses the row's expectation (empty: the row passes)."""
    if observed_result != ablation.expected.result:
        return [f"result: expected {ablation.expected.result}, observed {observed_result}"]
    if observed_result == "EXPECTED_DRIFT" and ablation.expected.signature is not None:
        return signature_mismatches(ablation.expected.signature, observed_sig or {}, layout)
    return []


def param_drift(strict: dict, probe: dict, limit: int = 16) -> list[str]:
    """Names of the parameters whose bytes differ between the arms (the weights a probe swapped), first ``limit``."""
    if strict is probe:
        return []
    names = [n for n in strict if n not in probe or not (strict[n] is probe[n] or bitwise_equal(probe[n], strict[n]))]
    return names[:limit]


def device_synthetic_source(cfg: ModelConfig, seed: int, device: str, variant: str = "transformer"):
    """Synthetic weights drawn with ``device``'s own generator (same names, shapes, dtypes and init rules as the
    CPU-seeded :class:`h3gate.synth.SyntheticSource`; the values differ). A real-size model is drawn in seconds on a
    GPU instead of minutes on a CPU; both arms of every row read the same tensors."""

    return SyntheticSource(cfg, seed, generator_device=device, variant=variant)


def build_context(
    config: str, layout: str, device: str, seed: int = 0, mode: str = "off", steps: int = 4, checkpoint=None
) -> Context:
    """The shared context on a prepared whole-model run (:func:`h3gate.runs.setup.prepare`): its config, layout,
    graph and bindings (``mode`` on ``device``), every parameter loaded, the strict arm's op table."""

    ckpt = None if checkpoint is None else str(checkpoint)
    run = prepare(RunSpec("model", layout, config, ckpt, device, seed, mode, draw="device"))
    cfg, packed, variant = run.cfg, run.layout, layout_variant(run.layout.spec.kind)
    ops = run.tables()["candidate"]
    per_op = {b.op: b.record() for nb in run.bindings.values() for b in nb.bindings}
    on_device = device != "cpu" and checkpoint is None

    def factory(s: int, v: str):
        return device_synthetic_source(cfg, s, device, v) if on_device else SyntheticSource(cfg, s, variant=v)

    params = load_model_params(run.source, cfg, device)
    drawn = f" drawn on {device}'s generator" if on_device else " (CPU-seeded)"
    weights = f"synthetic seed {seed} {variant}/{drawn}"
    execution = {
        "mode": mode,
        "device": device,
        "weights": f"checkpoint {checkpoint}" if checkpoint is not None else weights,
        "ops": per_op,
        "triton_ops": sorted(op for op, rec in per_op.items() if rec["actual"] == "triton"),
        "provider_ops": sorted(op for op, rec in per_op.items() if rec["actual"] == "provider"),
        "outside_graph": "sampler arithmetic (sigma grid, Euler step, noise mix) runs h3gate.schedule (the reference)",
    }
    ctx = Context(cfg, packed, device, seed, run.graph, params, ops, Recipe(steps=steps), TimestepPlan().resolve(),
                  execution, config, ckpt, factory, variant=variant, manifests=list(run.manifests))  # fmt: skip
    if sum(p.numel() for p in params.values()) > BIG_MODEL_PARAMS:  # H-C6 on a real-size model: bounded gradients
        last = f"transformer_blocks.{cfg.num_layers - 1}."
        ctx.cache["grad_params"] = [
            n
            for n in params
            if not n.startswith("transformer_blocks.") or n.startswith(("transformer_blocks.0.", last))
        ]
    return ctx
