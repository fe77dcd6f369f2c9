"""Lazy weight sources: a diffusers checkpoint folder read header-first, or seeded synthetic weights.

A :class:`WeightSource` names its tensors, gives each one's shape and dtype without reading data, and loads one
tensor on demand. :class:`CheckpointDir` parses every safetensors header itself (8-byte little-endian header
length, JSON header, contiguous ``data_offsets`` that must fit the file), so fingerprinting a 66 GB checkpoint reads
a few kilobytes; :meth:`CheckpointDir.load` reads one tensor through ``safetensors.safe_open``. Synthetic weights and
checkpoint writing live in :mod:`h3gate.synth`, which builds on this module (``open_weights`` is there).
"""

from __future__ import annotations

import errno
import hashlib
import json
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from h3gate.bounded import load_json_file, loads_json
from h3gate.errors import InputError
from h3gate.manifests.loader import validate
from h3gate.manifests.model_config import ARCHITECTURE, ModelConfig
from h3gate.paths import display

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
CONFIG_NAME = "config.json"
VARIANT_FOLDERS = ("transformer", "transformer_ref")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit

# safetensors dtype code -> (torch dtype name, bytes per element)
ST_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
}
DTYPE_CODES = {name: code for code, (name, _) in ST_DTYPES.items()}
ITEMSIZE = {name: size for name, size in ST_DTYPES.values()}


@runtime_checkable
class WeightSource(Protocol):
    """Names, metadata and on-demand tensors of one transformer's weights (diffusers state-dict keys)."""

    def names(self) -> list[str]: ...

    def meta(self, name: str) -> tuple[tuple[int, ...], str]: ...

    def load(self, name: str, device: str | torch.device = "cpu", check_finite: bool = False) -> torch.Tensor: ...

    def config(self) -> ModelConfig | None: ...


@dataclass(frozen=True)
class StoredTensor:
    """One header entry; ``start``/``end`` are absolute byte offsets in ``file``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return prod(self.shape)


def ensure_finite(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Raise ``InputError("<name>: non-finite values")`` when a floating tensor holds NaN or Inf."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise InputError(f"{name}: non-finite values")
    return tensor


def _entry(file: Path, name: str, raw: Any, data_start: int) -> StoredTensor:
    where = f"{display(file)}: tensor {name}"
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= set(raw):
        raise InputError(f"{where}: header entry must be an object with dtype, shape and data_offsets")
    code, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if code not in ST_DTYPES:
        raise InputError(f"{where}: unknown dtype {code!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InputError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    if not ok or not 0 <= offsets[0] <= offsets[1]:
        raise InputError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    dtype, itemsize = ST_DTYPES[code]
    needed = prod(shape) * itemsize
    if offsets[1] - offsets[0] != needed:
        raise InputError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype} "
            f"needs {needed}"
        )
    return StoredTensor(name, tuple(shape), dtype, file, data_start + offsets[0], data_start + offsets[1])


def read_safetensors_header(file: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse and validate one safetensors file's header without reading tensor data.

    Layout: ``u64 little-endian N | N bytes of UTF-8 JSON | data``. Every entry's ``data_offsets`` are relative to
    the data section; sorted by offset they must tile it from 0 with no gap or overlap, and the data section must
    end exactly at the end of the file (the rules ``safetensors`` enforces when it opens the file).
    Returns the entries in data order and the ``__metadata__`` mapping.
    """
    file = Path(file)
    where = display(file)
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise InputError(f"{where}: not a safetensors file ({size} bytes, no 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise InputError(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt)")
            if 8 + n > size:
                raise InputError(f"{where}: header length {n} exceeds the file size {size} (truncated or corrupt)")
            blob = fh.read(n)
    except OSError as exc:
        raise InputError(f"{where}: cannot read ({exc.strerror or exc})") from None
    try:
        header = loads_json(blob.decode("utf-8"), where, MAX_HEADER_BYTES)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{where}: header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InputError(f"{where}: header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{where}: __metadata__ must map strings to strings")
    data_start = 8 + n
    entries = sorted((_entry(file, k, v, data_start) for k, v in header.items()), key=lambda e: (e.start, e.end))
    cursor = data_start
    for e in entries:
        if e.end > size:
            raise InputError(
                f"{where}: tensor {e.name}: data ends at byte {e.end} but the file has {size} bytes (truncated)"
            )
        if e.start != cursor:
            raise InputError(
                f"{where}: tensor {e.name}: data starts at byte {e.start}, expected {cursor} "
                "(tensors must tile the data section without gaps or overlaps)"
            )
        cursor = e.end
    if cursor != size:
        raise InputError(f"{where}: {size - cursor} bytes after the last tensor (corrupt)")
    return {e.name: e for e in entries}, dict(metadata)


def read_json(file: Path) -> Any:
    """Parse a JSON file; missing, unreadable or malformed files become one-line input errors."""
    where = display(file)
    if not Path(file).is_file():
        raise InputError(f"{where}: missing")
    try:
        return load_json_file(Path(file), where)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: malformed JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise InputError(f"{where}: cannot read ({exc})") from None


def parse_diffusers_config(body: Any, source: str) -> ModelConfig:
    """A diffusers ``config.json`` body -> :class:`ModelConfig` (``_``-prefixed bookkeeping keys are dropped)."""
    if not isinstance(body, dict):
        raise InputError(f"{source}: must be a JSON object")
    cls = body.get("_class_name", ARCHITECTURE)
    if cls != ARCHITECTURE:
        raise InputError(f"{source}: _class_name: {cls!r} is not {ARCHITECTURE}")
    return validate({k: v for k, v in body.items() if not k.startswith("_")}, ModelConfig, source)


def real_path(path: Path) -> Path:
    """``path`` with every symbolic link resolved; a link loop or a dangling link is an input error naming it."""
    try:
        return Path(path).resolve(strict=True)
    except RuntimeError:  # Python < 3.13 reports a loop this way
        raise InputError(f"{display(path)}: symbolic link loop") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"{display(path)}: symbolic link loop") from None
        if Path(path).is_symlink():
            raise InputError(f"{display(path)}: dangling symbolic link (its target does not exist)") from None
        raise InputError(f"{display(path)}: cannot resolve ({exc.strerror or exc})") from None


class CheckpointDir:
    """A diffusers transformer folder: ``config.json`` plus one safetensors file or an index and its shards.

    Weight files may be symbolic links (the Hugging Face cache links into its blob store): each one's real path is
    kept in ``real_files``; those whose real path lies outside the (resolved) folder are listed in ``outside`` and
    announced by one ``h3gate: warning:`` line on stderr when the folder is opened, never followed silently.
    """

    def __init__(self, path: Path, require_config: bool = True) -> None:
        self.path = Path(path)
        where = display(self.path)
        if self.path.is_symlink() or self.path.exists():
            self.real_path = real_path(self.path)
        if not self.path.is_dir():
            what = "is a file, not a checkpoint folder" if self.path.exists() else "no such checkpoint folder"
            raise InputError(f"{where}: {what}")
        cfg_file = self.path / CONFIG_NAME
        self.config_json: dict | None = None
        self._config: ModelConfig | None = None
        if cfg_file.is_file() or require_config:
            if not cfg_file.is_file():
                hint = [f"{where}/{v}" for v in VARIANT_FOLDERS if (self.path / v / CONFIG_NAME).is_file()]
                raise InputError(f"{display(cfg_file)}: missing" + (f" (pass {' or '.join(hint)})" if hint else ""))
            self.config_json = read_json(cfg_file)
            self._config = parse_diffusers_config(self.config_json, display(cfg_file))
        self.index: dict | None = None
        index_file, single = self.path / INDEX_NAME, self.path / WEIGHTS_NAME
        if index_file.is_file():  # diffusers prefers the index when both exist
            self.files, self.weight_map = self._read_index(index_file)
        elif single.is_file():
            self.files, self.weight_map = [single], None
        else:
            for link in (p for p in (index_file, single) if p.is_symlink()):
                real_path(link)  # a loop or dangling link says so
            raise InputError(f"{where}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found")
        self.real_files = {f.name: real_path(f) for f in self.files}
        self.outside = [n for n, real in self.real_files.items() if not real.is_relative_to(self.real_path)]
        if self.outside:
            self._warn_outside()
        self._entries: dict[str, StoredTensor] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        for f in self.files:
            entries, self.metadata[f.name] = read_safetensors_header(f)
            for name, e in entries.items():
                if name in self._entries:
                    raise InputError(f"{display(f)}: tensor {name}: also stored in {self._entries[name].file.name}")
                self._entries[name] = e
        for name, shard in (self.weight_map or {}).items():
            if self._entries.get(name) is None or self._entries[name].file.name != shard:
                raise InputError(f"{display(index_file)}: tensor {name}: not in its shard {shard}")

    def _warn_outside(self) -> None:
        """One stderr line naming the weight files whose real path lies outside the checkpoint folder."""
        links = ", ".join(f"{n} -> {self.real_files[n]}" for n in self.outside)
        count = "1 weight file resolves" if len(self.outside) == 1 else f"{len(self.outside)} weight files resolve"
        print(
            f"h3gate: warning: {display(self.path)}: {count} outside the checkpoint folder ({links}); "
            "read anyway, recorded as outside_folder in fingerprint evidence",
            file=sys.stderr,
        )

    def _read_index(self, index_file: Path) -> tuple[list[Path], dict[str, str]]:
        where = display(index_file)
        self.index = body = read_json(index_file)
        if not isinstance(body, dict) or not isinstance(body.get("weight_map"), dict):
            raise InputError(f"{where}: weight_map: required mapping missing")
        weight_map = body["weight_map"]
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise InputError(f"{where}: weight_map.{name}: {shard!r} is not a file name in the folder")
        files = [self.path / s for s in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise InputError(f"{where}: weight_map names shard {f.name}, which is missing")
        return files, weight_map

    # -- WeightSource ----------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> StoredTensor:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"{name}: no such tensor in {display(self.path)}") from None

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        e = self.entry(name)
        return e.shape, e.dtype

    def load(self, name: str, device: str | torch.device = "cpu", check_finite: bool = False) -> torch.Tensor:
        """One tensor read through ``safe_open`` (memory-mapped; nothing else is read)."""
        from safetensors import safe_open

        e = self.entry(name)
        try:
            with safe_open(str(e.file), framework="pt", device=str(device)) as fh:
                tensor = fh.get_tensor(name)
        except Exception as exc:  # safetensors raises its own types; a bad file must stay an input error
            raise InputError(f"{display(e.file)}: tensor {name}: cannot read ({exc})") from None
        return ensure_finite(name, tensor) if check_finite else tensor

    def config(self) -> ModelConfig | None:
        return self._config

    # -- Header-only facts -----------------------------------------------------------------------------------------
    def shards(self) -> list[dict[str, Any]]:
        """Every weight file with its size in bytes, tensor count, real path (symbolic links resolved) and whether
        that real path lies outside the checkpoint folder."""
        return [
            {
                "file": f.name,
                "bytes": f.stat().st_size,
                "tensors": sum(1 for e in self._entries.values() if e.file == f),
                "real_path": str(self.real_files[f.name]),
                "outside_folder": f.name in self.outside,
            }
            for f in self.files
        ]

    def iter_raw(self, name: str, chunk: int = 1 << 24) -> Iterator[bytes]:
        """The tensor's stored bytes, in chunks, straight from the header offsets (no torch involved)."""
        e = self.entry(name)
        try:
            with e.file.open("rb") as fh:
                fh.seek(e.start)
                left = e.nbytes
                while left:
                    block = fh.read(min(chunk, left))
                    if not block:
                        raise InputError(f"{display(e.file)}: tensor {name}: file ended early (truncated)")
                    left -= len(block)
                    yield block
        except OSError as exc:
            raise InputError(f"{display(e.file)}: tensor {name}: cannot read ({exc.strerror or exc})") from None

    def tensor_sha256(self, name: str) -> str:
        """sha256 of the tensor's raw little-endian bytes as stored."""
        h = hashlib.sha256()
        for block in self.iter_raw(name):
            h.update(block)
        return h.hexdigest()


def open_checkpoint(path: str | Path, subfolder: str | None = None, require_config: bool = True) -> CheckpointDir:
    """Open a diffusers transformer folder (``path`` itself, or ``path/subfolder`` for ``transformer``/``_ref``)."""
    path = Path(path)
    if subfolder:
        sub = subfolder.strip("/")
        if sub not in VARIANT_FOLDERS:
            raise InputError(f"subfolder {subfolder!r}: must be one of {', '.join(VARIANT_FOLDERS)}")
        path = path / sub
    return CheckpointDir(path, require_config=require_config)


def materialize(source: WeightSource, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of ``source`` (for tiny configs and tests: this holds the whole model in memory)."""
    return {name: source.load(name, device) for name in source.names()}
