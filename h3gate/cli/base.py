"""The Typer application, its global options and the option types the verbs share (:mod:`h3gate.cli`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help=(
        "h3gate: evidence and gates proving two MiniMax-H3 executions run the same arithmetic. Exit codes: 0 gate "
        "passed, 1 gate failed (evidence written), 2 bad input or usage, 3 internal error (traceback in a file)."
    ),
)
DEBUG = [False]
# The global flags: given after the verb as well (``h3gate ablate H5 --quiet``), main() moves them before it.
GLOBAL_FLAGS = ("--quiet", "-q", "--debug", "--wide")
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


def global_flags_first(argv: list[str]) -> list[str]:
    """``argv`` with every global flag (:data:`GLOBAL_FLAGS`) moved before the verb, so ``h3gate ablate H5 --quiet``
    means ``h3gate --quiet ablate H5``; nothing after a ``--`` moves."""
    end = argv.index("--") if "--" in argv else len(argv)
    flags = [a for a in argv[:end] if a in GLOBAL_FLAGS]
    return flags + [a for a in argv[:end] if a not in GLOBAL_FLAGS] + argv[end:]


def versions() -> str:
    """``h3gate X (torch Y, triton Z, python W)``, read from the installed distributions (nothing imported)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from h3gate import __version__

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"h3gate {__version__} (torch {of('torch')}, triton {of('triton')}, python {platform.python_version()})"


def _print_version(value: bool) -> None:
    if value:
        print(versions())
        raise typer.Exit(0)


@app.callback()
def _global_options(
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress lines on stderr (results and errors still print).")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="On an internal error (exit 3), print the traceback to stderr.")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Every table column, however narrow the terminal (default: fit it).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the versions and exit."),
    ] = False,
) -> None:
    """Options that apply to every verb, before or after it: ``h3gate --quiet run ws1-block`` or ``h3gate run
    ws1-block --quiet``."""
    from h3gate.commands.console import set_quiet, set_wide

    set_quiet(quiet)
    set_wide(wide)
    DEBUG[0] = debug
