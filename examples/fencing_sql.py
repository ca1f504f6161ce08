"""Fencing with SQL: the token is a column, and part of the UPDATE's condition.

The pattern (from lockaspect.fencing), here with SQLite:

    UPDATE accounts SET balance = ?, fence = ? WHERE id = ? AND fence <= ?
    -- 0 rows updated: a newer lock holder already wrote; this writer is stale.

    .venv/bin/python examples/fencing_sql.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/fencing_sql.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing

from lockaspect import LockClient, LockLost, configure, current_lease, distributed_lock

SCHEMA = """
CREATE TABLE accounts (
    id      TEXT PRIMARY KEY,
    balance INTEGER NOT NULL,
    fence   BIGINT  NOT NULL DEFAULT 0  -- 64-bit, lower than any token (tokens are positive)
)
"""

db_path = ""  # set in main()


def read_balance(account: str) -> int:
    with closing(sqlite3.connect(db_path)) as db:
        (balance,) = db.execute("SELECT balance FROM accounts WHERE id = ?", (account,)).fetchone()
        return int(balance)


def fenced_update(account: str, balance: int, token: int) -> bool:
    """Write ``balance`` unless a newer token already wrote this row."""
    with closing(sqlite3.connect(db_path)) as db, db:  # `with db`: commit
        cursor = db.execute(
            "UPDATE accounts SET balance = ?, fence = ? WHERE id = ? AND fence <= ?",
            (balance, token, account, token),
        )
        return cursor.rowcount == 1


@distributed_lock(key="account:<account>", wait=5.0)
def withdraw(account: str, amount: int) -> int:
    """Read, compute, write: safe under the lock, and fenced in case the lock was lost."""
    lease = current_lease()
    assert lease is not None
    balance = read_balance(account) - amount
    if not fenced_update(account, balance, lease.fencing_token):
        raise RuntimeError(f"stale writer: token {lease.fencing_token} was overtaken")
    return balance


def delete_keys(client: LockClient, pattern: str) -> None:
    """Delete the keys of this run (``pattern``: its namespaces): the locks are gone by now,
    but their fence counters outlive them, and this may be your own server."""
    redis = client.backend.redis
    for key in redis.scan_iter(match=pattern):
        redis.delete(key)


def main() -> None:
    # lockaspect logs a WARNING on "lockaspect.watchdog" when it learns a lease is lost.
    logging.basicConfig(level=logging.WARNING, format="  [log] %(levelname)s %(name)s: %(message)s")
    global db_path
    with ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_URL")
        if not url:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
        namespace = f"example-{uuid.uuid4().hex[:8]}:"
        client = stack.enter_context(LockClient.from_url(url, namespace=namespace))
        stack.callback(delete_keys, client, f"{namespace}*")
        configure(client)
        db_path = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "bank.db")
        with closing(sqlite3.connect(db_path)) as db, db:
            db.execute(SCHEMA)
            db.execute("INSERT INTO accounts (id, balance) VALUES ('acct-1', 100)")
        other_worker = stack.enter_context(ThreadPoolExecutor(max_workers=1))

        print("1. a normal fenced withdrawal")
        print(f"  withdraw 10 -> balance {withdraw('acct-1', 10)}")

        print("2. a slow holder pauses past its lease; another worker withdraws meanwhile")
        try:
            with client.lock("account:acct-1", lease=1.0) as slow:  # fixed lease, no watchdog
                balance = read_balance("acct-1") - 50  # computed before the pause
                time.sleep(1.3)  # the pause: its lease ends in the store meanwhile
                print(
                    f"  another worker: withdraw 20 -> balance {other_worker.submit(withdraw, 'acct-1', 20).result()}"
                )
                written = fenced_update("acct-1", balance, slow.fencing_token)
                print(
                    f"  slow holder writes balance {balance} with token {slow.fencing_token}: "
                    f"{'written' if written else 'REJECTED (0 rows updated)'}"
                )
                assert not written, "a stale writer must be rejected"
        except LockLost as exc:
            print(f"  and leaving its block raised LockLost ({exc.reason})")
        else:
            raise AssertionError("the slow holder's block should have raised LockLost")

        final = read_balance("acct-1")
        print(f"  final balance {final} (100 - 10 - 20; the stale withdrawal of 50 never landed)")
        assert final == 70, final
        print("ok")


if __name__ == "__main__":
    main()
