"""SGLang's ``MiniMaxH3DiTModel`` built on a run's weights, the way SGLang's transformer loader builds it from a
diffusers-layout ``transformer/`` folder.

:func:`build_model` takes a folder (``h3gate synth-checkpoint`` output, a user's ``--checkpoint``) or any h3gate
weight source; a source that is not a folder (synthetic weights) is first written as one with
:func:`h3gate.synth.write_checkpoint` into a temporary folder, so every model is loaded from files by SGLang's own
code:

1. ``config.json`` (read and validated by :mod:`h3gate.checkpoint`) goes through SGLang's
   ``MiniMaxH3DiTConfig.update_model_arch``; the class name resolves through SGLang's ``ModelRegistry`` and, as its
   transformer loader decides, ``checkpoint_uses_diffusers_layout = (class name != "MiniMaxH3DiTModel")``. The
   AdaLN output widths, which SGLang's config defaults to the released width (18 x 5376, 2 x 5376) and does not
   derive, are set from the config: ``18 H`` and ``2 H``.
2. The safetensors files SGLang's ``resolve_transformer_checkpoint_files`` lists are read by its
   ``safetensors_weights_iterator``; ``maybe_load_fsdp_model`` (no FSDP, strict) maps the diffusers names through
   ``_diffusers_h3_checkpoint`` (q/k/v concatenated into ``attn.qkv_proj``; ``ff.net.0.proj`` ``[value | gate]``
   swapped into ``mlp.fc1`` ``[gate | value]``) and keeps each parameter at the dtype SGLang declares, the
   checkpoint's: FP32 boundary modules, BF16 elsewhere.
3. ``rope.inv_freq``, a persistent buffer in SGLang and a non-persistent one in diffusers (so absent from a
   diffusers checkpoint), is appended to the stream as diffusers computes it:
   ``1 / theta ** (arange(0, 2F, 2, float32) / 2F)`` (F = ``rope_freq_dim``).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from h3gate.adapters.sglang.runtime import init_runtime, quiet, require_sglang
from h3gate.checkpoint import CONFIG_NAME, CheckpointDir, WeightSource, open_checkpoint
from h3gate.errors import InputError
from h3gate.manifests.model_config import MODALITY_NUM, ModelConfig
from h3gate.synth import write_checkpoint

NATIVE_CLASS = "MiniMaxH3DiTModel"


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """diffusers' ``MiniMaxH3RotaryPosEmbed.inv_freq`` (F,) float32."""
    f = cfg.rope_freq_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))


def dit_config(hf_config: dict[str, Any], cfg: ModelConfig) -> tuple[Any, type]:
    """(SGLang ``MiniMaxH3DiTConfig``, model class) for a diffusers ``config.json`` body, as its loader sets them."""
    from sglang.multimodal_gen.configs.models.dits.minimax_h3 import MiniMaxH3DiTConfig
    from sglang.multimodal_gen.runtime.models.registry import ModelRegistry

    body = dict(hf_config)
    class_name = body.pop("_class_name", None)
    if class_name is None:
        raise InputError(f"{CONFIG_NAME}: _class_name: missing (SGLang resolves the model class from it)")
    model_cls, _ = ModelRegistry.resolve_model_cls(class_name)
    if model_cls.__name__ != NATIVE_CLASS:
        raise InputError(f"{CONFIG_NAME}: _class_name {class_name!r}: SGLang resolves it to {model_cls.__name__}")
    config = MiniMaxH3DiTConfig()
    config.update_model_arch(body)
    arch = config.arch_config
    arch.adaln_out_features = 6 * MODALITY_NUM * cfg.hidden_size
    arch.final_adaln_out_features = 2 * cfg.hidden_size
    arch.checkpoint_uses_diffusers_layout = class_name != model_cls.__name__
    return config, model_cls


def _checkpoint_files(folder: Path) -> list[str]:
    from sglang.multimodal_gen.runtime.loader.transformer_load_utils import resolve_transformer_checkpoint_files

    try:
        files = resolve_transformer_checkpoint_files(SimpleNamespace(transformer_weights_path=None), str(folder))
    except ValueError as exc:
        raise InputError(f"{folder}: {exc}") from None
    return list(files.safetensors)


def _weights(files: list[str], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's reader over the files, then the computed ``rope.inv_freq``."""
    from sglang.multimodal_gen.runtime.loader.weight_utils import safetensors_weights_iterator

    return itertools.chain(safetensors_weights_iterator(files, to_cpu=True), [("rope.inv_freq", rope_inv_freq(cfg))])


def load_folder(checkpoint: CheckpointDir, device: str | torch.device = "cpu") -> torch.nn.Module:
    """SGLang's DiT loaded from a diffusers-layout folder by SGLang's loader (module docstring), in eval mode."""
    require_sglang()
    cfg = checkpoint.config()
    if cfg is None:
        raise InputError(f"{checkpoint.path}: {CONFIG_NAME}: missing (SGLang's loader needs it)")
    init_runtime(hidden_size=cfg.hidden_size)
    from sglang.multimodal_gen.runtime.loader.fsdp_load import maybe_load_fsdp_model

    hf_config = dict(checkpoint.config_json or {})
    config, model_cls = dit_config(hf_config, cfg)
    with quiet(), contextlib.redirect_stderr(io.StringIO()):  # its loader's progress bar: h3gate reports progress
        model = _load(maybe_load_fsdp_model, model_cls, config, hf_config, device, checkpoint, cfg)
    return model.to(device).eval()


def _load(maybe_load_fsdp_model, model_cls, config, hf_config: dict, device, checkpoint: CheckpointDir, cfg):
    return maybe_load_fsdp_model(
        model_cls=model_cls,
        init_params={"config": config, "hf_config": {k: v for k, v in hf_config.items() if k != "_class_name"}},
        weight_dir_list=[],
        device=torch.device(device),
        hsdp_replicate_dim=1,
        hsdp_shard_dim=1,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        fsdp_inference=False,
        pin_cpu_memory=False,
        strict=True,
        weights_iterator=_weights(_checkpoint_files(Path(checkpoint.path)), cfg),
    )


def build_model(
    weights: WeightSource | str | Path, device: str | torch.device = "cpu", workdir: str | Path | None = None
) -> torch.nn.Module:
    """SGLang's DiT holding ``weights``: a checkpoint folder (or an open :class:`CheckpointDir`) is loaded as it is;
    another weight source is written as a diffusers-layout folder under ``workdir`` (a temporary folder, removed
    after loading, when None) and loaded from there."""
    if isinstance(weights, str | Path):
        return load_folder(open_checkpoint(weights), device)
    if isinstance(weights, CheckpointDir):
        return load_folder(weights, device)
    require_sglang()
    if workdir is not None:
        folder = Path(workdir) / "transformer"
        write_checkpoint(weights, None, folder)
        return load_folder(open_checkpoint(folder), device)
    with tempfile.TemporaryDirectory(prefix="h3gate-sglang-") as tmp:
        folder = Path(tmp) / "transformer"
        write_checkpoint(weights, None, folder)
        return load_folder(open_checkpoint(folder), device)
