"""One executor: ``h3gate/graph/execute.py`` is the only module that iterates a graph's nodes to run them.

Every other module reads nodes freely (names, row dims, records) but runs them through the executor's loops
(:func:`~h3gate.graph.execute.run_nodes` and what is built on it, :func:`~h3gate.graph.execute.iter_isolated`,
:func:`~h3gate.graph.execute.iter_node_vjps`, :func:`~h3gate.graph.stages.iter_stages`). The check reads every module
with ``ast``: a ``for`` loop or comprehension over nodes (an iterable that mentions ``.nodes``, or a name ending in
``nodes``) whose body runs a node - calls :data:`RUNNERS`, a node's ``.fn(...)``, or the result of a call (an override
factory's product) - is a second node loop. Nested function bodies are not part of a loop's body (an override defined
in a loop runs later, inside the executor).
"""

from __future__ import annotations

import ast

from tests.package_sources import PACKAGE, relative, sources

EXECUTOR = PACKAGE / "graph" / "execute.py"
RUNNERS = frozenset({"run_node", "run_nodes", "node_vjp", "run_stage", "stage_vjp", "run_chained", "iter_graph"})


def _mentions_nodes(expr: ast.expr) -> bool:
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Attribute) and sub.attr == "nodes":
            return True
        if isinstance(sub, ast.Name) and sub.id.endswith("nodes"):
            return True
    return False


def _runs_a_node(body: list[ast.AST]) -> str | None:
    """The first node-running call in ``body`` (nested defs and lambdas skipped), as source text, or None."""
    stack = list(body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in RUNNERS:
                return ast.unparse(node)
            if isinstance(func, ast.Attribute) and (func.attr == "fn" or func.attr in RUNNERS):
                return ast.unparse(node)
            if isinstance(func, ast.Call):
                return ast.unparse(node)
        stack.extend(ast.iter_child_nodes(node))
    return None


def node_loops(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` for every loop over nodes in ``source`` whose body runs a node."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.For | ast.AsyncFor) and _mentions_nodes(node.iter):
            call = _runs_a_node([*node.body, *node.orelse])
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            if not any(_mentions_nodes(g.iter) for g in node.generators):
                continue
            parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            call = _runs_a_node([*parts, *(c for g in node.generators for c in g.ifs)])
        else:
            continue
        if call is not None:
            found.append((node.lineno, call))
    return found


def test_only_the_executor_iterates_nodes_to_run_them():
    offenders = [
        f"{relative(path)}:{line}: {call}"
        for path in sources().values()
        if path != EXECUTOR
        for line, call in node_loops(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], f"node loops outside h3gate/graph/execute.py (run them through the executor): {offenders}"


def test_the_check_finds_a_second_node_loop():
    """Negative controls: the shapes a second node loop takes are all found; reading nodes is not a loop."""
    loops = (
        "for node in graph.nodes:\n    values[node.name] = run_node(node, ops, values, params)\n",
        "for n in reversed(stage.nodes):\n    out = n.fn(ops, x, p)\n",
        "for node in nodes:\n    y = fault.override(node, dims)(ops, x, p)\n",
        "outs = {n.name: run_node(n, ops, v, p) for n in g.nodes}\n",
        "for node in gate.graph.nodes:\n    if ok:\n        with torch.no_grad():\n"
        "            execute.run_node(node, t, v, p)\n",
    )
    for source in loops:
        assert node_loops(source), source
    reads = (
        "names = [n.name for n in graph.nodes]\n",
        "for node in graph.nodes:\n    overrides[node.name] = NodeOverride(lambda o, v, p, n: run_node(n, o, v, p))\n",
        "for node, fed, out in iter_isolated(graph.nodes, ops, feed, params):\n    records.append(out)\n",
    )
    for source in reads:
        assert not node_loops(source), source
