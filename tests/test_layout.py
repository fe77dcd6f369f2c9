"""Layout manifests, PackedLayout properties, patch pack/unpack and the ``h3gate layout`` verb (no oracle)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, safe_open

from h3gate.errors import InputError
from h3gate.layout import build_layout, patchify_video_latents, unpatchify_video_latents
from h3gate.manifests.layouts import LayoutSpec, layout_names, load_layout, load_layouts

GOOD = {"text_tokens": 10, "latent_frames": 2, "latent_height": 4, "latent_width": 6, "audio_latents": 3}
# S = 10 text + 2 frames * (2 * 3) video + 2 * 3 audio
GOOD_S = 28
FRAMES_MESSAGE = "must be of the form 5n+2 (the video VAE encodes its 17n+5 pixel-frame grid to 5n+2 latent frames)"


def write_manifest(tmp_path: Path, **overrides) -> Path:
    path = tmp_path / "layouts.yaml"
    path.write_text(yaml.safe_dump({"layouts": {"medium": {**GOOD, **overrides}}}))
    return path


def test_named_layouts_and_declared_lengths() -> None:
    assert layout_names() == [
        "768p",
        "medium",
        "micro",
        "micro-odd",
        "ref2va-768p",
        "ref2va-medium",
        "ref2va-tiny",
        "small",
        "tiny",
    ]
    expected = {
        "micro": (84, {"text": 24, "video": 48, "audio": 12}, 16),
        "micro-odd": (83, {"text": 23, "video": 48, "audio": 12}, 16),
        "tiny": (264, {"text": 120, "video": 128, "audio": 16}, 0),
        "small": (925, {"text": 83, "video": 768, "audio": 74}, 96),
        "medium": (3160, {"text": 206, "video": 2880, "audio": 74}, 640),
        "768p": (38974, {"text": 256, "video": 38304, "audio": 414}, 1008),
    }
    for name, (seq_len, rows, cond) in expected.items():
        layout = build_layout(load_layout(name), name)
        assert (layout.seq_len, layout.rows_per_modality(), layout.num_condition_video_rows) == (seq_len, rows, cond)
        assert layout.num_condition_audio_rows == 0
        assert layout.position_ids.dtype == torch.float64 and layout.position_ids.shape == (seq_len, 3)
        rows_all = torch.cat([layout.text_indices, layout.video_indices, layout.audio_indices])
        assert torch.equal(rows_all.sort().values, torch.arange(seq_len))  # a partition of the rows
        for tensor in (layout.token_tags, layout.video_indices, layout.audio_indices, layout.text_indices):
            assert tensor.dtype == torch.int64 and tensor.ndim == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"audio_latents": 0}, "layouts.medium.audio_latents: must be > 0"),
        ({"text_tokens": -3}, "layouts.medium.text_tokens: must be > 0"),
        ({"text_tokens": "ten"}, "layouts.medium.text_tokens: must be an integer"),
        ({"latent_frames": 4}, f"layouts.medium.latent_frames: {FRAMES_MESSAGE}, got 4"),
        ({"latent_height": 5}, "layouts.medium.latent_height: must be a multiple of the spatial patch 2, got 5"),
        ({"latent_width": 7}, "layouts.medium.latent_width: must be a multiple of the spatial patch 2, got 7"),
        ({"anchors": ["middle"]}, "layouts.medium.anchors.0: must be one of 'first' or 'last'"),
        ({"colour": 3}, "layouts.medium.colour: unknown field"),
        ({"text_vision_rows": [[4, 4]]}, "layouts.medium.text_vision_rows: entry 0 (4:4): start must be < end"),
        ({"text_vision_rows": [[-1, 2]]}, "layouts.medium.text_vision_rows: entry 0 (-1:2): start must be >= 0"),
        (
            {"text_vision_rows": [[2, 11]]},
            "layouts.medium.text_vision_rows: entry 0 (2:11): must lie inside the 10 text rows",
        ),
        ({"text_vision_rows": [[5, 8], [1, 6]]}, "layouts.medium.text_vision_rows: 1:6 and 5:8 overlap"),
        ({"seq_len": 0}, "layouts.medium.seq_len: must be > 0"),
    ],
)
def test_manifest_errors_name_the_field(tmp_path: Path, overrides: dict, message: str) -> None:
    path = write_manifest(tmp_path, **overrides)
    with pytest.raises(InputError) as exc:
        load_layouts(path)
    assert str(exc.value) == f"{path}: {message}"


def test_manifest_missing_field_and_adjacent_vision_rows(tmp_path: Path) -> None:
    path = tmp_path / "layouts.yaml"
    path.write_text(yaml.safe_dump({"layouts": {"x": {k: v for k, v in GOOD.items() if k != "latent_width"}}}))
    with pytest.raises(InputError, match=r"layouts\.x\.latent_width: required field missing$"):
        load_layouts(path)
    ok = load_layouts(write_manifest(tmp_path, text_vision_rows=[[5, 10], [0, 5]]))["medium"]
    assert ok.text_vision_rows == [(5, 10), (0, 5)]
    tags = build_layout(ok).token_tags
    assert tags[:10].tolist() == [0] * 10


def test_declared_seq_len_is_checked_against_the_built_layout(tmp_path: Path) -> None:
    assert build_layout(load_layouts(write_manifest(tmp_path, seq_len=GOOD_S))["medium"], "medium").seq_len == GOOD_S
    spec = load_layouts(write_manifest(tmp_path, seq_len=GOOD_S + 1))["medium"]
    with pytest.raises(InputError) as exc:
        build_layout(spec, "medium")
    assert str(exc.value) == f"layout 'medium': seq_len: declared {GOOD_S + 1} but the built layout has {GOOD_S}"


def test_unknown_layout_lists_known_names() -> None:
    with pytest.raises(InputError) as exc:
        load_layout("huge")
    known = "768p, medium, micro, micro-odd, ref2va-768p, ref2va-medium, ref2va-tiny, small, tiny"
    assert str(exc.value) == f"layout 'huge': unknown (known: {known})"


def test_row_modalities_tags_and_adaln_indices() -> None:
    spec = LayoutSpec(**GOOD, anchors=["last"], text_vision_rows=[(2, 5)])
    layout = build_layout(spec)
    # [10 text | 6 condition | 6 audio | 12 video]
    expected = ["text"] * 10 + ["video"] * 6 + ["audio"] * 6 + ["video"] * 12
    assert layout.row_modalities() == expected
    assert [layout.modality_of_row(r) for r in range(layout.seq_len)] == expected
    assert layout.token_tags.tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 1, 1] + [0] * 6 + [2] * 6 + [0] * 12
    timestep, indices = layout.row_timesteps(0.25, 0.5, 0.999, 1.0)
    assert timestep.tolist() == [0.25, 0.5, torch.tensor(0.999, dtype=torch.float32).item()]
    assert indices.tolist() == [0] * 10 + [2] * 6 + [1] * 6 + [0] * 12
    assert torch.equal(layout.adaln_indices(indices), indices * 3 + layout.token_tags)
    assert layout.adaln_indices(indices)[:6].tolist() == [1, 1, 0, 0, 0, 1]
    with pytest.raises(InputError, match=r"row 34 outside \[0, 34\)"):
        layout.modality_of_row(34)


def test_patch_pack_unpack_is_an_exact_inverse() -> None:
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 3, 4, 6, 8, generator=gen, dtype=torch.float64)
    rows = patchify_video_latents(latents)
    assert rows.shape == (2 * 4 * 3 * 4, 3 * 4)
    # Row 0 holds latents[0, :, 0, 0:2, 0:2] flattened (c, dh, dw) with dw fastest.
    assert torch.equal(rows[0], latents[0, :, 0, 0:2, 0:2].reshape(-1))
    assert torch.equal(unpatchify_video_latents(rows, latents.shape), latents)
    bf16 = latents.to(torch.bfloat16)
    assert torch.equal(unpatchify_video_latents(patchify_video_latents(bf16, (2, 2, 2)), bf16.shape, (2, 2, 2)), bf16)
    with pytest.raises(InputError, match=r"video latents: \(T, H, W\) \(4, 6, 8\) not divisible by the patch"):
        patchify_video_latents(latents, (3, 2, 2))
    with pytest.raises(InputError, match="video rows: shape"):
        unpatchify_video_latents(rows[1:], latents.shape)


def geometry_flags(**overrides: str) -> list[str]:
    """The five geometry flags of GOOD as CLI arguments, with some values replaced."""
    values = {**{k: str(v) for k, v in GOOD.items()}, **overrides}
    return [arg for key, value in values.items() for arg in ("--" + key.replace("_", "-"), value)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--text-tokens", "10"],
            "--latent-frames: required when any geometry flag is given (give all five, or a NAME)",
        ),
        (["small", "--audio-latents", "3"], "layout 'small': --audio-latents cannot be combined with a layout NAME"),
        (
            ["nope"],
            "layout 'nope': unknown (known: 768p, medium, micro, micro-odd, ref2va-768p, ref2va-medium, ref2va-tiny, "
            "small, tiny)",
        ),
        (geometry_flags(latent_frames="3"), f"--latent-frames 3: {FRAMES_MESSAGE}, got 3"),
        (geometry_flags(text_tokens="0"), "--text-tokens 0: must be > 0"),
        (geometry_flags(latent_width="5"), "--latent-width 5: must be a multiple of the spatial patch 2, got 5"),
        ([*geometry_flags(), "--anchor", "middle"], "--anchor 'middle': must be one of 'first' or 'last'"),
        (
            [*geometry_flags(), "--text-vision-rows", "3-5"],
            "--text-vision-rows '3-5': expected START:END with integer bounds",
        ),
        (
            [*geometry_flags(), "--text-vision-rows", "8:12"],
            "--text-vision-rows: entry 0 (8:12): must lie inside the 10 text rows",
        ),
        (["tiny", "--save", "out.bin"], "--save out.bin: must end in .safetensors"),
        (
            ["tiny", "--save", "no/such/dir/x.safetensors"],
            "--save no/such/dir/x.safetensors: folder no/such/dir does not exist",
        ),
    ],
)
def test_layout_cli_errors(run_cli, args: list[str], message: str) -> None:
    code, out, err = run_cli("layout", *args)
    assert (code, out, err) == (2, "", f"h3gate: error: {message}\n")


def test_layout_cli_default_is_tiny_and_json_hashes(run_cli) -> None:
    code, out, err = run_cli("layout", "--json")
    assert code == 0 and err == ""
    body = json.loads(out)
    layout = build_layout(load_layout("tiny"), "tiny")
    assert body["name"] == "tiny" and body["seq_len"] == 264
    assert body["rows"] == {"text": 120, "video": 128, "audio": 16}
    assert body["sha256"] == layout.tensor_hashes()
    assert len(set(body["sha256"].values())) == 5
    assert body["sha256"]["text_indices"] == hashlib.sha256(torch.arange(120).numpy().tobytes()).hexdigest()
    code, out, _ = run_cli("layout", "medium")
    assert code == 0 and "S = 3160" in out and "2880" in out and "640" in out


def test_layout_cli_custom_geometry_save_roundtrip(run_cli, tmp_path: Path) -> None:
    target = tmp_path / "custom.safetensors"
    args = ["--text-tokens", "10", "--latent-frames", "2", "--latent-height", "4", "--latent-width", "6"]
    args += ["--audio-latents", "3", "--anchor", "first", "--anchor", "last", "--text-vision-rows", "1:3"]
    code, out, err = run_cli("layout", *args, "--save", target, "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["seq_len"] == GOOD_S + 12
    spec = LayoutSpec(**GOOD, anchors=["first", "last"], text_vision_rows=[(1, 3)])
    built = build_layout(spec).tensors()
    loaded = load_file(target)
    assert sorted(loaded) == sorted(built)
    for key, tensor in built.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    assert loaded["position_ids"].dtype == torch.float64
    with safe_open(target, "pt") as fh:
        assert fh.metadata()["layout"] == "custom"
    assert [p.name for p in tmp_path.iterdir()] == ["custom.safetensors"]  # no temp file left behind


def test_failed_save_leaves_nothing(run_cli, tmp_path: Path) -> None:
    folder = tmp_path / "taken.safetensors"
    folder.mkdir()
    code, _, err = run_cli("layout", "tiny", "--save", folder)
    assert code == 2 and err.startswith(f"h3gate: error: --save {folder}: cannot write")
    assert [p.name for p in tmp_path.iterdir()] == ["taken.safetensors"]
    assert list(folder.iterdir()) == []


def test_packed_rows_counts_what_build_layout_builds():
    """``parse_layouts`` reads S without building a layout: the count equals the built layout's."""
    from h3gate.layout import packed_rows, parse_layouts
    from h3gate.manifests.layouts import load_layouts

    for name, spec in load_layouts().items():
        if name != "768p":  # 38974 rows: the declared seq_len is the check
            assert packed_rows(spec, name) == build_layout(spec, name).seq_len, name
    assert parse_layouts("tiny, 768p") == [("tiny", 264), ("768p", 38974)]
