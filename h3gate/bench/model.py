"""``h3gate bench ws1-model``: the whole MiniMax-H3 transformer, strict next to provider replay, forward and
forward + backward.

Both executions run in one process on the same inputs and the same parameters: every parameter of ``--config``
(synthetic, seed 0, generated on the device) is placed on the device once and shared by both arms; the inputs are
request 0 of ``--layout`` (:func:`h3gate.runs.model_stages.model_inputs`). The provider arm runs the torch
references (``provider_table``), the strict arm the bound Triton kernels (``candidate_table`` of
``bind_graph(graph, "strict", device)``, which fails closed, naming the node, before any weight is read).

What is timed, per arm (:func:`h3gate.bench.timing.side_by_side`: warm-up, then interleaved rounds, L2 flushed
before each call, CUDA events per call; median / min / max ms and the strict / provider ratio of the medians):

* ``forward`` - under ``no_grad``, stage by stage (:func:`h3gate.graph.stages.run_stage`), each value dropped
  after the last stage that reads it; returns ``(video, audio)`` = ``heads.video_select``, ``heads.audio_select``.
* ``forward_backward`` - the gradient of the declared loss (:data:`~h3gate.runs.model_stages.LOSS`)
  ``L = sum(video.float() * c_v) + sum(audio.float() * c_a)`` by per-stage recomputation
  (:data:`~h3gate.runs.model_stages.RECOMPUTATION`): a ``no_grad`` forward that saves each stage's external
  inputs, then in reverse stage order ``g = stage_vjp(stage, saved, params_stage, table, incoming)`` - the stage
  recomputed under autograd and back-propagated from the gradients its outputs received - and
  ``incoming += g.inputs`` (:func:`~h3gate.graph.stages.accumulate`). Parameter gradients are computed per
  stage and released (:data:`PARAM_GRADS`); the seeded cotangents are drawn once, before timing. Returns
  ``dL/d video_rows``.

The peak of ``torch.cuda.max_memory_allocated()`` is recorded per arm and phase on its first (warm-up) call:
parameters, inputs and the 256 MiB L2-flush buffer included. TF32 is off for both arms.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from h3gate.bench import energy
from h3gate.bench.block import STRICT_ORDER, arm_tables, phase_tables, ratios
from h3gate.bench.nodes import method as step_method
from h3gate.bench.nodes import step_times
from h3gate.bench.timing import side_by_side
from h3gate.errors import InputError
from h3gate.graph.core import OpTable
from h3gate.graph.executions import NodeBinding
from h3gate.graph.stages import Stage, backward_stages, forward_stages, stage_params
from h3gate.memory import require
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.runs.model_stages import LEAVES, LOSS, RECOMPUTATION, model_cotangents
from h3gate.runs.setup import Run, RunSpec, prepare, read_inputs

KIND = "bench-ws1-model"
WARMUP = 1
WARMUP_S = 0.0
SMALL_ROWS = 10_000  # layouts with fewer packed rows get ITERS_SMALL rounds, the others ITERS_LARGE
ITERS_SMALL = 5
ITERS_LARGE = 3
STAGE_HEAD_START_US = 100_000.0  # not yet measured to cover the host: host_behind_rounds counts the rounds it did not
SEED = 0
PARAM_GRADS = (
    "parameter gradients computed per stage and released, as a streamed optimizer step or a reduce-scatter would"
)

Tensors = dict[str, torch.Tensor]


def iters_for(seq_len: int) -> int:
    """Timed rounds per arm: 5 below :data:`SMALL_ROWS` packed rows, else 3 (a median of at least 3)."""
    return ITERS_SMALL if seq_len < SMALL_ROWS else ITERS_LARGE


def model_backward(
    stages: Sequence[Stage],
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    table: OpTable,
    cotangents: Mapping[str, torch.Tensor] | None = None,
    per_stage: Mapping[str, Tensors] | None = None,
    param_grads: dict[str, torch.Tensor] | None = None,
) -> Tensors:
    """Gradients of the declared loss w.r.t. ``video_rows``, ``audio_rows`` and ``text`` by per-stage
    recomputation (module docstring). ``cotangents`` default to ``model_cotangents(SEED, outputs)``;
    ``per_stage`` to :func:`stage_params`. Parameter gradients are dropped after each stage unless ``param_grads``
    is given (a test), which then receives them."""
    per_stage = per_stage if per_stage is not None else stage_params(stages, params)
    saved: dict[str, Tensors] = {}
    with torch.no_grad():
        outputs = forward_stages(stages, inputs, per_stage, table, saved)
    incoming: Tensors = dict(cotangents if cotangents is not None else model_cotangents(SEED, outputs))
    del outputs
    incoming = backward_stages(stages, saved, per_stage, table, incoming, param_grads)
    return {k: incoming[k] for k in LEAVES if k in incoming}


def forward_arm(
    stages: Sequence[Stage], inputs: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], table: OpTable
) -> Callable[[], Tensors]:
    """The timed forward: :func:`~h3gate.runs.model_stages.forward_stages` under ``no_grad``."""
    per_stage = stage_params(stages, params)

    def run() -> Tensors:
        with torch.no_grad():
            return forward_stages(stages, inputs, per_stage, table)

    return run


def forward_backward_arm(
    stages: Sequence[Stage],
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    table: OpTable,
    cotangents: Mapping[str, torch.Tensor],
) -> Callable[[], torch.Tensor]:
    """The timed forward + backward: :func:`model_backward` with fixed cotangents; returns ``dL/d video_rows``."""
    per_stage = stage_params(stages, params)

    def run() -> torch.Tensor:
        return model_backward(stages, inputs, params, table, cotangents, per_stage)["video_rows"]

    return run


def stage_times(
    stages: Sequence[Stage],
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    tables: Mapping[str, OpTable],
    iters: int,
    warmup: int = 1,
    head_start_us: float = STAGE_HEAD_START_US,
) -> dict:
    """The forward stage by stage (:func:`h3gate.bench.nodes.step_times`): per arm every stage's median ms, and the
    embedded blocks' spread (``blocks``: count, median / min / max, sum) beside the rest (``other_ms``)."""
    per_stage = stage_params(stages, params)

    def forward(table: OpTable):
        return lambda mark: forward_stages(stages, inputs, per_stage, table, after=lambda _stage: mark())

    labels = [stage.label for stage in stages]
    blocks = [stage.label for stage in stages if stage.label.startswith("block.")]
    arms = step_times({arm: forward(t) for arm, t in tables.items()}, labels, iters, warmup, head_start_us)
    out: dict = {"method": step_method("stage", head_start_us, iters, warmup, "h3gate.bench.model"), "arms": {}}
    for arm, rec in arms.items():
        times = rec.pop("times")
        spread = [times[b] for b in blocks]
        out["arms"][arm] = {
            "stages": times,
            "blocks": {
                "count": len(spread),
                "median_ms": statistics.median(spread),
                "min_ms": min(spread),
                "max_ms": max(spread),
                "sum_ms": sum(spread),
            },
            "other_ms": sum(t for label, t in times.items() if label not in blocks),
            **rec,
        }
    return out


def _with_peak(fn: Callable[[], object], peaks: dict[str, int], who: str) -> Callable[[], object]:
    """``fn`` that records ``torch.cuda.max_memory_allocated()`` of its first call in ``peaks[who]``."""

    def run() -> object:
        if who in peaks:
            return fn()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        peaks[who] = int(torch.cuda.max_memory_allocated())
        return out

    return run


def operator_bindings(bindings: Mapping[str, NodeBinding]) -> dict[str, dict]:
    """Operator -> its binding record (one per operator: the candidate table binds it alike in every node)."""
    out: dict[str, dict] = {}
    for nb in bindings.values():
        for b in nb.bindings:
            out.setdefault(b.op, b.record())
    return out


def _load_params(source, device: str) -> Tensors:
    return {name: source.load(name, device, check_finite=True) for name in source.names()}


def _check_memory(source, layout, cfg, what: str, device: str) -> int:
    """Refuse before any weight is placed when the parameters plus the saved stage inputs (one packed bf16 hidden
    state per block and one more) cannot fit; returns the parameters' bytes."""

    nbytes = 0
    for name in source.names():
        shape, dtype = source.meta(name)
        nbytes += torch.Size(shape).numel() * getattr(torch, dtype).itemsize
    saved = (cfg.num_layers + 1) * layout.seq_len * cfg.hidden_size * 2
    require(nbytes + saved, what, device, hint="use a smaller layout")
    return nbytes


def _setup(layout: str, config: str, device: str) -> Run:
    """The bench's whole-model run: strict bindings (bound before anything touches the device), synthetic weights
    drawn on the device's generator, nothing read yet."""
    if not device.startswith("cuda"):
        raise InputError(f"--device {device}: bench needs --device cuda (CUDA-event timings)")
    spec = RunSpec("model", layout, config, None, device, SEED, "strict", merge=STRICT_ORDER, draw="device")
    return prepare(spec, read=False)


def bench_model(
    layout: str,
    config: str,
    device: str,
    progress: Callable[[str], None] | None = None,
    merge: str = DEFAULT_MERGE_ORDER,
) -> tuple[dict, list[Path]]:
    """Time the strict model and the provider model side by side: the ``bench-ws1-model`` body and the manifests
    read (the caller, ``h3gate bench ws1-model``, writes and prints; this runs under its numerics switch).

    ``progress(label)`` is called before loading and before each timed phase. ``strict`` is the single walk;
    ``merge="seg8"`` adds the ``strict_seg8`` arm (every operator in the seg8 merge order), timed in the same rounds.
    """
    run = read_inputs(_setup(layout, config, device))
    name, cfg, packed, graph, bindings = run.config_name, run.cfg, run.layout, run.graph, run.bindings
    source, stages, manifests = run.source, run.stages, run.manifests
    what = f"bench ws1-model --layout {layout} --config {name} --device {device} (S={packed.seq_len})"
    param_bytes = _check_memory(source, packed, cfg, what, device)
    if progress is not None:
        progress(f"parameters and inputs ({param_bytes / 2**30:.1f} GiB of weights)")
    params = _load_params(source, device)
    inputs = run.inputs
    tables, seg8 = arm_tables(graph, bindings, device, merge)
    with torch.no_grad():
        cot = model_cotangents(SEED, forward_stages(stages, inputs, stage_params(stages, params), tables["provider"]))
    iters = iters_for(packed.seq_len)
    makers = {
        "forward": lambda t: forward_arm(stages, inputs, params, t),
        "forward_backward": lambda t: forward_backward_arm(stages, inputs, params, t, cot),
    }
    results: dict[str, dict] = {}
    timed: dict[str, dict[str, Callable[[], object]]] = {}
    for phase, make in makers.items():
        if progress is not None:
            progress(f"{phase} (provider and strict, {WARMUP} warm-up and {iters} timed rounds)")
        peaks: dict[str, int] = {}
        fns = timed[phase] = {
            who: _with_peak(make(t), peaks, who) for who, t in phase_tables(tables, graph, phase).items()
        }
        clocks: dict = {}
        stats = side_by_side(fns, iters=iters, warmup=WARMUP, warmup_s=WARMUP_S, observe=clocks)
        results[phase] = {**stats, **ratios(stats), "max_memory_allocated_bytes": peaks, "device_clocks": clocks}
    if progress is not None:
        progress("forward stage by stage (provider and strict)")
    stages_rec = stage_times(stages, inputs, params, tables, iters)
    if progress is not None:
        progress("sustained forward: each arm back to back, ms and joules per call")
    rounds = energy.ROUNDS if packed.seq_len < SMALL_ROWS else 1
    steady = {"method": energy.METHOD, "forward": energy.sustained(timed["forward"], rounds=rounds)}
    body = {
        "config": name,
        "layout": {"name": layout, "seq_len": packed.seq_len, "rows": packed.rows_per_modality()},
        "device": device,
        "device_name": torch.cuda.get_device_name(device),
        "layers": cfg.num_layers,
        "stages": len(stages),
        "nodes": len(graph.nodes),
        "weights": {"kind": "synthetic", "seed": SEED, "tensors": len(params), "bytes": param_bytes},
        "method": (
            f"h3gate.bench.timing.side_by_side: {WARMUP} warm-up round, then {iters} interleaved rounds (provider, "
            "strict), L2 flushed before each call, CUDA events per call; median / min / max. Forward: the stages in "
            "order under no_grad. Forward + backward: a no_grad forward saving each stage's inputs, then each stage "
            "recomputed under autograd and back-propagated in reverse order (cotangents drawn before timing). "
            "max_memory_allocated_bytes: the peak of each arm's first call (parameters, inputs and the L2-flush "
            "buffer included); host_ms: the host's time to enqueue each call; device_clocks: the SM clock, power "
            "and clock-event reasons sampled during each arm's calls (h3gate.bench.clocks)"
        ),
        "loss": LOSS,
        "recomputation": RECOMPUTATION,
        "parameter_gradients": PARAM_GRADS,
        "bindings": operator_bindings(bindings),
        **({"seg8_bindings": operator_bindings(seg8)} if seg8 else {}),
        "results": results,
        "forward_stages": stages_rec,
        "sustained": steady,
    }
    return body, manifests
