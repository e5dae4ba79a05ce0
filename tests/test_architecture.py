"""The shape ARCHITECTURE.md promises, checked where ruff cannot (ruff checks complexity and
parameter counts: C901 and PLR0913 in pyproject.toml): short functions, a one-screen loop, and an
import graph without cycles, TYPE_CHECKING imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mptrain"
MAX_FUNCTION_LINES = 60
MAX_LOOP_LINES = 45


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def imported_modules(tree: ast.Module) -> set[str]:
    """The mptrain modules a module imports anywhere (function bodies, TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mptrain."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "mptrain":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("mptrain."))
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path, or None."""
    visiting, done = [], set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return [*visiting[visiting.index(module) :], module]
        if module in done or module not in graph:
            return None
        visiting.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    return next((c for c in map(visit, sorted(graph)) if c), None)


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_says_what_it_owns(module):
    assert ast.get_docstring(modules()[module]), f"mptrain/{module}.py has no module docstring"


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{module}.{fn.name} ({length(fn)} lines)"
        for module, tree in modules().items()
        for fn in functions(tree)
        if length(fn) > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_training_loop_fits_on_one_screen():
    (loop,) = [fn for fn in functions(modules()["loop"]) if fn.name == "train_loop"]
    assert length(loop) <= MAX_LOOP_LINES


def test_the_import_graph_has_no_cycle():
    graph = {module: imported_modules(tree) for module, tree in modules().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_entry_point_and_the_loop_are_named_after_training():
    """The call path reads run.train -> loop.train_loop; nothing else claims to 'train'."""
    named = sorted(
        f"{module}.{fn.name}"
        for module, tree in modules().items()
        for fn in functions(tree)
        if "train" in fn.name.lower().split("_")  # train, train_loop, _train (not training)
    )
    assert named == ["loop.train_loop", "run.train"]
