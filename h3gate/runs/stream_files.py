"""A streamed whole-model gate's RUNDIR (:mod:`h3gate.runs.model_stream`): its plan, boundaries and range reports.

::

    RUNDIR/plan.json                          what the run is (settings, code_sha256, ranges, lanes, disk plan)
    RUNDIR/boundaries/before-block-5/forward/<lane>.safetensors    every lane's live values before block 5
    RUNDIR/boundaries/before-block-5/forward.json                  their sha256 and each lane's refusal
    RUNDIR/boundaries/before-block-5/backward/<lane>.safetensors   every saving lane's incoming gradients there
    RUNDIR/boundaries/before-block-5/backward.json
    RUNDIR/boundaries/end/forward/...         the lanes' values after the last stage (the model's outputs)
    RUNDIR/ranges/5-10.json                   phase 2 of blocks 5 .. 9: its partial report
    RUNDIR/ws1-model.json                     phase 3: the merged record

Every file is written atomically (temp file, ``os.replace``); a boundary's sidecar is written after its tensor
files, so a boundary is stored exactly when its sidecar exists and every file hashes to what it says. Ranks sharing
phase 1 by lane each write their lanes' files and a ``<direction>.rank-R.part`` (JSON, not evidence), which rank 0
joins into the sidecar and removes. safetensors and JSON only; every JSON is an evidence document
(``schemas/ws1-model-stream-plan``, ``ws1-model-boundary``, ``ws1-model-range``), so ``h3gate seal`` takes the
folder. Folder convention: :mod:`h3gate.evidence.runfolder`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.errors import InputError
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.writer import atomic_write_safetensors, atomic_write_text, write_evidence
from h3gate.paths import display

PLAN = "plan.json"
PLAN_KIND = "ws1-model-stream-plan"
RANGE_KIND = "ws1-model-range"
BOUNDARY_KIND = "ws1-model-boundary"
BOUNDARIES = "boundaries"
RANGES = "ranges"
DIRECTIONS = ("forward", "backward")


def boundary_name(block: int | None) -> str:
    """The folder of the boundary before ``block`` (``None``: after the last stage)."""
    return "end" if block is None else f"before-block-{block}"


def lane_slug(name: str) -> str:
    return name.replace(" ", "-").replace("@", "at")


def range_name(a: int, b: int) -> str:
    return f"{a}-{b}"


def write_doc(rundir: Path, rel: str, kind: str, body: dict) -> Path:
    """An evidence document (provenance stamped, schema ``kind`` validated, atomic); a read document's own
    ``kind``, ``schema_version`` and ``provenance`` are restamped."""
    body = {k: v for k, v in body.items() if k not in ("kind", "schema_version", "provenance")}
    return write_evidence(rundir, rel, kind, body)


def read_json(path: Path, kind: str, what: str) -> dict:
    try:
        doc = load_json_file(path, display(path), MAX_EVIDENCE_BYTES)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{display(path)}: unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise InputError(f"{display(path)}: not a {what}")
    return doc


def read_plan(rundir: Path, flag: str) -> dict:
    path = rundir / PLAN
    if not path.is_file():
        raise InputError(f"{flag} {display(rundir)}: no {PLAN} (not a streamed ws1-model run folder)")
    return read_json(path, PLAN_KIND, f"{PLAN_KIND} document")


def _write_lanes(folder: Path, direction: str, tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict]:
    """Each lane's tensors in ``folder/direction/<lane>.safetensors``; per lane its file, sha256 and tensor count."""
    (folder / direction).mkdir(parents=True, exist_ok=True)
    files = {}
    for lane, values in tensors.items():
        path = folder / direction / f"{lane_slug(lane)}.safetensors"
        cpu = {k: v.detach().contiguous().cpu() for k, v in values.items()}
        atomic_write_safetensors({path: cpu}, {"lane": lane}, f"{display(path)}")
        files[lane] = {"file": f"{direction}/{path.name}", "sha256": sha256_file(path), "tensors": len(cpu)}
    return files


def _sidecar(rundir: Path, block: int | None, direction: str, files: dict, refused: dict, seconds: dict) -> None:
    rel = f"{BOUNDARIES}/{boundary_name(block)}/{direction}.json"
    body = {"direction": direction, "block": block, "lanes": files, "refused": refused}
    write_doc(rundir, rel, BOUNDARY_KIND, body | ({"seconds": seconds} if seconds else {}))


def write_boundary(
    rundir: Path,
    block: int | None,
    direction: str,
    tensors: dict[str, dict[str, torch.Tensor]],
    refused: dict,
    seconds: dict[str, float] | None = None,
) -> None:
    """Every lane's tensors (``lane -> name -> tensor``), then the sidecar naming their sha256, refusals and the
    seconds each lane spent reaching them (``seconds``, phase 1's clock)."""
    folder = rundir / BOUNDARIES / boundary_name(block)
    _sidecar(rundir, block, direction, _write_lanes(folder, direction, tensors), refused, seconds or {})


def part_path(rundir: Path, block: int | None, direction: str, rank: int) -> Path:
    return rundir / BOUNDARIES / boundary_name(block) / f"{direction}.rank-{rank}.part"


def write_boundary_part(
    rundir: Path, block: int | None, direction: str, tensors: dict, refused: dict, seconds: dict, rank: int
) -> None:
    """One rank's lanes of a boundary (phase 1 split by lane over ranks): their tensor files, then a part file
    (JSON, not evidence: :func:`join_boundary` folds the parts into the sidecar and removes them)."""
    folder = rundir / BOUNDARIES / boundary_name(block)
    files = _write_lanes(folder, direction, tensors)
    part = {"lanes": files, "refused": refused, "seconds": seconds}
    atomic_write_text(part_path(rundir, block, direction, rank), json.dumps(part))


def join_boundary(rundir: Path, block: int | None, direction: str, world: int, order: list[str]) -> None:
    """The sidecar of a boundary whose lanes ``world`` ranks wrote (:func:`write_boundary_part`), lanes in
    ``order`` (the plan's: the sidecar a single rank writes), then the parts removed."""
    parts = [json.loads(part_path(rundir, block, direction, r).read_text(encoding="utf-8")) for r in range(world)]
    merged = {key: {k: v for p in parts for k, v in p[key].items()} for key in ("lanes", "refused", "seconds")}
    ordered = {key: {n: merged[key][n] for n in order if n in merged[key]} for key in merged}
    _sidecar(rundir, block, direction, ordered["lanes"], ordered["refused"], ordered["seconds"])
    for r in range(world):
        part_path(rundir, block, direction, r).unlink()


def phase1_seconds(rundir: Path) -> dict[str, dict[str, float]]:
    """Per direction, per lane: phase 1's seconds summed over the stored boundaries' sidecars (empty where they
    name none)."""
    out: dict[str, dict[str, float]] = {d: {} for d in DIRECTIONS}
    for path in sorted((rundir / BOUNDARIES).glob("*/*.json")):
        side = read_json(path, BOUNDARY_KIND, "boundary sidecar")
        for lane, sec in side.get("seconds", {}).items():
            out[side["direction"]][lane] = round(out[side["direction"]].get(lane, 0.0) + sec, 4)
    return out


def stored(rundir: Path, block: int | None, direction: str) -> bool:
    return (rundir / BOUNDARIES / boundary_name(block) / f"{direction}.json").is_file()


def read_boundary(
    rundir: Path, block: int | None, direction: str, device: str, lanes: list[str] | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """(lane -> name -> tensor on ``device``, lane -> refusal) of a stored boundary, each file checked against
    its sidecar's sha256 (an altered or truncated file is an InputError naming it)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = rundir / BOUNDARIES / boundary_name(block)
    side = read_json(folder / f"{direction}.json", BOUNDARY_KIND, "boundary sidecar")
    out = {}
    for lane, info in side["lanes"].items():
        if lanes is not None and lane not in lanes:
            continue
        path = folder / info["file"]
        if not path.is_file():
            raise InputError(f"{display(path)}: missing (its sidecar exists)")
        if sha256_file(path) != info["sha256"]:
            raise InputError(f"{display(path)}: sha256 differs from its sidecar (altered or truncated)")
        try:
            out[lane] = load_file(str(path), device=device)
        except (SafetensorError, OSError) as exc:
            raise InputError(f"{display(path)}: unreadable ({exc})") from None
    return out, side["refused"]


def range_path(rundir: Path, a: int, b: int) -> Path:
    return rundir / RANGES / f"{range_name(a, b)}.json"


def write_range(rundir: Path, a: int, b: int, body: dict) -> Path:
    return write_doc(rundir, f"{RANGES}/{range_name(a, b)}.json", RANGE_KIND, body)


def write_plan(rundir: Path, body: dict) -> Path:
    return write_doc(rundir, PLAN, PLAN_KIND, body)


def read_range(rundir: Path, a: int, b: int) -> dict:
    return read_json(range_path(rundir, a, b), RANGE_KIND, f"{RANGE_KIND} document")
