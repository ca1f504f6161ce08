"""One write and the replies of lock commands on a :class:`._wire._Wire` connection, read
straight from its socket with the connection's own hiredis reader when it has one.

redis-py's ``send_packed_command`` writes each frame apart, and its ``read_response`` goes
through three layers per reply (connection, parser, socket read) for what our scripts
answer in a few bytes. On a plain TCP or Unix connection speaking RESP2 with redis-py's
hiredis parser (RESP2 or RESP3), :func:`send` writes every frame in one ``sendall`` and
:func:`read` feeds the parser's reader from ``recv`` itself: the same reader, so the same
replies, error replies as the same exception classes, push messages handed to the parser's
handler as redis-py does, and a reconnect (which gives the parser a new reader) is seen at
once. Any other connection (TLS, Sentinel's, the pure-Python parser) goes through redis-py's
own calls. ``pip install 'lockaspect[fast]'`` brings hiredis.

On Linux the socket timeout of such a connection moves into the kernel (``SO_RCVTIMEO``,
``SO_SNDTIMEO``, the same number of seconds): Python polls a socket that has a timeout
before every ``send`` and ``recv``, two more system calls per round trip; the kernel's
timeout costs none. A read or write that times out still fails as redis-py's
``TimeoutError``."""

from __future__ import annotations

import socket
import struct
import sys
from typing import Any

import redis
from redis.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ResponseError

_HIREDIS: Any = None
NOT_ENOUGH_DATA: Any = None
try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _HiredisParser

    _HIREDIS = _HiredisParser
except ImportError:  # pragma: no cover - a redis-py that moved them: redis-py's own calls
    pass
_PUSH: Any = None  # hiredis < 3.2, or none: push messages are not told apart (as in redis-py)
try:
    from hiredis import PushNotification

    _PUSH = PushNotification
except ImportError:
    pass

__all__ = ["fast_reader", "read", "send"]

#: The connection classes whose reads are nothing but the parser's (TLS wraps the socket,
#: Sentinel's turns READONLY into a reconnect): matched exactly, not with isinstance.
_PLAIN = (Connection, UnixDomainSocketConnection)

#: Bytes asked of one recv: our scripts' replies are a few bytes; a larger one takes more.
_RECV = 16384


def fast_reader(connection: Any) -> Any:
    """The hiredis reader behind ``connection``'s replies when :func:`read` may feed it
    itself (see the module's docstring), else ``None``."""
    if _HIREDIS is None or type(connection) not in _PLAIN:
        return None
    parser = connection._parser
    if type(parser) is not _HIREDIS or connection._sock is None:
        return None
    return getattr(parser, "_reader", None)


#: Whether a socket timeout can move into the kernel (struct timeval as two C longs).
_KERNEL_TIMEOUTS = sys.platform == "linux"


def _kernel_timeout(sock: Any) -> None:
    """Move ``sock``'s timeout into the kernel (see the module's docstring); a socket without
    a timeout, or a non-blocking one, stays as it is. Only sockets whose replies :func:`read`
    reads itself: redis-py's own reads expect Python's timeout."""
    timeout = sock.gettimeout()
    if not timeout or not _KERNEL_TIMEOUTS:
        return
    seconds = int(timeout)
    micros = max(1, int((timeout - seconds) * 1e6)) if seconds == 0 else int((timeout - seconds) * 1e6)
    timeval = struct.pack("ll", seconds, micros)  # never 0 s 0 us: that would mean no timeout
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)


def _where(connection: Any) -> str:
    """``host:port`` of a TCP connection, the socket path of a Unix one."""
    path = getattr(connection, "path", None)
    return str(path) if path else f"{connection.host}:{connection.port}"


def send(connection: Any, frames: tuple[bytes, ...]) -> None:
    """Write ``frames`` on the connected ``connection``: one ``sendall`` on a plain
    connection. Failures as redis-py reports them (the connection is then disconnected)."""
    sock = connection._sock
    if type(connection) not in _PLAIN or sock is None:
        connection.send_packed_command(frames, check_health=False)
        return
    try:
        sock.sendall(frames[0] if len(frames) == 1 else b"".join(frames))
    except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_SNDTIMEO ran out
        connection.disconnect()
        raise redis.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        connection.disconnect()
        raise redis.ConnectionError(f"Error while writing to socket: {exc}") from None


def read(connection: Any, count: int, raise_last: bool = True) -> list[Any]:
    """``count`` replies from ``connection``: an error reply to any but the last is
    returned, to the last raised (returned too unless ``raise_last``). A failure to read
    leaves the connection as it is (the caller decides: the command may have run)."""
    reader = fast_reader(connection)
    replies: list[Any] = []
    if reader is None:
        while len(replies) < count:
            try:
                replies.append(connection.read_response(disconnect_on_error=False))
            except ResponseError as exc:
                if raise_last and len(replies) == count - 1:
                    raise
                replies.append(exc)
        return replies
    sock = connection._sock
    if sock.gettimeout() is not None:
        _kernel_timeout(sock)
    while len(replies) < count:
        reply = reader.gets()
        if reply is NOT_ENOUGH_DATA:
            try:
                data = sock.recv(_RECV)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO ran out
                raise redis.TimeoutError(f"Timeout reading from {_where(connection)}") from None
            except OSError as exc:
                raise redis.ConnectionError(f"Error while reading from socket: {exc}") from None
            if not data:
                raise redis.ConnectionError("Connection closed by server.")
            reader.feed(data)
            continue
        if isinstance(reply, redis.ConnectionError):
            raise reply
        if type(reply) is list and reply and isinstance(reply[0], redis.ConnectionError):
            raise reply[0]  # as redis-py's parser does
        if _PUSH is not None and type(reply) is _PUSH:
            handle = getattr(connection._parser, "handle_push_response", None)
            if handle is not None:
                handle(reply)
            continue
        replies.append(reply)
    last = replies[-1]
    if raise_last and isinstance(last, ResponseError):
        raise last
    return replies
