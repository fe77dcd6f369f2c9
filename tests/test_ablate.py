"""``h3gate ablate``: the manifest, the whole RFC section 6 matrix on the tiny config (CPU), and negative controls
proving the engine fails a row whose expectation is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from h3gate.ablate.checks import no_kv_cache
from h3gate.ablate.engine import build_context, device_synthetic_source, resolve_packed_row
from h3gate.ablate.probes import canonical_order, permuted_layout
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
from h3gate.parallel.plans import OwnershipError, check_ownership, cp_plan, hidden_only_plan, misowned_plan

ROWS = load_ablations()
CFG_TINY = load_config("tiny").config
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ctx():
    return build_context("tiny", "tiny", "cpu")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The CI run: every row on the tiny config, CPU, provider ops."""
    out = tmp_path_factory.mktemp("ablate")
    code = ablate_cmd.ablate_command(None, True, False, "tiny", "tiny", "cpu", out, True)
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
    assert code == 0 and doc["verdict"] == "pass" and list(by_id) == list(ROWS)
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
    assert "rank 0: adaln_indices holds packed row(s) [132]" in by_id["A4"]["observed"]["reason"]
    assert "Checked:" in by_id["A5"]["observed"]["reason"] and "Checked:" in by_id["C2"]["observed"]["reason"]
    sig = by_id["H2"]["observed"]["signature"]
    assert (sig["node"], sig["layer"], sig["row"], sig["modality"]) == ("block.0.norm1", 0, 136, "video")
    assert by_id["H17"]["observed"]["signature"]["row"] == 132  # first row of rank 1
    # trajectory rows seal per-step velocity and latent hashes for both arms
    steps = {(h["node"], h["step"]) for h in by_id["H-C2"]["hashed"]["strict"]}
    assert {("scheduler.video_step", s) for s in range(3)} <= steps and ("heads.audio_select", 2) in steps
    # the multi-rank rows really sharded: rank 0 held one of two heads / half of the rows
    plans = by_id["H-C4"]["diagnostics"]["plans"]["tp"]
    assert plans["overridden_nodes"] > 0 and plans["rank0_local_shapes"]["block.0.q_proj"][-1] == 128
    assert by_id["H-C5"]["diagnostics"]["plans"]["cp"]["rank0_local_shapes"]["block.0.norm1"][1] == 132
    # H-C3 is a PASS only through canonical-order attention; packed-order attention is reported honestly
    diag = by_id["H-C3"]["diagnostics"]["packed_order_attention"]["outputs"]["heads.video_select"]
    assert diag["bitwise"] is False and diag["rows_differing"] > 0
    same = by_id["H-C3"]["diagnostics"]["canonical_strict_vs_provider"]["outputs"]
    assert all(o["bitwise"] for o in same.values())  # canonical order is the identity on the canonical layout
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
    """``ranks`` is read: H-C4 on three ranks asks for TP3, which the tiny config's two heads cannot split (N/A)."""
    record = run_ablation("H-C4", ROWS["H-C4"].model_copy(update={"ranks": 3}), ctx)
    assert record["observed"]["result"] == "NA" and record["verdict"] == "fail"
    assert record["observed"]["reason"] == "not run: TP3: 2 heads are not divisible by 3"


def test_ownership_check_rejects_misowned_metadata():
    check_ownership(cp_plan(264, 2), 264)
    check_ownership(hidden_only_plan(264, 2), 264)  # no ownership declared: nothing to reject (H17 drifts instead)
    with pytest.raises(OwnershipError, match=r"rank 0: adaln_indices holds packed row\(s\) \[132\]"):
        check_ownership(misowned_plan(264, 2), 264)
    uneven = cp_plan(925, 2)  # an odd packed length: near-equal contiguous shards
    assert [len(r) for r in uneven.hidden_rows] == [463, 462]
    check_ownership(uneven, 925)
    with pytest.raises(OwnershipError, match=r"rank 0: adaln_indices holds packed row\(s\) \[463\]"):
        check_ownership(misowned_plan(925, 2), 925)
    plan = cp_plan(264, 2)
    broken = type(plan)(2, (plan.hidden_rows[0], plan.hidden_rows[0]), None)
    with pytest.raises(OwnershipError, match="do not cover"):
        check_ownership(broken, 264)


# -- the command line ---------------------------------------------------------------------------------------------


def test_cli_list_unknown_row_and_usage_errors(run_cli):
    code, out, _ = run_cli("ablate", "--list", "--json")
    assert code == 0 and list(json.loads(out)) == list(ROWS)
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


def test_canonical_order_is_identity_on_canonical_layouts_and_inverts_permutations():
    spec = LayoutSpec(text_tokens=11, latent_frames=2, latent_height=4, latent_width=6, audio_latents=3,
                      anchors=["first", "last"])  # fmt: skip
    layout = build_layout(spec, "anchored")
    nc = layout.num_condition_video_rows
    assert torch.equal(canonical_order(layout.tensors(), nc), torch.arange(layout.seq_len))
    perm = torch.randperm(layout.seq_len, generator=torch.Generator().manual_seed(3))
    permuted = permuted_layout(layout, perm)
    assert torch.equal(perm[canonical_order(permuted.tensors(), nc)], torch.arange(layout.seq_len))
    assert torch.equal(permuted.position_ids, layout.position_ids[perm])
    assert torch.equal(permuted_layout(layout, perm, keep_positions=True).position_ids, layout.position_ids)


def test_device_synthetic_source_keeps_names_dtypes_and_init_rules():
    source = device_synthetic_source(CFG_TINY, 0, "cpu")
    params = load_model_params(source, CFG_TINY)  # shapes and dtypes checked against the inventory
    norm, bias = params["transformer_blocks.0.norm1.weight"], params["proj_in.bias"]
    assert norm.dtype == torch.bfloat16 and abs(float(norm.float().mean()) - 1.0) < 0.05
    assert bias.dtype == torch.float32 and float(bias.abs().max()) < 0.2
    again = device_synthetic_source(CFG_TINY, 0, "cpu").load("transformer_blocks.1.ff.net.2.weight")
    assert torch.equal(again, params["transformer_blocks.1.ff.net.2.weight"])


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
