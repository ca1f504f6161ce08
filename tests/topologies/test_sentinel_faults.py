"""The ``redis+sentinel://`` store through real master changes: ``SENTINEL FAILOVER`` with the
old master demoted at once (sync and asyncio, with and without ``wait_replicas``) and left
writable (the ~11 s split brain Sentinel itself allows), a SIGKILL of the master with a holder
and a blocked waiter, and lock commands sent on connections kept from before a failover.

Each test has a sentinel set of its own (master, replica, 3 sentinels; ~0.05 s to start).
States are awaited with :data:`~._support.BOUND` as the only deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lockaspect import LockClient
from lockaspect.testing import ValkeyNode, ValkeySentinel

from ._support import (
    BOUND,
    LostHook,
    Recorder,
    has_key,
    held_through_a_kill,
    lock_key,
    pttl,
    refused,
    refused_async,
    renewed_on,
    until,
)

Make = Callable[..., LockClient]

#: A lease that outlives the ~1.1 s during which the sentinels disagree about the master
#: after SENTINEL FAILOVER (a reconnection may be sent to the demoted one meanwhile):
#: 4 s, renewed every 0.6 s.
OUTLIVES_SWITCH = {"watchdog_lease": 4.0, "delay_weight": 0.15}


def replicated(sentinel: ValkeySentinel, name: str) -> ValkeyNode:
    """Wait until the replica has ``name``; the replica."""
    [replica] = sentinel.replicas
    until(lambda: has_key(replica, name), f"the replica to have {name!r}")
    return replica


class TestFailoverWithTheOldMasterDemoted:
    def test_the_lease_is_kept_on_the_new_master_and_released_there(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        hook = LostHook()
        holder = make(sentinel.url, **OUTLIVES_SWITCH)
        other = make(sentinel.url)
        name = lock_key(holder, key)
        with holder.lock(key, on_lost=hook) as lease:
            old = sentinel.master
            replicated(sentinel, name)
            refused(other, key)
            new = sentinel.failover(demote_old=True)
            assert new is not old
            renewed_on(new, name)
            refused(other, key, wait=1.0)  # its kept connection is on a replica now
            assert lease.held
            assert not hook.leases
        assert not has_key(new, name)
        with other.lock(key, wait=1.0) as second:
            assert second.fencing_token > lease.fencing_token
        assert not hook.leases

    def test_async_the_lease_is_kept_on_the_new_master_and_released_there(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        hook = LostHook()
        holder = make(sentinel.url, **OUTLIVES_SWITCH)
        other = make(sentinel.url)
        name = lock_key(holder, key)

        async def main() -> tuple[int, int, ValkeyNode]:
            try:
                async with holder.lock(key, on_lost=hook) as lease:
                    await asyncio.to_thread(replicated, sentinel, name)
                    await refused_async(other, key)
                    new = await asyncio.to_thread(sentinel.failover, True)
                    await asyncio.to_thread(renewed_on, new, name)
                    assert lease.held
                    assert not hook.leases
                async with other.lock(key, wait=1.0) as second:
                    return lease.fencing_token, second.fencing_token, new
            finally:
                await holder.aclose()
                await other.aclose()

        first, second, new = asyncio.run(main())
        assert second > first
        assert not has_key(new, name)
        assert not hook.leases

    def test_with_wait_replicas_the_replica_has_the_lock_before_the_body_and_keeps_it(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        hook = LostHook()
        holder = make(sentinel.url, wait_replicas=(1, 0.5), **OUTLIVES_SWITCH)
        other = make(sentinel.url)
        name = lock_key(holder, key)
        [replica] = sentinel.replicas
        with holder.lock(key, on_lost=hook) as lease:
            # No NotReplicated: WAIT counted the replica, so it has the lock already.
            assert has_key(replica, name)
            new = sentinel.failover(demote_old=True)
            assert new is replica
            renewed_on(new, name)
            refused(other, key, wait=1.0)
            assert lease.held
        assert not hook.leases
        assert not has_key(new, name)


class TestFailoverWithTheOldMasterStillWritable:
    def test_the_store_follows_the_sentinels_to_the_new_master(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        """A lease must outlast the switch (the sentinels' ~1.1 s, plus up to FOLLOW_EVERY
        until the store asks them): 4 s here. A shorter one can run out on the new master
        before the store moves there (see docs/stores/redis.md)."""
        hook = LostHook()
        holder = make(sentinel.url, watchdog_lease=4.0, delay_weight=0.15)
        name = lock_key(holder, key)
        with holder.lock(key, on_lost=hook) as lease:
            old = sentinel.master
            replicated(sentinel, name)
            new = sentinel.failover(demote_old=False)
            assert old.role() == "master", "the old master was meant to stay writable"
            # Within FOLLOW_EVERY (1 s) of renewals the store asks the sentinels and moves.
            renewed_on(new, name)
            # From then on renewals land on the new master only: the old one's copy is left
            # to run down while the new one's is extended.
            before = pttl(old, name)
            renewed_on(new, name)
            after = pttl(old, name)
            # (-2: the old master's copy is gone, so nothing renews it there either. Once the
            # sentinels have turned the old master into a replica, its copy follows the new
            # master's by replication: no renewal of ours.)
            if old.role() == "master":
                assert after < before or after == -2, (
                    f"a renewal still went to the old master (PTTL {before} -> {after})"
                )
            # A client made now is sent to the new master by the sentinels, and finds it held.
            late = make(sentinel.url)
            refused(late, key)
            assert lease.held
            assert not hook.leases
        assert not has_key(new, name)
        with late.lock(key) as second:
            assert second.fencing_token > lease.fencing_token


class TestKilledMaster:
    def test_the_holder_keeps_the_lock_or_is_told_and_a_blocked_waiter_gets_it_after(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        # An 8 s lease outlives the promotion (~2.3 s); renewed every 0.8 s.
        holder = make(sentinel.url, watchdog_lease=8.0, delay_weight=0.1)
        waits = Recorder()
        waiter = make(sentinel.url, observers=[waits])
        held_through_a_kill(holder, waiter, waits, key, sentinel.kill_master, lambda: refused(make(sentinel.url), key))


class TestReadOnlyFormerMaster:
    def test_a_connection_kept_from_before_the_failover_sends_the_lock_to_the_new_master(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        client = make(sentinel.url)
        name = lock_key(client, key)
        old = sentinel.master
        with client.lock(key):
            pass  # leaves an idle lock connection to the old master
        new = sentinel.failover(demote_old=True)
        assert old.role() == "slave"
        with client.lock(key, wait=BOUND) as lease:
            assert has_key(new, name)
            assert lease.held
        assert not has_key(new, name)

    def test_async_a_connection_kept_from_before_the_failover_sends_the_lock_to_the_new_master(
        self, sentinel: ValkeySentinel, make: Make, key: str
    ) -> None:
        client = make(sentinel.url)
        name = lock_key(client, key)

        async def main() -> bool:
            try:
                async with client.lock(key):
                    pass
                new = await asyncio.to_thread(sentinel.failover, True)
                async with client.lock(key, wait=BOUND):
                    return await asyncio.to_thread(has_key, new, name)
            finally:
                await client.aclose()

        assert asyncio.run(main())
