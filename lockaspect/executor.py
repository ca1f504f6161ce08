"""Where a locked body runs.

By default the body runs inline, in the caller's thread, exactly like an undecorated call:
thread-local state (a database session, an open transaction, a request context) keeps
working, and the caller learns of a lost lease when the body returns (or earlier, by
polling :meth:`Lease.check`).

With ``executor=`` set to a :class:`concurrent.futures.Executor`, the body is submitted
with a copy of the caller's :mod:`contextvars` context (so :func:`current_lease` and
re-entry work in the worker thread) and the caller waits for whichever comes first: the
body's result, or the lease being lost. On a lost lease the caller raises
:class:`~lockaspect.LockLost` at once **while the body keeps running** (Python cannot stop
a thread); the lock is released when the body finally finishes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Executor, Future, InvalidStateError, ProcessPoolExecutor
from typing import Any, Final, Literal

from ._wakeup import Wakeup
from .lease import Lease

__all__ = ["INLINE", "ExecutorOption", "Outcome", "check_executor", "run_body"]

INLINE: Final = "inline"

ExecutorOption = Executor | Literal["inline"] | None


def check_executor(executor: object) -> Executor | None:
    """Validate the ``executor=`` option; ``None`` means inline."""
    if executor is None or executor == INLINE:
        return None
    if isinstance(executor, ProcessPoolExecutor):
        raise TypeError(
            "a ProcessPoolExecutor cannot run a locked body: the lease, its watchdog and the "
            "caller's context live in this process; use a thread pool, or lock inside the task"
        )
    if isinstance(executor, Executor) or callable(getattr(executor, "submit", None)):
        return executor  # type: ignore[return-value]
    raise TypeError(f"executor must be a concurrent.futures.Executor or 'inline', got {type(executor).__name__}")


class Outcome:
    """What became of a body: a result, an exception, or (executor only) still running
    when the lease was lost."""

    __slots__ = ("exception", "future", "interrupt", "result")

    def __init__(
        self,
        result: Any = None,
        exception: BaseException | None = None,
        future: Future[Any] | None = None,
        interrupt: BaseException | None = None,
    ) -> None:
        self.result = result
        self.exception = exception
        #: Set when the caller stopped waiting for a body that is still running.
        self.future = future
        #: The KeyboardInterrupt (or other BaseException) that stopped the wait.
        self.interrupt = interrupt

    @property
    def abandoned(self) -> bool:
        return self.future is not None


class _Handoff:
    """The body as submitted to an executor: it runs in the caller's copied context and
    completes a future of our own, so the caller can cancel it or wait for it even when
    ``submit`` never returned the executor's future (an interrupt inside ``submit``)."""

    __slots__ = ("args", "context", "fn", "future", "kwargs")

    def __init__(
        self, context: contextvars.Context, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.context = context
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.future: Future[Any] = Future()

    def abandon(self, submitted: Future[Any]) -> None:
        """Done-callback of the executor's own future. ``__call__`` never raises, so the
        executor's future fails (or is cancelled) only if our body never ran."""
        if submitted.cancelled():
            self.future.cancel()  # a no-op if the body runs or ran
            return
        error = submitted.exception()
        if error is None or self.future.running() or self.future.done():
            return
        try:
            if self.future.set_running_or_notify_cancel():
                self.future.set_exception(error)
        except (InvalidStateError, RuntimeError):  # the body started after all
            pass

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled by the caller before it started
        try:
            result = self.context.run(self.fn, *self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


def run_body(
    executor: Executor | None,
    lease: Lease,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Outcome:
    """Run ``fn(*args, **kwargs)`` inline or on ``executor``.

    ``Exception`` from the body becomes ``Outcome.exception``; ``BaseException``
    (``KeyboardInterrupt``, ``SystemExit``) propagates so the caller's cleanup runs.
    """
    if executor is None:
        try:
            return Outcome(result=fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the caller re-raises it after releasing
            return Outcome(exception=exc)
    handoff = _Handoff(contextvars.copy_context(), fn, args, kwargs)
    future = handoff.future
    # A Wakeup, not a threading.Event: set from the timer thread when the lease is lost, it
    # must not block on a lock an interrupted wait() of the caller's left held.
    done = Wakeup()
    future.add_done_callback(lambda _: done.set())
    lease._add_lost_waiter(done.set)
    future.add_done_callback(lambda _: lease._remove_lost_waiter(done.set))
    try:
        # Inside the try: an interrupt can land in submit() after the body was queued
        # (ThreadPoolExecutor starts its worker thread after queueing), and the body must
        # then still not run without the lock.
        submitted = executor.submit(handoff)
        # If the executor fails the task without running it (a custom executor that
        # pickles, a shutdown race), fail ours too instead of waiting forever.
        submitted.add_done_callback(handoff.abandon)
        done.wait()
    except BaseException as exc:
        if future.cancel():
            raise  # never started (and now never will): the caller releases as usual
        # Interrupted while the body runs: the caller stops waiting, the body does not,
        # and the lock must stay held until it finishes.
        return Outcome(future=future, interrupt=exc)
    if not future.done():
        return Outcome(future=future)
    exception = future.exception()
    if exception is not None:
        if not isinstance(exception, Exception):
            raise exception
        return Outcome(exception=exception)
    return Outcome(result=future.result())
