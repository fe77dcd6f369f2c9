"""Ref2VA layouts without the oracle: manifest validation, row accounting, timesteps and ``h3gate layout --task
ref2va`` (save, print, bad input)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, safe_open

from h3gate.errors import InputError
from h3gate.layout import build_layout, packed_rows, reference_blocks
from h3gate.manifests.layouts import LayoutSpec, load_layout, load_layouts

GOOD = {"task": "ref2va", "text_tokens": 10, "latent_frames": 7, "latent_height": 4, "latent_width": 6}
IMAGE = {"kind": "image", "latent_height": 4, "latent_width": 8}
# [10 text | image 2x4 = 8 | video soundtrack 2 x 5 = 10, video 2 frames x 2x3 = 12 | audio 2 x 4 = 8 |
#  target audio 2 x 3 = 6 | target video 7 x 6 = 42]
REFS = [IMAGE, {"kind": "video", "latent_frames": 2, "latent_height": 4, "latent_width": 6, "audio_latents": 5}]
REFS += [{"kind": "audio", "audio_latents": 4}]
GOOD_S = 10 + 8 + 10 + 12 + 8 + 6 + 42
FLAGS = ["--task", "ref2va", "--text-tokens", "10", "--latent-frames", "7", "--latent-height", "4"]
FLAGS += ["--latent-width", "6", "--audio-latents", "3"]
REF_FLAGS = ["--ref", "image:4:8", "--ref", "video:2:4:6:5", "--ref", "audio:4"]


def write_manifest(tmp_path: Path, **overrides) -> Path:
    path = tmp_path / "layouts.yaml"
    path.write_text(yaml.safe_dump({"layouts": {"r": {**GOOD, "audio_latents": 3, "references": REFS, **overrides}}}))
    return path


def test_named_ref2va_layouts_rows() -> None:
    expected = {
        "ref2va-tiny": (182, {"text": 64, "video": 88, "audio": 30}, 56, 18),
        "ref2va-768p": (83386, {"text": 256, "video": 81888, "audio": 1242}, 44592, 828),
    }
    for name, (seq_len, rows, cond_video, cond_audio) in expected.items():
        spec = load_layout(name)
        layout = build_layout(spec, name)
        assert (layout.seq_len, layout.rows_per_modality()) == (seq_len, rows)
        assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == (cond_video, cond_audio)
        assert packed_rows(spec, name) == seq_len and spec.kind == "ref2va"
        rows_all = torch.cat([layout.text_indices, layout.video_indices, layout.audio_indices])
        assert torch.equal(rows_all.sort().values, torch.arange(seq_len))  # a partition of the rows
        assert layout.position_ids.dtype == torch.float64 and layout.position_ids.shape == (seq_len, 3)


def test_blocks_clock_and_tags() -> None:
    layout = build_layout(load_layout("ref2va-tiny"), "ref2va-tiny")
    blocks = reference_blocks(layout)
    assert [(b.kind, b.audio_rows, b.video_rows, b.clock) for b in blocks] == [
        ("image", (64, 64), (64, 88), 64.0),
        ("video", (88, 98), (98, 130), 65.0),  # image: one integer slot
        ("audio", (130, 138), (138, 138), 65.0 + 5.0 / 3.0 * 5),  # 2 frames span 25/3 > 5 soundtrack latents
    ]
    pos = layout.position_ids
    assert pos[150, 0].item() == pos[138, 0].item() == blocks[2].clock + 4.0  # target audio and video share a start
    assert layout.token_tags[:12].tolist() == [1, 1] + [0] * 8 + [1, 1]
    assert layout.row_modalities()[64:150] == ["video"] * 24 + ["audio"] * 10 + ["video"] * 32 + ["audio"] * 20
    # Reference audio rows stay at the clean level, reference video rows at the keyframe level.
    timestep, indices = layout.row_timesteps(0.25, 0.5, 0.999, 1.0)
    assert timestep[indices[88]].item() == 1.0 and timestep[indices[130]].item() == 1.0
    assert timestep[indices[64]].item() == torch.tensor(0.999).item() and timestep[indices[140]].item() == 0.5
    assert reference_blocks(build_layout(load_layout("tiny"), "tiny")) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"references": []}, "layouts.r.references: a ref2va layout needs at least one reference"),
        ({"task": "t2v"}, "layouts.r.task: must be one of 't2va', 'fl2va' or 'ref2va'"),
        ({"anchors": ["first"]}, "layouts.r.anchors: a ref2va layout has no keyframe anchors (fl2va has)"),
        ({"task": "fl2va"}, "layouts.r.anchors: an fl2va layout needs at least one keyframe anchor"),
        ({"task": "t2va"}, "layouts.r.references: only a ref2va layout (task: ref2va) has references"),
        ({"references": [{"kind": "sound"}]},
         "layouts.r.references.0.kind: must be one of 'image', 'video' or 'audio'"),
        ({"references": [{"kind": "image", "latent_height": 4}]},
         "layouts.r.references.0.latent_width: required for an image reference"),
        ({"references": [{**IMAGE, "latent_frames": 2}]},
         "layouts.r.references.0.latent_frames: not a field of an image reference"),
        ({"references": [{**IMAGE, "latent_height": 5}]},
         "layouts.r.references.0.latent_height: must be a multiple of the spatial patch 2, got 5"),
        ({"references": [IMAGE, {**REFS[1], "latent_frames": 4}]},
         "layouts.r.references.1.latent_frames: must be of the form 5n+2 (the video VAE encodes its 17n+5 "
         "pixel-frame grid to 5n+2 latent frames), got 4"),
        ({"references": [IMAGE, {**REFS[1], "audio_latents": 0}]}, "layouts.r.references.1.audio_latents: must be > 0"),
        ({"references": [{**IMAGE, "colour": 1}]}, "layouts.r.references.0.colour: unknown field"),
        ({"references": [{"kind": "audio", "audio_latents": 4}]},
         "layouts.r.references: audio references need at least one image or video reference beside them"),
        ({"references": [IMAGE] * 10}, "layouts.r.references: at most 9 image references, got 10"),
        ({"references": [REFS[1]] * 4}, "layouts.r.references: at most 3 video references, got 4"),
        ({"references": [IMAGE] * 9 + [REFS[2]] * 3 + [REFS[1]]},
         "layouts.r.references: at most 12 references in all, got 13"),
        ({"references": [IMAGE, {**REFS[1], "latent_frames": 12}]},
         "layouts.r.references: entry 1 (video:12:4:6:5): latent_frames 12 exceeds the 7 target latent frames (a "
         "video reference is truncated to the generated duration)"),
    ],
)  # fmt: skip
def test_manifest_errors_name_the_field(tmp_path: Path, overrides: dict, message: str) -> None:
    path = write_manifest(tmp_path, **overrides)
    with pytest.raises(InputError) as exc:
        load_layouts(path)
    assert str(exc.value) == f"{path}: {message}"


def test_declared_seq_len_and_anchors_copied_in(tmp_path: Path) -> None:
    spec = load_layouts(write_manifest(tmp_path, seq_len=GOOD_S))["r"]
    assert build_layout(spec, "r").seq_len == GOOD_S and spec.reference_rows == (20, 18)
    with pytest.raises(InputError, match=rf"^layout 'r': seq_len: declared {GOOD_S + 1} but the built layout has"):
        build_layout(load_layouts(write_manifest(tmp_path, seq_len=GOOD_S + 1))["r"], "r")
    # An engine copying anchors into a ref2va spec (model_copy skips validation) gets an input error, not a layout.
    with pytest.raises(InputError, match="a ref2va layout has task ref2va and no keyframe anchors"):
        build_layout(spec.model_copy(update={"anchors": ["first"]}), "r")


def test_cli_table_json_and_save(run_cli, tmp_path: Path) -> None:
    target = tmp_path / "ref.safetensors"
    code, out, err = run_cli("layout", *FLAGS, *REF_FLAGS, "--text-vision-rows", "1:3", "--save", target, "--json")
    assert (code, err) == (0, "")
    body = json.loads(out)
    assert (body["task"], body["seq_len"]) == ("ref2va", GOOD_S)
    assert (body["condition_video_rows"], body["condition_audio_rows"]) == (20, 18)
    assert [r["ref"] for r in body["references"]] == ["image:4:8", "video:2:4:6:5", "audio:4"]
    assert body["spec"]["references"][0] == IMAGE and body["target"]["video_rows"] == [GOOD_S - 42, GOOD_S]
    spec = LayoutSpec(**GOOD, audio_latents=3, references=REFS, text_vision_rows=[(1, 3)])
    built = build_layout(spec)
    loaded = load_file(target)
    assert sorted(loaded) == sorted(built.tensors())
    for key, tensor in built.tensors().items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(target, "pt") as fh:
        meta = fh.metadata()
    assert (meta["task"], meta["num_condition_video_rows"], meta["num_condition_audio_rows"]) == ("ref2va", "20", "18")
    assert json.loads(meta["spec"])["references"][2] == REFS[2]
    assert [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]

    code, out, err = run_cli("layout", "ref2va-tiny")
    assert (code, err) == (0, "")
    assert "layout ref2va-tiny (ref2va): S = 182" in out and "of which reference" in out
    assert "video:2:8:8:5" in out and "73.33333333333333" in out and "77.33333333333333" in out
    code, out, _ = run_cli("layout", "medium", "--json")  # a t2va/fl2va record reads as before
    assert code == 0 and "task" not in json.loads(out)["spec"] and "references" not in json.loads(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*FLAGS, "--ref", "picture:4:4"], "--ref 'picture:4:4': expected image:H:W, video:F:H:W[:A], audio:A"),
        ([*FLAGS, "--ref", "image:4"], "--ref 'image:4': expected image:H:W with integer fields"),
        ([*FLAGS, "--ref", "image:4:x"], "--ref 'image:4:x': expected image:H:W with integer fields"),
        ([*FLAGS, "--ref", "video:2:4:6:5:1"], "--ref 'video:2:4:6:5:1': expected video:F:H:W[:A] with integer fields"),
        ([*FLAGS, "--ref", "audio"], "--ref 'audio': expected audio:A with integer fields"),
        ([*FLAGS, "--ref", "image:5:8"],
         "--ref 'image:5:8': latent_height: must be a multiple of the spatial patch 2, got 5"),
        ([*FLAGS, "--ref", "audio:0", "--ref", "image:4:4"], "--ref 'audio:0': audio_latents: must be > 0"),
        ([*FLAGS, "--ref", "video:3:4:4"],
         "--ref 'video:3:4:4': latent_frames: must be of the form 5n+2 (the video VAE encodes its 17n+5 pixel-frame "
         "grid to 5n+2 latent frames), got 3"),
        ([*FLAGS, "--ref", "image:4:4", "--ref", "video:12:4:4"],
         "--ref 'video:12:4:4': latent_frames 12 exceeds the 7 target latent frames (a video reference is truncated "
         "to the generated duration)"),
        ([*FLAGS, "--ref", "audio:3"],
         "--ref: audio references need at least one image or video reference beside them"),
        ([*FLAGS, *["--ref", "video:2:4:4"] * 4], "--ref: at most 3 video references, got 4"),
        (FLAGS, "--ref: a ref2va layout needs at least one reference"),
        ([*FLAGS[2:], "--ref", "image:4:4"], "--ref 'image:4:4': reference blocks need --task ref2va"),
        ([*FLAGS, *REF_FLAGS, "--anchor", "first"], "--anchor: a ref2va layout has no keyframe anchors (fl2va has)"),
        (["--task", "ref2va", "--ref", "image:4:4"],
         "--text-tokens: required when any geometry flag is given (give all five, or a NAME)"),
        (["ref2va-tiny", "--task", "ref2va"], "layout 'ref2va-tiny': --task cannot be combined with a layout NAME"),
        (["tiny", "--ref", "image:4:4"], "layout 'tiny': --ref cannot be combined with a layout NAME"),
        (["--task", "v2v", *FLAGS[2:]], "--task 'v2v': must be one of 't2va', 'fl2va' or 'ref2va'"),
    ],
)  # fmt: skip
def test_cli_bad_references_exit_2(run_cli, args: list[str], message: str) -> None:
    code, out, err = run_cli("layout", *args)
    assert (code, out, err) == (2, "", f"h3gate: error: {message}\n")
