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
from lockaspect.errors import BackendError
from lockaspect.testing import ValkeyCluster, ValkeyNode

from ._support import BOUND, GRANT_BOUND, LostHook, has_key, in_thread, lock_key, renewed_on, same_slot_key, until

Make = Callable[..., LockClient]


def tryagain_count(node: ValkeyNode) -> int:
    """How many TRYAGAIN replies ``node`` sent (its ``INFO errorstats``)."""
    with node.client() as raw:
        stats = raw.info("errorstats").get("errorstat_TRYAGAIN")
    return int(stats["count"]) if stats else 0


class TestHeldLockThroughAMigration:
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
            # The lock's empty waiter queue exists on neither node, so the importing node
            # cannot tell whether it is still to come: TRYAGAIN until the migration ends. The
            # attempt is refused, or fails transiently: never granted.
            with pytest.raises((LockNotAcquired, BackendError)) as caught, other.lock(key, wait=1.0):
                pass  # pragma: no cover
            assert not isinstance(caught.value, BackendError) or caught.value.transient
            assert lease.held
            # The release meets TRYAGAIN too, and is sent again (it did not run) while the
            # migration ends: it must land, before or after MOVED.
            finishing = threading.Thread(target=migration.finish)
            finishing.start()
        finishing.join(BOUND)
        assert not hook.leases
        assert not has_key(target, name), "the release never landed"
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
        finished.set()
        migration.finish()
        thread.join(GRANT_BOUND)
        assert not thread.is_alive(), "the multi-key lock was never taken after the migration"
        assert outcome == [True]
