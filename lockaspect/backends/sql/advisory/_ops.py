"""Every store operation as a plan of statements, with no I/O: each is a generator that yields
the round trips it needs (:class:`Run`, :class:`Queue`, :class:`Undo`, :class:`Leave`) and
receives their results, so the thread store (:mod:`.store`) and its asyncio twin (:mod:`.aio`)
run the same decisions and differ only in how they send a statement.

Decisions made here: the advisory keys of a request; which local owner already has what (a
session never conflicts with itself, so owners of one client are kept apart before the
server is asked, and again right after, under the session's lock); claiming a lock the server
granted to a waiter's queued wait; all-or-none multi-key locks; and what a busy answer queues.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

from ....errors import BackendError, ConfigurationError
from ...base import KINDS, AcquireRequest, AcquireResult, ReleaseResult, RenewItem, RenewStatus
from . import _sql
from ._state import CLOSED, FAILED, GRANTED, WAITING, Hold, Pending, Table, lock_key, slot_keys

__all__ = ["Core", "Leave", "Plan", "Queue", "Run", "Undo"]


class Run(NamedTuple):
    """Send ``sql`` on ``session`` (``None``: a holder session of the pool, preferring one that
    holds none of ``avoid``) under the session's lock; then, still under it, ``after(session,
    rows)`` (its value is the result). The driver answers ``(session, result)``."""

    sql: str
    params: dict[str, Any]
    key: str
    session: Any = None
    avoid: frozenset[int] = frozenset()
    after: Callable[[Any, list[tuple[Any, ...]]], Any] | None = None


class Queue(NamedTuple):
    """Queue ``waiter`` in the server: a blocking ``sql`` on a session of its own, in the
    background. The driver answers the :class:`Pending` (``None``: no session to spare)."""

    key: str
    waiter: str
    kind: str
    objkey: int
    shared: bool
    sql: str
    params: dict[str, Any]


class Undo(NamedTuple):
    """Unlock ``objkey`` once on ``session`` (errors ignored: a lost session freed it)."""

    session: Any
    objkey: int
    shared: bool


class Leave(NamedTuple):
    """Give up a queued wait: cancel its statement in the server, or unlock what it got."""

    pending: Pending


Plan = Generator[Any, Any, Any]

#: The busy answer's ``holder_ttl`` when the holder is another client: a session lock has no
#: expiry to report; the retry hint is the lease asked for.


class Core:
    """The state and decisions shared by a store and its asyncio twins (one lock, one table)."""

    def __init__(self, namespace: str, shown: str, idle_timeout: float) -> None:
        self.namespace = namespace
        self.shown = shown
        self.idle_timeout = idle_timeout
        self.lock = threading.Lock()
        self.table = Table()

    # -- checks ---------------------------------------------------------------------------

    def check(self, request: AcquireRequest) -> None:
        kind, keys = request.kind, request.keys
        if kind not in KINDS:
            raise ConfigurationError(f"the PostgreSQL advisory store serves {', '.join(sorted(KINDS))}, not {kind!r}")
        if not keys or not all(isinstance(key, str) for key in keys):
            raise ConfigurationError(f"an acquire request needs one or more str keys, got {keys!r}")
        if len(keys) > 1 and kind != "lock":
            raise ConfigurationError(f"only a 'lock' request may name several keys, not {kind!r}", key=keys[0])
        lease = request.lease
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not (0 < lease < math.inf):
            raise ConfigurationError(f"the lease must be a positive number of seconds, got {lease!r}", key=keys[0])
        if self.idle_timeout and lease >= self.idle_timeout:
            raise ConfigurationError(
                f"a {lease:g}s lease on a store whose idle_session_timeout is {self.idle_timeout:g}s: the server would "
                "end a holder session between two renewals; raise idle_session_timeout (an option of the URL's "
                "store) above the lease",
                key=keys[0],
            )
        if kind == "semaphore":
            permits = request.permits
            if isinstance(permits, bool) or not isinstance(permits, int) or permits < 1:
                raise ConfigurationError(
                    f"a semaphore request needs its number of permits, got {permits!r}", key=keys[0]
                )

    @staticmethod
    def check_kind(kind: str) -> None:
        if kind not in KINDS:
            raise ConfigurationError(f"the PostgreSQL advisory store serves {', '.join(sorted(KINDS))}, not {kind!r}")

    def _params(self, request: AcquireRequest, key: str, objkey: int, slot: int | None = None) -> dict[str, Any]:
        return {
            "k": objkey,
            "name": self.namespace + key,
            "slot": slot,
            "kind": request.kind,
            "lease": float(request.lease),
        }

    # -- acquire ----------------------------------------------------------------------------

    def acquire(self, request: AcquireRequest) -> Plan:
        """One attempt (see :meth:`Store.acquire`)."""
        self.check(request)
        if request.kind == "semaphore":
            return (yield from self._sem_acquire(request))
        if len(request.keys) > 1:
            return (yield from self._multi_acquire(request))
        key, token, waiter = request.key, request.token, request.waiter
        shared = request.kind == "read"
        objkey = lock_key(self.namespace, key)
        session = None
        with self.lock:
            hold = self.table.live(token, key)
            if hold is not None:
                return AcquireResult(True, hold.fence)
            claimed = self._claim(request, key, objkey, shared)
            if claimed is not None:
                return claimed
            if self.table.wait_of(key, waiter) is not None:
                return self._busy(request)  # queued in the server: its grant wakes us
            if self.table.conflict(objkey, shared, token, waiter, request.below):
                fence = None
            else:
                fence = 0
                if request.below:
                    below = self.table.held(request.below, key)
                    session = None if below is None else below.session  # a downgrade: on the writer's session
        if fence is not None:
            sql = _sql.TRY_SHARED if shared else _sql.TRY_X
            after = self._pin_after(request, key, objkey, shared)
            _, fence = yield Run(sql, self._params(request, key, objkey), key, session, frozenset((objkey,)), after)
            if fence:
                yield from self._dequeue(key, waiter)
                return AcquireResult(True, fence)
        if waiter is not None:
            sql = _sql.ACQUIRE_SHARED if shared else _sql.ACQUIRE_X
            yield Queue(key, waiter, request.kind, objkey, shared, sql, self._params(request, key, objkey))
        return self._busy(request)

    def _busy(self, request: AcquireRequest, busy: str | None = None) -> AcquireResult:
        return AcquireResult(False, holder_ttl=float(request.lease), busy=busy)

    def _pin_after(
        self, request: AcquireRequest, key: str, objkey: int, shared: bool
    ) -> Callable[[Any, list[tuple[Any, ...]]], int | None]:
        """Under the session's lock, after a try: record the hold, or give the lock back when
        another owner of this client got it meanwhile (on this very session it would have
        been granted again)."""

        def after(session: Any, rows: list[tuple[Any, ...]]) -> int | None:
            fence = rows[0][0] if rows else None
            if fence is None:
                return None
            with self.lock:
                if not self.table.conflict(objkey, shared, request.token, request.waiter, request.below):
                    self.table.add(Hold(key, request.token, request.kind, objkey, shared, session, int(fence)))
                    return int(fence)
            session.undo.append((objkey, shared))
            return None

        return after

    def _claim(self, request: AcquireRequest, key: str, objkey: int, shared: bool) -> AcquireResult | None:
        """The waiter's granted wait becomes its hold (lock held)."""
        pending = self.table.wait_of(key, request.waiter)
        if pending is None:
            return None
        pending.seen = time.monotonic()
        if pending.state == GRANTED and pending.objkey == objkey:
            self.table.remove_wait(pending)
            pending.state = CLOSED
            pending.session.waiting = None
            pending.over.set()
            self.table.add(Hold(key, request.token, request.kind, objkey, shared, pending.session, pending.fence))
            return AcquireResult(True, pending.fence)
        if pending.state in (FAILED, CLOSED):
            self.table.remove_wait(pending)
        return None

    def _dequeue(self, key: str, waiter: str | None) -> Plan:
        """Acquired without our queued wait (another slot, or a try): leave the queue."""
        with self.lock:
            pending = self.table.wait_of(key, waiter)
            if pending is not None:
                self.table.remove_wait(pending)
        if pending is not None:
            yield Leave(pending)

    def _sem_acquire(self, request: AcquireRequest) -> Plan:
        key, token, waiter = request.key, request.token, request.waiter
        permits = request.permits
        assert permits is not None
        slots = slot_keys(self.namespace, key, permits)
        with self.lock:
            hold = self.table.live(token, key)
            if hold is not None:
                return AcquireResult(True, hold.fence)
            pending = self.table.wait_of(key, waiter)
            if pending is not None:
                claimed = self._claim(request, key, pending.objkey, False)
                if claimed is not None:
                    return claimed
            free = [slot for slot in slots if not self.table.conflict(slot, False, token, waiter)]
        params = {"name": self.namespace + key, "want": permits, "slots": free, "lease": float(request.lease)}

        def after(session: Any, rows: list[tuple[Any, ...]]) -> tuple[int | None, int | None]:
            stored, slot, fence = rows[0]
            if fence is None:
                return stored, None
            objkey = free[slot]
            with self.lock:
                if not self.table.conflict(objkey, False, token, waiter):
                    self.table.add(Hold(key, token, "semaphore", objkey, False, session, int(fence)))
                    return stored, int(fence)
            session.undo.append((objkey, False))
            return stored, None

        _, (stored, fence) = yield Run(_sql.SEM_ACQUIRE, params, key, None, frozenset(slots), after)
        if stored is not None and stored != permits:
            return AcquireResult(False, permits=int(stored))
        if fence:
            yield from self._dequeue(key, waiter)
            return AcquireResult(True, fence)
        if waiter is not None and (pending is None or pending.state != WAITING):
            # Queue on one slot (at random: a semaphore's waiters are not served in order).
            objkey = random.choice(slots)
            yield Queue(
                key,
                waiter,
                "semaphore",
                objkey,
                False,
                _sql.ACQUIRE_X,
                self._params(request, key, objkey, slots.index(objkey)),
            )
        return self._busy(request)

    def _multi_acquire(self, request: AcquireRequest) -> Plan:
        """Every key or none, in the request's (sorted) order, on one session."""
        token, waiter = request.token, request.waiter
        taken: list[Hold] = []  # taken by this attempt (given back if another key is busy)
        fences: list[int] = []
        session: Any = None
        busy: str | None = None
        for key in request.keys:
            objkey = lock_key(self.namespace, key)
            with self.lock:
                hold = self.table.live(token, key)
                if hold is None:
                    pending = self.table.wait_of(key, waiter)
                    if pending is not None and pending.state == GRANTED:
                        claimed = self._claim(request, key, objkey, False)
                        assert claimed is not None
                        hold = self.table.held(token, key)
                        assert hold is not None
                        taken.append(hold)
                    else:
                        queued = pending is not None and pending.state == WAITING
                        if queued or self.table.conflict(objkey, False, token, waiter):
                            busy = key
            if busy is not None:
                break
            if hold is None:
                after = self._pin_after(request, key, objkey, False)
                session, fence = yield Run(
                    _sql.TRY_X, self._params(request, key, objkey), key, session, frozenset((objkey,)), after
                )
                if not fence:
                    busy = key
                    break
                hold = self.table.held(token, key)
                assert hold is not None
                taken.append(hold)
            fences.append(hold.fence)
        if busy is None:
            for key in request.keys:
                yield from self._dequeue(key, waiter)
            return AcquireResult(True, fences[0], fencing_tokens=tuple(fences))
        for hold in taken:
            yield from self._give_back(hold)
        if waiter is not None:
            with self.lock:
                queued = self.table.wait_of(busy, waiter) is not None
            if not queued:
                objkey = lock_key(self.namespace, busy)
                yield Queue(busy, waiter, "lock", objkey, False, _sql.ACQUIRE_X, self._params(request, busy, objkey))
        return self._busy(request, busy)

    def _give_back(self, hold: Hold) -> Plan:
        with self.lock:
            self.table.remove(hold)
        yield Undo(hold.session, hold.objkey, hold.shared)

    # -- release, re-entry, queue ---------------------------------------------------------

    def release(self, key: str, token: str, kind: str) -> Plan:
        """Unlock ``token``'s hold on its session: ``RELEASED``, or ``NOT_OWNER`` when the hold
        is unknown, its session was lost, or the server did not have it (a pooler in front)."""
        self.check_kind(kind)
        with self.lock:
            hold = self.table.held(token, key)
            if hold is None:
                return ReleaseResult.NOT_OWNER
            if hold.session.lost is not None:
                self.table.remove(hold)
                return ReleaseResult.NOT_OWNER
            queued = [p for p in self.table.waits_on(hold.objkey) if p.state == WAITING]
        params = {"k": hold.objkey, "pids": [p.session.pid for p in queued]}
        if queued:
            sql = _sql.UNLOCK_WOKEN_SHARED if hold.shared else _sql.UNLOCK_WOKEN
        else:
            sql = _sql.UNLOCK_SHARED if hold.shared else _sql.UNLOCK

        def after(session: Any, rows: list[tuple[Any, ...]]) -> tuple[bool, list[int]]:
            with self.lock:
                self.table.remove(hold)
            ok = bool(rows[0][0])
            return ok, list(rows[0][1]) if queued else []

        try:
            _, (ok, woken) = yield Run(sql, params, key, hold.session, after=after)
        except BackendError:
            with self.lock:
                self.table.remove(hold)
            if _gone(hold):
                return ReleaseResult.NOT_OWNER  # the session ended: so did the lock
            raise
        except BaseException:
            with self.lock:
                self.table.remove(hold)
            raise
        if not ok:
            hold.session.suspect_pooler(key)
            return ReleaseResult.NOT_OWNER
        # A wait of ours the unlock granted answers in a moment: wait for it, so the lock is
        # seen as its waiter's by the next attempt (not free, not busy for it).
        for pending in queued:
            if pending.session.pid in woken:
                yield pending
        return ReleaseResult.RELEASED

    def reenter(self, key: str, token: str, kind: str) -> Plan:
        """Whether ``token`` still holds ``key``: its session answers that it has the lock."""
        self.check_kind(kind)
        with self.lock:
            hold = self.table.held(token, key)
        if hold is None or hold.session.lost is not None:
            return False
        try:
            _, keys = yield Run(_sql.PROBE, {}, key, hold.session, after=_probed)
        except BackendError:
            if _gone(hold):
                return False  # the session is gone, and the lock with it
            raise
        return keys is not None and hold.objkey in keys and not _gone(hold)

    def unqueue(self, key: str, waiter: str, kind: str) -> Plan:
        self.check_kind(kind)
        with self.lock:
            pending = self.table.wait_of(key, waiter)
            if pending is not None:
                self.table.remove_wait(pending)
        if pending is not None:
            yield Leave(pending)

    # -- renewal ----------------------------------------------------------------------------

    def holds_for(
        self, leases: Sequence[RenewItem]
    ) -> tuple[list[RenewStatus], dict[Any, list[int]], list[Hold | None]]:
        """The statuses decided without a round trip (unknown hold, lost session: ``False``),
        and the items to probe, by session."""
        statuses: list[RenewStatus] = [None] * len(leases)
        by_session: dict[Any, list[int]] = {}
        holds: list[Hold | None] = []
        with self.lock:
            for i, item in enumerate(leases):
                self.check_kind(item.kind)
                hold = self.table.held(item.token, item.key)
                holds.append(hold)
                if hold is None or hold.session.lost is not None:
                    statuses[i] = False
                else:
                    by_session.setdefault(hold.session, []).append(i)
        return statuses, by_session, holds

    def probed(
        self, statuses: list[RenewStatus], items: list[int], holds: list[Hold | None], keys: set[int] | None
    ) -> None:
        """Apply one session's probe: ``None`` keys: the session is lost (every item False)."""
        for i in items:
            hold = holds[i]
            assert hold is not None
            statuses[i] = keys is not None and hold.objkey in keys


def _gone(hold: Hold) -> bool:
    """Whether ``hold``'s session was lost (read afresh: a round trip may have lost it)."""
    return hold.session.lost is not None


def _probed(session: Any, rows: list[tuple[Any, ...]]) -> set[int] | None:
    """The advisory keys a probe found on ``session`` (``None``: it is not the session we
    opened, a transaction pooler gave us another backend). A key the session holds that no
    hold of ours is pinned to (an attempt interrupted after the server took the lock) is
    unlocked behind the probe."""
    pid, keys, modes = rows[0]
    if pid != session.pid:
        session.lose(f"the backend pid changed ({session.pid} -> {pid}): a transaction pooler (PgBouncer) in front?")
        return None
    found = {int(k) for k in keys}
    for k, mode in zip(keys, modes, strict=True):
        if session.pins.get(int(k), 0) <= 0:
            session.undo.append((int(k), mode == "ShareLock"))
    return found


probe_after = _probed


def session_of(op: Any) -> Any:
    """The session a round trip must run on, if it names one."""
    if isinstance(op, (Run, Undo)):
        return op.session
    if isinstance(op, Leave):
        return op.pending.session
    return None
