"""PEFT parity of the LoRA update: a real ``peft`` LoRA on a bf16 ``nn.Linear`` (bias, lora_B non-zero) equals
``(base(x) + h3gate's reference update).to(bf16)`` bitwise on the CPU, forward and every gradient (x, lora_A,
lora_B), for a bf16 adapter and for a float32 adapter (PEFT's default on a bf16 base); the strict kernel's update in
the same composition stays within its declared bounds of the float64 golden."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from h3gate.dtypes import dtype_name
from h3gate.kernels.lora import h3_lora_update
from h3gate.ops import registry
from h3gate.ops.reference import lora_update

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]
BF16, FP32 = torch.bfloat16, torch.float32
K, N, RANK, ALPHA = 67, 45, 6, 16.0  # scaling 16 / 6: not a binary fraction, the multiply rounds
ADAPTERS = [pytest.param(BF16, id="adapter_bf16"), pytest.param(FP32, id="adapter_fp32")]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(K, N, bias=True, dtype=BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def peft_layer(adapter_dtype: torch.dtype):
    """A PEFT LoRA ``Linear`` around a seeded bf16 base; the adapter at ``adapter_dtype``, lora_B non-zero."""
    torch.manual_seed(0)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["proj"], lora_dropout=0.0)
    model = get_peft_model(Block(), config, autocast_adapter_dtype=adapter_dtype == FP32)
    layer = model.base_model.model.proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert a.dtype == b.dtype == adapter_dtype and layer.base_layer.weight.dtype == BF16
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        a.copy_(torch.randn(a.shape, generator=g) * K**-0.5)
        b.copy_(torch.randn(b.shape, generator=g) * RANK**-0.5)  # PEFT starts lora_B at zero: a trained adapter
    assert layer.scaling["default"] == ALPHA / RANK and isinstance(layer.lora_dropout["default"], torch.nn.Identity)
    return layer


def composed(layer, update, x: torch.Tensor) -> torch.Tensor:
    """What the caller does: the base GEMM, ``update`` on the layer's adapter, the add and the cast, plain torch."""
    base = layer.base_layer(x)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return (base + update(x, a, b, layer.scaling["default"])).to(base.dtype)


def run(layer, fn, x: torch.Tensor, gy: torch.Tensor) -> list[torch.Tensor]:
    """Output and the gradients of x, lora_A and lora_B (the base stays frozen, as in LoRA training)."""
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    y = fn(leaf)
    y.backward(gy)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert layer.base_layer.weight.grad is None
    return [y.detach(), leaf.grad, a.grad.clone(), b.grad.clone()]


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, 9, K, generator=g).to(BF16), torch.randn(2, 9, N, generator=g).to(BF16)


@pytest.mark.parametrize("adapter_dtype", ADAPTERS)
def test_reference_update_is_peft_bitwise_forward_and_backward(adapter_dtype) -> None:
    layer = peft_layer(adapter_dtype)
    x, gy = inputs()
    want = run(layer, layer, x, gy)  # PEFT's own LoRA Linear.forward
    got = run(layer, lambda t: composed(layer, lora_update, t), x, gy)
    for w, g, name in zip(want, got, ("output", "dx", "d_lora_A", "d_lora_B"), strict=True):
        assert w.dtype == g.dtype and torch.equal(w, g), name
    assert want[0].dtype == BF16 and want[2].dtype == adapter_dtype and want[3].abs().sum() > 0
    with torch.no_grad():
        assert not torch.equal(want[0], layer.base_layer(x))  # the adapter really contributes


@pytest.mark.parametrize("adapter_dtype", ADAPTERS)
def test_strict_update_in_peft_composition_is_within_its_bounds(adapter_dtype) -> None:
    """The strict kernel in place of the reference: not promised bitwise (provider_bitwise: false), within the
    contract's rel_l2 bounds of the float64 golden of the whole layer (base + update), output and every gradient."""
    layer = peft_layer(adapter_dtype)
    x, gy = inputs()
    got = run(layer, lambda t: composed(layer, h3_lora_update, t), x, gy)
    base = layer.base_layer
    a, b = (w.detach() for w in (layer.lora_A["default"].weight, layer.lora_B["default"].weight))
    leaves = [t.double().requires_grad_() for t in (x, a, b)]
    golden = F.linear(leaves[0], base.weight.double(), base.bias.double())
    golden = golden + lora_update(*leaves, layer.scaling["default"])
    golden.backward(gy.double())
    acc = registry.spec("h3_lora_update").contract.accuracy
    names = ("output", "dx", "d_lora_A", "d_lora_B")
    for tensor, want, name in zip(got, [golden.detach()] + [t.grad for t in leaves], names, strict=True):
        err = float((tensor.double() - want).norm() / want.norm())
        bound = (acc.forward if name == "output" else acc.backward)[dtype_name(tensor.dtype)]
        assert err < bound, (name, err)
