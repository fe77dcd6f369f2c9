"""The parent side of the parallel harness: spawn ``world`` ranks, hand them a job, collect rank 0's results.

Workers are separate processes (``python -m h3gate.parallel.worker --rank R ...``; gloo over a ``file://``
rendezvous). The job travels as JSON (config name, seed, op mode, threads, plans) plus one safetensors file of graph
inputs; every rank regenerates the synthetic weights of the seed. Rank 0 writes, per plan, every node's full value
as it gathered it (safetensors, no pickle).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from h3gate.memory import BIG_MODEL_PARAMS as MAX_PARAMS  # CPU ranks each hold the whole model
from h3gate.parallel.launch import run_ranks
from h3gate.parallel.plans import NotAvailable, Plan, plan_record

TIMEOUT_S = 300
BACKEND = "gloo, CPU, spawned worker processes"
MERGE = "all_gather of raw bytes, concatenated by logical head/channel/row id (no arithmetic)"


@dataclass(frozen=True)
class Job:
    """What every rank runs: the graph of ``config`` on ``inputs`` under each plan of ``plans`` (all of one world)."""

    config: str
    seed: int
    mode: str
    threads: int
    world: int
    plans: dict[str, Plan]
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PlanResult:
    """Rank 0's view of one plan: every node's full (gathered) value, and how much of the graph ran sharded."""

    values: dict[str, torch.Tensor]
    overridden_nodes: int
    rank0_local_shapes: dict[str, list[int]]


def check_supported(device: str, checkpoint: str | None, params: int) -> None:
    """Raise :class:`NotAvailable` for what this harness cannot run: a non-CPU device, a checkpoint, a huge model."""
    if device != "cpu":
        raise NotAvailable(f"the multi-rank harness is CPU gloo only; --device {device} needs an NCCL harness")
    if checkpoint is not None:
        raise NotAvailable("the multi-rank harness regenerates synthetic weights in each worker; no checkpoint path")
    if params > MAX_PARAMS:
        raise NotAvailable(f"{params} parameters on CPU ranks: the gloo harness runs configs up to {MAX_PARAMS}")


def run_job(job: Job) -> dict[str, PlanResult]:
    """Run every plan of ``job`` on ``job.world`` spawned CPU ranks; rank 0's results by plan name."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if any(plan.world != job.world for plan in job.plans.values()):
        raise ValueError(f"every plan of a job runs on its {job.world} ranks")
    spec = {
        "config": job.config,
        "seed": job.seed,
        "mode": job.mode,
        "threads": job.threads,
        "plans": {name: plan_record(plan) for name, plan in job.plans.items()},
    }
    with tempfile.TemporaryDirectory(prefix="h3gate-parallel-") as tmp:
        folder = Path(tmp)
        spec["init_file"] = str(folder / "rendezvous")
        (folder / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in job.inputs.items()}, str(folder / "inputs"))
        errors = run_ranks("h3gate.parallel.worker", job.world, tmp, job.threads, TIMEOUT_S)
        if errors:
            raise NotAvailable("gloo harness failed: " + "; ".join(errors))
        results = {}
        for name in job.plans:
            path = str(folder / f"{name}.safetensors")
            with safe_open(path, framework="pt") as fh:
                meta = fh.metadata() or {}
            results[name] = PlanResult(
                load_file(path),
                int(meta.get("overridden_nodes", 0)),
                json.loads(meta.get("rank0_local_shapes", "{}")),
            )
    return results
