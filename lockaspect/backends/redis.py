"""Redis and Valkey through redis-py: the lock scripts, batched renewal and release wake-ups.

Key layout for a lock rendered as ``order:42`` in namespace ``lockaspect:``::

    lockaspect:{order:42}            hash {<token>: holds, "fence": n}, with the lease as TTL
    lockaspect:{order:42}:fence      fence counter (INCR per first acquisition, no TTL)
    lockaspect:{order:42}:released   pub/sub channel, one message per final release

All three share the hash tag ``{order:42}``, so Redis Cluster keeps them in one slot.
Rendered keys never contain ``{`` or ``}`` (values are percent-encoded, templates may not
contain them), so the tag cannot be broken from outside.

The fence counter outlives the lock on purpose: a fencing token must exceed every token
issued before for that key, also after the lock expired. That costs one small key per
distinct lock name ever used.
"""

from __future__ import annotations

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

from ..errors import BackendError
from ._channels import ChannelTable
from .base import AcquireResult, Capability, ReleaseResult

__all__ = ["LuaScript", "RedisBackend", "RedisNotifier", "load_script", "map_redis_error"]

log = logging.getLogger("lockaspect.backend")

#: Default socket (and connect) timeout in seconds: a renewal that hangs times out and is
#: retried within the default renewal margin (a 30 s lease renewed at 0.9 leaves 3 s).
DEFAULT_SOCKET_TIMEOUT = 2.0

# One EVALSHA per chunk keeps each script call short on the server (Redisson uses 100);
# all chunks of one batch still travel in one pipelined round trip.
RENEW_CHUNK = 256


def load_script(name: str) -> str:
    """The text of ``lockaspect/backends/lua/<name>``."""
    return resources.files(__package__).joinpath("lua").joinpath(name).read_text(encoding="utf-8")


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


class RedisBackend:
    """A lock store on one Redis or Valkey server (6.2 or newer).

    Args:
        client: A ``redis.Redis`` client; it should not retry commands by itself
            (see :func:`no_retry_client`).
        namespace: Prefix of every key lockaspect writes, e.g. ``"lockaspect:"``.
    """

    capabilities = Capability.RENEWABLE | Capability.BATCH_RENEW | Capability.RELEASE_NOTIFY | Capability.FENCING

    def __init__(self, client: redis.Redis, *, namespace: str = "lockaspect:") -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must not contain '{{' or '}}': {namespace!r}")
        # Any: redis-py's command methods are only partly annotated.
        self.redis: Any = client
        self.namespace = namespace
        # Per instance, not per class: redis-py's Lock caches scripts on the class, bound
        # to whichever client registered them first.
        self._acquire = LuaScript("acquire.lua")
        self._reenter = LuaScript("reenter.lua")
        self._release = LuaScript("release.lua")
        self._renew = LuaScript("renew.lua")
        self._wire = _Wire(client)
        self._notifier: RedisNotifier | None = None
        self._notifier_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "lockaspect:", **options: Any) -> RedisBackend:
        return cls(no_retry_client(url, **options), namespace=namespace)

    def lock_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}"

    def fence_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}:fence"

    def channel(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}:released"

    def acquire(self, key: str, token: str, lease: float) -> AcquireResult:
        lock = f"{self.namespace}{{{key}}}".encode()
        try:
            reply = self._acquire.run(
                self._wire, self.redis, (lock, lock + b":fence"), (token.encode(), b"%d" % _ms(lease))
            )
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc
        if reply > 0:
            return AcquireResult(True, reply, 1)
        return AcquireResult(False, holder_ttl=(-reply - 1) / 1000.0 if reply < 0 else None)

    def reenter(self, key: str, token: str) -> AcquireResult:
        lock = f"{self.namespace}{{{key}}}".encode()
        try:
            holds = self._reenter.run(self._wire, self.redis, (lock,), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return AcquireResult(holds > 0, 0, holds)

    def release(self, key: str, token: str) -> ReleaseResult:
        lock = f"{self.namespace}{{{key}}}".encode()
        try:
            code = self._release.run(self._wire, self.redis, (lock,), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def renew(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        if not leases:
            return []
        chunks = [leases[i : i + RENEW_CHUNK] for i in range(0, len(leases), RENEW_CHUNK)]
        try:
            replies = self._renew_chunks(chunks)
        except RedisError as exc:
            first = leases[0][0] if len(leases) == 1 else None
            raise map_redis_error(exc, first, f"renewal of {len(leases)} lease(s)") from exc
        return [bool(status) for reply in replies for status in reply]

    def _renew_chunks(self, chunks: list[Sequence[tuple[str, str, float]]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for chunk in chunks:
            self._queue_renew(pipe, chunk)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        if any(isinstance(reply, NoScriptError) for reply in replies):
            self.redis.execute_command("SCRIPT", "LOAD", self._renew.source)
            pipe = self.redis.pipeline(transaction=False)
            for chunk in chunks:
                self._queue_renew(pipe, chunk)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _queue_renew(self, pipe: Any, chunk: Sequence[tuple[str, str, float]]) -> None:
        keys: list[str] = []
        args: list[object] = []
        namespace = self.namespace
        for key, token, lease in chunk:
            keys.append(f"{namespace}{{{key}}}")
            args.append(token)
            args.append(_ms(lease))
        pipe.execute_command("EVALSHA", self._renew.sha, len(keys), *keys, *args)

    def notifier(self) -> RedisNotifier:
        with self._notifier_lock:
            if self._notifier is None:
                self._notifier = RedisNotifier(self.redis, self.channel)
            return self._notifier

    def threads(self) -> list[threading.Thread]:
        """Threads the backend started (the release-notification reader, once used)."""
        notifier = self._notifier
        thread = None if notifier is None else notifier._thread
        return [] if thread is None else [thread]

    def close(self) -> None:
        with self._notifier_lock:
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
        self._lock = threading.Condition(threading.Lock())
        self._table = ChannelTable()
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unavailable_until = 0.0

    def subscribe(self, key: str, timeout: float) -> _Subscription:
        sub = _Subscription(self._channel_for(key).encode())
        now = time.monotonic()
        deadline = now + timeout
        with self._lock:
            if self._closed or now < self._unavailable_until:
                return sub
            if self._table.join(sub):
                try:
                    self._send("SUBSCRIBE", sub.channel)
                except RedisError as exc:
                    log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                    self._table.leave(sub, now)
                    return sub
            # Stop waiting when the reader gave up (it resets the table and clears _pubsub).
            while not self._table.subscribed(sub.channel) and not self._closed and self._pubsub is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._lock.wait(remaining):
                    break
            sub.active = self._table.subscribed(sub.channel)
        return sub

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
                for waiter in self._table.message(name):
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
