"""RedLock over five real, independent servers: a majority holds the lock, two servers down
is survivable, three down fails cleanly, a minority held elsewhere does not matter,
renewals count on a majority, async, and what RedLock refuses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from lockaspect import BackendError, ConfigurationError, LockClient, LockLost, LockNotAcquired
from lockaspect.testing import LockServer

LIVENESS = 30.0


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIVENESS
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


class Cluster:
    def __init__(self, servers: list[LockServer], namespace: str) -> None:
        self.servers = servers
        self.namespace = namespace
        self.raws = [server.redis() for server in servers]

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def holding(self, key: str) -> int:
        """How many live servers have the lock key."""
        count = 0
        for server, raw in zip(self.servers, self.raws, strict=True):
            if server.process is not None and raw.exists(f"{self.namespace}{{{key}}}"):
                count += 1
        return count

    def client(self, stack: ExitStack, **options: Any) -> LockClient:
        return stack.enter_context(LockClient.from_urls(self.urls, namespace=self.namespace, **options))


@pytest.fixture
def cluster(namespace: str) -> Iterator[Cluster]:
    with ExitStack() as stack:
        servers = [stack.enter_context(LockServer()) for _ in range(5)]
        yield Cluster(servers, namespace)


class TestMajority:
    def test_held_on_every_node_and_released_everywhere(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client, other = cluster.client(stack), cluster.client(stack)
            with client.lock("k") as lease:
                assert cluster.holding("k") == 5
                assert lease.fencing_token > 0
                with pytest.raises(LockNotAcquired), other.lock("k"):
                    pytest.fail("the lock is held")
            assert cluster.holding("k") == 0

    def test_two_nodes_down_still_works(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client = cluster.client(stack)
            cluster.servers[0].kill()
            cluster.servers[1].kill()
            with client.lock("k"):
                assert cluster.holding("k") == 3
            assert cluster.holding("k") == 0

    def test_three_nodes_down_fails_cleanly(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client = cluster.client(stack)
            for server in cluster.servers[:3]:
                server.kill()
            with pytest.raises(BackendError, match="2 of 5"), client.lock("k"):
                pytest.fail("no majority")
            assert cluster.holding("k") == 0, "the two live nodes keep nothing"
            assert client.stats().held == 0

    def test_a_minority_held_by_someone_else_does_not_stop_a_majority(self, cluster: Cluster) -> None:
        for raw in cluster.raws[:2]:
            raw.hset(f"{cluster.namespace}{{k}}", mapping={"f" * 32: 1, "fence": 1})
            raw.pexpire(f"{cluster.namespace}{{k}}", 30_000)
        with ExitStack() as stack:
            client = cluster.client(stack)
            with client.lock("k"):
                assert cluster.holding("k") == 5
            cluster.raws[2].hset(f"{cluster.namespace}{{j}}", mapping={"f" * 32: 1, "fence": 1})
            for raw in cluster.raws[:2]:
                raw.hset(f"{cluster.namespace}{{j}}", mapping={"f" * 32: 1, "fence": 1})
            with pytest.raises(LockNotAcquired), client.lock("j"):
                pytest.fail("a majority is held by someone else")
            for raw in cluster.raws[3:]:
                assert raw.exists(f"{cluster.namespace}{{j}}") == 0, "what the minority granted is given back"


class TestRenewal:
    def test_renewals_count_on_a_majority(self, cluster: Cluster) -> None:
        """Renewed through two nodes dying; lost when the third dies (no majority renews it)."""
        with ExitStack() as stack:
            client = cluster.client(stack, watchdog_lease=1.0)

            def hold() -> None:
                with client.lock("long") as lease:
                    wait_until(lambda: client.stats().renewals >= 1, "a renewal")
                    cluster.servers[0].kill()
                    cluster.servers[1].kill()
                    before = client.stats().renewals
                    wait_until(lambda: client.stats().renewals >= before + 2, "renewals on 3 of 5")
                    assert not lease.lost
                    cluster.servers[2].kill()
                    wait_until(lambda: lease.lost, "the lease to be lost without a majority")

            with pytest.raises(LockLost):
                hold()


class TestAsyncAndLimits:
    def test_async_with(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client = cluster.client(stack)

            async def main() -> int:
                async with client.lock("a") as lease:
                    assert cluster.holding("a") == 5
                    token = lease.fencing_token
                await client.aclose()
                return token

            assert asyncio.run(main()) > 0
            assert cluster.holding("a") == 0

    def test_single_server_kinds_are_refused_before_any_io(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client = cluster.client(stack)
            for block in (
                client.fair_lock("f"),
                client.semaphore("s", permits=2),
                client.rw_lock("r").read(),
                client.multi_lock(["m1", "m2"]),
            ):
                with pytest.raises(ConfigurationError, match="RedLock"), block:
                    pytest.fail("refused")
            assert sum(raw.dbsize() for raw in cluster.raws) == 0

    @pytest.mark.parametrize(
        ("urls", "error"),
        [
            (lambda c: c.urls[:2], ConfigurationError),
            (lambda c: [c.urls[0]] * 3, ConfigurationError),
            (lambda c: c.urls[0], TypeError),
            (lambda c: ["http://x", *c.urls[:2]], ConfigurationError),
        ],
    )
    def test_bad_urls(self, cluster: Cluster, urls: Callable[[Cluster], Any], error: type[Exception]) -> None:
        with pytest.raises(error):
            LockClient.from_urls(urls(cluster))
