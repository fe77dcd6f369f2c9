"""One rank of ``run ws2`` (started by torch's launcher, :func:`h3gate.ranks.run_ranks`: ``python -m
torch.distributed.run ... -m h3gate.parallel.ws2_rank --dir D``; gloo or NCCL).

Reads ``D/spec.json``, ``D/inputs`` and ``D/reference`` (the one-device strict run: every node value ``v:<node>``,
every gradient ``g:<name>``, the cotangents ``c:<output>``), builds its shard of the scope (TP: its heads' and
channels' weights; CP: its packed rows and their metadata), runs one forward and the backward, compares every value
and gradient it holds with the same slice of the reference, byte for byte, and writes ``D/rank-R.json`` (with
``"gather"`` in the spec also ``D/rank-R.safetensors``, what it holds: :mod:`h3gate.parallel.ws2_gather`).
Ranks are laid out TP-innermost: ``rank = cp_rank * tp + tp_rank``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from h3gate.bounded import load_json_file
from h3gate.paths import display
from h3gate.ranks import rank_main
from h3gate.runs.setup import RunSpec, prepare

NCCL_SETTINGS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
                 "NCCL_IB_DISABLE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")  # fmt: skip


def _groups(tp: int, cp: int):
    """Every TP group (consecutive ranks) and CP group (stride tp), created in one order on every rank."""
    import torch.distributed as dist

    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group([t + c * tp for c in range(cp)]) for t in range(tp)]
    return tp_groups, cp_groups


def runtime_record(backend: str, device: str, rank: int, world: int, tp: int, cp: int) -> dict:
    """What the process group and device report at run time (read back, not restated from the request)."""
    import torch.distributed as dist

    rec = {
        "rank": rank,
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "rank_in_world": dist.get_rank(),
        "tp_group": [c * tp + t for c in [rank // tp] for t in range(tp)],
        "cp_group": [rank % tp + c * tp for c in range(cp)],
        "device": str(device),
        "torch": torch.__version__,
        "host_pid": os.getpid(),
    }
    ids = torch.tensor([rank], dtype=torch.int64, device="cpu" if rec["backend"] == "gloo" else device)
    seen = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(seen, ids)
    rec["collective_probe"] = {"all_gather_rank_order": [int(t) for t in seen], "tensor_device": str(ids.device)}
    if device.startswith("cuda"):
        rec["device_name"] = torch.cuda.get_device_name(torch.device(device))
        if backend == "nccl":
            rec["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
            rec["nccl_settings"] = {k: os.environ.get(k, "default") for k in NCCL_SETTINGS}
    return rec


def run_rank(rank: int, world: int, folder: Path) -> None:
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file

    from h3gate.graph import determinism
    from h3gate.graph.determinism import Injection
    from h3gate.parallel.shards import RankPlan
    from h3gate.parallel.ws2_gather import write_shards
    from h3gate.parallel.ws2_partition import Partition
    from h3gate.parallel.ws2_scope import Fault, build_scope, byte_diff, forward_backward, repeat_forward

    spec = load_json_file(folder / "spec.json", display(folder / "spec.json"))
    torch.set_num_threads(spec["threads"])
    tp, cp = spec["tp"], spec["cp"]
    device = spec["device"]
    if device.startswith("cuda"):
        device = f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
        torch.cuda.set_device(torch.device(device))
    # TP1's run on this rank's device: bad input fails every rank alike, before any rank waits on another
    run = prepare(RunSpec.from_record(spec["run"]).with_(device=device))
    cfg = run.cfg
    dist.init_process_group(spec["backend"], init_method=f"file://{spec['init_file']}", rank=rank, world_size=world)
    tp_groups, cp_groups = _groups(tp, cp)
    scope = build_scope(run)
    inputs = {k: v.to(device) for k, v in load_file(str(folder / "inputs")).items()}
    ops = run.tables()["candidate"]
    plan = RankPlan.build(cfg, scope, inputs, rank, tp, cp, tp_groups[rank // tp], cp_groups[rank % tp],
                          spec.get("sp", False), Partition.from_record(spec.get("partition")))  # fmt: skip
    faults = [Fault(**f) for f in spec["faults"] if f["rank"] == rank]
    overrides = plan.overrides(faults)
    single = spec.get("injection")
    single = None if single is None or single.pop("rank") != rank else Injection(**single)
    recorder = determinism.Recorder()
    recorder.role(ops, "candidate")
    injecting = determinism.injecting(single) if single is not None else contextlib.nullcontext()
    with safe_open(str(folder / "reference"), framework="pt", device=str(device)) as ref:
        cots = {k[2:]: plan.local_value(k[2:], ref.get_tensor(k)) for k in ref.keys() if k.startswith("c:")}  # noqa: SIM118
        local = plan.local_inputs(inputs)
        with determinism.recording(recorder), injecting as state:
            with determinism.evaluation("forward"):
                values, grads = forward_backward(scope, local, plan.params, ops, overrides, lambda _: cots)
            repeat_forward(scope, local, values, plan.params, ops, overrides)
        out = {"values": {}, "grads": {}, "checked_values": 0, "checked_grads": 0,
               "determinism": recorder.record(), "injected": None if single is None else state.describe()}  # fmt: skip
        for node in scope.graph.nodes:
            d = byte_diff(values[node.name], plan.local_value(node.name, ref.get_tensor("v:" + node.name)),
                          node.row_dim)  # fmt: skip
            out["checked_values"] += 1
            if d is not None:
                out["values"][node.name] = {**d, **plan.locate(node.name, d)}
        for name, g in grads.items():
            d = byte_diff(g, plan.local_grad(name, ref.get_tensor("g:" + name)), plan.grad_row_dim(name))
            out["checked_grads"] += 1
            if d is not None:
                out["grads"][name] = {**d, **plan.locate_grad(name, d)}
        if spec.get("gather"):
            write_shards(plan, values, grads, ref, folder)
    out["runtime"] = runtime_record(spec["backend"], device, rank, world, tp, cp)
    out["plan"] = plan.record()
    (folder / f"rank-{rank}.json").write_text(json.dumps(out), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, "h3gate.parallel.ws2_rank", "one run ws2 rank", run_rank)


if __name__ == "__main__":
    sys.exit(main())
