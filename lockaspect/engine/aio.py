"""The asyncio runner: :mod:`.sync`'s twin, method for method, around the same :mod:`.core`
and :mod:`.waiting` decisions. What is genuinely asyncio lives here: the per-loop state (an
async store per event loop), shielding of the round trips that must finish whatever happens
to the caller (leaving a queue; a release cut short by a cancellation is sent again), and
cancelling a body whose lease is lost."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from .. import _policy
from ..backends.base import AcquireRequest, AcquireResult, ReleaseResult
from ..errors import BackendError, LockNotAcquired
from ..kinds import LockKind
from ..lease import _HELD, Lease, _push
from ..options import LockSpec
from ..owner import owner_record
from ._loop import LoopState, LostCancel, _AsyncSlot, _quietly, cancelling, raise_if_cancel_lost, resend_release
from .core import Engine, Plan
from .holds import Hold
from .many import arelease_all
from .outcome import lost_error
from .waiting import ATTEMPT, LISTEN, Waiting, gave_up, new_token, take_grant

__all__ = ["AsyncRunner"]

log = logging.getLogger("lockaspect.acquire")


class AsyncRunner:
    """Acquire, re-enter, wait, run and release for asyncio tasks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopState] = weakref.WeakKeyDictionary()
        self.last: LoopState | None = None

    # -- the loop's state -----------------------------------------------------------------

    def _owner(self, key: str) -> str:
        """The owner record of the running task's acquisition of ``key`` ("" without owner_info)."""
        if not self.engine.owner_info:
            return ""
        task = asyncio.current_task()
        return owner_record(key, None if task is None else task.get_name())

    def state(self) -> LoopState:
        """The running loop's async store and waiter slots, made on first use."""
        loop = asyncio.get_running_loop()
        state = self.last
        if state is not None and state.loop is loop:
            return state
        with self.engine.lock:
            state = self.states.get(loop)
            if state is None:
                state = LoopState(loop, self.engine.store.asyncio_twin(), self._forget_state)
                self.states[loop] = state
        self.last = state
        return state

    def _forget_state(self, state: LoopState) -> None:
        with self.engine.lock:
            if self.states.get(state.loop) is state:
                del self.states[state.loop]
            if self.last is state:
                self.last = None

    async def close_loop(self) -> None:
        """Close the running loop's store (awaiting its pending releases)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        with self.engine.lock:
            state = self.states.pop(loop, None)
            if self.last is state:
                self.last = None
        if state is not None:
            await state.close()

    # -- acquiring ------------------------------------------------------------------------

    async def acquire(self, key: str, spec: LockSpec) -> Hold:
        """:meth:`SyncRunner.acquire <lockaspect.engine.sync.SyncRunner.acquire>` for a task."""
        engine = self.engine
        kind = spec.kind
        try:
            held = engine.held_here(key, kind.family)
            state = self.state()
            if held is not None:
                hold = await self.reenter(held, state)
                if hold is not None:
                    return hold
            below = kind.below(key, engine.find)
            plan = engine.plan(spec, key)
            token = new_token()
            waiter = None if spec.wait == 0 else self._first_waiter(state, key, spec)  # a single try never queues
            sent = engine.clock()
            failure: BackendError | None = None
            owner = self._owner(key)
            request = AcquireRequest(
                kind.name, (key,), token, plan.lease_time, waiter, False, below, kind.permits, owner, kind.weight
            )
            try:
                # try_once inlined: one coroutine less held by each first attempt in flight
                result = await state.store.acquire(request)
                kind.check(key, result)
            except BackendError as exc:
                if waiter is not None:
                    await self.leave_queue(state, key, waiter, spec, kind.slot_key(key) in state.slots, token)
                if not exc.transient or spec.wait == 0:
                    raise
                result, failure = AcquireResult(False), exc
                # A fair waiter queues afresh: the failed attempt (under the old id) may still arrive.
                waiter = self._first_waiter(state, key, spec) if kind.own_place else None
            except BaseException:
                if waiter is not None:
                    await self.leave_queue(state, key, waiter, spec, kind.slot_key(key) in state.slots, token)
                raise
            start = sent
            if not result.acquired:
                result, sent, token = await self.wait(
                    state, key, token, plan, spec, start, result, waiter, below, failure
                )
            hold = await self.take(state, (key,), token, result, spec, plan, sent, start)
            if waiter is not None:
                engine.spare(key, kind, waiter)
            return hold
        except BackendError as exc:
            engine.tell("acquire_failed", key, kind.name, error=exc)
            raise

    def _first_waiter(self, state: LoopState, key: str, spec: LockSpec) -> str | None:
        if spec.wait == 0:
            return None  # a single try never queues
        engine = self.engine
        if spec.kind.own_place or not engine.listens(spec):
            return engine.early_waiter(spec, None, key)
        notifier = state.store.notifier()
        return engine.early_waiter(spec, notifier if notifier is not None and notifier.listening(key) else None)

    async def try_once(self, state: LoopState, request: AcquireRequest, kind: LockKind) -> AcquireResult:
        # A failed or cancelled attempt leaves no lock behind: the store sends the release on
        # the same connection right behind the attempt.
        result: AcquireResult = await state.store.acquire(request)
        kind.check(request.keys[0], result)
        return result

    async def take(
        self,
        state: LoopState,
        keys: tuple[str, ...],
        token: str,
        result: AcquireResult,
        spec: LockSpec,
        plan: Plan,
        sent: float,
        start: float,
    ) -> Hold:
        holds: list[Hold] = []
        try:
            # Before Python 3.12 a cancellation that lands as redis-py completes a write can be
            # swallowed (asyncio.wait_for): it must not let a cancelled task into its body.
            raise_if_cancel_lost()
            self.engine.granted(keys, token, result, spec, plan, sent, holds, state.loop, sent - start)
        except BaseException:
            for made in holds:
                await self.release(made, state)
            await self.discard(state, keys[len(holds) :], token, spec.kind.name)
            raise
        return holds[0]

    async def discard(self, state: LoopState, keys: tuple[str, ...], token: str, kind: str) -> None:
        async def discard() -> None:
            for key in keys:
                with contextlib.suppress(BackendError):
                    await state.store.release(key, token, kind)

        await asyncio.shield(state.spawn(discard()))

    async def leave_queue(
        self, state: LoopState, key: str, waiter: str, spec: LockSpec, others: bool, token: str
    ) -> None:
        """Leave ``key``'s queue (shielded: it may run while the task is cancelled); ``others``:
        other waiters of this loop still use the loop's place; then give ``token`` back if a
        release may have handed it the lock (FAIR_HANDOFF)."""
        if not spec.kind.own_place and others:
            return
        await _quietly(state, state.store.unqueue(key, waiter, spec.kind.name))
        if self.engine.hands_over(state.store, spec.kind):
            await self.discard(state, (key,), token, spec.kind.name)

    # -- waiting --------------------------------------------------------------------------

    async def wait(
        self,
        state: LoopState,
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
        """:meth:`SyncRunner.wait <lockaspect.engine.sync.SyncRunner.wait>` for a task: queue
        behind this loop's other waiters for ``key``."""
        engine = self.engine
        kind = spec.kind
        deadline = _policy.wait_deadline(start, spec.wait)
        slot_key = kind.slot_key(key)
        slot: _AsyncSlot | None = None
        turn = False
        waiting = False
        try:
            raise_if_cancel_lost()
            if deadline is not None and engine.clock() >= deadline:
                if failure is not None:
                    raise failure
                raise gave_up(self.engine, key, spec, start, result)
            engine.tell("waiting", key, kind.name, 0.0)
            waiting = True
            if kind.own_place:
                turn = True  # the wait loop leaves the queue itself
                w = engine.waiting(
                    state.store, (key,), token, plan, spec, start, result, waiter, below, failure, owner=self._owner
                )
                return await self.run_wait(state, w, None)
            queued = waiter is not None
            slot = state.join_slot(slot_key)
            if slot.users > 1:
                queued = False  # others of ours wait too: one of them may have used our place
            if not slot.lock.locked():
                await slot.lock.acquire()  # free: taken at once, without a suspension
            elif deadline is None:
                queued = False  # others of ours went first: our place in the queue may be gone
                await slot.lock.acquire()
            else:
                queued = False
                try:
                    await asyncio.wait_for(slot.lock.acquire(), max(0.0, deadline - engine.clock()))
                except asyncio.TimeoutError:
                    raise gave_up(self.engine, key, spec, start, result) from None
            turn = True
            try:
                w = engine.waiting(
                    state.store,
                    (key,),
                    token,
                    plan,
                    spec,
                    start,
                    result,
                    waiter if queued else None,
                    "",
                    failure,
                    owner=self._owner,
                )
                return await self.run_wait(state, w, slot)
            finally:
                slot.lock.release()
        except BaseException:
            if not turn and waiter is not None:
                # Timed out, cancelled or failed before our turn, at any await point (the wait
                # loop leaves the queue itself).
                others = slot.users > 1 if slot is not None else slot_key in state.slots
                await self.leave_queue(state, key, waiter, spec, others, token)
            raise
        finally:
            if slot is not None:
                state.leave_slot(slot_key, slot)
            if waiting:  # however the wait ended (a cancellation too): the gauges go back down
                engine.tell("wait_ended", key, kind.name, engine.clock() - start)

    async def run_wait(self, state: LoopState, w: Waiting, slot: _AsyncSlot | None) -> tuple[AcquireResult, float, str]:
        """The wait loop: do what ``w`` decides until it acquires or raises."""
        engine = self.engine
        clock = engine.clock
        store = state.store
        notifier: Any = store.notifier() if w.notify else None
        if notifier is None:
            w.notify = False  # no notifier after all (a closed store): poll
        subscription: Any = None
        announced = False  # a multi-key wait's "waiting" was emitted
        try:
            while True:
                raise_if_cancel_lost()
                try:
                    step = w.step(clock(), engine.closed, subscription is not None and subscription.active)
                except LockNotAcquired as exc:
                    why = "busy" if w.wait == 0 else "timeout"
                    engine.tell("not_acquired", exc.key or w.keys[0], w.kind.name, exc.waited, why, number=w.tries)
                    raise
                if step == ATTEMPT:
                    sent = clock()
                    try:
                        result = await self.try_once(state, w.request(sent), w.kind)
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
                        await _quietly(state, store.unqueue(*leave, "lock"))
                    subscription = await notifier.subscribe(w.listen_key, w.listen_timeout(), w.listen_as)
                    w.listened(subscription.active, notifier.waiter_id)
                else:
                    if subscription is not None:
                        woken = await subscription.wait(w.pause)
                    else:
                        await asyncio.sleep(w.pause)
                        woken = False
                    if w.paused(woken, take_grant(subscription), clock()):
                        return w.result, w.sent, w.token
                    for stale in w.discards():
                        await self.discard(state, w.keys[:1], stale, w.kind.name)
        finally:
            if announced:
                engine.tell("wait_ended", w.keys[0], w.kind.name, clock() - w.start)
            if subscription is not None:
                notifier.unsubscribe(subscription)
            place = w.leaving(slot is not None and slot.users > 1)
            if place is not None:
                # Gave up with no other waiter of ours to take over: leave the queue (shielded:
                # this may run while the waiter is being cancelled).
                await _quietly(state, store.unqueue(*place, w.kind.name))
                for granted in w.granted_tokens():  # a release may have handed us the lock meanwhile
                    await self.discard(state, place[:1], granted, w.kind.name)

    # -- multi-key ------------------------------------------------------------------------

    async def acquire_multi(self, keys: tuple[str, ...], spec: LockSpec) -> list[Hold]:
        """:meth:`SyncRunner.acquire_multi <lockaspect.engine.sync.SyncRunner.acquire_multi>`."""
        try:
            return await self._acquire_multi(keys, spec)
        except BackendError as exc:
            self.engine.tell("acquire_failed", keys[0], spec.kind.name, error=exc)
            raise

    async def _acquire_multi(self, keys: tuple[str, ...], spec: LockSpec) -> list[Hold]:
        engine = self.engine
        held = engine.multi_held(keys)
        state = self.state()
        if held is not None:
            entered: list[Hold] = []
            try:
                for lease in held:
                    hold = await self.reenter(lease, state)
                    if hold is None:
                        break
                    entered.append(hold)
                else:
                    return entered
            except BaseException:
                for made in entered:
                    await self.release(made, state)
                raise
            for made in entered:
                await self.release(made, state)
        plan = engine.plan(spec, keys[0], True)
        start = engine.clock()
        w = engine.waiting(
            state.store, keys, new_token(), plan, spec, start, AcquireResult(False), multi=True, owner=self._owner
        )
        result, sent, token = await self.run_wait(state, w, None)
        holds: list[Hold] = []
        try:
            raise_if_cancel_lost()
            engine.granted(keys, token, result, spec, plan, sent, holds, state.loop, sent - w.start)
        except BaseException:
            for made in holds:
                await self.release(made, state)
            await self.discard(state, keys[len(holds) :], token, "lock")
            raise
        return holds

    # -- re-entry and release -------------------------------------------------------------

    async def reenter(self, lease: Lease, state: LoopState) -> Hold | None:
        """Re-enter ``lease`` for a task. The store only checks (holds are counted in the
        engine), so a cancelled check changes nothing there: the counted hold is given back."""
        engine = self.engine
        hold = engine.enter_hold(lease)
        if hold is None:
            return None
        try:
            engine.entered(hold, await state.store.reenter(lease.key, lease.token, lease.kind))
        except BaseException:
            await self.release(hold, state)  # no round trip unless it was the last hold
            raise
        return hold

    async def release(self, hold: Hold, state: LoopState) -> None:
        """Give back one hold; the last is released in the store in the caller's task (a task
        of its own per release costs a third of a cycle). A caller cancelled meanwhile stops
        waiting; the release is sent again (:func:`~._loop.resend_release`)."""
        ref = hold.ref
        assert ref is not None
        lease = self.engine.give_back(ref)
        hold.ref = None  # see SyncRunner.release
        if lease is not None:
            await self._release_store(lease, state, resend=True)

    async def release_all(self, holds: Sequence[Hold], state: LoopState) -> None:
        """:meth:`release` for a multi-key lock's holds: one store call for the set (see :mod:`.many`)."""
        release = partial(self._release_store, state=state)
        await asyncio.shield(state.spawn(arelease_all(self.engine, state.store, holds, release)))

    async def _release_store(self, lease: Lease, state: LoopState, resend: bool = False) -> None:
        """Release ``lease`` (its last hold was given back) in the store; ``resend``: if the
        caller is cancelled meanwhile, send it again from a task of its own."""
        code: ReleaseResult | BackendError
        try:
            code = await state.store.release(lease.key, lease.token, lease.kind)
        except BackendError as exc:
            code = exc
        except BaseException as exc:
            if resend and isinstance(exc, asyncio.CancelledError):
                state.spawn(resend_release(self.engine, state.store, lease))
            else:
                self.engine.release_failed_locally(lease)
            raise
        self.engine.release_done(lease, code)

    # -- a decorated call -----------------------------------------------------------------

    async def run(
        self,
        key: str,
        spec: LockSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_failure: Callable[[LockNotAcquired], Any] | None = None,
    ) -> Any:
        """:meth:`SyncRunner.run <lockaspect.engine.sync.SyncRunner.run>` for ``async def``: the
        body runs as a task, cancelled if the lease is lost."""
        try:
            hold = await self.acquire(key, spec)
        except LockNotAcquired as exc:
            if on_failure is None:
                raise
            value = on_failure(exc)
            return await value if inspect.isawaitable(value) else value
        lease = hold.lease
        state = self.state()
        loop = state.loop
        held = _push(lease)
        try:
            body = loop.create_task(fn(*args, **kwargs))  # a copy of this context: it holds the lease
        except BaseException:
            _HELD.reset(held)
            await self.release(hold, state)
            raise
        _HELD.reset(held)
        lost_cancel = LostCancel(loop, body)
        lease._add_lost_waiter(lost_cancel)
        body.add_done_callback(lambda _: lease._remove_lost_waiter(lost_cancel))
        try:
            result = await body
        except asyncio.CancelledError as exc:
            if not body.done():
                # We were cancelled: the body got the cancellation too; let it finish its own
                # cleanup before the lock goes.
                await asyncio.wait({body})
            await self.release(hold, state)
            if lost_cancel.fired and not cancelling():
                raise lost_error(lease, "; the body was cancelled", exc) from exc
            raise
        except BaseException as exc:
            await self.release(hold, state)
            if lease.lost and isinstance(exc, Exception):
                raise lost_error(lease, " before the call completed", exc) from exc
            raise
        await self.release(hold, state)
        if lease.lost:
            raise lost_error(lease, " before the call completed", result=result)
        return result

    def reset_after_fork(self) -> None:
        self.states = weakref.WeakKeyDictionary()
        self.last = None
