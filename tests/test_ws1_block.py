"""``h3gate run ws1-block``: the engine (verdicts, first drift, invariance), its evidence schema, and the CLI."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from h3gate.commands import run_cmd
from h3gate.errors import InputError
from h3gate.evidence.schema import validate_document
from h3gate.gate.compare import tensor_sha256
from h3gate.graph.block import BLOCK_NODES, block_params, build_block_graph
from h3gate.graph.inputs import build_block_inputs
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec
from h3gate.manifests.model_config import load_config
from h3gate.manifests.tolerances import load_tolerance, tolerance_path
from h3gate.ops import registry
from h3gate.runs import memory_plan
from h3gate.runs import setup as run_setup
from h3gate.runs.ws1_block import BlockGate, run_block_gate
from h3gate.synth import SyntheticSource, write_checkpoint

SMALL = LayoutSpec(text_tokens=9, latent_frames=2, latent_height=4, latent_width=6, audio_latents=3, anchors=["first"])


@pytest.fixture(scope="module")
def small():
    cfg = load_config("tiny").config
    source = SyntheticSource(cfg, 0)
    layout = build_layout(SMALL, "small-test")
    return cfg, layout, block_params(source, 0), build_block_inputs(layout, cfg, source, 0, "cpu")


def _gate(small, mode, **kw) -> BlockGate:
    cfg, _, params, inputs = small
    return BlockGate(build_block_graph(cfg), inputs, params, "cpu", mode, load_tolerance("ws1-block"), **kw)


def _one_ulp_at(row: int):
    """A q_norm override: the provider's q_norm plus one BF16 ulp on every element of packed row ``row`` (of every
    batch item), added differentiably (``out + delta`` is exact: delta is one ulp of each element)."""
    node = build_block_graph(load_config("tiny").config).node("q_norm")

    def fn(ops, x, p):
        out = node.fn(ops, x, p)
        up = out.detach()[:, row].clone()
        up.view(torch.int16).add_(1)
        delta = torch.zeros_like(out)
        delta[:, row] = up - out.detach()[:, row]
        return out + delta

    return fn


def test_off_mode_is_the_provider_and_passes(small):
    result = run_block_gate(_gate(small, "off"))
    rep = result.report
    assert result.verdict == "pass" and result.failing == []
    assert all(n["binding"]["actual"] == "provider" and n["binding"]["label"] == "reference" for n in rep["nodes"])
    assert all(n["chained"]["bitwise"] and n["isolated"]["bitwise"] for n in rep["nodes"])
    assert rep["first_drift"] is None and rep["first_isolated_drift"] is None
    assert rep["fallbacks"] == []
    bw = rep["backward"]
    assert set(bw["leaves"]) == {"hidden_states", "temb", *block_params.__globals__["BLOCK_PARAMS"]}
    assert set(bw["nodes"]) == set(BLOCK_NODES)
    assert bw["leaves"]["hidden_states"]["batch_row"]["bitwise"] is True
    assert bw["nodes"]["adaln_projection"]["batch_row"] is None  # sums over the batch: no per-row check


def _specs(monkeypatch, kernel_for) -> None:
    """Replace the operator declarations: ``kernel_for(name, spec)`` is the kernel import path or None. Keeps these
    tests independent of which Triton kernels exist (a stand-in "kernel" is the operator's reference)."""
    real = registry.specs()
    fake = {}
    for name, spec in real.items():
        kernel = kernel_for(name, spec)
        fake[name] = spec.model_copy(update={"kernel": kernel, "kernel_id": None if kernel is None else f"test:{name}"})
    monkeypatch.setattr(registry, "specs", lambda: fake)


@pytest.fixture
def no_kernels(monkeypatch):
    _specs(monkeypatch, lambda name, spec: None)


def test_audit_mode_reports_every_fallback_as_a_failing_finding(small, no_kernels):
    result = run_block_gate(_gate(small, "audit", backward=False))
    rep = result.report
    fallback_nodes = {f["node"] for f in rep["fallbacks"]}
    flagged = {c.split(".")[1] for c in result.failing if ".no_fallback" in c}
    assert fallback_nodes == flagged
    for node in rep["nodes"]:
        assert node["binding"]["fallback"] == (node["name"] in fallback_nodes)
        if node["binding"]["fallback"]:
            assert node["binding"]["actual"] == "provider" and node["binding"]["label"] == "reference"
    assert len(fallback_nodes) == 17 and result.verdict == "fail"
    assert len(result.failing) == 17  # nothing but the fallbacks fails: the references are the provider
    assert rep["backward"] is None


def test_auto_mode_records_fallbacks_without_failing_on_them(small, no_kernels):
    result = run_block_gate(_gate(small, "auto", backward=False))
    assert result.verdict == "pass" and result.failing == []
    assert {f["node"] for f in result.report["fallbacks"]} == set(BLOCK_NODES)


def test_first_drift_localises_a_one_ulp_perturbation(small):
    cfg, layout, *_ = small
    row = int(layout.video_indices[3])
    result = run_block_gate(_gate(small, "off", node_overrides={"q_norm": _one_ulp_at(row)}))
    rep = result.report
    assert rep["first_drift"] == {"node": "q_norm", "first_row": row, "first_modality": "video"}
    assert rep["first_isolated_drift"] == {"node": "q_norm", "first_row": row, "first_modality": "video"}
    nodes = {n["name"]: n for n in rep["nodes"]}
    before = BLOCK_NODES[: BLOCK_NODES.index("q_norm")]
    assert all(nodes[n]["chained"]["bitwise"] for n in before)
    q = nodes["q_norm"]["chained"]
    assert q["rows_differing"] == 1 and q["max_abs"] > 0
    assert nodes["attention"]["chained"]["first_row"] == row  # attention output row r reads q row r only
    # isolated: only the perturbed node differs; chained: the drift reaches the output through row `row`
    assert [n for n in BLOCK_NODES if not nodes[n]["isolated"]["bitwise"]] == ["q_norm"]
    assert nodes["k_norm"]["chained"]["bitwise"] and nodes["rope_k"]["chained"]["bitwise"]
    assert nodes["rope_q"]["chained"]["first_row"] == row
    assert not nodes["residual_mlp"]["chained"]["bitwise"]
    # the perturbation is deterministic and per row: repeat and batch probes stay clean
    assert rep["first_repeat_drift"] is None and rep["first_batch_drift"] is None
    assert "forward.q_norm.isolated_bitwise (promised by the tolerance profile)" in result.failing
    assert result.verdict == "fail"
    bw = rep["backward"]
    assert bw["first_grad_drift"] is not None and bw["first_grad_drift"]["first_row"] == row
    assert bw["first_grad_repeat_drift"] is None and bw["first_grad_batch_drift"] is None


def test_a_repeat_drift_is_found_and_fails(small):
    calls = {"n": 0}
    node = build_block_graph(load_config("tiny").config).node("swiglu")

    def flaky(ops, x, p):  # differs on every call: what a nondeterministic kernel looks like
        calls["n"] += 1
        out = node.fn(ops, x, p)
        return out + calls["n"] * torch.finfo(torch.bfloat16).eps * out.detach().abs()

    result = run_block_gate(_gate(small, "off", node_overrides={"swiglu": flaky}, backward=False))
    assert result.report["first_repeat_drift"]["node"] == "swiglu"
    assert any(c.startswith("forward.swiglu.repeat_bitwise") for c in result.failing)


def test_unknown_node_in_the_tolerance_profile_is_an_input_error(small, tmp_path):
    body = tolerance_path("ws1-block").read_text().replace("isolated_bitwise: [norm1,", "isolated_bitwise: [nrom1,")
    (tmp_path / "typo.yaml").write_text(body)
    gate = _gate(small, "off")
    gate.tolerance = load_tolerance(tmp_path / "typo.yaml")
    with pytest.raises(InputError, match="forward.isolated_bitwise: unknown node 'nrom1'"):
        run_block_gate(gate)


def test_tolerance_profile_breadcrumbs(tmp_path):
    (tmp_path / "bad.yaml").write_text(tolerance_path("ws1-block").read_text().replace("error_factor: 1.25", "x: 1"))
    with pytest.raises(InputError, match=r"bad\.yaml: forward\.error_factor: required field missing"):
        load_tolerance(tmp_path / "bad.yaml")
    with pytest.raises(InputError, match="tolerance profile 'nope': unknown"):
        load_tolerance("nope")


# ---- CLI -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """``h3gate run ws1-block --mode audit --device cpu`` on the embedded default (tiny config, tiny layout).

    Every operator is declared kernel-less here, so audit binds all 17 nodes to the reference and the run takes
    seconds; the declared Triton kernels go through the gate in ``test_declared_kernels_through_the_gate``.
    """
    from h3gate.cli import main

    root = tmp_path_factory.mktemp("ws1")
    saved = root / "tensors"
    with pytest.MonkeyPatch.context() as mp:
        _specs(mp, lambda name, spec: None)
        mp.setattr(run_cmd, "LOCAL_EVIDENCE", root / "evidence")
        with pytest.raises(SystemExit) as exc:
            main(["run", "ws1-block", "--mode", "audit", "--device", "cpu", "--save-tensors", str(saved)])
    latest = root / "evidence" / "ws1-block" / "tiny-tiny" / "latest"  # the default run folder, linked as latest
    assert latest.is_symlink() and not (latest / ".h3gate-unfinished").exists()
    return exc.value.code, json.loads((latest / "ws1-block.json").read_text()), saved


def test_default_run_exit_code_and_evidence(default_run):
    code, doc, _ = default_run
    assert code == 1 and doc["verdict"] == "fail"  # audit: every fallback is a failing finding
    assert {f["node"] for f in doc["fallbacks"]} == set(BLOCK_NODES)
    assert sorted(c.split(" ")[0] for c in doc["failing_checks"]) == sorted(
        f"forward.{n}.no_fallback" for n in BLOCK_NODES
    )
    assert doc["config"]["name"] == "tiny" and doc["layout"]["name"] == "tiny" and doc["layout"]["seq_len"] == 264
    assert doc["layout"]["rows"] == {"text": 120, "video": 128, "audio": 16}
    assert doc["device"] == "cpu" and doc["mode"] == "audit" and doc["checkpoint"]["kind"] == "synthetic"
    assert [n["name"] for n in doc["nodes"]] == list(BLOCK_NODES)
    assert doc["tolerance"]["sha256"] == hashlib.sha256(tolerance_path("ws1-block").read_bytes()).hexdigest()
    for node in doc["nodes"]:
        b = node["binding"]
        assert (b["requested"], b["actual"], b["label"], b["fallback"]) == ("triton", "provider", "reference", True)
        assert node["chained"]["bitwise"] and node["isolated"]["bitwise"]
        assert node["error"]["provider"]["rel_l2"] > 0  # the golden is a different execution
    assert doc["first_drift"] is None and doc["first_repeat_drift"] is None and doc["first_batch_drift"] is None
    assert len(doc["backward"]["leaves"]) == 14 and all(v["pass"] for v in doc["backward"]["leaves"].values())
    assert doc["inputs"]["distinct_timesteps"] == 2 and doc["inputs"]["steps"] == 50
    assert doc["timing"]["wall_s"] > 0
    assert doc["memory"]["upper_gib"] >= doc["memory"]["device_gib"] and doc["memory"]["available_gib"] > 0
    validate_document(doc, "ws1-block")


# ~17 s on two cores: make test-slow (.ci/run runs both); in make test the default command runs every declared kernel
# through the same gate (tests/test_gate_trust.py)
@pytest.mark.slow
def test_declared_kernels_through_the_gate(small, tmp_path):
    """The operators' declared kernels (Triton, interpreted on CPU) through the whole gate, forward and backward, in
    the single order: each operator's own kernel (the default order's twins: tests/test_merge_order_verbs.py)."""
    from h3gate.evidence.writer import write_evidence
    from h3gate.graph.executions import bind_graph

    cfg, layout, params, inputs = small
    single = bind_graph(build_block_graph(cfg), "auto", "cpu", "single")
    result = run_block_gate(_gate(small, "auto", bindings=single))
    rep = result.report
    for node in rep["nodes"]:
        declared = all(registry.spec(op).kernel is not None for op in node["ops"])
        b = node["binding"]
        assert b["actual"] == ("triton" if declared else "provider"), node["name"]
        assert (b["label"] == "reference") == (b["actual"] == "provider")
        assert [o["kernel_id"] for o in b["ops"]] == [
            registry.spec(op).kernel_id if declared else f"provider:{registry.spec(op).reference}" for op in node["ops"]
        ]
        assert node["isolated_bitwise_promise"]["applies"] == (
            node["name"] in load_tolerance("ws1-block").forward.isolated_bitwise
            and all(o["actual"] == "provider" or registry.spec(o["op"]).contract.provider_bitwise for o in b["ops"])
        )
    assert (result.verdict == "pass") == (result.failing == []), result.failing
    # the schedules the candidate's kernels launched, by node, from the kernels themselves (interpreted pointer walks
    # here; the H200's Gluon / TMA walks show there): the attention node and every GEMM node, nothing else
    from h3gate.kernels import attention, gemm

    launched = {n["name"]: n["launch"] for n in rep["nodes"] if "launch" in n}
    gemm_nodes = set(launched) - {"attention"}  # the strict GEMM's callers: the projections and the AdaLN one
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "ffn_gate_up", "ffn_down", "adaln_projection"} == gemm_nodes
    (att,) = launched["attention"]["h3_full_attention"]
    q = torch.empty(1, layout.seq_len, cfg.num_attention_heads, cfg.attention_head_dim, dtype=torch.bfloat16)
    assert att == attention.launch_record(q) and att["forward"] == att["backward"] == "triton_pointer"
    for name in gemm_nodes:
        for op, records in launched[name].items():
            assert records and all(set(r) == {"forward", "dx", "dw", "interpreted"} for r in records), (name, op)
    wo = params["attn.to_out.0.weight"]  # o_proj: x (1, S, inner) @ Wo^T, one launch
    x = torch.empty(1, layout.seq_len, wo.shape[1], dtype=wo.dtype)
    assert launched["o_proj"] == {"h3_attention_o_gemm": [gemm.launch_record(x, wo)]}
    checkpoint = {"kind": "synthetic", "path": None, "seed": 0}
    spec = run_setup.RunSpec("block", mode="auto", merge="single")
    setup = run_setup.Run(spec, "tiny", cfg, layout, None, checkpoint, [], block=run_setup.BlockData(params, inputs))
    tol = load_tolerance("ws1-block")
    body = run_cmd.build_body(setup, result, "auto", 0, tol, tolerance_path("ws1-block"))
    write_evidence(tmp_path, "ws1-block.json", "ws1-block", body)  # validates against the schema


def test_report_schema_rejects_inconsistent_documents(default_run):
    _, doc, _ = default_run
    bad = copy.deepcopy(doc)
    bad["verdict"] = "pass" if doc["failing_checks"] else "fail"
    with pytest.raises(InputError):
        validate_document(bad, "ws1-block")
    bad = copy.deepcopy(doc)
    del bad["nodes"][0]["chained"]["first_row"]
    with pytest.raises(InputError, match="first_row"):
        validate_document(bad, "ws1-block")


def test_saved_tensors_are_what_ran(default_run):
    _, doc, saved = default_run
    inputs = load_file(saved / "inputs.safetensors")
    assert set(inputs) == {"hidden_states", "temb", "adaln_indices", "rope_cos", "rope_sin", "attention_order"}
    for key, info in doc["inputs"]["tensors"].items():
        assert tensor_sha256(inputs[key]) == info["sha256"]
    for who in ("provider", "candidate", "golden"):
        tensors = load_file(saved / f"{who}.safetensors")
        assert set(tensors) == {*BLOCK_NODES, "output"}
        assert torch.equal(tensors["output"], tensors["residual_mlp"])
    provider = load_file(saved / "provider.safetensors")
    for node in doc["nodes"]:
        assert tensor_sha256(provider[node["name"]]) == node["sha256"]["provider"]
    assert load_file(saved / "golden.safetensors")["output"].dtype == torch.float64


def test_saved_gradients_are_the_candidate_gradients_the_gate_hashed(default_run):
    """With the backward, ``candidate-grads`` holds the candidate's gradients under ``run ws2``'s keys: each is the
    tensor whose sha256 the evidence's backward record carries, and the cotangent is ``block_cotangent``'s.
    Negative control: one gradient changed by one ulp no longer matches its record."""
    from h3gate.graph.inputs import block_cotangent

    _, doc, saved = default_run
    grads = load_file(saved / "candidate-grads.safetensors")
    bw = doc["backward"]
    leaves = {f"input:{k}" if k in ("hidden_states", "temb") else f"param:{k}": rec for k, rec in bw["leaves"].items()}
    records = {**{f"node:{k}": rec for k, rec in bw["nodes"].items()}, **leaves}
    assert set(grads) == {*records, "cotangent:residual_mlp"}
    assert {k.partition(":")[0] for k in grads} == {"node", "input", "param", "cotangent"}
    for key, rec in records.items():
        assert tensor_sha256(grads[key]) == rec["sha256"]["candidate"], key
    h = load_file(saved / "inputs.safetensors")["hidden_states"]
    want = block_cotangent(int(doc["seed"]), h.shape[1], h.shape[2], "cpu")
    assert torch.equal(grads["cotangent:residual_mlp"].view(torch.int16), want.view(torch.int16))
    bent = grads["node:o_proj"].clone()
    bent.view(torch.int16).view(-1)[3] += 1
    assert tensor_sha256(bent) != records["node:o_proj"]["sha256"]["candidate"]


@pytest.mark.parametrize("short", ["memory", "disk"])
def test_saved_tensors_that_do_not_fit_are_exit_2_before_any_work(run_cli, tmp_path, monkeypatch, short) -> None:
    """``--save-tensors``' files are bounded against host memory and the folder's disk before any weight is read:
    one byte less than :func:`~h3gate.runs.memory_plan.block_saved_bytes` available is exit 2 naming it; the bound
    itself passes (the control); the gradients count only with the backward."""
    from h3gate import memory

    spec = run_setup.RunSpec(device="cpu")
    setup = run_setup.prepare(spec, read=False)
    need = memory_plan.block_saved_bytes(setup.cfg, setup.layout.seq_len, True)
    assert memory_plan.block_saved_bytes(setup.cfg, setup.layout.seq_len, False) < need
    started = []
    monkeypatch.setattr(run_cmd, "read_inputs", lambda *a, **k: started.append(1) or (_ for _ in ()).throw(
        RuntimeError("weights read")))  # fmt: skip
    real = memory.device_available_bytes
    target = "device_available_bytes" if short == "memory" else "free_disk_bytes"
    for budget, refused in ((need - 1, True), (need, False)):
        if short == "memory":
            monkeypatch.setattr(memory, target, lambda d, b=budget: b if d == "cpu" else real(d))
        else:
            monkeypatch.setattr(memory, target, lambda *_a, b=budget: b)
        monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: None)  # the gate's own plan: no bound
        args = ("run", "ws1-block", "--device", "cpu", "--save-tensors", tmp_path / "t", "--out", tmp_path / "ev")
        code, out, err = run_cli(*args)
        if refused:
            what = "needs at least" if short == "memory" else "writes at least"
            assert code == 2 and err.startswith("h3gate: error: --save-tensors at --layout tiny") and what in err, err
            assert len(err.strip().splitlines()) == 1 and not started and not (tmp_path / "ev").exists()
        else:
            assert code == 3 and started, err  # past the check, to the (stubbed) weights


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layout", "nope"], "layout 'nope': unknown"),
        (["--config", "nope"], "config 'nope': unknown"),
        (["--mode", "bogus"], "--mode 'bogus': must be one of strict, audit, auto, off"),
        (["--tolerance", "nope"], "tolerance profile 'nope': unknown"),
        (["--checkpoint", "/nonexistent/ckpt"], "no such checkpoint folder"),
    ],
)
def test_bad_inputs_exit_2(run_cli, tmp_path, args, message):
    code, _, err = run_cli("run", "ws1-block", "--device", "cpu", "--out", tmp_path / "ev", *args)
    assert code == 2
    assert message in err and err.startswith("h3gate: error: ") and err.count("\n") == 1
    assert not (tmp_path / "ev").exists()


def test_cpu_run_too_large_for_memory_refuses_before_loading(run_cli, tmp_path, monkeypatch):
    """768p at real widths on the CPU would hold tens of GiB: refused up front (exit 2), nothing written. The bound
    is the streamed forward's (--no-backward): weights, pass 1's golden + 3 provider lanes + candidate at the widest
    node, and the value store (on the CPU, the host is the device)."""
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 4 * 2**30)
    monkeypatch.setattr(
        run_setup, "block_params", lambda *a, **k: pytest.fail("weights loaded before the memory check")
    )
    code, out, err = run_cli(
        "run", "ws1-block", "--layout", "768p", "--config", "real", "--device", "cpu", "--mode", "off",
        "--no-backward", "--out", tmp_path / "ev",
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert err == (
        "h3gate: error: --layout 768p --config real --device cpu: needs at least 54.1 GiB (S=38974), "
        "4.0 GiB available; use a smaller layout or --device cuda\n"
    )
    assert not (tmp_path / "ev").exists()


def test_cpu_memory_lower_bound_counts_weights_and_kept_values():
    cfg = load_config("tiny").config
    h, nd, f = 192, 256, 384
    assert memory_plan.block_lower_bound_bytes(cfg, 0) == (4 * h * nd + 3 * h * f) * 10
    kept = memory_plan.block_lower_bound_bytes(cfg, 264) - memory_plan.block_lower_bound_bytes(cfg, 0)
    assert kept == 264 * (6 * h + 8 * nd + 3 * f) * 14  # float64 golden, provider, candidate chained and isolated


def test_the_backward_bound_adds_five_lanes_of_gradients():
    """While the golden's backward runs, the provider, its repeat, the candidate, its repeat (bf16) and the golden
    (float64) hold their weight and node-output gradients together: 16 bytes per weight and per element."""
    cfg = load_config("tiny").config
    h, nd, f = 192, 256, 384
    weights = 4 * h * nd + 3 * h * f
    assert memory_plan.block_backward_bytes(cfg, 0) == weights * 16
    node_elems = sum(memory_plan.row_widths(cfg)[n] for n in BLOCK_NODES)
    kept = memory_plan.block_backward_bytes(cfg, 264) - memory_plan.block_backward_bytes(cfg, 0)
    assert kept == 264 * node_elems * 16


def test_the_released_block_backward_is_refused_on_one_h200_and_medium_is_not(monkeypatch):
    """768p's block backward holds at least 153.7 GiB (forward values 71.0 GiB, gradients 82.8 GiB): refused up front
    on a 139.3 GiB H200, naming --no-backward; medium's (21.0 GiB) is planned on the device."""
    from h3gate import memory
    from h3gate.manifests.layouts import load_layout

    cfg, gib = load_config("real").config, 2**30
    monkeypatch.setattr(memory, "device_available_bytes", lambda device: int(139.3 * gib))

    def plan(name: str):
        packed = build_layout(load_layout(name), name)
        return memory_plan.plan_block_memory(cfg, packed, name, "real", "cuda", memory_plan.GateNeeds(7))

    assert round(plan("medium").device_bytes / gib, 1) == 21.0
    with pytest.raises(InputError, match=r"\(S=38974\): needs at least 153\.7 GiB.*; use a smaller layout or --no-b"):
        plan("768p")


def test_the_memory_bound_refuses_the_released_ref2va_block_on_one_h200():
    """Measured on the H200 (139.3 GiB free): 768p's block gate ran; ref2va-768p's ran out of memory in the golden
    (session 11). The bound keeps the first and refuses the second before any weight is read."""
    cfg, h200 = load_config("real").config, 139.3 * 2**30
    assert memory_plan.block_lower_bound_bytes(cfg, 38974) < h200 < memory_plan.block_lower_bound_bytes(cfg, 83386)


class _Drop:
    def __init__(self, source, drop):
        self.source, self.drop = source, drop

    def names(self):
        return [n for n in self.source.names() if n != self.drop]

    def meta(self, name):
        return self.source.meta(name)

    def load(self, name, device="cpu", check_finite=False):
        return self.source.load(name, device)

    def config(self):
        return self.source.config()


def test_checkpoint_lacking_a_block0_tensor_exits_2(run_cli, tmp_path):
    source = _Drop(SyntheticSource(load_config("tiny").config, 0), "transformer_blocks.0.ff.net.2.weight")
    write_checkpoint(source, None, tmp_path / "ckpt")
    args = ("--device", "cpu", "--mode", "off", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "ev")
    code, _, err = run_cli("run", "ws1-block", *args)
    assert code == 2
    assert "transformer_blocks.0.ff.net.2.weight: missing" in err


class _Poison(_Drop):
    """A source whose one named tensor holds a NaN (written into the checkpoint as is)."""

    def names(self):
        return self.source.names()

    def load(self, name, device="cpu", check_finite=False):
        tensor = self.source.load(name, device)
        if name == self.drop:
            tensor = tensor.clone()
            tensor.view(-1)[3] = float("nan")
        return tensor


def test_checkpoint_with_a_non_finite_block0_tensor_exits_2(run_cli, tmp_path):
    source = _Poison(SyntheticSource(load_config("tiny").config, 0), "transformer_blocks.0.attn.to_k.weight")
    write_checkpoint(source, None, tmp_path / "ckpt")
    args = ("--device", "cpu", "--mode", "off", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "ev")
    code, _, err = run_cli("run", "ws1-block", *args)
    assert code == 2
    assert err.strip() == "h3gate: error: transformer_blocks.0.attn.to_k.weight: non-finite values"
    assert not (tmp_path / "ev").exists()


def test_sharded_checkpoint_equals_the_synthetic_weights_it_was_written_from(run_cli, tmp_path):
    write_checkpoint(load_config("tiny").config, 0, tmp_path / "ckpt", shard_size=200_000)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    common = ["run", "ws1-block", "--device", "cpu", "--mode", "off", "--no-backward", "--json"]
    code_s, out_s, _ = run_cli(*common, "--out", tmp_path / "synthetic")
    code_c, out_c, _ = run_cli(*common, "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "checkpoint")
    synthetic, checkpoint = json.loads(out_s), json.loads(out_c)
    assert code_s == code_c == 0
    assert checkpoint["checkpoint"]["kind"] == "checkpoint" and checkpoint["config"]["name"] == "tiny"
    assert [n["sha256"] for n in synthetic["nodes"]] == [n["sha256"] for n in checkpoint["nodes"]]
    code, _, err = run_cli(*common, "--checkpoint", tmp_path / "ckpt", "--config", "real", "--out", tmp_path / "x")
    assert code == 2 and "--config real: num_attention_heads 56 does not match" in err


def test_strict_mode_with_a_missing_kernel_names_the_node(run_cli, tmp_path, monkeypatch):
    # Every operator gets a stand-in "kernel" except h3_swiglu, so the test does not depend on which kernels exist.
    _specs(monkeypatch, lambda name, spec: None if name == "h3_swiglu" else spec.reference)
    code, _, err = run_cli("run", "ws1-block", "--device", "cpu", "--mode", "strict", "--out", tmp_path / "ev")
    assert code == 2
    assert "node swiglu: strict mode: operator h3_swiglu" in err and "refusing to fall back" in err
    assert not (tmp_path / "ev").exists()


def test_bench_needs_cuda():
    from h3gate.bench.block import bench_block

    with pytest.raises(InputError, match="bench needs --device cuda"):
        bench_block("tiny", "tiny", "cpu")


def test_agreement_is_bytes_rows_and_modalities():
    from h3gate.gate.compare import agreement, error

    a = torch.zeros(2, 4, 3, dtype=torch.bfloat16)
    b = a.clone()
    b[1, 2, 0] = -0.0  # equal values, different bytes
    rec = agreement(b, a, 1, ["text", "text", "video", "audio"])
    assert not rec["bitwise"] and rec["first_row"] == 2 and rec["first_modality"] == "video"
    assert rec["rows_differing"] == 1 and rec["max_abs"] == 0.0
    assert agreement(a, a.clone(), 1)["bitwise"]
    assert not agreement(a.float(), a, 1)["bitwise"]  # a dtype change is never bitwise
    assert error(torch.ones(3), torch.zeros(3)) == {"max_abs": 1.0, "rel_l2": None}  # no relative error against 0
    assert error(torch.tensor([float("nan")]), torch.ones(1))["max_abs"] is None


def test_leaf_bound_factor_and_ulp_allowance():
    from h3gate.gate.tolerance import bf16_ulp, error_check, leaf_check

    assert bf16_ulp(1.0) == 2**-7 and bf16_ulp(3.0) == 2**-6 and bf16_ulp(0.0) == 0.0
    assert error_check({"rel_l2": 2.3e-3}, {"rel_l2": 1e-3}, "rel_l2", 1.25, 1e-3)["pass"] is False
    assert error_check({"rel_l2": 2.2e-3}, {"rel_l2": 1e-3}, "rel_l2", 1.25, 1e-3)["pass"] is True
    assert error_check({"rel_l2": None}, {"rel_l2": 1e-3}, "rel_l2", 1.25, 1e-3)["pass"] is False
    cand, prov = {"rel_l2": 0.05, "max_abs": 0.05}, {"rel_l2": 0.01, "max_abs": 0.01}
    by_ulp = leaf_check(cand, prov, 1.0, True, "rel_l2", 1.5, 5e-3, 6)  # 0.05 <= 0.01 + 6 * 2**-7
    assert by_ulp["pass"] and by_ulp["passed_by"] == "ulp"
    assert not leaf_check(cand, prov, 1.0, False, "rel_l2", 1.5, 5e-3, 6)["pass"]  # FP32 leaf: no ulp allowance
    assert not leaf_check(cand, prov, 0.25, True, "rel_l2", 1.5, 5e-3, 6)["pass"]  # ulp at 0.25 is 2**-9


def test_the_streamed_forward_fits_the_released_ref2va_block_on_one_h200(monkeypatch):
    """Forward only, ref2va-768p (S = 83386) keeps its value store in host memory and streams pass 1 (golden, the 7
    CUDA provider lanes, candidate) on the device within the H200's 139.3 GiB; 768p keeps its store on the device;
    the backward (whole executions) is still refused, naming --no-backward."""
    from h3gate import memory
    from h3gate.manifests.layouts import load_layout

    cfg, gib = load_config("real").config, 2**30
    monkeypatch.setattr(memory, "device_available_bytes", lambda device: int(139.3 * gib))
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 120 * gib)

    def plan(name: str, **needs):
        packed = build_layout(load_layout(name), name)
        return memory_plan.plan_block_memory(cfg, packed, name, "real", "cuda", memory_plan.GateNeeds(7, **needs))

    released = plan("ref2va-768p", backward=False)
    assert (released.store, round(released.device_bytes / gib, 1), round(released.host_bytes / gib, 1)) == (
        "host", 103.8, 41.2,
    )  # fmt: skip
    assert plan("768p", backward=False).store == "device"
    with pytest.raises(InputError, match=r"\(S=83386\): needs at least 318\.3 GiB.*; use a smaller layout or --no-b"):
        plan("ref2va-768p", backward=True)
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 32 * gib)
    with pytest.raises(InputError, match=r"value store needs at least 41\.2 GiB of host memory, 32\.0 GiB available"):
        plan("ref2va-768p", backward=False)


def test_the_streamed_peak_is_the_block_s_widest_live_set(small):
    """``row_widths`` are the node outputs' elements per packed row (checked on a run), and one streamed execution
    holds at most 3F + 2H per row: swiglu, the gate/up output it reads, residual_attn and the block input."""
    from h3gate.graph.execute import iter_graph, live_at
    from h3gate.graph.executions import provider_table

    cfg, layout, params, inputs = small
    graph, widths = build_block_graph(cfg), memory_plan.row_widths(cfg)
    rows = layout.seq_len
    with torch.no_grad():
        for node, out in iter_graph(graph, inputs.tensors, params, provider_table()):
            assert out.numel() == (widths[node.name] * rows if node.row_dim is not None else out.numel()), node.name
    k = [n.name for n in graph.nodes].index("swiglu")
    assert set(live_at(graph, k)) == {"adaln_projection", "residual_attn", "ffn_gate_up", "swiglu"}
    real = load_config("real").config
    assert memory_plan.streamed_peak_width(real) == 3 * real.ffn_dim + 2 * real.hidden_size


@pytest.mark.slow
def test_a_host_store_gives_the_same_records_and_runs_forward_only(small):
    """The host-memory path of the value store (every value moved to ``cpu`` when kept, back to the device when
    read) gives the device store's records; on this CPU both places are the host, so what this shows is that the
    path computes nothing else (the H200 run at ref2va-768p is the one that moved 41 GiB), and that one wrong packed
    row still fails it, located at its node and row. The backward and the fault matrix, which read every value on the
    device, refuse a host store."""
    from h3gate.gate.faults import RowFault
    from h3gate.runs.block_rows import value_row_dims

    on_device = run_block_gate(_gate(small, "strict", backward=False))
    on_host = run_block_gate(_gate(small, "strict", backward=False, store="host"))
    assert on_host.report["nodes"] == on_device.report["nodes"] and on_host.verdict == on_device.verdict == "pass"
    graph = build_block_graph(small[0])
    fault = {"o_proj": RowFault("o_proj", 7).override(graph.node("o_proj"), value_row_dims(graph))}
    faulted = run_block_gate(_gate(small, "strict", backward=False, store="host", node_overrides=fault))
    assert faulted.verdict == "fail" and faulted.report["first_row_failure"]["node"] == "o_proj"
    assert faulted.report["first_row_failure"]["row"] == 7
    with pytest.raises(ValueError, match="a host value store runs forward only"):
        run_block_gate(_gate(small, "strict", store="host"))


def test_a_variant_refused_mid_block_drops_out_of_every_envelope(small, monkeypatch):
    """A provider variant that fails at run time at the attention node (as sdpa-math runs out of memory at a long S)
    is recorded as skipped, and no node's chained envelope keeps its errors (the nodes before attention included)."""
    import contextlib

    from h3gate.gate.variants import Variant
    from h3gate.runs import block_rows

    entered = {"n": 0}

    @contextlib.contextmanager
    def fails_at_attention():
        entered["n"] += 1
        if entered["n"] == BLOCK_NODES.index("attention") + 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 778.00 GiB\nmore")
        yield

    real = block_rows.provider_variants
    monkeypatch.setattr(
        block_rows,
        "provider_variants",
        lambda names, device: _with(real(names, device), Variant("oom", fails_at_attention)),
    )
    result = run_block_gate(_gate(small, "strict", backward=False))
    rule = result.report["row_rule"]
    assert "oom" not in rule["variants_run"]
    assert {"name": "oom", "reason": "refused at run time: CUDA out of memory. Tried to allocate 778.00 GiB"} in rule[
        "variants_skipped"
    ]
    for node in result.report["nodes"]:
        assert "oom" not in node["rows"]["chained"]["spread"], node["name"]


def _with(made, variant):
    run, skipped = made
    return [*run, variant], skipped


def test_the_upper_memory_estimate_covers_the_h100_measurement_and_only_warns(monkeypatch):
    """Measured on an H100 (strict, forward + backward, --config real --layout medium): the process held at least
    54 GiB when the golden's backward asked for one more float64 (1, 56, 3160, 3160) score matrix (4.17 GiB) and ran
    out of memory. The lower bound (21.0 GiB) stays what refuses; the upper estimate covers the measured 54 GiB and
    is recorded, and warns (never refuses) where the device has less. 768p forward-only ran on a 139.3 GiB H200:
    still planned, with no warning."""
    from h3gate import memory
    from h3gate.manifests.layouts import load_layout

    cfg, gib = load_config("real").config, 2**30
    monkeypatch.setattr(memory, "device_available_bytes", lambda device: int(139.3 * gib))

    def plan(name: str, **needs):
        packed = build_layout(load_layout(name), name)
        return memory_plan.plan_block_memory(cfg, packed, name, "real", "cuda", memory_plan.GateNeeds(7, **needs))

    medium = plan("medium")
    assert round(medium.device_bytes / gib, 1) == 21.0 and medium.upper_bytes >= 54 * gib
    assert medium.upper_bytes <= 3 * 54 * gib and medium.warning is None
    assert medium.record()["upper_gib"] == round(medium.upper_bytes / gib, 4)
    assert memory_plan.golden_attention_bytes(cfg, 3160, "cuda") >= 3 * 56 * 3160**2 * 8  # dense, three matrices
    released = plan("768p", backward=False)
    assert released.store == "device" and released.upper_bytes < 139.3 * gib and released.warning is None
    monkeypatch.setattr(memory, "device_available_bytes", lambda device: 40 * gib)  # negative control: it warns
    low = plan("medium")
    assert low.device_bytes == medium.device_bytes and low.warning is not None
    assert low.warning.startswith(f"memory: the peak may reach {medium.upper_bytes / gib:.1f} GiB")
    assert "40.0 GiB available" in low.warning and low.record()["available_gib"] == 40.0


def test_the_upper_memory_estimate_is_at_least_the_lower_bound_everywhere():
    """At every layout, device and need, the upper estimate is at least the lower bound the plan refuses on; the
    chunked golden attention (score matrix above 16 GiB) counts four (B, nh, C, S) blocks, not S x S."""
    from h3gate.manifests.layouts import layout_names, load_layout

    for config in ("tiny", "real"):
        cfg = load_config(config).config
        for name in layout_names():
            rows = build_layout(load_layout(name), name).seq_len
            for needs in (memory_plan.GateNeeds(3), memory_plan.GateNeeds(7, backward=False)):
                for device in ("cpu", "cuda"):
                    lower = max(memory_plan.block_forward_bytes(cfg, rows, needs, True),
                                memory_plan.block_lower_bound_bytes(cfg, rows)
                                + (memory_plan.block_backward_bytes(cfg, rows) if needs.backward else 0))  # fmt: skip
                    assert memory_plan.block_peak_estimate_bytes(cfg, rows, needs, device) >= lower, (name, needs)
    real = load_config("real").config
    assert memory_plan.golden_attention_bytes(real, 38974, "cuda") <= 4 * 2 * 2**30


def test_the_command_warns_when_the_upper_memory_estimate_exceeds_what_is_free(run_cli, tmp_path, monkeypatch):
    """Free host memory between the lower bound (45 MB at tiny/tiny: not refused) and the upper estimate: one warning
    line on stderr before the run reads its inputs (stopped there); with plenty free, no warning."""
    monkeypatch.setattr(run_cmd, "read_inputs", lambda setup: (_ for _ in ()).throw(InputError("stop")))
    args = ("run", "ws1-block", "--device", "cpu", "--mode", "off", "--out", tmp_path / "ev")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 100 << 20)
    code, _, err = run_cli(*args)
    assert code == 2 and err.startswith("h3gate: warning: memory: the peak may reach 0.3 GiB (upper estimate")
    assert "0.1 GiB available: the run may run out of memory\n" in err and err.endswith("h3gate: error: stop\n")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 64 << 30)  # the negative control
    code, _, err = run_cli(*args, "--force")
    assert code == 2 and err == "h3gate: error: stop\n"
