"""ppokit's modules import each other without cycles, counting imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import ppokit

PACKAGE = Path(ppokit.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the ppokit modules it imports anywhere in its source (functions included).

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of
    ``a.b``. A package importing its own submodules, and a submodule importing its parent
    package, are the normal package shape and do not count.
    """
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != "ppokit":
                    continue
                found = resolve(target)
                if (
                    found
                    and found != module
                    and not module.startswith(found + ".")
                    and not found.startswith(module + ".")
                ):
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle_through_a_function_level_import():
    graph = {"ppokit.a": {"ppokit.b"}, "ppokit.b": {"ppokit.c"}, "ppokit.c": {"ppokit.a"}, "ppokit.d": set()}
    assert cycles(graph) == [["ppokit.a", "ppokit.b", "ppokit.c"]]
    real = import_graph()
    assert "ppokit.persistence.rundir" in real["ppokit.loop"]  # a top-level import
    assert "ppokit.monitoring.track" in real["ppokit.loop"]  # an import inside a function
    assert "ppokit.lm.accel" in real["ppokit.lm.model.stack"]


def test_ppokit_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_nothing_but_the_builders_depends_on_the_cpu_acceleration():
    """lm/accel is an opt-in layer: the policy, generation and the loop run without it; the one
    recipe that builds a policy (lm/model/stack.py) and the reward model apply it."""
    users = {
        m
        for m, targets in import_graph().items()
        if any(t == "ppokit.lm.accel" or t.startswith("ppokit.lm.accel.") for t in targets)
        and not m.startswith("ppokit.lm.accel")
    }
    assert users == {"ppokit.lm.model.stack", "ppokit.lm.rewards.reward_model"}
