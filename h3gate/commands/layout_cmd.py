"""``h3gate layout``: build a packed layout and print its rows (table or JSON), optionally save its tensors.

A custom layout comes from the five geometry flags; ``--task ref2va`` adds ``--ref`` reference blocks in packed
order (``image:H:W``, ``video:F:H:W[:A]`` with a soundtrack of A audio latents, ``audio:A``). ``--save`` writes the
five index tensors; the leading reference (condition) video and audio row counts go into the file's metadata.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from h3gate.commands.console import print_verdict, stdout_console
from h3gate.errors import EXIT_PASS, InputError
from h3gate.evidence.writer import atomic_write_safetensors
from h3gate.layout import PackedLayout, build_layout, reference_blocks
from h3gate.manifests.layouts import (
    OPTIONAL_REFERENCE_FIELDS,
    REFERENCE_FIELDS,
    LayoutSpec,
    load_layout,
)
from h3gate.manifests.loader import describe_validation_error
from h3gate.memory import check_writable

DEFAULT_LAYOUT = "tiny"
FLAGS = {
    "text_tokens": "--text-tokens",
    "latent_frames": "--latent-frames",
    "latent_height": "--latent-height",
    "latent_width": "--latent-width",
    "audio_latents": "--audio-latents",
    "anchors": "--anchor",
    "text_vision_rows": "--text-vision-rows",
    "task": "--task",
    "references": "--ref",
}
GEOMETRY = ("text_tokens", "latent_frames", "latent_height", "latent_width", "audio_latents")
REF_FORMS = {"image": "image:H:W", "video": "video:F:H:W[:A]", "audio": "audio:A"}
_ENTRY = re.compile(r"^entry (\d+) \([^)]*\): (.*)$")


def check_save_path(path: Path) -> None:
    """``--save PATH`` before any work: a ``.safetensors`` name in an existing folder that takes a new file."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise InputError(f"--save {path}: must end in .safetensors")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise InputError(f"--save {path}: folder {path.parent} {what}")
    check_writable(path, "--save")


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``path`` atomically (temp file in the same folder, then ``os.replace``)."""
    path = Path(path)
    check_save_path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write_safetensors({path: tensors}, metadata, f"--save {path}")


def parse_vision_rows(values: list[str]) -> list[tuple[int, int]]:
    """``START:END`` strings -> ``[(start, end), ...]``; range checks are the manifest model's."""
    ranges = []
    for value in values:
        start, sep, end = value.partition(":")
        try:
            if not sep:
                raise ValueError
            ranges.append((int(start), int(end)))
        except ValueError:
            raise InputError(f"--text-vision-rows {value!r}: expected START:END with integer bounds") from None
    return ranges


def parse_ref(value: str) -> dict:
    """One ``--ref`` spec -> a reference mapping (``kind`` plus its fields); range checks are the manifest model's."""
    kind, _, rest = value.partition(":")
    if kind not in REF_FORMS:
        raise InputError(f"--ref {value!r}: expected {', '.join(REF_FORMS.values())}")
    required, optional = REFERENCE_FIELDS[kind], OPTIONAL_REFERENCE_FIELDS[kind]
    parts = rest.split(":") if rest else []
    try:
        if not len(required) <= len(parts) <= len(required) + len(optional):
            raise ValueError
        numbers = [int(part) for part in parts]
    except ValueError:
        raise InputError(f"--ref {value!r}: expected {REF_FORMS[kind]} with integer fields") from None
    return {"kind": kind, **dict(zip(required + optional, numbers, strict=False))}


def _flag_error(exc: ValidationError, data: dict, refs: list[str]) -> InputError:
    """The first validation error of a custom spec as one line naming the flag (and its value or ``--ref`` spec)."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"]
    field = str(loc[0]) if loc else ""
    message = describe_validation_error(exc).split(": ", 1)[-1]
    if field == "references":
        if len(loc) > 1 and isinstance(loc[1], int):
            rest = ".".join(str(p) for p in loc[2:])
            return InputError(f"--ref {refs[loc[1]]!r}: {rest + ': ' if rest else ''}{message}")
        entry = _ENTRY.match(message)
        if entry is not None:
            return InputError(f"--ref {refs[int(entry.group(1))]!r}: {entry.group(2)}")
        return InputError(f"--ref: {message}")
    scalar = not isinstance(err["input"], list | dict)
    value = f" {err['input']!r}" if field in (*GEOMETRY, "anchors", "task") and scalar else ""
    return InputError(f"{FLAGS.get(field, field)}{value}: {message}")


def spec_from_flags(
    geometry: dict[str, int | None],
    anchors: list[str],
    vision_rows: list[str],
    task: str | None = None,
    refs: list[str] | None = None,
) -> LayoutSpec:
    """A custom layout from the five geometry flags (all required) plus anchors and vision rows, or ``--task`` and
    its ``--ref`` reference blocks."""
    refs = list(refs or [])
    for field in GEOMETRY:
        if geometry.get(field) is None:
            raise InputError(f"{FLAGS[field]}: required when any geometry flag is given (give all five, or a NAME)")
    if refs and task != "ref2va":
        raise InputError(f"--ref {refs[0]!r}: reference blocks need --task ref2va")
    data: dict = {**geometry, "anchors": list(anchors), "text_vision_rows": parse_vision_rows(vision_rows)}
    if task is not None:
        data.update(task=task, references=[parse_ref(ref) for ref in refs])
    try:
        return LayoutSpec.model_validate(data)
    except ValidationError as exc:
        raise _flag_error(exc, data, refs) from None


def resolve_layout(
    name: str | None,
    geometry: dict[str, int | None],
    anchors: list[str],
    vision_rows: list[str],
    task: str | None = None,
    refs: list[str] | None = None,
) -> PackedLayout:
    """The named layout, else the custom one the flags describe, else the default (``tiny``)."""
    refs = list(refs or [])
    given = [FLAGS[k] for k, v in geometry.items() if v is not None]
    given += ["--anchor"] * bool(anchors) + ["--text-vision-rows"] * bool(vision_rows)
    given += ["--task"] * (task is not None) + ["--ref"] * bool(refs)
    if name is not None:
        if given:
            raise InputError(f"layout {name!r}: {', '.join(given)} cannot be combined with a layout NAME")
        return build_layout(load_layout(name), name)
    if not given:
        return build_layout(load_layout(DEFAULT_LAYOUT), DEFAULT_LAYOUT)
    return build_layout(spec_from_flags(geometry, anchors, vision_rows, task, refs), "custom")


def spec_record(spec: LayoutSpec) -> dict:
    """The spec as JSON; ``task`` and ``references`` only where given (a t2va/fl2va record reads as before)."""
    record = spec.model_dump(mode="json", exclude={"references"})
    if record["task"] is None:
        del record["task"]
    if spec.references:
        record["references"] = [ref.model_dump(mode="json", exclude_none=True) for ref in spec.references]
    return record


def layout_summary(layout: PackedLayout) -> dict:
    """What the built tensors say: row counts by index tensor and by tag, and a sha256 per tensor."""
    tags = torch.bincount(layout.token_tags, minlength=3).tolist()
    return {
        "name": layout.name,
        "task": layout.spec.kind,
        "spec": spec_record(layout.spec),
        "seq_len": layout.seq_len,
        "rows": layout.rows_per_modality(),
        "condition_video_rows": layout.num_condition_video_rows,
        "condition_audio_rows": layout.num_condition_audio_rows,
        "rows_by_tag": {"video(0)": tags[0], "text(1)": tags[1], "audio(2)": tags[2]},
        "sha256": layout.tensor_hashes(),
        **_reference_record(layout),
    }


def _reference_record(layout: PackedLayout) -> dict:
    """A ref2va layout's reference blocks: spec, audio and video row ranges ``[start, end)``, rotary start time."""
    blocks = reference_blocks(layout)
    if not blocks:
        return {}
    audio_start = int(layout.audio_indices[layout.num_condition_audio_rows])
    video_start = int(layout.video_indices[layout.num_condition_video_rows])
    return {
        "references": [
            {"ref": ref.token(), "audio_rows": list(b.audio_rows), "video_rows": list(b.video_rows), "clock": b.clock}
            for ref, b in zip(layout.spec.references, blocks, strict=True)
        ],
        "target": {
            "audio_rows": [audio_start, video_start],
            "video_rows": [video_start, layout.seq_len],
            "clock": float(layout.position_ids[video_start, 0]),
        },
    }


@dataclass(frozen=True)
class LayoutCommand:
    """``layout``'s settings: a named layout (none: ``tiny``), or a custom one from the five geometry fields, its
    anchors, text rows tagged video, ``task`` and ref2va reference blocks ``refs``; an optional file to save to."""

    name: str | None = None
    text_tokens: int | None = None
    latent_frames: int | None = None
    latent_height: int | None = None
    latent_width: int | None = None
    audio_latents: int | None = None
    anchors: tuple[str, ...] = ()
    text_vision_rows: tuple[str, ...] = ()
    task: str | None = None
    refs: tuple[str, ...] = ()
    save: Path | None = None
    json: bool = False


def layout_command(settings: LayoutCommand) -> int:
    """``h3gate layout``: build, optionally save (five tensors; the reference row counts as metadata), print."""
    save = settings.save
    if save is not None:
        check_save_path(save)
    geometry = {field: getattr(settings, field) for field in GEOMETRY}
    anchors, vision_rows, refs = list(settings.anchors), list(settings.text_vision_rows), list(settings.refs)
    layout = resolve_layout(settings.name, geometry, anchors, vision_rows, settings.task, refs)
    summary = layout_summary(layout)
    if save is not None:
        metadata = {
            "layout": layout.name,
            "task": summary["task"],
            "spec": json.dumps(summary["spec"], sort_keys=True),
            "num_condition_video_rows": str(layout.num_condition_video_rows),
            "num_condition_audio_rows": str(layout.num_condition_audio_rows),
        }
        save_safetensors(save, layout.tensors(), metadata)
        summary["saved"] = str(save)
    if settings.json:
        print(json.dumps({**summary, "verdict": "complete"}, indent=2))
        return EXIT_PASS
    console = stdout_console()
    _print_tables(console, layout, summary)
    if save is not None:
        console.print(
            f"saved {', '.join(layout.tensors())} to {save} (metadata: num_condition_video_rows "
            f"{layout.num_condition_video_rows}, num_condition_audio_rows {layout.num_condition_audio_rows})"
        )
    print_verdict("complete", f"layout {layout.name}: {layout.seq_len} packed rows", console=console)
    return EXIT_PASS


def _clock(clock) -> str:
    """A rotary start as ``f, h, w`` (a number as itself)."""
    return ", ".join(str(c) for c in clock) if isinstance(clock, list | tuple) else str(clock)


def _print_tables(console: Console, layout: PackedLayout, summary: dict) -> None:
    """The rows table and, for a ref2va layout, its reference blocks."""
    ref2va = layout.spec.kind == "ref2va"
    title = f"layout {layout.name}{' (ref2va)' if ref2va else ''}: S = {layout.seq_len}"
    table = Table(title=title)
    table.add_column("modality")
    table.add_column("rows (index tensor)", justify="right")
    table.add_column("of which reference" if ref2va else "of which condition", justify="right")
    table.add_column("rows by tag", justify="right")
    by_tag = summary["rows_by_tag"]
    table.add_row("text", str(summary["rows"]["text"]), "-", str(by_tag["text(1)"]))
    table.add_row("video", str(summary["rows"]["video"]), str(layout.num_condition_video_rows), str(by_tag["video(0)"]))
    table.add_row("audio", str(summary["rows"]["audio"]), str(layout.num_condition_audio_rows), str(by_tag["audio(2)"]))
    console.print(table)
    if not ref2va:
        return
    refs = Table(title="reference blocks, in packed order")
    for column in ("#", "reference", "audio rows", "video rows", "rotary start"):
        refs.add_column(column, justify="left" if column == "reference" else "right")
    for index, block in enumerate(summary["references"]):
        spans = [f"{a}:{b}" if b > a else "-" for a, b in (block["audio_rows"], block["video_rows"])]
        refs.add_row(str(index), block["ref"], *spans, _clock(block["clock"]))
    target = summary["target"]
    spans = [f"{a}:{b}" for a, b in (target["audio_rows"], target["video_rows"])]
    refs.add_row("", "target", *spans, _clock(target["clock"]))
    console.print(refs)
