"""Review findings on the lease-table stores: each test proves one bug that was fixed."""

from __future__ import annotations

import secrets
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from lockaspect import BackendError
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, ReleaseResult
from lockaspect.backends.sql.table import TableStore, open_sqlite_store, schema_sql
from lockaspect.testing import PostgresServer


def hand_made(path: Path) -> None:
    """A lease table created by hand (``schema_sql``), in SQLite's default journal mode."""
    conn = sqlite3.connect(path)
    conn.executescript(schema_sql("sqlite"))
    conn.close()


def test_a_failed_commit_does_not_leave_a_pooled_connection_inside_its_transaction(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    hand_made(path)
    store = open_sqlite_store(f"sqlite:///{path}", create_schema=False, busy_timeout=0, namespace="")
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM lockaspect_holds").fetchall()  # a SHARED lock: COMMIT cannot get EXCLUSIVE
        with pytest.raises(BackendError) as failed:
            store.acquire(AcquireRequest("fair", ("k",), secrets.token_hex(16), 30.0))
        assert failed.value.transient
        reader.execute("COMMIT")
        # The failed transaction was rolled back: nothing is held, and the file's write lock is free.
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
        finally:
            other.close()
        token = secrets.token_hex(16)
        assert store.acquire(AcquireRequest("lock", ("other",), token, 30.0)).acquired
        seen = reader.execute("SELECT owner FROM lockaspect_holds").fetchall()
        assert seen == [(token,)]  # committed: visible to every connection
        assert store.release("other", token) is ReleaseResult.RELEASED
    finally:
        reader.close()
        store.close()


def test_postgres_a_claim_that_began_before_a_whole_hold_still_gets_a_larger_token(
    postgres_server: PostgresServer, namespace: str
) -> None:
    """A claim's statement draws a token when it starts; if a whole other hold (taken and
    released) happens before the claim writes its row, the claim must still end up with a
    token larger than that hold's. Forced here without timing: the claim waits on the row lock
    of a transaction that takes and ends a hold, then commits."""
    url = postgres_server.url.replace("postgresql://", "postgresql+table://", 1)
    store = open_store(url, namespace=namespace)
    assert isinstance(store, TableStore)
    name = namespace + "k"
    try:
        token = secrets.token_hex(16)
        first = store.acquire(AcquireRequest("lock", ("k",), token, 30.0))
        assert first.acquired
        assert store.release("k", token) == ReleaseResult.RELEASED
        with postgres_server.connect() as blocker:
            blocker.execute("BEGIN")  # holds the row's lock from here to COMMIT
            blocker.execute("UPDATE lockaspect_holds SET owner = 'other' WHERE name = %s AND space = 'lock'", (name,))
            claim: dict[str, Any] = {}

            def claimer() -> None:  # draws its token now, then waits for the blocker's row lock
                claim["result"] = store.acquire(AcquireRequest("lock", ("k",), secrets.token_hex(16), 30.0))

            thread = threading.Thread(target=claimer)
            thread.start()
            waiting = postgres_server.connect()
            try:
                while not waiting.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                ).fetchone()[0]:
                    threading.Event().wait(0.005)  # polling the server's own view, not a timing guess
            finally:
                waiting.close()
            # the claim drew its token and waits: now the other holder's whole hold, a newer token
            other = blocker.execute(
                "UPDATE lockaspect_holds SET expires_at = 1e12, fence = nextval('lockaspect_fence') "
                "WHERE name = %s AND space = 'lock' AND slot = '' RETURNING fence",
                (name,),
            ).fetchone()[0]
            blocker.execute(
                "UPDATE lockaspect_holds SET owner = '', expires_at = 0 WHERE name = %s AND space = 'lock'", (name,)
            )
            blocker.execute("COMMIT")
            thread.join(30)
        result = claim["result"]
        assert result.acquired
        assert result.fencing_token > other > first.fencing_token
    finally:
        store.close()


def test_a_file_locked_while_opening_is_a_transient_backend_error(tmp_path: Path) -> None:
    """Processes starting together each make the schema: a file another connection holds
    locked is waited for (busy_timeout), then reported as a transient BackendError, never as a
    configuration error; once free, the store opens."""
    path = tmp_path / "locks.db"
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("BEGIN IMMEDIATE")
        with pytest.raises(BackendError, match="busy_timeout") as raised:
            open_sqlite_store(f"sqlite:///{path}", busy_timeout=0.2)
        assert raised.value.transient
        writer.execute("ROLLBACK")
        store = open_sqlite_store(f"sqlite:///{path}", busy_timeout=0.2)
        writer.execute("BEGIN IMMEDIATE")  # now a lock operation meets the busy file
        with pytest.raises(BackendError, match="file of their own") as busy:
            store.acquire(AcquireRequest("lock", ("k",), secrets.token_hex(16), 30.0))
        assert busy.value.transient
        writer.execute("ROLLBACK")
        store.close()
    finally:
        writer.close()
