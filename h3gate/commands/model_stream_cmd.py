"""``h3gate run ws1-model --stream | --layers A:B --from RUNDIR | --merge RUNDIR``: the whole-model gate in three
phases over a run folder (:mod:`h3gate.runs.model_stream`), resumable, and sharded over ranks when torch's launcher
started it (``torchrun --nproc-per-node N -m h3gate run ws1-model --stream ...``: phase 1 on rank 0, the ranges
round-robin over the ranks, rank 0 merges and prints the verdict).

Exit codes: as ``run ws1-model``; a ``--resume`` / ``--from`` / ``--merge`` folder from other code or settings is
exit 2 naming the first differing field, as is a boundary plan that does not fit the disk.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.commands.model_cmd import KIND, Ws1ModelCommand, build_body, parse_model_fault, print_summary
from h3gate.commands.run_cmd import check_gate_args, warn_memory
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.provenance import code_sha256, sha256_file
from h3gate.evidence.runfolder import enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.gate.variants import provider_lanes
from h3gate.graph.determinism import Injection
from h3gate.manifests.tolerances import ToleranceProfile
from h3gate.memory import release_cached, require, require_disk, turns_to_fit
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs import model_stream
from h3gate.runs import stream_files as files
from h3gate.runs.memory_plan import model_lower_bound_bytes, phase1_lower_bound_bytes, row_stages
from h3gate.runs.model_memory import hold_on_host, plan_model_memory
from h3gate.runs.model_merge import merge_ranges, range_timing
from h3gate.runs.model_stages import timestep_count
from h3gate.runs.model_stream import Share, StreamPlan, boundary_bytes, build_plan, phase1, run_range
from h3gate.runs.setup import ModelNeeds, Run, parse_layers, prepare, read_inputs
from h3gate.runs.trajectory_files import differing_field
from h3gate.runs.ws1_model import ModelGate, ModelGateResult, gate_context, lane_records, make_lanes

SMALL_MODEL = 8  # configs up to this many blocks get one range per block by default, larger ones DEFAULT_RANGE
DEFAULT_RANGE = 5
BARRIER_TIMEOUT = timedelta(hours=12)  # a rank waits for the slowest one at each boundary and after its ranges


def parse_ranges(ranges: str | None, size: int | None, num_layers: int) -> list[tuple[int, int]]:
    """``--ranges 0:5,5:50`` (contiguous, covering every block) or ``--range-size K``; default one range per
    block up to :data:`SMALL_MODEL` blocks, else :data:`DEFAULT_RANGE` blocks a range."""
    if ranges is not None and size is not None:
        raise InputError("--ranges and --range-size: give one of them")
    if ranges is None:
        k = size if size is not None else (1 if num_layers <= SMALL_MODEL else DEFAULT_RANGE)
        if k < 1:
            raise InputError(f"--range-size {k}: must be >= 1")
        return [(a, min(a + k, num_layers)) for a in range(0, num_layers, k)]
    out = []
    for part in ranges.split(","):
        pieces = part.split(":")
        if len(pieces) != 2 or not all(p.strip().isdigit() for p in pieces):
            raise InputError(f"--ranges {ranges!r}: {part!r} is not A:B")
        out.append((int(pieces[0]), int(pieces[1])))
    ends = [0] + [b for _, b in out]
    if any(a != e or b <= a for (a, b), e in zip(out, ends, strict=False)) or ends[-1] != num_layers:
        raise InputError(f"--ranges {ranges!r}: must be contiguous ranges A:B covering blocks 0 .. {num_layers - 1}")
    return out


def _settings_record(s: Ws1ModelCommand, tol_file: Path) -> dict:
    """What ties a RUNDIR to one run: resuming or adding a range with any field different is refused."""
    spec = s.run.record()
    spec["device"] = "cuda" if spec["device"].startswith("cuda") else spec["device"]
    spec.pop("layers")
    return {"code_sha256": code_sha256(), "run": spec, "backward": s.backward,
            "tolerance": {"name": s.tolerance, "sha256": sha256_file(tol_file)}, "fault": s.fault}  # fmt: skip


def _value_at(doc: dict, dotted: str):
    for k in dotted.split("."):
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _check_plan(rundir: Path, flag: str, settings: dict) -> dict:
    plan = files.read_plan(rundir, flag)
    diff = differing_field(plan["settings"], settings)
    if diff is not None:
        raise InputError(f"{flag} {display(rundir)}: {diff} differs from the saved run (saved "
                         f"{_value_at(plan['settings'], diff)!r}, now {_value_at(settings, diff)!r})")  # fmt: skip
    return plan


def _distributed() -> tuple[int, int]:
    """(rank, world) as torch's launcher set them; (0, 1) outside it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _init_ranks(device: str) -> str:
    """Join the launcher's process group: NCCL on CUDA with one GPU per local rank; gloo on the CPU, or where the
    host's ranks outnumber its GPUs (processes sharing one GPU, :func:`placement`). The rank's device."""
    import torch.distributed as dist

    backend = "gloo"
    if device.startswith("cuda"):
        gpu, _, _ = _local_placement(device)
        rank_device = f"cuda:{gpu}"
        torch.cuda.set_device(torch.device(rank_device))
        backend = "nccl" if _local_world() <= torch.cuda.device_count() else "gloo"
        device = spec_device(device, rank_device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=BARRIER_TIMEOUT)
    return device


def placement(device: str, local_rank: int, local_world: int, gpus: int) -> tuple[int, int, int]:
    """(this rank's GPU, how many of the host's ranks share its device, its place among them): local rank R runs on
    GPU R mod ``gpus``; on the CPU every local rank shares the host's memory."""
    count = max(1, min(gpus if device.startswith("cuda") else 1, local_world))
    return local_rank % count, len(range(local_rank % count, local_world, count)), local_rank // count


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _local_placement(device: str) -> tuple[int, int, int]:
    """:func:`placement` of this process, from torch's launcher's environment and the GPUs this host has."""
    gpus = torch.cuda.device_count() if device.startswith("cuda") and torch.cuda.is_available() else 1
    return placement(device, int(os.environ.get("LOCAL_RANK", "0")), _local_world(), gpus)


def _phase2_turns(setup: Run) -> tuple[int, int]:
    """(turns, this rank's turn) of phase 2: ranks sharing a device gate their ranges at once where the plan's upper
    estimate fits that many times in what the device has free, else one at a time (the most turns any rank needs,
    agreed over the ranks: every rank waits at each turn's barrier)."""
    import torch.distributed as dist

    _, sharing, place = _local_placement(setup.device)
    need = turns_to_fit(setup.memory.upper_bytes, sharing, setup.memory.available_bytes)
    agreed = torch.tensor([need], dtype=torch.int64, device=setup.device if _on_nccl() else "cpu")
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    turns = int(agreed.item())
    return turns, (place if turns > 1 else 0)


def spec_device(requested: str, rank_device: str) -> str:
    """The device a rank's run places its tensors on and its records name: a bare ``cuda`` as requested (torch's
    current device, which :func:`_init_ranks` set to the rank's GPU), so that a streamed record names the device as
    the plain run's does; any other request, the rank's own device."""
    return requested if requested == "cuda" else rank_device


def _on_nccl() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "nccl"


def _share_path(path: Path | None, device: str) -> Path:
    """Rank 0's run folder, sent to every rank as bytes (no pickle)."""
    import torch.distributed as dist

    on = device if _on_nccl() else "cpu"
    data = torch.tensor(list(str(path).encode()) if path is not None else [], dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=on)
    dist.broadcast(size, 0)
    buf = data.to(on) if path is not None else torch.zeros(int(size), dtype=torch.uint8, device=on)
    dist.broadcast(buf, 0)
    return Path(bytes(buf.cpu().tolist()).decode())


def _barrier(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if _on_nccl():
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def _prepared(s: Ws1ModelCommand, device: str | None = None, out: bool = True) -> tuple[Run, object, Path]:
    """The cheap checks and the run, nothing read (``out``: check ``--out``, rank 0's folder)."""
    if s.run.candidate == "sglang":
        raise InputError("--stream: the SGLang candidate is computed whole; stream the h3gate candidate")
    if s.save_tensors is not None:
        raise InputError("--save-tensors: not with a streamed run (each range holds only its own values)")
    if s.fault_matrix:
        raise InputError("--fault-matrix: not with a streamed run (run it on a plain ws1-model run)")
    tol_file, tol = check_gate_args(s.run.mode, s.tolerance, None, s.out if out else None, s.force)
    spec = s.run if device is None else s.run.with_(device=device)
    setup = prepare(spec.with_(layers=None), None, read=False)
    if s.fault is not None and isinstance(parse_model_fault(s.fault, setup), Injection):
        raise InputError(f"--fault {s.fault!r}: ulp@K counts one process's evaluations; not with a streamed run")
    return setup, tol, tol_file


def _require_memory(s: Ws1ModelCommand, setup: Run, ranges: list[tuple[int, int]], tol: ToleranceProfile,
                    phase1: bool = False) -> None:  # fmt: skip
    """The device's memory against the largest lower bound of what this invocation runs: phase 1 (``phase1``) and,
    unless ``--boundaries-only``, phase 2 of each range of blocks (with the stages before and after them); the upper
    estimate (the gate's lanes over the largest range's stages) warns."""
    cfg, seq, last, lanes = setup.cfg, setup.layout.seq_len, setup.cfg.num_layers, ModelNeeds().lanes
    blocks = max(b - a for a, b in ranges)
    gated = [] if phase1 and s.boundaries_only else ranges
    providers = provider_lanes(list(tol.row_rule.variants), setup.device)
    hold = hold_on_host(cfg, seq, providers, s.backward, setup.device)  # as ModelGate.of decides for each range
    needs = [model_lower_bound_bytes(cfg, seq, row_stages(b - a, a == 0, b == last), lanes, s.backward, hold)
             for a, b in gated]  # fmt: skip
    first = phase1_lower_bound_bytes(cfg, seq, lanes, s.backward, model_stream.SEGMENT) if phase1 else 0
    if not needs or first > max(needs):  # phase 1 holds the most: smaller ranges do not help
        need, what, hint = first, "phase 1", "use a smaller layout" + (" or --no-backward" if s.backward else "")
    else:
        need, what = max(needs), f"ranges of {blocks} blocks"
        hint = "use smaller ranges (--range-size)" + (" or --no-backward" if s.backward else "")
    require(
        need,
        f"ws1-model --stream --layout {s.run.layout} --config {setup.config_name} (S={seq}, {what})",
        setup.device,
        hint=hint,
    )
    stages = blocks + cfg.num_refiner_layers + 6
    setup.memory = plan_model_memory(cfg, seq, stages, providers, s.backward, None, setup.device, need, 0, hold)
    warn_memory(setup.memory)  # the plan's hold is the ranges' (ModelGate.of reads it): decided once


def _gate(s: Ws1ModelCommand, setup: Run, tol, step=None) -> ModelGate:
    fault = None if s.fault is None else parse_model_fault(s.fault, setup)
    gate = ModelGate.of(setup, tol, s.backward, fault, progress=step)
    return gate


def _new_plan(s: Ws1ModelCommand, setup: Run, gate: ModelGate, settings: dict, rundir: Path) -> dict:
    ctx = gate_context(gate)
    lanes = lane_records(make_lanes(gate, ctx))
    ranges = parse_ranges(s.ranges, s.range_size, setup.cfg.num_layers)
    per = boundary_bytes(setup.cfg, setup.layout.seq_len, timestep_count(setup.layout), lanes)
    count = len(ranges)  # boundaries between ranges and one after the last stage
    require_disk(per * count, rundir, f"--stream: {count} boundaries of {per / 1e9:.2f} GB "
                 f"(S={setup.layout.seq_len}, {len(lanes)} lanes)", hint="fewer ranges (--range-size)")  # fmt: skip
    return {"settings": settings, "ranges": [list(r) for r in ranges], "lanes": lanes,
            "memory": {"boundaries": "disk", "folder": files.BOUNDARIES, "bytes_per_boundary": per,
                       "boundaries_stored": count, "total_bytes": per * count,
                       "formula": "per lane: m S H e + T H f + S (2 D f + 48); saving lanes again m S H e + T H f "
                                  "(e: 2 bf16 / 8 golden, f: 4 / 8)"}}  # fmt: skip


def _plan_of(doc: dict, setup: Run) -> StreamPlan:
    return build_plan(setup.stages, [tuple(r) for r in doc["ranges"]])


def _run_ranges(s, setup, tol, rundir: Path, plan: StreamPlan, mine: list[int], step) -> list[str]:
    """Phase 2 of the ranges ``mine`` not yet stored; their names."""
    done = []
    for r in mine:
        a, b = plan.ranges[r]
        if files.range_path(rundir, a, b).is_file():
            continue
        gate = _gate(s, setup, tol, step)
        ctx = gate_context(gate)
        body = run_range(gate, ctx, rundir, plan, r)
        body["rank"] = _distributed()[0]
        files.write_range(rundir, a, b, body)
        done.append(f"{a}:{b}")
    return done


@run_scope
def run_streamed(s: Ws1ModelCommand) -> int:
    """Dispatch on the streamed modes (module docstring)."""
    if s.merge_dir is not None:
        return _merge_only(s)
    if s.from_dir is not None:
        return _one_range(s)
    return _stream(s)


def _stored_for(rundir: Path, plan: StreamPlan, r: int, backward: bool) -> bool:
    """Whether phase 1 stored what range ``r`` reads: its start, its end and (backward) its end's gradients."""
    blocks = plan.boundaries
    need = [(blocks[r], "forward")] + ([(blocks[r - 1], "forward")] if r > 0 else [])
    if backward and r < len(plan.ranges) - 1:
        need.append((blocks[r], "backward"))
    return all(files.stored(rundir, blk, d) for blk, d in need)


def _one_range(s: Ws1ModelCommand) -> int:
    """``--layers A:B --from RUNDIR``: phase 2 of one range (no lock: ranges run side by side); verdict complete."""
    started = time.perf_counter()
    if s.run.layers is None:
        raise InputError("--from RUNDIR: needs --layers A:B (one of the run's ranges)")
    setup, tol, tol_file = _prepared(s)
    a, b = parse_layers(s.run.layers, setup.cfg)
    _require_memory(s, setup, [(a, b)], tol)
    rundir = Path(s.from_dir)
    doc = _check_plan(rundir, "--from", _settings_record(s, tol_file))
    if [a, b] not in doc["ranges"]:
        plan_ranges = ", ".join(f"{x}:{y}" for x, y in doc["ranges"])
        raise InputError(f"--layers {a}:{b}: not one of the run's ranges ({plan_ranges})")
    read_inputs(setup)
    plan = _plan_of(doc, setup)
    r = plan.index(a, b)
    if not _stored_for(rundir, plan, r, s.backward):
        raise InputError(f"--from {display(rundir)}: phase 1 has not stored the boundaries of {a}:{b} yet "
                         "(run --stream --resume RUNDIR --boundaries-only first)")  # fmt: skip
    with progress(KIND, None, started) as step:
        done = _run_ranges(s, setup, tol, rundir, plan, [r], step)
    rng = files.read_range(rundir, a, b)
    failing = sum(len(rng["findings"][d]["failing"]) for d in ("forward", "backward"))
    console = stdout_console()
    path = files.range_path(rundir, a, b)
    console.print(f"range {a}:{b}: {display(path)}" + ("" if done else " (stored before; not run again)"))
    print_verdict("complete", f"range {a}:{b} of {len(plan.ranges)} gated, {failing} failing checks in it; "
                  "--merge RUNDIR judges the run")  # fmt: skip
    return EXIT_PASS


def _stream(s: Ws1ModelCommand) -> int:
    """``--stream`` (new run or ``--resume RUNDIR``): phase 1, the ranges (over the launcher's ranks), phase 3."""
    started = time.perf_counter()
    rank, world = _distributed()
    if s.run.layers is not None:
        raise InputError("--layers with --stream: a range runs with --layers A:B --from RUNDIR (--ranges plans them)")
    device = _init_ranks(s.run.device) if world > 1 else s.run.device
    try:
        return _streamed(s, rank, world, device, started)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _streamed(s: Ws1ModelCommand, rank: int, world: int, device: str, started: float) -> int:
    setup, tol, tol_file = _prepared(s, device, out=rank == 0)
    settings = _settings_record(s, tol_file)
    ranges = parse_ranges(s.ranges, s.range_size, setup.cfg.num_layers)
    if s.resume is not None:
        ranges = [tuple(r) for r in _check_plan(Path(s.resume), "--resume", settings)["ranges"]]
    _require_memory(s, setup, ranges, tol, phase1=True)
    rundir = None
    if rank == 0:
        out = s.resume if s.resume is not None else s.out
        default = LOCAL_EVIDENCE / KIND / f"{setup.config_name}-{setup.spec.layout}"
        rundir = enter_run(out, default, s.force, reuse=s.resume is not None)
    if world > 1:
        rundir = _share_path(rundir, device)
    read_inputs(setup)
    with progress(KIND, None, started) as step:
        _phase1(s, setup, tol, rundir, settings, step, Share(rank, world, lambda: _barrier(device)))
        _barrier(device)
        doc = files.read_plan(rundir, "--stream")
        plan = _plan_of(doc, setup)
        if s.boundaries_only:
            return _boundaries_done(rank, rundir, plan)
        mine, done = list(range(rank, len(plan.ranges), world)), []
        turns, turn = _phase2_turns(setup) if world > 1 else (1, 0)
        release_cached(device)  # phase 1's cached blocks, before any rank's turn
        for t in range(turns):  # ranks sharing a device that cannot hold their gates at once take turns
            if t == turn:
                done = _run_ranges(s, setup, tol, rundir, plan, mine, step)
                release_cached(device)
            _barrier(device)
    if rank != 0:
        print(f"rank {rank}: ranges {', '.join(done) or 'none new'} gated into {display(rundir)}", flush=True)
        return EXIT_PASS
    return _merge(s, setup, tol_file, rundir, plan, started, (world, turns))


def _phase1(s, setup: Run, tol, rundir: Path, settings: dict, step, share: Share) -> None:
    """Phase 1 on every rank, each its own lanes (:class:`~h3gate.runs.model_stream.Share`); rank 0 writes the plan
    first and its phase-1 seconds after (wall seconds: every boundary waits for all ranks)."""
    gate = _gate(s, setup, tol, step)
    if share.rank == 0 and not (rundir / files.PLAN).is_file():
        files.write_plan(rundir, _new_plan(s, setup, gate, settings, rundir))
    share.barrier()
    doc = files.read_plan(rundir, "--resume")
    ctx = gate_context(gate)
    seconds = phase1(gate, ctx, rundir, _plan_of(doc, setup), step, share)
    if share.rank == 0 and ("phase1" not in doc or any(seconds.values())):
        prior = doc.get("phase1", {"forward_s": 0.0, "backward_s": 0.0, "calls": 0})
        doc["phase1"] = {k: round(prior[k] + seconds[k], 4) for k in ("forward_s", "backward_s")}
        doc["phase1"] |= {"calls": prior["calls"] + 1, "ranks": share.world}
        files.write_plan(rundir, doc)


def _boundaries_done(rank: int, rundir: Path, plan: StreamPlan) -> int:
    if rank == 0:
        print_verdict("incomplete", f"phase 1: {len(plan.boundaries)} boundaries stored in {display(rundir)}; "
                      "ranges: --layers A:B --from RUNDIR, then --merge RUNDIR")  # fmt: skip
    return EXIT_PASS


def _merge_only(s: Ws1ModelCommand) -> int:
    """``--merge RUNDIR``: phase 3 (``--partial``: of the ranges stored so far, failing as incomplete)."""
    started = time.perf_counter()
    setup, _, tol_file = _prepared(s, out=False)
    rundir = Path(s.merge_dir)
    doc = _check_plan(rundir, "--merge", _settings_record(s, tol_file))
    rundir = enter_run(rundir, rundir, reuse=True, flag="--merge")
    read_inputs(setup)
    return _merge(s, setup, tol_file, rundir, _plan_of(doc, setup), started, (None, None))


def _merge(s, setup: Run, tol_file: Path, rundir: Path, plan: StreamPlan, started: float,
           ranks: tuple[int | None, int | None]) -> int:  # fmt: skip
    """Phase 3; ``ranks``: (world size, phase 2's turns on a shared device) of the run that gated the ranges, or
    (None, None) for ``--merge``."""
    have = [i for i, (a, b) in enumerate(plan.ranges) if files.range_path(rundir, a, b).is_file()]
    missing = [f"{a}:{b}" for i, (a, b) in enumerate(plan.ranges) if i not in have]
    if missing and not s.partial:
        raise InputError(f"--merge {display(rundir)}: ranges {', '.join(missing)} not gated yet (run them with "
                         "--layers A:B --from RUNDIR, or merge what is there with --partial)")  # fmt: skip
    if not have:
        raise InputError(f"--merge {display(rundir)}: no range gated yet")
    ranges = [files.read_range(rundir, *plan.ranges[i]) for i in have]
    gate = ModelGate.of(setup, load_tol(s), s.backward)
    report = merge_ranges(gate, ranges)
    if missing:
        report["failing_checks"].append(f"stream.incomplete (ranges {', '.join(missing)} not gated)")
        report["verdict"] = "fail"
    doc = files.read_plan(rundir, "--merge")
    report["streamed"] = {
        "folder": display(rundir), "world_size": ranks[0], "device_turns": ranks[1],
        "plan": {"ranges": doc["ranges"], "memory": doc["memory"]},
        "phase1": doc.get("phase1"), "ranges_missing": missing,
        "ranges": [range_timing(r, r.get("rank")) for r in ranges],
    }  # fmt: skip
    result = ModelGateResult(report, report["verdict"], report["failing_checks"])
    body = build_body(setup, result, s.run.seed, s.tolerance, tol_file)
    body["injected_fault"] = None if s.fault is None else parse_model_fault(s.fault, setup).label()
    body["timing"]["setup_s"] = 0.0
    body["timing"]["wall_s"] = round(time.perf_counter() - started, 4)
    manifests = [*setup.manifests, tol_file]
    path = write_evidence(rundir, f"{KIND}.json", KIND, body, manifests=manifests, device=setup.device)
    if s.json:
        print(path.read_text(encoding="utf-8"), end="")
    else:
        print_summary(load_json_file(path, display(path), MAX_EVIDENCE_BYTES), path)
    return EXIT_PASS if report["verdict"] == "pass" else EXIT_FAIL


def load_tol(s: Ws1ModelCommand):
    return check_gate_args(s.run.mode, s.tolerance, None, None)[1]
