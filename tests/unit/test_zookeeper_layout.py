"""The ZooKeeper store's pure parts: node names, queue order across the sequence wrap, who
holds, URL checks, and the two kazoo internals the store relies on (no server needed)."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("kazoo")

from lockaspect import ConfigurationError
from lockaspect.backends.zookeeper import open_zookeeper_store
from lockaspect.backends.zookeeper._layout import (
    decide,
    decode_key,
    encode_key,
    holders,
    infix_of,
    ordered,
    parse,
    root_path,
)
from lockaspect.backends.zookeeper._options import parse_settings

UUID = "0123456789abcdef0123456789abcdef"


def name(seq: int, infix: str = "lock", uuid: str = UUID) -> str:
    """A contender name as the server makes it (a signed 32-bit counter, 10 digits)."""
    signed = seq - (1 << 32) if seq >= 1 << 31 else seq
    return f"_c_{uuid}-{infix}-{signed:010d}"


@given(st.text())
def test_key_encoding_round_trips_into_one_node_name(key: str) -> None:
    encoded = encode_key(key)
    assert "/" not in encoded
    assert encoded not in ("", ".", "..")
    assert decode_key(encoded) == key


def test_plain_keys_stay_readable() -> None:
    assert encode_key("order:42") == "order:42"
    assert encode_key("a/b c") == "a%2Fb%20c"
    assert root_path("lockaspect:") == "/lockaspect"


def test_parse_reads_what_the_server_made_and_ignores_the_rest() -> None:
    contender = parse(name(7, "sem.3"))
    assert contender is not None
    assert (contender.uuid, contender.infix, contender.seq, contender.permits, contender.family) == (
        UUID,
        "sem.3",
        7,
        3,
        "sem",
    )
    assert parse("lock-0000000001") is None  # kazoo's own recipe, or anything else
    assert parse(name(1) + "x") is None
    negative = parse(name((1 << 31) + 5))
    assert negative is not None
    assert negative.seq == (1 << 31) + 5


@pytest.mark.parametrize("start", [0, (1 << 31) - 2, (1 << 32) - 2, 12345])
def test_queue_order_survives_the_32_bit_wrap(start: int) -> None:
    """The counter goes 2147483647 -> -2147483648 -> ... -> -1 -> 0: order is still creation order."""
    seqs = [(start + i) % (1 << 32) for i in range(5)]
    names = [name(seq, uuid=f"{i:032x}") for i, seq in enumerate(seqs)]
    shuffled = [names[3], names[0], names[4], names[2], names[1]]
    assert [c.name for c in ordered(shuffled)] == names


def test_each_family_decides_among_its_own() -> None:
    children = [name(1, "read"), name(2, "lock"), name(3, "write"), name(4, "read"), name(5, "sem.2")]
    assert [c.name for c in ordered(children, "rw")] == [children[0], children[2], children[3]]
    assert [c.name for c in ordered(children, "lock")] == [children[1]]


def test_mutex_and_writer_watch_their_predecessor() -> None:
    queue = ordered([name(1), name(2), name(3)])
    assert decide(queue, name(1)).holds  # type: ignore[union-attr]
    verdict = decide(queue, name(3))
    assert verdict is not None
    assert not verdict.holds
    assert verdict.watch == name(2)
    assert verdict.ahead == 2
    assert decide(queue, name(9)) is None


def test_readers_wait_only_for_earlier_writers() -> None:
    queue = ordered([name(1, "read"), name(2, "write"), name(3, "read"), name(4, "read")])
    assert decide(queue, name(1, "read")).holds  # type: ignore[union-attr]
    assert decide(queue, name(2, "write")).watch == name(1, "read")  # type: ignore[union-attr]
    assert decide(queue, name(4, "read")).watch == name(2, "write")  # type: ignore[union-attr]
    # a downgrade: the reader's own write lock does not count
    assert decide(queue, name(3, "read"), ignore=name(2, "write")).holds  # type: ignore[union-attr]
    assert [c.name for c in holders(queue)] == [name(1, "read")]


def test_semaphore_first_waiter_watches_the_queue_and_the_rest_their_predecessor() -> None:
    queue = ordered([name(i, "sem.2") for i in range(1, 6)])
    assert [decide(queue, name(i, "sem.2")).holds for i in range(1, 6)] == [True, True, False, False, False]  # type: ignore[union-attr]
    assert decide(queue, name(3, "sem.2")).watch == ""  # type: ignore[union-attr]
    assert decide(queue, name(4, "sem.2")).watch == name(3, "sem.2")  # type: ignore[union-attr]
    # an operator's permits override what the contenders expect
    assert decide(queue, name(4, "sem.2"), permits=4).holds  # type: ignore[union-attr]
    assert decide(queue, name(5, "sem.2")).permits == 2  # type: ignore[union-attr]
    assert infix_of("semaphore", 2) == "sem.2"
    assert infix_of("fair", None) == "lock"


@pytest.mark.parametrize(
    "url",
    [
        "zookeeper://",
        "zookeeper:///chroot",
        "zookeeper://host:0",
        "zookeeper://host:70000",
        "zookeeper://host:port",
        "zookeeper://h1:2181,,h2:2181",
        "zookeeper://host/a/../b",
        "zookeeper://host/#frag",
        "zookeeper://user@host",
        "zookeeper://host?unknown=1",
        "zookeeper://host?session_timeout=-1",
        "zookeeper://host?session_timeout=abc",
        "zookeeper://host?owner_info=maybe",
        "zookeeper://host?containers=2",
        "redis://host",
    ],
)
def test_bad_urls_are_refused_before_any_io(url: str) -> None:
    with pytest.raises(ConfigurationError):
        open_zookeeper_store(url)


def test_url_parts_and_options() -> None:
    settings = parse_settings(
        "zookeeper://alice:s3cret@h1,h2:2182,[::1]:2183/app/locks?session_timeout=4&owner_info=false",
        "ns:",
        {"connect_timeout": 2},
    )
    assert settings.hosts == "h1:2181,h2:2182,[::1]:2183"
    assert settings.chroot == "/app/locks"
    assert settings.auth == ("digest", "alice:s3cret")
    assert "s3cret" not in settings.shown
    assert (settings.session_timeout, settings.connect_timeout, settings.request_timeout) == (4.0, 2.0, 4.0)
    assert settings.owner_info is False
    assert settings.containers is True
    assert parse_settings("zookeeper://h?containers=false", "ns:", {}).containers is False
    with pytest.raises(TypeError):
        parse_settings(b"zookeeper://h", "ns:", {})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError) as info:
        open_zookeeper_store("zookeeper://alice:s3cret@h1?nope=1")
    assert "s3cret" not in str(info.value)


def test_the_kazoo_internals_the_store_uses_are_there() -> None:
    """Container nodes go through kazoo's private ``_call`` with a CREATE2 body (opcode 19):
    if a kazoo release changes either, this fails before any lock does."""
    from kazoo.client import KazooClient
    from kazoo.protocol.connection import ConnectionHandler
    from kazoo.protocol.serialization import Create2

    assert list(inspect.signature(KazooClient._call).parameters) == ["self", "request", "async_object"]
    assert Create2._fields == ("path", "data", "acl", "flags")
    assert Create2.type == 15
    # The granted session timeout is read from what the connection's _connect returns.
    assert list(inspect.signature(ConnectionHandler._connect).parameters) == ["self", "host", "hostip", "port"]
    assert "return read_timeout, connect_timeout" in inspect.getsource(ConnectionHandler._connect)
    # A waiter that gives up takes its watch function off kazoo's watcher sets.
    client = KazooClient(hosts="127.0.0.1:1")
    assert isinstance(client._data_watchers, dict)
    assert isinstance(client._child_watchers, dict)
    assert callable(client._connection._connect)
