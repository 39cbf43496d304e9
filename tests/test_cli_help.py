"""Help an operator can read: ``pd-router --help`` shows pd-router's own options with their
defaults, the peers' compatibility flags wait under ``--help-all``; a usage error is the usage
line and the error, with a suggestion for a near miss; both commands say their version."""

from __future__ import annotations

import itertools
from importlib.metadata import version

import pytest

from tests.cli_process import NOWHERE, PD_ROUTER, PD_WORKER, run

# Usage line and error line; nothing else.
SHORT_USAGE_ERROR_LINES = 2


def usage_error(*args: str) -> str:
    result = run(PD_ROUTER, *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= SHORT_USAGE_ERROR_LINES, result.stderr
    return lines[-1]


def test_help_shows_pd_routers_own_options_with_their_defaults():
    result = run(PD_ROUTER, "--help")
    assert result.returncode == 0
    text = result.stdout
    assert "--first-byte-timeout-secs" in text
    assert "--admin-api-key-file" in text and "--allow-unauthenticated" in text
    assert "default: 30000" in text
    assert "default: least_inflight" in text
    assert "--help-all" in text
    assert "--oracle-username" not in text and "--mesh-port" not in text


def test_help_all_lists_the_compatibility_flags_too():
    result = run(PD_ROUTER, "--help-all")
    assert result.returncode == 0
    assert "--first-byte-timeout-secs" in result.stdout
    assert "--oracle-username" in result.stdout and "--mesh-port" in result.stdout


def test_a_compatibility_flag_hidden_from_help_is_still_parsed():
    line = usage_error(*NOWHERE, "--mesh-port", "not-a-number")
    assert "--mesh-port" in line


def test_a_bad_flag_value_is_the_usage_line_and_the_error():
    line = usage_error("--port", "eighty")
    assert "--port" in line and "'eighty'" in line


def test_a_mistyped_subcommand_suggests_the_nearest():
    line = usage_error("covert", "w1")
    assert "'covert'" in line and "did you mean 'convert'" in line


def test_an_unknown_word_lists_the_subcommands():
    line = usage_error("frobnicate")
    assert "status" in line and "convert" in line and "autopilot" in line


def test_a_mistyped_flag_suggests_the_nearest():
    line = usage_error(*NOWHERE, "--prefill-polcy", "random")
    assert "--prefill-polcy" in line and "did you mean --prefill-policy" in line


def test_a_mistyped_subcommand_flag_suggests_the_nearest():
    line = usage_error("convert", "w1", "--drain-timout", "5")
    assert "did you mean --drain-timeout" in line


@pytest.mark.parametrize("binary", [PD_ROUTER, PD_WORKER], ids=["router", "worker"])
def test_version_comes_from_the_package_metadata(binary):
    result = run(binary, "--version")
    assert result.returncode == 0, result.stderr
    name = binary.rsplit("/", 1)[1]
    assert result.stdout.strip() == f"{name} {version('pd-router')}"


def undescribed(help_text: str) -> list[str]:
    """The options of an argparse help text shown without a description: a flag line with no
    text after it whose next line is not its description (indented under the column)."""
    lines = [*help_text.split("options:", 1)[1].splitlines(), ""]
    return [
        line.strip()
        for line, following in itertools.pairwise(lines)
        if line.startswith("  -") and "  " not in line.strip() and not following.startswith(" " * 8)
    ]


@pytest.mark.parametrize(
    "command", [(PD_WORKER, "cluster"), (PD_ROUTER, "demo")], ids=["worker-cluster", "demo"]
)
def test_every_option_of_the_cluster_and_demo_commands_says_what_it_does(command):
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert undescribed(result.stdout) == [], result.stdout
    assert "``" not in result.stdout
