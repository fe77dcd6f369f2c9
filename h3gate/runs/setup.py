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
from h3gate.graph.block import block_params, build_block_graph
from h3gate.graph.core import Graph
from h3gate.graph.executions import NodeBinding, bind_graph
from h3gate.graph.inputs import BlockInputs, build_block_inputs
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.layouts import LAYOUTS_FILE, load_layout
from h3gate.manifests.model_config import ModelConfig, config_names, load_config
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
    and candidate passes (session 11); with it that layout is refused up front, 768p (S = 38974, which ran) is not.
    """
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8)
    values = rows * (6 * h + 8 * nd + 3 * f) * (8 + 2 + 2 + 2)
    return weights + values


def check_cpu_memory(cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str) -> None:
    """Refuse a CPU run whose lower-bound footprint exceeds the memory available (instead of swapping or OOM)."""
    available = available_memory_bytes()
    need = block_lower_bound_bytes(cfg, packed.seq_len)
    if available is not None and need > available:
        raise InputError(
            f"--layout {layout} --config {config_name} --device cpu: needs at least {need / 2**30:.1f} GiB "
            f"(S={packed.seq_len}), {available / 2**30:.1f} GiB available; use a smaller layout or --device cuda"
        )


def check_memory(cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str, device: str) -> None:
    """The lower bound against host memory (CPU) or the GPU's free memory, before any weight is placed there."""
    if device == "cpu":
        check_cpu_memory(cfg, packed, layout, config_name)
        return
    from h3gate.memory import require

    require(
        block_lower_bound_bytes(cfg, packed.seq_len),
        f"--layout {layout} --config {config_name} --device {device} (S={packed.seq_len})",
        device,
        hint="use a smaller layout",
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
) -> Ws1BlockSetup:
    """Resolve config, weights, layout, block-0 graph, bindings, parameters and inputs (bad input -> InputError).

    The cheap checks run first; ``mode`` is bound for every node before any weight is read, so strict mode fails
    closed (naming the node) without loading anything. The bindings travel in the setup: nothing binds again.
    """
    device = check_device(device)
    check_mode(mode)
    spec = load_layout(layout)
    config_name, cfg, source, ckpt, manifests = config_for(config, checkpoint, seed, spec.kind)
    packed = build_layout(spec, layout)
    check_memory(cfg, packed, layout, config_name, device)
    graph = build_block_graph(cfg, LAYER)
    bindings = bind_graph(graph, mode, device, merge)
    params = block_params(source, LAYER, device)
    inputs = build_block_inputs(packed, cfg, source, seed, device)
    manifests += [LAYOUTS_FILE, *sorted((MANIFESTS / "operators").glob("*.yaml"))]
    return Ws1BlockSetup(
        config_name, cfg, packed, source, ckpt, device, params, inputs, manifests, graph, bindings, mode
    )
