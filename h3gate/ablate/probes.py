"""Named perturbations of the strict arm, one small function each, referenced by name from ``ablations.yaml``.

An arm probe ``fn(ctx, arm) -> Arm`` changes one factor: metadata (``raw_hook``, ``adaln_rule``, layout
permutation), an operator (``OpTable.with_overrides`` wrapping the arm's own binding, so a probe perturbs whatever
execution runs), a node (:class:`~h3gate.graph.execute.NodeOverride`), the weights, the batch, or the sampler
(:class:`~h3gate.trajectory.Recipe`). Registered by name in :data:`ARM_PROBES` (the name a row's ``probe`` or
``strict`` gives); check rows name :data:`h3gate.ablate.checks.CHECKS`, multi-rank rows
:data:`h3gate.ablate.multirank.PLANS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from h3gate.ablate.arms import Arm
from h3gate.graph.execute import NodeOverride
from h3gate.graph.model import RawMetadata
from h3gate.layout import AUDIO_TAG, PackedLayout
from h3gate.ops import registry
from h3gate.schedule import Schedule, euler_step, scale_noise

OP_ATTENTION = "h3_full_attention"
QK_EPS_PROBE = 1e-3  # A2: the Q/K RMSNorm epsilon the probe uses instead of the config's 1e-5
KV_BLOCKS = 4  # A7: KV blocks of the split-KV plan


# -- helpers -------------------------------------------------------------------------------------------------------


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``reference.attention``'s layout around ``scaled_dot_product_attention`` with extra keyword arguments."""
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), dropout_p=0.0, **kwargs
    )
    return out.permute(0, 2, 1, 3).flatten(2, 3).type_as(q)


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Attention over ``KV_BLOCKS`` contiguous key blocks merged in ``order`` (a CP block plan).

    Block ``j``: ``o_j = sdpa(q, k_j, v_j)`` at q's dtype and ``lse_j = logsumexp(q k_j^T / sqrt(D))`` in FP32;
    merge ``lse = logaddexp(lse_acc, lse_j)``, ``o = o_acc * exp(lse_acc - lse) + o_j * exp(lse_j - lse)`` with the
    weights cast to q's dtype and the products/sum at q's dtype (BF16), so the merge order is visible in the bytes.
    """
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    bounds = torch.linspace(0, kh.shape[2], KV_BLOCKS + 1).round().long().tolist()
    scale = 1.0 / math.sqrt(q.shape[-1])
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        scores = (qh.float() @ kh[:, :, a:b].float().transpose(-1, -2)) * scale
        parts.append((F.scaled_dot_product_attention(qh, kh[:, :, a:b], vh[:, :, a:b]), scores.logsumexp(-1, True)))
    acc, lse = parts[order[0]]
    for j in order[1:]:
        o, l_j = parts[j]
        new = torch.logaddexp(lse, l_j)
        acc = acc * torch.exp(lse - new).to(o.dtype) + o * torch.exp(l_j - new).to(o.dtype)
        lse = new
    return acc.permute(0, 2, 1, 3).flatten(2, 3).type_as(q)


def _prefix(node) -> str:
    return node.name.rsplit(".", 1)[0]


def permuted_layout(layout: PackedLayout, perm: torch.Tensor, keep_positions: bool = False) -> PackedLayout:
    """``layout`` with packed row ``p`` holding logical row ``perm[p]``: every row tensor permuted and every index
    tensor remapped (``inv[idx]``), except ``position_ids`` when ``keep_positions`` (H1's left-behind tensor)."""
    inv = torch.argsort(perm)
    return replace(
        layout,
        name=f"{layout.name}~perm",
        position_ids=layout.position_ids if keep_positions else layout.position_ids[perm],
        token_tags=layout.token_tags[perm],
        video_indices=inv[layout.video_indices],
        audio_indices=inv[layout.audio_indices],
        text_indices=inv[layout.text_indices],
    )


def _raw(fn: Callable[[RawMetadata], RawMetadata], previous) -> Callable[[RawMetadata], RawMetadata]:
    return fn if previous is None else (lambda raw: fn(previous(raw)))


# -- 6.1 / 6.3 forward probes --------------------------------------------------------------------------------------


def identity(ctx, arm: Arm) -> Arm:
    """Change nothing: the same arm replayed from fresh state (repeat-run control)."""
    return arm.with_notes("probe arm = strict arm, executed again")


def shift_one_position(ctx, arm: Arm) -> Arm:
    """A1: the h coordinate of the first generated video row's position id + 1 (RoPE tables rebuilt from it)."""
    r = ctx.resolve_packed_row("video_target[0]")

    def hook(raw: RawMetadata) -> RawMetadata:
        pos = raw.position_ids.clone()
        pos[r, 1] += 1.0
        return replace(raw, position_ids=pos)

    return arm.with_notes(f"position_ids[{r}, h] + 1", raw_hook=_raw(hook, arm.raw_hook))


def qk_norm_epsilon(ctx, arm: Arm) -> Arm:
    """A2: Q/K RMSNorm epsilon 1e-5 -> 1e-3 (every Q/K norm, refiner included)."""
    base = arm.ops["h3_qk_rmsnorm_d128"]
    ops = arm.ops.with_overrides({"h3_qk_rmsnorm_d128": lambda x, w, heads, eps: base(x, w, heads, QK_EPS_PROBE)})
    return arm.with_notes(f"h3_qk_rmsnorm_d128 eps -> {QK_EPS_PROBE}", ops=ops)


def split_document(ctx, arm: Arm) -> Arm:
    """A3: the packed document split into two attention documents at row S // 2 (block-diagonal mask)."""

    def fn(ops, values, params, node):
        p = _prefix(node)
        q, k = values[f"{p}.rope_q"], values[f"{p}.rope_k"]
        v = values[f"{p}.v_proj"].unflatten(-1, (q.shape[2], -1))
        doc = torch.arange(q.shape[1], device=q.device) >= q.shape[1] // 2
        return sdpa(q, k, v, attn_mask=doc[:, None] == doc[None, :])

    return arm.with_notes(
        "block attention masked to two documents",
        overrides={**arm.overrides, "block.*.attention": NodeOverride(fn, label="split_document")},
    )


def adaln_cast_before_silu(ctx, arm: Arm) -> Arm:
    """A6: the AdaLN activation cast to BF16 before SiLU instead of after (cast point moved)."""
    ops = arm.ops.with_overrides({"adaln_silu_cast": lambda temb, dtype: F.silu(temb.to(dtype))})
    return arm.with_notes("adaln_silu_cast = silu(temb.to(bf16))", ops=ops)


def _split_kv(merge: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """``h3_full_attention`` as the split-KV plan merged in ``merge`` (packed-order blocks; the walk order ignored)."""
    return lambda q, k, v, order=None: split_kv_attention(q, k, v, merge)


def kv_split_merge_forward(ctx, arm: Arm) -> Arm:
    """A7 strict arm: every attention as a 4-block split-KV plan merged in block order 0, 1, 2, 3."""
    merge = tuple(range(KV_BLOCKS))
    ops = arm.ops.with_overrides({OP_ATTENTION: _split_kv(merge)})
    return arm.with_notes(f"split-KV attention, merge order {merge}", ops=ops)


def kv_split_merge_reversed(ctx, arm: Arm) -> Arm:
    """A7 probe: the same split-KV plan merged in reversed block order 3, 2, 1, 0."""
    merge = tuple(reversed(range(KV_BLOCKS)))
    ops = arm.ops.with_overrides({OP_ATTENTION: _split_kv(merge)})
    return arm.with_notes(f"split-KV attention, merge order {merge}", ops=ops)


def _batch(ctx, arm: Arm, size: int, position: int, tag: str) -> Arm:
    others = iter(ctx.request(100 + i) for i in range(size))
    items = tuple(arm.requests[0] if i == position else next(others) for i in range(size))
    return arm.with_notes(f"{tag}: batch of {size}, the request at item {position}", requests=items, batch_row=position)


def batch_position(ctx, arm: Arm) -> Arm:
    """C1: the request packed as item 2 of a batch of 3 (unrelated requests at items 0 and 1)."""
    return _batch(ctx, arm, 3, 2, "C1")


def batch_with_other_request(ctx, arm: Arm) -> Arm:
    """H-C1: the request as item 0 of a batch of 2 next to an unrelated request."""
    return _batch(ctx, arm, 2, 0, "H-C1")


# -- 6.2 mismatch probes -------------------------------------------------------------------------------------------


def permute_rows_leave_positions(ctx, arm: Arm) -> Arm:
    """H1: media rows packed in reverse order with tags and indices permuted, position_ids left unpermuted."""
    n_text, s = arm.layout.text_indices.numel(), arm.layout.seq_len
    perm = torch.cat([torch.arange(n_text), torch.arange(s - 1, n_text - 1, -1)])
    layout = permuted_layout(arm.layout, perm, keep_positions=True)
    return arm.with_notes("media rows reversed; position_ids not permuted", layout=layout, row_perm=perm)


def flip_one_tag(ctx, arm: Arm) -> Arm:
    """H2: the first generated video row's modality tag flipped video (0) -> audio (2)."""
    r = ctx.resolve_packed_row("video_target[0]")

    def hook(raw: RawMetadata) -> RawMetadata:
        tags = raw.token_tags.clone()
        tags[r] = AUDIO_TAG
        return replace(raw, token_tags=tags)

    return arm.with_notes(f"token_tags[{r}] = {AUDIO_TAG}", raw_hook=_raw(hook, arm.raw_hook))


def offset_one_timestep_index(ctx, arm: Arm) -> Arm:
    """H3: the first generated video row's timestep index offset by one (mod T)."""
    r = ctx.resolve_packed_row("video_target[0]")

    def hook(raw: RawMetadata) -> RawMetadata:
        ti = raw.timestep_indices.clone()
        ti[r] = (ti[r] + 1) % raw.timestep.numel()
        return replace(raw, timestep_indices=ti)

    return arm.with_notes(f"timestep_indices[{r}] + 1", raw_hook=_raw(hook, arm.raw_hook))


def modality_major_adaln(ctx, arm: Arm) -> Arm:
    """H4: AdaLN rows addressed modality-major (tag * T + t) against the timestep-major table."""
    return arm.with_notes(
        "adaln_indices = token_tags * T + timestep_indices", adaln_rule=lambda ti, tags, t: tags * t + ti
    )


def rope_axis_order(ctx, arm: Arm) -> Arm:
    """H5: MM-RoPE angle blocks concatenated [w | h | t] instead of [t | h | w] (wrong axis concatenation)."""
    f = ctx.cfg.rope_freq_dim
    base = arm.ops["h3_mm_rope_3axis_partial"]

    def swap(table: torch.Tensor) -> torch.Tensor:
        t, h, w = table[:, :f], table[:, f : 2 * f], table[:, 2 * f : 3 * f]
        half = torch.cat([w, h, t], dim=-1)
        return torch.cat([half, half], dim=-1)

    ops = arm.ops.with_overrides({"h3_mm_rope_3axis_partial": lambda x, cos, sin: base(x, swap(cos), swap(sin))})
    return arm.with_notes("rope tables reordered [w|h|t]", ops=ops)


def rope_before_qk_norm(ctx, arm: Arm) -> Arm:
    """H6: every block applies MM-RoPE to Q/K first and the per-head RMSNorm after (order swapped)."""
    heads, eps = ctx.cfg.num_attention_heads, ctx.cfg.qk_norm_eps

    def normed(which: str):
        def fn(ops, values, params, node):
            p, w = _prefix(node), params[f"{node.meta['param_prefix']}attn.norm_{which}.weight"]
            x = values[f"{p}.{which}_proj"].unflatten(-1, (heads, -1))
            rotated = ops["h3_mm_rope_3axis_partial"](x, values["rope_cos"], values["rope_sin"])
            return ops["h3_qk_rmsnorm_d128"](rotated.flatten(2), w, heads, eps)

        return NodeOverride(fn, label=f"rope then norm ({which})")

    def passthrough(which: str):
        return NodeOverride(lambda ops, values, params, node: values[f"{_prefix(node)}.{which}_norm"], label="no-op")

    overrides = {
        **arm.overrides,
        "block.*.q_norm": normed("q"),
        "block.*.k_norm": normed("k"),
        "block.*.rope_q": passthrough("q"),
        "block.*.rope_k": passthrough("k"),
    }
    return arm.with_notes("block q/k: rope then rmsnorm", overrides=overrides)


def video_input_bf16(ctx, arm: Arm) -> Arm:
    """H7: the video rows cast to BF16 before the FP32 video input projection (FP32 path rounded early)."""

    def fn(ops, values, params, node):
        w = params["proj_in.weight"]
        x = values["video_rows"].to(torch.bfloat16).to(w.dtype)
        return ops["video_input_projection_fp32"](x, w, params["proj_in.bias"])

    return arm.with_notes(
        "video_rows.to(bf16) before proj_in",
        overrides={**arm.overrides, "embed.video": NodeOverride(fn, label="bf16 input")},
    )


def causal_mask(ctx, arm: Arm) -> Arm:
    """H8: every attention (refiner included) causal instead of one non-causal document."""
    return arm.with_notes(
        "is_causal=True",
        ops=arm.ops.with_overrides({OP_ATTENTION: lambda q, k, v, order=None: sdpa(q, k, v, is_causal=True)}),
    )


def stale_video_selection(ctx, arm: Arm) -> Arm:
    """H14: the video output selection reads an index one row stale (video_indices - 1); packing is unchanged."""

    def hook(raw: RawMetadata) -> RawMetadata:
        return replace(raw, video_select=raw.video_indices - 1)

    return arm.with_notes("video_select = video_indices - 1", raw_hook=_raw(hook, arm.raw_hook))


def mixed_variant_block(ctx, arm: Arm) -> Arm:
    """H16: transformer block 0 read from the other variant's weights (``transformer_ref/`` on an FL2VA / T2VA
    layout, ``transformer/`` on a Ref2VA one; the same seed: the synthetic variants differ by their tensor seeds)."""
    other_variant = "transformer" if ctx.variant == "transformer_ref" else "transformer_ref"
    other = ctx.variant_source(ctx.seed, other_variant)
    params = dict(arm.params)
    for name in [k for k in params if k.startswith("transformer_blocks.0.")]:
        params[name] = other.load(name, ctx.device)
    note = f"transformer_blocks.0.* from {other_variant}/ (the run: {ctx.variant}/, synthetic seed {ctx.seed})"
    return arm.with_notes(note, params=params)


# -- 6.2 trajectory probes -----------------------------------------------------------------------------------------


def euler_subtract(model_output, timestep, sample, sigma, sigma_next):
    """Euler with the velocity subtracted: ``x0 = x - (1 - t) v`` (the usual flow-matching sign)."""
    return euler_step(-model_output, timestep, sample, sigma, sigma_next)


def euler_reordered(model_output, timestep, sample, sigma, sigma_next):
    """``x_next = x + (sigma - sigma_next) * v`` in FP32: algebraically the H3 blend, evaluated in another order."""
    s_now = sigma.to(device=sample.device, dtype=torch.float32)
    s_next = sigma_next.to(device=sample.device, dtype=torch.float32)
    return (sample.float() + (s_now - s_next) * model_output.float()).to(sample.dtype)


def generic_flow_grid(steps: int, shift: float) -> Schedule:
    """A generic flow-matching grid: shifted ``linspace(1, 1/1000, steps - 1)`` with a terminal 0 appended."""
    base = torch.linspace(1.0, 1.0 / 1000, steps - 1, dtype=torch.float32)
    sigmas = torch.cat([shift * base / (1 + (shift - 1) * base), torch.zeros(1)])
    return Schedule(shift=shift, steps=steps, sigmas=sigmas, timesteps=1.0 - sigmas[:-1])


def swapped_noise_mix(sample, t, noise):
    """``(1 - t) * x0 + t * noise``: the conditioning mix with t and 1 - t swapped."""
    return scale_noise(noise, t, sample)


def velocity_sign(ctx, arm: Arm) -> Arm:
    """H9: x0 = xt - sigma * v (velocity subtracted) in both Euler updates."""
    return arm.with_notes("euler: velocity subtracted", recipe=replace(arm.recipe, euler=euler_subtract))


def t_equals_sigma(ctx, arm: Arm) -> Arm:
    """H10: the model (and the steps) take t = sigma instead of t = 1 - sigma."""
    return arm.with_notes("t = sigma", recipe=replace(arm.recipe, timesteps_of=lambda s: s.sigmas[:-1]))


def generic_sigma_grid(ctx, arm: Arm) -> Arm:
    """H11: both schedules built on a generic flow-matching grid instead of H3's shifted linspace(1, 0)."""
    return arm.with_notes("generic flow-matching grid", recipe=replace(arm.recipe, grid=generic_flow_grid))


def shared_schedule(ctx, arm: Arm) -> Arm:
    """H12: the audio rows stepped on the video grid and index (one scheduler owns both modalities)."""
    return arm.with_notes("audio uses the video schedule", recipe=replace(arm.recipe, share_schedule=True))


def reordered_euler(ctx, arm: Arm) -> Arm:
    """H13: Euler update evaluated as x + (sigma - sigma_next) * v instead of the declared FP32 blend."""
    return arm.with_notes("euler: reordered expression", recipe=replace(arm.recipe, euler=euler_reordered))


def swapped_noise_formula(ctx, arm: Arm) -> Arm:
    """H15: conditioning rows mixed as (1 - t) * x0 + t * noise instead of t * x0 + (1 - t) * noise."""
    return arm.with_notes("condition mix formula swapped", recipe=replace(arm.recipe, condition_mix=swapped_noise_mix))


# -- H-C3 ----------------------------------------------------------------------------------------------------------


def strict_attention(ctx, arm: Arm) -> Arm:
    """H-C3 strict arm: ``h3_full_attention`` is the strict operator, which walks the rows in the graph's canonical
    ``attention_order`` (the factor the row tests). Under ``--mode strict`` (the kernel bound already) the arm is
    unchanged; under ``--mode off`` the provider's SDPA, which attends in packed order, is replaced by the kernel."""
    bound = ctx.execution["ops"].get(OP_ATTENTION, {})
    if bound.get("actual") == "triton":
        return arm.with_notes(f"{OP_ATTENTION}: the arm's own strict kernel ({bound.get('kernel_id')})")
    binding = registry.bind(OP_ATTENTION, "strict", ctx.device)
    return arm.with_notes(
        f"{OP_ATTENTION}: the strict kernel ({binding.kernel_id}) in place of the provider",
        ops=arm.ops.with_overrides({OP_ATTENTION: binding.fn}),
    )


def packed_order_attention(ctx, arm: Arm) -> Arm:
    """H-C3 diagnostic and negative control: the arm's own attention op given the identity order, i.e. walking the
    rows in packed order, whatever ``attention_order`` the graph holds."""
    base = arm.ops[OP_ATTENTION]

    def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order=None) -> torch.Tensor:
        return base(q, k, v, order=None if order is None else torch.arange(q.shape[1], device=q.device))

    ops = arm.ops.with_overrides({OP_ATTENTION: packed})
    return arm.with_notes(f"{OP_ATTENTION}: identity order (packed-order walk)", ops=ops)


def consistent_permutation(ctx, arm: Arm) -> Arm:
    """H-C3 probe: a seeded permutation of every packed row with positions, tags and indices permuted alike (the
    graph's ``attention_order``, derived from the indices, follows the rows)."""
    g = torch.Generator().manual_seed(ctx.seed)
    perm = torch.randperm(arm.layout.seq_len, generator=g)
    layout = permuted_layout(arm.layout, perm)
    probe_arm = arm.with_notes("all rows permuted consistently (seeded)", layout=layout, row_perm=perm)
    packed = packed_order_attention(ctx, arm)
    diagnostics = {
        # the same permutation with attention walked in packed order: how many rows that changes
        "packed_order_attention": (packed, packed_order_attention(ctx, probe_arm)),
        # canonical against packed order on the canonical layout (bitwise where the canonical order is the identity)
        "canonical_vs_packed_order": (packed, arm),
    }
    return replace(probe_arm, diagnostics=diagnostics)


def gradient_checkpointing(ctx, arm: Arm) -> Arm:
    """H-C6 probe: every refiner and transformer block under torch.utils.checkpoint (non-reentrant recompute)."""
    notes = ["torch.utils.checkpoint around each refiner/transformer block"]
    if ctx.cache.get("grad_params") is not None:
        notes.append(f"gradients of {len(ctx.cache['grad_params'])} parameters (boundary + first/last block)")
    return arm.with_notes(*notes, checkpointing=True)


ARM_PROBES: dict[str, Callable[..., Arm]] = {
    "identity": identity,
    "shift_one_position": shift_one_position,
    "qk_norm_epsilon": qk_norm_epsilon,
    "split_document": split_document,
    "adaln_cast_before_silu": adaln_cast_before_silu,
    "kv_split_merge_forward": kv_split_merge_forward,
    "kv_split_merge_reversed": kv_split_merge_reversed,
    "batch_position": batch_position,
    "batch_with_other_request": batch_with_other_request,
    "permute_rows_leave_positions": permute_rows_leave_positions,
    "flip_one_tag": flip_one_tag,
    "offset_one_timestep_index": offset_one_timestep_index,
    "modality_major_adaln": modality_major_adaln,
    "rope_axis_order": rope_axis_order,
    "rope_before_qk_norm": rope_before_qk_norm,
    "video_input_bf16": video_input_bf16,
    "causal_mask": causal_mask,
    "stale_video_selection": stale_video_selection,
    "mixed_variant_block": mixed_variant_block,
    "velocity_sign": velocity_sign,
    "t_equals_sigma": t_equals_sigma,
    "generic_sigma_grid": generic_sigma_grid,
    "shared_schedule": shared_schedule,
    "reordered_euler": reordered_euler,
    "swapped_noise_formula": swapped_noise_formula,
    "strict_attention": strict_attention,
    "packed_order_attention": packed_order_attention,
    "consistent_permutation": consistent_permutation,
    "gradient_checkpointing": gradient_checkpointing,
}
