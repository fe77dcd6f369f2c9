"""``h3gate run ws2``: TP, CP and SP ranks on gloo byte-equal to TP1, the one-device strict path in the seg8 order.

The acceptance matrix (ws2-tiny, micro layout, forward and backward), its negative controls (a one-row fault on one
rank, forward or backward, must fail and be located to that rank, node and row; the single-walk merge order must
not pass for seg8), the bad inputs (exit 2, before anything runs) and a crash (exit 3).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(run_cli, tmp_path, *args: str) -> tuple[int, dict | None, str]:
    out = tmp_path / "out"
    code, stdout, err = run_cli("--quiet", "run", "ws2", *args, "--out", out)
    path = out / "ws2.json"
    return code, json.loads(path.read_text()) if path.exists() else None, stdout + err


# ~50 s of make test's 300 on two cores (383 s in all on a clean clone with torch 2.13 and Triton 3.7.1): both in make
# test-slow (.ci/run runs both); make test keeps the merge-order control, the bad inputs and the crash
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["tp2", "tp4"])
def test_tp_ranks_are_byte_equal_to_tp1_forward_and_backward(run_cli, tmp_path, topology) -> None:
    code, body, text = _run(run_cli, tmp_path, "--topology", topology)
    assert code == 0, text
    assert text.splitlines()[-1] == "verdict: pass (0 failing checks)"
    n = body["tp"]
    assert body["forward_byte_equal"] and body["backward_byte_equal"] and body["verdict"] == "pass"
    assert body["world_size"] == n == len(body["ranks"])
    for r, rank in enumerate(body["ranks"]):
        assert rank["backend"] == "gloo" and rank["world_size"] == n and rank["rank_in_world"] == r
        assert rank["values_checked"] == 17 and rank["grads_checked"] >= 17 + 2 + 12
        assert rank["heads"] == [r * 8 // n, (r + 1) * 8 // n]
        assert rank["ffn_channels"] == [r * 512 // n, (r + 1) * 512 // n]
        assert rank["collective_probe"]["all_gather_rank_order"] == list(range(n))
        # every split GEMM holds 1/n of its weight: FLOPs divided by the degree
        shapes = rank["sharded_param_shapes"]
        assert shapes["attn.to_q.weight"] == [1024 // n, 192] and shapes["attn.to_out.0.weight"] == [192, 1024 // n]
        assert shapes["ff.net.0.proj.weight"] == [1024 // n, 192] and shapes["ff.net.2.weight"] == [192, 512 // n]
    bound = {b["ops"][0].get("bound") for b in body["reference"]["bindings"].values()}
    assert {"h3_attention_o_gemm_seg8", "h3_ffn_down_gemm_seg8", "h3_qkv_gemm_seg8"} <= bound
    # within-run determinism: TP1 and every rank evaluate each node once more after the forward, bitwise
    rec = body["determinism"]
    assert rec["pass"] and rec["mismatches"] == [] and rec["pairs"] == {"candidate": 17 * (n + 1)}
    assert [r["name"] for r in rec["ranks"]] == ["TP1", *(f"rank {r}" for r in range(n))]
    assert f"pairs on identical inputs: candidate {17 * (n + 1)}; all bitwise" in text


@pytest.mark.parametrize(
    ("topology", "layout", "rows"),
    [
        # 28 s of make test's 300 on two cores: make test-slow (.ci/run runs both), with TP2 and its faults
        pytest.param("cp2", "micro-odd", [[0, 44], [44, 83]], marks=pytest.mark.slow),
        pytest.param("tp2cp2", "micro", [[0, 44], [0, 44], [44, 84], [44, 84]], marks=pytest.mark.slow),
    ],
)
def test_cp_ranks_are_byte_equal_with_ulysses_attention(run_cli, tmp_path, topology, layout, rows) -> None:
    """CP (83 rows: shards of whole 11-row segments, the last one 6) and TP x CP: every value and every gradient
    equal to TP1, the row-sums CP splits (every GEMM's dW, the norms' weights, the AdaLN tables, temb) included."""
    code, body, text = _run(run_cli, tmp_path, "--topology", topology, "--layout", layout)
    assert code == 0, text
    assert body["forward_byte_equal"] and body["backward_byte_equal"]
    assert [r["packed_rows"] for r in body["ranks"]] == rows
    assert all(r["attention"].startswith("Ulysses all-to-all") for r in body["ranks"])
    assert body["ranks"][0]["cp_group"] == [0, body["tp"]] and body["ranks"][0]["tp_group"] == list(range(body["tp"]))
    assert "gradients_not_compared" not in body
    # 17 node outputs, hidden_states and temb, and the block's 12 parameters (TP: the rank's shards)
    assert all(r["grads_checked"] == 31 for r in body["ranks"])
    seq = body["layout"]["seq_len"]
    assert all(r["row_segments"] == [0, 11, 22, 33, 44, 55, 66, 77, seq] for r in body["ranks"])


@pytest.mark.slow  # SP in make test-slow (with tp4cp2sp, the model at tp2sp and the SP fault); .ci/run runs both
def test_sp_ranks_hold_their_row_segments_and_are_byte_equal(run_cli, tmp_path) -> None:
    """TP2 with SP: the norms and gated residuals on each rank's 4 row segments, Q/K/V and gate/up inputs gathered
    over the TP group, O and down merged then sliced; every value and gradient equal to TP1."""
    code, body, text = _run(run_cli, tmp_path, "--topology", "tp2sp")
    assert code == 0 and body["sp"] is True, text
    assert [r["sp_rows"] for r in body["ranks"]] == [[0, 44], [44, 84]]
    assert all(r["grads_checked"] == 31 and r["values_checked"] == 17 for r in body["ranks"])


@pytest.mark.parametrize(
    ("topology", "fault", "name", "rank", "row"),
    [
        pytest.param("cp2", "1:q_norm:70", "q_norm", 1, 70, marks=pytest.mark.slow),
        # 27 s of four ranks on two cores: make test-slow (.ci/run runs both), with the TP2 faults
        pytest.param("tp2cp2", "3:ffn_down:70:backward", "node:swiglu", 3, 70, marks=pytest.mark.slow),
        pytest.param("tp2sp", "1:residual_attn:60", "residual_attn", 1, 60, marks=pytest.mark.slow),  # an SP value
    ],
)
def test_a_cp_fault_is_located_to_its_rank_and_global_row(run_cli, tmp_path, topology, fault, name, rank, row):
    code, body, text = _run(run_cli, tmp_path, "--topology", topology, "--fault", fault)
    assert code == 1, text
    drift = body["first_drift"] if "backward" not in fault else body["first_backward_drift"]
    got = (drift["name"], drift["owner_rank"], drift["logical_row"], drift["ranks_differing"])
    assert got == (name, rank, row, [rank])


@pytest.mark.slow
def test_tp4cp2_and_the_whole_model_at_cp2(run_cli, tmp_path) -> None:
    code, body, text = _run(run_cli, tmp_path / "a", "--topology", "tp4cp2")
    assert code == 0 and body["world_size"] == 8 and body["ranks"][7]["heads"] == [6, 8], text
    code, body, text = _run(run_cli, tmp_path / "b", "--topology", "cp2", "--scope", "model")
    assert code == 0 and body["forward_byte_equal"] and body["backward_byte_equal"], text
    assert body["ranks"][0]["grads_checked"] == body["ranks"][1]["grads_checked"] > 17 * 2


@pytest.mark.slow
def test_tp4cp2sp_and_the_whole_model_at_tp2sp(run_cli, tmp_path) -> None:
    code, body, text = _run(run_cli, tmp_path / "a", "--topology", "tp4cp2sp")
    assert code == 0 and body["world_size"] == 8, text
    assert [r["sp_rows"] for r in body["ranks"]][5:] == [[55, 66], [66, 77], [77, 84]]
    assert all(r["grads_checked"] == 31 for r in body["ranks"])
    code, body, text = _run(run_cli, tmp_path / "b", "--topology", "tp2sp", "--scope", "model")
    assert code == 0 and body["forward_byte_equal"] and body["backward_byte_equal"], text


@pytest.mark.slow
def test_tp8_and_the_whole_model_at_tp2(run_cli, tmp_path) -> None:
    code, body, text = _run(run_cli, tmp_path / "a", "--topology", "tp8")
    assert code == 0 and body["ranks"][7]["heads"] == [7, 8], text
    code, body, text = _run(run_cli, tmp_path / "b", "--topology", "tp2", "--scope", "model")
    assert code == 0 and body["forward_byte_equal"] and body["backward_byte_equal"], text
    assert body["ranks"][0]["values_checked"] > 17 * 2  # every block, the refiner, embeddings and heads


@pytest.mark.parametrize(
    ("fault", "phase", "node", "rank", "row", "modality"),
    [
        pytest.param("1:o_proj:30", "forward", "o_proj", 1, 30, "video", marks=pytest.mark.slow),  # replicated value
        pytest.param("0:q_proj:5", "forward", "q_proj", 0, 5, "text", marks=pytest.mark.slow),  # a sharded value
        pytest.param("1:ffn_down:40:backward", "backward", "node:swiglu", 1, 40, "audio", marks=pytest.mark.slow),
    ],
)
def test_a_one_row_fault_on_one_rank_fails_and_is_located(run_cli, tmp_path, fault, phase, node, rank, row, modality):
    code, body, text = _run(run_cli, tmp_path, "--topology", "tp2", "--fault", fault)
    assert code == 1, text
    drift = body["first_drift"] if phase == "forward" else body["first_backward_drift"]
    assert drift["name"] == node and drift["owner_rank"] == rank and drift["logical_row"] == row
    assert drift["modality"] == modality and drift["rows_differing"] == 1 and drift["ranks_differing"] == [rank]
    assert body["verdict"] == "fail" and body["failing_checks"]
    n = len(body["failing_checks"])
    checks = f"{n} failing check{'' if n == 1 else 's'}"
    assert text.splitlines()[-1] == f"verdict: fail ({checks}; first drift: {node} on rank {rank})"
    if phase == "backward":
        assert body["forward_byte_equal"]


def test_the_single_walk_merge_order_is_not_what_tp_ranks_compute() -> None:
    """Negative control of the merge order: the TP2 row-parallel merge equals the seg8 operator, never the
    single-walk kernel (a crafted row whose FP32 sum depends on the order)."""
    from h3gate.kernels.gemm import linear
    from h3gate.kernels.gemm_merge import linear_merge
    from h3gate.kernels.tp_layers import MergeGroup, RowLinear

    k = 1024
    x = torch.zeros(1, k, dtype=torch.float32)
    x[0, 0], x[0, 256], x[0, 384] = 1.0, 2.0**25, -(2.0**25)  # segments 0, 2 and 3 (BLOCK_K 32: S = 128)
    w = torch.ones(4, k)
    subs = []
    for r in range(2):
        cols = slice(r * 512, (r + 1) * 512)
        subs.append((x[:, cols].contiguous(), w[:, cols].contiguous()))
    parts = [None, None]

    def gather(t):
        return list(parts)

    from h3gate.kernels.gemm_merge import segment_partials
    from h3gate.kernels.merge_tree import owned_segments

    for r, (xa, wa) in enumerate(subs):
        parts[r] = segment_partials(xa, wa, owned_segments(2, r), (4, k), "fwd").clone()
    merged = RowLinear.apply(subs[0][0], subs[0][1], (4, k), MergeGroup(2, 0, gather))
    assert torch.equal(merged, linear_merge(x, w)) and merged[0, 0] == 1.0
    assert not torch.equal(merged, linear(x, w))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "tp3"],
         "--topology 'tp3': must be one of tp1, tp2, tp4, tp8, cp2, tp2cp2, tp4cp2, tp2sp, tp2cp2sp, tp4cp2sp"),
        (["--topology", "tp2", "--scope", "layer"], "--scope 'layer': must be one of block, model"),
        (["--topology", "tp2", "--backend", "mpi"], "--backend 'mpi': must be one of gloo, nccl"),
        (["--topology", "tp2", "--backend", "nccl"], "--backend nccl: needs --device cuda (one GPU per rank)"),
        (["--topology", "tp2", "--config", "tiny"], "TP2 rank 0: attention O forward: its segments cover [0, 256) "
         "but the rank owns [0, 128); this config's widths do not fall on segment boundaries"),
        (["--topology", "tp2", "--fault", "2:o_proj:3"], "--fault '2:o_proj:3': rank 2 outside the topology's 2 ranks"),
        (["--topology", "tp2", "--fault", "0:o_proj:84"], "--fault '0:o_proj:84': row 84 must be < 84"),
        (["--topology", "tp2", "--fault", "0:o_proj:3:sideways"],
         "--fault '0:o_proj:3:sideways': 'sideways' is neither forward nor backward"),
        (["--topology", "tp2", "--fault", "o_proj:3"], "--fault 'o_proj:3': expected RANK:NODE:ROW[:forward|backward]"),
        (["--topology", "tp2", "--merge-order", "seg8"], "No such option"),
        (["--topology", "cp2", "--fault", "1:q_norm:3"],
         "--fault '1:q_norm:3': rank 1 (CP rank 1) holds packed rows [44, 84), not row 3"),
        (["--topology", "tp2sp", "--fault", "0:norm1:50"],
         "--fault '0:norm1:50': rank 0 (SP) holds packed rows [0, 44) of norm1, not row 50"),
        (["--topology", "tp2", "--layout", "nope"], "layout 'nope': unknown (known: 768p, medium, micro,"),
    ],
)  # fmt: skip
def test_bad_input_is_exit_2_in_one_line_before_anything_runs(run_cli, tmp_path, args, message) -> None:
    code, stdout, err = run_cli("--quiet", "run", "ws2", *args, "--out", tmp_path / "out")
    assert code == 2, stdout + err
    assert err.startswith(f"h3gate: error: {message}") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "ws1-block", "--merge-order", "seg16"], "--merge-order 'seg16': must be one of single, seg8"),
        (["run", "ws1-model", "--merge-order", "seg16"], "--merge-order 'seg16': must be one of single, seg8"),
        (["bench", "ws1-block", "--merge-order", "seg16"], "--merge-order 'seg16': must be one of single, seg8"),
        (["bench", "--op", "h3_qkv_gemm", "--merge-order", "seg8"],
         "--merge-order: applies to bench ws1-block and ws1-model (operators: --op NAME_seg8)"),
    ],
)  # fmt: skip
def test_a_merge_order_that_does_not_apply_is_exit_2(run_cli, tmp_path, args, message) -> None:
    code, _, err = run_cli("--quiet", *args, "--out", tmp_path / "out")
    assert code == 2 and err.strip() == f"h3gate: error: {message}"
    assert not (tmp_path / "out").exists()


def test_a_crash_is_exit_3_never_a_verdict(run_cli, monkeypatch, tmp_path) -> None:
    import h3gate.commands.ws2_cmd as ws2_cmd

    def boom(plan, progress=None):
        raise RuntimeError("run ws2: rank 1 exit 1: injected")

    monkeypatch.setattr(ws2_cmd, "run_ws2", boom)
    code, stdout, err = run_cli("--quiet", "run", "ws2", "--topology", "tp2", "--out", tmp_path / "out")
    assert code == 3, stdout + err
    assert err.startswith("h3gate: internal error: RuntimeError: run ws2: rank 1 exit 1") and "Traceback" not in err
    assert not (tmp_path / "out" / "ws2.json").exists()


@pytest.mark.slow  # 5-8 s on two cores: make test-slow (.ci/run runs both); make test's budget
def test_a_failing_rank_is_an_error_naming_the_rank(tmp_path) -> None:
    from h3gate.parallel.ws2 import Ws2Settings, _launch, plan_ws2

    plan = plan_ws2(Ws2Settings("tp2"))
    plan.run.spec = plan.run.spec.with_(config="no-such-config")  # the ranks cannot load it
    # both ranks read the bad config; torch's launcher stops the other at the first failure, so which rank exits 2
    # first is a race (the other is "ended by signal 15" or exits 2 too)
    with pytest.raises(RuntimeError, match=r"run ws2: rank [01] exit 2: h3gate: error: .*no-such-config"):
        _launch(plan, tmp_path)


def test_a_layout_that_leaves_a_rank_without_rows_is_exit_2(run_cli, tmp_path, monkeypatch) -> None:
    """17 packed rows are segments of 3 (the last two empty): under tp4cp2sp ranks 6 and 7 would hold no rows."""
    import h3gate.manifests.layouts as layouts

    text = layouts.LAYOUTS_FILE.read_text(encoding="utf-8") + (
        "  pico:\n    description: 17 rows\n    text_tokens: 5\n    latent_frames: 2\n    latent_height: 4\n"
        "    latent_width: 4\n    audio_latents: 2\n    anchors: []\n    seq_len: 17\n"
    )
    (tmp_path / "layouts.yaml").write_text(text, encoding="utf-8")
    monkeypatch.setattr(layouts, "LAYOUTS_FILE", tmp_path / "layouts.yaml")
    args = ("--quiet", "run", "ws2", "--topology", "tp4cp2sp", "--layout", "pico", "--out", tmp_path / "o")
    code, _, err = run_cli(*args)
    assert code == 2 and err.strip() == (
        "h3gate: error: --layout pico: 17 packed rows leave a rank of tp4cp2sp without rows (shards of whole row "
        "segments: [0, 3, 6, 9, 12, 15, 17, 17, 17])"
    )
    assert not (tmp_path / "o").exists()
