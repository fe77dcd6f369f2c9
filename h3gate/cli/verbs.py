"""The top-level verbs: each resolves its device (if it has one), builds its command's settings object and calls the
command through :func:`~h3gate.cli.base.run_command`, which exits with its code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from h3gate.cli.base import (
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    SeedOpt,
    app,
    out_option,
    run_command,
)
from h3gate.numerics import resolve_device


@app.command()
def layout(
    name: Annotated[str | None, typer.Argument(help="A layout of manifests/layouts.yaml (default: tiny).")] = None,
    text_tokens: Annotated[
        int | None, typer.Option("--text-tokens", help="Text tokens (overrides the named layout).")
    ] = None,
    latent_frames: Annotated[
        int | None, typer.Option("--latent-frames", help="Video latent frames (overrides the named layout).")
    ] = None,
    latent_height: Annotated[
        int | None, typer.Option("--latent-height", help="Video latent height (overrides the named layout).")
    ] = None,
    latent_width: Annotated[
        int | None, typer.Option("--latent-width", help="Video latent width (overrides the named layout).")
    ] = None,
    audio_latents: Annotated[
        int | None, typer.Option("--audio-latents", help="Audio latent rows (overrides the named layout).")
    ] = None,
    anchor: Annotated[list[str] | None, typer.Option("--anchor", help="first | last (repeatable).")] = None,
    text_vision_rows: Annotated[
        list[str] | None, typer.Option("--text-vision-rows", help="START:END text rows tagged video (repeatable).")
    ] = None,
    task: Annotated[str | None, typer.Option("--task", help="t2va | fl2va | ref2va (default: by the anchors).")] = None,
    ref: Annotated[
        list[str] | None,
        typer.Option("--ref", help="ref2va reference, in packed order: image:H:W | video:F:H:W[:A] | audio:A."),
    ] = None,
    save: Annotated[Path | None, typer.Option("--save", help="Write the index tensors to FILE.safetensors.")] = None,
    json_: JsonOpt = False,
) -> None:
    """Build a packed layout (bitwise equal to diffusers' build_packed_sequence / build_ref2va_packed_sequence)."""
    from h3gate.commands.layout_cmd import LayoutCommand, layout_command

    settings = LayoutCommand(
        name=name,
        text_tokens=text_tokens,
        latent_frames=latent_frames,
        latent_height=latent_height,
        latent_width=latent_width,
        audio_latents=audio_latents,
        anchors=tuple(anchor or ()),
        text_vision_rows=tuple(text_vision_rows or ()),
        task=task,
        refs=tuple(ref or ()),
        save=save,
        json=json_,
    )
    run_command(layout_command, settings)


@app.command()
def schedule(
    steps: Annotated[int, typer.Option("--steps", help="Sigma grid points, terminal 0 included.")],
    shift: Annotated[float, typer.Option("--shift", help="Timestep shift of the sigma grid.")] = 12.0,
    save: Annotated[
        Path | None, typer.Option("--save", help="Write the sigmas and timesteps to FILE.safetensors.")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Sigmas and timesteps bitwise equal to MiniMaxH3Scheduler.set_timesteps."""
    from h3gate.commands.schedule_cmd import ScheduleCommand, schedule_command

    run_command(schedule_command, ScheduleCommand(steps=steps, shift=shift, save=save, json=json_))


@app.command("synth-checkpoint")
def synth_checkpoint(
    out: Annotated[Path, typer.Option("--out", help="Checkpoint folder to write.")],
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic weights.")] = 0,
    shard_size: Annotated[int | None, typer.Option("--shard-size", help="Shard above this many bytes.")] = None,
    variant: Annotated[
        str, typer.Option("--variant", help="transformer (FL2VA/T2VA) | transformer_ref (Ref2VA) weights.")
    ] = "transformer",
    json_: JsonOpt = False,
) -> None:
    """Write a seeded diffusers-layout checkpoint (config.json + safetensors, sharded with an index)."""
    from h3gate.commands.checkpoint_cmd import SynthCheckpointCommand, synth_command

    settings = SynthCheckpointCommand(
        out=out, config=config, seed=seed, shard_size=shard_size, variant=variant, json=json_
    )
    run_command(synth_command, settings)


@app.command()
def fingerprint(
    manifest: Annotated[
        str, typer.Option("--manifest", help="Checkpoint manifest name or PATH.yaml.")
    ] = "minimax-h3-42ed227",
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", help="diffusers transformer folder to check (headers only).")
    ] = None,
    config: Annotated[str, typer.Option("--config", help="NAME | PATH | auto (read config.json)")] = "auto",
    hash_tensors: Annotated[
        bool, typer.Option("--hash-tensors", help="Also stream every tensor and record its sha256 (reads all data).")
    ] = False,
    out: Annotated[Path | None, out_option("fingerprint")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Fingerprint the manifest, or check a checkpoint's headers against the inventory its config implies."""
    from h3gate.commands.checkpoint_cmd import FingerprintCommand, fingerprint_command

    settings = FingerprintCommand(
        manifest=manifest,
        checkpoint=checkpoint,
        config=config,
        hash_tensors=hash_tensors,
        out=out,
        json=json_,
        force=force,
    )
    run_command(fingerprint_command, settings)


@app.command()
def compare(
    run_a: Annotated[Path, typer.Argument(help="A ws1-trajectory RUNDIR.")],
    run_b: Annotated[Path, typer.Argument(help="Another ws1-trajectory RUNDIR (same layout and sigma grids).")],
    device: DeviceOpt = "auto",
    out: Annotated[Path | None, out_option("compare/<RUN_A>-vs-<RUN_B>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Two trajectory runs step by step: byte equality per modality, drift size, and the first drifting step re-run
    with node capture on both sides to name the first node, layer, packed row and modality."""
    device = resolve_device(device)
    from h3gate.commands.compare_cmd import CompareCommand, compare_command

    run_command(
        compare_command, CompareCommand(run_a=run_a, run_b=run_b, device=device, out=out, json=json_, force=force)
    )


@app.command()
def seal(
    folder: Annotated[Path, typer.Argument(help="Evidence folder.")],
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-check schemas, file hashes, SEAL.json's own hash and signature.")
    ] = False,
    key: Annotated[
        Path | None, typer.Option("--key", help="Sign the seal with this Ed25519 private key (h3gate keygen).")
    ] = None,
    pubkey: Annotated[
        Path | None, typer.Option("--pubkey", help="With --verify: require a valid signature by this public key.")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Schema-validate every evidence JSON under FOLDER and seal it (or verify an existing seal)."""
    from h3gate.commands.seal_cmd import SealCommand, seal_command

    run_command(seal_command, SealCommand(folder=folder, verify=verify, key=key, pubkey=pubkey, json=json_))


@app.command()
def report(
    paths: Annotated[list[Path], typer.Argument(help="Evidence files or folders (sealed or not).")],
    out: Annotated[
        Path, typer.Option("--out", help="Folder for index.html and the figures' PNGs (a previous report is replaced).")
    ],
    open_: Annotated[bool, typer.Option("--open", help="Open the page in a web browser once written.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Write the evidence as one self-contained HTML page (figures inline, nothing loaded from the network) plus
    the figures as PNG. Needs matplotlib: pip install 'h3gate\\[report]'."""
    from h3gate.commands.report_cmd import ReportCommand, report_command

    run_command(report_command, ReportCommand(paths=tuple(paths), out=out, open_page=open_, json=json_))


@app.command()
def keygen(
    out: Annotated[
        Path,
        typer.Option("--out", help="Private key file to write (KEY.pub next to it; missing folders made 0700)."),
    ],
    json_: JsonOpt = False,
) -> None:
    """Write a new Ed25519 key for signing seals: KEY (PEM PKCS8, mode 0600) and KEY.pub; never overwrites."""
    from h3gate.commands.keygen_cmd import KeygenCommand, keygen_command

    run_command(keygen_command, KeygenCommand(out=out, json=json_))


@app.command()
def bench(
    target: Annotated[str | None, typer.Argument(help="ws1-block | ws1-model, or leave empty and pass --op.")] = None,
    op: Annotated[list[str] | None, typer.Option("--op", help="Operator name (repeatable).")] = None,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml (row count).")] = "medium",
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml (widths and dtypes).")] = "real",
    merge_order: Annotated[
        str | None,
        typer.Option(
            "--merge-order",
            help="seg8 (default for ws1-block / ws1-model): also time the strict path in the TP merge order (a third "
            "arm beside the single walk); single: the single walk only.",
        ),
    ] = None,
    device: DeviceOpt = "cuda",
    out: Annotated[Path | None, out_option("bench/<ws1-block|ws1-model|ops>-<config>-<layout>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Time strict kernels next to the provider in one run (median of CUDA-event timings): operators (--op), the
    block (ws1-block), or the whole model forward and forward + backward (ws1-model). The block and the model also
    record the forward in the power-capped steady state: ms and joules per call, each arm back to back."""
    from h3gate.commands.bench_cmd import BenchCommand, bench_command, check_bench_merge

    check_bench_merge(target, merge_order)  # before the device: a bad merge order is named even without CUDA
    device = resolve_device(device)
    settings = BenchCommand(
        target=target,
        ops=tuple(op or ()),
        layout=layout,
        config=config,
        merge=merge_order,
        device=device,
        out=out,
        json=json_,
        force=force,
    )
    run_command(bench_command, settings)


@app.command()
def ablate(
    row: Annotated[str | None, typer.Argument(help="An ablation row id (A0, H5, H-C3, ...).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Run every row.")] = False,
    list_: Annotated[bool, typer.Option("--list", help="List the rows and exit.")] = False,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "tiny",
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml")] = "tiny",
    device: DeviceOpt = "auto",
    mode: Annotated[str, typer.Option("--mode", help="off (provider ops) | strict | audit | auto")] = "off",
    steps: Annotated[int, typer.Option("--steps", help="Sigma grid points of trajectory rows.")] = 4,
    seed: SeedOpt = 0,
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="Real weights (default: synthetic).")] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="Intra-op CPU threads (default: 1 on cpu).")] = None,
    out: Annotated[Path | None, out_option("ablate/<config>-<layout>")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Run RFC section 6 ablation rows and assert each one's first-drift signature."""
    device = resolve_device(device)
    from h3gate.commands.ablate_cmd import AblateCommand, ablate_command

    settings = AblateCommand(
        row=row,
        all_rows=all_,
        list_rows=list_,
        layout=layout,
        config=config,
        device=device,
        mode=mode,
        steps=steps,
        seed=seed,
        checkpoint=checkpoint,
        threads=threads,
        out=out,
        json=json_,
        force=force,
    )
    run_command(ablate_command, settings)


@app.command()
def validate(
    json_: JsonOpt = False,
) -> None:
    """Load and cross-check every manifest (configs, layouts, tolerances, operators, ablations)."""
    from h3gate.commands.validate_cmd import ValidateCommand, validate_command

    run_command(validate_command, ValidateCommand(json=json_))
