"""PEFT LoRA layers inside ``h3gate.strict``: the base GEMM and the scaled low-rank update in one declared order.

A PEFT ``lora.Linear`` wrapping one of the body projections (``attn.to_q/to_k/to_v/to_out.0``, ``ff.net.0.proj``,
``ff.net.2`` of a transformer or refiner block) computes, for each active adapter in ``active_adapters`` order::

    y = base(x)                                         the node's own GEMM operator (strict kernel or provider)
    y = y + h3_lora_update(x, A, B, scaling)            lora_B(lora_A(x.to(A.dtype))) * scaling, at A's dtype
    y = y.to(base dtype)                                one rounding when the adapter dtype promoted the sum

exactly PEFT 0.21's vanilla ``Linear.forward`` (dropout must be the identity: ``p = 0`` or eval mode). The update
operator is bound by :func:`h3gate.ops.registry.bind` in the session's mode, so ``off`` is PEFT bitwise and
``strict`` runs the strict GEMM twice (manifest ``h3_lora_update``). Backward flows through the same operators; a
frozen base weight gets no gradient. What this module cannot cover is refused, naming the layer: another PEFT
variant (DoRA, ...), a LoRA bias, live dropout, a LoRA layer on any other module. h3gate never imports peft.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from h3gate.errors import InputError

# The body GEMM operators a LoRA update may ride on (signature ``op(x, weight)``), by the module suffix they read.
LORA_TARGETS: dict[str, str] = {
    "attn.to_q": "h3_qkv_gemm",
    "attn.to_k": "h3_qkv_gemm",
    "attn.to_v": "h3_qkv_gemm",
    "attn.to_out.0": "h3_attention_o_gemm",
    "ff.net.0.proj": "h3_ffn_gate_up_gemm",
    "ff.net.2": "h3_ffn_down_gemm",
}
BLOCK_PREFIXES = ("transformer_blocks.", "token_refiner.refiner_blocks.")
LORA_OPS = frozenset(LORA_TARGETS.values())
UPDATE_OP = "h3_lora_update"


@dataclass(frozen=True)
class Adapter:
    name: str
    lora_a: torch.Tensor  # (r, K)
    lora_b: torch.Tensor  # (N, r)
    scaling: float


@dataclass(frozen=True)
class LoraSlot:
    """One LoRA-wrapped linear: the module's name, its base weight and its active adapters (in PEFT's order)."""

    module: str
    base: torch.Tensor
    adapters: tuple[Adapter, ...]


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA layer (duck-typed: peft is not imported)."""
    return (
        type(module).__module__.startswith("peft.")
        and hasattr(module, "base_layer")
        and hasattr(module, "lora_A")
        and hasattr(module, "lora_B")
    )


def _covered(name: str) -> bool:
    return name.startswith(BLOCK_PREFIXES) and any(name.endswith("." + t) for t in LORA_TARGETS)


def _check_layer(name: str, layer: torch.nn.Module) -> None:
    if not _covered(name):
        raise InputError(
            f"h3gate.strict: LoRA layer {name}: not covered (strict LoRA covers the attention and FFN projections "
            f"of the transformer and refiner blocks)"
        )
    if type(layer).__name__ != "Linear" or type(layer.base_layer) is not torch.nn.Linear:
        raise InputError(f"h3gate.strict: LoRA layer {name} ({type(layer).__name__}): only lora.Linear is covered")
    if getattr(layer, "merged_adapters", None):
        raise InputError(f"h3gate.strict: LoRA layer {name}: adapters merged into the base weight (unmerge first)")
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "lora_variant", {}).get(adapter) is not None or getattr(layer, "use_dora", {}).get(adapter):
            raise InputError(f"h3gate.strict: LoRA layer {name}: adapter {adapter!r} is a variant (DoRA, ...)")
        if layer.lora_B[adapter].bias is not None or layer.lora_A[adapter].bias is not None:
            raise InputError(f"h3gate.strict: LoRA layer {name}: adapter {adapter!r} has a LoRA bias")
        dropout = layer.lora_dropout[adapter]
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training:
            raise InputError(
                f"h3gate.strict: LoRA layer {name}: adapter {adapter!r} has dropout p={dropout.p} in training mode "
                f"(random; set lora_dropout=0 or eval())"
            )


def find_lora(model: torch.nn.Module) -> dict[str, LoraSlot]:
    """``checkpoint weight name ("X.weight") -> LoraSlot`` for every PEFT LoRA layer of ``model``; refuses what is not
    covered (module docstring)."""
    slots: dict[str, LoraSlot] = {}
    for name, module in model.named_modules():
        if not is_lora_layer(module):
            continue
        _check_layer(name, module)
        adapters = ()
        if not getattr(module, "disable_adapters", False):
            adapters = tuple(
                Adapter(a, module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a]))
                for a in module.active_adapters
                if a in module.lora_A
            )
        slots[f"{name}.weight"] = LoraSlot(name, module.base_layer.weight, adapters)
    return slots


def canonical_parameters(model: torch.nn.Module, slots: Mapping[str, LoraSlot]) -> dict[str, torch.Tensor]:
    """The module's parameters under their checkpoint names: a LoRA layer's ``base_layer.weight`` as ``X.weight``,
    its adapter tensors left out (they are read through the slots)."""
    out: dict[str, torch.Tensor] = {}
    modules = {slot.module for slot in slots.values()}
    for name, p in model.named_parameters():
        owner = next((m for m in modules if name.startswith(m + ".")), None)
        if owner is None:
            out[name] = p
        elif name == f"{owner}.base_layer.weight":
            out[f"{owner}.weight"] = p
        elif name == f"{owner}.base_layer.bias":
            out[f"{owner}.bias"] = p
    return out


def lora_modules(slots: Mapping[str, LoraSlot]) -> set[str]:
    """Names of the submodules a LoRA layer adds (skipped by the architecture check; its base is checked instead)."""
    return {slot.module for slot in slots.values()}


def lora_record(slots: Mapping[str, LoraSlot]) -> dict:
    """Evidence: every LoRA layer, its adapters, rank, scaling and dtypes."""
    return {
        slot.module: [
            {
                "adapter": a.name,
                "rank": int(a.lora_a.shape[0]),
                "scaling": a.scaling,
                "dtype": str(a.lora_a.dtype).removeprefix("torch."),
            }  # fmt: skip
            for a in slot.adapters
        ]
        for slot in slots.values()
    }


def with_lora(op: str, fn: Callable, slots_by_id: Mapping[int, LoraSlot], update: Callable, note: Callable) -> Callable:
    """``fn`` (a body GEMM ``op(x, weight)``) extended by the LoRA update of the layer whose base weight it is given:
    ``(fn(x, W) + update(x, A, B, s)).to(fn(x, W).dtype)`` per active adapter; ``note(adapter)`` traces each update."""

    def run(x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = fn(x, weight, *args, **kwargs)
        slot = slots_by_id.get(id(weight))
        if slot is None or not slot.adapters:
            return result
        dtype = result.dtype
        for a in slot.adapters:
            note(a)
            result = result + update(x, a.lora_a, a.lora_b, a.scaling)
        return result.to(dtype)

    return run if op in LORA_OPS else fn
