"""Singleton Celery tasks: one run per key at a time, the others retried later.

Stack the decorators with Celery's outermost, so the worker runs the locked function and
the task's ``self`` is one of its bound arguments::

    from lockaspect import distributed_lock
    from lockaspect.contrib.celery import retry_when_busy

    @app.task(bind=True, max_retries=10)
    @distributed_lock(key="report:<account_id>", on_failure=retry_when_busy())
    def generate_report(self, account_id: int) -> str: ...

A second ``generate_report.delay(42)`` sent while one runs finds ``report:42`` busy, and
instead of failing it is put back on the queue with a countdown from the holder's remaining
lease (Celery's ``self.retry``). Its worker slot is free meanwhile. When the task runs out of
retries it fails with the :class:`~lockaspect.LockNotAcquired`.

To drop the duplicate instead, return a value from ``on_failure``:
``on_failure=lambda ctx: "skipped"`` (the task then succeeds with that result).

Needs the ``celery`` extra (``pip install 'lockaspect[celery]'``). See
docs/integrations/celery.md for the decorator order, key templates and what happens when a
worker dies holding a lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NoReturn

from celery import Task

from ..aspect import FailureContext
from ..errors import ConfigurationError, LockNotAcquired

__all__ = ["busy_countdown", "retry_when_busy"]


def busy_countdown(error: LockNotAcquired, *, min_countdown: float = 1.0, max_countdown: float | None = None) -> float:
    """Seconds to wait before trying a busy lock again: the holder's remaining lease
    (``error.holder_ttl``) rounded up to a whole second, at least ``min_countdown`` (also
    used when the store did not report the holder's lease), at most ``max_countdown``.

    The holder's remaining lease is when the lock frees at the latest if the holder stops
    renewing it (it crashed, or a fixed ``lease=`` runs out). A holder in watchdog mode renews
    it while it runs, so the lock may free sooner (when the holder finishes) or later (the
    retry finds it busy again and retries again).
    """
    seconds = min_countdown
    if error.holder_ttl is not None and error.holder_ttl > 0:
        seconds = max(seconds, float(math.ceil(error.holder_ttl)))
    if max_countdown is not None:
        seconds = min(seconds, max_countdown)
    return seconds


def retry_when_busy(
    *, min_countdown: float = 1.0, max_countdown: float | None = None, task_argument: str = "self"
) -> Callable[[FailureContext], NoReturn]:
    """An ``on_failure`` for a bound Celery task: retry the task later instead of failing it.

    The returned callable takes the task from the call's bound arguments
    (``ctx.arguments[task_argument]``: the ``self`` of ``@app.task(bind=True)``) and raises
    ``task.retry(exc=ctx.error, countdown=busy_countdown(ctx.error, ...))``. Celery then
    re-sends the task with the same id, arguments and ``request.retries + 1``, to run after the
    countdown; the worker slot is not held meanwhile. Once the task's ``max_retries`` (Celery's
    default: 3; ``None``: forever) are used up, Celery raises the
    :class:`~lockaspect.LockNotAcquired` and the task fails with it. Set ``max_retries`` on
    the task (``@app.task(bind=True, max_retries=...)``) to cover how long a holder may run.

    Args:
        min_countdown: The shortest countdown in seconds, and the one used when the store did
            not report the holder's remaining lease.
        max_countdown: The longest countdown in seconds (default: none). In watchdog mode the
            holder's remaining lease is up to the client's ``watchdog_lease`` (30 s by
            default) however soon it finishes: cap it for short tasks.
        task_argument: The name of the task's parameter (``self`` unless named otherwise).

    Raises:
        ValueError: ``min_countdown`` is negative or above ``max_countdown``.

    When the lock is busy, the callable raises Celery's ``Retry`` (or the ``LockNotAcquired``
    once out of retries, or at once when the task was called directly rather than run by a
    worker), and :class:`~lockaspect.ConfigurationError` when the function was not run as a
    bound task: ``bind=True`` missing, or ``@distributed_lock`` placed above ``@app.task``.
    """
    if min_countdown < 0:
        raise ValueError(f"min_countdown must be >= 0, got {min_countdown!r}")
    if max_countdown is not None and max_countdown < min_countdown:
        raise ValueError(f"max_countdown ({max_countdown!r}) must be >= min_countdown ({min_countdown!r})")

    def on_failure(ctx: FailureContext) -> NoReturn:
        task = ctx.arguments.get(task_argument)
        if not isinstance(task, Task):
            raise ConfigurationError(
                f"retry_when_busy() needs the Celery task as {ctx.function}()'s {task_argument!r} argument, got "
                f"{type(task).__name__}: declare it @app.task(bind=True) above @distributed_lock(...)"
            ) from ctx.error
        countdown = busy_countdown(ctx.error, min_countdown=min_countdown, max_countdown=max_countdown)
        raise task.retry(exc=ctx.error, countdown=countdown)

    return on_failure
