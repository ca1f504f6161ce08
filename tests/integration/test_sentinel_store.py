"""The Sentinel store on a real master, replica and 3 sentinels (the session's
``valkey_sentinel``): URLs, the constructor from a user's ``Sentinel``, the asyncio twin,
``wait_replicas`` and wake-ups. Failovers are in tests/topologies/."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis.sentinel

from lockaspect import LockClient, LockNotAcquired, NotReplicated
from lockaspect.backends.redis.sentinel import AsyncSentinelStore, SentinelStore
from lockaspect.testing import ValkeySentinel

BOUND = 30.0  # a deadlock guard, not a speed expectation


@pytest.fixture
def make_client(make_client: Callable[..., LockClient], valkey_sentinel: ValkeySentinel) -> Callable[..., LockClient]:
    """Clients on the session's topology, in the test's namespace (closed after the test)."""
    return functools.partial(make_client, valkey_sentinel.url)


def test_locks_live_on_the_master(make_client: Callable[..., LockClient], valkey_sentinel: ValkeySentinel) -> None:
    client = make_client()
    assert isinstance(client.backend, SentinelStore)
    assert "redis+sentinel://" in repr(client.backend)
    assert "mymaster" in repr(client.backend)
    master = valkey_sentinel.master.client()
    with client.lock("order:1") as lease:
        assert master.exists(client.backend.lock_key("order:1")) == 1
        assert lease.fencing_token > 0
    assert master.exists(client.backend.lock_key("order:1")) == 0


def test_a_db_in_the_url(valkey_sentinel: ValkeySentinel, namespace: str) -> None:
    client = LockClient.from_url(valkey_sentinel.url + "/3", namespace=namespace)
    try:
        with client.lock("in-db-3"):
            assert valkey_sentinel.master.client(db=3).exists(client.backend.lock_key("in-db-3")) == 1
    finally:
        client.close()


def test_from_sentinel_sync_and_async(valkey_sentinel: ValkeySentinel, namespace: str) -> None:
    sentinel = redis.sentinel.Sentinel(valkey_sentinel.sentinel_addrs, socket_timeout=2.0)
    client = LockClient(SentinelStore.from_sentinel(sentinel, valkey_sentinel.service, namespace=namespace))
    other = LockClient(SentinelStore.from_sentinel(sentinel, valkey_sentinel.service, namespace=namespace))
    try:
        with client.lock("order:2"), pytest.raises(LockNotAcquired), other.lock("order:2", wait=0):
            pass

        async def main() -> None:
            twin = client.backend.asyncio_twin()
            assert isinstance(twin, AsyncSentinelStore)
            await twin.aclose()
            async with client.lock("order:3") as lease:
                assert lease.fencing_token > 0
                with pytest.raises(LockNotAcquired):
                    async with other.lock("order:3", wait=0):
                        pass

        asyncio.run(main())
    finally:
        client.close()
        other.close()
        for connection in sentinel.sentinels:
            connection.close()


def test_wait_replicas(valkey_sentinel: ValkeySentinel, namespace: str) -> None:
    """WAIT behind each acquisition counts the master's replica; asking for more fails."""
    enough = LockClient.from_url(valkey_sentinel.url, namespace=namespace, wait_replicas=(1, 1.0))
    too_many = LockClient.from_url(valkey_sentinel.url, namespace=namespace, wait_replicas=(2, 0.2))
    try:
        with enough.lock("replicated"):
            pass
        with pytest.raises(NotReplicated), too_many.lock("replicated"):
            pass

        async def main() -> None:
            async with enough.lock("replicated-async"):
                pass

        asyncio.run(main())
    finally:
        enough.close()
        too_many.close()


def test_a_release_wakes_a_waiter(make_client: Callable[..., LockClient]) -> None:
    holder, waiter = make_client(), make_client()
    got = threading.Event()

    def wait() -> None:
        with waiter.lock("hot", wait=BOUND):
            got.set()

    with holder.lock("hot"):
        thread = threading.Thread(target=wait)
        thread.start()
        assert not got.wait(0.1)
    assert got.wait(BOUND)
    thread.join(BOUND)


def test_the_master_is_asked_before_renewals(
    make_client: Callable[..., LockClient], valkey_sentinel: ValkeySentinel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog's renewals ask the sentinels who the master is (at most once a second)."""
    client = make_client(watchdog_lease=0.5, tick=0.05)
    store = client.backend
    asked = threading.Event()
    original = store.redis.connection_pool.get_master_address

    def spy() -> Any:
        asked.set()
        return original()

    monkeypatch.setattr(store.redis.connection_pool, "get_master_address", spy)
    with client.lock("renewed"):
        assert asked.wait(BOUND)
    assert store._follow.master == ("127.0.0.1", valkey_sentinel.master.port)


def _until(condition: Callable[[], bool]) -> None:
    deadline = threading.Event()
    for _ in range(int(BOUND / 0.01)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("timed out")


def test_a_client_follows_a_manual_failover_before_its_next_command(namespace: str) -> None:
    """After ``SENTINEL FAILOVER`` the old master stays writable for seconds. A client that
    holds nothing (so renews nothing) and talked to the old master before must still send its
    next lock commands to the new master once it asks the sentinels again (at most
    FOLLOW_EVERY later): it is refused a lock held there, never given a second copy on the
    old master. Also from an event loop."""
    with ValkeySentinel() as topology:
        holder = LockClient.from_url(topology.url, namespace=namespace)
        late = LockClient.from_url(topology.url, namespace=namespace)
        try:
            with late.lock("warm"):  # late's connections are on the old master now
                pass
            old = topology.master
            new = topology.failover(demote_old=False)
            assert old.client().execute_command("ROLE")[0] == b"master"  # still writable
            with holder.lock("x") as lease:
                assert new.client().exists(holder.backend.lock_key("x")) == 1
                _until(late.backend._follow.due)
                with pytest.raises(LockNotAcquired), late.lock("x", wait=0):
                    pass
                assert old.client().exists(late.backend.lock_key("x")) == 0

                async def main() -> None:
                    with pytest.raises(LockNotAcquired):
                        async with late.lock("x", wait=0):
                            pass

                asyncio.run(main())
            assert not lease.lost
        finally:
            holder.close()
            late.close()


def test_the_asyncio_store_renews_on_the_master(valkey_sentinel: ValkeySentinel, namespace: str) -> None:
    from lockaspect.backends.base import AcquireRequest, RenewItem
    from lockaspect.backends.redis.sentinel import SentinelStore as Store

    store = Store.from_sentinel(
        redis.sentinel.Sentinel(valkey_sentinel.sentinel_addrs), "mymaster", namespace=namespace
    )

    async def main() -> list[bool | None]:
        twin = store.asyncio_twin()
        try:
            assert (await twin.acquire(AcquireRequest("lock", ("r",), "tok", 5.0))).acquired
            return list(await twin.renew([RenewItem("r", "tok", 60.0), RenewItem("r", "other", 60.0)]))
        finally:
            await twin.aclose()

    try:
        assert asyncio.run(main()) == [True, False]
        assert valkey_sentinel.master.client().pttl(store.lock_key("r")) > 5_000
    finally:
        store.close()
