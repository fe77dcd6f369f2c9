"""Checkpoint fingerprints (RFC #420 section 2): the manifest's identity, and a checkpoint checked against it.

``manifest_fingerprint`` summarises what the manifest pins (architecture, config, the inventory the config implies,
the FP32 boundary, scheduler, variants, upstream revision) and hashes it: sha256 of the canonical JSON
(``sort_keys``, ``(",", ":")`` separators, ASCII) of every other field.

``check_checkpoint`` reads safetensors HEADERS ONLY and compares every stored tensor's name, shape and dtype with
``expected_inventory(config, manifest.precision)``; with ``hash_tensors`` it also streams each tensor's raw bytes
through sha256 (from the header offsets, never through torch).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3gate.checkpoint import ITEMSIZE, CheckpointDir, open_checkpoint, parse_diffusers_config, read_json
from h3gate.errors import InputError
from h3gate.inventory import TensorSpec, expected_inventory
from h3gate.manifests.checkpoint_manifest import CheckpointManifest, PrecisionMap
from h3gate.manifests.model_config import ModelConfig, load_config
from h3gate.paths import display


def canonical_sha256(body: Any) -> str:
    """sha256 of ``json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)``."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def config_body(cfg: ModelConfig) -> dict[str, Any]:
    body = cfg.model_dump()
    body["patch_size"] = list(cfg.patch_size)
    return body


def inventory_summary(specs: list[TensorSpec]) -> dict[str, Any]:
    """Tensor and parameter totals, per group and per dtype (with bytes)."""
    groups: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "parameters": 0})
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "parameters": 0, "bytes": 0})
    for s in specs:
        groups[s.group]["tensors"] += 1
        groups[s.group]["parameters"] += s.numel
        dtypes[s.dtype]["tensors"] += 1
        dtypes[s.dtype]["parameters"] += s.numel
        dtypes[s.dtype]["bytes"] += s.numel * ITEMSIZE[s.dtype]
    return {
        "tensors": len(specs),
        "parameters": sum(s.numel for s in specs),
        "bytes": sum(d["bytes"] for d in dtypes.values()),
        "groups": dict(groups),
        "dtypes": dict(dtypes),
    }


def precision_body(precision: PrecisionMap, specs: list[TensorSpec]) -> dict[str, Any]:
    return {
        "default_dtype": precision.default_dtype,
        "fp32_dtype": precision.fp32_dtype,
        "fp32_modules": list(precision.fp32_modules),
        "computed_fp32": list(precision.computed_fp32),
        "fp32_tensors": [s.name for s in specs if s.dtype == precision.fp32_dtype],
    }


def manifest_fingerprint(manifest: CheckpointManifest) -> dict[str, Any]:
    """The manifest's identity plus the inventory its config implies, and the sha256 of all of it."""
    cfg = manifest.config
    specs = expected_inventory(cfg, manifest.precision)
    body: dict[str, Any] = {
        "name": manifest.name,
        "architecture": manifest.architecture,
        "model_family": manifest.model_family,
        "config": config_body(cfg),
        "derived": {
            "inner_dim": cfg.inner_dim,
            "rotary_dim": cfg.rotary_dim,
            "video_patch_dim": cfg.video_patch_dim,
            "adaln_width": cfg.adaln_width,
        },
        "inventory": inventory_summary(specs),
        "precision": precision_body(manifest.precision, specs),
        "scheduler": manifest.scheduler.model_dump(),
        "variants": {k: v.model_dump() for k, v in manifest.variants.items()},
        "upstream": manifest.upstream.model_dump(),
    }
    body["content_sha256"] = canonical_sha256(body)
    return body


def resolve_config(config: str | Path, ckpt: CheckpointDir) -> tuple[ModelConfig, str]:
    """``auto`` -> the checkpoint's config.json; a ``.json`` path -> that diffusers config; else a config manifest."""
    if str(config) == "auto":
        cfg = ckpt.config()
        assert cfg is not None  # opened with require_config=True
        return cfg, display(ckpt.path / "config.json")
    if str(config).endswith(".json"):
        return parse_diffusers_config(read_json(Path(config)), display(Path(config))), display(Path(config))
    return load_config(config).config, str(config)


def config_differences(cfg: ModelConfig, manifest_cfg: ModelConfig) -> list[dict[str, Any]]:
    """Config fields whose value differs from the manifest's: ``{field, checkpoint, manifest}`` each."""
    released = config_body(manifest_cfg)
    return [
        {"field": k, "checkpoint": v, "manifest": released[k]} for k, v in config_body(cfg).items() if v != released[k]
    ]


def config_note(differences: list[dict[str, Any]], config_source: str) -> str | None:
    """Why a checkpoint whose config differs from the manifest's can still match (None when nothing differs)."""
    if not differences:
        return None
    fields = ", ".join(d["field"] for d in differences)
    return (
        f"{len(differences)} config field(s) differ from the manifest ({fields}). The expected inventory is computed "
        f"from the config the checkpoint is checked with ({config_source}), not from the manifest's, so tensor "
        "names, shapes and dtypes (and the manifest's FP32 boundary) can all match; the manifest fixes the "
        "released sizes. A match means a consistent checkpoint of that config, not the released model."
    )


def check_checkpoint(
    path: str | Path,
    config: str | Path = "auto",
    manifest: CheckpointManifest | None = None,
    hash_tensors: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Compare a checkpoint's stored tensors (headers only) with the inventory its config implies.

    ``mismatched`` lists every expected tensor whose shape or dtype differs; ``precision_boundary.violations`` is
    the subset that crosses the FP32 boundary (an FP32-module tensor not stored float32, or another tensor stored
    float32). ``match`` is true when nothing is missing, unexpected or mismatched. ``config_differences`` and
    ``config_note`` say how the config differs from the manifest's and why that does not decide ``match``.
    ``progress(label)`` is called before each tensor is hashed.
    """
    if manifest is None:
        raise InputError("check_checkpoint: a checkpoint manifest is required")
    ckpt = open_checkpoint(path, require_config=str(config) == "auto")
    cfg, config_source = resolve_config(config, ckpt)
    precision = manifest.precision
    specs = expected_inventory(cfg, precision)
    expected = {s.name: s for s in specs}
    found = {n: ckpt.entry(n) for n in ckpt.names()}

    missing = [n for n in expected if n not in found]
    unexpected = [{"name": n, "shape": list(e.shape), "dtype": e.dtype} for n, e in found.items() if n not in expected]
    mismatched, violations = [], []
    for name, spec in expected.items():
        e = found.get(name)
        if e is None:
            continue
        problems = [k for k, bad in (("shape", e.shape != spec.shape), ("dtype", e.dtype != spec.dtype)) if bad]
        if problems:
            mismatched.append(
                {
                    "name": name,
                    "problems": problems,
                    "expected_shape": list(spec.shape),
                    "found_shape": list(e.shape),
                    "expected_dtype": spec.dtype,
                    "found_dtype": e.dtype,
                }
            )
        want_fp32 = spec.dtype == precision.fp32_dtype
        if want_fp32 != (e.dtype == precision.fp32_dtype):
            violations.append(
                {"name": name, "side": "fp32" if want_fp32 else "default", "expected": spec.dtype, "found": e.dtype}
            )

    fp32_names = [s.name for s in specs if s.dtype == precision.fp32_dtype]
    differences = config_differences(cfg, manifest.config)
    report: dict[str, Any] = {
        "path": str(ckpt.path),  # as given; real_path resolves every symbolic link
        "real_path": str(ckpt.real_path),
        "outside_folder": list(ckpt.outside),
        "config_source": config_source,
        "config": config_body(cfg),
        "config_matches_manifest": not differences,
        "config_differences": differences,
        "config_note": config_note(differences, config_source),
        "layout": "sharded" if ckpt.weight_map is not None else "single",
        "shards": ckpt.shards(),
        "expected": {"tensors": len(specs), "parameters": sum(s.numel for s in specs)},
        "found": {"tensors": len(found), "parameters": sum(e.numel for e in found.values())},
        "missing": missing,
        "unexpected": unexpected,
        "mismatched": mismatched,
        "precision_boundary": {
            "ok": not violations,
            "fp32_modules": list(precision.fp32_modules),
            "fp32_tensors_expected": len(fp32_names),
            "fp32_tensors_found": sum(1 for n in fp32_names if n in found and found[n].dtype == precision.fp32_dtype),
            "violations": violations,
        },
        "tensor_sha256": None,
        "match": not (missing or unexpected or mismatched or violations),
    }
    if hash_tensors:
        report["tensor_sha256"] = hash_stored_tensors(ckpt, sorted(found), progress)
    return report


def hash_stored_tensors(
    ckpt: CheckpointDir, names: list[str], progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """``{tensors: {name: sha256}, combined}``: each tensor's raw bytes streamed through sha256, in ``names`` order."""
    hashes = {}
    for name in names:
        if progress is not None:
            progress(f"sha256 {name}")
        hashes[name] = ckpt.tensor_sha256(name)
    return {"tensors": hashes, "combined": canonical_sha256(hashes)}
