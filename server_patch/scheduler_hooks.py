"""What server_patch changes inside SGLang's scheduler processes (SGLang 0.5.23).

SGLang spawns each scheduler as a fresh interpreter, so nothing the launcher patches in the HTTP
process reaches it. The launcher hands SGLang `run_scheduler_process` below as the scheduler's
process function; it installs these changes in the new process and then runs SGLang's own
`run_scheduler_process` unchanged. Both changes are described in docs/sglang-bugs.md.

- **The prefix cache follows the role** (bug a). A decode launched as such runs its tree cache
  disabled (`disable=True`, SGLang's PD hook turns the radix cache off on decodes unless
  `--disaggregation-decode-enable-radix-cache`), and the decode paths are written for that: in
  `SchedulerDisaggregationDecodeMixin._get_new_prebuilt_batch` (decode.py) a request whose KV row
  was preallocated whole is matched against `self.tree_cache` again, and when it finishes
  `release_kv_cache` frees only the row past the matched prefix. A server launched as prefill
  keeps its enabled radix cache across the switch (`_release_prefix_cache_for_role_switch`
  empties it but leaves it enabled), so a decode request whose prompt shares a prefix with an
  earlier finished one leaks that many KV slots, and the idle memory check kills the server. After
  every switch the tree cache is enabled exactly when the new role would have it at launch.
- **`pd_router_forget_prefill`** (bug b): a scheduler method the HTTP process calls through
  SGLang's scheduler RPC (`RpcReqInput`, server_patch/scheduler_rpc.py) to make a decode drop
  what it cached about one prefill (rank endpoints, registration, sockets) and fail the requests
  still waiting on it, as SGLang does itself when that prefill's bootstrap server stops
  answering `/health`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("server_patch")

FORGET_PREFILL_METHOD = "pd_router_forget_prefill"


def run_scheduler_process(*args: Any, **kwargs: Any) -> None:
    """SGLang's `run_scheduler_process`, with this module's changes installed first."""
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    install()
    sglang_run(*args, **kwargs)


def install() -> None:
    """Wrap the role switch and add the forget method, in this (scheduler) process. On an
    SGLang without the names they build on (checked against 0.5.23) nothing is changed."""
    from sglang.srt.managers.scheduler import Scheduler

    try:
        from sglang.srt.disaggregation import role_switch
        from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: F401
        from sglang.srt.runtime_context import get_disagg  # noqa: F401
        from sglang.srt.utils.network import NetworkAddress  # noqa: F401

        original = role_switch.handle_pd_role_switch
    except (ImportError, AttributeError) as missing:
        logger.warning("scheduler changes not installed, this SGLang lacks %s", missing)
        return
    if getattr(original, "_pd_router_wrapped", False):
        return

    def handle_pd_role_switch(scheduler: Any, recv_req: Any) -> Any:
        reply = original(scheduler, recv_req)
        if reply.success and reply.old_role != reply.new_role:
            fit_prefix_cache_to_role(scheduler)
        return reply

    handle_pd_role_switch._pd_router_wrapped = True
    role_switch.handle_pd_role_switch = handle_pd_role_switch
    setattr(Scheduler, FORGET_PREFILL_METHOD, forget_prefill)


def fit_prefix_cache_to_role(scheduler: Any) -> None:
    """Disable the tree cache in decode mode unless the server runs SGLang's decode radix
    cache; enable it again in prefill mode. A cache disabled at launch is left alone.

    The switch has just emptied the tree (the server was idle, `_release_prefix_cache_for_role_
    switch` reset it), so no request holds a node while the flag changes.
    """
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg

    tree_cache = scheduler.tree_cache
    if scheduler.disable_radix_cache or tree_cache is None or not hasattr(tree_cache, "disable"):
        return
    decode = scheduler.disaggregation_mode == DisaggregationMode.DECODE
    disable = decode and not get_disagg().disaggregation_decode_enable_radix_cache
    if tree_cache.disable != disable:
        tree_cache.disable = disable
        logger.info(
            "prefix cache %s for the %s role",
            "disabled" if disable else "enabled",
            scheduler.disaggregation_mode.value,
        )


def forget_prefill(scheduler: Any, bootstrap_host: str, bootstrap_port: int) -> None:
    """Drop a decode's cached endpoints of the prefill whose bootstrap server listens at
    `bootstrap_host`:`bootstrap_port`, so its next request asks that bootstrap server again.

    Runs on the scheduler thread (between batches). SGLang's `_handle_node_failure` is what its
    heartbeat runs when a prefill's bootstrap server stops answering: it removes the
    `connection_pool` entries and `prefill_info_table` row of that address, closes the sockets
    to their rank endpoints, and fails the rooms still bound to it (they would wait forever). On
    a prefill, or a decode that never talked to that prefill, it does nothing.
    """
    from sglang.srt.utils.network import NetworkAddress

    bootstrap_addr = NetworkAddress(bootstrap_host, int(bootstrap_port)).to_host_port_str()
    queue = getattr(scheduler, "disagg_decode_prealloc_queue", None)
    manager = getattr(queue, "kv_manager", None)
    if manager is None or bootstrap_addr not in manager.prefill_info_table:
        return
    manager._handle_node_failure(bootstrap_addr)
    logger.info("forgot prefill %s: its endpoints are fetched again", bootstrap_addr)
