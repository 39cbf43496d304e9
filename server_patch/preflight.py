"""Checks the launcher runs before it starts SGLang, kept free of SGLang imports so they are
testable anywhere. Each failure is a `LaunchError` whose message says what to change."""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_SGLANG_VERSION = (0, 5, 21)
ROLE_SWITCH_FLAG = "--enable-pd-role-switch"
TESTED_TRANSFER_BACKENDS = ("mooncake", "mori")


class LaunchError(Exception):
    """The server cannot be launched with the extension; the message says why."""


@dataclass(frozen=True)
class ServingPlan:
    """What the launcher needs to know of the parsed SGLang server arguments."""

    disaggregation_mode: str
    enable_pd_role_switch: bool
    tokenizer_worker_num: int
    transfer_backend: str
    python_http_server: bool  # False for gRPC, Ray, encoder-only or the Rust server


def parse_version(version: str) -> tuple[int, int, int]:
    """`0.5.23`, `0.5.21rc1`, `0.5.23.post1` -> (0, 5, 23)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise LaunchError(f"cannot read the SGLang version {version!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def check_version(found: str | None) -> None:
    """SGLang >= 0.5.21 has the in-process switch (`/pd_role_switch`) the extension drives."""
    wanted = ".".join(str(part) for part in MIN_SGLANG_VERSION)
    if found is None:
        raise LaunchError(f"SGLang is not installed; install sglang>={wanted}")
    if parse_version(found) < MIN_SGLANG_VERSION:
        raise LaunchError(
            f"SGLang {found} is installed; server_patch needs sglang>={wanted} "
            "(the first release with --enable-pd-role-switch)"
        )


def check_plan(plan: ServingPlan) -> list[str]:
    """Refuse launches the extension cannot serve; return warnings for untested setups."""
    if plan.disaggregation_mode not in ("prefill", "decode"):
        raise LaunchError(
            "server_patch serves PD disaggregation only: pass --disaggregation-mode prefill "
            f"or --disaggregation-mode decode (got {plan.disaggregation_mode!r})"
        )
    if not plan.python_http_server:
        raise LaunchError(
            "server_patch extends SGLang's Python HTTP server; gRPC, Ray, encoder-only and "
            "SGLANG_RUST_SERVER launches do not serve it"
        )
    if plan.tokenizer_worker_num > 1:
        raise LaunchError(
            "server_patch needs one tokenizer process (--tokenizer-worker-num 1): the drain "
            "gate lives in the HTTP process and would not be shared by several workers"
        )
    if plan.transfer_backend not in TESTED_TRANSFER_BACKENDS:
        return [
            f"transfer backend {plan.transfer_backend!r}: SGLang's role switch is implemented "
            f"for {' and '.join(TESTED_TRANSFER_BACKENDS)}; conversions may be refused"
        ]
    return []


def with_role_switch(argv: list[str], enabled: bool) -> list[str]:
    """The arguments with the in-process switch turned on."""
    return list(argv) if enabled else [*argv, ROLE_SWITCH_FLAG]
