"""``h3gate validate``: load and cross-check every manifest and every JSON Schema the repository holds.

Checked, in order: model configs (name = file stem), checkpoint manifests (name = file stem, config equal to
``configs/real.yaml``), operator declarations (unique names; every ``reference``/``kernel`` import path resolves to
a callable), layouts (each one built, declared ``seq_len`` checked), tolerance profiles, ablation rows (each row's
``probe``/``strict`` registered for its run), and the schemas (valid 2020-12, ``$id`` = file name, every ``$ref``
resolves). A manifest kind whose loader module is not in this checkout is reported "not present" and skipped. The
first invalid item stops the run: its breadcrumb is the error (exit 2)."""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable, Iterator, Sized
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

from rich.markup import escape
from rich.table import Table

from h3gate.commands.console import print_verdict, stdout_console
from h3gate.errors import EXIT_PASS, InputError
from h3gate.paths import MANIFESTS, SCHEMAS, display


@dataclass
class Check:
    kind: str
    file: str
    entries: int | None
    status: str


# A check: (kind, file shown, callable returning the number of entries validated, or None: loader not present).
Step = tuple[str, str, Callable[[], int | None]]


def _optional(module: str) -> ModuleType | None:
    """The loader module when this checkout has it; None when absent (an import error inside it is a bug)."""
    if importlib.util.find_spec(module) is None:
        return None
    return importlib.import_module(module)


def _loader(module: ModuleType, name: str) -> Callable:
    """``module.name``; a loader module without its agreed entry point is a bug in this checkout, said plainly."""
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RuntimeError(f"{module.__name__}: has no {name}() (the loader entry point validate calls)")
    return fn


def _count(loaded: object) -> int:
    return len(loaded) if isinstance(loaded, Sized) else 1


def _config_steps() -> Iterator[Step]:
    from h3gate.manifests.model_config import config_names, load_config

    def one(name: str) -> int:
        manifest = load_config(name)
        if manifest.name != name:
            path = display(MANIFESTS / "configs" / f"{name}.yaml")
            raise InputError(f"{path}: name: {manifest.name!r} does not match the file name {name!r}")
        return 1

    for name in config_names():
        yield "config", display(MANIFESTS / "configs" / f"{name}.yaml"), lambda name=name: one(name)


def _checkpoint_steps() -> Iterator[Step]:
    from h3gate.manifests.checkpoint_manifest import load_checkpoint_manifest
    from h3gate.manifests.model_config import load_config

    def one(path: Path) -> int:
        manifest = load_checkpoint_manifest(path)
        if manifest.name != path.stem:
            raise InputError(f"{display(path)}: name: {manifest.name!r} does not match the file name {path.stem!r}")
        real = load_config("real").config
        if manifest.config != real:
            fields = [k for k in type(real).model_fields if getattr(manifest.config, k) != getattr(real, k)]
            raise InputError(
                f"{display(path)}: config: differs from {display(MANIFESTS / 'configs' / 'real.yaml')} "
                f"in {', '.join(fields)}"
            )
        return len(manifest.variants)

    for path in sorted((MANIFESTS / "checkpoints").glob("*.yaml")):
        yield "checkpoint", display(path), lambda path=path: one(path)


def _operator_steps() -> Iterator[Step]:
    from h3gate.manifests.loader import read_yaml, validate
    from h3gate.manifests.operators import OperatorFile, load_operator_specs
    from h3gate.ops.registry import check_paths, import_path

    folder = MANIFESTS / "operators"

    def one(path: Path) -> int:
        ops = validate(read_yaml(path), OperatorFile, display(path)).operators
        for name, spec in ops.items():
            for field, target in (("reference", spec.reference), ("kernel", spec.kernel)):
                if target is None:
                    continue
                try:
                    fn = import_path(target)
                except InputError as exc:
                    raise InputError(f"{display(path)}: operators.{name}.{field}: {exc}") from None
                if not callable(fn):
                    raise InputError(f"{display(path)}: operators.{name}.{field}: {target} is not callable")
            try:
                check_paths(spec)  # every declared kernel path exists in the kernel module, with its tilings
            except InputError as exc:
                raise InputError(f"{display(path)}: operators.{name}.{exc}") from None
        return len(ops)

    for path in sorted(folder.glob("*.yaml")):
        yield "operators", display(path), lambda path=path: one(path)
    yield "operators", f"{display(folder)}/ (all files)", lambda: len(load_operator_specs(folder))


def _layout_steps() -> Iterator[Step]:
    layouts = _optional("h3gate.manifests.layouts")
    builder = _optional("h3gate.layout")
    if layouts is None or builder is None:
        yield "layouts", display(MANIFESTS / "layouts.yaml"), lambda: None
        return
    path = Path(layouts.LAYOUTS_FILE)

    def run() -> int:
        specs = _loader(layouts, "load_layouts")(path)
        for name, spec in specs.items():
            try:
                built = _loader(builder, "build_layout")(spec, name)
            except InputError as exc:
                raise InputError(f"{display(path)}: layouts.{name}: {exc}") from None
            if spec.seq_len is not None and spec.seq_len != built.seq_len:
                raise InputError(
                    f"{display(path)}: layouts.{name}.seq_len: declared {spec.seq_len}, built {built.seq_len}"
                )
        return len(specs)

    yield "layouts", display(path), run


def _tolerance_steps() -> Iterator[Step]:
    module = _optional("h3gate.manifests.tolerances")
    if module is None:
        yield "tolerance", f"{display(MANIFESTS / 'tolerances')}/", lambda: None
        return
    paths = sorted((MANIFESTS / "tolerances").glob("*.yaml"))
    if not paths:
        yield "tolerance", f"{display(MANIFESTS / 'tolerances')}/ (no files)", lambda: 0
    for path in paths:
        yield "tolerance", display(path), lambda path=path: _count(_loader(module, "load_tolerance")(path))


def _ablation_steps() -> Iterator[Step]:
    module = _optional("h3gate.manifests.ablations")
    if module is None:
        yield "ablations", "h3gate.manifests.ablations", lambda: None
        return

    def run() -> int:
        from h3gate.ablate.registry import check_names

        return check_names(_loader(module, "load_ablations")())  # each row's probe/strict names a registered one

    yield "ablations", "ablation rows", run


def _schema_steps() -> Iterator[Step]:
    from h3gate.evidence.schema import SUFFIX, check_schema

    def one(path: Path) -> int:
        schema = check_schema(path)
        return len(schema.get("$defs", {})) + len(schema.get("properties", {}))

    paths = sorted(SCHEMAS.glob(f"*{SUFFIX}"))
    if not paths:
        raise InputError(f"{display(SCHEMAS)}: no *{SUFFIX} files")
    for path in paths:
        yield "schema", display(path), lambda path=path: one(path)


def _render(checks: list[Check], json_: bool, ok: bool) -> None:
    if json_:
        verdict = "pass" if ok else "fail"
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks], "verdict": verdict}, indent=1))
        return
    table = Table(title="h3gate validate")
    table.add_column("kind")
    table.add_column("file", overflow="fold")
    table.add_column("entries", justify="right")
    table.add_column("status", overflow="fold")
    for c in checks:
        colour = "green" if c.status == "ok" else "yellow" if c.status == "not present" else "red"
        entries = "-" if c.entries is None else str(c.entries)
        table.add_row(c.kind, escape(c.file), entries, f"[{colour}]{escape(c.status)}[/{colour}]")
    stdout_console().print(table)


@dataclass(frozen=True)
class ValidateCommand:
    """``validate``'s settings: JSON instead of a table."""

    json: bool = False


def validate_command(settings: ValidateCommand) -> int:
    """0 when every manifest and schema is valid; the first invalid one raises its breadcrumb (exit 2)."""
    json_ = settings.json
    checks: list[Check] = []
    groups = (
        _config_steps,
        _checkpoint_steps,
        _operator_steps,
        _layout_steps,
        _tolerance_steps,
        _ablation_steps,
        _schema_steps,
    )
    try:
        for group in groups:
            for kind, file, run in group():
                checks.append(Check(kind, file, None, "checking"))
                entries = run()
                checks[-1].entries = entries
                checks[-1].status = "not present" if entries is None else "ok"
    except InputError as exc:
        if checks and checks[-1].status == "checking":
            checks[-1].status = "invalid"
        _render(checks, json_, ok=False)
        if not json_:
            print_verdict("fail", f"{checks[-1].file if checks else 'a manifest'} is invalid; the error follows")
        raise InputError(str(exc)) from None
    _render(checks, json_, ok=True)
    if not json_:
        print_verdict("pass", f"{len(checks)} manifests and schemas checked, all valid")
    return EXIT_PASS
