"""The per-lease side of :class:`~lockaspect.LockClient`: take a lock in one place and release
it in another (:meth:`~Manual.acquire`, :meth:`~Manual.aacquire`), act on a lock another
process took by its token (:meth:`~Manual.adopt`), and semaphore holds of several permits
(:func:`weighted`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .backends.base import AdminStore, Capability
from .engine.manual import Handle
from .errors import ConfigurationError, LockLost
from .keys import check_key
from .kinds import LockKind, semaphore
from .lease import Lease, _push_weak
from .options import LockSpec, OnLost

if TYPE_CHECKING:
    from .engine.core import Engine

__all__ = ["Manual", "weighted"]


@dataclass(frozen=True, slots=True)
class _WeightedSpec(LockSpec):
    """A semaphore's options whose holds take ``weight`` permits."""

    weight: int = 1

    @property
    def kind(self) -> LockKind:
        assert self.permits is not None
        return semaphore(self.permits, self.weight)


def weighted(spec: LockSpec, count: object) -> LockSpec:
    """``spec`` (a semaphore's) taking ``count`` permits per hold; checked before any I/O."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    if count == 1:
        return spec
    if spec.permits is None:
        raise ConfigurationError("count= takes several permits of a semaphore: give permits= too")
    if not 1 <= count <= spec.permits:
        raise ConfigurationError(f"count must be between 1 and permits ({spec.permits}), got {count}")
    values = {field.name: getattr(spec, field.name) for field in fields(LockSpec)}
    return _WeightedSpec(**values, weight=count)


def _spec(count: object, **options: Any) -> LockSpec:
    return weighted(LockSpec.create(**options), count)


class Manual:
    """The per-lease calls of :class:`~lockaspect.LockClient` (a mixin: see the module)."""

    _engine: Engine
    backend: Any

    def acquire(
        self,
        key: str,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
        fair: bool = False,
        permits: int | None = None,
        count: int = 1,
        mode: str | None = None,
    ) -> Lease:
        """Take ``key`` and return its :class:`~lockaspect.Lease`, to release later with
        ``lease.release()``, in this function or another (the redis-py / Redisson style).

        The options of :meth:`lock`, and ``permits=`` (with ``count=``) for a semaphore or
        ``mode="read"``/``"write"`` for a read-write lock. Until it is released the lease is
        renewed (``lease=None``: the watchdog) and counts as held by this context: a nested
        ``client.lock`` or ``acquire`` of the key re-enters it (``lease.hold_count``), and
        :func:`~lockaspect.current_lease` finds it. A lease never released is renewed until the
        client closes; one dropped without a release is logged at WARNING when it is
        garbage-collected, and given back then. Raises as :meth:`lock` does on entering.

        Example::

            lease = client.acquire("report:daily", wait=5)
            try:
                build_report(fence=lease.fencing_token)
            finally:
                lease.release()
        """
        spec = _spec(
            count, lease=lease, wait=wait, delay_weight=delay_weight, on_lost=on_lost, max_hold=max_hold,
            wait_strategy=wait_strategy, fair=fair, permits=permits, mode=mode,
        )  # fmt: skip
        hold = self._engine.sync.acquire(check_key(key), spec)
        handle = Handle(hold)
        _push_weak(hold.lease)
        return handle

    async def aacquire(
        self,
        key: str,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
        fair: bool = False,
        permits: int | None = None,
        count: int = 1,
        mode: str | None = None,
    ) -> Lease:
        """:meth:`acquire` for asyncio: ``lease = await client.aacquire(key)``, then
        ``await lease.arelease()``. Waiting does not block the event loop. Unlike ``async
        with``, nothing cancels the task if the lease is lost: check ``lease.held`` or use
        ``on_lost``."""
        spec = _spec(
            count, lease=lease, wait=wait, delay_weight=delay_weight, on_lost=on_lost, max_hold=max_hold,
            wait_strategy=wait_strategy, fair=fair, permits=permits, mode=mode,
        )  # fmt: skip
        hold = await self._engine.aio.acquire(check_key(key), spec)
        handle = Handle(hold)
        _push_weak(hold.lease)
        return handle

    def adopt(self, key: str, token: str, *, kind: str | None = None, renew: bool = False) -> Lease:
        """A :class:`~lockaspect.Lease` for the hold of ``key`` that another process (or
        client) took, by its owner token (``lease.token`` there): extend it, release it, or
        ask whether it is still held (python-redis-lock's ``Lock(id=...)``).

        One round trip to find the hold (its kind, fencing token and remaining lease; ``kind``
        picks one where the key holds several). The adopted lease is not renewed unless
        ``renew=True`` (then the watchdog renews it until it is released, as a ``lease=None``
        lock); it counts as held until its lease ends. Works on stores whose holds are leases
        (Redis, memory, SQL lease tables); a ZooKeeper or PostgreSQL advisory hold belongs to
        the session that took it (:class:`ConfigurationError`).

        Raises:
            LockLost: the store has no hold of ``key`` for ``token`` (reason ``"not-owner"``).
            ConfigurationError: the store cannot describe its holds, or its holds are
                session-bound; a bad ``kind``.
        """
        from .info import check_kind

        key = check_key(key)
        if not isinstance(token, str) or not token:
            raise TypeError("token must be the holder's owner token (a non-empty str)")
        group = check_kind(kind)
        engine = self._engine
        store = self.backend
        if store.capabilities & Capability.SESSION_BOUND:
            raise ConfigurationError(
                f"{store!r} holds locks for the session that took them: another process cannot adopt one", key=key
            )
        if not isinstance(store, AdminStore):
            raise ConfigurationError(f"adopt: {store!r} cannot describe its locks", key=key)
        sent = engine.clock()
        for state in store.describe(key):
            for holder in state.held_by:
                if holder.token != token or (group is not None and _group(state.kind) != group):
                    continue
                left = 1e-3 if holder.remaining is None else max(1e-3, holder.remaining)
                permits = state.permits if state.kind == "semaphore" else None
                mode = state.kind if state.kind in ("read", "write") else None
                spec = LockSpec.create(
                    lease=None if renew else left, permits=permits, fair=state.kind == "fair", mode=mode
                )
                spec = weighted(spec, holder.weight if permits is not None else 1)
                plan = engine.plan(spec, key)
                made = engine.new_lease(key, token, holder.fencing_token or 0, left, spec, plan, sent)
                made.lease.acquired_at = time.time()
                return Handle(made)
        raise LockLost(f"the store has no hold of {key!r} for that token", key=key, reason="not-owner")


def _group(kind: str) -> str:
    from .info import KIND_FILTERS

    return KIND_FILTERS.get(kind, kind)
