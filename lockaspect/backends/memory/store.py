""":class:`MemoryStore` and :class:`AsyncMemoryStore`: the memory store's protocol side
(checks, the lock, the clock, wake-ups) around the pure state machine of :mod:`._kinds`.
See the package's docstring for what the store is for."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ...errors import ConfigurationError
from ..base import (
    KINDS,
    AcquireRequest,
    AcquireResult,
    Capability,
    KeyState,
    ReleaseResult,
    RenewItem,
    RenewStatus,
    checked_request,
    new_waiter_id,
)
from ._kinds import MemoryState
from ._notify import AsyncMemoryNotifier, Hub, MemoryNotifier

__all__ = ["AsyncMemoryStore", "MemoryStore", "Shared", "open_memory_store"]

_T = TypeVar("_T")


class Shared:
    """One state and everything that guards it: the lock, the clock and the notifier hub.
    Every store made on it (a named store's namesakes, a store's asyncio twins) shares it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.mutex = threading.Lock()
        self.state = MemoryState()
        self.hub = Hub()
        self.state.publish = self.hub.publish

    def run(self, operation: Callable[[float], _T]) -> _T:
        """Run ``operation(now)`` under the lock, then deliver the wake-ups it produced. The
        clock is read before the lock is taken (it may be the caller's code)."""
        now = self.clock()
        with self.mutex:
            try:
                result = operation(now)
            finally:
                fired = self.hub.take()
        for waiter in fired:
            waiter.wake()
        return result

    def reset(self) -> None:
        """Forget everything, with a fresh lock (a forked child: another thread may have held
        the old one at the fork)."""
        self.mutex = threading.Lock()
        self.state.clear()
        self.hub.clear()


_named: dict[str, Shared] = {}
_named_lock = threading.Lock()


def _shared(name: str | None, clock: Callable[[], float] | None) -> Shared:
    if name is None:
        return Shared(clock or time.monotonic)
    with _named_lock:
        found = _named.get(name)
        if found is None:
            found = _named[name] = Shared(clock or time.monotonic)
        elif clock is not None and clock is not found.clock:
            raise ConfigurationError(f"the memory store {name!r} exists already, with another clock")
        return found


def _after_fork_in_child() -> None:
    global _named_lock
    _named_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # pragma: no branch - absent on Windows only
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str):
        raise ConfigurationError(f"namespace must be a str, got {namespace!r}")
    return namespace


class _MemoryBase:
    """What the sync store and its twins share: the checks and the operations (no waiting)."""

    capabilities = (
        Capability.RENEWABLE
        | Capability.BATCH_RENEW
        | Capability.RELEASE_NOTIFY
        | Capability.FENCING
        | Capability.MULTI_KEY
        | Capability.FAIR_HANDOFF
    )
    kinds = KINDS

    def __init__(self, shared: Shared, namespace: str) -> None:
        self._shared = shared
        self.namespace = _check_namespace(namespace)

    @staticmethod
    def waiter_id(listens: bool) -> str:
        """A fresh waiter id (see :func:`~lockaspect.backends.base.new_waiter_id`)."""
        return new_waiter_id(listens)

    def _check(self, request: AcquireRequest) -> AcquireRequest:
        """``request`` with its keys namespaced, or :class:`ConfigurationError`."""
        return checked_request(request, self.namespace, "the memory store")

    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise ConfigurationError(f"the memory store serves {', '.join(sorted(KINDS))}, not {kind!r}")

    def _acquire(self, request: AcquireRequest) -> AcquireResult:
        checked = self._check(request)
        result = self._shared.run(lambda now: self._shared.state.acquire(checked, now))
        if result.busy is not None:
            result = result._replace(busy=result.busy[len(self.namespace) :])
        return result

    def _release(self, key: str, token: str, kind: str) -> ReleaseResult:
        self._check_kind(kind)
        return self._shared.run(lambda now: self._shared.state.release(self.namespace + key, token, kind, now))

    def _release_many(self, keys: Sequence[str], token: str) -> list[ReleaseResult]:
        state, named = self._shared.state, [self.namespace + key for key in keys]
        return self._shared.run(lambda now: [state.release(key, token, "lock", now) for key in named])

    def _reenter(self, key: str, token: str, kind: str) -> bool:
        self._check_kind(kind)
        return self._shared.run(lambda now: self._shared.state.reenter(self.namespace + key, token, kind, now))

    def _renew(self, leases: Sequence[RenewItem]) -> list[RenewStatus]:
        items = []
        for key, token, lease, kind in leases:
            self._check_kind(kind)
            items.append(RenewItem(self.namespace + key, token, lease, kind))
        return list(self._shared.run(lambda now: self._shared.state.renew(items, now)))

    def _unqueue(self, key: str, waiter: str, kind: str) -> None:
        self._check_kind(kind)
        self._shared.run(lambda now: self._shared.state.unqueue(self.namespace + key, waiter, kind, now))

    def _describe(self, key: str) -> list[KeyState]:
        states = self._shared.run(lambda now: self._shared.state.describe(self.namespace + key, now))
        return [state._replace(key=key) for state in states]

    def _held_keys(self, pattern: str) -> list[str]:
        return self._shared.run(lambda now: self._shared.state.held_keys(self.namespace, pattern, now))

    def _force_release(self, key: str) -> bool:
        return self._shared.run(lambda now: self._shared.state.force_release(self.namespace + key, now))

    def _permits(self, key: str, set_to: int | None) -> tuple[int | None, int]:
        if set_to is not None and (isinstance(set_to, bool) or not isinstance(set_to, int) or set_to < 0):
            raise ConfigurationError(f"permits must be an int >= 0, got {set_to!r}")
        return self._shared.run(lambda now: self._shared.state.permits(self.namespace + key, set_to, now))

    def _add_permits(self, key: str, delta: int) -> tuple[int, int]:
        delta = _check_delta(delta)
        return self._shared.run(lambda now: self._shared.state.add_permits(self.namespace + key, delta, now))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} namespace={self.namespace!r}>"


class MemoryStore(_MemoryBase):
    """A lock store in this process's memory (a :class:`~lockaspect.backends.base.Store`
    and :class:`~lockaspect.backends.base.AdminStore`).

    Args:
        clock: The monotonic clock leases are judged by, e.g. a
            :class:`~lockaspect.testing.ManualClock`; expiry is evaluated on every operation.
        name: Stores of one name share their state within the process (``memory://<name>``);
            ``None`` (default): a private state.
        namespace: Prefix of the keys in the state, so clients with different namespaces on
            one named state do not meet.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        name: str | None = None,
        namespace: str = "lockaspect:",
    ) -> None:
        super().__init__(_shared(name, clock), namespace)
        self.name = name
        self._notifier: MemoryNotifier | None = None
        self._closed = False

    # -- Store ----------------------------------------------------------------------------

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        """Try once to take ``request.keys`` (see :meth:`Store.acquire`)."""
        return self._acquire(request)

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        """``RELEASED`` and wake the next waiter(s), or ``NOT_OWNER``."""
        return self._release(key, token, kind)

    def release_many(self, keys: Sequence[str], token: str) -> list[ReleaseResult]:
        """Every lock of ``keys`` released at once, as :meth:`release` would (see
        :class:`~lockaspect.backends.base.ReleasesMany`)."""
        return self._release_many(keys, token)

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        """Whether ``token`` still holds ``key`` (changes nothing)."""
        return self._reenter(key, token, kind)

    def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        """Extend each lease still held by its token: ``True``, else ``False``."""
        return self._renew(leases)

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Take ``waiter`` off ``key``'s queue of ``kind``."""
        self._unqueue(key, waiter, kind)

    def notifier(self) -> MemoryNotifier | None:
        """The store's notifier (made on first use), ``None`` once closed."""
        with self._shared.mutex:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = MemoryNotifier(self._shared, self.namespace)
            return self._notifier

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        raise ConfigurationError("the memory store has no replicas to wait for (wait_replicas)")

    def asyncio_twin(self) -> AsyncMemoryStore:
        """An :class:`AsyncMemoryStore` on the same state: sync and async code of this
        process exclude each other."""
        return AsyncMemoryStore(self._shared, self.namespace)

    def threads(self) -> list[threading.Thread]:
        """None: the memory store starts no thread."""
        return []

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's locks and waiters are not the child's; forget them."""
        self._shared.reset()
        self._notifier = None

    def close(self) -> None:
        """Wake this store's waiters and stop notifying (idempotent). The state stays: a named
        store's namesakes keep using it, and leases held here end with their lease."""
        with self._shared.mutex:
            self._closed = True
            notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()

    # -- AdminStore --------------------------------------------------------------------------

    def describe(self, key: str) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free)."""
        return self._describe(key)

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The keys of this namespace held now whose name matches the glob ``pattern``."""
        return iter(self._held_keys(pattern))

    def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` whoever holds it, waking waiters (fencing counters are
        kept); whether anything was held."""
        return self._force_release(key)

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to ``set_to``."""
        return self._permits(key, set_to)

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` to semaphore ``key``'s permits in one step (see ``AddsPermits``)."""
        return self._add_permits(key, delta)

    def __repr__(self) -> str:
        name = "" if self.name is None else f" name={self.name!r}"
        return f"<MemoryStore{name} namespace={self.namespace!r}>"

    # -- the admin operations both twins run --


def _check_delta(delta: object) -> int:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"the permits to add must be an int, got {type(delta).__name__}")
    return delta


class AsyncMemoryStore(_MemoryBase):
    """The :class:`~lockaspect.backends.base.AsyncStore` twin of a :class:`MemoryStore`, for
    one event loop: the same state (made by :meth:`MemoryStore.asyncio_twin`). Nothing is
    awaited inside: every operation is a few dictionary updates under the state's lock."""

    def __init__(self, shared: Shared, namespace: str) -> None:
        super().__init__(shared, namespace)
        self._notifier: AsyncMemoryNotifier | None = None
        self._closed = False

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        return self._acquire(request)

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        return self._release(key, token, kind)

    async def release_many(self, keys: Sequence[str], token: str) -> list[ReleaseResult]:
        return self._release_many(keys, token)

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        return self._reenter(key, token, kind)

    async def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        return self._renew(leases)

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        self._unqueue(key, waiter, kind)

    def notifier(self) -> AsyncMemoryNotifier | None:
        with self._shared.mutex:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = AsyncMemoryNotifier(self._shared, self.namespace)
            return self._notifier

    async def describe(self, key: str) -> list[KeyState]:
        return self._describe(key)

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        for key in self._held_keys(pattern):
            yield key

    async def force_release(self, key: str) -> bool:
        return self._force_release(key)

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        return self._permits(key, set_to)

    async def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        return self._add_permits(key, delta)

    async def aclose(self) -> None:
        """Wake this twin's waiters and stop notifying (idempotent)."""
        with self._shared.mutex:
            self._closed = True
            notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()


def open_memory_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> MemoryStore:
    """The store factory of ``memory://`` (private state) and ``memory://<name>`` (the state
    shared by every store of that name in the process). Takes no options."""
    if options:
        raise ConfigurationError(f"memory:// takes no options, got {', '.join(repr(name) for name in sorted(options))}")
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    if not url.startswith("memory://") or parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigurationError(f"a memory store URL is memory:// or memory://<name>, got {url!r}")
    return MemoryStore(name=parts.netloc or None, namespace=_check_namespace(namespace))
