"""What a stage backward keeps (``h3gate.graph.stages.Keep``) and where: dropping node values after their last reader,
keeping no node gradient, and parking gradients in host memory change what is held, never a byte of what is kept
(tiny config and layout, the provider table and the FP64 golden; the gate-level check, the whole-model gate holding on
the host, is a slow test in tests/test_ws1_model_stream.py)."""

from __future__ import annotations

import pytest
import torch

from h3gate.graph.core import to_float64
from h3gate.graph.executions import golden_table, provider_table
from h3gate.graph.parked import Fetched, park, to_host, unpark
from h3gate.graph.stages import KEEP_ALL, Keep, forward_stages, run_stage, split_stages, stage_vjp


@pytest.fixture(scope="module")
def last_block(tiny_params):
    """The last transformer block's stage, its saved inputs (provider forward) and a seeded cotangent of its output."""
    from h3gate.graph.model import build_model_graph
    from h3gate.layout import build_layout
    from h3gate.manifests.layouts import load_layout
    from h3gate.manifests.model_config import load_config
    from h3gate.runs.model_stages import model_inputs

    cfg = load_config("tiny").config
    stages = split_stages(build_model_graph(cfg))
    inputs, _ = model_inputs(build_layout(load_layout("tiny"), "tiny"), cfg, 0, "cpu")
    per = {s.label: {n: tiny_params[n] for n in s.param_names(list(tiny_params))} for s in stages}
    saved: dict = {}
    with torch.no_grad():
        forward_stages(stages, inputs, per, provider_table(), saved=saved)
        stage = [s for s in stages if s.label.startswith("block.")][-1]
        (out,) = stage.outputs
        value = run_stage(stage, saved[stage.label], per[stage.label], provider_table())[out]
    cot = torch.randn(value.shape, generator=torch.Generator().manual_seed(0)).to(value.dtype)
    return stage, saved[stage.label], per[stage.label], {out: cot}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("golden", [False, True], ids=["provider", "golden"])
def test_what_a_stage_backward_keeps_never_changes_a_byte_of_it(last_block, golden):
    """Every node, input and parameter gradient of ``Keep()`` again, bitwise and in the same order, under every other
    keep: values dropped after their last reader (the forward then holds the stage's outputs only, themselves
    bitwise), gradients parked on the host, both; with ``nodes=False`` no node gradient and the same inputs' and
    parameters' gradients. The control: a cotangent one ulp off on one row changes the node gradients."""
    stage, saved, params, incoming = last_block
    table = golden_table() if golden else provider_table()
    if golden:
        saved, params, incoming = to_float64(saved), to_float64(params), {k: v.double() for k, v in incoming.items()}
    full = stage_vjp(stage, saved, params, table, incoming, keep=KEEP_ALL)
    assert list(full.nodes) == [n.name for n in stage.nodes]  # every node output has a gradient
    for keep in (Keep(forward=False), Keep(host=True), Keep(forward=False, host=True)):
        got = stage_vjp(stage, saved, params, table, incoming, keep=keep)
        assert _same(got.nodes, full.nodes) and _same(got.inputs, full.inputs), keep
        assert _same(got.params, full.params), keep
        kept = full.forward if keep.forward else {k: full.forward[k] for k in stage.outputs}
        assert _same(got.forward, kept), keep
    lean = stage_vjp(stage, saved, params, table, incoming, keep=Keep(forward=False, nodes=False))
    assert lean.nodes == {} and _same(lean.inputs, full.inputs) and _same(lean.params, full.params)
    (out,) = incoming
    bumped = incoming[out].clone()
    bumped[0, 5] = torch.nextafter(bumped[0, 5], torch.tensor(float("inf"), dtype=bumped.dtype))
    off = stage_vjp(stage, saved, params, table, {out: bumped}, keep=Keep(forward=False, host=True))
    assert not _same(off.nodes, full.nodes)


def test_a_dropped_value_still_reports_its_gradient_as_retain_grad_would():
    """The hook that keeps a node gradient outlives the value's Python object and keeps its own contiguous copy: a
    later in-place accumulation by the engine (a leaf reading the same gradient twice) cannot reach it."""
    from h3gate.graph import stages as stages_mod

    a = torch.randn(3, 4, requires_grad=True)
    kept: dict = {}
    b = a * 2
    b.register_hook(stages_mod._kept_grad(kept, "b", host=False))
    c = (b + a).sum() + b.t().sum()
    del b
    c.backward()
    assert torch.equal(kept["b"], torch.full((3, 4), 2.0)) and kept["b"].is_contiguous()
    assert torch.equal(a.grad, torch.full((3, 4), 5.0))


def test_parked_tensors_come_back_with_their_bytes_one_at_a_time():
    """``to_host`` copies (the caller owns the copy even on the CPU), ``park``/``unpark`` keep keys, order and ``None``;
    ``Fetched`` hands out the parked tensors on the device as they are read, caching nothing."""
    t = torch.randn(4, 5, dtype=torch.float64)
    h = to_host(t)
    assert torch.equal(h, t) and h.data_ptr() != t.data_ptr()
    parked = park({"x": t, "none": None, "y": t[:, 1]})
    assert list(parked) == ["x", "none", "y"] and parked["none"] is None and parked["y"].is_contiguous()
    back = unpark(parked, "cpu")
    assert torch.equal(back["x"], t) and torch.equal(back["y"], t[:, 1])
    fetched = Fetched({"x": h}, "cpu")
    assert list(fetched) == ["x"] and len(fetched) == 1 and torch.equal(fetched["x"], t)
    with pytest.raises(KeyError):
        fetched["y"]
