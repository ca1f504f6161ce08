"""Exceptions raised asynchronously, forks and shutdown never leave a lock behind or the
client wedged.

* A signal handler raising at any point of a lock cycle (after the store granted the lock
  but before the block recorded it, at the top of ``__exit__``, inside the release's
  bookkeeping) left a lease that the watchdog renewed forever with no owner, and sometimes
  left the watchdog's internal lock held so every later lock, release or ``close()``
  deadlocked.
* A forked child inherited the parent's per-key waiter slots (a ``wait=None`` call in the
  child hung forever) and the module-level bookkeeping lock of ``lease.py`` (a child could
  deadlock on its first release).
* ``close()`` while a renewal was in flight killed the watchdog thread with
  ``RuntimeError('timer is stopped')``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faults import wait_until

import lockaspect.lease
from lockaspect import LockClient, LockNotAcquired
from lockaspect.testing import LockServer

FORK_WARNING = "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"


class Interrupt(BaseException):
    """What the signal handler raises (a KeyboardInterrupt would do the same)."""


def _closes(client: LockClient) -> bool:
    """Close ``client`` in a thread; ``False`` if that deadlocked."""
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(30)
    return not closer.is_alive()


class Storm:
    """A storm of signals: a thread sends SIGUSR1 to the main thread every few hundred
    microseconds, and the handler raises :class:`Interrupt`, but only inside
    :meth:`interrupting` (once per entry), never in the test's own bookkeeping.

    (Not SIGALRM: pytest-timeout's alarm must keep working.) The handler lets a signal pass
    when it lands inside the standard library's ``logging``: on Python < 3.13 its module
    lock is taken by a Python-level function, so an exception raised right there leaves it
    held and every later log call of every thread blocks; that is logging's own limit, which
    no library using it can lift (see docs/concepts/failure.md).
    """

    def __init__(self) -> None:
        self.armed = False
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None

    def handler(self, signum: int, frame: Any) -> None:
        if not self.armed:
            return
        probe = frame
        while probe is not None:
            if probe.f_code.co_filename == logging.__file__:
                return
            probe = probe.f_back
        self.armed = False
        raise Interrupt

    def start(self) -> None:
        def storm() -> None:
            rng = random.Random(7)
            while not self._stop.wait(rng.uniform(0.0002, 0.0015)):
                signal.pthread_kill(self._main, signal.SIGUSR1)  # type: ignore[arg-type]

        self._thread = threading.Thread(target=storm, name="signal-storm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def interrupting(self, work: Callable[[], None]) -> bool:
        """Run ``work``; ``True`` if it was interrupted."""
        try:
            try:
                self.armed = True
                work()
            finally:
                self.armed = False
        except Interrupt:
            return True
        return False


@pytest.fixture
def storm() -> Iterator[Storm]:
    storm = Storm()
    previous = signal.signal(signal.SIGUSR1, storm.handler)
    yield storm
    storm.stop()
    signal.signal(signal.SIGUSR1, previous)


class TestSignalStorm:
    # An interrupt inside redis-py's own connect can drop a socket it had not closed yet.
    @pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
    @pytest.mark.parametrize("form", ["with", "decorator", "reentrant"])
    def test_interrupted_cycles_leave_no_lease_and_no_deadlock(
        self,
        make_client: Callable[..., LockClient],
        raw: Any,
        namespace: str,
        storm: Storm,
        form: str,
    ) -> None:
        from lockaspect import distributed_lock

        client = make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5)

        @distributed_lock(key="k<n>", client=client)
        def locked(n: int) -> None:
            pass

        def cycle(n: int) -> None:
            if form == "with":
                with client.lock(f"k{n}"):
                    pass
            elif form == "decorator":
                locked(n)
            else:
                with client.lock(f"k{n}"), client.lock(f"k{n}"):
                    pass

        interrupted = cycles = 0
        storm.start()
        deadline = time.monotonic() + 30.0  # a bound, not the measure: the storm stops at 200 interrupts
        try:
            while interrupted < 200 and time.monotonic() < deadline:
                cycles += 1
                try:
                    interrupted += storm.interrupting(functools.partial(cycle, cycles % 8))
                except LockNotAcquired:
                    pass  # a hold abandoned by an interrupt and not swept yet
        finally:
            storm.stop()
        assert interrupted >= 200, "the storm interrupted too few cycles to test anything"
        # Every hold abandoned by an interrupt is released: nothing stays held or renewed.
        wait_until(lambda: client.stats().held == 0, "the abandoned holds to be released")
        locks = [client.backend.lock_key(f"k{n}") for n in range(8)]
        wait_until(lambda: not raw.exists(*locks), "the keys to be released")
        renewals = client.stats().renewals
        with client.lock("after"):  # still usable
            pass
        # Nothing is renewed any more: more than two watchdog leases later, no key came back.
        time.sleep(2.5)  # waits out two watchdog leases: a renewed orphan would show here
        assert not raw.exists(*locks)
        assert client.stats().renewals == renewals
        assert _closes(client), "close() deadlocked"


def _fork(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child; its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return pid


def _reap(pid: int) -> int:
    """The child's exit status (0: fine), or -1 if it hung (then it is killed)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


def _child(work: Callable[[], None]) -> int:
    return _reap(_fork(work))


@pytest.mark.filterwarnings(FORK_WARNING)
class TestFork:
    def test_a_child_does_not_inherit_the_parents_waiter_slots(
        self, make_client: Callable[..., LockClient], raw: Any
    ) -> None:
        client = make_client()
        holder = make_client()
        queue = client.backend.queue_key("slot")
        parent_waiter = client.backend.notifier().waiter_id
        got: list[bool] = []

        def parent_waits() -> None:
            with client.lock("slot", wait=None):
                got.append(True)

        with holder.lock("slot", lease=30):
            thread = threading.Thread(target=parent_waits)
            thread.start()
            # The parent's waiter holds its slot for the key (it is queued in the store).
            wait_until(lambda: parent_waiter.encode() in raw.lrange(queue, 0, -1), "the parent's waiter to queue")

            def child() -> None:
                with client.lock("slot", wait=None):
                    pass

            pid = _fork(child)
            # Free the lock once the child waits for it too (queued under an id of its own);
            # a child stuck on the parent's slot never queues: then free it anyway, later.
            try:
                wait_until(lambda: len(raw.lrange(queue, 0, -1)) >= 2, "the child to queue", timeout=10)
            except AssertionError:
                pass
        status = _reap(pid)
        thread.join(30)
        assert status == 0, "the child hung on a free lock (or failed)"
        assert got == [True]

    def test_a_child_does_not_inherit_the_bookkeeping_lock(self, make_client: Callable[..., LockClient]) -> None:
        client = make_client()
        taken, release = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with lockaspect.lease._BOOKKEEPING:
                taken.set()
                release.wait(30)

        thread = threading.Thread(target=hold_the_lock)
        thread.start()
        assert taken.wait(30)

        def child() -> None:
            with client.lock("fork-bookkeeping", lease=5) as lease:
                lease._add_lost_waiter(lambda: None)  # takes the bookkeeping lock

        try:
            status = _child(child)
        finally:
            release.set()
            thread.join(30)
        assert status == 0, "the child deadlocked on the bookkeeping lock (or failed)"


class TestCloseDuringRenewal:
    def test_close_while_a_renewal_is_in_flight_stops_cleanly(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        failures: list[BaseException] = []
        monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
        client = make_client(url=fresh_server.url, watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        block = client.lock("closing")
        contextvars.copy_context().run(block.__enter__)  # never exited: keep it out of this thread's context
        trips = client.stats().renewal_round_trips
        fresh_server.pause()
        try:
            wait_until(lambda: client.stats().renewal_round_trips > trips, "a renewal to go out")
            closer = threading.Thread(target=client.close, daemon=True)
            closer.start()
        finally:
            fresh_server.resume()
        closer.join(30)
        assert not closer.is_alive(), "close() hung"
        assert failures == []
        assert all(not thread.is_alive() for thread in client.threads())
