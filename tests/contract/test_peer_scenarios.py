"""Scenarios ported from the peers' own test suites (redis-py's ``tests/test_lock.py``,
python-redis-lock's ``tests/test_redis_lock.py``, Redisson's ``RedissonLockTest`` and
``RedissonSemaphoreTest``, pottery's ``tests/test_redlock.py``, kazoo's
``kazoo/tests/test_lock.py``), each written against lockaspect's per-lease API and run on
every store (see conftest). Each test names the scenario it ports.
"""

from __future__ import annotations

import asyncio
import gc
import math
import threading
from collections.abc import Callable

import pytest

from lockaspect import ConfigurationError, LockClient, LockLost, LockNotAcquired, current_lease
from lockaspect.backends.base import Capability

from .conftest import skip_unless_served

BOUND = 20.0


def leases_expire(client: LockClient) -> bool:
    return not client.backend.capabilities & Capability.SESSION_BOUND


def skip_unless_leases(client: LockClient) -> None:
    if not leases_expire(client):
        pytest.skip(f"{client.backend!r}: holds last as long as a session, not a lease")


# -- locked / owned (redis-py test_locked, test_owned; Redisson isLocked) -------------------------


def test_locked_follows_acquire_and_release(client: LockClient) -> None:
    assert not client.locked("k")
    lease = client.acquire("k")
    assert client.locked("k")
    lease.release()
    assert not client.locked("k")


def test_owned_is_true_only_for_the_owner(make_client: Callable[..., LockClient]) -> None:
    one, other = make_client(), make_client()
    lease = one.acquire("k", lease=30)
    assert lease.owned()
    assert not other.locked("nope")
    with pytest.raises(LockNotAcquired):
        other.acquire("k")  # redis-py test_competing_locks
    lease.release()
    assert not lease.owned()


def test_owned_after_another_owner_took_it_is_false(make_client: Callable[..., LockClient]) -> None:
    """redis-py test_owned after the key was taken over; python-redis-lock's reset()."""
    one, operator = make_client(), make_client()
    lease = one.acquire("k", lease=30)
    assert operator.force_release("k")
    taker = operator.acquire("k", lease=30)
    assert not lease.owned()
    assert lease.lost
    assert lease.lost_reason == "not-owner"
    taker.release()


# -- release (redis-py test_releasing_unlocked_lock_raises_error, ..._no_longer_owned_...) ---------


def test_releasing_twice_raises(client: LockClient) -> None:
    lease = client.acquire("k")
    lease.release()
    with pytest.raises(LockLost) as caught:
        lease.release()
    assert caught.value.reason == "released"


def test_releasing_a_lock_no_longer_owned_raises(make_client: Callable[..., LockClient]) -> None:
    one, operator = make_client(), make_client()
    lease = one.acquire("k", lease=30)
    operator.force_release("k")
    with pytest.raises(LockLost) as caught:
        lease.release()
    assert caught.value.reason == "not-owner"


def test_release_in_another_thread(client: LockClient) -> None:
    """A lock taken in one place and released in another (Redisson's forceUnlock-free path,
    redis-py's thread_local=False)."""
    lease = client.acquire("k")
    worker = threading.Thread(target=lease.release)
    worker.start()
    worker.join(BOUND)
    assert not client.locked("k")
    assert lease.hold_count == 0


def test_release_early_inside_a_block(client: LockClient) -> None:
    with client.lock("k") as lease:
        lease.release()
        assert not client.locked("k")
        with client.lock("k", wait=0):  # free again, taken afresh
            pass
    assert not client.locked("k")


# -- hold count (Redisson getHoldCount, isHeldByCurrentThread) -------------------------------------


def test_hold_count_counts_reentries(client: LockClient) -> None:
    lease = client.acquire("k")
    assert lease.hold_count == 1
    again = client.acquire("k")
    assert again.token == lease.token
    assert lease.hold_count == 2
    with client.lock("k") as inner:
        assert inner.hold_count == 3
    assert lease.hold_count == 2
    again.release()
    assert lease.hold_count == 1
    assert client.locked("k")
    lease.release()
    assert lease.hold_count == 0
    assert not client.locked("k")


def test_current_lease_by_key(client: LockClient) -> None:
    assert current_lease("k") is None
    lease = client.acquire("k")
    found = current_lease("k")
    assert found is not None
    assert found.token == lease.token
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(current_lease("k")))
    thread.start()
    thread.join(BOUND)
    assert seen == [None]  # another thread does not hold it
    lease.release()
    assert current_lease("k") is None


# -- remaining lease (redis-py test_timeout; Redisson remainTimeToLive; pottery locked()) ----------


def test_remaining_is_the_stores_lease(client: LockClient) -> None:
    lease = client.acquire("k", lease=10)
    left = lease.remaining()
    if leases_expire(client):
        assert 0 < left <= 10.01
    else:
        assert left == math.inf
    lease.release()
    assert lease.remaining() == 0.0


# -- extend (redis-py test_extend_lock, ..._replace_ttl, ..._float, ..._no_longer_owned) -----------


def test_extend_adds_time(client: LockClient) -> None:
    skip_unless_leases(client)
    lease = client.acquire("k", lease=10)
    lease.extend(10)
    assert 10 < lease.remaining() <= 20.01
    assert 10 < lease.expires_in <= 20
    lease.release()


def test_extend_with_replace_sets_the_lease(client: LockClient) -> None:
    skip_unless_leases(client)
    lease = client.acquire("k", lease=10)
    lease.extend(2.5, replace=True)
    assert 0 < lease.remaining() <= 2.51
    lease.release()


def test_an_extended_lease_is_not_lost_at_its_old_end(client: LockClient) -> None:
    skip_unless_leases(client)
    lease = client.acquire("k", lease=0.4)
    lease.extend(BOUND)
    ended = threading.Event()
    assert not ended.wait(0.8)  # past the old end: time passing is the scenario
    assert lease.held
    assert lease.owned()
    lease.release()


def test_extending_a_released_or_lost_lock_raises(make_client: Callable[..., LockClient]) -> None:
    one, operator = make_client(), make_client()
    lease = one.acquire("k", lease=30)
    lease.release()
    with pytest.raises(LockLost):
        lease.extend(5)
    lease = one.acquire("k", lease=30)
    operator.force_release("k")
    if leases_expire(one):
        with pytest.raises(LockLost) as caught:
            lease.extend(5)
        assert caught.value.reason == "not-owner"


def test_extend_refuses_a_watchdog_lease_and_bad_seconds(client: LockClient) -> None:
    """redis-py test_extending_lock_with_no_timeout_raises_error: the watchdog renews it."""
    lease = client.acquire("k")
    with pytest.raises(ConfigurationError):
        lease.extend(5)
    lease.release()
    fixed = client.acquire("k", lease=5)
    for bad in (0, -1, math.inf, "5", True):
        with pytest.raises(ConfigurationError):
            fixed.extend(bad)  # type: ignore[arg-type]
    fixed.release()


# -- force release (python-redis-lock reset(); Redisson forceUnlock) ------------------------------


def test_force_release_returns_whether_anything_was_held(client: LockClient) -> None:
    assert not client.force_release("k")
    lease = client.acquire("k")
    assert client.force_release("k")
    assert not client.locked("k")
    with pytest.raises(LockLost):
        lease.release()


# -- adopt by token (python-redis-lock Lock(id=...), redis-py Lock(token=...)) --------------------


def test_adopt_a_lock_by_its_token(make_client: Callable[..., LockClient]) -> None:
    taker, other = make_client(), make_client()
    lease = taker.acquire("k", lease=30)
    if not leases_expire(taker):
        with pytest.raises(ConfigurationError):
            other.adopt("k", lease.token)
        lease.release()
        return
    adopted = other.adopt("k", lease.token)
    assert adopted.fencing_token == lease.fencing_token
    assert adopted.owned()
    assert 0 < adopted.remaining() <= 30.01
    adopted.extend(30)
    assert adopted.remaining() > 30
    adopted.release()
    assert not taker.locked("k")
    with pytest.raises(LockLost):
        lease.release()


def test_adopt_with_a_wrong_token_raises(client: LockClient) -> None:
    skip_unless_leases(client)
    lease = client.acquire("k", lease=30)
    with pytest.raises(LockLost):
        client.adopt("k", "0" * 32)
    with pytest.raises(LockLost):
        client.adopt("free", lease.token)
    lease.release()


# -- semaphores (Redisson tryAcquire(permits), addPermits, availablePermits; kazoo lease_holders) --


def test_taking_several_permits_at_once(make_client: Callable[..., LockClient]) -> None:
    one, other = make_client(), make_client()
    skip_unless_served(one, "semaphore")
    with one.semaphore("s", permits=3, count=2) as two:
        assert one.permits("s") == (3, 2)
        info = one.describe("s")
        assert info is not None
        assert [h.permits for h in info.holders] == [2]
        with pytest.raises(LockNotAcquired), other.semaphore("s", permits=3, count=2):
            pass
        assert other.permits("s") == (3, 2)  # the busy attempt left nothing
        with other.semaphore("s", permits=3):
            assert other.permits("s") == (3, 3)
        assert two.permits == 3
    # ZooKeeper forgets a semaphore's number once nobody holds or waits (no node stays).
    assert one.permits("s") in ((3, 0), (None, 0))


def test_a_release_of_several_permits_lets_several_waiters_in(make_client: Callable[..., LockClient]) -> None:
    one = make_client()
    skip_unless_served(one, "semaphore")
    waiters = [make_client() for _ in range(2)]
    inside = threading.Barrier(3)
    big = one.acquire("s", permits=2, count=2)
    got: list[int] = []

    def wait_for_one(client: LockClient) -> None:
        with client.semaphore("s", permits=2, wait=BOUND) as permit:
            got.append(permit.fencing_token)
            inside.wait(BOUND)

    threads = [threading.Thread(target=wait_for_one, args=(client,)) for client in waiters]
    for thread in threads:
        thread.start()
    big.release()
    inside.wait(BOUND)  # both in at once
    for thread in threads:
        thread.join(BOUND)
    assert len(got) == 2


def test_count_is_checked_before_any_io(client: LockClient) -> None:
    with pytest.raises(ConfigurationError):
        client.semaphore("s", permits=2, count=3)
    with pytest.raises(ConfigurationError):
        client.semaphore("s", permits=2, count=0)
    with pytest.raises(TypeError):
        client.semaphore("s", permits=2, count=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        client.acquire("s", count=2)  # count without permits
    skip_unless_served(client, "semaphore")
    assert client.permits("s") == (None, 0)


def test_add_permits(client: LockClient) -> None:
    skip_unless_served(client, "semaphore")
    assert client.add_permits("s", 2) == (2, 0)
    with client.semaphore("s", permits=2):
        assert client.add_permits("s", 3) == (5, 1)
        assert client.add_permits("s", -10) == (0, 1)  # never below 0; the holder keeps its permit
    client.set_permits("s", 1)
    with client.semaphore("s", permits=1):
        pass
    with pytest.raises(TypeError):
        client.add_permits("s", 1.0)  # type: ignore[arg-type]


# -- leaks, asyncio --------------------------------------------------------------------------------


def test_a_lease_dropped_without_release_is_given_back(client: LockClient, caplog: pytest.LogCaptureFixture) -> None:
    lease = client.acquire("k")
    del lease
    gc.collect()
    assert "garbage-collected without release()" in caplog.text
    with client.lock("k", wait=BOUND):  # the watchdog's sweep gave it back
        pass


def test_the_async_per_lease_api(make_client: Callable[..., LockClient]) -> None:
    one, operator = make_client(), make_client()

    async def main() -> None:
        lease = await one.aacquire("k", lease=30)
        assert await lease.aowned()
        left = await lease.aremaining()
        assert left == math.inf if not leases_expire(one) else 0 < left <= 30.01
        if leases_expire(one):
            await lease.aextend(30)
            assert await lease.aremaining() > 30
        with pytest.raises(LockNotAcquired):
            await operator.aacquire("k")
        await lease.arelease()
        assert not await lease.aowned()
        with pytest.raises(LockLost):
            await lease.arelease()

    asyncio.run(main())
