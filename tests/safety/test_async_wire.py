"""The asyncio lock wire's own reader (lockaspect/backends/redis/_async_replies.py, a
:class:`Line` per taken-over connection) against a real server, with the network path
stalled by :class:`FaultProxy` where a test needs a reply held back: frames split anywhere,
error replies, the socket timeout, a connection closed mid-reply, and a caller cancelled
mid-reply (its connection is never reused before its reply is read)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
from faults import DOWN, FaultProxy
from redis.exceptions import NoScriptError, ResponseError

from lockaspect.backends.redis import AsyncRedisStore
from lockaspect.backends.redis._async_replies import LINE, Line
from lockaspect.backends.redis._script import _packed
from lockaspect.testing import LockServer

pytest.importorskip("hiredis")


@pytest.fixture
def proxy(lock_server: LockServer) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", lock_server.port)) as proxy:
        yield proxy


def _line(connection: Any) -> Line:
    line = getattr(connection, LINE, None)
    assert isinstance(line, Line), "the connection was not taken over"
    return line


async def _until(condition: Callable[[], object], what: str) -> None:
    """Poll ``condition`` without blocking the loop; fail naming ``what`` after 15 s (a safety net
    against a hang, not a speed expectation)."""
    deadline = time.monotonic() + 15.0
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _wire_on(url: str, **options: Any) -> AsyncIterator[Any]:
    """The asyncio wire of a store on ``url`` (closed after, with the store's client)."""
    store = AsyncRedisStore.from_url(url, **options)
    try:
        yield store._wire
    finally:
        await store._wire.close()
        await store.redis.aclose()


def _ping(wire: Any) -> Any:
    return wire.call(_packed((b"PING",)), ("PING",))


def _raw_replies(server: LockServer, frames: bytes, lines: int) -> bytes:
    """What the real server answers to ``frames`` (``lines`` CRLF-ended lines), on a plain socket."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(frames)
        data = b""
        while data.count(b"\r\n") < lines:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            data += chunk
    return data


def test_lock_commands_go_through_a_line_and_error_replies_keep_it_clean(lock_server: LockServer) -> None:
    async def main() -> None:
        async with _wire_on(lock_server.url) as wire:
            assert await _ping(wire) == b"PONG"
            connection = wire._free[-1]
            line = _line(connection)
            # An error reply before the last comes back as its redis-py exception; the last raises.
            assert await wire.call_then(_packed((b"ECHO", b"a")), ("ECHO", "a"), (b"ECHO", b"b")) == (b"a", b"b")
            replies = await wire.batch(_packed((b"EVALSHA", b"0" * 40, b"0")) + _packed((b"ECHO", b"c")), 2)
            assert isinstance(replies[0], NoScriptError)
            assert replies[1] == b"c"
            with pytest.raises(ResponseError):
                await wire.call(_packed((b"NO-SUCH-COMMAND",)), ("NO-SUCH-COMMAND",))
            # The whole reply was read: the same connection and line serve the next call.
            assert await wire.call(_packed((b"ECHO", b"d")), ("ECHO", "d")) == b"d"
            assert wire._free == [connection]
            assert _line(connection) is line
            assert not line.broken

    asyncio.run(main())


def test_replies_split_at_every_byte_resolve_once_whole(lock_server: LockServer, proxy: FaultProxy) -> None:
    key = b"split:" + secrets.token_hex(6).encode()
    frames = _packed((b"ECHO", b"x" * 40)) + _packed((b"EVALSHA", b"0" * 40, b"0")) + _packed((b"INCRBY", key, b"7"))
    whole = _raw_replies(lock_server, frames, 4)  # a bulk string (2 lines), an error, an integer

    async def main() -> None:
        async with _wire_on(proxy.url) as wire:
            try:
                await _ping(wire)
                line = _line(wire._free[-1])
                proxy.hold(DOWN)  # the real answer stays in the proxy: this test feeds the line itself
                replies = line.send(frames, 3, None)
                for i in range(len(whole)):
                    assert not replies.done(), f"resolved after {i} of {len(whole)} bytes"
                    line.data_received(whole[i : i + 1])
                assert replies.done()
                echo, noscript, number = replies.result()
                assert echo == b"x" * 40
                assert isinstance(noscript, NoScriptError)
                assert number == 7
            finally:
                proxy.release()

    asyncio.run(main())


def test_a_timed_out_reply_drops_the_connection(proxy: FaultProxy) -> None:
    async def main() -> None:
        async with _wire_on(proxy.url, socket_timeout=0.2) as wire:
            try:
                await _ping(wire)
                connection = wire._free[-1]
                line = _line(connection)
                proxy.hold(DOWN)
                with pytest.raises(redis.TimeoutError):
                    await _ping(wire)
                assert line.broken
                assert getattr(connection, LINE, None) is None
                proxy.release()
                assert await wire.call(_packed((b"ECHO", b"e")), ("ECHO", "e")) == b"e"  # a new connection
                assert _line(connection) is not line
                assert proxy.connections == 2
            finally:
                proxy.release()

    asyncio.run(main())


def test_a_connection_closed_mid_reply_fails_the_call_and_is_replaced(lock_server: LockServer) -> None:
    key = b"blocked:" + secrets.token_hex(6).encode()

    async def main() -> None:
        admin = lock_server.redis()
        async with _wire_on(lock_server.url) as wire:
            try:
                await _ping(wire)
                connection = wire._free[-1]
                line = _line(connection)
                client_id = await wire.call(_packed((b"CLIENT", b"ID")), ("CLIENT", "ID"))
                # Two replies owed: the first comes at once, the second never (BLPOP blocks).
                call = asyncio.ensure_future(wire.batch(_packed((b"ECHO", b"f")) + _packed((b"BLPOP", key, b"0")), 2))
                await _until(lambda: any(c.get("cmd") == "blpop" for c in admin.client_list()), "BLPOP to block")
                assert admin.client_kill_filter(_id=client_id) == 1
                with pytest.raises(redis.ConnectionError):
                    await call
                assert line.broken
                assert await wire.call(_packed((b"ECHO", b"g")), ("ECHO", "g")) == b"g"
                assert wire._free == [connection]
                assert _line(connection) is not line
            finally:
                admin.close()

    asyncio.run(main())


def test_a_call_cancelled_mid_reply_sets_its_connection_aside_until_answered(proxy: FaultProxy) -> None:
    key = b"aside:" + secrets.token_hex(6).encode()

    async def main() -> None:
        async with _wire_on(proxy.url) as wire:
            try:
                await _ping(wire)
                connection = wire._free[-1]
                line = _line(connection)
                proxy.hold(DOWN)
                before = proxy.bytes_up
                call = asyncio.ensure_future(wire.call(_packed((b"INCR", key)), ("INCR", key)))
                await asyncio.to_thread(proxy.wait_for_traffic, before)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                # Its reply is still owed: not in the free list, so another call takes a new connection.
                assert wire._free == []
                assert not line.broken
                other = asyncio.ensure_future(wire.call(_packed((b"ECHO", b"h")), ("ECHO", "h")))
                await asyncio.to_thread(proxy.wait_for_connections, 2)
                proxy.release()
                assert await other == b"h"
                await _until(lambda: connection in wire._free, "the INCR reply to be read")
                assert _line(connection) is line
                assert not line.broken
                assert proxy.connections == 2
                # Its next reply is its own, not the INCR's.
                wire._free.remove(connection)
                wire._free.append(connection)
                assert await wire.call(_packed((b"ECHO", b"i")), ("ECHO", "i")) == b"i"
                assert wire._free[-1] is connection
            finally:
                proxy.release()

    asyncio.run(main())


def test_a_write_past_the_high_water_mark_waits_for_the_socket_to_drain(lock_server: LockServer) -> None:
    value = secrets.token_bytes(16) * (1 << 20)  # 16 MiB: more than the kernel's socket buffers take at once

    async def main() -> None:
        async with _wire_on(lock_server.url) as wire:
            await _ping(wire)
            line = _line(wire._free[-1])
            replies = line.send(_packed((b"ECHO", value)), 1, None)
            assert line.paused  # the transport asked to stop writing: the wire awaits this
            await line.writable()
            assert not line.paused
            assert (await replies)[0] == value
            assert await wire.call(_packed((b"ECHO", value)), ("ECHO", value)) == value  # the wire's own path

    asyncio.run(main())


def test_a_waiter_woken_and_cancelled_at_once_passes_the_connection_on(
    lock_server: LockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection busy, two tasks wait; the one a check-in wakes is cancelled in the same
    loop iteration: the next waiter gets the connection then, not at its next token poll."""
    from lockaspect.backends.redis import _async_wire

    monkeypatch.setattr(_async_wire, "TOKEN_POLL", 3600.0)  # only a passed-on wake-up can help

    async def main() -> None:
        async with _wire_on(lock_server.url, max_connections=3) as wire:  # one for lock commands
            first = await wire._checkout()
            woken = asyncio.ensure_future(wire._checkout())
            next_in_line = asyncio.ensure_future(wire._checkout())
            await _until(lambda: len(wire._waiters) == 2, "both tasks to wait for a connection")
            wire._checkin(first)  # wakes `woken`...
            woken.cancel()  # ...which is cancelled before it runs
            connection = await asyncio.wait_for(next_in_line, 15.0)  # a hang guard
            assert connection is first
            assert woken.cancelled()
            wire._checkin(connection)

    asyncio.run(main())
