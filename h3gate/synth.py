"""Seeded synthetic weights and the streaming diffusers-layout checkpoint writer.

Tensor ``name`` of seed ``s`` is drawn on the CPU from ``torch.Generator().manual_seed(k)`` with
``k = first 8 bytes (little-endian) of sha256(f"{s}:{name}")`` masked to 63 bits, as float32 ``z ~ N(0, 1)`` (the
``transformer/`` variant, FL2VA/T2VA; the Ref2VA variant ``transformer_ref/`` - the same class and config with its own
weights in the release - hashes ``f"{s}:transformer_ref:{name}"`` instead, so its tensors differ from seed ``s``'s
``transformer/`` tensors and from every other seed's):

* RMSNorm weights (every 1-D ``.weight``): ``1 + 0.1 z``
* biases: ``0.02 z``
* AdaLN projections (``adaln_proj.linear.weight``, ``norm_out.linear.weight``): ``MOD_GAIN * z / sqrt(fan_in)``,
  so that shift/scale/gate come out O(0.1-0.5) for the timestep embedding these weights produce;
* every other linear weight: ``z / sqrt(fan_in)`` (unit-variance inputs give unit-ish variance outputs).

The float32 draw is then cast once (round-to-nearest-even) to the precision map's dtype: FP32 boundary modules stay
float32, everything else becomes bfloat16. A tensor depends on nothing but (seed, name, shape), so block 0 of the
33B ``real`` config is made without generating the other 49 blocks, and the values do not depend on the device.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from math import prod, sqrt
from pathlib import Path
from typing import Any

import torch

from h3gate.checkpoint import (
    CONFIG_NAME,
    DTYPE_CODES,
    INDEX_NAME,
    ITEMSIZE,
    VARIANT_FOLDERS,
    WEIGHTS_NAME,
    WeightSource,
    ensure_finite,
    open_checkpoint,
)
from h3gate.errors import InputError
from h3gate.inventory import DEFAULT_PRECISION, TensorSpec, expected_inventory
from h3gate.manifests.checkpoint_manifest import PrecisionMap
from h3gate.manifests.model_config import ModelConfig
from h3gate.memory import require, require_disk
from h3gate.paths import display

NORM_STD = 0.1
BIAS_STD = 0.02
MOD_GAIN = 1.0
MODULATION_WEIGHTS = ("adaln_proj.linear.weight", "norm_out.linear.weight")


def check_variant(variant: str, flag: str | None = None) -> str:
    """``variant`` when it names a transformer folder (``checkpoint.VARIANT_FOLDERS``), else an InputError naming
    ``flag`` (a CLI option) or the weights variant."""
    if variant not in VARIANT_FOLDERS:
        what = f"{flag} {variant}" if flag else f"weights variant {variant!r}"
        raise InputError(f"{what}: must be one of {', '.join(VARIANT_FOLDERS)}")
    return variant


def tensor_seed(seed: int, name: str, variant: str = "transformer") -> int:
    """The generator seed of one tensor: 63 bits of sha256(f"{seed}:{name}") (``transformer/``) or of
    sha256(f"{seed}:{variant}:{name}") (another variant folder)."""
    check_variant(variant)
    key = f"{seed}:{name}" if variant == "transformer" else f"{seed}:{variant}:{name}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def layout_variant(task: str) -> str:
    """The transformer variant a layout's task runs: ``transformer_ref`` for ref2va (the Ref2VA pipeline's
    ``transformer_name``), ``transformer`` for t2va / fl2va."""
    return "transformer_ref" if task == "ref2va" else "transformer"


def init_rule(name: str, shape: tuple[int, ...]) -> str:
    """Which initialisation a tensor gets: ``norm``, ``bias``, ``modulation`` or ``linear``."""
    if name.endswith(".bias"):
        return "bias"
    if len(shape) == 1:
        return "norm"
    if name.endswith(MODULATION_WEIGHTS):
        return "modulation"
    return "linear"


def synth_tensor(
    seed: int, name: str, shape: tuple[int, ...], generator_device: str = "cpu", variant: str = "transformer"
) -> torch.Tensor:
    """The float32 value of one synthetic tensor (before the cast to its stored dtype), drawn on
    ``generator_device``'s own generator: values depend on that device's RNG, so only "cpu" is portable."""
    g = torch.Generator(device=generator_device).manual_seed(tensor_seed(seed, name, variant))
    x = torch.randn(shape, generator=g, dtype=torch.float32, device=generator_device)
    rule = init_rule(name, shape)
    if rule == "norm":
        return x.mul_(NORM_STD).add_(1.0)
    if rule == "bias":
        return x.mul_(BIAS_STD)
    gain = MOD_GAIN if rule == "modulation" else 1.0
    return x.mul_(gain / sqrt(shape[-1]))


class SyntheticSource:
    """Seeded weights of one variant (``transformer`` or ``transformer_ref``) for ``cfg`` with the inventory's names,
    shapes and dtypes, each generated on demand."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int,
        precision: PrecisionMap = DEFAULT_PRECISION,
        generator_device: str = "cpu",
        variant: str = "transformer",
    ) -> None:
        check_variant(variant)  # a bad variant fails here, before anything is drawn
        self._cfg = cfg
        self.seed = int(seed)
        self.generator_device = generator_device
        self.precision = precision
        self.variant = variant
        self._specs: dict[str, TensorSpec] = {s.name: s for s in expected_inventory(cfg, precision)}

    def with_config(self, cfg: ModelConfig) -> SyntheticSource:
        """The same seed, precision, generator and variant for another config (a tensor's values depend on its name
        only: a config cut to its first blocks holds the same tensors)."""
        return SyntheticSource(cfg, self.seed, self.precision, self.generator_device, self.variant)

    def drawn_on(self, generator_device: str) -> SyntheticSource:
        """The same seed, variant and precision drawn with ``generator_device``'s generator (other values)."""
        return SyntheticSource(self._cfg, self.seed, self.precision, generator_device, self.variant)

    def record(self) -> dict[str, Any]:
        """What the evidence says about these weights."""
        rec = {"kind": "synthetic", "path": None, "seed": self.seed, "variant": self.variant}
        return rec if self.generator_device == "cpu" else {**rec, "generator_device": self.generator_device}

    def names(self) -> list[str]:
        return list(self._specs)

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise InputError(f"{name}: no such tensor in the synthetic weights") from None

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        s = self.spec(name)
        return s.shape, s.dtype

    def load(self, name: str, device: str | torch.device = "cpu", check_finite: bool = False) -> torch.Tensor:
        s = self.spec(name)
        value = synth_tensor(self.seed, name, s.shape, self.generator_device, self.variant)
        tensor = value.to(getattr(torch, s.dtype)).to(device)
        return ensure_finite(name, tensor) if check_finite else tensor

    def config(self) -> ModelConfig | None:
        return self._cfg


def _nbytes(source: WeightSource, name: str) -> int:
    shape, dtype = source.meta(name)
    if dtype not in DTYPE_CODES:
        raise InputError(f"{name}: dtype {dtype} cannot be stored in safetensors")
    return prod(shape) * ITEMSIZE[dtype]


def plan_shards(source: WeightSource, shard_size: int | None) -> list[list[str]]:
    """Greedy in state-dict order: a new shard starts when the next tensor would push the current one past
    ``shard_size`` bytes (a tensor larger than ``shard_size`` gets a shard of its own). ``None``: one file."""
    names = source.names()
    if shard_size is None:
        return [names]
    if shard_size <= 0:
        raise InputError(f"--shard-size {shard_size}: must be a positive number of bytes")
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        size = _nbytes(source, name)
        if shards[-1] and used + size > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def safetensors_header(source: WeightSource, names: list[str], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The 8-byte length + JSON header for ``names`` (offsets from ``meta``, padded with spaces to a multiple of 8
    bytes) and the size of the data section that must follow it."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        shape, dtype = source.meta(name)
        size = _nbytes(source, name)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offset


def write_safetensors(path: Path, source: WeightSource, names: list[str], metadata: dict[str, str]) -> int:
    """Write ``names`` of ``source`` to one safetensors file, loading one tensor at a time; returns its size.

    The header is written first, then each tensor's contiguous little-endian bytes in header order.
    """
    if sys.byteorder != "little":
        raise InputError("write_checkpoint: safetensors data is little-endian; this host is big-endian")
    head, data_size = safetensors_header(source, names, metadata)
    with path.open("wb") as fh:
        fh.write(head)
        for name in names:
            shape, dtype = source.meta(name)
            tensor = source.load(name, "cpu")
            if tuple(tensor.shape) != tuple(shape) or str(tensor.dtype) != f"torch.{dtype}":
                raise InputError(
                    f"{name}: source produced {tuple(tensor.shape)} {tensor.dtype}, its meta says {shape} {dtype}"
                )
            fh.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
    return len(head) + data_size


SHARD_HEADER_BYTES = 256  # header bytes per tensor entry (name, dtype, shape, offsets), an upper estimate
CONFIG_FILES_BYTES = 1 << 20  # config.json and the shard index


def check_room(source: WeightSource, out: Path, shards: int) -> None:
    """Before the folder is made: the disk under ``out`` holds every tensor's bytes plus the headers and JSON files;
    host memory holds the largest tensor three times at float32 (the draw, its cast, the byte view written)."""
    names = source.names()
    data = sum(_nbytes(source, n) for n in names) + SHARD_HEADER_BYTES * len(names) + CONFIG_FILES_BYTES
    require_disk(data, out, f"{display(out)} ({len(names)} tensors in {shards} file(s))", hint="free the disk or "
                 "write elsewhere")  # fmt: skip
    largest = max((prod(source.meta(n)[0]) for n in names), default=0)
    require(3 * 4 * largest, f"{display(out)}: its largest tensor ({largest:,} values)")


def _shard_name(i: int, n: int) -> str:
    return f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors"


PARTIAL_SUFFIX = ".partial"


def _partial_prefix(out: Path) -> str:
    return f".{out.name}."


def _lock_folder(folder: Path) -> int | None:
    """An exclusive ``flock`` on ``folder`` itself (its descriptor), or None when another process holds one."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def clean_partials(out: Path) -> list[str]:
    """Remove the hidden ``.<name>.*.partial`` folders a killed :func:`write_checkpoint` into ``out`` left beside it
    (their names, sorted). A writer holds an exclusive ``flock`` on its partial folder until the folder is renamed
    into place, and the kernel drops it when the writer dies (SIGKILL included): a partial folder whose lock is held
    belongs to a live writer and is refused (InputError naming it), never removed."""
    if not out.parent.is_dir():
        return []
    found = sorted(p for p in out.parent.glob(f"{_partial_prefix(out)}*{PARTIAL_SUFFIX}") if p.is_dir())
    removed = []
    for partial in found:
        if partial.is_symlink():
            continue
        fd = _lock_folder(partial)
        if fd is None:
            raise InputError(f"{display(out)}: {display(partial)} is being written by another h3gate process; wait "
                             "for it to finish")  # fmt: skip
        try:
            shutil.rmtree(partial)
        except OSError as exc:
            raise InputError(f"{display(partial)}: a killed run's partial checkpoint; cannot remove it ("
                             f"{exc.strerror or exc})") from None  # fmt: skip
        finally:
            os.close(fd)
        removed.append(partial.name)
    return removed


def write_checkpoint(
    source_or_cfg: WeightSource | ModelConfig,
    seed: int | None,
    out_dir: str | Path,
    shard_size: int | None = None,
    precision: PrecisionMap = DEFAULT_PRECISION,
) -> dict[str, Any]:
    """Write ``config.json`` and the weights in diffusers' layout; returns a summary of what was written.

    A :class:`ModelConfig` becomes ``SyntheticSource(cfg, seed, precision)``. Everything is written into a temporary
    folder next to ``out_dir`` (``.<name>.*.partial``, locked by this process while it writes) and renamed into place
    at the end; an existing non-empty ``out_dir`` is refused; the partial folders of a killed write into ``out_dir``
    are removed first (:func:`clean_partials`; ``cleaned`` in the summary).
    """
    started = time.perf_counter()
    out = Path(out_dir)
    if isinstance(source_or_cfg, ModelConfig):
        source: WeightSource = SyntheticSource(source_or_cfg, 0 if seed is None else seed, precision)
    else:
        source = source_or_cfg
    cfg = source.config()
    if cfg is None:
        raise InputError("write_checkpoint: the weight source has no config to write as config.json")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{display(out)}: already exists and is not an empty folder")
    shards = plan_shards(source, shard_size)
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise InputError(f"{display(out)}: cannot create ({display(blocker)} is a file, not a folder)")
    cleaned = clean_partials(out)  # a killed write's disk space counts as free
    check_room(source, out, len(shards))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(out), suffix=PARTIAL_SUFFIX, dir=out.parent))
        lock = _lock_folder(tmp)  # held until the folder is renamed into place (a new folder: nobody else holds it)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the checkpoint gets an ordinary folder's mode
    except OSError as exc:
        raise InputError(f"{display(out)}: cannot create ({exc.strerror or exc})") from None
    try:
        files = _write_into(tmp, out, source, cfg, shards)
    finally:
        if lock is not None:
            os.close(lock)
    names = source.names()
    return {
        "path": display(out),
        "files": files,
        "tensors": len(names),
        "parameters": sum(prod(source.meta(n)[0]) for n in names),
        "tensor_bytes": sum(_nbytes(source, n) for n in names),
        "seconds": round(time.perf_counter() - started, 3),
        **({"cleaned": cleaned} if cleaned else {}),
    }


def _write_into(tmp: Path, out: Path, source: WeightSource, cfg: ModelConfig, shards: list) -> list[dict[str, Any]]:
    """The files into ``tmp``, then ``tmp`` renamed to ``out`` (removed on any failure); the files' records."""
    metadata = {"format": "pt", "producer": "h3gate"}
    if isinstance(source, SyntheticSource):
        metadata["h3gate_seed"] = str(source.seed)
        if source.variant != "transformer":  # (transformer/ files keep the bytes they always had)
            metadata["h3gate_variant"] = source.variant
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg.diffusers_config(), indent=2) + "\n", encoding="utf-8")
        files: list[dict[str, Any]] = []
        if len(shards) == 1:
            size = write_safetensors(tmp / WEIGHTS_NAME, source, shards[0], metadata)
            files.append({"file": WEIGHTS_NAME, "bytes": size, "tensors": len(shards[0])})
        else:
            weight_map: dict[str, str] = {}
            for i, names in enumerate(shards, start=1):
                fname = _shard_name(i, len(shards))
                size = write_safetensors(tmp / fname, source, names, metadata)
                files.append({"file": fname, "bytes": size, "tensors": len(names)})
                weight_map.update(dict.fromkeys(names, fname))
            total = sum(_nbytes(source, n) for n in source.names())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"{display(out)}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def open_weights(
    checkpoint: str | Path | None, cfg: ModelConfig | None = None, seed: int = 0, precision: PrecisionMap | None = None
) -> WeightSource:
    """A checkpoint folder when given, otherwise seeded synthetic weights for ``cfg``."""
    if checkpoint is not None:
        return open_checkpoint(checkpoint)
    if cfg is None:
        raise InputError("open_weights: a config is needed for synthetic weights when no checkpoint is given")
    return SyntheticSource(cfg, seed) if precision is None else SyntheticSource(cfg, seed, precision)
