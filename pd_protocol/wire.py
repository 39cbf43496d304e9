"""The wire contract of the native role switch and the extension endpoints.

Native SGLang serves ``POST /pd_role_switch``; the extension (``server_patch`` on SGLang, and
``pd_worker``) adds ``GET /pd_role``, ``POST /pd_drain``, ``POST /convert_pd_role`` and
``POST /pd_forget_prefill``. The paths, the role names, the body fields each route takes and the
knobs an in-process switch cannot honour are defined here once: the servers validate bodies
against them and the router builds bodies from them. Described in docs/server_patch.md (server
side) and docs/conversion.md (router side).
"""

from __future__ import annotations

ROLES = ("prefill", "decode")

SWITCH_PATH = "/pd_role_switch"
ROLE_PATH = "/pd_role"
DRAIN_PATH = "/pd_drain"
CONVERT_PATH = "/convert_pd_role"
# On a decode: drop what it cached about one prefill (its rank endpoints), so the next request
# from that prefill asks its bootstrap server again. A router calls it on every decode when a
# worker becomes a prefill again (SGLang keeps the endpoints of the prefill's previous run).
FORGET_PREFILL_PATH = "/pd_forget_prefill"
FORGET_PREFILL_FIELDS = frozenset({"bootstrap_host", "bootstrap_port"})

# A router names the role it routes a generation leg to in this header; a server with the
# extension whose live role is the other one answers MISDIRECTED_STATUS at once (the body names its
# live role) instead of waiting for a KV transfer that cannot happen. Native SGLang ignores it.
ROLE_HEADER = "X-PD-Role"
MISDIRECTED_STATUS = 421

# Seconds a client is told to wait (``Retry-After``) when a draining server refuses a new
# generation request.
RETRY_AFTER_SECS = 1

# How long ``/convert_pd_role`` waits for the server to become idle when the body does not say.
DEFAULT_DRAIN_TIMEOUT_SECS = 300.0

# The body of the native ``/pd_role_switch``.
SWITCH_FIELDS = frozenset({"new_role", "decode_cuda_graph_bs", "decode_cuda_graph_memory_gb"})

# The body of ``/convert_pd_role``: the switch's fields, the drain timeout, and the SGLang
# PR #9325 spellings of the role and the bootstrap port.
CONVERT_FIELDS = SWITCH_FIELDS | {
    "drain_timeout_secs",
    "disaggregation_mode",
    "bootstrap_port",
    "disaggregation_bootstrap_port",
}

# Fields of the PR #9325 body (and of the router's admin API) that address the server or the
# router, or ask for what a conversion does anyway (``check_idle`` true, ``drain``): a server
# accepts and ignores them (``check_idle`` false is refused).
ROUTING_FIELDS = frozenset({"server_url", "worker_url", "check_idle", "drain"})

# Knobs of the PR #9325 proposal that need a server restart: the in-process switch keeps the
# weights, the KV pool and the launch arguments, so a server refuses any of them (400 naming the
# field) unless it is null or false. The router passes them on to servers with the extension.
UNSUPPORTED_KNOBS = frozenset(
    {
        "disable_cuda_graph",
        "disable_radix_cache",
        "enable_hierarchical_cache",
        "chunked_prefill_size",
        "max_running_requests",
        "mem_fraction_static",
        "cuda_graph_max_bs",
        "cuda_graph_bs",
        "tp_size",
        "dp_size",
        "pp_size",
        "page_size",
        "disaggregation_transfer_backend",
        "disaggregation_ib_device",
        "disaggregation_decode_tp",
        "disaggregation_decode_dp",
        "disaggregation_prefill_pp",
        "num_reserved_decode_tokens",
        "enable_dp_attention",
        "failed_bootstrap_addr",
    }
)
