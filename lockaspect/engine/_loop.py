"""What the asyncio runner keeps per event loop, and the asyncio helpers it needs: shielded
store calls, cancelling a body whose lease is lost, a cancellation that went unseen."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ..errors import BackendError

__all__ = ["LoopState", "LostCancel", "cancelling", "raise_if_cancel_lost", "resend_release"]


class _AsyncSlot:
    """Where one event loop's waiters for one key queue (see the sync runner's ``_Slot``)."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class LoopState:
    """What a runner keeps per event loop: the loop's async store (connections belong to one
    loop), its waiter slots, and background tasks it must not lose. (Leases taken on the loop
    are renewed by the watchdog thread, so a busy loop cannot starve them.)"""

    __slots__ = ("_closed", "_forget", "_guard", "loop", "slots", "store", "tasks")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, store: Any, forget: Callable[[LoopState], None] | None = None
    ) -> None:
        self.loop = loop
        self.store = store
        # Called when the state closes, so the runner drops it (the state refers to its loop:
        # kept in the runner, it would keep every closed loop alive).
        self._forget = forget
        self.slots: dict[str, _AsyncSlot] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # asyncio.run() (and any runner calling loop.shutdown_asyncgens()) finalises the loop's
        # async generators before closing it: a started one closes this loop's connections
        # even if nobody awaits client.aclose().
        self._guard = _close_at_shutdown(self)
        step = self._guard.asend(None)
        try:
            step.send(None)
        except StopIteration:
            pass

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def join_slot(self, key: str) -> _AsyncSlot:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _AsyncSlot()
        slot.users += 1
        return slot

    def leave_slot(self, key: str, slot: _AsyncSlot) -> None:
        slot.users -= 1
        if slot.users == 0 and self.slots.get(key) is slot:
            del self.slots[key]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._forget is not None:
            self._forget(self)
        pending = [task for task in self.tasks if not task.done()]
        if pending:
            await asyncio.wait(pending)
        await self.store.aclose()


async def _close_at_shutdown(state: LoopState) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await state.close()


class LostCancel:
    """Cancels a locked body's task when its lease is lost (called from any thread)."""

    __slots__ = ("fired", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: Any) -> None:
        self.loop = loop
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed: nothing left to cancel
            pass

    def _cancel(self) -> None:
        if not self.task.done() and not self.fired:  # once, also when several leases are lost
            self.fired = True
            self.task.cancel()


def cancelling() -> bool:
    """Whether the current task has a cancellation of its own pending (Python 3.11+)."""
    task = asyncio.current_task()
    pending = getattr(task, "cancelling", None)
    return bool(pending()) if pending is not None else False


def raise_if_cancel_lost() -> None:
    """Raise the cancellation this task was sent but never saw, before waiting any longer.

    On Python < 3.12 ``asyncio.wait_for``, which redis-py wraps around every socket write,
    returns normally when a cancellation lands just as the write completes. A waiter that
    went on waiting would then ignore its caller's timeout (until the lock frees, maybe
    never). Python 3.11+ still counts the request (``Task.cancelling()``); 3.10 cannot tell.
    """
    if cancelling():
        raise asyncio.CancelledError


async def _quietly(state: LoopState, coro: Any) -> None:
    """Run a store call that must finish (leaving a queue, discarding an attempt) in a task of
    its own, ignoring its failure and a cancellation of the caller meanwhile."""

    async def call() -> None:
        try:
            await coro
        except BackendError:
            pass

    with contextlib.suppress(BaseException):
        await asyncio.shield(state.spawn(call()))


async def resend_release(engine: Any, store: Any, lease: Any) -> None:
    """Release ``lease`` again (a task of its own) after a cancellation cut its release short:
    the first request may have gone out and run, or not. A release is by owner token, and
    every store answers a second release of a token NOT_OWNER (tests/contract), so this one
    either releases the lock or finds it released already (or taken since by another owner,
    whose lock it leaves alone). The renewals stop either way; NOT_OWNER here is not a loss
    (the first release's answer is unknown), as for the sweep's releases."""
    code: Any
    try:
        code = await store.release(lease.key, lease.token, lease.kind)
    except BackendError as exc:
        code = exc
    except BaseException:
        engine.release_failed_locally(lease)
        raise
    engine.release_done(lease, code, abandoned=True)
