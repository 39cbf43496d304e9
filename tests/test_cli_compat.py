"""Drop-in compatibility with sglang-router 0.3.2 and smg 1.13: their PD command lines start
pd-router unchanged, every option of theirs is in pd_router.cli.compat's table and parses with their
arity (checked against their recorded ``--help`` and argparse definitions in tests/data/,
recorded with tests/data/record_peer_options.py), inapplicable options are named once in a
start-up warning, and the client's request id is read from the configured headers."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pd_router.cli.compat import DOC_HEADING, PEER_OPTIONS, doc_section, policy_names
from pd_router.cli.main import (
    build_parser,
    config_from_args,
    config_from_argv,
    overrides_from_argv,
    startup_warnings,
)
from pd_router.config import ConfigError, load_config
from pd_router.dataplane.routing import policies
from tests.router_helpers import assert_paired, generate_body, running_router

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
VENVS = ROOT / "bench" / "venvs"  # where bench/ installs the peers (git-ignored)
PEERS = {
    "sglang-router": ("sglang_router_0.3.2_help.txt", "sglang_router_0.3.2_options.json"),
    "smg": ("smg_1.13_launch_help.txt", "smg_1.13_options.json"),
}
HELP_COMMANDS = {
    "sglang-router": [str(VENVS / "sglang-router/bin/python"), "-m",
                      "sglang_router.launch_router", "--help"],
    "smg": [str(VENVS / "smg/bin/smg"), "launch", "--help"],
}  # fmt: skip
WORKERS = ["--prefill", "http://127.0.0.1:30001", "--decode", "http://127.0.0.1:30011"]


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


@contextlib.asynccontextmanager
async def client_of_router(cluster, **overrides) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of a real router over ``cluster`` configured with ``overrides``."""
    async with running_router(cluster, **overrides) as router, router.client() as http:
        yield http


async def test_request_id_is_read_from_the_configured_headers_in_order(cluster):
    headers = ["x-trace-id", "x-correlation-id"]
    async with client_of_router(cluster, request_id_headers=headers) as http:
        both = {"X-Correlation-Id": "corr-1", "X-Trace-Id": "trace-1", "X-Request-Id": "r-1"}
        response = await http.post("/generate", json=generate_body("ids"), headers=both)
        assert response.status_code == 200
        assert response.headers["X-Request-Id"] == "trace-1"
        assert response.json()["meta_info"]["id"].startswith("trace-1-")
        second = {"X-Correlation-Id": "corr-2", "X-Request-Id": "r-2"}
        response = await http.post("/generate", json=generate_body("ids"), headers=second)
        assert response.headers["X-Request-Id"] == "corr-2"


async def test_x_request_id_is_still_read_after_the_configured_headers(cluster):
    async with client_of_router(cluster, request_id_headers=["x-trace-id"]) as http:
        response = await http.post(
            "/generate", json=generate_body("ids"), headers={"X-Request-Id": "plain-7"}
        )
        assert response.headers["X-Request-Id"] == "plain-7"


async def test_configured_request_id_header_is_echoed_on_a_stream(cluster):
    async with client_of_router(cluster, request_id_headers=["x-trace-id"]) as http:
        body = generate_body("ids", stream=True)
        headers = {"X-Trace-Id": "stream-9"}
        async with http.stream("POST", "/generate", json=body, headers=headers) as response:
            assert response.headers["X-Request-Id"] == "stream-9"
            await response.aread()


@pytest.mark.parametrize("names", [["x trace"], [""], ["x-id\r\n"], "x-trace-id", [3]])
def test_request_id_headers_must_be_a_list_of_header_names(names):
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"request_id_headers": names})
    assert caught.value.key.startswith("request_id_headers")


def usage_options(help_text: str) -> set[str]:
    """The option names in a ``--help`` output's usage block (the text before the first blank
    line), without -h/--help."""
    usage = help_text.split("\n\n", 1)[0]
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", usage)) - {"--help"}


def table_options(peer: str) -> set[str]:
    return {name for o in PEER_OPTIONS.values() if peer in o.peers for name in o.label.split("/")}


@pytest.mark.parametrize("peer", PEERS)
def test_every_option_in_the_peers_help_is_in_the_table_for_that_peer(peer):
    recorded = usage_options((DATA / PEERS[peer][0]).read_text())
    assert len(recorded) > 90
    assert recorded - table_options(peer) == set()


def recorded_names(peer: str) -> set[str]:
    """Every option string of the peer's parser, aliases included (usage shows one name)."""
    actions = json.loads((DATA / PEERS[peer][1]).read_text())
    return {name for action in actions for name in action["options"]}


@pytest.mark.parametrize("peer", PEERS)
def test_every_name_and_alias_of_the_peers_options_is_in_the_table(peer):
    assert recorded_names(peer) - table_options(peer) == set()


def test_every_option_in_the_table_is_one_of_a_peers():
    recorded = recorded_names("sglang-router") | recorded_names("smg")
    assert table_options("sglang-router") | table_options("smg") == recorded


@pytest.mark.parametrize("peer", PEERS)
def test_recorded_help_is_what_the_installed_peer_prints(peer):
    command = HELP_COMMANDS[peer]
    if not Path(command[0]).exists():
        pytest.skip(f"{peer} is not installed at {command[0]}")
    printed = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    assert usage_options(printed) == usage_options((DATA / PEERS[peer][0]).read_text())


def sample_argv(action: argparse.Action, name: str, peer_type: str | None) -> list[str]:
    """``name`` with a value of the peer's type (one of ours when we check choices)."""
    if action.nargs == 0:
        return [name]
    kind = peer_type or ""
    value = "3" if "int" in kind else "0.5" if "float" in kind else "x"
    if action.choices:
        value = next(iter(action.choices))
    return [name, value]


@pytest.mark.parametrize("peer", PEERS)
def test_every_peer_option_parses_with_the_peers_arity_and_type(peer):
    parser = build_parser()
    ours = {name: action for action in parser._actions for name in action.option_strings}
    for recorded in json.loads((DATA / PEERS[peer][1]).read_text()):
        for name in recorded["options"]:
            action = ours[name]
            assert action.nargs == recorded["nargs"], name
            args = parser.parse_args(sample_argv(action, name, recorded["type"]))
            assert action.dest in vars(args), name


def test_the_doc_table_is_generated_from_the_compat_table():
    text = (ROOT / "docs" / "router.md").read_text()
    start = text.index(DOC_HEADING)
    end = text.find("\n## ", start)
    section = text[start : end + 1 if end >= 0 else len(text)]
    assert section.rstrip("\n") == doc_section().rstrip("\n"), (
        "regenerate with: python -m pd_router.cli.compat docs/router.md"
    )


SGLANG_DOC_LINES = [
    "--pd-disaggregation --prefill http://127.0.0.1:30001 9001 --decode http://127.0.0.1:30011 "
    "--policy cache_aware --host 0.0.0.0 --port 8000",
    "--pd-disaggregation --prefill http://127.0.0.1:8000 9000 --prefill http://127.0.0.1:8002 "
    "--decode http://127.0.0.1:8001 --decode http://127.0.0.1:8003 --policy cache_aware",
    "--pd-disaggregation --prefill http://127.0.0.1:8000 9000 --prefill http://127.0.0.1:8002 "
    "none --prefill http://127.0.0.1:8004 --decode http://127.0.0.1:8001 "
    "--decode http://127.0.0.1:8003",
    "--pd-disaggregation --prefill http://127.0.0.1:8000 --prefill http://127.0.0.1:8002 "
    "--decode http://127.0.0.1:8001 --decode http://127.0.0.1:8003 "
    "--prefill-policy cache_aware --decode-policy power_of_two",
]


@pytest.mark.parametrize("line", SGLANG_DOC_LINES)
def test_the_peers_documented_pd_command_lines_give_a_config(line):
    config = config_from_argv(line.split())
    assert config.prefill and config.decode
    assert config.prefill[0].bootstrap_port in (9000, 9001, None)


def test_a_documented_command_line_sets_workers_ports_and_per_role_policies():
    config = config_from_argv(SGLANG_DOC_LINES[2].split())
    assert [p.bootstrap_port for p in config.prefill] == [9000, None, None]
    assert [d.url for d in config.decode] == ["http://127.0.0.1:8001", "http://127.0.0.1:8003"]
    config = config_from_argv(SGLANG_DOC_LINES[3].split())
    assert (config.prefill_policy, config.decode_policy) == ("cache_aware", "power_of_two")


def test_per_role_policy_wins_over_policy_in_any_order():
    argv = [*WORKERS, "--prefill-policy", "round_robin", "--policy", "random"]
    config = config_from_argv(argv)
    assert (config.prefill_policy, config.decode_policy) == ("round_robin", "random")


def test_options_on_existing_keys_set_their_config_values():
    config = config_from_argv(
        [*WORKERS, "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
         "--retry-max-backoff-ms", "30000", "--cb-failure-threshold", "10",
         "--cb-timeout-duration-secs", "60", "--health-failure-threshold", "4",
         "--health-success-threshold", "1", "--health-check-timeout-secs", "5",
         "--health-check-interval-secs", "60", "--health-check-endpoint", "/health_generate",
         "--request-timeout-secs", "1800", "--max-payload-size", "536870912",
         "--header-read-timeout-secs", "7", "--idle-connection-timeout-secs", "30",
         "--stream-body-stall-timeout-secs", "9", "--upstream-pool-idle-timeout-secs", "3",
         "--api-key", "worker-key", "--log-level", "warn", "--log-json",
         "--request-id-headers", "x-trace-id", "x-correlation-id"]
    )  # fmt: skip
    assert config.retry.max_attempts == 3
    assert (config.retry.backoff_base_secs, config.retry.backoff_max_secs) == (0.05, 30.0)
    assert (config.circuit.failure_threshold, config.circuit.cooldown_secs) == (10, 60.0)
    h = config.health
    assert (h.failure_threshold, h.success_threshold, h.timeout_secs) == (4, 1, 5.0)
    assert (h.interval_secs, h.endpoint) == (60.0, "/health_generate")
    assert (config.request_timeout_secs, config.max_payload_size) == (1800.0, 536870912)
    assert config.client_header_timeout_secs == 7.0
    assert config.client_keepalive_timeout_secs == 30.0
    assert config.client_body_timeout_secs == 9.0
    assert config.legs.idle_timeout_secs == 3.0
    assert config.worker_api_key == "worker-key"
    assert (config.log_level, config.log_format) == ("warn", "json")
    assert config.request_id_headers == ("x-trace-id", "x-correlation-id")


def test_retry_max_retries_counts_attempts_as_the_peers_do():
    assert config_from_argv([*WORKERS, "--retry-max-retries", "1"]).retry.max_attempts == 1
    assert config_from_argv([*WORKERS, "--retry-max-retries", "0"]).retry.max_attempts == 1
    argv = [*WORKERS, "--disable-retries", "--retry-max-retries", "5"]
    assert config_from_argv(argv).retry.max_attempts == 1


def test_options_map_onto_the_agreed_config_keys():
    overrides = overrides_from_argv(
        [*WORKERS, "--cache-threshold", "0.5", "--balance-abs-threshold", "32",
         "--balance-rel-threshold", "1.2", "--eviction-interval-secs", "60",
         "--max-tree-size", "1024", "--max-concurrent-requests", "8", "--queue-size", "4",
         "--queue-timeout-secs", "2", "--rate-limit-tokens-per-second", "100",
         "--cb-success-threshold", "3", "--cb-window-duration-secs", "120",
         "--disable-circuit-breaker", "--disable-health-check",
         "--retry-backoff-multiplier", "1.5", "--retry-jitter-factor", "0.2",
         "--worker-startup-timeout-secs", "1800", "--cors-allowed-origins", "http://a", "http://b",
         "--tls-cert-path", "c.pem", "--tls-key-path", "k.pem", "--ca-cert-paths", "ca.pem",
         "--client-cert-path", "cc.pem", "--client-key-path", "ck.pem"]
    )  # fmt: skip
    assert overrides["cache_aware"] == {
        "cache_threshold": 0.5, "balance_abs_threshold": 32, "balance_rel_threshold": 1.2,
        "eviction_interval_secs": 60.0, "max_tree_size": 1024,
    }  # fmt: skip
    assert overrides["admission"] == {
        "max_concurrent_requests": 8, "queue_size": 4, "queue_timeout_secs": 2.0,
        "rate_limit_tokens_per_second": 100.0,
    }  # fmt: skip
    circuit = {"success_threshold": 3, "window_secs": 120.0, "enabled": False}
    assert overrides["circuit"] == circuit
    assert overrides["health"] == {"enabled": False, "startup_wait_secs": 1800.0}
    assert overrides["retry"] == {"backoff_multiplier": 1.5, "jitter_factor": 0.2}
    assert overrides["cors_allowed_origins"] == ["http://a", "http://b"]
    assert overrides["tls"] == {
        "cert_path": "c.pem", "key_path": "k.pem", "ca_cert_path": ["ca.pem"],
        "client_cert_path": "cc.pem", "client_key_path": "ck.pem",
    }  # fmt: skip


def test_the_peers_shutdown_grace_sets_the_routers():
    config = config_from_argv([*WORKERS, "--shutdown-grace-period-secs", "5"])
    assert config.server.shutdown_grace_secs == 5.0


def test_wait_for_workers_sets_the_startup_wait():
    overrides = overrides_from_argv([*WORKERS, "--wait-for-workers", "30"])
    assert overrides["health"] == {"startup_wait_secs": 30.0}


def test_the_peers_minus_one_concurrency_limit_means_no_limit():
    overrides = overrides_from_argv([*WORKERS, "--max-concurrent-requests", "-1"])
    assert overrides["admission"] == {"max_concurrent_requests": 0}


def test_several_ca_files_are_all_passed_on():
    overrides = overrides_from_argv([*WORKERS, "--ca-cert-paths", "a.pem", "b.pem"])
    assert overrides["tls"] == {"ca_cert_path": ["a.pem", "b.pem"]}


def test_policy_names_are_checked_against_the_policy_registry(capsys):
    for name in policy_names():
        assert build_parser().parse_args(["--policy", name]).opt_policy == name
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["--decode-policy", "fastest"])
    assert caught.value.code == 2
    assert "fastest" in capsys.readouterr().err


def warnings_for(argv: list[str]) -> list[str]:
    args = build_parser().parse_args(argv)
    return startup_warnings(args, config_from_args(args))


def test_an_inapplicable_option_gives_exactly_one_warning_naming_it():
    lines = warnings_for([*WORKERS, "--model-path", "m", "--model", "n", "--policy", "random"])
    assert len(lines) == 1
    assert lines[0].startswith("--model-path/--model is accepted for compatibility")
    assert "tokeniz" in lines[0]


def test_each_inapplicable_option_is_named_in_its_own_warning():
    argv = [*WORKERS, "--prometheus-port", "29000", "--log-dir", "/tmp", "--dp-aware",
            "--encode-selector", "app=sglang", "tier=gpu",
            "--no-remove-unhealthy-workers"]  # fmt: skip
    lines = warnings_for(argv)
    named = ["--prometheus-port", "--log-dir", "--dp-aware", "--encode-selector",
             "--remove-unhealthy"]  # fmt: skip
    assert len(lines) == len(named)
    for name in named:
        assert sum(line.startswith(name) for line in lines) == 1, name


def test_the_mesh_flags_point_to_replicas_on_etcd():
    (line,) = warnings_for([*WORKERS, "--enable-mesh", "--mesh-port", "39527"])[:1]
    assert "--etcd" in line and "--cluster" in line
    assert "share no state" not in line


def test_options_that_ask_for_what_pd_router_does_give_no_warning():
    argv = [*WORKERS, "--pd-disaggregation", "--mini-lb", "--disable-tokenizer-autoload"]
    assert warnings_for(argv) == []


def alias_with_warning() -> str:
    """A policy alias whose warning is defined (skip when this branch has none)."""
    explain = getattr(policies, "alias_warning", None)
    if explain is None:
        pytest.skip("pd_router.dataplane.routing.policies.alias_warning is not in this branch")
    alias = next((name for name in policy_names() if explain(name)), None)
    if alias is None:
        pytest.skip("no policy alias with a warning in this branch")
    return alias


def test_a_policy_alias_is_explained_once():
    alias = alias_with_warning()
    lines = warnings_for([*WORKERS, "--policy", alias, "--prefill-policy", alias])
    assert len(lines) == 1
    assert lines[0].startswith(f"prefill_policy and decode_policy {alias}: ")


def test_a_policy_alias_from_the_config_file_is_explained_too(tmp_path):
    alias = alias_with_warning()
    path = tmp_path / "router.toml"
    path.write_text(f'decode_policy = "{alias}"\n')
    lines = warnings_for([*WORKERS, "--config", str(path), "--prefill-policy", "random"])
    assert lines == [f"decode_policy {alias}: {policies.alias_warning(alias)}"]


def wait_ready(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/readiness", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "router did not become ready"
        time.sleep(0.05)


def test_smg_launch_command_line_starts_and_warns_once_per_inapplicable_option(cluster, free_port):
    port = free_port()
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    process = subprocess.Popen(
        [sys.executable, "-m", "pd_router.cli.main", "launch", "--pd-disaggregation",
         "--prefill", prefill, str(cluster.bootstrap_port(prefill)), "--decode", decode,
         "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
         "--host", "127.0.0.1", "--port", str(port), "--model-path", "Qwen/Qwen3-8B",
         "--prometheus-port", "29000", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url)
        response = httpx.post(url + "/generate", json=generate_body("smg line", 3), timeout=10)
        assert_paired(response.json(), "smg line", 3)
    finally:
        process.terminate()
        stderr = process.communicate(timeout=10)[1].decode()
    assert stderr.count("--model-path") == 1
    assert stderr.count("--prometheus-port") == 1


def peer_policy_names() -> set[str]:
    """Every name the peers' policy flags accept."""
    names: set[str] = set()
    for _, options in PEERS.values():
        for action in json.loads((DATA / options).read_text()):
            if action["options"][0] in ("--policy", "--prefill-policy", "--decode-policy"):
                names.update(action["choices"])
    return names


def test_every_policy_name_of_the_peers_is_accepted():
    if getattr(policies, "alias_warning", None) is None:
        pytest.skip(
            "the peers' policy names arrive with pd_router.dataplane.routing.policies.alias_warning"
        )
    assert peer_policy_names() - set(policy_names()) == set()
    for name in sorted(peer_policy_names()):
        assert config_from_argv([*WORKERS, "--policy", name]).prefill_policy == name
