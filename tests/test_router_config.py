"""Configuration and command line: TOML, CLI overrides, mini_lb command lines, validation
messages, and ``pd-router`` serving as a real process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pd_router.cli.main import config_from_argv
from pd_router.config import ConfigError, load_config
from tests.router_helpers import assert_paired, generate_body

EXAMPLE = Path(__file__).resolve().parent.parent / "configs" / "router.toml"


def test_example_config_loads():
    config = load_config(EXAMPLE)
    assert config.prefill[0].bootstrap_port == 8998
    assert config.prefill[1].bootstrap_port is None
    assert len(config.decode) == 2
    assert config.retry.max_attempts == 3
    assert config.autopilot.mode == "off"


def test_mini_lb_command_line_works_unchanged():
    config = config_from_argv(
        [
            "--pd-disaggregation", "--mini-lb",
            "--prefill", "http://127.0.0.1:30001", "8998",
            "--prefill", "http://127.0.0.1:30002", "none",
            "--prefill", "http://127.0.0.1:30003",
            "--decode", "http://127.0.0.1:30011",
            "--host", "127.0.0.1", "--port", "8000",
            "--policy", "random", "--request-timeout-secs", "60", "--log-level", "warn",
        ]
    )  # fmt: skip
    assert [p.bootstrap_port for p in config.prefill] == [8998, None, None]
    assert config.decode[0].url == "http://127.0.0.1:30011"
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.prefill_policy == config.decode_policy == "random"
    assert config.request_timeout_secs == 60.0


def test_disable_retries_means_one_attempt():
    argv = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert config_from_argv([*argv, "--disable-retries"]).retry.max_attempts == 1


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(
        'port = 9000\nprefill_policy = "random"\n[health]\ninterval_secs = 1.0\n'
        '[[prefill]]\nurl = "http://127.0.0.1:1"\n[[decode]]\nurl = "http://127.0.0.1:2"\n'
    )
    config = config_from_argv(
        ["--config", str(path), "--port", "9100", "--health-check-timeout-secs", "3",
         "--retry-max-retries", "4", "--cb-failure-threshold", "7"]
    )  # fmt: skip
    assert config.port == 9100
    assert config.prefill_policy == "random"
    assert config.health.interval_secs == 1.0
    assert config.health.timeout_secs == 3.0
    assert config.retry.max_attempts == 4
    assert config.circuit.failure_threshold == 7


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"port": "80"}, "port"),
        ({"port": 70000}, "port"),
        ({"prefill_policy": "fastest"}, "prefill_policy"),
        ({"health": {"interval_secs": 0}}, "health.interval_secs"),
        ({"health": {"intervall_secs": 1}}, "health.intervall_secs"),
        ({"retry": {"max_attempts": True}}, "retry.max_attempts"),
        ({"decode": [{"url": "http://a:1", "bootstrap_port": 1}]}, "decode[0].bootstrap_port"),
        ({"prefill": [{"url": "ftp://a"}]}, "prefill[0].url"),
        ({"worker_api_key": "k\r\nX-Injected: 1"}, "worker_api_key"),
        ({"worker_api_key": ""}, "worker_api_key"),
        ({"admin_api_key": "two words"}, "admin_api_key"),
        ({"prefill": [{"url": "http://a:1"}], "decode": [{"url": "http://a:1"}]}, "prefill/decode"),
        ({"log_level": "loud"}, "log_level"),
        ({"colour": "blue"}, "colour"),
        ({"autopilot": {"mode": "on"}}, "autopilot.mode"),
        ({"autopilot": {"ttft_slo_ms": 0}}, "autopilot.ttft_slo_ms"),
        ({"autopilot": {"decode_kv_usage": 85}}, "autopilot.decode_kv_usage"),
        ({"autopilot": {"margin": 1.2}}, "autopilot.margin"),
        ({"autopilot": {"interval_secs": 10, "window_secs": 5}}, "autopilot.window_secs"),
        ({"autopilot": {"hysteresis": 1.0}}, "autopilot.hysteresis"),
        ({"autopilot": {"cooldown": 60}}, "autopilot.cooldown"),
    ],
)
def test_invalid_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as caught:
        load_config(None, data)
    assert caught.value.key == key


def test_unreadable_or_invalid_toml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pd_router.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_bad_command_line_exits_2_with_a_message():
    result = run_cli("--prefill", "http://127.0.0.1:1", "eighty", "--decode", "http://127.0.0.1:2")
    assert result.returncode == 2
    assert "bootstrap port must be a number or 'none'" in result.stderr
    assert run_cli("--decode", "http://127.0.0.1:2").returncode == 2


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


def test_pd_router_serves_as_a_process(cluster, free_port):
    port = free_port()
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    process = subprocess.Popen(
        [sys.executable, "-m", "pd_router.cli.main", "--pd-disaggregation",
         "--prefill", prefill, str(cluster.bootstrap_port(prefill)), "--decode", decode,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/readiness", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "router did not become ready"
            time.sleep(0.05)
        response = httpx.post(url + "/generate", json=generate_body("as a process", 3), timeout=10)
        assert_paired(response.json(), "as a process", 3)
    finally:
        process.terminate()
        process.wait(10)
