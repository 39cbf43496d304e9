"""The data-plane processes of a multi-process router: their sockets, start, restart, stop.

Listening. The control process binds one SO_REUSEPORT socket per data plane on the shared port
(so a port in use fails the start before anything runs) and hands socket ``i`` to data plane
``i``; the kernel spreads new connections over the sockets by their address hash, which
``bench/listen_spread.py`` measured to be more even under keep-alive clients than one inherited
socket that every process accepts from. The control process keeps every socket open and never
accepts: a data plane that is restarted takes its socket, and the connections queued on it
meanwhile, over.

Talking. Each data plane gets one end of a Unix socketpair as its channel (see
:mod:`pd_router.dataplane.link.channel`); the other end is handed to ``attach(index, sock)``, and
``detach(index)`` is called when the process exits. A data plane that exits while the router
runs is started again after :data:`RESTART_DELAY_SECS`, the delay doubling (up to
:data:`MAX_RESTART_DELAY_SECS`) while it keeps exiting within :data:`STABLE_SECS` of its start.
One that is still running but ``unresponsive(index)`` (hung: stopped, or its event loop
blocked, so the connections the kernel hands its socket would wait forever) is killed, and
started again the same way.

Stopping. :meth:`Supervisor.stop` closes the control process's copies of the sockets and sends
SIGTERM to every data plane, which stops accepting and lets its requests in flight finish
(up to its shutdown deadline), then waits for them; one still running after ``grace`` seconds
is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("pd_router.supervisor")

RESTART_DELAY_SECS = 0.2
MAX_RESTART_DELAY_SECS = 10.0
STABLE_SECS = 10.0
STOP_KILL_AFTER_SECS = 5.0
WATCH_SECS = 1.0


def reuseport_sockets(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """``count`` listening sockets on one address (port 0: a free one, the same for all).
    OSError (EADDRINUSE) if anything listens there already: SO_REUSEPORT alone would let this
    router share the port with another one started with it."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    if port:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
            sock.listen(backlog)
            sock.set_inheritable(True)
            address = sock.getsockname()
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


Attach = Callable[[int, socket.socket], Awaitable[None]]


class Supervisor:
    """Runs ``len(sockets)`` data planes: ``command`` plus ``--index``, ``--listen-fd`` and
    ``--channel-fd``, with ``stdin_bytes`` written to its standard input (its configuration)."""

    def __init__(
        self,
        sockets: Sequence[socket.socket],
        command: Sequence[str],
        stdin_bytes: bytes,
        *,
        attach: Attach,
        detach: Callable[[int], None],
        unresponsive: Callable[[int], bool],
    ) -> None:
        self._sockets = list(sockets)
        self._command = list(command)
        self._stdin = stdin_bytes
        self._attach = attach
        self._detach = detach
        self._unresponsive = unresponsive
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._runs: list[asyncio.Task] = []
        self._stopping = False

    @property
    def pids(self) -> dict[int, int]:
        return {index: proc.pid for index, proc in self._processes.items()}

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._runs = [loop.create_task(self._run(index)) for index in range(len(self._sockets))]

    async def _run(self, index: int) -> None:
        """Keep data plane ``index`` running until the router stops."""
        delay = RESTART_DELAY_SECS / 2  # doubled before the first restart
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            try:
                proc = await self._spawn(index)
            except OSError as exc:
                log.error("data plane %d not started: %s", index, exc)
            else:
                returncode = await self._watch(index, proc)
                self._processes.pop(index, None)
                self._detach(index)
                if self._stopping:
                    return
                log.error(
                    "data plane %d (pid %d) exited with %s; starting it again",
                    index, proc.pid, returncode, extra={"dataplane": index},
                )  # fmt: skip
            stable = loop.time() - started >= STABLE_SECS
            delay = RESTART_DELAY_SECS if stable else min(2 * delay, MAX_RESTART_DELAY_SECS)
            await asyncio.sleep(delay)

    async def _watch(self, index: int, proc: asyncio.subprocess.Process) -> int:
        """Wait for data plane ``index`` to exit; kill it if it hangs (its exit status)."""
        exited = asyncio.ensure_future(proc.wait())
        while True:
            done, _ = await asyncio.wait((exited,), timeout=WATCH_SECS)
            if done:
                return exited.result()
            if not self._stopping and self._unresponsive(index):
                log.error(
                    "data plane %d (pid %d) stopped answering; killing it",
                    index, proc.pid, extra={"dataplane": index},
                )  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        listen = self._sockets[index]
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command,
                "--index", str(index),
                "--listen-fd", str(listen.fileno()),
                "--channel-fd", str(theirs.fileno()),
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(listen.fileno(), theirs.fileno()),
            )  # fmt: skip
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._processes[index] = proc
        assert proc.stdin is not None
        proc.stdin.write(self._stdin)
        with contextlib.suppress(ConnectionError):
            await proc.stdin.drain()
        proc.stdin.close()
        await self._attach(index, ours)
        log.info("data plane %d started (pid %d)", index, proc.pid, extra={"dataplane": index})
        return proc

    async def stop(self, grace: float) -> None:
        """Stop accepting everywhere, let every data plane finish, kill what is left."""
        self._stopping = True
        for sock in self._sockets:
            sock.close()
        for proc in list(self._processes.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if not self._runs:
            return
        _, pending = await asyncio.wait(self._runs, timeout=grace + STOP_KILL_AFTER_SECS)
        for proc in list(self._processes.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if pending:
            await asyncio.wait(pending, timeout=STOP_KILL_AFTER_SECS)
        for task in pending:
            task.cancel()
