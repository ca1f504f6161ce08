"""The asyncio twins of :class:`~.store.TableStore`: :class:`AsyncBridgeStore` (SQLite,
inline on the loop or on the sync store's threads) and :class:`AsyncTableStore` (PostgreSQL,
psycopg's ``AsyncConnection``), each with the asyncio admin part
(:class:`~lockaspect.backends.base.AsyncAdminStore`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ....errors import BackendError
from ...base import AcquireRequest, AcquireResult, KeyState, ReleaseResult, RenewItem, RenewStatus
from ._driver import AsyncDriver
from ._notify import AsyncTableNotifier, Hub
from ._ops import TableOps
from .store import TableStore, _TableBase

__all__ = ["AsyncBridgeStore", "AsyncTableStore"]


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
        try:
            return self._inline.acquire(request)
        except BackendError as exc:
            if not _busy_file(exc):
                raise
        future = self._store.bridge().submit(self._store.acquire, request)
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

    # -- AsyncAdminStore (the sync store's operations, inline or on the bridge) --

    async def describe(self, key: str) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free)."""
        states: list[KeyState] = await self._call("describe", key)
        return states

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        """The keys of this namespace held now whose name matches the glob ``pattern``."""
        keys: list[str] = await self._call("held_list", pattern)
        for key in keys:
            yield key

    async def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` (see :meth:`TableStore.force_release`)."""
        return bool(await self._call("force_release", key))

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting them to ``set_to``."""
        self._checked_permits(key, set_to)
        answer: tuple[int | None, int] = await self._call("permits", key, set_to)
        return answer

    async def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` to semaphore ``key``'s permits in one step (see
        :meth:`TableStore.add_permits`)."""
        self._checked_delta(key, delta)
        answer: tuple[int, int] = await self._call("add_permits", key, delta)
        return answer

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
                claim = ops.claim(name, checked.token, checked.lease, self._info(checked))
                claimed = ops.claimed(await rows(claim, key, "acquire"))
                return claimed or ops.busy(await rows(ops.holder_of(name), key, "acquire"))
            result = await self._driver.run(self._ops.acquire(checked, self._info(checked)), key, "acquire")
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

    # -- AsyncAdminStore ----------------------------------------------------------------------

    async def describe(self, key: str) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free)."""
        return await self._driver.run(self._ops.describe(self.namespace + key, key), key, "describe")

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        """The keys of this namespace held now whose name matches the glob ``pattern``."""
        for key in await self._driver.run(self._ops.held_keys(self.namespace, pattern), None, "list held keys"):
            yield key

    async def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` (see :meth:`TableStore.force_release`)."""
        name = self.namespace + key
        held = await self._driver.run(self._ops.force_release(name), key, "force-release")
        self._hub.wake(name)
        return held

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting them to ``set_to``."""
        self._checked_permits(key, set_to)
        answer = await self._driver.run(self._ops.permits(self.namespace + key, set_to), key, "permits")
        if set_to is not None:
            self._hub.wake(self.namespace + key)
        return answer

    async def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` to semaphore ``key``'s permits in one step (see
        :meth:`TableStore.add_permits`)."""
        delta = self._checked_delta(key, delta)
        answer = await self._driver.run(self._ops.add_permits(self.namespace + key, delta), key, "add permits")
        if delta > 0:
            self._hub.wake(self.namespace + key)
        return answer

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
