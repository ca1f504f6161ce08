"""What one client knows about its advisory locks, with no I/O: the holds (which owner token
holds which advisory key on which session), the places in the server's queue (pending waits),
the conflicts decided locally, and how a lock key becomes advisory keys.

A PostgreSQL session never conflicts with itself (it may take a lock it holds again, and a
shared lock under its own exclusive one), so two owners of one client must be kept apart
here, before any statement: :meth:`Table.conflict`. Callers hold the store's lock around every
method (one :class:`Table` serves a store and its asyncio twins).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from .._keys import advisory_key

__all__ = ["CLOSED", "FAILED", "GRANTED", "WAITING", "Hold", "Pending", "Table", "lock_key", "slot_keys"]

#: A pending wait's states: queued in the server, granted (the lock is ours, waiting to be
#: claimed by the waiter's next attempt), failed (the statement failed), closed (claimed,
#: cancelled or unlocked).
WAITING, GRANTED, FAILED, CLOSED = range(4)


def lock_key(namespace: str, key: str) -> int:
    """The advisory key of ``key`` (lock, fair lock, read-write lock, multi-key locks)."""
    return advisory_key(namespace + key)


def slot_keys(namespace: str, key: str, permits: int) -> list[int]:
    """The advisory keys of a semaphore's slots: slot ``i`` is ``namespace + key + ':slot:' + i``."""
    name = namespace + key
    return [advisory_key(f"{name}:slot:{i}") for i in range(permits)]


@dataclass(eq=False, slots=True)
class Hold:
    """One owner token's hold of one advisory key (a semaphore's hold of several permits: of
    ``objkey`` and the slots in ``more``), pinned to the session that took it."""

    key: str
    token: str
    kind: str
    objkey: int
    shared: bool
    session: Any
    fence: int
    more: tuple[int, ...] = ()
    #: A reader's place among this client's readers of the key on its session (its row of
    #: ``lockaspect_advisory_reader``).
    place: int = 0

    @property
    def objkeys(self) -> tuple[int, ...]:
        return (self.objkey, *self.more) if self.more else (self.objkey,)


@dataclass(eq=False, slots=True)
class Pending:
    """A waiter's place in the server's queue: a blocking ``pg_advisory_lock`` running on a
    session of its own. When granted, the lock is the waiter's: its next attempt claims it,
    nobody else's may (see the package docstring)."""

    key: str
    waiter: str
    kind: str
    objkey: int
    shared: bool
    session: Any
    seen: float
    state: int = WAITING
    fence: int = 0
    error: BaseException | None = None
    #: Subscriptions inside ``wait()`` now: a waiter that is there is not gone.
    watchers: int = 0
    #: Set when the statement ended (granted, failed or cancelled).
    done: threading.Event = field(default_factory=threading.Event)
    #: Set when the wait is over for good: claimed, or left (its runner may stop watching).
    over: threading.Event = field(default_factory=threading.Event)
    #: Set when its runner is done with it (a cancelled wait's lock, if it got one, is unlocked).
    settled: threading.Event = field(default_factory=threading.Event)
    #: The waiter left while the statement ran: a lock it still gets is unlocked at once.
    cancelled: bool = False
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def finish(self, state: int, fence: int = 0, error: BaseException | None = None) -> list[Callable[[], None]]:
        """Record the statement's outcome; the listeners to call (outside the store's lock)."""
        if self.state == WAITING:
            self.state, self.fence, self.error = state, fence, error
        self.done.set()
        listeners, self.listeners = self.listeners, []
        return listeners


class Table:
    """The holds and pending waits of one client (see the module docstring)."""

    def __init__(self) -> None:
        self.holds: dict[tuple[str, str], Hold] = {}  # (token, key) -> hold
        self.by_objkey: dict[int, list[Hold]] = {}
        self.pending: dict[tuple[str, str], Pending] = {}  # (key, waiter) -> its wait
        self.pending_by_objkey: dict[int, list[Pending]] = {}

    def clear(self) -> None:
        self.holds.clear()
        self.by_objkey.clear()
        self.pending.clear()
        self.pending_by_objkey.clear()

    # -- holds ----------------------------------------------------------------------------

    def held(self, token: str, key: str) -> Hold | None:
        return self.holds.get((token, key))

    def live(self, token: str, key: str) -> Hold | None:
        """``token``'s hold of ``key`` if its session lives (a lost one's is forgotten)."""
        hold = self.holds.get((token, key))
        if hold is not None and hold.session.lost is not None:
            self.remove(hold)
            return None
        return hold

    def add(self, hold: Hold) -> None:
        self.holds[(hold.token, hold.key)] = hold
        for objkey in hold.objkeys:
            self.by_objkey.setdefault(objkey, []).append(hold)
            hold.session.pin(objkey, 1)

    def remove(self, hold: Hold) -> bool:
        """Forget ``hold``; whether it was there."""
        if self.holds.get((hold.token, hold.key)) is not hold:
            return False
        del self.holds[(hold.token, hold.key)]
        for objkey in hold.objkeys:
            found = self.by_objkey.get(objkey, [])
            found.remove(hold)
            if not found:
                self.by_objkey.pop(objkey, None)
            hold.session.pin(objkey, -1)
        return True

    def readers_on(self, objkey: int, session: Any) -> list[Hold]:
        """This client's readers of ``objkey`` on ``session``."""
        return [hold for hold in self.by_objkey.get(objkey, ()) if hold.shared and hold.session is session]

    def on_session(self, session: Any) -> list[Hold]:
        return [hold for hold in self.holds.values() if hold.session is session]

    def conflict(self, objkey: int, shared: bool, token: str, waiter: str | None, below: str = "") -> bool:
        """Whether another owner of this client holds ``objkey`` in a conflicting mode (or a
        granted wait of another waiter keeps it for that waiter)."""
        for hold in self.by_objkey.get(objkey, ()):
            if hold.token in (token, below) or hold.session.lost is not None:
                continue  # a lost session's holds are gone in the server
            if not (shared and hold.shared):
                return True
        for pending in self.pending_by_objkey.get(objkey, ()):
            if pending.state == GRANTED and pending.waiter != waiter and not (shared and pending.shared):
                return True
        return False

    # -- pending waits --------------------------------------------------------------------

    def wait_of(self, key: str, waiter: str | None) -> Pending | None:
        return None if waiter is None else self.pending.get((key, waiter))

    def add_wait(self, pending: Pending) -> None:
        self.pending[(pending.key, pending.waiter)] = pending
        self.pending_by_objkey.setdefault(pending.objkey, []).append(pending)

    def remove_wait(self, pending: Pending) -> None:
        if self.pending.get((pending.key, pending.waiter)) is pending:
            del self.pending[(pending.key, pending.waiter)]
        found = self.pending_by_objkey.get(pending.objkey)
        if found is not None and pending in found:
            found.remove(pending)
            if not found:
                del self.pending_by_objkey[pending.objkey]

    def waits_on(self, objkey: int) -> list[Pending]:
        return list(self.pending_by_objkey.get(objkey, ()))

    def gone_waits(self, now: float, after: float) -> list[Pending]:
        """Waits whose waiter has not been seen for ``after`` seconds (it died, or gave up
        without unqueueing: its place, or its granted lock, must go)."""
        return [p for p in self.pending.values() if p.watchers == 0 and now - p.seen > after]


#: A waiter not seen (no attempt, no wait) for this long has left: its wait is cancelled
#: and a lock granted to it unlocked. Live waiters come back at least every NOTIFY_RECHECK
#: (1 s) or POLL_CAP (2 s).
GONE_AFTER: Final = 10.0
