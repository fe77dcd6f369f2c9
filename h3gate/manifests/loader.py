"""Load YAML manifests (``yaml.safe_load`` only) into strict pydantic models.

Every failure is an :class:`~h3gate.errors.InputError` whose one line reads ``file: dotted.path: message``, e.g.
``manifests/layouts.yaml: layouts.medium.audio_latents: must be > 0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from h3gate.bounded import MAX_CONFIG_BYTES, loads_yaml, read_bounded
from h3gate.errors import InputError
from h3gate.paths import display

M = TypeVar("M", bound=BaseModel)

_MESSAGES = {
    "missing": "required field missing",
    "extra_forbidden": "unknown field",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "literal_error": "must be one of {expected}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "tuple_type": "must be a list",
    "too_short": "must have at least {min_length} items",
    "too_long": "must have at most {max_length} items",
}


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """The first pydantic error as ``dotted.path: message`` (breadcrumbs start at ``prefix``)."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    path = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
    template = _MESSAGES.get(err["type"])
    if template is not None:
        try:
            message = template.format(**err.get("ctx", {}))
        except (KeyError, IndexError):
            message = err["msg"]
    else:
        message = err["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
    return f"{path}: {message}"


def read_yaml(path: Path) -> Any:
    """Parse one YAML file safely; missing file or YAML syntax errors become one-line input errors."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{display(path)}: no such manifest file")
    try:
        return loads_yaml(read_bounded(path, display(path), MAX_CONFIG_BYTES), display(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{display(path)}: {where}malformed YAML ({problem})") from None
    except UnicodeDecodeError:
        raise InputError(f"{display(path)}: not UTF-8 text") from None


def validate(data: Any, model: type[M], source: str, prefix: str = "") -> M:
    """Validate already-parsed data; ``source`` names where it came from for the breadcrumb."""
    if data is None:
        raise InputError(f"{source}: empty manifest")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{source}: {describe_validation_error(exc, prefix)}") from None


def load_yaml(path: Path, model: type[M]) -> M:
    """Read and validate one manifest file into ``model``."""
    return validate(read_yaml(path), model, display(path))


def resolve(name_or_path: str | Path, folder: Path, what: str) -> Path:
    """A manifest named ``name`` (``folder/name.yaml``) or given as a path; unknown names list the known ones."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.is_file():
            raise InputError(f"{candidate}: no such {what} file")
        return candidate
    named = folder / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    raise InputError(f"{what} {name_or_path!r}: unknown (known: {', '.join(known) or 'none'})")
