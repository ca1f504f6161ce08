"""The memory store's state machine: every lock kind's acquire, release, re-entry, renewal
and queues, as the Lua scripts in ``lockaspect/backends/redis/lua/`` define them. Pure: no
threads, no locks, no clock of its own (every operation is given ``now``), no I/O.

The layout follows the Redis store's keys (``docs/how-it-works.md``), one dictionary per
kind of key, all keyed by the namespaced lock key:

* :attr:`MemoryState.locks`: the mutex and the fair lock (one record, as one hash in Redis,
  so a fair and a plain call on one key exclude each other), also each key of a multi-key
  lock;
* :attr:`MemoryState.fences`: the fencing counters, shared by every kind of one key (as
  ``…:fence``), never dropped: tokens of a key only grow;
* :attr:`MemoryState.queues`: the waiter queues by role (``"lock"`` for ``…:waiters``,
  ``"fair"`` for ``…:fair`` with its last-seen times, ``"semaphore"``, ``"rw"``), which
  expire :data:`QUEUE_TTL` after the last waiting attempt, as in Redis;
* the semaphores and read-write locks of :mod:`._kinds`.

A lease whose end has come (``ends <= now``) is gone: every operation drops what it finds
expired before it looks, so expiry needs no timer (and a test can drive it with a
:class:`~lockaspect.testing.ManualClock`).

Waking a waiter is :attr:`MemoryState.publish` ``(key, waiter, granted)``, which answers how many
listeners received it (as Redis's ``PUBLISH``); the store points it at its notifier hub.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from ..._policy import FAIR_GONE_AFTER, FAIR_SUBSCRIBE_GRACE
from ..base import AcquireRequest, AcquireResult, HolderState, KeyState, ReleaseResult, RenewItem

__all__ = ["FAIR_SCAN", "QUEUE_TTL", "WAKE_LIMIT", "Hold", "Queue", "StateBase"]

#: Seconds a waiter queue lives after the last waiting attempt (the scripts' 60 s PEXPIRE):
#: a queue whose waiters all died goes away by itself.
QUEUE_TTL: Final = 60.0
#: At most this many waiters are popped (woken or skipped) per release (the scripts' 16).
WAKE_LIMIT: Final = 16
#: A fair acquire looks at most this many waiters at the queue's head for gone ones.
FAIR_SCAN: Final = 64


def _nobody(key: str, waiter: str, granted: int = 0) -> int:
    """The default :attr:`MemoryState.publish`: nobody listens."""
    return 0


@dataclass(slots=True)
class Hold:
    """One owner's hold of a lock, a writer's hold or a permit: its token, fencing token and
    the end of its lease; ``kind`` is what took it (``"lock"``/``"fair"``, for describe)."""

    owner: str
    fence: int
    ends: float
    kind: str = "lock"
    #: The owner record sent with the acquisition (``AcquireRequest.owner``).
    record: str = ""


@dataclass(slots=True)
class Queue:
    """A waiter queue (a Redis list) with, for the fair lock, each waiter's last attempt
    (``…:fair:seen``); both expire together at ``until``."""

    ids: list[str]
    until: float
    seen: dict[str, float] = field(default_factory=dict)
    #: The fair lock's waiters' registered leases (``…:fair:grant``): waiter id -> (token,
    #: lease, owner record), what release.lua grants to the first of them.
    grants: dict[str, tuple[str, float, str]] = field(default_factory=dict)


class StateBase:
    """Queues, fencing counters, the mutex, the fair lock and the multi-key lock."""

    def __init__(self) -> None:
        #: Wakes ``waiter`` for a release of ``key`` (``granted``: the fencing token of the hold
        #: the release gave it, 0 for none); answers how many received it.
        self.publish: Callable[[str, str, int], int] = _nobody
        self.fences: dict[str, int] = {}
        self.locks: dict[str, Hold] = {}
        self.queues: dict[tuple[str, str], Queue] = {}

    # -- queues and fences -------------------------------------------------------------

    def queue(self, role: str, key: str, now: float) -> Queue | None:
        """The live queue of ``role`` for ``key`` (``None``: empty or expired)."""
        found = self.queues.get((role, key))
        if found is not None and (found.until <= now or not found.ids):
            del self.queues[(role, key)]
            return None
        return found

    def enqueue(self, role: str, key: str, waiter: str, now: float, front: bool = False) -> Queue:
        """Queue ``waiter`` once (at the head with ``front``) and refresh the queue's expiry."""
        found = self.queue(role, key, now)
        if found is None:
            found = self.queues[(role, key)] = Queue([], now + QUEUE_TTL)
        if waiter not in found.ids:
            if front:
                found.ids.insert(0, waiter)
            else:
                found.ids.append(waiter)
        found.until = now + QUEUE_TTL
        return found

    def dequeue(self, role: str, key: str, waiter: str, now: float) -> bool:
        """Take ``waiter`` off the queue (every entry, and its last-seen time); whether it was there."""
        found = self.queue(role, key, now)
        if found is None:
            return False
        there = waiter in found.ids
        if there:
            found.ids = [queued for queued in found.ids if queued != waiter]
        found.seen.pop(waiter, None)
        found.grants.pop(waiter, None)
        if not found.ids:
            del self.queues[(role, key)]
        return there

    def queued(self, role: str, key: str, waiter: str, now: float) -> bool:
        found = self.queue(role, key, now)
        return found is not None and waiter in found.ids

    def waiting(self, role: str, key: str, now: float) -> int:
        found = self.queue(role, key, now)
        return 0 if found is None else len(found.ids)

    def wake(self, role: str, key: str, now: float, limit: int = WAKE_LIMIT, one: bool = True) -> None:
        """Pop up to ``limit`` waiters of the queue and wake each; with ``one``, stop at the
        first that somebody received (lib.lua's ``wake``)."""
        found = self.queue(role, key, now)
        if found is None:
            return
        for _ in range(limit):
            if not found.ids:
                break
            waiter = found.ids.pop(0)
            if self.publish(key, waiter, 0) > 0 and one:
                break
        if not found.ids:
            del self.queues[(role, key)]

    def next_fence(self, key: str) -> int:
        """The key's next fencing token (one counter per key, shared by every kind)."""
        fence = self.fences.get(key, 0) + 1
        self.fences[key] = fence
        return fence

    # -- the lock and the fair lock (acquire.lua, release.lua, reenter.lua) -------------

    def live_lock(self, key: str, now: float) -> Hold | None:
        held = self.locks.get(key)
        if held is not None and held.ends <= now:
            del self.locks[key]
            return None
        return held

    def lock_acquire(self, request: AcquireRequest, now: float) -> AcquireResult:
        key, token, waiter = request.key, request.token, request.waiter
        held = self.live_lock(key, now)
        if held is None:
            held = self.locks[key] = Hold(token, self.next_fence(key), now + request.lease, "lock", request.owner)
            if waiter is not None:
                self.dequeue("lock", key, waiter, now)
            return AcquireResult(True, held.fence)
        if held.owner == token:
            return AcquireResult(True, held.fence)
        if waiter is not None:
            self.enqueue("lock", key, waiter, now, request.front)
        return AcquireResult(False, holder_ttl=held.ends - now)

    def fair_acquire(self, request: AcquireRequest, now: float) -> AcquireResult:
        """acquire.lua with "fair": a free lock goes only to the first live waiter; waiters
        not seen for FAIR_GONE_AFTER at the head of the queue leave it."""
        key, token, waiter = request.key, request.token, request.waiter
        found = self.queue("fair", key, now)
        first: str | None = None
        if found is not None:
            gone = 0
            for queued in found.ids[:FAIR_SCAN]:
                at = found.seen.get(queued)
                if at is not None and now - at <= FAIR_GONE_AFTER:
                    break
                gone += 1
            for queued in found.ids[:gone]:
                found.seen.pop(queued, None)
                found.grants.pop(queued, None)
            del found.ids[:gone]
            first = found.ids[0] if found.ids else None
        held = self.live_lock(key, now)
        if held is None and (first is None or first == waiter):
            held = self.locks[key] = Hold(token, self.next_fence(key), now + request.lease, "fair", request.owner)
            if waiter is not None:
                self.dequeue("fair", key, waiter, now)
            else:
                self.queue("fair", key, now)  # drops it if the gone ones emptied it
            return AcquireResult(True, held.fence)
        if held is not None and held.owner == token:
            held.ends = now + request.lease  # granted by a release while we waited: from now on
            return AcquireResult(True, held.fence)
        if waiter is not None:
            queue = self.enqueue("fair", key, waiter, now)
            queue.seen[waiter] = now
            queue.grants[waiter] = (token, request.lease, request.owner)
        else:
            self.queue("fair", key, now)
        if held is None:
            return AcquireResult(False, holder_ttl=FAIR_GONE_AFTER)  # promised to the first waiter
        return AcquireResult(False, holder_ttl=held.ends - now)

    def multi_acquire(self, request: AcquireRequest, now: float) -> AcquireResult:
        """multi_acquire.lua: every key or none. A busy key queues the waiter there and passes
        on the wake-ups of the free keys before it (the caller may have been woken for them)."""
        token, waiter = request.token, request.waiter
        taken: dict[str, int | None] = {}  # key -> its fence if already ours, None: free (to take)
        for index, key in enumerate(request.keys):
            if key in taken:
                continue
            held = self.live_lock(key, now)
            if held is None:
                taken[key] = None
            elif held.owner == token:
                taken[key] = held.fence
            else:
                for earlier in request.keys[:index]:
                    if taken.get(earlier, 0) is None and self.waiting("lock", earlier, now):
                        self.wake("lock", earlier, now)
                if waiter is not None:
                    self.enqueue("lock", key, waiter, now)
                return AcquireResult(False, holder_ttl=held.ends - now, busy=key)
        fences: dict[str, int] = {}
        for key, fence in taken.items():
            if fence is None:
                fence = self.next_fence(key)
                self.locks[key] = Hold(token, fence, now + request.lease, "lock", request.owner)
            fences[key] = fence
            if waiter is not None:
                self.dequeue("lock", key, waiter, now)
        tokens = tuple(fences[key] for key in request.keys)
        return AcquireResult(True, tokens[0], fencing_tokens=tokens)

    def lock_release(self, key: str, token: str, now: float, fair: bool, grant: bool = True) -> ReleaseResult:
        held = self.live_lock(key, now)
        if held is None or held.owner != token:
            return ReleaseResult.NOT_OWNER
        del self.locks[key]
        if fair:
            self.fair_wake(key, now, grant)
        else:
            self.wake("lock", key, now)
        return ReleaseResult.RELEASED

    def fair_wake(self, key: str, now: float, grant: bool = True) -> None:
        """release.lua's fair part: the first live waiter that somebody receives for gets the
        lock (its registered lease, a fresh fencing token) and a wake-up saying so; one nobody
        receives for keeps its place (and the lock stays free for it) while it polls ("p"
        ids) or is within its grace, else it is skipped (popped), as is a gone one. Without
        ``grant`` (force_release.lua), only the wake-up."""
        found = self.queue("fair", key, now)
        if found is None:
            return
        skipped = 0
        chosen: str | None = None
        fence = self.fences.get(key, 0) + 1  # what a grant takes (next_fence below)
        for queued in found.ids[:WAKE_LIMIT]:
            at = found.seen.get(queued)
            if at is not None and now - at <= FAIR_GONE_AFTER:
                granted = fence if grant and queued in found.grants else 0
                if self.publish(key, queued, granted) > 0:
                    chosen = queued
                    break
                if queued.startswith("p") or now - at <= FAIR_SUBSCRIBE_GRACE:
                    break
            skipped += 1
        lease = None if chosen is None or not grant else found.grants.get(chosen)
        if lease is not None:
            token, seconds, record = lease
            self.locks[key] = Hold(token, self.next_fence(key), now + seconds, "fair", record)
            skipped += 1  # the new owner leaves the queue
        for queued in found.ids[:skipped]:
            found.seen.pop(queued, None)
            found.grants.pop(queued, None)
        del found.ids[:skipped]
        self.queue("fair", key, now)

    def lock_held(self, key: str, token: str, now: float) -> bool:
        held = self.live_lock(key, now)
        return held is not None and held.owner == token

    def renew_hold(self, held: Hold | None, token: str, lease: float, now: float) -> bool:
        if held is None or held.owner != token or held.ends <= now:
            return False
        held.ends = now + lease
        return True

    # -- what every kind's state answers (the kinds' module adds semaphores, rw locks) --

    def renew(self, items: Sequence[RenewItem], now: float) -> list[bool]:
        raise NotImplementedError  # pragma: no cover - see MemoryState

    def lock_states(self, key: str, now: float) -> list[KeyState]:
        held = self.live_lock(key, now)
        if held is None:
            return []
        role = "fair" if held.kind == "fair" else "lock"
        ends = held.ends - now
        holder = HolderState(held.owner, held.record, ends, held.fence)
        return [KeyState(key, held.kind, 1, ends, held.fence, self.waiting(role, key, now), None, (holder,))]
