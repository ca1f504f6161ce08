"""The hashed-wheel timer: the pure ``_Wheel`` driven by explicit ``now`` values (no sleeping),
and a few tests of the threaded ``HashedWheelTimer`` that await callbacks with events."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockaspect.timer import HashedWheelTimer, Timeout, _Wheel

#: Generous bound for awaiting a callback on the timer thread; a guard against hanging, not a timing assertion.
WAIT = 10.0


def noop(arg: object) -> None:
    return None


def step(wheel: _Wheel, ticks: int) -> dict[Timeout, float]:
    """Advance ``wheel`` one tick boundary at a time; map each expired timeout to the ``now`` it fired at."""
    fired: dict[Timeout, float] = {}
    for _ in range(ticks):
        now = wheel.next_tick_at()
        for timeout in wheel.advance(now):
            fired[timeout] = now
    return fired


class TestWheelFiring:
    @pytest.mark.parametrize("deadline", [0.0, 0.05, 0.1, 0.25, 0.3, 0.7, 0.999, 1.0])
    def test_fires_at_or_after_the_deadline_and_at_most_one_tick_late(self, deadline: float) -> None:
        """Stepping tick by tick, a timeout fires no earlier than its deadline and no more than one tick after it."""
        wheel = _Wheel(0.1, 8)
        timeout = wheel.add(deadline, noop)
        fired = step(wheel, 20)
        assert deadline <= fired[timeout] <= deadline + 0.1 + 1e-9
        assert timeout.expired

    def test_never_fires_before_its_tick_has_ended(self) -> None:
        """A timeout due inside tick 3 does not fire at the end of tick 2, and fires at the end of tick 3."""
        wheel = _Wheel(1.0, 8)
        timeout = wheel.add(3.5, noop)
        assert wheel.advance(3.0) == []
        assert wheel.advance(3.99) == []
        assert wheel.advance(4.0) == [timeout]

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        tick=st.floats(0.001, 1.0),
        start=st.floats(0.0, 1e6),
        size=st.sampled_from([1, 2, 8, 512]),
        offsets=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=6),
    )
    def test_firing_window_property(self, tick: float, start: float, size: int, offsets: list[float]) -> None:
        """For any tick, start, wheel size and deadlines, each timeout fires within one tick after its deadline."""
        wheel = _Wheel(tick, size, start=start)
        timeouts = [wheel.add(start + offset * tick, noop) for offset in offsets]
        fired = step(wheel, 60)
        for timeout in timeouts:
            assert timeout.deadline <= fired[timeout] <= timeout.deadline + tick + 1e-6

    def test_catch_up_fires_everything_due_in_tick_order(self) -> None:
        """One late ``advance`` fires every timeout due by then, earlier ticks first, and leaves later ones."""
        wheel = _Wheel(1.0, 4)
        late = wheel.add(30.5, noop)
        due = [wheel.add(deadline, noop) for deadline in (7.5, 0.5, 5.5, 2.5)]
        assert wheel.advance(10.0) == sorted(due, key=lambda timeout: timeout.deadline)
        assert len(wheel) == 1
        assert not late.expired

    def test_advance_does_not_run_callbacks(self) -> None:
        """``advance`` only returns expired timeouts; the caller runs them."""
        calls: list[object] = []
        wheel = _Wheel(1.0, 8)
        wheel.add(0.5, calls.append, "payload")
        assert len(wheel.advance(1.0)) == 1
        assert calls == []

    def test_deadline_in_the_past_fires_on_the_next_tick(self) -> None:
        """A deadline already past when added fires at the end of the next tick."""
        wheel = _Wheel(1.0, 8)
        wheel.advance(10.0)
        timeout = wheel.add(3.0, noop)
        assert wheel.advance(10.99) == []
        assert wheel.advance(11.0) == [timeout]

    def test_deadline_before_the_start_fires_on_the_first_tick(self) -> None:
        """A deadline before the wheel's start fires on tick 0."""
        wheel = _Wheel(1.0, 8, start=100.0)
        timeout = wheel.add(50.0, noop)
        assert wheel.advance(100.5) == []
        assert wheel.advance(101.0) == [timeout]


class TestRounds:
    def test_deadline_beyond_one_revolution_waits_its_rounds(self) -> None:
        """A deadline 2000 ticks out on a 512-bucket wheel passes its bucket three times before firing."""
        wheel = _Wheel(1.0, 512)
        timeout = wheel.add(2000.5, noop)
        bucket = 2000 % 512
        for revolution in range(3):
            assert wheel.advance(revolution * 512 + bucket + 1.0) == []
        assert wheel.advance(2000.0) == []
        assert wheel.advance(2001.0) == [timeout]

    def test_timeouts_sharing_a_bucket_fire_in_their_own_revolution(self) -> None:
        """Timeouts in one bucket but different revolutions fire one revolution apart."""
        wheel = _Wheel(1.0, 8)
        timeouts = [wheel.add(3.5 + 8 * revolution, noop) for revolution in range(4)]
        fired = step(wheel, 40)
        assert [fired[timeout] for timeout in timeouts] == [4.0, 12.0, 20.0, 28.0]

    def test_wheel_of_one_bucket_still_counts_rounds(self) -> None:
        """With a single bucket every timeout waits in it for as many rounds as ticks."""
        wheel = _Wheel(1.0, 1)
        timeout = wheel.add(5.5, noop)
        fired = step(wheel, 10)
        assert fired[timeout] == 6.0


class TestCancel:
    def test_cancel_before_transfer(self) -> None:
        """A timeout cancelled before any tick never fires and no longer counts."""
        wheel = _Wheel(1.0, 8)
        timeout = wheel.add(2.5, noop)
        assert timeout.cancel()
        assert timeout.cancelled
        assert wheel.advance(10.0) == []
        assert len(wheel) == 0
        assert wheel.idle

    def test_cancel_after_transfer(self) -> None:
        """A timeout cancelled while in its bucket is dropped on the next tick and never fires."""
        wheel = _Wheel(1.0, 8)
        timeout = wheel.add(5.5, noop)
        wheel.advance(1.0)
        assert len(wheel) == 1
        assert timeout.cancel()
        wheel.advance(2.0)
        assert len(wheel) == 0
        assert wheel.advance(10.0) == []
        assert not timeout.expired

    def test_cancel_one_of_many_in_a_bucket(self) -> None:
        """Cancelling one timeout leaves its bucket neighbours to fire."""
        wheel = _Wheel(1.0, 8)
        keep = wheel.add(3.2, noop)
        drop = wheel.add(3.4, noop)
        wheel.advance(1.0)
        drop.cancel()
        assert wheel.advance(4.0) == [keep]

    def test_cancel_twice_or_after_firing_returns_false(self) -> None:
        """``cancel`` is true only for the call that cancelled a pending timeout."""
        wheel = _Wheel(1.0, 8)
        cancelled = wheel.add(1.5, noop)
        fired = wheel.add(0.5, noop)
        assert cancelled.cancel()
        assert not cancelled.cancel()
        assert wheel.advance(1.0) == [fired]
        assert not fired.cancel()
        assert fired.expired
        assert not fired.cancelled


class TestManyInOneBucket:
    def test_all_timeouts_of_a_tick_fire_together(self) -> None:
        """A thousand timeouts due in one tick all fire at that tick, and the next revolution's wait."""
        wheel = _Wheel(1.0, 8)
        now_due = {wheel.add(3.0 + i / 1000, noop) for i in range(1000)}
        later = {wheel.add(11.0 + i / 1000, noop) for i in range(100)}
        assert wheel.advance(3.0) == []
        assert set(wheel.advance(4.0)) == now_due
        assert len(wheel) == 100
        assert set(wheel.advance(12.0)) == later
        assert wheel.idle


class TestFastForward:
    def test_idle_wheel_skips_to_now(self) -> None:
        """After an idle stretch the wheel's next tick is the one in progress, not the long-past ones."""
        wheel = _Wheel(1.0, 8)
        wheel.fast_forward(1000.25)
        assert wheel.next_tick_at() == 1001.0

    def test_timeout_added_after_fast_forward_fires_on_time(self) -> None:
        """A timeout added after a fast-forward fires within one tick of its deadline."""
        wheel = _Wheel(1.0, 8)
        wheel.fast_forward(1000.0)
        timeout = wheel.add(1003.5, noop)
        fired = step(wheel, 10)
        assert fired[timeout] == 1004.0

    def test_fast_forward_keeps_bucketed_timeouts(self) -> None:
        """A wheel holding timeouts in buckets does not fast-forward past them."""
        wheel = _Wheel(1.0, 8)
        timeout = wheel.add(5.5, noop)
        wheel.advance(1.0)
        wheel.fast_forward(100.0)
        assert wheel.next_tick_at() == 2.0
        assert step(wheel, 10)[timeout] == 6.0

    def test_fast_forward_never_goes_back(self) -> None:
        """Fast-forwarding to an earlier instant leaves the wheel where it was."""
        wheel = _Wheel(1.0, 8)
        wheel.fast_forward(50.0)
        wheel.fast_forward(10.0)
        assert wheel.next_tick_at() == 51.0

    def test_advance_fast_forwards_once_empty(self) -> None:
        """A long ``advance`` that empties the wheel jumps to ``now`` instead of stopping at the last timeout."""
        wheel = _Wheel(1.0, 8)
        timeout = wheel.add(0.5, noop)
        assert wheel.advance(1000.0) == [timeout]
        assert wheel.next_tick_at() == 1001.0


class TestWheelShape:
    @pytest.mark.parametrize(("size", "rounded"), [(1, 1), (2, 2), (3, 4), (500, 512), (512, 512), (513, 1024)])
    def test_size_is_rounded_up_to_a_power_of_two(self, size: int, rounded: int) -> None:
        """The bucket count is the requested size rounded up to a power of two."""
        assert _Wheel(0.1, size).size == rounded

    @pytest.mark.parametrize("size", [0, -1])
    def test_size_must_be_positive(self, size: int) -> None:
        """A wheel needs at least one bucket."""
        with pytest.raises(ValueError, match="wheel size"):
            _Wheel(0.1, size)

    @pytest.mark.parametrize("tick", [0.0, -0.1])
    def test_tick_must_be_positive(self, tick: float) -> None:
        """A tick of zero or less is rejected."""
        with pytest.raises(ValueError, match="tick"):
            _Wheel(tick, 8)

    def test_len_and_idle_count_waiting_timeouts(self) -> None:
        """``len`` counts timeouts waiting, queued or bucketed, and ``idle`` is true only with none."""
        wheel = _Wheel(1.0, 8)
        assert wheel.idle
        wheel.add(5.5, noop)
        wheel.add(6.5, noop)
        assert len(wheel) == 2
        assert not wheel.idle
        wheel.advance(1.0)
        assert len(wheel) == 2
        step(wheel, 10)
        assert len(wheel) == 0
        assert wheel.idle


class TestClear:
    def test_clear_returns_pending_timeouts(self) -> None:
        """``clear`` returns the timeouts still pending, queued or bucketed, and leaves the wheel empty."""
        wheel = _Wheel(1.0, 8)
        bucketed = wheel.add(5.5, noop)
        wheel.advance(1.0)
        queued = wheel.add(7.5, noop)
        wheel.add(6.5, noop).cancel()
        assert set(wheel.clear()) == {bucketed, queued}
        assert len(wheel) == 0
        assert wheel.idle
        assert wheel.advance(20.0) == []

    def test_cancelling_a_cleared_timeout_keeps_the_count(self) -> None:
        """Cancelling a timeout that ``clear`` returned does not corrupt the wheel's count."""
        wheel = _Wheel(1.0, 8)
        timeout = wheel.add(5.5, noop)
        wheel.advance(1.0)
        wheel.clear()
        timeout.cancel()
        wheel.advance(2.0)
        assert len(wheel) == 0
        assert wheel.idle
        later = wheel.add(4.5, noop)
        assert wheel.advance(5.0) == [later]


@pytest.fixture
def timer() -> Iterator[HashedWheelTimer]:
    made = HashedWheelTimer(tick=0.01, wheel_size=64)
    yield made
    made.stop()


class Recorder:
    """Records callbacks with the thread they ran on, and signals each one."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, threading.Thread]] = []
        self.fired = threading.Event()

    def __call__(self, arg: object) -> None:
        self.calls.append((arg, threading.current_thread()))
        self.fired.set()


class TestHashedWheelTimer:
    def test_thread_starts_lazily_on_first_schedule(self, timer: HashedWheelTimer) -> None:
        """No thread exists until the first schedule; then callbacks run on one daemon thread named lockaspect-timer."""
        assert timer.thread is None
        recorder = Recorder()
        timer.call_later(0.0, recorder, "first")
        assert recorder.fired.wait(WAIT)
        thread = timer.thread
        assert thread is not None
        assert thread.name == "lockaspect-timer"
        assert thread.daemon
        assert recorder.calls == [("first", thread)]

    def test_all_callbacks_share_one_thread(self, timer: HashedWheelTimer) -> None:
        """Every callback runs on the same timer thread, also after the timer went idle in between."""
        first, second = Recorder(), Recorder()
        timer.call_later(0.0, first, 1)
        assert first.fired.wait(WAIT)
        timer.call_later(0.0, second, 2)
        assert second.fired.wait(WAIT)
        assert first.calls[0][1] is second.calls[0][1] is timer.thread

    def test_callback_runs_no_earlier_than_its_deadline(self, timer: HashedWheelTimer) -> None:
        """A callback observes the monotonic clock at or past its deadline."""
        seen: list[float] = []
        done = threading.Event()

        def record(arg: object) -> None:
            seen.append(time.monotonic())
            done.set()

        timeout = timer.call_later(0.03, record)
        assert done.wait(WAIT)
        assert seen[0] >= timeout.deadline
        assert timeout.expired

    def test_cancelled_timeout_does_not_run(self, timer: HashedWheelTimer) -> None:
        """A cancelled timeout never runs, while a later one scheduled alongside does."""
        cancelled, later = Recorder(), Recorder()
        timer.call_later(0.02, cancelled).cancel()
        timer.call_later(0.04, later)
        assert later.fired.wait(WAIT)
        assert cancelled.calls == []

    def test_stop_joins_the_thread_and_returns_unfired_timeouts(self, timer: HashedWheelTimer) -> None:
        """``stop`` joins the timer thread and returns the timeouts that never fired."""
        recorder = Recorder()
        timer.call_later(0.0, recorder)
        assert recorder.fired.wait(WAIT)
        far = timer.call_later(3600.0, noop)
        thread = timer.thread
        assert thread is not None
        assert timer.stop() == [far]
        assert not thread.is_alive()
        assert timer.stop() == []

    def test_stop_before_any_schedule_starts_no_thread(self) -> None:
        """Stopping a timer that never scheduled anything returns nothing and starts no thread."""
        idle = HashedWheelTimer(tick=0.01)
        assert idle.stop() == []
        assert idle.thread is None

    def test_schedule_after_stop_is_refused(self, timer: HashedWheelTimer) -> None:
        """A stopped timer refuses new timeouts."""
        timer.stop()
        with pytest.raises(RuntimeError, match="stopped"):
            timer.call_later(0.0, noop)

    def test_tick_listener_runs_after_the_ticks_timeouts(self, timer: HashedWheelTimer) -> None:
        """A tick listener runs after all the timeouts due in that tick have run."""
        fired: list[str] = []
        seen_by_listener: list[list[str]] = []
        done = threading.Event()

        def listener() -> None:
            if fired and not done.is_set():
                seen_by_listener.append(list(fired))
                done.set()

        timer.add_tick_listener(listener)
        deadline = time.monotonic() + 0.03
        for name in ("a", "b", "c"):
            timer.schedule(deadline, fired.append, name)
        assert done.wait(WAIT)
        assert sorted(seen_by_listener[0]) == ["a", "b", "c"]

    def test_failing_callback_does_not_stop_the_timer(
        self, timer: HashedWheelTimer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A callback that raises is logged and the timer keeps running later callbacks."""

        def fail(arg: object) -> None:
            raise RuntimeError("callback failed")

        recorder = Recorder()
        caplog.set_level(logging.ERROR, logger="lockaspect.timer")
        timer.call_later(0.0, fail)
        timer.call_later(0.05, recorder, "after")
        assert recorder.fired.wait(WAIT)
        assert recorder.calls[0][0] == "after"
        assert any("timer callback" in record.getMessage() for record in caplog.records)

    def test_failing_tick_listener_does_not_stop_the_timer(
        self, timer: HashedWheelTimer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A tick listener that raises is logged and the timer keeps running callbacks."""

        def broken() -> None:
            raise RuntimeError("listener failed")

        caplog.set_level(logging.ERROR, logger="lockaspect.timer")
        timer.add_tick_listener(broken)
        first, second = Recorder(), Recorder()
        timer.call_later(0.0, first)
        assert first.fired.wait(WAIT)
        timer.call_later(0.0, second)
        assert second.fired.wait(WAIT)
        assert any("tick listener" in record.getMessage() for record in caplog.records)

    def test_len_counts_scheduled_timeouts(self, timer: HashedWheelTimer) -> None:
        """``len`` counts the timeouts scheduled and not yet fired."""
        timer.call_later(3600.0, noop)
        timer.call_later(3600.0, noop)
        assert len(timer) == 2

    def test_tick_and_clock_are_injectable(self) -> None:
        """The tick is configurable and deadlines are read on the injected clock."""
        now: list[float] = [500.0]

        def clock() -> float:
            return now[0]

        manual = HashedWheelTimer(tick=0.25, clock=clock)
        try:
            assert manual.tick == 0.25
            timeout = manual.call_later(3600.0, noop)
            assert timeout.deadline == 4100.0
        finally:
            assert manual.stop() == [timeout]


class TestTimeout:
    def test_run_calls_the_callback_with_its_argument(self) -> None:
        """``run`` calls the callback with the argument given at ``add``."""
        calls: list[object] = []
        wheel = _Wheel(1.0, 8)
        wheel.add(0.5, calls.append, "payload")
        [timeout] = wheel.advance(1.0)
        timeout.run()
        assert calls == ["payload"]

    def test_repr_shows_deadline_and_state(self) -> None:
        """A timeout's repr names its deadline and state."""
        wheel = _Wheel(1.0, 8)
        timeout: Any = wheel.add(2.0, noop)
        assert repr(timeout) == "<Timeout deadline=2.000 pending>"
        timeout.cancel()
        assert repr(timeout) == "<Timeout deadline=2.000 cancelled>"
