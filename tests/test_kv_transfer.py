"""KV transfer transports: byte-exact pulls between processes, bounded failures, no fallback.

Each transport is exercised for real: a peer process (tests/kv_transfer_peer.py) registers a
patterned buffer, this process pulls ranges of it into its own buffer over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from pd_worker.kv_transfer import (
    TRANSPORTS,
    KVTransferFailed,
    KVTransport,
    TcpTransport,
    make_transport,
)
from tests.kv_transfer_peer import LOOPBACK, pattern, patterned_buffer

REPO = Path(__file__).resolve().parent.parent
PEER_BYTES = 4 << 20
# Several runs across the buffer: unaligned, adjacent, one of several MB (more than a chunk), the
# peer's last bytes. Their destinations never overlap, as KV slots do not: a transport may
# write the ranges in any order (mooncake runs them as concurrent batches).
LAST_LOCAL = (3 << 20) + 8192
RANGES = [
    (7, 0, 1000),
    (4096, 1000, 4096),
    (8192, 5096, 3 << 20),
    (PEER_BYTES - 333, LAST_LOCAL, 333),
]
FAILURE_BOUND_SECS = 15.0


def needs(kind: str) -> None:
    """Skip a mooncake test when its engine cannot be imported here (missing Debian libraries)."""
    if kind == "mooncake":
        pytest.importorskip(
            "mooncake.engine",
            reason="mooncake TransferEngine not importable (make test installs libibverbs1 "
            "librdmacm1 libnuma1; the 'torch' extra installs the engine)",
        )


@dataclass
class Peer:
    process: subprocess.Popen[str]
    endpoint: str
    ptr: int


@pytest.fixture
def start_peer() -> Iterator[Callable[[str], Peer]]:
    """Starts peer processes serving a patterned buffer; stops them at teardown."""
    peers: list[subprocess.Popen[str]] = []

    def start(kind: str) -> Peer:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_transfer_peer", kind, str(PEER_BYTES)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        peers.append(process)
        line = process.stdout.readline() if process.stdout else ""
        if not line:
            pytest.fail(f"{kind} peer exited before serving (status {process.wait(5)})")
        announced = orjson.loads(line)
        return Peer(process, announced["endpoint"], announced["ptr"])

    yield start
    for process in peers:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@pytest.fixture
def transports() -> Iterator[Callable[[str], KVTransport]]:
    """Makes transports on loopback; closes them at teardown."""
    made: list[KVTransport] = []

    def make(kind: str) -> KVTransport:
        needs(kind)
        made.append(make_transport(kind, LOOPBACK))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


def expected(ranges: list[tuple[int, int, int]], nbytes: int) -> bytes:
    """The local buffer after pulling ``ranges`` of the pattern into zeros."""
    source = pattern(PEER_BYTES)
    result = bytearray(nbytes)
    for remote, local, length in ranges:
        result[local : local + length] = source[remote : remote + length]
    return bytes(result)


def assert_same_bytes(actual: bytes, wanted: bytes) -> None:
    """Byte for byte; a difference is reported by its offset (a diff of megabytes took pytest
    minutes to render)."""
    if actual == wanted:
        return
    if len(actual) != len(wanted):
        raise AssertionError(f"{len(actual)} bytes, {len(wanted)} wanted")
    first = next(i for i, (x, y) in enumerate(zip(actual, wanted, strict=True)) if x != y)
    last = max(i for i in range(len(wanted)) if actual[i] != wanted[i])
    raise AssertionError(
        f"bytes differ from offset {first} to {last}: {actual[first : first + 16].hex()} "
        f"where {wanted[first : first + 16].hex()} was wanted"
    )


def unused_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pull_from_another_process_copies_each_range_byte_for_byte(
    kind: str, start_peer: Callable[[str], Peer], transports: Callable[[str], KVTransport]
) -> None:
    local = transports(kind)
    peer = start_peer(kind)
    destination = ctypes.create_string_buffer(PEER_BYTES)
    local.register(ctypes.addressof(destination), PEER_BYTES)

    await local.pull(peer.endpoint, peer.ptr, ctypes.addressof(destination), RANGES)

    assert_same_bytes(destination.raw, expected(RANGES, PEER_BYTES))


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pulls_repeat_from_the_same_peer(
    kind: str, start_peer: Callable[[str], Peer], transports: Callable[[str], KVTransport]
) -> None:
    local = transports(kind)
    peer = start_peer(kind)
    destination = ctypes.create_string_buffer(PEER_BYTES)
    local.register(ctypes.addressof(destination), PEER_BYTES)

    for shift in range(5):
        ranges = [(remote + shift, local_offset, length) for remote, local_offset, length in RANGES]
        ranges[-1] = (PEER_BYTES - 333 - shift, LAST_LOCAL, 333)
        await local.pull(peer.endpoint, peer.ptr, ctypes.addressof(destination), ranges)
        assert_same_bytes(destination.raw, expected(ranges, PEER_BYTES))


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pull_between_torch_tensors_in_one_process(
    kind: str, transports: Callable[[str], KVTransport]
) -> None:
    torch = pytest.importorskip("torch", reason="torch not installed (the 'torch' extra)")
    source_bytes = torch.frombuffer(bytearray(pattern(PEER_BYTES)), dtype=torch.uint8)
    source = source_bytes.view(torch.float32).reshape(-1, 64).clone()
    destination = torch.zeros_like(source)
    prefill, decode = transports(kind), transports(kind)
    prefill.register(source.data_ptr(), source.nbytes)
    decode.register(destination.data_ptr(), destination.nbytes)
    row = 64 * 4
    ranges = [(3 * row, 0, 2 * row), (100 * row, 2 * row, 50 * row)]

    await decode.pull(prefill.endpoint, source.data_ptr(), destination.data_ptr(), ranges)

    assert torch.equal(destination[:2], source[3:5])
    assert torch.equal(destination[2:52], source[100:150])
    assert not destination[52:].any()


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_cancelled_pull_no_longer_writes_into_the_destination(
    kind: str, start_peer: Callable[[str], Peer], transports: Callable[[str], KVTransport]
) -> None:
    local = transports(kind)
    peer = start_peer(kind)
    destination = ctypes.create_string_buffer(PEER_BYTES)
    local.register(ctypes.addressof(destination), PEER_BYTES)
    # 64 reads of different bytes into the same place: any late write changes the buffer.
    length = PEER_BYTES - 64
    ranges = [(shift, 0, length) for shift in range(64)]
    pull = asyncio.ensure_future(
        local.pull(peer.endpoint, peer.ptr, ctypes.addressof(destination), ranges)
    )
    await asyncio.sleep(0.01)
    pull.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pull

    after_cancel = destination.raw
    await asyncio.sleep(0.5)
    assert_same_bytes(destination.raw, after_cancel)


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pull_from_a_killed_peer_fails_with_the_endpoint_in_bounded_time(
    kind: str, start_peer: Callable[[str], Peer], transports: Callable[[str], KVTransport]
) -> None:
    local = transports(kind)
    peer = start_peer(kind)
    destination = ctypes.create_string_buffer(PEER_BYTES)
    local.register(ctypes.addressof(destination), PEER_BYTES)
    await local.pull(peer.endpoint, peer.ptr, ctypes.addressof(destination), RANGES)
    peer.process.kill()
    peer.process.wait(10)

    started = time.monotonic()
    with pytest.raises(KVTransferFailed) as failed:
        await local.pull(peer.endpoint, peer.ptr, ctypes.addressof(destination), RANGES)

    assert time.monotonic() - started < FAILURE_BOUND_SECS
    assert peer.endpoint in failed.value.message


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pull_from_an_endpoint_nobody_listens_on_fails(
    kind: str, transports: Callable[[str], KVTransport]
) -> None:
    local = transports(kind)
    destination = ctypes.create_string_buffer(1024)
    endpoint = f"{LOOPBACK}:{unused_loopback_port()}"

    with pytest.raises(KVTransferFailed) as failed:
        await local.pull(endpoint, 1 << 40, ctypes.addressof(destination), [(0, 0, 1024)])

    assert endpoint in failed.value.message


async def test_tcp_pull_from_a_stalled_peer_fails_after_the_progress_timeout(
    start_peer: Callable[[str], Peer],
) -> None:
    peer = start_peer("tcp")
    local = TcpTransport(LOOPBACK, progress_timeout_secs=0.5)
    destination = ctypes.create_string_buffer(PEER_BYTES)
    os.kill(peer.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(KVTransferFailed, match=r"no progress within 0\.5 s"):
            await local.pull(peer.endpoint, peer.ptr, ctypes.addressof(destination), RANGES)
    finally:
        os.kill(peer.process.pid, signal.SIGCONT)
        local.close()


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pull_outside_the_registered_buffer_fails(
    kind: str, transports: Callable[[str], KVTransport]
) -> None:
    prefill, decode = transports(kind), transports(kind)
    source = patterned_buffer(4096)
    destination = ctypes.create_string_buffer(4096)
    prefill.register(ctypes.addressof(source), 4096)

    with pytest.raises(KVTransferFailed):
        await decode.pull(
            prefill.endpoint,
            ctypes.addressof(source),
            ctypes.addressof(destination),
            [(4000, 0, 200)],
        )


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_unregistered_buffer_is_no_longer_served_and_can_be_registered_again(
    kind: str, transports: Callable[[str], KVTransport]
) -> None:
    prefill, decode = transports(kind), transports(kind)
    source = patterned_buffer(4096)
    destination = ctypes.create_string_buffer(4096)
    prefill.register(ctypes.addressof(source), 4096)
    prefill.unregister(ctypes.addressof(source))

    with pytest.raises(KVTransferFailed):
        await decode.pull(
            prefill.endpoint, ctypes.addressof(source), ctypes.addressof(destination), [(0, 0, 64)]
        )
    prefill.register(ctypes.addressof(source), 4096)
    await decode.pull(
        prefill.endpoint, ctypes.addressof(source), ctypes.addressof(destination), [(0, 0, 64)]
    )
    assert destination.raw[:64] == pattern(64)


def test_make_transport_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'nope'"):
        make_transport("nope", LOOPBACK)


def test_unusable_mooncake_raises_with_the_reason_instead_of_falling_back_to_tcp() -> None:
    # A process where mooncake's engine cannot be imported (as without its Debian libraries).
    script = (
        "import sys; sys.modules['mooncake.engine'] = None\n"
        "from pd_worker.kv_transfer import TransportUnavailable, make_transport\n"
        "try:\n"
        "    transport = make_transport('mooncake', '127.0.0.1')\n"
        "except TransportUnavailable as exc:\n"
        "    print('unavailable:', exc)\n"
        "else:\n"
        "    print('made:', transport.kind)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )

    assert result.stdout.startswith("unavailable: mooncake transfer engine cannot be imported")
    assert "choose the tcp transport explicitly" in result.stdout
