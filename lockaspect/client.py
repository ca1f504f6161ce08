"""LockClient: one per store. Owns the connections, the timer, the watchdog and the
default executor, and runs the acquire / run / release cycle for the decorator and for
``with client.lock(...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from os import urandom as _urandom
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from . import _policy
from .backends.base import AcquireRequest, AcquireResult, Capability, ReleaseResult, Store, Subscription
from .errors import _NO_RESULT, BackendError, ConfigurationError, LockLost, LockNotAcquired, NotReplicated
from .executor import Outcome, check_executor, run_body
from .keys import check_key
from .lease import _HELD, Lease, MultiLease, _find_held, _push
from .timer import HashedWheelTimer
from .watchdog import Renewal, Watchdog, lost_guard

__all__ = ["ClientStats", "LockClient", "LockSpec"]

log = logging.getLogger("lockaspect.acquire")
release_log = logging.getLogger("lockaspect.release")
lost_log = logging.getLogger("lockaspect.watchdog")

_SCHEMES = ("redis", "rediss", "unix")

#: How long a waiter waits for the store to confirm its release subscription before it
#: starts polling instead.
SUBSCRIBE_TIMEOUT = 1.0

WAIT_STRATEGIES = ("notify", "poll")

OnLost = Callable[[Lease], object]


@dataclass(frozen=True, slots=True)
class LockSpec:
    """Validated lock options, shared by the decorator and ``client.lock``.

    Attributes:
        lease: Seconds of fixed lease, or ``None`` for watchdog mode.
        delay_weight: First renewal attempt at ``delay_weight * lease``; ``None`` takes
            the client's default.
        wait: Seconds to wait for the lock; 0 tries once; ``None`` waits forever.
        max_hold: Stop renewing after this many seconds; the lease then ends and is lost.
        on_lost: Called once with the lease when it is lost.
        wait_strategy: ``"notify"``: waiters wake on the release message (falling back to
            bounded polling when pub/sub is unavailable); ``"poll"``: jittered polling
            bounded by the holder's remaining lease, for stores or proxies without pub/sub.
        fair: A fair lock: callers get it in the order they asked (see
            :meth:`LockClient.fair_lock`).
        permits: A semaphore with this many permits (see :meth:`LockClient.semaphore`);
            ``None`` for a lock.
        mode: ``"read"`` or ``"write"`` for a read-write lock (see
            :meth:`LockClient.rw_lock`); ``None`` for a lock.
    """

    lease: float | None = None
    delay_weight: float | None = None
    wait: float | None = 0.0
    max_hold: float | None = None
    on_lost: OnLost | None = None
    wait_strategy: str = "notify"
    fair: bool = False
    permits: int | None = None
    mode: str | None = None

    @property
    def kind(self) -> str:
        """``"lock"``, ``"fair"``, ``"semaphore"``, ``"read"`` or ``"write"``."""
        if self.mode is not None:
            return self.mode
        if self.permits is not None:
            return "semaphore"
        return "fair" if self.fair else "lock"

    @classmethod
    def create(
        cls,
        *,
        lease: object = None,
        delay_weight: object = None,
        wait: object = 0.0,
        max_hold: object = None,
        on_lost: object = None,
        wait_strategy: object = "notify",
        fair: object = False,
        permits: object = None,
        mode: object = None,
    ) -> LockSpec:
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be callable, got {type(on_lost).__name__}")
        if wait_strategy not in WAIT_STRATEGIES:
            if not isinstance(wait_strategy, str):
                raise TypeError(f"wait_strategy must be a str, got {type(wait_strategy).__name__}")
            raise ConfigurationError(f"wait_strategy must be 'notify' or 'poll', got {wait_strategy!r}")
        if not isinstance(fair, bool):
            raise TypeError(f"fair must be a bool, got {type(fair).__name__}")
        if permits is not None:
            if isinstance(permits, bool) or not isinstance(permits, int):
                raise TypeError(f"permits must be an int, got {type(permits).__name__}")
            if permits < 1:
                raise ConfigurationError(f"permits must be at least 1, got {permits}")
            if fair:
                raise ConfigurationError("a semaphore cannot be fair (fair=True with permits)")
        if mode is not None:
            if not isinstance(mode, str):
                raise TypeError(f"mode must be a str, got {type(mode).__name__}")
            if mode not in ("read", "write"):
                raise ConfigurationError(f"mode must be 'read' or 'write', got {mode!r}")
            if fair or permits is not None:
                raise ConfigurationError("a read-write lock (mode=) cannot also be fair or a semaphore")
        return cls(
            lease=_policy.lease_seconds(lease),
            delay_weight=None if delay_weight is None else _policy.check_delay_weight(delay_weight),
            wait=_policy.wait_seconds(wait),
            max_hold=_policy.seconds(max_hold, "max_hold", allow_none=True),
            on_lost=on_lost,
            wait_strategy=str(wait_strategy),
            fair=fair,
            permits=permits,
            mode=mode,
        )


#: Kinds whose waiters each keep a place of their own in the store's queue (no coalescing).
_OWN_PLACE = frozenset({"fair", "read", "write"})


def _acquire_call(
    backend: Any, key: str, token: str, lease_time: float, spec: LockSpec, waiter: str | None, front: bool, below: str
) -> Any:
    """The store call for one acquire attempt of ``spec``'s kind (a result, or an awaitable
    on an async store). ``below``: the token of the write lock a reader holds, else ""."""
    kind = spec.kind
    permits = spec.permits
    return backend.acquire(AcquireRequest(kind, (key,), token, lease_time, waiter, front, below, permits))


def _release_call(backend: Any, key: str, token: str, kind: str) -> Any:
    """The store call that gives back ``kind``'s hold (see :func:`_acquire_call`)."""
    return backend.release(key, token, kind)


def _reenter_call(backend: Any, key: str, token: str, kind: str) -> Any:
    """The store call that checks a re-entry's lease is still ours."""
    return backend.reenter(key, token, kind)


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot of a client's counters (see :meth:`LockClient.stats`)."""

    acquired: int
    reentered: int
    not_acquired: int
    released: int
    renewals: int
    renewal_round_trips: int
    renewal_failures: int
    lost: int
    held: int


_DEFAULT_SPEC = LockSpec()


class _Plan(NamedTuple):
    watchdog: bool
    lease_time: float
    delay_weight: float


def _with_result(lost: LockLost, result: Any) -> LockLost:
    """``lost`` again, carrying the body's result (as a single-key call's LockLost does)."""
    return LockLost(str(lost), key=lost.key, reason=lost.reason, lease=lost.lease, result=result)


def _slot_key(key: str, spec: LockSpec) -> str:
    """Where same-process waiters for ``key`` coalesce: a semaphore's apart from a lock's of
    the same name (braces cannot occur in keys)."""
    kind = spec.kind
    return key if kind in ("lock", "fair") else "{" + kind + "}" + key


def _token() -> str:
    """A fresh owner token: 128 bits from the OS CSPRNG (what ``secrets`` uses)."""
    return _urandom(16).hex()


class _Hold:
    """One hold of a lease (its acquisition, or one re-entry), owned by the ``with`` block or
    the decorated call that took it, which gives it back with ``client._release(hold)``.

    The client keeps only a weak reference to it (:class:`_HoldRef`): a hold that is
    garbage-collected without having been released (its owner was unwound by an exception
    raised asynchronously, say a signal handler's, at a point where no cleanup could run) is
    released by the watchdog thread's sweep, so nothing renews a lease nobody holds."""

    __slots__ = ("__weakref__", "lease", "ref")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.ref: _HoldRef | None = None


class _HoldRef(weakref.ref):  # type: ignore[type-arg]
    """The client's record of a :class:`_Hold`: its lease, and whether it was given back."""

    __slots__ = ("done", "lease")

    def __new__(cls, hold: _Hold, callback: Callable[[_HoldRef], object], lease: Lease) -> _HoldRef:
        return super().__new__(cls, hold, callback)

    def __init__(self, hold: _Hold, callback: Callable[[_HoldRef], object], lease: Lease) -> None:
        super().__init__(hold, callback)  # type: ignore[call-arg]
        self.lease = lease
        self.done = False


class _LoopState:
    """What a client keeps per event loop: the loop's async backend (connections belong to
    one loop), its waiter slots, and background tasks it must not lose. (Leases taken on the
    loop are renewed by the client's watchdog thread, so a busy loop cannot starve them.)"""

    __slots__ = ("_closed", "_forget", "_guard", "backend", "loop", "slots", "tasks")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        backend: Any,
        forget: Callable[[_LoopState], None] | None = None,
    ) -> None:
        self.loop = loop
        self.backend = backend
        # Called when the state closes, so the client drops it (the state refers to its loop:
        # kept in the client, it would keep every closed loop alive).
        self._forget = forget
        self.slots: dict[str, _AsyncSlot] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # asyncio.run() (and any runner calling loop.shutdown_asyncgens()) finalises the loop's
        # async generators before closing it: a started one closes this loop's connections
        # even if nobody awaits client.aclose().
        self._guard = _close_at_shutdown(self)
        step = self._guard.asend(None)
        try:
            step.send(None)
        except StopIteration:
            pass

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def join_slot(self, key: str) -> _AsyncSlot:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _AsyncSlot()
        slot.users += 1
        return slot

    def leave_slot(self, key: str, slot: _AsyncSlot) -> None:
        slot.users -= 1
        if slot.users == 0 and self.slots.get(key) is slot:
            del self.slots[key]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._forget is not None:
            self._forget(self)
        pending = [task for task in self.tasks if not task.done()]
        if pending:
            await asyncio.wait(pending)
        await self.backend.aclose()


async def _close_at_shutdown(state: _LoopState) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await state.close()


class _AsyncSlot:
    """:class:`_Slot` for one event loop's tasks."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class _LostCancel:
    """Cancels a locked body's task when its lease is lost (called from any thread)."""

    __slots__ = ("fired", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        self.loop = loop
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed: nothing left to cancel
            pass

    def _cancel(self) -> None:
        if not self.task.done() and not self.fired:  # once, also when several leases are lost
            self.fired = True
            self.task.cancel()


async def _shielded(state: _LoopState, coro: Any) -> Any:
    """Run ``coro`` in a task of its own and wait for it; a cancellation of the caller
    interrupts the wait, not the task (which the loop state keeps a reference to)."""
    return await asyncio.shield(state.spawn(coro))


def _cancelling() -> bool:
    """Whether the current task has a cancellation of its own pending (Python 3.11+)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _raise_if_cancel_lost() -> None:
    """Raise the cancellation this task was sent but never saw, before waiting any longer.

    On Python < 3.12 ``asyncio.wait_for``, which redis-py wraps around every socket write,
    returns normally when a cancellation lands just as the write completes. A waiter that
    went on waiting would then ignore its caller's timeout (until the lock frees, maybe
    never). Python 3.11+ still counts the request (``Task.cancelling()``); 3.10 cannot tell.
    """
    if _cancelling():
        raise asyncio.CancelledError


class _Slot:
    """Where this process's waiters for one key queue, so one at a time talks to the store."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


def _run_hook(lease: Lease) -> None:
    hook = lease._on_lost
    if hook is None:
        return
    try:
        result = hook(lease)
    except Exception:  # noqa: BLE001 - a user hook must not break lockaspect
        lost_log.exception("on_lost hook for %r raised", lease.key)
        return
    if inspect.isawaitable(result):
        # An async hook: run it on the event loop of the code that holds the lease.
        loop = lease._loop
        try:
            if loop is None:
                raise RuntimeError("the lease was taken by sync code: there is no loop to run it on")
            asyncio.run_coroutine_threadsafe(_await_hook(lease, result), loop)
        except RuntimeError as exc:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            lost_log.error("async on_lost hook for %r not run: %s", lease.key, exc)


async def _await_hook(lease: Lease, awaitable: Any) -> None:
    try:
        await awaitable
    except Exception:  # noqa: BLE001 - a user hook must not break lockaspect
        lost_log.exception("on_lost hook for %r raised", lease.key)


class _HookRunner:
    """Runs ``on_lost`` hooks for leases the timer or watchdog gave up.

    On a thread of their own, started on the first loss: a slow hook must neither delay
    the detection of other losses (timer) nor renewals (watchdog), and a hung renewal round
    trip must not delay a hook.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[Lease] = []
        self.thread: threading.Thread | None = None
        self._stopping = False

    def submit(self, lease: Lease) -> None:
        with self._cond:
            if self._stopping:
                return
            self._queue.append(lease)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="lockaspect-hooks", daemon=True)
                self.thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                leases, self._queue = self._queue, []
            for lease in leases:
                _run_hook(lease)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)


_clients: weakref.WeakSet[LockClient] = weakref.WeakSet()


class LockClient:
    """A connection to one lock store, with its timer, watchdog and default executor.

    Create one per store and process (usually through :meth:`from_url`) and share it: it
    is thread-safe. Use it as a context manager or call :meth:`close` at shutdown.

    Args:
        backend: The store (e.g. :class:`~lockaspect.backends.redis.RedisBackend`).
        watchdog_lease: Seconds of lease taken in watchdog mode (``lease=None``) and
            renewed until the call completes. Default 30, as Redisson.
        tick: Resolution of the timer wheel in seconds. Default 0.1.
        delay_weight: Default for locks that do not set one: the first renewal attempt is
            made at ``delay_weight * watchdog_lease``. ``None`` (default): 0.9, or for a
            watchdog lease too short for 0.9 (under about 2 s) the weight that leaves twice
            the required margin. A given value is checked here:
            ``(1 - delay_weight) * watchdog_lease`` must exceed ``tick`` + 0.1 s.
        executor: Default executor for decorated calls: ``None``/``"inline"`` (the
            caller's thread) or a :class:`concurrent.futures.Executor`. The client does not
            shut it down.
        wait_replicas: ``(replicas, timeout)``: after taking a lock, wait up to ``timeout``
            seconds (``WAIT``) for that many replicas to have it; if fewer confirm, release it
            and raise :class:`~lockaspect.NotReplicated` (the body does not run). Guards
            against a failover to a replica that never saw the lock. ``None`` (default): no
            wait. The timeout must be shorter than the socket timeout (2 s by default) and at
            most 2 s: ``WAIT`` follows every acquire attempt, also a waiter's.
        clock: Monotonic clock, injectable for tests.
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        lease = _policy.seconds(watchdog_lease, "watchdog_lease")
        tick_s = _policy.seconds(tick, "tick")
        assert lease is not None
        assert tick_s is not None
        if tick_s >= lease:
            raise ConfigurationError(f"tick ({tick_s:g}s) must be shorter than watchdog_lease ({lease:g}s)")
        if delay_weight is None:
            weight = _policy.default_delay_weight(lease, tick_s)
        else:
            weight = _policy.check_delay_weight(delay_weight)
            _policy.check_margin(lease, weight, tick_s)
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
        self._clock = clock
        self._timer = HashedWheelTimer(tick_s, clock=clock)
        self._orphans: deque[_HoldRef] = deque()
        self._watchdog = Watchdog(
            backend,
            self._timer,
            self._watchdog_lost,
            sweep=self._sweep,
            orphans=self._orphans,
            vanished=self._vanished,
            release_vanished=self._release_vanished,
            clock=clock,
        )
        self._hooks = _HookRunner()
        self._notify = bool(backend.capabilities & Capability.RELEASE_NOTIFY)
        self._closed = False
        # The client's bookkeeping lock: hold counts, counters, the live holds. A plain Lock
        # entered with ``with`` (C-level), never held across I/O or user code.
        self._count_lock = threading.Lock()
        self._counts = dict.fromkeys(("acquired", "reentered", "not_acquired", "released", "lost"), 0)
        # The leases of this client that holds (see _Hold) may still be given back to; those
        # whose last hold went are pruned by the watchdog's sweep.
        self._leases: set[Lease] = set()
        # key -> leases of this client on it in this process (any context), for _acquire's
        # fast path: a key nobody here holds cannot be a re-entry. Never too low (it drops a
        # lease only once its last hold is given back); the sweep recounts it.
        self._held_keys: dict[str, int] = {}
        self._epoch = 0  # bumped in a forked child: its inherited leases are the parent's
        self._slots: dict[str, _Slot] = {}  # key -> this process's sync waiters for it
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
        self._last_state: _LoopState | None = None
        _clients.add(self)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "lockaspect:",
        watchdog_lease: float = 30.0,
        tick: float = 0.1,
        delay_weight: float | None = None,
        executor: Executor | str | None = None,
        wait_replicas: tuple[int, float] | None = None,
        **redis_options: Any,
    ) -> LockClient:
        """A client for the lock store ``url`` names: a Redis or Valkey server, or this
        process's memory.

        The store is opened by :func:`lockaspect.backends.open_store`, which picks the
        factory registered for the URL's scheme (entry points of the group
        ``lockaspect.stores``, or :func:`~lockaspect.backends.register_store`).

        Args:
            url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for TLS, or
                ``unix:///path/to/socket[?db=0]``: query parameters are passed to redis-py.
                ``memory://``: a store in this process's memory, private to this client, or
                ``memory://<name>``: shared by every client of that name in this process
                (for tests of single-process code: see
                :mod:`lockaspect.backends.memory`; it takes no options).
            namespace: Prefix of every key the client writes. Must not contain ``{``/``}``
                (Redis).
            watchdog_lease: See :class:`LockClient`.
            tick: See :class:`LockClient`.
            delay_weight: See :class:`LockClient`.
            executor: See :class:`LockClient`.
            wait_replicas: See :class:`LockClient`.
            **redis_options: Passed to the store's factory; for Redis to
                ``redis.Redis.from_url`` (``socket_timeout`` defaults to 2 s; redis-py's own
                command retries are switched off, because whether a lock command may be
                repeated is lockaspect's decision).

        Raises:
            ConfigurationError: at once, before any connection is made, for an unknown
                scheme (listing the registered ones), a malformed URL (bad port or db) or an
                option the store would not accept (for Redis naming it, with the closest
                allowed name and the allowed ones).
        """
        from .backends import open_store

        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__}")
        backend = open_store(url, namespace=namespace, **redis_options)
        try:
            return cls(
                backend,
                watchdog_lease=watchdog_lease,
                tick=tick,
                delay_weight=delay_weight,
                executor=executor,
                wait_replicas=wait_replicas,
            )
        except BaseException:
            backend.close()
            raise

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        *,
        namespace: str = "lockaspect:",
        watchdog_lease: float = 30.0,
        tick: float = 0.1,
        delay_weight: float | None = None,
        executor: Executor | str | None = None,
        **redis_options: Any,
    ) -> LockClient:
        """A client whose locks are RedLock locks over several independent servers.

        A lock is held when a majority of the servers granted it within its validity time
        (the lease minus the time the requests took minus a clock-drift allowance of 1% +
        2 ms); otherwise it is released on every server. Renewals count when a majority
        renewed; releases go to every server; waiters poll (random, PTTL-bounded delays).
        Read docs/concepts/redlock.md before relying on it: it assumes bounded clock drift
        and pauses, and its fencing tokens are not strictly increasing.

        Args:
            urls: At least 3 server URLs (5 is usual: it survives 2 servers down), each an
                independent master, not a replica of another.
            redis_options: As for :meth:`from_url`; ``socket_timeout`` and
                ``socket_connect_timeout`` default to 0.25 s here, so a dead server costs
                little.

        Only plain locks (``lock``, the decorator without ``fair``/``mode``/``keys`` and
        not a semaphore) work on such a client; the others raise
        :class:`ConfigurationError` when used, before any I/O.
        """
        if isinstance(urls, str) or not all(isinstance(url, str) for url in urls):
            raise TypeError("urls must be a list of URL strings")
        from .backends._redis_options import check_redis_options

        for url in urls:
            check_redis_options(url, redis_options)
            if urlsplit(url).scheme not in _SCHEMES:
                raise ConfigurationError(f"unsupported lock store URL {url!r}")
        if len(set(urls)) != len(urls):
            raise ConfigurationError("RedLock needs distinct servers: a URL is repeated")
        if not isinstance(namespace, str) or "{" in namespace or "}" in namespace:
            raise ConfigurationError(f"namespace must be a str without '{{' or '}}', got {namespace!r}")
        from .backends.redlock import RedlockBackend

        if len(urls) < 3:
            raise ConfigurationError(f"RedLock needs at least 3 independent servers, got {len(urls)}")
        backend = RedlockBackend.from_urls(list(urls), namespace=namespace, **redis_options)
        try:
            return cls(backend, watchdog_lease=watchdog_lease, tick=tick, delay_weight=delay_weight, executor=executor)
        except BaseException:
            backend.close()
            raise

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
    ) -> LockBlock:
        """Lock ``key`` for a ``with`` block; the block gets the :class:`Lease`.

        Same engine and options as :func:`~lockaspect.distributed_lock`: ``lease=None``
        renews the lease from the watchdog until the block exits; ``delay_weight=None``
        uses the client's. A nested
        ``client.lock`` on the same key in the same context re-enters.

        Raises (on entering): :class:`LockNotAcquired`, :class:`BackendError`. On exit, if
        the lease was lost while the block ran, :class:`LockLost` is raised (chained to the
        block's own exception, if any).

        Example::

            with client.lock("order:42", wait=2.0) as lease:
                write(order, fence=lease.fencing_token)
        """
        if (
            lease is None
            and wait == 0.0
            and delay_weight is None
            and on_lost is None
            and max_hold is None
            and wait_strategy == "notify"
            and fair is False
        ):
            spec = _DEFAULT_SPEC
        else:
            spec = LockSpec.create(
                lease=lease,
                delay_weight=delay_weight,
                wait=wait,
                max_hold=max_hold,
                on_lost=on_lost,
                wait_strategy=wait_strategy,
                fair=fair,
            )
        return LockBlock(self, check_key(key), spec)

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

        The same block, options and guarantees as :meth:`lock` (``lock(key, fair=True)``),
        plus first come, first served across processes and within one: each waiter takes a
        place in the key's queue on its first attempt, and a free lock goes only to the
        first in line (a newcomer does not barge in while others wait). A waiter whose
        process died, or that hangs, leaves the queue once it made no attempt for
        ``FAIR_GONE_AFTER`` (5 s), so it holds up those behind it about that long (until the
        next of them notices: about 5-6 s); one that gives up (``wait`` runs out,
        cancelled) leaves at once.

        ``wait=0`` tries once and never queues: it fails while others wait, even if the
        lock is free. Fair and non-fair calls on one key exclude each other, but only fair
        calls queue in order: use one kind per key.

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

        The keys are deduplicated and sorted, and taken in one atomic step on the store, so
        two calls over overlapping sets can never each hold a part and wait for the other,
        and a failed attempt leaves nothing behind. While a key is busy the call waits as
        :meth:`lock` does (woken by that key's release), then tries the whole set again.
        Each key gets a lease of its own with its own fencing token
        (``multi.fencing_tokens``); the watchdog renews them together, and the block raises
        :class:`LockLost` if any of them is lost. Inside the block, ``client.lock(key)`` on
        one of the keys re-enters it. A multi-key lock whose keys are all held in this
        context re-enters them; one with only some of them held is refused
        (:class:`ConfigurationError`: taking the rest later is how deadlocks start).

        Raises (at once, before any I/O): :class:`ConfigurationError` for an empty key list,
        :class:`TypeError` for a key that is not a ``str``, :class:`KeyTemplateError` for a
        malformed key.

        Example::

            with client.multi_lock([f"account:{a}", f"account:{b}"], wait=5) as both:
                transfer(a, b, fences=both.fencing_tokens)
        """
        if isinstance(keys, str):
            raise TypeError("keys must be an iterable of keys, not a single str (use client.lock)")
        checked = []
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"every key must be a str, got {type(key).__name__}")
            checked.append(check_key(key))
        if not checked:
            raise ConfigurationError("multi_lock needs at least one key")
        spec = LockSpec.create(
            lease=lease,
            delay_weight=delay_weight,
            wait=wait,
            max_hold=max_hold,
            on_lost=on_lost,
            wait_strategy=wait_strategy,
        )
        return MultiLockBlock(self, tuple(sorted(set(checked))), spec)

    def rw_lock(self, key: str) -> RWLock:
        """The read-write lock ``key``: many readers at once, or one writer.

        ``client.rw_lock(key).read(...)`` and ``.write(...)`` take the same options as
        :meth:`lock` and return the same kind of block (``with`` / ``async with``), with a
        lease renewed by the watchdog, a fencing token, ``LockLost`` and re-entry (a read
        inside a read, a write inside a write). A writer may also take the read lock inside
        its write block (downgrade). A reader that asks for the write lock gets
        :class:`ConfigurationError` at once instead of a deadlock.

        Writers are preferred: while a writer waits, new readers wait too, so a stream of
        readers cannot starve writers; a waiting writer that died stops counting within 5 s.

        Example::

            orders = client.rw_lock("orders")
            with orders.read(wait=5):
                report = summarize()
            with orders.write(wait=5) as lease:
                rewrite(fence=lease.fencing_token)
        """
        return RWLock(self, check_key(key))

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
    ) -> LockBlock:
        """Hold one of ``permits`` permits of the semaphore ``key`` for a ``with`` (or
        ``async with``) block; the block gets the permit's :class:`Lease`.

        At most ``permits`` holders at once, across processes. Each permit has a lease of its
        own: renewed by the watchdog until the block exits (``lease=None``) or fixed, so a
        dead holder's permit comes back when its lease ends, never later. Waiting, failure,
        ``LockLost`` and re-entry (a nested block on the same semaphore in the same context
        re-enters the permit) work as for :meth:`lock`; ``lease.fencing_token`` grows with
        every permit handed out.

        The store remembers the number of permits. Entering with another number raises
        :class:`ConfigurationError` and changes nothing: use :meth:`set_permits`.

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
        return LockBlock(self, check_key(key), spec)

    def set_permits(self, key: str, permits: int) -> None:
        """Set the number of permits of the semaphore ``key`` (creating it if needed).

        Raising it wakes waiters at once. Lowering it takes no permit away: holders keep
        theirs, and new permits are handed out once fewer are held than the new number.
        Callers that still pass the old number get :class:`ConfigurationError`.
        """
        spec = LockSpec.create(permits=permits)
        assert spec.permits is not None
        self._admin("set_permits").permits(check_key(key), spec.permits)

    def permits(self, key: str) -> tuple[int | None, int]:
        """``(permits, in use)`` of the semaphore ``key``: its number of permits (``None``
        if it was never used) and how many are held now (leases that have not ended)."""
        state: tuple[int | None, int] = self._admin("permits").permits(check_key(key))
        return state

    def _admin(self, what: str) -> Any:
        """The store's admin part, for a semaphore's permits."""
        backend = self.backend
        if "semaphore" not in backend.kinds or not callable(getattr(backend, "permits", None)):
            raise ConfigurationError(f"{what}: {backend!r} does not serve semaphores")
        return backend

    def stats(self) -> ClientStats:
        """Counters since the client was created (renewals, lost leases, ...)."""
        wd = self._watchdog.stats
        with self._count_lock:
            counts = dict(self._counts)
            held = sum(1 for lease in self._leases if lease._refs)
        return ClientStats(
            acquired=counts["acquired"],
            reentered=counts["reentered"],
            not_acquired=counts["not_acquired"],
            released=counts["released"],
            renewals=wd.renewals,
            renewal_round_trips=wd.round_trips,
            renewal_failures=wd.renewal_failures,
            lost=counts["lost"],
            held=held,
        )

    def close(self) -> None:
        """Stop the timer and watchdog threads and close the connections. Idempotent.

        Leases still held are not released: their keys expire with their lease.
        """
        if self._closed:
            return
        self._closed = True
        # The watchdog first: a renewal in flight must not find the timer already stopped.
        self._watchdog.stop(timeout=5.0)
        self._timer.stop()
        self._hooks.stop()
        self.backend.close()
        _clients.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def threads(self) -> list[threading.Thread]:
        """The library threads this client has started and that are alive.

        Holding locks takes two: ``lockaspect-timer`` and ``lockaspect-watchdog``, however
        many locks. Waiting for a busy lock adds ``lockaspect-notifier`` (one subscriber
        connection for all waiters); the first lost lease with an ``on_lost`` hook adds
        ``lockaspect-hooks``.
        """
        threads = [self._timer.thread, self._watchdog.thread, self._hooks.thread]
        threads.extend(self.backend.threads())
        return [t for t in threads if t is not None and t.is_alive()]

    def __enter__(self) -> LockClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<LockClient {type(self.backend).__name__} watchdog_lease={self.watchdog_lease:g}s {state}>"

    # -- the engine -------------------------------------------------------------------

    def _acquire(self, key: str, spec: LockSpec) -> _Hold:
        """Re-enter a lease this context holds on ``key``, or take the lock. The caller owns
        the returned hold and gives it back with :meth:`_release`."""
        held = self._held_here(key, spec.kind)
        if held is not None:
            hold = self._reenter(held)
            if hold is not None:
                return hold
            # Its last hold was given back meanwhile (the outer call returned): take the lock.
        below = self._below(key, spec)
        plan = self._plan(spec, key)
        token = _token()
        waiter = self._own_waiter(spec) if spec.kind in _OWN_PLACE else self._early_waiter(key, spec)
        sent = self._clock()
        failure: BackendError | None = None
        try:
            result = self._try(key, token, plan.lease_time, spec, waiter, below=below)
        except BackendError as exc:
            if waiter is not None:
                self._leave_queue(key, waiter, spec)
            if not exc.transient or spec.wait == 0:
                raise
            # A store restarting or failing over: a waiting caller keeps trying until its wait
            # runs out (the attempt left nothing behind, see _try).
            result, failure, waiter = AcquireResult(False), exc, None
        except BaseException:
            if waiter is not None:
                self._leave_queue(key, waiter, spec)
            raise
        if not result.acquired:
            result, sent, token = self._wait(key, token, plan.lease_time, spec, sent, result, waiter, below, failure)
        return self._take(key, token, result, spec, plan, sent)

    def _take(self, key: str, token: str, result: AcquireResult, spec: LockSpec, plan: _Plan, sent: float) -> _Hold:
        """The hold for a granted acquisition; if anything stops it from being handed over,
        the lock is given back."""
        try:
            if self._too_few_replicas(result):
                raise self._not_replicated(key, result)
            return self._new_lease(key, token, result, spec, plan, sent, None)
        except BaseException:
            self._discard(key, token, spec)
            raise

    def _run_multi(
        self,
        keys: tuple[str, ...],
        spec: LockSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_failure: Callable[[LockNotAcquired], Any] | None,
    ) -> Any:
        """A decorated call with ``keys=``: the body runs inline under :meth:`multi_lock`."""
        block = MultiLockBlock(self, keys, spec)
        try:
            block.__enter__()
        except LockNotAcquired as exc:
            if on_failure is None:
                raise
            return on_failure(exc)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            block.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            block.__exit__(None, None, None)
        except LockLost as lost:
            raise _with_result(lost, result) from None
        return result

    async def _arun_multi(
        self,
        keys: tuple[str, ...],
        spec: LockSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_failure: Callable[[LockNotAcquired], Any] | None,
    ) -> Any:
        """:meth:`_run_multi` for ``async def``: the calling task is cancelled if a lease is lost."""
        block = MultiLockBlock(self, keys, spec)
        try:
            await block.__aenter__()
        except LockNotAcquired as exc:
            if on_failure is None:
                raise
            outcome = on_failure(exc)
            return await outcome if inspect.isawaitable(outcome) else outcome
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            await block.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            await block.__aexit__(None, None, None)
        except LockLost as lost:
            raise _with_result(lost, result) from None
        return result

    def _acquire_multi(self, keys: tuple[str, ...], spec: LockSpec) -> list[_Hold]:
        """Take every key at once (see :meth:`multi_lock`), or re-enter them all: one hold
        per key, in the keys' order."""
        held = self._multi_held(keys)
        if held is not None:
            entered = self._reenter_all(held)
            if entered is not None:
                return entered
        plan = self._plan(spec, keys[0], True)
        token = _token()
        own = self.backend.waiter_id(True)  # a place of its own in each queue it joins (not the process's)
        clock = self._clock
        start = clock()
        deadline = _policy.wait_deadline(start, spec.wait)
        notifier = (
            self.backend.notifier() if self._notify and spec.wait_strategy == "notify" and spec.wait != 0 else None
        )
        subscription: Subscription | None = None
        watched: str | None = None  # the busy key whose release we listen for
        waiter: str | None = None
        attempt = tries = 0
        failure: BackendError | None = None
        try:
            while True:
                sent = clock()
                try:
                    result = self.backend.acquire(AcquireRequest("lock", keys, token, plan.lease_time, waiter))
                    failure = None
                except BackendError as exc:
                    # The attempt left nothing behind (the backend undoes a failed attempt).
                    now = clock()
                    if not exc.transient or spec.wait == 0 or (deadline is not None and now >= deadline):
                        raise
                    failure = exc
                    result = AcquireResult(False, busy=watched or keys[0])
                    token = _token()  # see _wait_turn: the failed attempt may still arrive
                tries += 1
                if result.acquired:
                    waiter = None  # the script took us off every queue
                    break
                now = clock()
                if deadline is not None and now >= deadline:
                    if failure is not None:
                        raise failure
                    raise self._not_acquired(result.busy or keys[0], spec, start, result, tries)
                if self._closed:
                    raise ConfigurationError("the LockClient was closed while waiting", key=keys[0])
                if notifier is not None and failure is None and result.busy != watched:
                    # Listen for the busy key's release (queued by the next attempt), then retry.
                    if subscription is not None:
                        notifier.unsubscribe(subscription)
                        subscription = None
                    self._leave_queue_of(watched, waiter)
                    watched = result.busy
                    assert watched is not None
                    remaining = SUBSCRIBE_TIMEOUT if deadline is None else min(SUBSCRIBE_TIMEOUT, deadline - now)
                    subscription = notifier.subscribe(watched, remaining, own)
                    waiter = own if subscription.active else None
                    continue
                pause = _policy.retry_sleep(
                    now=now,
                    deadline=deadline,
                    holder_ttl=result.holder_ttl,
                    attempt=attempt,
                    notified=subscription is not None and subscription.active,
                )
                if subscription is not None:
                    subscription.wait(pause)
                else:
                    time.sleep(pause)
                attempt += 1
        finally:
            if subscription is not None and notifier is not None:
                notifier.unsubscribe(subscription)
            self._leave_queue_of(watched, waiter)
        holds: list[_Hold] = []
        try:
            if self._too_few_replicas(result):
                raise self._not_replicated(keys[0], result)
            for key, fence in zip(keys, result.fencing_tokens, strict=True):
                holds.append(self._new_lease(key, token, AcquireResult(True, fence), spec, plan, sent, None))
        except BaseException:
            for made in holds:
                self._release(made)
            self._discard_all(keys[len(holds) :], token)
            raise
        return holds

    def _multi_held(self, keys: tuple[str, ...]) -> list[Lease] | None:
        """The leases this context holds on every key (a re-entry), ``None`` when it holds
        none of them; refused when it holds only some."""
        held = [self._held_here(key) for key in keys]
        if all(lease is None for lease in held):
            return None
        if any(lease is None for lease in held):
            mine = [key for key, lease in zip(keys, held, strict=True) if lease is not None]
            raise ConfigurationError(
                f"this context already holds {mine!r} and asks for them together with other keys: taking the "
                "rest later is how two callers deadlock; take the whole set at once, before any of them",
                key=mine[0],
            )
        return [lease for lease in held if lease is not None]

    def _reenter_all(self, held: list[Lease]) -> list[_Hold] | None:
        """Re-enter every lease of ``held``; ``None`` when one was given back meanwhile (then
        none is re-entered and the caller takes the set afresh)."""
        entered: list[_Hold] = []
        try:
            for lease in held:
                hold = self._reenter(lease)
                if hold is None:
                    for made in entered:
                        self._release(made)
                    return None
                entered.append(hold)
        except BaseException:
            for made in entered:
                self._release(made)
            raise
        return entered

    def _discard_all(self, keys: Sequence[str], token: str) -> None:
        for key in keys:
            try:
                self.backend.release(key, token)
            except BackendError:
                pass

    def _leave_queue_of(self, key: str | None, waiter: str | None) -> None:
        """A multi-key waiter leaves the queue of the key it listened on (its own place)."""
        if key is None or waiter is None:
            return
        try:
            self.backend.unqueue(key, waiter)
        except BackendError:
            pass

    def _leave_queue(self, key: str, waiter: str, spec: LockSpec) -> None:
        """Take ``waiter`` off ``key``'s queue when its wait ends before the wait loop (which
        does this itself): a fair waiter's own place always, the process's place only when
        no other waiter of this process for ``key`` is left to use it."""
        if spec.kind not in _OWN_PLACE and _slot_key(key, spec) in self._slots:
            return
        try:
            self.backend.unqueue(key, waiter, spec.kind)
        except BackendError:
            pass

    def _below(self, key: str, spec: LockSpec) -> str:
        """For a read-write lock: the token of the write lock this context holds when it asks
        to read (a downgrade), else "". Asking to write while holding the read lock would
        wait for itself: refused."""
        if spec.kind == "read":
            writer = _find_held(self, key, "write") if key in self._held_keys else None
            return "" if writer is None else writer.token
        if spec.kind == "write" and key in self._held_keys and _find_held(self, key, "read") is not None:
            raise ConfigurationError(
                f"this context holds the read lock of {key!r}: asking for its write lock would wait for "
                "itself forever (release the read lock first, or take the write lock first and then read)",
                key=key,
            )
        return ""

    @staticmethod
    def _check_permits(key: str, spec: LockSpec, result: AcquireResult) -> None:
        """Raise when the store's semaphore has another number of permits than asked for."""
        if result.permits is not None:
            raise ConfigurationError(
                f"semaphore {key!r} has {result.permits} permits, not {spec.permits}: change the number "
                f"explicitly with client.set_permits({key!r}, {spec.permits})",
                key=key,
            )

    def _too_few_replicas(self, result: AcquireResult) -> bool:
        wanted = self.wait_replicas
        return wanted is not None and result.replicas is not None and result.replicas < wanted[0]

    def _not_replicated(self, key: str, result: AcquireResult) -> NotReplicated:
        assert self.wait_replicas is not None
        wanted, timeout = self.wait_replicas
        confirmed = result.replicas or 0
        log.warning("%r: %d of %d replica(s) confirmed the lock within %gs; released", key, confirmed, wanted, timeout)
        return NotReplicated(
            f"lock {key!r} was confirmed by {confirmed} of {wanted} replica(s) within {timeout:g}s, "
            "so a failover could lose it; it was released",
            key=key,
            replicas=confirmed,
            wanted=wanted,
        )

    def _own_waiter(self, spec: LockSpec) -> str | None:
        """The id of a waiter with a place of its own (fair lock, read-write lock), or
        ``None`` for a try-once call. Ids of waiters that will not listen for wake-ups start
        with "p" (see release.lua)."""
        if spec.wait == 0:
            return None
        listens = self._notify and spec.wait_strategy == "notify"
        return self.backend.waiter_id(listens)

    def _early_waiter(self, key: str, spec: LockSpec) -> str | None:
        """The waiter id a first attempt may queue under: when the caller would wait and this
        process already listens for ``key``'s wake-ups, a busy first attempt queues at once
        (one round trip fewer per contended acquisition)."""
        if spec.wait == 0 or spec.wait_strategy != "notify" or not self._notify:
            return None
        notifier = self.backend.notifier()
        if notifier is None or not notifier.listening(key):
            return None
        return notifier.waiter_id

    # -- steps shared by the sync and async engines (no I/O) ------------------------------

    def _held_here(self, key: str, kind: str = "lock") -> Lease | None:
        """The lease this context holds on ``key`` (a re-entry), checking the client is open."""
        if self._closed:
            raise ConfigurationError("this LockClient is closed", key=key)
        # Walk this context's held leases only if this client holds the key at all, so
        # taking many distinct locks in one context stays O(1) per lock.
        return _find_held(self, key, kind) if key in self._held_keys else None

    def _plan(self, spec: LockSpec, key: str, multi: bool = False) -> _Plan:
        """The lease to ask for and how to renew it; refuses, before any I/O, a kind the store
        does not serve."""
        backend = self.backend
        if spec.kind not in backend.kinds or (multi and not backend.capabilities & Capability.MULTI_KEY):
            what = "multi-key" if multi else spec.kind
            raise ConfigurationError(
                f"{backend!r} does not serve {what} locks (it serves: {', '.join(sorted(backend.kinds))})", key=key
            )
        watchdog = spec.lease is None
        delay_weight = self.delay_weight if spec.delay_weight is None else spec.delay_weight
        if watchdog:
            if spec.delay_weight is not None:
                _policy.check_margin(self.watchdog_lease, delay_weight, self.tick)
            lease_time = self.watchdog_lease
        else:
            lease_time = spec.lease  # type: ignore[assignment]
        if spec.max_hold is not None and spec.max_hold < lease_time:
            lease_time = spec.max_hold
        return _Plan(watchdog, lease_time, delay_weight)

    def _new_lease(
        self,
        key: str,
        token: str,
        result: AcquireResult,
        spec: LockSpec,
        plan: _Plan,
        sent: float,
        loop: asyncio.AbstractEventLoop | None,
    ) -> _Hold:
        """The lease for an acquisition, its first hold, registered with the watchdog and
        counted. ``sent``: when the acquire request left (the lease is trusted from then)."""
        granted = plan.lease_time if result.valid_for is None else min(result.valid_for, plan.lease_time)
        record = Renewal(
            key=key,
            token=token,
            kind=spec.kind,
            lease_time=plan.lease_time,
            delay_weight=plan.delay_weight,
            sent=sent,
            granted=granted,
            max_hold=spec.max_hold,
            guard=lost_guard(plan.lease_time, self.tick),
            clock=self._clock,
        )
        lease = Lease(
            client=self,
            record=record,
            fencing_token=result.fencing_token,
            watchdog=plan.watchdog,
            on_lost=spec.on_lost,
            loop=loop,
            permits=spec.permits,
        )
        record.lease_ref = weakref.ref(lease)
        hold = self._new_hold(lease)
        with self._count_lock:
            held_keys = self._held_keys
            held_keys[key] = held_keys.get(key, 0) + 1
            self._leases.add(lease)
            lease._refs.add(hold.ref)  # the hold exists from here: one step
            self._counts["acquired"] += 1
        if plan.watchdog:
            self._watchdog.register(record)
        else:
            self._watchdog.watch(record)
        return hold

    def _new_hold(self, lease: Lease) -> _Hold:
        hold = _Hold(lease)
        # The callback is deque.append itself: a C call, which no exception raised
        # asynchronously can interrupt halfway (the watchdog thread sweeps the deque).
        hold.ref = _HoldRef(hold, self._orphans.append, lease)
        return hold

    def _give_back(self, ref: _HoldRef) -> Lease | None:
        """Count one hold of ``ref.lease`` given back (once per hold, whoever gives it back:
        its owner, or the sweep). Returns the lease when that was its last hold and the
        release must go to the store; ``None`` otherwise.

        Each step of the bookkeeping is one operation, and the watchdog's sweep completes
        what an exception raised asynchronously (a signal handler's) cuts short: a lease with
        no hold left that nobody is releasing is released by the sweep."""
        lease = ref.lease
        record = lease._record
        with self._count_lock:
            refs = lease._refs
            if ref not in refs:
                return None  # given back already
            refs.discard(ref)
            if refs or lease._epoch != self._epoch:
                # Re-entered holds remain; or a forked child unwinding a block its parent
                # entered: the lock is the parent's.
                return None
            # The release is ours to send from here (the sweep leaves it to us a while).
            record.releasing_since = self._clock()
            self._forget(lease)
        if record.lost_reason is None and self._clock() >= record.lost_at:
            self._lost_here(lease, record.time_reason())
        if record.lost_reason == "not-owner":  # nothing of ours is left in the store
            self._watchdog.released(record)
            return None
        return lease

    def _forget(self, lease: Lease) -> None:
        """``lease`` has no hold left: drop it from the client's tables (lock held)."""
        if lease in self._leases:
            self._leases.discard(lease)
            held_keys = self._held_keys
            left = held_keys.get(lease.key, 0) - 1
            if left > 0:
                held_keys[lease.key] = left
            else:
                held_keys.pop(lease.key, None)

    def _release_done(self, lease: Lease, code: ReleaseResult | BackendError) -> None:
        """Act on the store's answer to a release (or on its failure)."""
        record = lease._record
        self._watchdog.released(record)
        if record.swept and code == ReleaseResult.NOT_OWNER:
            return  # the sweep had released it meanwhile (a release that took too long)
        if isinstance(code, BackendError):
            release_log.warning(
                "release of %r failed; the key expires with its lease (at most %.1fs): %s",
                lease.key,
                lease.lease_time,
                code,
            )
        elif code == ReleaseResult.NOT_OWNER:
            self._lost_here(lease, "not-owner")
        elif code == ReleaseResult.RELEASED:
            with self._count_lock:
                self._counts["released"] += 1
        else:
            release_log.warning("%r is still held by this owner after its last release", lease.key)

    def _sweep(self) -> None:
        """Give back the holds whose owner vanished without giving them back (watchdog
        thread), and recount the client's tables."""
        orphans = self._orphans
        abandoned = False
        while orphans:
            ref = orphans.popleft()
            if ref not in ref.lease._refs:
                continue
            abandoned = True
            release_log.warning(
                "a hold of %r was abandoned without being released (its block or call was unwound by "
                "an exception raised asynchronously?); releasing it",
                ref.lease.key,
            )
            self._give_back_to_store(ref, abandoned=True)
        if not abandoned:
            return
        with self._count_lock:
            leases = {lease for lease in self._leases if lease._refs}
            self._leases = leases
            counts: dict[str, int] = {}
            for lease in leases:
                counts[lease.key] = counts.get(lease.key, 0) + 1
            self._held_keys = counts

    def _vanished(self, record: Renewal) -> bool:
        """Whether a lease the watchdog is about to renew has nobody left to hold it: its
        lease object is gone, or it has no hold and nobody is releasing it (or a release
        began a whole lease ago and never finished)."""
        lease = None if record.lease_ref is None else record.lease_ref()
        if lease is None:
            return True
        if lease._refs:
            return False  # the usual case, read without the lock: holds only go away under it
        with self._count_lock:  # the owner gives its last hold back and claims the release at once
            if lease._refs:
                return False
            since = record.releasing_since
        return since is None or self._clock() - since > record.lease_time

    def _release_vanished(self, record: Renewal) -> None:
        """Release a lease nobody holds any more (watchdog thread; see :meth:`_vanished`)."""
        record.swept = True
        self._watchdog.released(record)
        release_log.warning("lease on %r has no holder left (its release never came); releasing it", record.key)
        try:
            _release_call(self.backend, record.key, record.token, record.kind)
        except BackendError as exc:
            release_log.warning("release of %r failed; the key expires with its lease: %s", record.key, exc)
        lease = None if record.lease_ref is None else record.lease_ref()
        if lease is not None:
            with self._count_lock:
                self._forget(lease)

    def _give_back_to_store(self, ref: _HoldRef, abandoned: bool = False) -> None:
        """:meth:`_release` for a hold's record (sync, on the calling thread)."""
        lease = self._give_back(ref)
        if lease is None:
            return
        code: ReleaseResult | BackendError
        try:
            code = _release_call(self.backend, lease.key, lease.token, lease.kind)
        except BackendError as exc:
            code = exc
        except BaseException:
            self._watchdog.released(lease._record)  # nobody holds it: let it expire
            raise
        if abandoned and code == ReleaseResult.NOT_OWNER:
            # Nobody to tell: the interrupted call had given the lock back already.
            self._watchdog.released(lease._record)
            return
        self._release_done(lease, code)

    def _try(
        self,
        key: str,
        token: str,
        lease_time: float,
        spec: LockSpec,
        waiter: str | None = None,
        front: bool = False,
        below: str = "",
    ) -> AcquireResult:
        # A failed attempt (a timeout, an interrupt) leaves no lock behind: the backend sends
        # the release on the same connection right behind the attempt, so the store runs it
        # after the attempt, whenever the attempt arrives.
        result: AcquireResult = _acquire_call(self.backend, key, token, lease_time, spec, waiter, front, below)
        self._check_permits(key, spec, result)
        return result

    def _discard(self, key: str, token: str, spec: LockSpec) -> None:
        try:
            _release_call(self.backend, key, token, spec.kind)
        except BackendError:
            pass

    def _wait(
        self,
        key: str,
        token: str,
        lease_time: float,
        spec: LockSpec,
        start: float,
        result: AcquireResult,
        waiter: str | None = None,
        below: str = "",
        failure: BackendError | None = None,
    ) -> tuple[AcquireResult, float, str]:
        """Wait for a busy lock: queue behind this process's other waiters for ``key``, then
        retry on each release message (or by bounded polling) until the deadline. ``waiter``:
        the id under which the failed attempt queued (the process's, or the waiter's own for
        kinds whose waiters keep their own places and do not coalesce); ``below``: see
        :meth:`_below`; ``failure``: the first attempt failed transiently (retried). Returns the
        result, when its request was sent, and the owner token it holds the lock under."""
        deadline = _policy.wait_deadline(start, spec.wait)
        turn = False
        try:
            if deadline is not None and self._clock() >= deadline:
                if failure is not None:
                    raise failure
                raise self._not_acquired(key, spec, start, result, 1)
            if log.isEnabledFor(logging.DEBUG):
                ends = "with no expiry" if result.holder_ttl is None else f"in {result.holder_ttl:.3f}s"
                limit = "forever" if spec.wait is None else f"up to {spec.wait:g}s"
                log.debug("%r is busy (the holder's lease ends %s); waiting %s", key, ends, limit)
            if spec.kind in _OWN_PLACE:
                turn = True  # the wait loop leaves the queue itself
                return self._wait_turn(
                    key, token, lease_time, spec, start, deadline, result, None, waiter, below, failure
                )
            queued = waiter is not None
            slot_key = _slot_key(key, spec)
            slot = self._join_slot(slot_key)
            try:
                # Same-process waiters coalesce: only the one holding the slot talks to the store.
                if slot.users > 1:
                    queued = False  # others of ours wait too: one of them may have used our place
                if slot.lock.acquire(blocking=False):
                    pass
                elif deadline is None:
                    queued = False  # others of ours went first: our place in the queue may be gone
                    slot.lock.acquire()
                elif slot.lock.acquire(timeout=max(0.0, deadline - self._clock())):
                    queued = False
                else:
                    raise self._not_acquired(key, spec, start, result, 1)
                try:
                    turn = True
                    return self._wait_turn(
                        key,
                        token,
                        lease_time,
                        spec,
                        start,
                        deadline,
                        result,
                        slot,
                        waiter if queued else None,
                        "",
                        failure,
                    )
                finally:
                    slot.lock.release()
            finally:
                self._leave_slot(slot_key, slot)
        except BaseException:
            if not turn and waiter is not None:
                # Timed out, interrupted or failed before our turn (the wait loop leaves the
                # queue itself).
                self._leave_queue(key, waiter, spec)
            raise

    def _wait_turn(
        self,
        key: str,
        token: str,
        lease_time: float,
        spec: LockSpec,
        start: float,
        deadline: float | None,
        result: AcquireResult,
        slot: _Slot | None,
        queued: str | None,
        below: str = "",
        failure: BackendError | None = None,
    ) -> tuple[AcquireResult, float, str]:
        """Retry until acquired or the deadline. ``slot``: this process's turn for ``key``
        (``None`` for a waiter with a place of its own); ``queued``: the id under which the
        failed attempt queued, if it did; ``failure``: the last attempt failed transiently.

        After a failed attempt the next one uses a fresh owner token: the failed attempt (and
        the release written behind it) may still arrive, after a retry that acquired the
        lock, and must not release the retry's lock."""
        if failure is not None:
            token = _token()
        clock = self._clock
        own = spec.kind in _OWN_PLACE
        notifier = self.backend.notifier() if self._notify and spec.wait_strategy == "notify" else None
        subscription: Subscription | None = None
        # Our id in the lock's waiter queue: a place of our own from the start, or the
        # process's once subscribed.
        waiter: str | None = queued if own else None
        woken = False
        listens = own and waiter is not None and waiter.startswith("n")
        attempt = 0
        tries = 1
        try:
            while True:
                now = clock()
                if deadline is not None and now >= deadline:
                    if failure is not None:
                        raise failure
                    raise self._not_acquired(key, spec, start, result, tries)
                if self._closed:
                    raise ConfigurationError("the LockClient was closed while waiting", key=key)
                if notifier is not None and subscription is None and failure is None:
                    remaining = SUBSCRIBE_TIMEOUT if deadline is None else min(SUBSCRIBE_TIMEOUT, deadline - now)
                    subscription = notifier.subscribe(key, remaining, waiter)
                    if subscription.active and not own:
                        waiter = notifier.waiter_id
                        if queued is not None:
                            continue  # queued by the failed attempt: wait for the wake-up
                    # Subscribed: retry at once (and queue for a wake-up), the holder may have
                    # released meanwhile (a fair waiter may be first in line by now).
                else:
                    pause = _policy.retry_sleep(
                        now=now,
                        deadline=deadline,
                        holder_ttl=result.holder_ttl,
                        attempt=attempt,
                        # a fair waiter that cannot hear its wake-up still re-checks often enough
                        # to keep its place (FAIR_SUBSCRIBE_GRACE)
                        notified=failure is None and ((subscription is not None and subscription.active) or listens),
                    )
                    if subscription is not None:
                        woken = subscription.wait(pause)
                    else:
                        time.sleep(pause)
                    attempt += 1
                sent = clock()
                try:
                    # Woken for this release but beaten to it: keep the head of the queue.
                    result = self._try(key, token, lease_time, spec, waiter, woken and not own, below)
                except BackendError as exc:
                    # A store restarting or failing over: keep trying until the wait runs out.
                    if not exc.transient:
                        raise
                    log.debug("%r: attempt failed, retrying while the wait lasts: %s", key, exc)
                    failure, result, token = exc, AcquireResult(False), _token()
                    continue
                failure = None
                tries += 1
                if result.acquired:
                    waiter = None  # the acquire script took us off the queue
                    return result, sent, token
        finally:
            if subscription is not None and notifier is not None:
                notifier.unsubscribe(subscription)
            if waiter is not None and (slot is None or slot.users == 1):
                # Gave up with no other waiter of ours to take over: leave the queue, so a
                # release wakes someone still waiting.
                try:
                    self.backend.unqueue(key, waiter, spec.kind)
                except BackendError:
                    pass

    def _not_acquired(
        self, key: str, spec: LockSpec, start: float, result: AcquireResult, tries: int
    ) -> LockNotAcquired:
        waited = self._clock() - start if spec.wait else 0.0
        with self._count_lock:
            self._counts["not_acquired"] += 1
        log.debug("%r not acquired after %d attempt(s)", key, tries)
        return LockNotAcquired(
            f"lock {key!r} is held by another owner" + (f" (waited {waited:.3f}s)" if spec.wait else ""),
            key=key,
            waited=waited,
            holder_ttl=result.holder_ttl,
        )

    def _join_slot(self, key: str) -> _Slot:
        with self._count_lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            slot.users += 1
            return slot

    def _leave_slot(self, key: str, slot: _Slot) -> None:
        with self._count_lock:
            slot.users -= 1
            if slot.users == 0 and self._slots.get(key) is slot:
                del self._slots[key]

    def _enter_hold(self, lease: Lease) -> _Hold | None:
        """Count one more hold of ``lease`` before asking the store (so that an outer call
        returning meanwhile cannot release the lock under it); ``None`` when its last hold
        was already given back (the caller then takes the lock afresh)."""
        if lease.lost:
            raise LockLost(
                f"cannot re-enter {lease.key!r}: its lease is lost ({lease.lost_reason})",
                key=lease.key,
                reason=lease.lost_reason or "expired",
                lease=lease,
            )
        hold = self._new_hold(lease)
        with self._count_lock:
            if not lease._refs:
                return None
            lease._refs.add(hold.ref)
        return hold

    def _entered(self, hold: _Hold, held: bool) -> None:
        """Settle a re-entry once the store said whether the lease is still ours."""
        lease = hold.lease
        if not held:
            self._lost_here(lease, "not-owner")
            raise LockLost(
                f"cannot re-enter {lease.key!r}: the store no longer has it for this owner",
                key=lease.key,
                reason="not-owner",
                lease=lease,
            )
        with self._count_lock:
            self._counts["reentered"] += 1

    def _reenter(self, lease: Lease) -> _Hold | None:
        """Re-enter ``lease`` (see :meth:`_enter_hold`); the store is asked whether it still
        has the lease for this owner (it only checks: holds are counted here, one place for
        every kind). Any failure gives the counted hold back."""
        hold = self._enter_hold(lease)
        if hold is None:
            return None
        try:
            self._entered(hold, _reenter_call(self.backend, lease.key, lease.token, lease.kind))
        except BaseException:
            self._release(hold)
            raise
        return hold

    def _release(self, hold: _Hold) -> None:
        """Give back one hold; on the last, stop the watchdog and delete the key.

        Never raises for store trouble: a release that fails leaves a key that expires
        with its lease, and the work done under the lock is not undone by it.
        """
        ref = hold.ref
        assert ref is not None
        self._give_back_to_store(ref)
        # Given back: its weak reference may die with it (no callback, no sweep for nothing).
        hold.ref = None

    def _release_when_done(self, hold: _Hold, outcome: Outcome) -> None:
        assert outcome.future is not None
        key = hold.lease.key

        def release(future: Any) -> None:
            if not future.cancelled() and future.exception() is not None:
                # The caller has already raised LockLost (or was interrupted): this is the
                # only place the body's own failure can still be seen.
                release_log.warning(
                    "the body that held %r finished after its caller stopped waiting, and raised %r",
                    key,
                    future.exception(),
                )
            try:
                self._release(hold)
            except Exception:  # noqa: BLE001 # pragma: no cover - _release does not raise for the store
                release_log.exception("deferred release of %r failed", key)

        outcome.future.add_done_callback(release)

    def _lost_here(self, lease: Lease, reason: str) -> None:
        """The caller's thread learned of the loss (release, re-entry): hook runs here."""
        if lease._mark_lost(reason):
            self._report_lost(lease.key, lease.fencing_token, reason)
            _run_hook(lease)

    def _watchdog_lost(self, record: Renewal, reason: str) -> None:
        """Report a lease the timer or watchdog gave up; the hook runs on the hook thread."""
        lease = None if record.lease_ref is None else record.lease_ref()
        if lease is None:
            # Nobody holds the lease object any more (the sweep releases what is left).
            if record.lost_reason is None:
                record.lost_reason = reason
            return
        if lease._mark_lost(reason):
            self._report_lost(lease.key, lease.fencing_token, reason)
            if lease._on_lost is not None:
                self._hooks.submit(lease)

    def _report_lost(self, key: str, fencing_token: int, reason: str) -> None:
        with self._count_lock:
            self._counts["lost"] += 1
        lost_log.warning("lease on %r lost (%s); fencing token %d is stale from now on", key, reason, fencing_token)

    def _run(
        self,
        key: str,
        spec: LockSpec,
        executor: Executor | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_failure: Callable[[LockNotAcquired], Any] | None = None,
    ) -> Any:
        """Acquire, run ``fn`` through the executor, release; raise LockLost if lost.

        ``on_failure`` turns a busy lock into a fallback result.
        """
        if on_failure is None:
            hold = self._acquire(key, spec)
        else:
            try:
                hold = self._acquire(key, spec)
            except LockNotAcquired as exc:
                return on_failure(exc)
        lease = hold.lease
        outcome: Outcome | None = None
        held = None
        try:
            held = _push(lease)
            outcome = run_body(executor, lease, fn, args, kwargs)
        finally:
            if held is not None:
                _HELD.reset(held)
            if outcome is not None and outcome.abandoned:
                self._release_when_done(hold, outcome)
            else:
                self._release(hold)
        return self._settle(lease, outcome)

    @staticmethod
    def _settle(lease: Lease, outcome: Outcome) -> Any:
        """Turn a finished (or abandoned) body into the call's result or exception."""
        if outcome.interrupt is not None:
            raise outcome.interrupt
        exception = outcome.exception
        if outcome.abandoned or lease.lost:
            reason = lease.lost_reason or "expired"
            when = (
                "while the body was still running; it keeps running in its executor"
                if outcome.abandoned
                else "before the call completed"
            )
            finished = exception is None and not outcome.abandoned
            raise LockLost(
                f"lease on {lease.key!r} lost ({reason}) {when}",
                key=lease.key,
                reason=reason,
                lease=lease,
                result=outcome.result if finished else _NO_RESULT,
                exception=exception,
            ) from exception
        if exception is not None:
            raise exception
        return outcome.result

    # -- the asyncio engine: the twins of the methods above, sharing every step -----------

    def _loop_state(self) -> _LoopState:
        """The running loop's async backend and waiter slots, made on first use."""
        loop = asyncio.get_running_loop()
        state = self._last_state
        if state is not None and state.loop is loop:
            return state
        with self._count_lock:
            state = self._states.get(loop)
            if state is None:
                backend = self.backend.asyncio_twin()
                state = _LoopState(loop, backend, self._forget_state)
                self._states[loop] = state
        self._last_state = state
        return state

    def _forget_state(self, state: _LoopState) -> None:
        """Drop a closing loop's state (see :class:`_LoopState`)."""
        with self._count_lock:
            if self._states.get(state.loop) is state:
                del self._states[state.loop]
            if self._last_state is state:
                self._last_state = None

    async def _aacquire(self, key: str, spec: LockSpec) -> _Hold:
        """:meth:`_acquire` for a task."""
        held = self._held_here(key, spec.kind)
        state = self._loop_state()
        if held is not None:
            hold = await self._areenter(held, state)
            if hold is not None:
                return hold
        below = self._below(key, spec)
        plan = self._plan(spec, key)
        token = _token()
        waiter = self._own_waiter(spec) if spec.kind in _OWN_PLACE else self._early_async_waiter(state, key, spec)
        sent = self._clock()
        failure: BackendError | None = None
        try:
            result = await self._atry(state, key, token, plan.lease_time, spec, waiter, below=below)
        except BackendError as exc:
            if waiter is not None:
                await self._aleave_queue(state, key, waiter, spec, _slot_key(key, spec) in state.slots)
            if not exc.transient or spec.wait == 0:
                raise
            result, failure, waiter = AcquireResult(False), exc, None
        except BaseException:
            if waiter is not None:
                await self._aleave_queue(state, key, waiter, spec, _slot_key(key, spec) in state.slots)
            raise
        if not result.acquired:
            result, sent, token = await self._await(
                state, key, token, plan.lease_time, spec, sent, result, waiter, below, failure
            )
        try:
            # Before Python 3.12 a cancellation that lands as redis-py completes a write can be
            # swallowed (asyncio.wait_for): it must not let a cancelled task into its body.
            _raise_if_cancel_lost()
            if self._too_few_replicas(result):
                raise self._not_replicated(key, result)
            return self._new_lease(key, token, result, spec, plan, sent, state.loop)
        except BaseException:
            await self._adiscard(state, key, token, spec)
            raise

    async def _aacquire_multi(self, keys: tuple[str, ...], spec: LockSpec) -> list[_Hold]:
        """:meth:`_acquire_multi` for a task."""
        held = self._multi_held(keys)
        state = self._loop_state()
        if held is not None:
            entered: list[_Hold] = []
            try:
                for lease in held:
                    hold = await self._areenter(lease, state)
                    if hold is None:
                        break
                    entered.append(hold)
                else:
                    return entered
            except BaseException:
                for made in entered:
                    await self._arelease_shielded(made, state)
                raise
            for made in entered:
                await self._arelease_shielded(made, state)
        plan = self._plan(spec, keys[0], True)
        token = _token()
        own = state.backend.waiter_id(True)
        clock = self._clock
        start = clock()
        deadline = _policy.wait_deadline(start, spec.wait)
        notify = self._notify and spec.wait_strategy == "notify" and spec.wait != 0
        notifier = state.backend.notifier() if notify else None
        subscription: Any = None
        watched: str | None = None
        waiter: str | None = None
        attempt = tries = 0
        failure: BackendError | None = None
        try:
            while True:
                _raise_if_cancel_lost()
                sent = clock()
                try:
                    result = await state.backend.acquire(AcquireRequest("lock", keys, token, plan.lease_time, waiter))
                    failure = None
                except BackendError as exc:
                    # The attempt left nothing behind (the backend undoes a failed attempt).
                    now = clock()
                    if not exc.transient or spec.wait == 0 or (deadline is not None and now >= deadline):
                        raise
                    failure = exc
                    result = AcquireResult(False, busy=watched or keys[0])
                    token = _token()  # see _wait_turn: the failed attempt may still arrive
                tries += 1
                if result.acquired:
                    waiter = None
                    break
                now = clock()
                if deadline is not None and now >= deadline:
                    if failure is not None:
                        raise failure
                    raise self._not_acquired(result.busy or keys[0], spec, start, result, tries)
                if self._closed:
                    raise ConfigurationError("the LockClient was closed while waiting", key=keys[0])
                if notifier is not None and failure is None and result.busy != watched:
                    if subscription is not None:
                        notifier.unsubscribe(subscription)
                        subscription = None
                    await self._aleave_queue_of(state, watched, waiter)
                    watched = result.busy
                    assert watched is not None
                    remaining = SUBSCRIBE_TIMEOUT if deadline is None else min(SUBSCRIBE_TIMEOUT, deadline - now)
                    subscription = await notifier.subscribe(watched, remaining, own)
                    waiter = own if subscription.active else None
                    continue
                pause = _policy.retry_sleep(
                    now=now,
                    deadline=deadline,
                    holder_ttl=result.holder_ttl,
                    attempt=attempt,
                    notified=subscription is not None and subscription.active,
                )
                if subscription is not None:
                    await subscription.wait(pause)
                else:
                    await asyncio.sleep(pause)
                attempt += 1
        finally:
            if subscription is not None and notifier is not None:
                notifier.unsubscribe(subscription)
            await self._aleave_queue_of(state, watched, waiter)
        holds: list[_Hold] = []
        try:
            _raise_if_cancel_lost()
            if self._too_few_replicas(result):
                raise self._not_replicated(keys[0], result)
            for key, fence in zip(keys, result.fencing_tokens, strict=True):
                holds.append(self._new_lease(key, token, AcquireResult(True, fence), spec, plan, sent, state.loop))
        except BaseException:
            for made in holds:
                await self._arelease_shielded(made, state)
            await self._adiscard_all(state, keys[len(holds) :], token)
            raise
        return holds

    async def _adiscard_all(self, state: _LoopState, keys: Sequence[str], token: str) -> None:
        async def discard() -> None:
            for key in keys:
                try:
                    await state.backend.release(key, token)
                except BackendError:
                    pass

        await _shielded(state, discard())

    async def _aleave_queue_of(self, state: _LoopState, key: str | None, waiter: str | None) -> None:
        """:meth:`_leave_queue_of` for a task (shielded)."""
        if key is None or waiter is None:
            return

        async def unqueue() -> None:
            try:
                await state.backend.unqueue(key, waiter)
            except BackendError:
                pass

        with contextlib.suppress(BaseException):
            await _shielded(state, unqueue())

    async def _aleave_queue(self, state: _LoopState, key: str, waiter: str, spec: LockSpec, others: bool) -> None:
        """:meth:`_leave_queue` for a task (shielded: it may run while the task is cancelled);
        ``others``: other waiters of this loop still use the loop's place."""
        if spec.kind not in _OWN_PLACE and others:
            return

        async def unqueue() -> None:
            try:
                await state.backend.unqueue(key, waiter, spec.kind)
            except BackendError:
                pass

        with contextlib.suppress(BaseException):
            await _shielded(state, unqueue())

    def _early_async_waiter(self, state: _LoopState, key: str, spec: LockSpec) -> str | None:
        """:meth:`_early_waiter` for a loop's notifier."""
        if spec.wait == 0 or spec.wait_strategy != "notify" or not self._notify:
            return None
        notifier = state.backend.notifier()
        if not notifier.listening(key):
            return None
        waiter: str = notifier.waiter_id
        return waiter

    async def _atry(
        self,
        state: _LoopState,
        key: str,
        token: str,
        lease_time: float,
        spec: LockSpec,
        waiter: str | None = None,
        front: bool = False,
        below: str = "",
    ) -> AcquireResult:
        # A failed or cancelled attempt leaves no lock behind: the backend sends the release
        # on the same connection right behind the attempt (see _try).
        result: AcquireResult = await _acquire_call(state.backend, key, token, lease_time, spec, waiter, front, below)
        self._check_permits(key, spec, result)
        return result

    async def _adiscard(self, state: _LoopState, key: str, token: str, spec: LockSpec) -> None:
        async def discard() -> None:
            try:
                await _release_call(state.backend, key, token, spec.kind)
            except BackendError:
                pass

        await _shielded(state, discard())

    async def _await(
        self,
        state: _LoopState,
        key: str,
        token: str,
        lease_time: float,
        spec: LockSpec,
        start: float,
        result: AcquireResult,
        waiter: str | None = None,
        below: str = "",
        failure: BackendError | None = None,
    ) -> tuple[AcquireResult, float, str]:
        """:meth:`_wait` for a task: queue behind this loop's other waiters for ``key``."""
        deadline = _policy.wait_deadline(start, spec.wait)
        slot_key = _slot_key(key, spec)
        slot: _AsyncSlot | None = None
        turn = False
        try:
            _raise_if_cancel_lost()
            if deadline is not None and self._clock() >= deadline:
                if failure is not None:
                    raise failure
                raise self._not_acquired(key, spec, start, result, 1)
            if spec.kind in _OWN_PLACE:
                turn = True  # the wait loop leaves the queue itself
                return await self._await_turn(
                    state, key, token, lease_time, spec, start, deadline, result, None, waiter, below, failure
                )
            queued = waiter is not None
            slot = state.join_slot(slot_key)
            if slot.users > 1:
                queued = False  # others of ours wait too: one of them may have used our place
            if not slot.lock.locked():
                await slot.lock.acquire()  # free: taken at once, without a suspension
            elif deadline is None:
                queued = False  # others of ours went first: our place in the queue may be gone
                await slot.lock.acquire()
            else:
                queued = False
                try:
                    await asyncio.wait_for(slot.lock.acquire(), max(0.0, deadline - self._clock()))
                except asyncio.TimeoutError:
                    raise self._not_acquired(key, spec, start, result, 1) from None
            turn = True
            try:
                return await self._await_turn(
                    state,
                    key,
                    token,
                    lease_time,
                    spec,
                    start,
                    deadline,
                    result,
                    slot,
                    waiter if queued else None,
                    "",
                    failure,
                )
            finally:
                slot.lock.release()
        except BaseException:
            if not turn and waiter is not None:
                # Timed out, cancelled or failed before our turn, at any await point (the wait
                # loop leaves the queue itself).
                others = slot.users > 1 if slot is not None else slot_key in state.slots
                await self._aleave_queue(state, key, waiter, spec, others)
            raise
        finally:
            if slot is not None:
                state.leave_slot(slot_key, slot)

    async def _await_turn(
        self,
        state: _LoopState,
        key: str,
        token: str,
        lease_time: float,
        spec: LockSpec,
        start: float,
        deadline: float | None,
        result: AcquireResult,
        slot: _AsyncSlot | None,
        queued: str | None,
        below: str = "",
        failure: BackendError | None = None,
    ) -> tuple[AcquireResult, float, str]:
        """:meth:`_wait_turn` for a task (a fresh token after a failed attempt, see there)."""
        if failure is not None:
            token = _token()
        clock = self._clock
        own = spec.kind in _OWN_PLACE
        notifier = state.backend.notifier() if self._notify and spec.wait_strategy == "notify" else None
        subscription: Any = None
        waiter: str | None = queued if own else None
        woken = False
        listens = own and waiter is not None and waiter.startswith("n")
        attempt = 0
        tries = 1
        try:
            while True:
                _raise_if_cancel_lost()
                now = clock()
                if deadline is not None and now >= deadline:
                    if failure is not None:
                        raise failure
                    raise self._not_acquired(key, spec, start, result, tries)
                if self._closed:
                    raise ConfigurationError("the LockClient was closed while waiting", key=key)
                if notifier is not None and subscription is None and failure is None:
                    remaining = SUBSCRIBE_TIMEOUT if deadline is None else min(SUBSCRIBE_TIMEOUT, deadline - now)
                    subscription = await notifier.subscribe(key, remaining, waiter)
                    if subscription.active and not own:
                        waiter = notifier.waiter_id
                        if queued is not None:
                            continue  # queued by the failed attempt: wait for the wake-up
                    # Subscribed: retry at once (and queue for a wake-up), the holder may have
                    # released meanwhile (a fair waiter may be first in line by now).
                else:
                    pause = _policy.retry_sleep(
                        now=now,
                        deadline=deadline,
                        holder_ttl=result.holder_ttl,
                        attempt=attempt,
                        # a fair waiter that cannot hear its wake-up still re-checks often enough
                        # to keep its place (FAIR_SUBSCRIBE_GRACE)
                        notified=failure is None and ((subscription is not None and subscription.active) or listens),
                    )
                    if subscription is not None:
                        woken = await subscription.wait(pause)
                    else:
                        await asyncio.sleep(pause)
                    attempt += 1
                sent = clock()
                try:
                    # Woken for this release but beaten to it: keep the head of the queue.
                    result = await self._atry(state, key, token, lease_time, spec, waiter, woken and not own, below)
                except BackendError as exc:
                    if not exc.transient:
                        raise
                    log.debug("%r: attempt failed, retrying while the wait lasts: %s", key, exc)
                    failure, result, token = exc, AcquireResult(False), _token()
                    continue
                failure = None
                tries += 1
                if result.acquired:
                    waiter = None  # the acquire script took us off the queue
                    return result, sent, token
        finally:
            if subscription is not None and notifier is not None:
                notifier.unsubscribe(subscription)
            if waiter is not None and (slot is None or slot.users == 1):
                # Gave up with no other waiter of ours to take over: leave the queue (shielded:
                # this may run while the waiter is being cancelled).
                async def unqueue() -> None:
                    try:
                        await state.backend.unqueue(key, waiter, spec.kind)
                    except BackendError:
                        pass

                with contextlib.suppress(BaseException):
                    await _shielded(state, unqueue())

    async def _areenter(self, lease: Lease, state: _LoopState) -> _Hold | None:
        """:meth:`_reenter` for a task. The store only checks (holds are counted here), so a
        cancelled check changes nothing there: the counted hold is given back."""
        hold = self._enter_hold(lease)
        if hold is None:
            return None
        try:
            self._entered(hold, await _reenter_call(state.backend, lease.key, lease.token, lease.kind))
        except BaseException:
            assert hold.ref is not None
            last = self._give_back(hold.ref)  # no await unless it was the last hold
            if last is not None:
                await _shielded(state, self._arelease_store(last, state))
            raise
        return hold

    async def _arelease(self, hold: _Hold, state: _LoopState) -> None:
        """:meth:`_release` for a task; run it through :meth:`_arelease_shielded`."""
        ref = hold.ref
        assert ref is not None
        lease = self._give_back(ref)
        hold.ref = None  # see _release
        if lease is not None:
            await self._arelease_store(lease, state)

    async def _arelease_store(self, lease: Lease, state: _LoopState) -> None:
        """Release ``lease`` (its last hold was given back) in the store."""
        code: ReleaseResult | BackendError
        try:
            code = await _release_call(state.backend, lease.key, lease.token, lease.kind)
        except BackendError as exc:
            code = exc
        except BaseException:
            self._watchdog.released(lease._record)  # nobody holds it: let it expire
            raise
        self._release_done(lease, code)

    async def _arelease_shielded(self, hold: _Hold, state: _LoopState) -> None:
        """Release in a task of its own: a caller cancelled meanwhile stops waiting, the
        release does not (and waits on nothing but its own round trip)."""
        await _shielded(state, self._arelease(hold, state))

    async def _arun(
        self,
        key: str,
        spec: LockSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_failure: Callable[[LockNotAcquired], Any] | None = None,
    ) -> Any:
        """:meth:`_run` for ``async def``: the body runs as a task, cancelled if the lease is lost."""
        try:
            hold = await self._aacquire(key, spec)
        except LockNotAcquired as exc:
            if on_failure is None:
                raise
            value = on_failure(exc)
            return await value if inspect.isawaitable(value) else value
        lease = hold.lease
        state = self._loop_state()
        loop = state.loop
        held = _push(lease)
        try:
            body = loop.create_task(fn(*args, **kwargs))  # a copy of this context: it holds the lease
        except BaseException:
            _HELD.reset(held)
            await self._arelease_shielded(hold, state)
            raise
        _HELD.reset(held)
        lost_cancel = _LostCancel(loop, body)
        lease._add_lost_waiter(lost_cancel)
        body.add_done_callback(lambda _: lease._remove_lost_waiter(lost_cancel))
        try:
            result = await body
        except asyncio.CancelledError as exc:
            if not body.done():
                # We were cancelled: the body got the cancellation too; let it finish its own
                # cleanup before the lock goes.
                await asyncio.wait({body})
            await self._arelease_shielded(hold, state)
            if lost_cancel.fired and not _cancelling():
                raise LockLost(
                    f"lease on {key!r} lost ({lease.lost_reason or 'expired'}); the body was cancelled",
                    key=key,
                    reason=lease.lost_reason or "expired",
                    lease=lease,
                    exception=exc,
                ) from exc
            raise
        except BaseException as exc:
            await self._arelease_shielded(hold, state)
            if lease.lost and isinstance(exc, Exception):
                reason = lease.lost_reason or "expired"
                raise LockLost(
                    f"lease on {key!r} lost ({reason}) before the call completed",
                    key=key,
                    reason=reason,
                    lease=lease,
                    exception=exc,
                ) from exc
            raise
        await self._arelease_shielded(hold, state)
        if lease.lost:
            reason = lease.lost_reason or "expired"
            raise LockLost(
                f"lease on {key!r} lost ({reason}) before the call completed",
                key=key,
                reason=reason,
                lease=lease,
                result=result,
            )
        return result

    async def aclose(self) -> None:
        """Close the running event loop's connections, then the whole client (:meth:`close`).

        Pending releases are awaited first. Other loops' connections are dropped with their
        loops. Idempotent.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._count_lock:
            state = self._states.pop(loop, None) if loop is not None else None
            if self._last_state is state:
                self._last_state = None
        if state is not None:
            await state.close()
        self.close()

    def _reset_after_fork(self) -> None:
        self._timer._reset_after_fork()
        self._watchdog._reset_after_fork()
        self._hooks = _HookRunner()
        self.backend.reset_after_fork()
        self._count_lock = threading.Lock()
        self._counts = dict.fromkeys(self._counts, 0)
        self._held_keys = {}
        # The parent's holds, waiter slots and event loops: none of them is this process's.
        self._leases = set()
        self._orphans.clear()
        self._slots = {}
        self._states = weakref.WeakKeyDictionary()
        self._last_state = None
        self._epoch += 1
        self._watchdog.stats = type(self._watchdog.stats)()


class RWLock:
    """A read-write lock on one key (see :meth:`LockClient.rw_lock`)."""

    __slots__ = ("_client", "key")

    def __init__(self, client: LockClient, key: str) -> None:
        self._client = client
        self.key = key

    def read(
        self,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
    ) -> LockBlock:
        """A block holding the lock for reading, shared with other readers."""
        return self._block("read", lease, wait, delay_weight, on_lost, max_hold, wait_strategy)

    def write(
        self,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
    ) -> LockBlock:
        """A block holding the lock for writing, alone."""
        return self._block("write", lease, wait, delay_weight, on_lost, max_hold, wait_strategy)

    def _block(
        self,
        mode: str,
        lease: float | None,
        wait: float | None,
        delay_weight: float | None,
        on_lost: OnLost | None,
        max_hold: float | None,
        wait_strategy: str,
    ) -> LockBlock:
        spec = LockSpec.create(
            lease=lease,
            delay_weight=delay_weight,
            wait=wait,
            max_hold=max_hold,
            on_lost=on_lost,
            wait_strategy=wait_strategy,
            mode=mode,
        )
        return LockBlock(self._client, self.key, spec)

    def __repr__(self) -> str:
        return f"<RWLock {self.key!r}>"


class LockBlock:
    """The context manager returned by :meth:`LockClient.lock`, for ``with`` and ``async with``.

    ``async with`` takes the lock without blocking the event loop and, if the lease is lost
    while the block runs, cancels the task running the block; the block then ends with
    :class:`~lockaspect.LockLost` (chained to that cancellation) instead of ``CancelledError``.
    """

    __slots__ = ("_client", "_hold", "_key", "_lost_cancel", "_spec", "_token")

    def __init__(self, client: LockClient, key: str, spec: LockSpec) -> None:
        self._client = client
        self._key = key
        self._spec = spec
        self._hold: _Hold | None = None
        self._token: Any = None
        self._lost_cancel: _LostCancel | None = None

    def __enter__(self) -> Lease:
        if self._hold is not None:
            raise RuntimeError("this lock block is already entered; call client.lock() again")
        hold = self._client._acquire(self._key, self._spec)
        self._hold = hold
        self._token = _push(hold.lease)
        return hold.lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hold, self._hold = self._hold, None
        assert hold is not None
        try:
            _HELD.reset(self._token)
        finally:
            self._client._release(hold)
        _raise_if_lost(hold.lease, exc)

    async def __aenter__(self) -> Lease:
        if self._hold is not None:
            raise RuntimeError("this lock block is already entered; call client.lock() again")
        hold = await self._client._aacquire(self._key, self._spec)
        self._hold = hold
        lease = hold.lease
        self._token = _push(lease)
        task = asyncio.current_task()
        if task is not None:
            self._lost_cancel = _LostCancel(asyncio.get_running_loop(), task)
            lease._add_lost_waiter(self._lost_cancel)
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hold, self._hold = self._hold, None
        assert hold is not None
        lease = hold.lease
        lost_cancel, self._lost_cancel = self._lost_cancel, None
        if lost_cancel is not None:
            lost_cancel.task = _DONE  # from here on a loss must not cancel the task
            lease._remove_lost_waiter(lost_cancel)
        try:
            _HELD.reset(self._token)
        finally:
            await self._client._arelease_shielded(hold, self._client._loop_state())
        if lost_cancel is not None and lost_cancel.fired and isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()  # the cancellation was ours, not the caller's
            if not _cancelling():
                reason = lease.lost_reason or "expired"
                raise LockLost(
                    f"lease on {lease.key!r} lost ({reason}); the block was cancelled",
                    key=lease.key,
                    reason=reason,
                    lease=lease,
                    exception=exc,
                ) from exc
        _raise_if_lost(lease, exc)


class MultiLockBlock:
    """The context manager returned by :meth:`LockClient.multi_lock`, for ``with`` and
    ``async with``; like :class:`LockBlock`, with a :class:`~lockaspect.lease.MultiLease`."""

    __slots__ = ("_client", "_holds", "_keys", "_lost_cancel", "_multi", "_spec", "_tokens")

    def __init__(self, client: LockClient, keys: tuple[str, ...], spec: LockSpec) -> None:
        self._client = client
        self._keys = keys
        self._spec = spec
        self._multi: MultiLease | None = None
        self._holds: list[_Hold] = []
        self._tokens: list[Any] = []
        self._lost_cancel: _LostCancel | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys, deduplicated and sorted."""
        return self._keys

    def __enter__(self) -> MultiLease:
        if self._multi is not None:
            raise RuntimeError("this lock block is already entered; call client.multi_lock() again")
        holds = self._client._acquire_multi(self._keys, self._spec)
        self._holds = holds
        self._multi = multi = MultiLease([hold.lease for hold in holds])
        self._tokens = [_push(lease) for lease in multi.leases]
        return multi

    def _unwind(self) -> MultiLease:
        multi, self._multi = self._multi, None
        assert multi is not None
        tokens, self._tokens = self._tokens, []
        for token in reversed(tokens):
            _HELD.reset(token)
        return multi

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        multi = self._multi
        assert multi is not None
        holds, self._holds = self._holds, []
        try:
            self._unwind()
        finally:
            for hold in reversed(holds):
                self._client._release(hold)
        for lease in multi.leases:
            _raise_if_lost(lease, exc)

    async def __aenter__(self) -> MultiLease:
        if self._multi is not None:
            raise RuntimeError("this lock block is already entered; call client.multi_lock() again")
        holds = await self._client._aacquire_multi(self._keys, self._spec)
        self._holds = holds
        self._multi = multi = MultiLease([hold.lease for hold in holds])
        self._tokens = [_push(lease) for lease in multi.leases]
        task = asyncio.current_task()
        if task is not None:
            self._lost_cancel = _LostCancel(asyncio.get_running_loop(), task)
            for lease in multi.leases:
                lease._add_lost_waiter(self._lost_cancel)
        return multi

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        multi = self._multi
        assert multi is not None
        holds, self._holds = self._holds, []
        lost_cancel, self._lost_cancel = self._lost_cancel, None
        if lost_cancel is not None:
            lost_cancel.task = _DONE
            for lease in multi.leases:
                lease._remove_lost_waiter(lost_cancel)
        try:
            self._unwind()
        finally:
            state = self._client._loop_state()
            for hold in reversed(holds):
                await self._client._arelease_shielded(hold, state)
        if lost_cancel is not None and lost_cancel.fired and isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()
            if not _cancelling():
                reason = multi.lost_reason or "expired"
                lost = next((lease for lease in multi.leases if lease.lost), multi.leases[0])
                raise LockLost(
                    f"lease on {lost.key!r} lost ({reason}); the block was cancelled",
                    key=lost.key,
                    reason=reason,
                    lease=lost,
                    exception=exc,
                ) from exc
        for lease in multi.leases:
            _raise_if_lost(lease, exc)


def _raise_if_lost(lease: Lease, exc: BaseException | None) -> None:
    if lease.lost and (exc is None or isinstance(exc, Exception)):
        reason = lease.lost_reason or "expired"
        raise LockLost(
            f"lease on {lease.key!r} lost ({reason}) before the block completed",
            key=lease.key,
            reason=reason,
            lease=lease,
            exception=exc,
        ) from exc


class _Done:
    """Stands in for a finished task in a :class:`_LostCancel` that must not cancel any more."""

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False


_DONE: Any = _Done()


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
