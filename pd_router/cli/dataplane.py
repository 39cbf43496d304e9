"""``python -m pd_router.cli.dataplane``: one data plane of a multi-process router. The control
process starts it (never a person): its index, listening socket and channel come as arguments,
its configuration (pickled) on standard input."""

from __future__ import annotations

import argparse
import asyncio
import pickle
import socket
import sys
from collections.abc import Sequence

from pd_router.cli.logs import configure_logging
from pd_router.dataplane.front.listener import raise_fd_limit
from pd_router.runtime.dataplane_process import serve_dataplane
from pd_router.runtime.serve import tune_gc, uvloop_factory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--control-socket", required=True)
    args = parser.parse_args(argv)
    config = pickle.load(sys.stdin.buffer)
    configure_logging(config.log_level, config.log_format)
    raise_fd_limit()
    listen = socket.socket(fileno=args.listen_fd)
    channel = socket.socket(fileno=args.channel_fd)
    tune_gc()
    with asyncio.Runner(loop_factory=uvloop_factory()) as r:
        return r.run(serve_dataplane(config, args.index, listen, channel, args.control_socket))


if __name__ == "__main__":
    sys.exit(main())
