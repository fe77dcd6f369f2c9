"""One setup for every engine that runs the block: config, weights, layout, graph and bindings, resolved once.

:func:`prepare` checks the cheap things first (device, mode, config, layout, a lower bound on memory), builds the
graph and binds every op of every node (so strict mode fails closed, naming the node, before any weight is read),
then reads the block parameters and builds the block inputs. It records every manifest it read; the engines pass
the bindings down instead of binding again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gate.errors import InputError
from h3gate.graph.block import BLOCK_NODES, block_params, build_block_graph, row_widths
from h3gate.graph.core import Graph
from h3gate.graph.execute import live_at
from h3gate.graph.executions import NodeBinding, bind_graph
from h3gate.graph.inputs import BlockInputs, build_block_inputs
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.layouts import LAYOUTS_FILE, load_layout
from h3gate.manifests.model_config import ModelConfig, config_names, load_config
from h3gate.memory import GIB
from h3gate.memory import host_available_bytes as available_memory_bytes
from h3gate.ops.registry import check_mode
from h3gate.paths import MANIFESTS

LAYER = 0


@dataclass
class Ws1BlockSetup:
    """Everything a ws1-block run needs, resolved and checked (shared by the gate, the bench and tests)."""

    config_name: str
    cfg: ModelConfig
    layout: PackedLayout
    source: object
    checkpoint: dict
    device: str
    params: dict[str, torch.Tensor]
    inputs: BlockInputs
    manifests: list[Path]
    graph: Graph | None = None
    bindings: dict[str, NodeBinding] = field(default_factory=dict)
    mode: str = "off"
    memory: MemoryPlan | None = None


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
        return device
    raise InputError(f"--device {device!r}: must be cpu or cuda")


def block_lower_bound_bytes(cfg: ModelConfig, rows: int) -> int:
    """A lower bound on what a ws1-block run holds at once, on the CPU or a GPU (weights and activations only).

    Block weights (q/k/v/o: ``4 H (N D)``, feed-forward: ``3 H F``) in bf16 plus their float64 golden copy
    (10 bytes each), and the forward values kept of every node for ``rows`` packed rows: six nodes ``H`` wide,
    eight ``N D`` wide, gate-up ``2F`` and swiglu ``F``, at float64 (golden) + bf16 (provider) + bf16 (candidate,
    chained) + bf16 (candidate, isolated: all four are held together for the row rule). Without the isolated set the
    bound let ``ref2va-768p`` (S = 83386) start on the H200 and run out of memory in the golden after the provider
    and candidate passes; with it that layout is refused up front, 768p (S = 38974, which ran) is not.
    """
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8)
    values = rows * (6 * h + 8 * nd + 3 * f) * (8 + 2 + 2 + 2)
    return weights + values


def check_memory(cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str, device: str) -> None:
    """The whole-execution lower bound against host memory (CPU) or the GPU's free memory, before any weight is
    placed there."""
    _require(block_lower_bound_bytes(cfg, packed.seq_len), packed, layout, config_name, device, "use a smaller layout")


@dataclass(frozen=True)
class GateNeeds:
    """What a ws1-block run keeps, for its memory plan: ``provider_lanes`` counts the default provider and the
    variants this device runs (pass 1 streams them all beside the golden and the candidate); the backward and the
    fault matrix hold whole executions on the device; ``--save-tensors`` keeps the golden's values too."""

    provider_lanes: int
    backward: bool = True
    fault_matrix: bool = False
    save_golden: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """Where the gate keeps the provider's and candidate's values (``device`` or ``host``) and the estimates the
    plan compared (lower bounds, bytes)."""

    store: str
    device_bytes: int
    host_bytes: int
    estimate: str

    def record(self) -> dict:
        return {"store": self.store, "estimate": self.estimate, "device_gib": round(self.device_bytes / GIB, 2),
                "host_gib": round(self.host_bytes / GIB, 2)}  # fmt: skip


def streamed_peak_width(cfg: ModelConfig) -> int:
    """The most elements per packed row one streamed block execution holds (``graph.execute.iter_graph``): the
    block input and the node outputs live at the widest node (``swiglu``: 3F + 2H)."""
    graph, widths = build_block_graph(cfg), row_widths(cfg)
    return widths["hidden_states"] + max(sum(widths[v] for v in live_at(graph, k)) for k in range(len(graph.nodes)))


def block_forward_bytes(cfg: ModelConfig, rows: int, needs: GateNeeds, store_on_device: bool) -> int:
    """A lower bound on what the streamed forward (``runs/block_forward.py``) holds on the device at once: block
    weights in bf16 and float64 (10 bytes each), pass 1's lanes at their widest (float64 golden, ``provider_lanes``
    and the candidate in bf16, :func:`streamed_peak_width` each) and, when it is on the device, the value store."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8)
    lanes = rows * streamed_peak_width(cfg) * (8 + 2 * (needs.provider_lanes + 1))
    return weights + lanes + (store_bytes(cfg, rows, needs) if store_on_device else 0)


def store_bytes(cfg: ModelConfig, rows: int, needs: GateNeeds) -> int:
    """The value store: every node value of the provider and the candidate (bf16), and the golden's (float64)."""
    widths = row_widths(cfg)
    return rows * sum(widths[n] for n in BLOCK_NODES) * (2 + 2 + (8 if needs.save_golden else 0))


def plan_block_memory(
    cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str, device: str, needs: GateNeeds
) -> MemoryPlan:
    """Where the value store goes, or an :class:`InputError` before any weight is read.

    The backward and the fault matrix hold whole executions on the device (:func:`block_lower_bound_bytes`,
    at least the forward's); a forward-only run keeps its store on the device when everything fits, else in host
    memory with pass 1 on the device (on the CPU both are the host)."""
    rows = packed.seq_len
    streamed = block_forward_bytes(cfg, rows, needs, store_on_device=True)
    if needs.backward or needs.fault_matrix:
        need = max(block_lower_bound_bytes(cfg, rows), streamed)
        _require(need, packed, layout, config_name, device, "use a smaller layout or --no-backward")
        return MemoryPlan("device", need, 0, "whole executions (backward or fault matrix)")
    from h3gate.memory import device_available_bytes

    available = device_available_bytes(device)
    if device == "cpu" or available is None or streamed <= available:
        _require(streamed, packed, layout, config_name, device, "use a smaller layout")
        return MemoryPlan("device", streamed, 0, "streamed forward, store on the device")
    need = block_forward_bytes(cfg, rows, needs, store_on_device=False)
    _require(need, packed, layout, config_name, device, "use a smaller layout")
    host = store_bytes(cfg, rows, needs)
    host_free = available_memory_bytes()
    if host_free is not None and host > host_free:
        what = _what(packed, layout, config_name, device)
        raise InputError(
            f"{what}: its value store needs at least {host / GIB:.1f} GiB of host memory, {host_free / GIB:.1f} GiB "
            "available; use a smaller layout"
        )
    return MemoryPlan("host", need, host, "streamed forward, store in host memory")


def _what(packed: PackedLayout, layout: str, config_name: str, device: str) -> str:
    return f"--layout {layout} --config {config_name} --device {device} (S={packed.seq_len})"


def _require(need: int, packed: PackedLayout, layout: str, config_name: str, device: str, hint: str) -> None:
    """Refuse ``need`` bytes beyond what ``device`` has (the CPU's message names --device cuda as the way out)."""
    if device != "cpu":
        from h3gate.memory import require

        require(need, _what(packed, layout, config_name, device), device, hint=hint)
        return
    available = available_memory_bytes()
    if available is not None and need > available:
        raise InputError(
            f"--layout {layout} --config {config_name} --device cpu: needs at least {need / GIB:.1f} GiB "
            f"(S={packed.seq_len}), {available / GIB:.1f} GiB available; use a smaller layout or --device cuda"
        )


def config_for(
    config: str | None, checkpoint: Path | None, seed: int, task: str = "t2va"
) -> tuple[str, ModelConfig, object, dict, list]:
    """(config name, config, weight source, checkpoint record, manifests read): a named config over synthetic
    weights (default ``tiny``) of the layout task's variant (``synth.layout_variant``: ``transformer_ref`` for
    ref2va), or a checkpoint whose ``config.json`` must match ``config`` when both are given (its variant is its
    folder's name when that is ``transformer`` or ``transformer_ref``)."""
    from h3gate.checkpoint import VARIANT_FOLDERS, open_checkpoint
    from h3gate.synth import SyntheticSource, layout_variant

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


def prepare(
    layout: str,
    config: str | None,
    checkpoint: Path | None,
    device: str,
    seed: int,
    mode: str = "off",
    merge: str = "single",
    needs: GateNeeds | None = None,
) -> Ws1BlockSetup:
    """Resolve config, weights, layout, block-0 graph, bindings, parameters and inputs (bad input -> InputError).

    The cheap checks run first; ``mode`` is bound for every node before any weight is read, so strict mode fails
    closed (naming the node) without loading anything. The bindings travel in the setup: nothing binds again.
    With ``needs`` (the gate) the memory is planned (:func:`plan_block_memory`), else bounded as a whole execution.
    """
    device = check_device(device)
    check_mode(mode)
    spec = load_layout(layout)
    config_name, cfg, source, ckpt, manifests = config_for(config, checkpoint, seed, spec.kind)
    packed = build_layout(spec, layout)
    plan = None
    if needs is None:
        check_memory(cfg, packed, layout, config_name, device)
    else:
        plan = plan_block_memory(cfg, packed, layout, config_name, device, needs)
    graph = build_block_graph(cfg, LAYER)
    bindings = bind_graph(graph, mode, device, merge)
    params = block_params(source, LAYER, device)
    inputs = build_block_inputs(packed, cfg, source, seed, device)
    manifests += [LAYOUTS_FILE, *sorted((MANIFESTS / "operators").glob("*.yaml"))]
    return Ws1BlockSetup(
        config_name, cfg, packed, source, ckpt, device, params, inputs, manifests, graph, bindings, mode, plan
    )
