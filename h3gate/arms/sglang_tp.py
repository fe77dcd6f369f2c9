"""SGLang's rollout under its own parallelism: ``run arms --rollout sglang --tp N`` (tensor) or ``--ulysses N``.

The ranks are started by torch's own launcher through :func:`h3gate.ranks.run_ranks` (``python -m
torch.distributed.run --standalone --nproc-per-node N -m h3gate.arms.sglang_tp --dir WORK``; gloo on the CPU, NCCL
with one GPU a rank on CUDA). Each rank reads
``WORK/spec.json`` (the run's settings, the rollout letters, the fault), plans the same stack, loads its shards of
SGLang's DiT with SGLang's loader (:func:`h3gate.arms.sglang_side.build_sglang` at ``tp=N`` or ``ulysses=N``) and runs
the whole denoise loop for every letter (:func:`h3gate.arms.sides.rollout` on
:class:`~h3gate.arms.sglang_side.SglangEngine`): ``R`` under the strict binding (TP: in the seg8 order, its TP layers
all-gathering over SGLang's TP group; Ulysses: a rank's rows, whole segments on its heads after SGLang's all-to-all),
``P`` as shipped (SGLang's own row-parallel sums, its own all-to-all). Every rank holds the full velocities and steps
the same schedulers. Rank 0 writes
the step files into the run's ``rollout-<L>/steps``, the final latents and SGLang's record into ``WORK``; the parent
reads them back as :class:`~h3gate.arms.sides.Rollout` (:func:`tp_rollouts`).

The first drift is located at TP1 in the parent (the node map reads world-size-1 values only): R at TP1 is R at TPn
(seg8) and at Ulysses N byte for byte, which the location's ``replay_faithful`` checks against what the ranks
recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from h3gate.arms.sglang_side import SglangEngine, SglangFault, build_sglang
from h3gate.arms.sides import Rollout, rollout
from h3gate.arms.stack import ArmsSettings, Stack, plan_stack
from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.errors import InputError
from h3gate.paths import display
from h3gate.ranks import ERROR_PREFIX, rank_main, run_ranks
from h3gate.runs.trajectory_files import complete_steps, load_step

MODULE = "h3gate.arms.sglang_tp"
SPEC = "spec.json"
RECORD = "rollout.json"
TIMEOUT_S = 3600


def settings_record(settings: ArmsSettings) -> dict[str, Any]:
    body = dataclasses.asdict(settings)
    body.update(arms=list(settings.arms), checkpoint=None if settings.checkpoint is None else str(settings.checkpoint))
    return body


def settings_from(body: dict[str, Any]) -> ArmsSettings:
    checkpoint = body.get("checkpoint")
    return ArmsSettings(**{**body, "arms": tuple(body["arms"]), "checkpoint": checkpoint and Path(checkpoint)})


def _final(folder: Path, letter: str) -> Path:
    return folder / f"final-{letter}.safetensors"


def run_rank(rank: int, world: int, folder: Path) -> None:
    """One rank (module docstring); torch.distributed's environment from the launcher."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    spec = load_json_file(folder / SPEC, display(folder / SPEC))
    settings = settings_from(spec["settings"])
    torch.set_num_threads(spec["threads"])
    device = settings.device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(torch.device(device))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    stack, source = plan_stack(dataclasses.replace(settings, device=device))  # bad input fails every rank alike
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    build_sglang(stack, source, tp=settings.tp, ulysses=settings.ulysses)
    fault = spec["fault"] and SglangFault(**spec["fault"])
    engine = SglangEngine(stack, fault)
    out = Path(spec["out"])
    for letter in spec["letters"]:
        rundir = out / f"rollout-{letter}" if rank == 0 else folder / f"rank-{rank}" / f"rollout-{letter}"
        rolled = rollout(stack, letter, rundir, None, engine)
        if rank == 0:
            save_file({"video": rolled.final[0].contiguous(), "audio": rolled.final[1].contiguous()},
                      str(_final(folder, letter)))  # fmt: skip
    if rank == 0:
        record = {**engine.record(), "ranks": {"world": world, "launcher": "torch.distributed.run",
                                               "backend": dist.get_backend()}}  # fmt: skip
        (folder / RECORD).write_text(json.dumps(record), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, folder: Path) -> None:
    """The ranks through :func:`h3gate.ranks.run_ranks`; a rank's bad input is an InputError (its one
    line), any other failure a RuntimeError naming the ranks."""
    errors = run_ranks(MODULE, world, folder, 1, TIMEOUT_S)
    refused = [e.split(ERROR_PREFIX, 1)[1] for e in errors if " exit 2: " in e and ERROR_PREFIX in e]
    if refused:
        raise InputError(refused[0])
    if errors:
        raise RuntimeError(f"run arms: SGLang ranks failed: {'; '.join(errors)}")


def read_rollout(stack: Stack, letter: str, rundir: Path, final: Path, engine: SglangEngine) -> Rollout:
    """A rollout the ranks wrote: every step's inputs and velocities (digests checked), the final latents, the
    seconds; ``engine`` (TP1, built on first use) locates its drifts."""
    from safetensors.torch import load_file

    out = Rollout(letter, engine=engine)
    for i in complete_steps(rundir):
        tensors, record = load_step(rundir, i)
        out.states.append((tensors["video_latents"], tensors["audio_latents"]))
        out.velocities.append((tensors["video_velocity"], tensors["audio_velocity"]))
        out.seconds.append(float(record["seconds"]))
    if len(out.states) != stack.evaluations:
        raise RuntimeError(f"run arms: {rundir}: {len(out.states)} steps written, {stack.evaluations} expected")
    last = load_file(str(final))
    out.final = (last["video"], last["audio"])
    return out


def tp_rollouts(
    stack: Stack, source: Any, out: Path, letters: list[str], fault: SglangFault | None, progress=None
) -> tuple[dict[str, Rollout], dict]:
    """Every rollout letter on ``--tp`` x ``--ulysses`` ranks (module docstring); the rollouts read back and SGLang's
    record from rank 0 (with the ranks' world, launcher and backend)."""
    world = stack.settings.tp * stack.settings.ulysses
    with tempfile.TemporaryDirectory(prefix="h3gate-arms-tp-") as tmp:
        folder = Path(tmp)
        spec = {"settings": settings_record(stack.settings), "letters": letters, "out": str(out.resolve()),
                "fault": fault and dataclasses.asdict(fault), "threads": 1}  # fmt: skip
        (folder / SPEC).write_text(json.dumps(spec), encoding="utf-8")
        if progress is not None:
            kind = "TP" if stack.settings.tp > 1 else "Ulysses"
            progress(f"rollout {', '.join(letters)} (sglang): {world} {kind} ranks")
        _launch(world, folder)
        record = load_json_file(folder / RECORD, display(folder / RECORD), MAX_EVIDENCE_BYTES)
        engine = SglangEngine(stack, fault, source)
        rollouts = {k: read_rollout(stack, k, out / f"rollout-{k}", _final(folder, k), engine) for k in letters}
    for letter, rolled in rollouts.items():
        rolled.trace_ops = record["letters"][letter]["trace_ops"]
    return rollouts, record


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, MODULE, "one rank of run arms --tp / --ulysses", run_rank)


if __name__ == "__main__":
    sys.exit(main())
