"""``run arms``: the RFC's minimum experiment arms (section 6.4) on the user's own diffusers module.

An arm ``T/R`` trains with operators ``T`` and rolls out with operators ``R`` (``P``: the pinned provider, diffusers
0.42.1 as it is; ``R``: h3gate's strict kernels through ``h3gate.strict``). Each rollout letter runs once (the arms
that share it share its states); each arm's training side then runs at every saved rollout state
(:mod:`h3gate.arms.sides`). The rollout runs on the same module or, with ``--rollout sglang``, on SGLang's DiT on
the same weights (:mod:`h3gate.arms.sglang_side`; ``--tp N``: :mod:`h3gate.arms.sglang_tp`). Per arm and step: the
rollout's velocities against the training side's, alone and in both shuffled passes, bytewise per modality, with the
drift size; the gradients of the two identical passes bitwise; under LoRA every adapter gradient finite and non-zero
and no base parameter with a gradient. The first drift of an arm is located by :func:`h3gate.arms.locate.locate`.

Verdict: ``pass`` when R/R (if run) is byte-equal at every step and composition, and every arm training with ``R``
repeats its gradients bitwise and (under LoRA) passes the LoRA gate; the P arms' results are recorded, not judged
(the provider's backward need not repeat on a GPU).

Within-run determinism (:mod:`h3gate.graph.determinism`): every evaluation by R's strict kernels on the module (the
``candidate``: its rollout, its first rollout step once more, each training step's request alone and both passes,
the checkpointed blocks' recomputation) reports to one recorder; two evaluations of a node on bit-identical inputs
that differ fail the run, naming node, pass and row. P runs diffusers' own forward and records nothing, so a run
without R compares nothing there and says so. ``--fault NODE:ROW:ulp@K[:backward]``: one ulp in the K-th such
evaluation of NODE only (the negative control).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from h3gate.arms.locate import Side, diffusers_side, locate
from h3gate.arms.sides import Rollout, State, TrainingStep, base_gradients, rollout, train_step
from h3gate.arms.stack import Stack, build_stack, require_diffusers
from h3gate.errors import InputError
from h3gate.evidence.provenance import code_sha256
from h3gate.fingerprint import canonical_sha256, config_body
from h3gate.gate.compare import bitwise_equal, error
from h3gate.gate.faults import DIRECTIONS, KINDS, RowFault
from h3gate.graph import determinism
from h3gate.graph.determinism import Injection
from h3gate.graph.model import MODEL_INPUTS, build_model_graph
from h3gate.paths import display
from h3gate.runs.block_rows import determinism_failure
from h3gate.schedule import sigma_hash

if TYPE_CHECKING:
    from h3gate.arms.sglang_side import SglangFault

KIND = "arms"
MODALITIES = ("video", "audio")
COMPOSITIONS = ("alone", "batch.pass1", "batch.pass2")


def parse_fault(spec: str, stack: Stack) -> RowFault | Injection:
    """``NODE:ROW[:scale|zero_tail][:forward|backward]`` on the whole-model graph of the module's config, or
    ``NODE:ROW:ulp@K[:backward]``: one ulp in the K-th evaluation of NODE by R's strict kernels only."""
    parts = spec.split(":")
    nodes = {n.name: n for n in build_model_graph(stack.cfg).nodes}
    if len(parts) < 2 or not parts[1].isdigit():
        raise InputError(f"--fault {spec!r}: expected NODE:ROW[:scale|zero_tail|ulp@K][:forward|backward]")
    if parts[0] not in nodes:
        raise InputError(f"--fault {spec!r}: unknown node {parts[0]!r} (e.g. block.0.o_proj, embed.pack)")
    extra = parts[2:]
    single = determinism.injection_of(spec, parts[0], int(parts[1]), extra)
    if single is not None:
        return single
    unknown = [p for p in extra if p not in KINDS and p not in DIRECTIONS]
    if unknown:
        raise InputError(f"--fault {spec!r}: {unknown[0]!r} is neither a kind ({', '.join(KINDS)}) nor a direction")
    kind = next((p for p in extra if p in KINDS), "scale")
    direction = next((p for p in extra if p in DIRECTIONS), "forward")
    return RowFault(parts[0], int(parts[1]), kind, direction)


def fault_overrides(fault: RowFault, stack: Stack) -> Callable:
    graph = build_model_graph(stack.cfg)
    node = next(n for n in graph.nodes if n.name == fault.node)
    row_dims = {**{n.name: n.row_dim for n in graph.nodes}, **dict.fromkeys(MODEL_INPUTS)}
    row_dims.update(video_rows=1, audio_rows=1, text=1)
    override = fault.override(node, row_dims)
    return lambda session: {fault.node: override}


def _velocity_records(rolled: State, step: TrainingStep, b: int) -> dict:
    """Request ``b``: the rollout's velocity against each training composition, per modality."""
    out = {}
    for j, m in enumerate(MODALITIES):
        ref = rolled[j][b : b + 1]
        got = {"alone": step.alone[b][j], "batch.pass1": step.passes[0].velocities[j][b : b + 1],
               "batch.pass2": step.passes[1].velocities[j][b : b + 1]}  # fmt: skip
        out[m] = {c: {"bitwise": bitwise_equal(t, ref), **error(t, ref)} for c, t in got.items()}
    return out


def _gradient_record(stack: Stack, step: TrainingStep) -> dict:
    g1, g2 = step.passes[0].gradients, step.passes[1].gradients
    differing = [n for n in g1 if n not in g2 or not bitwise_equal(g1[n], g2[n])]
    first = None
    if differing:
        n = differing[0]
        row = None
        if n.startswith("input.") and n in g2:
            rows = (g1[n] != g2[n]).reshape(g1[n].shape[0], g1[n].shape[1], -1).any(-1).nonzero()
            row = None if rows.numel() == 0 else {"request": int(rows[0, 0]), "modality_row": int(rows[0, 1])}
        first = {"name": n, **(error(g2[n], g1[n]) if n in g2 else {}), "row": row}
    rec = {"repeat_bitwise": not differing, "differing": len(differing), "first_differing": first,
           "finite": all(bool(torch.isfinite(g).all()) for g in g1.values()), "count": len(g1)}  # fmt: skip
    if stack.lora_names:
        zero = [n for n in stack.lora_names if n not in g1 or not bool(g1[n].abs().sum() > 0)]
        base = base_gradients(stack)
        rec["lora"] = {
            "tensors": len(stack.lora_names), "all_nonzero": not zero, "first_zero": zero[0] if zero else None,
            "base_gradients_absent": not base, "first_base_gradient": base[0] if base else None,
        }  # fmt: skip
    return rec


def run_arm(stack: Stack, arm: str, rolled: Rollout, fault: Callable | None, progress) -> dict:
    """One arm's record: every step's comparison, gradients, timing, the first drift."""
    train = arm.split("/")[0]
    steps, first, grads_ok, lora_ok, t_train = [], None, True, True, []
    targets = (rolled.final[0] - rolled.states[0][0], rolled.final[1] - rolled.states[0][1])
    for i in range(stack.evaluations):
        ts = train_step(stack, train, i, rolled.states[i], targets, fault if train == "R" else None)
        t_train.append(ts.seconds_alone + sum(p.seconds for p in ts.passes))
        requests = [_velocity_records(rolled.velocities[i], ts, b) for b in range(len(stack.requests))]
        equal = all(c["bitwise"] for r in requests for m in r.values() for c in m.values())
        grads = _gradient_record(stack, ts)
        grads_ok &= grads["repeat_bitwise"] and grads["finite"]
        if "lora" in grads:
            lora_ok &= grads["lora"]["all_nonzero"] and grads["lora"]["base_gradients_absent"]
        steps.append({
            "step": i, "byte_equal": equal, "requests": requests, "gradients": grads, "order": ts.order,
            "seconds_training": round(t_train[-1], 4), "trace_ops": ts.trace_ops,
        })  # fmt: skip
        if first is None and not equal:
            first = _locate_first(stack, arm, rolled, i, requests, ts, fault)
        if progress is not None:
            progress(f"arm {arm}: step {i} of {stack.evaluations - 1} ({'equal' if equal else 'DRIFT'})")
    return {
        "arm": arm, "training": train, "rollout": arm.split("/")[1],
        "byte_equal": all(s["byte_equal"] for s in steps),
        "first_drift_step": None if first is None else first["step"],
        "first_drift": first,
        "gradients_repeat_bitwise": grads_ok, "lora_gate": lora_ok if stack.lora_names else None,
        "drift": _drift_summary(steps),
        "seconds_per_rollout_step": round(statistics.median(rolled.seconds), 4),
        "seconds_per_training_step": round(statistics.median(t_train), 4),
        "rollout_trace_ops": rolled.trace_ops,
        "steps": steps,
    }  # fmt: skip


def _drift_summary(steps: list[dict]) -> dict:
    """Per modality: the largest max-abs and rel-l2 over steps, requests and compositions."""
    out = {}
    for m in MODALITIES:
        cells = [c for s in steps for r in s["requests"] for c in r[m].values()]
        out[m] = {
            "max_abs": max((c["max_abs"] or 0.0) for c in cells),
            "rel_l2": max((c["rel_l2"] or 0.0) for c in cells),
        }
    return out


def _locate_first(stack: Stack, arm: str, rolled: Rollout, i: int, requests: list[dict], ts, fault) -> dict:
    """The first request and composition that drifted at step ``i``, located node by node."""
    b, comp = next((b, c) for b, r in enumerate(requests) for c in COMPOSITIONS if not all(
        r[m][c]["bitwise"] for m in MODALITIES))  # fmt: skip
    train, roll = arm.split("/")
    mode = {"P": "off", "R": "strict"}
    n = len(stack.requests)
    rows = [b] if comp == "alone" else ts.order
    recorded = {"alone": ts.alone[b], "batch.pass1": _slice(ts.passes[0].velocities, b),
                "batch.pass2": _slice(ts.passes[1].velocities, b)}[comp]  # fmt: skip
    overrides = None
    if fault is not None and train == "R" and comp == "batch.pass2":
        overrides = fault(None)
    rolled_b = _slice(rolled.velocities[i], b)
    if rolled.engine is not None:
        from h3gate.arms.sglang_side import sglang_side

        rollout_side: Side = sglang_side(rolled.engine, roll, i, rolled.states[i], rolled_b)
    else:
        rollout_side = diffusers_side(stack, mode[roll], i, rolled.states[i], list(range(n)), False, None, rolled_b)
    training_side = diffusers_side(stack, mode[train], i, rolled.states[i], rows, True, overrides, recorded)
    return {"composition": comp, **locate(stack, i, b, (rollout_side, training_side))}


def _slice(pair: State, b: int) -> State:
    return pair[0][b : b + 1], pair[1][b : b + 1]


def check_fault(stack: Stack) -> RowFault | SglangFault | Injection | None:
    """``--fault`` parsed against the module's graph (InputError naming what is wrong): on R training's second pass,
    or with ``--rollout sglang`` on SGLang's rollout module; ``ulp@K``: the K-th evaluation of the node by R's
    strict kernels on the module (rollout and training, in the order they run)."""
    settings = stack.settings
    if settings.fault is None:
        return None
    fault = parse_fault(settings.fault, stack)
    if isinstance(fault, Injection):
        if settings.rollout == "sglang":
            raise InputError(f"--fault {settings.fault!r}: ulp@K injects into h3gate's executor, not SGLang's module")
        if not any("R" in a for a in settings.arms):
            raise InputError(f"--fault {settings.fault}: needs an arm with R")
        return fault
    if settings.rollout == "sglang":
        from h3gate.arms.sglang_side import sglang_fault

        return sglang_fault(fault, stack)
    if not any(a.startswith("R/") for a in settings.arms):
        raise InputError(f"--fault {settings.fault}: needs an arm that trains with R (R/P or R/R)")
    return fault


def _rollouts(stack: Stack, source, out: Path, injected, progress) -> tuple[dict[str, Rollout], dict]:
    """Each rollout letter once, on the requested engine; the rollout record."""
    letters = dict.fromkeys(a.split("/")[1] for a in stack.settings.arms)
    if stack.settings.rollout != "sglang":
        rollouts = {k: rollout(stack, k, out / f"rollout-{k}", progress) for k in letters}
        record = {"engine": "diffusers", "diffusers": require_diffusers().__version__}
    elif stack.settings.tp * stack.settings.ulysses > 1:
        from h3gate.arms.sglang_tp import tp_rollouts

        rollouts, record = tp_rollouts(stack, source, out, list(letters), injected, progress)
    else:
        from h3gate.arms.sglang_side import SglangEngine, build_sglang

        build_sglang(stack, source)
        engine = SglangEngine(stack, injected)
        rollouts = {k: rollout(stack, k, out / f"rollout-{k}", progress, engine) for k in letters}
        record = engine.record()
    s = stack.settings
    return rollouts, {**record, "merge_order": s.merge, "tp": s.tp, **({"ulysses": s.ulysses} if s.ulysses > 1 else {})}


def run_arms(stack: Stack, source, out: Path, progress: Callable[[str], None] | None = None) -> dict:
    """Every requested arm (module docstring); the ``arms`` evidence body. ``out`` holds the rollout step files."""
    settings = stack.settings
    injected = check_fault(stack)
    build_stack(stack, source)
    fault = fault_overrides(injected, stack) if isinstance(injected, RowFault) else None
    single = injected if isinstance(injected, Injection) else None
    recorder = determinism.Recorder()  # R's strict table is the candidate (arms.sides.bound names it)
    injecting = determinism.injecting(single) if single is not None else contextlib.nullcontext()
    with determinism.recording(recorder), injecting as state:
        rollouts, rollout_record = _rollouts(stack, source, out, None if single else injected, progress)
        arms = [run_arm(stack, arm, rollouts[arm.split("/")[1]], fault, progress) for arm in settings.arms]
    failing = []
    for rec in arms:
        if rec["arm"] == "R/R" and not rec["byte_equal"]:
            failing.append(f"R/R.byte_equal (first drift at step {rec['first_drift_step']})")
        if rec["training"] == "R" and not rec["gradients_repeat_bitwise"]:
            failing.append(f"{rec['arm']}.gradients_repeat_bitwise")
        if rec["training"] == "R" and rec["lora_gate"] is False:
            failing.append(f"{rec['arm']}.lora_gate")
    modalities = stack.layout.row_modalities()
    failing += [determinism_failure(m, modalities) for m in recorder.failing()]
    return {"run": _run_record(stack, out), "rollout": rollout_record, "arms": arms,
            "determinism": recorder.record(), **({"injected": state.describe()} if single is not None else {}),
            "verdict": "fail" if failing else "pass", "failing_checks": failing}  # fmt: skip


def _run_record(stack: Stack, out: Path) -> dict:
    s = stack.settings
    video, audio = stack.recipe.schedules()
    return {
        "code_sha256": code_sha256(),
        "config": {
            "name": stack.config_name,
            "sha256": canonical_sha256(config_body(stack.cfg)),
            "num_layers": stack.cfg.num_layers,
        },  # fmt: skip
        "weights": {k: (str(v) if isinstance(v, Path) else v) for k, v in stack.weights.items()},
        "layout": {"name": stack.layout.name, "seq_len": stack.layout.seq_len},
        "schedule": {
            "steps": s.steps,
            "evaluations": stack.evaluations,
            "video_shift": s.shift,
            "audio_shift": stack.recipe.audio_shift,
            "video_sigma_sha256": sigma_hash(video),
            "audio_sigma_sha256": sigma_hash(audio),
        },  # fmt: skip
        "batch": s.batch,
        "seed": s.seed,
        "device": s.device,
        "training": {
            "mode": "lora" if s.lora_rank else "full",
            "lora_rank": s.lora_rank,
            "trainable_tensors": len(stack.trainable),
            "gradient_checkpointing": True,
            "loss": "sum_b sum_m mean((v - (x_final - x_initial))^2), float32",
        },  # fmt: skip
        "injected_fault": s.fault,
        "rollout_steps": {
            letter: display(out / f"rollout-{letter}") for letter in dict.fromkeys(a.split("/")[1] for a in s.arms)
        },  # fmt: skip
    }
