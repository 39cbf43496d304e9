"""Health probes on an interval, with failure and success thresholds, and the live role read on
the same interval.

A worker turns unhealthy after ``failure_threshold`` failed probes in a row and healthy again
after ``success_threshold`` good ones, so one lost probe does not flap the pools; a connection
that cannot even be opened (refused: no process listens) is proof enough, and makes it unhealthy
at once, from a probe or from a leg that could not connect (:meth:`HealthMonitor.suspect`).
The first probe of a worker decides at once (at start-up an unreachable worker is registered
unhealthy and is picked up when it comes up). A prefill whose bootstrap port is unknown gets it
from its ``/server_info`` before it counts as healthy; the model a worker serves is read from
the same endpoint by its probes until one answers (one without it names no model).

Role drift. A worker's role can change without this router: a second router converts it, an
operator calls its ``/pd_role_switch``, or it crashes and SGLang brings it back in its launch role
faster than the failure threshold notices. Routed by its old role, half of its pairs fail after
a KV transfer timeout. So every probe of an ACTIVE worker whose health endpoint answered also
reads its live state (``GET /pd_role`` on extension workers: role, bootstrap port, epoch, start
time, draining; ``/server_info`` otherwise: ``internal_states[0]``'s role and startup durations)
and the registry is brought in line before the worker gets more traffic:

- a worker in another role than its pool is moved to the other pool, with its bootstrap port;
- a restarted worker (another start signature, or an extension epoch that went back) is read
  afresh: whether it has the extension routes, and a circuit closed (failures of the dead
  process say nothing about the new one);
- a prefill whose reported bootstrap port changed is sent to the new one, unless the port in use
  was given in the configuration (it then differs from what the worker reports);
- a worker whose admission is closed (another router or an operator drains it) is taken out of
  selection at once (``Worker.admitting``): every request would get 503 and count against its
  circuit, and a conversion of this router must not count it in its pool's minimum. It stays
  healthy, so the requests it still runs for this router finish, and it comes back as soon as a
  reading says it admits again.

A reading that fails counts as a failed probe: a worker whose role is unknown cannot be placed.
Workers that a conversion of this router holds (not ACTIVE) are left to it, and a reading is
dropped when a conversion took or moved the worker while it was being read. The request path
calls :meth:`HealthMonitor.suspect` when a leg says its worker is in another role (an extension
worker's 421), so that worker is read and moved at once instead of at the next probe.

Probes off (``enabled = false``, the peers' ``--disable-health-check``): no worker is ever
probed; each counts as healthy from its registration on, so the router learns of a failing
worker only from its requests (the circuit breaker, the retries). A prefill without a configured
bootstrap port still has it read once from its ``/server_info`` (the default, 8998, when that
fails): pairing needs it. No other worker's model is read then: it is the one its configuration
names, or none (a router serving one model). Role drift goes unnoticed unless a leg's 421 asks
for a reading (:meth:`HealthMonitor.suspect`).

Circuit recovery: a worker the probes saw recover (unhealthy -> healthy, a drain ending, a
restart) gets its circuit closed: the failures it counted were the outage the probes saw. A
circuit that opened while the probes saw nothing wrong is left to its cool-down and trial.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass

import aiohttp
import orjson

from pd_protocol.json_values import is_int
from pd_router.config import HealthConfig
from pd_router.control.worker_control import ControlError, RoleReading, WorkerControl
from pd_router.control.workers import Role, Worker, WorkerRegistry, WorkerState
from pd_router.roles import DEFAULT_BOOTSTRAP_PORT

log = logging.getLogger("pd_router.control.health")

# Longest pause between the probes of the start-up wait.
STARTUP_POLL_SECS = 1.0


class WorkersUnreachable(Exception):
    """Configured workers did not pass a health probe within the start-up wait."""

    def __init__(self, urls: list[str], waited_secs: float) -> None:
        self.urls = urls
        super().__init__(
            f"{len(urls)} worker(s) did not pass a health probe within {waited_secs:g}s "
            f"(health.startup_wait_secs): {', '.join(urls)}"
        )


@dataclass
class ProbeRecord:
    """What the monitor remembers of one worker between probes."""

    successes: int = 0
    failures: int = 0
    probed: bool = False
    # Last reading: the process's start signature and extension epoch (restart detection).
    instance: str | None = None
    worker_epoch: int | None = None

    def count(self, ok: bool) -> bool:
        """Count one probe outcome; returns whether it was the worker's first probe."""
        if ok:
            self.successes += 1
            self.failures = 0
        else:
            self.failures += 1
            self.successes = 0
        first = not self.probed
        self.probed = True
        return first

    def restarted(self, reading: RoleReading) -> bool:
        """Whether ``reading`` comes from another process than the last one; remembers it."""
        new_instance = (
            self.instance is not None
            and reading.instance is not None
            and reading.instance != self.instance
        )
        epoch_back = (
            self.worker_epoch is not None
            and reading.epoch is not None
            and reading.epoch < self.worker_epoch
        )
        self.instance = reading.instance
        self.worker_epoch = reading.epoch
        return new_instance or epoch_back


@dataclass(frozen=True)
class ProbeResult:
    """What one probe of a worker found: whether it passed and why not (``refused``: the
    connection could not even be opened), and for an ACTIVE worker whose health endpoint
    answered, its live-role ``reading`` (``detected``: that reading found out afresh which
    protocol the worker speaks). ``epoch`` is the worker's epoch when the reading began: a
    conversion that moved the worker meanwhile makes the reading stale."""

    ok: bool
    epoch: int
    error: str | None = None
    refused: bool = False
    reading: RoleReading | None = None
    detected: bool = False


class HealthMonitor:
    """Probes every worker's health endpoint and live role, and feeds the registry."""

    def __init__(self, registry: WorkerRegistry, config: HealthConfig) -> None:
        self._registry = registry
        self._config = config
        self._records: dict[str, ProbeRecord] = {}
        self._suspicions: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    @property
    def _started_session(self) -> aiohttp.ClientSession:
        """The session probes go out on (RuntimeError before :meth:`start`)."""
        if self._session is None:
            raise RuntimeError("health monitor not started")
        return self._session

    def run_in_background(self) -> None:
        if self._config.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = list(self._suspicions.values())
        if self._task is not None:
            tasks.append(self._task)
            self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval_secs)
            await self.probe_all()

    async def probe_all(self) -> None:
        workers = [w for w in self._registry if w.state is not WorkerState.SWITCHING]
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))
        known = {w.id for w in self._registry}
        for worker_id in [k for k in self._records if k not in known]:
            del self._records[worker_id]

    def suspect(self, worker: Worker) -> asyncio.Task[None]:
        """Read ``worker``'s live role now and move it if it is in another role than its pool;
        with probes on, a worker that refuses the connection is unhealthy at once.

        For the request path, when a leg's answer says the worker is not in the role it was
        routed as (421 from an extension worker), or a leg could not connect to it (a worker
        that is gone must not look healthy until the failure threshold of the next probes).
        At most one read per worker is in flight:
        calls meanwhile get the same task. Awaiting it is optional (the failed request is
        retried on another pair anyway); it never raises.
        """
        task = self._suspicions.get(worker.id)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._recheck(worker))
            self._suspicions[worker.id] = task
            task.add_done_callback(functools.partial(self._forget_suspicion, worker.id))
        return task

    def _forget_suspicion(self, key: str, task: asyncio.Task[None]) -> None:
        if self._suspicions.get(key) is task:
            del self._suspicions[key]

    async def _recheck(self, worker: Worker) -> None:
        if (
            self._session is None
            or worker.state is not WorkerState.ACTIVE
            or not self._registry.registered(worker)
        ):
            return
        epoch = worker.epoch
        try:
            reading, detected = await self._read(worker)
        except ControlError as exc:
            if not exc.delivered and self._config.enabled and worker.healthy:
                error = f"connection refused: {exc}"
                self._log_unhealthy(worker, False, error)
                self._registry.set_health(worker, False, error)
                return
            log.info("suspected worker not read", extra={"worker": worker.url, "error": str(exc)})
            return
        if self._current(worker, epoch):
            record = self._records.setdefault(worker.id, ProbeRecord())
            self._reconcile(worker, record, reading, detected)

    def report_down(self, worker: Worker, error: str) -> None:
        """Something other than a probe found ``worker`` not answering (a conversion's control
        call). With probes on it is out of selection until they see it recover; with probes
        off nothing would ever bring it back, so only the error is kept and its requests
        decide, as for any failure the probes would have seen (the circuit breaker)."""
        if self._config.enabled:
            self._registry.set_health(worker, False, error)
        else:
            self._registry.note_error(worker, error)

    async def check(self, worker: Worker) -> bool:
        """Probe ``worker`` once (health, then live role when ACTIVE), apply the thresholds and
        bring the registry in line with the reading; returns the worker's health. With probes
        off the worker is taken as healthy without a call."""
        if not self._config.enabled:
            if worker.role is Role.PREFILL and worker.bootstrap_port is None:
                await self._learn_once(worker)
            if not worker.healthy:
                self._registry.mark_recovered(worker)
            return True
        ok, error, refused = await self._probe(worker)
        reading: RoleReading | None = None
        detected = False
        epoch = worker.epoch
        if ok and worker.state is WorkerState.ACTIVE:
            try:
                reading, detected = await self._read(worker)
            except ControlError as exc:
                ok, error = False, f"reading the live role failed: {exc}"
                refused = not exc.delivered
        return self.apply(worker, ProbeResult(ok, epoch, error, refused, reading, detected))

    def apply(self, worker: Worker, result: ProbeResult) -> bool:
        """What one probe's result does to ``worker``: count it against the thresholds, turn
        the worker unhealthy or healthy again, and bring the registry in line with a current
        reading (role drift, restart, bootstrap port, admission); returns the worker's health.
        No I/O: :meth:`check` gathers the result."""
        record = self._records.setdefault(worker.id, ProbeRecord())
        first = record.count(result.ok)
        if not result.ok:
            due = record.failures >= self._config.failure_threshold
            if first or (worker.healthy and (due or result.refused)):
                self._log_unhealthy(worker, first, result.error)
                self._registry.set_health(worker, False, result.error)
            elif result.error is not None:
                self._registry.note_error(worker, result.error)
            return worker.healthy
        if result.reading is not None and self._current(worker, result.epoch):
            self._reconcile(worker, record, result.reading, result.detected)
        if not worker.healthy and (first or record.successes >= self._config.success_threshold):
            if first:
                log.info("worker %s healthy", worker.url, extra=self._fields(worker))
            else:
                log.warning("worker %s healthy again", worker.url, extra=self._fields(worker))
            self._registry.mark_recovered(worker)
        elif worker.healthy and worker.last_error is not None:
            # A failed probe below the failure threshold: the worker answers again.
            self._registry.clear_error(worker)
        return worker.healthy

    def _log_unhealthy(self, worker: Worker, first: bool, error: str | None) -> None:
        """A warning naming the worker when its first probe fails (a worker that never
        answered, such as a mistyped URL, must not go unnoticed) or when it turns unhealthy."""
        fields = {**self._fields(worker), "error": error}
        if first:
            log.warning(
                "worker %s (%s) fails its health probe (%s); out of its pool until it passes",
                worker.url, worker.role.value, error, extra=fields,
            )  # fmt: skip
        else:
            log.warning("worker %s unhealthy", worker.url, extra=fields)

    @staticmethod
    def _fields(worker: Worker) -> dict[str, str]:
        return {"worker": worker.url, "role": worker.role.value}

    async def wait_for_workers(self, within: float) -> None:
        """Probe until every worker is healthy (the start-up wait); WorkersUnreachable naming
        the others after ``within`` seconds. Probes come every second at most (the health
        interval when shorter), so a worker that comes up late is served as soon as it
        passes its thresholds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        missing = [w.url for w in self._registry if not w.healthy]
        if missing:
            log.info(
                "waiting up to %gs for %s to pass a health probe before serving",
                within, ", ".join(missing),
            )  # fmt: skip
        while True:
            missing = [w.url for w in self._registry if not w.healthy]
            remaining = deadline - loop.time()
            if not missing:
                return
            if remaining <= 0:
                raise WorkersUnreachable(missing, within)
            await asyncio.sleep(min(STARTUP_POLL_SECS, self._config.interval_secs, remaining))
            await self.probe_all()

    def _current(self, worker: Worker, epoch: int) -> bool:
        """Whether a reading taken when the worker was ACTIVE at ``epoch`` still applies: no
        conversion took or moved it meanwhile, and it was not removed."""
        return (
            worker.state is WorkerState.ACTIVE
            and worker.epoch == epoch
            and self._registry.registered(worker)
        )

    def _reconcile(
        self, worker: Worker, record: ProbeRecord, reading: RoleReading, detected: bool
    ) -> None:
        """Bring the registry in line with a current reading of an ACTIVE worker; ``detected``
        says whether the reading found out afresh which protocol the worker speaks."""
        if record.restarted(reading):
            log.warning("worker %s restarted", worker.url, extra={"worker": worker.url})
            # Unless this reading just detected it, the next one finds out which protocol the
            # new process speaks; its start signature may come from the other source, so it
            # starts a new baseline.
            self._registry.note_restart(worker, forget_protocol=not detected)
            if not detected:
                record.instance = None
        if reading.role is not None and reading.role is not worker.role:
            log.warning(
                "worker %s serves as %s, not %s; moving it to the %s pool",
                worker.url,
                reading.role.value,
                worker.role.value,
                reading.role.value,
                extra={"worker": worker.url, "from": worker.role.value, "to": reading.role.value},
            )
            port = reading.bootstrap_port if reading.role is Role.PREFILL else None
            self._registry.adopt_role(worker, reading.role, port)
        elif (
            worker.role is Role.PREFILL
            and reading.bootstrap_port is not None
            and reading.bootstrap_port != worker.bootstrap_port
        ):
            # The port the worker serves KV on wins over one given for it (a decode sent to
            # another port would wait for the KV until its bootstrap timeout).
            log.warning(
                "prefill %s reports bootstrap port %d, not %s; using %d",
                worker.url, reading.bootstrap_port, worker.bootstrap_port, reading.bootstrap_port,
                extra={"worker": worker.url, "port": reading.bootstrap_port,
                       "given_port": worker.bootstrap_port},
            )  # fmt: skip
            self._registry.set_bootstrap_port(worker, reading.bootstrap_port)
        if reading.switch_supported is not None:
            self._registry.set_switch_supported(worker, reading.switch_supported)
        if reading.draining is worker.admitting:
            log.warning(
                "worker %s draining; out of selection"
                if reading.draining
                else "worker %s admits again",
                worker.url,
                extra={"worker": worker.url},
            )
            self._registry.set_admitting(worker, not reading.draining)

    async def _read(self, worker: Worker) -> tuple[RoleReading, bool]:
        """The worker's live role reading, and whether it detected the worker's protocol
        afresh; a worker that lost its extension routes (restarted without them) is read
        through the native protocol."""
        control = WorkerControl(
            self._started_session, self._registry, timeout_secs=self._config.timeout_secs
        )
        detected = worker.has_extensions is None
        try:
            return await control.read_role(worker), detected
        except ControlError as exc:
            if exc.status != 404 or not worker.has_extensions:
                raise
        self._registry.set_extensions(worker, None)
        return await control.read_role(worker), True

    async def _probe(self, worker: Worker) -> tuple[bool, str | None, bool]:
        """(healthy, the error, whether the connection could not even be opened)."""
        if self._session is None:
            raise RuntimeError("health monitor not started")
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_secs)
        try:
            async with self._session.get(
                worker.url + self._config.endpoint, timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    return False, f"health probe answered {resp.status}", False
            if worker.role is Role.PREFILL and worker.bootstrap_port is None:
                self._learn(worker, await self._server_info(worker, timeout))
            elif worker.model is None:
                await self._learn_model(worker, timeout)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            return False, f"health probe failed: {type(exc).__name__}: {exc}", refused
        return True, None, False

    async def _learn_once(self, worker: Worker) -> None:
        """Read a prefill's bootstrap port once (probes off: no other call reaches a worker,
        so the model of a worker is the one given, or the one this reading names); the default
        port and no model name if that fails."""
        if self._session is None:
            raise RuntimeError("health monitor not started")
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_secs)
        try:
            info = await self._server_info(worker, timeout)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning(
                "/server_info not read; the default bootstrap port and no model name",
                extra={"worker": worker.url, "port": DEFAULT_BOOTSTRAP_PORT, "error": str(exc)},
            )
            info = {}
        self._learn(worker, info)

    def _learn(self, worker: Worker, info: dict) -> None:
        """What the router needs once from a worker's ``/server_info``: a prefill's
        ``disaggregation_bootstrap_port`` (8998 if absent), and the model it serves."""
        if worker.role is Role.PREFILL and worker.bootstrap_port is None:
            port = info.get("disaggregation_bootstrap_port")
            self._registry.set_bootstrap_port(
                worker, port if is_int(port) else DEFAULT_BOOTSTRAP_PORT
            )
        if worker.model is None:
            self._registry.set_model(worker, served_model(info))

    async def _learn_model(self, worker: Worker, limit: aiohttp.ClientTimeout) -> None:
        """Read the worker's model from its ``/server_info``; a worker that has none (4xx)
        names no model, one that does not answer now is read again at the next probe (its
        health is its ``/health``'s to say)."""
        try:
            info = await self._server_info(worker, limit)
        except aiohttp.ClientResponseError as exc:
            if exc.status >= 500:
                return
            info = {}
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.debug("model of %s not read: %s", worker.url, exc)
            return
        self._registry.set_model(worker, served_model(info))

    async def _server_info(self, worker: Worker, limit: aiohttp.ClientTimeout) -> dict:
        async with self._started_session.get(worker.url + "/server_info", timeout=limit) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message="server_info failed"
                )
            info = orjson.loads(await resp.read())
        return info if isinstance(info, dict) else {}


def served_model(info: dict) -> str:
    """The model a worker serves by its ``/server_info``: the name its OpenAI API answers to
    (``served_model_name``, else ``model_path``, as SGLang defaults it); "" when it names
    none."""
    for key in ("served_model_name", "model_path"):
        name = info.get(key)
        if isinstance(name, str) and name:
            return name
    return ""
