"""The layout by where code runs (docs/concepts.md, "Layout"): rooms import only rooms below them, and no
module imports itself back through others. Every import counts, module-level and function-local; only those
under ``if TYPE_CHECKING:`` (never executed) are left out."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Rooms from the bottom up: a module may import its own room and the rooms before it, never one after it.
# The package root (``rlkit``, the plugin author's facade) is left out: importing any module runs it anyway.
ROOMS = [
    ("rlkit.errors",),
    ("rlkit.batch", "rlkit.hardware"),
    ("rlkit.algos",),
    ("rlkit.plugin",),
    ("rlkit.data", "rlkit.rewards"),
    ("rlkit.recipe",),
    ("rlkit.builtin",),
    ("rlkit.model",),
    ("rlkit.rollout",),
    ("rlkit.workers",),
    ("rlkit.runtime",),
    ("rlkit.eval",),
    ("rlkit.step",),
    ("rlkit.cli", "rlkit.__main__"),
    ("rlkit.testing",),
]
LEAVES = {"rlkit", "rlkit.__main__", "rlkit.errors", "rlkit.batch", "rlkit.hardware"}  # what the root keeps


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "rlkit").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name and target != "rlkit":
                    graph[name].add(target)
    return graph


def room_of(module: str) -> int:
    for level, prefixes in enumerate(ROOMS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is in no room: add it to a room of ROOMS (tests/unit/test_layout.py)")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_import_points_up_a_room():
    up = [
        f"{a} -> {b}"
        for a, bs in sorted(import_graph().items())
        for b in sorted(bs)
        if a != "rlkit" and room_of(b) > room_of(a)
    ]
    assert up == []


def test_the_package_root_holds_only_leaves():
    root = {
        name for name in modules() if name.count(".") == 1 and not (SRC / name.replace(".", "/")).is_dir()
    }
    assert root | {"rlkit"} <= LEAVES | {"rlkit"}, sorted(root - LEAVES)


@pytest.mark.parametrize("kind", ["cycle", "up"])
def test_the_check_sees_what_it_guards(kind):
    """The checks fail on a graph that breaks them (so a green run means something)."""
    if kind == "cycle":
        assert cycles({"rlkit.a": {"rlkit.b"}, "rlkit.b": {"rlkit.a"}}) == [["rlkit.a", "rlkit.b"]]
    else:
        assert room_of("rlkit.cli.run") > room_of("rlkit.algos.kl")
