"""``run ws2``: TP / CP / SP ranks byte-equal to the one-device strict path, forward and backward.

The reference is TP1: the scope's graph on one device with every operator bound in the ``seg8`` merge order
(:func:`h3gate.ops.registry.merge_twin`). Each rank of the topology runs its shard (:mod:`h3gate.parallel.shards`)
and compares every value, node-output gradient and parameter/input gradient it holds with the same slice of TP1,
byte for byte; a drift is located to its owning rank, node, logical row and modality. Ranks are processes launched
here (``python -m h3gate.parallel.ws2_rank``), gloo on CPU or NCCL on GPUs, rendezvous through a file.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.errors import InputError
from h3gate.graph import determinism
from h3gate.graph.determinism import Injection
from h3gate.kernels.tp_layers import check_alignment
from h3gate.layout import PackedLayout
from h3gate.manifests.model_config import ModelConfig
from h3gate.parallel import ws2_gather
from h3gate.parallel.collectives import cp_bounds
from h3gate.parallel.sp import sp_node
from h3gate.parallel.ulysses import row_sharded
from h3gate.parallel.ws2_partition import Partition
from h3gate.parallel.ws2_scope import SCOPES, Fault, build_scope, cotangents, forward_backward, repeat_forward
from h3gate.paths import display
from h3gate.ranks import run_ranks
from h3gate.runs.block_rows import determinism_failure
from h3gate.runs.setup import SCOPE_DRAW, Run, RunSpec, check_device, prepare, read_inputs

KIND = "ws2"
TOPOLOGIES: dict[str, tuple[int, int, bool]] = {
    "tp1": (1, 1, False),
    "tp2": (2, 1, False),
    "tp4": (4, 1, False),
    "tp8": (8, 1, False),
    "cp2": (1, 2, False),
    "tp2cp2": (2, 2, False),
    "tp4cp2": (4, 2, False),
    "tp2sp": (2, 1, True),
    "tp2cp2sp": (2, 2, True),
    "tp4cp2sp": (4, 2, True),
}
BACKENDS = ("gloo", "nccl")
RANK_TIMEOUT_S = 900


@dataclass
class Ws2Settings:
    topology: str
    scope: str = "block"
    backend: str | None = None
    device: str = "cpu"
    config: str = "ws2-tiny"
    layout: str = "micro"
    seed: int = 0
    faults: list[str] = field(default_factory=list)
    threads: int = 1
    partition: Partition = field(default_factory=Partition)  # the ablation rows' variants (no CLI flag)


@dataclass(frozen=True)
class RankInjection:
    """``RANK:NODE:ROW:ulp@K[:backward]``: one ulp in the K-th evaluation of NODE on rank RANK only (ROW: a row of
    that rank's own tensor), the determinism check's negative control."""

    rank: int
    injection: Injection

    def record(self) -> dict:
        return {"rank": self.rank, **dataclasses.asdict(self.injection)}


@dataclass
class Ws2Plan:
    settings: Ws2Settings
    tp: int
    cp: int
    sp: bool
    backend: str
    run: Run  # TP1's run, checked and bound, nothing read yet: the parent reads it for the reference
    faults: list
    injection: RankInjection | None = None

    @property
    def cfg(self) -> ModelConfig:
        return self.run.cfg

    @property
    def layout(self) -> PackedLayout:
        return self.run.layout


def _fault(spec: str, world: int, graph, seq_len: int, tp: int = 1, cp: int = 1, scope: str = "block",
           sp: bool = False):  # fmt: skip

    parts = spec.split(":")
    names = [n.name for n in graph.nodes]
    if not 3 <= len(parts) <= 5 or not parts[0].isdigit() or not parts[2].isdigit():
        raise InputError(f"--fault {spec!r}: expected RANK:NODE:ROW[:forward|backward] or RANK:NODE:ROW:ulp@K"
                         "[:backward]")  # fmt: skip
    if len(parts) == 5 and not any(determinism.is_ulp(p) for p in parts[3:]):
        raise InputError(f"--fault {spec!r}: expected RANK:NODE:ROW[:forward|backward]")
    rank, node, row = int(parts[0]), parts[1], int(parts[2])
    phase = parts[3] if len(parts) == 4 else "forward"
    if rank >= world:
        raise InputError(f"--fault {spec!r}: rank {rank} outside the topology's {world} ranks")
    if node not in names:
        raise InputError(f"--fault {spec!r}: unknown node {node!r} (known: {', '.join(names[:6])}, ...)")
    single = determinism.injection_of(spec, node, row, parts[3:])
    if single is not None:
        return RankInjection(rank, single)
    if phase not in ("forward", "backward"):
        raise InputError(f"--fault {spec!r}: {phase!r} is neither forward nor backward")
    if row >= seq_len:
        raise InputError(f"--fault {spec!r}: row {row} must be < {seq_len}")
    if sp and sp_node(scope, node):
        bounds = cp_bounds(seq_len, tp * cp)
        if not bounds[rank] <= row < bounds[rank + 1]:
            raise InputError(f"--fault {spec!r}: rank {rank} (SP) holds packed rows [{bounds[rank]}, "
                             f"{bounds[rank + 1]}) of {node}, not row {row}")  # fmt: skip
        return Fault(rank, node, row, phase)
    if cp > 1:
        bounds, c = cp_bounds(seq_len, cp), rank // tp
        if row_sharded(scope, node) and not bounds[c] <= row < bounds[c + 1]:
            raise InputError(f"--fault {spec!r}: rank {rank} (CP rank {c}) holds packed rows [{bounds[c]}, "
                             f"{bounds[c + 1]}), not row {row}")  # fmt: skip
    return Fault(rank, node, row, phase)


def plan_ws2(s: Ws2Settings) -> Ws2Plan:
    """Every check that needs no weights: topology, scope, backend and device, TP1's run (config, layout, graph,
    seg8 bindings; nothing read), config alignment, row shards, faults."""

    if s.topology not in TOPOLOGIES:
        raise InputError(f"--topology {s.topology!r}: must be one of {', '.join(TOPOLOGIES)}")
    tp, cp, sp = TOPOLOGIES[s.topology]
    if s.scope not in SCOPES:
        raise InputError(f"--scope {s.scope!r}: must be one of {', '.join(SCOPES)}")
    device = check_device(s.device)
    backend = s.backend or ("nccl" if device.startswith("cuda") else "gloo")
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend!r}: must be one of {', '.join(BACKENDS)}")
    if backend == "nccl":
        if device == "cpu":
            raise InputError("--backend nccl: needs --device cuda (one GPU per rank)")
        if not torch.distributed.is_nccl_available():
            raise InputError("--backend nccl: this torch build has no NCCL")
        if tp * cp > torch.cuda.device_count():
            raise InputError(f"--topology {s.topology}: {tp * cp} ranks need {tp * cp} GPUs, this machine has "
                             f"{torch.cuda.device_count()} (one NCCL rank per GPU)")  # fmt: skip
    device = "cpu" if s.device == "cpu" else "cuda:0"
    spec = RunSpec(s.scope, s.layout, s.config, None, device, s.seed, "strict", "seg8", draw=SCOPE_DRAW[s.scope])
    run = prepare(spec, read=False)
    cfg, layout, graph = run.cfg, run.layout, run.graph
    check_alignment(tp, cfg.num_attention_heads, cfg.attention_head_dim, cfg.hidden_size, cfg.ffn_dim, torch.bfloat16)
    if cfg.num_attention_heads % (tp * cp):
        raise InputError(f"--topology {s.topology}: Ulysses attention splits {cfg.num_attention_heads} heads over "
                         f"tp x cp = {tp * cp} ranks; they must divide")  # fmt: skip
    shards = tp * cp if sp else cp
    if shards > 1:
        bounds = cp_bounds(layout.seq_len, shards)
        if any(bounds[c] == bounds[c + 1] for c in range(shards)):
            raise InputError(f"--layout {s.layout}: {layout.seq_len} packed rows leave a rank of {s.topology} "
                             f"without rows (shards of whole row segments: {list(bounds)})")  # fmt: skip
    s.partition.check(tp, cp, sp, s.scope, layout.seq_len)
    parsed = [_fault(f, tp * cp, graph, layout.seq_len, tp, cp, s.scope, sp) for f in s.faults]
    faults = [f for f in parsed if isinstance(f, Fault)]
    injections = [f for f in parsed if isinstance(f, RankInjection)]
    if len(injections) > 1:
        raise InputError(f"--fault: {len(injections)} ulp@K faults; a run takes one")
    return Ws2Plan(s, tp, cp, sp, backend, run, faults, injections[0] if injections else None)


def _reference(plan: Ws2Plan, folder: Path) -> tuple[object, tuple[str, ...], dict, float, dict | None]:
    """TP1 on this device in the seg8 merge order; writes ``inputs`` and ``reference`` into ``folder``; returns its
    graph, leaves, bindings, seconds and determinism record (its forward, then each node once more)."""
    from safetensors.torch import save_file

    s, run = plan.settings, plan.run
    device = run.device
    scope = build_scope(read_inputs(run))
    graph, leaves, bindings = scope.graph, scope.leaves, run.bindings
    cots: dict = {}

    def cot_fn(values):
        cots.update(cotangents(scope, values, s.seed))
        return cots

    started = time.perf_counter()
    ops = run.tables()["candidate"]
    recorder = determinism.Recorder()
    recorder.role(ops, "candidate")
    with determinism.recording(recorder):
        with determinism.evaluation("forward"):
            values, grads = forward_backward(scope, scope.inputs, scope.params, ops, None, cot_fn)
        seconds = time.perf_counter() - started
        repeat_forward(scope, scope.inputs, values, scope.params, ops, None)
    tensors = {f"v:{k}": v for k, v in values.items()}
    tensors.update({f"g:{k}": g for k, g in grads.items()})
    tensors.update({f"c:{k}": c for k, c in cots.items()})
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / "reference"))
    save_file({k: v.detach().cpu().clone() for k, v in scope.inputs.items()}, str(folder / "inputs"))
    for held in (scope.params, scope.inputs, values, grads, tensors, cots):
        held.clear()  # the ranks need the device's memory
    run.block = run.model = None
    if device != "cpu":
        torch.cuda.empty_cache()
    return graph, leaves, bindings, seconds, recorder.record()


def _launch(plan: Ws2Plan, folder: Path, progress: Callable[[str], None] | None = None,
            gather: bool = False) -> tuple[list[dict], float]:  # fmt: skip
    """Spawn every rank, wait, read each ``rank-R.json``; a rank that fails is an internal error (exit 3).
    ``gather``: each rank also writes what it holds (:mod:`h3gate.parallel.ws2_gather`)."""
    s, world = plan.settings, plan.tp * plan.cp
    spec = {"run": plan.run.spec.record(), "threads": s.threads, "tp": plan.tp, "cp": plan.cp, "sp": plan.sp,
            "backend": plan.backend, "device": s.device, "init_file": str(folder / "rendezvous"),
            "faults": [f.record() for f in plan.faults], "partition": s.partition.record(),
            "injection": None if plan.injection is None else plan.injection.record(), "gather": gather}  # fmt: skip
    for f in spec["faults"]:
        f.pop("kind")
    (folder / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    started = time.perf_counter()
    errors = run_ranks("h3gate.parallel.ws2_rank", world, folder, s.threads, RANK_TIMEOUT_S, progress,
                       lambda r: folder / f"rank-{r}.json")  # fmt: skip
    if errors:
        raise RuntimeError("run ws2: " + "; ".join(errors))
    seconds = time.perf_counter() - started
    files = [folder / f"rank-{r}.json" for r in range(world)]
    return [load_json_file(f, display(f), MAX_EVIDENCE_BYTES) for f in files], seconds


def _modality(node, row: int | None, layout) -> str | None:
    if row is None or node is None:
        return None
    kind = node.meta.get("rows", "packed" if node.row_dim == 1 else "timestep")
    return layout.modality_of_row(row) if kind == "packed" and row < layout.seq_len else kind


def _first(order: list[str], per_rank: list[dict], key: str, nodes: dict, layout, phase: str) -> dict | None:
    """The first name of ``order`` that any rank reports differing; of those ranks, the lowest logical row."""
    for name in order:
        hits = [(rec[key][name], r) for r, rec in enumerate(per_rank) if name in rec[key]]
        if not hits:
            continue
        d, rank = min(hits, key=lambda h: (h[0]["logical_row"] is None, h[0]["logical_row"] or 0, h[1]))
        node = nodes.get(name.partition(":")[2] if name.startswith("node:") else name)
        return {"phase": phase, "name": name, "layer": None if node is None else node.layer,
                "owner_rank": d["owner_rank"], "logical_row": d["logical_row"],
                "modality": _modality(node, d["logical_row"], layout), "rows_differing": d["rows_differing"],
                "max_abs": d["max_abs"], "ranks_differing": sorted(r for _, r in hits)}  # fmt: skip
    return None


COMPARED = (
    "every node-output, input and parameter gradient each rank holds (the row-sums CP and SP split: merged in the "
    "row-segment order, compared like the rest)"
)


@dataclass(frozen=True)
class Reference:
    """A TP1 run kept in ``folder`` (its ``inputs`` and ``reference`` files) and what the evidence body needs of it:
    one TP1 serves every topology and partition of the same scope, config, layout, seed and device."""

    folder: Path
    key: tuple
    graph: object
    leaves: tuple[str, ...]
    bindings: dict
    seconds: float
    determinism: dict | None = None

    def serve(self, plan: Ws2Plan, folder: Path) -> tuple[object, tuple[str, ...], dict, float, dict | None]:
        """Copy the files into a run's ``folder`` (what :func:`_reference` returns, without running it again: no
        determinism record of TP1 in this run)."""
        if self.key != reference_key(plan.settings):
            raise ValueError(f"run ws2: the TP1 of {self.key} cannot serve {reference_key(plan.settings)}")
        for name in ("inputs", "reference"):
            shutil.copyfile(self.folder / name, folder / name)
        return self.graph, self.leaves, self.bindings, self.seconds, None


def reference_key(s: Ws2Settings) -> tuple:
    return (s.scope, s.config, s.layout, s.seed, s.device)


def make_reference(plan: Ws2Plan, folder: Path) -> Reference:
    """Run TP1 once into ``folder`` (the caller keeps it) for :func:`run_ws2` to reuse."""
    return Reference(folder, reference_key(plan.settings), *_reference(plan, folder))


def merged_determinism(processes: Sequence[tuple[str, int | None, dict | None]]) -> dict:
    """One evidence block from several processes' records, each ``(name, rank or None, record)``: evaluations, keys
    and pairs summed, each mismatch tagged with its process's ``rank`` (where it has one), each process's counts kept
    under ``ranks``; a process that sent no record counts as nothing compared."""
    pairs: dict[str, int] = {}
    mismatches: list[dict] = []
    for _, rank, rec in processes:
        for role, n in (rec or {}).get("pairs", {}).items():
            pairs[role] = pairs.get(role, 0) + n
        mismatches += [{**m, **({} if rank is None else {"rank": rank})} for m in (rec or {}).get("mismatches", [])]
    out = {
        "rule": determinism.RULE,
        "evaluations": sum((rec or {}).get("evaluations", 0) for *_, rec in processes),
        "keys": sum((rec or {}).get("keys", 0) for *_, rec in processes),
        "pairs": pairs,
        "mismatches": mismatches,
        "pass": not any(m["role"] == "candidate" for m in mismatches),
        "ranks": [{"name": name, "evaluations": (rec or {}).get("evaluations", 0),
                   "pairs": dict((rec or {}).get("pairs", {}))} for name, _, rec in processes],
    }  # fmt: skip
    return out if any(pairs.values()) else {**out, "note": determinism.NOTHING_COMPARED}


@dataclass
class Gathered:
    """What the ranks computed, un-sharded (:func:`~h3gate.parallel.ws2_gather.gather`): node ``values``,
    gradients ``grads`` (``node:`` / ``input:`` / ``param:`` names), and what every rank read: the ``inputs`` file
    and the seeded ``cotangents`` of the outputs (TP1's, each rank took its slice); ``replicas_differing``: the
    tensors (``v:<node>`` / ``g:<name>``) some element of which a higher rank holds with other bytes than the
    lowest rank, whose copy was kept, and those ranks."""

    inputs: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    cotangents: dict[str, torch.Tensor]
    replicas_differing: dict[str, list[int]]


def run_ws2(plan: Ws2Plan, reference: Reference | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Run TP1 (or reuse ``reference``) and the topology's ranks; the evidence body (verdict ``pass`` iff forward
    and backward byte-equal). ``progress`` hears each stage: TP1 done, then each rank as it finishes."""
    return _execute(plan, reference, progress, gather=False)[0]


def run_ws2_gathered(plan: Ws2Plan, progress: Callable[[str], None] | None = None) -> tuple[dict, Gathered]:
    """:func:`run_ws2`, and every rank's values and gradients gathered (``run ws2 --save-tensors``)."""
    body, gathered = _execute(plan, None, progress, gather=True)
    assert gathered is not None
    return body, gathered


def _execute(plan: Ws2Plan, reference: Reference | None, progress: Callable[[str], None] | None,
             gather: bool) -> tuple[dict, Gathered | None]:  # fmt: skip
    step = progress or (lambda label: None)
    gathered = None
    with tempfile.TemporaryDirectory(prefix="h3gate-ws2-") as tmp:
        folder = Path(tmp)
        run = _reference if reference is None else reference.serve
        step("TP1 reference (one device, seg8 merge order)")
        graph, leaves, bindings, ref_seconds, ref_determinism = run(plan, folder)
        step(f"TP1 done; {plan.tp * plan.cp} {plan.backend} ranks started")
        per_rank, rank_seconds = _launch(plan, folder, progress, gather)
        if gather:
            gathered = _gathered(folder, plan.tp * plan.cp)
    nodes = {n.name: n for n in graph.nodes}
    order = [n.name for n in graph.nodes]
    grad_order = [f"node:{n}" for n in reversed(order)] + [f"input:{k}" for k in leaves]
    grad_order += sorted({k for rec in per_rank for k in rec["grads"]} - set(grad_order))
    forward = _first(order, per_rank, "values", nodes, plan.layout, "forward")
    backward = _first(grad_order, per_rank, "grads", nodes, plan.layout, "backward")
    s = plan.settings
    failing = [f"{d['phase']}: {d['name']} rank {d['owner_rank']} row {d['logical_row']}" for d in (forward, backward)
               if d is not None]  # fmt: skip
    processes = [] if ref_determinism is None else [("TP1", None, ref_determinism)]
    processes += [(f"rank {r}", r, rec.get("determinism")) for r, rec in enumerate(per_rank)]
    record = merged_determinism(processes)
    failing += [f"{determinism_failure(m, [])} on {'rank ' + str(m['rank']) if 'rank' in m else 'TP1'}"
                for m in record["mismatches"] if m["role"] == "candidate"]  # fmt: skip
    injected = next((rec["injected"] for rec in per_rank if rec.get("injected")), None)
    return {
        "topology": s.topology,
        "tp": plan.tp, "cp": plan.cp, "sp": plan.sp,
        "world_size": plan.tp * plan.cp,
        "scope": s.scope,
        "backend": plan.backend,
        "device": s.device,
        "config": {"name": s.config, "heads": plan.cfg.num_attention_heads, "hidden_size": plan.cfg.hidden_size,
                   "ffn_dim": plan.cfg.ffn_dim, "num_layers": plan.cfg.num_layers},
        "layout": {"name": plan.layout.name, "seq_len": plan.layout.seq_len, "rows": plan.layout.rows_per_modality()},
        "reference": {"what": "TP1: the one-device strict path, every operator in the seg8 merge order",
                      "bindings": {k: v.record() for k, v in bindings.items()}, "seconds": ref_seconds},
        "ranks": [{**rec["runtime"], **rec["plan"], "values_checked": rec["checked_values"],
                   "grads_checked": rec["checked_grads"], "values_differing": len(rec["values"]),
                   "grads_differing": len(rec["grads"])} for rec in per_rank],  # fmt: skip
        "ranks_seconds": rank_seconds,
        "faults": [f.record() for f in plan.faults],
        "determinism": record,
        **({"injected": injected} if plan.injection is not None else {}),
        "forward_byte_equal": forward is None,
        "gradients_compared": COMPARED,
        "backward_byte_equal": backward is None,
        "first_drift": forward,
        "first_backward_drift": backward,
        "failing_checks": failing,
        "verdict": "pass" if not failing else "fail",
    }, gathered  # fmt: skip


def _gathered(folder: Path, world: int) -> Gathered:
    from safetensors import safe_open
    from safetensors.torch import load_file

    values, grads, replicas = ws2_gather.gather(folder, world)
    with safe_open(str(folder / "reference"), framework="pt") as ref:
        cots = {k[2:]: ref.get_tensor(k) for k in ref.keys() if k.startswith("c:")}  # noqa: SIM118
    return Gathered(load_file(str(folder / "inputs")), values, grads, cots, replicas)
