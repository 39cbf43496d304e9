"""Starts the real-SGLang test servers by forking one process that imported SGLang once: test
support, never part of what a GPU user runs (run by tests/sglang_cluster.py with SGLang's venv
and the servers' environment).

Each ``python -m sglang.launch_server`` spends most of its start importing SGLang, torch and
transformers (about 6 s of CPU alone, several times that with six servers starting on two
cores); the servers of a fleet import the same modules. This process imports them once, then
reads one JSON line per server on stdin (``module``, ``args``, ``log``, ``cwd``), forks, and
answers ``{"pid": N}``. The child is what ``python -m MODULE ARGS`` with its output on ``log``
would be, in a process group of its own that gets SIGTERM when this process dies (which gets it
when the test process dies); it runs the same code once started. Nothing here is imported that
server_patch changes: its servers import it after the fork, the plain ones never. Children are
reaped as they exit, so the test process sees them gone.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import traceback

# Imported once, for every server: the launcher and its HTTP server (engine, tokenizer manager).
import sglang.launch_server
import sglang.srt.entrypoints.http_server  # noqa: F401

PR_SET_PDEATHSIG = 1


def reap(*_: object) -> None:
    """Waits for every child that exited, so that none stays a zombie."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def become_server(request: dict[str, object]) -> None:
    """In the forked child: the process ``python -m MODULE ARGS`` would be; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(str(request["cwd"]))
        module = str(request["module"])
        sys.argv = [module, *map(str, request["args"])]  # type: ignore[call-overload]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    """Forks a server per request line until stdin closes, then leaves at once (an interpreter
    holding torch takes seconds to shut down, and this one has nothing to clean up)."""
    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            become_server(request)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
