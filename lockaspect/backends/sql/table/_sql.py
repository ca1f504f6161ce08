"""The lease table's schema and statements, in the two dialects it runs on: SQLite and
PostgreSQL. Text only: no connection, no driver import.

The layout (one row per hold; ``docs/stores/sql.md`` shows it to users):

* ``lockaspect_holds``: ``(name, space, slot)`` is the primary key. ``name`` is the
  namespaced lock key; ``space`` the record the kind lives in (``lock`` for the mutex, the
  fair lock and each key of a multi-key lock; ``rw`` for read-write locks; ``sem`` for
  semaphores, as the Redis store's separate keys); ``slot`` is ``''`` for an exclusive hold
  (the mutex, a writer: so the primary key itself guarantees one holder) and the owner token
  for a shared one (a reader, a permit). ``expires_at`` is in the database's time (seconds
  since the epoch, never the client's clock), ``fence`` the hold's fencing token, ``info``
  the owner record the client sent with the acquisition (JSON: host, pid, thread or task,
  function, template, acquired_at; ``NULL``: none), ``acquired_at`` database time,
  ``weight`` the permits a semaphore hold takes (1 for every other hold). Tables made before
  ``weight`` existed get it added when a store opens them (:data:`MIGRATIONS`).
* SQLite: ``lockaspect_fences (name, fence)``, the per-key fencing counter, advanced by a
  trigger on every new hold and never lowered (a released key keeps its counter).
  PostgreSQL: the sequence ``lockaspect_fence``, shared with the advisory-lock store, so a
  key's tokens increase whichever PostgreSQL mode took it.
* ``lockaspect_waiters (name, space, waiter, position, seen)``: the fair lock's queue and a
  read-write lock's waiting writers, each with the database time of its last attempt.
* ``lockaspect_semaphores (name, permits)``: each semaphore's number of permits.

Statements use ``:name`` parameters; :class:`Dialect` rewrites them for the driver.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["ADDED_COLUMNS", "POSTGRES", "SQLITE", "TABLES", "Dialect"]

#: The tables the store uses (and ``create_schema`` makes).
TABLES: Final = ("lockaspect_holds", "lockaspect_waiters", "lockaspect_semaphores")

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS lockaspect_holds (
    name TEXT NOT NULL, space TEXT NOT NULL, slot TEXT NOT NULL, owner TEXT NOT NULL,
    kind TEXT NOT NULL, expires_at REAL NOT NULL, fence INTEGER NOT NULL, info TEXT,
    acquired_at REAL NOT NULL, weight INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (name, space, slot)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lockaspect_fences (name TEXT PRIMARY KEY, fence INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lockaspect_waiters (
    name TEXT NOT NULL, space TEXT NOT NULL, waiter TEXT NOT NULL, position INTEGER NOT NULL,
    seen REAL NOT NULL, PRIMARY KEY (name, space, waiter)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lockaspect_semaphores (name TEXT PRIMARY KEY, permits INTEGER NOT NULL) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS lockaspect_fence_on_insert AFTER INSERT ON lockaspect_holds BEGIN
    INSERT INTO lockaspect_fences (name, fence) VALUES (NEW.name, NEW.fence)
    ON CONFLICT (name) DO UPDATE SET fence = max(fence, excluded.fence);
END;
CREATE TRIGGER IF NOT EXISTS lockaspect_fence_on_update AFTER UPDATE OF fence ON lockaspect_holds BEGIN
    INSERT INTO lockaspect_fences (name, fence) VALUES (NEW.name, NEW.fence)
    ON CONFLICT (name) DO UPDATE SET fence = max(fence, excluded.fence);
END;
"""

_POSTGRES_SCHEMA = """
CREATE TABLE IF NOT EXISTS lockaspect_holds (
    name TEXT NOT NULL, space TEXT NOT NULL, slot TEXT NOT NULL, owner TEXT NOT NULL,
    kind TEXT NOT NULL, expires_at DOUBLE PRECISION NOT NULL, fence BIGINT NOT NULL, info TEXT,
    acquired_at DOUBLE PRECISION NOT NULL, weight INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (name, space, slot)
);
CREATE SEQUENCE IF NOT EXISTS lockaspect_fence AS BIGINT;
CREATE TABLE IF NOT EXISTS lockaspect_waiters (
    name TEXT NOT NULL, space TEXT NOT NULL, waiter TEXT NOT NULL, position BIGINT NOT NULL,
    seen DOUBLE PRECISION NOT NULL, PRIMARY KEY (name, space, waiter)
);
CREATE TABLE IF NOT EXISTS lockaspect_semaphores (name TEXT PRIMARY KEY, permits INTEGER NOT NULL);
"""

#: Columns of ``lockaspect_holds`` added after its first release, ``(name, declaration)``: a
#: store that opens a table made by an older version adds them (see ``options``).
ADDED_COLUMNS: Final = (("weight", "INTEGER NOT NULL DEFAULT 1"),)

_PARAM = re.compile(r"(?<!:):([a-z_][a-z_0-9]*)")

#: Take (or keep) the exclusive hold of ``(name, space)`` for ``owner``: a fresh hold where
#: there is none or the last one expired; the same hold (same fence, same owner record) for
#: its own owner, whose lease is extended. No row returned: another owner holds it. A
#: taken-over row's fence is drawn when the row is written (``{fence_on_write}``): on
#: PostgreSQL, a token drawn when the statement began could be older than one issued to a
#: holder that came and went meanwhile.
_CLAIM = """
INSERT INTO lockaspect_holds (name, space, slot, owner, kind, expires_at, fence, info, acquired_at)
VALUES (:name, :space, '', :owner, :kind, {now} + :lease, {next_fence}, :info, {now})
ON CONFLICT (name, space, slot) DO UPDATE SET
    owner = excluded.owner, kind = excluded.kind, expires_at = excluded.expires_at,
    info = CASE WHEN lockaspect_holds.owner = excluded.owner AND lockaspect_holds.expires_at > {now}
        THEN lockaspect_holds.info ELSE excluded.info END,
    fence = CASE WHEN lockaspect_holds.owner = excluded.owner AND lockaspect_holds.expires_at > {now}
        THEN lockaspect_holds.fence ELSE {fence_on_write} END,
    acquired_at = CASE WHEN lockaspect_holds.owner = excluded.owner AND lockaspect_holds.expires_at > {now}
        THEN lockaspect_holds.acquired_at ELSE excluded.acquired_at END
WHERE lockaspect_holds.expires_at <= {now} OR lockaspect_holds.owner = excluded.owner
RETURNING fence
"""

#: A shared hold (a reader, a semaphore's holder of ``weight`` permits): a new row with a
#: fresh fence (its slot is the owner; callers first drop expired rows and answer a live one
#: of the owner themselves, so a conflict is a row about to be replaced).
_SHARE = """
INSERT INTO lockaspect_holds (name, space, slot, owner, kind, expires_at, fence, info, acquired_at, weight)
VALUES (:name, :space, :owner, :owner, :kind, {now} + :lease, {next_fence}, :info, {now}, :weight)
ON CONFLICT (name, space, slot) DO UPDATE SET
    expires_at = excluded.expires_at, fence = excluded.fence, info = excluded.info,
    acquired_at = excluded.acquired_at, weight = excluded.weight
RETURNING fence
"""

_HOLDER = """
SELECT owner, expires_at - {now}, fence FROM lockaspect_holds WHERE name = :name AND space = :space AND slot = ''
"""

_RELEASE = """
DELETE FROM lockaspect_holds
WHERE name = :name AND space = :space AND slot = :slot AND owner = :owner AND expires_at > {now}
"""

#: PostgreSQL releases an exclusive hold by ending it, keeping its row: a claim that began
#: before and meets the row later takes it over with a token drawn then (see _CLAIM), where a
#: deleted row would let it insert the token it drew before. The sweep deletes such rows a
#: minute after they ended.
_END = """
UPDATE lockaspect_holds SET owner = '', expires_at = 0, info = NULL
WHERE name = :name AND space = :space AND slot = :slot AND owner = :owner AND expires_at > {now}
"""

_HELD = """
SELECT 1 FROM lockaspect_holds
WHERE name = :name AND space = :space AND slot = :slot AND owner = :owner AND expires_at > {now}
"""

_RENEW = """
WITH v (name, space, slot, owner, lease) AS (VALUES {rows})
UPDATE lockaspect_holds SET expires_at = {now} + v.lease FROM v
WHERE lockaspect_holds.name = v.name AND lockaspect_holds.space = v.space AND lockaspect_holds.slot = v.slot
    AND lockaspect_holds.owner = v.owner AND lockaspect_holds.expires_at > {now}
RETURNING lockaspect_holds.name, lockaspect_holds.space, lockaspect_holds.slot, lockaspect_holds.owner
"""

_RENEW_ROW = "(:n{i}, :s{i}, :t{i}, :o{i}, CAST(:e{i} AS DOUBLE PRECISION))"


class Dialect:
    """One database's flavour of the statements: parameters, the clock, the fencing counter,
    how a write transaction starts, and the schema.

    Attributes:
        name: ``"sqlite"`` or ``"postgresql"``.
        now: The SQL expression of the database's time in seconds since the epoch.
        schema: The DDL that creates what the store needs (idempotent).
        begin: The statement that opens a write transaction.
    """

    def __init__(
        self, name: str, now: str, next_fence: str, fence_on_write: str, schema: str, begin: str, pyformat: bool
    ) -> None:
        self.name = name
        self.now = now
        self.next_fence = next_fence
        self.fence_on_write = fence_on_write
        self.schema = schema
        self.begin = begin
        self._pyformat = pyformat
        self.claim = self.text(_CLAIM)
        self.claim_at = self.text(_CLAIM, now=":now")  # inside a transaction: its time
        self.share_at = self.text(_SHARE, now=":now")
        self.holder = self.text(_HOLDER)
        self.release = self.text(_RELEASE)
        #: The release of an exclusive hold (the row ends; SQLite, whose writers are serial,
        #: deletes it).
        self.release_exclusive = self.text(_END if name == "postgresql" else _RELEASE)
        self.held = self.text(_HELD)
        self._renew: dict[int, str] = {}

    def text(self, sql: str, now: str | None = None) -> str:
        """``sql`` with the clock and fence filled in and its parameters in the driver's style."""
        sql = sql.strip().replace("{now}", now or self.now).replace("{next_fence}", self.next_fence)
        sql = sql.replace("{fence_on_write}", self.fence_on_write)
        if self._pyformat:
            sql = _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))
        return sql

    def renew(self, rows: int) -> str:
        """The batch renewal of ``rows`` holds (parameters ``n0, s0, t0, o0, e0, n1, ...``: name, space, slot,
        owner, lease)."""
        found = self._renew.get(rows)
        if found is None:
            values = ", ".join(_RENEW_ROW.format(i=i) for i in range(rows))
            found = self._renew[rows] = self.text(_RENEW.replace("{rows}", values))
        return found


SQLITE = Dialect(
    "sqlite",
    now="((julianday('now') - 2440587.5) * 86400.0)",
    next_fence="(SELECT coalesce(max(fence), 0) + 1 FROM lockaspect_fences WHERE name = :name)",
    fence_on_write="excluded.fence",  # one writer at a time: the statement's token is current
    schema=_SQLITE_SCHEMA,
    begin="BEGIN IMMEDIATE",
    pyformat=False,
)

POSTGRES = Dialect(
    "postgresql",
    now="extract(epoch FROM clock_timestamp())::float8",
    next_fence="nextval('lockaspect_fence')",
    fence_on_write="nextval('lockaspect_fence')",
    schema=_POSTGRES_SCHEMA,
    begin="BEGIN",
    pyformat=True,
)
