"""The Redis and Valkey store: :class:`RedisStore` (threads) and :class:`AsyncRedisStore` (one
event loop), the twins of one another. Each serves the store protocol
(:mod:`lockaspect.backends.base`) and its operator part over the script-level operations of
the operation table (:class:`~._layout.Op`): a one-line method per operation, run through
one routine per twin (``_op``: encode, run with ``WAIT`` behind an acquisition when asked,
decode, map errors). The key layout is in :mod:`._layout`.

``RedisBackend`` and ``AsyncRedisBackend`` are the old names of the two classes.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisError

from ...errors import ConfigurationError
from ..base import AcquireRequest, AcquireResult, KeyState, ReleaseResult, ReleaseStatus, RenewItem, redacted
from ._admin import ADD_PERMITS, DESCRIBE, FORCE_RELEASE, SCAN_COUNT, held_candidates, held_flags, held_new, scan_match
from ._async_wire import _AsyncWire, _run_async, _run_async_then
from ._client import error_key, map_redis_error, no_retry_async_client, no_retry_client
from ._layout import (
    _ACQUIRE,
    _REENTER,
    _RELEASE,
    _RELEASE_CODES,
    LOCK_ACQUIRE,
    LOCK_REENTER,
    LOCK_RELEASE,
    MULTI_ACQUIRE,
    MULTI_RELEASE,
    RW_ACQUIRE,
    RW_HELD,
    RW_RELEASE,
    SEM_ACQUIRE,
    SEM_PERMITS,
    SEM_REENTER,
    SEM_RELEASE,
    SEM_SET,
    UNQUEUE,
    Encoded,
    Op,
    _acquired,
    _Layout,
    _replicated,
)
from ._renewal import arenew_with, renew_with
from ._script import LuaScript
from ._wire import _Line, _Undo, _Wire
from .notify import AsyncRedisNotifier, RedisNotifier

__all__ = ["AsyncRedisBackend", "AsyncRedisStore", "RedisBackend", "RedisStore"]

T = TypeVar("T")


class RedisStore(_Layout):
    """A lock store on one Redis or Valkey server (6.2 or newer); also an
    :class:`~lockaspect.backends.base.AdminStore`. (Old name: ``RedisBackend``.)

    Args:
        client: A ``redis.Redis`` client; it should not retry commands by itself
            (see :func:`~._client.no_retry_client`).
        namespace: Prefix of every key lockaspect writes, e.g. ``"lockaspect:"``.
        url, options: How the client was built, so that :meth:`asyncio_twin` can build the
            same for an event loop (set by :meth:`from_url`).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str = "lockaspect:",
        url: str | None = None,
        sharded: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(namespace, sharded=sharded)
        # Any: redis-py's command methods are only partly annotated.
        self.redis: Any = client
        self._url = url
        self._options = options
        self._wire = _Wire(client)
        self._renew_line = _Line(client)
        self._notifier: RedisNotifier | None = None
        self._notifier_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "lockaspect:", **options: Any) -> RedisStore:
        return cls(no_retry_client(url, **options), namespace=namespace, url=url, **options)

    def __repr__(self) -> str:
        where = "a redis-py client" if self._url is None else redacted(self._url)
        return f"<RedisStore {where} namespace={self.namespace!r}>"

    def asyncio_twin(self) -> AsyncRedisStore:
        """An :class:`AsyncRedisStore` on the same server, namespace and options, for the
        running event loop (asyncio connections belong to one loop)."""
        if self._url is None:
            raise ConfigurationError(
                "asyncio needs a store built with RedisStore.from_url (or LockClient.from_url), "
                "so that it can connect again from each event loop"
            )
        twin = AsyncRedisStore.from_url(self._url, namespace=self.namespace, **self._options)
        twin._wait_command = self._wait_command
        return twin

    # -- the one routine every script call goes through --

    def _call(
        self,
        script: LuaScript,
        keys: tuple[bytes, ...],
        args: tuple[bytes, ...],
        decode: Callable[[Any, Any], T],
        key: Any,
        action: str,
        undo: _Undo | None = None,
    ) -> T:
        """Run one script call over the wire and decode its reply; an acquisition (``undo``
        given) is followed by ``WAIT`` when :meth:`wait_for_replicas` asked for it. Driver
        errors become :class:`~lockaspect.BackendError` naming ``key``."""
        try:
            if undo is not None and self._wait_command is not None:
                reply, acked = script.run_then(self._wire, self.redis, keys, args, self._wait_command, undo)
                return _replicated(decode(reply, key), acked)
            return decode(script.run(self._wire, self.redis, keys, args, undo), key)
        except RedisError as exc:
            raise map_redis_error(exc, error_key(key), action) from exc

    def _op(self, op: Op[T], key: Any, *params: Any) -> T:
        """Run the table entry ``op`` for ``key`` and the method's other parameters."""
        keys, args = op.encode(self, key, *params)
        undo = None if op.undo is None else op.undo(self, key, *params)
        return self._call(self._scripts[op.script], keys, args, op.decode, key, op.action, undo)

    # -- the store protocol --

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        result: AcquireResult = _ACQUIRE[request.kind](self, request)
        return result

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        result: ReleaseResult = _RELEASE[kind](self, key, token)
        return result

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        held: bool = _REENTER[kind](self, key, token)
        return held

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Take ``waiter`` off ``key``'s waiter queue (it stopped waiting)."""
        self._op(UNQUEUE, key, waiter, kind)

    def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        """Renew ``leases`` in one round trip, on a connection of the renewals' own (so no
        lock traffic, and no exhausted pool, ever delays a renewal). Called from one thread
        at a time (the client's watchdog)."""
        return renew_with(self, leases, self._renew_line.round_trip)

    # -- the script-level operations (the hot path's two written out: no table lookup) --

    def lock_acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
        owner: str = "",
    ) -> AcquireResult:
        # LOCK_ACQUIRE through _call, inlined.
        lock = self._lock(key)
        keys, args = self._acquire_request(lock, token, lease, waiter, front, fair, owner)
        undo = self._acquire_undo(lock, token, fair)
        try:
            if self._wait_command is not None:
                reply, acked = self._acquire.run_then(self._wire, self.redis, keys, args, self._wait_command, undo)
                return _replicated(_acquired(reply), acked)
            reply = self._acquire.run(self._wire, self.redis, keys, args, undo)
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc
        return _acquired(reply)

    def lock_release(self, key: str, token: str, fair: bool = False) -> ReleaseResult:
        # LOCK_RELEASE through _call, inlined.
        keys, args = self._release_request(self._lock(key), token, fair)
        try:
            code = self._release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def lock_reenter(self, key: str, token: str) -> bool:
        return self._op(LOCK_REENTER, key, token)

    def release_many(self, keys: Sequence[str], token: str) -> Sequence[ReleaseStatus]:
        """Give back ``token``'s locks of ``keys`` in one round trip (multi_release.lua)."""
        return self._op(MULTI_RELEASE, keys, token)

    def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None, owner: str = ""
    ) -> AcquireResult:
        """Take every lock of ``keys`` for ``token``, all at once or none (multi_acquire.lua)."""
        return self._op(MULTI_ACQUIRE, keys, token, lease, waiter, owner)

    def sem_acquire(
        self,
        key: str,
        token: str,
        lease: float,
        permits: int,
        waiter: str | None = None,
        front: bool = False,
        owner: str = "",
        weight: int = 1,
    ) -> AcquireResult:
        """Take ``weight`` of ``permits`` permits of semaphore ``key`` for ``lease`` seconds."""
        return self._op(SEM_ACQUIRE, key, token, lease, permits, waiter, front, owner, weight)

    def sem_release(self, key: str, token: str) -> ReleaseResult:
        return self._op(SEM_RELEASE, key, token)

    def sem_reenter(self, key: str, token: str) -> bool:
        return self._op(SEM_REENTER, key, token)

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to
        ``set_to`` if given (``None`` permits: never set)."""
        return self._op(SEM_PERMITS if set_to is None else SEM_SET, key, set_to)

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` (negative: take away) to semaphore ``key``'s permits in one step, never
        below 0 (a semaphore never used starts from 0); ``(permits, in use)`` after. Raising
        them wakes waiters; lowering them takes no permit from holders."""
        return self._op(ADD_PERMITS, key, delta)

    def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = "", owner: str = ""
    ) -> AcquireResult:
        return self._op(RW_ACQUIRE, key, token, lease, mode, waiter, below, owner)

    def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        return self._op(RW_RELEASE, key, token, mode)

    def rw_held(self, key: str, token: str, mode: str) -> bool:
        return self._op(RW_HELD, key, token, mode)

    # -- the operator part (AdminStore) --

    def describe(self, key: str) -> list[KeyState]:
        """What is held under ``key``: one :class:`KeyState` per kind held (see describe.lua);
        empty when nothing is."""
        return self._op(DESCRIBE, key)

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The user keys held now whose name matches the glob ``pattern``, each once, as
        ``SCAN`` finds them (never ``KEYS``): one SCAN page and one held.lua call at a time."""
        match = scan_match(self.namespace, pattern)
        seen: set[str] = set()
        cursor = 0
        while True:
            try:
                cursor, names = self.redis.scan(cursor, match=match, count=SCAN_COUNT)
            except RedisError as exc:
                raise map_redis_error(exc, None, "held_keys") from exc
            found = held_candidates(self.namespace, names, seen)
            if found:
                names_found = tuple(name for _, name in found)
                flags = self._call(self._scripts["held.lua"], names_found, (), held_flags, None, "held_keys")
                yield from held_new(found, flags, seen)
            if not cursor:
                return

    def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` (lock, semaphore permits, read-write holders) whoever
        holds it, in one script, waking waiters as the releases do; the fence counter stays,
        so fencing tokens keep increasing. Whether anything was held. A holder learns it lost
        the lock at its next renewal or release."""
        return self._op(FORCE_RELEASE, key)

    # -- the rest of the protocol --

    def notifier(self) -> RedisNotifier | None:
        with self._notifier_lock:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = RedisNotifier(self.redis, self.wake_channel)
            return self._notifier

    def threads(self) -> list[threading.Thread]:
        """Threads the store started (the release-notification reader, once used)."""
        notifier = self._notifier
        thread = None if notifier is None else notifier._thread
        return [] if thread is None else [thread]

    def close(self) -> None:
        with self._notifier_lock:
            self._closed = True
            notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()
        self._wire.close()
        self._renew_line.close()
        self.redis.close()
        pool = getattr(self.redis, "connection_pool", None)
        if pool is not None:
            pool.disconnect()

    def reset_after_fork(self) -> None:
        # redis-py's pool notices the new pid by itself; the subscriber thread did not
        # survive the fork, so forget it and start a fresh one on demand.
        self._notifier = None
        self._notifier_lock = threading.Lock()
        self._renew_line = _Line(self.redis)


class AsyncRedisStore(_Layout):
    """:class:`RedisStore` for one asyncio event loop (``redis.asyncio``). (Old name:
    ``AsyncRedisBackend``.)"""

    def __init__(self, client: Any, *, namespace: str = "lockaspect:", sharded: bool = False) -> None:
        super().__init__(namespace, sharded=sharded)
        self.redis: Any = client
        self._wire = _AsyncWire(client)
        self._notifier: AsyncRedisNotifier | None = None

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "lockaspect:", **options: Any) -> AsyncRedisStore:
        return cls(no_retry_async_client(url, **options), namespace=namespace)

    # -- the one routine every script call goes through --

    async def _call(
        self,
        script: LuaScript,
        keys: tuple[bytes, ...],
        args: tuple[bytes, ...],
        decode: Callable[[Any, Any], T],
        key: Any,
        action: str,
        undo: _Undo | None = None,
    ) -> T:
        """:meth:`RedisStore._call` for one event loop."""
        try:
            if undo is not None and self._wait_command is not None:
                reply, acked = await _run_async_then(
                    script, self._wire, self.redis, keys, args, self._wait_command, undo
                )
                return _replicated(decode(reply, key), acked)
            return decode(await _run_async(script, self._wire, self.redis, keys, args, undo), key)
        except RedisError as exc:
            raise map_redis_error(exc, error_key(key), action) from exc

    # _op and the hot path's methods that pass it on return _call's coroutine: no frame of theirs in flight.
    def _op(self, op: Op[T], key: Any, *params: Any) -> Coroutine[Any, Any, T]:
        encoded: Encoded = op.encode(self, key, *params)
        undo = None if op.undo is None else op.undo(self, key, *params)
        return self._call(self._scripts[op.script], *encoded, op.decode, key, op.action, undo)

    # -- the store protocol --
    def acquire(self, request: AcquireRequest) -> Coroutine[Any, Any, AcquireResult]:
        result: Coroutine[Any, Any, AcquireResult] = _ACQUIRE[request.kind](self, request)
        return result

    def release(self, key: str, token: str, kind: str = "lock") -> Coroutine[Any, Any, ReleaseResult]:
        result: Coroutine[Any, Any, ReleaseResult] = _RELEASE[kind](self, key, token)
        return result

    def reenter(self, key: str, token: str, kind: str = "lock") -> Coroutine[Any, Any, bool]:
        held: Coroutine[Any, Any, bool] = _REENTER[kind](self, key, token)
        return held

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        await self._op(UNQUEUE, key, waiter, kind)

    async def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        return await arenew_with(self, leases, self._pipelined)

    async def _pipelined(self, commands: list[tuple[object, ...]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    # -- the script-level operations --

    def lock_acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
        owner: str = "",
    ) -> Coroutine[Any, Any, AcquireResult]:
        return self._op(LOCK_ACQUIRE, key, token, lease, waiter, front, fair, owner)

    def lock_release(self, key: str, token: str, fair: bool = False) -> Coroutine[Any, Any, ReleaseResult]:
        return self._op(LOCK_RELEASE, key, token, fair)

    def lock_reenter(self, key: str, token: str) -> Coroutine[Any, Any, bool]:
        return self._op(LOCK_REENTER, key, token)

    async def release_many(self, keys: Sequence[str], token: str) -> Sequence[ReleaseStatus]:
        return await self._op(MULTI_RELEASE, keys, token)

    async def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None, owner: str = ""
    ) -> AcquireResult:
        return await self._op(MULTI_ACQUIRE, keys, token, lease, waiter, owner)

    async def sem_acquire(
        self,
        key: str,
        token: str,
        lease: float,
        permits: int,
        waiter: str | None = None,
        front: bool = False,
        owner: str = "",
        weight: int = 1,
    ) -> AcquireResult:
        return await self._op(SEM_ACQUIRE, key, token, lease, permits, waiter, front, owner, weight)

    async def sem_release(self, key: str, token: str) -> ReleaseResult:
        return await self._op(SEM_RELEASE, key, token)

    async def sem_reenter(self, key: str, token: str) -> bool:
        return await self._op(SEM_REENTER, key, token)

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        return await self._op(SEM_PERMITS if set_to is None else SEM_SET, key, set_to)

    async def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """See :meth:`RedisStore.add_permits`."""
        return await self._op(ADD_PERMITS, key, delta)

    async def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = "", owner: str = ""
    ) -> AcquireResult:
        return await self._op(RW_ACQUIRE, key, token, lease, mode, waiter, below, owner)

    async def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        return await self._op(RW_RELEASE, key, token, mode)

    async def rw_held(self, key: str, token: str, mode: str) -> bool:
        return await self._op(RW_HELD, key, token, mode)

    # -- the operator part --

    async def describe(self, key: str) -> list[KeyState]:
        return await self._op(DESCRIBE, key)

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        match = scan_match(self.namespace, pattern)
        seen: set[str] = set()
        cursor = 0
        while True:
            try:
                cursor, names = await self.redis.scan(cursor, match=match, count=SCAN_COUNT)
            except RedisError as exc:
                raise map_redis_error(exc, None, "held_keys") from exc
            found = held_candidates(self.namespace, names, seen)
            if found:
                names_found = tuple(name for _, name in found)
                flags = await self._call(self._scripts["held.lua"], names_found, (), held_flags, None, "held_keys")
                for key in held_new(found, flags, seen):
                    yield key
            if not cursor:
                return

    async def force_release(self, key: str) -> bool:
        return await self._op(FORCE_RELEASE, key)

    # -- the rest of the protocol --

    def notifier(self) -> AsyncRedisNotifier:
        if self._notifier is None:
            self._notifier = AsyncRedisNotifier(self.redis, self.wake_channel)
        return self._notifier

    async def aclose(self) -> None:
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            await notifier.aclose()
        await self._wire.close()
        await self.redis.aclose()


#: The old names of the two stores.
RedisBackend = RedisStore
AsyncRedisBackend = AsyncRedisStore
