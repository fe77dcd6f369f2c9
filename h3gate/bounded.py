"""Bounded JSON and YAML parsing: every JSON or YAML document h3gate reads goes through here.

A document is refused, as an :class:`~h3gate.errors.InputError` naming it and the limit, when it is larger than
its byte limit (checked on the file's size before it is read) or nested deeper than :data:`MAX_DEPTH` containers.
The depth is measured before parsing, so no parser recursion can overflow: JSON by a linear scan of its brackets
outside string literals (``[``/``{`` +1, ``]``/``}`` -1, the running maximum), YAML by the depth of the
collection events of ``yaml.parse`` (an iterative state machine) before ``yaml.safe_load`` composes the
document, and its node count with every alias expanded (validating or serialising a few nested aliases expands
them exponentially) is bounded by :data:`MAX_YAML_NODES`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from h3gate.errors import InputError

MIB = 2**20
MAX_DEPTH = 64  # containers inside containers; h3gate's own documents nest at most ~12 deep
MAX_CONFIG_BYTES = 16 * MIB  # config.json, index.json, YAML manifests, tolerance profiles, run specs
MAX_YAML_NODES = 1_000_000  # scalars and collections of one YAML document, aliases expanded
MAX_EVIDENCE_BYTES = 256 * MIB  # evidence documents (a real-size ws1-model record is ~10 MiB)
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(data: str | bytes) -> int:
    """The deepest container nesting of JSON text (0 for a scalar); string literals are skipped."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    arr = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    step = np.isin(arr, _OPEN).astype(np.int64) - np.isin(arr, _CLOSE).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def _check_size(nbytes: int, source: str, limit: int) -> None:
    if nbytes > limit:
        raise InputError(f"{source}: {nbytes:,} bytes exceeds the {limit:,}-byte limit for this file")


def check_json(data: str | bytes, source: str, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse JSON text above ``max_bytes`` or nested deeper than ``max_depth``."""
    _check_size(len(data), source, max_bytes)
    depth = json_depth(data)
    if depth > max_depth:
        raise InputError(f"{source}: JSON nested {depth} levels deep, above the limit of {max_depth}")


def loads_json(
    data: str | bytes, source: str, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_DEPTH, **kwargs: Any
) -> Any:
    """``json.loads(data, **kwargs)`` after :func:`check_json`; decoding errors propagate as ``json`` raises them
    (callers word their own malformed-JSON message)."""
    check_json(data, source, max_bytes, max_depth)
    return json.loads(data, **kwargs)


def read_bounded(path: Path, source: str, max_bytes: int) -> str:
    """A file's UTF-8 text, refused before reading when its size passes ``max_bytes``; ``OSError`` and
    ``UnicodeDecodeError`` propagate."""
    _check_size(Path(path).stat().st_size, source, max_bytes)
    return Path(path).read_text(encoding="utf-8")


def load_json_file(path: Path, source: str, max_bytes: int = MAX_CONFIG_BYTES, **kwargs: Any) -> Any:
    """:func:`loads_json` of a file's text (``OSError`` / ``UnicodeDecodeError`` / ``JSONDecodeError`` propagate)."""
    return loads_json(read_bounded(path, source, max_bytes), source, max_bytes, **kwargs)


def check_yaml(text: str, source: str, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse YAML text above ``max_bytes``, nested deeper than ``max_depth``, or whose aliases expand it past
    :data:`MAX_YAML_NODES` nodes (``yaml.YAMLError`` of malformed text propagates)."""
    _check_size(len(text.encode("utf-8", "surrogatepass")), source, max_bytes)
    depth = nodes = 0
    sizes: dict[str, int] = {}  # anchor -> expanded nodes of its node
    open_: list[tuple[str | None, int]] = []  # (anchor, nodes before it) of each open collection
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            nodes += sizes.get(event.anchor or "", 1)
        elif isinstance(event, yaml.ScalarEvent):
            nodes += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > max_depth:
                raise InputError(f"{source}: YAML nested more than {max_depth} levels deep (the limit)")
            open_.append((event.anchor, nodes))
            nodes += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
            anchor, before = open_.pop()
            if anchor is not None:
                sizes[anchor] = nodes - before
        if nodes > MAX_YAML_NODES:
            raise InputError(f"{source}: YAML expands (aliases included) past the limit of {MAX_YAML_NODES:,} nodes")


def loads_yaml(text: str, source: str, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """``yaml.safe_load(text)`` after :func:`check_yaml`."""
    check_yaml(text, source, max_bytes, max_depth)
    return yaml.safe_load(text)
