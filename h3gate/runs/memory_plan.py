"""Memory plans: what a run will hold, estimated from its config and layout before any weight is read, against what
the device (or host) has; an :class:`~h3gate.errors.InputError` naming the options when it does not fit.

The one-block gate plans where its value store goes (:func:`plan_block_memory`: on the device, or in host memory
for a forward-only run whose store does not fit beside pass 1) on lower bounds, which refuse, and carries an upper
estimate of its peak (:func:`block_peak_estimate_bytes`), which only warns; the whole-model gate bounds one stage's
weights and values per lane (:func:`model_lower_bound_bytes`) and ``--save-tensors``' host copy
(:func:`saved_values_bytes`; the one-block gate's: :func:`block_saved_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3gate import memory
from h3gate.errors import InputError
from h3gate.graph.block import BLOCK_NODES, block_param_shapes, build_block_graph, row_widths
from h3gate.graph.execute import live_at
from h3gate.graph.stages import Stage
from h3gate.layout import PackedLayout
from h3gate.manifests.model_config import ModelConfig
from h3gate.memory import GIB
from h3gate.memory import host_available_bytes as available_memory_bytes
from h3gate.ops.golden import CHUNK_BYTES, DENSE_ATTENTION_GOLDEN_BYTES


def block_lower_bound_bytes(cfg: ModelConfig, rows: int) -> int:
    """A lower bound on what a ws1-block run holds at once, on the CPU or a GPU (weights and activations only).

    Block weights (q/k/v/o: ``4 H (N D)``, feed-forward: ``3 H F``) in bf16 plus their float64 golden copy
    (10 bytes each), and the forward values kept of every node for ``rows`` packed rows: six nodes ``H`` wide,
    eight ``N D`` wide, gate-up ``2F`` and swiglu ``F``, at float64 (golden) + bf16 (provider) + bf16 (candidate,
    chained) + bf16 (candidate, isolated: all four are held together for the row rule). The isolated set matters at
    long S: without it ``ref2va-768p`` (S = 83386) would start on an H200 and run out of memory in the golden; with it
    that layout is refused up front and 768p (S = 38974) is not.
    """
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8)
    values = rows * (6 * h + 8 * nd + 3 * f) * (8 + 2 + 2 + 2)
    return weights + values


def block_backward_bytes(cfg: ModelConfig, rows: int) -> int:
    """A lower bound on what the one-block backward (``runs/block_backward.py``) adds: the gradients of the provider,
    its repeat, the candidate, its repeat (bf16) and the golden (float64) are held together while the golden's
    backward runs, each lane's leaf gradients (the block weights) and every node output's gradient for ``rows``
    packed rows: ``(4 * 2 + 8)`` bytes per weight and per node-output element."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    widths = row_widths(cfg)
    per_lane = 4 * 2 + 8
    return (4 * h * nd + 3 * h * f) * per_lane + rows * sum(widths[n] for n in BLOCK_NODES) * per_lane


# The upper estimate's allowance for the allocator, over the bytes counted. CUDA: torch's caching allocator keeps
# freed blocks for reuse (a request no cached block fits grows the pool beside them) and rounds blocks up (2 MiB
# segments for large ones); 1.25: at real / medium a ws1-block's reserved peak was 1.07 of the counted bytes and its
# allocated peak 0.94 (H100). CPU: glibc's heap (an arena per thread) grows through the
# streamed forward's transients and keeps them resident: at tiny config the counted bytes match the live tensors,
# while VmHWM less the process's own buffers was up to 1.75x them (S = 3160), spread 16 % from run to run; the
# process's own buffers (oneDNN, OpenMP, the autograd engine: ~110 MB at every S measured) are
# :data:`CPU_PROCESS_BYTES`. Measured: docs/measurements/gpu-estimates.md.
ALLOCATOR_SLACK = {"cuda": 1.25, "cpu": 2.25}
CPU_PROCESS_BYTES = 128 << 20


def block_weight_count(cfg: ModelConfig) -> int:
    """Every parameter of one block (q/k/v/o, feed-forward, the AdaLN projection and the norms)."""
    return sum(math.prod(shape) for shape, _ in block_param_shapes(cfg).values())


def golden_attention_bytes(cfg: ModelConfig, rows: int, device: str, batch: int = 1) -> int:
    """The golden attention's working set beyond its inputs and output, at its peak (forward or backward).

    Dense (:func:`h3gate.ops.golden.attention_golden` while one float64 ``(B, nh, S, S)`` score matrix ``M`` fits
    ``DENSE_ATTENTION_GOLDEN_BYTES``): torch's math SDPA holds three such matrices at once in the forward (scores,
    softmax, the safe-softmax result, with a bool mask of ``M / 8``) and three under autograd's backward (the saved
    probabilities, their gradient, the scores' gradient): ``3 M + M / 8``. On the CPU torch runs float64 SDPA with
    its flash kernel (query/key blocks, no ``S x S`` matrix): 0. Chunked (above the limit, any device): at most
    four ``(B, nh, C, S)`` float64 blocks (scores, their shifted copy, probabilities; in the backward the
    probabilities, ``dp``, ``dp - rowdot`` and ``ds``)."""
    nh = cfg.num_attention_heads
    scores = batch * nh * rows * rows * 8
    if scores > DENSE_ATTENTION_GOLDEN_BYTES:
        per_row = batch * nh * rows * 8
        return 4 * per_row * min(rows, max(1, CHUNK_BYTES // per_row))
    return 0 if device == "cpu" else 3 * scores + scores // 8


def block_peak_estimate_bytes(cfg: ModelConfig, rows: int, needs: GateNeeds, device: str, store: str = "device") -> int:
    """An upper estimate of a ws1-block run's device peak: :data:`ALLOCATOR_SLACK` times the largest phase (and
    :data:`CPU_PROCESS_BYTES` on the CPU). Per weight ``W``, per node-output element ``E`` (``S`` rows of every
    node) and per block-input element ``X``:

    * the streamed forward: :func:`block_forward_bytes`, the golden's intermediates at its widest node (one more
      float64 per element) and :func:`golden_attention_bytes`;
    * the golden's backward (:func:`_golden_phase`) and the gradient batch placements (:func:`_batch_phase`), when
      the backward or the fault matrix runs."""
    widths = row_widths(cfg)
    elements = rows * sum(widths[n] for n in BLOCK_NODES)
    attention = golden_attention_bytes(cfg, rows, device)
    forward_phase = (block_forward_bytes(cfg, rows, needs, store == "device") + rows * streamed_peak_width(cfg) * 8
                     + attention)  # fmt: skip
    phase = forward_phase
    if needs.backward or needs.fault_matrix:
        store_per = 2 + 2 + (8 if needs.save_golden else 0)
        weights, inputs = block_weight_count(cfg), rows * widths["hidden_states"]
        phase = max(phase, _golden_phase(weights, elements, inputs, store_per) + attention,
                    _batch_phase(weights, elements, inputs, store_per))  # fmt: skip
    kind = "cpu" if device == "cpu" else "cuda"
    return int(ALLOCATOR_SLACK[kind] * phase) + (CPU_PROCESS_BYTES if kind == "cpu" else 0)


def _golden_phase(weights: int, elements: int, inputs: int, store_per: int) -> int:
    """The golden's backward, all held at once: per ``W`` the bf16 parameters, their float64 copy, the golden's
    float64 leaf clone and gradient, the four bf16 lanes' gradients (``2 + 8 + 8 + 8 + 4 * 2``); per ``E`` the value
    store, the candidate's autograd outputs and its repeat's (bf16, the latter held by the backward until the next
    lane's replace them), the four lanes' node gradients (bf16), the golden's values, node gradients and autograd's
    saved intermediates (at most one float64 per element: norms keep ``x / rms``, the result and the gathered
    scale, the residuals their gathered gate, swiglu ``silu(gate)``, SDPA its output)
    (``store + 2 * 2 + 4 * 2 + 3 * 8``); per ``X`` the input, its float64 copy and clone, five lanes' gradients and the
    cotangent (``2 + 8 + 8 + 4 * 2 + 8 + 2 + 8``). The attention's working set is added by the caller."""
    return weights * 34 + elements * (store_per + 2 * 2 + 8 + 24) + inputs * 44


def _batch_phase(weights: int, elements: int, inputs: int, store_per: int) -> int:
    """The provider's batch-of-two gradient, after the golden's: per ``W`` the parameters (bf16, float64), five
    lanes' gradients, the batch lane's clone and gradient (``2 + 8 + 4 * 2 + 8 + 2 + 2``); per ``E`` the value
    store, five lanes' node gradients (four bf16, the golden's float64), the golden's values (kept to the backward's
    end), the candidate's batch gradients with their probed slices and its autograd forward's slices
    (``2 * 2 + 2 + 2``), and the running lane at batch 2: values, gradients and intermediates (at most one float32
    per element: ``2 * (2 + 2 + 4)``); per ``X`` as the golden phase's, and the batch's two inputs and
    cotangents."""
    return weights * 30 + elements * (store_per + 8 + 8 + 8 + 8 + 16) + inputs * (44 + 2 * 2 * 2)


def check_memory(cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str, device: str) -> None:
    """The whole-execution lower bound against host memory (CPU) or the GPU's free memory, before any weight is
    placed there."""
    _require(block_lower_bound_bytes(cfg, packed.seq_len), packed, layout, config_name, device, "use a smaller layout")


@dataclass(frozen=True)
class GateNeeds:
    """What a ws1-block run keeps, for its memory plan: ``provider_lanes`` counts the default provider and the
    variants this device runs (pass 1 streams them all beside the golden and the candidate); the backward and the
    fault matrix hold whole executions on the device; ``--save-tensors`` keeps the golden's values too."""

    provider_lanes: int
    backward: bool = True
    fault_matrix: bool = False
    save_golden: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """Where the gate keeps the provider's and candidate's values (``device`` or ``host``), the estimates the plan
    compared (lower bounds, bytes: what refuses), and the upper estimate of the device's peak with what the device
    had free (``None`` where unknown): :attr:`warning` when the peak may not fit."""

    store: str
    device_bytes: int
    host_bytes: int
    estimate: str
    upper_bytes: int | None = None
    available_bytes: int | None = None
    hold: str = "device"  # where a whole-model backward holds the golden's gradients (runs.model_memory.hold_on_host)

    @property
    def warning(self) -> str | None:
        """One line when the upper estimate exceeds what the device has (the run may still fit: it is not refused)."""
        if self.upper_bytes is None or self.available_bytes is None or self.upper_bytes <= self.available_bytes:
            return None
        return (f"memory: the peak may reach {self.upper_bytes / GIB:.1f} GiB (upper estimate; at least "
                f"{self.device_bytes / GIB:.1f} GiB), {self.available_bytes / GIB:.1f} GiB available: the run may "
                "run out of memory")  # fmt: skip

    def record(self) -> dict:
        """GiB to 4 decimals (0.1 MB: tiny configs' plans are a few MB)."""
        upper = {} if self.upper_bytes is None else {"upper_gib": round(self.upper_bytes / GIB, 4)}
        free = {} if self.available_bytes is None else {"available_gib": round(self.available_bytes / GIB, 4)}
        hold = {"hold": self.hold} if self.hold != "device" else {}
        return {"store": self.store, "estimate": self.estimate, "device_gib": round(self.device_bytes / GIB, 4),
                "host_gib": round(self.host_bytes / GIB, 4), **upper, **free, **hold}  # fmt: skip


def streamed_peak_width(cfg: ModelConfig) -> int:
    """The most elements per packed row one streamed block execution holds (``graph.execute.iter_graph``): the
    block input and the node outputs live at the widest node (``swiglu``: 3F + 2H)."""
    graph, widths = build_block_graph(cfg), row_widths(cfg)
    return widths["hidden_states"] + max(sum(widths[v] for v in live_at(graph, k)) for k in range(len(graph.nodes)))


def block_forward_bytes(cfg: ModelConfig, rows: int, needs: GateNeeds, store_on_device: bool) -> int:
    """A lower bound on what the streamed forward (``runs/block_forward.py``) holds on the device at once: block
    weights in bf16 and float64 (10 bytes each), pass 1's lanes at their widest (float64 golden, ``provider_lanes``
    and the candidate in bf16, :func:`streamed_peak_width` each) and, when it is on the device, the value store."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8)
    lanes = rows * streamed_peak_width(cfg) * (8 + 2 * (needs.provider_lanes + 1))
    return weights + lanes + (store_bytes(cfg, rows, needs) if store_on_device else 0)


def store_bytes(cfg: ModelConfig, rows: int, needs: GateNeeds) -> int:
    """The value store: every node value of the provider and the candidate (bf16), and the golden's (float64)."""
    widths = row_widths(cfg)
    return rows * sum(widths[n] for n in BLOCK_NODES) * (2 + 2 + (8 if needs.save_golden else 0))


def plan_block_memory(
    cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str, device: str, needs: GateNeeds
) -> MemoryPlan:
    """Where the value store goes, or an :class:`InputError` before any weight is read.

    The backward and the fault matrix hold whole executions on the device (:func:`block_lower_bound_bytes`, at
    least the forward's, plus the backward's gradients: :func:`block_backward_bytes`); a forward-only run keeps its
    store on the device when everything fits, else in host memory with pass 1 on the device (on the CPU both are
    the host). Only the lower bounds refuse; the plan carries :func:`block_peak_estimate_bytes` and what the
    device has free, for a warning (:attr:`MemoryPlan.warning`)."""
    plan = _plan_store(cfg, packed, layout, config_name, device, needs)
    upper = block_peak_estimate_bytes(cfg, packed.seq_len, needs, device, plan.store)
    free = available_memory_bytes() if device == "cpu" else memory.device_available_bytes(device)
    return MemoryPlan(plan.store, plan.device_bytes, plan.host_bytes, plan.estimate, upper, free)


def _plan_store(
    cfg: ModelConfig, packed: PackedLayout, layout: str, config_name: str, device: str, needs: GateNeeds
) -> MemoryPlan:
    rows = packed.seq_len
    streamed = block_forward_bytes(cfg, rows, needs, store_on_device=True)
    if needs.backward or needs.fault_matrix:
        whole = block_lower_bound_bytes(cfg, rows) + (block_backward_bytes(cfg, rows) if needs.backward else 0)
        need = max(whole, streamed)
        _require(need, packed, layout, config_name, device, "use a smaller layout or --no-backward")
        return MemoryPlan("device", need, 0, "whole executions (backward or fault matrix)")
    available = memory.device_available_bytes(device)
    if device == "cpu" or available is None or streamed <= available:
        _require(streamed, packed, layout, config_name, device, "use a smaller layout")
        return MemoryPlan("device", streamed, 0, "streamed forward, store on the device")
    need = block_forward_bytes(cfg, rows, needs, store_on_device=False)
    _require(need, packed, layout, config_name, device, "use a smaller layout")
    host = store_bytes(cfg, rows, needs)
    host_free = available_memory_bytes()
    if host_free is not None and host > host_free:
        what = _what(packed, layout, config_name, device)
        raise InputError(
            f"{what}: its value store needs at least {host / GIB:.1f} GiB of host memory, {host_free / GIB:.1f} GiB "
            "available; use a smaller layout"
        )
    return MemoryPlan("host", need, host, "streamed forward, store in host memory")


def _what(packed: PackedLayout, layout: str, config_name: str, device: str) -> str:
    return f"--layout {layout} --config {config_name} --device {device} (S={packed.seq_len})"


def _require(need: int, packed: PackedLayout, layout: str, config_name: str, device: str, hint: str) -> None:
    """Refuse ``need`` bytes beyond what ``device`` has (the CPU's message names --device cuda as the way out)."""
    if device != "cpu":
        memory.require(need, _what(packed, layout, config_name, device), device, hint=hint)
        return
    available = available_memory_bytes()
    if available is not None and need > available:
        raise InputError(
            f"--layout {layout} --config {config_name} --device cpu: needs at least {need / GIB:.1f} GiB "
            f"(S={packed.seq_len}), {available / GIB:.1f} GiB available; use a smaller layout or --device cuda"
        )


def block_node_elements(cfg: ModelConfig, seq_len: int) -> int:
    """``E``: one block's node-output elements at ``seq_len`` rows (six nodes ``H`` wide, eight ``N D``, gate-up
    ``2F`` and swiglu ``F`` per row)."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    return seq_len * (6 * h + 8 * nd + 3 * f)


def model_lower_bound_bytes(
    cfg: ModelConfig, seq_len: int, stages: int, lanes: int, backward: bool, host: bool = False
) -> int:
    """A lower bound on what a ws1-model run holds at once: one block's weights in bf16 + FP64 (twice under the
    backward: parameter gradients); one block's node values ``E`` (:func:`block_node_elements`), forward at FP64
    (golden) + bf16 for the provider, the candidate and a batch of three (``18 E`` bytes), or, with the backward, a
    stage backward at its fullest (:func:`h3gate.runs.model_backward.backward`: the golden's FP64 recomputed values
    and node gradients beside the provider's bf16 values and gradients and the candidate's gradients: ``22 E``; the
    other lanes run one at a time after it, reduced to records at once); each lane's stage boundaries ``S x H``
    (bf16, golden FP64) for ``stages`` stages holding packed rows (:func:`row_stages`), kept for every such stage
    when the backward runs. Holding on the host (``host``, :func:`h3gate.runs.model_memory.hold_on_host`), the
    golden's gradients wait in host memory and its values are dropped after their last reader: the isolated stage
    backward still runs beside the provider's values and gradients and the candidate's (``6 E``)."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8) * (2 if backward else 1)
    forward = 8 + 2 * (1 + 1 + 3)
    stage_backward = 2 * 2 + 2 if host else 2 * 8 + 2 * 2 + 2
    values = block_node_elements(cfg, seq_len) * (max(forward, stage_backward) if backward else forward)
    boundaries = seq_len * h * (8 + 2 * lanes) * (stages if backward else 2)
    return weights + values + boundaries


def phase1_lower_bound_bytes(cfg: ModelConfig, seq_len: int, lanes: int, backward: bool, segment: int) -> int:
    """A lower bound on what phase 1 of a streamed ws1-model run holds at once (:func:`h3gate.runs.model_stream.phase1`:
    one lane through one stage at a time, nothing judged): one block's weights in bf16 and FP64 (under the backward
    also the golden's FP64 parameter gradients); the golden's node values of a block at FP64 in the forward (``8 E``;
    its stage backward keeps no node value or gradient beyond what autograd saved: ``INPUTS_ONLY``); each lane's
    hidden state between stages, and under the backward each lane's stage inputs over one checkpoint segment of
    ``segment`` stages (``S x H`` each, bf16, golden FP64)."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    weights = (4 * h * nd + 3 * h * f) * (2 + 8 + (8 if backward else 0))
    values = block_node_elements(cfg, seq_len) * 8
    return weights + values + seq_len * h * (8 + 2 * lanes) * (segment if backward else 1)


def row_stages(blocks: int, first: bool = True, last: bool = True) -> int:
    """The stages whose saved inputs hold every packed row, in a range of ``blocks`` transformer blocks: each block,
    the packing (with the range from block 0: ``first``), the final AdaLN and the heads (with the range to the last
    block: ``last``). The embeddings, the refiner and the time embedding read request, text or timestep rows."""
    return blocks + (1 if first else 0) + (2 if last else 0)


def model_fault_matrix_bytes(cfg: ModelConfig, seq_len: int) -> int:
    """A lower bound on what ``run ws1-model --fault-matrix`` keeps beyond the gate until its end: for every stage
    whose backward faults re-run (each refiner block, the first and the last transformer block), the provider's and
    the candidate's saved stage inputs and incoming gradients (``S x H`` each, FP32 at most). Its per-row views are
    a few float64 values per row of each declared node."""
    return (cfg.num_refiner_layers + 2) * 2 * 2 * seq_len * cfg.hidden_size * 4


def transformer_blocks(stages: list[Stage]) -> int:
    """The transformer block stages (``block.N``: every packed row); the refiner blocks run on the text rows only, so
    a lower bound at ``S`` rows leaves them out."""
    return sum(1 for s in stages if s.label.startswith("block."))


def saved_values_bytes(cfg: ModelConfig, seq_len: int, stages: list[Stage], backward: bool = False) -> int:
    """A lower bound on ``run ws1-model --save-tensors``' host memory and files: every transformer block's node
    values (six nodes ``H`` wide, eight ``N D``, gate-up ``2F`` and swiglu ``F`` per packed row) at bf16 (provider,
    candidate) plus float64 (golden); with the backward the candidate's gradients (bf16): each of those node outputs'
    and each block's weights'. The refiner blocks (text rows only, fewer than ``seq_len``) are not counted."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    blocks = transformer_blocks(stages)
    nodes = blocks * block_node_elements(cfg, seq_len)
    grads = (nodes + blocks * (4 * h * nd + 3 * h * f)) * 2 if backward else 0
    return nodes * (2 + 2 + 8) + grads


def block_saved_bytes(cfg: ModelConfig, rows: int, backward: bool) -> int:
    """A lower bound on ``run ws1-block --save-tensors``' files, every tensor held on the host before any is
    written: each node value of the provider and the candidate (bf16) and the golden (float64), each lane's
    ``output`` copy and the block input; with the backward the candidate's gradients (bf16): every node output's,
    the block input's, the cotangent and the block weights'."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    nodes = rows * sum(row_widths(cfg)[n] for n in BLOCK_NODES)
    values = (nodes + rows * h) * (2 + 2 + 8) + rows * h * 2
    grads = (nodes + 2 * rows * h + 4 * h * nd + 3 * h * f) * 2 if backward else 0
    return values + grads


def gathered_tensors_bytes(cfg: ModelConfig, seq_len: int, blocks: int) -> tuple[int, int]:
    """Lower bounds on ``run ws2 --save-tensors``: (host memory, disk). The parent holds every gathered node value
    and node-output gradient of ``blocks`` blocks (bf16, ``S`` rows of six ``H``-wide nodes, eight ``N D``, gate-up
    ``2F`` and swiglu ``F``) with each element's position (int32 at least), and the blocks' weight gradients (bf16);
    the files hold the values and gradients."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    elements = blocks * seq_len * (6 * h + 8 * nd + 3 * f)
    weight_grads = blocks * (4 * h * nd + 3 * h * f) * 2
    return elements * (2 + 2 + 4 + 4) + weight_grads, elements * (2 + 2) + weight_grads
