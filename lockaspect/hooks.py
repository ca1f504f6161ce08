"""``on_lost`` hooks: run on the thread that learned of the loss, or on a thread of their own
when the timer or the watchdog did (a slow hook must not delay renewals or other losses)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any

from .lease import Lease

__all__ = ["HookRunner", "run_hook"]

log = logging.getLogger("lockaspect.watchdog")


def run_hook(lease: Lease) -> None:
    hook = lease._on_lost
    if hook is None:
        return
    try:
        result = hook(lease)
    except Exception:
        log.exception("on_lost hook for %r raised", lease.key)
        return
    if inspect.isawaitable(result):
        # An async hook: run it on the event loop of the code that holds the lease.
        loop = lease._loop
        try:
            if loop is None:
                raise RuntimeError("the lease was taken by sync code: there is no loop to run it on")
            asyncio.run_coroutine_threadsafe(_await_hook(lease, result), loop)
        except RuntimeError as exc:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            log.error("async on_lost hook for %r not run: %s", lease.key, exc)


async def _await_hook(lease: Lease, awaitable: Any) -> None:
    try:
        await awaitable
    except Exception:
        log.exception("on_lost hook for %r raised", lease.key)


class HookRunner:
    """Runs ``on_lost`` hooks for leases the timer or watchdog gave up.

    On a thread of their own, started on the first loss: a slow hook must neither delay
    the detection of other losses (timer) nor renewals (watchdog), and a hung renewal round
    trip must not delay a hook.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[Lease] = []
        self.thread: threading.Thread | None = None
        self._stopping = False

    def submit(self, lease: Lease) -> None:
        with self._cond:
            if self._stopping:
                return
            self._queue.append(lease)
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="lockaspect-hooks", daemon=True)
                thread.start()  # published once started: stop() joins what it finds
                self.thread = thread
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                leases, self._queue = self._queue, []
            for lease in leases:
                run_hook(lease)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
