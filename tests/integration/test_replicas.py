"""``wait_replicas``: a lock counts as taken only once enough replicas have it (``WAIT``),
against a real primary and a real replica on loopback; the replica is paused (SIGSTOP) to
make it miss the deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lockaspect import ConfigurationError, LockClient, LockError, NotReplicated, distributed_lock
from lockaspect.testing import LockServer

LINK_TIMEOUT = 30.0  # a deadlock guard for the replication link, not a speed expectation


class Pair:
    def __init__(self, primary: LockServer, replica: LockServer) -> None:
        self.primary = primary
        self.replica = replica
        self.primary_redis = primary.redis()
        self.replica_redis = replica.redis()

    def link_up(self) -> None:
        deadline = time.monotonic() + LINK_TIMEOUT
        while self.replica_redis.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never connected"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with LockServer() as primary, LockServer(args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
        made = Pair(primary, replica)
        made.link_up()
        yield made
        replica.resume()


@pytest.fixture
def client(pair: Pair, namespace: str) -> Iterator[LockClient]:
    with LockClient.from_url(pair.primary.url, namespace=namespace, wait_replicas=(1, 0.3)) as made:
        yield made


def paused(pair: Pair) -> Any:
    """A context in which the replica answers nothing (so it confirms nothing)."""

    class _Paused:
        def __enter__(self) -> None:
            pair.replica.pause()

        def __exit__(self, *exc: object) -> None:
            pair.replica.resume()
            pair.link_up()

    return _Paused()


class TestConfirmed:
    def test_the_replica_has_the_lock_before_the_body_runs(self, pair: Pair, client: LockClient) -> None:
        with client.lock("order:1") as lease:
            assert pair.replica_redis.exists(client.backend.lock_key("order:1")) == 1
            assert int(pair.replica_redis.hget(client.backend.lock_key("order:1"), "fence")) == lease.fencing_token
        assert client.stats().acquired == 1

    def test_async_with_is_confirmed_too(self, pair: Pair, client: LockClient) -> None:
        async def main() -> int:
            async with client.lock("order:2"):
                found: int = pair.replica_redis.exists(client.backend.lock_key("order:2"))
            await client.aclose()
            return found

        assert asyncio.run(main()) == 1


class TestNotConfirmed:
    def test_unconfirmed_lock_is_released_and_the_call_fails(self, pair: Pair, client: LockClient) -> None:
        ran = []

        @distributed_lock("job:<n>", client=client)
        def job(n: int) -> None:
            ran.append(n)

        with paused(pair), pytest.raises(NotReplicated) as caught:
            job(7)
        assert ran == []
        assert caught.value.key == "job:7"
        assert caught.value.replicas == 0
        assert caught.value.wanted == 1
        assert pair.primary_redis.exists(client.backend.lock_key("job:7")) == 0, "released on the primary"
        assert client.stats().held == 0
        assert client.stats().acquired == 0
        job(8)  # with the replica back, the next call goes through
        assert ran == [8]

    def test_unconfirmed_async_lock_is_released(self, pair: Pair, client: LockClient) -> None:
        async def main() -> None:
            with paused(pair), pytest.raises(NotReplicated):
                async with client.lock("order:3"):
                    pytest.fail("the body must not run")
            assert pair.primary_redis.exists(client.backend.lock_key("order:3")) == 0
            await client.aclose()

        asyncio.run(main())

    @pytest.mark.parametrize("kind", ["semaphore", "read", "write"])
    def test_every_lock_kind_is_checked(self, pair: Pair, client: LockClient, kind: str) -> None:
        """Semaphore permits and read-write holds are confirmed like locks: none is granted unconfirmed."""
        block = (
            client.semaphore("kinds", permits=2) if kind == "semaphore" else getattr(client.rw_lock("kinds"), kind)()
        )
        with paused(pair), pytest.raises(NotReplicated), block:
            pytest.fail("the body must not run")
        if kind == "semaphore":
            assert client.permits("kinds")[1] == 0
        else:
            keys = client.backend.rw_keys("kinds")
            assert pair.primary_redis.exists(keys["writer"]) == 0
            assert pair.primary_redis.zcard(keys["readers"]) == 0

    def test_more_replicas_than_there_are(self, pair: Pair, namespace: str) -> None:
        with LockClient.from_url(pair.primary.url, namespace=namespace, wait_replicas=(2, 0.2)) as client:
            with pytest.raises(NotReplicated) as caught, client.lock("order:4"):
                pytest.fail("the body must not run")
            assert caught.value.replicas == 1
            assert caught.value.wanted == 2
            assert pair.primary_redis.exists(client.backend.lock_key("order:4")) == 0


class TestBadInput:
    @pytest.mark.parametrize(
        ("value", "error"),
        [
            ((0, 0.5), ConfigurationError),
            ((1, 0), ConfigurationError),
            ((1, 2.0), ConfigurationError),  # not shorter than the 2 s socket timeout
            (("1", 0.5), TypeError),
            ((True, 0.5), TypeError),
            ([1, 0.5], TypeError),
            ((1,), TypeError),
            ((1, "0.5"), TypeError),
        ],
    )
    def test_rejected_when_the_client_is_built(
        self, lock_server: LockServer, namespace: str, value: object, error: type[Exception]
    ) -> None:
        with pytest.raises(error, match="wait_replicas"):
            LockClient.from_url(lock_server.url, namespace=namespace, wait_replicas=value)  # type: ignore[arg-type]

    def test_a_longer_socket_timeout_allows_up_to_two_seconds(self, lock_server: LockServer, namespace: str) -> None:
        with LockClient.from_url(
            lock_server.url, namespace=namespace, wait_replicas=(1, 2.0), socket_timeout=10.0
        ) as client:
            assert client.wait_replicas == (1, 2.0)
        with pytest.raises(ConfigurationError, match="at most 2s"):
            LockClient.from_url(lock_server.url, namespace=namespace, wait_replicas=(1, 2.5), socket_timeout=10.0)


class TestWaitRefused:
    """``WAIT`` refused by the server (an ACL without it, a proxy that does not pass it on):
    the lock the script took in front of it is given back before the error reaches the caller,
    also when the script was not cached (its NOSCRIPT reply is not hidden by the refusal)."""

    @pytest.fixture
    def refusing_url(self, lock_server: LockServer) -> Iterator[str]:
        raw = lock_server.redis()
        raw.acl_setuser(
            "nowait", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all", "-wait"]
        )
        try:
            yield lock_server.url.replace("redis://", "redis://nowait:pw@")
        finally:
            raw.acl_deluser("nowait")
            raw.close()

    @pytest.mark.parametrize("cached", [True, False], ids=["cached", "cold"])
    def test_sync(self, lock_server: LockServer, refusing_url: str, namespace: str, cached: bool) -> None:
        raw = lock_server.redis()
        _cache_scripts(lock_server, namespace, cached)
        with LockClient.from_url(refusing_url, namespace=namespace, wait_replicas=(1, 0.3)) as client:
            with pytest.raises(LockError, match=r"(?i)wait") as refused, client.lock("refused"):
                pytest.fail("the body ran")
            assert refused.value.key == "refused"
            assert raw.exists(client.backend.lock_key("refused")) == 0
        raw.close()

    @pytest.mark.parametrize("cached", [True, False], ids=["cached", "cold"])
    def test_asyncio(self, lock_server: LockServer, refusing_url: str, namespace: str, cached: bool) -> None:
        raw = lock_server.redis()
        client = LockClient.from_url(refusing_url, namespace=namespace, wait_replicas=(1, 0.3))

        _cache_scripts(lock_server, namespace, cached)

        async def main() -> None:
            with pytest.raises(LockError, match=r"(?i)wait") as refused:
                async with client.lock("refused"):
                    pytest.fail("the body ran")
            assert refused.value.key == "refused"
            await client.aclose()  # waits for what the store sends in the background

        try:
            asyncio.run(main())
            assert raw.exists(client.backend.lock_key("refused")) == 0
        finally:
            client.close()
            raw.close()


def _cache_scripts(server: LockServer, namespace: str, cached: bool) -> None:
    """Have the server's script cache hold lockaspect's scripts (a lock cycle by a client
    that does not wait for replicas), or hold nothing."""
    raw = server.redis()
    try:
        raw.script_flush()
        if cached:
            with LockClient.from_url(server.url, namespace=namespace) as plain, plain.lock("warm-up"):
                pass
            assert raw.info("memory")["number_of_cached_scripts"] > 0
    finally:
        raw.close()
