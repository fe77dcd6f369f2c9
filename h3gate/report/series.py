"""Plain series for the step, arms, operator, ablation and benchmark figures; nothing here plots (see ``extract``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STEP_SERIES = ("video_velocity", "audio_velocity", "video_latents", "audio_latents")
PROBES = ("repeat", "batch", "mutation", "prefix")


@dataclass
class StepDrift:
    """trajectory-compare: rel_l2 per step of each series (0.0 where bitwise), and the first drift it names."""

    steps: list[int]
    series: dict[str, list[float | None]]
    first_step: int | None
    first_drift: dict | None
    run_a: str
    run_b: str


def _run_name(run: dict) -> str:
    r = run.get("run") or {}
    batch = r.get("batch") or {}
    text = f"mode {r.get('mode')}"
    if batch.get("with_seed") is not None:
        text += f", batched with seed {batch['with_seed']} (size {batch.get('size')}, position {batch.get('position')})"
    return text


def step_drift(doc: dict) -> StepDrift:
    steps = doc.get("steps") or []
    series = {
        name: [(s.get(name) or {}).get("rel_l2") if isinstance(s.get(name), dict) else None for s in steps]
        for name in STEP_SERIES
    }
    runs = doc.get("runs") or {}
    return StepDrift(
        [int(s.get("step", i)) for i, s in enumerate(steps)],
        series,
        doc.get("first_drift_step"),
        doc.get("first_drift"),
        _run_name(runs.get("a") or {}),
        _run_name(runs.get("b") or {}),
    )


@dataclass
class OpError:
    """One operator's worst case (over layouts, and over gradient arguments backward): errors against the golden."""

    op: str
    direction: str
    layout: str
    kernel: float | None
    provider: float | None
    bound: float | None


def _error_case(op: str, direction: str, layout: str, rec: dict) -> OpError:
    kernel = (rec.get("kernel_vs_golden") or {}).get("rel_l2")
    provider = (rec.get("provider_vs_golden") or {}).get("rel_l2")
    return OpError(op, direction, layout, kernel, provider, rec.get("bound_rel_l2"))


def _badness(case: OpError) -> float:
    if case.kernel is None or not case.bound:
        return -1.0
    return case.kernel / case.bound


def op_errors(doc: dict) -> list[OpError]:
    """ws1-ops: forward and backward worst error-to-bound case of each operator."""
    found: list[OpError] = []
    for op in doc.get("operators") or []:
        name = str(op.get("op"))
        fwd: list[OpError] = []
        bwd: list[OpError] = []
        for r in op.get("results") or []:
            layout = str(r.get("layout"))
            if isinstance(r.get("forward"), dict):
                fwd.append(_error_case(name, "forward", layout, r["forward"]))
            for g in r.get("backward") or []:
                if isinstance(g, dict) and not g.get("missing"):
                    bwd.append(_error_case(name, f"backward (arg {g.get('arg')})", layout, g))
        found += [max(cases, key=_badness) for cases in (fwd, bwd) if cases]
    return found


@dataclass
class ProbeGrid:
    """ws1-ops invariance probes per operator, over every layout: True all bitwise, False any not, None none run."""

    ops: list[str]
    probes: list[str]
    cells: dict[tuple[str, str], bool | None]
    counts: dict[tuple[str, str], int]


def _probe_results(inv: dict) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = {}
    for probe in PROBES:
        value = inv.get(probe)
        records = value if isinstance(value, list) else ([value] if isinstance(value, dict) else [])
        for rec in records:
            for direction in ("forward", "backward"):
                if isinstance(rec.get(direction), bool):
                    out.setdefault(f"{probe} {direction[:3]}", []).append(rec[direction])
    return out


def probe_grid(doc: dict) -> ProbeGrid:
    probes = [f"{p} {d}" for p in PROBES for d in ("for", "bac")]
    cells: dict[tuple[str, str], bool | None] = {}
    counts: dict[tuple[str, str], int] = {}
    ops: list[str] = []
    for op in doc.get("operators") or []:
        name = str(op.get("op"))
        ops.append(name)
        merged: dict[str, list[bool]] = {}
        for r in op.get("results") or []:
            for key, values in _probe_results(r.get("invariance") or {}).items():
                merged.setdefault(key, []).extend(values)
        for probe in probes:
            values = merged.get(probe, [])
            cells[(name, probe)] = all(values) if values else None
            counts[(name, probe)] = len(values)
    labels = [p.replace(" for", " fwd").replace(" bac", " bwd") for p in probes]
    cells = {(o, labels[probes.index(p)]): v for (o, p), v in cells.items()}
    counts = {(o, labels[probes.index(p)]): v for (o, p), v in counts.items()}
    used = [lab for lab in labels if any(counts[(o, lab)] for o in ops)]
    return ProbeGrid(ops, used, cells, counts)


@dataclass
class AblationRow:
    """One ablation row: what was expected and what was observed, with each first-drift signature in words."""

    id: str
    factor: str
    run: str
    expected: str
    observed: str
    verdict: str
    expected_signature: str
    observed_signature: str
    reason: str | None


def signature_text(sig: Any) -> str:
    """``node, layer L, step S, row R (modality)`` of an ablation signature; ``-`` for none."""
    if not isinstance(sig, dict):
        return "-"
    parts = [str(sig.get("node"))]
    parts += [f"layer {sig['layer']}"] if sig.get("layer") is not None else []
    parts += [f"step {sig['step']}"] if sig.get("step") is not None else []
    row = f"row {sig['row']}" if sig.get("row") is not None else ""
    if row and sig.get("modality"):
        row += f" ({sig['modality']})"
    elif sig.get("modality"):
        row = f"modality {sig['modality']}"
    return ", ".join(parts + ([row] if row else []))


def ablation_rows(doc: dict) -> list[AblationRow]:
    rows = []
    for r in doc.get("rows") or []:
        exp, obs = r.get("expected") or {}, r.get("observed") or {}
        rows.append(
            AblationRow(
                str(r.get("id")),
                str(r.get("factor", "")),
                str(r.get("run", "")),
                str(exp.get("result")),
                str(obs.get("result")),
                str(r.get("verdict")),
                signature_text(exp.get("signature")),
                signature_text(obs.get("signature")),
                obs.get("reason"),
            )
        )
    return rows


@dataclass
class SpeedBar:
    """One timed case: speed relative to its baseline (baseline time / strict time; > 1 is faster) and the target."""

    label: str
    ratio: float | None
    target: float | None
    target_kind: str  # "declared target", "not slower (noise)", or "no target recorded"
    baseline: str
    passed: bool | None


def op_speeds(doc: dict) -> list[SpeedBar]:
    """bench (ops): each operator's forward ratio against its declared target, else the not-slower criterion; then
    what the record holds beside it, ungated: the forward against the provider when the target's baseline is another,
    and the backward alone against the provider and the declared baseline."""
    noise = (doc.get("criteria") or {}).get("not_slower_noise")
    bars = []
    for op in doc.get("operators") or []:
        name, target = str(op.get("op")), op.get("target")
        fwd = op.get("forward") or {}
        verdict = op.get("verdict")
        passed = None if verdict is None else verdict == "pass"
        if isinstance(target, dict):
            baseline = str(target.get("baseline"))
            bars.append(
                SpeedBar(name, target.get("ratio"), target.get("min_ratio"), "declared target", baseline, passed)
            )
            if baseline != "provider":
                bars.append(SpeedBar(f"{name} forward", fwd.get("speedup"), None, "recorded", "provider", None))
        else:
            floor = None if noise is None else 1.0 - float(noise)
            bars.append(SpeedBar(name, fwd.get("speedup"), floor, "not slower", "provider", passed))
            baseline = "provider"
        bwd = op.get("backward") or {}
        if bwd.get("speedup") is not None:
            bars.append(SpeedBar(f"{name} backward", bwd["speedup"], None, "recorded", "provider", None))
        if bwd.get("baseline_speedup") is not None:
            bars.append(SpeedBar(f"{name} backward", bwd["baseline_speedup"], None, "recorded", baseline, None))
    return bars


@dataclass
class GateSpeeds:
    """bench-ws1-block / bench-ws1-model: forward and forward + backward of one record."""

    label: str
    bars: list[SpeedBar] = field(default_factory=list)


def gate_speeds(doc: dict, label: str) -> GateSpeeds:
    out = GateSpeeds(label)
    for phase in ("forward", "forward_backward"):
        res = (doc.get("results") or {}).get(phase)
        if not isinstance(res, dict):
            continue
        over = res.get("strict_over_provider")
        ratio = 1.0 / over if isinstance(over, int | float) and over > 0 else None
        name = phase.replace("_", " + ")
        out.bars.append(SpeedBar(name, ratio, None, "no target recorded", "provider", None))
    return out


@dataclass
class NodeTimes:
    """bench-ws1-block's ``forward_nodes``: per node (graph order) the provider's and the strict median ms, with the
    sums of each arm."""

    label: str
    nodes: list[str]
    provider: list[float]
    strict: list[float]
    provider_sum: float
    strict_sum: float


def node_times(doc: dict, label: str) -> NodeTimes | None:
    """The record's forward node by node, or None where it has none (records made before it was recorded)."""
    arms = (doc.get("forward_nodes") or {}).get("arms") or {}
    prov, strict = arms.get("provider") or {}, arms.get("strict") or {}
    names = list(strict.get("nodes") or {})
    if not names or set(names) != set(prov.get("nodes") or {}):
        return None
    return NodeTimes(
        label,
        names,
        [float(prov["nodes"][n]) for n in names],
        [float(strict["nodes"][n]) for n in names],
        float(prov.get("sum_ms") or 0.0),
        float(strict.get("sum_ms") or 0.0),
    )


def sustained_text(doc: dict) -> str | None:
    """The record's forward at the power cap (``sustained``, where recorded) as one line: each arm's ms a forward and
    their ratio, with joules and watts where the energy counter answered, and the nodes whose loop was host-bound;
    None without it."""
    steady = doc.get("sustained") or {}
    arms = (steady.get("forward") or {}).get("arms") or {}
    strict, prov = arms.get("strict"), arms.get("provider")
    if not strict or not prov:
        return None
    text = (
        f"each arm back to back at the board's steady state: strict {strict['ms_per_call']:.3f} ms, provider "
        f"{prov['ms_per_call']:.3f} ms a forward ({strict['ms_per_call'] / prov['ms_per_call']:.3f}x)"
    )
    if "j_per_call" in strict and "j_per_call" in prov:
        text += (
            f"; {strict['j_per_call']:.4g} / {prov['j_per_call']:.4g} J "
            f"({strict['j_per_call'] / prov['j_per_call']:.3f}x) at {strict['mean_w']:.0f} / {prov['mean_w']:.0f} W"
        )
    nodes = (steady.get("forward_nodes") or {}).get("nodes") or {}
    bound = [name for name, rec in nodes.items() if any(a.get("host_bound") for a in rec["arms"].values())]
    if bound:
        text += f"; looped alone, the host was the limit for {', '.join(bound)}"
    return text


COMPOSITIONS = ("alone", "batch.pass1", "batch.pass2")
OPERATORS = {"P": "diffusers", "R": "h3gate.strict"}


@dataclass
class ArmDrift:
    """arms: one arm's velocity drift per denoising step and modality (the training side against the rollout), the
    worst rel_l2 over requests and compositions: 0.0 where every one is byte-equal, None where the bits differ but
    no rel_l2 is recorded (``differs`` says which steps differ at all), with the arm's first drift and gates."""

    arm: str
    training: str
    rollout: str
    steps: list[int]
    series: dict[str, list[float | None]]
    differs: dict[str, list[bool]]
    byte_equal: bool | None
    first_step: int | None
    first_drift: dict | None
    gradients: str
    lora_gate: str
    seconds_rollout: float | None
    seconds_training: float | None


def drift_text(where: dict | None) -> str:
    """``step S, COMPOSITION (request B): NODE, packed row R (MODALITY)`` of an arm's first drift; ``none``."""
    if not isinstance(where, dict):
        return "none"
    text = f"step {where.get('step')}, {where.get('composition')}"
    text += f" (request {where['request']})" if where.get("request") is not None else ""
    text += f": {where['node']}" if where.get("node") else ": node not located"
    text += f", packed row {where['row']}" if where.get("row") is not None else ""
    text += f" ({where['modality']})" if where.get("modality") else ""
    faithful = where.get("replay_faithful") or {}
    if any(v is False for v in faithful.values()):
        text += " [replay not faithful: location unconfirmed]"
    return text


def _worst_cell(requests: list[dict], modality: str) -> tuple[float | None, bool]:
    """(worst rel_l2 over requests and compositions, any bits differ) of one step and modality."""
    cells = [c for r in requests for c in ((r.get(modality) or {}).values()) if isinstance(c, dict)]
    if not cells:
        return None, False
    drifting = [c for c in cells if not c.get("bitwise")]
    if not drifting:
        return 0.0, False
    values = [c["rel_l2"] for c in drifting if isinstance(c.get("rel_l2"), int | float)]
    return (max(values) if values else None), True


def _gradients_text(arm: dict) -> str:
    repeat = arm.get("gradients_repeat_bitwise")
    if repeat is None:
        return "-"
    if repeat:
        return "yes"
    for s in arm.get("steps") or []:
        g = s.get("gradients") or {}
        if not g.get("repeat_bitwise", True):
            return f"no (step {s.get('step')}: {g.get('differing')} of {g.get('count')} tensors differ)"
        if g.get("finite") is False:
            return f"no (step {s.get('step')}: a gradient is not finite)"
    return "no"


def _lora_text(value: Any) -> str:
    if value is None:
        return "- (no LoRA: full training)"
    return "ok" if value is True else "FAIL"


def arm_drifts(doc: dict) -> list[ArmDrift]:
    """arms: each arm's drift per step and modality (modalities in the order the records name them)."""
    found = []
    for arm in doc.get("arms") or []:
        steps = arm.get("steps") or []
        modalities = list(dict.fromkeys(m for s in steps for r in s.get("requests") or [] for m in r))
        series: dict[str, list[float | None]] = {m: [] for m in modalities}
        differs: dict[str, list[bool]] = {m: [] for m in modalities}
        for s in steps:
            for m in modalities:
                value, differ = _worst_cell(s.get("requests") or [], m)
                series[m].append(value)
                differs[m].append(differ)
        name = str(arm.get("arm"))
        found.append(ArmDrift(
            name, str(arm.get("training", name[:1])), str(arm.get("rollout", name[-1:])),
            [int(s.get("step", i)) for i, s in enumerate(steps)], series, differs, arm.get("byte_equal"),
            arm.get("first_drift_step"), arm.get("first_drift"), _gradients_text(arm), _lora_text(arm.get("lora_gate")),
            arm.get("seconds_per_rollout_step"), arm.get("seconds_per_training_step"),
        ))  # fmt: skip
    return found
