"""``h3gate schedule``: print the shifted sigma grid and timesteps (table or JSON), optionally save them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from h3gate.commands.console import print_verdict, stdout_console
from h3gate.commands.layout_cmd import check_save_path, save_safetensors
from h3gate.errors import EXIT_PASS
from h3gate.memory import require, require_steps
from h3gate.schedule import Schedule, build_schedule, sigma_hash

PRINT_BYTES_PER_STEP = 4096  # a grid point's Python floats, JSON text and table row (~2.2 KB measured)


def schedule_summary(schedule: Schedule) -> dict:
    """The grid as floats (each float32 value exactly, as a double) and its sha256."""
    return {
        "steps": schedule.steps,
        "shift": schedule.shift,
        "num_evaluations": schedule.num_evaluations,
        "sigmas": [float(s) for s in schedule.sigmas.tolist()],
        "timesteps": [float(t) for t in schedule.timesteps.tolist()],
        "sigma_sha256": sigma_hash(schedule),
    }


@dataclass(frozen=True)
class ScheduleCommand:
    """``schedule``'s settings: sigma grid points (terminal 0 included), the timestep shift, an optional file."""

    steps: int
    shift: float = 12.0
    save: Path | None = None
    json: bool = False


def schedule_command(settings: ScheduleCommand) -> int:
    """Build the schedule, optionally save it, print it; 0."""
    save = settings.save
    require_steps(settings.steps)
    if save is not None:
        check_save_path(save)
    require(PRINT_BYTES_PER_STEP * settings.steps, f"--steps {settings.steps} (the printed grid)")
    schedule = build_schedule(settings.steps, settings.shift)
    summary = schedule_summary(schedule)
    if save is not None:
        metadata = {
            "steps": str(schedule.steps),
            "shift": repr(schedule.shift),
            "sigma_sha256": summary["sigma_sha256"],
        }
        save_safetensors(save, {"sigmas": schedule.sigmas, "timesteps": schedule.timesteps}, metadata)
        summary["saved"] = str(save)
    if settings.json:
        print(json.dumps({**summary, "verdict": "complete"}, indent=2))
        return EXIT_PASS
    table = Table(
        title=f"schedule: {schedule.steps} points, shift {schedule.shift:g}, {schedule.num_evaluations} evaluations"
    )
    table.add_column("index", justify="right")
    table.add_column("sigma", justify="right")
    table.add_column("timestep (1 - sigma)", justify="right")
    for index, sigma in enumerate(summary["sigmas"]):
        timestep = summary["timesteps"][index] if index < schedule.num_evaluations else None
        table.add_row(str(index), f"{sigma:.9g}", "-" if timestep is None else f"{timestep:.9g}")
    console = stdout_console()
    console.print(table)
    console.print(f"sigma sha256 {summary['sigma_sha256']}")
    if save is not None:
        console.print(f"saved sigmas, timesteps to {save}")
    print_verdict("complete", f"{schedule.steps} sigmas, {schedule.num_evaluations} timesteps", console=console)
    return EXIT_PASS
