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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ....errors import BackendError, ConfigurationError
from ...base import KINDS, AcquireRequest, AcquireResult, ReleaseResult, RenewItem, RenewStatus, checked_request
from . import _sql
from ._sem import SemaphoreOps
from ._state import CLOSED, FAILED, GRANTED, WAITING, Hold, Pending, Table, lock_key
from ._steps import Leave, Plan, Queue, Run, Undo

__all__ = ["Core", "Leave", "Plan", "Queue", "Run", "Undo"]


class Core(SemaphoreOps):
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
        # A weight and an owner record are checked as every store checks them (off the usual path).
        if type(request.weight) is not int or request.weight != 1 or type(request.owner) is not str:
            checked_request(request, "", "the PostgreSQL advisory store")

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
            "token": request.token,
            "owner": request.owner or None,
            "place": 0,
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
        fence: int | None = None
        with self.lock:
            hold = self.table.live(token, key)
            if hold is not None:
                return AcquireResult(True, hold.fence)
            claimed = self._claim(request, key, objkey, shared)
            if claimed is None:
                if self.table.wait_of(key, waiter) is not None:
                    return self._busy(request)  # queued in the server: its grant wakes us
                if not self.table.conflict(objkey, shared, token, waiter, request.below):
                    fence = 0
                    if request.below:
                        below = self.table.held(request.below, key)
                        session = None if below is None else below.session  # a downgrade: on the writer's session
        if claimed is not None:
            yield from self._record_claim(request, claimed)
            return AcquireResult(True, claimed.fence)
        if fence is not None:
            sql = _sql.TRY_SHARED if shared else _sql.TRY_X
            after = self._pin_after(request, key, objkey, shared)
            params = self._params(request, key, objkey)
            bind = self._reader_place(objkey, params) if shared else None
            _, fence = yield Run(sql, params, key, session, frozenset((objkey,)), after, bind)
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
            place = int(rows[0][1]) if shared else 0
            with self.lock:
                if not self.table.conflict(objkey, shared, request.token, request.waiter, request.below):
                    hold = Hold(key, request.token, request.kind, objkey, shared, session, int(fence), place=place)
                    self.table.add(hold)
                    return int(fence)
            session.undo.append((objkey, shared))
            return None

        return after

    def _reader_place(self, objkey: int, params: dict[str, Any]) -> Callable[[Any], dict[str, Any]]:
        """A reader's parameters on the session its statement runs on: its place there, the
        first not taken by another reader of this client (0 unless readers share it)."""

        def bind(session: Any) -> dict[str, Any]:
            with self.lock:
                taken = {hold.place for hold in self.table.readers_on(objkey, session)}
            return {**params, "place": next(place for place in range(len(taken) + 1) if place not in taken)}

        return bind

    def _claim(self, request: AcquireRequest, key: str, objkey: int, shared: bool) -> Pending | None:
        """The waiter's granted wait becomes its hold (lock held): that wait, or ``None``."""
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
            return pending
        if pending.state in (FAILED, CLOSED):
            self.table.remove_wait(pending)
        return None

    def _record_claim(self, request: AcquireRequest, pending: Pending) -> Plan:
        """A claimed wait's record names the queued attempt's owner: make it the claimer's
        (one statement on the holding session; the one round trip a handover adds). A
        failure leaves the record stale (it is for the operator tools only); an interruption
        gives the hold back to the session, which closes (see ``SessionBase.suspect``)."""
        params = {
            "k": pending.objkey,
            "token": request.token,
            "owner": request.owner or None,
            "lease": float(request.lease),
        }
        sql = _sql.CLAIMED_SHARED if pending.shared else _sql.CLAIMED
        try:
            yield Run(sql, params, pending.key, pending.session)
        except BackendError:
            pass
        except BaseException:
            with self.lock:
                hold = self.table.held(request.token, pending.key)
                if hold is not None:
                    self.table.remove(hold)
            raise

    def _dequeue(self, key: str, waiter: str | None) -> Plan:
        """Acquired without our queued wait (another slot, or a try): leave the queue."""
        with self.lock:
            pending = self.table.wait_of(key, waiter)
            if pending is not None:
                self.table.remove_wait(pending)
        if pending is not None:
            yield Leave(pending)

    def _multi_acquire(self, request: AcquireRequest) -> Plan:
        """Every key or none, in the request's (sorted) order, on one session."""
        token, waiter = request.token, request.waiter
        taken: list[Hold] = []  # taken by this attempt (given back if another key is busy)
        fences: list[int] = []
        session: Any = None
        busy: str | None = None
        record: Pending | None = None
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
                        record = claimed
                    else:
                        queued = pending is not None and pending.state == WAITING
                        if queued or self.table.conflict(objkey, False, token, waiter):
                            busy = key
            if busy is not None:
                break
            if record is not None:
                yield from self._record_claim(request, record)
                record = None
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
            # Waiting on ``busy`` only: a wait of ours on another key of the set, granted since
            # (the server holds that lock for us), would hold it while we wait for ``busy``,
            # whose holder may be waiting for it: a deadlock until the idle timeout.
            for key in request.keys:
                if key != busy:
                    yield from self._dequeue(key, waiter)
            with self.lock:
                queued = self.table.wait_of(busy, waiter) is not None
            if not queued:
                objkey = lock_key(self.namespace, busy)
                yield Queue(busy, waiter, "lock", objkey, False, _sql.ACQUIRE_X, self._params(request, busy, objkey))
        return self._busy(request, busy)

    def _give_back(self, hold: Hold) -> Plan:
        with self.lock:
            self.table.remove(hold)
        for objkey in hold.objkeys:
            yield Undo(hold.session, objkey, hold.shared)

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
            queued = [p for k in hold.objkeys for p in self.table.waits_on(k) if p.state == WAITING]
            alone = hold.shared and self.table.readers_on(hold.objkey, hold.session) == [hold]
        params: dict[str, Any] = {"k": hold.objkey, "pids": [p.session.pid for p in queued]}
        if hold.more:  # a semaphore's hold of several permits
            params["ks"] = list(hold.objkeys)
            sql = _sql.UNLOCK_WOKEN_SLOTS if queued else _sql.UNLOCK_SLOTS
        elif hold.shared and alone and hold.place == 0:  # its row ends with the session's shared hold
            sql = _sql.UNLOCK_WOKEN_SHARED if queued else _sql.UNLOCK_SHARED
        elif hold.shared:  # other readers keep the session's shared hold: the row goes
            params["place"] = hold.place
            sql = _sql.UNLOCK_WOKEN_READER if queued else _sql.UNLOCK_READER
        else:
            sql = _sql.UNLOCK_WOKEN if queued else _sql.UNLOCK

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
        return keys is not None and all(objkey in keys for objkey in hold.objkeys) and not _gone(hold)

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
            statuses[i] = keys is not None and all(objkey in keys for objkey in hold.objkeys)


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
