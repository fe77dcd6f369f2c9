"""Ref2VA through the gates (issue 22, part 2): the ``transformer_ref/`` variant's synthetic weights, run ws1-block
and a six-evaluation ws1-trajectory on a Ref2VA layout, the ablation rows H16 and H-C7 on the real Ref2VA path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from h3gate.ablate.runner import run_ablation
from h3gate.checkpoint import open_checkpoint
from h3gate.errors import InputError
from h3gate.manifests.ablations import load_ablations
from h3gate.manifests.layouts import load_layout
from h3gate.manifests.model_config import load_config
from h3gate.synth import SyntheticSource, layout_variant, tensor_seed

TINY = load_config("tiny").config
NAME = "transformer_blocks.0.attn.to_q.weight"


def test_the_ref_variant_has_its_own_tensors_and_transformer_keeps_its_bytes() -> None:
    """transformer/ hashes f"{seed}:{name}" as it always did (so every earlier synthetic tensor is unchanged);
    transformer_ref/ another stream, different from every transformer/ seed's; a bad variant fails closed."""
    assert tensor_seed(0, NAME) == tensor_seed(0, NAME, "transformer")
    plain, ref = SyntheticSource(TINY, 0), SyntheticSource(TINY, 0, variant="transformer_ref")
    assert plain.names() == ref.names() and plain.meta(NAME) == ref.meta(NAME)
    assert not torch.equal(plain.load(NAME), ref.load(NAME))
    assert all(not torch.equal(SyntheticSource(TINY, s).load(NAME), ref.load(NAME)) for s in range(4))
    assert torch.equal(ref.load(NAME), SyntheticSource(TINY, 0, variant="transformer_ref").load(NAME))
    assert ref.record()["variant"] == "transformer_ref" and ref.drawn_on("cpu").variant == "transformer_ref"
    with pytest.raises(InputError, match=r"^weights variant 'vae': must be one of transformer, transformer_ref$"):
        SyntheticSource(TINY, 0, variant="vae")
    assert (layout_variant("ref2va"), layout_variant("fl2va"), layout_variant("t2va")) == (
        "transformer_ref", "transformer", "transformer"
    )  # fmt: skip


def test_synth_checkpoint_writes_the_ref_variant(run_cli, tmp_path) -> None:
    out = tmp_path / "repo" / "transformer_ref"
    code, _, err = run_cli("synth-checkpoint", "--out", out, "--variant", "transformer_ref", "--seed", "3")
    assert code == 0, err
    ckpt = open_checkpoint(tmp_path / "repo", "transformer_ref")
    want = SyntheticSource(TINY, 3, variant="transformer_ref")
    assert all(torch.equal(ckpt.load(n), want.load(n)) for n in (NAME, "proj_out.weight"))
    with safe_open(str(ckpt.files[0]), "pt") as fh:
        assert fh.metadata()["h3gate_variant"] == "transformer_ref" and fh.metadata()["h3gate_seed"] == "3"
    code, out_, err = run_cli("synth-checkpoint", "--out", tmp_path / "x", "--variant", "vae")
    assert code == 2 and out_ == "" and not (tmp_path / "x").exists()
    assert err == "h3gate: error: --variant vae: must be one of transformer, transformer_ref\n"


@pytest.mark.slow  # 20 s on two cores: make test-slow (.ci/run runs both)
@pytest.mark.usefixtures("one_thread")
def test_ws1_block_on_a_ref2va_layout_runs_the_ref_weights_and_passes(run_cli, tmp_path) -> None:
    code, out, err = run_cli("--quiet", "run", "ws1-block", "--layout", "ref2va-tiny", "--out", tmp_path, "--json")
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["verdict"] == "pass" and doc["failing_checks"] == []
    assert doc["checkpoint"] == {"kind": "synthetic", "path": None, "seed": 0, "variant": "transformer_ref"}
    leaves = doc["backward"]["leaves"]
    assert doc["layout"]["name"] == "ref2va-tiny" and len(leaves) == 14 and all(g["pass"] for g in leaves.values())
    assert len(doc["nodes"]) == 17 and all(n["pass"] for n in doc["nodes"])


@pytest.mark.slow  # 12 s on two cores: make test-slow (.ci/run runs both)
@pytest.mark.usefixtures("one_thread")
def test_a_six_step_ref2va_trajectory_holds_every_reference_row(run_cli, tmp_path) -> None:
    """Six model evaluations (seven grid points) on ref2va-tiny with transformer_ref/ weights: every step saved; the
    reference rows (video condition rows and the audio reference rows) are never stepped, the target rows are."""
    rundir = tmp_path / "run"
    code, _, err = run_cli("--quiet", "run", "ws1-trajectory", "--layout", "ref2va-tiny", "--steps", "7",
                           "--out", rundir)  # fmt: skip
    assert code == 0, err[-3000:]
    doc = json.loads((rundir / "ws1-trajectory.json").read_text())
    assert (doc["verdict"], doc["evaluations"], doc["complete"]) == ("pass", 6, True)
    assert doc["run"]["weights"]["variant"] == "transformer_ref"
    spec = load_layout("ref2va-tiny")
    from h3gate.layout import build_layout

    layout = build_layout(spec, "ref2va-tiny")
    nc, nca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    assert nc > 0 and nca > 0
    steps = [load_file(str(rundir / "steps" / f"step-{k:04d}.safetensors")) for k in range(6)]
    for prev, cur in zip(steps, steps[1:], strict=False):
        assert torch.equal(prev["video_latents"][:nc], cur["video_latents"][:nc])
        assert torch.equal(prev["audio_latents"][:nca], cur["audio_latents"][:nca])
        assert not torch.equal(prev["video_latents"][nc:], cur["video_latents"][nc:])
        assert not torch.equal(prev["audio_latents"][nca:], cur["audio_latents"][nca:])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("layout", "run_variant", "other"), [("ref2va-tiny", "transformer_ref", "transformer")])
def test_h15_h16_and_h_c7_on_the_ref2va_path(layout, run_variant, other) -> None:
    from h3gate.ablate.engine import build_context

    rows = load_ablations()
    ctx = build_context("tiny", layout, "cpu")
    assert ctx.variant == run_variant and "transformer_ref/" in ctx.execution["weights"]
    h16 = run_ablation("H16", rows["H16"], ctx)
    assert h16["verdict"] == "pass" and h16["observed"]["result"] == "EXPECTED_DRIFT"
    assert any(f"from {other}/" in n for n in h16["notes"]), h16["notes"]
    assert h16["param_drift"] and all(p.startswith("transformer_blocks.0.") for p in h16["param_drift"])
    h15 = run_ablation("H15", rows["H15"], ctx)  # its condition rows are the reference rows: no anchors added
    assert h15["verdict"] == "pass" and h15["layout"] == layout, h15["observed"]
    assert h15["observed"]["signature"]["row"] == 64  # the first reference video row (the image's)
    hc7 = run_ablation("H-C7", rows["H-C7"], ctx)
    paths = hc7["diagnostics"]["paths"]
    assert hc7["verdict"] == "pass" and [(p["layout"], p["variant"]) for p in paths] == [(layout, run_variant)]
    assert paths[0]["layout_sha256"]["num_condition_video_rows"] == "56" and paths[0]["components_hashed"] > 0


def test_path_name_marks_a_checkpoint_variant(tmp_path) -> None:
    from h3gate.runs.setup import config_for
    from h3gate.synth import write_checkpoint

    write_checkpoint(SyntheticSource(TINY, 1, variant="transformer_ref"), 1, tmp_path / "transformer_ref")
    *_, record, _ = config_for(None, Path(tmp_path / "transformer_ref"), 0, "ref2va")
    assert record["variant"] == "transformer_ref" and record["kind"] == "checkpoint"


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_ws1_model_on_a_ref2va_layout_passes_with_the_ref_weights(run_cli, tmp_path) -> None:
    """The whole-model gate (every node and gradient) on ref2va-tiny over transformer_ref/ weights (about a minute on
    two cores: make test-slow)."""
    code, out, err = run_cli("--quiet", "run", "ws1-model", "--layout", "ref2va-tiny", "--out", tmp_path, "--json")
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["verdict"] == "pass" and doc["failing_checks"] == []
    assert doc["checkpoint"]["variant"] == "transformer_ref" and doc["layout"]["name"] == "ref2va-tiny"
