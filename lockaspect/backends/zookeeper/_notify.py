"""Wake-ups of the ZooKeeper store's waiters: a hub of subscriptions keyed by ``(namespaced
key, waiter id)``, woken from kazoo's threads (a watch on the waiter's predecessor fired, or
the session changed state) and waited on by threads or by tasks.

A contender node's watch belongs to the waiter that made it: only that waiter wakes (no herd,
not even within one process). A watch that fires before its waiter subscribed is kept as a
pending wake-up, which the next subscription of that waiter consumes at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..._wakeup import AsyncWakeup, Wakeup

__all__ = ["ARMED_TRUST", "AsyncZooKeeperNotifier", "Hub", "ZooKeeperNotifier"]

Channel = tuple[str, str]

#: Seconds an armed channel is trusted without a round trip. Past that, the waiter's next
#: attempt re-reads its queue and sets its watch again: a watch that can no longer fire (one
#: lost in a way nothing reported) costs a waiter this long, not the rest of its wait. Notified
#: waiters re-check at least every NOTIFY_RECHECK (1 s), so this is about one round trip per
#: waiting key every few seconds.
ARMED_TRUST = 3.0


class _Waiter(Protocol):
    channel: Channel
    active: bool

    def wake(self) -> None: ...


class Hub:
    """Subscriptions by channel, shared by a store, its twins and their notifiers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.channels: dict[Channel, set[_Waiter]] = {}
        self.pending: set[Channel] = set()
        self.wakers: dict[Channel, Callable[[Any], None]] = {}
        # Channels whose watch is set and has not fired since (with when it was armed): their
        # queue place cannot have moved up, so an attempt needs no round trip to know it is
        # still busy, for up to ARMED_TRUST seconds.
        self.armed: dict[Channel, float] = {}

    def arm(self, channel: Channel) -> None:
        """About to set ``channel``'s watch (armed before it is sent: its firing, whenever
        that comes, disarms it)."""
        with self.lock:
            self.armed[channel] = time.monotonic()

    def disarm(self, channel: Channel) -> None:
        with self.lock:
            self.armed.pop(channel, None)

    def is_armed(self, channel: Channel) -> bool:
        """Whether ``channel``'s watch is set, has not fired, and was set less than
        :data:`ARMED_TRUST` seconds ago (an older one is checked with a round trip)."""
        since = self.armed.get(channel)
        return since is not None and time.monotonic() - since < ARMED_TRUST

    def waker(self, channel: Channel) -> Callable[[Any], None]:
        """The watch function that wakes ``channel``: one object per channel, so a watch set
        again on the same node is one watch (kazoo keeps watch functions in a set)."""
        with self.lock:
            found = self.wakers.get(channel)
            if found is None:

                def found(event: Any) -> None:
                    self.wake(channel)

                found.paths = set()  # type: ignore[attr-defined]  # where it is set (see Session)
                self.wakers[channel] = found
            return found

    def wake(self, channel: Channel) -> None:
        """Wake ``channel``'s subscribers, or keep the wake-up for its next subscription."""
        with self.lock:
            self.armed.pop(channel, None)
            listeners = list(self.channels.get(channel, ()))
            if not listeners and channel in self.wakers:  # a forgotten channel keeps nothing
                self.pending.add(channel)
        for waiter in listeners:
            waiter.wake()

    def wake_all(self) -> None:
        """Wake everyone (the session changed: every waiter re-checks its place)."""
        with self.lock:
            self.armed.clear()
            listeners = [w for group in self.channels.values() for w in group]
        for waiter in listeners:
            waiter.wake()

    def forget(self, channel: Channel) -> Callable[[Any], None] | None:
        """The channel's contender is gone: drop a wake-up kept for it, and its watch function
        (returned, for the session to take it off kazoo's watcher sets)."""
        with self.lock:
            self.pending.discard(channel)
            self.armed.pop(channel, None)
            return self.wakers.pop(channel, None)

    def join(self, waiter: _Waiter) -> None:
        with self.lock:
            self.channels.setdefault(waiter.channel, set()).add(waiter)
            fired = waiter.channel in self.pending
            self.pending.discard(waiter.channel)
        if fired:
            waiter.wake()

    def leave(self, waiter: _Waiter) -> None:
        with self.lock:
            listeners = self.channels.get(waiter.channel)
            if listeners is not None:
                listeners.discard(waiter)
                if not listeners:
                    del self.channels[waiter.channel]

    def listening(self, channel: Channel) -> bool:
        with self.lock:
            return bool(self.channels.get(channel))

    def clear(self) -> None:
        with self.lock:
            self.channels.clear()
            self.pending.clear()
            self.wakers.clear()
            self.armed.clear()


class _Subscription:
    __slots__ = ("_event", "active", "channel")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.active = True
        self._event = Wakeup()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def wake(self) -> None:
        self._event.set()


class _AsyncSubscription:
    __slots__ = ("_wakeup", "active", "channel")

    def __init__(self, channel: Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.channel = channel
        self.active = True
        self._wakeup = AsyncWakeup(loop)

    async def wait(self, timeout: float) -> bool:
        return await self._wakeup.wait(timeout)

    def wake(self) -> None:
        self._wakeup.wake()


class _NotifierBase:
    def __init__(self, hub: Hub, namespace: str) -> None:
        self._hub = hub
        self._namespace = namespace
        #: The id coalesced waiters of this notifier queue under (one contender node).
        self.waiter_id = "n" + os.urandom(8).hex()
        self._mine: set[Any] = set()
        self._closed = False

    def _join(self, waiter: Any) -> None:
        if self._closed:
            waiter.active = False
            return
        self._mine.add(waiter)
        self._hub.join(waiter)

    def listening(self, key: str) -> bool:
        """Always: a waiter's wake-up comes from the watch its own attempt sets, so a first
        attempt may keep its queue place (its node) at once, as kazoo's recipe does."""
        return True

    def unsubscribe(self, subscription: Any) -> None:
        self._hub.leave(subscription)
        self._mine.discard(subscription)

    def close(self) -> None:
        self._closed = True
        mine, self._mine = self._mine, set()
        for waiter in mine:
            self._hub.leave(waiter)
            waiter.active = False
            waiter.wake()


class ZooKeeperNotifier(_NotifierBase):
    """The :class:`~lockaspect.backends.base.Notifier`: a subscription is active at once
    (the watch was set by the waiter's last attempt, which ZooKeeper confirmed)."""

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        subscription = _Subscription((self._namespace + key, waiter or self.waiter_id))
        self._join(subscription)
        return subscription


class AsyncZooKeeperNotifier(_NotifierBase):
    """The :class:`~lockaspect.backends.base.AsyncNotifier` of one event loop."""

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        subscription = _AsyncSubscription((self._namespace + key, waiter or self.waiter_id), asyncio.get_running_loop())
        self._join(subscription)
        return subscription

    async def aclose(self) -> None:
        self.close()
