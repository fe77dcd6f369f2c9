"""``run ws1-model --fault-matrix`` (:mod:`h3gate.runs.model_fault_matrix`): one-row faults at the refiner, the first
and last block and the heads, judged on the views the gate kept, without a gate run per fault.

Default set (cheap): the splice the matrix rests on (a one-row fault changes that row's error only, re-measured
alone; the whole-tensor error re-summed from per-row sums), the declared plan, and the forward matrix of a
forward-only gate with the candidate bound to the provider (``--mode off``: no interpreted kernels) on a one-block
model, with two negative controls that must fail it: a judge that cannot see the faulted row (nothing caught) and one
that sees it on the neighbouring row (caught, none located), each failing the gate's verdict.

Slow: the matrix at tiny with the strict kernels, its prediction for one node per depth, forward and backward,
checked against the real gate (``run ws1-model --fault NODE:ROW:scale[:backward]``): the same first failing node,
layer, row and modality, or the same pass where it predicts the fault is not caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3gate.gate.compare import error
from h3gate.gate.faults import corrupt, row_slice
from h3gate.gate.rows import row_errors
from h3gate.graph.stages import split_stages
from h3gate.manifests.model_config import load_config
from h3gate.manifests.tolerances import load_tolerance
from h3gate.numerics import strict_numerics
from h3gate.runs import fault_matrix, model_fault_matrix, ws1_model
from h3gate.runs.block_rows import RowContext
from h3gate.runs.fault_matrix import RowView, row_sums
from h3gate.runs.model_fault_matrix import KEY, MatrixKeep, depths, fault_rows_of
from h3gate.runs.model_forward import Findings
from h3gate.runs.setup import RunSpec, prepare

TINY = load_config("tiny").config


@pytest.mark.parametrize("row_dim, shape", [(1, (1, 84, 192)), (0, (3, 96)), (None, (5, 7)), (None, (11,))])
@pytest.mark.parametrize("kind", ["scale", "zero_tail"])
def test_a_one_row_fault_is_the_clean_errors_with_that_row_re_measured(row_dim, shape, kind) -> None:
    gen = torch.Generator().manual_seed(3)
    gold = torch.randn(shape, generator=gen, dtype=torch.float64)
    cand = (gold * (1 + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64))).to(torch.bfloat16)
    rows = row_errors(cand, gold, row_dim).numel()
    view = RowView.of(cand, gold, {"default": row_errors(cand, gold, row_dim)}, row_dim, range(rows), sums=True)
    for r in range(rows):
        faulted = corrupt(cand, r, row_dim, kind)
        assert torch.equal(view.errors(r, kind), row_errors(faulted, gold, row_dim))  # bit for bit
        assert torch.equal(view.faulted_row(r, kind), row_slice(faulted, r, row_dim))
        whole, spliced = error(faulted, gold), view.error(r, kind)
        assert spliced["max_abs"] == whole["max_abs"]
        assert spliced["rel_l2"] == pytest.approx(whole["rel_l2"], rel=1e-12)  # re-summed: last float64 bits
    assert row_sums(cand, gold, row_dim).shape == (rows, 3)


def test_the_rows_are_row_1_the_last_and_the_first_of_each_modality_they_miss() -> None:
    mods = ["text"] * 24 + ["video"] * 16 + ["audio"] * 12 + ["video"] * 32  # micro's packed rows
    assert fault_rows_of(84, mods) == [1, 40, 83]
    assert fault_rows_of(24, ["text"] * 24) == [1, 23]
    assert fault_rows_of(3, None) == [1, 2] and fault_rows_of(1, None) == [0]


def test_the_plan_declares_every_depth_and_where_each_backward_fault_is_judged() -> None:
    graph = prepare(RunSpec("model", "micro"), read=False).graph
    assert [(d.name, len(d.nodes)) for d in depths(graph, (0, TINY.num_layers))] == [
        ("refiner", 15), ("block 0", 17), ("block 1", 17), ("heads", 6),
    ]  # fmt: skip
    stages = split_stages(graph)
    keep = MatrixKeep.plan(graph, stages, (0, 2), backward=True)
    assert keep.targets["block.0.swiglu"] == ["block.0.ffn_down"]  # one reader: spliced
    assert keep.targets["block.1.norm1"] == ["block.1.q_proj", "block.1.k_proj", "block.1.v_proj"]
    assert {"block.1.norm1", "block.1.residual_attn", "refiner.0.norm1"} <= keep.rerun  # several readers: re-run
    assert "block.0.swiglu" not in keep.rerun
    excluded = {e["node"] for e in keep.excluded}
    assert {"block.0.norm1", "refiner.0.norm1", "final.norm_out", "heads.video_proj"} <= excluded
    assert not MatrixKeep.plan(graph, stages, (0, 2), backward=False).targets


@pytest.fixture(scope="module")
def forward_matrix():
    """A forward-only gate at --mode off on blocks 1:2 with the matrix; what the matrix read, kept for the controls."""
    state: dict = {}
    real = ws1_model._fault_matrix

    def spy(gate, ctx, findings):
        state.update(gate=gate, ctx=ctx, keep=ctx.kept[KEY])
        return real(gate, ctx, findings)

    with pytest.MonkeyPatch.context() as mp, strict_numerics("cpu"):
        mp.setattr(ws1_model, "_fault_matrix", spy)
        run = prepare(RunSpec("model", "micro", draw="device", layers="1:2", mode="off"))
        gate = ws1_model.ModelGate.of(run, load_tolerance("ws1-model"), backward=False, fault_matrix=True)
        result = ws1_model.run_model_gate(gate)
    return result, state


def test_the_forward_matrix_catches_and_locates_every_fault(forward_matrix) -> None:
    result, _ = forward_matrix
    matrix = result.report["fault_matrix"]
    assert result.verdict == "pass" and result.failing == []
    assert [d["depth"] for d in matrix["depths"]] == ["refiner", "block 1", "heads"]
    assert matrix["total"] == matrix["caught"] == matrix["located"] and matrix["pass"]
    faults = matrix["faults"]
    assert {f["direction"] for f in faults} == {"forward"} and {f["kind"] for f in faults} == {"scale", "zero_tail"}
    assert {f["node"] for f in faults} == {n for d in matrix["depths"] for n in d["nodes"]}
    audio = next(f for f in faults if f["fault"] == "forward:block.1.o_proj:row 40:scale")
    assert (audio["named_row"], audio["named_modality"], audio["stage"], audio["layer"]) == (40, "audio", "block.1", 1)
    assert {f["row"] for f in faults if f["node"] == "refiner.0.o_proj"} == {1, 23}  # text rows


def _rerun_matrix(state: dict) -> tuple[dict, list[str]]:
    state["ctx"].kept[KEY] = state["keep"]
    findings = Findings()
    matrix = ws1_model._fault_matrix(state["gate"], state["ctx"], findings)
    return matrix, findings.failing


def test_a_judge_that_cannot_see_the_faulted_row_catches_nothing_and_fails(forward_matrix, monkeypatch) -> None:
    monkeypatch.setattr(fault_matrix.RowView, "errors", lambda self, row, kind, got=None: self.errs.clone())
    monkeypatch.setattr(fault_matrix.RowView, "error", lambda self, row, kind, got=None: _clean_error(self))
    monkeypatch.setattr(model_fault_matrix, "_bitwise_check", lambda kept, fault: ("isolated_bitwise", True, None))
    matrix, failing = _rerun_matrix(forward_matrix[1])
    assert matrix["total"] > 0 and matrix["caught"] == matrix["located"] == 0 and not matrix["pass"]
    assert len(failing) == matrix["total"] and failing[0].endswith(".not_located")


def test_a_judge_that_sees_the_fault_on_the_next_row_locates_nothing(forward_matrix, monkeypatch) -> None:
    spliced = fault_matrix.RowView.errors

    def shifted(self, row, kind, got=None):  # the faulted row's error lands on its neighbour
        errs = spliced(self, row, kind, got)
        errs[row], errs[(row + 1) % len(errs)] = self.errs[row].item(), errs[row].item()
        return errs

    monkeypatch.setattr(fault_matrix.RowView, "errors", shifted)
    matrix, failing = _rerun_matrix(forward_matrix[1])
    # only the promised nodes' isolated-bitwise check, which reads no row error, still locates
    assert all(f["first_check"] == "isolated_bitwise" for f in matrix["faults"] if f["located"])
    others = [f for f in matrix["faults"] if f["first_check"] != "isolated_bitwise"]
    assert len(others) > matrix["total"] / 2 and not any(f["located"] for f in others) and not matrix["pass"]
    assert len(failing) == matrix["total"] - matrix["located"] == len(others)


def _clean_error(view: RowView) -> dict:
    num, den = float(view.sums[:, 0].sum()) ** 0.5, float(view.sums[:, 1].sum()) ** 0.5
    return {"max_abs": float(view.sums[:, 2].max()), "rel_l2": num / den}


# -- slow: the matrix's prediction against the real gate -------------------------------------------------------------

H3GATE = [sys.executable, "-m", "h3gate"]
# One node per depth (tiny: block 0 is the first block, block 1 the last), forward and backward.
E2E = (
    "forward:refiner.0.ffn_down:row 23:scale",
    "forward:block.0.o_proj:row 40:scale",
    "forward:block.1.attention:row 83:scale",
    "forward:final.norm_out:row 1:scale",
    "backward:refiner.0.ffn_down:row 1:scale",
    "backward:block.0.ffn_down:row 83:scale",
    "backward:block.0.q_norm:row 40:scale",  # seen by q_norm's backward alone only (isolated_node)
    "backward:block.1.residual_mlp:row 40:scale",
    "backward:heads.video_select:row 83:scale",
)


def _gate_run(label: str, tmp: Path) -> tuple[int, dict]:
    direction, node, row, kind = label.split(":")
    spec = f"{node}:{row.removeprefix('row ')}:{kind}:{direction}"
    out = tmp / label.replace(":", "_").replace(" ", "")
    args = ["--quiet", "run", "ws1-model", "--fault", spec, "--out", str(out)]
    args += [] if direction == "backward" else ["--no-backward"]  # forward checks do not depend on the backward
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([*H3GATE, *args], capture_output=True, text=True, cwd=tmp, env=env, timeout=1200)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return done.returncode, json.loads((out / "ws1-model.json").read_text(encoding="utf-8"))


@pytest.mark.slow  # the tiny matrix (strict, interpreted) then 8 gate runs: minutes on two cores
def test_the_matrix_predicts_what_the_real_gate_reports(tmp_path, monkeypatch) -> None:
    real = ws1_model.run_model_fault_matrix
    monkeypatch.setattr(ws1_model, "run_model_fault_matrix", lambda *a, **k: real(*a, **k, only=set(E2E)))
    with strict_numerics("cpu"):
        run = prepare(RunSpec("model", "micro", draw="device"))
        result = ws1_model.run_model_gate(ws1_model.ModelGate.of(run, load_tolerance("ws1-model"), fault_matrix=True))
    cases = {f["fault"]: f for f in result.report["fault_matrix"]["faults"]}
    assert set(cases) == set(E2E)
    assert sum(f["located"] for f in cases.values()) >= 6, cases
    for label, case in cases.items():
        rc, doc = _gate_run(label, tmp_path)
        assert rc == (1 if case["caught"] else 0), (label, case, doc["first_failure"])
        if not case["caught"]:
            continue
        first = doc["first_failure"]
        row = first["row"] if first["row"] is not None else doc["first_row_failure"]["row"]
        named = doc["first_row_failure"] if first["row"] is None else first
        got = (first["direction"], first["node"], first["layer"], first.get("operator"), first["check"], row,
               named["modality"])  # fmt: skip
        want = (case["direction"], case["judged"], case["layer"], case["operator"], case["first_check"],
                case["named_row"], case["named_modality"])  # fmt: skip
        assert got == want, (label, got, want)


def test_the_memory_plan_counts_what_the_matrix_keeps(monkeypatch) -> None:
    from h3gate import memory
    from h3gate.errors import InputError
    from h3gate.runs.memory_plan import (
        model_fault_matrix_bytes,
        model_lower_bound_bytes,
        row_stages,
        transformer_blocks,
    )
    from h3gate.runs.setup import ModelNeeds

    blocks = transformer_blocks(split_stages(prepare(RunSpec("model", "micro"), read=False).graph))
    gate = model_lower_bound_bytes(TINY, 84, row_stages(blocks), ModelNeeds().lanes, True)
    kept = model_fault_matrix_bytes(TINY, 84)
    assert kept == (TINY.num_refiner_layers + 2) * 2 * 2 * 84 * TINY.hidden_size * 4
    monkeypatch.setattr(memory, "device_available_bytes", lambda device: gate + kept // 2)  # between the two
    prepare(RunSpec("model", "micro"), ModelNeeds(), read=False)
    with pytest.raises(InputError, match=r"ws1-model --layout micro --config tiny \(S=84\): needs at least"):
        prepare(RunSpec("model", "micro"), ModelNeeds(fault_matrix=True), read=False)


def test_the_matrix_with_an_injected_fault_is_exit_2_with_one_line(run_cli, tmp_path) -> None:
    code, out, err = run_cli("run", "ws1-model", "--fault-matrix", "--fault", "block.0.o_proj:1", "--out",
                             str(tmp_path / "ev"))  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("h3gate: error: --fault-matrix with --fault") and not (tmp_path / "ev").exists()


def test_a_backward_fault_s_row_is_a_row_of_the_gradient_of_the_node_s_first_input() -> None:
    from h3gate.commands.model_cmd import parse_model_fault
    from h3gate.errors import InputError

    setup = prepare(RunSpec("model", "micro"), read=False)
    # heads.video_select has 48 video rows; its backward hands heads.video_proj (84 packed rows) its gradient
    fault = parse_model_fault("heads.video_select:83:scale:backward", setup)
    assert (fault.node, fault.row, fault.direction) == ("heads.video_select", 83, "backward")
    with pytest.raises(InputError, match=r"row '83' must be an integer in \[0, 48\) for heads.video_select$"):
        parse_model_fault("heads.video_select:83:scale", setup)
    with pytest.raises(InputError, match=r"\[0, 84\) for heads.video_select's input heads.video_proj$"):
        parse_model_fault("heads.video_select:84:scale:backward", setup)


# -- a fault that changes no value: the sign of a zero gradient row's zeros ------------------------------------------


def _signed_zero_gradient_keep() -> tuple[MatrixKeep, RowContext]:
    """The plan of tiny's graph with synthetic views of block.1.ffn_gate_up's gradient (the one swiglu's backward
    makes), whose row 1 is zero with mixed signs, as the last block's text rows are (the heads drop them, and
    swiglu's ``g * value * dsilu(gate)`` keeps the sign of ``value * dsilu`` on ``g = 0``)."""
    graph = prepare(RunSpec("model", "micro"), read=False).graph
    keep = MatrixKeep.plan(graph, split_stages(graph), (0, 2), backward=True)
    gen = torch.Generator().manual_seed(5)
    gold = torch.randn((1, 84, 2 * TINY.ffn_dim), generator=gen, dtype=torch.float64)
    gold[0, 1] = 0.0
    cand = gold.to(torch.bfloat16)
    cand[0, 1] = torch.where(torch.arange(cand.shape[-1]) % 2 == 1, -0.0, 0.0)
    prov = (gold * (1 + 2**-8 * torch.randn(gold.shape, generator=gen, dtype=torch.float64))).to(torch.bfloat16)
    env = {"default": row_errors(prov, gold, 1)}
    mods = ["text"] * 24 + ["video"] * 16 + ["audio"] * 12 + ["video"] * 32
    rows = fault_rows_of(84, mods)
    stage = next(s for s in split_stages(graph) if s.label == "block.1")
    keep.backward["block.1.ffn_gate_up"] = {
        "isolated": RowView.of(cand, gold, env, 1, rows, 0.0, mods),
        "chained": RowView.of(cand, gold, env, 1, rows, 0.0, mods, sums=True),
        "provider": error(prov, gold), "stage": stage,
    }  # fmt: skip
    keep.node_vjp["block.1.swiglu"] = RowView.of(cand, gold, env, 1, rows, 0.0, mods)
    ctx = RowContext(load_tolerance("ws1-model").row_rule, [], [], mods, {}, keep=True, kept={KEY: keep})
    return keep, ctx


def test_a_fault_that_only_flips_the_sign_of_zeros_is_excluded_not_missed(monkeypatch) -> None:
    keep, ctx = _signed_zero_gradient_keep()
    labels = {f"backward:block.1.swiglu:row {r}:{k}" for r in (1, 40, 83) for k in ("scale", "zero_tail")}

    def matrix() -> dict:
        keep.excluded = []
        return model_fault_matrix.run_model_fault_matrix(ctx, None, None, load_tolerance("ws1-model"),
                                                         lambda node: False, only=labels)  # fmt: skip

    got = matrix()
    assert got["total"] == got["located"] == 4 and got["pass"], got["faults"]
    reasons = {e["reason"].split(": ", 1)[0]: e["reason"] for e in got["excluded"]}
    assert "changes no bit" in reasons["backward:block.1.swiglu:row 1:scale"]
    assert "only the sign of 8 zeros" in reasons["backward:block.1.swiglu:row 1:zero_tail"]
    # negative control: judged by bytes, the sign flip is counted, no check sees it, and the matrix fails
    bytes_only = model_fault_matrix.unchanged_reason
    monkeypatch.setattr(model_fault_matrix, "unchanged_reason", lambda f, c, bits: bytes_only(f, c, True))
    got = matrix()
    missed = [f for f in got["faults"] if not f["caught"]]
    assert [f["fault"] for f in missed] == ["backward:block.1.swiglu:row 1:zero_tail"] and not got["pass"]


def test_a_sign_flip_is_a_fault_where_an_isolated_bitwise_check_judges_the_value() -> None:
    clean = torch.tensor([[1.5, 0.0, *[-0.0, 0.0, -0.0, 0.0] * 4]], dtype=torch.bfloat16)  # the last 16: zeros
    flipped = corrupt(clean, 0, 0, "zero_tail")
    assert model_fault_matrix.unchanged_reason(flipped, clean, bits=True) is None
    assert "sign of 8 zeros" in model_fault_matrix.unchanged_reason(flipped, clean, bits=False)
    scaled = corrupt(clean, 0, 0, "scale")
    assert model_fault_matrix.unchanged_reason(scaled, clean, bits=False) is None  # 1.5 changed
    clean[0, -1] = 2.0
    assert model_fault_matrix.unchanged_reason(corrupt(clean, 0, 0, "zero_tail"), clean, bits=False) is None
