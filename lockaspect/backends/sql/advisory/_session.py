"""Sessions (one PostgreSQL connection each) and what a store and its asyncio twins share
about them: the bookkeeping of a session, how a driver error becomes a lockaspect error, how a
new session is set up and the schema checked. The thread store's pool is :class:`Pool`; the
asyncio twin's is in :mod:`.aio`.

A session holds locks (pinned to it until released) or runs one queued wait (a blocking
``pg_advisory_lock`` in the server's queue), never both: a release must never wait behind a
blocked statement. Holder sessions are kept up to ``pool_size``; a wait takes an empty session
(opening one, up to ``max_waiters`` waiting at once), which becomes a holder session when its
lock is claimed. Sessions beyond ``pool_size`` close once empty.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import psycopg.errors

from ....errors import BackendError, ConfigurationError, LockError
from .. import _pgerrors
from . import _sql
from ._options import Settings

__all__ = [
    "Pool",
    "PoolBase",
    "Session",
    "SessionBase",
    "schema_error",
    "schema_steps",
    "setup_statements",
    "store_error",
    "upgrade_error",
]

log = logging.getLogger("lockaspect.postgres")

#: The SQLSTATEs of a statement ended by a cancel request or by ``lock_timeout``.
CANCELLED = ("57014", "55P03")


class SessionBase:
    """One connection's bookkeeping (guarded by the store's lock, except ``undo``, which is
    used under the session's own lock)."""

    def __init__(self, conn: Any, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        #: advisory key -> holds of this client pinned to it here.
        self.pins: dict[int, int] = {}
        self.count = 0
        #: The queued wait running here (then it holds nothing).
        self.waiting: Any = None
        #: Why the session is gone (then every hold on it is lost).
        self.lost: str | None = None
        #: A statement was interrupted here: it may hold a lock nobody knows of; it takes no
        #: new work and closes once empty (or a probe unlocks what it finds unclaimed).
        self.suspect = False
        self.users = 0
        self.last = time.monotonic()
        #: Locks to give back before the session's lock is released (see ``_ops``).
        self.undo: list[tuple[int, bool]] = []

    def pin(self, objkey: int, n: int) -> None:
        left = self.pins.get(objkey, 0) + n
        if left > 0:
            self.pins[objkey] = left
        else:
            self.pins.pop(objkey, None)
        self.count += n

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            log.warning("PostgreSQL session %d lost, and every lock held on it: %s", self.pid, reason)

    def suspect_pooler(self, key: str) -> None:
        self.lose(
            f"unlocking {key!r} returned false: the session no longer had the lock (a transaction pooler such as "
            "PgBouncer in transaction mode runs statements on other backends; session advisory locks need a "
            "direct connection or session pooling)"
        )

    def usable(self) -> bool:
        return self.lost is None and not self.suspect and self.waiting is None

    def __repr__(self) -> str:
        return f"<session pid={self.pid} holds={self.count}{' lost' if self.lost else ''}>"


def store_error(exc: BaseException, key: str | None, shown: str) -> LockError:
    """The lockaspect error for a driver error (chain it: ``raise store_error(...) from exc``)."""
    if isinstance(exc, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedObject)):
        return schema_error(shown, key)
    if isinstance(exc, psycopg.Error) and _pgerrors.permanent(exc):
        # A wrong password, a missing database or role, pg_hba.conf, sslmode: not retried.
        return BackendError(
            f"PostgreSQL {shown}: {_pgerrors.reason(exc)} (a configuration or credentials problem: not retried)",
            key=key,
            transient=False,
        )
    transient = isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, OSError))
    message = str(exc).strip().replace("\n", " ") or type(exc).__name__
    return BackendError(f"PostgreSQL {shown}: {message}", key=key, transient=transient)


def schema_error(shown: str, key: str | None = None) -> ConfigurationError:
    return ConfigurationError(
        f"the lockaspect schema is missing in {shown} (the sequence {_sql.FENCE_SEQUENCE} and the tables "
        "lockaspect_advisory, lockaspect_advisory_reader, lockaspect_semaphore): open the store once with "
        "create_schema=True (the default), or run as the owner: " + "; ".join(_sql.SCHEMA),
        key=key,
    )


def schema_steps(have: Sequence[Any], create: bool, shown: str) -> tuple[str, ...]:
    """The statements to run on a database whose ``SCHEMA_CHECK`` answered ``have``: the
    whole schema (``create``), the upgrade of one made by an older lockaspect (whatever
    ``create`` says: the owner records need it), or nothing.

    Asked twice when not nothing: the statements run in one transaction after
    ``SCHEMA_LOCK`` and a second ``SCHEMA_CHECK`` under it, and only what that second answer
    still lacks. Sessions opened at once on a fresh database all find the schema missing;
    all but the first wait for the lock while the first makes it, and must then leave it
    alone: an ``ALTER TABLE ... IF NOT EXISTS`` with nothing to add still takes the table's
    ACCESS EXCLUSIVE lock, queued behind every statement using the table (a queued wait's
    blocking statement uses it for as long as it waits) and ahead of every new one, which
    stalls every session of the client until ``lock_timeout``."""
    if not all(have[:3]):
        if not create:
            raise schema_error(shown)
        return _sql.SCHEMA
    if not all(have[3:5]):
        return _sql.SCHEMA_UPGRADE
    return ()


def upgrade_error(exc: BaseException, shown: str) -> LockError:
    """The error for a schema (or its upgrade) that could not be made."""
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return BackendError(
            f"PostgreSQL {shown}: upgrading the lockaspect schema waited 5s for a table another transaction "
            "keeps in use; retry",
            transient=True,
        )
    return ConfigurationError(
        f"PostgreSQL {shown}: cannot create or upgrade the lockaspect schema ({exc}); run as the owner: "
        + "; ".join(_sql.SCHEMA)
    )


def broken(conn: Any) -> bool:
    return bool(conn.closed or getattr(conn, "broken", False))


def setup_statements(settings: Settings, server_version: int) -> list[str]:
    """What a new session runs first: the server-side bound on a silent holder
    (``idle_session_timeout``, PostgreSQL 14+), no statement or lock timeouts of the
    server's defaults, asynchronous commit for the metadata rows (the locks are in memory
    anyway; the fence sequence's durability is ``nextval``'s own)."""
    statements = ["SET lock_timeout = 0", "SET statement_timeout = 0", "SET synchronous_commit = off"]
    if settings.idle_session_timeout and server_version >= 140000:
        statements.append(f"SET idle_session_timeout = {int(settings.idle_session_timeout * 1000)}")
    return statements


class Session(SessionBase):
    """A thread store's session: a sync psycopg connection and the lock its statements take."""

    def __init__(self, conn: psycopg.Connection[Any], pid: int) -> None:
        super().__init__(conn, pid)
        self.lock = threading.Lock()

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        cursor = self.conn.execute(sql, params)
        return cursor.fetchall() if cursor.description is not None else []

    def give_back(self) -> None:
        """Run the unlocks ``undo`` collected (session lock held; errors ignored)."""
        while self.undo:
            objkey, shared = self.undo.pop()
            try:
                self.conn.execute(_sql.UNLOCK_SHARED if shared else _sql.UNLOCK, {"k": objkey})
            except psycopg.Error as exc:
                if broken(self.conn):
                    self.lose(f"the connection failed: {exc}")
                    self.undo.clear()


_OPEN = object()  # a pool's answer: open a new session


class PoolBase:
    """The choices of a pool of sessions (no I/O): which session a statement or a queued wait
    takes, and which close. The store's lock guards it."""

    sessions: list[Any]

    def __init__(self, settings: Settings, lock: threading.Lock) -> None:
        self.settings = settings
        self.lock = lock  # the store's lock
        self.sessions = []
        self.opening = 0
        self.closed = False

    def _choose(self, avoid: frozenset[int]) -> tuple[Any, list[Any]]:
        """A holder session reserved for a statement, or ``_OPEN`` (one more while under
        ``pool_size``): the least used, preferring one that holds none of ``avoid`` (a session
        may take again what it holds, past the server's queue). Also the stale sessions
        dropped (to close)."""
        stale: list[Any] = []
        with self.lock:
            if self.closed:
                raise ConfigurationError("the PostgreSQL store is closed")
            now = time.monotonic()
            usable = []
            for session in self.sessions:
                if session.count == 0 and session.users == 0 and session.waiting is None and self._stale(session, now):
                    stale.append(session)
                elif session.usable():
                    usable.append(session)
            for session in stale:
                self.sessions.remove(session)
            best = min(usable, key=lambda s: (not avoid.isdisjoint(s.pins), s.users, s.count), default=None)
            grow = len(usable) + self.opening < self.settings.pool_size
            if best is not None and not (grow and (best.users or best.count)):
                best.users += 1
                return best, stale
            self.opening += 1
            return _OPEN, stale

    def _choose_wait(self, pending: Any) -> Any:
        """An empty session for a queued wait, ``_OPEN``, or ``None`` (``max_waiters`` wait)."""
        with self.lock:
            if self.closed:
                return None
            now = time.monotonic()
            for session in self.sessions:
                if session.usable() and session.count == 0 and session.users == 0 and not self._stale(session, now):
                    session.waiting = pending
                    return session
            waiting = sum(1 for session in self.sessions if session.waiting is not None)
            if waiting + self.opening >= self.settings.max_waiters:
                return None
            self.opening += 1
            return _OPEN

    def _opened(self, session: Any, pending: Any = None) -> None:
        with self.lock:
            self.opening -= 1
            if session is None:
                return
            if pending is None:
                session.users = 1
            else:
                session.waiting = pending
            self.sessions.append(session)
            if self.closed:
                session.lose("the store was closed")

    def _stale(self, session: SessionBase, now: float) -> bool:
        """An empty session the server may have ended for idling (or that failed)."""
        idle = self.settings.idle_session_timeout
        return session.lost is not None or session.suspect or bool(idle and now - session.last > idle * 0.75)

    def _done(self, session: Any, statement: bool = True) -> bool:
        """A statement on ``session`` finished (``statement``: it counted in ``users``) or its
        queued wait ended (not counted there: statements may run on the session meanwhile,
        and their count must stand): whether to close it (lost, or empty and surplus)."""
        with self.lock:
            session.last = time.monotonic()
            if statement:
                session.users = max(0, session.users - 1)
            drop = self._surplus(session)
            if drop and session in self.sessions:
                self.sessions.remove(session)
        return drop

    def _surplus(self, session: SessionBase) -> bool:
        if session.users or session.waiting is not None:
            return False
        if session not in self.sessions:
            return self.closed
        if session.lost is not None or self.closed:
            return True
        if session.count:
            return False
        return session.suspect or len(self.sessions) > self.settings.pool_size

    def _close_all(self) -> tuple[list[Any], list[Any]]:
        """Mark closed: (sessions to close now, sessions busy with a statement or a wait)."""
        with self.lock:
            self.closed = True
            sessions, self.sessions = self.sessions, []
        busy = [s for s in sessions if s.waiting is not None or s.users]
        return [s for s in sessions if s not in busy], busy

    def forget(self) -> None:
        """A forked child: the parent's sockets are not ours; drop them unclosed."""
        sessions, self.sessions = self.sessions, []
        self.opening = 0
        for session in sessions:
            detach(session)


class Pool(PoolBase):
    """The thread store's sessions (see the module docstring)."""

    def __init__(
        self, settings: Settings, lock: threading.Lock, on_schema: Callable[[psycopg.Connection[Any]], None]
    ) -> None:
        super().__init__(settings, lock)
        self._on_schema = on_schema

    def open(self) -> Session:
        """A new session, set up (its first, on a fresh client, checks the schema)."""
        settings = self.settings
        try:
            conn = psycopg.connect(settings.url, **settings.connect_kwargs())
        except psycopg.Error as exc:
            raise store_error(exc, None, settings.shown) from None
        try:
            self._on_schema(conn)
            for statement in setup_statements(settings, conn.info.server_version):
                conn.execute(statement)
            session = Session(conn, conn.info.backend_pid)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, psycopg.Error):
                raise store_error(exc, None, settings.shown) from None
            raise
        return session

    def take(self, avoid: frozenset[int]) -> Session:
        """Reserve a holder session for a statement (see :meth:`PoolBase._choose`)."""
        session, stale = self._choose(avoid)
        for old in stale:
            _close(old)
        if session is not _OPEN:
            return session  # type: ignore[no-any-return]
        opened = None
        try:
            opened = self.open()
        finally:
            self._opened(opened)
        return opened

    def for_wait(self, pending: Any) -> Session | None:
        """An empty session for a queued wait (``None``: ``max_waiters`` wait already)."""
        session = self._choose_wait(pending)
        if session is not _OPEN:
            return session  # type: ignore[no-any-return]
        opened = None
        try:
            opened = self.open()
        finally:
            self._opened(opened, pending)
        return opened

    def done(self, session: Session, statement: bool = True) -> None:
        if self._done(session, statement):
            _close(session)

    def close(self) -> list[Session]:
        """Close every idle session (the server frees their locks at once); the busy ones
        are returned (their statements are cancelled; they close when done)."""
        idle, busy = self._close_all()
        for session in idle:
            _close(session)
        return busy


def detach(session: SessionBase) -> None:
    """Point ``session``'s socket at /dev/null in this (forked) process, so that freeing the
    connection here sends nothing on the parent's session (libpq says goodbye on close)."""
    try:
        fd = session.conn.pgconn.socket
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
    except Exception:  # noqa: BLE001 - already closed: nothing to detach
        pass
    session.lost = "forked: the parent's session"


def _close(session: SessionBase) -> None:
    session.lost = session.lost or "closed"
    try:
        session.conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass
