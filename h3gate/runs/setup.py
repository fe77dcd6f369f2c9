"""The one run setup: a verb's options (:class:`RunSpec`) resolved once into a :class:`Run` that every engine takes.

:func:`prepare` is the only place a run's config, weight source, layout, graph, bindings, memory plan and the list
of manifests it read are resolved. It checks the cheap things first (device, mode, merge order, scope, config,
layout, a layer range, the weights the graph reads, memory), binds every op of every node (so strict mode fails
closed, naming the node, before any weight is read), then reads what the scope needs: block 0's parameters and
inputs, or the whole model's inputs with its weights read one stage at a time. The mode and merge order are decided
here, once: :meth:`Run.tables` hands out the provider, candidate and golden op tables every engine runs.

A :class:`RunSpec` is plain data (``record`` / ``from_record``), so a ``run ws2`` rank or a torchrun shard rebuilds
the same run from it in its own process through the same :func:`prepare`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from h3gate.checkpoint import VARIANT_FOLDERS, open_checkpoint
from h3gate.errors import InputError
from h3gate.graph.block import block_params, build_block_graph
from h3gate.graph.core import Graph, OpTable
from h3gate.graph.executions import NodeBinding, bind_graph, candidate_table, golden_table, provider_table
from h3gate.graph.inputs import BlockInputs, build_block_inputs
from h3gate.graph.model import RawMetadata, build_model_graph
from h3gate.graph.stages import Stage, split_stages
from h3gate.inventory import expected_inventory
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.layouts import LAYOUTS_FILE, load_layout
from h3gate.manifests.model_config import ModelConfig, config_names, load_config
from h3gate.memory import require
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.ops.registry import check_merge
from h3gate.paths import MANIFESTS
from h3gate.runs.candidate import check_candidate, sglang_candidate
from h3gate.runs.memory_plan import (
    GateNeeds,
    MemoryPlan,
    check_memory,
    model_fault_matrix_bytes,
    model_lower_bound_bytes,
    plan_block_memory,
    row_stages,
    saved_values_bytes,
    transformer_blocks,
)
from h3gate.runs.model_memory import hold_on_host, plan_model_memory, trajectory_lower_bound_bytes
from h3gate.runs.model_stages import StageWeights, model_inputs
from h3gate.synth import SyntheticSource, layout_variant

LAYER = 0  # the block the one-block gate runs
SCOPES = ("block", "model")
DRAWS = ("cpu", "device")
# where the gates draw a scope's synthetic weights: a block on the CPU (the same values on every device), the model
# on the run's device (a 33B model is not drawn on a CPU); every verb of one scope draws alike, so their files compare
SCOPE_DRAW = {"block": "cpu", "model": "device"}
UNRELATED_ITEMS = 2  # batch placements need at most two unrelated requests (a batch of 3)


@dataclass(frozen=True)
class RunSpec:
    """What decides a run, as a verb's options say it. ``scope``: ``block`` (block 0 as 17 nodes) or ``model`` (the
    whole transformer, or blocks ``layers`` = ``"A:B"`` of it); ``blocks``: a model of the config's first N blocks
    (``run arms --layers``); ``draw``: synthetic weights drawn by the CPU's seeded generator (the same values on
    every device) or by the run's device (a 33B model is not drawn on a CPU; values are per device kind).
    ``candidate``: what the gates judge, ``h3gate`` (its bound operators) or ``sglang`` (SGLang's MiniMax-H3 DiT at
    request quality ``sglang_quality``, attention backend ``sglang_attention`` or SGLang's default for the device;
    :mod:`h3gate.runs.candidate`)."""

    scope: str = "block"
    layout: str = "tiny"
    config: str | None = None
    checkpoint: str | None = None
    device: str = "cpu"
    seed: int = 0
    mode: str = "strict"
    merge: str = DEFAULT_MERGE_ORDER
    layers: str | None = None
    blocks: int | None = None
    draw: str = SCOPE_DRAW["block"]
    candidate: str = "h3gate"
    sglang_quality: str = "lossless"
    sglang_attention: str | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunSpec:
        return cls(**record)

    def with_(self, **changes: Any) -> RunSpec:
        return replace(self, **changes)


@dataclass(frozen=True)
class ModelNeeds:
    """What a whole-model gate holds at once, for its memory bound: ``lanes`` executions advanced together, the
    backward's saved stage inputs, ``--save-tensors``' host copy of every node value, and what ``--fault-matrix``
    keeps. For the upper estimate: ``providers`` the provider lanes among them (the default and the variants this
    device runs); ``evaluation_batch`` set: a trajectory's one candidate evaluation of that many requests, every
    weight resident (:mod:`h3gate.runs.model_memory`)."""

    lanes: int = 12
    backward: bool = True
    save_tensors: bool = False
    fault_matrix: bool = False
    providers: int = 7
    evaluation_batch: int | None = None


@dataclass
class BlockData:
    """Block 0 of a ``block`` run: its parameters (block-relative names) and the graph inputs."""

    params: dict[str, torch.Tensor]
    inputs: BlockInputs


@dataclass
class ModelData:
    """A ``model`` run: the blocks it covers, its stages, their weights read on demand, the request's graph inputs
    and those of unrelated requests (batch placements)."""

    layers: tuple[int, int]
    stages: list[Stage]
    weights: StageWeights
    inputs: dict[str, torch.Tensor]
    unrelated: list[dict[str, torch.Tensor]]
    raw: RawMetadata | None = None  # the request's metadata before derivation (what a second engine is fed)


@dataclass
class Run:
    """Everything a run needs, resolved and checked once (module docstring)."""

    spec: RunSpec
    config_name: str
    cfg: ModelConfig
    layout: PackedLayout
    source: Any
    checkpoint: dict
    manifests: list[Path]
    graph: Graph = None  # type: ignore[assignment]  # set by prepare before the run is handed out
    bindings: dict[str, NodeBinding] = field(default_factory=dict)
    memory: MemoryPlan | None = None
    block: BlockData | None = None
    model: ModelData | None = None
    sglang: Any = None  # the SGLang candidate (runs.candidate.sglang_candidate) of a run whose candidate is sglang
    cache: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def seed(self) -> int:
        return self.spec.seed

    def tables(self) -> dict[str, OpTable]:
        """The three executions' op tables: ``provider`` (the references), ``candidate`` (the bound operators: the
        references themselves in mode off) and ``golden`` (the references for float64 tensors)."""
        return {"provider": provider_table(), "candidate": candidate_table(self.bindings), "golden": golden_table()}

    def candidate(self, overrides=None) -> OpTable:
        return candidate_table(self.bindings, overrides)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Block 0's parameters (a ``block`` run)."""
        return self._block.params

    @property
    def inputs(self) -> Any:
        """The graph inputs: :class:`~h3gate.graph.inputs.BlockInputs` of a ``block`` run, the request's tensors of a
        ``model`` run."""
        return self._block.inputs if self.spec.scope == "block" else self._model.inputs

    @property
    def stages(self) -> list[Stage]:
        return self._model.stages

    @property
    def weights(self) -> StageWeights:
        return self._model.weights

    @property
    def unrelated(self) -> list[dict[str, torch.Tensor]]:
        return self._model.unrelated

    @property
    def layers(self) -> tuple[int, int]:
        return self._model.layers

    @property
    def complete(self) -> bool:
        return self._model.layers == (0, self.cfg.num_layers)

    @property
    def _block(self) -> BlockData:
        if self.block is None:
            raise ValueError(f"a {self.spec.scope} run has no block data")
        return self.block

    @property
    def _model(self) -> ModelData:
        if self.model is None:
            raise ValueError(f"a {self.spec.scope} run has no model data")
        return self.model


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
        return device
    raise InputError(f"--device {device!r}: must be cpu or cuda")


def config_for(
    config: str | None, checkpoint: Path | str | None, seed: int, task: str = "t2va"
) -> tuple[str, ModelConfig, object, dict, list]:
    """(config name, config, weight source, checkpoint record, manifests read): a named config over synthetic
    weights (default ``tiny``) of the layout task's variant (``synth.layout_variant``: ``transformer_ref`` for
    ref2va), or a checkpoint whose ``config.json`` must match ``config`` when both are given (its variant is its
    folder's name when that is ``transformer`` or ``transformer_ref``)."""

    manifests: list[Path] = []
    named = None
    if config is not None:
        named = load_config(config)
        path = Path(config) if Path(config).suffix in (".yaml", ".yml") else MANIFESTS / "configs" / f"{config}.yaml"
        manifests.append(path)
    if checkpoint is None:
        manifest = named or load_config("tiny")
        if named is None:
            manifests.append(MANIFESTS / "configs" / "tiny.yaml")
        source = SyntheticSource(manifest.config, seed, variant=layout_variant(task))
        return manifest.name, manifest.config, source, source.record(), manifests
    source = open_checkpoint(checkpoint)
    cfg = source.config()
    if named is not None and named.config != cfg:
        diff = next(k for k in type(cfg).model_fields if getattr(cfg, k) != getattr(named.config, k))
        raise InputError(
            f"--config {config}: {diff} {getattr(named.config, diff)} does not match the checkpoint's "
            f"config.json ({getattr(cfg, diff)})"
        )
    name = named.name if named is not None else next((n for n in config_names() if load_config(n).config == cfg), None)
    folder = Path(checkpoint).resolve().name
    variant = folder if folder in VARIANT_FOLDERS else None
    record = {"kind": "checkpoint", "path": str(checkpoint), "seed": None, "variant": variant}
    return name or "checkpoint", cfg, source, record, manifests


def parse_layers(spec: str | None, cfg: ModelConfig) -> tuple[int, int]:
    """``A:B`` -> blocks ``A .. B-1`` (default all); outside the model -> InputError naming it."""
    if spec is None:
        return 0, cfg.num_layers
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InputError(f"--layers {spec!r}: expected A:B (blocks A .. B-1), e.g. 0:{cfg.num_layers}")
    a, b = int(parts[0]), int(parts[1])
    if not 0 <= a < b <= cfg.num_layers:
        raise InputError(f"--layers {spec}: outside the model (0 <= A < B <= {cfg.num_layers} blocks)")
    return a, b


def check_weights(source, stages: list[Stage], cfg: ModelConfig, what: str) -> int:
    """Every tensor the stages read is in ``source`` with its inventory shape and dtype; returns the count."""
    have = set(source.names())
    specs = {s.name: s for s in expected_inventory(cfg)}
    count = 0
    for stage in stages:
        for name in stage.param_names(list(specs)):
            if name not in have:
                layer = "" if stage.layer is None else f" (layer {stage.layer})"
                raise InputError(f"{what}: {name}: missing{layer}")
            shape, dtype = source.meta(name)
            spec = specs[name]
            if tuple(shape) != tuple(spec.shape) or dtype != spec.dtype:
                raise InputError(f"{what}: {name}: {tuple(shape)} {dtype}, expected {tuple(spec.shape)} {spec.dtype}")
            count += 1
    return count


def _first_blocks(spec: RunSpec, cfg: ModelConfig, source, ckpt: dict) -> tuple[ModelConfig, object, dict]:
    """The config cut to its first ``spec.blocks`` blocks (synthetic weights redrawn for it)."""

    if not 1 <= spec.blocks <= cfg.num_layers:
        raise InputError(f"--layers {spec.blocks}: must be in 1..{cfg.num_layers} (the config's blocks)")
    cfg = cfg.model_copy(update={"num_layers": spec.blocks})
    if ckpt["kind"] == "synthetic":
        source = SyntheticSource(cfg, spec.seed, variant=source.variant)
        ckpt = source.record()
    return cfg, source, ckpt


def prepare(spec: RunSpec, needs: GateNeeds | ModelNeeds | None = None, read: bool = True) -> Run:
    """Resolve and check everything of ``spec`` (module docstring; bad input -> InputError before any weight is
    read). ``needs`` plans memory: :class:`~h3gate.runs.memory_plan.GateNeeds` for the one-block gate (else a
    whole execution is bounded), :class:`ModelNeeds` for a whole-model gate (else nothing is bounded). With
    ``read=False`` nothing is read yet (a plan that only checks; :func:`read_inputs` reads later)."""
    check_device(spec.device)
    check_merge(spec.merge)
    if spec.scope not in SCOPES:
        raise InputError(f"scope {spec.scope!r}: must be one of {', '.join(SCOPES)}")
    if spec.draw not in DRAWS:
        raise InputError(f"draw {spec.draw!r}: must be one of {', '.join(DRAWS)}")
    check_candidate(spec)
    layout_spec = load_layout(spec.layout)
    config_name, cfg, source, ckpt, manifests = config_for(spec.config, spec.checkpoint, spec.seed, layout_spec.kind)
    if spec.blocks is not None:
        cfg, source, ckpt = _first_blocks(spec, cfg, source, ckpt)
    packed = build_layout(layout_spec, spec.layout)
    run = Run(spec, config_name, cfg, packed, source, ckpt, manifests)
    if spec.scope == "block":
        _prepare_block(run, needs)
    else:
        _prepare_model(run, needs)
    run.manifests += [LAYOUTS_FILE, *sorted((MANIFESTS / "operators").glob("*.yaml"))]
    if read:
        read_inputs(run)
    return run


def read_inputs(run: Run) -> Run:
    """Read what the run's scope holds (after every check): block 0's parameters and inputs, or the request's
    graph inputs with the stage weights read on demand; synthetic weights drawn as ``spec.draw`` says."""
    spec, cfg, packed, device = run.spec, run.cfg, run.layout, run.device
    if spec.draw == "device" and run.checkpoint["kind"] == "synthetic" and device != "cpu":
        run.source = run.source.drawn_on(device)
        run.checkpoint = run.source.record()
    if spec.scope == "block":
        params = block_params(run.source, LAYER, device)
        run.block = BlockData(params, build_block_inputs(packed, cfg, run.source, spec.seed, device))
        run.sglang = sglang_candidate(run, LAYER)
        return run
    inputs, extra = model_inputs(packed, cfg, spec.seed, device)
    unrelated = []
    for item in range(1, UNRELATED_ITEMS + 1):
        other, _ = model_inputs(packed, cfg, spec.seed, device, item)
        unrelated.append({k: other[k] for k in ("video_rows", "audio_rows", "text")})
    span = parse_layers(spec.layers, cfg)
    run.model = ModelData(span, split_stages(run.graph), StageWeights(run.source, device), inputs, unrelated,
                          extra["raw"])  # fmt: skip
    run.sglang = sglang_candidate(run, LAYER)
    return run


def _prepare_block(run: Run, needs: GateNeeds | ModelNeeds | None) -> None:
    spec, cfg, packed = run.spec, run.cfg, run.layout
    if needs is None:
        check_memory(cfg, packed, spec.layout, run.config_name, run.device)
    else:
        run.memory = plan_block_memory(cfg, packed, spec.layout, run.config_name, run.device, needs)
    run.graph = build_block_graph(cfg, LAYER)
    run.bindings = bind_graph(run.graph, spec.mode, run.device, spec.merge)


def _prepare_model(run: Run, needs: GateNeeds | ModelNeeds | None) -> None:
    spec, cfg, packed, device = run.spec, run.cfg, run.layout, run.device
    span = parse_layers(spec.layers, cfg)
    run.graph = build_model_graph(cfg, span)
    stages = split_stages(run.graph)
    what = f"--checkpoint {spec.checkpoint}" if spec.checkpoint is not None else "synthetic weights"
    check_weights(run.source, stages, cfg, what)
    if isinstance(needs, ModelNeeds):
        at = f"--layout {spec.layout} --config {run.config_name} (S={packed.seq_len})"
        hold = needs.evaluation_batch is None and hold_on_host(cfg, packed.seq_len, needs.providers, needs.backward,
                                                               device)  # fmt: skip
        if needs.evaluation_batch is None:
            packed_stages = row_stages(transformer_blocks(stages))
            need = model_lower_bound_bytes(cfg, packed.seq_len, packed_stages, needs.lanes, needs.backward, hold)
            need += model_fault_matrix_bytes(cfg, packed.seq_len) if needs.fault_matrix and needs.backward else 0
            require(need, f"ws1-model {at}", device, hint="use a smaller layout, --layers or --no-backward")
        else:  # a trajectory: every weight resident, one evaluation's values
            need = trajectory_lower_bound_bytes(cfg, packed.seq_len, needs.evaluation_batch)
            require(need, f"ws1-trajectory {at}", device, hint="use a smaller layout")
        saved = saved_values_bytes(cfg, packed.seq_len, stages, needs.backward) if needs.save_tensors else 0
        if needs.save_tensors:
            grads = " and the candidate's gradients" if needs.backward else ""
            require(saved, f"--save-tensors at --layout {spec.layout} --config {run.config_name} (every node's "
                    f"values, three executions{grads})", "cpu", hint="bound it with --layers")  # fmt: skip
        run.memory = plan_model_memory(cfg, packed.seq_len, len(stages), needs.providers, needs.backward,
                                       needs.evaluation_batch, device, need, saved, hold)  # fmt: skip
    run.bindings = bind_graph(run.graph, spec.mode, device, spec.merge)
