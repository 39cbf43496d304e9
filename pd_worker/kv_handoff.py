"""What a torch prefill's room payload tells its decode, and how the decode maps the bytes.

The prefill publishes where the prompt's KV lies in its pool (transport endpoint, pool pointer,
byte runs of the prompt's slots) and the first token it sampled; the decode pairs those runs with
the runs of its own slots, since the two pools fragment differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

ByteRun = tuple[int, int]  # (offset, length) in a pool
Transfer = tuple[int, int, int]  # (remote offset, local offset, length)


class BadHandoff(ValueError):
    """A room payload that does not describe a prompt's KV."""


@dataclass(frozen=True)
class KVHandoff:
    """A torch prefill's room payload; ``transport`` is the kind of KV transport ``endpoint``
    belongs to (``--kv-transfer``), which the decode's must match."""

    transport: str
    endpoint: str
    pool_ptr: int
    ranges: list[ByteRun]
    first_token: int
    num_tokens: int

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "transport": self.transport,
                "endpoint": self.endpoint,
                "pool_ptr": self.pool_ptr,
                "ranges": self.ranges,
                "first_token": self.first_token,
                "num_tokens": self.num_tokens,
            }
        )

    @classmethod
    def decode(cls, payload: bytes) -> KVHandoff:
        try:
            body = orjson.loads(payload)
            return cls(
                str(body["transport"]),
                str(body["endpoint"]),
                int(body["pool_ptr"]),
                [(int(offset), int(length)) for offset, length in body["ranges"]],
                int(body["first_token"]),
                int(body["num_tokens"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise BadHandoff(f"not a torch KV handoff: {exc!r}") from None


def pair_runs(remote: list[ByteRun], local: list[ByteRun]) -> list[Transfer]:
    """Cut two run lists of the same total length into transfers contiguous on both sides."""
    if sum(n for _, n in remote) != sum(n for _, n in local):
        raise BadHandoff("the prefill's KV and the decode's slots differ in size")
    transfers: list[Transfer] = []
    r_index = l_index = 0
    r_done = l_done = 0
    while r_index < len(remote) and l_index < len(local):
        r_offset, r_length = remote[r_index]
        l_offset, l_length = local[l_index]
        length = min(r_length - r_done, l_length - l_done)
        transfers.append((r_offset + r_done, l_offset + l_done, length))
        r_done += length
        l_done += length
        if r_done == r_length:
            r_index, r_done = r_index + 1, 0
        if l_done == l_length:
            l_index, l_done = l_index + 1, 0
    return transfers
