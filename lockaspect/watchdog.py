"""The per-client watchdog: renews every watchdog-mode lease of a client, in batches.

Each lease has at most two timeouts on the client's wheel: the next renewal attempt and,
while an attempt is pending, the lease end. When a renewal falls due the timer thread
only queues the lease; after the tick the watchdog thread sends everything queued in ONE
round trip (one pipelined call of the batched renew script) and reads one status per
lease:

* renewed: the lease end moves to ``sent + lease`` (measured from when the request left,
  a conservative local estimate) and the next attempt is ``delay_weight * lease`` later;
* not ours: the lease is lost at once;
* the round trip failed: retried with short backoff while the lease lasts.

If the lease end passes first (store unreachable, a stalled round trip, a process pause)
the lease is lost. Losing a lease sets its flag, logs a WARNING on ``lockaspect.watchdog``
and hands the ``on_lost`` hook to the client's hook thread (so a slow hook never delays
renewals, and a hung round trip never delays a hook).

Two library threads in all, however many leases: the timer and this watchdog.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _policy
from .backends.base import RenewItem
from .errors import BackendError
from .lease import ARMED, CLOSED, FINAL, IN_FLIGHT, QUEUED, Lease

if TYPE_CHECKING:
    from .backends.base import Backend
    from .timer import HashedWheelTimer

__all__ = ["Watchdog", "WatchdogStats"]

log = logging.getLogger("lockaspect.watchdog")


class WatchdogStats:
    """Counters, written only by the watchdog thread (so plain ints are exact)."""

    __slots__ = ("renewal_failures", "renewals", "round_trips")

    def __init__(self) -> None:
        self.renewals = 0
        self.round_trips = 0
        self.renewal_failures = 0


class _Batch:
    """One renewal round trip of sync leases; ``cancel()`` waits on it."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()

    def finish(self) -> None:
        self.done.set()


class _LoopBatch:
    """One renewal round trip of an event loop's leases; finished on that loop."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = asyncio.Event()

    def finish(self) -> None:
        self.done.set()


class Watchdog:
    """Renews leases for one backend from one thread, driven by one timer.

    Args:
        backend: Where renewals go.
        timer: The client's wheel; the watchdog schedules on it and listens to its ticks.
        lost: Called as ``lost(lease, reason)`` on the timer thread (lease end passed) or the
            watchdog thread (the store said not ours), once per lease given up, after the
            lease's flag is set. It must be quick: it logs and queues the hook.
        clock: Monotonic clock; the same one the timer uses.
    """

    def __init__(
        self,
        backend: Backend,
        timer: HashedWheelTimer,
        lost: Callable[[Lease, str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._timer = timer
        self._lost = lost
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._due: list[Lease] = []
        self._loops_due: set[LoopRenewer] = set()
        self._failing = False  # for logging the start and end of an outage once each
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = WatchdogStats()
        timer.add_tick_listener(self._after_tick)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def register(self, lease: Lease) -> None:
        """Start renewing a watchdog-mode lease. Call before the body starts."""
        with self._cond:
            self._arm_next(lease)

    def watch(self, lease: Lease) -> None:
        """Watch a fixed lease: no renewal, only the lost signal at its end."""
        with self._cond:
            lease._wd_state = FINAL
            lease._deadline = self._timer.schedule(lease._expires_at, self._deadline_due, lease)

    def cancel(self, lease: Lease) -> Any:
        """Stop renewing or watching ``lease``. Returns the in-flight renewal batch the caller
        must wait for (``batch.done``: a threading.Event for sync leases, an asyncio.Event for
        a loop's) before it releases, so that nothing renews the key afterwards; or ``None``."""
        with self._cond:
            state = lease._wd_state
            lease._wd_state = CLOSED
            self._cancel_timeouts(lease)
            # Waiting keeps a renewal from landing after the release. A lost lease is not
            # ours to protect any more, and its round trip may be the one that hangs.
            batch = lease._batch if state == IN_FLIGHT and lease._lost_reason is None else None
        if batch is not None and threading.current_thread() is self._thread:
            return None  # a hook released from the watchdog thread itself: it cannot wait for itself
        return batch

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- called with self._cond held --------------------------------------------------

    def _arm_next(self, lease: Lease) -> None:
        hold_deadline = lease._hold_deadline
        if hold_deadline is not None and lease._expires_at >= hold_deadline - 1e-6:
            # max_hold reached: this lease term is the last one.
            lease._wd_state = FINAL
            lease._deadline = self._timer.schedule(lease._expires_at, self._deadline_due, lease)
            return
        lease._wd_state = ARMED
        at = _policy.first_renewal_at(lease._renewed_at, lease.lease_time, lease._delay_weight)
        lease._timeout = self._timer.schedule(at, self._renew_due, lease)

    def _cancel_timeouts(self, lease: Lease) -> None:
        for timeout in (lease._timeout, lease._deadline):
            if timeout is not None:
                timeout.cancel()
        lease._timeout = lease._deadline = None

    # -- timer thread -----------------------------------------------------------------

    def _renew_due(self, lease: Lease) -> None:
        with self._cond:
            if lease._wd_state != ARMED:
                return
            hold_deadline = lease._hold_deadline
            if hold_deadline is not None and hold_deadline - self._clock() <= self._timer.tick:
                # Nothing left to renew for: let the lease run out at max_hold.
                lease._wd_state = FINAL
                lease._timeout = None
                if lease._deadline is None:
                    lease._deadline = self._timer.schedule(lease._expires_at, self._deadline_due, lease)
                return
            lease._wd_state = QUEUED
            lease._timeout = None
            renewer = lease._renewer
            if renewer is None:
                self._due.append(lease)
            else:
                renewer.due.append(lease)
                self._loops_due.add(renewer)
            if lease._deadline is None:
                # If the attempt stalls, the lease end still fires on time.
                lease._deadline = self._timer.schedule(lease._expires_at, self._deadline_due, lease)

    def _after_tick(self) -> None:
        if self._due:
            with self._cond:
                if self._thread is None and not self._stopping:
                    self._thread = threading.Thread(target=self._run, name="lockaspect-watchdog", daemon=True)
                    self._thread.start()
                self._cond.notify()
        if self._loops_due:
            with self._cond:
                renewers, self._loops_due = self._loops_due, set()
            for renewer in renewers:
                if not renewer.kick():
                    self._drop(renewer)

    def _drop(self, renewer: LoopRenewer) -> None:
        """A loop closed with leases still renewing: stop watching them, quietly (they
        expire in the store; their loop, and whatever ran on it, is gone)."""
        with self._cond:
            leases, renewer.due = renewer.due, []
            for lease in leases:
                lease._wd_state = CLOSED
                self._cancel_timeouts(lease)
        log.debug("dropped %d renewal(s) for a closed event loop", len(leases))

    def _deadline_due(self, lease: Lease) -> None:
        with self._cond:
            state = lease._wd_state
            if state == CLOSED or lease._lost_reason is not None:
                return
            now = self._clock()
            if now < lease._expires_at:  # renewed since; a stale deadline
                return
            hold_deadline = lease._hold_deadline
            reason = "max-hold" if hold_deadline is not None and now >= hold_deadline - 1e-6 else "expired"
            lease._wd_state = CLOSED
            self._cancel_timeouts(lease)
        # Flip the flag here, on time, even while a renewal round trip hangs; ``lost`` only
        # logs and hands the hook to the client's hook thread.
        if lease._mark_lost(reason):
            self._lost(lease, reason)

    # -- the renewal round trip, shared by the watchdog thread and each LoopRenewer --------
    #
    # _take, _requests, _outcome and _apply do no I/O; the runners only add the round trip.

    def _take(self, due: list[Lease], batch: Any) -> list[Lease]:
        """Move the still-queued leases of ``due`` in flight in ``batch``; empties ``due``."""
        with self._cond:
            leases = []
            for lease in due:
                if lease._wd_state == QUEUED:
                    lease._wd_state = IN_FLIGHT
                    lease._batch = batch
                    leases.append(lease)
            due.clear()
        return leases

    def _requests(self, leases: list[Lease]) -> tuple[float, list[RenewItem]]:
        sent = self._clock()
        self.stats.round_trips += 1
        requests: list[RenewItem] = []
        for lease in leases:
            renewal = _policy.renewal_lease(sent, lease.lease_time, lease._hold_deadline)
            if lease.kind in ("lock", "fair"):
                requests.append((lease.key, lease.token, renewal))
            else:
                requests.append((lease.key, lease.token, renewal, lease.kind))
        return sent, requests

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
        leases: list[Lease],
        batch: Any,
        sent: float,
        requests: list[RenewItem],
        statuses: list[bool] | None,
    ) -> None:
        """Act on the store's answer (``None``: the round trip failed) and finish ``batch``."""
        stats = self.stats
        lost: list[tuple[Lease, str]] = []
        try:
            with self._cond:
                now = self._clock()
                for i, lease in enumerate(leases):
                    lease._batch = None
                    if lease._wd_state != IN_FLIGHT:
                        continue  # cancelled while in flight; the canceller is waiting
                    if statuses is None:
                        self._retry(lease, now)
                    elif now >= lease._expires_at:
                        # The reply came after the lease end, before the deadline timeout
                        # fired: ``lease.lost`` may already have said True (reason
                        # "expired"), so a late success must not revive the lease and a
                        # late "not ours" must not change the reason.
                        hold_deadline = lease._hold_deadline
                        late = hold_deadline is not None and now >= hold_deadline - 1e-6
                        lease._wd_state = CLOSED
                        self._cancel_timeouts(lease)
                        lost.append((lease, "max-hold" if late else "expired"))
                    elif statuses[i]:
                        stats.renewals += 1
                        lease._attempt = 0
                        if lease._lost_reason is None:
                            lease._renewed_at = sent
                            lease._expires_at = sent + requests[i][2]
                        if lease._deadline is not None:
                            lease._deadline.cancel()
                            lease._deadline = None
                        self._arm_next(lease)
                    else:
                        lease._wd_state = CLOSED
                        self._cancel_timeouts(lease)
                        lost.append((lease, "not-owner"))
        finally:
            batch.finish()
        for lease, reason in lost:
            if lease._mark_lost(reason):
                self._lost(lease, reason)

    # -- watchdog thread: the runner for sync leases ------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            batch = _Batch()
            leases = self._take(self._due, batch)
            if leases:
                self._renew(leases, batch)

    def _renew(self, leases: list[Lease], batch: _Batch) -> None:
        sent, requests = self._requests(leases)
        statuses: list[bool] | None = None
        try:
            statuses = self._backend.renew(requests)
        except BackendError as exc:
            self._outcome(len(leases), exc)
        else:
            self._outcome(len(leases), None)
        self._apply(leases, batch, sent, requests, statuses)

    def _retry(self, lease: Lease, now: float) -> None:
        lease._attempt += 1
        at = _policy.renewal_retry_at(now, lease._attempt, lease._expires_at, self._timer.tick)
        if at is None:
            lease._wd_state = FINAL  # the deadline timeout declares it lost
            return
        lease._wd_state = ARMED
        lease._timeout = self._timer.schedule(at, self._renew_due, lease)

    def _reset_after_fork(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._due = []
        self._loops_due = set()
        self._thread = None


class LoopRenewer:
    """Renews one event loop's leases from that loop: no thread, and no task per lease.

    The timer thread queues a loop's due leases here and, once per tick, asks the loop
    (``call_soon_threadsafe``) to flush them: one task per tick sends them all in one round
    trip with the loop's async backend, and the shared watchdog logic acts on the answer.
    """

    def __init__(self, watchdog: Watchdog, loop: asyncio.AbstractEventLoop, backend: Any) -> None:
        self.watchdog = watchdog
        self.loop = loop
        self.backend = backend
        self.due: list[Lease] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self._kicked = False

    def kick(self) -> bool:
        """Ask the loop to flush (timer thread); ``False`` if the loop is closed."""
        if self._kicked:
            return True
        self._kicked = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _flush(self) -> None:
        self._kicked = False
        batch = _LoopBatch()
        leases = self.watchdog._take(self.due, batch)
        if leases:
            task = self.loop.create_task(self._renew(leases, batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _renew(self, leases: list[Lease], batch: _LoopBatch) -> None:
        watchdog = self.watchdog
        sent, requests = watchdog._requests(leases)
        statuses: list[bool] | None = None
        try:
            statuses = await self.backend.renew(requests)
        except BackendError as exc:
            watchdog._outcome(len(leases), exc)
        else:
            watchdog._outcome(len(leases), None)
        finally:
            # Also on cancellation (the loop shutting down): the leases retry or run out.
            watchdog._apply(leases, batch, sent, requests, statuses)
