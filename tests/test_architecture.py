"""Rooms import only downward (DESIGN.md, "Rooms").

Every module of the package is read with ``ast``; every import counts, at module level or inside a function,
except those under ``if TYPE_CHECKING:``. Each module belongs to one room of :data:`ROOMS`, listed lowest first; a
module may import its own room and the rooms listed before it, never one listed after it. So the rooms form no
cycle, and no engine (``runs/``, ``bench/``, ``ablate/``, the trajectory, the parallel harness) imports
``commands/``, which only the CLI sits above. ``python tests/test_architecture.py`` prints the room map.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import package_sources
from tests.package_sources import sources

PACKAGE = Path(__file__).resolve().parents[1] / "h3gate"

# (room, module prefixes), lowest first: a room may import itself and the rooms above it in this list.
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "h3gate",
            "h3gate.errors",
            "h3gate.paths",
            "h3gate.hashing",
            "h3gate.dtypes",
            "h3gate.memory",
            "h3gate.bounded",
            "h3gate.numerics",
            "h3gate.ranks",
            "h3gate.merge_order",
        ),
    ),
    ("evidence", ("h3gate.evidence",)),
    ("report", ("h3gate.report",)),
    ("manifests", ("h3gate.manifests",)),
    ("inventory", ("h3gate.inventory",)),
    ("kernels", ("h3gate.kernels",)),
    ("ops", ("h3gate.ops",)),
    ("layout", ("h3gate.layout", "h3gate.schedule")),
    ("weights", ("h3gate.checkpoint", "h3gate.synth", "h3gate.fingerprint")),
    ("graph", ("h3gate.graph",)),
    ("gate", ("h3gate.gate",)),
    ("trajectory", ("h3gate.trajectory",)),
    ("sglang", ("h3gate.adapters",)),
    ("runs", ("h3gate.runs",)),
    ("adapter", ("h3gate.strict", "h3gate.strict_lora")),
    ("arms", ("h3gate.arms",)),
    ("bench", ("h3gate.bench",)),
    ("parallel", ("h3gate.parallel", "h3gate.distributed")),
    ("ablate", ("h3gate.ablate",)),
    ("commands", ("h3gate.commands",)),
    ("cli", ("h3gate.cli", "h3gate.__main__")),
)
ENGINES = ("runs", "arms", "bench", "ablate", "trajectory", "parallel")

# Known exceptions, (importing room, imported room): each one a debt with an owner, deleted when paid (a stale entry
# fails test_allowed_upward_entries_are_still_needed). Empty since issue 14 part B moved the ablation glue out of the
# parallel harness (the old ("parallel", "ablate") entry: distributed.py imported ablate.engine while
# ablate/checks.py imported distributed).
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()


def module_name(path: Path) -> str:
    return package_sources.module_name(path)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, name: str | None = None) -> set[str]:
    """Every ``h3gate`` module ``path`` (module ``name``) imports (``from m import a`` names ``m`` and ``m.a``),
    anywhere in the file but under ``if TYPE_CHECKING:``."""
    name, is_package = name or module_name(path), path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".")
                    base = base[: len(base) - child.level + (1 if is_package else 0)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                found.add(module)
                found.update(f"{module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return {m for m in found if m == "h3gate" or m.startswith("h3gate.")}


def room_of(module: str) -> str | None:
    """The room whose longest prefix matches ``module`` (``h3gate`` alone is the package root, in ``base``)."""
    best, length = None, -1
    for room, prefixes in ROOMS:
        for prefix in prefixes:
            matches = module == prefix or (prefix != "h3gate" and module.startswith(prefix + "."))
            if matches and len(prefix) > length:
                best, length = room, len(prefix)
    return best


def room_edges() -> dict[tuple[str, str], set[str]]:
    """(room, imported room) -> the importing modules, over every module of the package."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in sources().values():
        source = room_of(module_name(path))
        for module in imported_modules(path):
            target = room_of(module)
            if target is not None and source is not None and target != source:
                edges.setdefault((source, target), set()).add(module_name(path))
    return edges


RANK = {room: i for i, (room, _) in enumerate(ROOMS)}


def test_every_module_has_a_room():
    unplaced = [m for m in sources() if room_of(m) is None]
    assert unplaced == [], f"modules in no room of ROOMS (add them, and to DESIGN.md's table): {unplaced}"


def test_rooms_import_only_downward():
    upward = {
        f"{a} -> {b} ({', '.join(sorted(mods))})"
        for (a, b), mods in room_edges().items()
        if RANK[b] > RANK[a] and (a, b) not in ALLOWED_UPWARD
    }
    assert not upward, f"upward imports between rooms (DESIGN.md, Rooms): {sorted(upward)}"


def test_allowed_upward_entries_are_still_needed():
    stale = sorted(ALLOWED_UPWARD - set(room_edges()))
    assert stale == [], f"ALLOWED_UPWARD names imports that no longer exist (delete them): {stale}"


def test_no_cycle_between_rooms():
    graph: dict[str, set[str]] = {}
    for a, b in room_edges():
        if (a, b) not in ALLOWED_UPWARD:
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def cycle_from(room: str, trail: list[str]) -> list[str] | None:
        state[room] = 1
        for nxt in sorted(graph.get(room, ())):
            if state.get(nxt) == 1:
                return [*trail[trail.index(nxt) :], nxt] if nxt in trail else [room, nxt]
            if nxt not in state and (found := cycle_from(nxt, [*trail, nxt])):
                return found
        state[room] = 2
        return None

    for room in sorted(graph):
        if room not in state and (found := cycle_from(room, [room])):
            raise AssertionError(f"cycle between rooms: {' -> '.join(found)}")


def test_no_engine_imports_commands():
    offenders = sorted(
        m for (a, b), mods in room_edges().items() if a in ENGINES and b in ("commands", "cli") for m in mods
    )
    assert offenders == [], f"engines importing commands/ or the CLI: {offenders}"


def test_the_check_sees_imports_inside_functions_and_skips_type_checking(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from h3gate.commands import run_cmd\n"
        "def f():\n    from h3gate.graph.core import Graph\n    import h3gate.ops.registry\n",
        encoding="utf-8",
    )
    found = imported_modules(probe, "h3gate.probe")
    assert found == {"h3gate.graph.core", "h3gate.graph.core.Graph", "h3gate.ops.registry"}


def module_edges() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import name`` counts as ``pkg.name`` when that is a
    module, else as ``pkg``), every import but those under ``if TYPE_CHECKING:``."""
    modules = sources()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for target in imported_modules(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
        edges[name] = found
    return edges


def module_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# Known module circles (importing module, imported module): each one a debt, deleted when paid. Empty.
ALLOWED_MODULE_CYCLES: frozenset[tuple[str, str]] = frozenset()


def test_modules_import_only_modules_below_them():
    """No circle between modules, inside a package either (imports inside functions count): every module
    imports only modules below it, so a reader can read the package bottom-up."""
    edges = {m: {t for t in ts if (m, t) not in ALLOWED_MODULE_CYCLES} for m, ts in module_edges().items()}
    cycles = module_cycles(edges)
    assert cycles == [], f"import circles between modules (break them; ALLOWED_MODULE_CYCLES is empty): {cycles}"


def test_the_module_check_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert module_cycles(edges) == [["a", "b", "c"]]
    assert module_cycles({"a": {"b"}, "b": set()}) == []


def room_map() -> str:
    """``room -> imported rooms`` lines, lowest room first (what DESIGN.md's table states)."""
    edges = room_edges()
    lines = []
    for room, _ in ROOMS:
        below = sorted({b for a, b in edges if a == room}, key=RANK.__getitem__)
        marks = [f"{b}{' (ALLOWED UPWARD)' if (room, b) in ALLOWED_UPWARD else ''}" for b in below]
        lines.append(f"{room:>10} -> {', '.join(marks) or '-'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(room_map())
