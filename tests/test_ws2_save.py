"""``h3gate run ws2 --save-tensors``: the ranks' values and gradients gathered, written as ``run ws1-block
--save-tensors`` writes its candidate, so anyone can compare the files.

The gather (every rank's elements put back where its plan's slicing took them) on hand-made shards, with its
negative controls (an element no rank holds is an error; positions that lie give a different tensor); a bad path
is exit 2 before any work; end to end (slow): ``run ws2 --topology tp2`` and ``run ws1-block --merge-order seg8``
on the same config, layout and seed write byte-equal candidate files under the same keys, values and gradients
(both backwards start from one cotangent, ``block_cotangent``), and a ``--merge-order single`` ws1-block run or one
perturbed element is reported as a difference; ``--scope model`` against ``run ws1-model --merge-order seg8``,
its gradients included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3gate.parallel.ws2_gather import gather, write_shards

pytestmark = pytest.mark.usefixtures("one_thread")


def differing(a: Path, b: Path, name: str) -> list[str]:
    """Keys of ``a/name.safetensors`` whose dtype, shape or bytes differ in ``b``'s file (or that it lacks)."""
    mine, theirs = load_file(a / f"{name}.safetensors"), load_file(b / f"{name}.safetensors")
    out = []
    for key, t in mine.items():
        other = theirs.get(key)
        same = other is not None and t.dtype == other.dtype and t.shape == other.shape
        if not (same and torch.equal(t.contiguous().view(torch.uint8), other.contiguous().view(torch.uint8))):
            out.append(key)
    return out


# ---- the gather on hand-made shards --------------------------------------------------------------------------------


class _Plan:
    """A rank plan's slicing: ``cols`` [lo, hi) of the last dim of ``v:x``; ``g:w`` held whole (replicated)."""

    def __init__(self, rank: int, lo: int, hi: int) -> None:
        self.rank, self.lo, self.hi = rank, lo, hi

    def local_value(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t[..., self.lo : self.hi].contiguous()

    def local_grad(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t


def _shards(folder: Path, x: torch.Tensor, w: torch.Tensor, spans, w_by_rank=None) -> None:
    save_file({"v:x": x, "g:w": w}, str(folder / "reference"))
    with safe_open(str(folder / "reference"), framework="pt") as ref:
        for rank, (lo, hi) in enumerate(spans):
            plan = _Plan(rank, lo, hi)
            mine = w if w_by_rank is None else w_by_rank[rank]
            write_shards(plan, {"x": plan.local_value("x", x)}, {"w": mine}, ref, folder)


def test_the_gather_puts_every_rank_elements_back_where_its_plan_took_them(tmp_path) -> None:
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    w = torch.randn(4, 5)
    _shards(tmp_path, x, w, [(0, 3), (3, 8)])
    values, grads, replicas = gather(tmp_path, 2)
    assert set(values) == {"x"} and set(grads) == {"w"} and replicas == {}
    assert values["x"].dtype == torch.bfloat16 and torch.equal(values["x"].view(torch.int16), x.view(torch.int16))
    assert torch.equal(grads["w"], w)


def test_a_replicated_element_is_the_lowest_rank_copy_and_a_differing_copy_is_named(tmp_path) -> None:
    x, w = torch.randn(2, 4), torch.zeros(3)
    _shards(tmp_path, x, w, [(0, 2), (2, 4)], w_by_rank=[torch.full((3,), 1.0), torch.full((3,), 2.0)])
    _, grads, replicas = gather(tmp_path, 2)
    assert torch.equal(grads["w"], torch.full((3,), 1.0)) and replicas == {"g:w": [1]}
    # a copy differing only in the sign of a zero is another copy too (bytes, not values)
    _shards(tmp_path, x, w, [(0, 2), (2, 4)], w_by_rank=[torch.zeros(3), -torch.zeros(3)])
    assert gather(tmp_path, 2)[2] == {"g:w": [1]}
    _shards(tmp_path, x, w, [(0, 2), (2, 4)], w_by_rank=[torch.zeros(3), torch.zeros(3)])  # control
    assert gather(tmp_path, 2)[2] == {}


def test_an_element_no_rank_holds_is_an_error(tmp_path) -> None:
    """Negative control: the ranks leave columns 5 .. 7 of ``x`` to nobody."""
    _shards(tmp_path, torch.randn(2, 8), torch.randn(3), [(0, 3), (3, 5)])
    with pytest.raises(RuntimeError, match="no rank holds every element of v:x"):
        gather(tmp_path, 2)


def test_positions_that_lie_give_another_tensor(tmp_path) -> None:
    """Negative control: the same shards under swapped positions are not the full tensor (the positions place)."""
    x = torch.arange(16.0).reshape(2, 8)
    _shards(tmp_path, x, torch.randn(3), [(0, 4), (4, 8)])
    one, two = load_file(tmp_path / "rank-0.safetensors"), load_file(tmp_path / "rank-1.safetensors")
    one["p:v:x"], two["p:v:x"] = two["p:v:x"].clone(), one["p:v:x"].clone()
    save_file(one, str(tmp_path / "rank-0.safetensors"))
    save_file(two, str(tmp_path / "rank-1.safetensors"))
    assert not torch.equal(gather(tmp_path, 2)[0]["x"], x)


def test_ws2_block_cotangent_is_ws1_block_cotangent() -> None:
    """The block scope's cotangent is ``block_cotangent`` (the tensor ``run ws1-block`` starts its backward from),
    cast to the output's dtype; negative control: another seed gives another tensor."""
    from types import SimpleNamespace

    from h3gate.graph.inputs import block_cotangent
    from h3gate.parallel.ws2_scope import cotangents

    scope = SimpleNamespace(name="block", graph=SimpleNamespace(output="residual_mlp"))
    out = torch.zeros(1, 12, 16, dtype=torch.bfloat16)
    got = cotangents(scope, {"residual_mlp": out}, 7)["residual_mlp"]
    want = block_cotangent(7, 12, 16, "cpu")
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got.view(torch.int16), block_cotangent(8, 12, 16, "cpu").view(torch.int16))


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("/proc/h3gate-nowhere/x", "--save-tensors /proc/h3gate-nowhere/x: cannot write in /proc"),
        ("FILE", "exists and is not a folder"),
    ],
)
def test_a_bad_save_tensors_path_is_exit_2_before_any_work(run_cli, tmp_path, monkeypatch, where, message) -> None:
    from h3gate.commands import ws2_cmd

    def no_work(*_a, **_k):
        raise AssertionError("run ws2 planned before --save-tensors was checked")

    monkeypatch.setattr(ws2_cmd, "plan_ws2", no_work)
    (tmp_path / "FILE").write_text("x")
    path = tmp_path / "FILE" if where == "FILE" else where
    code, out, err = run_cli("run", "ws2", "--topology", "tp2", "--save-tensors", path, "--out", tmp_path / "ev")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert out == "" and not (tmp_path / "ev").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


@pytest.mark.parametrize("short", ["memory", "disk"])
def test_a_gathered_copy_that_does_not_fit_is_exit_2_before_any_rank(run_cli, tmp_path, monkeypatch, short) -> None:
    """The gathered values and gradients (host memory) and their files (disk) are bounded before any rank starts:
    with one byte less than the bound available, exit 2 naming --save-tensors; with the bound itself, no refusal."""
    from h3gate import memory
    from h3gate.commands import ws2_cmd
    from h3gate.runs.memory_plan import gathered_tensors_bytes

    started = []
    monkeypatch.setattr(
        ws2_cmd,
        "run_ws2_gathered",
        lambda *a, **k: started.append(1) or (_ for _ in ()).throw(RuntimeError("ranks started")),
    )
    plan = ws2_cmd.plan_ws2(
        ws2_cmd.Ws2Settings(
            topology="tp2",
            scope="block",
            backend=None,
            device="cpu",
            config="ws2-tiny",
            layout="micro",
            seed=0,
            faults=[],
        )
    )
    host, disk = gathered_tensors_bytes(plan.cfg, plan.layout.seq_len, 1)
    assert disk < host  # positions are held, not written
    budget = {"memory": host - 1, "disk": disk - 1}[short]
    target = "device_available_bytes" if short == "memory" else "free_disk_bytes"
    monkeypatch.setattr(memory, target, lambda *_a: budget)
    code, out, err = run_cli(
        "run", "ws2", "--topology", "tp2", "--save-tensors", tmp_path / "t", "--out", tmp_path / "ev"
    )
    what = "needs at least" if short == "memory" else "writes at least"
    assert code == 2 and err.startswith("h3gate: error: --save-tensors at --scope block --layout micro") and what in err
    assert len(err.strip().splitlines()) == 1 and not started and not (tmp_path / "ev").exists()
    monkeypatch.setattr(memory, target, lambda *_a: budget + 1)  # the control: exactly the bound fits
    code, _, err = run_cli(
        "run", "ws2", "--topology", "tp2", "--save-tensors", tmp_path / "t", "--out", tmp_path / "ev"
    )
    assert code == 3 and started  # got past the check to the (stubbed) ranks


# ---- end to end: ws2 TP2 against ws1-block seg8 ------------------------------------------------------------------

COMMON = ("--config", "ws2-tiny", "--layout", "micro", "--seed", "0")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``run ws2 --topology tp2``, ``run ws1-block --merge-order seg8`` and ``--merge-order single`` (with the
    backward: ws1-block saves its candidate's gradients too), and ``run ws2`` with one row faulted on rank 1 in a
    sharded value (``q_proj``: heads) and a replicated one (``o_proj``), each with ``--save-tensors``: (exit codes,
    folder, ws2 evidence by run)."""
    from h3gate.cli import main

    tmp = tmp_path_factory.mktemp("ws2-save")
    runs = {
        "ws2": ["run", "ws2", "--topology", "tp2", *COMMON],
        "seg8": ["run", "ws1-block", "--merge-order", "seg8", "--device", "cpu", *COMMON],
        "single": ["run", "ws1-block", "--merge-order", "single", "--device", "cpu", *COMMON],
        "faulted": ["run", "ws2", "--topology", "tp2", "--fault", "1:q_proj:30", "--fault", "1:o_proj:30", *COMMON],
    }
    codes = {}
    for name, args in runs.items():
        with pytest.raises(SystemExit) as exc:
            main(["--quiet", *args, "--save-tensors", str(tmp / name), "--out", str(tmp / f"ev-{name}")])
        codes[name] = exc.value.code
    docs = {k: json.loads((tmp / f"ev-{k}" / "ws2.json").read_text(encoding="utf-8")) for k in ("ws2", "faulted")}
    return codes, tmp, docs


@pytest.mark.slow
def test_ws2_writes_ws1_block_candidate_files_byte_for_byte(saved) -> None:
    codes, tmp, docs = saved
    assert codes == {"ws2": 0, "seg8": 0, "single": 0, "faulted": 1}
    doc = docs["ws2"]
    assert doc["verdict"] == "pass" and doc["saved_tensors"] == str(tmp / "ws2")
    assert doc["saved_tensors_replicas_differing"] == {}
    ws2, seg8 = tmp / "ws2", tmp / "seg8"
    assert sorted(p.name for p in ws2.iterdir()) == ["candidate-grads.safetensors", "candidate.safetensors",
                                                     "inputs.safetensors"]  # fmt: skip
    for name in ("inputs", "candidate"):
        with safe_open(str(ws2 / f"{name}.safetensors"), "pt") as a, safe_open(str(seg8 / f"{name}.safetensors"),
                                                                              "pt") as b:  # fmt: skip
            assert set(a.keys()) == set(b.keys()), name
            meta = a.metadata()
        assert differing(ws2, seg8, name) == [], name
        assert (meta["config"], meta["layout"], meta["mode"], meta["seed"], meta["topology"]) == (
            "ws2-tiny", "micro", "strict", "0", "tp2",
        )  # fmt: skip
    grads = load_file(ws2 / "candidate-grads.safetensors")
    names = {k.partition(":")[0] for k in grads}
    assert names == {"node", "input", "param", "cotangent"}
    assert {"input:hidden_states", "input:temb", "param:attn.to_q.weight", "cotangent:residual_mlp"} <= set(grads)
    # sharded under TP2 (heads, FFN channels), gathered whole
    assert grads["param:attn.to_q.weight"].shape == (1024, 192) and grads["node:swiglu"].shape[-1] == 512


@pytest.mark.slow
def test_ws2_writes_ws1_block_candidate_gradients_byte_for_byte(saved, tmp_path) -> None:
    """``candidate-grads``: every key ws2 writes is in ws1-block's file with the same bytes (and no other), the
    cotangent included. Negative controls: ws1-block in the single-walk order differs in some gradient; one element
    of one saved gradient changed by one ulp is reported, under its key only."""
    _, tmp, _ = saved
    ws2, seg8 = tmp / "ws2", tmp / "seg8"
    with (
        safe_open(str(ws2 / "candidate-grads.safetensors"), "pt") as a,
        safe_open(str(seg8 / "candidate-grads.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        assert len(a.keys()) > 20
    assert differing(ws2, seg8, "candidate-grads") == []
    assert differing(ws2, tmp / "single", "candidate-grads") != []
    assert "cotangent:residual_mlp" not in differing(ws2, tmp / "single", "candidate-grads")  # one cotangent
    bent = _one_ulp_copy(ws2, tmp_path / "bent", "candidate-grads", "param:attn.to_q.weight", 11)
    assert differing(bent, seg8, "candidate-grads") == ["param:attn.to_q.weight"]


def _one_ulp_copy(folder: Path, to: Path, stem: str, key: str, index: int) -> Path:
    """A copy of ``folder`` with element ``index`` of ``stem``'s bf16 tensor ``key`` one ulp up."""
    shutil.copytree(folder, to)
    tensors = load_file(to / f"{stem}.safetensors")
    bits = tensors[key].view(torch.int16).clone()
    bits.view(-1)[index] += 1
    tensors[key] = bits.view(torch.bfloat16)
    save_file(tensors, str(to / f"{stem}.safetensors"))
    return to


@pytest.mark.slow
def test_the_comparison_reports_another_merge_order_and_one_perturbed_element(saved, tmp_path) -> None:
    """Negative controls: ws1-block in the single-walk order is not what the TP2 ranks computed; one element of
    one saved value changed by one ulp is reported, under its key only."""
    _, tmp, _ = saved
    ws2 = tmp / "ws2"
    assert "o_proj" in differing(ws2, tmp / "single", "candidate")  # the row-parallel GEMM's merge order
    bent = _one_ulp_copy(ws2, tmp_path / "bent", "candidate", "o_proj", 7)
    assert differing(bent, tmp / "seg8", "candidate") == ["o_proj"]


@pytest.mark.slow
def test_the_saved_files_hold_what_the_ranks_computed(saved) -> None:
    """Negative control: a row faulted on rank 1 shows in the gathered files (its heads of ``q_proj``), and a
    replicated value only rank 1 got wrong (``o_proj``) is named with that rank (rank 0's copy is saved)."""
    codes, tmp, docs = saved
    assert codes["faulted"] == 1
    changed = differing(tmp / "faulted", tmp / "seg8", "candidate")
    assert "q_proj" in changed and "output" in changed
    q = load_file(tmp / "faulted" / "candidate.safetensors")["q_proj"]
    want = load_file(tmp / "seg8" / "candidate.safetensors")["q_proj"]
    rows = (q.view(torch.int16) != want.view(torch.int16)).reshape(q.shape[0], q.shape[1], -1).any(-1).nonzero()
    assert rows[:, 1].unique().tolist() == [30]  # that row only
    assert docs["faulted"]["saved_tensors_replicas_differing"]["v:o_proj"] == [1]


@pytest.mark.slow
def test_the_whole_model_at_tp2_writes_ws1_model_candidate_files_byte_for_byte(run_cli, tmp_path) -> None:
    """``--scope model``: the files of ``run ws1-model --merge-order seg8 --save-tensors`` (diffusers' argument
    names for the inputs, ``output.video`` / ``output.audio``), byte for byte, and its candidate's gradients
    (``candidate-grads``: the stage-by-stage backward of the declared loss against the ranks' one autograd pass,
    both from ``model_cotangents``) key for key. Negative control: one element of one saved gradient changed by
    one ulp is reported, under its key only. (About 8 minutes on two busy CPU cores.)"""
    ws2, ws1 = tmp_path / "ws2", tmp_path / "ws1"
    code, _, err = run_cli("--quiet", "run", "ws2", "--topology", "tp2", "--scope", "model", *COMMON,
                           "--save-tensors", ws2, "--out", tmp_path / "ev-ws2")  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli("--quiet", "run", "ws1-model", "--merge-order", "seg8", "--device", "cpu",
                           *COMMON, "--save-tensors", ws1, "--out", tmp_path / "ev-ws1")  # fmt: skip
    assert code == 0, err
    for name in ("inputs", "candidate", "candidate-grads"):
        assert set(load_file(ws2 / f"{name}.safetensors")) == set(load_file(ws1 / f"{name}.safetensors")), name
        assert differing(ws2, ws1, name) == [], name
    assert {"output.video", "output.audio"} <= set(load_file(ws2 / "candidate.safetensors"))
    grads = load_file(ws2 / "candidate-grads.safetensors")
    assert {k.partition(":")[0] for k in grads} == {"node", "input", "param", "cotangent"}
    key = "param:transformer_blocks.0.attn.to_q.weight"  # sharded under TP2 (heads), gathered whole
    assert {"input:video_rows", "input:audio_rows", "input:text", "cotangent:heads.video_select",
            "cotangent:heads.audio_select", "node:block.0.o_proj", key} <= set(grads)  # fmt: skip
    bent = _one_ulp_copy(ws2, tmp_path / "bent", "candidate-grads", key, 5)
    assert differing(bent, ws1, "candidate-grads") == [key]
