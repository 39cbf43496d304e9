"""What `python -m server_patch.launch_server` checks before it starts SGLang (no SGLang needed)."""

from __future__ import annotations

import pytest

from server_patch.preflight import (
    LaunchError,
    ServingPlan,
    check_plan,
    check_version,
    parse_version,
    with_role_switch,
)


def _plan(**changes) -> ServingPlan:
    fields = {
        "disaggregation_mode": "prefill",
        "enable_pd_role_switch": True,
        "tokenizer_worker_num": 1,
        "transfer_backend": "mooncake",
        "python_http_server": True,
    }
    fields.update(changes)
    return ServingPlan(**fields)


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("0.5.23", (0, 5, 23)), ("0.5.21rc1", (0, 5, 21)), ("0.5.23.post1", (0, 5, 23))],
)
def test_versions_are_read_by_their_numeric_release(version, parsed):
    assert parse_version(version) == parsed


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23", "0.6.0", "1.0.0"])
def test_sglang_with_the_in_process_switch_is_accepted(version):
    check_version(version)


def test_older_sglang_is_refused_naming_the_found_version():
    with pytest.raises(LaunchError, match=r"SGLang 0\.5\.20 is installed.*>=0\.5\.21"):
        check_version("0.5.20")


def test_missing_sglang_is_refused():
    with pytest.raises(LaunchError, match="not installed"):
        check_version(None)


def test_unreadable_version_is_refused():
    with pytest.raises(LaunchError, match="cannot read"):
        check_version("nightly")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_servers_are_accepted(mode):
    assert check_plan(_plan(disaggregation_mode=mode)) == []


def test_a_server_without_pd_mode_is_refused():
    with pytest.raises(LaunchError, match="--disaggregation-mode"):
        check_plan(_plan(disaggregation_mode="null"))


def test_several_tokenizer_workers_are_refused():
    with pytest.raises(LaunchError, match="--tokenizer-worker-num 1"):
        check_plan(_plan(tokenizer_worker_num=4))


def test_servers_without_the_python_http_server_are_refused():
    with pytest.raises(LaunchError, match="Python HTTP server"):
        check_plan(_plan(python_http_server=False))


@pytest.mark.parametrize("backend", ["mooncake", "mori"])
def test_transfer_backends_with_role_switch_give_no_warning(backend):
    assert check_plan(_plan(transfer_backend=backend)) == []


def test_other_transfer_backends_are_launched_with_a_warning():
    warnings = check_plan(_plan(transfer_backend="nixl"))
    assert len(warnings) == 1
    assert "nixl" in warnings[0]


def test_role_switch_flag_is_added_when_missing():
    argv = ["--model-path", "m", "--disaggregation-mode", "decode"]
    assert with_role_switch(argv, enabled=False) == [*argv, "--enable-pd-role-switch"]
    assert argv == ["--model-path", "m", "--disaggregation-mode", "decode"]


def test_role_switch_flag_is_not_repeated():
    argv = ["--disaggregation-mode", "decode", "--enable-pd-role-switch"]
    assert with_role_switch(argv, enabled=True) == argv
