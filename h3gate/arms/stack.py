"""The user's stack for ``run arms``: diffusers' own ``MiniMaxH3Transformer3DModel`` holding the run's weights (its
own parameters), two ``MiniMaxH3Scheduler`` (video ``--shift``, audio 3.0) stepped as diffusers' denoise loop steps
them, B requests, gradient checkpointing on, and a PEFT LoRA adapter when ``--lora-rank`` is given.

The module is built as ``from_pretrained`` builds it: parameters on the meta device, the checkpoint's tensors
assigned (mixed FP32/BF16 as stored), the computed ``rope.inv_freq`` buffer made on the CPU, then moved to the
device. LoRA (``peft``): ``r = --lora-rank``, ``lora_alpha = r`` (scaling 1), dropout 0, on the attention and FFN
projections of every transformer and refiner block, adapter weights float32 (PEFT's default for a bf16 base);
``lora_B`` is drawn (seeded, std 1e-2) instead of PEFT's zeros so that both factors get non-zero gradients at the
first step (as after some training). The base is frozen under LoRA; otherwise every parameter trains.

The rollout engine (``--rollout``): ``diffusers`` (this module) or ``sglang``, SGLang's ``MiniMaxH3DiTModel`` loaded by
SGLang's own loader from a diffusers-layout folder of the same weights (:mod:`h3gate.arms.sglang_side`). ``merge``:
the merge order R's operators are bound in on both sides (``seg8``: the TP-invariant order ``--tp`` needs; SGLang's
Ulysses, ``--ulysses``, splits no reduction and runs in either order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from h3gate.adapters.sglang.runtime import QUALITIES, require_sglang
from h3gate.errors import InputError
from h3gate.graph.inputs import seeded_normal
from h3gate.graph.model import raw_metadata
from h3gate.kernels.tp_layers import check_tp_order
from h3gate.layout import PackedLayout
from h3gate.manifests.model_config import ModelConfig
from h3gate.memory import require, require_steps
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.ops.registry import check_merge
from h3gate.runs.setup import RunSpec, prepare
from h3gate.schedule import AUDIO_SHIFT, VIDEO_SHIFT
from h3gate.strict_lora import LORA_TARGETS
from h3gate.trajectory import Recipe, Request, initial_latents, make_request, row_timestep_plan

ARMS = ("P/P", "R/P", "P/R", "R/R")  # training operators / rollout operators (RFC 6.4)
ROLLOUTS = ("diffusers", "sglang")
DIFFUSERS_SERIES = "0.42."
LORA_B_STD = 1e-2


@dataclass(frozen=True)
class ArmsSettings:
    arms: tuple[str, ...] = ARMS
    config: str | None = None
    checkpoint: Path | None = None
    layout: str = "micro"
    layers: int | None = None
    device: str = "cpu"
    steps: int = 4
    shift: float = VIDEO_SHIFT
    batch: int = 2
    lora_rank: int | None = None
    seed: int = 0
    fault: str | None = None
    rollout: str = "diffusers"
    sglang_quality: str = "lossless"
    sglang_attention: str | None = None
    merge: str = DEFAULT_MERGE_ORDER
    tp: int = 1
    ulysses: int = 1


def require_diffusers() -> Any:
    """diffusers 0.42.x, or a one-line InputError saying how to get it."""
    try:
        import diffusers
    except ImportError:
        raise InputError("run arms: needs diffusers 0.42.x: pip install 'h3gate[diffusers]'") from None
    if not diffusers.__version__.startswith(DIFFUSERS_SERIES):
        found = diffusers.__version__
        raise InputError(f"run arms: diffusers {found}: h3gate is tested with 0.42.x: pip install 'h3gate[diffusers]'")
    return diffusers


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise InputError("--lora-rank: needs peft: pip install 'h3gate[lora]'") from None
    return peft


def parse_arms(spec: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in spec.split(",") if a.strip())
    bad = next((a for a in arms if a not in ARMS), None)
    if not arms or bad is not None:
        raise InputError(f"--arms {spec!r}: expected a comma-separated list of {', '.join(ARMS)}")
    if len(set(arms)) != len(arms):
        raise InputError(f"--arms {spec!r}: an arm is listed twice")
    return arms


@dataclass
class Stack:
    """Everything both sides of every arm share."""

    settings: ArmsSettings
    config_name: str
    cfg: ModelConfig
    layout: PackedLayout
    recipe: Recipe
    plan: list[tuple[torch.Tensor, torch.Tensor]]
    requests: list[Request]
    weights: dict
    model: Any = None
    sglang: Any = None  # SGLang's DiT (``--rollout sglang``), once built in this process
    trainable: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    lora_names: tuple[str, ...] = ()

    @property
    def device(self) -> str:
        return self.settings.device

    @property
    def evaluations(self) -> int:
        return len(self.plan)

    def schedulers(self) -> SimpleNamespace:
        """Fresh video and audio ``MiniMaxH3Scheduler`` with their timesteps set, as the pipeline holds them."""
        diffusers = require_diffusers()
        video = diffusers.MiniMaxH3Scheduler(shift=self.recipe.video_shift)
        audio = diffusers.MiniMaxH3Scheduler(shift=self.recipe.audio_shift)
        video.set_timesteps(self.recipe.steps, device=self.device)
        audio.set_timesteps(self.recipe.steps, device=self.device)
        return SimpleNamespace(scheduler=video, audio_scheduler=audio)

    def layout_kwargs(self, step: int) -> dict[str, torch.Tensor]:
        """The transformer's layout arguments at ``step`` (the pipeline's ``denoiser_input_fields`` and plan)."""
        timestep, indices = self.plan[step]
        raw = raw_metadata(self.layout, timestep, indices)
        return {k: v.to(self.device) for k, v in {
            "timestep": raw.timestep, "timestep_indices": raw.timestep_indices, "token_tags": raw.token_tags,
            "position_ids": raw.position_ids, "video_indices": raw.video_indices,
            "audio_indices": raw.audio_indices, "text_indices": raw.text_indices}.items()}  # fmt: skip

    def initial_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The B requests' initial latents ``(B, Nv, Cv)``, ``(B, Na, Ca)`` float32."""
        pairs = [initial_latents(r, self.recipe)[1:] for r in self.requests]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def text(self) -> torch.Tensor:
        return torch.cat([r.text for r in self.requests])


def check_rollout(settings: ArmsSettings) -> None:
    """The rollout engine's options (InputError naming the option): a known engine; SGLang's only with ``sglang``
    (installed at its pinned version, a known quality); ``--ulysses`` > 1 for one request (``--tp``'s merge order
    and widths: :func:`plan_stack`, once the config is read)."""
    check_merge(settings.merge)
    if settings.rollout not in ROLLOUTS:
        raise InputError(f"--rollout {settings.rollout!r}: must be one of {', '.join(ROLLOUTS)}")
    if settings.rollout != "sglang":
        if settings.sglang_attention is not None:
            raise InputError("--sglang-attention-backend: only with --rollout sglang")
        if settings.tp != 1:
            raise InputError(f"--tp {settings.tp}: only with --rollout sglang (SGLang's tensor parallelism)")
        if settings.ulysses != 1:
            raise InputError(f"--ulysses {settings.ulysses}: only with --rollout sglang (SGLang's Ulysses)")
        return
    require_sglang("--rollout sglang")
    if settings.sglang_quality not in QUALITIES:
        raise InputError(f"--sglang-quality {settings.sglang_quality!r}: must be one of {', '.join(QUALITIES)}")
    if settings.lora_rank is not None:
        raise InputError("--lora-rank with --rollout sglang: SGLang's DiT holds the base weights only (the strict "
                         "binding does not cover its LoRA layers); drop --lora-rank")  # fmt: skip
    if settings.layers is not None and settings.checkpoint is not None:
        raise InputError("--layers with --rollout sglang --checkpoint: SGLang loads the whole checkpoint; "
                         "drop --layers or use synthetic weights")  # fmt: skip
    if settings.tp < 1 or settings.ulysses < 1:
        which = "--tp" if settings.tp < 1 else "--ulysses"
        raise InputError(f"{which} {min(settings.tp, settings.ulysses)}: must be at least 1")
    if settings.tp > 1 and settings.ulysses > 1:
        raise InputError(f"--tp {settings.tp} --ulysses {settings.ulysses}: one kind of SGLang parallelism at a time")
    if settings.ulysses > 1 and settings.batch != 1:
        raise InputError(f"--ulysses {settings.ulysses}: SGLang's Ulysses rollout takes one request (--batch 1: its "
                         "direct path, where SGLang's forward splits the rows itself)")  # fmt: skip


def batch_bytes(cfg: ModelConfig, seq_len: int, batch: int, steps: int) -> int:
    """What ``batch`` requests hold at once, an upper estimate: per packed row, one block's node values
    (``6 H + 8 N D + 3 F``, float32) for every block and refiner block plus two (the autograd graph and the gradients
    of the training arm, x2), and each step's latents of the four rollouts (float32, the widest input row)."""
    h, nd, f = cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    blocks = cfg.num_layers + cfg.num_refiner_layers + 2
    width = max(cfg.video_patch_dim, cfg.audio_in_channels)
    return batch * seq_len * ((6 * h + 8 * nd + 3 * f) * 4 * 2 * blocks + steps * 4 * 4 * width)


def plan_stack(settings: ArmsSettings) -> tuple[Stack, object]:
    """Check every input (InputError before any weight is read or any folder written); the stack without its
    module, and the weight source."""
    require_steps(settings.steps)
    require_diffusers()
    check_rollout(settings)
    if settings.lora_rank is not None:
        require_peft()
        if settings.lora_rank < 1:
            raise InputError(f"--lora-rank {settings.lora_rank}: must be at least 1")
    if settings.batch < 1:
        raise InputError(f"--batch {settings.batch}: must be at least 1")
    if settings.steps < 2:
        raise InputError(f"--steps {settings.steps}: must be at least 2 (grid points; steps - 1 evaluations)")
    checkpoint = None if settings.checkpoint is None else str(settings.checkpoint)
    run = prepare(RunSpec("model", settings.layout, settings.config, checkpoint, settings.device, settings.seed,
                          "strict", blocks=settings.layers, draw="device"))  # fmt: skip
    config_name, cfg, layout, source, ckpt, device = (
        run.config_name, run.cfg, run.layout, run.source, run.checkpoint, run.device
    )  # fmt: skip
    if settings.ulysses > 1 and cfg.num_attention_heads % settings.ulysses:
        raise InputError(f"--ulysses {settings.ulysses}: {cfg.num_attention_heads} heads do not divide among the ranks")
    remedy = "drop --merge-order single (seg8, the default, is)"
    check_tp_order(settings.tp, settings.merge, cfg, f"--tp {settings.tp}", remedy)
    require(batch_bytes(cfg, layout.seq_len, settings.batch, settings.steps), f"--batch {settings.batch} --steps "
            f"{settings.steps} at --layout {settings.layout} --config {config_name}", device, hint="ask for a smaller "
            "batch")  # fmt: skip
    recipe = Recipe(steps=settings.steps, video_shift=settings.shift, audio_shift=AUDIO_SHIFT)
    plan = row_timestep_plan(layout, recipe, *recipe.schedules())
    requests = [make_request(layout, cfg, settings.seed, b, device) for b in range(settings.batch)]
    return Stack(settings, config_name, cfg, layout, recipe, plan, requests, ckpt), source


def build_stack(stack: Stack, source) -> Stack:
    """The module on the run's weights, its LoRA adapter, gradient checkpointing on."""
    settings = stack.settings
    stack.model = build_module(stack.cfg, source, stack.device)
    if settings.lora_rank is not None:
        add_lora(stack, settings.lora_rank, settings.seed)
    else:
        stack.trainable = dict(stack.model.named_parameters())
    stack.model.enable_gradient_checkpointing()
    return stack


def build_module(cfg: ModelConfig, source, device: str) -> Any:
    """diffusers' module on the source's tensors (module docstring)."""
    diffusers = require_diffusers()
    kwargs = {k: v for k, v in cfg.diffusers_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        model = diffusers.MiniMaxH3Transformer3DModel(**kwargs)
    names = [n for n, _ in model.named_parameters()]
    state = {n: source.load(n, device, check_finite=True) for n in names}
    model.load_state_dict(state, strict=True, assign=True)
    model.rope = type(model.rope)(rope_freq_dim=cfg.rope_freq_dim, rope_theta=cfg.rope_theta).to(device)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"module tensors left on the meta device: {meta[:3]}")
    return model.eval()


def add_lora(stack: Stack, rank: int, seed: int) -> None:
    """PEFT LoRA on the block projections (module docstring); freezes the base."""
    peft = require_peft()
    model = stack.model
    model.requires_grad_(False)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    model.add_adapter(config)
    lora = {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    with torch.no_grad():
        for name, p in lora.items():
            if ".lora_B." in name:
                p.copy_(seeded_normal(seed, f"lora_B:{name}", tuple(p.shape)).to(p.device, p.dtype) * LORA_B_STD)
            p.requires_grad_(True)
    stack.trainable = lora
    stack.lora_names = tuple(lora)
