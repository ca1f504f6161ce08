"""The thread runner: the engine's round trips for sync code, around :mod:`.core` and
:mod:`.waiting` (its asyncio twin is :mod:`.aio`, method for method).

A failed attempt (a timeout, an interrupt) leaves no lock behind: the store undoes an attempt
it cannot know arrived (the Redis store writes the release behind it on the same connection).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from .. import _policy
from ..backends.base import AcquireRequest, AcquireResult, ReleaseResult
from ..errors import BackendError, LockNotAcquired
from ..executor import Outcome, run_body
from ..kinds import LockKind
from ..lease import _HELD, Lease, _push
from ..options import LockSpec
from ..renewal import Renewal
from .core import Engine, Plan
from .events import lease_event
from .holds import Hold, HoldRef
from .many import release_all
from .outcome import settle
from .waiting import ATTEMPT, LISTEN, Waiting, gave_up, new_token, take_grant

__all__ = ["SyncRunner"]

log = logging.getLogger("lockaspect.acquire")
release_log = logging.getLogger("lockaspect.release")


class _Slot:
    """Where this process's waiters for one key queue, so one at a time talks to the store."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class SyncRunner:
    """Acquire, re-enter, wait, run and release for threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.store: Any = engine.store
        self.slots: dict[str, _Slot] = {}  # slot key -> this process's sync waiters for it
        engine.release_abandoned = self.release_abandoned

    # -- acquiring ------------------------------------------------------------------------

    def acquire(self, key: str, spec: LockSpec) -> Hold:
        """Re-enter a lease this context holds on ``key``, or take the lock. The caller owns
        the returned hold and gives it back with :meth:`release`."""
        engine = self.engine
        kind = spec.kind
        try:
            held = engine.held_here(key, kind.family)
            if held is not None:
                hold = self.reenter(held)
                if hold is not None:
                    return hold
                # Its last hold was given back meanwhile (the outer call returned): take the lock.
            below = kind.below(key, engine.find)
            plan = engine.plan(spec, key)
            token = new_token()
            waiter = None if spec.wait == 0 else self._first_waiter(key, spec)  # a single try never queues
            sent = engine.clock()
            failure: BackendError | None = None
            owner = engine.owner(key)
            request = AcquireRequest(
                kind.name, (key,), token, plan.lease_time, waiter, False, below, kind.permits, owner, kind.weight
            )
            try:
                result = self.try_once(request, kind)
            except BackendError as exc:
                if waiter is not None:
                    self.leave_queue(key, waiter, spec, spec.kind.slot_key(key) in self.slots, token)
                if not exc.transient or spec.wait == 0:
                    raise
                # A store restarting or failing over: a waiting caller keeps trying until its
                # wait runs out (the attempt left nothing behind).
                result, failure = AcquireResult(False), exc
                # A fair waiter queues afresh: the failed attempt (under the old id) may still arrive.
                waiter = self._first_waiter(key, spec) if kind.own_place else None
            except BaseException:
                if waiter is not None:
                    self.leave_queue(key, waiter, spec, spec.kind.slot_key(key) in self.slots, token)
                raise
            start = sent
            if not result.acquired:
                result, sent, token = self.wait(key, token, plan, spec, start, result, waiter, below, failure)
            hold = self.take((key,), token, result, spec, plan, sent, start)
            if waiter is not None:
                engine.spare(key, kind, waiter)
            return hold
        except BackendError as exc:
            engine.tell("acquire_failed", key, kind.name, error=exc)
            raise

    def _first_waiter(self, key: str, spec: LockSpec) -> str | None:
        if spec.wait == 0:
            return None  # a single try never queues
        engine = self.engine
        if spec.kind.own_place or not engine.listens(spec):
            return engine.early_waiter(spec, None, key)
        notifier = self.store.notifier()
        return engine.early_waiter(spec, notifier if notifier is not None and notifier.listening(key) else None)

    def try_once(self, request: AcquireRequest, kind: LockKind) -> AcquireResult:
        """One attempt, checked by the kind (a semaphore with another number of permits)."""
        result: AcquireResult = self.store.acquire(request)
        kind.check(request.keys[0], result)
        return result

    def take(
        self,
        keys: tuple[str, ...],
        token: str,
        result: AcquireResult,
        spec: LockSpec,
        plan: Plan,
        sent: float,
        start: float,
    ) -> Hold:
        """The hold for a granted acquisition (the first key's; :meth:`acquire_multi` takes
        the others); if anything stops it from being handed over, the lock is given back."""
        holds: list[Hold] = []
        try:
            self.engine.granted(keys, token, result, spec, plan, sent, holds, None, sent - start)
        except BaseException:
            for made in holds:
                self.release(made)
            self.discard(keys[len(holds) :], token, spec.kind.name)
            raise
        return holds[0]

    def discard(self, keys: tuple[str, ...], token: str, kind: str) -> None:
        for key in keys:
            try:
                self.store.release(key, token, kind)
            except BackendError:
                pass

    def leave_queue(self, key: str, waiter: str, spec: LockSpec, others: bool, token: str) -> None:
        """Take ``waiter`` off ``key``'s queue when its wait ends before the wait loop (which
        does this itself): a waiter's own place always, the process's place only when no
        other waiter of this process for ``key`` (``others``) is left to use it; then give
        ``token`` back if a release may have handed it the lock (FAIR_HANDOFF)."""
        if not spec.kind.own_place and others:
            return
        self.unqueue(key, waiter, spec.kind.name)
        if self.engine.hands_over(self.store, spec.kind):
            self.discard((key,), token, spec.kind.name)

    def unqueue(self, key: str, waiter: str, kind: str) -> None:
        try:
            self.store.unqueue(key, waiter, kind)
        except BackendError:
            pass

    # -- waiting --------------------------------------------------------------------------

    def wait(
        self,
        key: str,
        token: str,
        plan: Plan,
        spec: LockSpec,
        start: float,
        result: AcquireResult,
        waiter: str | None,
        below: str,
        failure: BackendError | None,
    ) -> tuple[AcquireResult, float, str]:
        """Wait for a busy lock: queue behind this process's other waiters for ``key``, then
        retry on each release message (or by bounded polling) until the deadline. Returns the
        result, when its request was sent, and the owner token it holds the lock under."""
        engine = self.engine
        kind = spec.kind
        deadline = _policy.wait_deadline(start, spec.wait)
        turn = False
        waiting = False
        try:
            if deadline is not None and engine.clock() >= deadline:
                if failure is not None:
                    raise failure
                raise gave_up(self.engine, key, spec, start, result)
            self._busy(key, spec, result)
            waiting = True
            if kind.own_place:
                turn = True  # the wait loop leaves the queue itself
                w = engine.waiting(self.store, (key,), token, plan, spec, start, result, waiter, below, failure)
                return self.run_wait(w, None)
            queued = waiter is not None
            slot_key = kind.slot_key(key)
            slot = self._join_slot(slot_key)
            try:
                # Same-process waiters coalesce: only the one holding the slot talks to the store.
                if slot.users > 1:
                    queued = False  # others of ours wait too: one of them may have used our place
                if slot.lock.acquire(blocking=False):
                    pass
                elif deadline is None:
                    queued = False  # others of ours went first: our place in the queue may be gone
                    slot.lock.acquire()
                elif slot.lock.acquire(timeout=max(0.0, deadline - engine.clock())):
                    queued = False
                else:
                    raise gave_up(self.engine, key, spec, start, result)
                try:
                    turn = True
                    w = engine.waiting(
                        self.store, (key,), token, plan, spec, start, result, waiter if queued else None, "", failure
                    )
                    return self.run_wait(w, slot)
                finally:
                    slot.lock.release()
            finally:
                self._leave_slot(slot_key, slot)
        except BaseException:
            if not turn and waiter is not None:
                # Timed out, interrupted or failed before our turn (the wait loop leaves the
                # queue itself).
                self.leave_queue(key, waiter, spec, spec.kind.slot_key(key) in self.slots, token)
            raise
        finally:
            if waiting:  # however the wait ended: the waiting gauges go back down
                engine.tell("wait_ended", key, kind.name, engine.clock() - start)

    def _busy(self, key: str, spec: LockSpec, result: AcquireResult) -> None:
        self.engine.tell("waiting", key, spec.kind.name, 0.0)
        if log.isEnabledFor(logging.DEBUG):
            ends = "with no expiry" if result.holder_ttl is None else f"in {result.holder_ttl:.3f}s"
            limit = "forever" if spec.wait is None else f"up to {spec.wait:g}s"
            log.debug("%r is busy (the holder's lease ends %s); waiting %s", key, ends, limit)

    def run_wait(self, w: Waiting, slot: _Slot | None) -> tuple[AcquireResult, float, str]:
        """The wait loop: do what ``w`` decides until it acquires or raises."""
        engine = self.engine
        clock = engine.clock
        store = self.store
        notifier: Any = store.notifier() if w.notify else None
        if notifier is None:
            w.notify = False  # no notifier after all (a closed store): poll
        subscription: Any = None
        announced = False  # a multi-key wait's "waiting" was emitted
        try:
            while True:
                try:
                    step = w.step(clock(), engine.closed, subscription is not None and subscription.active)
                except LockNotAcquired as exc:
                    why = "busy" if w.wait == 0 else "timeout"
                    engine.tell("not_acquired", exc.key or w.keys[0], w.kind.name, exc.waited, why, number=w.tries)
                    raise
                if step == ATTEMPT:
                    sent = clock()
                    try:
                        result = self.try_once(w.request(sent), w.kind)
                    except BackendError as exc:
                        w.failed(exc, clock())
                        log.debug("%r: attempt failed, retrying while the wait lasts: %s", w.keys[0], exc)
                        continue
                    if w.attempted(result):
                        return result, sent, w.token
                    if w.multi and w.tries == 1 and w.wait != 0:
                        engine.tell("waiting", w.keys[0], w.kind.name, 0.0)
                        announced = True
                elif step == LISTEN:
                    if subscription is not None:
                        notifier.unsubscribe(subscription)
                        subscription = None
                    leave = w.leave_watched()
                    if leave is not None:
                        self.unqueue(*leave, "lock")
                    subscription = notifier.subscribe(w.listen_key, w.listen_timeout(), w.listen_as)
                    w.listened(subscription.active, notifier.waiter_id)
                else:
                    woken = subscription.wait(w.pause) if subscription is not None else _sleep(w.pause)
                    if w.paused(woken, take_grant(subscription), clock()):
                        return w.result, w.sent, w.token
                    for stale in w.discards():
                        self.discard(w.keys[:1], stale, w.kind.name)
        finally:
            if announced:
                engine.tell("wait_ended", w.keys[0], w.kind.name, clock() - w.start)
            if subscription is not None:
                notifier.unsubscribe(subscription)
            place = w.leaving(slot is not None and slot.users > 1)
            if place is not None:
                # Gave up with no other waiter of ours to take over: leave the queue, so a
                # release wakes someone still waiting.
                self.unqueue(*place, w.kind.name)
                for granted in w.granted_tokens():  # a release may have handed us the lock meanwhile
                    self.discard(place[:1], granted, w.kind.name)

    def _join_slot(self, key: str) -> _Slot:
        with self.engine.lock:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot()
            slot.users += 1
            return slot

    def _leave_slot(self, key: str, slot: _Slot) -> None:
        with self.engine.lock:
            slot.users -= 1
            if slot.users == 0 and self.slots.get(key) is slot:
                del self.slots[key]

    # -- multi-key ------------------------------------------------------------------------

    def acquire_multi(self, keys: tuple[str, ...], spec: LockSpec) -> list[Hold]:
        """Take every key at once (see ``LockClient.multi_lock``), or re-enter them all: one
        hold per key, in the keys' order."""
        engine = self.engine
        try:
            held = engine.multi_held(keys)
            if held is not None:
                entered = self._reenter_all(held)
                if entered is not None:
                    return entered
            plan = engine.plan(spec, keys[0], True)
            start = engine.clock()
            w = engine.waiting(self.store, keys, new_token(), plan, spec, start, AcquireResult(False), multi=True)
            result, sent, token = self.run_wait(w, None)
            holds: list[Hold] = []
            try:
                engine.granted(keys, token, result, spec, plan, sent, holds, None, sent - w.start)
            except BaseException:
                for made in holds:
                    self.release(made)
                self.discard(keys[len(holds) :], token, "lock")
                raise
            return holds
        except BackendError as exc:
            engine.tell("acquire_failed", keys[0], spec.kind.name, error=exc)
            raise

    def _reenter_all(self, held: list[Lease]) -> list[Hold] | None:
        """Re-enter every lease of ``held``; ``None`` when one was given back meanwhile (then
        none is re-entered and the caller takes the set afresh)."""
        entered: list[Hold] = []
        try:
            for lease in held:
                hold = self.reenter(lease)
                if hold is None:
                    for made in entered:
                        self.release(made)
                    return None
                entered.append(hold)
        except BaseException:
            for made in entered:
                self.release(made)
            raise
        return entered

    # -- re-entry and release -------------------------------------------------------------

    def reenter(self, lease: Lease) -> Hold | None:
        """Re-enter ``lease``: count a hold, then ask the store whether it still has the lease
        for this owner (it only checks). Any failure gives the counted hold back."""
        engine = self.engine
        hold = engine.enter_hold(lease)
        if hold is None:
            return None
        try:
            engine.entered(hold, self.store.reenter(lease.key, lease.token, lease.kind))
        except BaseException:
            self.release(hold)
            raise
        return hold

    def release(self, hold: Hold) -> None:
        """Give back one hold; on the last, stop renewing and release it in the store.

        Never raises for store trouble: a release that fails leaves a key that expires with
        its lease, and the work done under the lock is not undone by it."""
        ref = hold.ref
        assert ref is not None
        self._give_back(ref)
        # Given back: its weak reference may die with it (no callback, no sweep for nothing).
        hold.ref = None

    def release_all(self, holds: Sequence[Hold]) -> None:
        """Give back a multi-key lock's holds: one store call for the set (see :mod:`.many`)."""
        release_all(self.engine, self.store, holds, self._release_store)

    def _give_back(self, ref: HoldRef, abandoned: bool = False) -> None:
        lease = self.engine.give_back(ref)
        if lease is not None:
            self._release_store(lease, abandoned)

    def _release_store(self, lease: Lease, abandoned: bool = False) -> None:
        engine = self.engine
        code: ReleaseResult | BackendError
        try:
            code = self.store.release(lease.key, lease.token, lease.kind)
        except BackendError as exc:
            code = exc
        except BaseException:
            engine.release_failed_locally(lease)
            raise
        engine.release_done(lease, code, abandoned)

    def release_abandoned(self, ref: HoldRef) -> None:
        """The sweep's release of a hold whose owner vanished (watchdog thread)."""
        self._give_back(ref, abandoned=True)

    def release_vanished(self, record: Renewal) -> None:
        """Release a lease nobody holds any more (watchdog thread; see ``Engine.vanished``)."""
        engine = self.engine
        record.swept = True
        engine.watchdog.released(record)
        release_log.warning("lease on %r has no holder left (its release never came); releasing it", record.key)
        try:
            self.store.release(record.key, record.token, record.kind)
        except BackendError as exc:
            release_log.warning("release of %r failed; the key expires with its lease: %s", record.key, exc)
        engine.vanished_released(record)

    def release_when_done(self, hold: Hold, outcome: Outcome) -> None:
        """A body that outlived its caller: release when it ends."""
        assert outcome.future is not None
        key = hold.lease.key
        lease_event(self.engine.emit, "released_late", hold.lease)

        def release(future: Any) -> None:
            if not future.cancelled() and future.exception() is not None:
                # The caller has already raised LockLost (or was interrupted): this is the
                # only place the body's own failure can still be seen.
                release_log.warning(
                    "the body that held %r finished after its caller stopped waiting, and raised %r",
                    key,
                    future.exception(),
                )
            try:
                self.release(hold)
            except Exception:  # noqa: BLE001 # pragma: no cover - release does not raise for the store
                release_log.exception("deferred release of %r failed", key)

        outcome.future.add_done_callback(release)

    # -- a decorated call -----------------------------------------------------------------

    def run(
        self,
        key: str,
        spec: LockSpec,
        executor: Executor | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_failure: Callable[[LockNotAcquired], Any] | None = None,
    ) -> Any:
        """Acquire, run ``fn`` through the executor, release; raise LockLost if lost.
        ``on_failure`` turns a busy lock into a fallback result."""
        if on_failure is None:
            hold = self.acquire(key, spec)
        else:
            try:
                hold = self.acquire(key, spec)
            except LockNotAcquired as exc:
                return on_failure(exc)
        lease = hold.lease
        outcome: Outcome | None = None
        held = None
        try:
            held = _push(lease)
            outcome = run_body(executor, lease, fn, args, kwargs)
        finally:
            if held is not None:
                _HELD.reset(held)
            if outcome is not None and outcome.abandoned:
                self.release_when_done(hold, outcome)
            else:
                self.release(hold)
        return settle(lease, outcome)

    def reset_after_fork(self) -> None:
        self.slots = {}


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False
