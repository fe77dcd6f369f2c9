"""``run ws1-trajectory``: the dual-scheduler trajectory (:mod:`h3gate.trajectory`) one model evaluation at a time,
each step saved to disk (:mod:`h3gate.runs.trajectory_files`) so that a run stops, resumes and verifies.

Step ``i``: the model on the latents ``(x_i, a_i)`` at the step's row timestep plan gives ``(v_i, u_i)``; then each
modality's own Euler update on its generated rows (condition rows held):
``x_{i+1} = r x_i + (1 - r)(x_i + (1 - t_i) v_i)``, ``r = sigma_{i+1} / sigma_i``, at float32 (``euler_step``).
The step file holds ``x_i``, ``a_i``, ``v_i``, ``u_i`` (and, under ``--batch-with``, the unrelated request's
latents); the next step's inputs are what those imply, which ``--resume`` checks for every saved step before it
continues. Under ``--batch-with SEED`` every evaluation is a batch of two: the unrelated request (drawn from SEED)
first, the logical one second; both advance. The operators are bound once in ``--merge-order`` (``single`` or
``seg8``: each operator with a declared ``_seg8`` twin runs the twin, :mod:`h3gate.ops.registry`); the order is a
manifest field (a resume in the other order is refused) and the evidence lists every operator's binding.

Within-run determinism (:mod:`h3gate.graph.determinism`): every model evaluation of an invocation reports its node
evaluations to one recorder (the strict table is the ``candidate``); the invocation's first evaluation (the verified
step, else the first step it saves) runs twice, so every node has a pair. A candidate mismatch fails the invocation
naming node, pass (``step K``, ``step K repeat``, ``verify-last step K``) and row. An invocation that evaluates
nothing compares nothing and says so (verdict ``complete`` / ``incomplete``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from h3gate.errors import InputError
from h3gate.evidence.provenance import code_sha256
from h3gate.fingerprint import canonical_sha256, config_body
from h3gate.gate.compare import bitwise_equal
from h3gate.graph import determinism
from h3gate.graph.core import OpTable
from h3gate.graph.model import OUTPUTS, derive_metadata, raw_metadata
from h3gate.graph.stages import forward_stages, stage_params
from h3gate.memory import require, require_disk, require_steps
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.paths import display
from h3gate.runs.block_rows import determinism_failure
from h3gate.runs.model_memory import record_host_bytes
from h3gate.runs.setup import ModelNeeds, Run, RunSpec, prepare
from h3gate.runs.trajectory_files import (
    MANIFEST,
    STEPS,
    complete_steps,
    differing_field,
    load_step,
    read_manifest,
    write_manifest,
    write_step,
)
from h3gate.schedule import AUDIO_SHIFT, VIDEO_SHIFT, sigma_hash
from h3gate.trajectory import Recipe, Request, initial_latents, make_request, row_timestep_plan

State = tuple[torch.Tensor, torch.Tensor]  # (video latents (Nv, C), audio latents (Na, Ca)), float32 rows
ProgressFn = Callable[[str], None]
KIND = "ws1-trajectory"


@dataclass(frozen=True)
class TrajectorySettings:
    layout: str = "micro"
    config: str | None = None
    checkpoint: Path | None = None
    device: str = "cpu"
    mode: str = "strict"
    merge: str = DEFAULT_MERGE_ORDER
    steps: int = 6
    shift: float = VIDEO_SHIFT
    seed: int = 0
    batch_with: int | None = None


@dataclass
class Trajectory:
    """A prepared run: the model (weights on the device), the sampler and the request(s)."""

    settings: TrajectorySettings
    setup: Run
    params: dict[str, torch.Tensor]
    table: OpTable
    recipe: Recipe
    plan: list[tuple[torch.Tensor, torch.Tensor]]
    request: Request
    other: Request | None
    repeated: bool = False  # the invocation's first evaluation ran twice (its determinism pair)

    @property
    def evaluations(self) -> int:
        return len(self.plan)


def prepare_trajectory(settings: TrajectorySettings) -> Trajectory:
    """Check everything (InputError before any weight is read), bind, then load the weights onto the device."""
    if settings.steps < 2:
        raise InputError(f"--steps {settings.steps}: must be at least 2 (grid points; steps - 1 evaluations)")
    require_steps(settings.steps)
    if not settings.shift > 0:
        raise InputError(f"--shift {settings.shift}: must be positive")
    checkpoint = None if settings.checkpoint is None else str(settings.checkpoint)
    spec = RunSpec("model", settings.layout, settings.config, checkpoint, settings.device, settings.seed,
                   settings.mode, merge=settings.merge, draw="device")  # fmt: skip
    batch = 1 if settings.batch_with is None else 2
    setup = prepare(spec, ModelNeeds(lanes=2, backward=False, evaluation_batch=batch))
    recipe = Recipe(steps=settings.steps, video_shift=settings.shift, audio_shift=AUDIO_SHIFT)
    video, audio = recipe.schedules()
    plan = row_timestep_plan(setup.layout, recipe, video, audio)
    if not plan:
        raise InputError(f"--steps {settings.steps} --shift {settings.shift}: the grids give no model evaluation")
    table = setup.tables()["candidate"]
    params: dict[str, torch.Tensor] = {}  # read on the first evaluation, after every check
    device = setup.device
    request = make_request(setup.layout, setup.cfg, settings.seed, 0, device)
    other = (
        None if settings.batch_with is None else make_request(setup.layout, setup.cfg, settings.batch_with, 0, device)
    )
    return Trajectory(settings, setup, params, table, recipe, plan, request, other)


def manifest_fields(run: Trajectory) -> dict:
    """What ties a RUNDIR to one run: resuming with any field different is refused, naming it."""
    s, setup = run.settings, run.setup
    video, audio = run.recipe.schedules()
    return {
        "code_sha256": code_sha256(),
        "config": {"name": setup.config_name, "sha256": canonical_sha256(config_body(setup.cfg))},
        "weights": {k: (str(v) if isinstance(v, Path) else v) for k, v in setup.checkpoint.items()},
        "layout": {
            "name": setup.layout.name,
            "seq_len": setup.layout.seq_len,
            "tensor_sha256": setup.layout.tensor_hashes(),
        },  # fmt: skip
        "schedule": {
            "steps": s.steps,
            "evaluations": run.evaluations,
            "video_shift": s.shift,
            "audio_shift": AUDIO_SHIFT,
            "video_sigma_sha256": sigma_hash(video),
            "audio_sigma_sha256": sigma_hash(audio),
            "video_sigmas": [float(x) for x in video.sigmas.tolist()],
            "audio_sigmas": [float(x) for x in audio.sigmas.tolist()],
        },  # fmt: skip
        "seed": s.seed,
        "mode": s.mode,
        "merge_order": s.merge,
        "device_kind": "cuda" if setup.device.startswith("cuda") else "cpu",
        "batch": {
            "with_seed": s.batch_with,
            "size": 1 if s.batch_with is None else 2,
            "position": 0 if s.batch_with is None else 1,
        },  # fmt: skip
    }


def initial_state(run: Trajectory, request: Request) -> State:
    _, video, audio = initial_latents(request, run.recipe)
    return video, audio


def evaluate(run: Trajectory, step: int, state: State, other: State | None) -> tuple[State, State | None]:
    """The model at ``step`` on the logical state (second of two beside ``other`` under --batch-with):
    ``((v, u), (v', u') or None)``, velocities as rows ``(N, C)``."""
    setup = run.setup
    if not run.params:
        run.params.update(
            {n: setup.weights.source.load(n, setup.device, check_finite=True) for n in setup.weights.names}
        )
    timestep, indices = run.plan[step]
    meta = derive_metadata(raw_metadata(setup.layout, timestep, indices), setup.cfg, setup.device)
    items = [(state, run.request)] if other is None else [(other, run.other), (state, run.request)]
    values = {
        "video_rows": torch.stack([s[0] for s, _ in items]),
        "audio_rows": torch.stack([s[1] for s, _ in items]),
        "text": torch.cat([r.text for _, r in items]),
        **meta,
    }
    with torch.no_grad():
        outputs = forward_stages(setup.stages, values, stage_params(setup.stages, run.params), run.table)
    v, u = outputs[OUTPUTS[0]], outputs[OUTPUTS[1]]
    mine = (v[-1], u[-1])
    return mine, (None if other is None else (v[0], u[0]))


def evaluate_recorded(run: Trajectory, step: int, state: State, other: State | None, label: str):
    """:func:`evaluate` labelled ``label`` for the determinism record; under a recorder the first evaluation of the
    invocation runs a second time (its pair)."""
    with determinism.evaluation(label):
        out = evaluate(run, step, state, other)
        if not run.repeated and determinism.active() is not None:
            run.repeated = True
            with determinism.again():
                evaluate(run, step, state, other)
    return out


def euler(run: Trajectory, step: int, state: State, velocity: State) -> State:
    """Both modalities' Euler updates on their generated rows (condition rows held)."""
    video, audio = run.recipe.schedules()
    vt, at = run.recipe.timesteps_of(video), run.recipe.timesteps_of(audio)
    nc, nca = run.setup.layout.num_condition_video_rows, run.setup.layout.num_condition_audio_rows
    x, a = state[0].clone(), state[1].clone()
    x[nc:] = run.recipe.euler(velocity[0][nc:].float(), vt[step], x[nc:], video.sigmas[step], video.sigmas[step + 1])
    a[nca:] = run.recipe.euler(velocity[1][nca:].float(), at[step], a[nca:], audio.sigmas[step], audio.sigmas[step + 1])
    return x, a


def step_tensors(state: State, velocity: State, other: State | None, other_velocity: State | None) -> dict:
    out = {"video_latents": state[0], "audio_latents": state[1], "video_velocity": velocity[0],
           "audio_velocity": velocity[1]}  # fmt: skip
    if other is not None and other_velocity is not None:
        out.update({"batch.video_latents": other[0], "batch.audio_latents": other[1],
                    "batch.video_velocity": other_velocity[0], "batch.audio_velocity": other_velocity[1]})  # fmt: skip
    return out


@dataclass
class Resumed:
    """What the saved steps imply: the next step, the state fed to it, the unrelated request's, and the last
    saved step's tensors (for --verify-last)."""

    next_step: int
    state: State
    other: State | None
    last: dict[str, torch.Tensor] | None


def _pair(tensors: dict[str, torch.Tensor], prefix: str, what: str, device: str) -> State:
    return tensors[f"{prefix}video_{what}"].to(device), tensors[f"{prefix}audio_{what}"].to(device)


def _same(a: State, b: State) -> bool:
    return bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


def replay_saved(run: Trajectory, rundir: Path, steps: list[int]) -> Resumed:
    """Check every saved step (digests; its inputs equal what the previous step implies, step 0's the initial
    latents; the unrelated request's likewise) and return the state after the last one. A mismatch is an
    InputError naming the file."""
    device = run.setup.device
    state = initial_state(run, run.request)
    other = None if run.other is None else initial_state(run, run.other)
    last = None
    for k in steps:
        tensors, record = load_step(rundir, k)
        if not _same(_pair(tensors, "", "latents", device), state):
            implied = "the run's initial latents" if k == 0 else f"what step {k - 1} implies"
            raise InputError(f"{record['file']}: its input latents are not {implied}")
        state = euler(run, k, state, _pair(tensors, "", "velocity", device))
        if other is not None:
            if "batch.video_latents" not in tensors:
                raise InputError(f"{record['file']}: no batch.* tensors (made without --batch-with)")
            if not _same(_pair(tensors, "batch.", "latents", device), other):
                implied = "its initial latents" if k == 0 else f"what step {k - 1} implies"
                raise InputError(f"{record['file']}: the unrelated request's latents are not {implied}")
            other = euler(run, k, other, _pair(tensors, "batch.", "velocity", device))
        last = tensors
    return Resumed(len(steps), state, other, last)


def verify_last(run: Trajectory, rundir: Path, resumed: Resumed) -> dict | None:
    """Recompute the last saved step from its saved inputs; its velocities must be bitwise the saved ones."""
    if resumed.last is None:
        return None
    k = resumed.next_step - 1
    device = run.setup.device
    saved = resumed.last
    other = None if run.other is None else _pair(saved, "batch.", "latents", device)
    mine, _ = evaluate_recorded(run, k, _pair(saved, "", "latents", device), other, f"verify-last step {k}")
    want = _pair(saved, "", "velocity", device)
    per = {m: bitwise_equal(mine[j], want[j]) for j, m in enumerate(("video", "audio"))}
    return {"step": k, "bitwise": all(per.values()), "per_modality": per}


def advance(
    run: Trajectory, rundir: Path, resumed: Resumed, until: int | None, progress: ProgressFn | None = None
) -> list[dict]:
    """Evaluate steps ``resumed.next_step .. until`` (default: to the end), writing each step as it completes."""
    last = run.evaluations - 1 if until is None else min(until, run.evaluations - 1)
    state, other = resumed.state, resumed.other
    done: list[dict] = []
    started = time.perf_counter()
    for k in range(resumed.next_step, last + 1):
        t0 = time.perf_counter()
        mine, theirs = evaluate_recorded(run, k, state, other, f"step {k}")
        seconds = time.perf_counter() - t0
        record = {"seconds": round(seconds, 4), "device": run.setup.device, "mode": run.settings.mode}
        write_step(rundir, k, step_tensors(state, mine, other, theirs), record)
        done.append({"step": k, "seconds": round(seconds, 4)})
        state = euler(run, k, state, mine)
        if other is not None and theirs is not None:
            other = euler(run, k, other, theirs)
        if progress is not None:
            elapsed = time.perf_counter() - started
            eta = elapsed / len(done) * (last - k)
            progress(f"step {k} of {run.evaluations - 1} saved ({seconds:.1f} s; about {eta:.0f} s to step {last})")
    return done


def _value_at(fields: dict, dotted: str):
    value = fields
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


STEP_FILE_OVERHEAD = 64 * 1024  # a step's safetensors header and its JSON sidecar, at most


def step_file_bytes(run: Trajectory) -> int:
    """Bytes one saved step writes: latents and velocity of both modalities (float32 rows), twice with
    ``--batch-with``, plus :data:`STEP_FILE_OVERHEAD`."""
    video, audio = initial_state(run, run.request)
    rows = 2 * (video.numel() * video.element_size() + audio.numel() * audio.element_size())
    return rows * (2 if run.other is not None else 1) + STEP_FILE_OVERHEAD


def check_run_range(run: Trajectory, rundir: Path, until: int | None, advancing: bool = True) -> None:
    """``--until`` inside the run's steps; the free disk under RUNDIR for every step still to write; the host memory
    the determinism record keeps for this invocation's evaluations (the steps it runs, none when ``advancing`` is off
    (``--verify-last`` alone), and one more: a repeat pairs, a ``--verify-last`` evaluates;
    :func:`~h3gate.runs.model_memory.record_host_bytes`)."""
    last = run.evaluations - 1
    if until is not None and not 0 <= until <= last:
        raise InputError(f"--until {until}: outside the run's steps 0 .. {last} (--steps {run.settings.steps})")
    todo = max((last if until is None else until) + 1 - len(complete_steps(rundir)), 0)
    require_disk(todo * step_file_bytes(run), rundir, f"--steps {run.settings.steps} ({todo} step files)",
                 hint="ask for fewer steps or free the disk")  # fmt: skip
    evaluations = (todo if advancing else 0) + 1
    record = evaluations * record_host_bytes(run.setup.cfg, run.setup.layout.seq_len)
    require(record, f"--steps {run.settings.steps}: the determinism record of {evaluations} evaluations", "cpu",
            hint="stop earlier with --until and resume")  # fmt: skip


def open_rundir(run: Trajectory, rundir: Path, reuse: bool, flag: str = "--resume") -> dict:
    """A new RUNDIR gets the manifest; a reused one (--resume, --verify-last) must hold the same run."""
    fields = manifest_fields(run)
    if not reuse:
        if (rundir / MANIFEST).exists() or (rundir / STEPS).exists():
            raise InputError(f"--out {display(rundir)}: holds a trajectory run already; continue it with --resume")
        write_manifest(rundir, fields)
        return fields
    saved = read_manifest(rundir, flag)["run"]
    diff = differing_field(saved, fields)
    if diff is not None:
        raise InputError(
            f"{flag} {display(rundir)}: {diff} differs from the saved run (saved {_value_at(saved, diff)!r}, "
            f"now {_value_at(fields, diff)!r})"
        )
    return fields


def run_ws1_trajectory(
    run: Trajectory,
    rundir: Path,
    until: int | None = None,
    resume: bool = False,
    check_last: bool = False,
    progress: ProgressFn | None = None,
) -> dict:
    """Start, resume or verify the prepared run (:func:`prepare_trajectory`) in ``rundir``; the ``ws1-trajectory``
    evidence body of this invocation."""
    started = time.perf_counter()
    check_run_range(run, rundir, until, advancing=resume or not check_last)
    fields = open_rundir(run, rundir, resume or check_last, "--resume" if resume else "--verify-last")
    steps = complete_steps(rundir)
    recorder = determinism.Recorder()
    recorder.role(run.table, "candidate")
    with determinism.recording(recorder):
        resumed = replay_saved(run, rundir, steps)
        checked = verify_last(run, rundir, resumed) if check_last else None
        done = advance(run, rundir, resumed, until, progress) if (resume or not check_last) else []
    saved = len(steps) + len(done)
    failing = [] if checked is None or checked["bitwise"] else [f"verify_last.step_{checked['step']}.bitwise"]
    modalities = run.setup.layout.row_modalities()
    failing += [determinism_failure(m, modalities) for m in recorder.failing()]
    record = recorder.record()
    compared = checked is not None or any(record["pairs"].values())
    return {
        "run": fields,
        "evaluations": run.evaluations,
        "steps_saved": saved,
        "complete": saved == run.evaluations,
        "invocation": {
            "resumed_from": resumed.next_step if (resume or check_last) else None,
            "until": until,
            "steps": done,
            "verify_last": checked,
            "seconds": round(time.perf_counter() - started, 4),
            "seconds_per_step": None if not done else round(sum(d["seconds"] for d in done) / len(done), 4),
        },
        "determinism": record,
        "bindings": operator_bindings(run),
        "verdict": verdict(failing, compared, saved == run.evaluations),
        "failing_checks": failing,
    }


def operator_bindings(run: Trajectory) -> dict[str, dict]:
    """What every operator of the model ran, once per operator (a merge order's twin named by ``bound``)."""
    per_op = {b.op: b.record() for nb in run.setup.bindings.values() for b in nb.bindings}
    return dict(sorted(per_op.items()))


def verdict(failing: list[str], compared: bool, complete: bool) -> str:
    """``fail`` / ``pass`` where something was compared (``--verify-last``, a determinism pair); else ``complete`` /
    ``incomplete`` by the steps saved."""
    if failing:
        return "fail"
    if compared:
        return "pass"
    return "complete" if complete else "incomplete"
