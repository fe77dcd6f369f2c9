"""Rank-local execution of a plan: node overrides and the gathers that report full tensors.

Every merge is an ``all_gather`` followed by a concatenation by logical id - no arithmetic crosses ranks, so a
sharded run is byte-equal to the single-process replay when every local op is invariant to the columns/rows it is
given (checked on CPU: GEMM columns and rows, per-head SDPA, query-row subsets of SDPA with the full K/V in packed
order).

* TP: AdaLN projection output chunks, Q/K/V heads, per-head Q/K norm, RoPE and attention, O projection output chunks
  (input = all heads gathered), FFN gate/up chunk pairs, SwiGLU, FFN down output chunks (input = all channels
  gathered). The refiner blocks are split the same way; embeddings, norms, residuals, timestep MLP and heads are
  replicated.
* CP: block nodes run on the rank's rows and row metadata; attention gathers K and V in rank (= packed row) order;
  the two output heads gather rows back before selection.
"""

from __future__ import annotations

import torch

from h3gate.graph.execute import NodeOverride
from h3gate.parallel.plans import ROW_META, CpPlan, Plan, TpPlan

# TP: the dimension along which each node's value holds the rank's heads (gathered and merged by head id)
HEADS_DIM = {
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


def _tp_node_fns(cfg, plan: TpPlan, rank: int) -> dict:
    """The rank's function for each sharded node kind of a refiner/transformer block (by the node's local name)."""
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

    return {
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


def _tp(cfg, graph, plan: TpPlan, rank: int, meta):
    nh, table = cfg.num_attention_heads, _tp_node_fns(cfg, plan, rank)

    def merge(t: torch.Tensor, dim: int) -> torch.Tensor:
        return _merge_chunks(all_gather(t), plan.owners, nh, dim)

    overrides, dims = {}, {}
    for node in graph.nodes:
        stage, _, local = node.name.rpartition(".")
        if not (stage.startswith("block.") or stage.startswith("refiner.")) or not stage[-1].isdigit():
            continue
        if local in table:
            overrides[node.name] = NodeOverride(table[local], label=f"TP{plan.world} {local}")
        if local in HEADS_DIM or local == "ffn_gate_up":
            dims[node.name] = HEADS_DIM.get(local, "pairs")

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


def overrides_for(cfg, graph, plan: Plan, rank: int, meta):
    """Node overrides running ``plan`` on ``rank``, and ``report(node, value)`` giving the full tensor (collective:
    every rank calls it for every node, in order)."""
    return (_tp if isinstance(plan, TpPlan) else _cp)(cfg, graph, plan, rank, meta)
