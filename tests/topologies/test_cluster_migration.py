"""The ``redis+cluster://`` store while a slot moves between primaries: a held lock through
the ``ASK`` window (its keys already on the importing node) and after ``MOVED``, and a
multi-key lock over one slot whose keys are split between the two nodes (``TRYAGAIN``).

Each test has a cluster of its own; the migration is driven step by step with
:meth:`~lockaspect.testing.ValkeyCluster.migrate_slot`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from redis.crc import key_slot

from lockaspect import LockClient, LockNotAcquired
from lockaspect.testing import ValkeyCluster, ValkeyNode

from ._support import BOUND, GRANT_BOUND, LostHook, has_key, in_thread, lock_key, renewed_on, same_slot_key, until

Make = Callable[..., LockClient]


TRYAGAIN_NOT_TRANSIENT = (
    "TRYAGAIN is mapped as a permanent error. A script whose keys are split by a migration "
    "(valkey counts an absent key, e.g. the empty ':waiters' queue, as 'not here') gets "
    "'TRYAGAIN Multiple keys request during rehashing of slot'; redis-py parses it into "
    "redis.exceptions.TryAgainError whose str() drops the 'TRYAGAIN' prefix, and "
    "_client.py map_redis_error only checks isinstance(ConnectionError, TimeoutError, OSError, "
    "ClusterError, AskError) or a ResponseError *starting with* 'TRYAGAIN'/'READONLY'/..., so "
    "transient=False. Effects seen: a waiting acquire (wait=1 s) or multi_lock (wait=30 s) fails "
    "at once with BackendError(TryAgainError) instead of retrying, and the holder's release in "
    "the ASK window fails ('release ... failed; the key expires with its lease'). Suggested fix: "
    "add redis.exceptions.TryAgainError (and the other prefix-stripped classes: ReadOnlyError, "
    "BusyLoadingError, MasterDownError, ClusterDownError) to the isinstance check, and let "
    "_ClusterWire retry a TRYAGAIN release briefly (the command did not run)."
)


def tryagain_count(node: ValkeyNode) -> int:
    """How many TRYAGAIN replies ``node`` sent (its ``INFO errorstats``)."""
    with node.client() as raw:
        stats = raw.info("errorstats").get("errorstat_TRYAGAIN")
    return int(stats["count"]) if stats else 0


class TestHeldLockThroughAMigration:
    @pytest.mark.xfail(strict=True, reason=TRYAGAIN_NOT_TRANSIENT)
    def test_renewals_refusal_and_release_in_the_ask_window_then_a_new_lock_after_moved(
        self, cluster: ValkeyCluster, make: Make, key: str
    ) -> None:
        hook = LostHook()
        holder = make(cluster.url)
        other = make(cluster.url)
        name = lock_key(holder, key)
        slot = key_slot(key.encode())
        source = cluster.primary_for(slot)
        target = next(node for node in cluster.primaries() if node is not source)
        with holder.lock(key, on_lost=hook) as lease:
            renewed_on(source, name)
            migration = cluster.migrate_slot(slot, target)
            assert migration.move_keys() >= 1  # the lock and its fence: ASK from now on
            renewed_on_importing(target, name)
            with pytest.raises(LockNotAcquired), other.lock(key, wait=1.0):
                pass  # pragma: no cover
            assert lease.held
        assert not hook.leases
        migration.finish()  # MOVED from now on
        assert cluster.primary_for(slot) is target
        with other.lock(key) as second:
            assert second.fencing_token > lease.fencing_token
            assert has_key(target, name)


def renewed_on_importing(node: ValkeyNode, name: str) -> None:
    """:func:`renewed_on` on a node that serves the key behind ``ASKING`` only."""
    with node.client() as raw:

        def pttl() -> int:
            pipe = raw.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.pttl(name)
            return int(pipe.execute()[1])

        for _ in range(2):
            first = pttl()
            assert first > 0, f"{name!r} is not on {node.name} (PTTL {first})"
            until(lambda first=first: pttl() > first, f"a renewal of {name!r} on the importing {node.name}")


class TestMultiKeyLockSplitByAMigration:
    @pytest.mark.xfail(strict=True, reason=TRYAGAIN_NOT_TRANSIENT)
    def test_a_waiting_multi_key_lock_is_retried_through_tryagain_and_taken_after_moved(
        self, cluster: ValkeyCluster, make: Make, key: str
    ) -> None:
        client = make(cluster.url)
        second = same_slot_key(key)
        slot = key_slot(key.encode())
        with client.multi_lock([key, second]):
            pass  # leaves both fence counters in the slot
        source = cluster.primary_for(slot)
        target = next(node for node in cluster.primaries() if node is not source)
        migration = cluster.migrate_slot(slot, target)
        assert migration.move_keys([client.backend.fence_key(key)]) == 1  # type: ignore[attr-defined]
        before = tryagain_count(source) + tryagain_count(target)
        finished = threading.Event()

        def take() -> bool:
            with client.multi_lock([key, second], wait=BOUND) as lease:
                assert lease.held
                return finished.is_set()

        thread, outcome = in_thread(take, "multi-key waiter")
        until(lambda: tryagain_count(source) + tryagain_count(target) > before, "a TRYAGAIN for the split slot")
        assert not outcome, f"taken while the slot's keys were split: {outcome}"
        migration.finish()
        finished.set()
        thread.join(GRANT_BOUND)
        assert not thread.is_alive(), "the multi-key lock was never taken after the migration"
        assert outcome == [True]
