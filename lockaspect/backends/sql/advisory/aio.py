"""The asyncio twin (:class:`AsyncPostgresAdvisoryStore`): the same plans as the thread
store (:mod:`._ops`) and the same holds table, sent on ``psycopg.AsyncConnection`` sessions
of its own, for one event loop; queued waits are tasks on that loop.

The watchdog renews every lease from its thread through the thread store, which asks this
twin's loop to probe the twin's sessions (``probe_from_thread``): a loop blocked for longer
than that wait leaves the renewal undecided, and a lease the loop cannot confirm in time is
lost, as any other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from ....errors import BackendError
from ...base import KINDS, AcquireRequest, AcquireResult, ReleaseResult, RenewItem, RenewStatus, new_waiter_id
from . import _sql
from ._admin import AsyncAdminMixin
from ._notify import AsyncNotifier
from ._ops import Core, Leave, Plan, Queue, Run, Undo, probe_after
from ._ops import session_of as _session_of
from ._options import Settings
from ._session import (
    _OPEN,
    CANCELLED,
    PoolBase,
    SessionBase,
    broken,
    detach,
    schema_steps,
    setup_statements,
    store_error,
    upgrade_error,
)
from ._state import CLOSED, FAILED, GONE_AFTER, GRANTED, WAITING, Pending

__all__ = ["AsyncPostgresAdvisoryStore"]

log = logging.getLogger("lockaspect.postgres")

HANDOVER_WAIT = 5.0
QUEUE_CONFIRM = 2.0


class AsyncSession(SessionBase):
    """An asyncio twin's session: an async psycopg connection on one loop."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], pid: int, twin: AsyncPostgresAdvisoryStore) -> None:
        super().__init__(conn, pid)
        self.lock = asyncio.Lock()
        self.loop = asyncio.get_running_loop()
        self.twin = twin

    async def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        cursor = await self.conn.execute(sql, params)
        return await cursor.fetchall() if cursor.description is not None else []

    async def give_back(self) -> None:
        while self.undo:
            objkey, shared = self.undo.pop()
            try:
                await self.conn.execute(_sql.UNLOCK_SHARED if shared else _sql.UNLOCK, {"k": objkey})
            except psycopg.Error as exc:
                if broken(self.conn):
                    self.lose(f"the connection failed: {exc}")
                    self.undo.clear()

    def probe_from_thread(self, timeout: float) -> set[int] | None:
        """The watchdog thread's probe of this session, run on its loop."""
        try:
            future = asyncio.run_coroutine_threadsafe(self.twin._probe(self), self.loop)
        except RuntimeError:  # the loop is closed: nobody can use this session any more
            self.lose("its event loop was closed")
            return None
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BackendError("the event loop did not probe its PostgreSQL session in time", transient=True) from None


class AsyncPool(PoolBase):
    """A twin's sessions (see :class:`~._session.PoolBase`)."""

    def __init__(self, settings: Settings, lock: Any, twin: AsyncPostgresAdvisoryStore) -> None:
        super().__init__(settings, lock)
        self.twin = twin

    async def open(self) -> AsyncSession:
        settings = self.settings
        try:
            conn = await psycopg.AsyncConnection.connect(settings.url, **settings.connect_kwargs())
        except psycopg.Error as exc:
            raise store_error(exc, None, settings.shown) from None
        try:
            await self.twin._check_schema(conn)
            for statement in setup_statements(settings, conn.info.server_version):
                await conn.execute(statement)
            return AsyncSession(conn, conn.info.backend_pid, self.twin)
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, psycopg.Error):
                raise store_error(exc, None, settings.shown) from None
            raise

    async def take(self, avoid: frozenset[int]) -> AsyncSession:
        session, stale = self._choose(avoid)
        for old in stale:
            await _close(old)
        if session is not _OPEN:
            return session  # type: ignore[no-any-return]
        opened = None
        try:
            opened = await self.open()
        finally:
            self._opened(opened)
        return opened

    async def for_wait(self, pending: Any) -> AsyncSession | None:
        session = self._choose_wait(pending)
        if session is not _OPEN:
            return session  # type: ignore[no-any-return]
        opened = None
        try:
            opened = await self.open()
        finally:
            self._opened(opened, pending)
        return opened

    async def done(self, session: AsyncSession, statement: bool = True) -> None:
        if self._done(session, statement):
            await _close(session)


async def _close(session: SessionBase) -> None:
    session.lost = session.lost or "closed"
    try:
        await session.conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


class _Stale(Exception):
    pass


class AsyncPostgresAdvisoryStore(AsyncAdminMixin):
    """The :class:`~lockaspect.backends.base.AsyncStore` twin of a
    :class:`~lockaspect.backends.sql.advisory.store.PostgresAdvisoryStore`, for one event
    loop (made by its ``asyncio_twin()``), with the asyncio admin part (``describe``,
    ``held_keys``, ``force_release``, ``permits``, ``add_permits``)."""

    kinds = KINDS

    def __init__(self, settings: Settings, core: Core, parent: Any) -> None:
        self.settings = settings
        self.namespace = settings.namespace
        self.capabilities = parent.capabilities
        self._core = core
        self._parent = parent
        self._pool = AsyncPool(settings, core.lock, self)
        self._notifier: AsyncNotifier | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def _check_schema(self, conn: psycopg.AsyncConnection[Any]) -> None:
        parent = self._parent
        if parent._schema_ok:
            return
        cursor = await conn.execute(_sql.SCHEMA_CHECK)
        have = await cursor.fetchone()
        assert have is not None
        create, shown = self.settings.create_schema, self.settings.shown
        if schema_steps(have, create, shown):
            try:
                async with conn.transaction():
                    for statement in _sql.SCHEMA_LOCK:
                        await conn.execute(statement)
                    cursor = await conn.execute(_sql.SCHEMA_CHECK)
                    have = await cursor.fetchone()
                    assert have is not None
                    for statement in schema_steps(have, create, shown):
                        await conn.execute(statement)
            except psycopg.Error as exc:
                raise upgrade_error(exc, self.settings.shown) from exc
        parent._schema_ok = True

    # -- the driver -----------------------------------------------------------------------

    async def _run(self, plan: Plan) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = await self._do(op)
            except BaseException as exc:  # noqa: BLE001 - thrown into the plan, which re-raises
                error = exc

    async def _do(self, op: Any) -> Any:
        other = _session_of(op)
        if other is not None and not (isinstance(other, AsyncSession) and other.twin is self):
            if isinstance(other, AsyncSession):  # another twin's (another loop)
                return await asyncio.get_running_loop().run_in_executor(None, self._parent._on_twin, other, op)
            # the thread store's: its driver, in a worker thread
            return await asyncio.get_running_loop().run_in_executor(None, self._parent._do, op)
        if isinstance(op, Run):
            return await self._send(op)
        if isinstance(op, Queue):
            return await self._queue(op)
        if isinstance(op, Undo):
            async with op.session.lock:
                op.session.undo.append((op.objkey, op.shared))
                await op.session.give_back()
            return None
        if isinstance(op, Leave):
            await self._leave(op.pending)
            return None
        assert isinstance(op, Pending)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, op.done.wait, HANDOVER_WAIT)
        return None

    async def _send(self, op: Run, retry: bool = True) -> tuple[AsyncSession, Any]:
        try:
            return await self._send_once(op)
        except _Stale:
            if not retry:
                raise BackendError(
                    f"PostgreSQL {self.settings.shown}: the connection failed", key=op.key, transient=True
                ) from None
            return await self._send_once(op)

    async def _send_once(self, op: Run) -> tuple[AsyncSession, Any]:
        session = op.session
        if session is None:
            session = await self._pool.take(op.avoid)
        elif session.lost is not None:
            raise BackendError(f"PostgreSQL {self.settings.shown}: {session.lost}", key=op.key, transient=True)
        else:
            with self._core.lock:
                session.users += 1
        fresh = op.session is None and session.count == 0
        try:
            async with session.lock:
                try:
                    params = op.params if op.bind is None else op.bind(session)
                    rows = await session.execute(op.sql, params)
                    result = op.after(session, rows) if op.after is not None else rows
                except psycopg.Error as exc:
                    if broken(session.conn):
                        session.lose(f"the connection failed: {exc}")
                        if fresh:
                            raise _Stale from exc
                    raise store_error(exc, op.key, self.settings.shown) from exc
                except BaseException:
                    session.suspect = True  # cancelled or interrupted: what the server did is unknown
                    raise
                finally:
                    await session.give_back()
        finally:
            await self._pool.done(session)
        return session, result

    async def _probe(self, session: AsyncSession) -> set[int] | None:
        try:
            keys: set[int] | None = (
                await self._send(Run(_sql.PROBE, {}, "", session, after=probe_after), retry=False)
            )[1]
        except BackendError:
            if session.lost is None:
                raise
            return None
        return keys

    # -- queued waits -----------------------------------------------------------------------

    async def _queue(self, op: Queue) -> Pending | None:
        pending = Pending(op.key, op.waiter, op.kind, op.objkey, op.shared, None, time.monotonic())
        session = await self._pool.for_wait(pending)
        if session is None:
            return None
        pending.session = session
        with self._core.lock:
            clash = self._core.table.wait_of(op.key, op.waiter) is not None or self._closed
            if clash:
                session.waiting = None
            else:
                self._core.table.add_wait(pending)
        if clash:
            await self._pool.done(session, statement=False)
            return None
        task = asyncio.get_running_loop().create_task(self._wait(pending, op))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        delay = 0.0005
        deadline = time.monotonic() + QUEUE_CONFIRM
        params = {"pid": session.pid, "k": op.objkey}
        while not pending.done.is_set() and time.monotonic() < deadline:
            if (await self._send(Run(_sql.QUEUED, params, op.key)))[1][0][0]:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return pending

    async def _wait(self, pending: Pending, op: Queue) -> None:
        session: AsyncSession = pending.session
        fence: int | None = None
        error: BaseException | None = None
        try:
            async with session.lock:
                try:
                    fence = int((await session.execute(op.sql, op.params))[0][0])
                except psycopg.Error as exc:
                    if exc.sqlstate not in CANCELLED:
                        if broken(session.conn):
                            session.lose(f"the connection failed: {exc}")
                        error = store_error(exc, op.key, self.settings.shown)
                except BaseException as exc:  # noqa: BLE001 - cancelled with the loop: reported
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
                await self._watch_claim(pending)
            elif fence is not None:
                async with session.lock:
                    session.undo.append((op.objkey, op.shared))
                    await session.give_back()
        finally:
            with self._core.lock:
                if session.waiting is pending:
                    session.waiting = None
            await self._pool.done(session, statement=False)
            pending.settled.set()

    async def _watch_claim(self, pending: Pending) -> None:
        while True:
            await asyncio.sleep(1.0)
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
                async with pending.session.lock:
                    pending.session.undo.append((pending.objkey, pending.shared))
                    await pending.session.give_back()
                return

    async def _leave(self, pending: Pending) -> None:
        with self._core.lock:
            pending.cancelled = True
            state = pending.state
            if state == GRANTED:
                pending.state = CLOSED
            pending.over.set()
        if state == WAITING:
            try:
                await pending.session.conn.cancel_safe(timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - the connection is gone: so is the wait
                log.debug("cancelling a queued wait of %r failed: %s", pending.key, exc)
            # Over only once its statement ended (and a lock it got meanwhile is unlocked).
            deadline = time.monotonic() + 5.0
            while not pending.settled.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        elif state == GRANTED:
            async with pending.session.lock:
                pending.session.undo.append((pending.objkey, pending.shared))
                await pending.session.give_back()

    # -- AsyncStore ---------------------------------------------------------------------------

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        result: AcquireResult = await self._run(self._core.acquire(request))
        return result

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        result: ReleaseResult = await self._run(self._core.release(key, token, kind))
        return result

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        return bool(await self._run(self._core.reenter(key, token, kind)))

    async def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        """As the thread store's (the watchdog uses that one; this is for completeness)."""
        statuses, by_session, holds = self._core.holds_for(leases)
        for session, items in by_session.items():
            keys: set[int] | None
            try:
                if isinstance(session, AsyncSession) and session.loop is asyncio.get_running_loop():
                    keys = await self._probe(session)
                else:
                    loop = asyncio.get_running_loop()
                    keys = await loop.run_in_executor(None, self._parent._probe_one, session)
            except BackendError:
                continue
            self._core.probed(statuses, items, holds, keys)
        return statuses

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        await self._run(self._core.unqueue(key, waiter, kind))

    @staticmethod
    def waiter_id(listens: bool) -> str:
        return new_waiter_id(listens)

    def notifier(self) -> AsyncNotifier | None:
        with self._core.lock:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = AsyncNotifier(self._core)
            return self._notifier

    def forget(self) -> None:
        """A forked child: drop this twin's sessions unclosed (see the thread store's)."""
        self._pool.lock = self._core.lock
        self._pool.forget()
        self._tasks = set()
        self._notifier = None
        if self._aadmin is not None:
            detach(self._aadmin)
            self._aadmin = None
        self._aadmin_lock = None

    async def aclose(self) -> None:
        """Cancel this twin's queued waits and close its sessions (idempotent)."""
        with self._core.lock:
            self._closed = True
            notifier, self._notifier = self._notifier, None
            waits = [
                p
                for p in self._core.table.pending.values()
                if isinstance(p.session, AsyncSession) and p.session.twin is self
            ]
            for pending in waits:
                self._core.table.remove_wait(pending)
        if notifier is not None:
            notifier.close()
        for pending in waits:
            await self._leave(pending)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        idle, busy = self._pool._close_all()
        for session in idle + busy:
            await _close(session)
        await self._aclose_admin()

    def __repr__(self) -> str:
        return f"<AsyncPostgresAdvisoryStore {self.settings.shown} namespace={self.namespace!r}>"
