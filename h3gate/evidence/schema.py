"""Validate evidence documents against ``schemas/<kind>.schema.json`` (JSON Schema 2020-12).

Every file in ``schemas/`` is registered under its ``$id`` (its file name) in one cached
:class:`referencing.Registry`, so ``{"$ref": "common.schema.json#/$defs/provenance"}`` resolves across files.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from h3gate.bounded import load_json_file
from h3gate.errors import InputError
from h3gate.paths import SCHEMAS, display

SUFFIX = ".schema.json"
_KIND = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def schema_path(kind: str, folder: Path | None = None) -> Path:
    """Where the schema of evidence ``kind`` lives."""
    return (folder or SCHEMAS) / f"{kind}{SUFFIX}"


def kinds(folder: Path | None = None) -> list[str]:
    """Every evidence kind that has a schema file."""
    return sorted(p.name[: -len(SUFFIX)] for p in (folder or SCHEMAS).glob(f"*{SUFFIX}"))


def read_schema(path: Path) -> dict:
    """One schema file parsed as JSON; unreadable, malformed or non-object files are input errors naming it."""
    try:
        data = load_json_file(Path(path), display(path))
    except OSError as exc:
        raise InputError(f"{display(path)}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{display(path)}: malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{display(path)}: a schema must be a JSON object")
    return data


@cache
def _load(folder: Path) -> tuple[Registry, dict[str, dict]]:
    """All schemas of ``folder`` by kind, and a registry resolving each under its ``$id`` (default: its name)."""
    schemas: dict[str, dict] = {}
    resources: list[tuple[str, Resource]] = []
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        schema = read_schema(path)
        uri = schema.get("$id", path.name)
        if uri != path.name:
            raise InputError(f"{display(path)}: $id {uri!r} must equal the file name {path.name!r}")
        schemas[path.name[: -len(SUFFIX)]] = schema
        resources.append((uri, Resource.from_contents(schema, default_specification=DRAFT202012)))
    return Registry().with_resources(resources), schemas


def registry(folder: Path | None = None) -> Registry:
    """The cached registry of every schema in ``folder`` (default ``schemas/``)."""
    return _load((folder or SCHEMAS).resolve())[0]


def clear_cache() -> None:
    """Forget loaded schemas (after a schema file changed on disk in this process)."""
    _load.cache_clear()


def check_schema(path: Path) -> dict:
    """Check that one file is a valid 2020-12 schema whose ``$ref``s all resolve in the folder's registry."""
    schema = read_schema(path)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise InputError(f"{display(path)}: {where}: not a valid 2020-12 schema ({exc.message})") from None
    resolver = registry(Path(path).parent).resolver(base_uri=schema.get("$id", Path(path).name))
    for ref in _refs(schema):
        try:
            resolver.lookup(ref)
        except Exception as exc:  # referencing raises several unrelated types for unresolvable refs
            raise InputError(f"{display(path)}: $ref {ref!r} does not resolve ({type(exc).__name__})") from None
    return schema


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def validate_document(doc: dict, kind: str | None = None, source: str | None = None) -> None:
    """Validate ``doc`` against ``schemas/<kind>.schema.json`` (``kind`` defaults to ``doc["kind"]``).

    Failure is one :class:`InputError` line ``<source or schema file>: <json path>: <message>`` for the most
    relevant error (``jsonschema.exceptions.best_match``).
    """
    if kind is None:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if not isinstance(kind, str):
            raise InputError(f"{source or 'evidence document'}: $.kind: missing or not a string")
    if not _KIND.match(kind):
        raise InputError(f"{source or 'evidence document'}: $.kind: {kind!r} is not a valid evidence kind")
    folder = SCHEMAS.resolve()
    reg, schemas = _load(folder)
    if kind not in schemas:
        raise InputError(
            f"{source or 'evidence document'}: kind {kind!r}: no schema {display(schema_path(kind))} "
            f"(known: {', '.join(sorted(schemas)) or 'none'})"
        )
    validator = Draft202012Validator(schemas[kind], registry=reg)
    error = best_match(validator.iter_errors(doc))
    if error is not None:
        raise InputError(f"{source or display(schema_path(kind))}: {error.json_path}: {error.message}")
