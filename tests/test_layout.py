"""ftkit's layout (issue 31): modules of one concern each, small enough to read in one sitting, imported in one
direction only. A lower module never imports a higher one, not even inside a function: a circle means two
concerns have not been told apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ftkit"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, Path]:
    """ftkit's modules by dotted name (`ftkit.plan.timing`; a package by its __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def ftkit_imports(path: Path, known: set[str]) -> set[str]:
    """The ftkit modules `path` imports anywhere in it (at the top or inside a function), except for type
    annotations only (under `if TYPE_CHECKING:`, never run)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n in known}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (depth-first search), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_ftkit_has_no_import_circle():
    found = modules()
    graph = {name: ftkit_imports(path, set(found)) - {name} for name, path in found.items()}
    # A package's submodule may import its package's __init__ (where the shared names live), not the other way.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (name.startswith(m + ".") and m in found)}
    assert cycle(graph) is None, f"import circle: {' -> '.join(cycle(graph))}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_and_functions_read_in_one_sitting(name):
    path = modules()[name]
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: {', '.join(long)}"


def documented_levels() -> dict[str, int]:
    """ftkit/README.md's import order ("a -> b, c -> ..."): each module's level, from the bottom up."""
    text = (PACKAGE / "README.md").read_text().split("## Modules", 1)[1].split("\n\n", 2)[1]
    order = " ".join(text.split("\n")[2:])
    return {name.strip(" ."): level for level, part in enumerate(order.split("->")) for name in part.split(",")}


def test_every_import_goes_down_the_documented_order():
    found = modules()
    levels = documented_levels()
    top = {name.split(".")[1] for name in found if name != "ftkit"}
    assert set(levels) == top, f"ftkit/README.md's order misses or invents modules: {set(levels) ^ top}"
    upward = [
        f"{name} -> {target}"
        for name, path in found.items()
        if name != "ftkit"
        for target in ftkit_imports(path, set(found))
        if target != "ftkit"
        and target.split(".")[1] != name.split(".")[1]
        and levels[target.split(".")[1]] >= levels[name.split(".")[1]]
    ]
    assert not upward, f"imports that do not go down ftkit/README.md's order: {upward}"


@pytest.mark.parametrize("script", sorted(p.parent.name for p in (ROOT / "experiments").glob("*/train.py")))
def test_each_train_py_is_a_lesson_of_at_most_400_lines(script):
    """Each experiment's train.py is read top to bottom; what every script does alike lives in ftkit."""
    lines = (ROOT / "experiments" / script / "train.py").read_text().count("\n")
    assert lines <= 400, f"experiments/{script}/train.py: {lines} lines; move plumbing into its ftkit module"
