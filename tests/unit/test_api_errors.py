"""The control plane's refusals as the admin API answers them: plain exceptions in control/,
one table in api/errors.py giving each its status, error type and the fields its body names."""

from __future__ import annotations

import ast
from pathlib import Path

import orjson
import pytest

from pd_router.api.errors import error_response
from pd_router.control.conversion.history import ConversionNotFound
from pd_router.control.errors import (
    AlreadyInRole,
    ClusterUnavailable,
    ConversionRefused,
    KnobNotAccepted,
    WorkerUnreachable,
)
from pd_router.control.worker_control import ControlError
from pd_router.control.workers import DuplicateWorker, Role, UnknownWorker, WorkerRegistry
from pd_router.metrics import RouterMetrics

P = "http://127.0.0.1:1"
CONTROL = Path(__file__).resolve().parents[2] / "pd_router" / "control"


def answered(exc: Exception) -> tuple[int, dict, str | None]:
    response = error_response(exc)
    return (
        response.status,
        orjson.loads(response.body)["error"],
        response.headers.get("Retry-After"),
    )


def worker():
    return WorkerRegistry(RouterMetrics()).add(P, Role.PREFILL)


def test_an_unknown_worker_is_a_404():
    assert answered(UnknownWorker("w9")) == (
        404,
        {"message": "no worker with url or id 'w9'", "type": "not_found", "code": 404},
        None,
    )


def test_another_registry_refusal_is_a_409_without_a_reason():
    status, error, _ = answered(DuplicateWorker(P))
    assert (status, error) == (
        409,
        {"message": f"worker {P} is already registered", "type": "conflict", "code": 409},
    )


def test_a_refused_conversion_is_a_409_naming_its_reason():
    assert answered(ConversionRefused("min_decode", "too few decodes")) == (
        409,
        {"message": "too few decodes", "type": "conflict", "code": 409, "reason": "min_decode"},
        None,
    )


def test_a_subclass_answers_as_the_refusal_it_is():
    status, error, _ = answered(AlreadyInRole(worker()))
    assert (status, error["type"], error["reason"]) == (409, "conflict", "already_in_role")


def test_a_knob_a_native_worker_does_not_take_is_a_400_naming_the_field():
    status, error, _ = answered(KnobNotAccepted("check_idle", worker()))
    assert (status, error["type"], error["field"]) == (400, "invalid_request_error", "check_idle")


def test_an_unreachable_worker_to_convert_is_a_502():
    status, error, _ = answered(WorkerUnreachable(ControlError(P, "/server_info", "refused")))
    assert (status, error["type"]) == (502, "upstream_error")


def test_an_unknown_conversion_is_a_404():
    status, error, _ = answered(ConversionNotFound("c1"))
    assert (status, error) == (
        404,
        {"message": "no conversion with id 'c1'", "type": "not_found", "code": 404},
    )


def test_a_cluster_without_etcd_is_a_503_saying_when_to_come_back():
    status, error, retry_after = answered(ClusterUnavailable("etcd is away"))
    assert (status, error["type"], error["message"], retry_after) == (
        503,
        "cluster_unavailable",
        "etcd is away",
        "5",
    )


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyError("k")])
def test_anything_else_is_a_500_that_says_nothing_of_the_error(exc):
    assert answered(exc)[:2] == (
        500,
        {"message": "internal router error", "type": "internal_error", "code": 500},
    )


def test_no_control_module_imports_the_http_errors():
    offenders = []
    for path in sorted(CONTROL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "pd_router.errors":
                offenders.append(str(path.relative_to(CONTROL)))
    assert offenders == []
