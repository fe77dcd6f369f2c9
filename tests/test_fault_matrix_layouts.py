"""A sample of the one-row fault matrix at the small and medium layouts (the whole matrix runs at tiny in
tests/test_gate_trust.py and at released widths on the H200, evidence/h200/ws1-block-real-*).

For a sample of nodes (SAMPLES) the unmodified strict kernels pass the row
rule, forward (isolated) and backward (node VJP), and every one-row fault - row 1 and the last row, scaled or its
tail zeroed, forward and backward - is caught and located, judged by the gate's own check against provider-variant
envelopes computed on these layouts.
"""

from __future__ import annotations

import pytest
import torch

from h3gate.graph.core import to_float64
from h3gate.graph.execute import run_chained
from h3gate.graph.executions import candidate_table, provider_table
from h3gate.manifests.tolerances import load_tolerance
from h3gate.runs.block_rows import RowContext, isolated_envelope, vjp_rows
from h3gate.runs.fault_matrix import run_fault_matrix
from h3gate.runs.setup import RunSpec, prepare
from h3gate.runs.ws1_block import BlockGate, _Executions

# Per layout: at small a norm, a GEMM, attention, SwiGLU and a gated residual; at medium (12x the rows, every kernel
# under the CPU interpreter) the row-wise kernels, where a one-row fault is the easiest to hide in a long tensor.
SAMPLES = {
    "small": ("norm2", "ffn_gate_up", "attention", "swiglu", "residual_mlp"),
    "medium": ("norm1", "swiglu", "residual_attn"),
}

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", sorted(SAMPLES))
def test_a_sample_of_the_fault_matrix_is_caught_and_located(layout):
    sample = SAMPLES[layout]
    setup = prepare(RunSpec("block", layout))
    graph = setup.graph
    tol = load_tolerance("ws1-block")
    ctx = RowContext.build(tol.row_rule, graph, "cpu", setup.inputs.modalities, keep=True)
    params, golden_params = setup.params, to_float64(setup.params)
    table = candidate_table(setup.bindings)
    with torch.no_grad():
        prov = run_chained(graph, setup.inputs.tensors, params, provider_table())
    for name in sample:
        node = graph.node(name)
        local, errs = isolated_envelope(ctx, node, prov, params, golden_params)
        with torch.no_grad():
            sound = node.fn(table, {k: prov[k] for k in node.inputs}, params)
        assert ctx.judge(sound, errs, local, node.row_dim)["pass"], name  # the unmodified kernel passes
        ctx.kept.setdefault("forward", {})[name] = (local, errs)
    gate = BlockGate(graph, setup.inputs, params, "cpu", "strict", tol)
    h = setup.inputs.tensors["hidden_states"]
    cot = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(h.dtype)
    _, prov_grads, _ = _Executions(gate, setup.bindings).grads("provider", None, cot)
    vjps = vjp_rows(ctx, graph, table, None, params, golden_params, prov, prov_grads, only=sample)
    assert vjps and all(v["rows"]["pass"] for v in vjps.values()), [k for k, v in vjps.items() if not v["rows"]["pass"]]

    matrix = run_fault_matrix(graph, ctx, table, prov, params)
    assert {f["node"] for f in matrix["faults"]} == set(sample)
    assert {f["direction"] for f in matrix["faults"]} == {"forward", "backward"}
    assert matrix["total"] == len(sample) * 2 * 2 * 2
    assert [f["fault"] for f in matrix["faults"] if not f["located"]] == []
    assert any(f["row"] == setup.layout.seq_len - 1 for f in matrix["faults"])
