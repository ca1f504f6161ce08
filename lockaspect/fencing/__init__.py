"""Fencing: make the protected resource itself reject writes from a holder whose lease ended.

A lease lock cannot stop a paused holder (a GC pause, ``SIGSTOP``, a swapped-out process)
from waking up and writing after its lease ran out and someone else took the lock: the
holder is not running when it could be told. The fencing token closes that gap at the
resource. Every acquisition of a key gets ``lease.fencing_token``, an integer larger than
every token issued before for that key; the writer sends its token with each write, and
the resource refuses tokens older than the newest it has seen. Tokens are per key: a
resource compares only tokens of the lock that protects it.

Any store can do this that can compare and write atomically. Keep the largest token that
wrote the resource (its *high-water mark*) next to the data, and make "the token is not
older than the mark" part of the write itself, never a separate read before it.

Redis resources: :class:`RedisFence` (and :class:`AsyncRedisFence` for asyncio) write a
value only if the token is not older than the resource's high-water mark, atomically (a Lua
script). They live in :mod:`lockaspect.fencing.redis`; this package imports that module,
and with it the Redis driver, only when one of the two names is first used.

SQL resources: keep the token in a column and make it part of the update's condition::

    UPDATE accounts
       SET balance = :balance, fence = :token
     WHERE id = :id AND fence <= :token

    -- 0 rows updated means a newer holder wrote first: this writer is stale.

Create the column as a 64-bit integer with a default lower than any token (``fence BIGINT
NOT NULL DEFAULT 0``; tokens are positive and, seeded from the store's clock, need more than
32 bits). ``<=`` rather than ``<`` lets one holder write several times under one lease. Every
writer must go through the fenced statement. See ``docs/concepts/fencing.md`` (an upsert, a
complete example) and ``examples/fencing_sql.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .redis import AsyncRedisFence as AsyncRedisFence
    from .redis import RedisFence as RedisFence

__all__ = ["AsyncRedisFence", "RedisFence"]


def __getattr__(name: str) -> Any:
    """Import :mod:`lockaspect.fencing.redis` on the first use of one of its names."""
    if name in __all__:
        from . import redis

        value = getattr(redis, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
