"""Structured logs: one JSON object per line with the fields passed as ``extra`` (request_id,
worker, role, ...), so logs can be filtered by request id across the router and its workers."""

from __future__ import annotations

import logging
import sys

import orjson

STANDARD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """Human-readable lines that still show the extra fields (for the demo and a terminal):
    each one the message does not already say (an error or a worker url named in the message
    and kept as a field for the JSON logs would show twice), on the message's line, before a
    traceback."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        extras = " ".join(
            f"{key}={value}"
            for key, value in record.__dict__.items()
            if key not in STANDARD_ATTRS
            and not key.startswith("_")
            and (value is None or str(value) not in message)
        )
        line = logging.makeLogRecord({**record.__dict__, "args": None})
        line.msg = f"{message} {extras}" if extras else message
        return super().format(line)


def configure_logging(level: str, fmt: str) -> None:
    """Send the router's logs to stderr at ``level`` in ``fmt`` ("json" or "text")."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("pd_router")
    root.handlers[:] = [handler]
    root.setLevel({"warn": "WARNING"}.get(level.lower(), level.upper()))
    root.propagate = False
