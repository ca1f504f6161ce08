"""Bookkeeping of release-notification subscriptions, shared by the sync notifier (one
reader thread) and the async one (one reader task per event loop). Pure: no I/O, no locks;
the notifiers call it under their own lock or from their loop.

A channel counts as subscribed only once every SUBSCRIBE/UNSUBSCRIBE sent for it has been
answered and the last was a SUBSCRIBE: commands go out in the order of the state changes,
so a late UNSUBSCRIBE can never silently cancel a newer SUBSCRIBE.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["IDLE_UNSUBSCRIBE", "ChannelTable", "Waiter"]

#: A channel nobody waits on is unsubscribed after this many idle seconds, so a burst of
#: waits on one key costs one SUBSCRIBE, not one per waiter.
IDLE_UNSUBSCRIBE = 10.0

_UNSUBSCRIBED, _SUBSCRIBING, _SUBSCRIBED, _UNSUBSCRIBING = range(4)


class Waiter(Protocol):
    """A local waiter: woken by a release message (or when notifications fail)."""

    channel: bytes
    active: bool
    #: The fencing token a fair release handed over with its wake-up (0: none).
    granted: int

    def wake(self) -> None: ...


#: A wake-up that arrives while no local waiter listens (it queued with an attempt made just
#: before it registered here) is kept this long for the next waiter to register.
PENDING_WAKE = 0.25


class _Channel:
    __slots__ = ("expected", "idle_since", "pending_until", "state", "waiters")

    def __init__(self) -> None:
        self.state = _UNSUBSCRIBED
        self.expected: list[bytes] = []
        self.waiters: set[Waiter] = set()
        self.idle_since = 0.0
        self.pending_until = 0.0


class ChannelTable:
    """Which channels are wanted, sent, confirmed; who waits on each."""

    def __init__(self) -> None:
        self._channels: dict[bytes, _Channel] = {}

    def join(self, waiter: Waiter, now: float = 0.0) -> bool:
        """Register ``waiter``; ``True`` when the caller must now send SUBSCRIBE. A wake-up
        that arrived for nobody within :data:`PENDING_WAKE` before ``now`` wakes it at once."""
        channel = self._channels.get(waiter.channel)
        if channel is None:
            channel = self._channels[waiter.channel] = _Channel()
        channel.waiters.add(waiter)
        if channel.pending_until > now:
            channel.pending_until = 0.0
            waiter.wake()
        if channel.state in (_UNSUBSCRIBED, _UNSUBSCRIBING):
            channel.state = _SUBSCRIBING
            channel.expected.append(b"subscribe")
            return True
        return False

    def expects(self, name: bytes, kind: bytes) -> bool:
        """Whether a ``kind`` (subscribe or unsubscribe) confirmation of ``name`` is awaited:
        one that is not was sent by the server on its own."""
        channel = self._channels.get(name)
        return channel is not None and kind in channel.expected

    def subscribed(self, name: bytes) -> bool:
        channel = self._channels.get(name)
        return channel is not None and channel.state == _SUBSCRIBED

    def leave(self, waiter: Waiter, now: float) -> None:
        channel = self._channels.get(waiter.channel)
        if channel is not None:
            channel.waiters.discard(waiter)
            if not channel.waiters:
                channel.idle_since = now

    def reply(self, kind: bytes, name: bytes) -> bool:
        """Account a (un)subscribe confirmation; ``True`` when the channel's state settled."""
        channel = self._channels.get(name)
        if channel is None:
            return False
        if channel.expected:
            channel.expected.pop(0)
        if channel.expected:
            return False
        channel.state = _SUBSCRIBED if kind == b"subscribe" else _UNSUBSCRIBED
        if channel.state == _UNSUBSCRIBED and not channel.waiters:
            del self._channels[name]  # else one entry would stay per key ever waited on
        return True

    def message(self, name: bytes, now: float = 0.0) -> list[Waiter]:
        """The waiters a release message on ``name`` wakes; with none, the wake-up is kept
        for :data:`PENDING_WAKE` (see :meth:`join`)."""
        channel = self._channels.get(name)
        if channel is None:
            return []
        if not channel.waiters:
            channel.pending_until = now + PENDING_WAKE
        return list(channel.waiters)

    def idle(self, now: float) -> list[bytes]:
        """Subscribed channels idle long enough to unsubscribe; marked as being unsubscribed."""
        names = []
        for name, channel in self._channels.items():
            if not channel.waiters and channel.state == _SUBSCRIBED and now - channel.idle_since >= IDLE_UNSUBSCRIBE:
                channel.state = _UNSUBSCRIBING
                channel.expected.append(b"unsubscribe")
                names.append(name)
        return names

    def reset(self) -> list[Waiter]:
        """Forget everything (the connection is gone); return every waiter, made inactive."""
        waiters = [waiter for channel in self._channels.values() for waiter in channel.waiters]
        for waiter in waiters:
            waiter.active = False
        self._channels.clear()
        return waiters
