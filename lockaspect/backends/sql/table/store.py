""":class:`TableStore` (threads) and its asyncio twins: the lease table's protocol side
(checks, namespacing, same-process wake-ups, undoing a failed acquire) around the operations
of :mod:`._ops`, run by the drivers of :mod:`._driver`. The factories in :mod:`.options` open
them from ``sqlite://`` and ``postgresql+table://`` URLs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ....errors import BackendError, ConfigurationError
from ...base import (
    KINDS,
    AcquireRequest,
    AcquireResult,
    AsyncStore,
    Capability,
    KeyState,
    ReleaseResult,
    RenewItem,
    RenewStatus,
    checked_request,
    new_waiter_id,
)
from ._driver import AsyncDriver, SyncDriver
from ._notify import AsyncTableNotifier, Hub, TableNotifier
from ._ops import Begin, Op, Query, TableOps

__all__ = ["AsyncBridgeStore", "AsyncTableStore", "TableStore", "owner_info"]

_T = TypeVar("_T")

#: How often (at most) a store deletes rows of holds that expired long ago, and how long ago.
SWEEP_EVERY = 60.0
SWEEP_GRACE = 60.0

_HOST = socket.gethostname()
_info: dict[tuple[int, str], str] = {}


def owner_info() -> str:
    """The holder's metadata stored with each hold (JSON: host, pid, thread or task name)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    name = task.get_name() if task is not None else threading.current_thread().name
    pid = os.getpid()
    found = _info.get((pid, name))
    if found is None:
        if len(_info) > 4096:  # task names are often unique: keep the cache bounded
            _info.clear()
        found = _info[(pid, name)] = json.dumps({"host": _HOST, "pid": pid, "thread": name}, separators=(",", ":"))
    return found


class _TableBase:
    """What the sync store and its async twins share: the checks and the namespace."""

    capabilities = (
        Capability.RENEWABLE
        | Capability.BATCH_RENEW
        | Capability.LOCAL_NOTIFY
        | Capability.FENCING
        | Capability.MULTI_KEY
    )
    kinds = KINDS

    def __init__(self, ops: TableOps, hub: Hub, namespace: str, label: str, info: bool) -> None:
        self._ops = ops
        self._hub = hub
        self.namespace = namespace
        self.label = label
        self._with_info = info
        self._undo_hold = ops.d.text("DELETE FROM lockaspect_holds WHERE name = :name AND owner = :owner")

    @staticmethod
    def waiter_id(listens: bool) -> str:
        """A fresh waiter id (see :func:`~lockaspect.backends.base.new_waiter_id`)."""
        return new_waiter_id(listens)

    def _check(self, request: AcquireRequest) -> AcquireRequest:
        return checked_request(request, self.namespace, f"the lease table on {self.label}")

    def _check_kind(self, kind: str, key: str) -> None:
        if kind not in KINDS:
            raise ConfigurationError(f"the lease table serves {', '.join(sorted(KINDS))}, not {kind!r}", key=key)

    def _info(self) -> str | None:
        return owner_info() if self._with_info else None

    def _answer(self, result: AcquireResult) -> AcquireResult:
        if result.busy is not None:
            return result._replace(busy=result.busy[len(self.namespace) :])
        return result

    def _renew_items(self, leases: Sequence[RenewItem]) -> list[RenewItem]:
        items = []
        for key, token, lease, kind in leases:
            self._check_kind(kind, key)
            items.append(RenewItem(self.namespace + key, token, lease, kind))
        return items

    def _undo(self, checked: AcquireRequest, leave: bool) -> Op[None]:
        """Delete whatever the attempt ``checked`` may have taken (it failed midway, or its
        caller stopped waiting for its answer), and with ``leave`` its waiter's queue place
        too (the caller stopped waiting for the lock altogether: cancelled, interrupted). One
        transaction serialised with the writers of those keys, so on PostgreSQL it comes after
        an attempt's transaction that is still running on a connection we gave up."""
        yield Begin(checked.keys)
        for name in checked.keys:
            yield Query(self._undo_hold, {"name": name, "owner": checked.token})
        if leave and checked.waiter is not None:
            yield from self._ops.unqueue(checked.keys[0], checked.waiter, checked.kind)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label} namespace={self.namespace!r}>"


class TableStore(_TableBase):
    """A lease-table store for threads (a :class:`~lockaspect.backends.base.Store` and
    :class:`~lockaspect.backends.base.AdminStore`): SQLite or PostgreSQL behind one driver.

    Use :func:`~lockaspect.backends.sql.table.open_sqlite_store` or
    :func:`~lockaspect.backends.sql.table.open_table_store` (or ``LockClient.from_url``) to
    make one.
    """

    def __init__(
        self,
        driver: SyncDriver,
        hub: Hub,
        namespace: str,
        *,
        twin: Callable[[TableStore], AsyncStore],
        info: bool = True,
    ) -> None:
        super().__init__(TableOps(driver.dialect), hub, namespace, driver.backend.label, info)
        self._driver = driver
        self._twin = twin
        self._notifier: TableNotifier | None = None
        self._closed = False
        self._swept = time.monotonic()
        self._bridge: concurrent.futures.ThreadPoolExecutor | None = None
        self._bridge_lock = threading.Lock()

    def _run(self, op: Op[_T], key: str | None, action: str) -> _T:
        return self._driver.run(op, key, action)

    # -- Store ----------------------------------------------------------------------------

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        """Try once to take ``request.keys`` (see :meth:`Store.acquire`). An attempt that
        fails midway (an error, an interrupt) deletes whatever it may have taken."""
        return self.acquire_with(request, self._info())

    def acquire_with(self, request: AcquireRequest, info: str | None) -> AcquireResult:
        """:meth:`acquire` with the holder's metadata ``info`` (read by the caller: an asyncio
        twin reads the task's name on its loop)."""
        checked = self._check(request)
        key = request.keys[0]
        try:
            if checked.kind == "lock" and len(checked.keys) == 1:  # the hot path: one statement
                ops, rows = self._ops, self._driver.rows
                name = checked.keys[0]
                if checked.waiter is not None:  # a waiter polls with a read: no write lock while held
                    held = ops.still_held(rows(ops.holder_of(name), key, "acquire"), checked.token)
                    if held is not None:
                        return held
                result = ops.claimed(rows(ops.claim(name, checked.token, checked.lease, info), key, "acquire"))
                return result or ops.busy(rows(ops.holder_of(name), key, "acquire"))
            return self._answer(self._run(self._ops.acquire(checked, info), key, "acquire"))
        except BaseException as exc:
            self._undo_quietly(checked, leave=not isinstance(exc, Exception))
            raise

    def _undo_quietly(self, checked: AcquireRequest, leave: bool) -> None:
        try:
            self._run(self._undo(checked, leave), checked.keys[0], "undo")
        except Exception:  # noqa: BLE001 - best effort: the lease ends by itself
            pass

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        """``RELEASED`` (waking this process's waiters of ``key``), or ``NOT_OWNER``."""
        self._check_kind(kind, key)
        name = self.namespace + key
        released = self._ops.released(self._driver.count(self._ops.release(name, token, kind), key, "release"))
        if released is ReleaseResult.RELEASED:
            self._hub.wake(name)
        return released

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        self._check_kind(kind, key)
        return bool(self._driver.rows(self._ops.reenter(self.namespace + key, token, kind), key, "re-enter"))

    def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        """Every lease still held by its token extended by its lease from the database's
        time, in one statement (``True``), else ``False``."""
        if not leases:
            return []
        items = self._renew_items(leases)
        statuses = self._run(self._ops.renew(items), leases[0].key, "renew")
        if time.monotonic() - self._swept > SWEEP_EVERY:
            self._swept = time.monotonic()
            try:
                self._run(self._ops.sweep(SWEEP_GRACE), None, "sweep")
            except Exception:  # noqa: BLE001 - housekeeping; the next sweep retries
                pass
        return statuses

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        self._check_kind(kind, key)
        if kind in ("fair", "write"):
            self._run(self._ops.unqueue(self.namespace + key, waiter, kind), key, "unqueue")

    def notifier(self) -> TableNotifier | None:
        """Same-process wake-ups (see :mod:`._notify`), ``None`` once closed."""
        if self._closed:
            return None
        if self._notifier is None:
            self._notifier = TableNotifier(self._hub, self.namespace)
        return self._notifier

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        raise ConfigurationError(f"the lease table on {self.label} has no replicas to wait for (wait_replicas)")

    def asyncio_twin(self) -> AsyncStore:
        """A store for the running event loop on the same database."""
        return self._twin(self)

    def bridge(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads :class:`AsyncBridgeStore` runs this store's operations on (made on
        first use, shared by every twin)."""
        with self._bridge_lock:
            if self._closed:
                raise ConfigurationError(f"the store on {self.label} is closed")
            if self._bridge is None:
                self._bridge = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lockaspect-sql")
            return self._bridge

    def threads(self) -> list[threading.Thread]:
        """The bridge's threads, if an asyncio twin started them."""
        bridge = self._bridge
        return list(getattr(bridge, "_threads", ())) if bridge is not None else []

    def reset_after_fork(self) -> None:
        """In a forked child: drop the parent's connections unclosed, and its bridge."""
        self._driver.pool.forget()
        self._notifier = None
        self._bridge = None
        self._bridge_lock = threading.Lock()

    def close(self) -> None:
        """Close the connections and wake this store's waiters (idempotent). Holds taken
        through this store end with their lease."""
        self._closed = True
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()
        with self._bridge_lock:
            bridge, self._bridge = self._bridge, None
        if bridge is not None:
            bridge.shutdown(wait=True)
        self._driver.pool.close()

    # -- AdminStore --------------------------------------------------------------------------

    def describe(self, key: str) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free)."""
        return self._run(self._ops.describe(self.namespace + key, key), key, "describe")

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The keys of this namespace held now whose name matches the glob ``pattern``."""
        return iter(self._run(self._ops.held_keys(self.namespace, pattern), None, "list held keys"))

    def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` whoever holds it (fencing counters are kept; the
        holders' next renewal fails), waking this process's waiters; whether any was live."""
        name = self.namespace + key
        held = self._run(self._ops.force_release(name), key, "force-release")
        self._hub.wake(name)
        return held

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to ``set_to``."""
        if set_to is not None and (isinstance(set_to, bool) or not isinstance(set_to, int) or set_to < 0):
            raise ConfigurationError(f"permits must be an int >= 0, got {set_to!r}", key=key)
        answer = self._run(self._ops.permits(self.namespace + key, set_to), key, "permits")
        if set_to is not None:
            self._hub.wake(self.namespace + key)
        return answer


def _busy_file(exc: BackendError) -> bool:
    """``exc`` says SQLite's file was locked by another writer (a retry on a thread may wait)."""
    cause = exc.__cause__
    return exc.transient and isinstance(cause, sqlite3.OperationalError) and "locked" in str(cause).lower()


class AsyncBridgeStore(_TableBase):
    """The asyncio twin of a SQLite :class:`TableStore`.

    An operation first runs inline on the event loop, on a connection of the twin's own that
    never waits for SQLite's write lock (``busy_timeout=0``): a statement on an uncontended
    file takes tens of microseconds, less than a hop to a thread. When another writer holds
    the file, the operation runs again on the store's bridge threads (where sqlite3 may block
    for ``busy_timeout``), awaited. An acquire whose awaiting task is cancelled while it runs
    on a thread gives back whatever it took once it finished.
    """

    def __init__(self, store: TableStore, inline: TableStore) -> None:
        super().__init__(store._ops, store._hub, store.namespace, store.label, store._with_info)
        self._store = store
        self._inline = inline
        self._notifier: AsyncTableNotifier | None = None
        self._closed = False

    async def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._inline, name)(*args)
        except BackendError as exc:
            if not _busy_file(exc):
                raise
        return await asyncio.wrap_future(self._store.bridge().submit(getattr(self._store, name), *args))

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        self._check(request)  # refused before anything is sent
        info = self._info()  # the task's name, read on the loop
        try:
            return self._inline.acquire_with(request, info)
        except BackendError as exc:
            if not _busy_file(exc):
                raise
        future = self._store.bridge().submit(self._store.acquire_with, request, info)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda done: self._give_back(done, request))
            raise

    def _give_back(self, done: concurrent.futures.Future[AcquireResult], request: AcquireRequest) -> None:
        """After an acquire whose task was cancelled: give back what it took, and its queue
        place (its waiter left; the engine's own unqueue may have run before the attempt
        queued). An attempt that failed undid itself; one never started did nothing."""
        if done.cancelled() or done.exception() is not None:
            return
        if done.result().acquired or (request.waiter is not None and request.kind in ("fair", "write")):
            self._store._undo_quietly(self._check(request), leave=True)

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        result: ReleaseResult = await self._call("release", key, token, kind)
        return result

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        return bool(await self._call("reenter", key, token, kind))

    async def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        result: Sequence[RenewStatus] = await self._call("renew", leases)
        return result

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        if kind in ("fair", "write"):
            await self._call("unqueue", key, waiter, kind)

    def notifier(self) -> AsyncTableNotifier | None:
        if self._closed:
            return None
        if self._notifier is None:
            self._notifier = AsyncTableNotifier(self._hub, self.namespace)
        return self._notifier

    async def aclose(self) -> None:
        """Wake this twin's waiters and close its inline connection (the threads and their
        connections belong to the sync store)."""
        self._closed = True
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()
        self._inline.close()


class AsyncTableStore(_TableBase):
    """The asyncio twin of a PostgreSQL :class:`TableStore`: psycopg's ``AsyncConnection``
    on the running loop, the same operations. An acquire cancelled while its statement was in
    flight closes that connection and deletes whatever the attempt may have taken."""

    def __init__(self, driver: AsyncDriver, hub: Hub, namespace: str, info: bool) -> None:
        super().__init__(TableOps(driver.dialect), hub, namespace, driver.backend.label, info)
        self._driver = driver
        self._notifier: AsyncTableNotifier | None = None
        self._closed = False
        self._undoing: set[asyncio.Task[None]] = set()

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        checked = self._check(request)
        key = request.keys[0]
        try:
            if checked.kind == "lock" and len(checked.keys) == 1:  # the hot path: one statement
                ops, rows = self._ops, self._driver.rows
                name = checked.keys[0]
                if checked.waiter is not None:  # a waiter polls with a read: no write lock while held
                    held = ops.still_held(await rows(ops.holder_of(name), key, "acquire"), checked.token)
                    if held is not None:
                        return held
                claim = ops.claim(name, checked.token, checked.lease, self._info())
                claimed = ops.claimed(await rows(claim, key, "acquire"))
                return claimed or ops.busy(await rows(ops.holder_of(name), key, "acquire"))
            result = await self._driver.run(self._ops.acquire(checked, self._info()), key, "acquire")
        except BaseException as exc:
            leave = not isinstance(exc, Exception)
            task = asyncio.get_running_loop().create_task(self._undo_quietly(checked, leave))
            self._undoing.add(task)
            task.add_done_callback(self._undoing.discard)
            raise
        return self._answer(result)

    async def _undo_quietly(self, checked: AcquireRequest, leave: bool) -> None:
        try:
            await self._driver.run(self._undo(checked, leave), checked.keys[0], "undo")
        except Exception:  # noqa: BLE001 - best effort: the lease ends by itself
            pass

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        self._check_kind(kind, key)
        name = self.namespace + key
        released = self._ops.released(await self._driver.count(self._ops.release(name, token, kind), key, "release"))
        if released is ReleaseResult.RELEASED:
            self._hub.wake(name)
        return released

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        self._check_kind(kind, key)
        return bool(await self._driver.rows(self._ops.reenter(self.namespace + key, token, kind), key, "re-enter"))

    async def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        if not leases:
            return []
        return await self._driver.run(self._ops.renew(self._renew_items(leases)), leases[0].key, "renew")

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        self._check_kind(kind, key)
        if kind in ("fair", "write"):
            await self._driver.run(self._ops.unqueue(self.namespace + key, waiter, kind), key, "unqueue")

    def notifier(self) -> AsyncTableNotifier | None:
        if self._closed:
            return None
        if self._notifier is None:
            self._notifier = AsyncTableNotifier(self._hub, self.namespace)
        return self._notifier

    async def aclose(self) -> None:
        self._closed = True
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()
        if self._undoing:
            await asyncio.gather(*self._undoing, return_exceptions=True)
        await self._driver.aclose()
