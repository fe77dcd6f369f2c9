"""``h3gate bench ws1-model``: refused on CPU in one line; the timed arms' maths on CPU (tiny config and layout);
the evidence schema.

The forward + backward arm recomputes stage by stage; here its gradients (the three request inputs and every
parameter) are checked against one whole-graph autograd backward of the same loss: they agree bitwise with the
provider table (same ops, same order; the gradient of ``time.linear_2`` summed last reader first, as autograd does).
"""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError


@pytest.fixture(scope="module")
def tiny_model(tiny_params):
    from h3gate.graph.model import build_model_graph
    from h3gate.graph.stages import split_stages
    from h3gate.layout import build_layout
    from h3gate.manifests.layouts import load_layout
    from h3gate.manifests.model_config import load_config
    from h3gate.runs.model_stages import model_inputs

    cfg = load_config("tiny").config
    graph = build_model_graph(cfg)
    inputs, _ = model_inputs(build_layout(load_layout("tiny"), "tiny"), cfg, 0, "cpu")
    return graph, split_stages(graph), inputs, tiny_params


def test_cli_refuses_cpu_in_one_line(run_cli, tmp_path):
    code, out, err = run_cli("bench", "ws1-model", "--layout", "tiny", "--device", "cpu", "--out", tmp_path / "ev")
    assert (code, out) == (2, "")
    assert err.startswith("h3gate: error: ") and err.count("\n") == 1 and "bench needs --device cuda" in err, err
    assert "Traceback" not in err and not (tmp_path / "ev").exists()


def test_bench_model_needs_cuda():
    from h3gate.bench.model import bench_model

    with pytest.raises(InputError, match="bench needs --device cuda"):
        bench_model("tiny", "tiny", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_cuda_without_cuda(run_cli, tmp_path):
    code, out, err = run_cli("bench", "ws1-model", "--layout", "tiny", "--config", "tiny", "--out", tmp_path / "ev")
    assert (code, out) == (2, "") and err.count("\n") == 1 and "CUDA is not available" in err, err


def test_iters():
    from h3gate.bench.model import iters_for

    assert iters_for(3160) == 5 and iters_for(38974) == 3


def test_stagewise_forward_matches_the_chained_graph(tiny_model):
    from h3gate.bench.model import forward_arm
    from h3gate.graph.execute import run_chained
    from h3gate.graph.executions import provider_table
    from h3gate.graph.model import OUTPUTS

    graph, stages, inputs, params = tiny_model
    table = provider_table()
    out = forward_arm(stages, inputs, params, table)()
    with torch.no_grad():
        whole = run_chained(graph, inputs, params, table)
    assert list(out) == list(OUTPUTS)
    for name in OUTPUTS:
        assert torch.equal(out[name], whole[name]), name


def test_stagewise_backward_equals_whole_graph_autograd(tiny_model):
    """Per-stage recomputation (released parameter gradients captured here) against one autograd backward of
    ``sum(video.float() * c_v) + sum(audio.float() * c_a)`` over the chained graph: bitwise, every gradient."""
    from h3gate.bench.model import SEED, forward_backward_arm, model_backward
    from h3gate.graph.execute import run_chained
    from h3gate.graph.executions import provider_table
    from h3gate.graph.model import OUTPUTS
    from h3gate.runs.model_stages import LEAVES, model_cotangents

    graph, stages, inputs, params = tiny_model
    table = provider_table()
    param_grads: dict[str, torch.Tensor] = {}
    staged = model_backward(stages, inputs, params, table, param_grads=param_grads)

    leaves = {k: (v.detach().clone().requires_grad_(True) if k in LEAVES else v) for k, v in inputs.items()}
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        values = run_chained(graph, leaves, p, table)
        outs = [values[k] for k in OUTPUTS]
        cot = model_cotangents(SEED, {k: values[k] for k in OUTPUTS})
        torch.autograd.backward(outs, [cot[k].to(values[k].dtype) for k in OUTPUTS])

    assert sorted(staged) == sorted(LEAVES)
    for name in LEAVES:
        torch.testing.assert_close(staged[name], leaves[name].grad, rtol=0, atol=0, msg=name)
        assert torch.equal(staged[name], leaves[name].grad), f"{name}: not bitwise"
    assert sorted(param_grads) == sorted(params)  # every parameter receives a gradient
    for name, grad in param_grads.items():
        assert torch.equal(grad, p[name].grad), f"{name}: not bitwise"
    # The timed arm: fixed cotangents, parameter gradients dropped, returns dL/d video_rows.
    arm = forward_backward_arm(stages, inputs, params, table, {k: cot[k].detach() for k in OUTPUTS})
    assert torch.equal(arm(), leaves["video_rows"].grad)


def _binding(op: str, **kw) -> dict:
    return {
        "op": op, "rfc_row": "R1", "mode": "strict", "requested": "triton", "actual": "triton",
        "kernel_id": "triton.x.v1", "label": "row", "fallback": False, "reason": "", **kw,
    }  # fmt: skip


def _body(**bindings) -> dict:
    timing = {"median_ms": 2.0, "min_ms": 1.9, "max_ms": 2.2, "iters": 3}
    phase = {
        "provider": timing, "strict": timing, "strict_over_provider": 1.0,
        "max_memory_allocated_bytes": {"provider": 1 << 30, "strict": 1 << 30},
    }  # fmt: skip
    return {
        "config": "tiny",
        "layout": {"name": "tiny", "seq_len": 264, "rows": {"text": 120, "video": 128, "audio": 16}},
        "device": "cuda",
        "device_name": "NVIDIA H200",
        "layers": 2,
        "stages": 9,
        "nodes": 60,
        "weights": {"kind": "synthetic", "seed": 0, "tensors": 52, "bytes": 1234},
        "method": "side_by_side",
        "loss": "loss",
        "recomputation": "per-stage",
        "parameter_gradients": "released",
        "bindings": bindings or {"h3_swiglu": _binding("h3_swiglu")},
        "results": {"forward": phase, "forward_backward": phase},
    }


def test_schema_is_valid_and_a_minimal_body_validates(tmp_path):
    import json

    from jsonschema import Draft202012Validator

    from h3gate.bench.model import KIND
    from h3gate.evidence.schema import kinds, schema_path, validate_document
    from h3gate.evidence.writer import write_evidence

    assert KIND in kinds()
    Draft202012Validator.check_schema(json.loads(schema_path(KIND).read_text(encoding="utf-8")))
    path = write_evidence(tmp_path, f"{KIND}.json", KIND, _body())
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["kind"] == KIND
    validate_document(doc)
    for bad in (
        {**doc, "device": "cpu"},
        {**doc, "bindings": {"h3_swiglu": _binding("h3_swiglu", actual="provider")}},
        {**doc, "bindings": {"h3_swiglu": _binding("h3_swiglu", fallback=True)}},
        {**doc, "results": {"forward": doc["results"]["forward"]}},
    ):
        with pytest.raises(InputError):
            validate_document(bad)
