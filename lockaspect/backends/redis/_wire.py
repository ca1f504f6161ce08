"""The sync fast path of lock commands: :class:`_Wire` (pre-packed commands on connections
of its own, token-bounded, the undo of a failed attempt written behind it on the same
connection) and :class:`_Line` (the renewals' own connection)."""

from __future__ import annotations

import os
import queue
import select
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError

from ._replies import read, send
from ._script import _pack_any, _packed

__all__ = ["ASKING", "DRAIN_FOR", "_Line", "_Undo", "_Wire"]


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

    Commands go out in one ``sendall`` and their replies are read with the connection's
    own hiredis reader when it has one (:mod:`._replies`), else with redis-py's
    ``send_packed_command`` and ``read_response``. Clients without a plain pool (a single-connection client,
    Redis Cluster) use ``execute_command`` instead.
    """

    __slots__ = ("__weakref__", "_address", "_before", "_client", "_draining", "_free", "_make", "_tokens")

    def __init__(self, client: Any) -> None:
        self._client = client
        pool = getattr(client, "connection_pool", None)
        self._make = _connection_factory(client, pool)
        self._free: list[Any] = []
        #: The server every connection must be on (Sentinel's current master), or ``None``.
        self._address: tuple[str, int] | None = None
        #: Called before each command (Sentinel: ask who the master is, now and then).
        self._before: Callable[[], None] | None = None
        self._tokens = _tokens(pool)
        self._draining: list[tuple[Any, float]] = []
        _wires.add(self)

    def call(self, packed: bytes, args: tuple[object, ...], undo: _Undo | None = None, asking: bool = False) -> Any:
        """Send ``packed`` (``args`` is the same command unpacked, for the slow path) and read
        its reply; on a failure after sending, ``undo()`` (a command) follows it. ``asking``:
        ``ASKING`` goes first, in the same write (Redis Cluster, a slot being imported here)."""
        if asking:
            return self._round_trip((ASKING, packed), 2, asking_undo(undo))[1]
        if self._make is None:
            try:
                return self._client.execute_command(*args)
            except BaseException:
                if undo is not None:
                    self._undo_apart(undo)
                raise
        return self._round_trip((packed,), 1, undo)[0]

    def call_then(
        self,
        packed: bytes,
        args: tuple[object, ...],
        then: tuple[bytes, ...],
        undo: _Undo | None = None,
        asking: bool = False,
    ) -> tuple[Any, Any]:
        """:meth:`call`, then the command ``then`` on the same connection in the same write
        (``WAIT`` counts the replicas that have this connection's writes): both replies. An
        error reply to the first command is raised once the second reply is read; one to the
        second (``WAIT`` refused: an ACL, a proxy) is raised after ``undo()``, since the first
        may have taken a lock."""
        if asking:
            replies = self._round_trip((ASKING, packed, _packed(then)), 3, asking_undo(undo), raise_last=False)
            return self._then_replies(replies[1], replies[2], undo)
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
            return self._then_replies(replies[0], replies[1], undo)
        first, second = self._round_trip((packed, _packed(then)), 2, undo, raise_last=False)
        return self._then_replies(first, second, undo)

    def _then_replies(self, first: Any, second: Any, undo: _Undo | None) -> tuple[Any, Any]:
        """The replies of :meth:`call_then`: the first's error raised as it is (nothing ran,
        or NOSCRIPT: the caller falls back); the second's after ``undo()``."""
        if isinstance(first, Exception):
            raise first
        if isinstance(second, Exception):
            if undo is not None:
                self._undo_apart(undo)
            raise second
        return first, second

    def _round_trip(
        self, frames: tuple[bytes, ...], count: int, undo: _Undo | None, raise_last: bool = True
    ) -> list[Any]:
        """Send ``frames`` in one write on a kept connection and read ``count`` replies (an
        error reply to any but the last is returned, not raised; to the last too unless
        ``raise_last``). A Sentinel master that was turned into a replica refused them
        (``READONLY``, which redis-py reports as a connection error after dropping the
        connection): nothing ran, so they go once more, on a connection to the master the
        sentinels name now."""
        try:
            return self._round_trip_once(frames, count, undo, raise_last)
        except redis.ConnectionError as exc:
            if not demoted(exc):
                raise
        return self._round_trip_once(frames, count, undo, raise_last)

    def _round_trip_once(
        self, frames: tuple[bytes, ...], count: int, undo: _Undo | None, raise_last: bool = True
    ) -> list[Any]:
        if self._before is not None:
            self._before()
        if self._draining:
            self._drain()
        connection = self._checkout()
        if getattr(connection, "_sock", True) is None:
            # connect() first, as redis-py's pool does: send_packed_command would connect to
            # the connection's host and port, but a Sentinel connection asks the sentinels
            # for them in its connect(). Nothing was sent if it fails.
            try:
                connection.connect()
            except BaseException:
                connection.disconnect()
                self._checkin(connection)
                raise
        try:
            send(connection, frames)
        except BaseException:
            # A partial command never runs, but an interrupt may have landed after the last
            # byte went out, or in the middle of connecting: drop the connection (it reconnects
            # on its next use).
            connection.disconnect()
            self._checkin(connection)
            if undo is not None:
                self._undo_apart(undo)
            raise
        try:
            replies = read(connection, count, raise_last)
        except ResponseError:
            self._checkin(connection)  # the whole reply was read: the connection is clean
            raise
        except BaseException as exc:
            if demoted(exc):
                # READONLY from a Sentinel master turned replica: refused, nothing ran, nothing
                # to undo (redis-py dropped the connection: it reconnects on its next use).
                self._checkin(connection)
                raise
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
                if sock is not None and self._address is not None and self._address != _peer(connection):
                    connection.disconnect()  # on a former master: reconnect to the current one
                elif sock is not None and _readable(sock):
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
        """Best effort: ``undo()`` on another connection (the failed one is gone), its commands
        in one write (an ``ASKING`` among them applies to the next)."""
        commands = undo()
        try:
            if self._make is None:
                for command in commands:
                    self._client.execute_command(*command)
            else:
                self._round_trip_once(tuple(_pack_any(command) for command in commands), len(commands), None)
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

    def follow(self, address: tuple[str, int] | None) -> None:
        """From now on use only connections to ``address`` (the master changed): the idle
        ones are closed now, the busy ones before their next command."""
        self._address = address
        self.close_idle()

    def close_idle(self) -> None:
        """Close the idle connections (their node left the cluster, or serves other slots now);
        a connection set aside behind an undo stays until the server has answered it."""
        free, self._free = self._free, []
        for connection in free:
            connection.disconnect()

    def close(self) -> None:
        self.close_idle()
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

    __slots__ = ("_address", "_client", "_connection", "_make")

    def __init__(self, client: Any) -> None:
        self._client = client
        self._make = _connection_factory(client, getattr(client, "connection_pool", None))
        self._connection: Any = None
        self._address: tuple[str, int] | None = None

    def round_trip(self, commands: list[tuple[object, ...]]) -> list[Any]:
        """Send ``commands``, return one reply (or error reply, as an exception) per command."""
        if self._make is None:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute(raise_on_error=False))
        self.send(commands)
        return self.receive(len(commands))

    def send(self, commands: list[tuple[object, ...]]) -> None:
        """Write ``commands`` at once (their replies are read by :meth:`receive`)."""
        connection = self._connection
        if connection is None:
            connection = self._connection = self._make()  # type: ignore[misc]
        try:
            if self._address is not None and connection._sock is not None and _peer(connection) != self._address:
                connection.disconnect()  # on a former master: reconnect to the current one
            if getattr(connection, "_sock", True) is None:
                connection.connect()  # see _Wire._round_trip
            connection.send_packed_command([b"".join(_pack_any(command) for command in commands)], check_health=False)
        except BaseException:
            connection.disconnect()  # reconnects on the next round trip
            raise

    def receive(self, count: int) -> list[Any]:
        """The replies of the last :meth:`send`, an error reply as an exception."""
        connection = self._connection
        replies: list[Any] = []
        try:
            for _ in range(count):
                try:
                    replies.append(connection.read_response(disconnect_on_error=False))
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            connection.disconnect()
            raise
        return replies

    def follow(self, address: tuple[str, int] | None) -> None:
        """Reconnect, before the next batch, if not connected to ``address`` (see
        :meth:`_Wire.follow`); safe from another thread than the line's own."""
        self._address = address

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.disconnect()


#: ``ASKING``, packed: sent before a command for a slot that a node is importing.
ASKING = _packed((b"ASKING",))

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


def asking_undo(undo: _Undo | None) -> _Undo | None:
    """The undo of a command sent behind ``ASKING``: behind ``ASKING`` too (the importing node
    answers ``MOVED`` to it otherwise)."""
    if undo is None:
        return None
    return lambda: [(b"ASKING",), *undo()]


def demoted(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py's report of a ``READONLY`` reply from a Sentinel master
    turned replica (the command did not run)."""
    return isinstance(exc, redis.ConnectionError) and str(exc) == "The previous master is now a slave"


def _peer(connection: Any) -> tuple[str, int]:
    return str(connection.host), int(connection.port)


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
