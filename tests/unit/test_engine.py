"""The engine on the memory store and a manual clock: no server, no waiting on real time.

Time moves only when a test advances it, so leases end exactly when the test says, and the
engine's decisions (re-entry counted in one place, the local deadline, settling a lost lease
into LockLost, refusing a kind the store does not serve before any I/O) can be checked step
by step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from lockaspect import ConfigurationError, LockClient, LockLost, LockNotAcquired, distributed_lock
from lockaspect.backends.base import AcquireRequest, AcquireResult
from lockaspect.backends.memory import MemoryStore
from lockaspect.observe import LockEvent
from lockaspect.testing import ManualClock

LEASE = 10.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def events() -> list[LockEvent]:
    return []


@pytest.fixture
def client(clock: ManualClock, events: list[LockEvent]) -> Iterator[LockClient]:
    store = MemoryStore(clock=clock, name=f"engine-{id(clock)}")
    made = LockClient(store, clock=clock, watchdog_lease=LEASE, tick=0.1, observers=[events.append])
    yield made
    made.close()


@pytest.fixture
def other(clock: ManualClock, client: LockClient) -> Iterator[LockClient]:
    """A second client (another process, as far as the locks go) on the same memory."""
    store = MemoryStore(clock=clock, name=f"engine-{id(clock)}")
    made = LockClient(store, clock=clock, watchdog_lease=LEASE, tick=0.1)
    yield made
    made.close()


def test_a_fixed_lease_ends_when_the_clock_says_and_the_block_raises_lock_lost(
    client: LockClient, other: LockClient, clock: ManualClock
) -> None:
    block = client.lock("k", lease=5.0)
    lease = block.__enter__()
    assert lease.held
    clock.advance(4.9)  # within the local guard (a tick + 50 ms before the end): lost already
    assert lease.lost
    with pytest.raises(LockNotAcquired):
        other.lock("k").__enter__()  # ... while the store still has it
    clock.advance(0.1)
    with other.lock("k") as taken:  # the store's lease ended: another owner gets it
        assert taken.fencing_token > lease.fencing_token
    with pytest.raises(LockLost) as caught:
        block.__exit__(None, None, None)
    assert caught.value.reason == "expired"
    assert caught.value.lease is lease


def test_reentries_are_counted_in_the_engine_for_every_kind(client: LockClient, other: LockClient) -> None:
    blocks: list[Any] = [
        lambda c: c.lock("r:lock"),
        lambda c: c.fair_lock("r:fair"),
        lambda c: c.semaphore("r:sem", permits=1),
        lambda c: c.rw_lock("r:rw").write(),
    ]
    for make in blocks:
        with make(client) as outer:
            with make(client) as inner:
                assert inner is outer
            assert outer.held  # the inner exit gave back one hold, not the lock
            with pytest.raises(LockNotAcquired):
                make(other).__enter__()
        with make(other):
            pass  # free after the outer exit
    assert client.stats().reentered == len(blocks)


def test_a_lost_lease_cannot_be_reentered(client: LockClient, clock: ManualClock) -> None:
    block = client.lock("k", lease=1.0)
    block.__enter__()
    clock.advance(2.0)
    with pytest.raises(LockLost, match="cannot re-enter"):
        client.lock("k").__enter__()
    with pytest.raises(LockLost):
        block.__exit__(None, None, None)


def test_max_hold_caps_the_lease(client: LockClient, clock: ManualClock) -> None:
    block = client.lock("k", max_hold=2.0)
    assert block.__enter__().lease_time == 2.0
    clock.advance(2.0)
    with pytest.raises(LockLost) as caught:
        block.__exit__(None, None, None)
    assert caught.value.reason == "max-hold"


def test_a_busy_lock_without_waiting_reports_the_holders_time_left(
    client: LockClient, other: LockClient, clock: ManualClock
) -> None:
    with other.lock("k", lease=8.0):
        clock.advance(3.0)
        with pytest.raises(LockNotAcquired) as caught:
            client.lock("k").__enter__()
    assert caught.value.holder_ttl == pytest.approx(5.0)
    assert caught.value.waited == 0.0


def test_a_decorated_call_settles_a_loss_into_lock_lost_with_the_result(client: LockClient, clock: ManualClock) -> None:
    @distributed_lock(key="job", lease=1.0, client=client)
    def job() -> str:
        clock.advance(5.0)
        return "done"

    with pytest.raises(LockLost) as caught:
        job()
    assert caught.value.result == "done"


def test_the_events_follow_the_cycle(client: LockClient, events: list[LockEvent]) -> None:
    with client.lock("e"), client.lock("e"):
        pass
    assert [(e.name, e.key) for e in events] == [("acquired", "e"), ("reentered", "e"), ("released", "e")]


class _PlainLocksOnly(MemoryStore):
    """A store that declares only the mutex, and records what reaches it."""

    kinds = frozenset({"lock"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.requests: list[AcquireRequest] = []

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        self.requests.append(request)
        return super().acquire(request)


@pytest.mark.parametrize(
    "make",
    [
        lambda c: c.fair_lock("k"),
        lambda c: c.semaphore("k", permits=2),
        lambda c: c.rw_lock("k").read(),
        lambda c: c.rw_lock("k").write(),
    ],
)
def test_a_kind_the_store_does_not_serve_is_refused_before_any_io(make: Any, clock: ManualClock) -> None:
    store = _PlainLocksOnly(clock=clock)
    with LockClient(store, clock=clock) as client:
        with pytest.raises(ConfigurationError, match="does not serve"):
            make(client).__enter__()
        with client.lock("k"):
            pass
    assert [request.kind for request in store.requests] == ["lock"]


def test_a_waiter_polls_when_the_store_has_no_notifier_any_more() -> None:
    """Two clients on one store object; one closes it (the store stops notifying): the other's
    waiter falls back to polling and gets the lock when it is released."""
    store = MemoryStore()
    first, second = LockClient(store), LockClient(store)
    try:
        holder = second.lock("k")
        holder.__enter__()
        first.close()
        assert store.notifier() is None
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(_take(second, "k")))
        waiter.start()
        holder.__exit__(None, None, None)
        waiter.join(30)
        assert len(got) == 1
        assert got[0] > 0
    finally:
        second.close()


def _take(client: LockClient, key: str) -> int:
    with client.lock(key, wait=30) as lease:
        return lease.fencing_token


def test_an_acquisition_event_says_how_long_it_waited(client: LockClient, other: LockClient) -> None:
    events: list[LockEvent] = []
    watcher = LockClient(client.backend, observers=[events.append])
    try:
        with watcher.lock("w", wait=5):
            pass
        assert [(e.name, e.waited) for e in events if e.name == "acquired"] == [("acquired", 0.0)]
    finally:
        watcher.close()


def test_specs_made_from_plain_values_are_reused_but_never_confused_by_type(client: LockClient) -> None:
    from lockaspect.options import LockSpec

    assert LockSpec.create(wait=1) is LockSpec.create(wait=1)
    assert LockSpec.create(wait=1).wait == 1.0
    with pytest.raises(TypeError, match="wait"):
        LockSpec.create(wait=True)  # equal to 1 and hashed alike: the cache keys on the type too
    with pytest.raises(TypeError, match="wait"):
        client.lock("k", wait=True)
