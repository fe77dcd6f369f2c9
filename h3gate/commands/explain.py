"""The plain lines printed just above a verdict: what the run compared with what, on which weights, and what its
"first drift" means. Each line is derived from the run's own evidence (its mode, candidate, checkpoint, drift), so
it says what this run did, not what a typical run does."""

from __future__ import annotations

from rich.markup import escape

PROVIDER = "the provider (h3gate's op-for-op replay of diffusers 0.42.1)"
ALLOWED_DRIFT = (
    "first drift: the first node whose bytes differ from the provider's; allowed while every packed row stays "
    "within its bound (the row rule), which is why a pass can show one."
)


def weights(checkpoint: dict | None) -> str:
    """``synthetic seeded weights (seed N)`` or ``the checkpoint PATH`` from an evidence ``checkpoint`` record."""
    if not checkpoint or checkpoint.get("kind") == "synthetic" or not checkpoint.get("path"):
        seed = "" if not checkpoint or checkpoint.get("seed") is None else f" (seed {checkpoint['seed']})"
        return f"synthetic seeded weights{seed}"
    return f"the checkpoint {checkpoint['path']}"


def merge_label(doc: dict) -> str:
    """``, merge order seg8`` for a title: the order h3gate's kernels summed the split reductions in (none in mode off,
    for SGLang's DiT as the candidate, or for a record made before it was recorded)."""
    order = doc.get("merge_order")
    return "" if order is None or doc.get("mode") == "off" or doc.get("candidate") else f", merge order {order}"


def candidate(doc: dict) -> str:
    """What a gate judged: SGLang's DiT, or h3gate's kernels in the run's mode."""
    cand = doc.get("candidate")
    if cand:
        return f"SGLang {cand['versions']['sglang']}'s DiT (quality {cand['quality']})"
    return {
        "strict": "h3gate's strict kernels",
        "audit": "h3gate's strict kernels (audit mode: any provider fallback fails)",
        "auto": "h3gate's kernels (auto mode: provider fallbacks recorded, not failed)",
        "off": "the provider's own ops (mode off: a control, equal by construction)",
    }.get(doc["mode"], f"h3gate's kernels (mode {doc['mode']})")


def gate_lines(doc: dict) -> list[str]:
    """ws1-block / ws1-model: candidate vs provider vs FP64 golden, the weights, and the first drift's meaning."""
    first = (
        ALLOWED_DRIFT
        if doc.get("first_drift") is not None
        else "first drift: none (every node's bytes equal the provider's)."
    )
    return [
        f"compared: {candidate(doc)} vs {PROVIDER}, both vs the FP64 golden; {weights(doc.get('checkpoint'))}.",
        first,
    ]


def ablate_lines(mode: str, checkpoint: str | None, seed: int) -> list[str]:
    """ablate: each row's probe vs the unchanged run, and what the expected first drift is."""
    ops = "the provider's ops" if mode == "off" else f"h3gate's kernels (mode {mode})"
    source = f"the checkpoint {checkpoint}" if checkpoint else f"synthetic seeded weights (seed {seed})"
    return [
        f"compared: each row's probe (one factor changed) vs the unchanged run, byte for byte, on {ops}; {source}.",
        "first drift: the first node whose bytes differ between the two; a row passes when its observed result and "
        "first drift match manifests/ablations.yaml.",
    ]


def compare_lines(run_a: str, run_b: str) -> list[str]:
    return [
        f"compared: trajectory {run_a} vs {run_b}, step by step, latents and velocities byte for byte.",
        "first drift: the first step whose bytes differ, re-run with node capture on both sides to name its node.",
    ]


def trajectory_lines(body: dict) -> list[str]:
    run = body["run"]
    inv = body["invocation"]
    what = (
        f"saved: {body['steps_saved']}/{body['evaluations']} model evaluations of the dual-scheduler trajectory "
        f"(mode {run['mode']}, {weights(run.get('weights'))})."
    )
    pairs = sum((body.get("determinism") or {}).get("pairs", {}).values())
    repeat = f"every node's evaluations on bit-identical inputs within this invocation ({pairs} pairs)"
    if inv["verify_last"] is None:
        if pairs:
            return [what, f"compared: {repeat}; --verify-last recomputes a saved step, h3gate compare RUN_A RUN_B "
                    "compares two runs."]  # fmt: skip
        return [what, "nothing was compared: --verify-last recomputes the last step bitwise; h3gate compare RUN_A "
                "RUN_B compares two runs."]  # fmt: skip
    return [what, f"compared: step {inv['verify_last']['step']} recomputed vs its saved bytes (bitwise); {repeat}."]


def ws2_lines(body: dict) -> list[str]:
    return [
        f"compared: {body['world_size']} {body['backend']} ranks ({body['topology']}) vs TP1 on one device in the "
        "seg8 merge order, every value and gradient byte for byte; synthetic seeded weights.",
        "first drift: the first node where a rank's bytes differ from TP1's; any drift fails.",
    ]


def arms_lines(body: dict) -> list[str]:
    engine = body["rollout"]["engine"]
    rollout = "diffusers' module" if engine == "diffusers" else "SGLang's DiT"
    return [
        f"compared: training/rollout arms (P: the provider ops, diffusers as it is; R: h3gate's strict kernels), "
        f"rollouts on {rollout}; R/R must be byte-equal at every step, the other arms are recorded.",
        "first drift: the first step and node where an arm's training and rollout bytes differ.",
    ]


def count(n: int, noun: str) -> str:
    """``1 file``, ``2 files``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def gate_detail(failing: int, drift: str | None) -> str:
    """A gate verdict's parenthesis: ``N failing checks`` and, when there is one, ``first drift: ...``."""
    checks = count(failing, "failing check")
    return checks if drift is None else f"{checks}; first drift: {drift}"


def failing_header(failing: list[str]) -> str | None:
    """``failing checks (N):``, the line above the listed checks (None when there are none)."""
    return f"failing checks ({len(failing)}):" if failing else None


def determinism_line(record: dict | None) -> str | None:
    """One line on the within-run determinism check: evaluations, pairs, the first mismatch (pass, row)."""
    if record is None:
        return None
    pairs = ", ".join(f"{who} {n}" for who, n in sorted(record["pairs"].items())) or "none"
    line = f"determinism: {record['evaluations']} evaluations, pairs on identical inputs: {pairs}"
    bad = record["mismatches"]
    if not bad:
        return line + ("; all bitwise" if any(record["pairs"].values()) else "; nothing compared")
    m = bad[0]
    row = "whole tensor" if m["row"] is None else f"row {m['row']}"
    rank = "" if m.get("rank") is None else f" on rank {m['rank']}"
    return (f"{line}; {len(bad)} differ, first: {m['role']} {m['node']} {m['kind']}{rank} ({m['passes'][0]} vs "
            f"{m['passes'][1]}, {row})")  # fmt: skip


def print_checks(console, determinism: dict | None, failing: list[str], injected: str | None) -> None:
    """The lines every gate prints above its evidence path: its determinism line, each failing check, and the
    injected negative control when there is one."""
    line = determinism_line(determinism)
    if line is not None:
        console.print(escape(line))
    for check in failing:
        console.print(f"  failing: {escape(check)}")
    if injected:
        console.print(f"[yellow]injected fault (negative control): {escape(injected)}[/]")
