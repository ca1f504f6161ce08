"""Giving a multi-key lock back: every hold of the set at once, and the releases that must go
to the store in one call when the store can release many keys in one round trip
(:class:`~lockaspect.backends.base.ReleasesMany`), key by key otherwise. The decisions are
here, once, for both runners (:func:`release_all` for threads, :func:`arelease_all` for an
event loop): they differ only in awaiting the store."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..backends.base import ReleaseStatus
from ..errors import BackendError
from ..lease import Lease
from .core import Engine
from .holds import Hold

__all__ = ["arelease_all", "give_back_all", "release_all", "settle"]


def _give_back_one(engine: Engine, hold: Hold) -> Lease | None:
    ref, hold.ref = hold.ref, None
    return None if ref is None else engine.give_back(ref)


def give_back_all(engine: Engine, holds: Sequence[Hold], many: bool) -> list[list[Lease]]:
    """Give back every hold of ``holds`` (see ``Engine.give_back``): the leases whose release
    must go to the store, in groups of one store call each: the locks of one owner token (a
    multi-key lock's set) together when the store releases ``many`` at once, else one by one.

    Only for a store that releases many at once: key by key, each hold is given back right
    before its own release (see :func:`release_all`), since a lease given back is no longer
    renewed, and a slow release of one key (a hand-over to a waiter) must not let the leases
    of the keys after it run out meanwhile."""
    leases: list[Lease] = []
    for hold in reversed(holds):
        lease = _give_back_one(engine, hold)
        if lease is not None:
            leases.append(lease)
    if not many or len(leases) < 2:
        return [[lease] for lease in leases]
    groups: dict[str, list[Lease]] = {}
    alone: list[list[Lease]] = []
    for lease in leases:
        if lease.kind == "lock":
            groups.setdefault(lease.token, []).append(lease)
        else:
            alone.append([lease])
    return [*groups.values(), *alone]


def settle(engine: Engine, leases: list[Lease], statuses: Sequence[ReleaseStatus] | BackendError) -> None:
    """Act on the store's answer for each lease of one call (``Engine.release_done``): its own
    status, or the failure of the call as a whole."""
    for i, lease in enumerate(leases):
        engine.release_done(lease, statuses if isinstance(statuses, BackendError) else statuses[i])


def _failed_locally(engine: Engine, leases: list[Lease]) -> None:
    for lease in leases:
        engine.release_failed_locally(lease)


def release_all(engine: Engine, store: Any, holds: Sequence[Hold], release: Callable[[Lease], None]) -> None:
    """Give back a multi-key lock's ``holds`` (threads); ``release`` sends a lone lease's. Key by
    key in reverse order when the store has no ``release_many`` (the first key, the one
    waiters queue on, goes last: a waiter woken by it finds the rest free)."""
    many: Any = getattr(store, "release_many", None)
    if many is None:
        for hold in reversed(holds):
            lease = _give_back_one(engine, hold)
            if lease is not None:
                release(lease)
        return
    for leases in give_back_all(engine, holds, True):
        if len(leases) == 1:
            release(leases[0])
            continue
        statuses: Sequence[ReleaseStatus] | BackendError
        try:
            statuses = many([lease.key for lease in leases], leases[0].token)
        except BackendError as exc:
            statuses = exc
        except BaseException:
            _failed_locally(engine, leases)
            raise
        settle(engine, leases, statuses)


async def arelease_all(
    engine: Engine, store: Any, holds: Sequence[Hold], release: Callable[[Lease], Awaitable[None]]
) -> None:
    """:func:`release_all` for an event loop (``store``: the loop's async store)."""
    many: Any = getattr(store, "release_many", None)
    if many is None:
        for hold in reversed(holds):
            lease = _give_back_one(engine, hold)
            if lease is not None:
                await release(lease)
        return
    for leases in give_back_all(engine, holds, True):
        if len(leases) == 1:
            await release(leases[0])
            continue
        statuses: Sequence[ReleaseStatus] | BackendError
        try:
            statuses = await many([lease.key for lease in leases], leases[0].token)
        except BackendError as exc:
            statuses = exc
        except BaseException:
            _failed_locally(engine, leases)
            raise
        settle(engine, leases, statuses)
