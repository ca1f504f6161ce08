"""The asyncio subscriber connection of :class:`~.notify.AsyncRedisNotifier`: redis-py makes
and hands over the connection (address, TLS, AUTH, HELLO), then :class:`Subscriber` takes its
transport over as an :class:`asyncio.Protocol`. Each frame is parsed in ``data_received``, in
the loop iteration the bytes arrive in, and handed to the notifier there: a release wake-up
resolves its waiter's future with no reader task in between (which would cost a loop
iteration, redis-py's per-message retry wrapper, message dict and telemetry, on the path of
every hand-over). SUBSCRIBE and UNSUBSCRIBE are written pre-packed, with no await.

Frames are parsed by ``hiredis.Reader`` when hiredis is installed (``lockaspect[fast]``), else by
:class:`PushReader`, which reads only what a subscriber connection receives: arrays and RESP3
pushes of bulk strings and integers, simple strings and error replies. Not a protocol client:
the commands are sent and their replies checked by the notifier, per channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse

from ._async_wire import _abandon
from ._script import _pack_any

_HiredisReader: Any
try:  # pragma: no cover - depends on the environment
    from hiredis import Reader as _HiredisReader
except ImportError:  # pragma: no cover - depends on the environment
    _HiredisReader = None

__all__ = ["PushReader", "Subscriber", "new_reader"]


class _Incomplete(Exception):
    """The buffer ends inside a frame."""


class PushReader:
    """``hiredis.Reader``'s ``feed``/``gets`` for the frames a subscriber connection gets (see the
    module docstring); an error reply is returned as ``reply_error(message)``."""

    __slots__ = ("_buffer", "_reply_error")

    def __init__(self, reply_error: Callable[[str], Exception]) -> None:
        self._buffer = bytearray()
        self._reply_error = reply_error

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def gets(self) -> Any:
        """The next whole frame, or ``False`` when the buffer holds none yet."""
        try:
            value, end = self._parse(0)
        except _Incomplete:
            return False
        del self._buffer[:end]
        return value

    def _parse(self, pos: int) -> tuple[Any, int]:
        buffer = self._buffer
        end = buffer.find(b"\r\n", pos)
        if end < 0:
            raise _Incomplete
        kind, line, pos = buffer[pos], bytes(buffer[pos + 1 : end]), end + 2
        if kind in b"*>":  # an array, a RESP3 push
            items = []
            for _ in range(int(line)):
                item, pos = self._parse(pos)
                items.append(item)
            return items, pos
        if kind == ord("$"):
            size = int(line)
            if size < 0:
                return None, pos
            if len(buffer) < pos + size + 2:
                raise _Incomplete
            return bytes(buffer[pos : pos + size]), pos + size + 2
        if kind == ord(":"):
            return int(line), pos
        if kind == ord("+"):
            return line, pos
        if kind == ord("-"):
            return self._reply_error(line.decode("utf-8", "replace")), pos
        if kind == ord("_"):
            return None, pos
        raise InvalidResponse(f"unexpected frame type {chr(kind)!r} on the subscriber connection")


def new_reader() -> Any:
    """A frame reader: ``hiredis.Reader`` when installed, else :class:`PushReader`."""
    if _HiredisReader is not None:
        return _HiredisReader(protocolError=InvalidResponse, replyError=BaseParser.parse_error)
    return PushReader(BaseParser.parse_error)


class Subscriber(asyncio.Protocol):
    """One subscriber connection (see the module docstring). ``on_frame(self, frame)`` gets each
    frame (an error reply as an exception); ``on_lost(self, exc)`` once, when the connection
    fails or the server closes it (not after :meth:`close`)."""

    def __init__(
        self,
        pool: Any,
        connection: Any,
        on_frame: Callable[[Subscriber, Any], None],
        on_lost: Callable[[Subscriber, BaseException], None],
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._on_frame = on_frame
        self._on_lost: Callable[[Subscriber, BaseException], None] | None = on_lost
        self._reader = new_reader()
        self._transport: asyncio.Transport = connection._writer.transport
        # redis-py's StreamReaderProtocol: told when the connection closes, or the
        # connection's StreamWriter.wait_closed() (awaited by its disconnect()) never returns.
        self._previous: asyncio.BaseProtocol = self._transport.get_protocol()

    @classmethod
    async def open(
        cls,
        pool: Any,
        on_frame: Callable[[Subscriber, Any], None],
        on_lost: Callable[[Subscriber, BaseException], None],
    ) -> Subscriber:
        """A connection from ``pool`` (connected and set up by redis-py), taken over."""
        connection = await pool.get_connection()
        try:
            subscriber = cls(pool, connection, on_frame, on_lost)
            if connection._reader.at_eof():
                raise RedisConnectionError("the subscriber connection closed as it opened")
            # Nothing was sent on it: nothing is buffered for redis-py's reader to miss.
            subscriber._transport.set_protocol(subscriber)
        except BaseException:
            _abandon(connection)
            await pool.release(connection)
            raise
        return subscriber

    def send(self, command: bytes, channel: bytes) -> None:
        """Write ``command channel`` (no await: commands go out in the order they are sent)."""
        if self._on_lost is None or self._transport.is_closing():
            raise RedisConnectionError("the subscriber connection is closed")
        self._transport.write(_pack_any((command, channel)))

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        try:
            reader.feed(data)
            frame = reader.gets()
            while frame is not False:
                if self._on_lost is None:
                    return
                self._on_frame(self, frame)
                frame = reader.gets()
        except Exception as exc:  # noqa: BLE001 - a garbled frame: give the connection up
            self._lost(exc)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc or RedisConnectionError("the server closed the subscriber connection"))
        self._previous.connection_lost(exc)

    def _lost(self, exc: BaseException) -> None:
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            self._transport.close()
            on_lost(self, exc)

    async def close(self) -> None:
        """Close the connection and give it back to its pool (which reconnects it on next use)."""
        self._on_lost = None
        connection, self._connection = self._connection, None
        if connection is not None:
            _abandon(connection)  # closes the transport; redis-py's reader no longer gets data
            await self._pool.release(connection)
