"""A CPU gloo harness for tensor- and context-parallel execution of the model graph (RFC section 6 multi-rank rows).

Workers are separate processes (``python -m h3gate.distributed --rank R ...``, gloo over a ``file://`` rendezvous;
arguments and results travel as JSON and safetensors). Every merge is an ``all_gather`` followed by a concatenation
by logical id - no arithmetic crosses ranks, so a sharded run is byte-equal to the single-process replay when every
local op is invariant to the columns/rows it is given (checked on this CPU: GEMM columns and rows, per-head SDPA,
query-row subsets of SDPA with the full K/V in packed order).

* TP (``heads`` owned per rank; channel chunk ``c`` of every column-split weight goes with head ``c``): AdaLN
  projection output chunks, Q/K/V heads, per-head Q/K norm, RoPE and attention, O projection output chunks (input =
  all heads gathered), FFN gate/up chunk pairs, SwiGLU, FFN down output chunks (input = all channels gathered). The
  refiner blocks are split the same way; embeddings, norms, residuals, timestep MLP and heads are replicated.
* CP (``hidden_rows`` per rank, contiguous): the packed hidden state is sliced at the first block together with the
  row metadata (``adaln_indices``, ``rope_cos``, ``rope_sin``, ``timestep_indices``) per the plan's ownership map;
  attention gathers K and V in rank (= packed row) order; the two output heads gather rows back before selection.
  ``metadata_rows=None`` declares no metadata ownership (hidden state sharded alone): ranks then read metadata by
  local position - the H17 failure.

:func:`check_ownership` rejects a plan whose declared metadata rows are not its hidden rows (A4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from h3gate.errors import InputError

ROW_META = ("adaln_indices", "rope_cos", "rope_sin", "timestep_indices")
SCENARIOS = ("tp2", "tp2_swapped", "cp2", "cp2_hidden_only")
WORLD = 2
MAX_PARAMS = 2_000_000_000
TIMEOUT_S = 300


class NotAvailable(Exception):
    """This harness cannot run the requested configuration (the row reports N/A with this reason)."""


@dataclass(frozen=True)
class CpPlan:
    world: int
    hidden_rows: tuple[tuple[int, ...], ...]
    metadata_rows: dict[str, tuple[tuple[int, ...], ...]] | None


@dataclass(frozen=True)
class TpPlan:
    world: int
    owners: tuple[tuple[int, ...], ...]  # heads (and channel chunks) of each rank, merged by logical id


def cp_plan(seq_len: int, world: int) -> CpPlan:
    """Contiguous near-equal row shards (``tensor_split``: the first ``S % world`` ranks hold one more row)."""
    rows = tuple(tuple(int(i) for i in part) for part in torch.arange(seq_len).tensor_split(world))
    return CpPlan(world, rows, {name: rows for name in ROW_META})


def hidden_only_plan(seq_len: int, world: int) -> CpPlan:
    plan = cp_plan(seq_len, world)
    return CpPlan(world, plan.hidden_rows, None)


def misowned_plan(seq_len: int, world: int) -> CpPlan:
    """Rank 0's ``adaln_indices`` rows hold rank 1's first row instead of its own last row."""
    plan = cp_plan(seq_len, world)
    n = len(plan.hidden_rows[0])
    adaln = list(plan.hidden_rows)
    adaln[0] = (*adaln[0][:-1], n)
    adaln[1] = (n - 1, *adaln[1][1:])
    return CpPlan(world, plan.hidden_rows, {**plan.metadata_rows, "adaln_indices": tuple(adaln)})


def check_ownership(plan: CpPlan, seq_len: int) -> None:
    """Hidden rows tile ``[0, S)`` once; every declared metadata shard holds exactly its rank's hidden rows.

    Raises :class:`h3gate.ablate.engine.NonComparable` naming the first rank and tensor that break ownership."""
    from h3gate.ablate.engine import NonComparable

    seen = sorted(r for rows in plan.hidden_rows for r in rows)
    if seen != list(range(seq_len)):
        raise NonComparable(f"CP{plan.world} plan: hidden rows do not cover the {seq_len} packed rows exactly once")
    for name, shards in (plan.metadata_rows or {}).items():
        for rank, (rows, hidden) in enumerate(zip(shards, plan.hidden_rows, strict=True)):
            if tuple(rows) != tuple(hidden):
                foreign = sorted(set(rows) - set(hidden))
                raise NonComparable(
                    f"rank {rank}: {name} holds packed row(s) {foreign} owned by another rank (its hidden rows are "
                    f"{hidden[0]}..{hidden[-1]}): metadata mis-owned, arms not comparable"
                )


def tp_plan(heads: int, world: int, swapped: bool = False) -> TpPlan:
    if heads % world:
        raise NotAvailable(f"TP{world}: {heads} heads are not divisible by {world}")
    k = heads // world
    owners = [tuple(range(r * k, (r + 1) * k)) for r in range(world)]
    return TpPlan(world, tuple(reversed(owners)) if swapped else tuple(owners))


def plans(cfg, seq_len: int) -> dict[str, TpPlan | CpPlan]:
    return {
        "tp2": tp_plan(cfg.num_attention_heads, WORLD),
        "tp2_swapped": tp_plan(cfg.num_attention_heads, WORLD, swapped=True),
        "cp2": cp_plan(seq_len, WORLD),
        "cp2_hidden_only": hidden_only_plan(seq_len, WORLD),
    }


# -- the parent side -----------------------------------------------------------------------------------------------


def _spec(ctx) -> dict:
    if ctx.device != "cpu":
        raise NotAvailable(f"the multi-rank harness is CPU gloo only; --device {ctx.device} needs an NCCL harness")
    if ctx.checkpoint is not None:
        raise NotAvailable("the multi-rank harness regenerates synthetic weights in each worker; no checkpoint path")
    total = sum(v.numel() for v in ctx.params.values())
    if total > MAX_PARAMS:
        raise NotAvailable(f"{total} parameters on CPU ranks: the gloo harness runs configs up to {MAX_PARAMS}")
    return {
        "config": ctx.config_name,
        "layout_spec": ctx.layout.spec.model_dump(mode="json"),
        "layout_name": ctx.layout.name,
        "seed": ctx.seed,
        "plan": ctx.plan,
        "steps": ctx.recipe.steps,
        "mode": ctx.execution["mode"],
        "threads": torch.get_num_threads(),
        "scenarios": list(SCENARIOS),
    }


def run_scenarios(ctx) -> dict[str, dict[str, torch.Tensor]]:
    """Every scenario on ``WORLD`` spawned CPU ranks (once per context), rank 0's gathered node values by scenario."""
    if "distributed" in ctx.cache:
        return ctx.cache["distributed"]
    from safetensors import safe_open
    from safetensors.torch import load_file

    spec = _spec(ctx)
    with tempfile.TemporaryDirectory(prefix="h3gate-dist-") as tmp:
        spec["init_file"] = str(Path(tmp) / "rendezvous")
        (Path(tmp) / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "h3gate.distributed", "--rank", str(r), "--world", str(WORLD), "--dir", tmp],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
            )
            for r in range(WORLD)
        ]
        errors = []
        for r, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise NotAvailable(f"gloo harness rank {r} ran past {TIMEOUT_S} s") from None
            if p.returncode:
                lines = [ln for ln in err.splitlines() if "Error" in ln or "error:" in ln] or err.splitlines() or [""]
                errors.append(f"rank {r} exit {p.returncode}: {lines[-1].strip()}")
        if errors:
            raise NotAvailable("gloo harness failed: " + "; ".join(errors))
        ctx.cache["distributed"] = {s: load_file(str(Path(tmp) / f"{s}.safetensors")) for s in SCENARIOS}
        info = {}
        for s in SCENARIOS:
            with safe_open(str(Path(tmp) / f"{s}.safetensors"), framework="pt") as fh:
                meta = fh.metadata() or {}
            info[s] = {
                "overridden_nodes": int(meta.get("overridden_nodes", 0)),
                "rank0_local_shapes": json.loads(meta.get("rank0_local_shapes", "{}")),
            }
        ctx.cache["distributed_info"] = info
    return ctx.cache["distributed"]


def outcome(ctx, row, scenario: str):
    """The observation of one multi-rank row (see :mod:`h3gate.ablate.checks`)."""
    from h3gate.ablate.arms import forward_stream, replay_stream
    from h3gate.ablate.engine import compare_streams
    from h3gate.ablate.probes import Outcome

    s = ctx.layout.seq_len
    if scenario == "a4":
        check_ownership(cp_plan(s, WORLD), s)  # the co-sharded plan is comparable ...
        check_ownership(misowned_plan(s, WORLD), s)  # ... this one raises NonComparable
        return Outcome("PASS", None, notes=["ownership check accepted a mis-owned plan"])
    all_plans = plans(ctx.cfg, s)
    for plan in all_plans.values():
        if isinstance(plan, CpPlan):
            check_ownership(plan, s)  # every CP plan that runs declares consistent (or no) metadata ownership
    results = run_scenarios(ctx)
    strict_arm = ctx.base_arm()

    def replay(name: str):
        values = results[name]
        return replay_stream(ctx.graph, values, {k[5:]: v for k, v in values.items() if k.startswith("meta.")})

    pairs = {"hc4": (None, "tp2"), "c0": ("tp2", "tp2_swapped"), "hc5": (None, "cp2"), "h17": (None, "cp2_hidden_only")}
    left, right = pairs[scenario]
    strict = forward_stream(strict_arm, ctx.graph, ctx.cfg, ctx.plan, ctx.device) if left is None else replay(left)
    comparison = compare_streams(strict, replay(right), strict_arm, strict_arm, ctx.layout)
    result = "PASS" if comparison.first_drift is None else "EXPECTED_DRIFT"
    describe = {}
    for name in filter(None, (left, right)):
        plan = all_plans[name]
        if isinstance(plan, TpPlan):
            describe[name] = {"tp": plan.world, "owners": [list(o) for o in plan.owners]}
        else:
            describe[name] = {
                "cp": plan.world,
                "hidden_rows": [[r[0], r[-1]] for r in plan.hidden_rows],
                "metadata": "co-sharded" if plan.metadata_rows else "not sharded (read by local position)",
            }
        describe[name].update(ctx.cache["distributed_info"][name])
    evidence = {
        "backend": "gloo, CPU, spawned worker processes",
        "world": WORLD,
        "merge": "all_gather of raw bytes, concatenated by logical head/channel/row id (no arithmetic)",
        "strict_arm": left or "single-process replay",
        "probe_arm": right,
        "plans": describe,
    }
    return Outcome(result, None, comparison.first_drift, comparison, evidence=evidence)


# -- rank-local execution: node overrides and the gathers that report full tensors ----------------------------------


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` in rank order, moved as raw bytes (exact for any dtype; gloo lacks some float types)."""
    import torch.distributed as dist

    x = t.contiguous()
    raw = x.view(torch.uint8) if x.ndim else x.reshape(1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, raw)
    return [p.view(x.dtype).reshape(x.shape) for p in parts]


def _chunks(n: int, owned, count: int) -> torch.Tensor:
    size = n // count
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in owned])


def _merge_chunks(parts: list[torch.Tensor], owners, count: int, dim: int) -> torch.Tensor:
    """Per-rank chunk concatenations -> one tensor with chunk ``c`` at logical position ``c``."""
    by_id = {}
    for part, owned in zip(parts, owners, strict=True):
        for c, piece in zip(owned, part.chunk(len(owned), dim=dim), strict=True):
            by_id[c] = piece
    return torch.cat([by_id[c] for c in range(count)], dim=dim)


def _tp(cfg, graph, plan: TpPlan, rank: int, meta):
    from h3gate.graph.model import NodeOverride

    nh, owned = cfg.num_attention_heads, plan.owners[rank]
    k, eps = len(owned), cfg.qk_norm_eps

    def merge(t: torch.Tensor, dim: int) -> torch.Tensor:
        return _merge_chunks(all_gather(t), plan.owners, nh, dim)

    def cols(w: torch.Tensor) -> torch.Tensor:
        return w[_chunks(w.shape[0], owned, nh)]

    def fn_adaln(ops, v, p, node):
        pp = node.meta["param_prefix"]
        w, b = p[pp + "adaln_proj.linear.weight"], p[pp + "adaln_proj.linear.bias"]
        idx = _chunks(w.shape[0], owned, nh)
        return merge(
            ops["adaln_projection_3mod"](ops["adaln_silu_cast"](v["time.linear_2"], w.dtype), w[idx], b[idx]), -1
        )

    def fn_proj(which):
        def fn(ops, v, p, node):
            pre = node.name.rsplit(".", 1)[0]
            return ops["h3_qkv_gemm"](v[pre + ".norm1"], cols(p[node.meta["param_prefix"] + f"attn.to_{which}.weight"]))

        return fn

    def fn_norm(which):
        def fn(ops, v, p, node):
            pre, w = node.name.rsplit(".", 1)[0], p[node.meta["param_prefix"] + f"attn.norm_{which}.weight"]
            return ops["h3_qk_rmsnorm_d128"](v[f"{pre}.{which}_proj"], w, k, eps)

        return fn

    def fn_attention(ops, v, p, node):
        q, kk, vv = (v[i] for i in node.inputs)
        return ops["h3_full_attention"](q, kk, vv.unflatten(-1, (k, -1)))

    def fn_out(source, op, weight):
        def fn(ops, v, p, node):
            pre = node.name.rsplit(".", 1)[0]
            full = merge(v[f"{pre}.{source}"], -1)
            return merge(ops[op](full, cols(p[node.meta["param_prefix"] + weight])), -1)

        return fn

    def fn_gate_up(ops, v, p, node):
        pre, w = node.name.rsplit(".", 1)[0], p[node.meta["param_prefix"] + "ff.net.0.proj.weight"]
        half = _chunks(w.shape[0] // 2, owned, nh)
        return ops["h3_ffn_gate_up_gemm"](v[pre + ".norm2"], w[torch.cat([half, half + w.shape[0] // 2])])

    table = {
        "adaln_projection": fn_adaln,
        "q_proj": fn_proj("q"),
        "k_proj": fn_proj("k"),
        "v_proj": fn_proj("v"),
        "q_norm": fn_norm("q"),
        "k_norm": fn_norm("k"),
        "attention": fn_attention,
        "o_proj": fn_out("attention", "h3_attention_o_gemm", "attn.to_out.0.weight"),
        "ffn_gate_up": fn_gate_up,
        "ffn_down": fn_out("swiglu", "h3_ffn_down_gemm", "ff.net.2.weight"),
    }
    heads_dim = {
        "q_proj": -1,
        "k_proj": -1,
        "v_proj": -1,
        "q_norm": 2,
        "k_norm": 2,
        "rope_q": 2,
        "rope_k": 2,
        "attention": -1,
        "swiglu": -1,
    }
    overrides, dims = {}, {}
    for node in graph.nodes:
        stage, _, local = node.name.rpartition(".")
        if not (stage.startswith("block.") or stage.startswith("refiner.")) or not stage[-1].isdigit():
            continue
        if local in table:
            overrides[node.name] = NodeOverride(table[local], label=f"TP{plan.world} {local}")
        if local in heads_dim or local == "ffn_gate_up":
            dims[node.name] = heads_dim.get(local, "pairs")

    def report(node, value):
        how = dims.get(node.name)
        if how is None:
            return value
        if how != "pairs":
            return merge(value, how)
        parts = [p.chunk(2, dim=-1) for p in all_gather(value)]
        values = _merge_chunks([a for a, _ in parts], plan.owners, nh, -1)
        gates = _merge_chunks([g for _, g in parts], plan.owners, nh, -1)
        return torch.cat([values, gates], dim=-1)

    return overrides, report


def _cp(cfg, graph, plan: CpPlan, rank: int, meta):
    from h3gate.graph.model import NodeOverride

    rows = [torch.tensor(r, dtype=torch.int64) for r in plan.hidden_rows]
    mine, length = rows[rank], len(plan.hidden_rows[rank])
    if plan.metadata_rows is None:  # hidden state sharded alone: metadata read by local position
        local_meta = {name: meta[name][:length] for name in ROW_META}
    else:
        local_meta = {name: meta[name][torch.tensor(plan.metadata_rows[name][rank])] for name in ROW_META}
    seq = meta["rope_cos"].shape[0]

    longest = max(len(r) for r in rows)

    def gather_rows(t: torch.Tensor) -> torch.Tensor:
        """Row shards of every rank (padded to one length for the collective, trimmed after) at their rows."""
        padded = torch.cat([t, t.new_zeros((t.shape[0], longest - t.shape[1], *t.shape[2:]))], dim=1)
        full = t.new_empty((t.shape[0], seq, *t.shape[2:]))
        for r, part in zip(rows, all_gather(padded), strict=True):
            full.index_copy_(1, r, part[:, : len(r)])
        return full

    def local_inputs(node, v):
        out = {}
        for name in node.inputs:
            if name in ROW_META:
                out[name] = local_meta[name]
            elif name == "embed.pack":
                out[name] = v[name][:, mine]
            else:
                out[name] = v[name]
        return out

    def fn_local(ops, v, p, node):
        return node.fn(ops, local_inputs(node, v), p)

    def fn_attention(ops, v, p, node):
        pre = node.name.rsplit(".", 1)[0]
        kk, vv = gather_rows(v[pre + ".rope_k"]), gather_rows(v[pre + ".v_proj"])
        return ops["h3_full_attention"](v[pre + ".rope_q"], kk, vv.unflatten(-1, (cfg.num_attention_heads, -1)))

    def fn_head(ops, v, p, node):
        return gather_rows(node.fn(ops, {"final.norm_out": v["final.norm_out"]}, p))

    overrides, sharded = {}, set()
    for node in graph.nodes:
        if (
            node.name.startswith("block.")
            and not node.name.endswith(".adaln_projection")
            or node.name == ("final.norm_out")
        ):
            local = node.name.rpartition(".")[2]
            overrides[node.name] = NodeOverride(
                fn_attention if local == "attention" else fn_local, label=f"CP{plan.world} {local}"
            )
            sharded.add(node.name)
        elif node.name in ("heads.video_proj", "heads.audio_proj"):
            overrides[node.name] = NodeOverride(fn_head, label=f"CP{plan.world} gather rows")

    def report(node, value):
        return gather_rows(value) if node.name in sharded else value

    return overrides, report


def overrides_for(cfg, graph, plan, rank: int, meta):
    """Node overrides running ``plan`` on ``rank``, and ``report(node, value)`` giving the full tensor (collective:
    every rank calls it for every node, in order)."""
    return (_tp if isinstance(plan, TpPlan) else _cp)(cfg, graph, plan, rank, meta)


# -- the worker side -----------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, folder: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from h3gate.ablate.arms import Arm, _forward_inputs
    from h3gate.graph.executions import bind_graph, candidate_table, provider_table
    from h3gate.graph.model import build_model_graph, iter_graph, load_model_params
    from h3gate.layout import build_layout
    from h3gate.manifests.layouts import LayoutSpec
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import SyntheticSource
    from h3gate.trajectory import Recipe, make_request

    spec = json.loads((folder / "spec.json").read_text(encoding="utf-8"))
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world)
    cfg = load_config(spec["config"]).config
    layout = build_layout(LayoutSpec.model_validate(spec["layout_spec"]), spec["layout_name"])
    params = load_model_params(SyntheticSource(cfg, spec["seed"]), cfg)
    graph = build_model_graph(cfg)
    ops = provider_table() if spec["mode"] == "off" else candidate_table(bind_graph(graph, spec["mode"], "cpu"))
    arm = Arm(layout, params, ops, (make_request(layout, cfg, spec["seed"], 0),), Recipe(steps=spec["steps"]))
    request, meta = _forward_inputs(arm, cfg, spec["plan"], "cpu")
    all_plans = plans(cfg, layout.seq_len)
    for name in spec["scenarios"]:
        overrides, report = overrides_for(cfg, graph, all_plans[name], rank, meta)
        out = {f"meta.{k}": v.clone().contiguous() for k, v in meta.items()}
        local_shapes = {}
        with torch.no_grad():
            for node, value in iter_graph(graph, {**request, **meta}, params, ops, overrides):
                if node.name in overrides and (".0." in node.name or node.name.startswith("heads.")):
                    local_shapes[node.name] = list(value.shape)
                full = report(node, value)
                if rank == 0:
                    out[node.name] = full.clone().contiguous()
        if rank == 0:
            info = {"overridden_nodes": str(len(overrides)), "rank0_local_shapes": json.dumps(local_shapes)}
            save_file(out, str(folder / f"{name}.safetensors"), metadata=info)
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3gate.distributed", description="one gloo harness rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        _worker(args.rank, args.world, args.dir)
    except InputError as exc:
        print(f"h3gate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
