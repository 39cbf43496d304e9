"""What the request path picks from: :class:`Pools`, and :func:`choose`, the pick of one pool
wherever its workers come from (:class:`pd_router.dataplane.routing.snapshot.SnapshotPools`
calls it for each role)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from pd_router.dataplane.routing.policies import Policy
from pd_router.dataplane.routing.target import Target
from pd_router.errors import NoWorkers
from pd_router.roles import Role


class InRole(Protocol):
    """What a route holds: workers with a role (a snapshot's members)."""

    role: Role


T = TypeVar("T", bound=InRole)


class Route(Generic[T]):
    """One model's pools: what a request for it picks from. ``regular``: the model has no
    prefill or decode worker, so a request goes to one of its regular workers whole."""

    __slots__ = ("model", "pools", "regular")

    def __init__(self, model: str, members: Iterable[T], regular: bool) -> None:
        self.model = model
        self.regular = regular
        self.pools: dict[Role, list[T]] = {role: [] for role in Role}
        for member in members:
            self.pools[member.role].append(member)


class Pools(Protocol):
    def route(self, model: object) -> Route[Any]:
        """The pools of the model a request names (ModelNotFound, ModelRequired)."""
        ...

    def pick(
        self,
        role: Role,
        avoid: Iterable[Target] = (),
        prompt: Callable[[], str] | None = None,
        route: Route[Any] | None = None,
    ) -> Target:
        """A worker of ``role`` in ``route`` (None: the only model's) by its pool's policy
        (NoWorkers if none)."""
        ...

    def acquire(self, target: Target) -> None: ...
    def release(self, target: Target) -> None: ...

    def suspect(self, target: Target) -> None:
        """The worker answered for the other role: have its role read now."""
        ...

    def stuck(self, prefill: Target, decode: Target) -> None:
        """The pair missed its rendezvous: have the decode forget the prefill's endpoints."""
        ...


def choose(
    role: Role,
    workers: Sequence[Target],
    avoid: Iterable[Target],
    policy: Policy,
    prompt: Callable[[], str] | None,
    count_refusal: Callable[[str, str], None],
    model: str = "",
) -> Target:
    """The pick of a pool, wherever its workers come from: one of ``workers`` (the selectable
    ones, or when none is, those kept out only by their circuits), preferring those not in
    ``avoid`` (they already failed this request), chosen by ``policy``; NoWorkers (and a
    refusal of ``model`` counted) if there is none. ``prompt`` is called only for a policy
    that needs it."""
    if avoid and len(workers) > 1:
        avoided = set(avoid)
        fresh = [w for w in workers if w not in avoided]
        if fresh:
            workers = fresh
    if not workers:
        count_refusal(role.value, model)
        raise NoWorkers(f"no available {role.value} worker (none active, healthy and closed)")
    if policy.needs_prompt and prompt is not None:
        return policy.select(workers, prompt())
    return policy.select(workers)
