"""``h3gate run ...``: the gates, each a thin verb that builds its command's settings object and calls the command
through :func:`~h3gate.cli.base.run_command`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from h3gate.cli.base import (
    BackwardOpt,
    CandidateOpt,
    CheckpointOpt,
    DeviceOpt,
    FaultOpt,
    ForceOpt,
    JsonOpt,
    MergeOpt,
    ModelConfigOpt,
    ModeOpt,
    SeedOpt,
    SglangAttentionOpt,
    SglangQualityOpt,
    TolOpt,
    out_option,
    run_app,
    run_command,
)
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.numerics import resolve_device


@run_app.command("ws1-block")
def run_ws1_block(
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "tiny",
    config: ModelConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    device: DeviceOpt = "auto",
    mode: ModeOpt = "strict",
    backward: BackwardOpt = None,
    tolerance: TolOpt = "ws1-block",
    seed: SeedOpt = 0,
    save_tensors: Annotated[
        Path | None,
        typer.Option(
            "--save-tensors",
            help="Write inputs/provider/candidate/golden .safetensors into this folder (with the backward also the "
            "candidate's gradients as candidate-grads.safetensors, run ws2's keys).",
        ),
    ] = None,
    fault_matrix: Annotated[
        bool,
        typer.Option(
            "--fault-matrix",
            help="Also prove the gate catches one wrong packed row: every node, forward and backward, first and last "
            "tile, scaled by 1 + 2^-6 and last 16 columns zeroed; exit 1 unless every fault is caught and located.",
        ),
    ] = False,
    fault: FaultOpt = None,
    merge_order: MergeOpt = DEFAULT_MERGE_ORDER,
    candidate: CandidateOpt = "h3gate",
    sglang_quality: SglangQualityOpt = "lossless",
    sglang_attention_backend: SglangAttentionOpt = None,
    out: Annotated[Path | None, out_option("ws1-block/<config>-<layout>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """The one-block gate: block 0 as 17 nodes, provider replay vs strict candidate vs FP64 golden."""
    device = resolve_device(device)
    from h3gate.commands.run_cmd import Ws1BlockCommand, ws1_block_command
    from h3gate.runs.setup import RunSpec

    run = RunSpec(
        scope="block",
        layout=layout,
        config=config,
        checkpoint=None if checkpoint is None else str(checkpoint),
        device=device,
        seed=seed,
        mode=mode,
        merge=merge_order,
        candidate=candidate,
        sglang_quality=sglang_quality,
        sglang_attention=sglang_attention_backend,
    )
    settings = Ws1BlockCommand(
        run=run,
        backward=candidate != "sglang" if backward is None else backward,
        tolerance=tolerance,
        save_tensors=save_tensors,
        fault_matrix=fault_matrix,
        fault=fault,
        out=out,
        json=json_,
        force=force,
    )
    run_command(ws1_block_command, settings)


@run_app.command("ws1-model")
def run_ws1_model(
    layout: Annotated[
        str | None, typer.Option("--layout", help="A layout of manifests/layouts.yaml (default: micro).")
    ] = None,
    config: ModelConfigOpt = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="diffusers transformer folder, read one layer at a time (else synthetic)."),
    ] = None,
    device: DeviceOpt = "auto",
    mode: ModeOpt = "strict",
    backward: Annotated[
        bool | None,
        typer.Option(
            "--backward/--no-backward",
            help="Also gate the complete backward (every gradient); default on for the h3gate candidate, off for "
            "sglang.",
        ),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option("--layers", help="A:B runs transformer blocks A .. B-1 only (a truncated model; default all)."),
    ] = None,
    tolerance: TolOpt = "ws1-model",
    seed: SeedOpt = 0,
    save_tensors: Annotated[
        Path | None,
        typer.Option(
            "--save-tensors",
            help="Write inputs (diffusers' forward arguments) and provider/candidate/golden node values there (with "
            "the backward also the candidate's gradients as candidate-grads.safetensors, run ws2's keys).",
        ),
    ] = None,
    fault: FaultOpt = None,
    fault_matrix: Annotated[
        bool,
        typer.Option(
            "--fault-matrix",
            help="Also prove the gate catches one wrong row at every depth (refiner, first and last block, final "
            "AdaLN and heads): forward and backward, row 1, the last row and each modality's first, scaled by "
            "1 + 2^-6 and last 16 columns zeroed; exit 1 unless every fault is caught and located.",
        ),
    ] = False,
    merge_order: MergeOpt = DEFAULT_MERGE_ORDER,
    candidate: CandidateOpt = "h3gate",
    sglang_quality: SglangQualityOpt = "lossless",
    sglang_attention_backend: SglangAttentionOpt = None,
    out: Annotated[Path | None, out_option("ws1-model/<config>-<layout>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    stream: Annotated[
        bool,
        typer.Option(
            "--stream",
            help="Streamed gate in a RUNDIR: phase 1 stores every lane's values and gradients at each range "
            "boundary, phase 2 gates each range from them, phase 3 merges (same record and verdict). Under "
            "torchrun phase 1's lanes and then the ranges are split over the ranks.",
        ),
    ] = False,
    ranges: Annotated[
        str | None,
        typer.Option(
            "--ranges",
            help="--stream's ranges of blocks, A:B,B:C,... (default one per block, or 5 "
            "blocks a range above 8 blocks).",
        ),
    ] = None,  # fmt: skip
    range_size: Annotated[
        int | None, typer.Option("--range-size", help="--stream: K blocks a range (instead of --ranges).")
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Continue the streamed RUNDIR after its last stored boundary and range "
            "(refused for other code or settings).",
        ),
    ] = None,  # fmt: skip
    from_dir: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="Phase 2 of one range of a streamed RUNDIR: --layers A:B --from RUNDIR writes "
            "RUNDIR/ranges/A-B.json (verdict complete); any machine that sees RUNDIR may run one.",
        ),
    ] = None,  # fmt: skip
    merge: Annotated[
        Path | None,
        typer.Option("--merge", help="Phase 3: merge a streamed RUNDIR's ranges into RUNDIR/ws1-model.json."),
    ] = None,
    partial: Annotated[
        bool, typer.Option("--partial", help="--merge the ranges gated so far (fails as incomplete).")
    ] = False,
    boundaries_only: Annotated[
        bool, typer.Option("--boundaries-only", help="--stream: stop after phase 1 (the boundaries).")
    ] = False,
) -> None:
    """The whole-model gate: every node of every stage and every gradient, provider vs strict vs FP64 golden."""
    device = resolve_device(device)
    from h3gate.commands.model_cmd import MODEL_RUN, Ws1ModelCommand, ws1_model_command

    run = MODEL_RUN.with_(
        layout=layout or MODEL_RUN.layout,
        config=config,
        checkpoint=None if checkpoint is None else str(checkpoint),
        device=device,
        seed=seed,
        mode=mode,
        merge=merge_order,
        layers=layers,
        candidate=candidate,
        sglang_quality=sglang_quality,
        sglang_attention=sglang_attention_backend,
    )
    backward = candidate != "sglang" if backward is None else backward
    settings = Ws1ModelCommand(
        run=run,
        backward=backward,
        tolerance=tolerance,
        save_tensors=save_tensors,
        fault=fault,
        fault_matrix=fault_matrix,
        out=out,
        json=json_,
        force=force,
        stream=stream,
        ranges=ranges,
        range_size=range_size,
        resume=resume,
        from_dir=from_dir,
        merge_dir=merge,
        partial=partial,
        boundaries_only=boundaries_only,
    )
    if settings.streamed:
        from h3gate.commands.model_stream_cmd import run_streamed

        run_command(run_streamed, settings)
    run_command(ws1_model_command, settings)


@run_app.command("ws1-trajectory")
def run_ws1_trajectory(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="RUNDIR: the run's folder (default: a new evidence/local/ws1-trajectory/<config>-<layout>/<UTC time>-"
            "<id>/, 'latest' linked beside it; --resume and --verify-last take the RUNDIR).",
        ),
    ] = None,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "micro",
    config: ModelConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="Sigma grid points (steps - 1 model evaluations).")] = 6,
    shift: Annotated[float, typer.Option("--shift", help="The video grid's shift (audio keeps 3.0).")] = 12.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic weights and the request.")] = 0,
    mode: Annotated[str, typer.Option("--mode", help="strict | audit | auto | off (the provider)")] = "strict",
    merge_order: MergeOpt = DEFAULT_MERGE_ORDER,
    device: DeviceOpt = "auto",
    batch_with: Annotated[
        int | None,
        typer.Option("--batch-with", help="Evaluate every step beside an unrelated request drawn from this seed."),
    ] = None,
    until: Annotated[int | None, typer.Option("--until", help="Stop after this step (0-based).")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue RUNDIR after its last complete step (every saved step checked).")
    ] = False,
    verify_last: Annotated[
        bool, typer.Option("--verify-last", help="Recompute RUNDIR's last saved step and require it bitwise.")
    ] = False,
    fault: Annotated[
        str | None,
        typer.Option(
            "--fault",
            help="NODE:ROW:ulp@K: one ulp in the K-th evaluation of NODE only (the determinism check's negative "
            "control; the invocation's first step runs twice).",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """A dual-scheduler trajectory saved one model evaluation at a time in --out RUNDIR: resumable, verifiable."""
    device = resolve_device(device)
    from h3gate.commands.trajectory_cmd import Ws1TrajectoryCommand, ws1_trajectory_command
    from h3gate.runs.ws1_trajectory import TrajectorySettings

    run = TrajectorySettings(
        layout=layout,
        config=config,
        checkpoint=checkpoint,
        device=device,
        mode=mode,
        merge=merge_order,
        steps=steps,
        shift=shift,
        seed=seed,
        batch_with=batch_with,
    )
    settings = Ws1TrajectoryCommand(
        run=run, out=out, until=until, resume=resume, verify_last=verify_last, fault=fault, json=json_
    )  # fmt: skip
    run_command(ws1_trajectory_command, settings)


@run_app.command("arms")
def run_arms(
    arms: Annotated[
        str, typer.Option("--arms", help="Training/rollout operators: P/P,R/P,P/R,R/R (P provider, R strict).")
    ] = "P/P,R/P,P/R,R/R",
    config: ModelConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "micro",
    layers: Annotated[int | None, typer.Option("--layers", help="Keep the config's first N blocks.")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Sigma grid points (steps - 1 evaluations).")] = 4,
    batch: Annotated[int, typer.Option("--batch", help="Requests rolled out together (B).")] = 2,
    lora_rank: Annotated[
        int | None, typer.Option("--lora-rank", help="Train a PEFT LoRA of this rank (base frozen).")
    ] = None,
    shift: Annotated[float, typer.Option("--shift", help="The video grid's shift (audio keeps 3.0).")] = 12.0,
    seed: SeedOpt = 0,
    fault: Annotated[
        str | None,
        typer.Option(
            "--fault",
            help="NODE:ROW[:scale|zero_tail][:forward|backward] on R training's second pass (negative control); with "
            "--rollout sglang, NODE:ROW on SGLang's rollout module (ROW of its output: request b's row s at b*S+s); "
            "NODE:ROW:ulp@K[:backward]: one ulp in the K-th evaluation of NODE by R's strict kernels only.",
        ),
    ] = None,
    rollout: Annotated[
        str,
        typer.Option(
            "--rollout",
            help="The rollout engine: diffusers (the module) | sglang (SGLang 0.5.23's DiT on the same weights; "
            "make install-sglang). Training stays diffusers.",
        ),
    ] = "diffusers",
    sglang_quality: SglangQualityOpt = "lossless",
    sglang_attention_backend: SglangAttentionOpt = None,
    merge_order: MergeOpt = DEFAULT_MERGE_ORDER,
    tp: Annotated[
        int,
        typer.Option(
            "--tp", help="SGLang's tensor parallelism for the rollout (gloo ranks on the CPU; the seg8 merge order)."
        ),
    ] = 1,
    ulysses: Annotated[
        int,
        typer.Option("--ulysses", help="SGLang's Ulysses (sequence parallelism) for the rollout (--batch 1)."),
    ] = 1,
    device: DeviceOpt = "auto",
    out: Annotated[Path | None, out_option("arms/<config>-<layout>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Train/rollout arms on diffusers' own module (rollout on it or on SGLang's DiT): velocity bytes per step, first
    drift, gradient repeat, LoRA gate."""
    device = resolve_device(device)
    from h3gate.arms.stack import ArmsSettings, parse_arms
    from h3gate.commands.arms_cmd import ArmsCommand, arms_command

    run = ArmsSettings(
        arms=parse_arms(arms),
        config=config,
        checkpoint=checkpoint,
        layout=layout,
        layers=layers,
        device=device,
        steps=steps,
        shift=shift,
        batch=batch,
        lora_rank=lora_rank,
        seed=seed,
        fault=fault,
        rollout=rollout,
        sglang_quality=sglang_quality,
        sglang_attention=sglang_attention_backend,
        merge=merge_order,
        tp=tp,
        ulysses=ulysses,
    )
    run_command(arms_command, ArmsCommand(run=run, out=out, json=json_, force=force))


@run_app.command("ws2")
def run_ws2(
    topology: Annotated[
        str,
        typer.Option(
            "--topology", help="tp1 | tp2 | tp4 | tp8 | cp2 | tp2cp2 | tp4cp2 | tp2sp | tp2cp2sp | tp4cp2sp (sp: SP)."
        ),
    ],
    scope: Annotated[str, typer.Option("--scope", help="block (block 0) | model (the whole transformer).")] = "block",
    backend: Annotated[
        str | None, typer.Option("--backend", help="gloo (CPU ranks) | nccl (one GPU per rank); default by device.")
    ] = None,
    config: Annotated[str, typer.Option("--config", help="A config name or PATH.yaml.")] = "ws2-tiny",
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "micro",
    seed: SeedOpt = 0,
    fault: Annotated[
        list[str] | None,
        typer.Option(
            "--fault",
            help="RANK:NODE:ROW[:forward|backward]: one row scaled on one rank (repeatable); RANK:NODE:ROW:ulp@K"
            "[:backward]: one ulp in the K-th evaluation of NODE on that rank only (ROW of its own tensor).",
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu | cuda (default cpu).")] = "cpu",
    save_tensors: Annotated[
        Path | None,
        typer.Option(
            "--save-tensors",
            help="Write the ranks' gathered values as ws1-block's (--scope model: ws1-model's) inputs/candidate "
            ".safetensors, and their gradients as candidate-grads.safetensors, into this folder.",
        ),
    ] = None,
    out: Annotated[Path | None, out_option("ws2/<topology>-<scope>-<config>-<layout>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """TP/CP/SP ranks against TP1 (one device, seg8 merge order): every value and gradient byte for byte."""
    device = resolve_device(device)
    from h3gate.commands.ws2_cmd import Ws2Command, ws2_command
    from h3gate.parallel.ws2 import Ws2Settings

    run = Ws2Settings(
        topology=topology,
        scope=scope,
        backend=backend,
        device=device,
        config=config,
        layout=layout,
        seed=seed,
        faults=fault or [],
    )
    run_command(ws2_command, Ws2Command(run=run, out=out, json=json_, force=force, save_tensors=save_tensors))


@run_app.command("vae")
def run_vae(
    modality: Annotated[str, typer.Option("--modality", help="video | audio")],
    mode: Annotated[str, typer.Option("--mode", help="strict (one batch row a call, deterministic) | off")] = "strict",
    device: DeviceOpt = "auto",
    geometry: Annotated[str, typer.Option("--geometry", help="tiny (CI) | real (124 frames at 768x1344).")] = "tiny",
    seed: SeedOpt = 0,
    out: Annotated[Path | None, out_option("vae/<modality>-<geometry>-<mode>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Phase B: a seeded VAE (diffusers' class) encode/decode repeat-bitwise, batch-invariant, its latent
    normalisation and layout against the pipeline's helpers; decoded media hashed, not gated."""
    device = resolve_device(device)
    from h3gate.commands.vae_cmd import VaeCommand, vae_command
    from h3gate.runs.vae import VaeRun

    run = VaeRun(modality=modality, mode=mode, device=device, geometry=geometry, seed=seed)
    run_command(vae_command, VaeCommand(run=run, out=out, json=json_, force=force))


@run_app.command("ws1-ops")
def run_ws1_ops(
    op: Annotated[list[str] | None, typer.Option("--op", help="Operator name (repeatable; default all).")] = None,
    layouts: Annotated[str, typer.Option("--layouts", help="Comma-separated layouts giving row counts.")] = "tiny",
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml (widths and dtypes).")] = "tiny",
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    merge_order: MergeOpt = DEFAULT_MERGE_ORDER,
    out: Annotated[Path | None, out_option("ws1-ops")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Per-operator evidence: accuracy vs FP32/FP64, invariance, provider-bitwise flag, kernel id."""
    device = resolve_device(device)
    from h3gate.commands.ops_cmd import Ws1OpsCommand, ws1_ops_command

    settings = Ws1OpsCommand(
        ops=tuple(op or ()),
        layouts=layouts,
        config=config,
        device=device,
        seed=seed,
        merge=merge_order,
        out=out,
        json=json_,
        force=force,
    )
    run_command(ws1_ops_command, settings)
