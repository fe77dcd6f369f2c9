"""``h3gate layout``: build a packed layout and print its rows (table or JSON), optionally save its tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError
from rich.table import Table

from h3gate.commands.console import stdout_console
from h3gate.errors import EXIT_PASS, InputError
from h3gate.evidence.writer import atomic_write_safetensors
from h3gate.layout import PackedLayout, build_layout
from h3gate.manifests.layouts import LayoutSpec, load_layout
from h3gate.manifests.loader import describe_validation_error

DEFAULT_LAYOUT = "tiny"
FLAGS = {
    "text_tokens": "--text-tokens",
    "latent_frames": "--latent-frames",
    "latent_height": "--latent-height",
    "latent_width": "--latent-width",
    "audio_latents": "--audio-latents",
    "anchors": "--anchor",
    "text_vision_rows": "--text-vision-rows",
}
GEOMETRY = ("text_tokens", "latent_frames", "latent_height", "latent_width", "audio_latents")


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``path`` atomically (temp file in the same folder, then ``os.replace``)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise InputError(f"--save {path}: must end in .safetensors")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise InputError(f"--save {path}: folder {path.parent} {what}")
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


def spec_from_flags(geometry: dict[str, int | None], anchors: list[str], vision_rows: list[str]) -> LayoutSpec:
    """A custom layout from the five geometry flags (all required) plus anchors and vision rows."""
    for field in GEOMETRY:
        if geometry.get(field) is None:
            raise InputError(f"{FLAGS[field]}: required when any geometry flag is given (give all five, or a NAME)")
    data = {**geometry, "anchors": list(anchors), "text_vision_rows": parse_vision_rows(vision_rows)}
    try:
        return LayoutSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        message = describe_validation_error(exc).split(": ", 1)[-1]
        value = f" {err['input']!r}" if field in GEOMETRY or field == "anchors" else ""
        raise InputError(f"{FLAGS.get(field, field)}{value}: {message}") from None


def resolve_layout(
    name: str | None, geometry: dict[str, int | None], anchors: list[str], vision_rows: list[str]
) -> PackedLayout:
    given = [FLAGS[k] for k, v in geometry.items() if v is not None]
    given += ["--anchor"] * bool(anchors) + ["--text-vision-rows"] * bool(vision_rows)
    if name is not None:
        if given:
            raise InputError(f"layout {name!r}: {', '.join(given)} cannot be combined with a layout NAME")
        return build_layout(load_layout(name), name)
    if not given:
        return build_layout(load_layout(DEFAULT_LAYOUT), DEFAULT_LAYOUT)
    return build_layout(spec_from_flags(geometry, anchors, vision_rows), "custom")


def layout_summary(layout: PackedLayout) -> dict:
    """What the built tensors say: row counts by index tensor and by tag, and a sha256 per tensor."""
    tags = torch.bincount(layout.token_tags, minlength=3).tolist()
    return {
        "name": layout.name,
        "spec": layout.spec.model_dump(mode="json"),
        "seq_len": layout.seq_len,
        "rows": layout.rows_per_modality(),
        "condition_video_rows": layout.num_condition_video_rows,
        "condition_audio_rows": layout.num_condition_audio_rows,
        "rows_by_tag": {"video(0)": tags[0], "text(1)": tags[1], "audio(2)": tags[2]},
        "sha256": layout.tensor_hashes(),
    }


def layout_command(
    name: str | None,
    text_tokens: int | None,
    latent_frames: int | None,
    latent_height: int | None,
    latent_width: int | None,
    audio_latents: int | None,
    anchors: list[str],
    text_vision_rows: list[str],
    save: Path | None,
    json_: bool,
) -> int:
    geometry = {
        "text_tokens": text_tokens,
        "latent_frames": latent_frames,
        "latent_height": latent_height,
        "latent_width": latent_width,
        "audio_latents": audio_latents,
    }
    layout = resolve_layout(name, geometry, anchors, text_vision_rows)
    summary = layout_summary(layout)
    if save is not None:
        metadata = {"layout": layout.name, "spec": json.dumps(summary["spec"], sort_keys=True)}
        save_safetensors(save, layout.tensors(), metadata)
        summary["saved"] = str(save)
    if json_:
        print(json.dumps(summary, indent=2))
        return EXIT_PASS
    table = Table(title=f"layout {layout.name}: S = {layout.seq_len}")
    table.add_column("modality")
    table.add_column("rows (index tensor)", justify="right")
    table.add_column("of which condition", justify="right")
    table.add_column("rows by tag", justify="right")
    by_tag = summary["rows_by_tag"]
    table.add_row("text", str(summary["rows"]["text"]), "-", str(by_tag["text(1)"]))
    table.add_row("video", str(summary["rows"]["video"]), str(layout.num_condition_video_rows), str(by_tag["video(0)"]))
    table.add_row("audio", str(summary["rows"]["audio"]), str(layout.num_condition_audio_rows), str(by_tag["audio(2)"]))
    console = stdout_console()
    console.print(table)
    if save is not None:
        console.print(f"saved {', '.join(layout.tensors())} to {save}")
    return EXIT_PASS
