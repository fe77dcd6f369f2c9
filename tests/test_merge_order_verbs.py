"""``--merge-order`` on ``run ws1-trajectory`` and ``run ws1-ops`` (issue 46): every gate runs in the TP-invariant
``seg8`` order through the one run setup.

Cheap checks (default suite): what each verb binds and records under ``seg8`` (no kernel runs), and the refusals.
The runs themselves (a short seg8 trajectory, every seg8 twin through ws1-ops, a corrupted twin that only the seg8
run can see) are marked slow: under the Triton interpreter each seg8 twin costs seconds.

Not asserted: that the seg8 trajectory's velocities differ from the single order's. At the tiny config's widths
(K = 256 for the O projection) both orders round to the same bf16 bytes on these inputs (measured: the tiny/micro
trajectories are bitwise equal), so such a check would not hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3gate.evidence.schema import validate_document
from h3gate.graph.block import build_block_graph
from h3gate.graph.executions import bind_graph
from h3gate.graph.model import build_model_graph
from h3gate.kernels import rows_seg8
from h3gate.manifests.model_config import load_config
from h3gate.manifests.tolerances import load_tolerance
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.ops import registry
from h3gate.ops.cases import CASES
from h3gate.runs import ws1_ops as opsgate
from h3gate.runs.model_forward import promised
from h3gate.runs.ws1_block import _promise_reason
from h3gate.runs.ws1_trajectory import TrajectorySettings, manifest_fields, operator_bindings, prepare_trajectory

TWINNED = sorted(op for op in registry.specs() if f"{op}_seg8" in registry.specs())
TRAJ = ["--quiet", "run", "ws1-trajectory"]


def _one_line_refusal(result: tuple[int, str, str], *parts: str) -> str:
    code, out, err = result
    assert code == 2, out[-2000:] + err[-2000:]
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("h3gate: error: ") and "Traceback" not in err, err
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# 1. what the verbs bind and record (nothing evaluated)


def test_the_declared_twins_are_the_ones_this_file_expects() -> None:
    """The operators with a seg8 twin: the block's split reductions (a new twin shows up here first)."""
    assert TWINNED == [
        "adaln_gate_residual", "final_adaln_out", "h3_attention_o_gemm", "h3_ffn_down_gemm", "h3_ffn_gate_up_gemm",
        "h3_qk_rmsnorm_d128", "h3_qkv_gemm", "h3_rmsnorm_modulate",
    ]  # fmt: skip


@pytest.mark.parametrize("merge", ["single", "seg8"])
def test_a_trajectory_binds_in_its_merge_order_and_records_it(merge) -> None:
    run = prepare_trajectory(TrajectorySettings(merge=merge))
    assert run.setup.spec.merge == merge and manifest_fields(run)["merge_order"] == merge
    bindings = operator_bindings(run)
    bound = {op: b["bound"] for op, b in bindings.items() if "bound" in b}
    if merge == "single":
        assert bound == {}
        return
    assert bound == {op: f"{op}_seg8" for op in TWINNED}  # every twinned operator of the model runs its twin
    for op, twin in bound.items():
        assert bindings[op]["kernel_id"] == registry.spec(twin).kernel_id and bindings[op]["merge_order"] == "seg8"
        assert run.table[op] is registry.bind(twin, "strict", "cpu").fn  # what the evaluations call


def test_ws1_ops_under_seg8_runs_each_twin_as_its_operators_binding() -> None:
    ops, not_run = opsgate.default_ops(sorted(CASES), "seg8")
    assert not any(opsgate.is_twin(op) for op in ops) and set(TWINNED) <= set(ops)
    assert {r["op"]: r["reason"] for r in not_run if opsgate.is_twin(r["op"])} == {
        f"{op}_seg8": f"runs as {op} (merge order seg8)" for op in TWINNED
    }
    single_ops, _ = opsgate.default_ops(sorted(CASES), "single")
    assert {f"{op}_seg8" for op in TWINNED} <= set(single_ops)  # single: the twins run by their own names
    for op in TWINNED:
        header = opsgate.operator_header(op, "cpu", "seg8")
        name = f"{op}_seg8"
        twin = registry.spec(name)
        assert header["binding"]["bound"] == name and header["binding"]["kernel_id"] == twin.kernel_id
        assert header["merge"] == {"requested": "seg8", "actual": "seg8", "operator": name, "reason": ""}
        contract = header["contract"]  # the twin's own promises
        assert (contract["provider_bitwise"], contract["split_policy"]) == (
            twin.contract.provider_bitwise, twin.contract.split_policy
        )  # fmt: skip
    # the gated residual's single kernel promises the provider's bytes, its twin does not: the promise judged follows
    # the binding
    assert opsgate.operator_header("adaln_gate_residual", "cpu", "single")["contract"]["provider_bitwise"]
    assert not opsgate.operator_header("adaln_gate_residual", "cpu", "seg8")["contract"]["provider_bitwise"]


def test_an_operator_without_a_twin_runs_its_single_kernel_and_says_so() -> None:
    header = opsgate.operator_header("residual_add", "cpu", "seg8")
    assert "bound" not in header["binding"]
    assert header["binding"]["kernel_id"] == registry.spec("residual_add").kernel_id
    assert header["merge"]["actual"] == "single" and header["merge"]["operator"] == "residual_add"
    assert header["merge"]["reason"].startswith("no declared residual_add_seg8 twin: its single kernel runs")
    named = opsgate.merge_record("h3_qkv_gemm_seg8", "single")  # a twin asked for by name under single
    assert named["actual"] == "seg8" and "declared seg8 twin of h3_qkv_gemm" in named["reason"]
    assert opsgate.merge_record("residual_add", "single") == {
        "requested": "single", "actual": "single", "operator": "residual_add", "reason": "",
    }  # fmt: skip


def test_the_default_merge_order_is_seg8_everywhere(run_cli) -> None:
    """One default (h3gate.merge_order): the run setup, the trajectory, the strict API and the CLI all bind seg8."""
    assert DEFAULT_MERGE_ORDER == "seg8"
    assert prepare_trajectory(TrajectorySettings()).setup.spec.merge == "seg8"
    code, out, err = run_cli("run", "ws1-block", "--help")
    assert code == 0 and "[default: seg8]" in " ".join(out.split()), out


# The forward promises follow the binding: a twin that changes the forward's order (O, down: TP splits K) inherits
# neither the device promise (a tolerance's isolated_bitwise_on: the single walk measured bitwise with cuBLAS on CUDA)
# nor its operator's provider_bitwise; a twin whose forward is its operator's kernel (forward_as_single: only the
# backward's row or N sums change) keeps both.
ORDER_CHANGING_TWINS = {"h3_attention_o_gemm_seg8", "h3_ffn_down_gemm_seg8"}


@pytest.mark.parametrize("merge", ["single", "seg8"])
def test_a_node_keeps_its_single_forward_only_where_no_twin_changes_its_order(merge) -> None:
    graph = build_block_graph(load_config("tiny").config)
    bindings = bind_graph(graph, "strict", "cpu", merge)
    changed = {n for n, nb in bindings.items() if not nb.single_forward}
    if merge == "single":
        assert changed == set()
        return
    assert changed == {"o_proj", "ffn_down"}
    for op in TWINNED:
        assert registry.spec(f"{op}_seg8").contract.forward_as_single == (f"{op}_seg8" not in ORDER_CHANGING_TWINS)
    # the gated residual's twin declares provider_bitwise false (its dgate is another order) and forwards as its
    # operator, whose contract promises the provider's bytes: the node keeps that promise
    assert not registry.spec("adaln_gate_residual_seg8").contract.provider_bitwise
    assert bindings["residual_attn"].provider_bitwise and bindings["residual_mlp"].provider_bitwise
    assert not any(op.startswith("block") for op in changed)


@pytest.mark.parametrize("merge", ["single", "seg8"])
def test_the_device_promise_applies_to_a_gemm_node_only_with_its_single_forward(merge) -> None:
    cfg = load_config("tiny").config
    graph = build_model_graph(cfg, layers=(0, 1))
    gate = SimpleNamespace(
        tolerance=load_tolerance("ws1-model"), device="cuda", sglang=None,
        bindings=bind_graph(graph, "strict", "cpu", merge),
    )  # fmt: skip
    applies = {n.name: promised(gate, n)[1] for n in graph.nodes if n.name.startswith("block.0.")}
    gemms = {f"block.0.{n}": True for n in ("q_proj", "k_proj", "v_proj", "ffn_gate_up")}
    assert {n: applies[n] for n in gemms} == gemms
    assert applies["block.0.o_proj"] == applies["block.0.ffn_down"] == (merge == "single")
    gate.device = "cpu"  # listed for CUDA only
    assert not promised(gate, next(n for n in graph.nodes if n.name == "block.0.q_proj"))[1]


def test_the_record_says_why_a_device_promise_does_not_apply() -> None:
    assert _promise_reason(True, True, True, True, "cuda") == "listed for cuda devices (isolated_bitwise_on)"
    assert _promise_reason(True, False, True, False, "cuda") == (
        "listed for cuda devices (isolated_bitwise_on) for the single walk; a merge twin runs"
    )


def _twins(bindings) -> set[str]:
    """The ops bound to a merge twin (a record naming a ``bound`` operator other than its own)."""
    return {b.op for nb in bindings.values() for b in nb.bindings if b.bound and b.bound != b.op}


@pytest.mark.parametrize("merge", ["single", "seg8"])
def test_the_bench_times_the_single_walk_as_strict_whatever_the_default(merge, monkeypatch) -> None:
    """``bench ws1-block`` / ``ws1-model``: the ``strict`` arm is the single walk (what every order is measured
    against), the ``strict_seg8`` arm the twins; bound in the default order, strict would time seg8 against itself."""
    from h3gate.bench import block as bench_block
    from h3gate.bench import model as bench_model

    graph = build_block_graph(load_config("tiny").config)
    strict = bind_graph(graph, "strict", "cpu", bench_block.STRICT_ORDER)
    tables, seg8 = bench_block.arm_tables(graph, strict, "cpu", merge)
    assert _twins(strict) == set()  # the single walk binds no twin
    assert tables["strict"]["h3_attention_o_gemm"] is not None  # the strict arm is the given bindings' table
    if merge == "single":
        assert list(tables) == ["provider", "strict"] and seg8 == {}
    else:
        assert list(tables) == ["provider", "strict", "strict_seg8"]
        assert {"h3_attention_o_gemm", "h3_ffn_down_gemm"} <= _twins(seg8)
    specs = []

    def stop(spec, *args, **kwargs):
        specs.append(spec)
        raise LookupError("stopped after the run spec")

    monkeypatch.setattr(bench_block, "prepare", stop)
    monkeypatch.setattr(bench_model, "prepare", stop)
    for bench in (
        lambda: bench_block.bench_block("micro", "tiny", "cuda"),
        lambda: bench_model._setup("micro", "tiny", "cuda"),
    ):
        with pytest.raises(LookupError):
            bench()
    assert [s.merge for s in specs] == [bench_block.STRICT_ORDER] * 2 == ["single"] * 2


@pytest.mark.parametrize("scope", ["block", "model"])
def test_ws2_draws_its_weights_where_the_ws1_verb_of_its_scope_does(scope) -> None:
    """``run ws2 --save-tensors`` compares with ``run ws1-block`` / ``ws1-model --save-tensors`` only if both draw
    the synthetic weights alike (on a GPU a device draw gives other values than the CPU's generator)."""
    from h3gate.commands.model_cmd import MODEL_RUN
    from h3gate.commands.run_cmd import Ws1BlockCommand
    from h3gate.parallel.ws2 import Ws2Settings, plan_ws2
    from h3gate.runs.setup import SCOPE_DRAW

    ws1 = {"block": Ws1BlockCommand.run.draw, "model": MODEL_RUN.draw}
    assert ws1 == SCOPE_DRAW == {"block": "cpu", "model": "device"}
    assert plan_ws2(Ws2Settings("tp2", scope=scope)).run.spec.draw == ws1[scope]


# 2. refusals: exit 2, one line, nothing written


@pytest.mark.parametrize("verb", [["run", "ws1-trajectory"], ["run", "ws1-ops", "--op", "residual_add"]])
def test_a_bad_merge_order_is_exit_2_in_one_line(run_cli, tmp_path, verb) -> None:
    line = _one_line_refusal(run_cli("--quiet", *verb, "--merge-order", "seg16", "--out", tmp_path / "out"))
    assert line == "h3gate: error: --merge-order 'seg16': must be one of single, seg8"
    assert not (tmp_path / "out").exists()


# 3. the runs (slow: the seg8 twins under the Triton interpreter)


@pytest.mark.slow
def test_a_seg8_trajectory_passes_names_its_twins_and_refuses_a_resume_in_single(run_cli, tmp_path) -> None:
    rundir = tmp_path / "run"
    steps = ["--steps", "4", "--merge-order", "seg8"]  # 3 evaluations
    code, out, err = run_cli(*TRAJ, "--out", rundir, *steps, "--until", "1")
    assert code == 0, out[-3000:] + err[-3000:]
    assert out.splitlines()[-1].startswith("verdict: pass (") and "merge order seg8" in out
    doc = json.loads((rundir / "ws1-trajectory.json").read_text(encoding="utf-8"))
    validate_document(doc, "ws1-trajectory")
    validate_document(json.loads((rundir / "manifest.json").read_text(encoding="utf-8")), "trajectory-manifest")
    assert doc["run"]["merge_order"] == "seg8" and doc["steps_saved"] == 2
    assert {op: b.get("bound") for op, b in doc["bindings"].items() if "bound" in b} == {
        op: f"{op}_seg8" for op in TWINNED
    }
    for op in TWINNED:
        assert doc["bindings"][op]["kernel_id"] == registry.spec(f"{op}_seg8").kernel_id

    before = _tree(rundir)  # negative control: the same run resumed in the other order is refused, nothing written
    _one_line_refusal(run_cli(*TRAJ, "--out", rundir, "--steps", "4", "--resume", "--merge-order", "single"),
                      "--resume", "merge_order differs from the saved run (saved 'seg8', now 'single')")  # fmt: skip
    assert _tree(rundir) == before

    code, out, err = run_cli(*TRAJ, "--out", rundir, *steps, "--resume")
    assert code == 0, out[-3000:] + err[-3000:]
    doc = json.loads((rundir / "ws1-trajectory.json").read_text(encoding="utf-8"))
    assert doc["complete"] and doc["verdict"] == "pass" and doc["determinism"]["pairs"]["candidate"] > 0
    code, out, err = run_cli(*TRAJ, "--out", rundir, *steps, "--verify-last")
    assert code == 0 and "bitwise: yes" in out, out[-3000:] + err[-3000:]


@pytest.mark.slow
def test_ws1_ops_seg8_passes_every_twin_and_names_its_kernel(run_cli, tmp_path) -> None:
    args = ["--quiet", "run", "ws1-ops", "--device", "cpu", "--layouts", "micro", "--merge-order", "seg8"]
    for op in [*TWINNED, "residual_add"]:
        args += ["--op", op]
    code, out, err = run_cli(*args, "--out", tmp_path)
    assert code == 0, out[-3000:] + err[-3000:]
    doc = json.loads((tmp_path / "ws1-ops.json").read_text(encoding="utf-8"))
    validate_document(doc, "ws1-ops")
    assert doc["merge_order"] == "seg8" and doc["verdict"] == "pass" and doc["failures"] == []
    by_op = {o["op"]: o for o in doc["operators"]}
    for op in TWINNED:
        name = f"{op}_seg8"
        assert by_op[op]["binding"]["bound"] == name
        assert by_op[op]["binding"]["kernel_id"] == registry.spec(name).kernel_id
        assert by_op[op]["merge"]["actual"] == "seg8" and by_op[op]["verdict"] == "pass"
    assert by_op["residual_add"]["merge"]["actual"] == "single"
    assert "no declared twin, single kernel ran: residual_add" in out


@pytest.mark.slow
def test_a_twin_wrong_on_one_row_fails_only_the_seg8_run(run_cli, tmp_path, monkeypatch) -> None:
    """Negative control: the gated-residual twin scaled on one output row. The seg8 run binds it and fails, located
    by the row rule; the single run binds the single kernel and passes (so the seg8 run really ran the twin)."""
    from h3gate.gate.faults import corrupt

    real, row = rows_seg8.adaln_gate_residual_seg8, 5
    dim = CASES["adaln_gate_residual_seg8"](7, load_config("tiny").config, "meta", 0).out_row_dim
    monkeypatch.setattr(rows_seg8, "adaln_gate_residual_seg8", lambda *a: corrupt(real(*a), row, dim, "scale"))
    base = ["--quiet", "run", "ws1-ops", "--device", "cpu", "--layouts", "micro", "--op", "adaln_gate_residual"]
    code, out, err = run_cli(*base, "--merge-order", "seg8", "--out", tmp_path / "seg8")
    assert code == 1, out[-3000:] + err[-3000:]
    doc = json.loads((tmp_path / "seg8" / "ws1-ops.json").read_text(encoding="utf-8"))
    assert any(f.startswith("adaln_gate_residual S=84: forward row rule") and f": row {row}:" in f
               for f in doc["failures"]), doc["failures"]  # fmt: skip
    code, out, err = run_cli(*base, "--merge-order", "single", "--out", tmp_path / "single")
    assert code == 0, out[-3000:] + err[-3000:]


def test_a_title_names_the_merge_order_only_where_h3gate_s_kernels_ran_in_one() -> None:
    from h3gate.commands.explain import merge_label

    assert merge_label({"mode": "strict", "merge_order": "seg8"}) == ", merge order seg8"
    assert merge_label({"mode": "audit", "merge_order": "single"}) == ", merge order single"
    assert merge_label({"mode": "off", "merge_order": "seg8"}) == ""  # the provider's ops
    assert merge_label({"mode": "strict", "merge_order": "seg8", "candidate": {"versions": {}}}) == ""  # SGLang's
    assert merge_label({"mode": "strict"}) == ""  # a record made before the order was recorded
