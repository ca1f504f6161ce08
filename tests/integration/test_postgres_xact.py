"""Transaction-scoped PostgreSQL advisory locks (``scope="transaction"``), against a real server.

The lock is taken in the caller's own transaction (psycopg 3, SQLAlchemy, Django) and ends at
its commit or rollback; a second connection's ``pg_try_advisory_xact_lock`` shows whether it is
held. Refusals happen before anything is sent: a connection in a transaction shows it by its
state (``INTRANS`` after a statement), a sqlite3 connection by its change counter.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from lockaspect import (
    ConfigurationError,
    LockClient,
    LockLost,
    LockNotAcquired,
    current_lease,
    distributed_lock,
)
from lockaspect.backends.sql._keys import advisory_key

IDLE, INTRANS = TransactionStatus.IDLE, TransactionStatus.INTRANS


def take(block: Any) -> None:
    """Enter and leave ``block`` (a test expects entering to raise)."""
    with block:
        pass


@pytest.fixture(scope="module")
def pg(postgres_server: Any) -> Any:
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute("CREATE SEQUENCE IF NOT EXISTS lockaspect_fence")
        admin.execute("CREATE SCHEMA IF NOT EXISTS xact_no_fence")
    return postgres_server


@pytest.fixture
def connect(pg: Any) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """psycopg connections to the server (not autocommit unless asked), closed after the test."""
    opened: list[psycopg.Connection[Any]] = []

    def make(**kwargs: Any) -> psycopg.Connection[Any]:
        conn = psycopg.connect(pg.url, **kwargs)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.close()


@pytest.fixture
def client() -> Iterator[LockClient]:
    with LockClient.from_url("memory://", namespace=f"t-{uuid.uuid4().hex[:8]}:") as made:
        yield made


@pytest.fixture
def free(connect: Callable[..., psycopg.Connection[Any]], client: LockClient) -> Callable[[str], bool]:
    """Whether another connection could take ``key`` now (it takes and drops it at once)."""
    probe = connect(autocommit=True)
    namespace = client.backend.namespace  # type: ignore[attr-defined]

    def is_free(key: str) -> bool:
        row = probe.execute("SELECT pg_try_advisory_xact_lock(%s::bigint)", [advisory_key(namespace + key)]).fetchone()
        assert row is not None
        return bool(row[0])

    return is_free


class TestLifetime:
    def test_commit_releases_and_the_block_exit_does_not(self, connect: Any, client: LockClient, free: Any) -> None:
        conn = connect()
        with conn.transaction():
            with client.lock("order:1", scope="transaction", connection=conn) as lease:
                assert not free("order:1")
                assert lease.held
                assert not lease.lost
                assert lease.fencing_token > 0
                assert current_lease() is lease
            assert not free("order:1")  # the block is over, the transaction is not
            assert not lease.held
            assert current_lease() is None
        assert free("order:1")

    def test_rollback_releases(self, connect: Any, client: LockClient, free: Any) -> None:
        conn = connect()

        def fail_after_locking() -> None:
            with conn.transaction():
                with client.lock("order:2", scope="transaction", connection=conn):
                    assert not free("order:2")
                raise ZeroDivisionError

        with pytest.raises(ZeroDivisionError):
            fail_after_locking()
        assert conn.info.transaction_status == IDLE
        assert free("order:2")

    def test_a_second_transaction_waits_for_the_commit(self, connect: Any, client: LockClient) -> None:
        holder, waiter = connect(), connect()
        holder.execute("SELECT 1")  # a transaction, committed by the timer below
        with client.lock("order:3", scope="transaction", connection=holder) as first:
            pass
        timer = threading.Timer(0.3, holder.commit)
        started = time.monotonic()
        timer.start()
        with waiter.transaction(), client.lock("order:3", scope="transaction", connection=waiter, wait=None) as l2:
            waited = time.monotonic() - started
        timer.join()
        assert 0.25 < waited < 5
        assert l2.fencing_token > first.fencing_token

    def test_a_commit_inside_the_block_raises_lock_lost(self, connect: Any, client: LockClient, free: Any) -> None:
        conn = connect()
        conn.execute("SELECT 1")
        block = client.lock("order:4", scope="transaction", connection=conn)
        lease = block.__enter__()
        conn.commit()
        assert free("order:4")
        assert lease.lost
        with pytest.raises(LockLost):
            lease.check()
        with pytest.raises(LockLost) as caught:
            block.__exit__(None, None, None)
        assert caught.value.reason == "transaction-ended"

    def test_reentry_stacks_and_keeps_the_fence(self, connect: Any, client: LockClient, free: Any) -> None:
        conn = connect()
        with conn.transaction():
            with client.lock("order:5", scope="transaction", connection=conn) as outer:
                with client.lock("order:5", scope="transaction", connection=conn) as inner:
                    assert inner is outer
                assert outer.held
            assert not free("order:5")
        assert free("order:5")


class TestWaiting:
    def test_busy_with_wait_0_leaves_the_transaction_usable(self, connect: Any, client: LockClient) -> None:
        holder, other = connect(), connect()
        with holder.transaction(), client.lock("k", scope="transaction", connection=holder), other.transaction():
            with pytest.raises(LockNotAcquired) as caught:
                take(client.lock("k", scope="transaction", connection=other))
            assert caught.value.waited == 0.0
            assert caught.value.key == "k"
            assert "'k' is held by another session or transaction" in str(caught.value)
            assert other.execute("SELECT 41 + 1").fetchone() == (42,)
            assert other.info.transaction_status == INTRANS

    def test_a_wait_times_out_fast_and_restores_lock_timeout(self, connect: Any, client: LockClient) -> None:
        holder, other = connect(), connect()
        with holder.transaction(), client.lock("k", scope="transaction", connection=holder), other.transaction():
            other.execute("SET LOCAL lock_timeout = '7s'")
            started = time.monotonic()
            with pytest.raises(LockNotAcquired) as caught:
                take(client.lock("k", scope="transaction", connection=other, wait=0.2))
            elapsed = time.monotonic() - started
            assert 0.19 < elapsed < 2
            assert 0.19 < caught.value.waited < 2
            assert other.execute("SELECT current_setting('lock_timeout')").fetchone() == ("7s",)
        with other.transaction():
            other.execute("SET LOCAL lock_timeout = '7s'")
            with client.lock("k", scope="transaction", connection=other, wait=0.2):
                assert other.execute("SELECT current_setting('lock_timeout')").fetchone() == ("7s",)

    def test_a_session_lock_of_the_postgresql_store_is_named_as_a_possible_holder(
        self, pg: Any, connect: Any, client: LockClient
    ) -> None:
        """The holder may be a session-mode ``postgresql://`` lock, not only a transaction."""
        namespace = client.backend.namespace  # type: ignore[attr-defined]
        other = connect()
        with LockClient.from_url(pg.url, namespace=namespace) as session_client, session_client.lock("k"):
            with other.transaction(), pytest.raises(LockNotAcquired) as caught:
                take(client.lock("k", scope="transaction", connection=other))
            assert str(caught.value).startswith("lock 'k' is held by another session or transaction")
            with other.transaction(), pytest.raises(LockNotAcquired) as caught:
                take(client.lock("k", scope="transaction", connection=other, wait=0.1))
            assert str(caught.value).startswith("lock 'k' stayed held by another session or transaction for ")

    def test_fences_increase(self, connect: Any, client: LockClient) -> None:
        conn = connect()
        tokens = []
        for i in range(5):
            with conn.transaction():
                wait = None if i % 2 else 0
                with client.lock("k", scope="transaction", connection=conn, wait=wait) as lease:
                    tokens.append(lease.fencing_token)
        assert tokens == sorted(set(tokens))

    def test_a_missing_fence_sequence_is_a_configuration_error(self, pg: Any, connect: Any, client: LockClient) -> None:
        conn = connect(options="-c search_path=xact_no_fence")
        for wait in (0, 1.0):
            with conn.transaction():
                with pytest.raises(ConfigurationError, match="CREATE SEQUENCE IF NOT EXISTS lockaspect_fence"):
                    take(client.lock("k", scope="transaction", connection=conn, wait=wait))
                assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone() == (0,)
                assert conn.execute("SELECT current_setting('lock_timeout')").fetchone() == ("0",)


class TestFence:
    def test_the_fence_rejects_a_stale_writer(self, connect: Any, client: LockClient) -> None:
        """The ``UPDATE ... SET fence = :token WHERE fence < :token`` pattern in one table."""
        setup = connect(autocommit=True)
        table = f"accounts_{uuid.uuid4().hex[:8]}"
        setup.execute(
            f"CREATE TABLE {table} (id text PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0)"
        )
        setup.execute(f"INSERT INTO {table} (id, balance) VALUES ('a', 0)")
        update = f"UPDATE {table} SET balance = %(balance)s, fence = %(token)s WHERE id = 'a' AND fence < %(token)s"

        def write(conn: psycopg.Connection[Any], balance: int, token: int) -> int:
            return conn.execute(update, {"balance": balance, "token": token}).rowcount

        old, new = connect(), connect()
        with old.transaction(), client.lock("account:a", scope="transaction", connection=old) as stale:
            assert write(old, 10, stale.fencing_token) == 1
        with new.transaction(), client.lock("account:a", scope="transaction", connection=new) as lease:
            assert lease.fencing_token > stale.fencing_token
            assert write(new, 20, lease.fencing_token) == 1
        with old.transaction():  # the old holder, woken up late, writes with its old token
            assert write(old, 99, stale.fencing_token) == 0
        assert setup.execute(f"SELECT balance, fence FROM {table}").fetchone() == (20, lease.fencing_token)


class TestRefusals:
    def test_outside_a_transaction(self, connect: Any, client: LockClient) -> None:
        for conn in (connect(autocommit=True), connect()):
            with pytest.raises(ConfigurationError, match=r"no transaction is open.*conn\.transaction\(\)") as caught:
                take(client.lock("k", scope="transaction", connection=conn))
            assert caught.value.key == "k"
            assert conn.info.transaction_status == IDLE  # nothing was sent

    def test_an_aborted_transaction(self, connect: Any, client: LockClient) -> None:
        conn = connect()
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        with pytest.raises(ConfigurationError, match="aborted"):
            client.lock("k", scope="transaction", connection=conn).__enter__()
        conn.rollback()

    def test_a_sqlite3_connection_is_refused_and_nothing_written(self, client: LockClient) -> None:
        db = sqlite3.connect(":memory:")
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (1)")  # an open transaction
        before = db.total_changes
        with pytest.raises(ConfigurationError, match=r"sqlite3 connection.*PostgreSQL"):
            take(client.lock("k", scope="transaction", connection=db))
        assert db.total_changes == before
        assert db.in_transaction
        db.close()

    @pytest.mark.parametrize(
        ("options", "match"),
        [
            ({"scope": "transaction"}, "needs connection="),
            ({"connection": object()}, "only for scope='transaction'"),
            ({"scope": "global", "connection": object()}, "scope must be 'session' or 'transaction'"),
            ({"scope": "transaction", "connection": object(), "lease": 5}, "lease="),
            ({"scope": "transaction", "connection": object(), "on_lost": print}, "on_lost="),
            ({"scope": "transaction", "connection": object(), "max_hold": 5}, "max_hold="),
            ({"scope": "transaction", "connection": object()}, "on a object"),
            ({"scope": "transaction", "connection": "conn"}, "a parameter name is for @distributed_lock"),
        ],
    )
    def test_bad_options(self, client: LockClient, options: dict[str, Any], match: str) -> None:
        with pytest.raises(ConfigurationError, match=match):
            client.lock("k", **options)

    def test_scope_of_the_wrong_type(self, client: LockClient) -> None:
        with pytest.raises(TypeError, match="scope must be a str"):
            client.lock("k", scope=1, connection=object())  # type: ignore[arg-type]

    def test_with_on_an_async_connection_and_async_with_on_a_sync_one(self, pg: Any, client: LockClient) -> None:
        async def main() -> None:
            async with await psycopg.AsyncConnection.connect(pg.url) as aconn:
                await aconn.execute("SELECT 1")
                with pytest.raises(ConfigurationError, match="use `async with`"):
                    client.lock("k", scope="transaction", connection=aconn).__enter__()
            with psycopg.connect(pg.url) as conn:
                conn.execute("SELECT 1")
                with pytest.raises(ConfigurationError, match="use `with`"):
                    await client.lock("k", scope="transaction", connection=conn).__aenter__()

        asyncio.run(main())

    def test_decorator_options_are_checked_at_decoration(self, client: LockClient) -> None:
        def work(conn: Any) -> None: ...

        with pytest.raises(ConfigurationError, match="is not a parameter of"):
            distributed_lock("k", scope="transaction", connection="db", client=client)(work)
        with pytest.raises(ConfigurationError, match="lease="):
            distributed_lock("k", scope="transaction", connection="conn", lease=10, client=client)(work)
        with ThreadPoolExecutor(1) as pool, pytest.raises(ConfigurationError, match="executor="):
            distributed_lock("k", scope="transaction", connection="conn", executor=pool, client=client)(work)
        with pytest.raises(ConfigurationError, match="needs connection="):
            distributed_lock("k", scope="transaction", client=client)(work)


class TestDecorator:
    def test_connection_names_an_argument(self, connect: Any, client: LockClient, free: Any) -> None:
        @distributed_lock("order:<order_id>", scope="transaction", connection="conn", client=client)
        def ship(conn: psycopg.Connection[Any], order_id: int) -> int:
            lease = current_lease()
            assert lease is not None
            assert not free(f"order:{order_id}")
            return lease.fencing_token

        conn = connect()
        with conn.transaction():
            token = ship(conn, 7)
            assert not free("order:7")
        assert free("order:7")
        assert token > 0

    def test_a_callable_connection_and_on_failure(self, connect: Any, client: LockClient) -> None:
        holder, conn = connect(), connect()

        @distributed_lock(
            "k",
            scope="transaction",
            connection=lambda bound: bound["ctx"]["db"],
            on_failure=lambda ctx: "busy",
            client=client,
        )
        def work(ctx: dict[str, Any]) -> str:
            return "done"

        with conn.transaction():
            with holder.transaction(), client.lock("k", scope="transaction", connection=holder):
                assert work({"db": conn}) == "busy"
            assert work({"db": conn}) == "done"

    def test_readers_share_and_a_writer_waits(self, connect: Any, client: LockClient) -> None:
        @distributed_lock("report", scope="transaction", connection="conn", mode="read", client=client)
        def read(conn: Any) -> str:
            return current_lease().kind  # type: ignore[union-attr]

        @distributed_lock("report", scope="transaction", connection="conn", mode="write", client=client)
        def write(conn: Any) -> str:
            return "wrote"

        a, b, c = connect(), connect(), connect()
        with a.transaction(), b.transaction():
            assert read(a) == "read"
            assert read(b) == "read"
            with c.transaction(), pytest.raises(LockNotAcquired):
                write(c)
        with c.transaction():
            assert write(c) == "wrote"

    def test_async_psycopg(self, pg: Any, client: LockClient, free: Any) -> None:
        @distributed_lock("job:<job>", scope="transaction", connection="conn", client=client, wait=1.0)
        async def run(conn: psycopg.AsyncConnection[Any], job: int) -> int:
            lease = current_lease()
            assert lease is not None
            return lease.fencing_token

        async def main() -> None:
            async with await psycopg.AsyncConnection.connect(pg.url) as conn:
                async with conn.transaction():
                    async with client.lock("job:1", scope="transaction", connection=conn) as lease:
                        assert not free("job:1")
                    token = await run(conn, 1)  # granted at once (this transaction holds job:1), a new fence
                    assert token > lease.fencing_token
                assert free("job:1")
                async with conn.transaction():
                    assert await run(conn, 2) > token

        asyncio.run(main())

    def test_async_wait_cancelled_leaves_the_transaction_usable(self, pg: Any, client: LockClient) -> None:
        """A task cancelled while it waits for a busy lock: the wait's savepoint is rolled back,
        so the caller's transaction goes on (and nothing is locked by it)."""

        async def main() -> None:
            holder = await psycopg.AsyncConnection.connect(pg.url)
            conn = await psycopg.AsyncConnection.connect(pg.url)
            locked = client.lock("busy", scope="transaction", connection=holder)
            async with holder, conn, holder.transaction(), locked, conn.transaction():
                waiting = asyncio.ensure_future(_wait_on(client, conn))
                while not await _is_waiting(holder):  # the server says it queues
                    await asyncio.sleep(0.005)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                cursor = await conn.execute("SELECT 41 + 1")  # the transaction still works
                assert await cursor.fetchone() == (42,)

        asyncio.run(main())


async def _wait_on(client: LockClient, conn: Any) -> None:
    async with client.lock("busy", scope="transaction", connection=conn, wait=None):
        raise AssertionError("the lock is held by the other transaction")


async def _is_waiting(conn: Any) -> bool:
    cursor = await conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
    row = await cursor.fetchone()
    return bool(row and row[0])


class TestSQLAlchemy:
    @pytest.fixture
    def engine(self, pg: Any) -> Iterator[Any]:
        sqlalchemy = pytest.importorskip("sqlalchemy")
        engine = sqlalchemy.create_engine(pg.url.replace("postgresql://", "postgresql+psycopg://"))
        yield engine
        engine.dispose()

    def test_session(self, engine: Any, client: LockClient, free: Any) -> None:
        from sqlalchemy import text
        from sqlalchemy.orm import Session

        with Session(engine) as session:
            with pytest.raises(ConfigurationError, match="no transaction is open"):
                client.lock("k", scope="transaction", connection=session).__enter__()
            with session.begin():
                with client.lock("k", scope="transaction", connection=session, wait=1.0) as lease:
                    assert not free("k")
                    assert lease.fencing_token > 0
                    assert session.execute(text("SELECT 1")).scalar() == 1
                assert not free("k")
            assert free("k")
            with session.begin():
                block = client.lock("k", scope="transaction", connection=session)
                block.__enter__()
                session.commit()
                with pytest.raises(LockLost):
                    block.__exit__(None, None, None)

    def test_connection_and_autocommit(self, engine: Any, client: LockClient, free: Any) -> None:
        with engine.connect() as conn:
            with conn.begin(), client.lock("k", scope="transaction", connection=conn):
                assert not free("k")
            assert free("k")
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            with auto.begin(), pytest.raises(ConfigurationError, match="autocommit"):
                client.lock("k", scope="transaction", connection=auto).__enter__()

    def test_a_sqlite_session_is_refused(self, client: LockClient) -> None:
        sqlalchemy = pytest.importorskip("sqlalchemy")
        from sqlalchemy.orm import Session

        engine = sqlalchemy.create_engine("sqlite://")
        with Session(engine) as session, session.begin(), pytest.raises(ConfigurationError, match="Session on sqlite"):
            client.lock("k", scope="transaction", connection=session)
        engine.dispose()

    def test_async_session(self, pg: Any, client: LockClient, free: Any) -> None:
        pytest.importorskip("sqlalchemy")
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        async def main() -> None:
            engine = create_async_engine(pg.url.replace("postgresql://", "postgresql+psycopg://"))
            async with AsyncSession(engine) as session:
                async with session.begin(), client.lock("k", scope="transaction", connection=session) as lease:
                    assert not free("k")
                    assert lease.fencing_token > 0
                assert free("k")
            await engine.dispose()

        asyncio.run(main())


@pytest.fixture(scope="module")
def django_db(pg: Any) -> Iterator[Any]:
    django = pytest.importorskip("django")
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": "postgres",
                    "USER": "postgres",
                    "HOST": "127.0.0.1",
                    "PORT": str(pg.port),
                },
                "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            },
            USE_TZ=True,
        )
        django.setup()
    from django.db import connections

    yield connections
    connections.close_all()


class TestDjango:
    def test_atomic(self, django_db: Any, client: LockClient, free: Any) -> None:
        from django.db import connection, transaction

        with pytest.raises(ConfigurationError, match=r"transaction\.atomic\(\)"):
            client.lock("k", scope="transaction", connection=connection).__enter__()
        with transaction.atomic():
            with client.lock("k", scope="transaction", connection=connection, wait=1.0) as lease:
                assert not free("k")
                assert lease.fencing_token > 0
            assert not free("k")
        assert free("k")

    def test_a_sqlite_connection_is_refused(self, django_db: Any, client: LockClient) -> None:
        from django.db import transaction

        lite = django_db["lite"]
        with transaction.atomic(using="lite"), pytest.raises(ConfigurationError, match="Django sqlite connection"):
            client.lock("k", scope="transaction", connection=lite)


def test_the_example_runs(pg: Any) -> None:
    """examples/postgres_transaction_fence.py against the test server (a DSN on its command line)."""
    script = Path(__file__).resolve().parents[2] / "examples" / "postgres_transaction_fence.py"
    result = subprocess.run(
        [sys.executable, str(script), pg.url], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stale write with token" in result.stdout
    assert result.stdout.rstrip().endswith("ok")
