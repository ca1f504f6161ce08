"""SQL stores opened on tables made by the previous version of lockaspect (before owner
records and semaphore weights): the store adds what is missing itself, the holds the old
version wrote are still described (with the record it kept, or none), renewed, released and
counted, and an old version's statements still work on the upgraded table.

The old schemas below are copied from the previous release (``git show`` of
``lockaspect/backends/sql/table/_sql.py`` and ``advisory/_sql.py``); do not "fix" them."""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import ConfigurationError
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, HolderState, KeyState, ReleaseResult, RenewItem
from lockaspect.backends.sql._keys import advisory_key
from lockaspect.testing import PostgresServer

LONG = 30.0

OLD_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS lockaspect_holds (
    name TEXT NOT NULL, space TEXT NOT NULL, slot TEXT NOT NULL, owner TEXT NOT NULL,
    kind TEXT NOT NULL, expires_at REAL NOT NULL, fence INTEGER NOT NULL, info TEXT,
    acquired_at REAL NOT NULL, PRIMARY KEY (name, space, slot)
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

OLD_POSTGRES_SCHEMA = """
CREATE TABLE IF NOT EXISTS lockaspect_holds (
    name TEXT NOT NULL, space TEXT NOT NULL, slot TEXT NOT NULL, owner TEXT NOT NULL,
    kind TEXT NOT NULL, expires_at DOUBLE PRECISION NOT NULL, fence BIGINT NOT NULL, info TEXT,
    acquired_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (name, space, slot)
);
CREATE SEQUENCE IF NOT EXISTS lockaspect_fence AS BIGINT;
CREATE TABLE IF NOT EXISTS lockaspect_waiters (
    name TEXT NOT NULL, space TEXT NOT NULL, waiter TEXT NOT NULL, position BIGINT NOT NULL,
    seen DOUBLE PRECISION NOT NULL, PRIMARY KEY (name, space, waiter)
);
CREATE TABLE IF NOT EXISTS lockaspect_semaphores (name TEXT PRIMARY KEY, permits INTEGER NOT NULL);
"""

OLD_ADVISORY_SCHEMA = (
    "CREATE SEQUENCE IF NOT EXISTS lockaspect_fence AS bigint",
    "CREATE TABLE IF NOT EXISTS lockaspect_advisory ("
    " objkey bigint PRIMARY KEY, name text NOT NULL, slot integer, kind text NOT NULL,"
    " fence bigint, pid integer, lease double precision, acquired_at timestamptz)",
    "CREATE TABLE IF NOT EXISTS lockaspect_semaphore (name text PRIMARY KEY, permits integer NOT NULL)",
)

#: The previous version's claim of an exclusive hold (its ``_CLAIM``, SQLite's clock): it
#: names no weight column, and must keep working on an upgraded table.
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
PG_NOW = "extract(epoch FROM clock_timestamp())::float8"
OLD_INFO = json.dumps({"host": "old-host", "pid": 4121, "thread": "MainThread"}, separators=(",", ":"))


def old_hold(now: str, fence: str, param: str) -> str:
    """The previous version's INSERT of a hold (no ``weight``), in a driver's parameter style."""
    values = ", ".join([param] * 5) + f", {now} + {param}, {fence}, {param}, {now}"
    return (
        "INSERT INTO lockaspect_holds (name, space, slot, owner, kind, expires_at, fence, info, acquired_at) "
        f"VALUES ({values})"
    )


def token() -> str:
    return secrets.token_hex(16)


def only(states: list[KeyState], kind: str) -> KeyState:
    found = [state for state in states if state.kind == kind]
    assert len(found) == 1, states
    return found[0]


def check_old_holds(store: Any, lock_token: str, sem_token: str) -> None:
    """What a new store makes of a lock and a semaphore permit the old version wrote."""
    [holder] = only(store.describe("job"), "lock").held_by
    assert (holder.token, holder.owner, holder.weight) == (lock_token, OLD_INFO, 1)
    [permit] = only(store.describe("pool"), "semaphore").held_by
    assert (permit.token, permit.weight) == (sem_token, 1)
    assert store.permits("pool") == (2, 1)  # an old hold weighs one permit
    assert not store.acquire(AcquireRequest("semaphore", ("pool",), token(), LONG, permits=2, weight=2)).acquired
    assert store.acquire(AcquireRequest("semaphore", ("pool",), token(), LONG, permits=2)).acquired
    assert list(store.renew([RenewItem("job", lock_token, LONG, "lock")])) == [True]
    assert store.release("job", lock_token) is ReleaseResult.RELEASED
    assert store.release("pool", sem_token, "semaphore") is ReleaseResult.RELEASED
    assert store.permits("pool") == (2, 1)


# -- SQLite -----------------------------------------------------------------------------------------


def old_sqlite_file(path: Path, namespace: str) -> tuple[str, str]:
    """A lock file as the previous version left it: a held lock and a held permit."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.executescript(OLD_SQLITE_SCHEMA)
        insert = old_hold(SQLITE_NOW, "(SELECT coalesce(max(fence), 0) + 1 FROM lockaspect_fences WHERE name = ?)", "?")
        lock_token, sem_token = token(), token()
        conn.execute(insert, (namespace + "job", "lock", "", lock_token, "lock", LONG, namespace + "job", OLD_INFO))
        conn.execute(
            insert, (namespace + "pool", "sem", sem_token, sem_token, "semaphore", LONG, namespace + "pool", OLD_INFO)
        )
        conn.execute("INSERT INTO lockaspect_semaphores (name, permits) VALUES (?, 2)", (namespace + "pool",))
    finally:
        conn.close()
    return lock_token, sem_token


def columns(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {str(row[1]) for row in conn.execute("PRAGMA table_info(lockaspect_holds)")}
    finally:
        conn.close()


@pytest.mark.parametrize("create_schema", [True, False])
def test_sqlite_a_table_of_the_previous_version_is_upgraded_on_open(
    tmp_path: Path, namespace: str, create_schema: bool
) -> None:
    path = tmp_path / "locks.db"
    lock_token, sem_token = old_sqlite_file(path, namespace)
    assert "weight" not in columns(path)
    store = open_store(f"sqlite:///{path}", namespace=namespace, create_schema=create_schema)
    try:
        assert "weight" in columns(path)
        check_old_holds(store, lock_token, sem_token)
    finally:
        store.close()
    again = open_store(f"sqlite:///{path}", namespace=namespace)  # a second open adds nothing
    again.close()


def test_sqlite_the_previous_version_s_statements_work_on_the_upgraded_table(tmp_path: Path, namespace: str) -> None:
    path = tmp_path / "locks.db"
    old_sqlite_file(path, namespace)
    open_store(f"sqlite:///{path}", namespace=namespace).close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        insert = old_hold(SQLITE_NOW, "(SELECT coalesce(max(fence), 0) + 1 FROM lockaspect_fences WHERE name = ?)", "?")
        other = token()
        conn.execute(insert, (namespace + "pool", "sem", other, other, "semaphore", LONG, namespace + "pool", None))
    finally:
        conn.close()
    store = open_store(f"sqlite:///{path}", namespace=namespace)
    try:
        found = {holder.token: holder for holder in only(store.describe("pool"), "semaphore").held_by}
        assert {holder.weight for holder in found.values()} == {1}
        assert found[other].owner == ""
        assert store.permits("pool") == (2, 2)
    finally:
        store.close()


# -- PostgreSQL ----------------------------------------------------------------------------------


@pytest.fixture
def database(postgres_server: PostgresServer) -> Iterator[str]:
    """A database of its own (the session's has the new schema already): its URL."""
    name = "upgrade_" + uuid.uuid4().hex[:10]
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield postgres_server.url.rsplit("/", 1)[0] + "/" + name
    with postgres_server.connect() as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True)


@pytest.mark.parametrize("create_schema", [True, False])
def test_postgres_table_of_the_previous_version_is_upgraded_on_open(
    database: str, namespace: str, create_schema: bool
) -> None:
    with connect(database) as conn:
        for statement in OLD_POSTGRES_SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        insert = old_hold(PG_NOW, "nextval('lockaspect_fence')", "%s")
        lock_token, sem_token = token(), token()
        conn.execute(insert, (namespace + "job", "lock", "", lock_token, "lock", LONG, OLD_INFO))
        conn.execute(insert, (namespace + "pool", "sem", sem_token, sem_token, "semaphore", LONG, OLD_INFO))
        conn.execute("INSERT INTO lockaspect_semaphores (name, permits) VALUES (%s, 2)", (namespace + "pool",))
    url = database.replace("postgresql://", "postgresql+table://", 1)
    store = open_store(url, namespace=namespace, create_schema=create_schema)
    try:
        check_old_holds(store, lock_token, sem_token)
        with connect(database) as conn:
            # The previous version's claim still works on the upgraded table (weight 1).
            other = token()
            conn.execute(insert, (namespace + "pool", "sem", other, other, "semaphore", LONG, None))
        assert store.permits("pool") == (2, 2)
        [weights] = {holder.weight for holder in only(store.describe("pool"), "semaphore").held_by}
        assert weights == 1
    finally:
        store.close()


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_postgres_table_an_upgrade_made_meanwhile_is_not_made_again(
    database: str, namespace: str, isolation: str
) -> None:
    """Two clients open an old table at the same moment: the one that waited for the first's
    upgrade reads the catalog again under the schema lock and runs no ALTER TABLE of its own
    (one that adds nothing still takes the table's exclusive lock, and every lock operation
    would queue behind it); also where the server's default isolation is REPEATABLE READ (a
    snapshot taken before the lock would miss the upgrade)."""
    from lockaspect.backends.sql.table._sql import ADDED_COLUMNS
    from lockaspect.backends.sql.table.options import _SCHEMA_LOCK

    with connect(database) as conn:
        for statement in OLD_POSTGRES_SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"ALTER DATABASE {database.rsplit('/', 1)[1]} SET default_transaction_isolation = '{isolation}'")
        conn.execute("CREATE TABLE ddl_log (tag text)")
        conn.execute(
            "CREATE FUNCTION log_ddl() RETURNS event_trigger LANGUAGE plpgsql AS "
            "$$ BEGIN INSERT INTO ddl_log VALUES (tg_tag); END $$"
        )
        conn.execute(
            "CREATE EVENT TRIGGER log_ddl ON ddl_command_end WHEN TAG IN ('ALTER TABLE') EXECUTE FUNCTION log_ddl()"
        )
    url = database.replace("postgresql://", "postgresql+table://", 1)
    opened: list[Any] = []
    failed: list[BaseException] = []

    def open_it() -> None:
        try:
            opened.append(open_store(url, namespace=namespace, create_schema=False))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    first = connect(database)
    try:
        with first.transaction():  # the first client's upgrade, under the schema lock
            first.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            thread = threading.Thread(target=open_it)
            thread.start()
            # The second client found the columns missing and queues for the schema lock.
            while not first.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone()[0]:
                assert thread.is_alive(), failed
            for column, declaration in ADDED_COLUMNS:
                first.execute(f"ALTER TABLE lockaspect_holds ADD COLUMN {column} {declaration}")
        thread.join()
        assert not failed, failed
        assert first.execute("SELECT count(*) FROM ddl_log").fetchone()[0] == len(ADDED_COLUMNS)
    finally:
        first.close()
        for store in opened:
            store.close()


def test_postgres_advisory_schema_of_the_previous_version_is_upgraded_on_open(database: str, namespace: str) -> None:
    """An old version holds a lock, a permit and a read lock (its records have no owner token
    or record); a new store on the same database upgrades the schema, describes them, counts
    them, and can force-release them."""
    with connect(database) as setup:
        for statement in OLD_ADVISORY_SCHEMA:
            setup.execute(statement)
    old = connect(database)  # the old version's holder session
    try:
        record = (
            "WITH got AS (SELECT nextval('lockaspect_fence') AS fence) INSERT INTO lockaspect_advisory "
            "(objkey, name, slot, kind, fence, pid, lease, acquired_at) SELECT %s, %s, %s, %s, fence, "
            "pg_backend_pid(), %s, clock_timestamp() FROM got RETURNING fence"
        )
        job = advisory_key(namespace + "job")
        assert old.execute("SELECT pg_try_advisory_lock(%s)", (job,)).fetchone() == (True,)
        job_fence = old.execute(record, (job, namespace + "job", None, "lock", LONG)).fetchone()[0]
        slot = advisory_key(namespace + "pool:slot:0")
        assert old.execute("SELECT pg_try_advisory_lock(%s)", (slot,)).fetchone() == (True,)
        slot_fence = old.execute(record, (slot, namespace + "pool", 0, "semaphore", LONG)).fetchone()[0]
        old.execute("INSERT INTO lockaspect_semaphore (name, permits) VALUES (%s, 2)", (namespace + "pool",))
        doc = advisory_key(namespace + "doc")
        assert old.execute("SELECT pg_try_advisory_lock_shared(%s)", (doc,)).fetchone() == (True,)
        old.execute(record, (doc, namespace + "doc", None, "read", LONG))
        store = open_store(database, namespace=namespace)
        try:
            state = only(store.describe("job"), "lock")
            assert state.held_by == (HolderState("", "", None, job_fence),)
            state = only(store.describe("pool"), "semaphore")
            assert (state.holders, state.held_by) == (1, (HolderState("", "", None, slot_fence),))
            assert store.permits("pool") == (2, 1)
            assert not store.acquire(
                AcquireRequest("semaphore", ("pool",), token(), LONG, permits=2, weight=2)
            ).acquired
            state = only(store.describe("doc"), "read")
            assert (state.holders, state.held_by) == (1, ())  # an old reader: counted, nothing recorded
            assert sorted(store.held_keys()) == ["doc", "job", "pool"]
            assert store.force_release("job") is True
            assert store.describe("job") == []
            assert store.describe("doc") == []  # the same session: terminated with it
        finally:
            store.close()
    finally:
        old.close()


@pytest.fixture
def app_role(postgres_server: PostgresServer, database: str) -> Iterator[str]:
    """A role that may use the tables of ``database`` but owns none of them (its URL)."""
    role = "app_" + uuid.uuid4().hex[:8]
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
    yield database.replace("postgresql://postgres@", f"postgresql://{role}@", 1)
    with connect(database) as conn:
        conn.execute(f"DROP OWNED BY {role}")
    with postgres_server.connect() as conn:
        conn.execute(f"DROP ROLE {role}")


def grant_all(database: str, role_url: str) -> None:
    role = role_url.split("://", 1)[1].split("@", 1)[0]
    with connect(database) as conn:
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")


def test_postgres_table_an_upgrade_the_role_may_not_make_names_the_statement(
    database: str, app_role: str, namespace: str
) -> None:
    with connect(database) as conn:
        for statement in OLD_POSTGRES_SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
    grant_all(database, app_role)
    url = app_role.replace("postgresql://", "postgresql+table://", 1)
    with pytest.raises(ConfigurationError) as refused:
        open_store(url, namespace=namespace, create_schema=False)
    assert "ALTER TABLE lockaspect_holds ADD COLUMN IF NOT EXISTS weight INTEGER NOT NULL DEFAULT 1" in str(
        refused.value
    )


def test_postgres_advisory_an_upgrade_the_role_may_not_make_names_the_statements(
    database: str, app_role: str, namespace: str
) -> None:
    with connect(database) as conn:
        for statement in OLD_ADVISORY_SCHEMA:
            conn.execute(statement)
    grant_all(database, app_role)
    store = open_store(app_role, namespace=namespace, create_schema=False)
    try:
        with pytest.raises(ConfigurationError) as refused:
            store.acquire(AcquireRequest("lock", ("k",), token(), LONG))  # connects lazily
        assert "CREATE TABLE IF NOT EXISTS lockaspect_advisory_reader" in str(refused.value)
    finally:
        store.close()
