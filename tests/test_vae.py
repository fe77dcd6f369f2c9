"""``h3gate run vae`` (issue 22, part 3): the Phase B contracts on seeded VAEs built from diffusers' own classes, with
negative controls that must fail (the provider's batched video VAE, a wrong encode recipe, a non-repeating call)."""

from __future__ import annotations

import json

import pytest
import torch

from h3gate.evidence.schema import validate_document
from h3gate.runs import vae as vae_run

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _run(run_cli, tmp_path, *args: str) -> tuple[int, dict]:
    code, out, err = run_cli("--quiet", "run", "vae", *args, "--out", tmp_path / "ev", "--json")
    assert code in (0, 1), err
    doc = json.loads(out)
    validate_document(doc, "vae")
    assert json.loads((tmp_path / "ev" / "vae.json").read_text()) == doc
    return code, doc


def _checks(doc: dict) -> dict[str, bool]:
    return {c["check"]: c["pass"] for c in doc["checks"]}


@pytest.mark.parametrize("modality", ["video", "audio"])
def test_strict_encode_decode_pass_every_contract(run_cli, tmp_path, modality) -> None:
    code, doc = _run(run_cli, tmp_path, "--modality", modality)
    assert code == 0 and doc["verdict"] == "pass" and doc["failing_checks"] == [] and all(_checks(doc).values())
    assert doc["execution"] == {"per_item": True, "deterministic_algorithms": True, "tf32": False}
    assert doc["decoded"]["gated"] is False and len(doc["decoded"]["sha256"]) == 64
    if modality == "video":  # 22 frames of 32 x 64 pixels: f16 t4 c24 -> (1, 24, 7, 2, 4), patchified 7 * 1 * 2 rows
        assert (doc["latents"]["shape"], doc["latents"]["rows"]) == ([1, 24, 7, 2, 4], 14)
        assert doc["vae"]["class"] == "AutoencoderKLMiniMaxH3"
    else:  # 22 frames at 24 fps = 29333 samples at 32 kHz: 37 latents per channel, 74 stereo rows
        assert (doc["latents"]["shape"], doc["latents"]["rows"]) == ([2, 32, 37], 74)
    assert doc["latents"]["rows"] == doc["latents"]["layout_rows"]
    assert any(abs(m) > 0 for m in doc["vae"]["latents_mean"]) and len(set(doc["vae"]["latents_std"])) > 1


def test_the_batched_provider_video_vae_is_not_batch_invariant_on_this_cpu(run_cli, tmp_path) -> None:
    """Negative control (measured, not constructed): the provider's one batched call gives an item other bytes beside
    a neighbour than alone; strict mode's one-row calls are what make the contract hold."""
    code, doc = _run(run_cli, tmp_path, "--modality", "video", "--mode", "off")
    assert code == 1 and doc["verdict"] == "fail"
    assert "encode_batch_invariant" in doc["failing_checks"]  # (decode too with more than one thread)
    assert _checks(doc)["encode_repeat_bitwise"] and _checks(doc)["latent_normalisation"]


@pytest.mark.parametrize(
    ("patch", "failing"),
    [
        (lambda mp: mp.setattr(vae_run, "ENCODE_SEED", 41), "latent_normalisation"),  # another posterior draw
        (lambda mp: mp.setattr(vae_run, "PIXEL_STD", (0.5, 0.5, 0.5)), "latent_normalisation"),  # other pixel space
    ],
    ids=["encode-seed", "pixel-std"],
)
def test_a_wrong_encode_recipe_fails_the_normalisation_check(run_cli, tmp_path, monkeypatch, patch, failing) -> None:
    real = vae_run.condition_latents
    patch(monkeypatch)
    monkeypatch.setattr(vae_run, "condition_latents", real)
    code, doc = _run(run_cli, tmp_path, "--modality", "video", "--mode", "off")
    assert code == 1 and failing in doc["failing_checks"]


def test_a_call_that_does_not_repeat_fails_the_repeat_checks(run_cli, tmp_path, monkeypatch) -> None:
    calls = []
    real = vae_run.per_item

    def drifting(mode, fn, x):
        out = real(mode, fn, x)
        calls.append(1)
        return out + len(calls) * torch.finfo(out.dtype).eps * out.abs().max()  # every call lands elsewhere

    monkeypatch.setattr(vae_run, "per_item", drifting)
    code, doc = _run(run_cli, tmp_path, "--modality", "audio")
    assert code == 1 and {"encode_repeat_bitwise", "decode_repeat_bitwise"} <= set(doc["failing_checks"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--modality", "image"], "--modality image: must be one of video, audio"),
        (["--modality", "video", "--mode", "fast"], "--mode fast: must be one of strict, off"),
        (["--modality", "audio", "--geometry", "8k"], "--geometry 8k: must be one of tiny, real"),
        (["--modality", "audio", "--device", "tpu"], "--device 'tpu': must be cpu, cuda or auto"),
    ],
    ids=["modality", "mode", "geometry", "device"],
)
def test_bad_inputs_exit_2_in_one_line_writing_nothing(run_cli, tmp_path, args, message) -> None:
    code, out, err = run_cli("run", "vae", *args, "--out", tmp_path / "ev")
    assert code == 2 and out == "" and err == f"h3gate: error: {message}\n" and not (tmp_path / "ev").exists()


def test_without_diffusers_it_is_a_usage_error_naming_the_dependency(run_cli, tmp_path, monkeypatch) -> None:
    """A plain wheel has no diffusers (an optional runtime dependency): exit 2, one line, nothing written."""
    monkeypatch.setitem(__import__("sys").modules, "diffusers", None)  # import diffusers -> ImportError
    code, out, err = run_cli("run", "vae", "--modality", "audio", "--out", tmp_path / "ev")
    assert code == 2 and out == "" and not (tmp_path / "ev").exists()
    assert (
        err == "h3gate: error: run vae: needs diffusers (pip install 'diffusers==0.42.1'): the VAEs are its classes\n"
    )


def test_a_crash_is_exit_3_never_a_verdict(run_cli, tmp_path, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("simulated VAE bug")

    monkeypatch.setattr(vae_run, "build_vae", boom)
    code, out, err = run_cli("--quiet", "run", "vae", "--modality", "audio", "--out", tmp_path / "ev")
    assert code == 3 and out == "" and not (tmp_path / "ev" / "vae.json").exists()
    assert (
        err.startswith("h3gate: internal error: RuntimeError: simulated VAE bug (traceback in ")
        and err.count("\n") == 1
    )
