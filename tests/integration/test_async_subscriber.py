"""The asyncio subscriber connection (lockaspect.backends.redis._subscriber) against a real
server, with both frame readers: hiredis's when installed, and the pure :class:`PushReader`
(what runs without ``lockaspect[fast]``). Waiters are woken by the release itself; a refused
SUBSCRIBE and a lost connection leave them polling; idle channels are unsubscribed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio

from lockaspect import LockClient
from lockaspect.backends.redis import _channels, _subscriber
from lockaspect.backends.redis.store import AsyncRedisStore
from lockaspect.testing import LockServer

READERS = ["hiredis", "pure"]


@pytest.fixture(params=READERS)
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "hiredis":
        if _subscriber._HiredisReader is None:
            pytest.skip("hiredis is not installed")
    else:
        monkeypatch.setattr(_subscriber, "_HiredisReader", None)
    return str(request.param)


def _notifier(client: LockClient) -> Any:
    state = client._async.states.get(asyncio.get_running_loop())
    return None if state is None else state.store.notifier()


def test_push_reader_parses_frames_split_anywhere() -> None:
    frames = (
        b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n"
        b">3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$10\r\ngranted:42\r\n"
        b"-NOPERM no pubsub\r\n"
        b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$-1\r\n"
    )
    reader = _subscriber.PushReader(lambda message: RuntimeError(message))
    got: list[Any] = []
    for i in range(len(frames)):  # one byte at a time: every split point
        reader.feed(frames[i : i + 1])
        frame = reader.gets()
        while frame is not False:
            got.append(frame)
            frame = reader.gets()
    assert got[0] == [b"subscribe", b"ch", 1]
    assert got[1] == [b"message", b"ch", b"granted:42"]
    assert isinstance(got[2], RuntimeError)
    assert str(got[2]) == "NOPERM no pubsub"
    assert got[3] == [b"message", b"ch", None]
    assert len(got) == 4


def test_a_release_wakes_the_waiter_through_the_subscriber(reader: str, make_client: Callable[..., LockClient]) -> None:
    holder, waiter = make_client(), make_client()

    async def main() -> None:
        held = holder.lock("k", lease=30)
        await held.__aenter__()
        entered = asyncio.Event()

        async def wait() -> None:
            async with waiter.lock("k", wait=30, lease=30):
                entered.set()

        task = asyncio.create_task(wait())
        while _notifier(waiter) is None or not _notifier(waiter).listening("k"):
            await asyncio.sleep(0.01)
        assert not entered.is_set()
        await held.__aexit__(None, None, None)
        await asyncio.wait_for(task, 10)  # woken by the release, far before any poll
        assert isinstance(_notifier(waiter)._pubsub._reader, _subscriber.PushReader) == (reader == "pure")
        await holder.aclose()
        await waiter.aclose()

    asyncio.run(main())


def test_idle_channels_are_unsubscribed(
    reader: str, lock_server: LockServer, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_channels, "IDLE_UNSUBSCRIBE", 0.0)

    async def main() -> None:
        store = AsyncRedisStore(redis.asyncio.Redis.from_url(lock_server.url))
        notifier = store.notifier()
        subscription = await notifier.subscribe("idle", 5.0)
        assert subscription.active
        channel = subscription.channel
        assert raw.pubsub_numsub(channel) == [(channel, 1)]
        notifier.unsubscribe(subscription)
        for _ in range(500):  # the once-a-second check sends UNSUBSCRIBE
            if raw.pubsub_numsub(channel) == [(channel, 0)] and not notifier.listening("idle"):
                break
            await asyncio.sleep(0.01)
        assert raw.pubsub_numsub(channel) == [(channel, 0)]
        assert not notifier.listening("idle")
        # and subscribes again on the same connection
        again = await notifier.subscribe("idle", 5.0)
        assert again.active
        await store.aclose()

    asyncio.run(main())


def test_a_lost_connection_wakes_the_waiters_and_they_subscribe_again(
    reader: str, lock_server: LockServer, raw: Any
) -> None:
    async def main() -> None:
        store = AsyncRedisStore(redis.asyncio.Redis.from_url(lock_server.url))
        notifier = store.notifier()
        subscription = await notifier.subscribe("lost", 5.0)
        assert subscription.active
        raw.client_kill_filter(_type="pubsub")
        assert await subscription.wait(10.0)  # woken by the loss, not by the timeout
        for _ in range(500):
            if notifier._pubsub is None:
                break
            await asyncio.sleep(0.01)
        assert not notifier.listening("lost")
        again = await notifier.subscribe("lost", 5.0)
        assert again.active
        await store.aclose()

    asyncio.run(main())


def test_a_refused_subscribe_leaves_waiters_polling(reader: str, lock_server: LockServer, raw: Any) -> None:
    raw.acl_setuser("nopubsub", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@pubsub"])
    try:

        async def main() -> None:
            url = lock_server.url.replace("redis://", "redis://nopubsub:pw@")
            store = AsyncRedisStore(redis.asyncio.Redis.from_url(url))
            notifier = store.notifier()
            subscription = await notifier.subscribe("refused", 5.0)
            assert not subscription.active
            assert not (await notifier.subscribe("refused", 5.0)).active  # not asked again for a while
            await store.aclose()

        asyncio.run(main())
    finally:
        raw.acl_deluser("nopubsub")


def test_a_closed_subscriber_connection_is_closed_for_redis_py_too(
    reader: str, lock_server: LockServer, raw: Any
) -> None:
    """The connection taken over still tells redis-py's stream protocol that it closed: its
    ``disconnect()`` (a pool's ``disconnect``, ``aclose``) awaits ``wait_closed()``, which
    would otherwise never return."""

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(lock_server.url)
        lost = asyncio.Event()
        subscriber = await _subscriber.Subscriber.open(
            client.connection_pool, lambda _s, _frame: None, lambda _s, _exc: lost.set()
        )
        writer = subscriber._connection._writer
        subscriber.send(b"SUBSCRIBE", b"closing")
        while not raw.pubsub_channels("closing"):
            await asyncio.sleep(0.01)
        raw.client_kill_filter(_type="pubsub")
        await asyncio.wait_for(lost.wait(), 30)  # a deadlock guard, not a speed expectation
        await asyncio.wait_for(writer.wait_closed(), 30)
        await subscriber.close()
        await client.aclose()

    asyncio.run(main())
