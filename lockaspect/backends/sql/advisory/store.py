"""The thread store (:class:`PostgresAdvisoryStore`): the driver that sends the statements
:mod:`._ops` plans on the sessions of :mod:`._session`, the queued waits' runner threads,
and the Store protocol around them. See the package docstring for what it guarantees."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from ....errors import BackendError, ConfigurationError
from ...base import (
    KINDS,
    AcquireRequest,
    AcquireResult,
    Capability,
    ReleaseResult,
    RenewItem,
    RenewStatus,
    new_waiter_id,
)
from . import _sql
from ._admin import AdminMixin
from ._notify import Notifier
from ._ops import Core, Leave, Plan, Queue, Run, Undo, probe_after
from ._ops import session_of as _session_of
from ._options import Settings
from ._session import CANCELLED, Pool, Session, broken, detach, schema_steps, store_error, upgrade_error
from ._state import CLOSED, FAILED, GONE_AFTER, GRANTED, WAITING, Pending

__all__ = ["CAPABILITIES", "PostgresAdvisoryStore"]


class _Stale(Exception):
    """A fresh, empty session turned out dead (ended by the server while idle)."""


log = logging.getLogger("lockaspect.postgres")

#: What the advisory store declares: holds live with their session (no lease to renew; the
#: watchdog's renewal probes each holder session once a second), fencing tokens from one
#: sequence, multi-key locks, and release messages in the sense of the engine: a waiter
#: blocks in the server's queue until the lock is granted to it.
CAPABILITIES = (
    Capability.SESSION_BOUND
    | Capability.BATCH_RENEW
    | Capability.FENCING
    | Capability.MULTI_KEY
    | Capability.RELEASE_NOTIFY
)

#: How long a release waits for the reply of a queued wait of ours that its unlock granted.
HANDOVER_WAIT = 5.0
#: How long a queued wait may take to show in the server's queue before the attempt that
#: made it answers anyway.
QUEUE_CONFIRM = 2.0
#: How long leaving the queue waits for the cancelled statement to end.
LEAVE_WAIT = 5.0
#: How long a renewal waits for an asyncio twin's loop to probe its session.
TWIN_PROBE_WAIT = 5.0


class PostgresAdvisoryStore(AdminMixin):
    """PostgreSQL session advisory locks, for threads (a
    :class:`~lockaspect.backends.base.Store` and
    :class:`~lockaspect.backends.base.AdminStore`); open it with
    :func:`~lockaspect.backends.sql.advisory.open_postgres_store` or
    ``LockClient.from_url("postgresql://...")``.

    Args:
        settings: The checked URL and options (see ``_options.Settings``).
    """

    capabilities = CAPABILITIES
    kinds = KINDS

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.namespace = settings.namespace
        self._core = Core(settings.namespace, settings.shown, settings.idle_session_timeout)
        self._schema_ok = False
        self._pool = Pool(settings, self._core.lock, self._check_schema)
        self._notifier: Notifier | None = None
        self._threads: set[threading.Thread] = set()
        self._twins: list[Any] = []
        self._closed = False
        self._admin_lock = threading.Lock()

    # -- the driver -----------------------------------------------------------------------

    def _run(self, plan: Plan) -> Any:
        """Run ``plan`` (a generator of :mod:`._ops`), sending each round trip it yields."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = self._do(op)
            except BaseException as exc:  # noqa: BLE001 - thrown into the plan, which re-raises
                error = exc

    def _do(self, op: Any) -> Any:
        other = _session_of(op)
        if other is not None and not isinstance(other, Session):
            return self._on_twin(other, op)
        if isinstance(op, Run):
            return self._send(op)
        if isinstance(op, Queue):
            return self._queue(op)
        if isinstance(op, Undo):
            with op.session.lock:
                op.session.undo.append((op.objkey, op.shared))
                op.session.give_back()
            return None
        if isinstance(op, Leave):
            self._leave(op.pending)
            return None
        assert isinstance(op, Pending)
        op.done.wait(HANDOVER_WAIT)
        return None

    @staticmethod
    def _on_twin(session: Any, op: Any) -> Any:
        """A round trip on a session of an asyncio twin (a hold taken by async code, released
        or probed from a thread): run on the twin's loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is session.loop:
            raise BackendError(
                "a lock taken by async code on this event loop cannot be released by sync code running on the loop "
                "itself (it would block the loop it needs)",
                key=getattr(op, "key", None),
            )
        try:
            future = asyncio.run_coroutine_threadsafe(session.twin._do(op), session.loop)
        except RuntimeError:
            session.lose("its event loop was closed")
            raise BackendError("the event loop of that lock's session is closed", transient=True) from None
        try:
            return future.result(TWIN_PROBE_WAIT * 6)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BackendError("the event loop of that lock's session did not answer", transient=True) from None

    def _send(self, op: Run, retry: bool = True) -> tuple[Session, Any]:
        """Send one statement of a plan; an empty session the server ended meanwhile (idle
        timeout, restart) is replaced once, transparently."""
        try:
            return self._send_once(op)
        except _Stale:
            if not retry:
                raise BackendError(
                    f"PostgreSQL {self.settings.shown}: the connection failed", key=op.key, transient=True
                ) from None
            return self._send_once(op)

    def _send_once(self, op: Run) -> tuple[Session, Any]:
        session = op.session
        if session is None:
            session = self._pool.take(op.avoid)
        elif session.lost is not None:
            raise BackendError(f"PostgreSQL {self.settings.shown}: {session.lost}", key=op.key, transient=True)
        else:
            with self._core.lock:
                session.users += 1
        fresh = op.session is None and session.count == 0
        try:
            with session.lock:
                try:
                    params = op.params if op.bind is None else op.bind(session)
                    rows = session.execute(op.sql, params)
                    result = op.after(session, rows) if op.after is not None else rows
                except psycopg.Error as exc:
                    if broken(session.conn):
                        session.lose(f"the connection failed: {exc}")
                        if fresh:
                            raise _Stale from exc
                    raise store_error(exc, op.key, self.settings.shown) from exc
                except BaseException:
                    session.suspect = True  # interrupted: what the server did is unknown
                    raise
                finally:
                    session.give_back()
        finally:
            self._pool.done(session)
        return session, result

    # -- queued waits -----------------------------------------------------------------------

    def _queue(self, op: Queue) -> Pending | None:
        pending = Pending(op.key, op.waiter, op.kind, op.objkey, op.shared, None, time.monotonic())
        session = self._pool.for_wait(pending)
        if session is None:
            return None
        pending.session = session
        with self._core.lock:
            if self._core.table.wait_of(op.key, op.waiter) is not None or self._closed:
                session.waiting = None
                clash = True
            else:
                self._core.table.add_wait(pending)
                clash = False
        if clash:
            self._pool.done(session, statement=False)
            return None
        thread = threading.Thread(target=self._wait, args=(pending, op), name="lockaspect-pg-wait", daemon=True)
        with self._core.lock:
            self._threads.add(thread)
        thread.start()
        # The attempt answers once the server has the waiter in its queue: a release right
        # after it must find the waiter there (an attempt of another owner must not win).
        delay = 0.0005
        deadline = time.monotonic() + QUEUE_CONFIRM
        params = {"pid": session.pid, "k": op.objkey}
        while not pending.done.is_set() and time.monotonic() < deadline:
            if self._send(Run(_sql.QUEUED, params, op.key))[1][0][0]:
                break
            pending.done.wait(delay)
            delay = min(delay * 2, 0.05)
        return pending

    def _wait(self, pending: Pending, op: Queue) -> None:
        """A queued wait's thread: the blocking statement, then its outcome; a granted lock
        nobody claims (the waiter left without unqueueing) is unlocked after GONE_AFTER."""
        session: Session = pending.session
        fence: int | None = None
        error: BaseException | None = None
        try:
            with session.lock:
                try:
                    fence = int(session.execute(op.sql, op.params)[0][0])
                except psycopg.Error as exc:
                    if exc.sqlstate not in CANCELLED:
                        if broken(session.conn):
                            session.lose(f"the connection failed: {exc}")
                        error = store_error(exc, op.key, self.settings.shown)
                except BaseException as exc:  # noqa: BLE001 - the thread reports, never raises
                    session.suspect = True
                    error = exc
            with self._core.lock:
                cancelled = pending.cancelled
                if fence is not None and not cancelled:
                    listeners = pending.finish(GRANTED, fence)
                else:
                    listeners = pending.finish(FAILED if error is not None else CLOSED, error=error)
                    self._core.table.remove_wait(pending)
            for listener in listeners:
                listener()
            if fence is not None and not cancelled:
                self._watch_claim(pending)
            elif fence is not None:
                with session.lock:
                    session.undo.append((op.objkey, op.shared))
                    session.give_back()
        finally:
            with self._core.lock:
                if session.waiting is pending:
                    session.waiting = None
                self._threads.discard(threading.current_thread())
            self._pool.done(session, statement=False)
            pending.settled.set()

    def _watch_claim(self, pending: Pending) -> None:
        while not pending.over.wait(1.0):
            with self._core.lock:
                if pending.state != GRANTED:
                    return
                gone = pending.watchers == 0 and time.monotonic() - pending.seen > GONE_AFTER
                if gone:
                    pending.state = CLOSED
                    self._core.table.remove_wait(pending)
            if gone:
                log.warning(
                    "a lock granted to a waiter of %r was never claimed (the waiter left); unlocking it", pending.key
                )
                with pending.session.lock:
                    pending.session.undo.append((pending.objkey, pending.shared))
                    pending.session.give_back()
                return

    def _leave(self, pending: Pending) -> None:
        """The waiter gave up: cancel its statement in the server, or unlock what it got."""
        with self._core.lock:
            pending.cancelled = True
            state = pending.state
            if state == GRANTED:
                pending.state = CLOSED
            pending.over.set()
        if state == WAITING:
            try:
                pending.session.conn.cancel_safe(timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - the connection is gone: so is the wait
                log.debug("cancelling a queued wait of %r failed: %s", pending.key, exc)
            # Over only once its statement ended (and a lock it got meanwhile is unlocked).
            pending.settled.wait(LEAVE_WAIT)
        elif state == GRANTED:
            with pending.session.lock:
                pending.session.undo.append((pending.objkey, pending.shared))
                pending.session.give_back()

    # -- Store --------------------------------------------------------------------------

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        """Try once to take ``request.keys`` (see :meth:`Store.acquire`); a busy attempt with
        a waiter id queues that waiter in the server."""
        result: AcquireResult = self._run(self._core.acquire(request))
        return result

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        """Unlock on the session that holds it: ``RELEASED``, or ``NOT_OWNER`` when the
        session was lost (or the server did not have the lock)."""
        result: ReleaseResult = self._run(self._core.release(key, token, kind))
        return result

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        """Whether ``token``'s session still has the lock (one probe of that session)."""
        return bool(self._run(self._core.reenter(key, token, kind)))

    def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        """Probe each session holding one of ``leases`` once: ``True`` for the locks it still
        has, ``False`` for a lost session (terminated, restarted, a pooler) or a lock it lost;
        ``None`` for a session whose probe could not be sent."""
        statuses, by_session, holds = self._core.holds_for(leases)
        for session, items in by_session.items():
            try:
                keys = self._probe_one(session)
            except BackendError:
                continue  # not decided: retried while the lease lasts
            self._core.probed(statuses, items, holds, keys)
        return statuses

    def _probe_one(self, session: Any) -> set[int] | None:
        """The advisory keys ``session`` holds (``None``: the session is lost); raises
        :class:`BackendError` when the probe could not decide."""
        try:
            if isinstance(session, Session):
                keys: set[int] | None = self._send(Run(_sql.PROBE, {}, "", session, after=probe_after), retry=False)[1]
                return keys
            found: set[int] | None = session.probe_from_thread(TWIN_PROBE_WAIT)
            return found
        except BackendError:
            if session.lost is None:
                raise
            return None

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Leave the server's queue: cancel the waiter's blocking statement (or unlock a
        lock granted to it and not claimed)."""
        self._run(self._core.unqueue(key, waiter, kind))

    @staticmethod
    def waiter_id(listens: bool) -> str:
        return new_waiter_id(listens)

    def notifier(self) -> Notifier | None:
        """The store's notifier (made on first use); ``None`` once closed."""
        with self._core.lock:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = Notifier(self._core)
            return self._notifier

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        raise ConfigurationError(
            "the PostgreSQL advisory store cannot wait for replicas: advisory locks live in the primary's memory "
            "and are not replicated (wait_replicas)"
        )

    def asyncio_twin(self) -> Any:
        """An :class:`~lockaspect.backends.sql.advisory.aio.AsyncPostgresAdvisoryStore` for the
        running loop: sessions of its own, the same holds table (so owners of both exclude
        each other before the server is asked)."""
        from .aio import AsyncPostgresAdvisoryStore

        twin = AsyncPostgresAdvisoryStore(self.settings, self._core, self)
        with self._core.lock:
            self._twins.append(twin)
        return twin

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        """On the first session: the schema is there, or is created (``create_schema``)."""
        if self._schema_ok:
            return
        have = conn.execute(_sql.SCHEMA_CHECK).fetchone()
        assert have is not None
        create, shown = self.settings.create_schema, self.settings.shown
        if schema_steps(have, create, shown):
            try:
                with conn.transaction():
                    for statement in _sql.SCHEMA_LOCK:
                        conn.execute(statement)
                    have = conn.execute(_sql.SCHEMA_CHECK).fetchone()
                    assert have is not None
                    for statement in schema_steps(have, create, shown):
                        conn.execute(statement)
            except psycopg.Error as exc:
                raise upgrade_error(exc, self.settings.shown) from exc
        self._schema_ok = True

    def threads(self) -> list[threading.Thread]:
        """The queued waits' threads running now."""
        with self._core.lock:
            return list(self._threads)

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's sessions, holds and waits are not the child's; the
        sockets are detached (pointed at /dev/null), never closed (that would end the
        parent's sessions)."""
        core = self._core
        core.lock = threading.Lock()
        self._pool.lock = core.lock
        self._pool.forget()
        core.table.clear()
        self._threads = set()
        self._notifier = None
        for twin in self._twins:
            twin.forget()
        self._twins = []
        self._admin_lock = threading.Lock()
        if self._admin is not None:
            detach(self._admin)
            self._admin = None

    def close(self) -> None:
        """Close every session (the server frees their locks at once) and cancel the queued
        waits (idempotent)."""
        with self._core.lock:
            self._closed = True
            notifier, self._notifier = self._notifier, None
            waits = [p for p in self._core.table.pending.values() if isinstance(p.session, Session)]
        if notifier is not None:
            notifier.close()
        for pending in waits:
            self._leave(pending)
        for session in self._pool.close():
            if session.waiting is not None:
                try:
                    session.conn.cancel_safe(timeout=5.0)
                except Exception:  # noqa: BLE001 - gone already
                    pass
        for thread in self.threads():
            thread.join(5.0)
        self._close_admin()

    def __repr__(self) -> str:
        return f"<PostgresAdvisoryStore {self.settings.shown} namespace={self.namespace!r}>"
