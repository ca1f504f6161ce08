"""The asyncio twin of :mod:`._replies`: the replies of lock commands on an
:class:`~._async_wire._AsyncWire` connection, read by a :class:`Line`.

redis.asyncio reads a reply through its connection, parser and ``StreamReader`` layers under
an ``asyncio.timeout`` per call, and writes each frame apart. On a plain TCP or Unix
connection with redis-py's hiredis parser (RESP2 or RESP3), redis-py makes the connection
(address, AUTH, HELLO, SELECT), then :func:`take_over` hands its transport to a
:class:`Line`: the frames of a round trip go out in one ``transport.write``, the replies are
fed to the parser's own hiredis reader in ``data_received`` (so the same replies, error
replies as the same exception classes), and the caller's future is resolved there, in the
loop iteration the bytes arrive in. The socket timeout (read per round trip: redis-py relaxes
it during a server's maintenance) is a deadline per round trip, watched by one loop timer per
connection that re-arms itself for the deadline it finds when it fires (a timer per round
trip would cost a heap push and a cancelled handle each); no task per call. A RESP3 push
message is handed to the parser's own handler, in a task, as redis-py does. Any other
connection (TLS, Sentinel's, the pure-Python parser) keeps redis-py's path.
``pip install 'lockaspect[fast]'`` brings hiredis.

A :class:`Line` is never written to while replies are owed on it, except by the undo that
follows a failed command (:meth:`Line.drain_behind`): a caller cancelled mid-reply sets its
connection aside (:meth:`Line.set_aside`) until the server has answered it in full."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import InvalidResponse

from ._wire import DRAIN_FOR

_HIREDIS: Any = None
NOT_ENOUGH_DATA: Any = None
try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser

    _HIREDIS = _AsyncHiredisParser
except ImportError:  # pragma: no cover - a redis-py that moved them: redis-py's own path
    pass
_PUSH: Any = None
try:
    from hiredis import PushNotification

    _PUSH = PushNotification
except ImportError:  # pragma: no cover - hiredis < 3.2, or none
    pass

__all__ = ["Line", "take_over"]

#: The connection classes whose reads are nothing but the parser's, matched exactly.
_PLAIN = (Connection, UnixDomainSocketConnection)

#: Above this many buffered bytes a round trip waits for the socket to drain.
WRITE_HIGH_WATER = 64 * 1024

#: The attribute of a redis-py connection that holds its :class:`Line`.
LINE = "_lockaspect_line"


def take_over(connection: Any) -> Line | None:
    """The :class:`Line` of the connected ``connection``, made now if it may have one (see
    the module docstring), else ``None`` (redis-py's path)."""
    if type(connection) not in _PLAIN or _HIREDIS is None:
        return None
    parser = connection._parser
    writer = connection._writer
    stream = connection._reader
    if type(parser) is not _HIREDIS or writer is None or stream is None:
        return None
    reader = parser._reader
    transport = writer.transport
    # Nothing may be buffered for redis-py's reader (nothing was sent since the handshake).
    if reader is None or reader.has_data() or stream._buffer or stream.at_eof() or transport.is_closing():
        return None
    line = Line(transport, parser, connection._host_error())
    transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
    transport.set_protocol(line)
    setattr(connection, LINE, line)
    return line


class Line(asyncio.Protocol):
    """One taken-over connection (see the module docstring). ``broken``: never to be used
    again (timed out, failed, closed); the wire reconnects it."""

    __slots__ = (
        "__weakref__",
        "_aside",
        "_count",
        "_deadline",
        "_draining",
        "_future",
        "_keep",
        "_loop",
        "_parser",
        "_previous",
        "_reader",
        "_replies",
        "_timer",
        "_where",
        "_writable",
        "broken",
        "paused",
        "transport",
    )

    def __init__(self, transport: Any, parser: Any, where: str) -> None:
        self.transport = transport
        self._parser = parser
        self._reader = parser._reader
        #: redis-py's StreamReaderProtocol: told when the connection is lost, so its stream
        #: reader sees the end and ``StreamWriter.wait_closed`` returns.
        self._previous = transport.get_protocol()
        self._loop = asyncio.get_running_loop()
        self._where = where
        self._future: asyncio.Future[list[Any]] | None = None
        self._count = 0
        self._replies: list[Any] = []
        #: When the round trip in flight (or the drain) runs out (loop time), or ``None``.
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._aside: Callable[[], None] | None = None
        self._draining = False
        self._keep: Any = None
        self._writable: asyncio.Future[None] | None = None
        self.broken = False
        self.paused = False

    # -- the wire's calls -----------------------------------------------------------------

    def send(self, data: bytes, count: int, timeout: float | None) -> asyncio.Future[list[Any]]:
        """Write ``data`` (``count`` commands, no await) and return the future of their
        replies: every reply, an error reply as its exception, once all have come, or
        redis-py's ``TimeoutError`` after ``timeout`` seconds (``None``, 0: no limit)."""
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        self._future = future
        self._count = count
        self._replies = []
        self.transport.write(data)
        if timeout:
            self._watch(self._loop.time() + timeout)
        return future

    def writable(self) -> asyncio.Future[None]:
        """A future resolved once the transport's buffer is below its low-water mark again
        (failed with the round trip's timeout or the connection's loss)."""
        if self._writable is None:
            self._writable = self._loop.create_future()
        return self._writable

    def set_aside(self, answered: Callable[[], None]) -> None:
        """The caller is gone (cancelled) with replies owed: call ``answered()`` once they have
        all come (then the connection is clean), or once the connection is broken (timed out,
        closed). Never reused before either."""
        future = self._future
        if future is not None and not future.done():
            future.cancel()  # nobody awaits it: it never holds an exception nobody reads
        if self._future is None or self.broken:
            answered()
            return
        self._aside = answered
        if self._deadline is None:  # no socket timeout: do not wait for ever
            self._watch(self._loop.time() + DRAIN_FOR)

    def drain_behind(self, data: bytes, keep: Any) -> None:
        """Write ``data`` (the undo of the command in flight) behind it and half-close: the
        server runs both, answers, and closes its side; everything it sends is discarded. The
        connection closes then, or after :data:`DRAIN_FOR`. ``keep`` (the redis-py connection,
        whose token counts it, and its StreamWriter) stays referenced until then."""
        self._draining = True
        self._keep = keep
        self._fail(None)
        self.transport.write(data)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._deadline = None
        self._watch(self._loop.time() + DRAIN_FOR)

    # -- asyncio.Protocol -----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return
        reader = self._reader
        try:
            reader.feed(data)
            while True:
                reply = reader.gets()
                if reply is NOT_ENOUGH_DATA:
                    return
                if self.broken:
                    continue  # the rest of an answer that came too late
                if _PUSH is not None and type(reply) is _PUSH:
                    self._push(reply)
                    continue
                if self._count == 0:
                    raise InvalidResponse(f"a reply nothing was sent for, from {self._where}")
                if isinstance(reply, redis.ConnectionError):
                    raise reply
                if type(reply) is list and reply and isinstance(reply[0], redis.ConnectionError):
                    raise reply[0]  # as redis-py's parser does
                self._replies.append(reply)
                if len(self._replies) == self._count:
                    self._answered()
        except Exception as exc:  # noqa: BLE001 - a garbled or refused reply: give the connection up
            self._break(exc)

    def eof_received(self) -> bool:
        if not self._draining:
            self._break(redis.ConnectionError("Connection closed by server."))
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._break(redis.ConnectionError("Connection closed by server."))
        else:
            self._break(redis.ConnectionError(f"Error while reading from {self._where} : {exc}"))
        self._unwatch()
        self._keep = None
        self._previous.connection_lost(exc)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def _push(self, reply: Any) -> None:
        task = self._loop.create_task(self._parser.handle_push_response(reply))
        _pushes.add(task)
        task.add_done_callback(_pushes.discard)

    # -- the states -----------------------------------------------------------------------

    def _watch(self, deadline: float) -> None:
        self._deadline = deadline
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._expire)
        elif self._timer.when() > deadline:  # an earlier deadline than the armed one (a drain's)
            self._timer.cancel()
            self._timer = self._loop.call_at(deadline, self._expire)

    def _unwatch(self) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        """The timer: the deadline in force has passed (time out, or end the drain), or lies
        later (re-armed for it), or there is none (the line is idle: the timer stops)."""
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._expire)
        elif self._draining:
            self.transport.close()
        else:
            self._deadline = None
            self._break(redis.TimeoutError(f"Timeout reading from {self._where}"))

    def _answered(self) -> None:
        """Every reply owed has come: the connection is clean again."""
        self._deadline = None  # the timer, if armed, finds none and stops
        future, replies, aside = self._future, self._replies, self._aside
        self._future = None
        self._count = 0
        self._replies = []
        self._aside = None
        if aside is not None:
            aside()
        elif future is not None and not future.done():
            future.set_result(replies)

    def _break(self, exc: BaseException) -> None:
        """Never to be used again; the caller (if any) gets ``exc``. A connection set aside is
        given back now (broken: the wire reconnects it)."""
        first = not self.broken
        self.broken = True
        if not first or self._draining:
            return
        self._unwatch()
        aside, self._aside = self._aside, None
        self._fail(exc)
        if aside is not None:
            self.transport.close()
            aside()

    def _fail(self, exc: BaseException | None) -> None:
        future, self._future = self._future, None
        writable, self._writable = self._writable, None
        for waiter in (future, writable):
            if waiter is not None and not waiter.done():
                if exc is None:
                    waiter.cancel()
                else:
                    waiter.set_exception(exc)


#: The tasks handling push messages (kept alive until done).
_pushes: set[asyncio.Task[Any]] = set()
