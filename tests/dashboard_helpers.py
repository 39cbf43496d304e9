"""Every PromQL query of the Grafana dashboard JSON: panel targets (rows' nested panels too),
annotation queries and query template variables, so the tests that check metric names and
evaluate the queries cannot miss one."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = (
    Path(__file__).resolve().parent.parent / "configs" / "grafana" / "dashboards" / "pd-router.json"
)
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+),\s*)?[A-Za-z_]\w*\s*\)\s*$")
QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.+)\)\s*$")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query the dashboard runs."""
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            yield f"annotation {annotation['name']}", annotation["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            expr = variable_expr(variable["query"])
            if expr:
                yield f"variable {variable['name']}", expr
    yield from _panel_queries(dashboard.get("panels", []))


def _panel_queries(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        for target in panel.get("targets", []):
            if "expr" in target:
                yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]
        yield from _panel_queries(panel.get("panels", []))


def variable_expr(query: str | dict[str, Any]) -> str:
    """The PromQL inside a Prometheus template variable's query (``label_values(selector,
    label)``, ``query_result(expr)``); empty when it selects no metric (``label_values(label)``)."""
    text = query.get("query", "") if isinstance(query, dict) else query
    if match := LABEL_VALUES.match(text):
        return match.group("selector") or ""
    if match := QUERY_RESULT.match(text):
        return match.group("expr")
    return text


def count_expr_keys(node: Any) -> int:
    """How many ``expr`` keys the JSON holds anywhere (the walker must find each)."""
    if isinstance(node, dict):
        return int("expr" in node) + sum(count_expr_keys(v) for v in node.values())
    if isinstance(node, list):
        return sum(count_expr_keys(v) for v in node)
    return 0
