"""The layout is the architecture: imports flow one way, and server/'s modules stay one concept each."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "clients", "convert", "protos", "server")
MAX_SERVER_MODULE_LINES = 500


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if ".venv" not in path.parts}


def imported(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project's modules a file imports anywhere in it: at the top, in functions, under TYPE_CHECKING."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in known}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules around it, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return stack[stack.index(child):] + [child]
            if child not in state and (found := visit(child)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_among_the_project_s_modules_type_only_imports_included():
    known = modules()
    graph = {name: imported(path, known) - {name} for name, path in known.items()}
    # A package's own __init__ importing its submodules is how it re-exports them, not a cycle a reader holds.
    for name in graph:
        graph[name] = {child for child in graph[name] if not name.startswith(child + ".")}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_server_has_folders_with_code_and_no_module_past_the_limit():
    server = ROOT / "server"
    folders = [path for path in server.iterdir() if path.is_dir() and any(path.glob("*.py"))
               and any(p.stat().st_size for p in path.glob("*.py"))]
    assert len(folders) >= 3, folders
    long = {str(path.relative_to(ROOT)): n for path in server.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_SERVER_MODULE_LINES}
    assert not long, f"modules over {MAX_SERVER_MODULE_LINES} lines: {long}"
