"""Transaction-scoped PostgreSQL advisory locks, the store side: the statements (:mod:`._sql`)
and the connections they run on (:mod:`._adapters`: psycopg 3, SQLAlchemy, Django).

``client.lock(key, scope="transaction", connection=conn)`` and
``@distributed_lock(..., scope="transaction", connection=...)`` take ``pg_advisory_xact_lock``
on the key (the same 64-bit hash of the namespaced key as the ``postgresql://`` store,
:func:`~lockaspect.backends.sql._keys.advisory_key`) and a fencing token
(``nextval('lockaspect_fence')``, the sequence that store uses too) inside the caller's own open
transaction. The lock ends when that transaction commits or rolls back: no watchdog, no
release, and it works through PgBouncer's transaction pooling.

The lock's life (the block, its lease, the decorated call) is :mod:`lockaspect.xact`, which
imports this package by name on first use; this package imports only the errors, the key hash
and, for a connection of theirs, the driver. The user's guide:
``docs/stores/sql.md#transaction-scoped-advisory-locks``.
"""

from __future__ import annotations

from .._keys import advisory_key
from ._adapters import Adapter, adapt, is_connection
from ._sql import FENCE_SEQUENCE, acquire, arun, reenter, run

__all__ = [
    "FENCE_SEQUENCE",
    "Adapter",
    "acquire",
    "adapt",
    "advisory_key",
    "arun",
    "is_connection",
    "reenter",
    "run",
]
