"""The shape ARCHITECTURE.md promises, checked where ruff cannot (ruff checks complexity and
parameter counts: C901 and PLR0913 in pyproject.toml): short functions, a one-screen loop, modules
of a readable size, an import graph without cycles, and subpackages that import only downward in
the layer order (TYPE_CHECKING and function-level imports included)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mptrain"
MAX_FUNCTION_LINES = 60
MAX_LOOP_LINES = 45
MAX_MODULE_LINES = 500
# Modules allowed past MAX_MODULE_LINES, each with the reason it is one file.
LONG_MODULES: dict[str, str] = {
    # Being split (issue 26): each owns several things today.
}

# The layers, lowest first: a module may import its own layer and those before it, never one
# after it (ARCHITECTURE.md). The top-level modules (__main__, __init__) and the console script
# (cli.app) are the last layer.
LAYERS = [
    ("config",),
    ("platform",),
    ("models", "data"),
    ("rundir",),
    ("output",),
    ("precision",),
    ("perf",),
    ("train", "report", "pace", "checkpoint"),  # a job, its report, clocks and checkpoints
    ("cli",),  # the command line; the commands compose their jobs with it
    ("commands",),
    ("<top>",),  # with the console script, cli.app, which dispatches to the commands
]
ENTRY = "cli.app"


def dotted(path: Path) -> str:
    """``mptrain/train/loop.py`` -> ``train.loop``; a package's ``__init__`` is the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


@functools.cache
def modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name below ``mptrain`` (subpackages included)."""
    return {dotted(path): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module``'s subpackage (top-level modules: the last layer)."""
    if module == ENTRY:
        return len(LAYERS) - 1
    package = module.split(".")[0] if "." in module else "<top>"
    if (PACKAGE / module).is_dir() and "." not in module:
        package = module  # a subpackage's own __init__
    return next(i for i, names in enumerate(LAYERS) if package in names)


def functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def imported_modules(tree: ast.Module) -> set[str]:
    """The mptrain modules a module imports anywhere (function bodies, TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mptrain"):
            base = node.module.removeprefix("mptrain").removeprefix(".")
            for alias in node.names:  # `from mptrain.train import loop` imports train.loop
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if (PACKAGE / f"{name.replace('.', '/')}.py").is_file() else base)
        elif isinstance(node, ast.Import):
            found.update(
                a.name[len("mptrain.") :] for a in node.names if a.name.startswith("mptrain.")
            )
    return found - {""}


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
    assert ast.get_docstring(modules()[module]), f"mptrain.{module} has no module docstring"


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{module}.{fn.name} ({length(fn)} lines)"
        for module, tree in modules().items()
        for fn in functions(tree)
        if length(fn) > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_training_loop_fits_on_one_screen():
    (loop,) = [fn for fn in functions(modules()["train.loop"]) if fn.name == "train_loop"]
    assert length(loop) <= MAX_LOOP_LINES


def test_the_import_graph_has_no_cycle():
    graph = {module: imported_modules(tree) for module, tree in modules().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_module_is_longer_than_a_chapter():
    """A module past MAX_MODULE_LINES owns more than one thing; LONG_MODULES says why not."""
    long = sorted(
        f"{path.relative_to(PACKAGE)} ({n} lines)"
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
        and dotted(path) not in LONG_MODULES
    )
    assert long == []


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)  # StopIteration: a subpackage missing from LAYERS


def test_layers_import_only_downward():
    """No module imports a later layer (ARCHITECTURE.md's order), function-level imports too."""
    upward = sorted(
        f"{module} -> {target}"
        for module, tree in modules().items()
        for target in imported_modules(tree)
        if layer_of(target) > layer_of(module)
    )
    assert upward == []


def test_the_layer_test_sees_an_upward_import():
    tree = ast.parse("from mptrain.train.loop import train_loop\nimport mptrain.cli.app")
    assert imported_modules(tree) == {"train.loop", "cli.app"}
    assert layer_of("train.loop") > layer_of("precision.quant.linear")
    assert (
        layer_of("cli.app")
        == len(LAYERS) - 1
        > layer_of("commands.sweep")
        > layer_of("cli.preflight")
    )


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_entry_point_and_the_loop_are_named_after_training():
    """The call path reads train.job.train -> train.loop.train_loop; nothing else claims to
    'train'."""
    named = sorted(
        f"{module}.{fn.name}"
        for module, tree in modules().items()
        for fn in functions(tree)
        if "train" in fn.name.lower().split("_")  # train, train_loop, _train (not training)
    )
    assert named == ["train.job.train", "train.loop.train_loop"]


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages explicitly (conf/ and recipes/ are mapped in): each
    folder of mptrain/ must be there, or an installed mptrain lacks it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for init in PACKAGE.rglob("__init__.py")
    }
    assert folders - listed == set()


def test_every_package_has_its_test_folder():
    """tests/<package>/ for each folder of mptrain/ (tests/README.md): a newcomer looking for a
    package's tests finds them by its name."""
    packages = {init.parent.name for init in PACKAGE.glob("*/__init__.py")}
    missing = sorted(p for p in packages if not (PACKAGE.parent / "tests" / p).is_dir())
    assert missing == []
