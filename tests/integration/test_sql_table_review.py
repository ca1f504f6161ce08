"""Review findings on the lease-table stores: each test proves one bug that was fixed."""

from __future__ import annotations

import secrets
import sqlite3
from pathlib import Path

import pytest

from lockaspect import BackendError
from lockaspect.backends.base import AcquireRequest, ReleaseResult
from lockaspect.backends.sql.table import open_sqlite_store, schema_sql


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
