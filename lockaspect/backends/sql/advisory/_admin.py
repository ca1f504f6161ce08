"""The operator part of the advisory store (:class:`~lockaspect.backends.base.AdminStore`):
what ``pg_locks`` shows of a key, joined with the metadata the store records at each
acquisition (the full key, kind, fencing token and lease of the last holder of each advisory
key), on a connection of its own.

``force_release`` cannot unlock another session's advisory lock (PostgreSQL offers no way):
it terminates the holding sessions (``pg_terminate_backend``), which frees EVERY lock those
sessions hold, of any key, and their holders learn it at their next probe (their leases are
lost). Use it for a holder that is stuck, not as a routine release.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from ....errors import ConfigurationError
from ...base import KeyState
from . import _sql
from ._ops import Core
from ._session import Session, store_error
from ._state import lock_key, slot_keys

__all__ = ["AdminMixin"]


class AdminMixin:
    """:class:`~lockaspect.backends.base.AdminStore` for :class:`~.store.PostgresAdvisoryStore`."""

    namespace: str
    settings: Any
    _pool: Any
    _core: Core
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

    def _stored_permits(self, key: str) -> int | None:
        rows = self._query(_sql.PERMITS, {"name": self.namespace + key}, key)
        return None if not rows else int(rows[0][0])

    def describe(self, key: str) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free): the lock, fair lock
        or write lock (one advisory key, exclusive), the read lock (the same key, shared),
        the semaphore (its slots). ``remaining`` is the holder's lease (a session lock has no
        expiry of its own: it lasts while the holder's session does), ``fencing_token`` the
        last one issued on the key (per slot for a semaphore: the largest)."""
        permits = self._stored_permits(key)
        main = lock_key(self.namespace, key)
        slots = slot_keys(self.namespace, key, permits or 0)
        rows = self._query(_sql.DESCRIBE, {"keys": [main, *slots]}, key)
        states: list[KeyState] = []
        on_main = [row for row in rows if row[0] == main]
        waiters = sum(1 for row in on_main if not row[2])
        exclusive = [row for row in on_main if row[2] and row[1] == "ExclusiveLock"]
        shared = [row for row in on_main if row[2] and row[1] == "ShareLock"]
        if exclusive:
            _, _, _, _, kind, fence, lease, _ = exclusive[0]
            kind = kind if kind in ("lock", "fair", "write") else "lock"
            states.append(KeyState(key, kind, 1, lease, fence, waiters))
        if shared:
            fences = [row[5] for row in shared if row[5] is not None]
            leases = [row[6] for row in shared if row[6] is not None]
            states.append(
                KeyState(
                    key,
                    "read",
                    len({row[3] for row in shared}),
                    max(leases, default=None),
                    max(fences, default=None),
                    waiters,
                )
            )
        held_slots = [row for row in rows if row[0] != main and row[2]]
        if held_slots:
            fences = [row[5] for row in held_slots if row[5] is not None]
            leases = [row[6] for row in held_slots if row[6] is not None]
            slot_waiters = sum(1 for row in rows if row[0] != main and not row[2])
            states.append(
                KeyState(
                    key, "semaphore", len({row[0] for row in held_slots}), max(leases, default=None),
                    max(fences, default=None), slot_waiters, permits,
                )
            )  # fmt: skip
        return states

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The keys of this namespace held now (by any client) whose name matches the glob
        ``pattern``: ``pg_locks`` joined with the recorded full keys, one query."""
        rows = self._query(_sql.HELD_NAMES, {"prefix": self.namespace}, None)
        prefix = len(self.namespace)
        names = {str(row[0])[prefix:] for row in rows}
        return iter(sorted(name for name in names if fnmatch.fnmatchcase(name, pattern)))

    def force_release(self, key: str) -> bool:
        """Terminate every session holding ``key`` (any kind): whether one held it. This
        frees ALL the locks of those sessions, not only ``key``'s (PostgreSQL cannot unlock
        another session's advisory lock); their holders are told at their next probe. The
        fence sequence is untouched, so tokens keep increasing."""
        permits = self._stored_permits(key)
        keys = [lock_key(self.namespace, key), *slot_keys(self.namespace, key, permits or 0)]
        pids = [int(row[0]) for row in self._query(_sql.HOLDERS, {"keys": keys}, key)]
        if not pids:
            return False
        with self._core.lock:
            for session in self._pool.sessions:
                if session.pid in pids:
                    session.lose(f"force_release({key!r}) terminated it")
        self._query(_sql.TERMINATE, {"pids": pids}, key)
        return True

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to
        ``set_to``; lowering them takes no permit away (a slot above the new number stays
        held until released)."""
        if set_to is not None and (isinstance(set_to, bool) or not isinstance(set_to, int) or set_to < 0):
            raise ConfigurationError(f"permits must be an int >= 0, got {set_to!r}", key=key)
        old = self._stored_permits(key)
        if set_to is not None:
            self._query(_sql.SEM_SET, {"name": self.namespace + key, "permits": set_to}, key)
        count = max(old or 0, set_to or 0)
        rows = self._query(
            _sql.SEM_IN_USE, {"name": self.namespace + key, "slots": slot_keys(self.namespace, key, count)}, key
        )
        stored, in_use = rows[0]
        return (None if stored is None else int(stored)), int(in_use)

    def _close_admin(self) -> None:
        with self._admin_lock:
            session, self._admin = self._admin, None
        if session is not None:
            session.conn.close()
