"""Transaction-scoped PostgreSQL advisory locks: ``scope="transaction"``.

``client.lock(key, scope="transaction", connection=conn)`` and
``@distributed_lock(..., scope="transaction", connection=...)`` take
``pg_advisory_xact_lock`` on the key (the same 64-bit hash of the namespaced key as the
``postgresql://`` store, :func:`lockaspect.backends.sql._keys.advisory_key`) and a fencing token
(``nextval('lockaspect_fence')``, the sequence that store uses too) inside the caller's own open
transaction, on a psycopg 3 connection, a SQLAlchemy ``Session``/``Connection`` (or their
asyncio forms) or a Django connection. The lock ends when that transaction commits or rolls
back: no watchdog, no release, and it works through PgBouncer's transaction pooling.

The core imports this package by name only when such a lock is used (see
:func:`lockaspect._scope.transaction_scope`); the drivers are imported only for a connection of
theirs. The user's guide: ``docs/stores/sql.md#transaction-scoped-advisory-locks``.
"""

from __future__ import annotations

from typing import Any

from ....errors import ConfigurationError
from ....keys import ArgumentNames
from ....options import LockSpec
from ._sql import FENCE_SEQUENCE
from .block import ConnectionPlan, TransactionLease, TransactionLockBlock

__all__ = ["FENCE_SEQUENCE", "ConnectionPlan", "TransactionLease", "TransactionLockBlock", "open_block", "plan"]


def open_block(client: Any, key: str, spec: LockSpec, connection: object) -> TransactionLockBlock:
    """The block of ``client.lock(key, scope="transaction", connection=connection)``."""
    if isinstance(connection, str):
        raise ConfigurationError(
            f"connection={connection!r}: client.lock() takes the connection object itself "
            "(a parameter name is for @distributed_lock)",
            key=key,
        )
    namespace = getattr(client.backend, "namespace", "lockaspect:")
    return TransactionLockBlock(client._engine, key, spec, namespace, connection)


def plan(connection: object, names: ArgumentNames) -> ConnectionPlan:
    """How a decorated function finds its connection (checked at decoration)."""
    return ConnectionPlan(connection, names)
