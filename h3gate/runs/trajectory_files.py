"""A trajectory RUNDIR on disk: its manifest, one step file and one digest sidecar per model evaluation.

::

    RUNDIR/manifest.json            kind trajectory-manifest: what the run is (code hash, config, weights, layout,
                                    both sigma grids, seed, mode, device kind, batch composition)
    RUNDIR/steps/step-0003.safetensors   the latents fed to the model at step 3 and the velocities it returned, per
                                    modality (and the unrelated request's latents under --batch-with)
    RUNDIR/steps/step-0003.json     kind trajectory-step: sha256 of every tensor in the step file and of the file

Every file is written atomically (a temp file in its folder, then ``os.replace``); the sidecar is written after
its step file, so a step is complete exactly when its sidecar exists and the file's bytes hash to what it says.
A run interrupted mid-write leaves at most a temp file (``.step-*.tmp``), which is removed on resume.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.errors import InputError
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.writer import atomic_write_safetensors, write_evidence
from h3gate.gate.compare import tensor_sha256
from h3gate.paths import display

MANIFEST = "manifest.json"
STEPS = "steps"
MANIFEST_KIND = "trajectory-manifest"
STEP_KIND = "trajectory-step"


def step_name(step: int) -> str:
    return f"step-{step:04d}"


def write_manifest(rundir: Path, fields: dict) -> Path:
    return write_evidence(rundir, MANIFEST, MANIFEST_KIND, {"run": fields})


def read_manifest(rundir: Path, flag: str = "--resume") -> dict:
    path = rundir / MANIFEST
    if not path.is_file():
        raise InputError(f"{flag} {display(rundir)}: no {MANIFEST} (not a trajectory run folder)")
    try:
        doc = load_json_file(path, display(path), MAX_EVIDENCE_BYTES)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{display(path)}: unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != MANIFEST_KIND or not isinstance(doc.get("run"), dict):
        raise InputError(f"{display(path)}: not a {MANIFEST_KIND} document")
    return doc


def differing_field(saved: dict, now: dict) -> str | None:
    """The first field (dotted, in the manifest's own order) whose value differs between a saved run manifest and
    this invocation's."""
    for key in [*saved, *(k for k in now if k not in saved)]:
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = differing_field(a, b)
            if inner is not None:
                return f"{key}.{inner}"
        elif a != b:
            return key
    return None


def write_step(rundir: Path, step: int, tensors: dict[str, torch.Tensor], record: dict) -> Path:
    """The step file, then its sidecar (digests of every tensor and of the file)."""
    folder = rundir / STEPS
    folder.mkdir(exist_ok=True)
    path = folder / f"{step_name(step)}.safetensors"
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write_safetensors({path: cpu}, {"step": str(step)}, f"{display(rundir)}: step {step}")
    body = {
        "step": step,
        "file": f"{STEPS}/{path.name}",
        "file_sha256": sha256_file(path),
        "tensors": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."), "sha256": tensor_sha256(v)}
            for k, v in cpu.items()
        },  # fmt: skip
        **record,
    }
    write_evidence(folder, f"{step_name(step)}.json", STEP_KIND, body)
    return path


def complete_steps(rundir: Path) -> list[int]:
    """Steps whose sidecar exists, in order; stray temp files of an interrupted write are removed."""
    folder = rundir / STEPS
    if not folder.is_dir():
        return []
    for tmp in folder.glob(".step-*.tmp"):
        tmp.unlink(missing_ok=True)
    steps = sorted(int(p.stem.split("-")[1]) for p in folder.glob("step-*.json"))
    expected = list(range(len(steps)))
    if steps != expected:
        gap = next(s for s, e in zip(steps, expected, strict=False) if s != e) if steps else 0
        raise InputError(f"{display(folder)}: steps are not contiguous from 0 (step {gap} out of place)")
    return steps


def load_step(rundir: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A saved step's tensors, after checking the file's sha256 and every tensor's digest against the sidecar
    (an altered or truncated file is an InputError naming it)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = rundir / STEPS
    side = folder / f"{step_name(step)}.json"
    path = folder / f"{step_name(step)}.safetensors"
    try:
        record = load_json_file(side, display(side), MAX_EVIDENCE_BYTES)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{display(side)}: unreadable sidecar ({exc})") from None
    if not path.is_file():
        raise InputError(f"{display(path)}: missing (its sidecar exists)")
    if sha256_file(path) != record.get("file_sha256"):
        raise InputError(f"{display(path)}: sha256 differs from its sidecar (altered or truncated)")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{display(path)}: unreadable ({exc})") from None
    for name, info in record.get("tensors", {}).items():
        if name not in tensors or tensor_sha256(tensors[name]) != info["sha256"]:
            raise InputError(f"{display(path)}: tensor {name} does not match its sidecar digest")
    return tensors, record


def digest(values: dict[str, torch.Tensor]) -> str:
    """One sha256 over named tensor digests (sorted by name)."""
    text = "".join(f"{k}:{tensor_sha256(v)}\n" for k, v in sorted(values.items()))
    return hashlib.sha256(text.encode()).hexdigest()
