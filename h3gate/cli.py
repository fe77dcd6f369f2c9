"""The command line: thin verbs that parse options, call one function, and return an exit code.

Exit codes: 0 gate passed, 1 gate failed (evidence still written), 2 bad input or usage (one line naming the
thing), 3 internal error (one line; the traceback goes to a file, or to stderr with ``--debug``).

This is the only module that knows about Typer, and :func:`main` is the one error boundary: an
:class:`~h3gate.errors.InputError` anywhere below becomes one line on stderr and exit code 2; any other exception
becomes exit 3, never 1.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Annotated

import click
import typer

from h3gate.errors import EXIT_INPUT, EXIT_INTERNAL, InputError, crash_folder
from h3gate.numerics import resolve_device

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help=(
        "h3gate: evidence and gates proving two MiniMax-H3 executions run the same arithmetic. Exit codes: 0 gate "
        "passed, 1 gate failed (evidence written), 2 bad input or usage, 3 internal error (traceback in a file)."
    ),
)
_DEBUG = [False]
run_app = typer.Typer(no_args_is_help=True, help="Run a gate: strict kernels vs the provider replay and a golden.")
app.add_typer(run_app, name="run")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Evidence folder (default: evidence/local/<verb>).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu | cuda | auto (cuda when available).")]
ModelConfigOpt = Annotated[
    str | None,
    typer.Option("--config", help="tiny | real | PATH.yaml (default: the checkpoint's config.json, else tiny)."),
]
CheckpointOpt = Annotated[
    Path | None, typer.Option("--checkpoint", help="diffusers transformer folder (else seeded synthetic weights).")
]
ModeOpt = Annotated[str, typer.Option("--mode", help="strict | audit | auto | off")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the synthetic weights and inputs.")]
MergeOpt = Annotated[
    str, typer.Option("--merge-order", help="single (one-walk kernels) | seg8 (the TP merge order: the _seg8 twins).")
]
TolOpt = Annotated[str, typer.Option("--tolerance", help="Tolerance profile name or path.")]
FaultOpt = Annotated[
    str | None,
    typer.Option(
        "--fault",
        help="Negative control: corrupt one packed row of one node's candidate, NODE:ROW[:scale|zero_tail]"
        "[:forward|backward] (the gate must fail, exit 1).",
    ),
]


def _done(code: int) -> None:
    raise typer.Exit(code)


@app.callback()
def _global_options(
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress lines on stderr (results and errors still print).")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="On an internal error (exit 3), print the traceback to stderr.")
    ] = False,
) -> None:
    """Options that apply to every verb (given before it: ``h3gate --quiet run ws1-block``)."""
    from h3gate.commands.console import set_quiet

    set_quiet(quiet)
    _DEBUG[0] = debug


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
    from h3gate.commands.layout_cmd import layout_command

    _done(
        layout_command(
            name,
            text_tokens,
            latent_frames,
            latent_height,
            latent_width,
            audio_latents,
            anchor or [],
            text_vision_rows or [],
            save,
            json_,
            task,
            ref or [],
        )
    )


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
    from h3gate.commands.schedule_cmd import schedule_command

    _done(schedule_command(steps, shift, save, json_))


@app.command("synth-checkpoint")
def synth_checkpoint(
    out: Annotated[Path, typer.Option("--out", help="Checkpoint folder to write.")],
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic weights.")] = 0,
    shard_size: Annotated[int | None, typer.Option("--shard-size", help="Shard above this many bytes.")] = None,
    variant: Annotated[
        str, typer.Option("--variant", help="transformer (FL2VA/T2VA) | transformer_ref (Ref2VA) weights.")
    ] = "transformer",
) -> None:
    """Write a seeded diffusers-layout checkpoint (config.json + safetensors, sharded with an index)."""
    from h3gate.commands.checkpoint_cmd import synth_command

    _done(synth_command(config, seed, out, shard_size, variant))


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
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Fingerprint the manifest, or check a checkpoint's headers against the inventory its config implies."""
    from h3gate.commands.checkpoint_cmd import fingerprint_command

    _done(fingerprint_command(manifest, checkpoint, config, hash_tensors, out, json_))


@app.command()
def compare(
    run_a: Annotated[Path, typer.Argument(help="A ws1-trajectory RUNDIR.")],
    run_b: Annotated[Path, typer.Argument(help="Another ws1-trajectory RUNDIR (same layout and sigma grids).")],
    device: DeviceOpt = "auto",
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Two trajectory runs step by step: byte equality per modality, drift size, and the first drifting step re-run
    with node capture on both sides to name the first node, layer, packed row and modality."""
    device = resolve_device(device)
    from h3gate.commands.compare_cmd import compare_command

    _done(compare_command(run_a, run_b, device, out, json_))


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
) -> None:
    """Schema-validate every evidence JSON under FOLDER and seal it (or verify an existing seal)."""
    from h3gate.commands.seal_cmd import seal_command

    _done(seal_command(folder, verify, key, pubkey))


@app.command()
def report(
    paths: Annotated[list[Path], typer.Argument(help="Evidence files or folders (sealed or not).")],
    out: Annotated[
        Path, typer.Option("--out", help="Folder for index.html and the figures' PNGs (a previous report is replaced).")
    ],
    open_: Annotated[bool, typer.Option("--open", help="Open the page in a web browser once written.")] = False,
) -> None:
    """Write the evidence as one self-contained HTML page (figures inline, nothing loaded from the network) plus
    the figures as PNG. Needs matplotlib: pip install 'h3gate\\[report]'."""
    from h3gate.commands.report_cmd import report_command

    _done(report_command(paths, out, open_))


@app.command()
def keygen(
    out: Annotated[Path, typer.Option("--out", help="Private key file to write (KEY.pub is written next to it).")],
) -> None:
    """Write a new Ed25519 key for signing seals: KEY (PEM PKCS8, mode 0600) and KEY.pub; never overwrites."""
    from h3gate.commands.keygen_cmd import keygen_command

    _done(keygen_command(out))


@run_app.command("ws1-block")
def run_ws1_block(
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "tiny",
    config: ModelConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    device: DeviceOpt = "auto",
    mode: ModeOpt = "strict",
    backward: Annotated[
        bool, typer.Option("--backward/--no-backward", help="Also gate the backward pass (gradients).")
    ] = True,
    tolerance: TolOpt = "ws1-block",
    seed: SeedOpt = 0,
    save_tensors: Annotated[
        Path | None,
        typer.Option("--save-tensors", help="Write inputs/provider/candidate/golden .safetensors into this folder."),
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
    merge_order: MergeOpt = "single",
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The one-block gate: block 0 as 17 nodes, provider replay vs strict candidate vs FP64 golden."""
    device = resolve_device(device)
    from h3gate.commands.run_cmd import ws1_block_command

    _done(
        ws1_block_command(
            layout,
            config,
            checkpoint,
            device,
            mode,
            backward,
            tolerance,
            seed,
            save_tensors,
            out,
            json_,
            fault_matrix=fault_matrix,
            fault=fault,
            merge=merge_order,
        )  # fmt: skip
    )


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
        bool, typer.Option("--backward/--no-backward", help="Also gate the complete backward (every gradient).")
    ] = True,
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
            help="Write inputs (diffusers' forward arguments) and provider/candidate/golden node values there.",
        ),
    ] = None,
    fault: FaultOpt = None,
    merge_order: MergeOpt = "single",
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The whole-model gate: every node of every stage and every gradient, provider vs strict vs FP64 golden."""
    device = resolve_device(device)
    from h3gate.commands.model_cmd import ws1_model_command

    _done(
        ws1_model_command(
            layout,
            config,
            checkpoint,
            device,
            mode,
            backward,
            layers,
            tolerance,
            seed,
            save_tensors,
            out,
            json_,
            fault=fault,
            merge=merge_order,
        )  # fmt: skip
    )


@run_app.command("ws1-trajectory")
def run_ws1_trajectory(
    out: OutOpt = None,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "micro",
    config: ModelConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="Sigma grid points (steps - 1 model evaluations).")] = 6,
    shift: Annotated[float, typer.Option("--shift", help="The video grid's shift (audio keeps 3.0).")] = 12.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic weights and the request.")] = 0,
    mode: Annotated[str, typer.Option("--mode", help="strict | audit | auto | off (the provider)")] = "strict",
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
    json_: JsonOpt = False,
) -> None:
    """A dual-scheduler trajectory saved one model evaluation at a time in --out RUNDIR: resumable, verifiable."""
    device = resolve_device(device)
    from h3gate.commands.trajectory_cmd import ws1_trajectory_command
    from h3gate.runs.ws1_trajectory import TrajectorySettings

    settings = TrajectorySettings(layout, config, checkpoint, device, mode, steps, shift, seed, batch_with)
    _done(ws1_trajectory_command(settings, out, until, resume, verify_last, json_))


@run_app.command("arms")
def run_arms(
    arms: Annotated[
        str, typer.Option("--arms", help="Training/rollout operators: P/P,R/P,P/R,R/R (P provider, R strict).")
    ] = "P/P,R/P,P/R,R/R",
    config: ModelConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml.")] = "micro",
    layers: Annotated[int | None, typer.Option("--layers", help="Keep the config's first N blocks.")] = None,
    steps: Annotated[
        int,
        typer.Option(
            "--steps", help="Sigma grid points, as the pipeline's num_inference_steps (steps - 1 evaluations)."
        ),
    ] = 4,
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
            help="NODE:ROW[:scale|zero_tail][:forward|backward] on R training's second pass (negative control).",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Train/rollout arms on diffusers' own module: velocity bytes per step, first drift, gradient repeat, LoRA gate."""
    device = resolve_device(device)
    from h3gate.arms.stack import ArmsSettings, parse_arms
    from h3gate.commands.arms_cmd import arms_command

    settings = ArmsSettings(
        parse_arms(arms), config, checkpoint, layout, layers, device, steps, shift, batch, lora_rank, seed, fault
    )
    _done(arms_command(settings, out, json_))


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
        typer.Option("--fault", help="RANK:NODE:ROW[:forward|backward]: one row scaled on one rank (repeatable)."),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu | cuda (default cpu).")] = "cpu",
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """TP/CP/SP ranks against TP1 (one device, seg8 merge order): every value and gradient byte for byte."""
    from h3gate.commands.ws2_cmd import ws2_command
    from h3gate.parallel.ws2 import Ws2Settings

    settings = Ws2Settings(topology, scope, backend, resolve_device(device), config, layout, seed, fault or [])
    _done(ws2_command(settings, out, json_))


@run_app.command("vae")
def run_vae(
    modality: Annotated[str, typer.Option("--modality", help="video | audio")],
    mode: Annotated[str, typer.Option("--mode", help="strict (one batch row a call, deterministic) | off")] = "strict",
    device: DeviceOpt = "auto",
    geometry: Annotated[str, typer.Option("--geometry", help="tiny (CI) | real (124 frames at 768x1344).")] = "tiny",
    seed: SeedOpt = 0,
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Phase B: a seeded VAE (diffusers' class) encode/decode repeat-bitwise, batch-invariant, its latent
    normalisation and layout against the pipeline's helpers; decoded media hashed, not gated."""
    device = resolve_device(device)
    from h3gate.commands.vae_cmd import vae_command

    _done(vae_command(modality, mode, device, geometry, seed, out, json_))


@run_app.command("ws1-ops")
def run_ws1_ops(
    op: Annotated[list[str] | None, typer.Option("--op", help="Operator name (repeatable; default all).")] = None,
    layouts: Annotated[str, typer.Option("--layouts", help="Comma-separated layouts giving row counts.")] = "tiny",
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml (widths and dtypes).")] = "tiny",
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Per-operator evidence: accuracy vs FP32/FP64, invariance, provider-bitwise flag, kernel id."""
    device = resolve_device(device)
    from h3gate.commands.ops_cmd import ws1_ops_command

    _done(ws1_ops_command(op or [], layouts, config, device, seed, out, json_))


@app.command()
def bench(
    target: Annotated[str | None, typer.Argument(help="ws1-block | ws1-model, or leave empty and pass --op.")] = None,
    op: Annotated[list[str] | None, typer.Option("--op", help="Operator name (repeatable).")] = None,
    layout: Annotated[str, typer.Option("--layout", help="A layout of manifests/layouts.yaml (row count).")] = "medium",
    config: Annotated[str, typer.Option("--config", help="tiny | real | PATH.yaml (widths and dtypes).")] = "real",
    merge_order: Annotated[
        str,
        typer.Option("--merge-order", help="seg8: also time the strict path in the TP merge order (a third arm)."),
    ] = "single",
    device: DeviceOpt = "cuda",
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Time strict kernels next to the provider in one run (median of CUDA-event timings): operators (--op), the
    block (ws1-block), or the whole model forward and forward + backward (ws1-model)."""
    from h3gate.commands.bench_cmd import bench_command, check_bench_merge

    check_bench_merge(target, merge_order)
    device = resolve_device(device)

    _done(bench_command(target, op or [], layout, config, device, out, json_, merge_order))


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
    out: OutOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run RFC section 6 ablation rows and assert each one's first-drift signature."""
    device = resolve_device(device)
    from h3gate.commands.ablate_cmd import ablate_command

    _done(ablate_command(row, all_, list_, layout, config, device, out, json_, mode, steps, seed, checkpoint, threads))


@app.command()
def validate(
    json_: JsonOpt = False,
) -> None:
    """Load and cross-check every manifest (configs, layouts, tolerances, operators, ablations)."""
    from h3gate.commands.validate_cmd import validate_command

    _done(validate_command(json_))


def _click_errors() -> tuple[type[BaseException], ...]:
    """Usage-error classes of Typer's bundled click copy and of click itself (whichever is in use)."""
    classes: list[type[BaseException]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as TyperClickException

        classes.append(TyperClickException)
    except ImportError:  # older Typer uses click directly
        pass
    return tuple(classes)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: the single error boundary."""
    try:
        code = app(args=argv, standalone_mode=False)
    except InputError as exc:
        print(f"h3gate: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except (click.exceptions.Exit, typer.Exit) as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except (click.exceptions.Abort, typer.Abort):
        print("h3gate: aborted", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except _click_errors() as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # help was printed: not an error
            sys.exit(0)
        print(f"h3gate: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except Exception as exc:  # noqa: BLE001 - the one boundary: every other exception is exit 2 (memory) or 3
        if _out_of_memory(exc):
            # A request too large for the machine that slipped past the estimates: one line, exit 2.
            print(f"h3gate: error: out of memory ({type(exc).__name__}): {_first_line(exc)}", file=sys.stderr)
            sys.exit(EXIT_INPUT)
        where = _save_traceback()
        print(f"h3gate: internal error: {type(exc).__name__}: {_first_line(exc)} ({where})", file=sys.stderr)
        sys.exit(EXIT_INTERNAL)
    sys.exit(code if isinstance(code, int) else 0)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _out_of_memory(exc: BaseException) -> bool:
    """Host or device allocation failures (torch raises RuntimeError / OutOfMemoryError for them)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _save_traceback() -> str:
    """Write the active exception's traceback (to stderr with --debug, else to --out or a temp file)."""
    text = traceback.format_exc()
    if _DEBUG[0]:
        sys.stderr.write(text)
        return "traceback above"
    folder = crash_folder()
    try:
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            path = Path(folder) / "h3gate-traceback.txt"
            path.write_text(text, encoding="utf-8")
        else:
            fd, name = tempfile.mkstemp(prefix="h3gate-traceback-", suffix=".txt")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            path = Path(name)
    except OSError:
        sys.stderr.write(text)
        return "traceback above: it could not be written to a file"
    return f"traceback in {path}"
