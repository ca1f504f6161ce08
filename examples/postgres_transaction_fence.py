"""A transaction-scoped PostgreSQL lock and its fence, used in the same transaction's write.

    .venv/bin/python examples/postgres_transaction_fence.py postgresql://user@host/db
    LOCKASPECT_PG_URL=postgresql://user@host/db .venv/bin/python examples/postgres_transaction_fence.py

From the repository, after `make test` (it installs psycopg and finds or installs a
PostgreSQL), or after `make demo` and `.venv/bin/pip install -e '.[postgres]'`.

Without a DSN it starts a throwaway server (lockaspect.testing.PostgresServer, needs the
PostgreSQL server binaries). The lock is pg_advisory_xact_lock in the caller's transaction: it
ends at commit or rollback, and lease.fencing_token comes from the sequence lockaspect_fence.
The write is fenced:

    UPDATE accounts SET balance = :balance, fence = :token WHERE id = :id AND fence < :token
    -- 0 rows updated: a newer holder already wrote; this writer is stale.
"""

from __future__ import annotations

import os
import sys
import uuid
from contextlib import ExitStack
from typing import Any

import psycopg

from lockaspect import LockClient, LockNotAcquired, current_lease, distributed_lock

client = LockClient.from_url("memory://")  # only its namespace matters for transaction scope
TABLE = f"example_accounts_{uuid.uuid4().hex[:8]}"


def fenced_write(conn: psycopg.Connection[Any], balance: int, token: int) -> bool:
    """Write ``balance`` unless a holder with a newer token already wrote the row."""
    sql = f"UPDATE {TABLE} SET balance = %(balance)s, fence = %(token)s WHERE id = 'acct-1' AND fence < %(token)s"
    return conn.execute(sql, {"balance": balance, "token": token}).rowcount == 1


@distributed_lock("account:<account>", scope="transaction", connection="conn", wait=5, client=client)
def deposit(conn: psycopg.Connection[Any], account: str, amount: int) -> int:
    """Read, compute and write under the lock; the fence goes into the same transaction's write."""
    lease = current_lease()
    assert lease is not None
    row = conn.execute(f"SELECT balance FROM {TABLE} WHERE id = %s", [account]).fetchone()
    assert row is not None
    assert fenced_write(conn, row[0] + amount, lease.fencing_token)
    return lease.fencing_token


def main(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE SEQUENCE IF NOT EXISTS lockaspect_fence")  # once, like a migration
        admin.execute(f"CREATE TABLE {TABLE} (id text PRIMARY KEY, balance int NOT NULL, fence bigint DEFAULT 0)")
        admin.execute(f"INSERT INTO {TABLE} (id, balance) VALUES ('acct-1', 0)")
        try:
            with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
                with a.transaction():  # A deposits 100; its lock ends with this transaction
                    token_a = deposit(a, "acct-1", 100)
                with b.transaction():  # B deposits 50 and holds the lock until it commits
                    token_b = deposit(b, "acct-1", 50)
                    with a.transaction():  # meanwhile A cannot take it, and its transaction goes on
                        try:
                            with client.lock("account:acct-1", scope="transaction", connection=a, wait=0.2):
                                raise AssertionError("B's transaction still holds the lock")
                        except LockNotAcquired as busy:
                            print(f"A: busy for {busy.waited:.1f} s; its transaction is still usable:", end=" ")
                            print(a.execute("SELECT 'yes'").fetchone()[0])  # type: ignore[index]
                print(f"A's token {token_a}, B's token {token_b}")
                assert token_b > token_a
                with a.transaction():  # A, woken up late, writes with its old token: rejected
                    assert not fenced_write(a, 999, token_a)
                    print(f"stale write with token {token_a} rejected")
            print("balance", admin.execute(f"SELECT balance FROM {TABLE}").fetchone()[0])  # type: ignore[index]
        finally:
            admin.execute(f"DROP TABLE {TABLE}")
            client.close()
    print("ok")


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LOCKASPECT_PG_URL")
    with ExitStack() as stack:
        if not url:
            from lockaspect.testing import PostgresServer

            url = stack.enter_context(PostgresServer()).url
            print("started a throwaway server")
        main(url)
