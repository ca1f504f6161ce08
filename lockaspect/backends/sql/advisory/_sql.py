"""Every statement the advisory store sends, and the schema it needs: text only, no I/O.

The advisory key of a ``pg_locks`` row is ``(classid << 32) | objid`` with ``objsubid = 1``
(the single-``bigint`` form; PostgreSQL stores the high and the low 32 bits in those two oid
columns). :data:`LOCK_KEY` is that expression.

Every acquiring statement takes the lock and draws the fencing token from the one sequence
``lockaspect_fence`` in the same statement (``nextval`` only when the lock was taken), and
records who took it in ``lockaspect_advisory`` (one row per advisory key: the full key, the
kind, the last fencing token, the holder's backend pid and lease) for the operator tools. The
transaction-scoped helper uses the same key hash and the same sequence, so both modes exclude
each other and tokens keep increasing across them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ACQUIRE_SHARED",
    "ACQUIRE_X",
    "DESCRIBE",
    "FENCE_SEQUENCE",
    "HELD_NAMES",
    "HOLDERS",
    "LOCK_KEY",
    "PERMITS",
    "PROBE",
    "QUEUED",
    "SCHEMA",
    "SCHEMA_CHECK",
    "SEM_ACQUIRE",
    "SEM_IN_USE",
    "SEM_SET",
    "TERMINATE",
    "TRY_SHARED",
    "TRY_X",
    "UNLOCK",
    "UNLOCK_SHARED",
    "UNLOCK_WOKEN",
    "UNLOCK_WOKEN_SHARED",
]

#: The one fencing sequence (shared with the transaction-scoped helper: keep the name).
FENCE_SEQUENCE: Final = "lockaspect_fence"

#: A ``pg_locks`` row's advisory key (single-bigint form), as a signed bigint.
LOCK_KEY: Final = "((l.classid::bigint << 32) | l.objid::bigint)"

#: Created when ``create_schema=True`` (the default), under a transaction-scoped advisory lock
#: so that processes starting together do not race on the catalog.
SCHEMA: Final = (
    "SELECT pg_advisory_xact_lock(-8111973515212196337)",  # a fixed key, held only while the schema is made
    f"CREATE SEQUENCE IF NOT EXISTS {FENCE_SEQUENCE} AS bigint",
    "CREATE TABLE IF NOT EXISTS lockaspect_advisory ("
    " objkey bigint PRIMARY KEY, name text NOT NULL, slot integer, kind text NOT NULL,"
    " fence bigint, pid integer, lease double precision, acquired_at timestamptz)",
    "CREATE TABLE IF NOT EXISTS lockaspect_semaphore (name text PRIMARY KEY, permits integer NOT NULL)",
)

#: Which of the schema's objects exist (``NULL``: missing).
SCHEMA_CHECK: Final = (
    f"SELECT to_regclass('{FENCE_SEQUENCE}') IS NOT NULL, to_regclass('lockaspect_advisory') IS NOT NULL,"
    " to_regclass('lockaspect_semaphore') IS NOT NULL, current_setting('server_version_num')::int"
)

_RECORD: Final = (
    ", meta AS (INSERT INTO lockaspect_advisory (objkey, name, slot, kind, fence, pid, lease, acquired_at)"
    " SELECT %(k)s, %(name)s, %(slot)s, %(kind)s, fence, pg_backend_pid(), %(lease)s, clock_timestamp()"
    " FROM got WHERE fence IS NOT NULL"
    " ON CONFLICT (objkey) DO UPDATE SET name = excluded.name, slot = excluded.slot, kind = excluded.kind,"
    " fence = excluded.fence, pid = excluded.pid, lease = excluded.lease, acquired_at = excluded.acquired_at)"
    " SELECT fence FROM got"
)


def _try(function: str) -> str:
    return (
        f"WITH got AS MATERIALIZED (SELECT CASE WHEN {function}(%(k)s) THEN nextval('{FENCE_SEQUENCE}') END AS fence)"
        + _RECORD
    )


def _wait(function: str) -> str:
    # The lock first (its own CTE, which the fence's reads), then the fence: in that order.
    return (
        f"WITH l AS MATERIALIZED (SELECT {function}(%(k)s) AS v),"
        f" got AS MATERIALIZED (SELECT nextval('{FENCE_SEQUENCE}') AS fence FROM l)" + _RECORD
    )


#: Try once (exclusive / shared): the fencing token, or ``NULL`` when busy.
TRY_X: Final = _try("pg_try_advisory_lock")
TRY_SHARED: Final = _try("pg_try_advisory_lock_shared")
#: Wait in the server's queue (bounded by ``lock_timeout``), then the fencing token.
ACQUIRE_X: Final = _wait("pg_advisory_lock")
ACQUIRE_SHARED: Final = _wait("pg_advisory_lock_shared")

#: Unlock once on the holding session: ``false`` when this session did not hold it.
UNLOCK: Final = "SELECT pg_advisory_unlock(%(k)s)"
UNLOCK_SHARED: Final = "SELECT pg_advisory_unlock_shared(%(k)s)"

#: Unlock, then which of ``pids`` (sessions of this client queued for the key) the release
#: granted it to: the handover is decided by the unlock itself, so it is read in the same
#: statement, and the store waits for those waits' replies before it answers.
_WOKEN: Final = (
    " SELECT u.ok, ARRAY(SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    f" AND l.granted AND {LOCK_KEY} = %(k)s AND l.pid = ANY(%(pids)s)) FROM u"
)
UNLOCK_WOKEN: Final = "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock(%(k)s) AS ok)" + _WOKEN
UNLOCK_WOKEN_SHARED: Final = "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock_shared(%(k)s) AS ok)" + _WOKEN

#: One round trip per holder connection per watchdog tick: the session's pid and the
#: advisory keys it holds now (a terminated or recycled session answers no longer, or with
#: another pid: a transaction pooler in front).
PROBE: Final = (
    f"SELECT pg_backend_pid(), coalesce(array_agg({LOCK_KEY}) FILTER (WHERE l.pid IS NOT NULL), ARRAY[]::bigint[]),"
    " coalesce(array_agg(l.mode) FILTER (WHERE l.pid IS NOT NULL), ARRAY[]::text[])"
    " FROM (SELECT 1) AS one LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND l.pid = pg_backend_pid()"
)

#: A semaphore: the stored number of permits (inserted on first use), and one free slot of
#: the ``%(want)s`` first taken (``CASE`` keeps the permits check before any lock is tried;
#: ``LIMIT 1`` stops the scan at the first slot taken).
SEM_ACQUIRE: Final = (
    "WITH stored AS MATERIALIZED (SELECT permits FROM lockaspect_semaphore WHERE name = %(name)s),"
    " ins AS (INSERT INTO lockaspect_semaphore (name, permits) SELECT %(name)s, %(want)s"
    " WHERE NOT EXISTS (SELECT 1 FROM stored) ON CONFLICT (name) DO NOTHING),"
    " permits AS MATERIALIZED (SELECT coalesce((SELECT permits FROM stored), %(want)s) AS n),"
    " got AS MATERIALIZED (SELECT t.i - 1 AS slot, t.k, nextval('lockaspect_fence') AS fence"
    " FROM unnest(%(slots)s::bigint[]) WITH ORDINALITY AS t(k, i), permits"
    " WHERE CASE WHEN permits.n = %(want)s THEN pg_try_advisory_lock(t.k) ELSE false END LIMIT 1),"
    " meta AS (INSERT INTO lockaspect_advisory (objkey, name, slot, kind, fence, pid, lease, acquired_at)"
    " SELECT k, %(name)s, slot, 'semaphore', fence, pg_backend_pid(), %(lease)s, clock_timestamp() FROM got"
    " ON CONFLICT (objkey) DO UPDATE SET name = excluded.name, slot = excluded.slot, kind = excluded.kind,"
    " fence = excluded.fence, pid = excluded.pid, lease = excluded.lease, acquired_at = excluded.acquired_at)"
    " SELECT permits.n, got.slot, got.fence FROM permits LEFT JOIN got ON true"
)

#: ``(permits, in use)`` of a semaphore (``%(slots)s``: the slot keys of its stored permits).
SEM_IN_USE: Final = (
    "SELECT (SELECT permits FROM lockaspect_semaphore WHERE name = %(name)s),"
    f" (SELECT count(DISTINCT {LOCK_KEY}) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    f" AND l.granted AND {LOCK_KEY} = ANY(%(slots)s))"
)
PERMITS: Final = "SELECT permits FROM lockaspect_semaphore WHERE name = %(name)s"
SEM_SET: Final = (
    "INSERT INTO lockaspect_semaphore (name, permits) VALUES (%(name)s, %(permits)s)"
    " ON CONFLICT (name) DO UPDATE SET permits = excluded.permits"
)

#: Every ``pg_locks`` row of the given advisory keys in this database, with what the store
#: recorded about the key: (key, mode, granted, pid, kind, fence, lease, slot).
DESCRIBE: Final = (
    f"SELECT {LOCK_KEY}, l.mode, l.granted, l.pid, a.kind, a.fence, a.lease, a.slot FROM pg_locks l"
    f" LEFT JOIN lockaspect_advisory a ON a.objkey = {LOCK_KEY}"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND {LOCK_KEY} = ANY(%(keys)s)"
)

#: The recorded full keys (under a prefix) whose advisory lock is held now.
HELD_NAMES: Final = (
    f"SELECT DISTINCT a.name FROM pg_locks l JOIN lockaspect_advisory a ON a.objkey = {LOCK_KEY}"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND starts_with(a.name, %(prefix)s)"
)

#: The backends holding any of the given advisory keys (granted), in this database.
HOLDERS: Final = (
    f"SELECT DISTINCT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND {LOCK_KEY} = ANY(%(keys)s)"
)

#: Whether session ``%(pid)s`` is in the advisory key's queue (or was granted it): a queued
#: wait counts as queued, for the attempt that made it, once the server shows it here.
QUEUED: Final = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    f" AND l.pid = %(pid)s AND {LOCK_KEY} = %(k)s)"
)

#: End a session (its locks free at once); waits up to 5 s for it to be gone.
TERMINATE: Final = "SELECT pg_terminate_backend(pid, 5000) FROM unnest(%(pids)s::int[]) AS pid"
