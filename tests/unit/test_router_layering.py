"""The router's boundaries, read from its source.

``pd_router`` imports neither the reference worker nor server_patch (the demo command aside; what
they share is ``pd_protocol``); the reference worker does not import server_patch. Inside
``pd_router`` dependencies point one way: ``cli`` -> ``runtime`` -> ``api`` ->
``control``/``dataplane`` -> the shared modules at the top (config, errors, metrics, tls), and no
module imports itself back through another. No module but the registry (``control/workers.py``)
writes a worker's lifecycle fields (every change goes through the registry's transition table).
``api`` holds HTTP handlers only: process mains, signals and sockets live in ``runtime``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROUTER = REPO / "pd_router"
SERVER_SIDE = frozenset({"pd_worker", "server_patch"})
LIFECYCLE_FIELDS = frozenset(
    {
        "state",
        "healthy",
        "role",
        "epoch",
        "bootstrap_port",
        "has_extensions",
        "last_error",
        "conversion_id",
        "inflight",
    }
)
# What each layer may import of the router; the top-level modules are shared by all.
# ``config`` composes every part's section: it sits above the planes, and every layer reads it.
LAYERS = {
    "dataplane": {"dataplane"},
    "control": {"control", "dataplane"},
    "config": {"control", "dataplane"},
    "api": {"api", "control", "dataplane"},
    "runtime": {"runtime", "api", "control", "dataplane"},
    "cli": {"cli", "runtime", "api", "control", "dataplane"},
}

# What each part of the data plane may import of the others: routing at the bottom, the legs
# and the link above it; the request path and the client side (``front``) use each other (the
# client's reply is what the path answers on).
DATAPLANE_PARTS = {
    "routing": {"routing"},
    "legs": {"legs", "routing"},
    "link": {"link", "routing"},
    "path": {"path", "front", "legs", "routing"},
    "front": {"front", "path", "legs", "routing"},
}


def module_name(path: Path, root: Path = ROUTER) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROUTER, *skip: str) -> dict[str, ast.Module]:
    """Every module of a package, subpackages included, by dotted name."""
    return {
        module_name(path, root): ast.parse(path.read_text(), str(path))
        for path in sorted(root.rglob("*.py"))
        if module_name(path, root) not in skip
    }


def imported_packages(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def worker_field_writes(tree: ast.Module) -> list[str]:
    """``<...>worker.<lifecycle field> = ...`` (also augmented): the object is a worker by name
    (``worker``, ``conv.worker``, ``busy_worker``)."""
    writes = []
    for node in ast.walk(tree):
        for target in assigned(node):
            if isinstance(target, ast.Attribute) and target.attr in LIFECYCLE_FIELDS:
                owner = ast.unparse(target.value)
                if owner.lower().endswith("worker"):
                    writes.append(f"line {node.lineno}: {ast.unparse(target)}")
    return writes


def imported_modules(tree: ast.Module) -> set[str]:
    """Every absolute module an import statement names, at any depth (``TYPE_CHECKING`` too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def router_imports() -> dict[str, set[str]]:
    """Each router module and the router modules it imports."""
    trees = modules()
    return {name: imported_modules(tree) & trees.keys() - {name} for name, tree in trees.items()}


def layer(name: str) -> str | None:
    """The layer a router module belongs to: its subpackage, or ``config``; None for the shared
    top-level modules."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_the_router_imports_neither_the_reference_worker_nor_server_patch():
    offenders = {
        name: sorted(imported_packages(tree) & SERVER_SIDE)
        for name, tree in modules(ROUTER, "pd_router.cli.demo").items()
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_reference_worker_does_not_import_server_patch():
    offenders = {
        name: "server_patch"
        for name, tree in modules(REPO / "pd_worker").items()
        if "server_patch" in imported_packages(tree)
    }
    assert offenders == {}


def test_the_http_handlers_run_no_process():
    process_machinery = {"signal", "socket", "subprocess", "multiprocessing"}
    offenders = {
        name: sorted(imported_modules(tree) & process_machinery)
        for name, tree in modules(ROUTER).items()
        if layer(name) == "api"
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_every_layer_imports_only_the_layers_beneath_it():
    offenders = {}
    for name, imported in router_imports().items():
        own = layer(name)
        allowed = LAYERS.get(own, set()) if own else set()
        wrong = sorted(m for m in imported if layer(m) not in {None, "config", *allowed})
        if wrong:
            offenders[name] = wrong
    assert offenders == {}


def dataplane_part(name: str) -> str | None:
    """The part of the data plane a module belongs to (``pd_router.dataplane.<part>...``)."""
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "dataplane" else None


def test_each_part_of_the_data_plane_imports_only_the_parts_beneath_it():
    offenders = {}
    for name, imported in router_imports().items():
        own = dataplane_part(name)
        if own is None:
            continue
        allowed = DATAPLANE_PARTS[own]
        wrong = sorted(m for m in imported if dataplane_part(m) not in {None, *allowed})
        if wrong:
            offenders[name] = wrong
    assert offenders == {}


def test_no_router_module_imports_itself_back_through_others():
    graph = router_imports()
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(name, ())):
            if nxt == path[0]:
                cycles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert cycles == []


def test_only_the_registry_writes_worker_lifecycle_fields():
    offenders = {
        name: worker_field_writes(tree)
        for name, tree in modules(ROUTER, "pd_router.control.workers").items()
    }
    assert {name: found for name, found in offenders.items() if found} == {}
