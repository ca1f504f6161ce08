"""The memory store's semaphores and read-write locks, and :class:`MemoryState`, the whole
state machine with its operation tables (the twins of the Redis store's ``_ACQUIRE``,
``_RELEASE`` and ``_REENTER`` in ``backends/redis/_layout.py``). Pure, as :mod:`._state`: no threads, no clock, no I/O.

Semaphores follow sem_acquire.lua, sem_release.lua, sem_renew.lua and sem_set.lua; read-write
locks rw_acquire.lua, rw_release.lua and rw_held.lua; unqueue.lua serves every kind.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..._policy import FAIR_GONE_AFTER
from ..base import AcquireRequest, AcquireResult, HolderState, KeyState, ReleaseResult, RenewItem
from ._state import QUEUE_TTL, WAKE_LIMIT, Hold, StateBase

__all__ = ["MemoryState"]


class _Share(NamedTuple):
    """A semaphore holder's or a reader's hold: its lease end, fencing token, permits taken
    (its weight) and owner record."""

    ends: float
    fence: int
    weight: int = 1
    record: str = ""


@dataclass(slots=True)
class _Semaphore:
    """A semaphore: its number of permits (``None`` until first used; kept for good, as the
    ``…:sem:permits`` key) and its holders, token -> their :class:`_Share`."""

    permits: int | None = None
    holders: dict[str, _Share] = field(default_factory=dict)

    @property
    def in_use(self) -> int:
        return sum(share.weight for share in self.holders.values())


@dataclass(slots=True)
class _ReadWrite:
    """A read-write lock: the writer, the readers (token -> (lease end, fencing token)) and
    the waiting writers (waiter id -> time of its last attempt), which expire together at
    ``waiting_until`` (the ``…:rw:wq`` key's 60 s)."""

    writer: Hold | None = None
    readers: dict[str, _Share] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    waiting_until: float = 0.0


def _live(holders: dict[str, _Share], now: float) -> dict[str, _Share]:
    """Drop the holders whose lease ended; the same dict."""
    for token in [token for token, share in holders.items() if share.ends <= now]:
        del holders[token]
    return holders


def _holders(holders: dict[str, _Share], now: float) -> tuple[HolderState, ...]:
    return tuple(
        HolderState(token, share.record, share.ends - now, share.fence, share.weight)
        for token, share in holders.items()
    )


class MemoryState(StateBase):
    """Every kind's state in one process (see :mod:`._state`). Callers serialise access."""

    def __init__(self) -> None:
        super().__init__()
        self.semaphores: dict[str, _Semaphore] = {}
        self.rws: dict[str, _ReadWrite] = {}
        self._acquire: dict[str, Callable[[AcquireRequest, float], AcquireResult]] = {
            "lock": lambda r, now: self.lock_acquire(r, now) if len(r.keys) == 1 else self.multi_acquire(r, now),
            "fair": self.fair_acquire,
            "semaphore": self.sem_acquire,
            "read": self.rw_acquire,
            "write": self.rw_acquire,
        }
        self._release: dict[str, Callable[[str, str, float], ReleaseResult]] = {
            "lock": lambda key, token, now: self.lock_release(key, token, now, False),
            "fair": lambda key, token, now: self.lock_release(key, token, now, True),
            "semaphore": self.sem_release,
            "read": lambda key, token, now: self.rw_release(key, token, now, False),
            "write": lambda key, token, now: self.rw_release(key, token, now, True),
        }
        self._reenter: dict[str, Callable[[str, str, float], bool]] = {
            "lock": self.lock_held,
            "fair": self.lock_held,
            "semaphore": lambda key, token, now: self.live_semaphore(key, now).holders.get(token) is not None,
            "read": lambda key, token, now: self.live_rw(key, now).readers.get(token) is not None,
            "write": lambda key, token, now: self._writer_is(self.live_rw(key, now), token),
        }

    def clear(self) -> None:
        """Forget everything (a forked child: nothing here is the child's)."""
        self.fences.clear()
        self.locks.clear()
        self.queues.clear()
        self.semaphores.clear()
        self.rws.clear()

    # -- the operations (the store checks the request first) ----------------------------

    def acquire(self, request: AcquireRequest, now: float) -> AcquireResult:
        return self._acquire[request.kind](request, now)

    def release(self, key: str, token: str, kind: str, now: float) -> ReleaseResult:
        return self._release[kind](key, token, now)

    def reenter(self, key: str, token: str, kind: str, now: float) -> bool:
        return self._reenter[kind](key, token, now)

    def renew(self, items: Sequence[RenewItem], now: float) -> list[bool]:
        """One status per item: ``True`` renewed for its lease from ``now``, ``False`` not
        held by its token any more (renew.lua, sem_renew.lua)."""
        statuses = []
        for key, token, lease, kind in items:
            if kind in ("lock", "fair"):
                renewed = self.renew_hold(self.live_lock(key, now), token, lease, now)
            elif kind == "write":
                renewed = self.renew_hold(self.live_rw(key, now).writer, token, lease, now)
            else:
                if kind == "semaphore":
                    holders = self.live_semaphore(key, now).holders
                else:
                    holders = self.live_rw(key, now).readers
                held = holders.get(token)
                renewed = held is not None
                if held is not None:
                    holders[token] = held._replace(ends=now + lease)
            statuses.append(renewed)
        return statuses

    def unqueue(self, key: str, waiter: str, kind: str, now: float) -> None:
        """unqueue.lua: the last waiting writer of a read-write lock that leaves while no
        writer holds it wakes the readers it kept out."""
        if kind in ("read", "write"):
            rw = self.live_rw(key, now)
            last = waiter in rw.waiting and len(rw.waiting) == 1 and rw.writer is None
            rw.waiting.pop(waiter, None)
            self.dequeue("rw", key, waiter, now)
            if last:
                self.wake("rw", key, now, one=False)
        else:
            self.dequeue({"fair": "fair", "semaphore": "semaphore"}.get(kind, "lock"), key, waiter, now)

    # -- semaphores ----------------------------------------------------------------------

    def live_semaphore(self, key: str, now: float) -> _Semaphore:
        """The semaphore ``key`` without its expired permits (an empty one if unknown: not stored)."""
        found = self.semaphores.get(key)
        if found is None:
            return _Semaphore()
        _live(found.holders, now)
        return found

    def sem_acquire(self, request: AcquireRequest, now: float) -> AcquireResult:
        """sem_acquire.lua: one of ``request.permits`` permits, each with a lease of its own; a
        number unlike the stored one changes nothing and reports the stored one."""
        key, token, waiter = request.key, request.token, request.waiter
        wanted = request.permits
        assert wanted is not None  # checked by the store
        sem = self.semaphores.get(key)
        if sem is None:
            sem = self.semaphores[key] = _Semaphore(wanted)
        elif sem.permits is None:
            sem.permits = wanted
        elif sem.permits != wanted:
            return AcquireResult(False, permits=sem.permits)
        holders = _live(sem.holders, now)
        own = holders.get(token)
        if own is not None:
            return AcquireResult(True, own.fence)
        if sem.in_use + request.weight <= (wanted if sem.permits is None else sem.permits):
            fence = self.next_fence(key)
            holders[token] = _Share(now + request.lease, fence, request.weight, request.owner)
            if waiter is not None:
                self.dequeue("semaphore", key, waiter, now)
            return AcquireResult(True, fence)
        if waiter is not None:
            self.enqueue("semaphore", key, waiter, now, request.front)
        if not holders:
            return AcquireResult(False)  # no permits at all: nothing will free up by itself
        return AcquireResult(False, holder_ttl=max(0.001, min(share.ends for share in holders.values()) - now))

    def sem_release(self, key: str, token: str, now: float) -> ReleaseResult:
        sem = self.live_semaphore(key, now)
        share = sem.holders.pop(token, None)
        if share is None:
            return ReleaseResult.NOT_OWNER
        if share.weight == 1:
            self.wake("semaphore", key, now)
        else:  # as many waiters as permits came back (each may want one)
            self.wake("semaphore", key, now, min(WAKE_LIMIT, share.weight), one=False)
        return ReleaseResult.RELEASED

    def permits(self, key: str, set_to: int | None, now: float) -> tuple[int | None, int]:
        """sem_set.lua: ``(permits, in use)``; raising the number wakes that many more waiters,
        lowering it takes no permit away."""
        sem = self.live_semaphore(key, now)
        in_use = sem.in_use
        if set_to is None:
            return sem.permits, in_use
        old = 0 if sem.permits is None else sem.permits
        self.wake("semaphore", key, now, min(16, max(0, set_to - old)), one=False)
        self.semaphores.setdefault(key, sem).permits = set_to
        return set_to, in_use

    def add_permits(self, key: str, delta: int, now: float) -> tuple[int, int]:
        """:meth:`permits` set to the current number plus ``delta`` (at least 0)."""
        current = self.live_semaphore(key, now).permits or 0
        permits, in_use = self.permits(key, max(0, current + delta), now)
        assert permits is not None
        return permits, in_use

    # -- read-write locks ---------------------------------------------------------------

    def live_rw(self, key: str, now: float) -> _ReadWrite:
        """The read-write lock ``key`` without its ended leases and expired waiting writers
        (an empty one if unknown: not stored)."""
        rw = self.rws.get(key)
        if rw is None:
            return _ReadWrite()
        if rw.writer is not None and rw.writer.ends <= now:
            rw.writer = None
        _live(rw.readers, now)
        if rw.waiting_until <= now:
            rw.waiting.clear()
        if rw.writer is None and not rw.readers and not rw.waiting:
            del self.rws[key]
        return rw

    @staticmethod
    def _writer_is(rw: _ReadWrite, token: str) -> bool:
        return rw.writer is not None and rw.writer.owner == token

    def rw_acquire(self, request: AcquireRequest, now: float) -> AcquireResult:
        """rw_acquire.lua: many readers or one writer. A writer that made an attempt within
        FAIR_GONE_AFTER keeps new readers out; ``request.below`` lets the holder of the write
        lock take the read lock too (a downgrade)."""
        key, token, waiter = request.key, request.token, request.waiter
        writing = request.kind == "write"
        rw = self.live_rw(key, now)
        for gone in [queued for queued, at in rw.waiting.items() if at <= now - FAIR_GONE_AFTER]:
            del rw.waiting[gone]
        if writing:
            if self._writer_is(rw, token):
                assert rw.writer is not None
                return AcquireResult(True, rw.writer.fence)
            free = rw.writer is None and not rw.readers
        else:
            own = rw.readers.get(token)
            if own is not None:
                return AcquireResult(True, own.fence)
            downgrade = request.below != "" and self._writer_is(rw, request.below)
            free = downgrade or (not rw.waiting and rw.writer is None)
        if free:
            fence = self.next_fence(key)
            rw = self.rws.setdefault(key, rw)
            if writing:
                rw.writer = Hold(token, fence, now + request.lease, "write", request.owner)
                if waiter is not None:
                    rw.waiting.pop(waiter, None)
            else:
                rw.readers[token] = _Share(now + request.lease, fence, 1, request.owner)
            if waiter is not None:
                self.dequeue("rw", key, waiter, now)
            return AcquireResult(True, fence)
        if rw.writer is not None:
            hint = rw.writer.ends - now
        elif rw.readers:
            hint = min(share.ends for share in rw.readers.values()) - now
        else:
            hint = FAIR_GONE_AFTER  # only waiting writers keep this reader out
        if waiter is not None:
            if writing:
                rw = self.rws.setdefault(key, rw)
                rw.waiting[waiter] = now
                rw.waiting_until = now + QUEUE_TTL
            self.enqueue("rw", key, waiter, now)
        return AcquireResult(False, holder_ttl=max(0.001, hint))

    def rw_release(self, key: str, token: str, now: float, writing: bool) -> ReleaseResult:
        """rw_release.lua: the writer's release wakes every waiter (up to 16); the last reader
        out, with no writer, does too."""
        rw = self.live_rw(key, now)
        if writing:
            if not self._writer_is(rw, token):
                return ReleaseResult.NOT_OWNER
            rw.writer = None
            self.wake("rw", key, now, one=False)
        else:
            if rw.readers.pop(token, None) is None:
                return ReleaseResult.NOT_OWNER
            if not rw.readers and rw.writer is None:
                self.wake("rw", key, now, one=False)
        self.live_rw(key, now)  # drops the record once empty
        return ReleaseResult.RELEASED

    # -- the operator's view (AdminStore) -----------------------------------------------

    def describe(self, key: str, now: float) -> list[KeyState]:
        """One :class:`KeyState` per kind held at ``key`` (empty: free)."""
        states = self.lock_states(key, now)
        sem = self.live_semaphore(key, now)
        if sem.holders:
            ends = max(share.ends for share in sem.holders.values())
            fence = max(share.fence for share in sem.holders.values())
            waiters = self.waiting("semaphore", key, now)
            held = _holders(sem.holders, now)
            states.append(KeyState(key, "semaphore", len(sem.holders), ends - now, fence, waiters, sem.permits, held))
        rw = self.live_rw(key, now)
        waiters = self.waiting("rw", key, now)
        writer = rw.writer
        if writer is not None:
            holder = HolderState(writer.owner, writer.record, writer.ends - now, writer.fence)
            states.append(KeyState(key, "write", 1, writer.ends - now, writer.fence, waiters, None, (holder,)))
        if rw.readers:
            ends = max(share.ends for share in rw.readers.values())
            fence = max(share.fence for share in rw.readers.values())
            held = _holders(rw.readers, now)
            states.append(KeyState(key, "read", len(rw.readers), ends - now, fence, waiters, None, held))
        return states

    def held_keys(self, prefix: str, pattern: str, now: float) -> list[str]:
        """The keys held now that start with ``prefix`` and whose rest matches the glob
        ``pattern``, without the prefix, sorted."""
        candidates = set(self.locks) | set(self.semaphores) | set(self.rws)
        return sorted(
            key[len(prefix) :]
            for key in candidates
            if key.startswith(prefix) and fnmatch.fnmatchcase(key[len(prefix) :], pattern) and self.describe(key, now)
        )

    def force_release(self, key: str, now: float) -> bool:
        """Delete every hold of ``key`` and wake its waiters as the releases would; fencing
        counters are kept. Whether anything was held."""
        held = False
        lock = self.live_lock(key, now)
        if lock is not None:
            held = True
            self.lock_release(key, lock.owner, now, lock.kind == "fair", grant=False)  # as force_release.lua
        sem = self.live_semaphore(key, now)
        if sem.holders:
            held = True
            freed = sem.in_use
            sem.holders.clear()
            self.wake("semaphore", key, now, min(16, freed), one=False)
        rw = self.live_rw(key, now)
        if rw.writer is not None or rw.readers:
            held = True
            rw.writer = None
            rw.readers.clear()
            self.wake("rw", key, now, one=False)
            self.live_rw(key, now)
        return held
