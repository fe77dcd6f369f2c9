"""Ablation rows whose observation is a check rather than one strict/probe pair (``run: check``): N/A
justifications (A5, C2) and repeated preprocessing (H-C7). A check is ``fn(ctx, ablation) -> Outcome``, registered
by name in :data:`CHECKS` (the name a row's ``probe`` gives).

An N/A is only reported when the check that justifies it passes; when it fails the row observes a drift (and so
fails its N/A expectation) with what the check saw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace

import torch

from h3gate.ablate.arms import forward_stream
from h3gate.ablate.engine import compare_streams
from h3gate.ablate.outcome import Outcome
from h3gate.gate.compare import bitwise_equal, tensor_sha256
from h3gate.graph.model import derive_metadata, raw_metadata
from h3gate.layout import build_layout
from h3gate.manifests.ablations import AblationRow
from h3gate.manifests.layouts import load_layout
from h3gate.memory import BIG_MODEL_PARAMS
from h3gate.trajectory import iter_trajectory

STATE_WORDS = ("cache", "past", "kv_")


def no_kv_cache(ctx, ablation: AblationRow) -> Outcome:
    """A5: no KV-cache state: no cache-like input or node; a call after an unrelated call equals a fresh one."""
    names = [*ctx.graph.inputs, *(n.name for n in ctx.graph.nodes)]
    stateful = [n for n in names if any(w in n.lower() for w in STATE_WORDS)]
    evidence = {"graph_inputs": list(ctx.graph.inputs), "state_like_names": stateful, "nodes": len(ctx.graph.nodes)}
    if stateful:
        return Outcome("EXPECTED_DRIFT", f"cache semantics detected: state-like names {stateful}",
                       {"node": stateful[0]}, evidence=evidence)  # fmt: skip
    strict_arm = ctx.base_arm()
    for _ in forward_stream(replace(strict_arm, requests=(ctx.request(1),)), ctx.graph, ctx.cfg, ctx.plan, ctx.device):
        pass  # an unrelated call first: any state it left behind would reach the next call
    comparison = compare_streams(
        forward_stream(strict_arm, ctx.graph, ctx.cfg, ctx.plan, ctx.device),
        forward_stream(strict_arm, ctx.graph, ctx.cfg, ctx.plan, ctx.device),
        strict_arm,
        strict_arm,
        ctx.layout,
    )
    if comparison.first_drift is not None:
        return Outcome("EXPECTED_DRIFT", "cache semantics detected: a call after an unrelated call differs from a "
                       "fresh one", comparison.first_drift, comparison, evidence=evidence)  # fmt: skip
    reason = (
        f"{ablation.expected.reason} Checked: the graph's {len(ctx.graph.inputs)} inputs and {len(ctx.graph.nodes)} "
        "nodes carry no cache/past/kv state, and a call made after an unrelated call is byte-equal to a fresh "
        "call."
    )
    return Outcome("NA", reason, None, comparison, evidence=evidence)


def no_decode_handoff(ctx, ablation: AblationRow) -> Outcome:
    """C2: nothing but the latents passes between steps: resuming from step 1's latents reproduces every later step."""
    arm = ctx.base_arm()
    args = (ctx.graph, arm.params, arm.ops, ctx.cfg, ctx.layout, arm.requests[0], arm.recipe, ctx.device)
    full: dict[tuple[str, int], torch.Tensor] = {}
    with torch.no_grad():
        for node, value in iter_trajectory(*args):
            if node.name.startswith("scheduler."):
                full[(node.name, node.step)] = value
        evaluations = max(step for _, step in full) + 1
        if evaluations < 2:
            return Outcome("EXPECTED_DRIFT", f"C2 needs >= 2 model evaluations, the recipe gives {evaluations}")
        state = (full[("scheduler.video_step", 0)], full[("scheduler.audio_step", 0)])
        resumed = {
            (n.name, n.step): v
            for n, v in iter_trajectory(*args, start=1, state=state)
            if n.name.startswith("scheduler.")
        }
    differing = [f"{name}@{step}" for (name, step), v in resumed.items() if not bitwise_equal(v, full[(name, step)])]
    evidence = {"steps_resumed": sorted({s for _, s in resumed}), "differing": differing}
    if differing or len(resumed) != len(full) - 2:
        return Outcome(
            "EXPECTED_DRIFT",
            f"resumed trajectory differs at {differing or 'its step count'}",
            {"node": differing[0] if differing else None},
            evidence=evidence,
        )
    reason = (
        f"{ablation.expected.reason} Checked: resuming at step 1 from the step-0 latents alone reproduces all "
        f"{len(resumed)} later scheduler updates byte for byte (no cache or other handoff state)."
    )
    return Outcome("NA", reason, evidence=evidence)


def _digest(entries: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}:{v};" for k, v in sorted(entries.items())).encode()).hexdigest()


REF2VA_COMPANION = "ref2va-tiny"  # H-C7's Ref2VA path when the run's own layout is not ref2va


def _ref_blocks(spec) -> str:
    refs = spec.references or []
    return f" with {len(refs)} reference blocks ({', '.join(r.kind for r in refs)})" if refs else ""


def _preprocess_once(ctx, spec, name: str, variant: str) -> dict:
    """One build of a layout, its derived metadata and its variant's weight components, as hashes."""
    layout = build_layout(spec, name)
    ts, ti = layout.row_timesteps(
        ctx.plan["video_t"], ctx.plan["audio_t"], ctx.plan["cond_video_t"], ctx.plan["cond_audio_t"]
    )
    meta = derive_metadata(raw_metadata(layout, ts, ti), ctx.cfg, ctx.device)
    source = ctx.variant_source(ctx.seed, variant)
    names = source.names()
    if sum(torch.Size(source.meta(n)[0]).numel() for n in names) > BIG_MODEL_PARAMS:  # first/last block only
        last = ctx.cfg.num_layers - 1
        blocks = ("transformer_blocks.0.", f"transformer_blocks.{last}.")
        names = [n for n in names if not n.startswith("transformer_blocks.") or n.startswith(blocks)]
    rows = {"num_condition_video_rows": str(layout.num_condition_video_rows),
            "num_condition_audio_rows": str(layout.num_condition_audio_rows)}  # fmt: skip
    return {
        "layout": {**layout.tensor_hashes(), **rows},
        "metadata": {k: tensor_sha256(v) for k, v in meta.items()},
        "components": {n: tensor_sha256(source.load(n, "cpu")) for n in names},
    }


def repeated_preprocessing(ctx, ablation: AblationRow) -> Outcome:
    """H-C7: the packed layout, its derived metadata and the weight components built twice hash identically - on
    the run's layout with its variant's weights and, when that is not a Ref2VA layout, also on the Ref2VA path
    (``REF2VA_COMPANION`` with ``transformer_ref/`` weights)."""
    paths = [(ctx.layout.name, ctx.layout.spec, ctx.variant)]
    if ctx.layout.spec.kind != "ref2va":
        paths.append((REF2VA_COMPANION, load_layout(REF2VA_COMPANION), "transformer_ref"))
    evidence: dict = {"paths": []}
    differing: list[str] = []
    for name, spec, variant in paths:
        first, second = (_preprocess_once(ctx, spec, name, variant) for _ in range(2))
        differing += [f"{name}.{part}.{k}" for part in first for k in first[part] if first[part][k] != second[part][k]]
        evidence["paths"].append({
            "layout": name,
            "task": spec.kind,
            "variant": variant,
            "layout_sha256": first["layout"],
            "metadata_sha256": first["metadata"],
            "components_sha256": _digest(first["components"]),
            "components_hashed": len(first["components"]),
            "coverage": f"the {spec.kind} packed layout{_ref_blocks(spec)}, its derived metadata and the {variant}/ "
            "weight components (reference latents come from the VAE encode: run vae)",
        })  # fmt: skip
    if differing:
        return Outcome(
            "EXPECTED_DRIFT",
            f"repeated preprocessing differs at {differing[0]}",
            {"node": f"preprocess.{differing[0]}"},
            evidence=evidence,
        )
    what = " and ".join(f"{p['layout']} ({p['variant']}/)" for p in evidence["paths"])
    note = f"layout, metadata and weight components built twice: identical hashes on {what}"
    return Outcome("PASS", None, notes=[note], evidence=evidence)


CHECKS: dict[str, Callable[..., Outcome]] = {
    "no_kv_cache": no_kv_cache,
    "no_decode_handoff": no_decode_handoff,
    "repeated_preprocessing": repeated_preprocessing,
}
