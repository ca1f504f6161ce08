""":class:`TableStore` (threads): the lease table's protocol side (checks, namespacing,
same-process wake-ups, undoing a failed acquire) around the operations of :mod:`._ops`, run by
the drivers of :mod:`._driver`; its asyncio twins are in :mod:`.aio`. The factories in
:mod:`.options` open them from ``sqlite://`` and ``postgresql+table://`` URLs."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from ....errors import ConfigurationError
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
from ._driver import SyncDriver
from ._notify import Hub, TableNotifier
from ._ops import Begin, Op, Query, TableOps

__all__ = ["TableStore"]

_T = TypeVar("_T")

#: How often (at most) a store deletes rows of holds that expired long ago, and how long ago.
SWEEP_EVERY = 60.0
SWEEP_GRACE = 60.0


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

    def _info(self, request: AcquireRequest) -> str | None:
        """What the hold's ``info`` column keeps: the request's owner record (``NULL``: none,
        or the store opened with ``owner_info=false``)."""
        return request.owner or None if self._with_info else None

    @staticmethod
    def _checked_permits(key: str, set_to: int | None) -> None:
        if set_to is not None and (isinstance(set_to, bool) or not isinstance(set_to, int) or set_to < 0):
            raise ConfigurationError(f"permits must be an int >= 0, got {set_to!r}", key=key)

    @staticmethod
    def _checked_delta(key: str, delta: object) -> int:
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise ConfigurationError(f"the permits to add must be an int, got {delta!r}", key=key)
        return delta

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
        """Try once to take ``request.keys`` (see :meth:`Store.acquire`), keeping its owner
        record with the hold (in the same statement). An attempt that fails midway (an error,
        an interrupt) deletes whatever it may have taken."""
        checked = self._check(request)
        key = request.keys[0]
        info = self._info(checked)
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
        return iter(self.held_list(pattern))

    def held_list(self, pattern: str = "*") -> list[str]:
        """:meth:`held_keys` as a list (one query)."""
        return self._run(self._ops.held_keys(self.namespace, pattern), None, "list held keys")

    def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` whoever holds it (fencing counters are kept; the
        holders' next renewal fails), waking this process's waiters; whether any was live."""
        name = self.namespace + key
        held = self._run(self._ops.force_release(name), key, "force-release")
        self._hub.wake(name)
        return held

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key`` (in use: the sum of its holders'
        weights), after setting its permits to ``set_to``."""
        self._checked_permits(key, set_to)
        answer = self._run(self._ops.permits(self.namespace + key, set_to), key, "permits")
        if set_to is not None:
            self._hub.wake(self.namespace + key)
        return answer

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` (negative: take away) to semaphore ``key``'s permits in one
        statement, never below 0 (a semaphore never used starts from 0): ``(permits, in
        use)`` after. Raising them wakes this process's waiters; lowering them takes no
        permit away from holders."""
        delta = self._checked_delta(key, delta)
        answer = self._run(self._ops.add_permits(self.namespace + key, delta), key, "add permits")
        if delta > 0:
            self._hub.wake(self.namespace + key)
        return answer
