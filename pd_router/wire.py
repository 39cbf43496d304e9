"""The messages between the control side and its data planes: typed, immutable records, one
class per kind, and how they travel over a socket.

Over a socket (:class:`pd_router.dataplane.link.channel.Channel`) a message is the JSON array
``[tag, fields]`` (orjson writes the dataclass as the object of its fields); :func:`decode`
reads it back through the tag's class and refuses anything else with :class:`WireError`. In one
process the records are handed over as they are, so neither side changes one once sent (the
mappings in them included).

Both ends open with a :class:`Hello` naming :data:`PROTOCOL_VERSION`; an end that reads another
version closes the channel. The hello is ``["hello", {"version": N}]`` in every version, so two
versions can always tell each other apart. Bump the version with any change to a message.

A data plane applies a snapshot only once :func:`check_consistent` found nothing wrong with it:
a snapshot the data plane could misroute by is refused (:class:`SnapshotRefused`) and the data
plane routes on from the last one it applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import orjson

from pd_router.circuit_state import CircuitState
from pd_router.roles import Role

PROTOCOL_VERSION = 4
# Each end sends something at least this often, even with nothing to say (the data plane a
# report, the control side the in-flight totals), so that either can take a long silence of the
# other for a hang.
HEARTBEAT_SECS = 1.0
# The version a data plane routes from before its first snapshot.
NO_SNAPSHOT = -1
# A metric sample as a data plane sends it: family, type, sample name, labels, value
# (:func:`pd_router.metrics.samples`).
Sample = tuple[str, str, str, Mapping[str, str], float]


class WireError(Exception):
    """Bytes or a record that is not a message of this protocol version."""


class ChannelClosed(Exception):
    """The other end closed the channel (or sent something that is not a message)."""


class InconsistentSnapshot(Exception):
    """A snapshot that breaks an invariant the data plane routes by."""


# --- control side -> data plane ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One worker as a snapshot carries it: what a data plane routes by. ``pickable``: ACTIVE,
    healthy and admitting; ``usable``: requests may still go to it (else its legs are ended);
    ``half_open_at``: when an open circuit turns half-open (monotonic); ``trial``: the data
    plane that may send a half-open circuit's trial (None: none)."""

    url: str
    role: Role
    # The model it serves ("" when it names none).
    model: str
    epoch: int
    bootstrap_port: int | None
    pickable: bool
    usable: bool
    circuit: CircuitState
    half_open_at: float | None
    trial: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every worker of the registry at ``version`` (versions only go up)."""

    TAG: ClassVar[str] = "snapshot"
    version: int
    workers: tuple[WorkerEntry, ...]


@dataclass(frozen=True, slots=True)
class InflightTotals:
    """The router-wide in-flight count per worker, summed from every report, and the most
    client connections each data plane should keep (None: no limit)."""

    TAG: ClassVar[str] = "inflight"
    totals: Mapping[str, int]
    share: int | None


@dataclass(frozen=True, slots=True)
class WorkerLoads:
    """What the workers last reported about their own load, for a policy that routes by it
    (``least_load``): per worker, its requests (running + waiting over its DP ranks) and when
    the control side read the report (monotonic), which tells one report from the next. A
    worker absent has no report. Sent only while some worker has one, whenever one changes."""

    TAG: ClassVar[str] = "loads"
    loads: Mapping[str, tuple[int, float]]


@dataclass(frozen=True, slots=True)
class MetricsAsk:
    """A scrape: send your metric samples, answering with ``request``."""

    TAG: ClassVar[str] = "metrics?"
    request: int


# --- data plane -> control side ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    """A data plane's batch: ``version`` is the snapshot it routes from (its ack); its in-flight
    count per worker and when each idle one became idle; leg outcomes as runs ``(url,
    succeeded, how many in a row)``; TTFT samples ``(seconds, prefilled after, model)``, TPOT
    samples ``(seconds after the first, events, model)``, refusals ``(model, role, count)``; its
    open client connections."""

    TAG: ClassVar[str] = "report"
    version: int
    inflight: Mapping[str, int]
    idle_at: Mapping[str, float]
    outcomes: tuple[tuple[str, bool, int], ...]
    ttft: tuple[tuple[float, float | None, str], ...]
    tpot: tuple[tuple[float, int, str], ...]
    refused: tuple[tuple[str, str, int], ...]
    connections: int


@dataclass(frozen=True, slots=True)
class Suspect:
    """A leg to ``url`` was answered for the other role (421): read its role now."""

    TAG: ClassVar[str] = "suspect"
    url: str


@dataclass(frozen=True, slots=True)
class StuckPair:
    """A request through ``prefill`` and ``decode`` missed its rendezvous: the decode may keep
    an old endpoint of the prefill (SGLang 0.5.23 after the prefill's round trip), so it is
    asked to forget it."""

    TAG: ClassVar[str] = "stuck"
    prefill: str
    decode: str


@dataclass(frozen=True, slots=True)
class SnapshotRefused:
    """Snapshot ``version`` was inconsistent (``reason``) and not applied; the data plane
    routes on from ``routing``."""

    TAG: ClassVar[str] = "refused"
    version: int
    routing: int
    reason: str


@dataclass(frozen=True, slots=True)
class MetricsAnswer:
    """A data plane's metric samples, for scrape ``request`` (0: sent unasked)."""

    TAG: ClassVar[str] = "metrics"
    request: int
    samples: tuple[Sample, ...]


# --- both ways -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """The first message of each end: the protocol version it speaks."""

    TAG: ClassVar[str] = "hello"
    version: int


Message = (
    Hello
    | Snapshot
    | InflightTotals
    | WorkerLoads
    | MetricsAsk
    | Report
    | Suspect
    | StuckPair
    | SnapshotRefused
    | MetricsAnswer
)


class ChannelEnd(Protocol):
    """One end of a channel, over a socket or in one process
    (:mod:`pd_router.dataplane.link.channel`). Sending never waits; receiving raises ChannelClosed
    once the other end is gone."""

    @property
    def closed(self) -> bool: ...
    def send(self, message: Message) -> None: ...
    async def receive(self) -> Message: ...
    def close(self) -> None: ...


class VersionMismatch(Exception):
    """The other end speaks another protocol version."""

    def __init__(self, theirs: int) -> None:
        super().__init__(f"protocol version {theirs} on the other end, {PROTOCOL_VERSION} here")
        self.theirs = theirs


def check_hello(message: Message) -> None:
    """The other end's first message: a hello of this version, else VersionMismatch (another
    version) or WireError (no hello)."""
    if not isinstance(message, Hello):
        raise WireError(f"{type(message).__name__} before the hello")
    if message.version != PROTOCOL_VERSION:
        raise VersionMismatch(message.version)


# --- encoding ------------------------------------------------------------------------------


def encode(message: Message) -> bytes:
    return orjson.dumps((message.TAG, message))


def decode(data: bytes) -> Message:
    """The message in ``data``; WireError unless it is one of this protocol version."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)):
        raise WireError("not a [tag, fields] pair")
    decoder = DECODERS.get(raw[0])
    if decoder is None:
        raise WireError(f"unknown message {raw[0]!r}")
    return decoder(raw[1])


# How a field is read: the types its value may have (taken as it is), or a function making the
# value from what was read (WireError when it cannot).
Field = frozenset[type] | Callable[[Any], Any]
INT = frozenset({int})
NUMBER = frozenset({int, float})
TEXT = frozenset({str})
BOOL = frozenset({bool})
OBJECT = frozenset({dict})
LIST = frozenset({list})


def maybe(types: frozenset[type]) -> frozenset[type]:
    """``types`` or null."""
    return types | {type(None)}


def read(field: Field, value: Any) -> Any:
    if isinstance(field, frozenset):
        if type(value) not in field:
            raise WireError(f"{value!r} is not {kinds(field)}")
        return value
    return field(value)


def kinds(types: frozenset[type]) -> str:
    return " or ".join(sorted(t.__name__ for t in types))


def choice(enum: type[Role] | type[CircuitState]) -> Field:
    names = {member.value: member for member in enum}

    def decode_choice(value: Any) -> Any:
        if type(value) is not str or value not in names:
            raise WireError(f"{value!r} is not a {enum.__name__}")
        return names[value]

    return decode_choice


def mapping(values: frozenset[type]) -> Field:
    """An object whose values are of ``values`` (JSON keys are strings)."""

    def decode_mapping(value: Any) -> dict:
        if type(value) is not dict or not values.issuperset(map(type, value.values())):
            raise WireError(f"not an object of {kinds(values)}")
        return value

    return decode_mapping


def pairs(first: frozenset[type], second: frozenset[type]) -> Field:
    """An object whose values are arrays of two, the first of ``first``, the second of
    ``second``; read as tuples."""

    def decode_pairs(value: Any) -> dict:
        if type(value) is not dict:
            raise WireError("not an object")
        decoded = {}
        for key, pair in value.items():
            if not (type(pair) is list and len(pair) == 2):
                raise WireError(f"{key}: not an array of two")
            if type(pair[0]) not in first or type(pair[1]) not in second:
                raise WireError(f"{key}: not [{kinds(first)}, {kinds(second)}]")
            decoded[key] = (pair[0], pair[1])
        return decoded

    return decode_pairs


def rows(*columns: frozenset[type]) -> Field:
    """An array of arrays of ``len(columns)``, column i of the types ``columns[i]`` (checked a
    column at a time: a report carries thousands of samples)."""
    width = frozenset({len(columns)})

    def decode_rows(value: Any) -> tuple:
        if type(value) is not list or not LIST.issuperset(map(type, value)):
            raise WireError("not an array of arrays")
        if not width.issuperset(map(len, value)):
            raise WireError(f"not an array of arrays of {len(columns)}")
        read_columns = zip(*value, strict=True)
        for number, (column, types) in enumerate(zip(read_columns, columns, strict=False)):
            if not types.issuperset(map(type, column)):
                raise WireError(f"column {number} is not {kinds(types)}")
        return tuple(map(tuple, value))

    return decode_rows


def sequence(item: Callable[[Any], Any]) -> Field:
    def decode_sequence(value: Any) -> tuple:
        if type(value) is not list:
            raise WireError("not an array")
        return tuple(map(item, value))

    return decode_sequence


def record(cls: type, **fields: Field) -> Callable[[Any], Any]:
    """An object with exactly ``fields``, each read by its field, made into ``cls``."""

    def decode_record(value: Any) -> Any:
        if type(value) is not dict or value.keys() != fields.keys():
            raise WireError(f"{cls.__name__} wants the fields {', '.join(fields)}")
        decoded = {}
        for name, field in fields.items():
            try:
                decoded[name] = read(field, value[name])
            except WireError as exc:
                raise WireError(f"{cls.__name__}.{name}: {exc}") from None
        return cls(**decoded)

    return decode_record


WORKER_ENTRY = record(
    WorkerEntry,
    url=TEXT,
    role=choice(Role),
    model=TEXT,
    epoch=INT,
    bootstrap_port=maybe(INT),
    pickable=BOOL,
    usable=BOOL,
    circuit=choice(CircuitState),
    half_open_at=maybe(NUMBER),
    trial=maybe(INT),
)
DECODERS: dict[str, Callable[[Any], Any]] = {
    Hello.TAG: record(Hello, version=INT),
    Snapshot.TAG: record(Snapshot, version=INT, workers=sequence(WORKER_ENTRY)),
    InflightTotals.TAG: record(InflightTotals, totals=mapping(INT), share=maybe(INT)),
    WorkerLoads.TAG: record(WorkerLoads, loads=pairs(INT, NUMBER)),
    MetricsAsk.TAG: record(MetricsAsk, request=INT),
    Report.TAG: record(
        Report,
        version=INT,
        inflight=mapping(INT),
        idle_at=mapping(NUMBER),
        outcomes=rows(TEXT, BOOL, INT),
        ttft=rows(NUMBER, maybe(NUMBER), TEXT),
        tpot=rows(NUMBER, INT, TEXT),
        refused=rows(TEXT, TEXT, INT),
        connections=INT,
    ),
    Suspect.TAG: record(Suspect, url=TEXT),
    StuckPair.TAG: record(StuckPair, prefill=TEXT, decode=TEXT),
    SnapshotRefused.TAG: record(SnapshotRefused, version=INT, routing=INT, reason=TEXT),
    MetricsAnswer.TAG: record(
        MetricsAnswer, request=INT, samples=rows(TEXT, TEXT, TEXT, OBJECT, NUMBER)
    ),
}


# --- consistency ---------------------------------------------------------------------------


def check_consistent(snapshot: Snapshot, routing: int) -> None:
    """InconsistentSnapshot unless ``snapshot`` may replace the one of version ``routing``: its
    version is higher, each worker appears once, and every entry is well-typed and coherent."""
    if type(snapshot.version) is not int or snapshot.version <= routing:
        raise InconsistentSnapshot(
            f"version {snapshot.version!r} does not follow version {routing}"
        )
    urls = set()
    for entry in snapshot.workers:
        if type(entry) is not WorkerEntry or type(entry.url) is not str:
            raise InconsistentSnapshot(f"{entry!r} is not a worker entry")
        if entry.url in urls:
            raise InconsistentSnapshot(f"worker {entry.url} appears twice")
        urls.add(entry.url)
        problem = entry_problem(entry)
        if problem is not None:
            raise InconsistentSnapshot(f"worker {entry.url}: {problem}")


def entry_problem(entry: WorkerEntry) -> str | None:
    """What is wrong with ``entry``, or None."""
    port = entry.bootstrap_port
    if not isinstance(entry.role, Role):
        return f"role {entry.role!r} is not a role"
    if type(entry.model) is not str:
        return f"model {entry.model!r} is not a string"
    if not isinstance(entry.circuit, CircuitState):
        return f"circuit {entry.circuit!r} is not a circuit state"
    if type(entry.epoch) is not int:
        return f"epoch {entry.epoch!r} is not an integer"
    if port is not None and (type(port) is not int or not 0 <= port <= 65535):
        return f"bootstrap port {port!r} is not a port"
    if type(entry.pickable) is not bool or type(entry.usable) is not bool:
        return "pickable and usable are not booleans"
    if entry.pickable and not entry.usable:
        return "pickable but not usable"
    if entry.half_open_at is not None and type(entry.half_open_at) not in (int, float):
        return f"half-open time {entry.half_open_at!r} is not a number"
    if entry.half_open_at is not None and entry.circuit is not CircuitState.OPEN:
        return f"a {entry.circuit} circuit with a half-open time"
    if entry.trial is not None and (type(entry.trial) is not int or entry.trial < 0):
        return f"trial holder {entry.trial!r} is not a data plane"
    if entry.trial is not None and entry.circuit is CircuitState.CLOSED:
        return "a closed circuit with a trial holder"
    return None
