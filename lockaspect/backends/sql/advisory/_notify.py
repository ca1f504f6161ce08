"""Waiting on the server's queue, for the engine's LISTEN and PAUSE steps.

A busy attempt made with a waiter id queues that waiter in PostgreSQL itself: a blocking
``pg_advisory_lock`` on a session of its own (see :mod:`._ops`). A subscription's ``wait``
waits for that statement to end (the server granted the lock, or it failed), at most the
pause the engine asks for; a pause that ends first leaves the statement running, so the
waiter keeps its place in the server's FIFO queue across the engine's rechecks. Without a
queued wait (no session to spare, or not queued yet) ``wait`` sleeps the pause: the waiter
then polls.

Subscriptions are confirmed at once (nothing to confirm). Waiting inside ``wait`` also tells
the store the waiter is alive (see ``_state.GONE_AFTER``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from ._ops import Core
from ._state import Pending

__all__ = ["AsyncNotifier", "Notifier"]


class _Base:
    def __init__(self, core: Core) -> None:
        self._core = core
        #: This notifier's waiter id (what coalesced waiters of one process queue under).
        self.waiter_id = "n" + os.urandom(8).hex()
        self._listening: dict[str, int] = {}
        self.closed = False

    def listening(self, key: str) -> bool:
        """Whether a waiter of this notifier waits for ``key`` now (or holds its place)."""
        with self._core.lock:
            return bool(self._listening.get(key)) or self._core.table.wait_of(key, self.waiter_id) is not None

    def _join(self, key: str) -> None:
        with self._core.lock:
            self._listening[key] = self._listening.get(key, 0) + 1

    def unsubscribe(self, subscription: Any) -> None:
        if subscription.joined:
            subscription.joined = False
            with self._core.lock:
                left = self._listening.get(subscription.key, 0) - 1
                if left > 0:
                    self._listening[subscription.key] = left
                else:
                    self._listening.pop(subscription.key, None)

    def _enter(self, key: str, waiter: str) -> Pending | None:
        with self._core.lock:
            pending = self._core.table.wait_of(key, waiter)
            if pending is not None:
                pending.watchers += 1
                pending.seen = time.monotonic()
            return pending

    def _leave(self, pending: Pending) -> None:
        with self._core.lock:
            pending.watchers -= 1
            pending.seen = time.monotonic()


class _Subscription:
    __slots__ = ("active", "joined", "key", "notifier", "waiter")

    def __init__(self, notifier: Notifier, key: str, waiter: str) -> None:
        self.notifier = notifier
        self.key = key
        self.waiter = waiter
        self.active = not notifier.closed
        self.joined = True

    def wait(self, timeout: float) -> bool:
        """Until the queued wait ends (``True``) or ``timeout`` passes (``False``)."""
        notifier = self.notifier
        pending = notifier._enter(self.key, self.waiter)
        if pending is None:
            notifier._stop.wait(max(0.0, timeout))
            return notifier.closed
        try:
            return pending.done.wait(max(0.0, timeout))
        finally:
            notifier._leave(pending)


class Notifier(_Base):
    """The thread store's notifier (a :class:`~lockaspect.backends.base.Notifier`)."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._stop = threading.Event()

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        self._join(key)
        return _Subscription(self, key, waiter or self.waiter_id)

    def close(self) -> None:
        self.closed = True
        self._stop.set()


class _AsyncSubscription:
    __slots__ = ("active", "joined", "key", "notifier", "waiter")

    def __init__(self, notifier: AsyncNotifier, key: str, waiter: str) -> None:
        self.notifier = notifier
        self.key = key
        self.waiter = waiter
        self.active = not notifier.closed
        self.joined = True

    async def wait(self, timeout: float) -> bool:
        notifier = self.notifier
        pending = notifier._enter(self.key, self.waiter)
        if pending is None:
            try:
                await asyncio.wait_for(notifier._stop.wait(), max(0.0, timeout))
            except asyncio.TimeoutError:
                pass
            return notifier.closed
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(_resolve, future)

        try:
            with notifier._core.lock:
                ended = pending.done.is_set()
                if not ended:
                    pending.listeners.append(wake)
            if ended:
                return True
            try:
                return await asyncio.wait_for(asyncio.shield(future), max(0.0, timeout))
            except asyncio.TimeoutError:
                return pending.done.is_set()
        finally:
            with notifier._core.lock:
                if wake in pending.listeners:
                    pending.listeners.remove(wake)
            notifier._leave(pending)


def _resolve(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(True)


class AsyncNotifier(_Base):
    """An asyncio twin's notifier (a :class:`~lockaspect.backends.base.AsyncNotifier`)."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._stop = asyncio.Event()

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        self._join(key)
        return _AsyncSubscription(self, key, waiter or self.waiter_id)

    def close(self) -> None:
        self.closed = True
        self._stop.set()
