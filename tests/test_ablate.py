"""``h3gate ablate``: the manifest, the whole RFC section 6 matrix on the tiny config (CPU), and negative controls
proving the engine fails a row whose expectation is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from h3gate.ablate import multirank, probes
from h3gate.ablate.checks import no_kv_cache
from h3gate.ablate.engine import build_context, device_synthetic_source, resolve_packed_row
from h3gate.ablate.probes import permuted_layout
from h3gate.ablate.registry import check_names
from h3gate.ablate.runner import run_ablation
from h3gate.commands import ablate_cmd
from h3gate.errors import InputError
from h3gate.evidence.schema import validate_document
from h3gate.graph.core import Graph
from h3gate.graph.model import load_model_params
from h3gate.layout import build_layout
from h3gate.manifests.ablations import ABLATIONS_FILE, Signature, load_ablations
from h3gate.manifests.layouts import LayoutSpec
from h3gate.manifests.model_config import load_config
from h3gate.parallel.collectives import cp_bounds
from h3gate.parallel.ws2 import Ws2Settings, plan_ws2
from h3gate.parallel.ws2_partition import OwnershipError, Partition, check_ownership, metadata_rows

ROWS = load_ablations()
WS2_ROWS = ("C0", "H17", "H-C4", "H-C5")  # run ws2's ranks: tested at its CI config and layout (ws2-tiny, micro)
CFG_TINY = load_config("tiny").config
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ctx():
    return build_context("tiny", "tiny", "cpu")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The CI run: every row but the ws2 rows on the tiny config, CPU, provider ops (A4 plans ws2 and is refused)."""
    out = tmp_path_factory.mktemp("ablate")
    rows = ",".join(r for r in ROWS if r not in WS2_ROWS)
    settings = ablate_cmd.AblateCommand(row=rows, layout="tiny", config="tiny", device="cpu", out=out, json=True)
    code = ablate_cmd.ablate_command(settings)
    return code, out, json.loads((out / "ablation.json").read_text())


def test_manifest_holds_every_rfc_row_with_its_expectation():
    assert len(ROWS) == 36 and list(ROWS)[:2] == ["A0", "A1"] and list(ROWS)[-1] == "H-C7"
    assert [ROWS[r].section for r in ("A4", "C2", "H17", "H-C7")] == ["6.1", "6.1", "6.2", "6.3"]
    assert check_names(ROWS) == 36
    for row_id, row in ROWS.items():
        if row.expected.result in ("NA", "REJECTED"):
            assert row.expected.reason, row_id
        if row.expected.result == "EXPECTED_DRIFT":
            assert row.expected.signature.node, row_id
    assert {r for r, row in ROWS.items() if row.run == "distributed"} == {"A4", "C0", "H17", "H-C4", "H-C5"}
    assert {r for r, row in ROWS.items() if row.run == "trajectory"} == {"H9", "H10", "H11", "H12", "H13", "H15",
                                                                        "H-C2"}  # fmt: skip


def _corrupt(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(ABLATIONS_FILE.read_text())
    edit(data["rows"])
    path = tmp_path / "ablations.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["A5"]["expected"].pop("reason"), "rows.A5.expected: reason: required when result is NA"),
        (lambda r: r["H5"]["expected"]["signature"].update(nodes="x"), "rows.H5.expected.signature.nodes: unknown"),
        (lambda r: r["H2"]["expected"]["signature"].update(row="video[x]"), "rows.H2.expected.signature.row: "),
        (lambda r: r["H9"]["expected"].update(result="DRIFT"), "rows.H9.expected.result: must be one of"),
        (lambda r: r["A0"]["expected"].update(signature={"node": "x"}), "rows.A0.expected: signature: only"),
        (lambda r: r.update(h5=r.pop("H5")), "rows: ablation id 'h5': expected capitals"),
        (lambda r: r["H4"].update(ranks=2), "rows.H4: ranks: only a distributed row"),
    ],
)
def test_malformed_manifest_is_a_breadcrumb_error(tmp_path, edit, message):
    with pytest.raises(InputError, match="ablations.yaml: " + message.replace("[", r"\[")):
        load_ablations(_corrupt(tmp_path, edit))


def test_unknown_probe_and_row_symbols_are_input_errors(ctx):
    rows = {**ROWS, "H5": ROWS["H5"].model_copy(update={"probe": "nope"})}
    with pytest.raises(InputError, match="rows.H5.probe: 'nope' is not an arm probe"):
        check_names(rows)
    with pytest.raises(InputError, match=r"rows.H-C4.probe: 'tp2' is not a parallel plan \(known: cp, cp_hidden_only"):
        check_names({"H-C4": ROWS["H-C4"].model_copy(update={"probe": "tp2"})})
    with pytest.raises(InputError, match="rows.C0.strict: 'identity' is not a parallel plan of a distributed row"):
        check_names({"C0": ROWS["C0"].model_copy(update={"strict": "identity"})})
    with pytest.raises(InputError, match="rows.A5.strict: a check row has no strict arm"):
        check_names({"A5": ROWS["A5"].model_copy(update={"strict": "identity"})})
    assert resolve_packed_row(ctx.layout, "video_target[0]") == 136
    assert resolve_packed_row(ctx.layout, "media[0]") == 120
    assert resolve_packed_row(ctx.layout, "audio[-1]") == 135 and resolve_packed_row(ctx.layout, 7) == 7
    with pytest.raises(InputError, match="has 16 audio rows"):
        resolve_packed_row(ctx.layout, "audio[16]")


def test_whole_matrix_on_tiny_cpu(matrix):
    code, out, doc = matrix
    validate_document(doc, "ablation")
    by_id = {r["id"]: r for r in doc["rows"]}
    assert code == 0 and doc["verdict"] == "pass" and list(by_id) == [r for r in ROWS if r not in WS2_ROWS]
    assert all(r["verdict"] == "pass" and not r["mismatches"] for r in doc["rows"])
    assert doc["execution"]["mode"] == "off" and doc["execution"]["triton_ops"] == []
    for r in doc["rows"]:
        assert r["observed"]["result"] == r["expected"]["result"], r["id"]
        if r["observed"]["result"] == "PASS" and r["run"] != "check":
            assert r["strict_sha256"] == r["probe_sha256"] and r["nodes_compared"] > 0, r["id"]
        if (
            r["observed"]["result"] == "EXPECTED_DRIFT"
            and r["outputs"]
            and not all(o["bitwise"] for o in r["outputs"].values())
        ):
            assert r["strict_sha256"] != r["probe_sha256"], r["id"]
    first = cp_bounds(264, 2)[1]  # rank 1's first row: A4 plans ws2's CP2 at tiny's ws2 twin and is refused
    assert f"rank 0: adaln_indices holds packed row(s) [{first}]" in by_id["A4"]["observed"]["reason"]
    assert "Checked:" in by_id["A5"]["observed"]["reason"] and "Checked:" in by_id["C2"]["observed"]["reason"]
    sig = by_id["H2"]["observed"]["signature"]
    assert (sig["node"], sig["layer"], sig["row"], sig["modality"]) == ("block.0.norm1", 0, 136, "video")
    # trajectory rows seal per-step velocity and latent hashes for both arms
    steps = {(h["node"], h["step"]) for h in by_id["H-C2"]["hashed"]["strict"]}
    assert {("scheduler.video_step", s) for s in range(3)} <= steps and ("heads.audio_select", 2) in steps
    # H-C3 is a PASS through the strict attention's canonical walk (bound in place of the provider's packed-order
    # SDPA in this provider-mode run); the same attention walked in packed order is reported honestly
    assert any("the strict kernel" in n for n in by_id["H-C3"]["strict_notes"])
    diag = by_id["H-C3"]["diagnostics"]["packed_order_attention"]["outputs"]["heads.video_select"]
    assert diag["bitwise"] is False and diag["rows_differing"] > 0
    same = by_id["H-C3"]["diagnostics"]["canonical_vs_packed_order"]["outputs"]
    assert all(o["bitwise"] for o in same.values())  # the canonical order is the identity on the tiny layout
    # H16 reads block 0 of the real other variant (transformer_ref/), H-C7 also checks the Ref2VA path
    assert any("from transformer_ref/" in n for n in by_id["H16"]["notes"]), by_id["H16"]["notes"]
    paths = by_id["H-C7"]["diagnostics"]["paths"]
    assert [(p["layout"], p["task"], p["variant"]) for p in paths] == [
        ("tiny", "t2va", "transformer"), ("ref2va-tiny", "ref2va", "transformer_ref")
    ]  # fmt: skip
    trajectory = json.loads((out / "trajectory.json").read_text())
    validate_document(trajectory, "trajectory")
    assert len(trajectory["steps"]) == 3


# -- negative controls: the engine must fail rows whose expectation the run contradicts ----------------------------


def test_identity_probe_fails_a_row_that_expects_drift(ctx):
    record = run_ablation("H5", ROWS["H5"].model_copy(update={"probe": "identity"}), ctx)
    assert record["verdict"] == "fail"
    assert record["mismatches"] == ["result: expected EXPECTED_DRIFT, observed PASS"]


def test_drift_at_the_wrong_node_fails_its_row(ctx):
    record = run_ablation("H5", ROWS["H5"].model_copy(update={"probe": "causal_mask"}), ctx)
    assert record["observed"]["result"] == "EXPECTED_DRIFT" and record["verdict"] == "fail"
    assert "node: expected 'block.0.rope_q', observed 'refiner.0.attention'" in record["mismatches"]


def test_drift_at_the_wrong_row_fails_its_row(ctx):
    expected = ROWS["H2"].expected.model_copy(
        update={"signature": Signature(node="block.0.norm1", layer=0, row="text[0]", modality="text")}
    )
    record = run_ablation("H2", ROWS["H2"].model_copy(update={"expected": expected}), ctx)
    assert record["verdict"] == "fail"
    assert record["mismatches"] == [
        "modality: expected 'text', observed 'video'",
        "row: expected text[0] = packed row 0, observed 136",
    ]


def test_drift_fails_a_pass_row(ctx):
    record = run_ablation("H-C0", ROWS["H-C0"].model_copy(update={"probe": "flip_one_tag"}), ctx)
    assert record["verdict"] == "fail" and record["observed"]["signature"]["node"] == "block.0.norm1"


def test_na_is_not_reported_when_its_check_fails(ctx):
    stateful = Graph("model", ctx.graph.nodes, (*ctx.graph.inputs, "kv_cache"), ctx.graph.output)
    outcome = no_kv_cache(type(ctx)(**{**ctx.__dict__, "graph": stateful}), ROWS["A5"])
    assert outcome.result == "EXPECTED_DRIFT" and "kv_cache" in outcome.reason


def test_a_rows_ranks_is_its_plans_world(ctx):
    """``ranks`` is read: H-C4 on three ranks asks run ws2 for TP3, a topology it does not offer (N/A); the tiny
    config runs as its ws2 twin, and a checkpoint is N/A too (ws2's ranks draw synthetic weights)."""
    record = run_ablation("H-C4", ROWS["H-C4"].model_copy(update={"ranks": 3}), ctx)
    assert record["observed"]["result"] == "NA" and record["verdict"] == "fail"
    assert record["observed"]["reason"].startswith("not run: run ws2: --topology 'tp3': must be one of tp1, tp2,")
    assert multirank.ws2_settings(ctx, {"topology": "tp2"}).config == "ws2-tiny"
    with_checkpoint = type(ctx)(**{**ctx.__dict__, "checkpoint": "weights/", "cache": {}})
    record = run_ablation("H-C5", ROWS["H-C5"], with_checkpoint)
    reason = "not run: run ws2: its ranks draw seeded synthetic weights; no checkpoint"
    assert record["observed"] == {"result": "NA", "reason": reason, "signature": None}
    if not torch.cuda.is_available():  # a device ws2 cannot run is N/A; a mis-owned plan is refused on any device
        on_gpu = type(ctx)(**{**ctx.__dict__, "device": "cuda", "cache": {}})
        record = run_ablation("H-C4", ROWS["H-C4"], on_gpu)
        assert record["observed"]["reason"] == "not run: run ws2: --device cuda: CUDA is not available on this machine"
        assert run_ablation("A4", ROWS["A4"], on_gpu)["verdict"] == "pass"


def test_ownership_check_rejects_misowned_metadata():
    for seq_len in (264, 83):  # shards of whole row segments, even or not
        bounds = cp_bounds(seq_len, 2)
        check_ownership(metadata_rows("co-sharded", bounds), bounds)
        assert metadata_rows("local", bounds) is None  # no ownership declared: nothing to reject (H17 drifts instead)
        with pytest.raises(OwnershipError, match=rf"rank 0: adaln_indices holds packed row\(s\) \[{bounds[1]}\]"):
            check_ownership(metadata_rows("misowned", bounds), bounds)
    with pytest.raises(OwnershipError, match=r"rank 1: rope_cos holds packed row\(s\) \[0, 1\] owned by another"):
        check_ownership({"rope_cos": [[0, 1], [0, 1]]}, (0, 2, 4))


@pytest.mark.parametrize(
    ("topology", "scope", "partition", "message"),
    [
        ("tp2", "block", Partition((0, 0)), "partition tp_chunks [0, 0]: must be a permutation of 0..1"),
        ("tp2", "block", Partition(tp_merge="sideways"), "partition tp_merge 'sideways': must be one of logical, rank"),
        ("cp2", "block", Partition(cp_metadata="lost"), "partition cp_metadata 'lost': must be one of co-sharded,"),
        ("tp2", "block", Partition(cp_metadata="local"), "partition cp_metadata 'local': needs a CP topology"),
        ("cp2", "model", Partition(cp_metadata="local"), "partition cp_metadata 'local': block scope only"),
    ],
)  # fmt: skip
def test_a_partition_ws2_cannot_run_is_an_input_error(topology, scope, partition, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[")):
        plan_ws2(Ws2Settings(topology, scope=scope, partition=partition))
    with pytest.raises(OwnershipError, match="metadata mis-owned"):
        plan_ws2(Ws2Settings("cp2", partition=Partition(cp_metadata="misowned")))


# -- the multi-rank rows on run ws2 (ws2-tiny, micro layout, gloo on CPU: one run per plan) --------------------------


@pytest.mark.slow  # four multi-rank runs: make test-slow (.ci/run runs both)
def test_ws2_rows_give_their_expected_outcomes(tmp_path):
    """C0, H17, H-C4 and H-C5 through ``h3gate ablate``: real TP / CP ranks against TP1, forward and backward; C0's
    strict arm is H-C4's probe (one run), and one TP1 serves every plan."""
    settings = ablate_cmd.AblateCommand(
        row=",".join(WS2_ROWS), layout="micro", config="ws2-tiny", device="cpu", out=tmp_path, json=True
    )
    code = ablate_cmd.ablate_command(settings)
    doc = json.loads((tmp_path / "ablation.json").read_text())
    validate_document(doc, "ablation")
    by_id = {r["id"]: r for r in doc["rows"]}
    assert code == 0 and doc["verdict"] == "pass" and list(by_id) == list(WS2_ROWS)
    assert [by_id[r]["observed"]["result"] for r in WS2_ROWS] == ["PASS", "EXPECTED_DRIFT", "PASS", "PASS"]
    ws2 = {r: by_id[r]["diagnostics"]["ws2"] for r in WS2_ROWS}
    equal = (ws2["C0"]["tp"], ws2["C0"]["tp_swapped"], ws2["H-C4"]["tp"], ws2["H-C5"]["cp"])
    for body in equal:
        assert body["forward_byte_equal"] and body["backward_byte_equal"] and body["verdict"] == "pass"
        assert (body["backend"], body["world_size"], body["scope"], body["config"]["name"]) == ("gloo", 2, "block",
                                                                                                "ws2-tiny")  # fmt: skip
        assert [r["rank_in_world"] for r in body["ranks"]] == [0, 1] and body["layout"]["name"] == "micro"
    assert ws2["C0"]["tp"] == ws2["H-C4"]["tp"] and len({b["reference"]["seconds"] for b in equal}) == 1
    assert by_id["H-C4"]["nodes_compared"] == 2 * (17 + 31) and by_id["H-C4"]["nodes_drifting"] == 0
    assert [(r["heads"], r["ffn_channels"]) for r in ws2["H-C4"]["tp"]["ranks"]] == [([0, 4], [0, 256]),
                                                                                    ([4, 8], [256, 512])]  # fmt: skip
    swapped = ws2["C0"]["tp_swapped"]["ranks"]  # rank 0 owns the second half of heads, channels and weight shards
    assert [(r["heads"], r["ffn_channels"], r["tp_chunk"]) for r in swapped] == [([4, 8], [256, 512], 1),
                                                                                ([0, 4], [0, 256], 0)]  # fmt: skip
    assert swapped[0]["sharded_param_shapes"]["ff.net.2.weight"] == [192, 256]
    assert ws2["C0"]["tp_swapped"]["partition"]["tp_chunks"] == [1, 0]
    bounds = cp_bounds(84, 2)
    assert [r["packed_rows"] for r in ws2["H-C5"]["cp"]["ranks"]] == [[0, bounds[1]], [bounds[1], 84]]
    # H17: rank 1 reads metadata rows [0, 40) for its rows [44, 84): its first row's norm1 drifts
    sig = by_id["H17"]["observed"]["signature"]
    assert (sig["node"], sig["layer"], sig["rank"], sig["row"], sig["phase"]) == ("norm1", 0, 1, bounds[1], "forward")
    held = ws2["H17"]["cp_hidden_only"]["ranks"][1]["row_metadata"]
    assert held == f"read by local position: rows [0, {84 - bounds[1]}) (hidden rows only)"


@pytest.mark.slow  # multi-rank negative control: make test-slow (.ci/run runs both)
def test_c0_swapped_ownership_merged_in_rank_order_drifts(monkeypatch):
    """Negative control of C0's logical merge: TP4 ranks owning chunks (0, 2, 1, 3) whose merges combine the gathered
    subtrees in rank order, ((s0 + s2) + (s1 + s3)), fail the row. (At TP2 the swap merges to the same bytes in rank
    order: the tree's adds commute, see the next test. The reassociated FP32 sums differ in a few last bits. With the
    64-key attention walk (kernel id v1) one element of o_proj's forward rounded to another BF16 value at this seed;
    with v2's 128-key walk every forward sum still rounds alike, and the first drift is the merged input gradient
    of the FFN's column-parallel gate/up layer, at norm2's output in the backward: the location is data-dependent,
    the failure is not.)"""
    partition = Partition((0, 2, 1, 3), "rank")
    monkeypatch.setitem(multirank.PLANS, "tp_rank_order", lambda world: {"topology": "tp4", "partition": partition})
    row = ROWS["C0"].model_copy(update={"probe": "tp_rank_order", "strict": None, "ranks": 4})
    record = run_ablation("C0", row, build_context("ws2-tiny", "micro", "cpu"))
    assert record["verdict"] == "fail" and record["mismatches"] == ["result: expected PASS, observed EXPECTED_DRIFT"]
    sig = record["observed"]["signature"]
    assert (sig["node"], sig["phase"], sig["layer"]) == ("node:norm2", "backward", 0)
    ranks = record["diagnostics"]["ws2"]["tp_rank_order"]["ranks"]
    assert [(r["tp_chunk"], r["tp_merge"]) for r in ranks] == [(c, "rank order") for c in (0, 2, 1, 3)]


def test_the_tree_merges_a_reversed_ownership_alike_in_rank_order():
    """Why C0's negative control needs a permutation that changes the tree's pairing: IEEE adds commute, so a
    reversal merges to the same bytes in rank order (TP2 swapped, TP4 reversed); (0, 2, 1, 3) does not."""
    from h3gate.kernels.tp_layers import MergeGroup

    gen = torch.Generator().manual_seed(0)
    subtrees = [torch.randn(4096, generator=gen) * 7.0**c for c in range(4)]  # chunk c's FP32 subtree

    def merged(chunks: tuple[int, ...], rank_order: bool) -> torch.Tensor:
        held = [subtrees[c] for c in chunks]  # rank r's subtree is its chunk's
        return MergeGroup(len(chunks), 0, lambda t: held, chunks, rank_order).merge(held[0])

    for n in (2, 4):
        logical = merged(tuple(range(n)), False)
        reversal = tuple(reversed(range(n)))
        assert torch.equal(merged(reversal, False), logical) and torch.equal(merged(reversal, True), logical)
    logical = merged((0, 1, 2, 3), False)
    assert torch.equal(merged((0, 2, 1, 3), False), logical)
    assert not torch.equal(merged((0, 2, 1, 3), True), logical)


@pytest.mark.slow  # multi-rank negative control: make test-slow (.ci/run runs both)
def test_a_one_row_fault_makes_h_c4_and_h_c5_drift(monkeypatch):
    """Negative controls: the rows' plans with ws2's one-row fault on rank 1 fail their PASS rows, located to the
    faulted rank, node and packed row (one TP1 serves both)."""
    row = cp_bounds(84, 2)[1] + 6  # a row CP rank 1 holds
    plans = {"tp_fault": lambda world: {"topology": f"tp{world}", "faults": ["1:o_proj:30"]},
             "cp_fault": lambda world: {"topology": f"cp{world}", "faults": [f"1:q_norm:{row}"]}}  # fmt: skip
    for name, fn in plans.items():
        monkeypatch.setitem(multirank.PLANS, name, fn)
    ctx = build_context("ws2-tiny", "micro", "cpu")
    for row_id, probe, where in (("H-C4", "tp_fault", ("o_proj", 1, 30)), ("H-C5", "cp_fault", ("q_norm", 1, row))):
        record = run_ablation(row_id, ROWS[row_id].model_copy(update={"probe": probe}), ctx)
        assert record["mismatches"] == ["result: expected PASS, observed EXPECTED_DRIFT"], row_id
        sig = record["observed"]["signature"]
        assert (sig["node"], sig["rank"], sig["row"], sig["rows_differing"]) == (*where, 1), row_id
        assert record["diagnostics"]["ws2"][probe]["faults"][0]["rank"] == 1


# -- the command line ---------------------------------------------------------------------------------------------


def test_cli_list_unknown_row_and_usage_errors(run_cli):
    code, out, _ = run_cli("ablate", "--list", "--json")
    listed = json.loads(out)
    assert code == 0 and list(listed) == ["rows", "verdict"] and listed["verdict"] == "complete"
    assert list(listed["rows"]) == list(ROWS) and listed["rows"]["H5"]["probe"] == ROWS["H5"].probe
    code, _, err = run_cli("ablate", "H99", "--device", "cpu")
    assert code == 2 and "ablation row 'H99': unknown" in err
    code, _, err = run_cli("ablate", "--device", "cpu")
    assert code == 2 and "give a ROW" in err
    code, _, err = run_cli("ablate", "H2", "--all", "--device", "cpu")
    assert code == 2 and "not both" in err
    code, _, err = run_cli("ablate", "H9", "--steps", "2", "--device", "cpu")
    assert code == 2 and "--steps 2" in err
    code, _, err = run_cli("ablate", "A0,H99", "--device", "cpu")
    assert code == 2 and "ablation row 'H99': unknown" in err
    code, _, err = run_cli("ablate", "A0", "--threads", "0", "--device", "cpu")
    assert code == 2 and "--threads 0" in err


def test_cli_one_row_and_a_failing_row_exit_codes(run_cli, tmp_path, monkeypatch):
    code, out, _ = run_cli("ablate", "h-c0,H14", "--device", "cpu", "--out", tmp_path / "ok")
    assert code == 0 and "2/2 rows match" in out
    wrong = ROWS["H2"].expected.model_copy(update={"signature": Signature(node="block.1.norm1")})
    monkeypatch.setattr(ablate_cmd, "load_ablations", lambda: {**ROWS, "H2": ROWS["H2"].model_copy(
        update={"expected": wrong})})  # fmt: skip
    code, out, _ = run_cli("ablate", "H2", "--device", "cpu", "--out", tmp_path / "bad")
    doc = json.loads((tmp_path / "bad" / "ablation.json").read_text())
    assert code == 1 and doc["verdict"] == "fail" and doc["summary"]["failed"] == ["H2"]
    assert doc["rows"][0]["mismatches"] == ["node: expected 'block.1.norm1', observed 'block.0.norm1'"]


def test_permuted_layout_remaps_indices_so_the_canonical_order_follows_the_rows():
    spec = LayoutSpec(text_tokens=11, latent_frames=2, latent_height=4, latent_width=6, audio_latents=3,
                      anchors=["first", "last"])  # fmt: skip
    layout = build_layout(spec, "anchored")
    perm = torch.randperm(layout.seq_len, generator=torch.Generator().manual_seed(3))
    permuted = permuted_layout(layout, perm)
    assert torch.equal(perm[permuted.canonical_order()], layout.canonical_order())
    assert torch.equal(permuted.position_ids, layout.position_ids[perm])
    assert torch.equal(permuted_layout(layout, perm, keep_positions=True).position_ids, layout.position_ids)


def test_h_c3_fails_when_the_strict_attention_walks_packed_order(ctx, monkeypatch):
    """Negative control: the strict kernel given the identity order (a packed-order walk) on the permuted layout
    drifts at the first block's attention, and the row fails its PASS expectation."""

    def wrong_order(c, arm):
        return probes.packed_order_attention(c, probes.strict_attention(c, arm))

    monkeypatch.setitem(probes.ARM_PROBES, "wrong_order", wrong_order)
    record = run_ablation("H-C3", ROWS["H-C3"].model_copy(update={"strict": "wrong_order"}), ctx)
    assert record["verdict"] == "fail" and record["observed"]["result"] == "EXPECTED_DRIFT"
    assert record["observed"]["signature"]["node"] == "block.0.attention"
    assert any("identity order" in n for n in record["strict_notes"])


def test_device_synthetic_source_keeps_names_dtypes_and_init_rules():
    source = device_synthetic_source(CFG_TINY, 0, "cpu")
    params = load_model_params(source, CFG_TINY)  # shapes and dtypes checked against the inventory
    norm, bias = params["transformer_blocks.0.norm1.weight"], params["proj_in.bias"]
    assert norm.dtype == torch.bfloat16 and abs(float(norm.float().mean()) - 1.0) < 0.05
    assert bias.dtype == torch.float32 and float(bias.abs().max()) < 0.2
    again = device_synthetic_source(CFG_TINY, 0, "cpu").load("transformer_blocks.1.ff.net.2.weight")
    assert torch.equal(again, params["transformer_blocks.1.ff.net.2.weight"])


@pytest.mark.slow  # 36 s of make test's 300 on two cores: make test-slow (.ci/run runs both)
def test_rows_with_the_strict_kernels_as_the_strict_arm(run_cli, tmp_path):
    """The probes perturb the strict arm itself: every op bound to its Triton kernel (interpreted on CPU)."""
    code, out, err = run_cli(
        "ablate", "A0,H2,H5", "--mode", "strict", "--device", "cpu", "--out", tmp_path / "strict"
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads((tmp_path / "strict" / "ablation.json").read_text())
    execution = doc["execution"]
    assert execution["mode"] == "strict" and execution["provider_ops"] == []
    assert {"h3_full_attention", "h3_qkv_gemm", "h3_rmsnorm_modulate"} <= set(execution["triton_ops"])
    assert all(b["actual"] == "triton" and not b["fallback"] for b in execution["ops"].values())
    by_id = {r["id"]: r for r in doc["rows"]}
    assert by_id["A0"]["strict_sha256"] == by_id["A0"]["probe_sha256"]
    assert by_id["H5"]["observed"]["signature"]["node"] == "block.0.rope_q"
    assert by_id["H2"]["observed"]["signature"]["node"] == "block.0.norm1"
    assert [r["verdict"] for r in doc["rows"]] == ["pass", "pass", "pass"]
