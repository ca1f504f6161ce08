"""The per-client watchdog: renews every watchdog-mode lease of a client, in batches, from
one thread, whatever code (threads or event loops) holds the leases.

Each lease has a :class:`Renewal` record here (the user's :class:`~lockaspect.Lease` reads
its deadline and lost reason from it) and at most two timeouts on the client's wheel: the
next renewal attempt and, while an attempt is pending, the lease's local deadline. A new
lease reaches the wheel at the timer's next tick (see :meth:`Watchdog.register`). When a
renewal falls due the timer thread only queues the record; after the tick the watchdog
thread sends everything queued in ONE round trip, on a connection of its own (so lock
traffic, and a busy event loop, never delay it), and reads one status per lease:

* renewed: the lease end moves to ``sent + lease`` (measured from when the request left,
  a conservative local estimate; the store confirmed it held the lease without a gap, so
  this holds even when the reply is read late) and the next attempt is
  ``delay_weight * lease`` later (:data:`SESSION_PROBE` later on a SESSION_BOUND store, whose
  renewal probes the session);
* not ours: the lease is lost at once (unless its release is in flight: a release that
  overtook the renewal is not a loss);
* that item, or the whole round trip, failed: retried with short backoff while the lease
  lasts.

If the local deadline passes first (store unreachable, a stalled round trip, a process
pause) the lease is lost. The local deadline is a guard (one timer tick plus
:data:`DISPATCH_ALLOWANCE`) before the estimated store-side end, so the lost flag, the
``on_lost`` hook and a cancelled async body all come before another process can take the
lock. Losing a lease sets its flag, logs a WARNING on ``lockaspect.watchdog`` and hands the
``on_lost`` hook to the client's hook thread.

The same thread also sweeps holds whose owner (a ``with`` block, a decorated call) vanished
without releasing them, e.g. after an exception raised asynchronously by a signal handler.

Two library threads in all, however many leases: the timer and this watchdog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence, Sized
from typing import TYPE_CHECKING, Any, Final

from . import _policy
from ._wakeup import Wakeup
from .backends.base import Capability, RenewItem
from .errors import BackendError
from .observe import LockEvent
from .renewal import ARMED, CLOSED, DISPATCH_ALLOWANCE, FINAL, IN_FLIGHT, NEW, NEW_FINAL, QUEUED, Renewal

if TYPE_CHECKING:
    from .backends.base import Store
    from .timer import HashedWheelTimer, Timeout

__all__ = ["DISPATCH_ALLOWANCE", "Renewal", "Watchdog", "WatchdogStats"]

log = logging.getLogger("lockaspect.watchdog")


#: Most leases renewed in one round trip; more that fall due go in the next, at once.
BATCH: Final = 2048

#: Seconds between renewals of a lease whose store is SESSION_BOUND (at least one tick): the
#: renewal probes the session, and the server frees a lost session's locks at once, so the
#: holder must hear of it soon, not at ``delay_weight * lease``.
SESSION_PROBE: Final = 1.0

#: Renewal answers applied per hold of the watchdog's lock.
APPLY_CHUNK: Final = 256


class WatchdogStats:
    """Counters, written only by the watchdog thread (so plain ints are exact)."""

    __slots__ = ("renewal_failures", "renewals", "round_trips")

    def __init__(self) -> None:
        self.renewals = 0
        self.round_trips = 0
        self.renewal_failures = 0


class Watchdog:
    """Renews leases for one backend from one thread, driven by one timer.

    Args:
        backend: Where renewals go (the client's sync backend, also for leases taken by
            async code).
        timer: The client's wheel; the watchdog schedules on it and listens to its ticks.
        lost: Called as ``lost(record, reason)`` on the timer thread (deadline passed) or the
            watchdog thread (the store said not ours), once per lease given up. It must be
            quick: it flips the lease's flag, logs and queues the hook.
        sweep: Called on the watchdog thread while ``orphans`` is not empty: the client
            releases holds whose owner vanished (a weakref callback appends them there).
        vanished, release_vanished: Asked of every lease about to be renewed: when nobody
            holds it any more (its bookkeeping cut short by an exception raised
            asynchronously), it is not renewed but released.
        clock: Monotonic clock; the same one the timer uses.
        emit: The client's observers: told of each round trip (``renewed``) and of failed
            renewals (``renewal_failed``).

    Every lock here is a plain ``threading.Lock`` entered with ``with`` (a C-level enter):
    code on the caller's thread (register, release) may be interrupted by an exception a
    signal handler raises, and must not leave a lock held when it is.
    """

    def __init__(
        self,
        backend: Store,
        timer: HashedWheelTimer,
        lost: Callable[[Renewal, str], None],
        *,
        sweep: Callable[[], None] | None = None,
        orphans: Sized = (),
        vanished: Callable[[Renewal], bool] | None = None,
        release_vanished: Callable[[Renewal], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[LockEvent], object] | None = None,
    ) -> None:
        self._backend = backend
        self._emit = emit
        self._timer = timer
        self._lost = lost
        self._sweep = sweep
        self._orphans = orphans
        self._vanished = vanished
        self._release_vanished = release_vanished
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = Wakeup()
        self._due: list[Renewal] = []
        # Bound once: a bound method made per schedule would be one more object per renewal.
        self._renew_due_cb = self._renew_due
        self._deadline_due_cb = self._deadline_due
        self._failing = False  # for logging the start and end of an outage once each
        bound = bool(backend.capabilities & Capability.SESSION_BOUND)
        self._probe_every = max(timer.tick, SESSION_PROBE) if bound else None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = WatchdogStats()
        # Leases registered or watched since the timer's last tick (see register).
        self._new: deque[Renewal] = deque()
        timer.add_tick_listener(self._after_tick)
        timer.add_feed(self._new, self._arm_new)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def tick(self) -> float:
        return self._timer.tick

    def register(self, record: Renewal) -> None:
        """Start renewing a watchdog-mode lease. Call before the body starts.

        The caller only queues the record (a deque append, no lock, no timeout made): the
        timer thread puts it on the wheel at its next tick, before that tick's timeouts fire,
        which is when a timeout scheduled here would have reached the wheel too; so the first
        renewal and the deadline come exactly as if it were scheduled now. A lease released
        before that tick (the usual lock cycle) never reaches the wheel at all."""
        self._queue(record, NEW)

    def watch(self, record: Renewal) -> None:
        """Watch a fixed lease: no renewal, only the lost signal at its deadline (queued
        like :meth:`register`)."""
        self._queue(record, NEW_FINAL)

    def _queue(self, record: Renewal, state: int) -> None:
        timer = self._timer
        if timer.stopped:  # the client is closing: nothing will renew it (see _schedule)
            record.state = CLOSED
            return
        record.state = state
        self._new.append(record)
        timer.poke()

    def _arm_new(self) -> None:
        """Put the leases queued by :meth:`register` and :meth:`watch` on the wheel (timer
        thread), those not released meanwhile; in chunks, like :meth:`_apply`."""
        new = self._new
        while new:
            with self._lock:
                for _ in range(min(len(new), APPLY_CHUNK)):
                    record = new.popleft()
                    if record.state == NEW:
                        self._arm_next(record)
                    elif record.state == NEW_FINAL:
                        record.state = FINAL
                        self._ensure_deadline(record)

    def released(self, record: Renewal) -> None:
        """Stop renewing or watching ``record`` (its release was answered, or is not sent).

        Never waits for a renewal in flight: the store renews only a lease its token still
        holds, so a renewal that lands after the release changes nothing, and its answer is
        ignored here."""
        with self._lock:
            record.state = CLOSED
            self._cancel_timeouts(record)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread, after the round trip it may be in (at most ``timeout``)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def lose(self, record: Renewal, reason: str) -> None:
        """The store reported ``record`` lost by itself (a session that ended): give it up
        now, unless it is closed, already lost, or its release is in flight (the release's
        answer decides)."""
        with self._lock:
            if record.state == CLOSED or record.lost_reason is not None or record.releasing_since is not None:
                return
            record.state = CLOSED
            self._cancel_timeouts(record)
        self._lost(record, reason)

    # -- called with self._lock held --------------------------------------------------

    def _schedule(
        self, at: float, fn: Callable[[Renewal], None], record: Renewal, reuse: Timeout | None = None
    ) -> Timeout | None:
        try:
            if reuse is not None:
                return self._timer.reschedule(reuse, at, fn, record)
            return self._timer.schedule(at, fn, record)
        except RuntimeError:  # the timer stopped: the client is closing
            record.state = CLOSED
            return None

    def _ensure_deadline(self, record: Renewal) -> None:
        """One deadline timeout per record for its whole life: when it fires before the
        (since moved) local deadline, it moves itself there (see _deadline_due)."""
        if record.deadline is None:
            record.deadline = self._schedule(record.lost_at, self._deadline_due_cb, record)

    def _arm_renewal(self, record: Renewal, at: float) -> None:
        record.state = ARMED
        spare, record.spare = record.spare, None
        record.timeout = self._schedule(at, self._renew_due_cb, record, spare)

    def _arm_next(self, record: Renewal) -> None:
        hold_deadline = record.hold_deadline
        if hold_deadline is not None and record.ends_at >= hold_deadline - 1e-6:
            # max_hold reached: this lease term is the last one.
            record.state = FINAL
            self._ensure_deadline(record)
            return
        at = _policy.first_renewal_at(record.renewed_at, record.ends_at - record.renewed_at, record.delay_weight)
        if self._probe_every is not None:
            at = min(at, record.renewed_at + self._probe_every)
        # A tick early: the wheel fires up to a tick late, and never early.
        self._arm_renewal(record, at - self._timer.tick)

    def _cancel_timeouts(self, record: Renewal) -> None:
        for timeout in (record.timeout, record.deadline):
            if timeout is not None:
                timeout.cancel()
        record.timeout = record.deadline = None

    # -- timer thread -----------------------------------------------------------------

    def _renew_due(self, record: Renewal) -> None:
        with self._lock:
            if record.state != ARMED:
                return
            record.spare, record.timeout = record.timeout, None
            hold_deadline = record.hold_deadline
            if hold_deadline is not None and hold_deadline - self._clock() <= self._timer.tick:
                # Nothing left to renew for: let the lease run out at max_hold.
                record.state = FINAL
                self._ensure_deadline(record)
                return
            record.state = QUEUED
            self._due.append(record)
            # If the attempt stalls, the deadline still fires on time.
            self._ensure_deadline(record)

    def _after_tick(self) -> None:
        if self._due or self._orphans:
            if self._thread is None and not self._stopping:
                with self._lock:
                    if self._thread is None:
                        # Published once started: stop() joins what it finds, and a thread not
                        # started yet cannot be joined.
                        thread = threading.Thread(target=self._run, name="lockaspect-watchdog", daemon=True)
                        thread.start()
                        self._thread = thread
            self._wake.set()

    def _deadline_due(self, record: Renewal) -> None:
        with self._lock:
            if record.state == CLOSED or record.lost_reason is not None:
                return
            if self._clock() < record.lost_at:  # renewed since: move on to the new deadline
                record.deadline = self._schedule(record.lost_at, self._deadline_due_cb, record, record.deadline)
                return
            reason = record.time_reason()
            record.state = CLOSED
            self._cancel_timeouts(record)
        # Flip the flag here, on time, even while a renewal round trip hangs; ``lost`` only
        # logs and hands the hook to the client's hook thread.
        self._lost(record, reason)

    # -- the watchdog thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            # The timeout only guards against a wake-up lost to an interrupted set().
            self._wake.wait(1.0)
            if self._stopping:
                return
            if self._orphans and self._sweep is not None:
                try:
                    self._sweep()
                except Exception:  # pragma: no cover - the sweep logs its own failures
                    log.exception("sweeping abandoned holds failed")
            records = self._take()
            if records and self._vanished is not None and self._release_vanished is not None:
                gone = [record for record in records if self._vanished(record)]
                for record in gone:
                    self._release_vanished(record)
                if gone:
                    records = [record for record in records if record.state == IN_FLIGHT]
            if records:
                self._renew(records)

    def _take(self) -> list[Renewal]:
        """Move up to :data:`BATCH` still-queued records in flight, the earliest due first
        (the rest go in the next round trip, at once)."""
        with self._lock:
            records = []
            due = self._due
            taken = 0
            for taken, record in enumerate(due, 1):  # noqa: B007 - taken is used after the loop
                if record.state == QUEUED:
                    record.state = IN_FLIGHT
                    records.append(record)
                    if len(records) >= BATCH:
                        break
            self._due = due[taken:]
            if self._due:
                self._wake.set()
        return records

    def _renew(self, records: list[Renewal]) -> None:
        sent = self._clock()
        stats = self.stats
        stats.round_trips += 1
        renewals, failures = stats.renewals, stats.renewal_failures
        requests = [record.renewal_item(sent) for record in records]
        emit = self._emit
        if emit is not None:
            emit(LockEvent("renewing", batch=len(records)))
        statuses: Sequence[Any] | None = None
        error: BackendError | None = None
        try:
            statuses = self._backend.renew(requests)
        except BackendError as exc:
            error = exc
        self._outcome(len(records), error)
        self._apply(records, sent, requests, statuses)
        if emit is not None:
            emit(LockEvent("renewed", number=stats.renewals - renewals, batch=len(records)))
            failed = stats.renewal_failures - failures
            if failed:
                emit(LockEvent("renewal_failed", number=failed, batch=len(records), error=error))

    def _outcome(self, count: int, error: BackendError | None) -> None:
        """Account a round trip's success or failure, logging an outage once each way."""
        if error is not None:
            self.stats.renewal_failures += count
            if not self._failing:
                self._failing = True
                log.warning("renewals are failing, retrying until each lease ends: %s", error)
            else:
                log.debug("renewal round trip for %d lease(s) failed: %s", count, error)
        elif self._failing:
            self._failing = False
            log.info("renewals succeed again")

    def _apply(
        self,
        records: list[Renewal],
        sent: float,
        requests: list[RenewItem],
        statuses: Sequence[Any] | None,
    ) -> None:
        """Act on the store's answer (``None``: the round trip failed). Per item: ``True``
        renewed for the lease asked, a float renewed for that many seconds (RedLock's
        validity), ``False`` not ours, ``None`` that item failed (retried)."""
        lost: list[tuple[Renewal, str]] = []
        for start in range(0, len(records), APPLY_CHUNK):
            # The lock in chunks: the timer thread must not wait for a whole batch (a garbage
            # collection landing mid-batch would hold it up for all of it).
            with self._lock:
                self._apply_chunk(records, start, sent, requests, statuses, lost)
        for record, reason in lost:
            self._lost(record, reason)

    def _apply_chunk(
        self,
        records: list[Renewal],
        start: int,
        sent: float,
        requests: list[RenewItem],
        statuses: Sequence[Any] | None,
        lost: list[tuple[Renewal, str]],
    ) -> None:
        stats = self.stats
        now = self._clock()
        for i in range(start, min(start + APPLY_CHUNK, len(records))):
            record = records[i]
            if record.state != IN_FLIGHT:
                continue  # released (or lost) while in flight: its answer means nothing now
            status = None if statuses is None else statuses[i]
            if status is None:
                if statuses is not None:
                    stats.renewal_failures += 1
                self._retry(record, now)
            elif status is False:
                if record.releasing_since is not None:
                    # The release overtook this renewal; the release's answer decides.
                    record.state = FINAL
                    self._cancel_timeouts(record)
                    continue
                record.state = CLOSED
                self._cancel_timeouts(record)
                lost.append((record, "not-owner"))
            elif record.seen_lost:
                # Confirmed too late: the holder was already told the lease was lost.
                record.state = CLOSED
                self._cancel_timeouts(record)
                lost.append((record, record.time_reason()))
            else:
                # The store had the lease when the renewal arrived and extended it: the
                # lease never lapsed there, however late this reply is read.
                stats.renewals += 1
                record.attempt = 0
                asked: float = requests[i][2]
                granted = asked if status is True else min(float(status), asked)
                record.extend(sent, granted)  # its deadline timeout moves on when it fires
                self._arm_next(record)

    def _retry(self, record: Renewal, now: float) -> None:
        record.attempt += 1
        at = _policy.renewal_retry_at(now, record.attempt, record.lost_at, self._timer.tick)
        if at is None:
            record.state = FINAL  # the deadline timeout declares it lost
            return
        self._arm_renewal(record, at)

    def _reset_after_fork(self) -> None:
        self._new.clear()
        self._lock = threading.Lock()
        self._wake = Wakeup()
        self._due = []
        self._thread = None
