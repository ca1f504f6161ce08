"""Redis and Valkey through redis-py: the lock scripts, batched renewal and release wake-ups.

Key layout for a lock rendered as ``order:42`` in namespace ``lockaspect:``::

    lockaspect:{order:42}            hash {<token>: holds, "fence": n}, with the lease as TTL
    lockaspect:{order:42}:fence      fence counter (INCR per first acquisition, no TTL)
    lockaspect:{order:42}:waiters    FIFO list of waiter ids (one per waiting notifier)
    lockaspect:{order:42}:wake:<id>  pub/sub channel of one waiter; a release wakes the first

All three share the hash tag ``{order:42}``, so Redis Cluster keeps them in one slot.
Rendered keys never contain ``{`` or ``}`` (values are percent-encoded, templates may not
contain them), so the tag cannot be broken from outside.

The fence counter outlives the lock on purpose: a fencing token must exceed every token
issued before for that key, also after the lock expired. That costs one small key per
distinct lock name ever used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from .._policy import FAIR_GONE_AFTER, FAIR_SUBSCRIBE_GRACE
from ..errors import BackendError, ConfigurationError
from ._channels import ChannelTable
from .base import AcquireResult, Capability, MultiAcquireResult, ReleaseResult, RenewItem

__all__ = ["LuaScript", "RedisBackend", "RedisNotifier", "load_script", "map_redis_error"]

log = logging.getLogger("lockaspect.backend")

#: Default socket (and connect) timeout in seconds: a renewal that hangs times out and is
#: retried within the default renewal margin (a 30 s lease renewed at 0.9 leaves 3 s).
DEFAULT_SOCKET_TIMEOUT = 2.0

# One EVALSHA per chunk keeps each script call short on the server (Redisson uses 100);
# all chunks of one batch still travel in one pipelined round trip.
RENEW_CHUNK = 256


def load_script(name: str) -> str:
    """The text of ``lockaspect/backends/lua/<name>``, with each line ``-- include: <file>``
    replaced by that file's text (Lua scripts cannot load modules; shared helpers such as
    the fencing-counter seed live once, in lib.lua)."""
    lua = resources.files(__package__).joinpath("lua")
    lines = []
    for line in lua.joinpath(name).read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith(_INCLUDE):
            line = lua.joinpath(line[len(_INCLUDE) :].strip()).read_text(encoding="utf-8")
        lines.append(line)
    return "".join(lines)


_INCLUDE = "-- include: "


class LuaScript:
    """A script's text and SHA1, loaded once per backend instance."""

    __slots__ = ("_heads", "name", "sha", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = load_script(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self._heads: dict[tuple[int, int], bytes] = {}

    def packed(self, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> bytes:
        """``EVALSHA sha numkeys keys... args...`` in the wire format."""
        shape = (len(keys), len(args))
        head = self._heads.get(shape)
        if head is None:
            head = b"*%d\r\n" % (3 + shape[0] + shape[1]) + _bulk(b"EVALSHA") + _bulk(self.sha.encode())
            head += _bulk(b"%d" % shape[0])
            self._heads[shape] = head
        return head + b"".join([_bulk(part) for part in keys + args])

    def run(self, wire: _Wire, client: Any, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> Any:
        """EVALSHA over the wire, loading the script once on NOSCRIPT."""
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return wire.call(self.packed(keys, args), command)
        except NoScriptError:
            client.execute_command("SCRIPT", "LOAD", self.source)
            return wire.call(self.packed(keys, args), command)

    def run_then(
        self, wire: _Wire, client: Any, keys: tuple[bytes, ...], args: tuple[bytes, ...], then: tuple[bytes, ...]
    ) -> tuple[Any, Any]:
        """:meth:`run` with the command ``then`` sent right behind it on the same connection,
        in the same write: both replies."""
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return wire.call_then(self.packed(keys, args), command, then)
        except NoScriptError:
            client.execute_command("SCRIPT", "LOAD", self.source)
            return wire.call_then(self.packed(keys, args), command, then)

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[object]) -> Any:
        """EVALSHA, loading the script once on NOSCRIPT (after SCRIPT FLUSH or a failover)."""
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.execute_command("SCRIPT", "LOAD", self.source)
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


class _Wire:
    """Sends one pre-packed command on a connection of its own and reads the reply.

    The hot path of a lock is two round trips (acquire, release), and on loopback the
    client's own work is a large part of each. So lock commands skip what redis-py's
    ``execute_command`` adds per call:

    * packing: each script's constant ``EVALSHA <sha> <numkeys>`` prefix is packed once;
    * the pool's checkout probe: ``ConnectionPool.get_connection`` checks every connection
      for stray data with a zero-timeout read (two ``ioctl`` and a ``recv``) and the pid
      twice. Connections here are made by the pool (so ``max_connections``, client-side
      caching and metrics apply) but kept in a LIFO list of our own. They are clean by
      construction (a reply is always read in full; any other failure disconnects the
      connection), so one ``poll`` tells whether the server closed one; a forked child
      drops the list (see ``_after_fork``) instead of checking the pid per call.

    Commands go out with the connection's public ``send_packed_command`` and come back
    through ``read_response``. Clients without a plain pool (a single-connection client,
    Redis Cluster) use ``execute_command`` instead.
    """

    __slots__ = ("__weakref__", "_client", "_free", "_make")

    def __init__(self, client: Any) -> None:
        self._client = client
        pool = getattr(client, "connection_pool", None)
        make = getattr(pool, "make_connection", None)
        usable = getattr(client, "connection", None) is None and callable(make)
        self._make: Any = make if usable else None
        self._free: list[Any] = []
        _wires.add(self)

    def call(self, packed: bytes, args: tuple[object, ...]) -> Any:
        """Send ``packed`` (``args`` is the same command unpacked, for the slow path)."""
        if self._make is None:
            return self._client.execute_command(*args)
        free = self._free
        try:
            connection = free.pop()
        except IndexError:
            connection = self._make()
        else:
            sock = getattr(connection, "_sock", None)
            if sock is not None and _readable(sock):
                # Nothing may be pending on an idle connection: this one was closed by the
                # server (a restart, its idle timeout, CLIENT KILL). Reconnect before sending;
                # a command is never sent twice, since one that failed may have run.
                connection.disconnect()
        try:
            connection.send_packed_command((packed,), check_health=False)
            reply = connection.read_response()
        except ResponseError:
            free.append(connection)  # the whole reply was read: the connection is clean
            raise
        except BaseException:
            # A timeout or an interrupt may leave half a reply on the socket; a
            # disconnected connection reconnects on its next use.
            connection.disconnect()
            free.append(connection)
            raise
        free.append(connection)
        return reply

    def call_then(self, packed: bytes, args: tuple[object, ...], then: tuple[bytes, ...]) -> tuple[Any, Any]:
        """:meth:`call`, then the command ``then`` on the same connection in the same write
        (``WAIT`` counts the replicas that have this connection's writes): both replies. An
        error reply to the first command is raised once the second reply is read."""
        if self._make is None:
            pipe = self._client.pipeline(transaction=False)
            pipe.execute_command(*args)
            pipe.execute_command(*then)
            replies = pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies[0], replies[1]
        free = self._free
        connection = free.pop() if free else self._make()
        sock = getattr(connection, "_sock", None)
        if sock is not None and _readable(sock):
            connection.disconnect()
        try:
            connection.send_packed_command((packed, _packed(then)), check_health=False)
            first: Any
            try:
                first = connection.read_response()
            except ResponseError as exc:
                first = exc
            second = connection.read_response()
        except BaseException:
            connection.disconnect()
            free.append(connection)
            raise
        free.append(connection)
        if isinstance(first, ResponseError):
            raise first
        return first, second

    def close(self) -> None:
        free, self._free = self._free, []
        for connection in free:
            connection.disconnect()

    def _after_fork(self) -> None:
        # The parent's sockets: never write to them from the child. Dropping the objects
        # is safe, redis-py only shuts a socket down in the process that opened it.
        self._free = []


def _readable(sock: Any) -> bool:
    """Whether a socket has something to read (data, EOF or an error): one poll(2), no wait."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


if not hasattr(select, "poll"):  # pragma: no cover - Windows

    def _readable(sock: Any) -> bool:
        return bool(select.select([sock], [], [], 0)[0])


_wires: weakref.WeakSet[_Wire] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for wire in list(_wires):
        wire._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _packed(command: tuple[bytes, ...]) -> bytes:
    """``command`` in the wire format."""
    return b"*%d\r\n" % len(command) + b"".join([_bulk(part) for part in command])


def map_redis_error(exc: BaseException, key: str | None, action: str) -> BackendError:
    """The one place that turns a driver error into a :class:`BackendError`."""
    what = f" for {key!r}" if key is not None else ""
    return BackendError(f"{action}{what} failed: {type(exc).__name__}: {exc}", key=key)


def no_retry_client(url: str, **options: Any) -> redis.Redis:
    """A redis-py client that never retries a command on its own.

    redis-py retries on connection errors and timeouts by default. A lock command that
    timed out may still have run, so repeating it is the core's decision, not the
    driver's. Short default timeouts (2 s) keep a dead or hung server from hanging callers.
    """
    options.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("retry", Retry(backoff=NoBackoff(), retries=0))
    options["decode_responses"] = False
    return redis.Redis.from_url(url, **options)


class _RedisLocks:
    """What the sync and async backends share: the namespace, the scripts (per instance:
    redis-py's Lock caches scripts on the class, bound to whichever client registered them
    first), the key layout, and how requests are encoded and replies decoded. No I/O."""

    capabilities = Capability.RENEWABLE | Capability.BATCH_RENEW | Capability.RELEASE_NOTIFY | Capability.FENCING

    def __init__(self, namespace: str) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must not contain '{{' or '}}': {namespace!r}")
        self.namespace = namespace
        #: ``WAIT numreplicas timeout`` sent behind each acquire attempt, or ``None``.
        self._wait_command: tuple[bytes, ...] | None = None
        self._acquire = LuaScript("acquire.lua")
        self._reenter = LuaScript("reenter.lua")
        self._release = LuaScript("release.lua")
        self._renew = LuaScript("renew.lua")
        self._unqueue = LuaScript("unqueue.lua")
        self._sem_acquire = LuaScript("sem_acquire.lua")
        self._sem_release = LuaScript("sem_release.lua")
        self._sem_renew = LuaScript("sem_renew.lua")
        self._sem_reenter = LuaScript("sem_reenter.lua")
        self._sem_set = LuaScript("sem_set.lua")
        self._rw_acquire = LuaScript("rw_acquire.lua")
        self._rw_release = LuaScript("rw_release.lua")
        self._rw_held = LuaScript("rw_held.lua")
        self._multi_acquire = LuaScript("multi_acquire.lua")

    def lock_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}"

    def fence_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}:fence"

    def queue_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}:waiters"

    def wake_channel(self, key: str, waiter: str) -> str:
        """The channel on which a release wakes ``waiter`` (see release.lua)."""
        return f"{self.namespace}{{{key}}}:wake:{waiter}"

    def _lock(self, key: str) -> bytes:
        return f"{self.namespace}{{{key}}}".encode()

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        """Send ``WAIT replicas timeout`` behind every acquire attempt, in the same write and
        on the same connection, and report in :attr:`AcquireResult.replicas` how many
        replicas confirmed an acquisition (the core decides what too few means)."""
        self._wait_command = (b"WAIT", b"%d" % replicas, b"%d" % _ms(timeout))

    @staticmethod
    def _replicated(result: AcquireResult, acked: Any) -> AcquireResult:
        return result._replace(replicas=int(acked)) if result.acquired else result

    def semaphore_key(self, key: str) -> str:
        """A semaphore's holders: a sorted set of owner tokens by permit expiry (see
        sem_acquire.lua); ``…:permits``, ``…:fences`` and ``…:waiters`` sit next to it."""
        return f"{self.namespace}{{{key}}}:sem"

    # -- semaphores: requests and replies (no I/O) --

    def _sem_acquire_request(
        self, key: str, token: str, lease: float, permits: int, waiter: str | None, front: bool
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        lock = self._lock(key)
        sem = lock + b":sem"
        keys = (sem, sem + b":permits", lock + b":fence", sem + b":waiters", sem + b":fences")
        args = (token.encode(), b"%d" % _ms(lease), b"%d" % permits, (waiter or "").encode())
        return keys, (*args, b"front" if front else b"back")

    def _sem_release_request(self, key: str, token: str) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        lock = self._lock(key)
        sem = lock + b":sem"
        return (sem, sem + b":fences", sem + b":waiters"), (token.encode(), lock)

    def _sem_set_request(self, key: str, permits: int | None) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        lock = self._lock(key)
        sem = lock + b":sem"
        new = b"" if permits is None else b"%d" % permits
        return (sem, sem + b":permits", sem + b":waiters"), (new, lock)

    @staticmethod
    def _sem_acquired(reply: list[int]) -> AcquireResult:
        status, value = int(reply[0]), int(reply[1])
        if status == 1:
            return AcquireResult(True, value, 1)
        if status == 0:
            return AcquireResult(False, holder_ttl=value / 1000.0)
        return AcquireResult(False, permits=value)

    def _multi_request(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        packed: list[bytes] = []
        for key in keys:
            lock = self._lock(key)
            packed += (lock, lock + b":fence", lock + b":waiters")
        return tuple(packed), (token.encode(), b"%d" % _ms(lease), (waiter or "").encode())

    @staticmethod
    def _multi_acquired(keys: Sequence[str], reply: list[int]) -> MultiAcquireResult:
        if int(reply[0]) == 1:
            return MultiAcquireResult(True, tuple(int(fence) for fence in reply[1:]))
        ttl = int(reply[2])
        return MultiAcquireResult(False, busy=keys[int(reply[1]) - 1], holder_ttl=None if ttl < 0 else ttl / 1000.0)

    @staticmethod
    def _sem_state(reply: list[int]) -> tuple[int | None, int]:
        permits = int(reply[0])
        return (None if permits < 0 else permits), int(reply[1])

    def fair_queue_key(self, key: str) -> str:
        """The fair lock's waiter queue, in arrival order (see acquire.lua)."""
        return f"{self.namespace}{{{key}}}:fair"

    @staticmethod
    def _acquire_request(
        lock: bytes, token: str, lease: float, waiter: str | None, front: bool, fair: bool
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        if fair:
            # Without a waiter id ("": a try-once call) the attempt is still fair, but queues nothing.
            fair_keys = (lock, lock + b":fence", lock + b":fair", lock + b":fair:seen")
            return fair_keys, (token.encode(), b"%d" % _ms(lease), (waiter or "").encode(), b"fair", _FAIR_GONE_MS)
        keys = (lock, lock + b":fence", lock + b":waiters")
        if waiter is None:
            return keys, (token.encode(), b"%d" % _ms(lease))
        return keys, (token.encode(), b"%d" % _ms(lease), waiter.encode(), b"front" if front else b"back")

    @staticmethod
    def _release_request(lock: bytes, token: str, fair: bool) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        if fair:
            return (lock, lock + b":fair", lock + b":fair:seen"), (
                token.encode(),
                b"fair",
                _FAIR_GONE_MS,
                _FAIR_GRACE_MS,
            )
        return (lock, lock + b":waiters"), (token.encode(),)

    @staticmethod
    def _unqueue_request(lock: bytes, waiter: str, kind: str) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        if kind == "semaphore":
            return (lock + b":sem:waiters",), (waiter.encode(),)
        if kind in ("read", "write"):
            return (lock + b":rw:waiters", lock + b":rw:wq", lock + b":rw:w"), (waiter.encode(), b"zset", lock)
        if kind == "fair":
            return (lock + b":fair", lock + b":fair:seen"), (waiter.encode(), b"hash")
        return (lock + b":waiters",), (waiter.encode(),)

    # -- read-write locks: requests (no I/O) --

    def rw_keys(self, key: str) -> dict[str, str]:
        """The store keys of read-write lock ``key``, by role (see rw_acquire.lua)."""
        base = f"{self.namespace}{{{key}}}:rw"
        return {
            "writer": base + ":w",
            "readers": base + ":r",
            "fences": base + ":fences",
            "waiting writers": base + ":wq",
            "waiters": base + ":waiters",
        }

    def _rw_acquire_request(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None, below: str
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        lock = self._lock(key)
        rw = lock + b":rw"
        keys = (rw + b":w", rw + b":r", rw + b":fences", rw + b":wq", rw + b":waiters", lock + b":fence")
        args = (token.encode(), b"%d" % _ms(lease), mode.encode(), (waiter or "").encode(), _FAIR_GONE_MS)
        return keys, (*args, below.encode())

    def _rw_release_request(self, key: str, token: str, mode: str) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        lock = self._lock(key)
        rw = lock + b":rw"
        return (rw + b":w", rw + b":r", rw + b":fences", rw + b":waiters"), (token.encode(), mode.encode(), lock)

    @staticmethod
    def _acquired(reply: int) -> AcquireResult:
        if reply > 0:
            return AcquireResult(True, reply, 1)
        return AcquireResult(False, holder_ttl=(-reply - 1) / 1000.0 if reply < 0 else None)

    @staticmethod
    def _reentered(holds: int) -> AcquireResult:
        return AcquireResult(holds > 0, 0, holds)

    def _queue_renewals(self, pipe: Any, leases: Sequence[RenewItem]) -> list[int]:
        """Queue one EVALSHA per chunk of ``leases`` on a pipeline (sync or async: queueing
        does no I/O in either): locks and writers with renew.lua, semaphore permits and
        readers (by the item's kind, see :data:`RenewItem`) with sem_renew.lua. Returns the
        order in which the answers come back, as indexes into ``leases`` (see
        :meth:`_renewed`)."""
        namespace = self.namespace
        # renew.lua extends a hash its token is in: a lock (or fair lock), a writer;
        # sem_renew.lua a sorted-set member: a semaphore permit, a reader.
        items: Sequence[tuple[Any, ...]] = leases
        kinds = [str(item[3]) if len(item) > 3 else "lock" for item in items]
        unknown = set(kinds) - {"lock", "fair", "write", "semaphore", "read"}
        if unknown:
            raise ValueError(f"cannot renew leases of kind {sorted(unknown)}")
        hashes = [i for i, kind in enumerate(kinds) if kind in ("lock", "fair", "write")]
        members = [i for i, kind in enumerate(kinds) if kind in ("semaphore", "read")]
        for start in range(0, len(hashes), RENEW_CHUNK):
            keys: list[str] = []
            args: list[object] = []
            for i in hashes[start : start + RENEW_CHUNK]:
                key, token, lease = items[i][:3]
                keys.append(f"{namespace}{{{key}}}" + (":rw:w" if kinds[i] == "write" else ""))
                args.append(token)
                args.append(_ms(lease))
            pipe.execute_command("EVALSHA", self._renew.sha, len(keys), *keys, *args)
        for start in range(0, len(members), RENEW_CHUNK):
            keys = []
            args = []
            for i in members[start : start + RENEW_CHUNK]:
                key, token, lease = items[i][:3]
                base = f"{namespace}{{{key}}}" + (":sem" if kinds[i] == "semaphore" else ":rw")
                keys.append(base if kinds[i] == "semaphore" else base + ":r")
                keys.append(base + ":fences")
                args.append(token)
                args.append(_ms(lease))
            pipe.execute_command("EVALSHA", self._sem_renew.sha, len(keys), *keys, *args)
        return hashes + members

    @staticmethod
    def _renewed(replies: list[Any], order: list[int]) -> list[bool]:
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        statuses = [bool(status) for reply in replies for status in reply]
        renewed = [False] * len(order)
        for index, status in zip(order, statuses, strict=True):
            renewed[index] = status
        return renewed

    def _renew_scripts(self) -> tuple[LuaScript, ...]:
        return (self._renew, self._sem_renew)

    @staticmethod
    def _renew_error(exc: RedisError, leases: Sequence[RenewItem]) -> BackendError:
        first = leases[0][0] if len(leases) == 1 else None
        return map_redis_error(exc, first, f"renewal of {len(leases)} lease(s)")


class RedisBackend(_RedisLocks):
    """A lock store on one Redis or Valkey server (6.2 or newer).

    Args:
        client: A ``redis.Redis`` client; it should not retry commands by itself
            (see :func:`no_retry_client`).
        namespace: Prefix of every key lockaspect writes, e.g. ``"lockaspect:"``.
        url, options: How the client was built, so that :meth:`asyncio_twin` can build the
            same for an event loop (set by :meth:`from_url`).
    """

    def __init__(
        self, client: redis.Redis, *, namespace: str = "lockaspect:", url: str | None = None, **options: Any
    ) -> None:
        super().__init__(namespace)
        # Any: redis-py's command methods are only partly annotated.
        self.redis: Any = client
        self._url = url
        self._options = options
        self._wire = _Wire(client)
        self._notifier: RedisNotifier | None = None
        self._notifier_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "lockaspect:", **options: Any) -> RedisBackend:
        return cls(no_retry_client(url, **options), namespace=namespace, url=url, **options)

    def asyncio_twin(self) -> AsyncRedisBackend:
        """An :class:`AsyncRedisBackend` on the same server, namespace and options, for the
        running event loop (asyncio connections belong to one loop)."""
        if self._url is None:
            raise ConfigurationError(
                "asyncio needs a backend built with RedisBackend.from_url (or LockClient.from_url), "
                "so that it can connect again from each event loop"
            )
        twin = AsyncRedisBackend.from_url(self._url, namespace=self.namespace, **self._options)
        twin._wait_command = self._wait_command
        return twin

    def acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
    ) -> AcquireResult:
        keys, args = self._acquire_request(self._lock(key), token, lease, waiter, front, fair)
        try:
            if self._wait_command is not None:
                reply, acked = self._acquire.run_then(self._wire, self.redis, keys, args, self._wait_command)
                return self._replicated(self._acquired(reply), acked)
            reply = self._acquire.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc
        return self._acquired(reply)

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Take ``waiter`` off ``key``'s waiter queue (it stopped waiting)."""
        keys, args = self._unqueue_request(self._lock(key), waiter, kind)
        try:
            self._unqueue.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "unqueue") from exc

    def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None
    ) -> MultiAcquireResult:
        """Take every lock of ``keys`` for ``token``, all at once or none (multi_acquire.lua)."""
        packed, args = self._multi_request(keys, token, lease, waiter)
        try:
            if self._wait_command is not None:
                reply, acked = self._multi_acquire.run_then(self._wire, self.redis, packed, args, self._wait_command)
                result = self._multi_acquired(keys, reply)
                return result._replace(replicas=int(acked)) if result.acquired else result
            return self._multi_acquired(keys, self._multi_acquire.run(self._wire, self.redis, packed, args))
        except RedisError as exc:
            raise map_redis_error(exc, keys[0], "acquire") from exc

    def sem_acquire(
        self, key: str, token: str, lease: float, permits: int, waiter: str | None = None, front: bool = False
    ) -> AcquireResult:
        """Take one of ``permits`` permits of semaphore ``key`` for ``lease`` seconds."""
        keys, args = self._sem_acquire_request(key, token, lease, permits, waiter, front)
        try:
            if self._wait_command is not None:
                reply, acked = self._sem_acquire.run_then(self._wire, self.redis, keys, args, self._wait_command)
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(self._sem_acquire.run(self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    def sem_release(self, key: str, token: str) -> ReleaseResult:
        keys, args = self._sem_release_request(key, token)
        try:
            code = self._sem_release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def sem_reenter(self, key: str, token: str) -> AcquireResult:
        try:
            held = self._sem_reenter.run(self._wire, self.redis, (self._lock(key) + b":sem",), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return AcquireResult(bool(held), 0, 2 if held else 0)

    def sem_state(self, key: str, permits: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to
        ``permits`` if given (``None`` permits: never set)."""
        keys, args = self._sem_set_request(key, permits)
        try:
            return self._sem_state(self._sem_set.run(self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "set_permits" if permits is not None else "permits") from exc

    def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = ""
    ) -> AcquireResult:
        keys, args = self._rw_acquire_request(key, token, lease, mode, waiter, below)
        try:
            if self._wait_command is not None:
                reply, acked = self._rw_acquire.run_then(self._wire, self.redis, keys, args, self._wait_command)
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(self._rw_acquire.run(self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            code = self._rw_release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def rw_held(self, key: str, token: str, mode: str) -> AcquireResult:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            held = self._rw_held.run(self._wire, self.redis, keys[:2], args[:2])
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return AcquireResult(bool(held), 0, 2 if held else 0)

    def reenter(self, key: str, token: str) -> AcquireResult:
        try:
            holds = self._reenter.run(self._wire, self.redis, (self._lock(key),), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return self._reentered(holds)

    def release(self, key: str, token: str, fair: bool = False) -> ReleaseResult:
        keys, args = self._release_request(self._lock(key), token, fair)
        try:
            code = self._release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def renew(self, leases: Sequence[RenewItem]) -> list[bool]:
        if not leases:
            return []
        try:
            pipe = self.redis.pipeline(transaction=False)
            order = self._queue_renewals(pipe, leases)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            if any(isinstance(reply, NoScriptError) for reply in replies):
                for script in self._renew_scripts():
                    self.redis.execute_command("SCRIPT", "LOAD", script.source)
                pipe = self.redis.pipeline(transaction=False)
                self._queue_renewals(pipe, leases)
                replies = pipe.execute(raise_on_error=False)
            return self._renewed(replies, order)
        except RedisError as exc:
            raise self._renew_error(exc, leases) from exc

    def notifier(self) -> RedisNotifier | None:
        with self._notifier_lock:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = RedisNotifier(self.redis, self.wake_channel)
            return self._notifier

    def threads(self) -> list[threading.Thread]:
        """Threads the backend started (the release-notification reader, once used)."""
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
        self.redis.close()
        self.redis.connection_pool.disconnect()

    def _reset_after_fork(self) -> None:
        # redis-py's pool notices the new pid by itself; the subscriber thread did not
        # survive the fork, so forget it and start a fresh one on demand.
        self._notifier = None
        self._notifier_lock = threading.Lock()


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


_FAIR_GONE_MS = b"%d" % _ms(FAIR_GONE_AFTER)
_FAIR_GRACE_MS = b"%d" % _ms(FAIR_SUBSCRIBE_GRACE)


_RELEASE_CODES = {code.value: code for code in ReleaseResult}


# -- release notifications ----------------------------------------------------------------

#: After the server refuses pub/sub (an ACL without ``+@pubsub``, a proxy without it), stop
#: asking for this many seconds: waiters poll at once instead of timing out on SUBSCRIBE.
UNAVAILABLE_FOR = 60.0


class _Subscription:
    """A sync waiter's registration for release messages of one lock."""

    __slots__ = ("_event", "active", "channel")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self._event = threading.Event()
        self.active = False

    def wait(self, timeout: float) -> bool:
        woke = self._event.wait(timeout)
        self._event.clear()
        return woke

    def wake(self) -> None:
        self._event.set()


class RedisNotifier:
    """One subscriber connection and reader thread per client, fanning release messages
    out to local waiters (see :class:`~lockaspect.backends._channels.ChannelTable`).

    When the connection fails, every waiter is woken and every subscription turns
    inactive; when the server refuses pub/sub, subscriptions stay inactive for a while.
    Waiters then retry with bounded polling, so progress never depends on a message.
    """

    def __init__(self, client: redis.Redis, channel_for: Any) -> None:
        self._redis: Any = client
        self._channel_for = channel_for
        #: This notifier's waiter id: queued in a lock's waiter list, woken on its own channel.
        self.waiter_id = os.urandom(8).hex()
        self._lock = threading.Condition(threading.Lock())
        self._table = ChannelTable()
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unavailable_until = 0.0

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        sub = _Subscription(self._channel_for(key, waiter or self.waiter_id).encode())
        now = time.monotonic()
        deadline = now + timeout
        with self._lock:
            if self._closed or now < self._unavailable_until:
                return sub
            if self._table.join(sub, now):
                try:
                    self._send("SUBSCRIBE", sub.channel)
                except RedisError as exc:
                    log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                    # Nothing will answer that SUBSCRIBE: forget the subscriber connection's
                    # channels, as when the reader loses it, or this one waits for it forever.
                    for other in self._table.reset():
                        if other is not sub:
                            other.wake()
                    return sub
            # Stop waiting when the reader gave up (it resets the table and clears _pubsub).
            while not self._table.subscribed(sub.channel) and not self._closed and self._pubsub is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._lock.wait(remaining):
                    break
            sub.active = self._table.subscribed(sub.channel)
        return sub

    def listening(self, key: str) -> bool:
        """Whether this notifier already listens for wake-ups of ``key`` (so a first attempt
        may queue at once: a wake-up that comes before its waiter registers is kept)."""
        with self._lock:
            return self._table.subscribed(self._channel_for(key, self.waiter_id).encode())

    def unsubscribe(self, subscription: Any) -> None:
        with self._lock:
            self._table.leave(subscription, time.monotonic())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pubsub, self._pubsub = self._pubsub, None
            for waiter in self._table.reset():
                waiter.wake()
            self._lock.notify_all()
        if pubsub is not None:
            try:
                pubsub.close()
            except RedisError:  # pragma: no cover - closing a broken connection
                pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # Called with self._lock held.
    def _send(self, command: str, name: bytes) -> None:
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=False)
        if command == "SUBSCRIBE":
            self._pubsub.subscribe(name)
        else:
            self._pubsub.unsubscribe(name)
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name="lockaspect-notifier", daemon=True)
            self._thread.start()

    def _read(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                pubsub = self._pubsub
                for name in self._table.idle(time.monotonic()):
                    try:
                        self._send("UNSUBSCRIBE", name)
                    except RedisError:
                        break
            if pubsub is None:
                return
            try:
                message = pubsub.get_message(timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - any failure ends this reader
                # Also what redis-py raises when close() pulled the connection away.
                self._connection_lost(pubsub, exc)
                return
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        kind = kind.encode() if isinstance(kind, str) else kind
        name = message["channel"]
        with self._lock:
            if kind == b"message":
                for waiter in self._table.message(name, time.monotonic()):
                    waiter.wake()
            elif kind in (b"subscribe", b"unsubscribe") and self._table.reply(kind, name):
                self._lock.notify_all()

    def _connection_lost(self, pubsub: Any, exc: BaseException) -> None:
        with self._lock:
            if self._closed:
                return
            if isinstance(exc, ResponseError):
                # NOPERM (an ACL without pub/sub) or an unknown command behind a proxy.
                self._unavailable_until = time.monotonic() + UNAVAILABLE_FOR
                log.warning("the server refuses pub/sub, waiters poll instead for %gs: %s", UNAVAILABLE_FOR, exc)
            else:
                log.warning("release notifications interrupted, waiters fall back to polling: %s", exc)
            for waiter in self._table.reset():
                waiter.wake()
            if self._pubsub is pubsub:
                self._pubsub = None
            self._thread = None
            self._lock.notify_all()
        try:
            pubsub.close()
        except (RedisError, OSError):  # pragma: no cover
            pass


# -- asyncio ---------------------------------------------------------------------------------
#
# The twins of the classes above, for one event loop each (redis.asyncio connections belong
# to the loop that made them). Everything that does no I/O is shared through _RedisLocks,
# LuaScript and ChannelTable.


def no_retry_async_client(url: str, **options: Any) -> Any:
    """The ``redis.asyncio`` twin of :func:`no_retry_client`."""
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    options.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    options["retry"] = AsyncRetry(backoff=NoBackoff(), retries=0)
    options["decode_responses"] = False
    return redis.asyncio.Redis.from_url(url, **options)


#: Above this many buffered bytes an async lock command waits for the socket to drain.
_WRITE_HIGH_WATER = 64 * 1024


class _AsyncWire:
    """:class:`_Wire` for one event loop: pre-packed lock commands over connections kept in
    a LIFO list, checked before reuse (the loop reads a closed connection's EOF into its
    stream as soon as it arrives), never sent twice."""

    __slots__ = ("_client", "_free", "_make")

    def __init__(self, client: Any) -> None:
        self._client = client
        pool = getattr(client, "connection_pool", None)
        make = getattr(pool, "make_connection", None)
        usable = getattr(client, "connection", None) is None and callable(make)
        self._make: Any = make if usable else None
        self._free: list[Any] = []

    async def call(self, packed: bytes, args: tuple[object, ...]) -> Any:
        if self._make is None:
            return await self._client.execute_command(*args)
        free = self._free
        try:
            connection = free.pop()
        except IndexError:
            connection = self._make()
        else:
            reader = getattr(connection, "_reader", None)
            if reader is not None and (reader.at_eof() or reader.exception() is not None):
                await connection.disconnect(nowait=True)  # the server closed it: reconnect
        try:
            writer = getattr(connection, "_writer", None)
            if writer is None or not connection.is_connected:
                await connection.send_packed_command((packed,), check_health=False)
            else:
                # redis.asyncio wraps every write in asyncio.wait_for (a task and a timer per
                # command) when a socket timeout is set. A write only appends to the transport's
                # buffer; drain, under the timeout, only when the buffer is past its high-water
                # mark. The read below keeps redis-py's own timeout.
                writer.write(packed)
                if writer.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                    await asyncio.wait_for(writer.drain(), connection.socket_timeout)
            reply = await connection.read_response()
        except ResponseError:
            free.append(connection)  # the whole reply was read: the connection is clean
            raise
        except BaseException:
            # A timeout or a cancellation (asyncio.wait_for, a cancelled caller) may leave
            # half a reply on the socket: drop the connection, it reconnects on next use.
            _abandon(connection)
            free.append(connection)
            raise
        free.append(connection)
        return reply

    async def call_then(self, packed: bytes, args: tuple[object, ...], then: tuple[bytes, ...]) -> tuple[Any, Any]:
        """:meth:`_Wire.call_then` for one event loop."""
        if self._make is None:
            pipe = self._client.pipeline(transaction=False)
            pipe.execute_command(*args)
            pipe.execute_command(*then)
            replies = await pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies[0], replies[1]
        free = self._free
        connection = free.pop() if free else self._make()
        reader = getattr(connection, "_reader", None)
        if reader is not None and (reader.at_eof() or reader.exception() is not None):
            await connection.disconnect(nowait=True)
        try:
            await connection.send_packed_command((packed, _packed(then)), check_health=False)
            first: Any
            try:
                first = await connection.read_response()
            except ResponseError as exc:
                first = exc
            second = await connection.read_response()
        except BaseException:
            _abandon(connection)
            free.append(connection)
            raise
        free.append(connection)
        if isinstance(first, ResponseError):
            raise first
        return first, second

    async def close(self) -> None:
        free, self._free = self._free, []
        for connection in free:
            await connection.disconnect(nowait=True)


def _abandon(connection: Any) -> None:
    """Close an asyncio connection without awaiting (we may be handling a cancellation)."""
    writer = getattr(connection, "_writer", None)
    if writer is not None:
        writer.close()
    parser = getattr(connection, "_parser", None)
    if parser is not None:
        parser.on_disconnect()
    connection._reader = connection._writer = None


async def _run_async(
    script: LuaScript, wire: _AsyncWire, client: Any, keys: tuple[bytes, ...], args: tuple[bytes, ...]
) -> Any:
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    try:
        return await wire.call(script.packed(keys, args), command)
    except NoScriptError:
        await client.execute_command("SCRIPT", "LOAD", script.source)
        return await wire.call(script.packed(keys, args), command)


async def _run_async_then(
    script: LuaScript,
    wire: _AsyncWire,
    client: Any,
    keys: tuple[bytes, ...],
    args: tuple[bytes, ...],
    then: tuple[bytes, ...],
) -> tuple[Any, Any]:
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    try:
        return await wire.call_then(script.packed(keys, args), command, then)
    except NoScriptError:
        await client.execute_command("SCRIPT", "LOAD", script.source)
        return await wire.call_then(script.packed(keys, args), command, then)


class AsyncRedisBackend(_RedisLocks):
    """:class:`RedisBackend` for one asyncio event loop (``redis.asyncio``)."""

    def __init__(self, client: Any, *, namespace: str = "lockaspect:") -> None:
        super().__init__(namespace)
        self.redis: Any = client
        self._wire = _AsyncWire(client)
        self._notifier: AsyncRedisNotifier | None = None

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "lockaspect:", **options: Any) -> AsyncRedisBackend:
        return cls(no_retry_async_client(url, **options), namespace=namespace)

    async def acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
    ) -> AcquireResult:
        keys, args = self._acquire_request(self._lock(key), token, lease, waiter, front, fair)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._acquire, self._wire, self.redis, keys, args, self._wait_command
                )
                return self._replicated(self._acquired(reply), acked)
            reply = await _run_async(self._acquire, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc
        return self._acquired(reply)

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        keys, args = self._unqueue_request(self._lock(key), waiter, kind)
        try:
            await _run_async(self._unqueue, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "unqueue") from exc

    async def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None
    ) -> MultiAcquireResult:
        packed, args = self._multi_request(keys, token, lease, waiter)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._multi_acquire, self._wire, self.redis, packed, args, self._wait_command
                )
                result = self._multi_acquired(keys, reply)
                return result._replace(replicas=int(acked)) if result.acquired else result
            return self._multi_acquired(
                keys, await _run_async(self._multi_acquire, self._wire, self.redis, packed, args)
            )
        except RedisError as exc:
            raise map_redis_error(exc, keys[0], "acquire") from exc

    async def sem_acquire(
        self, key: str, token: str, lease: float, permits: int, waiter: str | None = None, front: bool = False
    ) -> AcquireResult:
        keys, args = self._sem_acquire_request(key, token, lease, permits, waiter, front)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._sem_acquire, self._wire, self.redis, keys, args, self._wait_command
                )
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(await _run_async(self._sem_acquire, self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    async def sem_release(self, key: str, token: str) -> ReleaseResult:
        keys, args = self._sem_release_request(key, token)
        try:
            code = await _run_async(self._sem_release, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    async def sem_reenter(self, key: str, token: str) -> AcquireResult:
        keys = (self._lock(key) + b":sem",)
        try:
            held = await _run_async(self._sem_reenter, self._wire, self.redis, keys, (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return AcquireResult(bool(held), 0, 2 if held else 0)

    async def sem_state(self, key: str, permits: int | None = None) -> tuple[int | None, int]:
        keys, args = self._sem_set_request(key, permits)
        try:
            return self._sem_state(await _run_async(self._sem_set, self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "set_permits" if permits is not None else "permits") from exc

    async def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = ""
    ) -> AcquireResult:
        keys, args = self._rw_acquire_request(key, token, lease, mode, waiter, below)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._rw_acquire, self._wire, self.redis, keys, args, self._wait_command
                )
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(await _run_async(self._rw_acquire, self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    async def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            code = await _run_async(self._rw_release, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    async def rw_held(self, key: str, token: str, mode: str) -> AcquireResult:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            held = await _run_async(self._rw_held, self._wire, self.redis, keys[:2], args[:2])
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return AcquireResult(bool(held), 0, 2 if held else 0)

    async def reenter(self, key: str, token: str) -> AcquireResult:
        try:
            holds = await _run_async(self._reenter, self._wire, self.redis, (self._lock(key),), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return self._reentered(holds)

    async def release(self, key: str, token: str, fair: bool = False) -> ReleaseResult:
        keys, args = self._release_request(self._lock(key), token, fair)
        try:
            code = await _run_async(self._release, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    async def renew(self, leases: Sequence[RenewItem]) -> list[bool]:
        if not leases:
            return []
        try:
            pipe = self.redis.pipeline(transaction=False)
            order = self._queue_renewals(pipe, leases)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            if any(isinstance(reply, NoScriptError) for reply in replies):
                for script in self._renew_scripts():
                    await self.redis.execute_command("SCRIPT", "LOAD", script.source)
                pipe = self.redis.pipeline(transaction=False)
                self._queue_renewals(pipe, leases)
                replies = await pipe.execute(raise_on_error=False)
            return self._renewed(replies, order)
        except RedisError as exc:
            raise self._renew_error(exc, leases) from exc

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


class _AsyncSubscription:
    """An async waiter's registration for release messages of one lock."""

    __slots__ = ("_future", "_woken", "active", "channel")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self._future: asyncio.Future[bool] | None = None
        self._woken = False
        self.active = False

    async def wait(self, timeout: float) -> bool:
        # A future and a call_later, not asyncio.wait_for (a task per wait on Python 3.11).
        if self._woken:
            self._woken = False
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout, _resolve, future, False)
        self._future = future
        try:
            return await future
        finally:
            timer.cancel()
            self._future = None
            self._woken = False

    def wake(self) -> None:
        future = self._future
        if future is None:
            self._woken = True
        else:
            _resolve(future, True)


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class AsyncRedisNotifier:
    """:class:`RedisNotifier` for one event loop: one subscriber connection and one reader
    task per loop. SUBSCRIBE/UNSUBSCRIBE are decided and sent under one asyncio lock, so they
    reach the server in the order the table recorded them."""

    def __init__(self, client: Any, channel_for: Any) -> None:
        self._redis = client
        self._channel_for = channel_for
        self.waiter_id = os.urandom(8).hex()
        self._table = ChannelTable()
        self._send_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self._unavailable_until = 0.0

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        sub = _AsyncSubscription(self._channel_for(key, waiter or self.waiter_id).encode())
        now = time.monotonic()
        if self._closed or now < self._unavailable_until:
            return sub
        async with self._send_lock:
            if self._table.join(sub, now):
                try:
                    await self._send("SUBSCRIBE", sub.channel)
                except RedisError as exc:
                    log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                    # Nothing will answer that SUBSCRIBE: forget the subscriber connection's
                    # channels, as when the reader loses it, or this one waits for it forever.
                    for other in self._table.reset():
                        if other is not sub:
                            other.wake()
                    return sub
        if not self._table.subscribed(sub.channel):
            try:
                async with self._changed:
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda: self._table.subscribed(sub.channel) or self._closed or self._pubsub is None
                        ),
                        timeout,
                    )
            except asyncio.TimeoutError:
                pass
        sub.active = self._table.subscribed(sub.channel)
        return sub

    def listening(self, key: str) -> bool:
        """See :meth:`RedisNotifier.listening`."""
        return self._table.subscribed(self._channel_for(key, self.waiter_id).encode())

    def unsubscribe(self, subscription: Any) -> None:
        self._table.leave(subscription, time.monotonic())

    async def aclose(self) -> None:
        self._closed = True
        for waiter in self._table.reset():
            waiter.wake()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    # Called with self._send_lock held.
    async def _send(self, command: str, name: bytes) -> None:
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=False)
        if command == "SUBSCRIBE":
            await self._pubsub.subscribe(name)
        else:
            await self._pubsub.unsubscribe(name)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="lockaspect-notifier")

    async def _read(self) -> None:
        while not self._closed:
            pubsub = self._pubsub
            if pubsub is None:
                return
            async with self._send_lock:
                for name in self._table.idle(time.monotonic()):
                    try:
                        await self._send("UNSUBSCRIBE", name)
                    except RedisError:
                        break
            try:
                message = await pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure ends this reader
                await self._connection_lost(pubsub, exc)
                return
            if message is not None:
                await self._dispatch(message)

    async def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        kind = kind.encode() if isinstance(kind, str) else kind
        name = message["channel"]
        if kind == b"message":
            for waiter in self._table.message(name, time.monotonic()):
                waiter.wake()
        elif kind in (b"subscribe", b"unsubscribe") and self._table.reply(kind, name):
            async with self._changed:
                self._changed.notify_all()

    async def _connection_lost(self, pubsub: Any, exc: BaseException) -> None:
        if isinstance(exc, ResponseError):
            self._unavailable_until = time.monotonic() + UNAVAILABLE_FOR
            log.warning("the server refuses pub/sub, waiters poll instead for %gs: %s", UNAVAILABLE_FOR, exc)
        else:
            log.warning("release notifications interrupted, waiters fall back to polling: %s", exc)
        for waiter in self._table.reset():
            waiter.wake()
        if self._pubsub is pubsub:
            self._pubsub = None
        self._reader = None
        async with self._changed:
            self._changed.notify_all()
        with contextlib.suppress(Exception):
            await pubsub.aclose()
