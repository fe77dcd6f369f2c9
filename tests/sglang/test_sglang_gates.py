"""SGLang as the gates' candidate (``run ws1-block`` / ``run ws1-model --candidate sglang``) at the tiny config on the
CPU, through the command line: where SGLang's eager path is the provider bit for bit the gate passes with every node
bitwise; a one-row fault in one SGLang module fails it at that node and row; what SGLang did not capture fails by
name; what the candidate cannot do is refused up front (exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.sglang.helpers import MARKS

pytestmark = MARKS


def _doc(folder, name: str) -> dict:
    return json.loads((folder / name).read_text(encoding="utf-8"))


def test_the_block_gate_passes_with_sglang_bitwise_at_every_node(tiny, run_cli, tmp_path):
    code, out, err = run_cli("-q", "run", "ws1-block", "--candidate", "sglang", "--device", "cpu", "--out", tmp_path)
    doc = _doc(tmp_path, "ws1-block.json")
    assert code == 0 and doc["verdict"] == "pass", doc["failing_checks"]
    assert doc["candidate"]["kind"] == "sglang" and doc["candidate"]["scope"] == "block"
    assert doc["candidate"]["versions"]["sglang"] == "0.5.23" and doc["candidate"]["quality"] == "lossless"
    assert doc["backward"] is None and doc["first_drift"] is None
    for node in doc["nodes"]:
        assert node["binding"]["actual"] == "sglang" and node["binding"]["kernel_id"].startswith("sglang:blocks.0")
        assert node["chained"]["bitwise"] and node["isolated"]["bitwise"], node["name"]
    assert "candidate sglang 0.5.23" in out and err == ""


def test_a_fault_in_one_sglang_module_fails_the_block_gate_at_its_node_and_row(tiny, run_cli, tmp_path):
    code, _, _ = run_cli("-q", "run", "ws1-block", "--candidate", "sglang", "--device", "cpu", "--fault", "ffn_down:7",
                         "--out", tmp_path)  # fmt: skip
    doc = _doc(tmp_path, "ws1-block.json")
    assert code == 1 and doc["verdict"] == "fail"
    assert doc["first_isolated_drift"]["node"] == "ffn_down" and doc["first_isolated_drift"]["first_row"] == 7
    failure = doc["first_row_failure"]
    assert (failure["node"], failure["view"], failure["row"]) == ("ffn_down", "isolated", 7)
    upstream = [n for n in doc["nodes"] if n["name"] in ("norm2", "ffn_gate_up", "swiglu")]
    assert all(n["pass"] for n in upstream)


def test_the_model_gate_passes_with_sglang_and_locates_a_fault(tiny, run_cli, tmp_path):
    code, _, _ = run_cli("-q", "run", "ws1-model", "--candidate", "sglang", "--device", "cpu", "--out", tmp_path / "a")
    doc = _doc(tmp_path / "a", "ws1-model.json")
    assert code == 0 and doc["verdict"] == "pass" and doc["first_drift"] is None
    assert doc["summary"]["forward_nodes"] == 63 and doc["backward"] is None
    assert {n["binding"]["actual"] for n in doc["nodes"]} == {"sglang"}
    code, _, _ = run_cli("-q", "run", "ws1-model", "--candidate", "sglang", "--device", "cpu",
                         "--fault", "block.1.o_proj:30", "--out", tmp_path / "b")  # fmt: skip
    doc = _doc(tmp_path / "b", "ws1-model.json")
    assert code == 1
    drift = doc["first_drift"]
    assert (drift["node"], drift["layer"], drift["row"], drift["modality"]) == ("block.1.o_proj", 1, 30, "video")
    failure = doc["first_row_failure"]
    assert (failure["node"], failure["view"], failure["row"]) == ("block.1.o_proj", "isolated", 30)


def test_a_node_sglang_does_not_capture_fails_by_name(tiny, run_cli, tmp_path, monkeypatch):
    """As SGLang's fused QK-norm on CUDA: the norm modules are not called, so q_norm / k_norm are not captured; the
    gate fails them as such (and their readers' isolated view), never passes them silently."""
    import sglang.multimodal_gen.runtime.models.dits.minimax_h3 as dit

    def fused_qk_norm(q, k, q_norm, k_norm, head_dim):
        rms = torch.nn.functional.rms_norm
        return rms(q, (head_dim,), q_norm.weight, q_norm.eps), rms(k, (head_dim,), k_norm.weight, k_norm.eps)

    monkeypatch.setattr(dit, "_apply_qk_norm", fused_qk_norm)
    code, _, _ = run_cli("-q", "run", "ws1-block", "--candidate", "sglang", "--device", "cpu", "--out", tmp_path)
    doc = _doc(tmp_path, "ws1-block.json")
    assert code == 1 and set(doc["candidate"]["uncovered"]) >= {"q_norm", "k_norm"}
    failing = [c for c in doc["failing_checks"] if c.endswith(".captured") or ".captured " in c]
    assert {c.split(".")[1] for c in failing} >= {"q_norm", "k_norm"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "ws1-block", "--backward"), "--backward --candidate sglang: SGLang serves rollouts"),
        (("run", "ws1-block", "--fault-matrix"), "--fault-matrix --candidate sglang"),
        (("run", "ws1-block", "--fault", "q_proj:3"), "--fault q_proj --candidate sglang: the node is not a whole"),
        (("run", "ws1-model", "--layers", "1:2"), "--layers 1:2 --candidate sglang: SGLang runs its model from block"),
        (("run", "ws1-block", "--sglang-quality", "best"), "--sglang-quality 'best': must be one of exact, lossless"),
    ],
)
def test_what_the_sglang_candidate_cannot_do_is_refused_up_front(tiny, run_cli, tmp_path, args, message):
    code, out, err = run_cli(*args, "--candidate", "sglang", "--device", "cpu", "--out", tmp_path / "ev")
    assert (code, out) == (2, "") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "ev").exists()
