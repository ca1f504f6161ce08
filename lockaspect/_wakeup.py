"""A wake-up flag that an exception raised asynchronously cannot break (no I/O, no imports
beyond ``threading``: the timer, the watchdog and the stores' notifiers share it)."""

from __future__ import annotations

import threading

__all__ = ["Wakeup"]


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
