"""House census: the counts issue "One house" names, measured on a source tree with ``ast`` (h3gate is never imported).

    python tools/house_census.py [ROOT] [--json] [--layout-walk]

ROOT defaults to the repository holding this script. Product code is ``h3gate/`` plus the kernels, manifests and
schemas wherever they live: ``h3gate/kernels``, ``h3gate/data/{manifests,schemas}`` today, top-level ``kernels/``,
``manifests/``, ``schemas/`` after the move (whichever exists). Definitions, one per count:

1. setups: functions (``module:qualname``) that do all three setup steps in their own body (nested functions are
   their own functions): resolve a config (a call of ``config_for``, ``load_config``, ``open_checkpoint``,
   ``open_weights``, ``resolve_config``, ``SyntheticSource``, ``device_synthetic_source``), a layout
   (``load_layout``, ``build_layout``, ``build_ref2va_layout``, ``parse_layouts``) and a graph (``bind_graph``,
   ``build_block_graph``, ``build_model_graph``, ``build_refiner_graph``); ``two_of_three`` lists those doing at
   least two (marked C, L, G), ``bind_graph_callers`` every function calling ``bind_graph``.
   manifests_read: functions outside ``manifests/`` building a "manifests read" list: a list display,
   ``.append``/``.extend`` or ``+=`` naming ``LAYOUTS_FILE`` or a ``MANIFESTS / ...`` path, or a
   ``(MANIFESTS / "operators").glob`` call.
2. node_loops: ``for`` loops and comprehensions outside ``graph/execute.py`` that iterate nodes (their target or
   iterable names ``node``/``nodes``/``nd``/``n``/``stage(s)``/``group``/``seg(s)``/``segments``/``graph``) and run
   them: a call of ``run_node``, ``run_nodes``, ``partial(run_node, ...)`` or ``<x>.fn(...)`` in the body (not
   inside a nested node loop, which counts itself, or a nested function) or as the loop's iterable; ``module:line``.
3. mode_decisions: calls of ``check_mode(``, and comparisons (``==``, ``!=``, ``in``, ``not in``) of a name
   ``mode`` or an attribute ``.mode`` against ``"strict"``/``"audit"``/``"auto"``/``"off"`` or a tuple/list/set
   holding one of them.
4. strict_numerics: calls of ``strict_numerics(`` (the ``with`` entries); numerics_setters: assignments to an
   ``.allow_tf32`` attribute and calls of ``use_deterministic_algorithms``.
5. import circles: every ``import``/``from`` of an h3gate (or kernels) module, anywhere but under ``if
   TYPE_CHECKING:``; ``from pkg import name`` goes to ``pkg.name`` when that is a module, else to ``pkg`` (a
   relative import resolved first); implicit imports of parent packages are not edges. Strongly connected
   components of size > 1, of the whole graph and of the module-level graph (imports not inside a function);
   function_imports: import statements inside functions, and how many would close a cycle at module level (one of
   their targets reaches the importing module through module-level imports). Imports by string
   (``importlib.import_module``, the registry's ``module:attr`` kernel paths) are not edges.
6. kernel_knobs: module-level names of a kernels module assigned from another file under ``h3gate/``,
   ``kernels/``, ``tools/``, ``tests/``: ``mod.NAME = ...`` (tuple targets too), ``setattr(mod, "NAME", ...)``,
   ``monkeypatch.setattr(mod, "NAME", ...)`` / ``("pkg.mod.NAME", ...)``, ``patch.object(mod, "NAME")``, where
   ``mod`` is a local alias of a kernels module; a ``setattr`` with a computed name on a kernels module counts
   every UPPERCASE string constant of that file naming a module-level name of that module (or, through a
   subscript such as ``mods[m]``, of any kernels module the file imports), marked ``dynamic``.
   experimental_flags: module-level bool/number assignments (``gl.constexpr(number)`` too) in kernels whose
   comment block above or trailing comment says ``experiment``, ``not (yet) measured``, ``unmeasured``,
   ``probe knob`` or ``a probe may set``.
7. lab_citations: lines of product code (``.py``, ``.yaml``, ``.json``) matching ``\\bsessions? \\d+\\b``,
   ``perf-probe-\\d+`` or ``\\bprobe \\d+\\b`` (case-insensitive).
8. layout_walk (``--layout-walk``, dynamic): ``run ws1-block --no-backward --layout tiny`` (config tiny, synthetic
   weights) in a child process on ROOT's code under ``sys.setprofile``. A call of a product-code function is a stop
   when, at its return (its locals are then complete), a local of its frame holds the ``--layout`` string (passed as
   a fresh, non-interned string and matched by ``id``, so the config's interned ``"tiny"`` does not count; or a local
   whose name contains ``layout`` equal to it) or an object of type ``PackedLayout`` or ``LayoutSpec`` (by type name;
   so the layout's own methods, ``self``, count; a ``spec`` local of another type, e.g. an operator spec, does not).
   Stops are in call order, immediate repeats of one function collapsed (generator resumptions are calls); each maps
   to its room by the ``ROOMS`` table of ROOT's ``tests/test_architecture.py`` (read with ``ast``, longest prefix).
   rooms = distinct rooms; returns = room visits (maximal runs of consecutive stops in one room) that enter a room
   visited before, i.e. visits - rooms. ``through_attributes`` also counts frames where the layout is an attribute
   (``vars``) of a product-code object held by a local (a setup or gate object).
9. sizes: lines per package folder (physical and code: non-blank, non-comment), modules over 500 lines,
   functions over 80 lines (``def`` line to last line).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = frozenset({"strict", "audit", "auto", "off"})
CONFIG_CALLS = frozenset({"config_for", "load_config", "open_checkpoint", "open_weights", "resolve_config",
                          "SyntheticSource", "device_synthetic_source"})  # fmt: skip
LAYOUT_CALLS = frozenset({"load_layout", "build_layout", "build_ref2va_layout", "parse_layouts"})
GRAPH_CALLS = frozenset({"bind_graph", "build_block_graph", "build_model_graph", "build_refiner_graph"})
NODE_WORDS = frozenset({"node", "nodes", "nd", "n", "stage", "stages", "group", "seg", "segs", "segments", "graph"})
EXPERIMENTAL = re.compile(r"experiment|not (yet )?measured|unmeasured|probe knob|a probe may set", re.I)
LAB = re.compile(r"\bsessions? \d+\b|perf-probe-\d+|\bprobe \d+\b", re.I)
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
LOOPS = (ast.For, ast.AsyncFor, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass
class Tree:
    """The source tree: where the package, kernels, manifests and schemas are, and every product module."""

    root: Path
    kernels: Path
    kernels_pkg: str
    data: list[Path]
    modules: dict[str, Path] = field(default_factory=dict)
    asts: dict[str, ast.Module] = field(default_factory=dict)

    @property
    def product(self) -> list[Path]:
        """Product-code folders, none inside another: ``h3gate/`` and the kernels and data folders outside it."""
        pkg = self.root / "h3gate"
        return [pkg, *(p for p in (self.kernels, *self.data) if not p.is_relative_to(pkg))]


def load_tree(root: Path) -> Tree:
    """Detect the layout (today's or the moved one) and parse every product module."""
    pkg = root / "h3gate"
    kernels = root / "kernels" if (root / "kernels").is_dir() else pkg / "kernels"
    data = [p for p in (root / "manifests", root / "schemas") if p.is_dir()]
    data += [p for p in (pkg / "data" / "manifests", pkg / "data" / "schemas") if p.is_dir()]
    if kernels.parent == pkg:
        kernels_pkg = "h3gate.kernels"
    else:  # moved: imported as ``kernels`` unless the package still spells it h3gate.kernels (package-dir mapping)
        spelled = any("h3gate.kernels" in p.read_text(encoding="utf-8") for p in pkg.rglob("*.py"))
        kernels_pkg = "h3gate.kernels" if spelled else "kernels"
    tree = Tree(root, kernels, kernels_pkg, data)
    for base, prefix in ((pkg, "h3gate"), (kernels, kernels_pkg)):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            name = ".".join((prefix, *parts))
            if name not in tree.modules:
                tree.modules[name] = path
                tree.asts[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return tree


def rel(tree: Tree, path: Path) -> str:
    return path.relative_to(tree.root).as_posix()


def call_name(node: ast.AST) -> str | None:
    """``f`` for ``f(...)`` and ``x.f(...)``."""
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return None


def own_nodes(fn: ast.AST) -> list[ast.AST]:
    """Every node of ``fn``'s body, not descending into nested functions or classes."""
    out, stack = [], list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return out


def functions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """``(qualname, def)`` for every function and method, nested ones included."""
    found: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


# --- 1. run setups and manifests-read lists -------------------------------------------------------------------------


def _names_manifest_path(node: ast.AST) -> bool:
    """``node`` mentions ``LAYOUTS_FILE`` or a ``MANIFESTS / ...`` path."""
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Name, ast.Attribute)) and (getattr(sub, "id", None) or sub.attr) == "LAYOUTS_FILE":
            return True
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Div):
            left = sub.left
            if isinstance(left, (ast.Name, ast.Attribute)) and (getattr(left, "id", None) or left.attr) == "MANIFESTS":
                return True
    return False


def _builds_manifest_list(node: ast.AST) -> bool:
    if isinstance(node, ast.List):
        return _names_manifest_path(node)
    if isinstance(node, ast.Call) and call_name(node) in ("append", "extend"):
        return any(_names_manifest_path(a) for a in node.args)
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
        return _names_manifest_path(node.value)
    if isinstance(node, ast.Call) and call_name(node) == "glob" and isinstance(node.func, ast.Attribute):
        inner = node.func.value
        right = getattr(inner, "right", None)
        return _names_manifest_path(inner) and isinstance(right, ast.Constant) and right.value == "operators"
    return False


def setups(tree: Tree) -> dict[str, Any]:
    """Run-setup builders (config + layout + graph; two of three; bind_graph callers) and manifests-read lists."""
    full, two, binders, lists = [], [], [], []
    for mod, module in tree.asts.items():
        for qual, fn in functions(module):
            nodes = own_nodes(fn)
            calls = {call_name(n) for n in nodes if isinstance(n, ast.Call)}
            steps = "".join(k for k, names in (("C", CONFIG_CALLS), ("L", LAYOUT_CALLS), ("G", GRAPH_CALLS))
                            if calls & names)  # fmt: skip
            if len(steps) >= 2:
                two.append(f"{mod}:{qual} [{steps}]")
            if len(steps) == 3:
                full.append(f"{mod}:{qual}")
            if "bind_graph" in calls:
                binders.append(f"{mod}:{qual}")
            lines = sorted({n.lineno for n in nodes if _builds_manifest_list(n)})
            if lines and not mod.startswith("h3gate.manifests"):
                lists.append(f"{mod}:{qual} (lines {', '.join(map(str, lines))})")
    return {"setups": {"count": len(full), "list": sorted(full),
                       "two_of_three": {"count": len(two), "list": sorted(two)},
                       "bind_graph_callers": {"count": len(binders), "list": sorted(binders)}},
            "manifests_read": {"count": len(lists), "list": sorted(lists)}}  # fmt: skip


# --- 2. node loops --------------------------------------------------------------------------------------------------


def _runs_node(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = call_name(node)
    if name in ("run_node", "run_nodes") or (name == "fn" and isinstance(node.func, ast.Attribute)):
        return True
    return name == "partial" and bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in (
        "run_node", "run_nodes")  # fmt: skip


def _loop_names(loop: ast.AST) -> set[str]:
    parts: list[ast.AST] = [loop.target, loop.iter] if isinstance(loop, (ast.For, ast.AsyncFor)) else [
        x for g in loop.generators for x in (g.target, g.iter)]  # fmt: skip
    names = set()
    for part in parts:
        for sub in ast.walk(part):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                names.add(sub.attr)
    return names


def _is_node_loop(node: ast.AST) -> bool:
    return isinstance(node, LOOPS) and bool(_loop_names(node) & NODE_WORDS)


def _loop_body(loop: ast.AST) -> list[ast.AST]:
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        return [*loop.body, *loop.orelse]
    return [loop.key, loop.value] if isinstance(loop, ast.DictComp) else [loop.elt]


def _runs_in_body(loop: ast.AST) -> bool:
    """A node-running call in ``loop``'s body (not inside a nested node loop or function) or its own iterable."""
    its = [loop.iter] if isinstance(loop, (ast.For, ast.AsyncFor)) else [g.iter for g in loop.generators]
    if any(_runs_node(i) for i in its):
        return True
    stack = _loop_body(loop)
    while stack:
        n = stack.pop()
        if _runs_node(n):
            return True
        if not (_is_node_loop(n) or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
            stack.extend(ast.iter_child_nodes(n))
    return False


def node_loops(tree: Tree) -> dict[str, Any]:
    """Node loops that run nodes themselves, outside the one executor."""
    found = sorted((m, loop.lineno) for m, module in tree.asts.items() if not m.endswith("graph.execute")
                   for loop in ast.walk(module) if _is_node_loop(loop) and _runs_in_body(loop))  # fmt: skip
    listed = [f"{m}:{line}" for m, line in found]
    return {"count": len(listed), "list": listed}


# --- 3. mode decisions, 4. numerics switches ------------------------------------------------------------------------


def _is_mode(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "mode") or (
        isinstance(node, ast.Attribute) and node.attr == "mode"
    )


def _mode_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in MODES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in MODES for e in node.elts)
    return False


def _mode_decision(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return call_name(node) == "check_mode"
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    return any(_is_mode(a) and _mode_literal(b) or _is_mode(b) and _mode_literal(a)
               for a, b in zip(sides, sides[1:], strict=False))  # fmt: skip


def _sites(tree: Tree, test) -> list[str]:
    return [f"{m}:{n.lineno}" for m, module in tree.asts.items() for n in ast.walk(module) if test(n)]


def _numerics_setter(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return call_name(node) == "use_deterministic_algorithms"
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Attribute) and t.attr == "allow_tf32" for t in targets)
    return False


def decisions(tree: Tree) -> dict[str, Any]:
    """Mode decisions, ``with strict_numerics(`` entries and numerics setters."""
    modes = sorted(_sites(tree, _mode_decision), key=_site_key)
    checks = [s for s in modes if s in set(_sites(tree, lambda n: call_name(n) == "check_mode"))]
    entries = sorted(_sites(tree, lambda n: call_name(n) == "strict_numerics"), key=_site_key)
    setters = sorted(_sites(tree, _numerics_setter), key=_site_key)
    return {"mode_decisions": {"count": len(modes), "check_mode_calls": len(checks), "list": modes},
            "strict_numerics": {"count": len(entries), "list": entries},
            "numerics_setters": {"count": len(setters), "list": setters}}  # fmt: skip


def _site_key(site: str) -> tuple[str, int]:
    mod, _, line = site.rpartition(":")
    return mod, int(line)


# --- 5. import circles ----------------------------------------------------------------------------------------------


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(tree: Tree, mod: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The product modules one import statement of ``mod`` reaches."""
    ours = ("h3gate", tree.kernels_pkg)
    if isinstance(node, ast.Import):
        found = {a.name for a in node.names}
    else:
        base = node.module or ""
        if node.level:
            parts = mod.split(".")
            keep = len(parts) - node.level + (1 if tree.modules[mod].name == "__init__.py" else 0)
            base = ".".join([*parts[:keep], *([node.module] if node.module else [])])
        found = {f"{base}.{a.name}" if f"{base}.{a.name}" in tree.modules else base for a in node.names}
    return {m for m in found if m in tree.modules and m.startswith(ours)}


def import_edges(tree: Tree) -> list[tuple[str, str, bool, int]]:
    """``(importer, imported, inside a function, line)`` for every product import outside ``TYPE_CHECKING``."""
    edges: list[tuple[str, str, bool, int]] = []

    def visit(mod: str, node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit(mod, other, in_fn)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                edges.extend((mod, t, in_fn, child.lineno) for t in sorted(_targets(tree, mod, child)) if t != mod)
            visit(mod, child, in_fn or isinstance(child, FUNCS))

    for mod, module in tree.asts.items():
        visit(mod, module, False)
    return edges


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, stack = {src}, [src]
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt == dst:
                return True
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def circles(tree: Tree) -> dict[str, Any]:
    """SCCs of the whole and the module-level import graph; imports inside functions and those closing a cycle."""
    edges = import_edges(tree)
    whole: dict[str, set[str]] = {}
    top: dict[str, set[str]] = {}
    for a, b, in_fn, _ in edges:
        whole.setdefault(a, set()).add(b)
        if not in_fn:
            top.setdefault(a, set()).add(b)
    stmts: dict[tuple[str, int], set[str]] = {}
    for a, b, in_fn, line in edges:
        if in_fn:
            stmts.setdefault((a, line), set()).add(b)
    closing = sorted(f"{a}:{line} -> {', '.join(sorted(t for t in ts if _reaches(top, t, a)))}"
                     for (a, line), ts in stmts.items() if any(_reaches(top, t, a) for t in ts))  # fmt: skip
    whole_sccs, top_sccs = sccs(whole), sccs(top)
    return {"import_cycles": {"count": len(whole_sccs), "modules": sum(map(len, whole_sccs)), "list": whole_sccs},
            "import_cycles_module_level": {"count": len(top_sccs), "list": top_sccs},
            "function_imports": {"count": len(stmts), "closing_a_cycle": len(closing), "list": closing}}  # fmt: skip


# --- 6. kernel knobs ------------------------------------------------------------------------------------------------


def module_names(module: ast.Module) -> set[str]:
    """Names a module binds at its top level (assignments, defs, classes)."""
    names: set[str] = set()
    for node in module.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []  # fmt: skip
        for t in targets:
            names.update(e.id for e in ast.walk(t) if isinstance(e, ast.Name))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def kernel_aliases(tree: Tree, source: ast.Module) -> dict[str, str]:
    """Local name -> kernels module, for every way ``source`` imports one (anywhere in the file)."""
    kp = tree.kernels_pkg
    aliases: dict[str, str] = {}
    for node in ast.walk(source):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(kp + ".") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith(kp + ".") and full in tree.modules:
                    aliases[a.asname or a.name] = full
    for node in ast.walk(source):  # ``g = attention_gluon``: a local name for an imported kernels module
        one = isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        if one and (mod := aliases.get(_dotted(node.value) or "")) is not None:
            aliases[node.targets[0].id] = mod
    return aliases


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _call_knob(
    call: ast.Call, resolve: dict[str, str], imported: set[str], dyn: dict[str, set[str]]
) -> list[tuple[str, str, bool]]:
    """``setattr``/``monkeypatch.setattr``/``patch.object``/``patch`` of a kernels module's name; a computed name
    counts every UPPERCASE string of the file naming one of the module's (or, through a subscript, the file's
    imported kernels modules') top-level names."""
    name = call_name(call)
    if name not in ("setattr", "object", "patch") or not call.args:
        return []
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):  # monkeypatch.setattr("pkg.mod.NAME", v)
        mod, _, attr = first.value.rpartition(".")
        return [(mod, attr, False)] if mod in dyn else []
    if len(call.args) < 2 or name == "patch":
        return []
    mod, attr = resolve.get(_dotted(first) or ""), call.args[1]
    if mod and isinstance(attr, ast.Constant):
        return [(mod, attr.value, False)]
    if name == "setattr" and (mod or isinstance(first, ast.Subscript)):
        return [(m, s, True) for m in sorted({mod} if mod else imported) for s in sorted(dyn[m])]
    return []


def _knob_writes(tree: Tree, source: ast.Module, names: dict[str, set[str]]) -> list[tuple[str, str, int, bool]]:
    """``(kernels module, name, line, dynamic)`` for each outside assignment to a kernels module's name."""
    aliases = kernel_aliases(tree, source)
    resolve = {**aliases, **{m: m for m in names}}
    strings = {n.value for n in ast.walk(source) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    dyn = {m: {s for s in strings & ns if s.isupper()} for m, ns in names.items()}
    out = []
    for node in ast.walk(source):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for attr in (e for t in targets for e in ast.walk(t) if isinstance(e, ast.Attribute)):
                if (mod := resolve.get(_dotted(attr.value) or "")) is not None:
                    out.append((mod, attr.attr, node.lineno, False))
        elif isinstance(node, ast.Call):
            out += [(m, a, node.lineno, d) for m, a, d in _call_knob(node, resolve, set(aliases.values()), dyn)]
    return out


def knobs(tree: Tree) -> dict[str, Any]:
    """Kernels' module-level names assigned from other files, and flags their comments call experimental."""
    kp = tree.kernels_pkg + "."
    names = {m: module_names(a) for m, a in tree.asts.items() if m.startswith(kp)}
    files = [p for d in ("h3gate", "kernels", "tools", "tests") if (tree.root / d).is_dir()
             for p in sorted((tree.root / d).rglob("*.py"))]  # fmt: skip
    writes: dict[str, list[str]] = {}
    for path in files:
        source = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for mod, name, line, dynamic in _knob_writes(tree, source, names):
            if tree.modules.get(mod) != path and name in names.get(mod, ()):
                where = f"{rel(tree, path)}:{line}{' (dynamic)' if dynamic else ''}"
                writes.setdefault(f"{mod}.{name}", []).append(where)
    flags = [f for m in sorted(names) for f in _experimental(m, tree.modules[m])]
    return {"kernel_knobs": {"count": len(writes), "list": {k: sorted(set(v)) for k, v in sorted(writes.items())}},
            "experimental_flags": {"count": len(flags), "list": flags}}  # fmt: skip


def _flag_value(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and node.args and call_name(node) == "constexpr":
        node = node.args[0]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float))


def _experimental(mod: str, path: Path) -> list[str]:
    """Module-level bool/number flags whose comment (block above, or trailing) matches :data:`EXPERIMENTAL`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for node in ast.parse("\n".join(lines)).body:
        if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _flag_value(node.value)):
            continue
        k, comment = node.lineno - 2, [lines[node.lineno - 1].partition("#")[2]]
        while k >= 0 and lines[k].lstrip().startswith("#"):
            comment.append(lines[k])
            k -= 1
        if match := EXPERIMENTAL.search(" ".join(comment)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            found.append(f"{mod}.{_dotted(target)} = {ast.unparse(node.value)} ({match.group(0)!r})")
    return found


# --- 7. lab citations, 9. sizes -------------------------------------------------------------------------------------


def citations(tree: Tree) -> dict[str, Any]:
    """Lines of product code citing lab history (sessions, perf probes, probe N)."""
    found = []
    for base in tree.product:
        for path in sorted(p for p in base.rglob("*") if p.suffix in (".py", ".yaml", ".yml", ".json")):
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if LAB.search(line):
                    found.append(f"{rel(tree, path)}:{i}: {', '.join(m.group(0) for m in LAB.finditer(line))}")
    listed = sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))
    return {"count": len(listed), "list": listed}


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def sizes(tree: Tree) -> dict[str, Any]:
    """Lines per package folder, modules over 500 lines, functions over 80 lines."""
    folders: dict[str, dict[str, int]] = {}
    big, long = [], []
    for mod, path in tree.modules.items():
        text = path.read_text(encoding="utf-8")
        n = len(text.splitlines())
        folder = rel(tree, path.parent)
        entry = folders.setdefault(folder, {"modules": 0, "lines": 0, "code": 0})
        entry["modules"] += 1
        entry["lines"] += n
        entry["code"] += _code_lines(text)
        if n > 500:
            big.append(f"{mod} ({n})")
        for qual, fn in functions(tree.asts[mod]):
            length = fn.end_lineno - fn.lineno + 1
            if length > 80:
                long.append(f"{mod}:{qual} ({length})")
    return {"folders": dict(sorted(folders.items())), "modules_over_500": {"count": len(big), "list": sorted(big)},
            "functions_over_80": {"count": len(long), "list": sorted(long)}}  # fmt: skip


# --- 8. the --layout walk (dynamic) ---------------------------------------------------------------------------------

LAYOUT_TYPES = frozenset({"PackedLayout", "LayoutSpec"})


def read_rooms(root: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``ROOMS`` of ``tests/test_architecture.py``, read with ``ast`` (the test is never imported)."""
    module = ast.parse((root / "tests" / "test_architecture.py").read_text(encoding="utf-8"))
    for node in module.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "ROOMS":
            return [(room, tuple(prefixes)) for room, prefixes in ast.literal_eval(node.value)]
    raise SystemExit(f"{root}/tests/test_architecture.py: no ROOMS table")


def room_of(rooms: list[tuple[str, tuple[str, ...]]], module: str) -> str:
    """The room of the longest matching prefix (``h3gate`` alone is the package root), as the test decides."""
    best, length = "?", -1
    for room, prefixes in rooms:
        for p in prefixes:
            if (module == p or (p != "h3gate" and module.startswith(p + "."))) and len(p) > length:
                best, length = room, len(p)
    return best


def walk_child(root: Path, result: Path) -> None:
    """In this process: run ``ws1-block --no-backward`` under a profiler; write the stops (call order) to ``result``."""
    tree = load_tree(root)
    by_file = {str(p.resolve()): m for m, p in tree.modules.items()}
    layout = "".join(["ti", "ny"])  # a fresh string object: the config's interned "tiny" is another object
    entered: dict[Any, int] = {}
    counter = itertools.count()
    stops: list[tuple[int, str, str, int]] = []
    product: dict[Any, str | None] = {}
    ours = ("h3gate", tree.kernels_pkg)

    def is_layout(key: str, v: Any) -> bool:
        named = isinstance(v, str) and "layout" in key and v == layout
        return v is layout or named or type(v).__name__ in LAYOUT_TYPES

    def holds(frame: Any) -> int:
        """2: a local is the layout; 1: an attribute of a product object held by a local is; 0: neither."""
        local = frame.f_locals
        if any(is_layout(k, v) for k, v in local.items()):
            return 2
        objects = (v for v in local.values() if type(v).__module__.startswith(ours) and hasattr(v, "__dict__"))
        return 1 if any(is_layout(k, x) for v in objects for k, x in vars(v).items()) else 0

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if code not in product:
            product[code] = by_file.get(str(Path(code.co_filename).resolve()))
        mod = product[code]
        if mod is None:
            return
        if event == "call":
            entered[frame] = next(counter)
        elif (seq := entered.pop(frame, None)) is not None and (level := holds(frame)):
            stops.append((seq, mod, code.co_qualname, level))

    sys.path.insert(0, str(root))
    os.environ["TRITON_INTERPRET"] = "1"
    import importlib

    cli = importlib.import_module("h3gate.cli")
    with tempfile.TemporaryDirectory() as out:
        argv = ["--quiet", "run", "ws1-block", "--no-backward", "--layout", layout, "--out", out]
        code = None
        sys.setprofile(profile)
        try:
            cli.main(argv)
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.setprofile(None)
    result.write_text(json.dumps({"exit": code, "stops": sorted(stops)}), encoding="utf-8")


def layout_walk(tree: Tree) -> dict[str, Any]:
    """Run :func:`walk_child` in a child process on ``tree``'s code; stops, rooms and returns."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "walk.json"
        env = {**os.environ, "PYTHONPATH": str(tree.root), "TRITON_INTERPRET": "1"}
        env.pop("H3GATE_HOME", None)
        cmd = [sys.executable, str(Path(__file__).resolve()), str(tree.root), "--walk-child", str(result)]
        subprocess.run(cmd, env=env, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        raw = json.loads(result.read_text(encoding="utf-8"))
    rooms = read_rooms(tree.root)
    direct = _walk([(m, q) for _, m, q, level in raw["stops"] if level == 2], rooms)
    reach = _walk([(m, q) for _, m, q, _ in raw["stops"]], rooms)
    return {"exit": raw["exit"], **direct, "through_attributes": reach}


def _walk(calls: list[tuple[str, str]], rooms: list[tuple[str, tuple[str, ...]]]) -> dict[str, Any]:
    """Stops (immediate repeats collapsed), distinct rooms, returns into a room left before."""
    stops: list[str] = []
    for mod, qual in calls:
        if not stops or stops[-1] != f"{mod}:{qual}":
            stops.append(f"{mod}:{qual}")
    visits: list[str] = []
    for stop in stops:
        room = room_of(rooms, stop.split(":")[0])
        if not visits or visits[-1] != room:
            visits.append(room)
    listed = [f"{s} [{room_of(rooms, s.split(':')[0])}]" for s in stops]
    return {"stops": len(stops), "rooms": len(set(visits)), "returns": len(visits) - len(set(visits)),
            "room_sequence": visits, "list": listed}  # fmt: skip


# --- report ---------------------------------------------------------------------------------------------------------


def census(root: Path, walk: bool) -> dict[str, Any]:
    """Every count, with its list."""
    tree = load_tree(root)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    found: dict[str, Any] = {"root": str(root), "commit": head.stdout.strip() or None, "layout": {
        "kernels": rel(tree, tree.kernels), "kernels_package": tree.kernels_pkg,
        "data": [rel(tree, p) for p in tree.data], "modules": len(tree.modules)}}  # fmt: skip
    found |= setups(tree)
    found["node_loops"] = node_loops(tree)
    found |= decisions(tree)
    found |= circles(tree)
    found |= knobs(tree)
    found["lab_citations"] = citations(tree)
    if walk:
        found["layout_walk"] = layout_walk(tree)
    found["sizes"] = sizes(tree)
    return found


SHORT = 12


def _listing(items: Any) -> list[str]:
    if isinstance(items, dict):
        items = [f"{k}: {', '.join(v)}" for k, v in items.items()]
    lines = [("  " + " <-> ".join(i)) if isinstance(i, list) else f"  {i}" for i in items[:SHORT]]
    return lines + ([f"  ... {len(items) - SHORT} more (--json lists all)"] if len(items) > SHORT else [])


def table(found: dict[str, Any]) -> str:
    """Plain-text table: one line per count, then its (shortened) list."""
    lay = found["layout"]
    out = [f"house census of {found['root']} at {(found['commit'] or '?')[:12]} ({lay['modules']} modules; kernels in "
           f"{lay['kernels']} as {lay['kernels_package']})"]  # fmt: skip
    for key, value in found.items():
        if not isinstance(value, dict) or key in ("layout", "sizes"):
            continue
        extra = ", ".join(f"{k} {v}" for k, v in value.items() if k not in ("count", "list") and not
                          isinstance(v, (list, dict)))  # fmt: skip
        head = value.get("count", value.get("stops"))
        out.append(f"{key:<28} {head:>5}{f'  ({extra})' if extra else ''}")
        out += _listing(value.get("list", []))
        for sub, inner in value.items():
            if isinstance(inner, dict) and "count" in inner:
                out.append(f"  {sub}: {inner['count']}")
                out += ["  " + line for line in _listing(inner.get("list", []))]
    sz = found["sizes"]
    out.append("lines per folder (modules, physical, code):")
    out += [f"  {k:<24} {v['modules']:>4} {v['lines']:>7} {v['code']:>7}" for k, v in sz["folders"].items()]
    for key in ("modules_over_500", "functions_over_80"):
        out.append(f"{key:<28} {sz[key]['count']:>5}")
        out += _listing(sz[key]["list"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--json", action="store_true", help="print every count and its full list as JSON")
    ap.add_argument("--layout-walk", action="store_true", help="also run the dynamic --layout walk (minutes)")
    ap.add_argument("--walk-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if not (root / "h3gate").is_dir():
        raise SystemExit(f"{root}: no h3gate/ package there")
    if args.walk_child:
        walk_child(root, args.walk_child)
        return 0
    found = census(root, args.layout_walk)
    print(json.dumps(found, indent=1) if args.json else table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
