"""What the topology fault tests share: a bounded wait on state only the servers (or another
thread) can tell, an ``on_lost`` hook and an observer that record what the holder was told, a
view of a lock key's expiry on one node, and the slot arithmetic of lock keys.

No sleep stands for an event here: each wait polls a condition and fails after
:data:`BOUND`, which only stops a broken store from hanging the run (never a timing
threshold).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from lockaspect import Lease, LockClient, LockLost, LockNotAcquired
from lockaspect.observe import LockEvent
from lockaspect.testing import ValkeyNode

BOUND = 30.0  # seconds: how long a broken store may hang a test
#: How long a waiter may take to get a lock once it is free, after a fault (a few of the
#: waiters' own rechecks); only bounds a hang, it measures nothing.
GRANT_BOUND = 10.0


def until(condition: Callable[[], object], what: str, bound: float = BOUND) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``bound`` seconds."""
    pause = threading.Event()
    deadline = time.monotonic() + bound
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound:g}s waiting for {what}")
        pause.wait(0.01)


async def until_async(condition: Callable[[], object], what: str, bound: float = BOUND) -> None:
    """:func:`until` for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + bound
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound:g}s waiting for {what}")
        await asyncio.sleep(0.01)


class LostHook:
    """An ``on_lost`` hook: the leases reported lost, with their reasons."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.fired = threading.Event()

    def __call__(self, lease: Lease) -> None:
        self.leases.append(lease)
        self.fired.set()

    @property
    def reasons(self) -> list[str | None]:
        return [lease.lost_reason for lease in self.leases]


class Recorder:
    """An observer keeping every event: renewals done, renewals failed (and their errors)."""

    def __init__(self) -> None:
        self.events: list[LockEvent] = []
        self._mutex = threading.Lock()

    def __call__(self, event: LockEvent) -> None:
        with self._mutex:
            self.events.append(event)

    def named(self, name: str) -> list[LockEvent]:
        with self._mutex:
            return [event for event in self.events if event.name == name]

    def renewed(self) -> int:
        """Leases renewed so far (the ``number`` of every ``renewed`` event)."""
        return sum(event.number for event in self.named("renewed"))

    def errors(self) -> list[BaseException]:
        """The store errors of failed renewals and releases, and their causes."""
        found: list[BaseException] = []
        for event in self.named("renewal_failed") + self.named("release_failed"):
            error: BaseException | None = event.error
            while error is not None:
                found.append(error)
                error = error.__cause__
        return found


def no_noscript(recorder: Recorder) -> None:
    """Assert no NOSCRIPT reached the engine (a renewal or release failing with it)."""
    noscript = [error for error in recorder.errors() if isinstance(error, redis.exceptions.NoScriptError)]
    assert not noscript, f"NOSCRIPT surfaced: {noscript}"
    assert not [error for error in recorder.errors() if "NOSCRIPT" in str(error)]


def pttl(node: ValkeyNode, name: str) -> int:
    """``PTTL name`` on ``node`` itself (-2: no such key there; a node that does not serve
    the key's slot answers with an error, raised)."""
    with node.client() as raw:
        return int(raw.pttl(name))


def has_key(node: ValkeyNode, name: str) -> bool:
    with node.client() as raw:
        try:
            return bool(raw.exists(name))
        except redis.exceptions.ResponseError:  # MOVED / ASK: the node does not serve it
            return False


def renewed_on(node: ValkeyNode, name: str, bound: float = BOUND) -> None:
    """Wait until a renewal lands on ``node``: the key's remaining time there goes *up* (it
    only goes down between renewals), twice, so that one write already in flight when this
    was called does not count alone."""
    for _ in range(2):
        first = pttl(node, name)
        assert first > 0, f"{name!r} is not on {node.name} (PTTL {first})"
        seen: list[int] = []

        def up(first: int = first, seen: list[int] = seen) -> bool:
            seen.append(pttl(node, name))
            return seen[-1] > first

        try:
            until(up, f"a renewal of {name!r} on {node.name}", bound)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (PTTL there: {first} first, {seen[-1:]} last)") from None


def lock_key(client: LockClient, key: str) -> str:
    return str(client.backend.lock_key(key))  # type: ignore[attr-defined]


def same_slot_key(key: str) -> str:
    """Another user key whose store keys share ``key``'s hash slot (a one-slot multi-key lock)."""
    slot = key_slot(key.encode())
    for i in range(1_000_000):
        other = f"{key}-{i}"
        if key_slot(other.encode()) == slot:
            return other
    raise AssertionError("no key found in the slot")  # pragma: no cover - 16384 slots


def in_thread(target: Callable[[], Any], name: str) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a daemon thread; its result (or exception) lands in the list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, outcome


def refused(client: LockClient, key: str, wait: float = 0.0) -> None:
    """A lock of ``key`` is refused (``wait``: retrying transient errors meanwhile, as a
    client whose slot map still names a dead node must): someone holds it."""
    with pytest.raises(LockNotAcquired), client.lock(key, wait=wait):
        pass  # pragma: no cover - the point is that it is never entered


async def refused_async(client: LockClient, key: str) -> None:
    with pytest.raises(LockNotAcquired):
        async with client.lock(key):
            pass  # pragma: no cover


def held_through_a_kill(
    holder: LockClient,
    waiter: LockClient,
    waits: Recorder,
    key: str,
    kill: Callable[[], ValkeyNode],
    refuse: Callable[[], None],
) -> None:
    """The primary (or master) holding ``key`` is killed while ``holder`` holds it and
    ``waiter`` waits for it (``waits`` records the waiter's events); ``kill()`` returns the
    promoted node once it serves the key. Either the lock is kept (the new node has the key,
    renewals land there, ``refuse()`` — another client — is refused, the waiter has not got
    it) or the holder is told (on_lost, ``not-owner`` or ``expired``); never silently two
    holders. Then the waiter gets the lock after the release, with a newer fencing token; and
    what the store could keep (the promoted node had the key), it keeps."""
    hook = LostHook()
    name = lock_key(holder, key)
    released = threading.Event()

    def wait_for_it() -> tuple[int, bool]:
        with waiter.lock(key, wait=BOUND) as got:
            return got.fencing_token, released.is_set()

    block = holder.lock(key, on_lost=hook)
    lease = block.__enter__()
    try:
        thread, outcome = in_thread(wait_for_it, "waiter")
        until(lambda: waits.named("waiting"), "the waiter to find the lock busy")
        new = kill()
        promoted_with_key = has_key(new, name)
        landed: list[bool] = []
        # Whichever comes first: a renewal on the new node, or the holder told.
        in_thread(lambda: landed.append(renewed_on(new, name) is None), "renewal probe")
        until(lambda: landed or hook.fired.is_set(), "a renewal on the new node or on_lost")
        if not hook.leases:
            assert promoted_with_key, "the holder was not told, but the new node lacks its key"
            refuse()
            assert not outcome, f"the waiter got the lock while it was held: {outcome}"
            assert lease.held
        else:
            assert hook.reasons[0] in ("not-owner", "expired")
    finally:
        released.set()
        try:
            block.__exit__(None, None, None)
        except LockLost:
            assert hook.leases, "LockLost on release, but on_lost was never called"
    thread.join(GRANT_BOUND)
    assert not thread.is_alive(), "the waiter blocked through the kill never got the lock"
    assert len(outcome) == 1
    assert not isinstance(outcome[0], BaseException), outcome[0]
    fence, after_release = outcome[0]
    assert fence > lease.fencing_token
    if not hook.leases:
        assert after_release, "the waiter got the lock before the holder released it"
    assert not (promoted_with_key and hook.leases), (
        f"lost ({hook.reasons}) although the promoted node had the lock: renewals never reached it"
    )
