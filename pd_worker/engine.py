"""The worker's engine: KV pool, bootstrap listener, request bookkeeping and in-process role switch.

Mirrors the split of SGLang's scheduler under ``--enable-pd-role-switch``: the :class:`Engine`
(weights, KV pool, bootstrap port) lives as long as the process, while the role object
(:class:`~pd_worker.roles.PrefillRole` / :class:`~pd_worker.roles.DecodeRole`) is torn down and
rebuilt by :meth:`Engine.switch_role`, whose checks and messages follow SGLang 0.5.23's
``disaggregation/role_switch.py``.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pd_protocol.wire import ROLES
from pd_worker.bootstrap import BootstrapServer, Room, RoomRegistry
from pd_worker.config import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_DECODE_CUDA_GRAPH_BS,
    REGULAR_MODE,
    WorkerConfig,
)
from pd_worker.data_plane import DataPlane, PlaneUnavailable, Role, TimingPlane
from pd_worker.errors import BadRequest, WorkerError
from pd_worker.faults import Faults
from pd_worker.kvpool import KVPool
from pd_worker.prefix_cache import PrefixCache
from pd_worker.requests import GenItem, Progress, Req
from pd_worker.stats import EngineStats

PREFILL_STAGES = ("waiting", "running", "inflight")
DECODE_STAGES = ("prealloc", "transfer", "waiting", "running")
# The queues each mode reports; a regular server's requests wait, then run.
STAGES = {"prefill": PREFILL_STAGES, "decode": DECODE_STAGES, REGULAR_MODE: ("waiting", "running")}
# SGLang's scheduler refusal of a switch on a regular server.
NOT_DISAGGREGATED = "instance is not running in PD disaggregation mode"
KV_PUBLISH_EXIT_CODE = 3

log = logging.getLogger("pd_worker")
# The keys SGLang's /pd_role_switch reply carries first (its request base type's rid and
# http_worker_ipc, both null on a switch).
SWITCH_REPLY_ROUTING: dict[str, None] = {"rid": None, "http_worker_ipc": None}


class SwitchTeardownFailed(Exception):
    """The teardown/rebuild step of a role switch failed (the ``fail_next_switch`` fault)."""


@dataclass(frozen=True)
class DecodeGraphs:
    """Decode CUDA graphs captured on this instance; kept across later switches, as in SGLang."""

    batch_sizes: tuple[int, ...]
    memory_gb: float


_DONE = object()
# The phases SGLang reports graph memory and capture time for.
GRAPH_PHASES = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)


class Engine:
    """Everything that survives role switches, plus the current role object."""

    def __init__(self, config: WorkerConfig, faults: Faults) -> None:
        self.config = config
        self.timing = config.timing
        self.faults = faults
        self.stats = EngineStats()
        self.kv_pool = KVPool(self.timing.max_total_num_tokens, self._changed)
        self.prefix_cache = PrefixCache(self.timing.max_total_num_tokens)
        self.rooms = RoomRegistry()
        self.plane: DataPlane = _make_plane(self)
        self.running_slots = asyncio.Semaphore(self.timing.max_running_requests)
        self.bootstrap = BootstrapServer(
            config.host,
            self.rooms,
            config.url,
            room_wait_secs=self.timing.bootstrap_timeout_secs,
            before_send=self.plane.before_send,
            is_hung=lambda: self.faults.hang_bootstrap,
            after_send=self._after_kv_publish,
        )
        self.role_name = config.role
        self.role: Role = self.plane.make_role(self, config.role)
        self.graphs: DecodeGraphs | None = None
        if config.role == "decode":
            self.graphs = DecodeGraphs(
                DEFAULT_DECODE_CUDA_GRAPH_BS, config.decode_cuda_graph_memory_gb
            )
        self.serving = False
        # SGLang's startup durations (``internal_states[].startup_time``); they differ from one
        # process to the next, so a router tells a restart by them. No weights are loaded here:
        # the CPU time the process took until it served stands in for ``load_weight``.
        self.startup_time: dict[str, Any] = {}
        self.unhealthy_after_switch = False
        self.switch_in_progress = False
        self._role_ready = asyncio.Event()
        self._role_ready.set()
        self._requests: dict[str, Req] = {}
        self._stages: collections.Counter[str] = collections.Counter()
        self._listeners: list[Callable[[], None]] = []

    async def start(self) -> None:
        """Bind the bootstrap port (a regular server has none) and start the role; the worker
        serves from then on."""
        began = time.perf_counter()
        if not self.config.regular:
            await self._bind_bootstrap()
        self.role.start()
        self.startup_time = {
            "load_weight": time.process_time(),
            "kv_cache_allocation": 0.0,
            "scheduler_e2e": time.perf_counter() - began,
            "cuda_graph": dict.fromkeys(GRAPH_PHASES, 0.0),
        }
        self.serving = True

    async def _bind_bootstrap(self) -> None:
        """Bind the bootstrap port given at launch; without one, a prefill takes SGLang's
        default (8998) unless another process holds it and a decode takes a free port (it
        serves no KV before it becomes a prefill), so workers started on one host do not
        collide. The port taken is reported in /server_info and /pd_role, where routers read
        it."""
        if self.config.bootstrap_port is not None:
            await self.bootstrap.start(self.config.bootstrap_port)
            return
        if self.role_name == "prefill":
            try:
                await self.bootstrap.start(DEFAULT_BOOTSTRAP_PORT)
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
            await self.bootstrap.start(0)
            log.warning(
                "bootstrap port %d is in use; this prefill serves KV on port %d instead",
                DEFAULT_BOOTSTRAP_PORT, self.bootstrap.port,
            )  # fmt: skip
            return
        await self.bootstrap.start(0)

    @property
    def bootstrap_port(self) -> int | None:
        """The port the bootstrap server listens on (None: a regular server runs none)."""
        return None if self.config.regular else self.bootstrap.port

    async def stop(self) -> None:
        self.serving = False
        for req in list(self._requests.values()):
            if req.task is not None:
                req.task.cancel()
        await self.role.teardown()
        await self.plane.close()
        await self.bootstrap.stop()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on every load change (the extension's event-driven idle wait)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        for callback in self._listeners:
            callback()

    # ----------------------------------------------------------------- requests

    def set_stage(self, req: Req, stage: str | None) -> None:
        """Move a request between queues (None: it left the engine)."""
        if req.stage is not None:
            self._stages[req.stage] -= 1
        req.stage = stage
        if stage is not None:
            self._stages[stage] += 1
        self._changed()

    def check_fits(self, tokens: int) -> None:
        if tokens > self.kv_pool.capacity:
            raise BadRequest(
                f"The input ({tokens} tokens) is longer than the KV capacity "
                f"({self.kv_pool.capacity} tokens)."
            )

    @property
    def num_running(self) -> int:
        return self._stages["running"]

    async def generate(self, item: GenItem) -> AsyncIterator[Progress]:
        """Run one item under the current role, yielding cumulative progress until finished."""
        await self._role_ready.wait()
        if item.rid in self._requests:
            raise BadRequest(f"Duplicate request ID {item.rid!r}")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        req = Req(item.rid)
        self._requests[item.rid] = req
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(item.prompt_ids)
        req.task = asyncio.create_task(self._produce(item, req, queue.put_nowait))
        try:
            while (entry := await queue.get()) is not _DONE:
                if isinstance(entry, WorkerError):
                    raise entry
                yield entry
        finally:
            if not req.task.done():
                req.task.cancel()
            self._requests.pop(item.rid, None)

    async def _produce(self, item: GenItem, req: Req, emit: Callable[[Any], None]) -> None:
        last = Progress()

        def forward(progress: Progress) -> None:
            nonlocal last
            last = progress
            emit(progress)

        try:
            await self.role.run(item, req, forward)
        except WorkerError as exc:
            emit(exc)
        except asyncio.CancelledError:
            self.stats.num_aborted_requests += 1
            abort = {
                "type": "abort",
                "message": req.abort_message,
                "status_code": None,
                "err_type": None,
            }
            emit(Progress(last.output_ids, last.text, abort, last.kv_source, last.cached_tokens))
        finally:
            self.set_stage(req, None)
            emit(_DONE)

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """Abort matching in-flight requests (SGLang ``/abort_request``); returns how many."""
        targets = list(self._requests.values()) if abort_all else []
        if not abort_all and rid in self._requests:
            targets = [self._requests[rid]]
        for req in targets:
            if req.task is not None:
                req.task.cancel()
        return len(targets)

    def _after_kv_publish(self, room: Room) -> None:
        """Fault ``exit_after_kv_publish``: die before any decode can read the published KV."""
        if self.faults.exit_after_kv_publish:
            os._exit(KV_PUBLISH_EXIT_CODE)

    # -------------------------------------------------------------------- loads

    def is_fully_idle(self) -> bool:
        """SGLang's is_fully_idle: nothing running, waiting, bootstrapping or transferring."""
        return (
            not self._requests and sum(self._stages.values()) == 0 and not self.kv_pool.num_waiting
        )

    def queue_sizes(self) -> dict[str, int]:
        return {stage: self._stages[stage] for stage in STAGES[self.role_name]}

    def num_waiting(self) -> int:
        return sum(
            n for stage, n in self.queue_sizes().items() if stage not in ("running", "inflight")
        )

    def loads(self) -> dict[str, Any]:
        """One DP rank's load snapshot, shaped like SGLang's LoadSnapshot (``/v1/loads``)."""
        queues = self.queue_sizes()
        prefill = self.role_name == "prefill"
        capacity = self.kv_pool.capacity
        return {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": self.num_running,
            "num_waiting_reqs": self.num_waiting(),
            "num_waiting_uncached_tokens": self.role.queued_tokens,
            "num_used_tokens": self.kv_pool.used,
            "num_total_tokens": self.kv_pool.used,
            "max_total_num_tokens": capacity,
            "max_running_requests": self.timing.max_running_requests,
            "token_usage": round(self.kv_pool.usage(), 4),
            "gen_throughput": round(self.stats.gen_throughput(), 2),
            "cache_hit_rate": round(self.stats.cache_hit_rate(), 4),
            "utilization": round(self.num_running / self.timing.max_running_requests, 4),
            "total_prefill_uncached_tokens": self.stats.prefill_uncached_tokens,
            "total_prefill_busy_us": self.stats.prefill_busy_us,
            "decode_moments": self.stats.decode_moments_or_none(),
            "memory": {
                "weight_gb": 15.0,
                "kv_cache_gb": round(capacity * self.timing.kv_bytes_per_token / 1e9, 3),
                "graph_gb": self.graphs.memory_gb if self.graphs else 0.0,
                "token_capacity": capacity,
            },
            "disaggregation": {
                "mode": self.role_name,
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": queues.get("inflight", 0) if prefill else 0,
                "decode_prealloc_queue_reqs": queues.get("prealloc", 0),
                "decode_transfer_queue_reqs": queues.get("transfer", 0),
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": round(self.stats.kv_transfer_speed_gb_s(), 3),
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {
                "waiting": queues.get("waiting", 0),
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            },
        }

    def internal_state(self) -> dict[str, Any]:
        """``internal_states[0]`` of /server_info: live role, decode graphs, object identities."""
        return {
            "world_size": 1,
            "disaggregation_mode": self.role_name,
            "startup_time": self.startup_time,
            "decode_cuda_graph_bs": list(self.graphs.batch_sizes) if self.graphs else None,
            "decode_cuda_graph_memory_gb": round(self.graphs.memory_gb, 3) if self.graphs else 0.0,
            "effective_max_running_requests_per_dp": self.timing.max_running_requests,
            "last_gen_throughput": round(self.stats.gen_throughput(), 2),
            "memory_usage": self.memory_usage(),
            "pd_role_switch_in_progress": self.switch_in_progress,
            "pd_role_switch_unhealthy": self.unhealthy_after_switch,
            "pd_worker": {
                "engine_id": id(self),
                "kv_pool_id": id(self.kv_pool),
                "role_object_id": id(self.role),
                "bootstrap_server_id": id(self.bootstrap),
            },
        }

    def memory_usage(self) -> dict[str, Any]:
        """SGLang's ``memory_usage`` (GB, per graph phase too): no weights or KV tensors are
        allocated here, so only the token capacity, the free memory the worker was launched with
        and the decode graphs' modeled footprint are non-zero."""
        graph = dict.fromkeys(GRAPH_PHASES, 0.0)
        if self.graphs is not None:
            graph["decode"] = round(self.graphs.memory_gb, 3)
        return {
            "weight": 0.0,
            "kvcache": 0.0,
            "startup_available": round(self.config.gpu_free_memory_gb, 3),
            "token_capacity": self.kv_pool.capacity,
            "token_capacity_swa": None,
            "graph": graph,
        }

    # ------------------------------------------------------------- role switch

    async def switch_role(self, request: dict[str, Any]) -> dict[str, Any]:
        """SGLang's handle_pd_role_switch: same preconditions, order, messages and flags."""
        old_role = self.role_name
        new_role = str(request.get("new_role") or "").lower()

        def reply(success: bool, message: str, safe_to_restore: bool = False) -> dict[str, Any]:
            return {
                **SWITCH_REPLY_ROUTING,
                "success": success,
                "message": message,
                "old_role": old_role,
                "new_role": new_role,
                "safe_to_restore": safe_to_restore,
            }

        rejection = self._reject_reason(new_role)
        if rejection is not None:
            return reply(False, *rejection)
        if new_role == old_role:
            return reply(True, "already in target role")
        if not self.is_fully_idle() or self.faults.take_busy_switch():
            return reply(False, "instance is not idle; drain all requests before switching", True)
        graph_problem = self._graph_problem(new_role, request.get("decode_cuda_graph_memory_gb"))
        if graph_problem is not None:
            return reply(False, graph_problem, True)
        if request.get("prepare_only"):
            return reply(True, "ready", True)
        if self.faults.take_switch_lie():
            return reply(True, "ok")
        try:
            await self._rebuild(new_role, request)
        except SwitchTeardownFailed as exc:
            self.unhealthy_after_switch = True
            return reply(False, f"role switch failed; instance unhealthy, restart required: {exc}")
        return reply(True, "ok")

    def _reject_reason(self, new_role: str) -> tuple[str, bool] | None:
        checks = (
            (not self.config.enable_pd_role_switch, True,
             "--enable-pd-role-switch is not set on this instance"),
            (self.unhealthy_after_switch, False,
             "instance is unhealthy after a failed role switch; restart required"),
            (self.switch_in_progress, False, "another role switch is already in progress"),
            (new_role not in ROLES, True, f"invalid new_role={new_role!r}"),
        )  # fmt: skip
        return next(((msg, safe) for failed, safe, msg in checks if failed), None)

    def _graph_problem(self, new_role: str, required_gb: Any) -> str | None:
        if new_role != "decode" or (self.graphs is not None and not self.faults.no_decode_graphs):
            return None
        if required_gb is None:
            return "decode_cuda_graph_memory_gb is required before capturing decode graphs"
        if required_gb < 0:
            return "decode_cuda_graph_memory_gb must be non-negative"
        available = self.config.gpu_free_memory_gb
        if available < required_gb:
            return (
                "insufficient decode CUDA graph headroom: "
                f"required={required_gb:.3f} GB, available={available:.3f} GB"
            )
        return None

    async def _rebuild(self, new_role: str, request: dict[str, Any]) -> None:
        """Tear the old role down and build the new one; admission waits meanwhile."""
        self.switch_in_progress = True
        self._role_ready.clear()
        try:
            await self.role.teardown()
            if self.faults.take_switch_failure():
                raise SwitchTeardownFailed("injected fault: teardown of the old role failed")
            await self.plane.after_teardown()
            self.role_name = new_role
            self.prefix_cache.clear()
            self.role = self.plane.make_role(self, new_role)
            try:
                self.role.start()
            except PlaneUnavailable as exc:
                raise SwitchTeardownFailed(f"the new role cannot start: {exc}") from exc
            if new_role == "decode" and self.graphs is None:
                batch_sizes = request.get("decode_cuda_graph_bs") or DEFAULT_DECODE_CUDA_GRAPH_BS
                self.graphs = DecodeGraphs(
                    tuple(batch_sizes), float(request["decode_cuda_graph_memory_gb"])
                )
        finally:
            self.switch_in_progress = False
            self._role_ready.set()
            self._changed()


def _make_plane(engine: Engine) -> DataPlane:
    """The data plane of ``--engine`` (torch is imported only when asked for)."""
    if engine.config.engine == "torch":
        try:
            from pd_worker.torch_plane import TorchPlane
        except ImportError as exc:
            raise PlaneUnavailable(
                f"--engine torch needs the torch extra (pip install -e '.[torch]'): {exc}"
            ) from exc
        return TorchPlane(engine.config, engine.kv_pool.capacity)
    return TimingPlane(engine.timing)
