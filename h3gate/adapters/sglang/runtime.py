"""SGLang's runtime around its MiniMax-H3 DiT: the pinned version, the process groups it needs, its global server
arguments, the request quality, and a record of what it ran.

* :func:`require_sglang` - sglang exactly :data:`SGLANG_VERSION` and its DiT importable (torchvision through
  :mod:`.tvshim` first), else a one-line :class:`~h3gate.errors.InputError` naming ``make install-sglang``.
* :func:`init_runtime` - SGLang's process groups and global server arguments, idempotent. World size 1 by default:
  gloo on the CPU (NCCL on CUDA, SGLang's platform choice) through a TCP store on ``127.0.0.1`` at a free port
  (``GLOO_SOCKET_IFNAME=lo`` unless set); ``tp``/``sp`` > 1 take the ranks of an already initialised
  ``torch.distributed`` world (one process per rank, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment as
  SGLang reads them). The server arguments are the few fields the DiT's forward reads (``attention_backend``:
  ``None`` for the platform default - ``torch_sdpa`` on the CPU, FlashAttention on Hopper -, or a name such as
  ``"torch_sdpa"``, ``"fa"``).
* :func:`set_quality` - SGLang's request quality on a built model: ``"exact"`` unmounts the fused RMSNorm + AdaLN
  site (the reference chain, bit for bit), ``"lossless"`` (SGLang's default request quality) and ``"high"``
  mount it (one FP32 pass, one rounding: not bit-exact). It only runs where its static guards pass (CUDA BF16).
* :func:`runtime_record` - what ran: versions, degrees, the attention backend requested and resolved, the quality,
  per fused path whether it is switched on for this model on this device, and whether h3gate's strict binding
  (:mod:`.strict_bind`) is active on the model (with its mode, merge order, TP degree and bound forwards; after the
  block: the last binding's, ``active`` False).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from h3gate.adapters.sglang.tvshim import ensure_torchvision, torchvision_record
from h3gate.errors import InputError

SGLANG_VERSION = "0.5.23"
INSTALL = "make install-sglang"
DIT_MODULE = "sglang.multimodal_gen.runtime.models.dits.minimax_h3"
QUALITIES = ("exact", "lossless", "high")


@dataclass
class RuntimeState:
    """What :func:`init_runtime` set up (one per process)."""

    tp: int
    sp: int
    attention_backend: str | None
    init_method: str | None
    backend: str
    extras: dict[str, Any] = field(default_factory=dict)


_runtime: list[RuntimeState | None] = [None]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """SGLang's import-time device warnings (quantization backends the CPU lacks) and its loader's progress bars
    (tqdm, which reads ``TQDM_DISABLE``) silenced; h3gate's own progress lines say what runs."""
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Only CUDA", category=UserWarning)
            yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def require_sglang(what: str = "--candidate sglang") -> str:
    """sglang's version when it is exactly :data:`SGLANG_VERSION` and its MiniMax-H3 DiT imports."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise InputError(f"{what}: needs sglang {SGLANG_VERSION}: {INSTALL}") from None
    if version != SGLANG_VERSION:
        raise InputError(f"{what}: sglang {version} is installed, h3gate is tested with {SGLANG_VERSION}: {INSTALL}")
    ensure_torchvision()
    try:
        with quiet():
            importlib.import_module(DIT_MODULE)
    except ImportError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        missing = getattr(exc, "name", None) or (lines[0][:160] if lines else type(exc).__name__)
        raise InputError(
            f"{what}: sglang {version}'s MiniMax-H3 DiT does not import (needs {missing}): {INSTALL}"
        ) from None
    return version


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_args(attention_backend: str | None, hidden_size: int | None) -> SimpleNamespace:
    """The global server arguments the DiT's construction and forward read, and nothing else (SGLang's own unit
    tests of single modules do the same); the attention selector reads ``attention_backend``."""
    return SimpleNamespace(
        attention_backend=attention_backend,
        attention_backend_config=None,
        kv_gather_degree=1,
        sp_split_auto=False,
        enable_cfg_parallel=False,
        pipeline_config=SimpleNamespace(dit_config=SimpleNamespace(hidden_size=hidden_size)),
    )


def init_runtime(
    tp: int | None = None, sp: int | None = None, attention_backend: str | None = None, hidden_size: int | None = None
) -> RuntimeState:
    """SGLang's distributed state and global server arguments (see the module docstring), idempotent: ``tp``/``sp``
    None take the degrees this process already has (1 / 1 before any); other degrees than those initialised are an
    InputError. ``attention_backend`` / ``hidden_size`` None keep what was set (the model resolves its attention
    backend at its first forward, so choose it before that)."""
    require_sglang()
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    from sglang.multimodal_gen.runtime.server_args import set_global_server_args

    state = _runtime[0]
    if state is not None:
        want = (tp or state.tp, sp or state.sp)
        if want != (state.tp, state.sp):
            have = f"tp {state.tp}, sp {state.sp}"
            raise InputError(f"sglang runtime: initialised with {have} in this process, not {want[0]}/{want[1]}")
    else:
        tp, sp = tp or 1, sp or 1
        if tp < 1 or sp < 1:
            raise InputError(f"sglang runtime: tp {tp}, sp {sp}: degrees must be >= 1")
        init_method = None
        if not torch.distributed.is_initialized():
            if tp * sp != 1:
                raise InputError(
                    f"sglang runtime: tp {tp} x sp {sp} needs torch.distributed initialised (a process a rank)"
                )
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            init_method = f"tcp://127.0.0.1:{_free_local_port()}"
        ps.maybe_init_distributed_environment_and_model_parallel(
            tp_size=tp, sp_size=sp, ulysses_degree=sp, distributed_init_method=init_method or "env://"
        )
        state = RuntimeState(tp, sp, None, init_method, torch.distributed.get_backend())
        _runtime[0] = state
    if attention_backend is not None:
        state.attention_backend = attention_backend
    if hidden_size is not None:
        state.extras["hidden_size"] = hidden_size
    set_global_server_args(_server_args(state.attention_backend, state.extras.get("hidden_size")))
    return state


def set_quality(model: torch.nn.Module, quality: str) -> bool:
    """SGLang's request quality on ``model`` (its denoising stage's rule for the H3 site); True when the fused
    RMSNorm + AdaLN site is mounted afterwards."""
    if quality not in QUALITIES:
        raise InputError(f"sglang quality {quality!r}: must be one of {', '.join(QUALITIES)}")
    from sglang.kernels.ops.diffusion import MINIMAX_H3_NORM_MODULATE
    from sglang.multimodal_gen.configs.sample.sampling_params import quality_allows

    if quality_allows(quality, "lossless"):
        return bool(MINIMAX_H3_NORM_MODULATE.mount(model))
    MINIMAX_H3_NORM_MODULATE.unmount(model)
    return False


def degrees() -> dict[str, int]:
    from sglang.multimodal_gen.runtime.distributed import get_tp_world_size
    from sglang.multimodal_gen.runtime.distributed.parallel_state import get_ring_ctx, get_ulysses_ctx

    return {"tp": get_tp_world_size(), "ulysses": get_ulysses_ctx()[0], "ring": get_ring_ctx()[0]}


def fused_paths(model: torch.nn.Module, device: torch.device) -> dict[str, bool]:
    """Per fused path of the DiT's forward: switched on for this model on ``device`` (the guards its forward
    checks; on the CPU every one is off and the forward runs the eager reference chain)."""
    from sglang.kernels.ops.diffusion import MINIMAX_H3_NORM_MODULATE

    cuda = device.type == "cuda"
    block = model.blocks[0]
    attn = block.attn
    return {
        "qkv_single_gemm": True,  # structural: one MergedColumnParallelLinear for q, k and v
        "fc1_single_gemm": True,  # structural: [gate | value] in one MergedColumnParallelLinear
        "qknorm_rope_jit_cuda": bool(attn._use_fused_qknorm_rope),
        "qknorm_jit_cuda_refiner": cuda,
        "rope_sgl_kernel": cuda and not attn._use_fused_qknorm_rope,
        "indexed_adaln_triton": cuda,
        "indexed_gate_triton": cuda,
        "rmsnorm_adaln_site_mounted": MINIMAX_H3_NORM_MODULATE.is_enabled(block),
        "rmsnorm_adaln_site_runs": cuda and MINIMAX_H3_NORM_MODULATE.is_enabled(block),
        "silu_mul_jit_cuda": cuda,
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_record(model: torch.nn.Module, quality: str) -> dict[str, Any]:
    """Evidence of what SGLang ran (after a forward: the attention backend is resolved at the first one)."""
    state = _runtime[0]
    device = next(model.parameters()).device
    resolved = getattr(model, "_resolved_attention_backend", None)
    import triton

    return {
        "versions": {
            "sglang": _version("sglang"),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "torchvision": torchvision_record(),
            "apache_tvm_ffi": _version("apache-tvm-ffi"),
            "python": platform.python_version(),
        },
        "device": str(device),
        "distributed_backend": state.backend if state else None,
        "degrees": degrees(),
        "attention_backend": {
            "requested": state.attention_backend if state else None,
            "resolved": None if resolved is None else str(resolved),
        },
        "quality": quality,
        "fused_paths": fused_paths(model, device),
        "strict_binding": dict(getattr(model, "_h3gate_strict_binding", None) or {"active": False}),
    }
