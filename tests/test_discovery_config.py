"""The ``[discovery]`` section and the peers' discovery flags: what they set, what start-up
refuses, and how the selectors read pod labels."""

from __future__ import annotations

import pytest

from pd_router.cli.main import build_parser, config_from_argv, startup_warnings
from pd_router.config import ConfigError, load_config
from pd_router.control.discovery.selectors import Selector, SelectorError, role_label, shared
from pd_router.control.workers import Role

PD = ["--prefill-selector", "app=sglang", "role=prefill",
      "--decode-selector", "app=sglang", "role=decode"]  # fmt: skip


def test_the_peers_flags_configure_kubernetes_discovery_without_a_worker_list():
    argv = ["--service-discovery", *PD, "--service-discovery-namespace", "inference",
            "--service-discovery-port", "30000", "--model-id-from", "label:model"]  # fmt: skip
    discovery = config_from_argv(argv).discovery
    assert discovery.active_provider == "kubernetes"
    assert discovery.prefill_selector == ("app=sglang", "role=prefill")
    assert (discovery.namespace, discovery.port, discovery.model_id_from) == (
        "inference", 30000, "label:model"
    )  # fmt: skip
    args = build_parser().parse_args(argv)
    assert startup_warnings(args, config_from_argv(argv)) == []


def test_the_file_provider_takes_its_manifest_and_interval():
    argv = ["--discovery-provider", "file", "--discovery-file", "/etc/pd/workers.json",
            "--discovery-check-interval-secs", "5"]  # fmt: skip
    discovery = config_from_argv(argv).discovery
    assert (discovery.active_provider, discovery.file, discovery.check_interval_secs) == (
        "file", "/etc/pd/workers.json", 5.0
    )  # fmt: skip


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"enabled": True}, "discovery.selector"),
        ({"provider": "file"}, "discovery.file"),
        ({"provider": "consul"}, "discovery.provider"),
        ({"enabled": True, "selector": ["app in sglang"]}, "discovery.selector"),
        ({"enabled": True, "selector": ["app=x"], "model_id_from": "pod"},
         "discovery.model_id_from"),
        ({"enabled": True, "selector": ["app=x"], "port": 0}, "discovery.port"),
    ],
)  # fmt: skip
def test_a_discovery_setting_that_cannot_work_stops_start_up_naming_it(section, key):
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"discovery": section})
    assert caught.value.key == key


def test_selectors_match_labels_as_the_api_server_does():
    selector = Selector.parse(["app=sglang,tier in (gpu, big)", "!canary", "zone!=b"])
    assert selector.matches({"app": "sglang", "tier": "gpu"})
    assert not selector.matches({"app": "sglang", "tier": "cpu"})
    assert not selector.matches({"app": "sglang", "tier": "big", "canary": "1"})
    assert not selector.matches({"app": "sglang", "tier": "big", "zone": "b"})
    with pytest.raises(SelectorError):
        Selector.parse(["=sglang"])


def test_one_watch_asks_for_what_the_role_selectors_share():
    prefill = Selector.parse(["app=sglang", "role=prefill"])
    decode = Selector.parse(["app=sglang", "role=decode"])
    assert str(shared([prefill, decode])) == "app=sglang"


def test_the_role_label_is_the_one_key_the_role_selectors_set_differently():
    prefill = Selector.parse(["app=sglang", "role=prefill"])
    decode = Selector.parse(["app=sglang", "role=decode"])
    label = role_label(prefill, decode, None)
    assert label is not None
    assert (label.key, label.values[Role.PREFILL], label.values[Role.DECODE]) == (
        "role", "prefill", "decode"
    )  # fmt: skip
    assert role_label(Selector.parse(["app=p"]), Selector.parse(["app=d", "x=1"]), None) is not None
    assert role_label(Selector.parse(["a=1", "b=1"]), Selector.parse(["a=2", "b=2"]), None) is None
    explicit = role_label(Selector.parse(["app=sglang"]), Selector.parse(["app=sglang"]), "pd")
    assert explicit is not None
    assert dict(explicit.values) == {Role.PREFILL: "prefill", Role.DECODE: "decode"}
