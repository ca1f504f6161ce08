"""The ``redis+cluster://`` store through real primary changes: a coordinated ``CLUSTER
FAILOVER`` of the primary holding a lock (with every script cache flushed behind it), a SIGKILL
of that primary, and waiters blocked on a lock while its slot's primary changes.

Each test has a cluster of its own (3 primaries, 3 replicas, ~2.1 s to start). What happens
is decided by the servers: the tests wait for states (a key's expiry going up on the new
primary, an ``on_lost`` call, a waiter's thread ending) with :data:`~._support.BOUND` as the
only deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from redis.crc import key_slot

from lockaspect import LockClient
from lockaspect.testing import ValkeyCluster, ValkeyNode

from ._support import (
    GRANT_BOUND,
    LostHook,
    Recorder,
    has_key,
    held_through_a_kill,
    in_thread,
    lock_key,
    no_noscript,
    refused,
    refused_async,
    renewed_on,
    until,
)

Make = Callable[..., LockClient]


def shard_channels(node: ValkeyNode, namespace: str) -> list[bytes]:
    """The sharded channels of the test's namespace that ``node`` has subscribers on."""
    with node.client() as raw:
        return list(raw.execute_command("PUBSUB", "SHARDCHANNELS", f"{namespace}*"))


class TestCoordinatedFailover:
    def test_the_lease_is_kept_and_renewed_on_the_new_primary_without_noscript(
        self, cluster: ValkeyCluster, make: Make, key: str
    ) -> None:
        recorder, hook = Recorder(), LostHook()
        holder = make(cluster.url, observers=[recorder])
        other = make(cluster.url)
        name = lock_key(holder, key)
        with holder.lock(key, on_lost=hook) as lease:
            old = cluster.primary_for(key)
            renewed_on(old, name)
            refused(other, key)  # `other` now routes the slot to the old primary

            new = cluster.failover(key)
            assert new is not old
            cluster.flush_scripts()  # the next EVALSHA anywhere meets NOSCRIPT
            renewed_on(new, name)
            cluster.flush_scripts()
            refused(other, key)  # its slot map is stale: MOVED, then NOSCRIPT, then busy
            assert lease.held
            assert not hook.leases
            cluster.flush_scripts()  # the release meets NOSCRIPT too
        assert not has_key(new, name)
        with other.lock(key) as second:
            assert second.fencing_token > lease.fencing_token
        assert not hook.leases
        no_noscript(recorder)

    def test_async_the_lease_is_kept_and_renewed_on_the_new_primary_without_noscript(
        self, cluster: ValkeyCluster, make: Make, key: str
    ) -> None:
        recorder, hook = Recorder(), LostHook()
        holder = make(cluster.url, observers=[recorder])
        other = make(cluster.url)
        name = lock_key(holder, key)

        async def main() -> tuple[int, int, ValkeyNode]:
            try:
                async with holder.lock(key, on_lost=hook) as lease:
                    old = cluster.primary_for(key)
                    await asyncio.to_thread(renewed_on, old, name)
                    await refused_async(other, key)

                    new = await asyncio.to_thread(cluster.failover, key)
                    assert new is not old
                    await asyncio.to_thread(cluster.flush_scripts)
                    await asyncio.to_thread(renewed_on, new, name)
                    await asyncio.to_thread(cluster.flush_scripts)
                    await refused_async(other, key)
                    assert lease.held
                    assert not hook.leases
                    await asyncio.to_thread(cluster.flush_scripts)
                async with other.lock(key) as second:
                    return lease.fencing_token, second.fencing_token, new
            finally:
                await holder.aclose()
                await other.aclose()

        first, second, new = asyncio.run(main())
        assert second > first
        assert not has_key(new, name)
        assert not hook.leases
        no_noscript(recorder)


def key_on(cluster: ValkeyCluster, base: str, wanted: Callable[[ValkeyNode], bool]) -> str:
    """A user key (``base-<n>``) whose slot's primary satisfies ``wanted``."""
    for i in range(1000):
        candidate = f"{base}-{i}"
        if wanted(cluster.primary_for(candidate)):
            return candidate
    raise AssertionError("no key found on the wanted primary")  # pragma: no cover


class TestKilledPrimary:
    @pytest.mark.parametrize(
        "victim",
        [
            "another-primary",
            "default-node",
        ],
    )
    def test_the_holder_keeps_the_lock_or_is_told_and_a_blocked_waiter_gets_it_after(
        self, cluster: ValkeyCluster, make: Make, key: str, victim: str
    ) -> None:
        # An 8 s lease outlives the promotion (~2.5 s); renewed every 0.8 s.
        holder = make(cluster.url, watchdog_lease=8.0, delay_weight=0.1)
        waits = Recorder()
        waiter = make(cluster.url, observers=[waits])
        other = make(cluster.url)
        default_port = holder.backend.redis.get_default_node().port  # type: ignore[attr-defined]
        key = key_on(cluster, key, lambda node: (node.port == default_port) == (victim == "default-node"))
        slot = key_slot(key.encode())

        def kill() -> ValkeyNode:
            old = cluster.primary_for(slot)
            cluster.kill(old)
            return cluster.wait_primary_changed(slot, old)

        # The other client's first try meets the dead node: wait a little.
        held_through_a_kill(holder, waiter, waits, key, kill, lambda: refused(other, key, wait=1.0))


class TestWakeUpsAcrossAFailover:
    def test_a_waiter_gets_the_lock_released_right_after_its_slot_failed_over(
        self, cluster: ValkeyCluster, make: Make, key: str, namespace: str
    ) -> None:
        holder = make(cluster.url)
        waits = Recorder()
        waiter = make(cluster.url, observers=[waits])
        released = threading.Event()

        def wait_for_it() -> bool:
            with waiter.lock(key, wait=None):
                return released.is_set()

        with holder.lock(key) as lease:
            old = cluster.primary_for(key)
            thread, outcome = in_thread(wait_for_it, "waiter")
            until(lambda: shard_channels(old, namespace), "the waiter to subscribe on the slot's primary")
            new = cluster.failover(key)
            assert new is not old
            # Released at once: the release's SPUBLISH may well reach nobody (the waiter's
            # subscription was dropped with the slot). The waiter must not depend on it.
            released.set()
        thread.join(GRANT_BOUND)
        assert not thread.is_alive(), "the waiter never got the lock after the failover"
        assert outcome == [True]
        assert lease.fencing_token > 0

    def test_async_a_waiter_listens_again_on_the_new_primary_and_gets_the_lock(
        self, cluster: ValkeyCluster, make: Make, key: str, namespace: str
    ) -> None:
        holder = make(cluster.url)
        waiter = make(cluster.url)
        released = threading.Event()

        async def main() -> bool:
            try:
                async with waiter.lock(key, wait=None):
                    return released.is_set()
            finally:
                await waiter.aclose()

        with holder.lock(key):
            old = cluster.primary_for(key)
            thread, outcome = in_thread(lambda: asyncio.run(main()), "async waiter")
            until(lambda: shard_channels(old, namespace), "the waiter to subscribe on the slot's primary")
            new = cluster.failover(key)
            try:
                # A waiter rechecks the lock at least every ~1.1 s: a few rechecks' time.
                until(lambda: shard_channels(new, namespace), "the waiter to subscribe on the new primary", 5.0)
            finally:
                released.set()
        thread.join(GRANT_BOUND)
        assert not thread.is_alive(), "the async waiter never got the lock after the failover"
        assert outcome == [True]
