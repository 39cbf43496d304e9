"""No module-level import cycle in pd_router or pd_worker.

A cycle among top-of-file imports makes the import order matter (a name is missing when a
half-initialised module is read) and keeps modules from being understood or tested alone. The
graph is read from the source with `ast`, so it sees every module, not only those a test run
happens to import: imports under `if TYPE_CHECKING:` and inside functions are left out, since
they do not run when the module loads. pd_worker is held to more: its roles depend on
`pd_worker.role_host`, not on the engine, so even those imports form no cycle there.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pd_router", "pd_worker")


def module_name(path: Path) -> str:
    """The dotted name of a source file under ROOT (a package is named by its __init__)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    """Whether an `if` test is `TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def load_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module loads: top level, or nested in a
    module-level try/if/with (but not under `if TYPE_CHECKING:`), never in a def or class."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not is_type_checking(node.test):
                found += load_time_imports(node.body)
            found += load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found += load_time_imports(block)
            for handler in node.handlers:
                found += load_time_imports(handler.body)
        elif isinstance(node, ast.With):
            found += load_time_imports(node.body)
    return found


def every_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands."""
    module = ast.Module(body=body, type_ignores=[])
    return [node for node in ast.walk(module) if isinstance(node, ast.Import | ast.ImportFrom)]


def imported_modules(
    name: str, is_package: bool, imports: list[ast.Import | ast.ImportFrom], known: set[str]
) -> set[str]:
    """The known modules the imports name (`from m import x` names `m.x` when that is a
    module, else `m`); relative imports are resolved against the module's package."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in imports:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.add(sub if sub in known else base)
    return {target for target in targets if target in known and target != name}


def import_graph(
    packages: tuple[str, ...] = PACKAGES, find=load_time_imports
) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (``find``: which import statements of
    a module's body count)."""
    files = {
        module_name(path): path for package in packages for path in (ROOT / package).rglob("*.py")
    }
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        body = ast.parse(path.read_text(), str(path)).body
        graph[name] = imported_modules(name, path.name == "__init__.py", find(body), known)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the list of modules along it (first repeated last), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_a_cycle_is_found_and_spelled_out():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_graph_is_read_from_every_module():
    graph = import_graph()
    assert "pd_router.control.supervisor" in graph
    assert "pd_worker.engine" in graph
    assert graph["pd_worker.app"], "pd_worker.app imports other pd_worker modules"


def test_no_module_level_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_pd_worker_has_no_cycle_even_through_type_only_or_deferred_imports():
    cycle = find_cycle(import_graph(("pd_worker",), every_import))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
