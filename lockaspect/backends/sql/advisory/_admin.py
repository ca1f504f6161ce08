"""The operator part of the advisory store (:class:`~lockaspect.backends.base.AdminStore`,
and :class:`~lockaspect.backends.base.AsyncAdminStore` for its asyncio twin): what
``pg_locks`` shows of a key, joined with what the store recorded at each acquisition (the
full key, kind, fencing token, lease, owner token and owner record: per advisory key, and per
reader), on a connection of its own. Each operation is a plan of statements (no I/O), which
the thread store and the twin send on their admin connection.

``force_release`` cannot unlock another session's advisory lock (PostgreSQL offers no way):
it terminates the holding sessions (``pg_terminate_backend``), which frees EVERY lock those
sessions hold, of any key, and their holders learn it at their next probe (their leases are
lost). Use it for a holder that is stuck, not as a routine release.
"""

from __future__ import annotations

import asyncio
import fnmatch
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import psycopg

from ....errors import ConfigurationError
from ...base import HolderState, KeyState
from . import _sql
from ._ops import Core
from ._session import Session, store_error
from ._state import lock_key, slot_keys

__all__ = ["AdminMixin", "AsyncAdminMixin"]

#: A statement of an admin plan: (sql, params, the key it is about); answered with its rows.
Ask = tuple[str, dict[str, Any], "str | None"]
AdminPlan = Generator[Ask, list[tuple[Any, ...]], Any]
_EXCLUSIVE = ("lock", "fair", "write")


def _checked_permits(key: str, set_to: int | None) -> None:
    if set_to is not None and (isinstance(set_to, bool) or not isinstance(set_to, int) or set_to < 0):
        raise ConfigurationError(f"permits must be an int >= 0, got {set_to!r}", key=key)


def _checked_delta(key: str, delta: object) -> int:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise ConfigurationError(f"the permits to add must be an int, got {delta!r}", key=key)
    return delta


class _Plans:
    """The admin operations as plans (see the module docstring)."""

    namespace: str

    def _stored(self, key: str) -> AdminPlan:
        """The semaphore's permits (``None``: never used) and how many slots may be held."""
        rows = yield _sql.PERMITS, {"name": self.namespace + key}, key
        return (None, 0) if not rows else (int(rows[0][0]), int(rows[0][1]))

    def _describe(self, key: str) -> AdminPlan:
        permits, span = yield from self._stored(key)
        main = lock_key(self.namespace, key)
        slots = slot_keys(self.namespace, key, span)
        rows = yield _sql.DESCRIBE, {"keys": [main, *slots]}, key
        states: list[KeyState] = []
        on_main = [row for row in rows if row[0] == main]
        waiters = sum(1 for row in on_main if not row[2])
        exclusive = [row for row in on_main if row[2] and row[1] == "ExclusiveLock"]
        shared = [row for row in on_main if row[2] and row[1] == "ShareLock"]
        if exclusive:
            _, _, _, pid, kind, fence, lease, _, recorder, token, owner = exclusive[0]
            # The record is the holder's when its backend holds the key (not a reader's, nor a
            # lock taken without one: the transaction-scoped helper's, another program's).
            ours = kind in _EXCLUSIVE and recorder == pid
            holder = (HolderState(token or "", owner or "", None, fence),) if ours else ()
            kind = kind if kind in _EXCLUSIVE else "lock"
            states.append(KeyState(key, kind, 1, lease, fence, waiters, None, holder))
        if shared:
            readers = yield _sql.READERS, {"k": main}, key
            held_by = tuple(HolderState(token, owner or "", None, fence) for token, _, owner, fence, _ in readers)
            unrecorded = {row[3] for row in shared} - {reader[1] for reader in readers}  # an older version's
            fences = [reader[3] for reader in readers] + [row[5] for row in shared if row[5] is not None]
            leases = [reader[4] for reader in readers if reader[4] is not None]
            leases += [row[6] for row in shared if row[6] is not None]
            count, remaining, fence = (
                len(held_by) + len(unrecorded),
                max(leases, default=None),
                max(fences, default=None),
            )
            states.append(KeyState(key, "read", count, remaining, fence, waiters, None, held_by))
        held_slots = [row for row in rows if row[0] != main and row[2]]
        if held_slots:
            states.append(self._semaphore(key, permits, held_slots, rows, main))
        return states

    @staticmethod
    def _semaphore(key: str, permits: int | None, held: list[Any], rows: list[Any], main: int) -> KeyState:
        """A semaphore's holders: its held slots grouped by the owner token recorded with
        them (a hold of several permits has several slots)."""
        by_token: dict[str, list[Any]] = {}
        holders: list[HolderState] = []
        anonymous = 0
        for row in held:
            _, _, _, pid, kind, fence, _, _, recorder, token, owner = row
            if kind != "semaphore" or recorder != pid:
                anonymous += 1
            elif token:
                by_token.setdefault(token, []).append(row)
            else:  # recorded by an older version: one permit, no owner
                holders.append(HolderState("", owner or "", None, fence))
        for token, slots in by_token.items():
            holders.append(HolderState(token, slots[0][10] or "", None, slots[0][5], len(slots)))
        holders.sort(key=lambda holder: holder.fencing_token or 0)
        fences = [row[5] for row in held if row[5] is not None]
        leases = [row[6] for row in held if row[6] is not None]
        waiters = sum(1 for row in rows if row[0] != main and not row[2])
        count = len(holders) + anonymous
        return KeyState(
            key, "semaphore", count, max(leases, default=None), max(fences, default=None), waiters, permits,
            tuple(holders),
        )  # fmt: skip

    def _held(self, pattern: str) -> AdminPlan:
        rows = yield _sql.HELD_NAMES, {"prefix": self.namespace}, None
        prefix = len(self.namespace)
        names = {str(row[0])[prefix:] for row in rows}
        return sorted(name for name in names if fnmatch.fnmatchcase(name, pattern))

    def _force(self, key: str, lose: Callable[[list[int], str], None]) -> AdminPlan:
        _, span = yield from self._stored(key)
        keys = [lock_key(self.namespace, key), *slot_keys(self.namespace, key, span)]
        pids = [int(row[0]) for row in (yield _sql.HOLDERS, {"keys": keys}, key)]
        if not pids:
            return False
        lose(pids, key)
        yield _sql.TERMINATE, {"pids": pids}, key
        yield _sql.FORGET, {"keys": keys, "pids": pids}, key
        return True

    def _permits(self, key: str, set_to: int | None) -> AdminPlan:
        _, span = yield from self._stored(key)
        if set_to is not None:
            yield _sql.SEM_SET, {"name": self.namespace + key, "permits": set_to}, key
        return (yield from self._in_use(key, max(span, set_to or 0)))

    def _add(self, key: str, delta: int) -> AdminPlan:
        rows = yield _sql.SEM_ADD, {"name": self.namespace + key, "delta": delta}, key
        permits, span = int(rows[0][0]), int(rows[0][1])
        _, in_use = yield from self._in_use(key, span)
        return permits, in_use

    def _in_use(self, key: str, count: int) -> AdminPlan:
        params = {"name": self.namespace + key, "slots": slot_keys(self.namespace, key, count)}
        rows = yield _sql.SEM_IN_USE, params, key
        stored, in_use = rows[0]
        return (None if stored is None else int(stored)), int(in_use)


class AdminMixin(_Plans):
    """:class:`~lockaspect.backends.base.AdminStore` for :class:`~.store.PostgresAdvisoryStore`."""

    settings: Any
    _pool: Any
    _core: Core
    _twins: list[Any]
    _admin: Session | None = None
    _admin_lock: threading.Lock

    def _query(self, sql: str, params: dict[str, Any], key: str | None) -> list[tuple[Any, ...]]:
        """One statement on the admin connection (opened on first use, reopened if lost)."""
        with self._admin_lock:
            session = self._admin
            if session is None or session.lost is not None or session.conn.closed:
                session = self._admin = self._pool.open()
            try:
                return session.execute(sql, params)
            except psycopg.Error as exc:
                if session.conn.closed or session.conn.broken:
                    session.lost = "failed"
                raise store_error(exc, key, self.settings.shown) from exc

    def _admin_run(self, plan: AdminPlan) -> Any:
        rows: Any = None
        while True:
            try:
                sql, params, key = plan.send(rows)
            except StopIteration as stop:
                return stop.value
            rows = self._query(sql, params, key)

    def _lose_holders(self, pids: list[int], key: str) -> None:
        """Mark this client's sessions among ``pids`` lost (the thread store's and its twins'):
        their holders are told at once, not at their next probe."""
        with self._core.lock:
            for pool in [self._pool, *(twin._pool for twin in self._twins)]:
                for session in pool.sessions:
                    if session.pid in pids:
                        session.lose(f"force_release({key!r}) terminated it")

    def describe(self, key: str) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free): the lock, fair lock
        or write lock (one advisory key, exclusive), the read lock (the same key, shared),
        the semaphore (its slots), each listing its holders with their owner records.
        ``remaining`` is the holder's lease (a session lock has no expiry of its own: it lasts
        while the holder's session does; a holder's own ``remaining`` is ``None``),
        ``fencing_token`` the last one issued on the key (per slot for a semaphore: the
        largest)."""
        states: list[KeyState] = self._admin_run(self._describe(key))
        return states

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The keys of this namespace held now (by any client) whose name matches the glob
        ``pattern``: ``pg_locks`` joined with the recorded full keys, one query."""
        return iter(self._admin_run(self._held(pattern)))

    def force_release(self, key: str) -> bool:
        """Terminate every session holding ``key`` (any kind): whether one held it. This
        frees ALL the locks of those sessions, not only ``key``'s (PostgreSQL cannot unlock
        another session's advisory lock); their holders are told at their next probe. Their
        owner records go; the fence sequence is untouched, so tokens keep increasing."""
        return bool(self._admin_run(self._force(key, self._lose_holders)))

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to
        ``set_to``; lowering them takes no permit away (a slot above the new number stays
        held until released)."""
        _checked_permits(key, set_to)
        answer: tuple[int | None, int] = self._admin_run(self._permits(key, set_to))
        return answer

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` (negative: take away) to semaphore ``key``'s permits in one
        statement, never below 0 (a semaphore never used starts from 0): ``(permits, in
        use)`` after. Lowering them takes no permit away; waiters see new permits at their
        next recheck (they queue on the slots that existed)."""
        answer: tuple[int, int] = self._admin_run(self._add(key, _checked_delta(key, delta)))
        return answer

    def _close_admin(self) -> None:
        with self._admin_lock:
            session, self._admin = self._admin, None
        if session is not None:
            session.conn.close()


class AsyncAdminMixin(_Plans):
    """:class:`~lockaspect.backends.base.AsyncAdminStore` for the asyncio twin: the same
    plans on an ``AsyncConnection`` of its own."""

    settings: Any
    _pool: Any
    _parent: Any
    _aadmin: Any = None
    _aadmin_lock: asyncio.Lock | None = None

    async def _aquery(self, sql: str, params: dict[str, Any], key: str | None) -> list[tuple[Any, ...]]:
        if self._aadmin_lock is None:
            self._aadmin_lock = asyncio.Lock()
        async with self._aadmin_lock:
            session = self._aadmin
            if session is None or session.lost is not None or session.conn.closed:
                session = self._aadmin = await self._pool.open()
            try:
                rows: list[tuple[Any, ...]] = await session.execute(sql, params)
                return rows
            except psycopg.Error as exc:
                if session.conn.closed or session.conn.broken:
                    session.lost = "failed"
                raise store_error(exc, key, self.settings.shown) from exc

    async def _aadmin_run(self, plan: AdminPlan) -> Any:
        rows: Any = None
        while True:
            try:
                sql, params, key = plan.send(rows)
            except StopIteration as stop:
                return stop.value
            rows = await self._aquery(sql, params, key)

    async def describe(self, key: str) -> list[KeyState]:
        """See :meth:`AdminMixin.describe`."""
        states: list[KeyState] = await self._aadmin_run(self._describe(key))
        return states

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        """See :meth:`AdminMixin.held_keys`."""
        for key in await self._aadmin_run(self._held(pattern)):
            yield key

    async def force_release(self, key: str) -> bool:
        """See :meth:`AdminMixin.force_release`."""
        return bool(await self._aadmin_run(self._force(key, self._parent._lose_holders)))

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """See :meth:`AdminMixin.permits`."""
        _checked_permits(key, set_to)
        answer: tuple[int | None, int] = await self._aadmin_run(self._permits(key, set_to))
        return answer

    async def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """See :meth:`AdminMixin.add_permits`."""
        answer: tuple[int, int] = await self._aadmin_run(self._add(key, _checked_delta(key, delta)))
        return answer

    async def _aclose_admin(self) -> None:
        session, self._aadmin = self._aadmin, None
        if session is not None:
            try:
                await session.conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
