"""The lock commands' lean reply path (lockaspect/backends/redis/_replies.py): one write per
round trip, replies read with the connection's own hiredis reader, against a real server."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import NoScriptError, ResponseError

from lockaspect.backends.base import ReleaseResult
from lockaspect.backends.redis import RedisBackend
from lockaspect.backends.redis._replies import fast_reader, read, send
from lockaspect.backends.redis._script import _packed
from lockaspect.testing import LockServer

hiredis = pytest.importorskip("hiredis")


@pytest.fixture
def connection(lock_server: LockServer) -> Iterator[Any]:
    """A connected plain redis-py connection (hiredis parser), as a wire makes them."""
    client = lock_server.redis()
    pool = client.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)
    conn.connect()
    yield conn
    conn.disconnect()
    client.close()


def test_the_backend_reads_lock_replies_with_the_hiredis_reader(lock_server: LockServer, namespace: str) -> None:
    backend = RedisBackend.from_url(lock_server.url, namespace=namespace)
    try:
        token = secrets.token_hex(16)
        assert backend.lock_acquire("k", token, 10.0).acquired
        assert backend.lock_release("k", token) is ReleaseResult.RELEASED
        connection = backend._wire._free[-1]
        assert fast_reader(connection) is connection._parser._reader
    finally:
        backend.close()


def test_frames_go_in_one_write_and_each_reply_comes_back_in_order(connection: Any) -> None:
    key = b"replies:" + secrets.token_hex(8).encode()
    send(connection, (_packed((b"SET", key, b"v")), _packed((b"GET", key)), _packed((b"DEL", key))))
    assert read(connection, 3) == [b"OK", b"v", 1]


def test_an_error_reply_before_the_last_is_returned_and_the_last_raised(connection: Any) -> None:
    send(connection, (_packed((b"EVALSHA", b"0" * 40, b"0")), _packed((b"PING",))))
    first, second = read(connection, 2)
    assert isinstance(first, NoScriptError)  # redis-py's own exception class for NOSCRIPT
    assert second == b"PONG"
    send(connection, (_packed((b"PING",)), _packed((b"NO-SUCH-COMMAND",))))
    with pytest.raises(ResponseError):
        read(connection, 2)
    send(connection, (_packed((b"PING",)),))
    assert read(connection, 1) == [b"PONG"]  # the whole error reply was read: still in step


def test_a_connection_closed_by_the_server_is_a_connection_error(connection: Any, lock_server: LockServer) -> None:
    send(connection, (_packed((b"CLIENT", b"ID")),))
    (client_id,) = read(connection, 1)
    killer = lock_server.redis()
    try:
        killer.client_kill_filter(_id=client_id)
    finally:
        killer.close()

    def ping() -> list[Any]:
        send(connection, (_packed((b"PING",)),))  # fails here, or its reply does
        return read(connection, 1)

    with pytest.raises(redis.ConnectionError):
        ping()


@pytest.mark.parametrize("first", [True, False], ids=["python-timeout", "kernel-timeout"])
def test_a_reply_that_does_not_come_in_the_socket_timeout_is_a_timeout_error(connection: Any, first: bool) -> None:
    connection._sock.settimeout(0.05)
    if not first:  # the first read moves the timeout into the kernel (on Linux)
        send(connection, (_packed((b"PING",)),))
        assert read(connection, 1) == [b"PONG"]
        if sys.platform == "linux":
            assert connection._sock.gettimeout() is None
    send(connection, (_packed((b"BLPOP", b"replies:never:" + secrets.token_hex(8).encode(), b"0")),))
    with pytest.raises(redis.TimeoutError):
        read(connection, 1)


def test_a_timeout_on_a_unix_socket_connection_names_its_path(lock_server: LockServer) -> None:
    client = redis.Redis.from_url(lock_server.unix_url, socket_timeout=0.05)
    pool = client.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)
    conn.connect()
    try:
        assert fast_reader(conn) is not None
        send(conn, (_packed((b"BLPOP", b"replies:never:" + secrets.token_hex(8).encode(), b"0")),))
        with pytest.raises(redis.TimeoutError, match=str(conn.path)):
            read(conn, 1)
    finally:
        conn.disconnect()
        client.close()
