"""LockClient: the facade. One per store and process: it builds the engine (the store, the
timer and the watchdog, the holds it counts, its observers) and its two runners (threads and
asyncio), and hands out the lock blocks. Every decision is in :mod:`lockaspect.engine`.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from typing import Any

from . import _defaults, _policy, _scope
from .backends.base import Capability, Store
from .blocks import LockBlock, MultiLockBlock, RWLock
from .engine.aio import AsyncRunner
from .engine.core import Engine
from .engine.sync import SyncRunner
from .errors import ConfigurationError
from .executor import check_executor
from .factories import Factories, _check_owner_info
from .keys import check_key, check_keys
from .manual import Manual, weighted
from .observe import ClientStats, LogObserver, Observer, Observers, StatsObserver
from .operations import Operations
from .options import SPEC_FIELDS, LockSpec, OnLost
from .options import WAIT_STRATEGIES as WAIT_STRATEGIES
from .xact import open_block

__all__ = ["ClientStats", "LockClient", "LockSpec"]


_clients: weakref.WeakSet[LockClient] = weakref.WeakSet()


class LockClient(Factories, Operations, Manual):
    """A connection to one lock store, with its timer, watchdog and default executor.

    Create one per store and process (usually through :meth:`from_url`) and share it: it
    is thread-safe. Use it as a context manager or call :meth:`close` at shutdown.

    Args:
        backend: The store (e.g. :class:`~lockaspect.backends.redis.RedisBackend`).
        watchdog_lease: Seconds of lease taken in watchdog mode (``lease=None``) and
            renewed until the call completes. Default 30, as Redisson.
        tick: Resolution of the timer wheel in seconds. Default 0.1.
        delay_weight: Default for locks that do not set one: the first renewal attempt at
            ``delay_weight * watchdog_lease``. ``None``: 0.9, or for a lease under about 2 s
            the weight that leaves twice the margin ``(1 - delay_weight) * watchdog_lease``
            must exceed (``tick`` + 0.1 s).
        executor: Default executor for decorated calls: ``None``/``"inline"`` (the caller's
            thread) or a :class:`concurrent.futures.Executor` (not shut down by the client).
        wait_replicas: ``(replicas, timeout)``: after taking a lock, wait up to ``timeout``
            seconds (at most 2, under the socket timeout) for that many replicas to have it,
            else release it and raise :class:`~lockaspect.NotReplicated` (stores with
            ``Capability.REPLICAS``: Redis). ``None`` (default): no wait.
        observers: Callables told of every :class:`~lockaspect.observe.LockEvent`; one that
            raises is logged once and never fails a lock (see :mod:`lockaspect.observe`).
        owner_info: Record who holds each lock with the hold (host, pid, thread or task,
            decorated function and key template, time), for :meth:`describe` and
            ``lockaspect list``. Default ``True``; ``False`` records nothing.
        defaults: Defaults for the options of the functions decorated to lock through this
            client, e.g. ``{"wait": 2.0, "on_failure": answer_busy}``: ``lease``,
            ``delay_weight``, ``wait``, ``max_hold``, ``on_failure``, ``on_lost``,
            ``executor``, ``wait_strategy``. Precedence: the decorator's options > its
            policy > these > ``configure(defaults=...)`` > the library's. ``client.lock()``
            and the other calls are not affected: their options are their arguments.
            Checked here (:class:`TypeError`, :class:`ConfigurationError`).
        clock: Monotonic clock, injectable for tests (a :class:`~lockaspect.testing.ManualClock`).

    The operator tools (:meth:`describe`, :meth:`held_locks`, :meth:`locked`,
    :meth:`force_release`, the semaphores' permits) are in
    :class:`~lockaspect.operations.Operations`; the per-lease calls (:meth:`acquire`,
    :meth:`adopt`) in :class:`~lockaspect.manual.Manual`.
    """

    def __init__(
        self,
        backend: Store,
        *,
        watchdog_lease: float = 30.0,
        tick: float = 0.1,
        delay_weight: float | None = None,
        executor: Executor | str | None = None,
        wait_replicas: tuple[int, float] | None = None,
        observers: Iterable[Observer] | None = None,
        owner_info: bool = True,
        defaults: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_owner_info(owner_info)
        self.defaults = _defaults.check_defaults(defaults, "LockClient")
        lease, tick_s, weight = _policy.client_settings(watchdog_lease, tick, delay_weight)
        users = Observers.check(observers)
        replicated = _policy.check_wait_replicas(wait_replicas, None)
        if replicated is not None:
            if not backend.capabilities & Capability.REPLICAS:
                raise ConfigurationError(f"{backend!r} cannot wait for replicas (wait_replicas)")
            backend.wait_for_replicas(*replicated)
        self.wait_replicas = replicated
        self.backend = backend
        self.delay_weight = weight
        self.watchdog_lease = lease
        self.tick = tick_s
        self.executor = check_executor(executor)
        self._stats = StatsObserver()
        engine = self._engine = Engine(
            backend,
            watchdog_lease=lease,
            tick=tick_s,
            delay_weight=weight,
            wait_replicas=replicated,
            clock=clock,
            emit=Observers([LogObserver(), *users], stats=self._stats),
            owner_info=owner_info,
        )
        self._sync = engine.sync = SyncRunner(engine)
        self._async = engine.aio = AsyncRunner(engine)
        _clients.add(self)

    # -- public API -------------------------------------------------------------------

    def lock(
        self,
        key: str,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
        fair: bool = False,
        scope: str = "session",
        connection: Any = None,
    ) -> LockBlock:
        """Lock ``key`` for a ``with`` block; the block gets the :class:`Lease`.

        The options of :func:`~lockaspect.distributed_lock`: ``lease=None`` renews the lease
        until the block exits. A nested ``client.lock`` on the key in the same context
        re-enters. Raises :class:`LockNotAcquired` or :class:`BackendError` on entering, and
        :class:`LockLost` on exit if the lease was lost meanwhile (chained to the block's own
        exception, if any). ``scope="transaction"`` with ``connection=`` (psycopg, SQLAlchemy,
        Django) takes a PostgreSQL advisory lock in that connection's open transaction, held
        until it commits or rolls back, not until the block exits (docs/stores/sql.md).

        Example::

            with client.lock("order:42", wait=2.0) as lease:
                write(order, fence=lease.fencing_token)
        """
        spec = LockSpec.create(
            lease=lease,
            delay_weight=delay_weight,
            wait=wait,
            max_hold=max_hold,
            on_lost=on_lost,
            wait_strategy=wait_strategy,
            fair=fair,
        )
        if scope != "session" or connection is not None:
            return _transaction_block(self, check_key(key), spec, scope, connection)
        return LockBlock(self._engine, check_key(key), spec)

    def fair_lock(
        self,
        key: str,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
    ) -> LockBlock:
        """Lock ``key`` fairly: waiters get the lock in the order they asked for it.

        :meth:`lock` with ``fair=True``: a free lock goes only to the first in line, across
        processes; a dead waiter drops out after 5 s without an attempt. ``wait=0`` tries
        once and never queues. Use one kind per key (docs/concepts/fair-lock.md).

        Example::

            with client.fair_lock("ticket-desk", wait=30) as lease:
                serve_next_customer(fence=lease.fencing_token)
        """
        return self.lock(
            key,
            lease=lease,
            wait=wait,
            delay_weight=delay_weight,
            on_lost=on_lost,
            max_hold=max_hold,
            wait_strategy=wait_strategy,
            fair=True,
        )

    def multi_lock(
        self,
        keys: Iterable[str],
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
    ) -> MultiLockBlock:
        """Lock every key of ``keys`` for a ``with`` (or ``async with``) block, all at once
        or none; the block gets a :class:`~lockaspect.lease.MultiLease`.

        The keys are deduplicated, sorted and taken all or none (over several Redis Cluster
        slots key by key, given back when one is busy), so overlapping sets never deadlock and
        a failed attempt leaves nothing behind; while a key is busy the call waits for its
        release, then tries the whole set again. Each key has its own lease and fencing token
        (``multi.fencing_tokens``); the block raises :class:`LockLost` if any is lost. Holding
        some of the keys already is refused (:class:`ConfigurationError`); see docs/concepts/multi-key.md.

        Bad keys raise at once, before any I/O: :class:`ConfigurationError` (none),
        :class:`TypeError` (not a ``str``), :class:`KeyTemplateError` (malformed).

        Example::

            with client.multi_lock([f"account:{a}", f"account:{b}"], wait=5) as both:
                transfer(a, b, fences=both.fencing_tokens)
        """
        checked = check_keys(keys)
        spec = LockSpec.create(
            lease=lease,
            delay_weight=delay_weight,
            wait=wait,
            max_hold=max_hold,
            on_lost=on_lost,
            wait_strategy=wait_strategy,
        )
        return MultiLockBlock(self._engine, checked, spec)

    def rw_lock(self, key: str) -> RWLock:
        """The read-write lock ``key``: many readers at once, or one writer.

        ``.read(...)`` and ``.write(...)`` take the options of :meth:`lock` and return its
        kind of block. A writer may read inside its write block (downgrade); a reader asking
        to write gets :class:`ConfigurationError` at once instead of a deadlock. Writers are
        preferred: while one waits, new readers wait too (docs/concepts/rw-lock.md).

        Example::

            orders = client.rw_lock("orders")
            with orders.read(wait=5):
                report = summarize()
            with orders.write(wait=5) as lease:
                rewrite(fence=lease.fencing_token)
        """
        return RWLock(self._engine, check_key(key))

    def semaphore(
        self,
        key: str,
        *,
        permits: int,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
        count: int = 1,
    ) -> LockBlock:
        """Hold one of ``permits`` permits of the semaphore ``key`` for a ``with`` (or
        ``async with``) block; the block gets the permit's :class:`Lease`.

        At most ``permits`` holders at once, across processes; each permit has a lease of its
        own, so a dead holder's permit comes back when its lease ends. Waiting, ``LockLost``
        and re-entry work as for :meth:`lock`. The store remembers the number of permits:
        entering with another number raises :class:`ConfigurationError` and changes nothing
        (use :meth:`set_permits`; docs/concepts/semaphore.md). ``count=k`` takes ``k``
        permits at once, all or none, under one lease (checked before any I/O: 1 to
        ``permits``).

        Example::

            with client.semaphore("pdf-render", permits=4, wait=30) as permit:
                render(doc)
        """
        spec = LockSpec.create(
            lease=lease,
            delay_weight=delay_weight,
            wait=wait,
            max_hold=max_hold,
            on_lost=on_lost,
            wait_strategy=wait_strategy,
            permits=permits,
        )
        return LockBlock(self._engine, check_key(key), weighted(spec, count))

    def stats(self) -> ClientStats:
        """Counters since the client was created (renewals, lost leases, ...)."""
        return self._stats.snapshot(self._engine.held_count())

    def close(self) -> None:
        """Stop the client's threads and close its connections (idempotent). Leases still
        held are not released: their keys expire with their lease."""
        if self._engine.closed:
            return
        self._engine.stop()
        self.backend.close()
        _clients.discard(self)

    async def aclose(self) -> None:
        """Await the running loop's pending releases, close its connections, then the whole
        client (:meth:`close`); other loops' connections go with their loops. Idempotent."""
        await self._async.close_loop()
        self.close()

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def threads(self) -> list[threading.Thread]:
        """The library threads this client started that are alive: ``lockaspect-timer`` and
        ``lockaspect-watchdog`` however many locks are held, ``lockaspect-notifier`` once a
        caller waited, ``lockaspect-hooks`` once an ``on_lost`` hook ran for a lost lease."""
        threads = [*self._engine.threads(), *self.backend.threads()]
        return [t for t in threads if t is not None and t.is_alive()]

    def __enter__(self) -> LockClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<LockClient {type(self.backend).__name__} watchdog_lease={self.watchdog_lease:g}s {state}>"


def _transaction_block(client: LockClient, key: str, spec: LockSpec, scope: object, connection: Any) -> LockBlock:
    """``client.lock(key, scope="transaction", connection=...)``: checked before any I/O, then
    the block of :mod:`lockaspect.xact`."""
    options = {name: getattr(spec, name) for name in SPEC_FIELDS}
    _scope.check_rules({**options, "scope": _scope.check_scope(scope), "connection": connection})
    return open_block(client, key, spec, connection)


def _after_fork_in_child() -> None:
    for client in list(_clients):  # the parent's locks, threads and loops are not ours
        client._engine.reset_after_fork()
        client._sync.reset_after_fork()
        client._async.reset_after_fork()
        client.backend.reset_after_fork()
        client._stats.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
