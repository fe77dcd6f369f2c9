"""The Typer application, its global options and the option types the verbs share (:mod:`h3gate.cli`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help=(
        "h3gate: evidence and gates proving two MiniMax-H3 executions run the same arithmetic. Exit codes: 0 gate "
        "passed, 1 gate failed (evidence written), 2 bad input or usage, 3 internal error (traceback in a file)."
    ),
)
DEBUG = [False]
run_app = typer.Typer(no_args_is_help=True, help="Run a gate: strict kernels vs the provider replay and a golden.")
app.add_typer(run_app, name="run")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Evidence folder (default: a new evidence/local/<verb>/.../<UTC time>-<id>/ per run)."),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Write into an --out folder that already holds evidence, replacing its files.")
]


def out_option(run: str) -> typer.models.OptionInfo:
    """``--out`` naming the verb's default run folder ``evidence/local/<run>/<UTC time>-<id>/``."""
    return typer.Option(
        "--out",
        help=f"Evidence folder (default: a new evidence/local/{run}/<UTC time>-<id>/ per run, 'latest' linked "
        "beside it; a folder holding evidence needs --force).",
    )


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
CandidateOpt = Annotated[
    str,
    typer.Option(
        "--candidate",
        help="What the gate judges: h3gate (its strict kernels) | sglang (SGLang 0.5.23's MiniMax-H3 DiT, forward "
        "only; make install-sglang).",
    ),
]
SglangQualityOpt = Annotated[
    str,
    typer.Option(
        "--sglang-quality",
        help="SGLang's request quality: exact | lossless (its default: the fused RMSNorm + AdaLN site) | high.",
    ),
]
SglangAttentionOpt = Annotated[
    str | None,
    typer.Option("--sglang-attention-backend", help="SGLang's attention backend (default: SGLang's for the device)."),
]
BackwardOpt = Annotated[
    bool | None,
    typer.Option(
        "--backward/--no-backward",
        help="Also gate the backward pass (gradients); default on for the h3gate candidate, off for sglang.",
    ),
]
FaultOpt = Annotated[
    str | None,
    typer.Option(
        "--fault",
        help="Negative control: corrupt one packed row of one node's candidate, NODE:ROW[:scale|zero_tail]"
        "[:forward|backward] (the gate must fail, exit 1).",
    ),
]


Settings = TypeVar("Settings")


def run_command(command: Callable[[Settings], int], settings: Settings) -> NoReturn:
    """Call a command function with its one settings object and exit with the code it returns."""
    raise typer.Exit(command(settings))


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
    DEBUG[0] = debug
