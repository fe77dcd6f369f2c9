"""``run arms --rollout sglang``: SGLang's DiT drives the rollout, diffusers' module trains (tiny config, one block,
the micro layout, batch 2).

R/R (SGLang under the strict binding, h3gate's Euler step; diffusers under ``h3gate.strict``) is byte-equal at every
step, request, modality and composition, and its rollout step files are byte for byte those of ``--rollout
diffusers``. P/P is byte-equal too at this size: on the CPU SGLang's eager path (every fused path off) is bitwise
diffusers' forward, and both P rollouts step diffusers' scheduler (the provider is not batch-invariant in general: on
the ws2-tiny config diffusers' own P/P drifts between a batch of two and a request alone, at the refiner). A one-row
fault on SGLang's rollout module is located at its node, step, request and row. Under SGLang's TP2 (two gloo ranks
started by torch's launcher) the R rollout in the seg8 order is byte for byte TP1's and the diffusers module's; under
its Ulysses 2 both letters roll out as on one device.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from tests.sglang.helpers import MARKS

pytestmark = MARKS
ARGS = ["--quiet", "run", "arms", "--device", "cpu", "--rollout", "sglang", "--layers", "1", "--json"]
MICRO_ROWS = 84  # micro: rows 0-23 text, 24-39 video, 40-51 audio, 52-83 video


def _cli(*args: str) -> tuple[int, dict, str]:
    """The CLI in this process (SGLang's runtime is per process): exit code, the --json brief, stderr."""
    from h3gate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    text = out.getvalue()
    return exc.value.code, json.loads(text) if text.strip().startswith("{") else {}, err.getvalue()


def _step_digests(rundir: Path) -> list[dict[str, str]]:
    sides = sorted((rundir / "steps").glob("step-*.json"))
    return [{k: v["sha256"] for k, v in json.loads(p.read_text())["tensors"].items()} for p in sides]


@pytest.fixture(scope="module")
def acceptance(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("arms-sglang")
    code, brief, err = _cli(*ARGS, "--arms", "P/P,R/R", "--steps", "3", "--out", out)
    return code, brief, json.loads((out / "arms.json").read_text()) if code in (0, 1) else {}, out, err


def test_r_r_and_p_p_are_byte_equal_at_every_step_and_modality(acceptance):
    code, brief, doc, _, err = acceptance
    assert code == 0, err
    arms = {a["arm"]: a for a in brief["arms"]}
    for name in ("R/R", "P/P"):  # P/P too: SGLang's eager CPU path is bitwise diffusers' forward
        assert arms[name]["byte_equal"] is True and arms[name]["first_drift"] is None, name
        assert arms[name]["gradients_repeat_bitwise"] is True
    full = {a["arm"]: a for a in doc["arms"]}
    assert doc["run"]["schedule"]["evaluations"] == 2
    for step in full["R/R"]["steps"]:
        assert len(step["requests"]) == 2
        for request in step["requests"]:
            for m in ("video", "audio"):
                assert all(c["bitwise"] for c in request[m].values())
    assert full["R/R"]["rollout_trace_ops"]["h3_full_attention triton"] > 0
    assert full["R/R"]["rollout_trace_ops"]["h3_ode_step provider"] == 4  # h3gate's Euler step, video + audio
    assert full["P/P"]["rollout_trace_ops"] == {}


def test_the_rollout_record_says_what_sglang_ran(acceptance):
    _, brief, doc, _, _ = acceptance
    rollout = brief["rollout"]
    assert rollout == doc["rollout"] and rollout["engine"] == "sglang" and rollout["tp"] == 1
    assert rollout["sglang"]["versions"]["sglang"] == "0.5.23" and rollout["sglang"]["quality"] == "lossless"
    assert rollout["sglang"]["attention_backend"]["resolved"] and rollout["sglang"]["degrees"]["tp"] == 1
    assert rollout["packing"]["cu_seqlens"] == [0, MICRO_ROWS, 2 * MICRO_ROWS, 192]  # padded to 64
    r, p = rollout["letters"]["R"], rollout["letters"]["P"]
    assert r["strict_binding"] == {"active": True, "mode": "strict", "merge_order": "seg8", "tp": 1, "ulysses": 1,
                                   "forwards": 2, "findings": 0}  # fmt: skip
    assert p["strict_binding"] is None and p["operators"] == "sglang as shipped"


def test_the_rollout_step_files_are_byte_for_byte_the_diffusers_rollouts(tiny, acceptance, tmp_path):
    """The same denoise loop on diffusers' module (R under h3gate.strict with its scheduler binding, P plain):
    every step's latents and velocities have the same digests as SGLang's."""
    from h3gate.arms.sides import rollout
    from h3gate.arms.stack import ArmsSettings, build_stack, plan_stack

    _, _, _, out, _ = acceptance
    stack, source = plan_stack(ArmsSettings(arms=("P/P", "R/R"), layers=1, steps=3))
    build_stack(stack, source)
    for letter in ("R", "P"):
        rollout(stack, letter, tmp_path / letter)
        ours, theirs = _step_digests(tmp_path / letter), _step_digests(out / f"rollout-{letter}")
        assert len(ours) == 2 and ours == theirs, letter


def test_a_fault_in_sglangs_module_is_located_at_its_node_step_and_row(tiny, tmp_path):
    code, brief, err = _cli(*ARGS, "--arms", "R/R", "--steps", "2", "--fault", f"block.0.o_proj:{MICRO_ROWS + 30}",
                            "--out", tmp_path)  # fmt: skip
    assert code == 1, err
    rr = brief["arms"][0]
    assert rr["byte_equal"] is False and rr["first_drift_step"] == 0
    where = rr["first_drift"]
    assert (where["node"], where["request"], where["row"], where["modality"]) == ("block.0.o_proj", 1, 30, "video")
    assert where["replay_faithful"] == {"rollout": True, "training": True} and where["max_abs"] > 0
    assert brief["rollout"]["fault"] == {"node": "block.0.o_proj", "module": "blocks.0.attn.out_proj", "row": 114}
    assert brief["failing_checks"] == ["R/R.byte_equal (first drift at step 0)"]


def test_tp2_rollout_under_seg8_is_byte_for_byte_tp1_and_the_diffusers_module(tiny, tmp_path):
    """SGLang's TP2 (gloo ranks, torch's launcher) under the strict binding in the seg8 order: the R rollout's step
    files equal TP1's (SGLang bound in seg8, this process) and diffusers' module under h3gate.strict in seg8."""
    from h3gate.arms.sglang_side import SglangEngine, build_sglang
    from h3gate.arms.sglang_tp import tp_rollouts
    from h3gate.arms.sides import rollout
    from h3gate.arms.stack import ArmsSettings, build_stack, plan_stack

    settings = ArmsSettings(arms=("R/R",), config="ws2-tiny", layers=1, steps=2, rollout="sglang", merge="seg8")
    stack, source = plan_stack(settings)
    stack.settings = ArmsSettings(**{**vars(settings), "tp": 2})
    tp2, record = tp_rollouts(stack, source, tmp_path / "tp2", ["R"], None)
    assert record["ranks"] == {"world": 2, "launcher": "torch.distributed.run", "backend": "gloo"}
    assert record["letters"]["R"]["strict_binding"]["tp"] == 2 and record["sglang"]["degrees"]["tp"] == 2
    stack.settings = settings
    build_sglang(stack, source)
    tp1 = rollout(stack, "R", tmp_path / "tp1" / "rollout-R", None, SglangEngine(stack))
    build_stack(stack, source)
    module = rollout(stack, "R", tmp_path / "module" / "rollout-R")
    digests = [_step_digests(tmp_path / w / "rollout-R") for w in ("tp2", "tp1", "module")]
    assert len(digests[0]) == 1 and digests[0] == digests[1] == digests[2]
    assert [t.equal(u) for t, u in zip(tp2["R"].final, tp1.final, strict=True)] == [True, True]
    assert [t.equal(u) for t, u in zip(tp1.final, module.final, strict=True)] == [True, True]


def test_ulysses2_rollout_is_byte_for_byte_one_device_in_both_letters(tiny, tmp_path):
    """SGLang's Ulysses 2 (gloo ranks, torch's launcher; one request, its direct path): R under the strict binding and
    P as shipped roll out byte for byte as on one device."""
    from h3gate.arms.sglang_side import SglangEngine, build_sglang
    from h3gate.arms.sglang_tp import tp_rollouts
    from h3gate.arms.sides import rollout
    from h3gate.arms.stack import ArmsSettings, plan_stack

    settings = ArmsSettings(arms=("P/P", "R/R"), layers=1, steps=2, batch=1, rollout="sglang", ulysses=2)
    stack, source = plan_stack(settings)
    sp2, record = tp_rollouts(stack, source, tmp_path / "sp2", ["R", "P"], None)
    assert record["sglang"]["degrees"] == {"tp": 1, "ulysses": 2, "ring": 1} and record["packing"]["path"] == "direct"
    assert record["letters"]["R"]["strict_binding"]["ulysses"] == 2
    build_sglang(stack, source)
    engine = SglangEngine(stack)
    for letter in ("R", "P"):
        one = rollout(stack, letter, tmp_path / "one" / f"rollout-{letter}", None, engine)
        digests = [_step_digests(tmp_path / w / f"rollout-{letter}") for w in ("sp2", "one")]
        assert len(digests[0]) == 1 and digests[0] == digests[1], letter
        assert [t.equal(u) for t, u in zip(sp2[letter].final, one.final, strict=True)] == [True, True]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sglang-quality", "best"], "--sglang-quality 'best': must be one of exact, lossless, high"),
        (["--fault", "block.0.q_proj:3"], "--fault block.0.q_proj --rollout sglang: the node is not a whole SGLang"),
        (
            ["--fault", "block.0.o_proj:168"],
            "--fault block.0.o_proj:168 --rollout sglang: blocks.0.attn.out_proj's output has 168 rows",
        ),
        (["--fault", "block.0.o_proj:3:backward"], "only forward scale faults"),
        (
            ["--tp", "2", "--merge-order", "single"],
            "--tp 2: merge order 'single' is not TP-invariant; drop --merge-order single",
        ),
        (["--tp", "2"], "TP2 rank 0: "),  # the tiny config's 2 heads (in the default order)
        (["--tp", "0"], "--tp 0: must be at least 1"),
        (["--lora-rank", "2"], "--lora-rank with --rollout sglang: SGLang's DiT holds the base weights only"),
        (["--ulysses", "2"], "--ulysses 2: SGLang's Ulysses rollout takes one request (--batch 1"),
        (["--ulysses", "2", "--tp", "2", "--merge-order", "seg8"], "one kind of SGLang parallelism at a time"),
    ],
)
def test_bad_sglang_input_is_exit_2_with_one_line(tiny, tmp_path, args, message):
    out = tmp_path / "out"
    code, _, err = _cli(*ARGS, *args, "--out", out)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
