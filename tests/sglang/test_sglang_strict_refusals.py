"""What the strict binding cannot bind in SGLang's DiT: refused in strict mode with an error naming the module and the
feature, recorded in audit mode (a failing finding; the part it touches keeps SGLang's forward), a note in auto mode.
Every switch is SGLang's own attribute, set for the test and restored (submodules and parameters through the module's
own ``_modules`` / ``_parameters``, which pytest's monkeypatch restores as they were)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from h3gate.errors import InputError
from tests.sglang.helpers import MARKS, batch_inputs

pytestmark = MARKS


class Mxfp8LinearMethod:
    """Stands for a quantized linear method (SGLang's MXFP8 / FP8 / NVFP4 ... classes); only its name is read."""


def _sparse(model, mp):
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum

    model._resolve_attention_backend_once()  # SGLang resolves the backends once (at the first forward)
    mp.setattr(model.blocks[0].attn, "_attention_backend_enum", AttentionBackendEnum.VIDEO_SPARSE_ATTN_H3)


def _hook(model, mp):
    return model.blocks[0].mlp.register_forward_hook(lambda *a: None)  # the test removes it


CASES = {
    "sparse attention": (_sparse, r"blocks.0.attn: sparse attention \(video_sparse_attn_h3\)", ("block.0",)),
    "VSA gate": (lambda m, mp: mp.setattr(m.blocks[1].attn, "to_gate_compress", torch.nn.Identity()),
                 "blocks.1.attn.to_gate_compress: VSA compression gate", ("block.1",)),
    "quantized": (lambda m, mp: mp.setattr(m.blocks[1].mlp.fc2, "quant_method", Mxfp8LinearMethod()),
                  r"blocks.1.mlp.fc2: quantized linear \(Mxfp8LinearMethod\)", ("block.1",)),
    "class": (lambda m, mp: mp.setitem(m.token_refiner.blocks[0].mlp._modules, "fc2", torch.nn.Linear(384, 192)),
              "token_refiner.blocks.0.mlp.fc2: submodule class Linear", ("refiner.0",)),
    "hook": (_hook, "blocks.0.mlp: forward hooks", ("block.0",)),
    "adaln cache": (lambda m, mp: mp.setattr(m, "adaln_cache", object()), "adaln_cache: AdaLN cache",
                    ("block.0", "block.1", "final")),
    "curve": (lambda m, mp: mp.setitem(m._parameters, "adaln_t_table", torch.nn.Parameter(torch.zeros(2, 96), False)),
              "adaln_t_table: pruned curve AdaLN", ("time", "block.0", "block.1", "final")),
    "pdd": (lambda m, mp: mp.setattr(m.final_layer, "_pdd_heads", {}), "final_layer: PDD fused heads", ("final",)),
    "cache-dit": (lambda m, mp: mp.setattr(m, "_sglang_cache_dit_adapter", object(), raising=False),
                  "<model>: Cache-DiT", ("block.0", "block.1", "final")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_strict_refuses_naming_it(tiny, monkeypatch, case):
    from h3gate.adapters.sglang.strict_bind import bind_strict

    setup, message, _ = CASES[case]
    handle = setup(tiny.model, monkeypatch)
    try:
        with pytest.raises(InputError, match=f"^sglang strict binding: {message}: "), bind_strict(tiny.model):
            pass
    finally:
        if handle is not None:
            handle.remove()
    assert not [n for n, m in tiny.model.named_modules() if "forward" in vars(m)]  # nothing left bound


@pytest.mark.parametrize("case", list(CASES))
def test_audit_records_it_and_leaves_that_part_to_sglang(tiny, monkeypatch, case):
    from h3gate.adapters.sglang.strict_bind import bind_strict
    from h3gate.adapters.sglang.strict_checks import unit_of

    setup, message, units = CASES[case]
    handle = setup(tiny.model, monkeypatch)
    try:
        with bind_strict(tiny.model, "audit") as session:
            record = session.record()
    finally:
        if handle is not None:
            handle.remove()
    [finding] = [f for f in record["findings"] if re.match(f"^sglang strict binding: {message}", f["message"])]
    assert finding["failing"] is True and set(units) <= set(finding["unbound"])
    bound_units = {unit_of(name.rsplit(".", 1)[0]) for name in record["replaced"]}
    assert not set(units) & bound_units and "embed" in bound_units  # those parts alone keep SGLang's forwards


def test_auto_notes_it_without_failing(tiny, monkeypatch):
    from h3gate.adapters.sglang.strict_bind import bind_strict

    monkeypatch.setattr(tiny.model.final_layer, "_pdd_heads", {})
    with bind_strict(tiny.model, "auto") as session:
        pass
    assert [f["failing"] for f in session.findings] == [False]


def test_spectrum_forecasting_is_refused_per_forward(tiny):
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context

    from h3gate.adapters.sglang.inputs import packing, run_forward
    from h3gate.adapters.sglang.strict_bind import bind_strict

    tensors, raw, layout = batch_inputs("micro", tiny.cfg, 1)
    pack = packing(1, layout.seq_len, raw.text_indices, serving=False)  # the text is refined inside the forward
    request = SimpleNamespace(enable_spectrum=True)
    refused = pytest.raises(InputError, match="^sglang strict binding: <model>: Spectrum forecasting: ")
    with bind_strict(tiny.model) as session, set_forward_context(0, None, request), refused:
        run_forward(tiny.model, tensors, raw, pack)
    assert session.calls == 0 and session.trace == []  # refused before any operator ran


def test_ring_attention_and_nested_bindings_are_refused(tiny, monkeypatch):
    from sglang.multimodal_gen.runtime.distributed import parallel_state

    from h3gate.adapters.sglang.strict_bind import bind_strict

    with bind_strict(tiny.model), pytest.raises(InputError, match="forward already replaced"), bind_strict(tiny.model):
        pass
    monkeypatch.setattr(parallel_state, "get_ring_ctx", lambda: (2, 0))
    refused = pytest.raises(InputError, match=r"ring attention \(ring degree 2, ulysses 1\): not covered")
    with refused, bind_strict(tiny.model):
        pass
