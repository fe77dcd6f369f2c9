"""``run vae``: the Phase B contracts of MiniMax-H3's video and audio VAEs, on seeded VAEs built from diffusers' own
classes (``AutoencoderKLMiniMaxH3``, ``AutoencoderKLMiniMaxH3Audio``; diffusers is the optional runtime dependency).

The VAEs keep the release's geometry with tiny widths (``VIDEO_CONFIG``: f16 t4, 24 latent channels, ``17 n + 5``
pixel frames -> ``5 n + 2`` latent frames; ``AUDIO_CONFIG``: 800-sample hop at 32 kHz = 40 latents per second, 32
latent channels, stereo carried as batch 2), weights drawn under ``torch.manual_seed(seed)`` at construction and
hashed into the evidence; ``latents_mean`` / ``latents_std`` are seeded, non-trivial config values.

Execution (``--mode``): ``strict`` runs every encode / decode one batch row at a time (a batch of one: an item's
bytes cannot depend on its neighbours), TF32 off, deterministic algorithms
(:func:`h3gate.numerics.deterministic_algorithms`); ``off`` runs the provider as a user calls it (one batched call,
default algorithms). Checks, each pass / fail:

* ``*_repeat_bitwise`` - the same call twice, byte-equal (encode: the posterior mean and log-variance; decode: the
  samples);
* ``*_batch_invariant`` - the item alone vs at position 1 of a batch beside an unrelated item, byte-equal;
* ``latent_normalisation`` - video: h3gate's statement of the conditioning recipe (ImageNet pixels, the posterior
  sampled under a CPU generator seeded 42, rounded to float16, ``(z - mean) / std`` from the config) equals the
  pipeline's own ``encode_vae_condition`` byte for byte; audio (the pipeline normalises inline, no helper to call):
  h3gate's rows ``((mode^T - mean) / std)`` in channel-major ``(2 T, 32)`` order equal that formula evaluated in
  float64 and rounded once;
* ``latent_layout`` - video: the latent shape is ``(1, 24, video_latent_num_frames(F), H / 16, W / 16)`` (the
  pipeline's helper), h3gate's patchify equals diffusers' ``patchify_video_latents`` byte for byte and its row
  count is the layout's video rows for that latent grid; audio: ``audio_latent_num_frames(F)`` latents per channel,
  ``2 T`` rows = the layout's audio rows.

Decoded media are hashed and recorded but never gated (RFC Phase B exit: latent evidence decides).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from h3gate.errors import InputError
from h3gate.gate.compare import bitwise_equal, error, tensor_sha256
from h3gate.layout import build_layout, patchify_video_latents
from h3gate.manifests.layouts import LayoutSpec
from h3gate.memory import require
from h3gate.numerics import deterministic_algorithms, torch_defaults

MODALITIES = ("video", "audio")
MODES = ("strict", "off")
GEOMETRIES = ("tiny", "real")
# Pixel frames and (H, W) of each geometry: ``real`` is the released ref2va target (124 frames at 768 x 1344, whose
# soundtrack is 207 audio latents); ``tiny`` runs in CI.
FRAMES = {"tiny": 22, "real": 124}
PIXELS = {"tiny": (32, 64), "real": (768, 1344)}
FPS, SAMPLE_RATE, HOP = 24, 32000, 800
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ENCODE_SEED = 42  # the pipeline's keyframe_encode_seed
NORM_ULPS = 1.001  # two float32 roundings (subtract, divide): relative error <= 2u = 1 eps, plus second order
VIDEO_CONFIG = {
    "latent_channels": 24,
    "block_out_channels": (8, 8, 8, 8),
    "layers_per_block": 1,
    "spatial_downsample_factors": (2, 2, 2, 2),
    "temporal_downsample_factors": (1, 2, 2, 1),
    "norm_num_groups": 8,
    "decoder_num_layers": 1,
    "decoder_num_attention_heads": 1,
    "decoder_attention_head_dim": 8,
    "decoder_num_register_tokens": 1,
    "decoder_ffn_mult": 1,
}
AUDIO_CONFIG = {
    "encoder_dim": 2,
    "encoder_rates": (2, 4, 4, 5, 5),
    "latent_dim": 64,
    "latent_channels": 32,
    "num_attention_heads": 2,
    "decoder_dim": 128,
    "decoder_rates": (5, 5, 2, 2, 2, 2, 2),
    "decoder_kernel_sizes": (9, 9, 4, 4, 4, 4, 4),
    "resblock_kernel_sizes": (3,),
    "resblock_dilation_sizes": ((1,),),
    "sampling_rate": SAMPLE_RATE,
}


@dataclass
class VaeRun:
    """One invocation's settings (validated by :func:`check_settings` before any model is built)."""

    modality: str
    mode: str
    device: str
    geometry: str = "tiny"
    seed: int = 0

    @property
    def strict(self) -> bool:
        """Strict execution (module docstring): one batch row per call, deterministic algorithms; else the provider
        as a user calls it. The one place the mode is read."""
        return self.mode == "strict"


def check_settings(run: VaeRun) -> None:
    for flag, value, known in (
        ("--modality", run.modality, MODALITIES),
        ("--mode", run.mode, MODES),
        ("--geometry", run.geometry, GEOMETRIES),
    ):
        if value not in known:
            raise InputError(f"{flag} {value}: must be one of {', '.join(known)}")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise InputError(
            "run vae: needs diffusers (pip install 'diffusers==0.42.1'): the VAEs are its classes"
        ) from None


def _seeded_stats(seed: int, channels: int) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(seed + 1)
    mean = (0.1 * torch.randn(channels, generator=g)).tolist()
    std = (0.5 + 0.5 * torch.rand(channels, generator=g)).tolist()
    return mean, std


def build_vae(modality: str, seed: int, device: str):
    """The seeded VAE of ``modality`` in eval mode on ``device`` and its evidence record."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    cls, cfg = (
        (AutoencoderKLMiniMaxH3, VIDEO_CONFIG) if modality == "video" else (AutoencoderKLMiniMaxH3Audio, AUDIO_CONFIG)
    )
    mean, std = _seeded_stats(seed, cfg["latent_channels"])
    torch.manual_seed(seed)
    vae = cls(**cfg, latents_mean=mean, latents_std=std).eval().to(device)
    digest = hashlib.sha256()
    for name, p in sorted(vae.state_dict().items()):
        digest.update(f"{name}:{tensor_sha256(p)};".encode())
    record = {
        "class": cls.__name__,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "seed": seed,
        "parameters": sum(p.numel() for p in vae.parameters()),
        "weights_sha256": digest.hexdigest(),
        "latents_mean": mean,
        "latents_std": std,
    }
    return vae, record


@contextmanager
def execution(strict: bool):
    """Strict: deterministic algorithms on (inside the run's numerics switch, which has TF32 off); off: torch's
    default numerics, as a user's process runs the VAE; restored on exit."""
    if not strict:
        with torch_defaults():
            yield
        return
    with deterministic_algorithms():
        yield


def per_item(strict: bool, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` over the batch: one row at a time in strict execution, one batched call otherwise."""
    if strict:
        return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    return fn(x)


def compare(check: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """A byte-equality check record (``gate.compare.bitwise_equal``: same dtype, shape and bits), with the largest
    difference when it fails."""
    if bitwise_equal(a, b):
        return {"check": check, "pass": True, "detail": ""}
    detail = f"max |diff| {error(a, b)['max_abs']:.3e}" if a.shape == b.shape else "shapes differ"
    return {"check": check, "pass": False, "detail": detail}


def invariance_checks(
    stage: str, strict: bool, fn: Callable, x: torch.Tensor, other: torch.Tensor
) -> tuple[list[dict], torch.Tensor]:
    """``{stage}_repeat_bitwise`` (``fn`` on ``x`` twice) and ``{stage}_batch_invariant`` (``x`` alone vs after an
    unrelated ``other`` in one batch), ``fn`` run through :func:`per_item`: (the two checks, the first ``fn(x)``)."""
    first = per_item(strict, fn, x)
    beside = per_item(strict, fn, torch.cat([other, x]))[other.shape[0] :]
    return [compare(f"{stage}_repeat_bitwise", first, per_item(strict, fn, x)),
            compare(f"{stage}_batch_invariant", first, beside)], first  # fmt: skip


def _latents_record(latents: torch.Tensor, rows: torch.Tensor, layout_rows: int) -> dict:
    return {"shape": list(latents.shape), "sha256": tensor_sha256(latents), "rows": int(rows.shape[0]),
            "rows_sha256": tensor_sha256(rows), "layout_rows": layout_rows}  # fmt: skip


def _moments(post) -> torch.Tensor:
    """The posterior as one tensor: mean and log-variance (video) or log-std (audio), stacked on the channels."""
    return torch.cat([post.mean, post.logvar if hasattr(post, "logvar") else post.logs], dim=1)


def _layout_rows(latent_frames: int, latent_h: int, latent_w: int, audio_latents: int) -> tuple[int, int]:
    """(video rows, audio rows) of h3gate's packed layout for this latent grid (a t2va layout, one text row)."""

    spec = LayoutSpec(
        text_tokens=1,
        latent_frames=latent_frames,
        latent_height=latent_h,
        latent_width=latent_w,
        audio_latents=audio_latents,
        anchors=[],
    )
    layout = build_layout(spec, "vae-geometry")
    return int(layout.video_indices.numel()), int(layout.audio_indices.numel())


def _pixels(seed: int, item: int, frames: int, h: int, w: int, device: str) -> torch.Tensor:
    key = hashlib.sha256(f"{seed}:vae-pixels:{item}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (1, 3, frames, h, w), generator=g, dtype=torch.uint8).to(device)


def _imagenet(vae, u8: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(PIXEL_MEAN, device=u8.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=u8.device).view(1, -1, 1, 1, 1)
    return (u8.to(torch.float32).div(255.0) - mean) / std


def condition_latents(vae, u8: torch.Tensor) -> torch.Tensor:
    """h3gate's statement of the released conditioning recipe: ImageNet pixels, the posterior *sampled* under a
    CPU generator seeded ``ENCODE_SEED``, rounded to float16, then ``(z - latents_mean) / latents_std``."""
    post = vae.encode(_imagenet(vae, u8), return_dict=False)[0]
    z = post.sample(generator=torch.Generator().manual_seed(ENCODE_SEED)).to(torch.float16).float().cpu()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def pipeline_recipe() -> tuple[tuple, tuple, int]:
    """The pipeline's own pixel mean, pixel std and encode seed (``MiniMaxH3ModularPipeline``'s component
    properties, read from the class: independent of h3gate's constants, which the normalisation check tests)."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as P

    return P.pixel_mean.fget(None), P.pixel_std.fget(None), P.keyframe_encode_seed.fget(None)


def video_checks(run: VaeRun, vae, step: Callable[[str], None] = lambda label: None) -> tuple[list[dict], dict]:
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents as their_patchify
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames, video_latent_num_frames

    frames, (h, w) = FRAMES[run.geometry], PIXELS[run.geometry]
    a, b = (_pixels(run.seed, i, frames, h, w, run.device) for i in (0, 1))
    moments = lambda y: _moments(vae.encode(y, return_dict=False)[0])  # noqa: E731
    step("encode: repeat and batch invariance")
    checks, _ = invariance_checks("encode", run.strict, moments, _imagenet(vae, a), _imagenet(vae, b))
    recipe = pipeline_recipe()
    theirs = encode_vae_condition(vae, a, *recipe)
    checks.append(compare("latent_normalisation", condition_latents(vae, a), theirs))
    want = (1, VIDEO_CONFIG["latent_channels"], video_latent_num_frames(frames, 17, 5), h // 16, w // 16)
    rows = patchify_video_latents(theirs)
    layout_rows, _ = _layout_rows(want[2], want[3], want[4], audio_latent_num_frames(frames))
    ok = (
        tuple(theirs.shape) == want
        and rows.shape[0] == layout_rows
        and torch.equal(rows, their_patchify(theirs, (1, 2, 2)))
    )
    detail = f"latents {tuple(theirs.shape)} (expected {want}); {rows.shape[0]} rows, layout {layout_rows}"
    checks.append({"check": "latent_layout", "pass": bool(ok), "detail": detail})
    mean = torch.tensor(vae.config.latents_mean, device=run.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=run.device).view(1, -1, 1, 1, 1)
    z = theirs.to(run.device) * std + mean  # the pipeline's denormalisation before decode
    zb = encode_vae_condition(vae, b, *recipe).to(run.device) * std + mean
    decode = lambda y: vae.decode(y, return_dict=False)[0]  # noqa: E731
    step("decode: repeat and batch invariance")
    decoded, d1 = invariance_checks("decode", run.strict, decode, z, zb)
    checks += decoded
    pm, ps = (torch.tensor(v, device=run.device).view(1, -1, 1, 1, 1) for v in (PIXEL_MEAN, PIXEL_STD))
    media = ((d1 * ps + pm).clamp(0, 1) * 255).round().to(torch.uint8)
    record = {
        "input": {"pixels": [1, 3, frames, h, w], "dtype": "uint8"},
        "latents": _latents_record(theirs, rows, layout_rows),
        "decoded": {"shape": list(media.shape), "sha256": tensor_sha256(media.cpu()), "gated": False},
    }
    return checks, record


def audio_checks(run: VaeRun, vae, step: Callable[[str], None] = lambda label: None) -> tuple[list[dict], dict]:
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    frames = FRAMES[run.geometry]
    samples = round(frames / FPS * SAMPLE_RATE)  # the pipeline's clip length: num_frames / fps seconds
    g = torch.Generator().manual_seed(run.seed + 7)
    a, b = ((torch.rand(2, 1, samples, generator=g) - 0.5).to(run.device) for _ in range(2))  # stereo = batch 2
    moments = lambda y: _moments(vae.encode(y, return_dict=False)[0])  # noqa: E731
    step("encode: repeat and batch invariance")
    checks, _ = invariance_checks("encode", run.strict, moments, a, b)
    c = vae.config.latent_channels
    mode = per_item(run.strict, lambda y: vae.encode(y, return_dict=False)[0].mode(), a).float().cpu()  # (2, C, T)
    mean, std = (
        torch.tensor(vae.config.latents_mean).view(1, 1, -1),
        torch.tensor(vae.config.latents_std).view(1, 1, -1),
    )
    rows = ((mode.transpose(1, 2) - mean) / std).reshape(-1, c)  # channel-major (2 T, C)
    exact = ((mode.double().transpose(1, 2) - mean.double()) / std.double()).reshape(-1, c)
    ulps = ((rows.double() - exact).abs() / torch.finfo(torch.float32).eps / exact.abs().clamp_min(1e-30)).max().item()
    checks.append(
        {
            "check": "latent_normalisation",
            "pass": bool(ulps <= NORM_ULPS),
            "detail": f"rows vs (mode^T - mean) / std in float64: at most {ulps:.3f} float32 ulp (bound {NORM_ULPS})",
        }
    )
    t = audio_latent_num_frames(frames)
    _, layout_rows = _layout_rows(2, 2, 2, t)
    ok = tuple(mode.shape) == (2, c, t) and rows.shape[0] == layout_rows == 2 * t
    detail = f"latents {tuple(mode.shape)} (expected (2, {c}, {t})); {rows.shape[0]} rows, layout {layout_rows}"
    checks.append({"check": "latent_layout", "pass": bool(ok), "detail": detail})
    z = (rows.reshape(2, t, c).permute(0, 2, 1) * std.view(1, -1, 1) + mean.view(1, -1, 1)).to(run.device)
    zb = per_item(run.strict, lambda y: vae.encode(y, return_dict=False)[0].mode(), b)
    decode = lambda y: vae.decode(y, return_dict=False)[0]  # noqa: E731
    step("decode: repeat and batch invariance")
    decoded, d1 = invariance_checks("decode", run.strict, decode, z, zb)
    checks += decoded
    record = {
        "input": {"waveform": [2, 1, samples], "dtype": "float32", "sample_rate": SAMPLE_RATE},
        "latents": _latents_record(mode, rows, layout_rows),
        "decoded": {"shape": list(d1.shape), "sha256": tensor_sha256(d1.cpu()), "gated": False},
    }
    return checks, record


def pixel_bytes(geometry: str) -> int:
    """A lower bound of the video checks' host or device memory: two clips' float32 pixels (3 channels) and, at
    full resolution, the first encoder block's and the last decoder block's activations (``block_out_channels[0]``
    channels each, three live: input, normalised, output)."""
    frames, (h, w) = FRAMES[geometry], PIXELS[geometry]
    return 2 * frames * h * w * 4 * (3 + 3 * VIDEO_CONFIG["block_out_channels"][0])


def run_vae(run: VaeRun, progress: Callable[[str], None] | None = None) -> dict:
    """The ``vae`` evidence body of one modality (checks, latents, decoded-media hashes, the VAE's record);
    ``progress`` hears each stage (the VAE built, encode, decode)."""
    step = progress or (lambda label: None)
    check_settings(run)
    if run.modality == "video":
        require(pixel_bytes(run.geometry), f"run vae --modality video --geometry {run.geometry}", run.device,
                hint="use --geometry tiny or --device cuda")  # fmt: skip
    step(f"building the seeded {run.modality} VAE")
    vae, vae_record = build_vae(run.modality, run.seed, run.device)
    with execution(run.strict), torch.no_grad():
        # read inside the run's execution: what the calls ran under (off mode keeps torch's defaults, and on CUDA
        # cuDNN's TF32 default is on: docs/gpu-notes.md)
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32 or (run.device != "cpu" and torch.backends.cudnn.allow_tf32))
        deterministic = torch.are_deterministic_algorithms_enabled()
        checks, record = (video_checks if run.modality == "video" else audio_checks)(run, vae, step)
    failing = [c["check"] for c in checks if not c["pass"]]
    return {
        "modality": run.modality,
        "mode": run.mode,
        "device": run.device,
        "geometry": run.geometry,
        "seed": run.seed,
        "execution": {
            "per_item": run.strict,
            "deterministic_algorithms": deterministic,
            "tf32": tf32,
        },
        "vae": vae_record,
        **record,
        "checks": checks,
        "failing_checks": failing,
        "verdict": "pass" if not failing else "fail",
    }
