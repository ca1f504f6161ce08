"""Same-process wake-ups for the lease table's waiters.

The table has no message bus: a waiter polls, with the engine's jittered backoff bounded by
the holder's remaining lease. A release made by this process wakes this process's waiters of
that key at once (every store on the same database shares one :class:`Hub`), so a handoff
between threads or tasks of one process does not wait for the next poll. The subscriptions
never report ``active``: a release by another process sends no message, so the engine keeps
its polling cadence.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Protocol

from ...._wakeup import AsyncWakeup, Wakeup

__all__ = ["AsyncTableNotifier", "Hub", "TableNotifier", "hub_for"]


class _Waiter(Protocol):
    name: str

    def wake(self) -> None: ...


class Hub:
    """Who waits for which key (namespaced) in this process, for one database."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, set[_Waiter]] = {}

    def join(self, waiter: _Waiter) -> None:
        with self._lock:
            self._waiting.setdefault(waiter.name, set()).add(waiter)

    def leave(self, waiter: _Waiter) -> None:
        with self._lock:
            found = self._waiting.get(waiter.name)
            if found is not None:
                found.discard(waiter)
                if not found:
                    del self._waiting[waiter.name]

    def listening(self, name: str) -> bool:
        return name in self._waiting

    def wake(self, name: str) -> None:
        """Wake every waiter of ``name`` (a release or a force-release of it)."""
        if name not in self._waiting:  # the usual case: nobody waits, no lock taken
            return
        with self._lock:
            found = list(self._waiting.get(name, ()))
        for waiter in found:
            waiter.wake()

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._waiting = {}


_hubs: dict[str, Hub] = {}
_hubs_lock = threading.Lock()


def hub_for(identity: str) -> Hub:
    """The hub of the database ``identity`` names (a file's real path, a server's address)."""
    with _hubs_lock:
        found = _hubs.get(identity)
        if found is None:
            found = _hubs[identity] = Hub()
        return found


def _after_fork_in_child() -> None:
    global _hubs_lock
    _hubs_lock = threading.Lock()
    for hub in _hubs.values():
        hub.reset()


if hasattr(os, "register_at_fork"):  # pragma: no branch - absent on Windows only
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Subscription:
    __slots__ = ("_event", "name")

    active = False

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = Wakeup()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def wake(self) -> None:
        self._event.set()


class _AsyncSubscription:
    __slots__ = ("_wakeup", "name")

    active = False

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self._wakeup = AsyncWakeup(loop)

    async def wait(self, timeout: float) -> bool:
        return await self._wakeup.wait(timeout)

    def wake(self) -> None:
        self._wakeup.wake()


class _NotifierBase:
    def __init__(self, hub: Hub, namespace: str) -> None:
        self._hub = hub
        self._namespace = namespace
        #: The id coalesced waiters of this notifier would queue under (the table keeps no
        #: queue for them: nothing to wake across processes).
        self.waiter_id = os.urandom(8).hex()
        self._mine: set[Any] = set()
        self._closed = False

    def listening(self, key: str) -> bool:
        return self._hub.listening(self._namespace + key)

    def unsubscribe(self, subscription: Any) -> None:
        self._hub.leave(subscription)
        self._mine.discard(subscription)

    def _join(self, subscription: Any) -> None:
        if not self._closed:
            self._hub.join(subscription)
            self._mine.add(subscription)

    def close(self) -> None:
        """Wake this notifier's waiters (they re-check at once) and stop."""
        self._closed = True
        mine, self._mine = self._mine, set()
        for subscription in mine:
            self._hub.leave(subscription)
            subscription.wake()


class TableNotifier(_NotifierBase):
    """The :class:`~lockaspect.backends.base.Notifier` of the lease-table stores (threads)."""

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        subscription = _Subscription(self._namespace + key)
        self._join(subscription)
        return subscription


class AsyncTableNotifier(_NotifierBase):
    """:class:`TableNotifier` for one event loop."""

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        subscription = _AsyncSubscription(self._namespace + key, asyncio.get_running_loop())
        self._join(subscription)
        return subscription
