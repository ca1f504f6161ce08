"""Wake-up flags: :class:`Wakeup` for a thread, which an exception raised asynchronously cannot
break, and :class:`AsyncWakeup` for a task, settable from any thread (no I/O: the timer, the
watchdog and the stores' notifiers share them)."""

from __future__ import annotations

import asyncio
import threading

__all__ = ["AsyncWakeup", "Wakeup"]


class Wakeup:
    """A wake-up flag for one waiting thread, set and consumed with one C call each.

    ``threading.Event`` takes a ``Condition`` through a Python-level ``__enter__``: an
    exception raised asynchronously (a signal handler in the main thread) between its lock
    being taken and the ``with`` block starting leaves that lock held, and every later
    ``set`` or ``wait`` deadlocks. Here ``set`` is ``Lock.release`` and ``wait`` is
    ``Lock.acquire``: the lock is held while the flag is clear.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set (or ``timeout`` seconds); ``True`` if it was set. Clears it."""
        if timeout is None:
            return self._lock.acquire()
        return self._lock.acquire(timeout=max(0.0, timeout))


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class AsyncWakeup:
    """A wake-up flag for one task on ``loop``: :meth:`wake` may be called from any thread or
    loop; a wake-up that came since the last :meth:`wait` counts."""

    __slots__ = ("_future", "_loop", "_woken")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._woken = False
        self._future: asyncio.Future[bool] | None = None

    async def wait(self, timeout: float) -> bool:
        """Wait for a wake-up or ``timeout`` seconds; ``True`` if woken. Clears it."""
        if self._woken:
            self._woken = False
            return True
        future: asyncio.Future[bool] = self._loop.create_future()
        self._future = future
        timer = self._loop.call_later(max(0.0, timeout), _resolve, future, False)
        try:
            return await future
        finally:
            timer.cancel()
            self._future = None
            self._woken = False

    def wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _set(self) -> None:
        self._woken = True
        if self._future is not None:
            _resolve(self._future, True)
