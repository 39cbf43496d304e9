"""Which pools a request picks from, by its ``model``, on a data plane's snapshot: one model
(or none named) is the only route whatever the request says; several are chosen by name, with
404 for an unknown one and 400 for none; a model with prefill or decode workers is served in PD,
one with regular workers only whole on one of them. And where the models and the regular
workers come from: the configuration, the registry."""

from __future__ import annotations

import pytest

from pd_router.circuit_state import CircuitState
from pd_router.config import ConfigError, build_config
from pd_router.control.workers import WorkerRegistry
from pd_router.errors import ModelNotFound, ModelRequired, NoWorkers
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from pd_router.wire import Snapshot, WorkerEntry
from tests.unit.test_wire import pools as plain_pools

P1, D1, R1, P2 = (f"http://127.0.0.1:{port}" for port in (1001, 1002, 1003, 1004))


def entry(url: str, role: Role, model: str, pickable: bool = True) -> WorkerEntry:
    port = 8998 if role is Role.PREFILL else None
    return WorkerEntry(url, role, model, 0, port, pickable, True, CircuitState.CLOSED, None, None)


def routed(*entries: WorkerEntry):
    routing = plain_pools()
    routing.apply(Snapshot(1, entries))
    return routing


def test_one_model_is_the_only_route_whatever_the_request_names():
    routing = routed(entry(P1, Role.PREFILL, "big"), entry(D1, Role.DECODE, "big"))
    for model in (None, "big", "something else", 3):
        route = routing.route(model)
        assert (route.model, route.regular) == ("big", False)
    assert routing.pick(Role.DECODE).url == D1


def test_workers_that_name_no_model_are_one_model():
    routing = routed(entry(P1, Role.PREFILL, ""), entry(D1, Role.DECODE, ""))
    assert routing.route("anything").model == ""
    assert routing.pick(Role.PREFILL).url == P1


def test_a_worker_not_named_joins_the_one_named_model():
    routing = routed(entry(P1, Role.PREFILL, "big"), entry(D1, Role.DECODE, ""))
    route = routing.route(None)
    assert routing.pick(Role.DECODE, route=route).url == D1


def test_several_models_are_routed_by_name():
    routing = routed(
        entry(P1, Role.PREFILL, "big"),
        entry(D1, Role.DECODE, "big"),
        entry(R1, Role.REGULAR, "small"),
    )
    big, small = routing.route("big"), routing.route("small")
    assert (big.regular, small.regular) == (False, True)
    assert routing.pick(Role.REGULAR, route=small).url == R1
    with pytest.raises(NoWorkers):
        routing.pick(Role.REGULAR, route=big)
    assert routing.models() == ["big", "small"]


def test_an_unknown_model_is_404_and_none_is_400_when_several_are_served():
    routing = routed(entry(P1, Role.PREFILL, "big"), entry(R1, Role.REGULAR, "small"))
    with pytest.raises(ModelNotFound) as unknown:
        routing.route("medium")
    with pytest.raises(ModelRequired) as missing:
        routing.route(None)
    assert (unknown.value.status, missing.value.status) == (404, 400)


def test_a_model_with_pd_workers_is_served_in_pd_even_with_regular_ones():
    routing = routed(
        entry(P1, Role.PREFILL, "big"),
        entry(R1, Role.REGULAR, "big"),
        entry(P2, Role.PREFILL, "other"),
    )
    assert routing.route("big").regular is False


def test_a_model_whose_workers_are_all_out_of_selection_keeps_its_route_and_refuses_with_503():
    routing = routed(
        entry(P1, Role.PREFILL, "big", pickable=False),
        entry(R1, Role.REGULAR, "small"),
    )
    with pytest.raises(NoWorkers):
        routing.pick(Role.PREFILL, route=routing.route("big"))


def test_regular_workers_come_from_the_config_with_their_model_and_policy():
    config = build_config(
        {
            "policy": "round_robin",
            "regular": [{"url": "127.0.0.1:30021", "model": "small"}, "http://127.0.0.1:30022"],
        }
    )
    assert [(w.url, w.model) for w in config.regular] == [
        ("http://127.0.0.1:30021", "small"),
        ("http://127.0.0.1:30022", None),
    ]
    assert config.policy_of(Role.REGULAR) == "round_robin"


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"url": "http://127.0.0.1:30021", "bootstrap_port": 8998}, "regular[0].bootstrap_port"),
        ({"url": "http://127.0.0.1:30021", "model": " "}, "regular[0].model"),
    ],
)
def test_a_regular_worker_with_a_bootstrap_port_or_a_blank_model_is_a_config_error(entry, key):
    with pytest.raises(ConfigError) as error:
        build_config({"regular": [entry]})
    assert error.value.key == key


def test_the_registry_names_the_models_its_workers_report_and_no_model_for_one_not_read():
    registry = WorkerRegistry(RouterMetrics())
    registry.add(P1, Role.PREFILL, 8998, model="big")
    registry.add(D1, Role.DECODE)
    assert registry.models() == ["big"]
    registry.add(R1, Role.REGULAR, model="small")
    assert registry.models() == ["big", "small"]
    assert [w.url for w in registry.selectable(Role.REGULAR, "small")] == [R1]
    assert registry.roles() == (Role.PREFILL, Role.DECODE, Role.REGULAR)
