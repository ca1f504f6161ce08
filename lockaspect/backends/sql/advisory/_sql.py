"""Every statement the advisory store sends, and the schema it needs: text only, no I/O.

The advisory key of a ``pg_locks`` row is ``(classid << 32) | objid`` with ``objsubid = 1``
(the single-``bigint`` form; PostgreSQL stores the high and the low 32 bits in those two oid
columns). :data:`LOCK_KEY` is that expression.

Every acquiring statement takes the lock and draws the fencing token from the one sequence
``lockaspect_fence`` in the same statement (``nextval`` only when the lock was taken), and
records who took it, for the operator tools, in that statement too: an exclusive hold (and
each slot of a semaphore's hold) in ``lockaspect_advisory`` (one row per advisory key: the
full key, the kind, the last fencing token, the holder's backend pid, lease, owner token and
owner record), a reader in ``lockaspect_advisory_reader`` (one row per reader's place: the
advisory key, the backend pid, and the reader's number among this client's readers of the
key on that session, 0 but for readers sharing a session). Rows are overwritten, not
deleted, on release: a row tells who holds the key only while ``pg_locks`` shows its backend
pid holding it (in its mode). The one exception: a reader that leaves others of its client on
its session, or whose place is not 0, deletes its row with its release (its session still
holds the key shared). The transaction-scoped helper
uses the same key hash and the same sequence, so both modes exclude each other and tokens
keep increasing across them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ACQUIRE_SHARED",
    "ACQUIRE_X",
    "CLAIMED",
    "CLAIMED_SHARED",
    "DESCRIBE",
    "FENCE_SEQUENCE",
    "FORGET",
    "HELD_NAMES",
    "HOLDERS",
    "LOCK_KEY",
    "PERMITS",
    "PROBE",
    "QUEUED",
    "READERS",
    "SCHEMA",
    "SCHEMA_BASE",
    "SCHEMA_CHECK",
    "SCHEMA_LOCK",
    "SCHEMA_UPGRADE",
    "SEM_ACQUIRE",
    "SEM_ACQUIRE_MANY",
    "SEM_ADD",
    "SEM_IN_USE",
    "SEM_SET",
    "TERMINATE",
    "TRY_SHARED",
    "TRY_X",
    "UNLOCK",
    "UNLOCK_READER",
    "UNLOCK_SHARED",
    "UNLOCK_SLOTS",
    "UNLOCK_WOKEN",
    "UNLOCK_WOKEN_READER",
    "UNLOCK_WOKEN_SHARED",
    "UNLOCK_WOKEN_SLOTS",
]

#: The one fencing sequence (shared with the transaction-scoped helper: keep the name).
FENCE_SEQUENCE: Final = "lockaspect_fence"

#: A ``pg_locks`` row's advisory key (single-bigint form), as a signed bigint.
LOCK_KEY: Final = "((l.classid::bigint << 32) | l.objid::bigint)"

#: Run (in one transaction) before the schema statements: a fixed advisory key, held only
#: while the schema is made, so that processes starting together do not race on the catalog;
#: and a bound on waiting for a table's lock (an ALTER TABLE waits for every transaction that
#: uses the table, and every statement on it queues behind the ALTER).
SCHEMA_LOCK: Final = (
    # The check under the lock must see what a client that held it before committed, whatever
    # the server's default_transaction_isolation (a snapshot taken before the lock would not).
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SELECT pg_advisory_xact_lock(-8111973515212196337)",
    "SET LOCAL lock_timeout = '5s'",
)
#: Created when ``create_schema=True`` (the default).
SCHEMA_BASE: Final = (
    f"CREATE SEQUENCE IF NOT EXISTS {FENCE_SEQUENCE} AS bigint",
    "CREATE TABLE IF NOT EXISTS lockaspect_advisory ("
    " objkey bigint PRIMARY KEY, name text NOT NULL, slot integer, kind text NOT NULL,"
    " fence bigint, pid integer, lease double precision, acquired_at timestamptz, token text, owner text)",
    "CREATE TABLE IF NOT EXISTS lockaspect_semaphore (name text PRIMARY KEY, permits integer NOT NULL, slots integer)",
)
#: What a schema made by an older lockaspect lacks (the owner records): added by any store
#: that opens it, whatever ``create_schema`` says.
SCHEMA_UPGRADE: Final = (
    "ALTER TABLE lockaspect_advisory ADD COLUMN IF NOT EXISTS token text, ADD COLUMN IF NOT EXISTS owner text",
    "ALTER TABLE lockaspect_semaphore ADD COLUMN IF NOT EXISTS slots integer",
    "CREATE TABLE IF NOT EXISTS lockaspect_advisory_reader (objkey bigint NOT NULL, pid integer NOT NULL,"
    " place integer NOT NULL, name text NOT NULL, token text NOT NULL, owner text, fence bigint NOT NULL,"
    " lease double precision, acquired_at timestamptz, PRIMARY KEY (objkey, pid, place))",
)
SCHEMA: Final = SCHEMA_BASE + SCHEMA_UPGRADE

#: Which of the schema's objects exist: the base (3 columns), the upgrade (2), then the
#: server's version.
SCHEMA_CHECK: Final = (
    f"SELECT to_regclass('{FENCE_SEQUENCE}') IS NOT NULL, to_regclass('lockaspect_advisory') IS NOT NULL,"
    " to_regclass('lockaspect_semaphore') IS NOT NULL, to_regclass('lockaspect_advisory_reader') IS NOT NULL,"
    " (SELECT count(*) = 3 FROM pg_attribute WHERE NOT attisdropped AND (attrelid = to_regclass('lockaspect_advisory')"
    " AND attname IN ('token', 'owner') OR attrelid = to_regclass('lockaspect_semaphore') AND attname = 'slots')),"
    " current_setting('server_version_num')::int"
)

_UPSERT: Final = (
    "INSERT INTO lockaspect_advisory (objkey, name, slot, kind, fence, pid, lease, acquired_at, token, owner)"
    " SELECT {values} ON CONFLICT (objkey) DO UPDATE SET name = excluded.name, slot = excluded.slot,"
    " kind = excluded.kind, fence = excluded.fence, pid = excluded.pid, lease = excluded.lease,"
    " acquired_at = excluded.acquired_at, token = excluded.token, owner = excluded.owner"
)
_RECORD: Final = (
    ", meta AS ("
    + _UPSERT.format(
        values="%(k)s, %(name)s, %(slot)s, %(kind)s, fence, pg_backend_pid(), %(lease)s, clock_timestamp(),"
        " %(token)s, %(owner)s FROM got WHERE fence IS NOT NULL"
    )
    + ") SELECT fence FROM got"
)
#: A reader's record, at its place on its session (``%(place)s``): (fence, place).
_RECORD_SHARED: Final = (
    ", meta AS (INSERT INTO lockaspect_advisory_reader (objkey, pid, place, name, token, owner, fence, lease,"
    " acquired_at) SELECT %(k)s, pg_backend_pid(), %(place)s, %(name)s, %(token)s, %(owner)s, fence, %(lease)s,"
    " clock_timestamp() FROM got WHERE fence IS NOT NULL ON CONFLICT (objkey, pid, place) DO UPDATE SET"
    " name = excluded.name, token = excluded.token, owner = excluded.owner, fence = excluded.fence,"
    " lease = excluded.lease, acquired_at = excluded.acquired_at)"
    " SELECT fence, %(place)s FROM got"
)


def _try(function: str, record: str) -> str:
    return (
        f"WITH got AS MATERIALIZED (SELECT CASE WHEN {function}(%(k)s) THEN nextval('{FENCE_SEQUENCE}') END AS fence)"
        + record
    )


def _wait(function: str, record: str) -> str:
    # The lock first (its own CTE, which the fence's reads), then the fence: in that order.
    return (
        f"WITH l AS MATERIALIZED (SELECT {function}(%(k)s) AS v),"
        f" got AS MATERIALIZED (SELECT nextval('{FENCE_SEQUENCE}') AS fence FROM l)" + record
    )


#: Try once (exclusive / shared): the fencing token, or ``NULL`` when busy.
TRY_X: Final = _try("pg_try_advisory_lock", _RECORD)
TRY_SHARED: Final = _try("pg_try_advisory_lock_shared", _RECORD_SHARED)
#: Wait in the server's queue (bounded by ``lock_timeout``), then the fencing token.
ACQUIRE_X: Final = _wait("pg_advisory_lock", _RECORD)
ACQUIRE_SHARED: Final = _wait("pg_advisory_lock_shared", _RECORD_SHARED)

#: A lock granted to a queued wait, claimed by an attempt of another owner token (a process's
#: waiters share a place in the queue): the record becomes the claimer's.
CLAIMED: Final = (
    "UPDATE lockaspect_advisory SET token = %(token)s, owner = %(owner)s, lease = %(lease)s WHERE objkey = %(k)s"
)
CLAIMED_SHARED: Final = (
    "UPDATE lockaspect_advisory_reader SET token = %(token)s, owner = %(owner)s, lease = %(lease)s"
    " WHERE objkey = %(k)s AND pid = pg_backend_pid() AND place = 0"
)

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
#: A reader's release that deletes its record (see the module docstring for when).
_DROP_READER: Final = (
    ", d AS (DELETE FROM lockaspect_advisory_reader WHERE objkey = %(k)s AND pid = pg_backend_pid()"
    " AND place = %(place)s)"
)
UNLOCK_READER: Final = (
    "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock_shared(%(k)s) AS ok)" + _DROP_READER + " SELECT ok FROM u"
)
UNLOCK_WOKEN_READER: Final = (
    "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock_shared(%(k)s) AS ok)" + _DROP_READER + _WOKEN
)
#: A semaphore hold of several permits: every slot unlocked (``ok``: all were held).
_UNLOCK_SLOTS: Final = "SELECT bool_and(pg_advisory_unlock(s.k)) AS ok FROM unnest(%(ks)s::bigint[]) AS s(k)"
UNLOCK_SLOTS: Final = _UNLOCK_SLOTS
UNLOCK_WOKEN_SLOTS: Final = (
    f"WITH u AS MATERIALIZED ({_UNLOCK_SLOTS}) SELECT u.ok, ARRAY(SELECT l.pid FROM pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    f" AND l.granted AND {LOCK_KEY} = ANY(%(ks)s) AND l.pid = ANY(%(pids)s)) FROM u"
)

#: One round trip per holder connection per watchdog tick: the session's pid and the
#: advisory keys it holds now (a terminated or recycled session answers no longer, or with
#: another pid: a transaction pooler in front).
PROBE: Final = (
    f"SELECT pg_backend_pid(), coalesce(array_agg({LOCK_KEY}) FILTER (WHERE l.pid IS NOT NULL), ARRAY[]::bigint[]),"
    " coalesce(array_agg(l.mode) FILTER (WHERE l.pid IS NOT NULL), ARRAY[]::text[])"
    " FROM (SELECT 1) AS one LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND l.pid = pg_backend_pid()"
)

_SEM_STORED: Final = (
    "WITH stored AS MATERIALIZED (SELECT permits FROM lockaspect_semaphore WHERE name = %(name)s),"
    " ins AS (INSERT INTO lockaspect_semaphore (name, permits) SELECT %(name)s, %(want)s"
    " WHERE NOT EXISTS (SELECT 1 FROM stored) ON CONFLICT (name) DO NOTHING),"
    " permits AS MATERIALIZED (SELECT coalesce((SELECT permits FROM stored), %(want)s) AS n),"
)
#: The slots to try, in order: ``%(slots)s`` holds every slot's key, ``NULL`` for a slot another
#: owner of this client holds (the session would be granted it again).
_SEM_TRY: Final = (
    " FROM unnest(%(slots)s::bigint[]) WITH ORDINALITY AS t(k, i), permits WHERE t.k IS NOT NULL"
    " AND CASE WHEN permits.n = %(want)s THEN pg_try_advisory_lock(t.k) ELSE false END"
)

#: A semaphore hold of one permit: the stored number of permits (inserted on first use), and
#: the first free slot taken (``CASE`` keeps the permits check before any lock is tried;
#: ``LIMIT 1`` stops the scan at the first slot taken): (permits, slot, fence).
SEM_ACQUIRE: Final = (
    _SEM_STORED
    + f" got AS MATERIALIZED (SELECT t.i - 1 AS slot, t.k, nextval('{FENCE_SEQUENCE}') AS fence"
    + _SEM_TRY
    + " LIMIT 1), meta AS ("
    + _UPSERT.format(
        values="k, %(name)s, slot, 'semaphore', fence, pg_backend_pid(), %(lease)s, clock_timestamp(),"
        " %(token)s, %(owner)s FROM got"
    )
    + ") SELECT permits.n, got.slot, got.fence FROM permits LEFT JOIN got ON true"
)
#: A semaphore hold of ``%(weight)s`` permits: that many free slots taken, all or none (too
#: few are unlocked again in the same statement), with one fencing token for the hold:
#: (permits, the slots' numbers, fence, slots given back).
SEM_ACQUIRE_MANY: Final = (
    _SEM_STORED + " got AS MATERIALIZED (SELECT t.i - 1 AS slot, t.k" + _SEM_TRY + " LIMIT %(weight)s),"
    " enough AS MATERIALIZED (SELECT count(*) = %(weight)s AS ok FROM got),"
    " back AS MATERIALIZED (SELECT pg_advisory_unlock(got.k) FROM got, enough WHERE NOT enough.ok),"
    f" fenced AS MATERIALIZED (SELECT nextval('{FENCE_SEQUENCE}') AS fence FROM enough WHERE enough.ok),"
    " meta AS ("
    + _UPSERT.format(
        values="got.k, %(name)s, got.slot, 'semaphore', fenced.fence, pg_backend_pid(), %(lease)s,"
        " clock_timestamp(), %(token)s, %(owner)s FROM got, fenced"
    )
    + ") SELECT permits.n, (SELECT array_agg(got.slot) FROM got, enough WHERE enough.ok),"
    " (SELECT fence FROM fenced), (SELECT count(*) FROM back) FROM permits"
)

#: ``(permits, in use)`` of a semaphore (``%(slots)s``: the slot keys of its stored permits).
SEM_IN_USE: Final = (
    "SELECT (SELECT permits FROM lockaspect_semaphore WHERE name = %(name)s),"
    f" (SELECT count(DISTINCT {LOCK_KEY}) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    f" AND l.granted AND {LOCK_KEY} = ANY(%(slots)s))"
)
#: A semaphore's permits, and how many slots may be held: ``slots`` keeps the most permits it
#: ever had (a hold on a slot above a lowered number stays until released).
PERMITS: Final = "SELECT permits, greatest(permits, coalesce(slots, 0)) FROM lockaspect_semaphore WHERE name = %(name)s"
_SLOTS: Final = "slots = greatest(lockaspect_semaphore.slots, lockaspect_semaphore.permits, excluded.permits)"
SEM_SET: Final = (
    "INSERT INTO lockaspect_semaphore (name, permits) VALUES (%(name)s, %(permits)s)"
    f" ON CONFLICT (name) DO UPDATE SET permits = excluded.permits, {_SLOTS}"
)
#: The permits plus ``%(delta)s``, never below 0 (from 0 for a semaphore never used), and the
#: slots that may be held.
SEM_ADD: Final = (
    "INSERT INTO lockaspect_semaphore AS s (name, permits) VALUES (%(name)s, greatest(0, %(delta)s))"
    " ON CONFLICT (name) DO UPDATE SET permits = greatest(0, s.permits + %(delta)s),"
    " slots = greatest(s.slots, s.permits, greatest(0, s.permits + %(delta)s))"
    " RETURNING permits, greatest(permits, coalesce(slots, 0))"
)

#: Every ``pg_locks`` row of the given advisory keys in this database, with what the store
#: recorded about the key: (key, mode, granted, pid, kind, fence, lease, slot, the recording
#: backend's pid, owner token, owner record).
DESCRIBE: Final = (
    f"SELECT {LOCK_KEY}, l.mode, l.granted, l.pid, a.kind, a.fence, a.lease, a.slot, a.pid, a.token, a.owner"
    " FROM pg_locks l"
    f" LEFT JOIN lockaspect_advisory a ON a.objkey = {LOCK_KEY}"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND {LOCK_KEY} = ANY(%(keys)s)"
)

#: The readers of advisory key ``%(k)s`` whose backend holds it shared now: (token, pid,
#: owner, fence, lease); the records of readers gone without a release (a crash, a terminated
#: session) are deleted on the way.
READERS: Final = (
    "WITH live AS MATERIALIZED (SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1"
    " AND l.granted AND l.mode = 'ShareLock'"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND {LOCK_KEY} = %(k)s),"
    " stale AS (DELETE FROM lockaspect_advisory_reader r WHERE r.objkey = %(k)s"
    " AND r.pid NOT IN (SELECT pid FROM live))"
    " SELECT r.token, r.pid, r.owner, r.fence, r.lease FROM lockaspect_advisory_reader r"
    " WHERE r.objkey = %(k)s AND r.pid IN (SELECT pid FROM live) ORDER BY r.fence"
)

#: After a force-release: the owner records of the terminated sessions are dropped (their
#: fencing tokens stay in the rows: the sequence is never touched).
FORGET: Final = (
    "WITH r AS (DELETE FROM lockaspect_advisory_reader WHERE pid = ANY(%(pids)s))"
    " UPDATE lockaspect_advisory SET token = NULL, owner = NULL WHERE objkey = ANY(%(keys)s) AND pid = ANY(%(pids)s)"
)

#: The recorded full keys (under a prefix) whose advisory lock is held now.
_HELD: Final = (
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
HELD_NAMES: Final = (
    f"SELECT a.name FROM pg_locks l JOIN lockaspect_advisory a ON a.objkey = {LOCK_KEY}"
    + _HELD
    + " AND starts_with(a.name, %(prefix)s) UNION"
    f" SELECT r.name FROM pg_locks l JOIN lockaspect_advisory_reader r ON r.objkey = {LOCK_KEY} AND r.pid = l.pid"
    + _HELD
    + " AND l.mode = 'ShareLock' AND starts_with(r.name, %(prefix)s)"
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
