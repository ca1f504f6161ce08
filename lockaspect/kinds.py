"""Lock kinds as objects: the mutex, the fair lock, a semaphore of n permits, and the two sides
of a read-write lock.

A kind carries the few facts the engine needs about it and two hooks; the engine never asks
which kind it has. What a kind means in a store is the store's business: it looks
:attr:`LockKind.name` up in its own operation table.

- ``family``: kinds that share one store entry re-enter each other (a fair hold re-enters a
  plain one on the same key).
- ``own_place``: each waiter keeps a place of its own in the store's queue (fair and
  read-write waiters are served in order); otherwise a process's waiters for a key coalesce
  and one place serves them all.
- ``permits``: a semaphore's number of permits.
- :meth:`LockKind.below`: what the caller already holds that the request must name (a reader
  inside its own write lock downgrades), or a refusal (a reader asking to write would wait for
  itself).
- :meth:`LockKind.check`: whether the store's answer contradicts the request (a semaphore
  with another number of permits).

Re-entries are counted in one place for every kind: the client (``lease._refs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .backends.base import AcquireResult
    from .lease import Lease

__all__ = ["FAIR", "MUTEX", "READ", "WRITE", "LockKind", "kind_for", "semaphore"]

#: Finds the lease this context holds on ``key`` in ``family`` (the client's lookup).
HeldLookup = Callable[[str, str], "Lease | None"]


@dataclass(frozen=True, slots=True)
class LockKind:
    """One kind of lock (see the module docstring)."""

    name: str
    family: str
    own_place: bool = False
    permits: int | None = None
    #: Permits one hold takes (a semaphore's ``count=``; 1 otherwise).
    weight: int = 1

    def slot_key(self, key: str) -> str:
        """Where same-process waiters for ``key`` of this kind coalesce: a semaphore's apart
        from a lock's of the same name (braces cannot occur in keys)."""
        return key if self.family == "lock" else "{" + self.name + "}" + key

    def below(self, key: str, held: HeldLookup) -> str:
        """The token of a hold this context has that the request must name, or ""."""
        return ""

    def check(self, key: str, result: AcquireResult) -> None:
        """Raise when the store's answer contradicts what was asked (nothing was taken)."""

    def __repr__(self) -> str:
        if self.permits is None:
            return f"<LockKind {self.name}>"
        taken = "" if self.weight == 1 else f", count={self.weight}"
        return f"<LockKind {self.name}({self.permits}{taken})>"


@dataclass(frozen=True, slots=True, repr=False)
class _Semaphore(LockKind):
    def check(self, key: str, result: AcquireResult) -> None:
        if result.permits is not None:
            raise ConfigurationError(
                f"semaphore {key!r} has {result.permits} permits, not {self.permits}: change the number "
                f"explicitly with client.set_permits({key!r}, {self.permits})",
                key=key,
            )


@dataclass(frozen=True, slots=True, repr=False)
class _Read(LockKind):
    def below(self, key: str, held: HeldLookup) -> str:
        writer = held(key, "write")
        return "" if writer is None else writer.token


@dataclass(frozen=True, slots=True, repr=False)
class _Write(LockKind):
    def below(self, key: str, held: HeldLookup) -> str:
        if held(key, "read") is not None:
            raise ConfigurationError(
                f"this context holds the read lock of {key!r}: asking for its write lock would wait for "
                "itself forever (release the read lock first, or take the write lock first and then read)",
                key=key,
            )
        return ""


#: A mutex: one holder; a process's waiters share one place in the queue.
MUTEX = LockKind("lock", "lock")
#: A fair mutex: waiters are served in the order they asked.
FAIR = LockKind("fair", "lock", own_place=True)
#: A read-write lock's shared side.
READ: LockKind = _Read("read", "read", own_place=True)
#: A read-write lock's exclusive side.
WRITE: LockKind = _Write("write", "write", own_place=True)


@functools.lru_cache(maxsize=64)
def semaphore(permits: int, weight: int = 1) -> LockKind:
    """The kind of a semaphore with ``permits`` permits whose holds take ``weight`` of them
    (both already checked)."""
    return _Semaphore("semaphore", "semaphore", permits=permits, weight=weight)


def kind_for(fair: bool, permits: int | None, mode: str | None) -> LockKind:
    """The kind the public options ``fair=``, ``permits=`` and ``mode=`` name (checked)."""
    if mode is not None:
        return READ if mode == "read" else WRITE
    if permits is not None:
        return semaphore(permits)
    return FAIR if fair else MUTEX
