"""A request body sent compressed (``Content-Encoding: gzip`` or ``deflate``), decoded up to
the size limit, so a small compressed body cannot unfold into gigabytes in the router."""

from __future__ import annotations

import zlib

from pd_router.errors import BadRequest, PayloadTooLarge

# zlib's window bits: gzip's header, or zlib's (deflate as HTTP names it).
WINDOW_BITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}


def decoded_body(raw: bytes, encoding: str | None, limit: int) -> bytes:
    """``raw`` as sent, decoded by ``encoding`` (``identity`` or none: unchanged);
    PayloadTooLarge past ``limit`` bytes decoded, BadRequest for a body that is not what its
    encoding says or an encoding the router does not read."""
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return raw
    bits = WINDOW_BITS.get(name)
    if bits is None:
        raise BadRequest(f"request body could not be read: unsupported Content-Encoding {name!r}")
    decoder = zlib.decompressobj(bits)
    try:
        body = decoder.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"request body could not be read: not valid {name} data ({exc})") from None
    if len(body) > limit or decoder.unconsumed_tail:
        raise PayloadTooLarge(
            f"request body decoded is over the limit of {limit} bytes (max_payload_size)"
        )
    if not decoder.eof:
        raise BadRequest(f"request body could not be read: {name} data ends early")
    return body
