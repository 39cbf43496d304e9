"""The router's boundaries, read from its source: ``pd_router`` imports neither the reference
worker nor server_patch (the demo command aside; what they share is ``pd_protocol``), and no
module but ``workers.py`` writes a worker's lifecycle fields (every change goes through the
registry's transition table)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parent.parent / "pd_router"
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


def modules(*skip: str) -> dict[str, ast.Module]:
    return {
        path.name: ast.parse(path.read_text(), str(path))
        for path in sorted(ROUTER.glob("*.py"))
        if path.name not in skip
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


def test_the_router_imports_neither_the_reference_worker_nor_server_patch():
    offenders = {
        name: sorted(imported_packages(tree) & SERVER_SIDE)
        for name, tree in modules("demo.py").items()
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_only_the_registry_writes_worker_lifecycle_fields():
    offenders = {name: worker_field_writes(tree) for name, tree in modules("workers.py").items()}
    assert {name: found for name, found in offenders.items() if found} == {}
