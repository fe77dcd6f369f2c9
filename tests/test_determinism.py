"""Within-run determinism (:mod:`h3gate.graph.determinism`): the fingerprint, and the gates failing on a 1-ulp change
confined to ONE evaluation of one node, at each position of that node's call sequence, forward and backward."""

from __future__ import annotations

import re

import pytest
import torch

from h3gate.graph import determinism, fingerprints
from h3gate.graph.block import block_params, build_block_graph
from h3gate.graph.inputs import build_block_inputs
from h3gate.layout import build_layout
from h3gate.manifests.layouts import LayoutSpec
from h3gate.manifests.model_config import load_config
from h3gate.manifests.tolerances import load_tolerance
from h3gate.runs.ws1_block import BlockGate, run_block_gate
from h3gate.synth import SyntheticSource

SMALL = LayoutSpec(text_tokens=9, latent_frames=2, latent_height=4, latent_width=6, audio_latents=3, anchors=["first"])
ROW = 3  # the packed row the injection touches (a text row of SMALL)


# -- the fingerprint ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_every_single_element_one_ulp_change_changes_its_rows_fingerprint(dtype):
    t = torch.randn(2, 7, 13, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = fingerprints.row_fingerprints(t, 1)
    assert base.shape == (7,) and torch.equal(base, fingerprints.row_fingerprints(t.clone(), 1))
    for flat in range(t.numel()):
        u = t.clone()
        u.view(-1)[flat] = torch.nextafter(u.view(-1)[flat].double(), torch.tensor(float("inf"))).to(dtype)
        if torch.equal(u, t):  # the next double rounds back: take the dtype's next value through its bits
            u = t.clone()
            fingerprints.bits(u).view(-1)[flat] += 1
        got = fingerprints.row_fingerprints(u, 1)
        row = (flat // 13) % 7
        assert (got != base).nonzero().flatten().tolist() == [row]
        assert int(fingerprints.whole(u)) != int(fingerprints.whole(t))


def test_bump_changes_exactly_one_element_per_batch_item():
    t = torch.randn(3, 5, 4).to(torch.bfloat16)
    u = determinism.bump(t, 2, 1)
    differ = (u.view(torch.int16) != t.view(torch.int16)).nonzero().tolist()
    assert differ == [[0, 2, 0], [1, 2, 0], [2, 2, 0]]
    assert torch.all((u.view(torch.int16) - t.view(torch.int16)).abs() <= 1)


# -- the recorder's queue ----------------------------------------------------------------------------------------


def _observe_sequence(recorder: determinism.Recorder, drift_at: int) -> None:
    """70 evaluations of two nodes: ``a`` on the same inputs each time (the ``drift_at``-th output one ulp off in
    row 2), ``b`` on fresh input tensors with equal bytes, a parameter read each time."""
    x = torch.arange(12.0).reshape(4, 3)
    w = torch.ones(3)
    with determinism.recording(recorder):
        for i in range(35):
            out = x * 2
            if i == drift_at:
                out = determinism.bump(out, 2, 0)
            with determinism.evaluation(f"pass {i}"):
                determinism.observe("a", "forward", "table", None, {"x": x}, {"w": w}, {"out": (out, 0)})
                determinism.observe("b", "forward", "table", None, {"x": x.clone()}, {}, {"out": (x + 1, None)})


def test_the_queue_settles_as_if_each_evaluation_were_settled_at_once(monkeypatch):
    records = {}
    for every in (1, 5, determinism.FLUSH_EVERY):
        monkeypatch.setattr(determinism, "FLUSH_EVERY", every)
        recorder = determinism.Recorder()
        recorder.role("table", "candidate")
        _observe_sequence(recorder, drift_at=33)
        records[every] = recorder.record()
    assert records[1] == records[5] == records[determinism.FLUSH_EVERY]
    got = records[1]
    assert got["evaluations"] == 70 and got["keys"] == 2 and got["pairs"] == {"candidate": 68} and not got["pass"]
    assert [(m["node"], m["row"], m["passes"]) for m in got["mismatches"]] == [("a", 2, ["pass 0", "pass 33"])]


def test_evaluations_wait_in_the_queue_until_a_flush_or_a_read():
    recorder = determinism.Recorder()
    recorder.role("table", "candidate")
    _observe_sequence(recorder, drift_at=-1)
    queued = 70 % determinism.FLUSH_EVERY
    assert len(recorder.queue) == queued and recorder.queue  # the last ones are not settled yet
    settled = sum(recorder.pairs.values())
    assert recorder.failing() == [] and not recorder.queue
    assert sum(recorder.pairs.values()) == settled + queued == 68
    assert all(r.device.type == "cpu" for f in recorder.first.values() for r in f.rows.values())


# -- the gate ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    cfg = load_config("tiny").config
    source = SyntheticSource(cfg, 0)
    layout = build_layout(SMALL, "small-test")
    return cfg, block_params(source, 0), build_block_inputs(layout, cfg, source, 0, "cpu")


def _run(small, mode: str, backward: bool, spec: determinism.Injection | None = None):
    cfg, params, inputs = small
    tolerance = load_tolerance("ws1-block")
    gate = BlockGate(build_block_graph(cfg), inputs, params, "cpu", mode, tolerance, backward=backward)
    if spec is None:
        return run_block_gate(gate), None
    with determinism.injecting(spec) as state:
        result = run_block_gate(gate)
    return result, state


def _located(report: dict) -> set[tuple[str, int | None]]:
    """Every (node, row) the report names as not bitwise where two evaluations should agree: the determinism
    mismatches, the repeat / batch / autograd-forward records, and gradient drifts by the operator that made them."""
    found = {(m["node"], m["row"]) for m in report["determinism"]["mismatches"] if m["role"] == "candidate"}
    for n in report["nodes"]:
        for view in ("repeat", "batch_row"):
            if not n[view]["bitwise"]:
                found.add((n["name"], n[view]["first_row"]))
    bw = report["backward"]
    if bw is not None:
        for key in ("first_grad_repeat_drift", "first_grad_batch_drift"):
            d = bw[key]
            if d is not None:
                found |= {(op, d["first_row"]) for op in (d.get("operator") or d["node"]).split("+")}
        for n, rec in bw["autograd_forward"].items():
            if not rec["bitwise"]:
                found.add((n, rec["first_row"]))
        for n, rec in bw["autograd_forward_batch"].items():
            if not rec["bitwise"]:
                found.add((n, rec["first_row"]))
    return found


@pytest.fixture(scope="module")
def forward_sequence(small):
    """The clean forward-only run (the negative control) and o_proj's candidate call sequence in it."""
    result, state = _run(small, "off", False, determinism.Injection("o_proj", 10**6))
    return result, state.calls


def test_no_injection_passes_and_records_the_pairs(forward_sequence):
    result, calls = forward_sequence
    rec = result.report["determinism"]
    assert result.verdict == "pass" and rec["pass"] and rec["mismatches"] == []
    assert rec["pairs"]["candidate"] >= 2 * 17  # chained vs repeat and isolated vs its repeat, for every node
    assert [label for _, label in calls] == [
        "chained", "isolated", "isolated repeat", "repeat", "batch 2 at 0", "batch 3 at 2"
    ]  # fmt: skip


@pytest.mark.parametrize("label", ["isolated", "isolated repeat"])
def test_a_one_ulp_change_in_the_isolated_evaluation_alone_fails(small, forward_sequence, label):
    _, calls = forward_sequence
    k = [lab for _, lab in calls].index(label) + 1
    result, state = _run(small, "off", False, determinism.Injection("o_proj", k, "forward", ROW))
    assert state.fired == label
    assert result.verdict == "fail"
    assert ("o_proj", ROW) in _located(result.report)
    # off mode: the candidate is the provider, so the chained evaluation has the isolated one's inputs too
    mismatches = result.report["determinism"]["mismatches"]
    assert mismatches and all(m["node"] == "o_proj" and m["row"] == ROW and label in m["passes"] for m in mismatches)
    assert any(re.match(rf"determinism\.o_proj\.forward\.bitwise \(out: .*{label}.*, row 3, text\)", c)
               for c in result.failing)  # fmt: skip
    first = result.report["first_row_failure"]
    assert (first["node"], first["row"], first["modality"]) == ("o_proj", ROW, "text")


def test_the_unrelated_requests_two_placements_share_are_compared_and_agree(forward_sequence):
    result, _ = forward_sequence
    shared = {n["name"]: n["batch_row"]["fillers"] for n in result.report["nodes"] if n["batch_row"]["fillers"]}
    assert "o_proj" in shared and len(shared) >= 15  # every node with a batch axis (not the AdaLN table)
    for fillers in shared.values():  # u0: second of the batch of 2, first of the batch of 3
        assert [(f["filler"], f["first"], f["second"], f["bitwise"]) for f in fillers] == [
            (0, [2, 0, 1], [3, 2, 0], True)
        ]


def test_one_ulp_on_an_unrelated_requests_row_in_one_placement_fails_the_batch_row_check(small, forward_sequence):
    """The negative control: one ulp on o_proj's row of the unrelated request (batch item 1) in the batch of 2 only;
    the request's own item is untouched, so only the fillers' comparison can see it."""
    _, calls = forward_sequence
    k = [lab for _, lab in calls].index("batch 2 at 0") + 1
    result, state = _run(small, "off", False, determinism.Injection("o_proj", k, "forward", ROW, item=1))
    assert state.fired == "batch 2 at 0"
    rec = next(n for n in result.report["nodes"] if n["name"] == "o_proj")["batch_row"]
    assert all(p["bitwise"] for p in rec["placements"])  # the request's rows: untouched
    assert [(f["bitwise"], f["first_row"]) for f in rec["fillers"]] == [(False, ROW)]
    assert (rec["bitwise"], rec["first_row"]) == (False, ROW)
    assert result.verdict == "fail" and any("o_proj" in c and "batch_row_bitwise" in c for c in result.failing)


def _walk(small, node: str, mode: str, direction: str) -> list[str]:
    """Inject at every position of ``node``'s candidate call sequence in a forward + backward run: the labels of
    the positions that did NOT fail naming (node, row)."""
    _, probe = _run(small, mode, True, determinism.Injection(node, 10**6, direction, ROW))
    assert len(probe.calls) >= (10 if direction == "forward" else 5)  # never a vacuous walk
    escaped = []
    for k, (_, label) in enumerate(probe.calls, start=1):
        result, state = _run(small, mode, True, determinism.Injection(node, k, direction, ROW))
        assert state.fired == label
        if result.verdict != "fail" or (node, ROW) not in _located(result.report):
            escaped.append(f"{k}: {label}")
    return escaped


def test_every_backward_call_position_of_one_node_is_caught(small):
    """The representative walk of the default set: SwiGLU's backward evaluations (candidate, its repeat, the isolated
    VJP, its repeat, the batch of 2), with the provider's kernels bound (``off``: about 1 s a run)."""
    assert _walk(small, "swiglu", "off", "backward") == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("node", "direction"),
    [(n, d) for n in ("o_proj", "ffn_down", "attention", "swiglu") for d in ("forward", "backward")
     if (n, d) != ("swiglu", "backward")],  # that one is in the default set
)  # fmt: skip
def test_every_call_position_is_caught(small, node, direction):
    assert _walk(small, node, "off", direction) == []


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_every_call_position_is_caught_with_the_strict_kernels(small, direction):
    assert _walk(small, "swiglu", "strict", direction) == []


# -- the --fault grammar -----------------------------------------------------------------------------------------


def test_fault_grammar_ulp_at_k():
    from h3gate.commands.run_cmd import parse_fault
    from h3gate.errors import InputError

    graph = build_block_graph(load_config("tiny").config)
    assert parse_fault("o_proj:3:ulp@2", graph, 33) == determinism.Injection("o_proj", 2, "forward", 3)
    assert parse_fault("swiglu:5:ulp@11:backward", graph, 33) == determinism.Injection("swiglu", 11, "backward", 5)
    for bad, message in (
        ("o_proj:3:ulp@0", "'ulp@0' is neither a kind"),
        ("o_proj:3:scale:ulp@2", "ulp@K is the kind; only a direction may follow it"),
        ("o_proj:33:ulp@2", "row '33' must be an integer in \\[0, 33\\)"),
    ):
        with pytest.raises(InputError, match=message):
            parse_fault(bad, graph, 33)


@pytest.mark.slow
def test_ws1_model_fails_on_one_ulp_in_one_evaluation_and_the_console_agrees(tmp_path):
    from test_ws1_model import _doc, _run, assert_console_agrees

    args = ["--quiet", "run", "ws1-model", "--no-backward", "--layers", "1:2", "--out", str(tmp_path / "ev")]
    done = _run([*args, "--fault", "block.1.o_proj:50:ulp@2"], tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    doc = _doc(tmp_path / "ev")
    assert doc["injected_fault"].startswith("forward:block.1.o_proj:row 50:one ulp in call 2 only (the ")
    mismatch = doc["determinism"]["mismatches"][0]
    assert (mismatch["node"], mismatch["row"]) == ("block.1.o_proj", 50)
    assert_console_agrees(done.stdout, doc)


@pytest.mark.slow  # one forward-only whole-model gate (two layers' worth) twice: make test-slow
def test_ws1_model_fails_on_one_ulp_on_an_unrelated_requests_row_in_one_placement():
    """ws1-model's filler negative control: one ulp on block.1.o_proj's row 50 of the unrelated request u0 (item 0)
    in the batch of 3 only; the request's own rows are untouched, so only the fillers' comparison sees it."""
    from h3gate.manifests.tolerances import load_tolerance
    from h3gate.numerics import strict_numerics
    from h3gate.runs.setup import ModelNeeds, RunSpec, prepare, read_inputs
    from h3gate.runs.ws1_model import ModelGate, run_model_gate

    spec = RunSpec("model", "micro", layers="1:2", draw="device")
    setup = read_inputs(prepare(spec, ModelNeeds(backward=False), read=False))
    gate = ModelGate.of(setup, load_tolerance("ws1-model"), backward=False)
    with strict_numerics("cpu"), determinism.injecting(determinism.Injection("block.1.o_proj", 10**6)) as probe:
        clean = run_model_gate(gate)
    assert clean.verdict == "pass"
    k = [label for _, label in probe.calls].index("candidate batch 3@2") + 1
    spec_ = determinism.Injection("block.1.o_proj", k, "forward", 50, item=0)
    with strict_numerics("cpu"), determinism.injecting(spec_) as state:
        result = run_model_gate(ModelGate.of(setup, load_tolerance("ws1-model"), backward=False))
    assert state.fired == "candidate batch 3@2"
    rec = next(n for n in result.report["nodes"] if n["name"] == "block.1.o_proj")["batch_row"]
    assert all(p["bitwise"] for p in rec["placements"])
    assert [(f["first"], f["bitwise"], f["first_row"]) for f in rec["fillers"]] == [([3, 2, 0], False, 50)]
    assert result.verdict == "fail"


def test_a_gradient_is_named_after_the_operator_whose_backward_made_it():
    from h3gate.commands.run_cmd import _drift
    from h3gate.gate.drift import gradient_operator

    graph = build_block_graph(load_config("tiny").config)
    assert gradient_operator(graph.nodes, "ffn_gate_up") == "swiglu"  # swiglu's backward makes ffn_gate_up's gradient
    assert gradient_operator(graph.nodes, graph.output) is None  # the cotangent: no node's backward
    assert set(gradient_operator(graph.nodes, "norm1").split("+")) >= {"q_proj", "k_proj", "v_proj"}  # summed
    drift = {"node": "ffn_gate_up", "operator": "swiglu", "first_row": 3, "first_modality": "text", "kind": "node"}
    assert _drift(drift) == "swiglu backward (gradient of ffn_gate_up) (row 3, text)"
