"""RedLock's lease ends at its validity time, not at the lease: on real, independent servers.

The algorithm trusts a RedLock lease for the validity time: the lease minus the time the
round trips took minus a clock-drift allowance (1% of the lease + 2 ms). The backend reports
that validity, counted from when the request was sent: ``AcquireResult.valid_for`` on
acquire, and a float per renewed item from ``renew`` (``False``: not ours, ``None``: not
decided, retry). The client must end the lease there. Relations only, no durations: each
reported validity is at most the lease minus the drift allowance, at least the lease minus
the time the call took around it minus the allowance, and never past any node's own lease
end (read with PTTL).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from lockaspect import BackendError, LockClient
from lockaspect.backends.base import AcquireRequest
from lockaspect.backends.redlock import AsyncRedlockBackend, RedlockBackend
from lockaspect.testing import LockServer

#: Long enough that the drift allowance dwarfs millisecond rounding and scheduling noise.
LEASE = 60.0


def drift(lease: float) -> float:
    """The clock-drift allowance of Redis's RedLock description: 1% of the lease + 2 ms."""
    return lease * 0.01 + 0.002


class Cluster:
    def __init__(self, servers: list[LockServer], namespace: str, stack: ExitStack) -> None:
        self.servers = servers
        self.namespace = namespace
        self.raws = [server.redis() for server in servers]
        for raw in self.raws:
            stack.callback(raw.close)
        self.stack = stack

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def backend(self) -> RedlockBackend:
        backend = RedlockBackend.from_urls(self.urls, namespace=self.namespace)
        self.stack.callback(backend.close)
        return backend

    def node_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}"

    def assert_ends_before_every_node(self, key: str, sent: float, valid_for: float) -> None:
        """``sent + valid_for`` is no later than the lease end on any node holding ``key``.

        A node's end is ``t + PTTL`` for the instant ``t`` it answered, which is after our
        clock read before asking: so that read plus the PTTL is a lower bound of the end."""
        for server, raw in zip(self.servers, self.raws, strict=True):
            if server.process is None:
                continue
            before = time.monotonic()
            remaining_ms = raw.pttl(self.node_key(key))
            assert remaining_ms > 0, f"{server} holds {key!r}"
            assert sent + valid_for <= before + remaining_ms / 1000, f"trusted past {server}'s lease end"


def cluster_of(size: int, namespace: str) -> Iterator[Cluster]:
    with ExitStack() as stack:
        servers = [stack.enter_context(LockServer()) for _ in range(size)]
        yield Cluster(servers, namespace, stack)


@pytest.fixture
def cluster(namespace: str) -> Iterator[Cluster]:
    yield from cluster_of(5, namespace)


@pytest.fixture
def cluster4(namespace: str) -> Iterator[Cluster]:
    yield from cluster_of(4, namespace)


def token() -> str:
    return uuid.uuid4().hex


def assert_validity(valid_for: Any, lease: float, took: float) -> None:
    """A float (not ``True``, not ``None``) with the lease's round trips and drift taken off."""
    assert type(valid_for) is float, f"a validity in seconds, got {valid_for!r}"
    assert valid_for <= lease - drift(lease), "the drift allowance is taken off the lease"
    # the backend measured its round trips inside the call, so they took at most ``took``
    assert valid_for >= lease - took - drift(lease)
    assert valid_for > 0


class TestAcquire:
    def test_acquire_reports_the_validity_not_the_lease(self, cluster: Cluster) -> None:
        backend, owner = cluster.backend(), token()
        sent = time.monotonic()
        result = backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE))
        took = time.monotonic() - sent
        assert result.acquired
        assert_validity(result.valid_for, LEASE, took)
        assert result.valid_for is not None
        cluster.assert_ends_before_every_node("k", sent, result.valid_for)

    def test_acquire_with_two_nodes_down_reports_the_validity(self, cluster: Cluster) -> None:
        backend, owner = cluster.backend(), token()
        cluster.servers[0].kill()
        cluster.servers[1].kill()
        sent = time.monotonic()
        result = backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE))
        took = time.monotonic() - sent
        assert result.acquired
        assert_validity(result.valid_for, LEASE, took)
        assert result.valid_for is not None
        cluster.assert_ends_before_every_node("k", sent, result.valid_for)

    def test_a_busy_lock_reports_no_validity(self, cluster: Cluster) -> None:
        backend = cluster.backend()
        assert backend.acquire(AcquireRequest("lock", ("k",), token(), LEASE)).acquired
        busy = backend.acquire(AcquireRequest("lock", ("k",), token(), LEASE))
        assert not busy.acquired
        assert busy.valid_for is None

    def test_async_acquire_reports_the_validity(self, cluster: Cluster) -> None:
        backend: AsyncRedlockBackend = cluster.backend().asyncio_twin()

        async def main() -> tuple[float, float, Any]:
            try:
                sent = time.monotonic()
                result = await backend.acquire(AcquireRequest("lock", ("k",), token(), LEASE))
                return sent, time.monotonic() - sent, result
            finally:
                await backend.aclose()

        sent, took, result = asyncio.run(main())
        assert result.acquired
        assert_validity(result.valid_for, LEASE, took)
        cluster.assert_ends_before_every_node("k", sent, result.valid_for)


class TestRenew:
    def test_each_renewed_item_reports_its_own_validity(self, cluster: Cluster) -> None:
        backend, owner = cluster.backend(), token()
        leases = {"a": LEASE, "b": 2 * LEASE}
        for key in leases:
            assert backend.acquire(AcquireRequest("lock", (key,), owner, 1.0)).acquired
        sent = time.monotonic()
        statuses = backend.renew([(key, owner, lease) for key, lease in leases.items()])
        took = time.monotonic() - sent
        assert len(statuses) == len(leases)
        for (key, lease), status in zip(leases.items(), statuses, strict=True):
            assert_validity(status, lease, took)
            assert isinstance(status, float)
            cluster.assert_ends_before_every_node(key, sent, status)

    def test_renewed_by_a_bare_majority(self, cluster: Cluster) -> None:
        backend, owner = cluster.backend(), token()
        assert backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE)).acquired
        for raw in cluster.raws[:2]:
            raw.delete(cluster.node_key("k"))
        sent = time.monotonic()
        (status,) = backend.renew([("k", owner, LEASE)])
        assert_validity(status, LEASE, time.monotonic() - sent)

    def test_not_ours_once_a_majority_says_so(self, cluster: Cluster) -> None:
        backend, owner = cluster.backend(), token()
        assert backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE)).acquired
        for raw in cluster.raws[:3]:
            raw.delete(cluster.node_key("k"))
        assert backend.renew([("k", owner, LEASE)]) == [False]

    def test_not_ours_once_no_majority_can_renew_it_on_an_even_cluster(self, cluster4: Cluster) -> None:
        """4 nodes, 3 needed: 2 saying "not ours" leave no majority, though 2 renewed it."""
        backend, owner = cluster4.backend(), token()
        assert backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE)).acquired
        for raw in cluster4.raws[:2]:
            raw.delete(cluster4.node_key("k"))
        assert backend.renew([("k", owner, LEASE)]) == [False]

    def test_undecided_when_the_missing_node_could_tip_it(self, cluster: Cluster) -> None:
        """2 renewed, 2 not ours, 1 unreachable: neither side has a majority: retry."""
        backend, owner = cluster.backend(), token()
        assert backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE)).acquired
        for raw in cluster.raws[:2]:
            raw.delete(cluster.node_key("k"))
        cluster.servers[4].kill()
        assert backend.renew([("k", owner, LEASE)]) == [None]

    def test_too_few_nodes_answering_is_a_backend_error(self, cluster: Cluster) -> None:
        backend, owner = cluster.backend(), token()
        assert backend.acquire(AcquireRequest("lock", ("k",), owner, LEASE)).acquired
        for server in cluster.servers[:3]:
            server.kill()
        with pytest.raises(BackendError, match="2 of 5"):
            backend.renew([("k", owner, LEASE)])

    def test_async_renew_reports_the_validity(self, cluster: Cluster) -> None:
        backend: AsyncRedlockBackend = cluster.backend().asyncio_twin()
        owner = token()

        async def main() -> tuple[float, float, list[Any]]:
            try:
                assert (await backend.acquire(AcquireRequest("lock", ("k",), owner, 1.0))).acquired
                sent = time.monotonic()
                statuses = await backend.renew([("k", owner, LEASE)])
                return sent, time.monotonic() - sent, list(statuses)
            finally:
                await backend.aclose()

        sent, took, (status,) = asyncio.run(main())
        assert_validity(status, LEASE, took)
        cluster.assert_ends_before_every_node("k", sent, status)


class TestClientLease:
    """The lease the client hands out ends at the validity (needs the client to use
    ``AcquireResult.valid_for``)."""

    def test_lease_ends_at_the_validity(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client = stack.enter_context(LockClient.from_urls(cluster.urls, namespace=cluster.namespace))
            lease = stack.enter_context(client.lock("k", lease=LEASE))
            assert lease.expires_in <= LEASE - drift(LEASE)

    def test_watchdog_lease_ends_at_the_validity(self, cluster: Cluster) -> None:
        with ExitStack() as stack:
            client = stack.enter_context(
                LockClient.from_urls(cluster.urls, namespace=cluster.namespace, watchdog_lease=LEASE)
            )
            lease = stack.enter_context(client.lock("k"))
            assert lease.expires_in <= LEASE - drift(LEASE)

    def test_async_lease_ends_at_the_validity(self, cluster: Cluster) -> None:
        client = LockClient.from_urls(cluster.urls, namespace=cluster.namespace)

        async def main() -> float:
            try:
                async with client.lock("k", lease=LEASE) as lease:
                    return lease.expires_in
            finally:
                await client.aclose()

        try:
            assert asyncio.run(main()) <= LEASE - drift(LEASE)
        finally:
            client.close()
