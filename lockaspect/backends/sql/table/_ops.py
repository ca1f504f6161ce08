"""Every lock kind's operations on the lease table, as generators that yield statements and
are sent their rows: no connection, no driver, no clock (the database's time comes back from
:class:`Begin`). The sync and the async drivers (:mod:`._driver`) run the same generators, so
the two share every decision; the semantics are the memory store's
(:mod:`lockaspect.backends.memory`), the reference.

An operation either runs its statements one by one in autocommit (the hot paths: the mutex's
acquire, every release, re-entry, the batch renewal are each one statement), or first yields
:class:`Begin`, and then runs in one write transaction that the driver commits when the
generator returns (or rolls back on :class:`Rollback` or an error). ``Begin(names)`` also
serialises writers of those keys (SQLite: ``BEGIN IMMEDIATE`` takes the database's write lock;
PostgreSQL: a transaction-scoped advisory lock per key), so a transaction's reads stay true
until it commits.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from ...._policy import FAIR_GONE_AFTER
from ...base import AcquireRequest, AcquireResult, HolderState, KeyState, ReleaseResult, RenewItem, RenewStatus
from ._sql import Dialect

__all__ = ["QUEUE_TTL", "Begin", "Counted", "Op", "Query", "Rollback", "TableOps", "place"]

_T = TypeVar("_T")

#: Seconds a waiter's queue place lives after its last attempt (the Redis scripts' 60 s).
QUEUE_TTL = 60.0
#: A fair acquire looks at most this many waiters at the queue's head for gone ones.
FAIR_SCAN = 64
#: Waiters poll (nothing announces a release made by another process): at most this often
#: apart, in seconds, the head of a fair queue (the lock is promised to it, so it must come
#: soon), any other waiter, and the rest of a fair queue (well within FAIR_GONE_AFTER).
POLL_HEAD = 0.01
POLL_OTHERS = 0.25
POLL_QUEUED = 1.0
#: A fair waiter's poll only reads (no write lock, so polls do not queue behind each other)
#: while its place in the queue was refreshed within this many seconds (< FAIR_GONE_AFTER).
FAIR_REFRESH = 1.0
#: Renewals per statement (five parameters each: far below SQLite's 32,766).
RENEW_CHUNK = 500


class Begin(NamedTuple):
    """Open a write transaction serialising writers of ``names``; the driver sends back the
    database's time (seconds since the epoch)."""

    names: tuple[str, ...]


class Query(NamedTuple):
    """Run ``sql`` with ``params``; the driver sends back its rows (a list of tuples)."""

    sql: str
    params: dict[str, Any]


class Counted(NamedTuple):
    """Run ``sql`` with ``params``; the driver sends back how many rows it changed."""

    sql: str
    params: dict[str, Any]


class Rollback(Exception):
    """Roll the transaction back and answer ``result``."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result


Op = Generator["Begin | Query | Counted", Any, _T]


def place(kind: str, token: str) -> tuple[str, str]:
    """``(space, slot)`` of ``token``'s hold of ``kind`` (see :mod:`._sql`)."""
    if kind in ("lock", "fair"):
        return "lock", ""
    if kind == "write":
        return "rw", ""
    if kind == "read":
        return "rw", token
    return "sem", token


def _hint(ttl: float | None) -> float | None:
    return None if ttl is None else max(0.001, float(ttl))


def _fair_poll(ahead: int | None) -> float:
    """How often a fair waiter with ``ahead`` live waiters before it polls: the first two
    often (the second is next once the head takes the lock), the rest less the further back."""
    if ahead is None or ahead <= 1:
        return POLL_HEAD
    return min(POLL_QUEUED, POLL_HEAD * ahead)


def _busy(ttl: float | None, poll: float, busy: str | None = None) -> AcquireResult:
    """Busy: the holder's remaining lease ``ttl`` and the advice to retry within ``poll``."""
    hint = _hint(ttl)
    return AcquireResult(False, holder_ttl=hint, busy=busy, retry_after=poll if hint is None else min(hint, poll))


class TableOps:
    """The operations of one dialect (statements prepared once)."""

    def __init__(self, dialect: Dialect) -> None:
        self.d = dialect
        t = dialect.text
        self._queue_head = t(
            "SELECT waiter, seen, position FROM lockaspect_waiters WHERE name = :name AND space = :space "
            f"ORDER BY position LIMIT {FAIR_SCAN}"
        )
        self._queue_drop_upto = t(
            "DELETE FROM lockaspect_waiters WHERE name = :name AND space = :space AND position <= :position"
        )
        self._queue_drop_old = t(
            "DELETE FROM lockaspect_waiters WHERE name = :name AND space = :space AND seen <= :before"
        )
        self._queue_leave = t(
            "DELETE FROM lockaspect_waiters WHERE name = :name AND space = :space AND waiter = :waiter"
        )
        self._queue_join = t(
            "INSERT INTO lockaspect_waiters (name, space, waiter, position, seen) VALUES (:name, :space, :waiter, "
            "(SELECT coalesce(max(position), 0) + 1 FROM lockaspect_waiters WHERE name = :name AND space = :space), "
            ":now) "
            "ON CONFLICT (name, space, waiter) DO UPDATE SET seen = excluded.seen"
        )
        self._queue_count = t(
            "SELECT space, count(*) FROM lockaspect_waiters WHERE name = :name AND seen > :before GROUP BY space"
        )
        self._shared = t(
            "SELECT slot, owner, expires_at - :now, fence, weight FROM lockaspect_holds "
            "WHERE name = :name AND space = :space AND expires_at > :now"
        )
        self._drop_expired = t(
            "DELETE FROM lockaspect_holds WHERE name = :name AND space = :space AND expires_at <= :now"
        )
        now = dialect.now
        self._fair_probe = t(
            "SELECT (SELECT owner FROM lockaspect_holds WHERE name = :name AND space = 'lock' AND slot = '' "
            f"AND expires_at > {now}), (SELECT expires_at - {now} FROM lockaspect_holds WHERE name = :name "
            "AND space = 'lock' AND slot = ''), (SELECT waiter FROM lockaspect_waiters WHERE name = :name "
            f"AND space = 'fair' AND seen > {now} - :gone ORDER BY position LIMIT 1), (SELECT {now} - seen "
            "FROM lockaspect_waiters WHERE name = :name AND space = 'fair' AND waiter = :waiter), "
            "(SELECT count(*) FROM lockaspect_waiters WHERE name = :name AND space = 'fair' "
            f"AND seen > {now} - :gone AND position < (SELECT position FROM lockaspect_waiters "
            "WHERE name = :name AND space = 'fair' AND waiter = :waiter))"
        )
        self._permits = t("SELECT permits FROM lockaspect_semaphores WHERE name = :name")
        self._set_permits = t(
            "INSERT INTO lockaspect_semaphores (name, permits) VALUES (:name, :permits) "
            "ON CONFLICT (name) DO UPDATE SET permits = excluded.permits"
        )
        larger = "max" if dialect.name == "sqlite" else "greatest"
        self._add_permits = t(
            f"INSERT INTO lockaspect_semaphores (name, permits) VALUES (:name, {larger}(0, :delta)) "
            f"ON CONFLICT (name) DO UPDATE SET permits = {larger}(0, lockaspect_semaphores.permits + :delta) "
            "RETURNING permits"
        )
        self._describe = t(
            f"SELECT kind, expires_at - {dialect.now}, fence, owner, info, weight FROM lockaspect_holds "
            f"WHERE name = :name AND expires_at > {dialect.now} ORDER BY fence"
        )
        self._held_names = t(
            f"SELECT DISTINCT name FROM lockaspect_holds WHERE name >= :low AND name < :high "
            f"AND expires_at > {dialect.now} ORDER BY name"
        )
        if dialect.name == "postgresql":  # exclusive rows end, and stay (see _sql._END)
            self._force = t(
                f"WITH shared AS (DELETE FROM lockaspect_holds WHERE name = :name AND slot <> '' "
                f"RETURNING expires_at > {now} AS live), exclusive AS (UPDATE lockaspect_holds "
                f"SET owner = '', expires_at = 0, info = NULL WHERE name = :name AND slot = '' AND expires_at > {now} "
                "RETURNING true AS live) SELECT live FROM shared UNION ALL SELECT live FROM exclusive"
            )
        else:
            self._force = t(f"DELETE FROM lockaspect_holds WHERE name = :name RETURNING expires_at > {now}")
        self._sweep = t(f"DELETE FROM lockaspect_holds WHERE expires_at <= {dialect.now} - :grace")

    # -- acquire --------------------------------------------------------------------------

    def acquire(self, request: AcquireRequest, info: str | None) -> Op[AcquireResult]:
        """``request`` with namespaced keys (checked by the store)."""
        kind = request.kind
        if kind == "lock":
            if len(request.keys) == 1:
                return self._lock(request, info)
            return self._multi(request, info)
        if kind == "fair":
            return self._fair(request, info)
        if kind == "semaphore":
            return self._semaphore(request, info)
        return self._rw(request, info)

    def _claim_params(
        self, name: str, space: str, request: AcquireRequest, kind: str, info: str | None
    ) -> dict[str, Any]:
        return {
            "name": name,
            "space": space,
            "owner": request.token,
            "kind": kind,
            "lease": request.lease,
            "info": info,
            "weight": request.weight,
        }

    # The mutex's acquire and every release, re-entry and renewal are single statements: the
    # stores run them directly (no generator on the hot path) through these pieces.

    def claim(self, name: str, token: str, lease: float, info: str | None) -> Query:
        """The mutex's claim of ``name`` (answer with :meth:`claimed`)."""
        params = {"name": name, "space": "lock", "owner": token, "kind": "lock", "lease": lease, "info": info}
        return Query(self.d.claim, params)

    @staticmethod
    def claimed(rows: list[Any]) -> AcquireResult | None:
        """The claim's answer: acquired, or ``None``: busy (ask :meth:`holder_of` for the hint)."""
        return AcquireResult(True, int(rows[0][0])) if rows else None

    def holder_of(self, name: str) -> Query:
        return Query(self.d.holder, {"name": name, "space": "lock"})

    @staticmethod
    def still_held(rows: list[Any], token: str) -> AcquireResult | None:
        """A waiter's read before its claim (a poll that takes no write lock): busy while
        another owner's hold is alive, else ``None`` (claim it)."""
        if rows and rows[0][1] > 0 and rows[0][0] != token:
            return _busy(rows[0][1], POLL_OTHERS)
        return None

    @staticmethod
    def busy(rows: list[Any]) -> AcquireResult:
        """A busy mutex, with the holder's remaining lease as the retry hint (gone meanwhile:
        retry at once)."""
        return _busy(rows[0][1] if rows else 0.001, POLL_OTHERS)

    def _lock(self, request: AcquireRequest, info: str | None) -> Op[AcquireResult]:
        """One statement: the claim; a busy key costs a second one for the retry hint."""
        rows = yield self.claim(request.key, request.token, request.lease, info)
        result = self.claimed(rows)
        if result is None:
            result = self.busy((yield self.holder_of(request.key)))
        return result

    def _multi(self, request: AcquireRequest, info: str | None) -> Op[AcquireResult]:
        """Every key claimed in one transaction (keys sorted: no deadlock), or none."""
        now = yield Begin(())
        fences = []
        for name in request.keys:
            params = self._claim_params(name, "lock", request, "lock", info)
            params["now"] = now
            rows = yield Query(self.d.claim_at, params)
            if not rows:
                rows = yield Query(self.d.holder, {"name": name, "space": "lock"})
                raise Rollback(_busy(rows[0][1] if rows else 0.001, POLL_OTHERS, name))
            fences.append(int(rows[0][0]))
        return AcquireResult(True, fences[0], fencing_tokens=tuple(fences))

    def _fair(self, request: AcquireRequest, info: str | None) -> Op[AcquireResult]:
        """A free lock goes only to the first live waiter; waiters not seen for
        FAIR_GONE_AFTER at the head of the queue leave it (acquire.lua's fair part)."""
        name, token, waiter = request.key, request.token, request.waiter
        if waiter is not None:  # a poll: decided by a read while our place is fresh
            probe = yield Query(self._fair_probe, {"name": name, "waiter": waiter, "gone": FAIR_GONE_AFTER})
            owner, ttl, first, age, ahead = probe[0]
            if age is not None and age < FAIR_REFRESH and owner != token and (owner is not None or first != waiter):
                return _busy(ttl if owner is not None else FAIR_GONE_AFTER, _fair_poll(ahead))
        now = yield Begin((name,))
        queue = {"name": name, "space": "fair"}
        head = yield Query(self._queue_head, queue)
        gone = None
        first = None
        for queued, seen, position in head:
            if now - seen <= FAIR_GONE_AFTER:
                first = queued
                break
            gone = position
        live = [queued for queued, seen, _ in head if now - seen <= FAIR_GONE_AFTER]
        ahead = live.index(waiter) if waiter in live else len(live)
        if gone is not None:
            yield Query(self._queue_drop_upto, {**queue, "position": gone})
        rows = yield Query(self._shared, {"name": name, "space": "lock", "now": now})
        held = rows[0] if rows else None
        if held is not None and held[1] == token:
            return AcquireResult(True, int(held[3]))
        if held is None and (first is None or first == waiter):
            params = self._claim_params(name, "lock", request, "fair", info)
            params["now"] = now
            claimed = yield Query(self.d.claim_at, params)
            if not claimed:  # a plain lock of the key took it meanwhile (it does not queue)
                rows = yield Query(self.d.holder, {"name": name, "space": "lock"})
                return _busy(rows[0][1] if rows else 0.001, POLL_HEAD)
            if waiter is not None:
                yield Query(self._queue_leave, {**queue, "waiter": waiter})
            return AcquireResult(True, int(claimed[0][0]))
        if waiter is not None:
            yield Query(self._queue_join, {**queue, "waiter": waiter, "now": now})
        poll = _fair_poll(ahead) if waiter is not None else POLL_QUEUED
        if held is None:
            return _busy(FAIR_GONE_AFTER, poll)  # promised to the first waiter
        return _busy(held[2], poll)

    def _semaphore(self, request: AcquireRequest, info: str | None) -> Op[AcquireResult]:
        """``request.weight`` of ``request.permits`` permits at once (all or none), under one
        lease; admitted while the holders' weights plus it fit in the permits. A number unlike
        the stored one changes nothing and reports the stored one (sem_acquire.lua). The
        transaction serialises the key's writers, so the sum read is still true when the row is
        written."""
        name, token = request.key, request.token
        wanted = request.permits
        assert wanted is not None  # checked by the store
        now = yield Begin((name,))
        rows = yield Query(self._permits, {"name": name})
        if not rows:
            yield Query(self._set_permits, {"name": name, "permits": wanted})
        elif int(rows[0][0]) != wanted:
            return AcquireResult(False, permits=int(rows[0][0]))
        space = {"name": name, "space": "sem", "now": now}
        yield Query(self._drop_expired, space)
        holders = yield Query(self._shared, space)
        for _, owner, _, fence, _ in holders:
            if owner == token:
                return AcquireResult(True, int(fence))
        if sum(int(weight) for *_, weight in holders) + request.weight <= wanted:
            params = self._claim_params(name, "sem", request, "semaphore", info)
            params["now"] = now
            rows = yield Query(self.d.share_at, params)
            return AcquireResult(True, int(rows[0][0]))
        if not holders:
            return AcquireResult(False, retry_after=POLL_QUEUED)  # no permits at all (until raised)
        return _busy(min(ttl for _, _, ttl, _, _ in holders), POLL_OTHERS)

    def _rw(self, request: AcquireRequest, info: str | None) -> Op[AcquireResult]:
        """Many readers or one writer. A writer that made an attempt within FAIR_GONE_AFTER
        keeps new readers out; ``request.below`` lets the holder of the write lock take the
        read lock too, a downgrade (rw_acquire.lua)."""
        name, token, waiter = request.key, request.token, request.waiter
        writing = request.kind == "write"
        now = yield Begin((name,))
        queue = {"name": name, "space": "rw"}
        yield Query(self._queue_drop_old, {**queue, "before": now - FAIR_GONE_AFTER})
        space = {"name": name, "space": "rw", "now": now}
        yield Query(self._drop_expired, space)
        holds = yield Query(self._shared, space)
        writer = next((hold for hold in holds if hold[0] == ""), None)
        readers = [hold for hold in holds if hold[0] != ""]
        if writing:
            if writer is not None and writer[1] == token:
                return AcquireResult(True, int(writer[3]))
            free = writer is None and not readers
        else:
            for _, owner, _, fence, _ in readers:
                if owner == token:
                    return AcquireResult(True, int(fence))
            downgrade = request.below != "" and writer is not None and writer[1] == request.below
            if downgrade:
                free = True
            else:
                waiting = yield Query(self._queue_head, queue)
                free = not waiting and writer is None
        if free:
            params = self._claim_params(name, "rw", request, request.kind, info)
            params["now"] = now
            rows = yield Query(self.d.claim_at if writing else self.d.share_at, params)
            if not rows:  # pragma: no cover - every writer of the record is serialised
                return AcquireResult(False, holder_ttl=0.001)
            if waiter is not None:
                yield Query(self._queue_leave, {**queue, "waiter": waiter})
            return AcquireResult(True, int(rows[0][0]))
        if writer is not None:
            hint: float = writer[2]
        elif readers:
            hint = min(ttl for _, _, ttl, _, _ in readers)
        else:
            hint = FAIR_GONE_AFTER  # only waiting writers keep this reader out
        if waiter is not None and writing:
            yield Query(self._queue_join, {**queue, "waiter": waiter, "now": now})
        return _busy(hint, POLL_OTHERS)

    # -- release, re-entry, renewal, queues -----------------------------------------------

    def release(self, name: str, token: str, kind: str) -> Query:
        """The release of ``token``'s hold: its row deleted if ``token`` has it alive (an
        expired one stays for the next claim or the sweep); :meth:`released` reads the count."""
        space, slot = place(kind, token)
        sql = self.d.release_exclusive if slot == "" else self.d.release
        return Query(sql, {"name": name, "space": space, "slot": slot, "owner": token})

    @staticmethod
    def released(deleted: int) -> ReleaseResult:
        return ReleaseResult.RELEASED if deleted > 0 else ReleaseResult.NOT_OWNER

    def reenter(self, name: str, token: str, kind: str) -> Query:
        """Whether ``token`` still holds ``name``: any row is yes."""
        space, slot = place(kind, token)
        return Query(self.d.held, {"name": name, "space": space, "slot": slot, "owner": token})

    def renew(self, items: Sequence[RenewItem]) -> Op[list[RenewStatus]]:
        """Every lease still held by its token extended from the database's now, in one
        statement per :data:`RENEW_CHUNK` items (one transaction: the driver opens it when
        there is more than one chunk)."""
        if len(items) > RENEW_CHUNK:
            yield Begin(())
        renewed: set[tuple[str, str, str, str]] = set()
        for start in range(0, len(items), RENEW_CHUNK):
            chunk = items[start : start + RENEW_CHUNK]
            params: dict[str, Any] = {}
            for i, (name, token, lease, kind) in enumerate(chunk):
                space, slot = place(kind, token)
                params[f"n{i}"], params[f"s{i}"], params[f"t{i}"] = name, space, slot
                params[f"o{i}"], params[f"e{i}"] = token, float(lease)
            rows = yield Query(self.d.renew(len(chunk)), params)
            renewed.update((row[0], row[1], row[2], row[3]) for row in rows)
        return [(name, *place(kind, token), token) in renewed for name, token, _, kind in items]

    def unqueue(self, name: str, waiter: str, kind: str) -> Op[None]:
        """Only the fair lock and waiting writers keep queue places in the table."""
        space = "fair" if kind == "fair" else "rw" if kind == "write" else None
        if space is not None:
            yield Query(self._queue_leave, {"name": name, "space": space, "waiter": waiter})

    def sweep(self, grace: float) -> Op[None]:
        """Delete holds that expired more than ``grace`` seconds ago (nobody will release
        them: crashed holders' rows)."""
        yield Query(self._sweep, {"grace": grace})

    # -- the operator's view ----------------------------------------------------------------

    def describe(self, name: str, key: str) -> Op[list[KeyState]]:
        """One :class:`KeyState` per kind held at ``name`` (reported under ``key``), each
        listing its holders with their owner records (a row of an older version has the
        host, pid and thread it recorded then, or none)."""
        now = yield Begin(())
        rows = yield Query(self._describe, {"name": name})
        counts = yield Query(self._queue_count, {"name": name, "before": now - QUEUE_TTL})
        waiting = {space: int(count) for space, count in counts}
        permits = yield Query(self._permits, {"name": name})
        by_kind: dict[str, list[HolderState]] = {}
        for kind, remaining, fence, owner, info, weight in rows:
            holder = HolderState(str(owner), str(info or ""), float(remaining), int(fence), int(weight))
            by_kind.setdefault(kind, []).append(holder)
        states = []
        for kind, holders in sorted(by_kind.items()):
            waiters = waiting.get({"fair": "fair", "write": "rw", "read": "rw"}.get(kind, ""), 0)
            stored = int(permits[0][0]) if kind == "semaphore" and permits else None
            remaining = max(holder.remaining or 0.0 for holder in holders)
            fence = max(holder.fencing_token or 0 for holder in holders)
            states.append(KeyState(key, kind, len(holders), remaining, fence, waiters, stored, tuple(holders)))
        return states

    def held_keys(self, prefix: str, pattern: str) -> Op[list[str]]:
        """The keys held now whose name (without ``prefix``) matches the glob ``pattern``."""
        rows = yield Query(self._held_names, {"low": prefix, "high": prefix + "\U0010ffff"})
        names = (str(row[0])[len(prefix) :] for row in rows)
        return [name for name in names if fnmatch.fnmatchcase(name, pattern)]

    def force_release(self, name: str) -> Op[bool]:
        rows = yield Query(self._force, {"name": name})
        return any(row[0] for row in rows)

    def permits(self, name: str, set_to: int | None) -> Op[tuple[int | None, int]]:
        now = yield Begin((name,))
        rows = yield Query(self._permits, {"name": name})
        stored = int(rows[0][0]) if rows else None
        holders = yield Query(self._shared, {"name": name, "space": "sem", "now": now})
        if set_to is not None:
            yield Query(self._set_permits, {"name": name, "permits": set_to})
            stored = set_to
        return stored, sum(int(weight) for *_, weight in holders)

    def add_permits(self, name: str, delta: int) -> Op[tuple[int, int]]:
        """The permits plus ``delta`` (never below 0; a semaphore never used starts from 0)
        in one statement, and the permits in use."""
        now = yield Begin((name,))
        rows = yield Query(self._add_permits, {"name": name, "delta": delta})
        holders = yield Query(self._shared, {"name": name, "space": "sem", "now": now})
        return int(rows[0][0]), sum(int(weight) for *_, weight in holders)
