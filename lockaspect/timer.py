"""A hashed-wheel timer: Netty's ``HashedWheelTimer`` algorithm with one daemon thread.

The wheel is a ring of ``size`` buckets (a power of two, 512 by default), each covering one
``tick`` (100 ms by default). A timeout due ``n`` ticks from now goes into bucket
``(current + n) & mask`` with ``n // size`` remaining rounds; each tick the driver visits
one bucket, fires the timeouts whose rounds are used up and decrements the others. Adding
and cancelling are O(1), firing is O(due), and a timeout fires at most one tick late, never
early (Varghese & Lauck, "Hashed and Hierarchical Timing Wheels", 1987).

:class:`_Wheel` is the pure algorithm: it is advanced with explicit ``now`` values, so the
tests drive it with a manual clock and never sleep. :class:`HashedWheelTimer` drives one
wheel from one lazily started daemon thread. Create one per :class:`~lockaspect.LockClient`
(the client does), not one per lock: a thread per held lock is exactly what this replaces.

Callbacks run on the timer thread and must be quick; lockaspect's own callbacks only move
work to the watchdog thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sized
from typing import Any, Final

from ._wakeup import Wakeup

__all__ = ["HashedWheelTimer", "Timeout"]

log = logging.getLogger("lockaspect.timer")

#: Seconds the driver keeps ticking after the wheel empties before it sleeps until the next
#: schedule() wakes it.
IDLE_AFTER: Final = 1.0

#: While idle, the driver still looks at the wheel this often, in case the wake-up of a
#: schedule() was lost (an exception raised asynchronously inside it).
IDLE_RECHECK: Final = 10.0

_PENDING: Final = 0
_CANCELLED: Final = 1
_EXPIRED: Final = 2


class Timeout:
    """A scheduled call; :meth:`cancel` it any time from any thread."""

    __slots__ = ("_arg", "_bucket", "_fn", "_rounds", "_state", "_wheel", "deadline")

    def __init__(self, wheel: _Wheel, deadline: float, fn: Callable[[Any], object], arg: Any) -> None:
        self.deadline = deadline
        self._fn: Callable[[Any], object] | None = fn
        self._arg = arg
        self._wheel = wheel
        self._rounds = 0
        self._state = _PENDING
        self._bucket: set[Timeout] | None = None

    @property
    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    @property
    def expired(self) -> bool:
        return self._state == _EXPIRED

    def cancel(self) -> bool:
        """Cancel the timeout; ``False`` if it already fired or was cancelled."""
        if self._state != _PENDING:
            return False
        self._state = _CANCELLED
        # The wheel drops it from its bucket on its next tick (Netty's cancelledTimeouts
        # queue); deque.append is atomic, so no lock is needed on this path.
        self._wheel._cancelled.append(self)
        return True

    def run(self) -> None:
        """Call the callback (the wheel has already marked the timeout expired)."""
        fn, arg = self._fn, self._arg
        self._fn = self._arg = None
        if fn is not None:
            fn(arg)

    def __repr__(self) -> str:
        state = ("pending", "cancelled", "expired")[self._state]
        return f"<Timeout deadline={self.deadline:.3f} {state}>"


class _Wheel:
    """The pure wheel. Not thread-safe except :meth:`add` and :meth:`Timeout.cancel`,
    which only append to deques; everything else runs on the driving thread."""

    def __init__(self, tick: float, size: int = 512, *, start: float = 0.0) -> None:
        if tick <= 0:
            raise ValueError(f"tick must be > 0, got {tick!r}")
        if size < 1:
            raise ValueError(f"wheel size must be >= 1, got {size!r}")
        size = 1 << (size - 1).bit_length()  # round up to a power of two
        self.tick_duration = tick
        self.size = size
        self._mask = size - 1
        self._buckets: list[set[Timeout]] = [set() for _ in range(size)]
        self._start = start
        self._tick = 0  # index of the next tick to process
        self._count = 0  # timeouts sitting in buckets
        self._pending: deque[Timeout] = deque()
        self._cancelled: deque[Timeout] = deque()

    @property
    def idle(self) -> bool:
        """No timeout is waiting, in a bucket or in the pending queue."""
        return self._count == 0 and not self._pending

    def __len__(self) -> int:
        return self._count + len(self._pending)

    def add(self, deadline: float, fn: Callable[[Any], object], arg: Any = None) -> Timeout:
        timeout = Timeout(self, deadline, fn, arg)
        self._pending.append(timeout)
        return timeout

    def readd(self, timeout: Timeout, deadline: float, fn: Callable[[Any], object], arg: Any = None) -> bool:
        """Schedule a timeout that already fired again (no new object: a process renewing
        tens of thousands of leases would otherwise promote two objects per renewal to the
        garbage collector's oldest generation, and pay for it in long full collections).
        ``False`` (nothing done) unless it fired and its callback was taken."""
        if timeout._state != _EXPIRED or timeout._fn is not None or timeout._bucket is not None:
            return False
        timeout.deadline = deadline
        timeout._fn = fn
        timeout._arg = arg
        timeout._rounds = 0
        timeout._state = _PENDING
        self._pending.append(timeout)
        return True

    def next_tick_at(self) -> float:
        """The instant at which the next tick's bucket becomes due."""
        return self._start + (self._tick + 1) * self.tick_duration

    def fast_forward(self, now: float) -> None:
        """Skip the empty ticks of an idle period without visiting each bucket."""
        if self._count == 0:
            elapsed = int((now - self._start) / self.tick_duration)
            if elapsed > self._tick:
                self._tick = elapsed

    def advance(self, now: float) -> list[Timeout]:
        """Process every tick that ended at or before ``now``; return the expired timeouts.

        The caller runs them (``Timeout.run``) so that a slow callback cannot corrupt the
        wheel's state, and so the pure part stays free of error handling.
        """
        expired: list[Timeout] = []
        while self.next_tick_at() <= now:
            tick_end = self.next_tick_at()
            self._drop_cancelled()
            self._transfer_pending()
            self._expire(self._buckets[self._tick & self._mask], tick_end, expired)
            self._tick += 1
            if self._count == 0 and not self._pending:
                self.fast_forward(now)
        return expired

    def clear(self) -> list[Timeout]:
        """Remove and return every pending timeout (used by ``stop``)."""
        self._drop_cancelled()
        self._transfer_pending()
        left = [t for bucket in self._buckets for t in bucket if t._state == _PENDING]
        for bucket in self._buckets:
            for timeout in bucket:
                timeout._bucket = None  # so a later cancel() cannot decrement the count again
            bucket.clear()
        self._count = 0
        return left

    def _drop_cancelled(self) -> None:
        cancelled = self._cancelled
        while cancelled:
            timeout = cancelled.popleft()
            bucket = timeout._bucket
            if bucket is not None:
                bucket.discard(timeout)
                timeout._bucket = None
                self._count -= 1

    def _transfer_pending(self) -> None:
        # Netty caps the transfer at 100,000 per tick so a flood of adds cannot stall the
        # worker; in Python every add is already paid for by the caller, so take them all.
        pending = self._pending
        tick_duration = self.tick_duration
        while pending:
            timeout = pending.popleft()
            if timeout._state != _PENDING:
                continue
            calculated = int((timeout.deadline - self._start) / tick_duration)
            timeout._rounds = (calculated - self._tick) // self.size
            bucket = self._buckets[max(calculated, self._tick) & self._mask]
            bucket.add(timeout)
            timeout._bucket = bucket
            self._count += 1

    def _expire(self, bucket: set[Timeout], tick_end: float, expired: list[Timeout]) -> None:
        if not bucket:
            return
        done: list[Timeout] = []
        for timeout in bucket:
            if timeout._state != _PENDING:
                done.append(timeout)
            elif timeout._rounds <= 0:
                done.append(timeout)
                timeout._state = _EXPIRED
                expired.append(timeout)
            else:
                timeout._rounds -= 1
        for timeout in done:
            bucket.discard(timeout)
            timeout._bucket = None
        self._count -= len(done)


class HashedWheelTimer:
    """Drives a :class:`_Wheel` from one daemon thread, started on the first schedule.

    Args:
        tick: Seconds per tick; timeouts fire up to one tick late.
        wheel_size: Number of buckets, rounded up to a power of two.
        clock: Monotonic clock in seconds (injectable for tests).
        name: Thread name, shown in thread dumps.

    While the wheel is empty the thread sleeps until something is scheduled, so an idle
    client costs no wake-ups.
    """

    def __init__(
        self,
        tick: float = 0.1,
        wheel_size: int = 512,
        *,
        clock: Callable[[], float] = time.monotonic,
        name: str = "lockaspect-timer",
    ) -> None:
        self._clock = clock
        self._wheel = _Wheel(tick, wheel_size, start=clock())
        self._name = name
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._wake = Wakeup()
        self._idle = False
        self._stopped = False
        self._tick_listeners: list[Callable[[], None]] = []
        self._feeds: list[tuple[Sized, Callable[[], None]]] = []

    @property
    def tick(self) -> float:
        return self._wheel.tick_duration

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def __len__(self) -> int:
        """Timeouts scheduled and not yet fired or dropped."""
        return len(self._wheel)

    def add_tick_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` on the timer thread after each tick's timeouts have run.

        The watchdog uses this to send everything that fell due in one tick as one batch.
        """
        self._tick_listeners.append(listener)

    def add_feed(self, queue: Sized, drain: Callable[[], None]) -> None:
        """Call ``drain`` on the timer thread at each tick, before the tick's timeouts fire,
        while ``queue`` is not empty; the thread does not idle while it is. A caller appends
        to ``queue`` and then calls :meth:`poke` (the watchdog arms new leases this way)."""
        self._feeds.append((queue, drain))

    @property
    def stopped(self) -> bool:
        return self._stopped

    def poke(self) -> None:
        """Start the thread, or wake it if it idles, after an append to a feed's queue: as
        :meth:`schedule` does after its append (the same idle handshake)."""
        if self._thread is None:
            self._start()
        elif self._idle:
            self._wake.set()

    def _fed(self) -> bool:
        return any(queue for queue, _ in self._feeds)

    def schedule(self, deadline: float, fn: Callable[[Any], object], arg: Any = None) -> Timeout:
        """Call ``fn(arg)`` on the timer thread at monotonic time ``deadline`` (or up to one
        tick later). Thread-safe."""
        if self._stopped:
            raise RuntimeError("timer is stopped")
        timeout = self._wheel.add(deadline, fn, arg)
        if self._thread is None:
            self._start()
        elif self._idle:
            self._wake.set()
        return timeout

    def reschedule(self, timeout: Timeout, deadline: float, fn: Callable[[Any], object], arg: Any = None) -> Timeout:
        """:meth:`schedule`, reusing ``timeout`` when it has fired (else a new one). Call it
        from one thread at a time per timeout: the one whose callback ran, or that owns it."""
        if self._stopped:
            raise RuntimeError("timer is stopped")
        if not self._wheel.readd(timeout, deadline, fn, arg):
            return self.schedule(deadline, fn, arg)
        if self._thread is None:
            self._start()
        elif self._idle:
            self._wake.set()
        return timeout

    def call_later(self, delay: float, fn: Callable[[Any], object], arg: Any = None) -> Timeout:
        return self.schedule(self._clock() + delay, fn, arg)

    def stop(self, timeout: float | None = 5.0) -> list[Timeout]:
        """Stop the thread (waiting for it at most ``timeout`` seconds: it is a daemon, and a
        callback stuck on something outside lockaspect must not hang the caller) and return
        the timeouts that never fired. Idempotent."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return self._wheel.clear()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._stopped:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        wheel, clock, wake = self._wheel, self._clock, self._wake
        busy_at = clock()
        while not self._stopped:
            now = clock()
            # Busy: timeouts scheduled (and maybe cancelled) since the last tick count, and so
            # does a feed's queue (see add_feed).
            if not wheel.idle or self._fed():
                busy_at = now
            next_at = wheel.next_tick_at()
            if now < next_at:
                # Keep ticking a while after the wheel empties: under steady lock churn
                # each lock's timeout is added and cancelled within milliseconds, and waking
                # an idle thread for every one of them costs more than ten ticks a second.
                if wheel.idle and now - busy_at >= IDLE_AFTER:
                    # Announce idleness first, then re-check: schedule() appends before it
                    # reads _idle, so either we see its timeout or it sees _idle and wakes us.
                    self._idle = True
                    woken = True
                    if wheel.idle and not self._fed() and not self._stopped:
                        # Bounded: a wake-up may be lost to an interrupted schedule().
                        woken = wake.wait(IDLE_RECHECK)
                    self._idle = False
                    if woken or not wheel.idle or self._fed():
                        busy_at = clock()
                    else:
                        self._notify_listeners()  # a periodic look, also while idle
                    wheel.fast_forward(clock())
                else:
                    wake.wait(next_at - now)
                continue
            self._drain_feeds()  # into the wheel before this tick's bucket fires
            for timeout in wheel.advance(now):
                try:
                    timeout.run()
                except Exception:
                    log.exception("timer callback %r failed", timeout)
            self._notify_listeners()

    def _drain_feeds(self) -> None:
        for queue, drain in self._feeds:
            if queue:
                try:
                    drain()
                except Exception:
                    log.exception("timer feed %r failed", drain)

    def _notify_listeners(self) -> None:
        for listener in self._tick_listeners:
            try:
                listener()
            except Exception:
                log.exception("timer tick listener %r failed", listener)

    def _reset_after_fork(self) -> None:
        # The thread did not survive the fork, and the timeouts belong to the parent.
        self._thread = None
        self._start_lock = threading.Lock()
        self._wake = Wakeup()
        self._idle = False
        self._wheel.clear()
