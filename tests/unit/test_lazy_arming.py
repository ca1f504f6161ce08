"""A new lease reaches the timer's wheel at the timer's next tick (Watchdog.register queues it;
the timer thread arms it before that tick's timeouts fire): its first renewal and its local
deadline come exactly when a timeout scheduled at the acquisition would have fired, and a lease
released before that tick never reaches the wheel.

A manual clock: the timer ticks only when a test advances it, so "the next tick" is exact.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import LockClient
from lockaspect.backends.memory import MemoryStore
from lockaspect.renewal import CLOSED
from lockaspect.testing import ManualClock
from lockaspect.timer import IDLE_AFTER, HashedWheelTimer

#: A guard against hanging, not a timing assertion.
WAIT = 10.0
TICK = 0.1
LEASE = 10.0
DW = 0.5


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.002)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def timer(clock: ManualClock) -> Iterator[HashedWheelTimer]:
    made = HashedWheelTimer(tick=TICK, clock=clock)
    yield made
    made.stop()


def test_a_feed_drained_at_a_tick_fires_with_the_timeouts_scheduled_before_it(
    timer: HashedWheelTimer, clock: ManualClock
) -> None:
    """What the drain schedules fires in the same tick as a timeout of the same deadline
    scheduled directly before the tick, and the drain runs before that tick's timeouts."""
    order: list[str] = []
    queue: deque[float] = deque()
    first_tick: list[list[str]] = []
    seen = threading.Event()

    def drain() -> None:
        while queue:
            timer.schedule(queue.popleft(), order.append, "queued")
            order.append("drained")

    def listener() -> None:
        if order and not seen.is_set():
            first_tick.append(list(order))
            seen.set()

    timer.add_feed(queue, drain)
    timer.add_tick_listener(listener)
    due = clock() + TICK / 2
    timer.schedule(due, order.append, "direct")
    queue.append(due)
    timer.poke()
    clock.advance(TICK)
    assert seen.wait(WAIT)
    assert first_tick[0][0] == "drained"
    assert sorted(first_tick[0][1:]) == ["direct", "queued"]


def test_a_poke_wakes_an_idle_timer(timer: HashedWheelTimer, clock: ManualClock) -> None:
    """An idle timer thread (nothing on the wheel for IDLE_AFTER) drains a feed after a poke."""
    queue: deque[int] = deque()
    drained = threading.Event()

    def drain() -> None:
        queue.clear()
        drained.set()

    timer.add_feed(queue, drain)
    fired = threading.Event()
    timer.call_later(0.0, lambda arg: fired.set())  # starts the thread
    clock.advance(TICK)
    assert fired.wait(WAIT)
    clock.advance(IDLE_AFTER + TICK)  # nothing on the wheel for IDLE_AFTER
    wait_for(lambda: timer._idle, "the timer to idle")
    queue.append(1)
    timer.poke()
    wait_for(lambda: not timer._idle, "the poke to wake the timer")
    clock.advance(TICK)
    assert drained.wait(WAIT)


@pytest.fixture
def client(clock: ManualClock) -> Iterator[LockClient]:
    store = MemoryStore(clock=clock, name=f"lazy-{id(clock)}")
    made = LockClient(store, clock=clock, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)
    yield made
    made.close()


def _drained(client: LockClient) -> bool:
    return not client._engine.watchdog._new


def test_a_lease_released_before_the_next_tick_never_reaches_the_wheel(
    client: LockClient, clock: ManualClock
) -> None:
    with client.lock("quick") as lease, client.lock("fixed", lease=5.0):
        pass
    record = lease._record
    clock.advance(TICK)
    wait_for(lambda: _drained(client), "the timer's next tick")
    assert (record.state, record.timeout, record.deadline) == (CLOSED, None, None)
    clock.advance(LEASE)
    assert client.stats().renewals == 0
    assert len(client._engine.timer) == 0


def test_a_lease_held_across_the_tick_is_renewed_when_it_falls_due(client: LockClient, clock: ManualClock) -> None:
    with client.lock("held") as lease:
        clock.advance(TICK)
        wait_for(lambda: lease._record.timeout is not None, "the first renewal on the wheel")
        clock.advance(DW * LEASE)  # the first renewal falls due
        wait_for(lambda: client.stats().renewals == 1, "the first renewal")
        clock.advance(0.6 * LEASE)  # past the first term's end: renewed, so still held
        assert lease.held
    assert client.stats().lost == 0


def test_a_fixed_lease_queued_at_its_acquisition_is_declared_lost_on_time(
    client: LockClient, clock: ManualClock
) -> None:
    """Its deadline reached the wheel lazily, and the timer still fires the on_lost hook at it."""
    called = threading.Event()
    hooked: list[Any] = []

    def on_lost(lease: Any) -> None:
        hooked.append(lease)
        called.set()

    block = client.lock("fixed", lease=1.0, on_lost=on_lost)
    lease = block.__enter__()
    try:
        clock.advance(1.0)
        assert called.wait(WAIT)
        assert hooked == [lease]
        assert lease.lost_reason == "expired"
    finally:
        with pytest.raises(Exception, match="lost"):
            block.__exit__(None, None, None)
