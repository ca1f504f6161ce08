"""Redis and Valkey through redis-py: the lock scripts, batched renewal and release wake-ups.

Key layout for a lock rendered as ``order:42`` in namespace ``lockaspect:``::

    lockaspect:{order:42}            hash {<owner field>: holds, "fence": n}, with the lease as TTL
    lockaspect:{order:42}:fence      fence counter (INCR per first acquisition, no TTL)
    lockaspect:{order:42}:waiters    FIFO list of waiter ids (one per waiting notifier)
    lockaspect:{order:42}:wake:<id>  pub/sub channel of one waiter; a release wakes the first

An owner's field is its token as it is, except that the token ``fence`` and tokens starting
with ``#`` are stored with a ``#`` in front (``fence`` -> ``#fence``, ``#x`` -> ``##x``; see
``owner_field`` in lua/lib.lua). No token's field is ``fence``, so no caller can pass for an
owner of the fencing token, whatever token it sends; a read-write lock's writer hash
(``…:rw:w``) stores its owner the same way. A value of another type at a lock's key (not
written by lockaspect) counts as another owner's: busy, and never ours to renew or release.

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
import math
import os
import queue
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from ..._policy import FAIR_GONE_AFTER, FAIR_SUBSCRIBE_GRACE
from ..._wakeup import Wakeup
from ...errors import BackendError, ConfigurationError
from ..base import AcquireRequest, AcquireResult, Capability, ReleaseResult, RenewItem
from ._channels import ChannelTable

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
    """A script's text and SHA1, loaded once per backend instance.

    Every way of running it sends ``EVALSHA`` first; on NOSCRIPT (after a ``SCRIPT FLUSH``,
    a failover, a restart) it loads the script and sends ``EVALSHA`` again, and when that
    meets NOSCRIPT too (another client flushing in a loop), ``EVAL`` with the full text,
    which cannot: NOSCRIPT never reaches the caller."""

    __slots__ = ("_eval_heads", "_heads", "name", "sha", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = load_script(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self._heads: dict[tuple[int, int], bytes] = {}
        self._eval_heads: dict[tuple[int, int], bytes] = {}

    def packed(self, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> bytes:
        """``EVALSHA sha numkeys keys... args...`` in the wire format."""
        shape = (len(keys), len(args))
        head = self._heads.get(shape)
        if head is None:
            head = b"*%d\r\n" % (3 + shape[0] + shape[1]) + _bulk(b"EVALSHA") + _bulk(self.sha.encode())
            head += _bulk(b"%d" % shape[0])
            self._heads[shape] = head
        return head + b"".join([_bulk(part) for part in keys + args])

    def packed_eval(self, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> bytes:
        """``EVAL source numkeys keys... args...`` in the wire format (the fallback that
        cannot meet NOSCRIPT)."""
        shape = (len(keys), len(args))
        head = self._eval_heads.get(shape)
        if head is None:
            head = b"*%d\r\n" % (3 + shape[0] + shape[1]) + _bulk(b"EVAL") + _bulk(self.source.encode())
            head += _bulk(b"%d" % shape[0])
            self._eval_heads[shape] = head
        return head + b"".join([_bulk(part) for part in keys + args])

    def command(self, keys: Sequence[object], args: Sequence[object]) -> tuple[object, ...]:
        """``EVALSHA`` of ``keys`` and ``args``, unpacked (for ``execute_command``)."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def eval_command(self, keys: Sequence[object], args: Sequence[object]) -> tuple[object, ...]:
        """``EVAL`` with the full text, unpacked (for ``execute_command``)."""
        return ("EVAL", self.source, len(keys), *keys, *args)

    def run(
        self, wire: _Wire, client: Any, keys: tuple[bytes, ...], args: tuple[bytes, ...], undo: _Undo | None = None
    ) -> Any:
        """EVALSHA over the wire; on NOSCRIPT, EVAL with the full text on the same wire (which
        also caches the script for the next EVALSHA, and cannot meet NOSCRIPT). ``undo``: see
        :meth:`_Wire.call`."""
        try:
            return wire.call(self.packed(keys, args), self.command(keys, args), undo)
        except NoScriptError:
            return wire.call(self.packed_eval(keys, args), self.eval_command(keys, args), undo)

    def run_then(
        self,
        wire: _Wire,
        client: Any,
        keys: tuple[bytes, ...],
        args: tuple[bytes, ...],
        then: tuple[bytes, ...],
        undo: _Undo | None = None,
    ) -> tuple[Any, Any]:
        """:meth:`run` with the command ``then`` sent right behind it on the same connection,
        in the same write: both replies."""
        try:
            return wire.call_then(self.packed(keys, args), self.command(keys, args), then, undo)
        except NoScriptError:
            return wire.call_then(self.packed_eval(keys, args), self.eval_command(keys, args), then, undo)

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[object]) -> Any:
        """EVALSHA through ``client``; on NOSCRIPT, load the script and EVALSHA again, then
        EVAL."""
        try:
            return client.execute_command(*self.command(keys, args))
        except NoScriptError:
            pass
        try:
            client.execute_command("SCRIPT", "LOAD", self.source)
            return client.execute_command(*self.command(keys, args))
        except NoScriptError:
            return client.execute_command(*self.eval_command(keys, args))


class _Wire:
    """Sends one pre-packed command on a connection of its own and reads the reply.

    The hot path of a lock is two round trips (acquire, release), and on loopback the
    client's own work is a large part of each. So lock commands skip what redis-py's
    ``execute_command`` adds per call:

    * packing: each script's constant ``EVALSHA <sha> <numkeys>`` prefix is packed once;
    * the pool's checkout probe: ``ConnectionPool.get_connection`` checks every connection
      for stray data with a zero-timeout read (two ``ioctl`` and a ``recv``) and the pid
      twice. Connections here are made with the pool's connection class and settings,
      outside the pool's own count, and kept in a LIFO list of our own. They are clean by construction (a reply is
      always read in full; any other failure disconnects the connection), so one ``poll``
      tells whether the server closed one; a forked child drops the list (see
      ``_after_fork``) instead of checking the pid per call.

    At most ``max_connections - 2`` of them exist at once (the pool's ``max_connections``;
    two are left to the pool for the release notifications and anything else): a caller
    that finds them all busy waits for one. Renewals never queue here (they have a
    connection of their own, see :class:`RedisBackend`).

    A command that fails after it was sent (a timeout, an interrupt) may still run. When the
    caller gives an ``undo`` (the release of an acquire attempt), it is written right behind
    the command on the SAME connection, so the server runs it after the command whenever the
    command arrives (a stalled server, delayed packets); the connection is then half-closed
    and set aside until the server has answered both (or a while has passed), never reused.

    Commands go out with the connection's public ``send_packed_command`` and come back
    through ``read_response``. Clients without a plain pool (a single-connection client,
    Redis Cluster) use ``execute_command`` instead.
    """

    __slots__ = ("__weakref__", "_client", "_draining", "_free", "_make", "_tokens")

    def __init__(self, client: Any) -> None:
        self._client = client
        pool = getattr(client, "connection_pool", None)
        self._make = _connection_factory(client, pool)
        self._free: list[Any] = []
        self._tokens = _tokens(pool)
        self._draining: list[tuple[Any, float]] = []
        _wires.add(self)

    def call(self, packed: bytes, args: tuple[object, ...], undo: _Undo | None = None) -> Any:
        """Send ``packed`` (``args`` is the same command unpacked, for the slow path) and read
        its reply; on a failure after sending, ``undo()`` (a command) follows it."""
        if self._make is None:
            try:
                return self._client.execute_command(*args)
            except BaseException:
                if undo is not None:
                    self._undo_apart(undo)
                raise
        return self._round_trip((packed,), 1, undo)[0]

    def call_then(
        self, packed: bytes, args: tuple[object, ...], then: tuple[bytes, ...], undo: _Undo | None = None
    ) -> tuple[Any, Any]:
        """:meth:`call`, then the command ``then`` on the same connection in the same write
        (``WAIT`` counts the replicas that have this connection's writes): both replies. An
        error reply to the first command is raised once the second reply is read."""
        if self._make is None:
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.execute_command(*args)
                pipe.execute_command(*then)
                replies = pipe.execute(raise_on_error=False)
            except BaseException:
                if undo is not None:
                    self._undo_apart(undo)
                raise
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies[0], replies[1]
        first, second = self._round_trip((packed, _packed(then)), 2, undo)
        if isinstance(first, ResponseError):
            raise first
        return first, second

    def _round_trip(self, frames: tuple[bytes, ...], count: int, undo: _Undo | None) -> list[Any]:
        """Send ``frames`` in one write on a kept connection and read ``count`` replies (an
        error reply to any but the last is returned, not raised)."""
        if self._draining:
            self._drain()
        connection = self._checkout()
        try:
            connection.send_packed_command(frames, check_health=False)
        except BaseException:
            # A partial command never runs, but an interrupt may have landed after the last
            # byte went out, or in the middle of connecting: drop the connection (it reconnects
            # on its next use).
            connection.disconnect()
            self._checkin(connection)
            if undo is not None:
                self._undo_apart(undo)
            raise
        replies: list[Any] = []
        try:
            while len(replies) < count - 1:
                try:
                    replies.append(connection.read_response(disconnect_on_error=False))
                except ResponseError as exc:
                    replies.append(exc)
            replies.append(connection.read_response(disconnect_on_error=False))
        except ResponseError:
            self._checkin(connection)  # the whole reply was read: the connection is clean
            raise
        except BaseException:
            self._fail(connection, undo)
            raise
        self._checkin(connection)
        return replies

    # -- connections ------------------------------------------------------------------

    def _checkout(self) -> Any:
        free = self._free
        tokens = self._tokens
        while True:
            try:
                connection = free.pop()
            except IndexError:
                pass
            else:
                sock = getattr(connection, "_sock", None)
                if sock is not None and _readable(sock):
                    # Nothing may be pending on an idle connection: this one was closed by the
                    # server (a restart, its idle timeout, CLIENT KILL). Reconnect before
                    # sending; a command is never sent twice, since one that failed may have run.
                    connection.disconnect()
                return connection
            if tokens is None:
                break
            # One token per connection that may exist; all in use: wait for a connection to
            # come back (checked for every 50 ms) or to be gone for good.
            try:
                tokens.get(timeout=0.05)
            except queue.Empty:
                continue
            break
        assert self._make is not None
        try:
            connection = self._make()
        except BaseException:
            if tokens is not None:
                tokens.put(None)
            raise
        if tokens is not None:
            _return_token_when_gone(connection, tokens)
        return connection

    def _checkin(self, connection: Any) -> None:
        self._free.append(connection)

    def _fail(self, connection: Any, undo: _Undo | None) -> None:
        """A command was sent but its reply not read (a timeout, an interrupt): the reply may
        still come, so the connection is never reused as it is."""
        if undo is not None and self._undo_behind(connection, undo):
            return
        # A disconnected connection reconnects on its next use.
        connection.disconnect()
        self._checkin(connection)

    def _undo_behind(self, connection: Any, undo: _Undo) -> bool:
        """Write ``undo()`` behind the command in flight on ``connection`` and half-close it;
        ``False`` if that was impossible (then the undo goes on another connection)."""
        sock = getattr(connection, "_sock", None)
        if sock is None:
            self._undo_apart(undo)
            return False
        try:
            sock.sendall(b"".join(_pack_any(command) for command in undo()))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            connection.disconnect()
            self._checkin(connection)
            self._undo_apart(undo)
            return True
        # Set aside (still counted: its token comes back once it is gone): closed once the
        # server has answered both commands (it closes its side after our FIN), or after
        # DRAIN_FOR.
        self._draining.append((connection, time.monotonic() + DRAIN_FOR))
        return True

    def _undo_apart(self, undo: _Undo) -> None:
        """Best effort: ``undo()`` on another connection (the failed one is gone)."""
        for command in undo():
            try:
                self.call(_pack_any(command), command)
            except (RedisError, OSError):
                pass

    def _drain(self) -> None:
        """Close the set-aside connections whose server side has finished (or timed out)."""
        now = time.monotonic()
        keep = []
        for connection, until in self._draining:
            sock = getattr(connection, "_sock", None)
            if sock is not None and now < until and not _drained(sock):
                keep.append((connection, until))
                continue
            connection.disconnect()
        self._draining = keep

    def close(self) -> None:
        free, self._free = self._free, []
        for connection in free:
            connection.disconnect()
        draining, self._draining = self._draining, []
        for connection, _ in draining:
            connection.disconnect()

    def _after_fork(self) -> None:
        # The parent's sockets: never write to them from the child. Dropping the objects
        # is safe, redis-py only shuts a socket down in the process that opened it.
        self._free = []
        self._draining = []
        self._tokens = _tokens(getattr(self._client, "connection_pool", None))


class _Line:
    """A connection of its own for one thread (the watchdog's renewals): a batch of commands
    written at once, their replies read in order. Never shared, never pooled: nothing else
    can hold it up or use it up."""

    __slots__ = ("_client", "_connection", "_make")

    def __init__(self, client: Any) -> None:
        self._client = client
        self._make = _connection_factory(client, getattr(client, "connection_pool", None))
        self._connection: Any = None

    def round_trip(self, commands: list[tuple[object, ...]]) -> list[Any]:
        """Send ``commands``, return one reply (or error reply, as an exception) per command."""
        if self._make is None:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute(raise_on_error=False))
        connection = self._connection
        if connection is None:
            connection = self._connection = self._make()
        try:
            connection.send_packed_command([b"".join(_pack_any(command) for command in commands)], check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response(disconnect_on_error=False))
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            connection.disconnect()  # reconnects on the next round trip
            raise
        return replies

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.disconnect()


#: How long a connection whose command failed after it was sent stays set aside, waiting for
#: the server to answer the command and the undo written behind it, before it is closed.
DRAIN_FOR = 30.0

#: Connections of the pool's ``max_connections`` that lock commands leave to other uses
#: (the release-notification subscriber, and anything else that goes through the pool; the
#: renewals' connection is made apart from both).
_POOL_RESERVE = 2


def _connection_factory(client: Any, pool: Any) -> Callable[[], Any] | None:
    """How a wire makes its connections: the pool's connection class with the pool's
    settings, outside the pool's own count (a wire bounds its connections itself), or
    ``None`` for a client without a plain pool (commands then use ``execute_command``)."""
    if getattr(client, "connection", None) is not None or pool is None:
        return None
    cls = getattr(pool, "connection_class", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if cls is None or not isinstance(kwargs, dict) or not callable(getattr(pool, "make_connection", None)):
        return None
    return lambda: cls(**kwargs)


#: The weak references that give connections' tokens back (kept alive here until they fire).
_token_refs: set[weakref.ref[Any]] = set()


def _return_token_when_gone(connection: Any, tokens: queue.SimpleQueue[Any]) -> None:
    """Put a token back into ``tokens`` once ``connection`` is gone, however it went (also one
    dropped by an exception raised asynchronously at the worst moment). The callback is
    ``SimpleQueue.put`` itself, a C call, which such an exception cannot interrupt (the
    weakref is the token it puts back; its value does not matter)."""
    if len(_token_refs) > 4096:
        _token_refs.difference_update([ref for ref in list(_token_refs) if ref() is None])
    _token_refs.add(weakref.ref(connection, tokens.put))


def _tokens(pool: Any) -> queue.SimpleQueue[Any] | None:
    """One token per connection lock commands may have open at once (the pool's
    ``max_connections`` less :data:`_POOL_RESERVE`); ``None``: no limit. A SimpleQueue: its
    ``put`` is safe from a finaliser, wherever the garbage collector runs it."""
    limit = getattr(pool, "max_connections", None)
    if not isinstance(limit, int) or limit >= 2**20:
        return None
    tokens: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for _ in range(max(1, limit - _POOL_RESERVE)):
        tokens.put(None)
    return tokens


#: Builds the commands that undo a command in flight (called only when one failed).
_Undo = Callable[[], list[tuple[object, ...]]]


def _pack_any(command: tuple[object, ...]) -> bytes:
    """``command`` (str, bytes and int arguments) in the wire format."""
    parts: list[bytes] = []
    for arg in command:
        if isinstance(arg, bytes):
            parts.append(arg)
        elif isinstance(arg, int):
            parts.append(b"%d" % arg)
        else:
            parts.append(str(arg).encode())
    return _packed(tuple(parts))


def _drained(sock: Any) -> bool:
    """Read what the server sent on a half-closed socket; ``True`` at its end (EOF or an
    error): the server has run everything written to it."""
    try:
        while _readable(sock):
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                return True
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True
    return False


def _readable(sock: Any) -> bool:
    """Whether a socket has something to read (data, EOF or an error): one poll(2), no wait.
    A socket closed under us (fd -1) counts as readable: it must be dropped."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except (ValueError, OSError):
        return True
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
    # Connection failures and timeouts may pass (a restart, a failover); an error reply will not.
    transient = isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)) or (
        isinstance(exc, ResponseError)
        and str(exc).startswith(("LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "READONLY"))
    )
    return BackendError(f"{action}{what} failed: {type(exc).__name__}: {exc}", key=key, transient=transient)


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


class _RenewChunk(NamedTuple):
    """One script call of a renewal: its script, keys and arguments, and the indexes (into
    the renewed items) of the items it answers for, in the order of its statuses."""

    script: LuaScript
    keys: list[str]
    args: list[object]
    indexes: list[int]


class _RedisLocks:
    """What the sync and async backends share: the namespace, the scripts (per instance:
    redis-py's Lock caches scripts on the class, bound to whichever client registered them
    first), the key layout, and how requests are encoded and replies decoded. No I/O."""

    capabilities = (
        Capability.RENEWABLE
        | Capability.BATCH_RENEW
        | Capability.RELEASE_NOTIFY
        | Capability.FENCING
        | Capability.MULTI_KEY
        | Capability.REPLICAS
    )
    kinds = frozenset({"lock", "fair", "semaphore", "read", "write"})

    @staticmethod
    def waiter_id(listens: bool) -> str:
        """A waiter id with a queue place of its own; ids of waiters that will not listen for
        wake-ups start with "p" (release.lua hands them a free lock without a message)."""
        return ("n" if listens else "p") + os.urandom(8).hex()

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
        replicas confirmed an acquisition (the core decides what too few means). The timeout
        must be shorter than the connections' socket timeout (``WAIT`` blocks the read)."""
        redis_client: Any = getattr(self, "redis", None)
        options = getattr(getattr(redis_client, "connection_pool", None), "connection_kwargs", {})
        socket_timeout = options.get("socket_timeout")
        if socket_timeout is not None and timeout >= socket_timeout:
            raise ConfigurationError(
                f"wait_replicas: the timeout ({timeout:g}s) must be shorter than the socket timeout "
                f"({socket_timeout:g}s), or the WAIT reply would time out the connection"
            )
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
            return AcquireResult(True, value)
        if status == 0:
            # -1: nothing will free up by itself (a foreign value without expiry, no permits)
            return AcquireResult(False, holder_ttl=None if value < 0 else value / 1000.0)
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
    def _multi_acquired(keys: Sequence[str], reply: list[int]) -> AcquireResult:
        if int(reply[0]) == 1:
            fences = tuple(int(fence) for fence in reply[1:])
            return AcquireResult(True, fences[0], fencing_tokens=fences)
        ttl = int(reply[2])
        return AcquireResult(False, holder_ttl=None if ttl < 0 else ttl / 1000.0, busy=keys[int(reply[1]) - 1])

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

    # -- undo: what gives back an acquire attempt that failed after it was sent (no I/O) --

    def _acquire_undo(self, lock: bytes, token: str, fair: bool) -> _Undo:
        # EVAL with the whole text: an undo cannot meet NOSCRIPT and retry.
        return lambda: [self._release.eval_command(*self._release_request(lock, token, fair))]

    def _multi_undo(self, keys: Sequence[str], token: str) -> _Undo:
        return lambda: [
            self._release.eval_command(*self._release_request(self._lock(key), token, False)) for key in keys
        ]

    def _sem_undo(self, key: str, token: str) -> _Undo:
        return lambda: [self._sem_release.eval_command(*self._sem_release_request(key, token))]

    def _rw_undo(self, key: str, token: str, mode: str) -> _Undo:
        return lambda: [self._rw_release.eval_command(*self._rw_release_request(key, token, mode))]

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
            return AcquireResult(True, reply)
        return AcquireResult(False, holder_ttl=(-reply - 1) / 1000.0 if reply < 0 else None)

    @staticmethod
    def _reentered(holds: int) -> bool:
        return bool(holds > 0)

    def _renew_chunks(self, leases: Sequence[RenewItem]) -> list[_RenewChunk]:
        """``leases`` as script calls of at most :data:`RENEW_CHUNK` items each: locks and
        writers with renew.lua, semaphore permits and readers (by the item's kind, see
        :data:`RenewItem`) with sem_renew.lua. Each chunk keeps the indexes into ``leases``
        of its items, in the order of the script's statuses."""
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
        chunks: list[_RenewChunk] = []
        for start in range(0, len(hashes), RENEW_CHUNK):
            indexes = hashes[start : start + RENEW_CHUNK]
            keys: list[str] = []
            args: list[object] = []
            for i in indexes:
                key, token, lease = items[i][:3]
                keys.append(f"{namespace}{{{key}}}" + (":rw:w" if kinds[i] == "write" else ""))
                args.append(token)
                args.append(_ms(lease))
            chunks.append(_RenewChunk(self._renew, keys, args, indexes))
        for start in range(0, len(members), RENEW_CHUNK):
            indexes = members[start : start + RENEW_CHUNK]
            keys = []
            args = []
            for i in indexes:
                key, token, lease = items[i][:3]
                base = f"{namespace}{{{key}}}" + (":sem" if kinds[i] == "semaphore" else ":rw")
                keys.append(base if kinds[i] == "semaphore" else base + ":r")
                keys.append(base + ":fences")
                args.append(token)
                args.append(_ms(lease))
            chunks.append(_RenewChunk(self._sem_renew, keys, args, indexes))
        return chunks

    @staticmethod
    def _renew_round(
        chunks: list[_RenewChunk], pending: list[int], attempt: int
    ) -> list[tuple[int | None, tuple[object, ...]]]:
        """The commands of one round trip of a renewal, each with the index of the chunk it
        answers for (``None``: a SCRIPT LOAD). Round 0 sends every chunk with EVALSHA;
        the chunks that met NOSCRIPT go again, in round 1 after a SCRIPT LOAD of their
        scripts, in round 2 with EVAL (the full text: it cannot meet NOSCRIPT)."""
        commands: list[tuple[int | None, tuple[object, ...]]] = []
        if attempt == 1:
            loaded: list[LuaScript] = []
            for index in pending:
                script = chunks[index].script
                if script not in loaded:
                    loaded.append(script)
                    commands.append((None, ("SCRIPT", "LOAD", script.source)))
        for index in pending:
            chunk = chunks[index]
            make = chunk.script.eval_command if attempt == 2 else chunk.script.command
            commands.append((index, make(chunk.keys, chunk.args)))
        return commands

    @staticmethod
    def _renew_replies(
        commands: list[tuple[int | None, tuple[object, ...]]], results: list[Any], replies: list[Any]
    ) -> list[int]:
        """Record the replies of one round trip in ``replies`` (by chunk); the chunks that met
        NOSCRIPT, to send again."""
        again: list[int] = []
        for (index, _), result in zip(commands, results, strict=True):
            if index is None:
                continue
            replies[index] = result
            if isinstance(result, NoScriptError):
                again.append(index)
        return again

    @staticmethod
    def _renewed(chunks: list[_RenewChunk], replies: list[Any], count: int) -> list[bool | None]:
        """One status per item from the chunks' replies: ``True`` renewed, ``False`` not ours
        any more, ``None`` when its chunk's call failed (an error reply: that chunk only)."""
        renewed: list[bool | None] = [None] * count
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, Exception):
                log.warning("renewal of %d lease(s) failed, to be retried: %s", len(chunk.indexes), reply)
                continue
            for index, status in zip(chunk.indexes, reply, strict=True):
                renewed[index] = bool(status)
        return renewed

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
        self._renew_line = _Line(client)
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

    def lock_acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
    ) -> AcquireResult:
        lock = self._lock(key)
        keys, args = self._acquire_request(lock, token, lease, waiter, front, fair)
        undo = self._acquire_undo(lock, token, fair)
        try:
            if self._wait_command is not None:
                reply, acked = self._acquire.run_then(self._wire, self.redis, keys, args, self._wait_command, undo)
                return self._replicated(self._acquired(reply), acked)
            reply = self._acquire.run(self._wire, self.redis, keys, args, undo)
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc
        return self._acquired(reply)

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
        keys, args = self._unqueue_request(self._lock(key), waiter, kind)
        try:
            self._unqueue.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "unqueue") from exc

    def multi_acquire(self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None) -> AcquireResult:
        """Take every lock of ``keys`` for ``token``, all at once or none (multi_acquire.lua)."""
        packed, args = self._multi_request(keys, token, lease, waiter)
        undo = self._multi_undo(keys, token)
        try:
            if self._wait_command is not None:
                reply, acked = self._multi_acquire.run_then(
                    self._wire, self.redis, packed, args, self._wait_command, undo
                )
                result = self._multi_acquired(keys, reply)
                return result._replace(replicas=int(acked)) if result.acquired else result
            return self._multi_acquired(keys, self._multi_acquire.run(self._wire, self.redis, packed, args, undo))
        except RedisError as exc:
            raise map_redis_error(exc, keys[0], "acquire") from exc

    def sem_acquire(
        self, key: str, token: str, lease: float, permits: int, waiter: str | None = None, front: bool = False
    ) -> AcquireResult:
        """Take one of ``permits`` permits of semaphore ``key`` for ``lease`` seconds."""
        keys, args = self._sem_acquire_request(key, token, lease, permits, waiter, front)
        undo = self._sem_undo(key, token)
        try:
            if self._wait_command is not None:
                reply, acked = self._sem_acquire.run_then(self._wire, self.redis, keys, args, self._wait_command, undo)
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(self._sem_acquire.run(self._wire, self.redis, keys, args, undo))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    def sem_release(self, key: str, token: str) -> ReleaseResult:
        keys, args = self._sem_release_request(key, token)
        try:
            code = self._sem_release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def sem_reenter(self, key: str, token: str) -> bool:
        try:
            held = self._sem_reenter.run(self._wire, self.redis, (self._lock(key) + b":sem",), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return bool(held)

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to
        ``set_to`` if given (``None`` permits: never set)."""
        keys, args = self._sem_set_request(key, set_to)
        try:
            return self._sem_state(self._sem_set.run(self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "set_permits" if set_to is not None else "permits") from exc

    def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = ""
    ) -> AcquireResult:
        keys, args = self._rw_acquire_request(key, token, lease, mode, waiter, below)
        undo = self._rw_undo(key, token, mode)
        try:
            if self._wait_command is not None:
                reply, acked = self._rw_acquire.run_then(self._wire, self.redis, keys, args, self._wait_command, undo)
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(self._rw_acquire.run(self._wire, self.redis, keys, args, undo))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            code = self._rw_release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def rw_held(self, key: str, token: str, mode: str) -> bool:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            held = self._rw_held.run(self._wire, self.redis, keys[:2], args[:2])
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return bool(held)

    def lock_reenter(self, key: str, token: str) -> bool:
        try:
            holds = self._reenter.run(self._wire, self.redis, (self._lock(key),), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return self._reentered(holds)

    def lock_release(self, key: str, token: str, fair: bool = False) -> ReleaseResult:
        keys, args = self._release_request(self._lock(key), token, fair)
        try:
            code = self._release.run(self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        """Renew ``leases`` in one round trip, on a connection of the renewals' own (so no
        lock traffic, and no exhausted pool, ever delays a renewal). Called from one thread
        at a time (the client's watchdog)."""
        if not leases:
            return []
        chunks = self._renew_chunks(leases)
        replies: list[Any] = [None] * len(chunks)
        pending = list(range(len(chunks)))
        try:
            for attempt in range(3):
                commands = self._renew_round(chunks, pending, attempt)
                results = self._renew_line.round_trip([command for _, command in commands])
                pending = self._renew_replies(commands, results, replies)
                if not pending:
                    break
        except RedisError as exc:
            raise self._renew_error(exc, leases) from exc
        return self._renewed(chunks, replies, len(leases))

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
        self._renew_line.close()
        self.redis.close()
        self.redis.connection_pool.disconnect()

    def reset_after_fork(self) -> None:
        # redis-py's pool notices the new pid by itself; the subscriber thread did not
        # survive the fork, so forget it and start a fresh one on demand.
        self._notifier = None
        self._notifier_lock = threading.Lock()
        self._renew_line = _Line(self.redis)


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds, rounded UP (less a float's noise: 0.3 s is 300 ms): the
    store's lease must never end before the client's local estimate of it."""
    return max(1, math.ceil(seconds * 1000 - 1e-6))


_FAIR_GONE_MS = b"%d" % _ms(FAIR_GONE_AFTER)
_FAIR_GRACE_MS = b"%d" % _ms(FAIR_SUBSCRIBE_GRACE)


_RELEASE_CODES = {code.value: code for code in ReleaseResult}

# The operation tables: which script-level call serves each kind (the same names on both
# twins; on the async twin each returns a coroutine).
_ACQUIRE: dict[str, Callable[[Any, AcquireRequest], Any]] = {
    "lock": lambda s, r: (
        s.lock_acquire(r.keys[0], r.token, r.lease, r.waiter, r.front)
        if len(r.keys) == 1
        else s.multi_acquire(r.keys, r.token, r.lease, r.waiter)
    ),
    "fair": lambda s, r: s.lock_acquire(r.keys[0], r.token, r.lease, r.waiter, False, True),
    "semaphore": lambda s, r: s.sem_acquire(r.keys[0], r.token, r.lease, r.permits, r.waiter, r.front),
    "read": lambda s, r: s.rw_acquire(r.keys[0], r.token, r.lease, "read", r.waiter, r.below),
    "write": lambda s, r: s.rw_acquire(r.keys[0], r.token, r.lease, "write", r.waiter, r.below),
}
_RELEASE: dict[str, Callable[[Any, str, str], Any]] = {
    "lock": lambda s, key, token: s.lock_release(key, token),
    "fair": lambda s, key, token: s.lock_release(key, token, True),
    "semaphore": lambda s, key, token: s.sem_release(key, token),
    "read": lambda s, key, token: s.rw_release(key, token, "read"),
    "write": lambda s, key, token: s.rw_release(key, token, "write"),
}
_REENTER: dict[str, Callable[[Any, str, str], Any]] = {
    "lock": lambda s, key, token: s.lock_reenter(key, token),
    "fair": lambda s, key, token: s.lock_reenter(key, token),
    "semaphore": lambda s, key, token: s.sem_reenter(key, token),
    "read": lambda s, key, token: s.rw_held(key, token, "read"),
    "write": lambda s, key, token: s.rw_held(key, token, "write"),
}


# -- release notifications ----------------------------------------------------------------

#: After the server refuses pub/sub (an ACL without ``+@pubsub``, a proxy without it), stop
#: asking for this many seconds: waiters poll at once instead of timing out on SUBSCRIBE.
UNAVAILABLE_FOR = 60.0


class _Subscription:
    """A sync waiter's registration for release messages of one lock. (A :class:`Wakeup`,
    not a ``threading.Event``: a waiter interrupted by a signal handler's exception must not
    leave a lock behind that the reader thread then blocks on.)"""

    __slots__ = ("_event", "active", "channel")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self._event = Wakeup()
        self.active = False

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

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
        # Entered as ``with self._mutex`` (a C-level enter: an exception raised asynchronously
        # cannot leave it held); ``self._lock`` waits and notifies on it.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._table = ChannelTable()
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unavailable_until = 0.0

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        sub = _Subscription(self._channel_for(key, waiter or self.waiter_id).encode())
        now = time.monotonic()
        deadline = now + timeout
        with self._mutex:
            if self._closed or now < self._unavailable_until:
                return sub
            try:
                if self._table.join(sub, now):
                    try:
                        self._send("SUBSCRIBE", sub.channel)
                    except RedisError as exc:
                        log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                        # Nothing will answer that SUBSCRIBE: forget the subscriber connection's
                        # channels, as when the reader loses it, or this one waits for it forever.
                        self._forget_connection(sub)
                        return sub
                    except BaseException:
                        # Interrupted: whether SUBSCRIBE went out is unknown, so no reply can be
                        # counted on; start over on a fresh connection.
                        self._forget_connection(sub)
                        raise
                # Stop waiting when the reader gave up (it resets the table and clears _pubsub).
                while not self._table.subscribed(sub.channel) and not self._closed and self._pubsub is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._lock.wait(remaining):
                        break
            except BaseException:
                self._table.leave(sub, time.monotonic())  # the caller never gets it to leave
                raise
            sub.active = self._table.subscribed(sub.channel)
        return sub

    # Called with self._mutex held.
    def _forget_connection(self, sub: _Subscription) -> None:
        for other in self._table.reset():
            if other is not sub:
                other.wake()
        self._thread = None  # the reader of the old connection stops (see _read)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except (RedisError, OSError):  # pragma: no cover - closing a broken connection
                pass

    def listening(self, key: str) -> bool:
        """Whether this notifier already listens for wake-ups of ``key`` (so a first attempt
        may queue at once: a wake-up that comes before its waiter registers is kept)."""
        with self._mutex:
            return self._table.subscribed(self._channel_for(key, self.waiter_id).encode())

    def unsubscribe(self, subscription: Any) -> None:
        with self._mutex:
            self._table.leave(subscription, time.monotonic())

    def close(self) -> None:
        with self._mutex:
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

    # Called with self._mutex held.
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
        me = threading.current_thread()
        while True:
            with self._mutex:
                if self._closed or self._thread is not me:
                    return  # closed, or the connection was replaced (see _forget_connection)
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
        with self._mutex:
            if kind == b"message":
                for waiter in self._table.message(name, time.monotonic()):
                    waiter.wake()
            elif kind in (b"subscribe", b"unsubscribe") and self._table.reply(kind, name):
                self._lock.notify_all()

    def _connection_lost(self, pubsub: Any, exc: BaseException) -> None:
        with self._mutex:
            if self._closed:
                return
            if self._pubsub is not pubsub:
                pass  # an older connection, already replaced: nothing to reset
            elif isinstance(exc, ResponseError):
                # NOPERM (an ACL without pub/sub) or an unknown command behind a proxy.
                self._unavailable_until = time.monotonic() + UNAVAILABLE_FOR
                log.warning("the server refuses pub/sub, waiters poll instead for %gs: %s", UNAVAILABLE_FOR, exc)
            else:
                log.warning("release notifications interrupted, waiters fall back to polling: %s", exc)
            if self._pubsub is pubsub:
                for waiter in self._table.reset():
                    waiter.wake()
                self._pubsub = None
                if self._thread is threading.current_thread():
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
    stream as soon as it arrives), never sent twice, at most ``max_connections - 2`` at once,
    and a failed or cancelled command's ``undo`` written behind it on the same connection.

    A fresh connection connects in a task of its own, shielded from the caller: before
    Python 3.12, ``asyncio.wait_for`` (which redis-py wraps around the handshake's writes)
    can swallow a cancellation that lands as a write completes, and the caller would then go
    on, and into its critical section, as if it had not been cancelled."""

    __slots__ = ("_client", "_free", "_make", "_tasks", "_tokens", "_waiters")

    def __init__(self, client: Any) -> None:
        self._client = client
        pool = getattr(client, "connection_pool", None)
        self._make = _connection_factory(client, pool)
        self._free: list[Any] = []
        self._tokens = _tokens(pool)
        self._waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    async def call(self, packed: bytes, args: tuple[object, ...], undo: _Undo | None = None) -> Any:
        if self._make is None:
            try:
                return await self._client.execute_command(*args)
            except BaseException:
                if undo is not None:
                    self._spawn(self._undo_apart(undo))
                raise
        connection = await self._checkout()
        return (await self._round_trip(connection, (packed,), 1, undo))[0]

    async def call_then(
        self, packed: bytes, args: tuple[object, ...], then: tuple[bytes, ...], undo: _Undo | None = None
    ) -> tuple[Any, Any]:
        """:meth:`_Wire.call_then` for one event loop."""
        if self._make is None:
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.execute_command(*args)
                pipe.execute_command(*then)
                replies = await pipe.execute(raise_on_error=False)
            except BaseException:
                if undo is not None:
                    self._spawn(self._undo_apart(undo))
                raise
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies[0], replies[1]
        connection = await self._checkout()
        first, second = await self._round_trip(connection, (packed, _packed(then)), 2, undo)
        if isinstance(first, ResponseError):
            raise first
        return first, second

    async def _round_trip(self, connection: Any, frames: tuple[bytes, ...], count: int, undo: _Undo | None) -> Any:
        """Write ``frames`` (no await: nothing can interrupt it) and read ``count`` replies (an
        error reply to any but the last is returned, not raised)."""
        try:
            writer = connection._writer
            for frame in frames:
                writer.write(frame)
        except BaseException:
            _abandon(connection)
            self._checkin(connection)
            if undo is not None:
                self._spawn(self._undo_apart(undo))
            raise
        replies: list[Any] = []
        try:
            # redis.asyncio wraps every write in asyncio.wait_for (a task and a timer per
            # command) when a socket timeout is set. A write only appends to the transport's
            # buffer; drain, under the timeout, only when the buffer is past its high-water
            # mark. The read keeps redis-py's own timeout.
            if writer.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await asyncio.wait_for(writer.drain(), connection.socket_timeout)
            while len(replies) < count - 1:
                try:
                    replies.append(await connection.read_response(disconnect_on_error=False))
                except ResponseError as exc:
                    replies.append(exc)
            replies.append(await connection.read_response(disconnect_on_error=False))
        except ResponseError:
            self._checkin(connection)  # the whole reply was read: the connection is clean
            raise
        except BaseException:
            # A timeout, a cancellation: the command went out and may run.
            if undo is None or not self._undo_behind(connection, undo):
                _abandon(connection)  # half a reply may be on the socket: reconnects on next use
                self._checkin(connection)
            raise
        self._checkin(connection)
        return replies

    async def _checkout(self) -> Any:
        free = self._free
        tokens = self._tokens
        while True:
            if free:
                connection = free.pop()
                reader = getattr(connection, "_reader", None)
                if reader is not None and (reader.at_eof() or reader.exception() is not None):
                    _abandon(connection)  # the server closed it: reconnect
                break
            if tokens is None or _take_token(tokens):
                assert self._make is not None
                try:
                    connection = self._make()
                except BaseException:
                    if tokens is not None:
                        tokens.put(None)
                    raise
                if tokens is not None:
                    _return_token_when_gone(connection, tokens)
                break
            # All busy: wait for one to come back (or, every 50 ms, for a token).
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            timer = loop.call_later(0.05, _resolve_none, waiter)
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.cancelled() and free:
                    self._wake_one()  # pass on a wake-up we will not use
        if connection.is_connected:
            return connection
        task = self._spawn(connection.connect())
        try:
            await asyncio.shield(task)
        except BaseException:
            # Cancelled (the connect goes on, the connection comes back when it is done) or
            # failed (the connection reconnects on its next use).
            if task.done():
                self._checkin(connection)
            else:
                task.add_done_callback(lambda _: self._checkin(connection))
            raise
        return connection

    def _checkin(self, connection: Any) -> None:
        self._free.append(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                return

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _undo_behind(self, connection: Any, undo: _Undo) -> bool:
        """Write ``undo()`` behind the command in flight and half-close the connection, then
        drain it in the background (see :meth:`_Wire._undo_behind`)."""
        writer = getattr(connection, "_writer", None)
        if writer is None or writer.is_closing():
            self._spawn(self._undo_apart(undo))
            return False
        try:
            writer.write(b"".join(_pack_any(command) for command in undo()))
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            self._spawn(self._undo_apart(undo))
            return False
        # Out of the free list for good, still counted until it is drained and closed.
        reader = connection._reader
        parser = getattr(connection, "_parser", None)
        if parser is not None:
            with contextlib.suppress(Exception):
                parser.on_disconnect()
        connection._reader = connection._writer = None
        self._spawn(self._drain(reader, writer))
        return True

    async def _drain(self, reader: Any, writer: Any) -> None:
        async def until_eof() -> None:
            while await reader.read(65536):
                pass

        try:
            await asyncio.wait_for(until_eof(), DRAIN_FOR)
        except BaseException:  # noqa: BLE001 - the server went away, or we gave up
            pass
        finally:
            writer.close()

    async def _undo_apart(self, undo: _Undo) -> None:
        """Best effort: ``undo()`` on another connection."""
        for command in undo():
            with contextlib.suppress(RedisError, OSError):
                await self.call(_pack_any(command), command)

    async def close(self) -> None:
        free, self._free = self._free, []
        for connection in free:
            await connection.disconnect(nowait=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))


def _take_token(tokens: queue.SimpleQueue[Any]) -> bool:
    try:
        tokens.get_nowait()
    except queue.Empty:
        return False
    return True


def _resolve_none(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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
    script: LuaScript,
    wire: _AsyncWire,
    client: Any,
    keys: tuple[bytes, ...],
    args: tuple[bytes, ...],
    undo: _Undo | None = None,
) -> Any:
    """:meth:`LuaScript.run` for one event loop."""
    try:
        return await wire.call(script.packed(keys, args), script.command(keys, args), undo)
    except NoScriptError:
        return await wire.call(script.packed_eval(keys, args), script.eval_command(keys, args), undo)


async def _run_async_then(
    script: LuaScript,
    wire: _AsyncWire,
    client: Any,
    keys: tuple[bytes, ...],
    args: tuple[bytes, ...],
    then: tuple[bytes, ...],
    undo: _Undo | None = None,
) -> tuple[Any, Any]:
    """:meth:`LuaScript.run_then` for one event loop."""
    try:
        return await wire.call_then(script.packed(keys, args), script.command(keys, args), then, undo)
    except NoScriptError:
        return await wire.call_then(script.packed_eval(keys, args), script.eval_command(keys, args), then, undo)


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

    async def lock_acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
    ) -> AcquireResult:
        lock = self._lock(key)
        keys, args = self._acquire_request(lock, token, lease, waiter, front, fair)
        undo = self._acquire_undo(lock, token, fair)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._acquire, self._wire, self.redis, keys, args, self._wait_command, undo
                )
                return self._replicated(self._acquired(reply), acked)
            reply = await _run_async(self._acquire, self._wire, self.redis, keys, args, undo)
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc
        return self._acquired(reply)

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        result: AcquireResult = await _ACQUIRE[request.kind](self, request)
        return result

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        result: ReleaseResult = await _RELEASE[kind](self, key, token)
        return result

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        held: bool = await _REENTER[kind](self, key, token)
        return held

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        keys, args = self._unqueue_request(self._lock(key), waiter, kind)
        try:
            await _run_async(self._unqueue, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "unqueue") from exc

    async def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None
    ) -> AcquireResult:
        packed, args = self._multi_request(keys, token, lease, waiter)
        undo = self._multi_undo(keys, token)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._multi_acquire, self._wire, self.redis, packed, args, self._wait_command, undo
                )
                result = self._multi_acquired(keys, reply)
                return result._replace(replicas=int(acked)) if result.acquired else result
            return self._multi_acquired(
                keys, await _run_async(self._multi_acquire, self._wire, self.redis, packed, args, undo)
            )
        except RedisError as exc:
            raise map_redis_error(exc, keys[0], "acquire") from exc

    async def sem_acquire(
        self, key: str, token: str, lease: float, permits: int, waiter: str | None = None, front: bool = False
    ) -> AcquireResult:
        keys, args = self._sem_acquire_request(key, token, lease, permits, waiter, front)
        undo = self._sem_undo(key, token)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._sem_acquire, self._wire, self.redis, keys, args, self._wait_command, undo
                )
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(await _run_async(self._sem_acquire, self._wire, self.redis, keys, args, undo))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    async def sem_release(self, key: str, token: str) -> ReleaseResult:
        keys, args = self._sem_release_request(key, token)
        try:
            code = await _run_async(self._sem_release, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    async def sem_reenter(self, key: str, token: str) -> bool:
        keys = (self._lock(key) + b":sem",)
        try:
            held = await _run_async(self._sem_reenter, self._wire, self.redis, keys, (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return bool(held)

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        keys, args = self._sem_set_request(key, set_to)
        try:
            return self._sem_state(await _run_async(self._sem_set, self._wire, self.redis, keys, args))
        except RedisError as exc:
            raise map_redis_error(exc, key, "set_permits" if set_to is not None else "permits") from exc

    async def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = ""
    ) -> AcquireResult:
        keys, args = self._rw_acquire_request(key, token, lease, mode, waiter, below)
        undo = self._rw_undo(key, token, mode)
        try:
            if self._wait_command is not None:
                reply, acked = await _run_async_then(
                    self._rw_acquire, self._wire, self.redis, keys, args, self._wait_command, undo
                )
                return self._replicated(self._sem_acquired(reply), acked)
            return self._sem_acquired(await _run_async(self._rw_acquire, self._wire, self.redis, keys, args, undo))
        except RedisError as exc:
            raise map_redis_error(exc, key, "acquire") from exc

    async def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            code = await _run_async(self._rw_release, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    async def rw_held(self, key: str, token: str, mode: str) -> bool:
        keys, args = self._rw_release_request(key, token, mode)
        try:
            held = await _run_async(self._rw_held, self._wire, self.redis, keys[:2], args[:2])
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return bool(held)

    async def lock_reenter(self, key: str, token: str) -> bool:
        try:
            holds = await _run_async(self._reenter, self._wire, self.redis, (self._lock(key),), (token.encode(),))
        except RedisError as exc:
            raise map_redis_error(exc, key, "re-enter") from exc
        return self._reentered(holds)

    async def lock_release(self, key: str, token: str, fair: bool = False) -> ReleaseResult:
        keys, args = self._release_request(self._lock(key), token, fair)
        try:
            code = await _run_async(self._release, self._wire, self.redis, keys, args)
        except RedisError as exc:
            raise map_redis_error(exc, key, "release") from exc
        return _RELEASE_CODES[code]

    async def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        if not leases:
            return []
        chunks = self._renew_chunks(leases)
        replies: list[Any] = [None] * len(chunks)
        pending = list(range(len(chunks)))
        try:
            for attempt in range(3):
                commands = self._renew_round(chunks, pending, attempt)
                pipe = self.redis.pipeline(transaction=False)
                for _, command in commands:
                    pipe.execute_command(*command)
                pending = self._renew_replies(commands, await pipe.execute(raise_on_error=False), replies)
                if not pending:
                    break
        except RedisError as exc:
            raise self._renew_error(exc, leases) from exc
        return self._renewed(chunks, replies, len(leases))

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
        self._tasks: set[asyncio.Task[Any]] = set()

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        sub = _AsyncSubscription(self._channel_for(key, waiter or self.waiter_id).encode())
        now = time.monotonic()
        if self._closed or now < self._unavailable_until:
            return sub
        # Registering and sending SUBSCRIBE run in a task of their own: a waiter cancelled
        # meanwhile stops waiting, but what was sent and what the table expects stay in step
        # (else the channel would stay "subscribing" for every later waiter on the key).
        joined = asyncio.get_running_loop().create_task(self._join(sub, now))
        self._tasks.add(joined)
        joined.add_done_callback(self._tasks.discard)
        try:
            await asyncio.shield(joined)
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
        except BaseException:
            # The caller never gets the subscription to leave with: leave for it, once joined.
            if joined.done():
                self._table.leave(sub, time.monotonic())
            else:
                joined.add_done_callback(lambda _: self._table.leave(sub, time.monotonic()))
            raise
        sub.active = self._table.subscribed(sub.channel)
        return sub

    async def _join(self, sub: _AsyncSubscription, now: float) -> None:
        async with self._send_lock:
            if not self._table.join(sub, now):
                return
            try:
                await self._send("SUBSCRIBE", sub.channel)
            except RedisError as exc:
                log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                # Nothing will answer that SUBSCRIBE: forget the subscriber connection's
                # channels, as when the reader loses it, or this one waits for it forever.
                await self._forget_connection(sub)
            except BaseException:
                # Cancelled (the loop shutting down): whether SUBSCRIBE went out is unknown.
                await self._forget_connection(sub)
                raise

    async def _forget_connection(self, sub: _AsyncSubscription) -> None:
        for other in self._table.reset():
            if other is not sub:
                other.wake()
        self._reader = None  # the reader of the old connection stops (see _read)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    def listening(self, key: str) -> bool:
        """See :meth:`RedisNotifier.listening`."""
        return self._table.subscribed(self._channel_for(key, self.waiter_id).encode())

    def unsubscribe(self, subscription: Any) -> None:
        self._table.leave(subscription, time.monotonic())

    async def aclose(self) -> None:
        self._closed = True
        for waiter in self._table.reset():
            waiter.wake()
        for task in list(self._tasks):
            task.cancel()
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
        me = asyncio.current_task()
        while not self._closed:
            pubsub = self._pubsub
            if pubsub is None or self._reader is not me:
                return  # the connection was replaced (see _forget_connection)
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
        if self._pubsub is pubsub:
            if isinstance(exc, ResponseError):
                self._unavailable_until = time.monotonic() + UNAVAILABLE_FOR
                log.warning("the server refuses pub/sub, waiters poll instead for %gs: %s", UNAVAILABLE_FOR, exc)
            else:
                log.warning("release notifications interrupted, waiters fall back to polling: %s", exc)
            for waiter in self._table.reset():
                waiter.wake()
            self._pubsub = None
            if self._reader is asyncio.current_task():
                self._reader = None
            async with self._changed:
                self._changed.notify_all()
        with contextlib.suppress(Exception):
            await pubsub.aclose()
