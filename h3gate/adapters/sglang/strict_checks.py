"""What the strict binding cannot bind in SGLang's MiniMax-H3 DiT, found before anything is replaced.

Each finding names the SGLang module and the feature. :class:`Refusals` decides what a finding does, by mode
(:func:`h3gate.ops.registry.fallback_fails` semantics): ``strict`` raises one-line :class:`InputError`
(``sglang strict binding: <where>: <feature>: ...``); ``audit`` records it as a failing finding, ``auto`` / ``off``
as a note - and the part it touches keeps SGLang's own forward (its *unit*: the embeddings, the time embedder, a
refiner block, the refiner's final norm, a transformer block, the final layer; never a part of one). Found here:

* a submodule class the architecture does not have (an SGLang LoRA wrapper, Cache-DiT's block wrapper, ...), a
  missing unit module (the AdaLN projections a cache prunes), a forward / backward hook, a forward already replaced
  (a nested binding: always an error);
* a quantized linear (any quant method but ``UnquantizedLinearMethod``: MXFP8, FP8, NVFP4, INT8, GGUF ...) or one
  with extra parameters (scales);
* sparse attention: a resolved attention backend SGLang marks sparse (VSA, sliding tile, SubBlock, cube, VMoBA, ...),
  the VDN hybrid window attention (``attn.hybrid``) or VSA's compression gate (``attn.to_gate_compress``);
* AdaLN caches (``adaln_cache``: ``--minimax-h3-adaln-online`` / ``--minimax-h3-adaln-cache-path``) and the pruned
  curve AdaLN (``adaln_t_table``); PDD fused heads; Cache-DiT; layerwise offload;
* ring attention (ring degree > 1: an error in every mode). Ulysses is covered: every op but attention is row-local,
  and after SGLang's all-to-all a rank attends whole segments on its heads.

Per forward (:func:`check_forward`): Spectrum forecasting (the request's ``enable_spectrum``: skipped steps replace the
block stack's rows by a forecast). A mounted fused RMSNorm + AdaLN site (request quality ``lossless`` / ``high``) is
no finding: its switch is read only by the block forward the binding replaces, so it cannot run while bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from h3gate.errors import InputError
from h3gate.ops.registry import check_mode, fallback_fails, refuses_fallback

_BODY = r"(token_refiner\.)?blocks\.\d+"
EXPECTED: tuple[tuple[str, str], ...] = (
    (r"", "MiniMaxH3DiTModel"),
    (r"video_patch_proj|audio_patch_proj|condition_proj", "ColumnParallelLinear"),
    (r"time_embedder", "MiniMaxH3TimeEmbedder"),
    (r"time_embedder\.proj_in", "ColumnParallelLinear"),
    (r"time_embedder\.proj_out", "RowParallelLinear"),
    (r"rope", "MiniMaxH3Rope"),
    (r"token_refiner", "MiniMaxH3TokenRefiner"),
    (r"(token_refiner\.)?blocks", "ModuleList"),
    (r"token_refiner\.blocks\.\d+", "MiniMaxH3TokenRefinerBlock"),
    (r"blocks\.\d+", "MiniMaxH3DiTBlock"),
    (rf"{_BODY}\.(norm1|norm2)|{_BODY}\.attn\.(q_norm|k_norm)|token_refiner\.final_norm|final_layer\.norm", "RMSNorm"),
    (rf"{_BODY}\.attn", "MiniMaxH3Attention"),
    (rf"{_BODY}\.attn\.qkv_proj|{_BODY}\.mlp\.fc1", "MergedColumnParallelLinear"),
    (rf"{_BODY}\.attn\.out_proj|{_BODY}\.mlp\.fc2", "RowParallelLinear"),
    (rf"{_BODY}\.mlp", "MiniMaxH3MLP"),
    (r"blocks\.\d+\.adaln_proj|final_layer\.adaln_proj", "MiniMaxH3AdalnProj"),
    (r"(blocks\.\d+|final_layer)\.adaln_proj\.linear|final_layer\.(video_out|audio_out)", "ColumnParallelLinear"),
    (r"final_layer", "MiniMaxH3FinalLayer"),
)
LINEAR_CLASSES = ("ColumnParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear")
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
SPECIFIC = {"hybrid": "VDN hybrid window attention", "to_gate_compress": "VSA compression gate"}


def expected_class(name: str) -> str | None:
    return next((cls for pattern, cls in EXPECTED if re.fullmatch(pattern, name)), None)


def unit_of(name: str) -> str | None:
    """The unit a module belongs to (module docstring), or None for the root's own containers."""
    if name.startswith(("video_patch_proj", "audio_patch_proj", "condition_proj")):
        return "embed"
    if m := re.match(r"(token_refiner\.blocks|blocks)\.(\d+)", name):
        return f"{'refiner' if m.group(1) != 'blocks' else 'block'}.{m.group(2)}"
    for prefix, unit in (("time_embedder", "time"), ("token_refiner.final_norm", "refiner.final_norm"),
                         ("final_layer", "final")):  # fmt: skip
        if name == prefix or name.startswith(prefix + "."):
            return unit
    return None


def units(num_refiner: int, num_layers: int) -> list[str]:
    """Every unit of a model, in forward order."""
    return ["embed", *(f"refiner.{r}" for r in range(num_refiner)), "refiner.final_norm", "time",
            *(f"block.{i}" for i in range(num_layers)), "final"]  # fmt: skip


@dataclass
class Refusals:
    """Findings of one binding and what they do in ``mode`` (module docstring)."""

    mode: str
    findings: list[dict] = field(default_factory=list)
    unbound: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        check_mode(self.mode)

    def refuse(self, where: str, feature: str, why: str, units: tuple[str, ...] = ()) -> None:
        message = f"sglang strict binding: {where or '<model>'}: {feature}: {why}"
        if refuses_fallback(self.mode):
            raise InputError(message)
        self.unbound.update(units)
        self.findings.append({"where": where or "<model>", "feature": feature, "message": message,
                              "unbound": sorted(units), "failing": fallback_fails(self.mode)})  # fmt: skip


def _attention(name: str, module: torch.nn.Module, refusals: Refusals) -> None:
    unit = (unit_of(name),)
    backend = getattr(module, "_attention_backend_enum", None)
    if backend is not None and (backend.is_sparse or backend.name == "NO_ATTENTION"):
        refusals.refuse(name, f"sparse attention ({backend})", "h3gate's attention is dense", unit)
    for attr, what in SPECIFIC.items():
        if getattr(module, attr, None) is not None:
            refusals.refuse(f"{name}.{attr}", what, "not part of the dense MiniMax-H3 architecture", unit)


def _linear(name: str, module: torch.nn.Module, refusals: Refusals) -> None:
    method = type(getattr(module, "quant_method", None)).__name__
    extra = sorted(set(dict(module.named_parameters(recurse=False))) - {"weight", "bias"})
    if method != "UnquantizedLinearMethod" or extra:
        what = f"quantized linear ({method}{', ' + ', '.join(extra) if extra else ''})"
        refusals.refuse(name, what, "h3gate's GEMMs take the BF16 / FP32 weights", (unit_of(name) or "model",))


def check_modules(model: torch.nn.Module, num_refiner: int, num_layers: int, refusals: Refusals) -> None:
    """Structure, hooks, quantization and attention of every submodule (module docstring)."""
    seen = set()
    for name, module in model.named_modules():
        seen.add(name)
        cls, unit = type(module).__name__, (unit_of(name) or "model",)
        if "forward" in vars(module):
            raise InputError(f"sglang strict binding: {name or '<model>'}: forward already replaced (nested binding)")
        if any(part in SPECIFIC for part in name.split(".")):
            continue  # named by its attention module
        want = expected_class(name)
        if want != cls:
            refusals.refuse(name, f"submodule class {cls}", "not in the MiniMax-H3 architecture", unit)
            continue
        for hooks in HOOKS:
            if getattr(module, hooks, None):
                refusals.refuse(name, hooks.strip("_").replace("_", " "), "a hook the binding does not cover", unit)
        if cls in LINEAR_CLASSES:
            _linear(name, module, refusals)
        if cls == "MiniMaxH3Attention":
            _attention(name, module, refusals)
    for unit in units(num_refiner, num_layers):
        need = {"block": ("blocks.{}.adaln_proj",), "final": ("final_layer.adaln_proj",)}
        kind, _, index = unit.partition(".")
        for pattern in need.get(kind, ()):
            if pattern.format(index) not in seen:
                refusals.refuse(pattern.format(index), "missing AdaLN projection", "an AdaLN cache pruned it", (unit,))


def check_model(model: torch.nn.Module, refusals: Refusals, blocks_and_final: tuple[str, ...]) -> None:
    """The model-wide switches (module docstring)."""
    if getattr(model, "adaln_cache", None) is not None:
        refusals.refuse("adaln_cache", "AdaLN cache", "precomputed AdaLN outputs replace the projections",
                        blocks_and_final)  # fmt: skip
    if getattr(model, "adaln_t_table", None) is not None:
        refusals.refuse("adaln_t_table", "pruned curve AdaLN", "not the MiniMax-H3 time embedder",
                        ("time", *blocks_and_final))  # fmt: skip
    if getattr(model.final_layer, "_pdd_heads", None) is not None:
        refusals.refuse("final_layer", "PDD fused heads", "per-step heads are not the model's heads", ("final",))
    from sglang.multimodal_gen import envs
    from sglang.multimodal_gen.runtime.distributed.parallel_state import get_ring_ctx, get_ulysses_ctx
    from sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload import (
        is_layerwise_offloaded_module,
    )

    if hasattr(model, "_sglang_cache_dit_adapter") or envs.SGLANG_CACHE_DIT_ENABLED:
        refusals.refuse("", "Cache-DiT", "cached block residuals replace the blocks' arithmetic", blocks_and_final)
    if is_layerwise_offloaded_module(model):
        refusals.refuse("", "layerwise offload", "its prefetch hooks are not covered")
    ring = get_ring_ctx()[0]
    if ring > 1:
        raise InputError(
            f"sglang strict binding: ring attention (ring degree {ring}, ulysses {get_ulysses_ctx()[0]}): not covered "
            f"(a rank's rows attend to other ranks' K/V chunks merged by online softmax; the binding covers TP and "
            f"Ulysses)"
        )


def check_forward(model: torch.nn.Module, refusals: Refusals) -> None:
    """Per forward: Spectrum forecasting (module docstring)."""
    try:
        spectrum = model._h3_spectrum_requested(sp_ws=1)
    except ValueError:
        spectrum = True
    if spectrum:
        refusals.refuse("", "Spectrum forecasting", "forecast rows replace the block stack's arithmetic")
