"""The asyncio fast path of lock commands: :class:`_AsyncWire`, the twin of
:class:`~._wire._Wire` for one event loop, and the script calls over it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ._async_replies import LINE, WRITE_HIGH_WATER, Line, take_over
from ._script import LuaScript, _pack_any, _packed
from ._wire import (
    ASKING,
    DRAIN_FOR,
    _connection_factory,
    _peer,
    _return_token_when_gone,
    _tokens,
    _Undo,
    asking_undo,
    demoted,
)

__all__ = ["_AsyncWire", "_run_async", "_run_async_then"]


#: Sent behind a batch, so that every reply of the batch, errors included, is returned.
_PING = _packed((b"PING",))

#: Seconds between looks for a connection token (one may come back from a connection the
#: garbage collector closed, which wakes nobody) while every connection is busy.
TOKEN_POLL = 0.05

#: Above this many buffered bytes an async lock command waits for the socket to drain.
_WRITE_HIGH_WATER = WRITE_HIGH_WATER


class _AsyncWire:
    """:class:`_Wire` for one event loop: pre-packed lock commands over connections kept in
    a LIFO list, checked before reuse (the loop reads a closed connection's EOF into its
    stream as soon as it arrives), never sent twice, at most ``max_connections - 2`` at once,
    and a failed or cancelled command's ``undo`` written behind it on the same connection.

    A fresh connection connects in a task of its own, shielded from the caller: before
    Python 3.12, ``asyncio.wait_for`` (which redis-py wraps around the handshake's writes)
    can swallow a cancellation that lands as a write completes, and the caller would then go
    on, and into its critical section, as if it had not been cancelled.

    A plain connection with redis-py's hiredis parser is read by a :class:`~._async_replies.Line`
    once connected (see :mod:`._async_replies`): one write per round trip, the replies parsed
    as they arrive, one timer for the socket timeout. A caller cancelled mid-reply leaves its
    connection set aside until the server has answered (then it comes back, not reconnected).
    Other connections keep redis-py's ``StreamReader`` path."""

    __slots__ = ("_address", "_aside", "_before", "_client", "_free", "_make", "_tasks", "_tokens", "_waiters")

    def __init__(self, client: Any) -> None:
        self._client = client
        pool = getattr(client, "connection_pool", None)
        self._make = _connection_factory(client, pool)
        self._free: list[Any] = []
        self._tokens = _tokens(pool)
        # In arrival order; an OrderedDict, so a waiter leaves from anywhere in O(1) (thousands
        # of tasks may wait for a connection at once).
        self._waiters: collections.OrderedDict[asyncio.Future[None], None] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Lines set aside behind a cancelled call or draining behind an undo (closed by close();
        #: weak: a line is gone once its connection is closed).
        self._aside: weakref.WeakSet[Line] = weakref.WeakSet()
        self._address: tuple[str, int] | None = None
        self._before: Callable[[], Awaitable[None]] | None = None

    async def call(
        self, packed: bytes, args: tuple[object, ...], undo: _Undo | None = None, asking: bool = False
    ) -> Any:
        if asking:
            return (await self._send((ASKING, packed), 2, asking_undo(undo)))[1]
        if self._make is None:
            try:
                return await self._client.execute_command(*args)
            except BaseException:
                if undo is not None:
                    self._spawn(self._undo_apart(undo))
                raise
        return (await self._send((packed,), 1, undo))[0]

    async def call_then(
        self,
        packed: bytes,
        args: tuple[object, ...],
        then: tuple[bytes, ...],
        undo: _Undo | None = None,
        asking: bool = False,
    ) -> tuple[Any, Any]:
        """:meth:`_Wire.call_then` for one event loop."""
        if asking:
            replies = await self._send((ASKING, packed, _packed(then)), 3, asking_undo(undo), raise_last=False)
            return await self._then_replies(replies[1], replies[2], undo)
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
            return await self._then_replies(replies[0], replies[1], undo)
        first, second = await self._send((packed, _packed(then)), 2, undo, raise_last=False)
        return await self._then_replies(first, second, undo)

    async def _then_replies(self, first: Any, second: Any, undo: _Undo | None) -> tuple[Any, Any]:
        """See :meth:`_Wire._then_replies`: an error reply to the command behind is raised
        once ``undo()``, sent apart, is answered (shielded: a cancellation of the caller
        does not stop it)."""
        if isinstance(first, Exception):
            raise first
        if isinstance(second, Exception):
            if undo is not None:
                await asyncio.shield(self._spawn(self._undo_apart(undo)))
            raise second
        return first, second

    async def batch(self, frame: bytes, count: int) -> list[Any]:
        """Write ``frame`` (``count`` commands) and read every reply, an error reply as an
        exception (a renewal batch: nothing to undo)."""
        replies: list[Any] = await self._send((frame, _PING), count + 1, None)
        return replies[:-1]

    async def _send(
        self, frames: tuple[bytes, ...], count: int, undo: _Undo | None, raise_last: bool = True
    ) -> list[Any]:
        """:meth:`_round_trip` on a connection checked out for it; sent once more when a
        Sentinel master turned replica refused it (see :meth:`_Wire._round_trip`)."""
        try:
            return await self._round_trip(await self._checkout(), frames, count, undo, raise_last)
        except redis.ConnectionError as exc:
            if not demoted(exc):
                raise
        return await self._round_trip(await self._checkout(), frames, count, undo, raise_last)

    async def _round_trip(
        self, connection: Any, frames: tuple[bytes, ...], count: int, undo: _Undo | None, raise_last: bool = True
    ) -> list[Any]:
        """Write ``frames`` (no await: nothing can interrupt it) and read ``count`` replies (an
        error reply to any but the last is returned, not raised; to the last too unless
        ``raise_last``)."""
        line: Line | None = getattr(connection, LINE, None)
        if line is None:
            return await self._round_trip_stream(connection, frames, count, undo, raise_last)
        try:
            replies = line.send(frames[0] if len(frames) == 1 else b"".join(frames), count, connection.socket_timeout)
        except BaseException:
            self._write_failed(connection, undo)
            raise
        try:
            if line.paused:
                await line.writable()
            answer = await replies
        except BaseException as exc:
            # A timeout, a cancellation, a lost connection: the command went out and may run.
            if replies.done() and not replies.cancelled():
                replies.exception()  # failed while we waited to write: retrieved, not logged
            if undo is not None and self._undo_behind(connection, undo):
                raise
            if isinstance(exc, asyncio.CancelledError) and not line.broken:
                # Back once the server has answered (never reused mid-reply).
                self._aside.add(line)
                line.set_aside(lambda: self._answered(line, connection))
            else:
                _abandon(connection)
                self._checkin(connection)
            raise
        self._checkin(connection)
        last = answer[-1]
        if raise_last and isinstance(last, ResponseError):
            raise last  # the whole reply was read: the connection is clean
        return answer

    def _write_failed(self, connection: Any, undo: _Undo | None) -> None:
        """A write cut short (an interrupt may land after its last byte went out): drop the
        connection (it reconnects on next use) and send ``undo()`` apart."""
        _abandon(connection)
        self._checkin(connection)
        if undo is not None:
            self._spawn(self._undo_apart(undo))

    def _answered(self, line: Line, connection: Any) -> None:
        self._aside.discard(line)
        self._checkin(connection)

    async def _round_trip_stream(
        self, connection: Any, frames: tuple[bytes, ...], count: int, undo: _Undo | None, raise_last: bool = True
    ) -> list[Any]:
        """:meth:`_round_trip` on a connection read by redis-py (not taken over)."""
        try:
            writer = connection._writer
            for frame in frames:
                writer.write(frame)
        except BaseException:
            self._write_failed(connection, undo)
            raise
        replies: list[Any] = []
        try:
            # redis.asyncio wraps every write in asyncio.wait_for (a task and a timer per
            # command) when a socket timeout is set. A write only appends to the transport's
            # buffer; drain, under the timeout, only when the buffer is past its high-water
            # mark. The read keeps redis-py's own timeout.
            if writer.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await asyncio.wait_for(writer.drain(), connection.socket_timeout)
            while len(replies) < count:
                try:
                    replies.append(await connection.read_response(disconnect_on_error=False))
                except ResponseError as exc:
                    if raise_last and len(replies) == count - 1:
                        raise
                    replies.append(exc)
        except ResponseError:
            self._checkin(connection)  # the whole reply was read: the connection is clean
            raise
        except BaseException as exc:
            if demoted(exc):
                # Refused by a Sentinel master turned replica: nothing ran, nothing to undo (an
                # undo sent apart would race the command sent again to the new master).
                _abandon(connection)
                self._checkin(connection)
                raise
            # A timeout, a cancellation: the command went out and may run.
            if undo is None or not self._undo_behind(connection, undo):
                _abandon(connection)  # half a reply may be on the socket: reconnects on next use
                self._checkin(connection)
            raise
        self._checkin(connection)
        return replies

    async def _checkout(self) -> Any:
        if self._before is not None:
            await self._before()
        free = self._free
        tokens = self._tokens
        while True:
            if free:
                connection = free.pop()
                line = getattr(connection, LINE, None)
                if line is not None:
                    if line.broken or (self._address is not None and self._address != _peer(connection)):
                        _abandon(connection)  # closed by the server, timed out, or on a former master
                    else:
                        return connection
                    break
                reader = getattr(connection, "_reader", None)
                if reader is not None and (reader.at_eof() or reader.exception() is not None):
                    _abandon(connection)  # the server closed it: reconnect
                elif reader is not None and self._address is not None and self._address != _peer(connection):
                    _abandon(connection)  # on a former master: reconnect to the current one
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
            timer = loop.call_later(TOKEN_POLL, _resolve_none, waiter)
            self._waiters[waiter] = None
            try:
                await waiter
            except BaseException:
                if waiter not in self._waiters and not waiter.cancelled() and free:
                    # Woken by a check-in (which took us off the queue) and cancelled in the
                    # same loop iteration: pass on the wake-up we will not use.
                    self._wake_one()
                raise
            finally:
                timer.cancel()
                if waiter in self._waiters:
                    del self._waiters[waiter]
        if connection.is_connected:
            take_over(connection)  # connected by a connect that its caller did not wait for
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
        take_over(connection)
        return connection

    def _checkin(self, connection: Any) -> None:
        self._free.append(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter, _ = self._waiters.popitem(last=False)
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
        line: Line | None = getattr(connection, LINE, None)
        if line is not None:
            try:
                line.drain_behind(b"".join(_pack_any(command) for command in undo()), (connection, writer))
            except (OSError, RuntimeError):
                self._spawn(self._undo_apart(undo))
                return False
            # Out of the free list for good; the line keeps the connection (and so its token)
            # and its StreamWriter (whose __del__ would close the transport) until the server
            # has answered both and closed, or DRAIN_FOR has passed.
            self._aside.add(line)
            with contextlib.suppress(Exception):
                connection._parser.on_disconnect()
            connection._reader = connection._writer = None
            setattr(connection, LINE, None)
            return True
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
        """Best effort: ``undo()`` on another connection, in one write (see
        :meth:`_Wire._undo_apart`)."""
        commands = undo()
        with contextlib.suppress(RedisError, OSError):
            if self._make is None:
                for command in commands:
                    await self._client.execute_command(*command)
                return
            frames = tuple(_pack_any(command) for command in commands)
            await self._round_trip(await self._checkout(), frames, len(commands), None)

    def follow(self, address: tuple[str, int] | None) -> None:
        """See :meth:`_Wire.follow`."""
        self._address = address
        self.close_idle()

    def close_idle(self) -> None:
        """See :meth:`_Wire.close_idle`."""
        free, self._free = self._free, []
        for connection in free:
            _abandon(connection)

    async def close(self) -> None:
        free, self._free = self._free, []
        for connection in free:
            await connection.disconnect(nowait=True)
        aside, self._aside = list(self._aside), weakref.WeakSet()
        for line in aside:
            line.transport.close()
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
    if getattr(connection, LINE, None) is not None:
        setattr(connection, LINE, None)


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
