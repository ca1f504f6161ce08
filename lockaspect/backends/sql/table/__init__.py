"""The lease-table store: locks as rows of a table with a primary key, in SQLite
(``sqlite:///<path>``: no server at all, one host) or PostgreSQL (``postgresql+table://``:
works behind PgBouncer's transaction pooling).

Every hold is a row whose ``expires_at`` is set from the **database's** clock; the watchdog
renews the leases due in a tick in one statement; a renewal that finds no row of its token
alive means the lease is lost. Fencing tokens come from a per-key counter (SQLite) or the
``lockaspect_fence`` sequence (PostgreSQL) and never go backwards. Waiters poll, with
jittered backoff bounded by the holder's remaining lease; a release by the same process wakes
its waiters at once. Every lock kind of the engine: the mutex, the fair lock, read-write
locks, semaphores and multi-key locks (in one transaction). Asyncio: SQLite through a bridge
of threads (sqlite3 blocks), PostgreSQL through psycopg's ``AsyncConnection``.

``docs/stores/sql.md`` explains the layout and when to choose which SQL store.
"""

from __future__ import annotations

from .aio import AsyncBridgeStore, AsyncTableStore
from .options import open_sqlite_store, open_table_store, schema_sql
from .store import TableStore

__all__ = ["AsyncBridgeStore", "AsyncTableStore", "TableStore", "open_sqlite_store", "open_table_store", "schema_sql"]
