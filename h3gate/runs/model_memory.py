"""Upper estimates of the whole-model verbs' peaks (``run ws1-model``, ``run ws1-trajectory``): what their engines
hold at once, counted from the config and layout before any weight is read, times the allocator's slack
(:data:`~h3gate.runs.memory_plan.ALLOCATOR_SLACK`) and, on the CPU, the process's own buffers. They only warn
(:class:`~h3gate.runs.memory_plan.MemoryPlan`'s warning line and evidence record); the lower bounds
(:func:`~h3gate.runs.memory_plan.model_lower_bound_bytes`) refuse.

Sizes, per transformer block stage (the largest stage in weights and in node values: the refiner blocks run on the
text rows, the embeddings and heads on one ``H``-wide value per row): ``W`` the block's parameters
(:func:`~h3gate.runs.memory_plan.block_weight_count`), ``E`` its node-output elements (``S`` rows of every node,
:func:`~h3gate.graph.block.row_widths`), ``X = S H`` one stage boundary (the hidden state a block reads).
Measured on the CPU twin: docs/measurements/gpu-estimates.md.
"""

from __future__ import annotations

import math

from h3gate import memory
from h3gate.checkpoint import ITEMSIZE
from h3gate.graph.block import BLOCK_NODES, row_widths
from h3gate.inventory import expected_inventory
from h3gate.manifests.model_config import ModelConfig
from h3gate.runs import memory_plan
from h3gate.runs.memory_plan import (
    ALLOCATOR_SLACK,
    CPU_PROCESS_BYTES,
    MemoryPlan,
    block_weight_count,
    golden_attention_bytes,
    streamed_peak_width,
)

# The CPU process's own buffers in a forward under no_grad (oneDNN's scratch, OpenMP's per-thread stacks; no autograd
# engine): a trajectory evaluation at tiny config, micro layout, grows the resident size by 12.3-12.9 MB with 5.8 MB
# counted (docs/measurements/gpu-estimates.md); the backward's :data:`~h3gate.runs.memory_plan.CPU_PROCESS_BYTES`
# (128 MiB) would put the estimate at ten times the peak.
CPU_FORWARD_PROCESS_BYTES = 8 << 20
# The CPU process's own buffers and heap under the whole-model gate with the backward: with every lane but the default
# provider dropping its node values after their last reader, the tiny gate's resident peak measures 274-326 MB, above
# the 298 MB CPU_PROCESS_BYTES would give (glibc's heap fragmented by the early frees, the likeliest cause, not
# isolated); docs/measurements/gpu-estimates.md.
CPU_BACKWARD_PROCESS_BYTES = 192 << 20


def stage_sizes(cfg: ModelConfig, rows: int) -> tuple[int, int, int]:
    """``(W, E, X)`` of one transformer block stage at ``rows`` packed rows (module docstring)."""
    return block_weight_count(cfg), rows * sum(row_widths(cfg)[n] for n in BLOCK_NODES), rows * cfg.hidden_size


def model_weight_bytes(cfg: ModelConfig) -> int:
    """Every stored tensor of the model at its checkpoint dtype (what a trajectory keeps on the device)."""
    return sum(math.prod(s.shape) * ITEMSIZE[s.dtype] for s in expected_inventory(cfg))


def _slacked(phase: int, device: str, process: int = CPU_PROCESS_BYTES) -> int:
    kind = "cpu" if device == "cpu" else "cuda"
    return int(ALLOCATOR_SLACK[kind] * phase) + (process if kind == "cpu" else 0)


def model_peak_estimate_bytes(
    cfg: ModelConfig, rows: int, stages: int, providers: int, backward: bool, device: str, host: bool = False
) -> int:
    """An upper estimate of a ``run ws1-model`` peak (:mod:`h3gate.runs.ws1_model`; a streamed range holds one
    range's stages of the same lanes, no more): the larger of the forward and the backward phase at a block stage,
    with ``providers`` provider lanes (the default and the variants this device runs) beside the FP64 golden, the
    candidate, its repeat and two batch placements (3 and 2 items), times the slack; ``host``: the backward holds on
    the host (:func:`hold_on_host`)."""
    forward = model_forward_phase(cfg, rows, stages, providers, backward, device)
    back = model_backward_phase(cfg, rows, stages, providers, device, host) if backward else 0
    return _slacked(max(forward, back), device, CPU_BACKWARD_PROCESS_BYTES if backward else CPU_PROCESS_BYTES)


def hold_on_host(cfg: ModelConfig, rows: int, providers: int, backward: bool, device: str) -> bool:
    """Whether the backward holds on the host (:attr:`h3gate.runs.ws1_model.ModelGate.hold_on_host`): on a CUDA
    device, when one block stage's backward with everything on the device (:func:`model_backward_phase`, its own
    stage's boundaries only) times the slack exceeds what the device has available. The arithmetic is the same
    either way; only where the held tensors wait differs."""
    if not backward or device == "cpu":
        return False
    need = _slacked(model_backward_phase(cfg, rows, 1, providers, device), device)
    return need > memory.device_available_bytes(device)


def _saving_bytes(providers: int) -> int:
    """Bytes per boundary element of the lanes that keep stage inputs for the backward: the golden (FP64), the
    providers, the candidate, its repeat (bf16) and the batch-of-2 placement (two bf16 items)."""
    return 8 + 2 * providers + 2 + 2 + 2 * 2


def model_forward_phase(cfg: ModelConfig, rows: int, stages: int, providers: int, backward: bool, device: str) -> int:
    """One block stage of the forward (:mod:`h3gate.runs.model_forward`), all held at once:

    * per ``W``: the stage's parameters, bf16 and their FP64 copy (``2 + 8``);
    * per ``E``: the stage's node values of the golden (FP64), the provider and the candidate (bf16), and the batch
      placements' (3 + 2 items, bf16) while they are compared (``8 + 2 + 2 + 5 * 2``); the golden's working copies
      at its widest node (one FP64 per element of :func:`~h3gate.runs.memory_plan.streamed_peak_width`) and its
      attention's (:func:`~h3gate.runs.memory_plan.golden_attention_bytes`);
    * per ``X``: with the backward, every stage's input kept by each saving lane (:func:`_saving_bytes`) and the
      batch-of-3 lane's two boundaries; without it, two boundaries of every lane (the forward-only placement is a
      batch of 2)."""
    w, e, x = stage_sizes(cfg, rows)
    batch3 = 3 * 2
    if backward:
        boundaries = x * ((stages + 1) * _saving_bytes(providers) + 2 * batch3)
    else:
        boundaries = 2 * x * (8 + 2 * providers + 2 + 2 + batch3 + 2 * 2)
    working = rows * streamed_peak_width(cfg) * 8 + golden_attention_bytes(cfg, rows, device)
    return w * (2 + 8) + e * (8 + 2 + 2 + 5 * 2) + working + boundaries


def model_backward_phase(cfg: ModelConfig, rows: int, stages: int, providers: int, device: str,
                         host: bool = False) -> int:  # fmt: skip
    """One block stage of the backward (:mod:`h3gate.runs.model_backward`) at its fullest. The chained lanes run one
    at a time, each reduced to its records before the next, beside the golden's node gradients (FP64), the provider's
    recomputed values and gradients and the candidate's gradients (bf16); the golden's are dropped before the
    isolated stage's FP64 backward, which runs beside the provider's and the candidate's. The fullest moments
    (per ``E``): that FP64 backward running (values, gradients and autograd's saved intermediates, at most one FP64
    per element: ``24``) beside the provider and the candidate (``4 + 2``), or the batch-of-2 placement running
    (values, gradients, at most one FP32 intermediate per element, two items: ``2 * 8``) beside the golden's
    gradients, the provider and the candidate (``8 + 4 + 2``). Holding on the host (``host``): the golden's
    gradients and, while the other lanes run, the provider's wait in host memory, and the golden keeps only what
    autograd saved (``8``): ``max(8 + 4 + 2, 2 * 8 + 2)``.

    * per ``W``: the parameters (``2 + 8``); the held parameter gradients (golden FP64, the provider, the candidate,
      the isolated candidate and the running lane's in bf16: ``8 + 4 * 2``);
    * per ``E``: ``max(24 + 6, 14 + 16)``; the running op's backward temporaries (two FP64 per element of the widest
      node, :func:`~h3gate.runs.memory_plan.streamed_peak_width`) and the golden attention's working set;
    * per ``X``: every stage's input still kept by each saving lane (at the heads' backward all of them) and each
      saving lane's incoming and accumulated input gradients (``2 * ...``). ``providers`` counts in the boundaries
      only: a variant's stage backward is reduced to its row errors before the next lane runs."""
    w, e, x = stage_sizes(cfg, rows)
    weights = w * (2 + 8 + 8 + 4 * 2)
    values = e * (max(8 + 4 + 2, 2 * 8 + 2) if host else max(24 + 4 + 2, 8 + 4 + 2 + 2 * 8))
    working = rows * streamed_peak_width(cfg) * 2 * 8 + golden_attention_bytes(cfg, rows, device)
    boundaries = x * (stages + 2) * _saving_bytes(providers)
    return weights + values + working + boundaries


def trajectory_peak_estimate_bytes(cfg: ModelConfig, rows: int, batch: int, device: str) -> int:
    """An upper estimate of a ``run ws1-trajectory`` peak (:func:`h3gate.runs.ws1_trajectory.evaluate`): every
    weight of the model resident at its stored dtype (:func:`model_weight_bytes`), and one evaluation of ``batch``
    requests (2 under ``--batch-with``) under no_grad: per item every node value of the running stage (bf16,
    ``2 E``; :func:`~h3gate.graph.stages.run_stage` keeps them until the stage ends), the boundaries carried between
    stages (the stage's input and the text stream: ``2 * 2 X``) and one op's float32 working copies at the widest
    node (``4`` per element of :func:`~h3gate.runs.memory_plan.streamed_peak_width`; the candidate's attention is
    flash-like: no ``S x S`` matrix). Times the slack; on the CPU plus :data:`CPU_FORWARD_PROCESS_BYTES`."""
    _, e, x = stage_sizes(cfg, rows)
    per_item = e * 2 + 2 * x * 2 + rows * streamed_peak_width(cfg) * 4
    return _slacked(model_weight_bytes(cfg) + batch * per_item, device, CPU_FORWARD_PROCESS_BYTES)


def trajectory_lower_bound_bytes(cfg: ModelConfig, rows: int, batch: int) -> int:
    """A lower bound on what one ``run ws1-trajectory`` evaluation holds at once: every stored weight of the model
    (:func:`model_weight_bytes`, resident for the whole run) and, per request of the ``batch``, the bf16 values a block
    execution holds at its widest node (:func:`~h3gate.runs.memory_plan.streamed_peak_width`: the block input and the
    node outputs live there, 2 bytes each)."""
    return model_weight_bytes(cfg) + batch * rows * streamed_peak_width(cfg) * 2


def record_host_bytes(cfg: ModelConfig, rows: int) -> int:
    """A lower bound on the host memory one trajectory evaluation adds to the determinism record
    (:func:`h3gate.graph.determinism.observe`): every transformer block node output with packed rows keeps its per-row
    fingerprints (one int64 a row, whatever the batch) in host memory until the invocation ends; the refiner's,
    the embeddings' and the heads' are not counted. At 768p, 0.25 GB an evaluation."""
    nodes = sum(1 for n in BLOCK_NODES if row_widths(cfg)[n] > 0)
    return cfg.num_layers * nodes * rows * 8


def plan_model_memory(
    cfg: ModelConfig, rows: int, stages: int, providers: int, backward: bool, batch: int | None, device: str,
    lower: int, host: int, hold: bool = False,
) -> MemoryPlan:  # fmt: skip
    """The plan a whole-model run records (``lower``: the bound :func:`h3gate.runs.setup.prepare` refused on;
    ``host``: ``--save-tensors``' host copy; ``hold``: the backward holds on the host, :func:`hold_on_host`): the
    gate's upper estimate, or with ``batch`` set a trajectory's, and what the device (host memory on the CPU) has
    free, for the warning (never a refusal)."""
    if batch is None:
        what = f"whole-model gate, {providers} provider lanes, " + ("forward and backward" if backward else "forward")
        what += ", the golden's gradients held in host memory" if hold else ""
        upper = model_peak_estimate_bytes(cfg, rows, stages, providers, backward, device, hold)
    else:
        what = f"trajectory evaluation, batch {batch}, every weight resident"
        upper = trajectory_peak_estimate_bytes(cfg, rows, batch, device)
    free = memory_plan.available_memory_bytes() if device == "cpu" else memory.device_available_bytes(device)
    return MemoryPlan("device", lower, host, what, upper, free, "host" if hold else "device")
