"""The whole-model verbs' upper memory estimates (``h3gate.runs.model_memory``): counted from what the engines hold,
recorded in the plan, and a warning line (never a refusal) where the device has less. The CPU twin's measurements
against them are slow tests in tests/test_gpu_estimates.py."""

from __future__ import annotations

import pytest

from h3gate.commands import model_cmd, trajectory_cmd
from h3gate.errors import InputError
from h3gate.graph.stages import split_stages
from h3gate.layout import build_layout
from h3gate.manifests.layouts import layout_names, load_layout
from h3gate.manifests.model_config import load_config
from h3gate.runs import memory_plan, model_memory
from h3gate.runs.setup import ModelNeeds, RunSpec, prepare

GIB = 2**30


def _stop(*_args, **_kwargs):
    raise InputError("stop")


def test_the_gate_s_upper_estimate_is_at_least_its_lower_bound_everywhere():
    """At every layout, config, device and direction the gate's upper estimate is at least the lower bound that
    refuses; the backward's phase outweighs the forward's, and more provider lanes cost more."""
    seq_lens = {name: build_layout(load_layout(name), name).seq_len for name in layout_names()}
    for config in ("tiny", "real"):
        cfg = load_config(config).config
        stages = cfg.num_layers + cfg.num_refiner_layers + 6  # tests/test_ws1_model.py checks the count
        for name, rows in seq_lens.items():
            for backward in (True, False):
                lower = memory_plan.model_lower_bound_bytes(cfg, rows, stages, 12, backward)
                for device, providers in (("cpu", 3), ("cuda", 7)):
                    upper = model_memory.model_peak_estimate_bytes(cfg, rows, stages, providers, backward, device)
                    assert upper >= lower, (config, name, backward, device)
            assert model_memory.model_backward_phase(cfg, rows, stages, 7, "cuda") > (
                model_memory.model_forward_phase(cfg, rows, stages, 7, True, "cuda")
            )
            fewer = model_memory.model_peak_estimate_bytes(cfg, rows, stages, 3, True, "cuda")
            assert fewer < model_memory.model_peak_estimate_bytes(cfg, rows, stages, 7, True, "cuda")


def test_the_trajectory_s_upper_estimate_holds_every_weight_and_grows_with_the_batch():
    """Every weight resident: at real config the estimate is above the model's bf16 weights (about 62 GiB) times the
    slack; a batch of two holds twice the evaluation's values."""
    real = load_config("real").config
    weights = model_memory.model_weight_bytes(real)
    assert 60 * GIB < weights < 64 * GIB
    medium = build_layout(load_layout("medium"), "medium").seq_len
    one = model_memory.trajectory_peak_estimate_bytes(real, medium, 1, "cuda")
    two = model_memory.trajectory_peak_estimate_bytes(real, medium, 2, "cuda")
    assert one >= memory_plan.ALLOCATOR_SLACK["cuda"] * weights and two > one


def test_the_plan_records_the_upper_estimate_and_warns_only_when_the_device_has_less(monkeypatch):
    """The plan a ws1-model and a ws1-trajectory run record: the lower bound prepare checked, the upper estimate and
    what the device had free; a device with less than the upper estimate (but more than the lower bound: not
    refused) warns, one with enough does not."""
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 64 * GIB)
    gate = prepare(RunSpec("model", "micro"), ModelNeeds(providers=3), read=False).memory
    traj = prepare(RunSpec("model", "micro"), ModelNeeds(lanes=2, backward=False, evaluation_batch=1), read=False)
    for plan in (gate, traj.memory):
        assert plan.upper_bytes > plan.device_bytes > 0 and plan.available_bytes == 64 * GIB
        assert plan.warning is None and plan.record()["upper_gib"] == round(plan.upper_bytes / GIB, 4)
    assert gate.estimate == "whole-model gate, 3 provider lanes, forward and backward"
    assert traj.memory.estimate == "trajectory evaluation, batch 1, every weight resident"
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: gate.device_bytes + 1)  # the negative control
    low = prepare(RunSpec("model", "micro"), ModelNeeds(providers=3), read=False).memory
    assert low.upper_bytes == gate.upper_bytes and low.warning is not None
    assert low.warning.startswith("memory: the peak may reach") and low.warning.endswith("may run out of memory")


def test_ws1_model_warns_when_the_upper_estimate_exceeds_what_is_free(run_cli, tmp_path, monkeypatch):
    """Free host memory between the lower bound (20 MB at tiny/micro: not refused) and the upper estimate: one
    warning line on stderr before the run reads its inputs (stopped there); with plenty free, none."""
    monkeypatch.setattr(model_cmd, "read_inputs", _stop)
    args = ("run", "ws1-model", "--out", tmp_path / "ev")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 100 << 20)
    code, _, err = run_cli(*args)
    assert code == 2 and err.startswith("h3gate: warning: memory: the peak may reach 0.3 GiB (upper estimate")
    assert "0.1 GiB available: the run may run out of memory\n" in err and err.endswith("h3gate: error: stop\n")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 64 << 30)  # the negative control
    code, _, err = run_cli(*args, "--force")
    assert code == 2 and err == "h3gate: error: stop\n"


def test_ws1_trajectory_warns_when_the_upper_estimate_exceeds_what_is_free(run_cli, tmp_path, monkeypatch):
    """The same for the trajectory (lower bound 4.7 MB at tiny/micro), stopped before its run folder is made."""
    monkeypatch.setattr(trajectory_cmd, "enter_run", _stop)
    args = ("run", "ws1-trajectory", "--out", tmp_path / "run")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 12 << 20)
    code, _, err = run_cli(*args)
    assert code == 2 and err.startswith("h3gate: warning: memory: the peak may reach ")
    assert err.count("\n") == 2 and err.endswith("h3gate: error: stop\n")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 64 << 30)  # the negative control
    code, _, err = run_cli(*args)
    assert code == 2 and err == "h3gate: error: stop\n"


def test_a_streamed_range_warns_with_its_own_stages(capsys, monkeypatch):
    """``--stream`` checks each range: its upper estimate counts the range's stages (its blocks, the refiner and the
    six others), below the whole model's; the warning names it; with enough free, none."""
    from types import SimpleNamespace

    from h3gate.commands import model_stream_cmd
    from h3gate.manifests.tolerances import load_tolerance

    setup = prepare(RunSpec("model", "micro"), None, read=False)
    s = SimpleNamespace(run=SimpleNamespace(layout="micro"), backward=True)
    tol, cfg = load_tolerance("ws1-model"), setup.cfg
    upper = model_memory.model_peak_estimate_bytes(cfg, 84, 1 + cfg.num_refiner_layers + 6, 3, True, "cpu")
    assert upper < model_memory.model_peak_estimate_bytes(cfg, 84, len(split_stages(setup.graph)), 3, True, "cpu")
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 50 << 20)
    model_stream_cmd._require_memory(s, setup, [(0, 1)], tol)
    err = capsys.readouterr().err
    assert err.startswith(f"h3gate: warning: memory: the peak may reach {upper / GIB:.1f} GiB (upper estimate")
    assert err.endswith("the run may run out of memory\n") and err.count("\n") == 1
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: 64 << 30)  # the negative control
    model_stream_cmd._require_memory(s, setup, [(0, 1)], tol)
    assert capsys.readouterr().err == ""


def test_the_trajectory_is_refused_below_its_own_lower_bound_and_runs_at_it(monkeypatch):
    """A trajectory's lower bound is every stored weight plus one evaluation's widest block values (not the gate's
    five lanes and float64 golden, which it does not hold): one byte short is refused naming ws1-trajectory and the
    layout; exactly the bound passes the check (negative control). At real config the weights dominate it."""
    import h3gate.memory as memory

    cfg, rows = load_config("tiny").config, build_layout(load_layout("micro"), "micro").seq_len
    need = model_memory.trajectory_lower_bound_bytes(cfg, rows, 1)
    assert need == model_memory.model_weight_bytes(cfg) + rows * memory_plan.streamed_peak_width(cfg) * 2
    assert model_memory.trajectory_lower_bound_bytes(cfg, rows, 2) > need
    needs = ModelNeeds(lanes=2, backward=False, evaluation_batch=1)
    monkeypatch.setattr(memory, "device_available_bytes", lambda _device: need - 1)
    try:
        prepare(RunSpec("model", "micro"), needs, read=False)
    except InputError as err:
        assert str(err).startswith("ws1-trajectory --layout micro --config tiny") and "needs at least" in str(err)
    else:
        raise AssertionError("one byte short was not refused")
    monkeypatch.setattr(memory, "device_available_bytes", lambda _device: need)
    monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda: need)
    assert prepare(RunSpec("model", "micro"), needs, read=False).memory is not None
    real = load_config("real").config
    medium = build_layout(load_layout("medium"), "medium").seq_len
    assert model_memory.model_weight_bytes(real) / model_memory.trajectory_lower_bound_bytes(real, medium, 1) > 0.9


def test_the_released_backward_fits_one_h200_in_ranges_of_up_to_seven_blocks_holding_on_the_host(
    run_cli, tmp_path, monkeypatch
):
    """The whole-model backward holds at its fullest, everything on the device, the golden's FP64 stage backward
    beside the provider's values and gradients and the candidate's gradients (22 bytes per node element of a block).
    At 768p that does not fit one H200 (139.3 GiB available), so the gate holds on the host: the golden's gradients
    and, while the other lanes run, the provider's wait in host memory, and the fullest moment is the forward's
    (18 bytes per element: the golden's FP64 values beside the bf16 lanes'). A streamed range of one block then needs
    at least 100.1-112.6 GiB (the last range, with the final AdaLN and the heads, the most), four blocks 125.0 GiB;
    ranges of eight blocks (150.0 GiB) are refused before any weight is read, naming the way out, nothing written.
    At medium everything stays on the device; on the CPU the host is the device, and four blocks are refused."""
    from h3gate import memory

    cfg = load_config("real").config
    monkeypatch.setattr(memory, "device_available_bytes", lambda device: int(139.3 * GIB))
    seq = {name: build_layout(load_layout(name), name).seq_len for name in ("medium", "768p")}
    assert model_memory.hold_on_host(cfg, seq["768p"], 7, True, "cuda")
    assert not model_memory.hold_on_host(cfg, seq["medium"], 7, True, "cuda")
    assert not model_memory.hold_on_host(cfg, seq["768p"], 7, False, "cuda")  # no backward, nothing to hold
    assert not model_memory.hold_on_host(cfg, seq["768p"], 7, True, "cpu")  # on the CPU the host is the device

    def need(layout: str, a: int, b: int, backward: bool, host: bool = True) -> int:
        stages = memory_plan.row_stages(b - a, a == 0, b == cfg.num_layers)
        return memory_plan.model_lower_bound_bytes(cfg, seq[layout], stages, ModelNeeds().lanes, backward, host)

    cases = (("768p", 1, 2, True), ("768p", 0, 1, True), ("768p", 49, 50, True), ("768p", 0, 4, True),
             ("768p", 0, 8, True), ("768p", 0, 50, False), ("medium", 0, 50, True))  # fmt: skip
    assert [round(need(*a) / GIB, 1) for a in cases] == [100.1, 106.3, 112.6, 125.0, 150.0, 102.7, 41.0]
    assert [round(need(*a, host=False) / GIB, 1) for a in cases[:3]] == [119.3, 125.6, 131.8]
    element = memory_plan.block_node_elements(cfg, seq["768p"])
    assert need("768p", 1, 2, True, host=False) >= 22 * element > need("768p", 1, 2, True) >= 18 * element
    from types import SimpleNamespace

    from h3gate.commands import model_stream_cmd
    from h3gate.manifests.tolerances import load_tolerance

    def refusal(size: str) -> str:
        code, _, err = run_cli("run", "ws1-model", "--config", "real", "--layout", "768p", "--stream", "--range-size",
                               size, "--out", tmp_path / "run")  # fmt: skip
        assert code == 2 and not (tmp_path / "run").exists()
        return err

    # on the CPU the host is the device: nothing to hold elsewhere, four blocks are refused at 22 bytes an element
    assert refusal("4") == (
        "h3gate: error: ws1-model --stream --layout 768p --config real (S=38974, ranges of 4 blocks): needs at least "
        "144.3 GiB, 139.3 GiB of host memory available; use smaller ranges (--range-size) or --no-backward\n"
    )
    cuda = model_memory.hold_on_host  # the ranges decided as on the H200 (this machine has no CUDA device)
    monkeypatch.setattr(model_stream_cmd, "hold_on_host", lambda cfg, rows, p, backward, d: cuda(cfg, rows, p, backward,
                                                                                                 "cuda"))  # fmt: skip
    assert "(S=38974, ranges of 8 blocks): needs at least 150.0 GiB, 139.3 GiB" in refusal("8")
    setup = prepare(RunSpec("model", "768p", config="real"), None, read=False)
    s = SimpleNamespace(run=SimpleNamespace(layout="768p"), backward=True)
    ranges = [(a, a + 4) for a in range(0, 48, 4)] + [(48, 50)]
    model_stream_cmd._require_memory(s, setup, ranges, load_tolerance("ws1-model"))  # not refused: the control


def test_phase_1_alone_is_checked_against_its_own_bound(run_cli, tmp_path, monkeypatch):
    """``--boundaries-only`` runs phase 1 only (one lane through one stage at a time: the golden's FP64 node values
    and each lane's stage inputs over a checkpoint segment, 82.4 GiB at 768p): a plan whose 5:45 range could not be
    gated on one H200 stores its boundaries; without ``--boundaries-only`` the same plan is refused naming its
    ranges; with less than phase 1's bound free, phase 1 is refused naming it."""
    from h3gate import memory
    from h3gate.commands import model_stream_cmd

    cfg = load_config("real").config
    seq = build_layout(load_layout("768p"), "768p").seq_len
    first = memory_plan.phase1_lower_bound_bytes(cfg, seq, ModelNeeds().lanes, True, 6)
    assert round(first / GIB, 1) == 82.4
    monkeypatch.setattr(model_stream_cmd, "read_inputs", _stop)
    plan = ",".join(["0:1", "1:2", "2:3", "3:4", "4:5", "5:45", *(f"{a}:{a + 1}" for a in range(45, 50))])
    args = ("run", "ws1-model", "--config", "real", "--layout", "768p", "--stream", "--ranges", plan)
    for free, extra, want in (
        (139.3, ("--boundaries-only",), "h3gate: error: stop\n"),
        (139.3, (), "(S=38974, ranges of 40 blocks): needs at least"),
        (80.0, ("--boundaries-only",), "(S=38974, phase 1): needs at least 82.4 GiB"),
    ):
        monkeypatch.setattr(memory, "device_available_bytes", lambda device, free=free: int(free * GIB))
        monkeypatch.setattr(memory_plan, "available_memory_bytes", lambda free=free: int(free * GIB))
        code, _, err = run_cli(*args, *extra, "--out", tmp_path / "run", "--force")
        assert code == 2 and want in err.splitlines()[-1] + "\n", (extra, err)
    assert err.rstrip().endswith("use a smaller layout or --no-backward")


def test_the_trajectory_refuses_a_host_without_room_for_its_determinism_record(tmp_path, monkeypatch):
    """The determinism record keeps every block node's per-row fingerprints of each evaluation in host memory until
    the invocation ends (11.4 GiB for a 49-step 768p run): a host one byte short of the invocation's evaluations plus
    one is refused before any weight is read, naming the way out; exactly enough passes (negative control); a resumed
    run counts only the steps still to run."""
    import h3gate.memory as memory
    from h3gate.runs import ws1_trajectory as wt

    real = load_config("real").config
    assert round(49 * model_memory.record_host_bytes(real, 38974) / GIB, 1) == 11.4
    run = wt.prepare_trajectory(wt.TrajectorySettings(steps=4))
    need = 4 * model_memory.record_host_bytes(run.setup.cfg, run.setup.layout.seq_len)  # 3 evaluations and one more
    monkeypatch.setattr(memory, "device_available_bytes", lambda _device: need - 1)
    with pytest.raises(InputError, match=r"^--steps 4: the determinism record of 4 evaluations: needs at least .* GiB"
                       r" of host memory available; stop earlier with --until and resume$"):  # fmt: skip
        wt.check_run_range(run, tmp_path, None)
    assert list(tmp_path.iterdir()) == []
    wt.check_run_range(run, tmp_path, 1)  # two evaluations and one more fit
    wt.check_run_range(run, tmp_path, None, advancing=False)  # --verify-last alone: one evaluation
    monkeypatch.setattr(memory, "device_available_bytes", lambda _device: need)
    wt.check_run_range(run, tmp_path, None)
