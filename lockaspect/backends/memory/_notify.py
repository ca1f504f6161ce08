"""Release notifications of the memory store: a hub of channels shared by every store on one
state, and the notifiers (one per store, threads) and async notifiers (one per event loop's
twin) that subscribe waiters to it.

A channel is ``(namespaced key, waiter id)``, as Redis's ``…{key}:wake:<id>``. A release
that pops a waiter id from a queue publishes on its channel (:meth:`Hub.publish`, under the
store's lock); the store wakes the collected subscriptions after it let the lock go, so
nothing waits or runs foreign code while the lock is held. A sync subscription wakes on a
:class:`~lockaspect._wakeup.Wakeup`; an async one with ``loop.call_soon_threadsafe`` (the
release may run on another thread or event loop).
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Protocol

from ..._wakeup import AsyncWakeup, Wakeup

__all__ = ["AsyncMemoryNotifier", "Hub", "MemoryNotifier"]

Channel = tuple[str, str]


class _Shared(Protocol):
    """What a notifier uses of the state it serves (see ``store.Shared``): replaced in a
    forked child, so always read through this object."""

    mutex: threading.Lock
    hub: Hub


class _Waiter(Protocol):
    channel: Channel
    active: bool
    granted: int

    def wake(self) -> None: ...


class Hub:
    """Who listens on which channel, and the wake-ups a store operation produced (to be
    delivered once the store's lock is released). Guarded by the store's lock."""

    def __init__(self) -> None:
        self.channels: dict[Channel, set[_Waiter]] = {}
        self.fired: list[_Waiter] = []

    def publish(self, key: str, waiter: str, granted: int = 0) -> int:
        """Wake the listeners of ``(key, waiter)`` (``granted``: the fencing token of the hold
        the release gave that waiter); how many channels received it (0 or 1)."""
        listeners = self.channels.get((key, waiter))
        if not listeners:
            return 0
        if granted:
            for listener in listeners:
                listener.granted = granted
        self.fired.extend(listeners)
        return 1

    def take(self) -> list[_Waiter]:
        fired, self.fired = self.fired, []
        return fired

    def join(self, waiter: _Waiter) -> None:
        self.channels.setdefault(waiter.channel, set()).add(waiter)

    def leave(self, waiter: _Waiter) -> None:
        listeners = self.channels.get(waiter.channel)
        if listeners is not None:
            listeners.discard(waiter)
            if not listeners:
                del self.channels[waiter.channel]

    def listening(self, channel: Channel) -> bool:
        return bool(self.channels.get(channel))

    def clear(self) -> None:
        self.channels.clear()
        self.fired.clear()


class _Subscription:
    """A thread's registration for one channel (see :class:`~lockaspect.backends.base.Subscription`)."""

    __slots__ = ("_event", "active", "channel", "granted")

    def __init__(self, channel: Channel, active: bool) -> None:
        self.channel = channel
        self.active = active
        self.granted = 0  # see Capability.FAIR_HANDOFF
        self._event = Wakeup()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def wake(self) -> None:
        self._event.set()


class _AsyncSubscription:
    """A task's registration for one channel; woken from any thread through its loop."""

    __slots__ = ("_wakeup", "active", "channel", "granted")

    def __init__(self, channel: Channel, loop: asyncio.AbstractEventLoop, active: bool) -> None:
        self.channel = channel
        self.active = active
        self.granted = 0  # see Capability.FAIR_HANDOFF
        self._wakeup = AsyncWakeup(loop)

    async def wait(self, timeout: float) -> bool:
        """Wait for a wake-up (one that came since the last wait counts) or ``timeout``."""
        return await self._wakeup.wait(timeout)

    def wake(self) -> None:
        self._wakeup.wake()


class _NotifierBase:
    """What both notifiers share: the hub, the store's lock and namespace, the waiter id."""

    def __init__(self, shared: _Shared, namespace: str) -> None:
        self._shared = shared
        self._namespace = namespace
        #: This notifier's waiter id (queued by coalesced waiters of one store or loop).
        self.waiter_id = os.urandom(8).hex()
        self._mine: set[_Waiter] = set()
        self._closed = False

    def _join(self, waiter: _Waiter) -> None:
        with self._shared.mutex:
            if self._closed:
                waiter.active = False
                return
            self._shared.hub.join(waiter)
            self._mine.add(waiter)

    def listening(self, key: str, waiter: str | None = None) -> bool:
        """Whether a waiter of this notifier (``waiter``, default :attr:`waiter_id`) listens
        for ``key``'s wake-ups now."""
        with self._shared.mutex:
            return self._shared.hub.listening((self._namespace + key, waiter or self.waiter_id))

    def unsubscribe(self, subscription: Any) -> None:
        with self._shared.mutex:
            self._shared.hub.leave(subscription)
            self._mine.discard(subscription)

    def close(self) -> None:
        """Wake every waiter of this notifier (made inactive, they poll) and stop."""
        with self._shared.mutex:
            self._closed = True
            mine, self._mine = self._mine, set()
            for waiter in mine:
                self._shared.hub.leave(waiter)
                waiter.active = False
        for waiter in mine:
            waiter.wake()


class MemoryNotifier(_NotifierBase):
    """The :class:`~lockaspect.backends.base.Notifier` of a :class:`MemoryStore`: a
    subscription is active at once (nothing to confirm) and woken by a release's wake-up."""

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        subscription = _Subscription((self._namespace + key, waiter or self.waiter_id), True)
        self._join(subscription)
        return subscription


class AsyncMemoryNotifier(_NotifierBase):
    """The :class:`~lockaspect.backends.base.AsyncNotifier` of an :class:`AsyncMemoryStore`."""

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        loop = asyncio.get_running_loop()
        subscription = _AsyncSubscription((self._namespace + key, waiter or self.waiter_id), loop, True)
        self._join(subscription)
        return subscription

    async def aclose(self) -> None:
        self.close()
