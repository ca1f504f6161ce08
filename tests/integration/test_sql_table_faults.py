"""The lease-table store when things go wrong: PostgreSQL restarted or its connections
terminated under a holder, asyncio tasks cancelled while waiting or acquiring, and bad input
refused at open with nothing written. The happy paths are in ``test_sql_table.py``."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lockaspect import BackendError, ConfigurationError, LockClient, LockError, LockNotAcquired
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, ReleaseResult, RenewItem
from lockaspect.backends.sql.table import AsyncBridgeStore, AsyncTableStore, TableStore, schema_sql
from lockaspect.observe import LockEvent
from lockaspect.testing import PostgresServer

WORKTREE = str(Path(__file__).resolve().parents[2])
TABLES = {"lockaspect_holds", "lockaspect_waiters", "lockaspect_semaphores", "lockaspect_fences"}


def table_url(postgres: PostgresServer, database: str = "postgres") -> str:
    url = postgres.url.replace("postgresql://", "postgresql+table://", 1)
    return url.rsplit("/", 1)[0] + "/" + database


@pytest.fixture(scope="module")
def own_postgres(postgres_bindir: str) -> Iterator[PostgresServer]:
    """A server of this module's own: its tests restart it and terminate its connections."""
    with PostgresServer(postgres_bindir) as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return f"f-{uuid.uuid4().hex[:10]}:"


def table(client: LockClient) -> TableStore:
    store = client.backend
    assert isinstance(store, TableStore)
    return store


class Renewals:
    """An observer: every watchdog round trip that renewed all it carried sets an event."""

    def __init__(self) -> None:
        self.renewed = threading.Event()
        self.failed: list[BaseException | None] = []
        self.lost: list[str | None] = []

    def __call__(self, event: LockEvent) -> None:
        if event.name == "renewed" and event.number == event.batch:
            self.renewed.set()
        elif event.name == "renewal_failed":
            self.failed.append(event.error)
        elif event.name == "lost":
            self.lost.append(event.reason)


# -- 4. PostgreSQL restarted, connections terminated --------------------------------------------


@pytest.mark.slow
def test_renewals_resume_after_postgres_restarts(own_postgres: PostgresServer, namespace: str) -> None:
    renewals = Renewals()
    url = table_url(own_postgres)
    with (
        LockClient.from_url(url, namespace=namespace, watchdog_lease=5.0, tick=0.05, observers=[renewals]) as client,
        LockClient.from_url(url, namespace=namespace) as other,
    ):
        # renew at half the lease: after any renewal, the lease has 2.5 s to 5 s left
        with client.lock("job", delay_weight=0.5) as lease:
            assert renewals.renewed.wait(30)
            renewals.renewed.clear()
            own_postgres.restart()  # a clean restart: the table (and the lease) is kept
            assert renewals.renewed.wait(30)  # renewals resumed on new connections
            assert not lease.lost
            assert renewals.lost == []
            assert all(isinstance(error, BackendError) and error.transient for error in renewals.failed)
            with pytest.raises(LockNotAcquired), other.lock("job"):
                pass
            with client.lock("after") as after:  # a new lock can be taken
                assert after.fencing_token > lease.fencing_token
        assert table(client).describe("job") == []  # released
        with other.lock("job") as taken:
            assert taken.fencing_token > lease.fencing_token


def test_terminated_connections_are_replaced(own_postgres: PostgresServer, namespace: str) -> None:
    renewals = Renewals()
    url = table_url(own_postgres)
    with LockClient.from_url(url, namespace=namespace, watchdog_lease=5.0, tick=0.05, observers=[renewals]) as client:
        store = table(client)
        with client.lock("job") as lease:
            with client.lock("second"):  # two connections in the pool
                pass
            assert own_postgres.terminate_backends() >= 1
            with client.lock("other") as other:  # the next operation reconnects
                assert other.fencing_token > lease.fencing_token
            assert [state.fencing_token for state in store.describe("job")] == [lease.fencing_token]
        assert not lease.lost
        assert store.describe("job") == []  # the release went through


def test_terminated_connections_are_replaced_in_asyncio(own_postgres: PostgresServer, namespace: str) -> None:
    url = table_url(own_postgres)

    async def main() -> None:
        with LockClient.from_url(url, namespace=namespace, watchdog_lease=5.0, tick=0.05) as client:
            async with client.lock("job") as lease:
                async with client.lock("second"):  # two connections in the pool
                    pass
                assert await asyncio.to_thread(own_postgres.terminate_backends) >= 1
                async with client.lock("other") as other:  # the next operation reconnects
                    assert other.fencing_token > lease.fencing_token
            assert not lease.lost
            assert table(client).describe("job") == []  # the release went through

    asyncio.run(asyncio.wait_for(main(), 60))


# -- 5. asyncio ---------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres_table"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    return table_url(postgres)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_async_handoff_between_two_clients(url: str, namespace: str) -> None:
    async def main() -> list[Any]:
        order: list[Any] = []
        with (
            LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0, tick=0.05) as first,
            LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0, tick=0.05) as second,
        ):
            holding, release = asyncio.Event(), asyncio.Event()

            async def hold() -> None:
                async with first.lock("k") as lease:
                    order.append(("held", lease.fencing_token))
                    holding.set()
                    await release.wait()
                    order.append("releasing")

            async def wait() -> None:
                await holding.wait()
                async with second.lock("k", wait=30) as lease:
                    order.append(("taken", lease.fencing_token))

            holder = asyncio.create_task(hold())
            waiter = asyncio.create_task(wait())
            await holding.wait()
            release.set()
            await asyncio.gather(holder, waiter)
        return order

    (_, held), releasing, (taken_word, taken) = run(main())
    assert releasing == "releasing"
    assert taken_word == "taken"
    assert taken > held


def waiting_observer(loop: asyncio.AbstractEventLoop, waiting: asyncio.Event) -> Callable[[LockEvent], None]:
    def observe(event: LockEvent) -> None:
        if event.name == "waiting":
            loop.call_soon_threadsafe(waiting.set)

    return observe


def waiter_rows(url: str, name: str) -> int:
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            return int(conn.execute("SELECT count(*) FROM lockaspect_waiters WHERE name = ?", (name,)).fetchone()[0])
        finally:
            conn.close()
    with psycopg.connect(url.replace("postgresql+table://", "postgresql://", 1)) as conn:
        row = conn.execute("SELECT count(*) FROM lockaspect_waiters WHERE name = %s", (name,)).fetchone()
        return int(row[0])


@pytest.mark.parametrize("kind", ["lock", "fair", "write"])
def test_a_cancelled_waiting_task_leaves_nothing_behind(url: str, namespace: str, kind: str) -> None:
    def block(client: LockClient, **options: Any) -> Any:
        if kind == "fair":
            return client.fair_lock("k", **options)
        if kind == "write":
            return client.rw_lock("k").write(**options)
        return client.lock("k", **options)

    async def main() -> None:
        waiting = asyncio.Event()
        observe = waiting_observer(asyncio.get_running_loop(), waiting)
        with (
            LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0, tick=0.05) as holder,
            LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0, tick=0.05, observers=[observe]) as other,
        ):

            async def wait() -> None:
                async with block(other, wait=30):
                    pytest.fail("the waiter got the lock while it was held")

            async with block(holder):
                task = asyncio.create_task(wait())
                await waiting.wait()
                if kind != "lock":
                    assert waiter_rows(url, namespace + "k") == 1  # queued
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert table(holder).describe("k") == []
            assert waiter_rows(url, namespace + "k") == 0
            async with block(holder):  # free for anyone at once: no queue place left over
                pass

    run(main())


@pytest.mark.parametrize("kind", ["lock", "fair", "write"])
def test_a_bridge_acquire_cancelled_after_its_submit_gives_back_what_it_took(
    tmp_path: Path, namespace: str, kind: str
) -> None:
    """SQLite's asyncio twin runs an acquire on a bridge thread when another writer holds the
    file (here: a raw connection's write transaction); cancelled once submitted, the attempt
    still runs there once the file is free: what it took (the lock, or a place in the queue of
    a busy fair or write lock) must be given back."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    writer = sqlite3.connect(tmp_path / "locks.db", isolation_level=None, check_same_thread=False)

    async def attempts(busy: bool) -> int:
        store = open_store(url, namespace=namespace)
        assert isinstance(store, TableStore)
        twin = store.asyncio_twin()
        assert isinstance(twin, AsyncBridgeStore)
        cancelled = 0
        given_back: list[str] = []  # the tokens of cancelled attempts whose give-back has run
        give_back = twin._give_back

        def counted(done: Any, request: AcquireRequest) -> None:
            give_back(done, request)
            given_back.append(request.token)

        twin._give_back = counted  # type: ignore[method-assign]
        holder = AcquireRequest(kind, ("k",), secrets.token_hex(16), 30.0)
        try:
            if busy:
                assert store.acquire(holder).acquired
            for _ in range(10):
                request = AcquireRequest(kind, ("k",), secrets.token_hex(16), 30.0, waiter=twin.waiter_id(False))
                writer.execute("BEGIN IMMEDIATE")  # the file is busy: the inline try gives way
                task = asyncio.create_task(twin.acquire(request))
                await asyncio.sleep(0)  # the task runs up to its await: the submit is made
                task.cancel()
                writer.execute("ROLLBACK")  # the bridge thread's attempt goes on, and takes it
                try:
                    result = await task
                except asyncio.CancelledError:
                    cancelled += 1
                else:  # done before the cancel: give it back ourselves
                    assert result.acquired is not busy
                    if result.acquired:
                        await twin.release("k", request.token, kind)
                    await twin.unqueue("k", twin.waiter_id(False), kind)
                # the give-back of a cancelled attempt runs on its bridge thread once the attempt
                # ends (also when it never ran): wait for it before the next round
                for _ in range(6000):
                    if len(given_back) == cancelled:
                        break
                    await asyncio.sleep(0.01)
                assert len(given_back) == cancelled
                assert [state.holders for state in store.describe("k")] == ([1] if busy else [])
        finally:
            store.close()  # waits for the bridge threads (and the give-backs they run)
        check = open_store(url, namespace=namespace)
        try:
            assert [state.holders for state in check.describe("k")] == ([1] if busy else [])
            assert waiter_rows(url, namespace + "k") == 0
            if busy:
                check.release("k", holder.token, kind)
        finally:
            check.close()
        return cancelled

    assert run(attempts(busy=False)) > 0
    busy_cancelled = run(attempts(busy=True))
    # a busy plain lock is answered by a read, which another writer does not hold up: inline
    assert busy_cancelled == 0 if kind == "lock" else busy_cancelled > 0
    writer.close()


def test_the_sqlite_twin_runs_uncontended_operations_inline(tmp_path: Path, namespace: str) -> None:
    """On a file no other writer holds, the asyncio twin's operations run on the loop's thread
    (a statement is cheaper than a hop to a thread): no bridge thread is ever started."""
    store = open_store(f"sqlite:///{tmp_path / 'locks.db'}", namespace=namespace)
    assert isinstance(store, TableStore)

    async def main() -> None:
        twin = store.asyncio_twin()
        for kind in ("lock", "fair", "semaphore", "read", "write"):
            token = secrets.token_hex(16)
            assert (await twin.acquire(AcquireRequest(kind, ("k",), token, 30.0, permits=1))).acquired
            assert await twin.reenter("k", token, kind)
            assert list(await twin.renew([RenewItem("k", token, 30.0, kind)])) == [True]
            assert await twin.release("k", token, kind) == ReleaseResult.RELEASED
        await twin.aclose()

    try:
        run(main())
        assert store.threads() == []
    finally:
        store.close()


def suspended_at(task: asyncio.Task[Any]) -> tuple[Any, ...]:
    """Where ``task`` waits: the chain of its coroutines' frames (name, last instruction), and
    the future it waits on (a new one for each wait, even at the same place)."""
    where: list[Any] = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            where.append(coro)  # the future at the bottom
            break
        where.append((frame.f_code.co_name, frame.f_lasti))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return tuple(where)


async def run_until_suspension(task: asyncio.Task[Any], number: int) -> bool:
    """Turn the event loop until ``task`` reached its ``number``-th suspension (0: before it
    started; then each time it waits somewhere else than it last did); ``False`` if it
    finished first."""
    seen, last = -1, None
    while not task.done():
        where = suspended_at(task)
        if where != last:
            seen, last = seen + 1, where
            if seen == number:
                return True
        await asyncio.sleep(0)
    return False


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "write"])
def test_a_postgres_acquire_cancelled_at_every_await_point_leaves_nothing(
    postgres_server: PostgresServer, namespace: str, kind: str
) -> None:
    """The asyncio twin on PostgreSQL, cancelled at its first, second, ... suspension until
    an attempt finishes first: every cancelled attempt leaves no hold and no queue place,
    whether the lock was free or busy."""
    url = table_url(postgres_server)

    async def attempts() -> int:
        store = open_store(url, namespace=namespace)
        assert isinstance(store, TableStore)
        check = postgres_server.connect()
        queued = "SELECT count(*) FROM lockaspect_waiters WHERE name = %s"
        permits = 1 if kind == "semaphore" else None
        total = 0
        try:
            for busy in (False, True) if kind in ("fair", "write") else (False,):
                holder = AcquireRequest(kind, ("k",), secrets.token_hex(16), 30.0, permits=permits)
                expected = []
                if busy:
                    held = store.acquire(holder)
                    assert held.acquired
                    expected = [held.fencing_token]
                point = 0
                while True:
                    twin = store.asyncio_twin()
                    assert isinstance(twin, AsyncTableStore)
                    await twin.reenter("k", "nobody", kind)  # a connection ready in its pool
                    waiter = twin.waiter_id(False)
                    request = AcquireRequest(kind, ("k",), secrets.token_hex(16), 30.0, waiter, permits=permits)
                    task = asyncio.create_task(twin.acquire(request))
                    reached = await run_until_suspension(task, point)
                    task.cancel()
                    try:
                        result = await task
                    except asyncio.CancelledError:
                        assert reached
                    else:
                        assert result.acquired is not busy
                        if result.acquired:
                            await twin.release("k", request.token, kind)
                        await twin.unqueue("k", waiter, kind)
                    await twin.aclose()  # waits for the undo of a cancelled attempt
                    states = store.describe("k")
                    assert [state.fencing_token for state in states] == expected, point
                    assert check.execute(queued, (namespace + "k",)).fetchone() == (0,), point
                    if not reached:
                        break
                    point += 1
                    assert point < 1000
                total += point
                if busy:
                    store.release("k", holder.token, kind)
        finally:
            check.close()
            store.close()
        return total

    assert run(attempts()) > 1


# -- 7. bad input, refused at open with nothing written -----------------------------------------


def refused(url: str, **options: Any) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as info:
        LockClient.from_url(url, **options)
    error = info.value
    assert type(error) is ConfigurationError
    assert isinstance(error, LockError)
    assert isinstance(error, ValueError)
    return error


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("sqlite://host/locks.db", {}),
        ("sqlite:///:memory:", {}),
        ("sqlite://", {}),
        ("sqlite:///locks.db?nosuch=1", {}),
        ("sqlite:///locks.db", {"nosuch": 1}),
        ("sqlite:///locks.db?busy_timeout=-1", {}),
        ("sqlite:///locks.db", {"busy_timeout": -1}),
        ("sqlite:///locks.db?busy_timeout=soon", {}),
        ("sqlite:///locks.db?create_schema=maybe", {}),
        ("sqlite:///locks.db", {"create_schema": "maybe"}),
        ("sqlite:///locks.db?create_schema=false", {}),
        ("sqlite:///locks.db", {"create_schema": False}),
        ("sqlite:///locks.db?owner_info=2", {}),
    ],
)
def test_bad_sqlite_urls_and_options_are_refused_writing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, options: dict[str, Any]
) -> None:
    monkeypatch.chdir(tmp_path)
    error = refused(url, **options)
    if "nosuch" in url or "nosuch" in options:
        assert "'nosuch'" in str(error)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_directory_hints_at_the_absolute_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    error = refused("sqlite:///var/lib/app/locks.db")  # meant /var/lib/app: written relative
    assert "sqlite:////var/lib/app/locks.db" in str(error)
    error = refused(f"sqlite:///{tmp_path}/nowhere/locks.db")  # absolute already: no hint
    assert "does not exist" in str(error)
    assert "absolute path" not in str(error)
    assert list(tmp_path.iterdir()) == []


def tables_of(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()


def test_create_schema_false_refuses_a_file_without_the_tables(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE mine (n INTEGER)")
    conn.commit()
    conn.close()
    error = refused(f"sqlite:///{path}?create_schema=false")
    assert "schema_sql" in str(error)
    assert tables_of(path) == {"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_a_schema_made_by_hand_opens_with_create_schema_false(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.executescript(schema_sql("sqlite"))
    conn.close()
    assert tables_of(path) >= TABLES
    with LockClient.from_url(f"sqlite:///{path}", create_schema=False) as client:
        with client.lock("k") as first:
            pass
        with client.lock("k") as second:
            assert second.fencing_token > first.fencing_token
    with pytest.raises(ConfigurationError):
        schema_sql("mysql")


DROP_TO_NOBODY = """
import os, pwd, sys
from lockaspect import ConfigurationError, LockClient
import lockaspect.backends.sql.table  # imported as root: the interpreter's files may be root's only
nobody = pwd.getpwnam("nobody")
os.setgroups([])
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)
try:
    LockClient.from_url(sys.argv[1]).close()
except ConfigurationError as exc:
    print("ConfigurationError", exc)
else:
    print("opened")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops privileges to nobody: needs root")
def test_a_read_only_database_file_is_refused(tmp_path: Path) -> None:
    # a directory nobody may enter but not write, a file nobody may read but not write
    directory = Path(tempfile.mkdtemp(prefix="lockaspect-ro-"))
    try:
        directory.chmod(0o755)
        path = directory / "locks.db"
        LockClient.from_url(f"sqlite:///{path}").close()  # a real store file, made by root
        path.chmod(0o644)
        before = sorted(p.name for p in directory.iterdir()), path.read_bytes()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [WORKTREE, os.environ.get("PYTHONPATH")])))
        for url in (f"sqlite:///{path}", f"sqlite:///{path}?create_schema=false"):
            result = subprocess.run(
                [sys.executable, "-c", DROP_TO_NOBODY, url], capture_output=True, text=True, env=env, timeout=60
            )
            assert result.returncode == 0, result.stderr
            assert result.stdout.startswith("ConfigurationError"), result.stdout
            assert "read-only" in result.stdout, result.stdout
        assert (sorted(p.name for p in directory.iterdir()), path.read_bytes()) == before
    finally:
        shutil.rmtree(directory)


def pg_tables(postgres: PostgresServer, database: str) -> set[str]:
    with psycopg.connect(postgres.url.rsplit("/", 1)[0] + "/" + database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relname LIKE 'lockaspect%%' AND relkind IN ('r', 'S')"
        ).fetchall()
    return {row[0] for row in rows}


def test_postgres_create_schema_false_on_a_fresh_database(own_postgres: PostgresServer) -> None:
    database = f"fresh_{uuid.uuid4().hex[:8]}"
    with own_postgres.connect() as conn:
        conn.execute(f"CREATE DATABASE {database}")
    error = refused(table_url(own_postgres, database) + "?create_schema=false")
    assert str(error) == (
        f"{table_url(own_postgres, database)}?create_schema=false: the table lockaspect_holds is missing: "
        "open the store with create_schema=True, or create the tables with "
        "lockaspect.backends.sql.table.schema_sql('postgresql')"
    )
    error = refused(table_url(own_postgres, database), create_schema=False)
    assert pg_tables(own_postgres, database) == set()
    with psycopg.connect(own_postgres.url.rsplit("/", 1)[0] + "/" + database, autocommit=True) as conn:
        for statement in schema_sql("postgresql").split(";"):
            if statement.strip():
                conn.execute(statement)
    with (
        LockClient.from_url(table_url(own_postgres, database), create_schema=False) as client,
        client.lock("k") as lease,
    ):
        assert lease.fencing_token > 0
    assert pg_tables(own_postgres, database) == {
        "lockaspect_holds",
        "lockaspect_waiters",
        "lockaspect_semaphores",
        "lockaspect_fence",
    }


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("postgresql+table://postgres@127.0.0.1:5432/postgres?nosuch=1", {}),
        ("postgresql+table://postgres@127.0.0.1:5432/postgres", {"nosuch": 1}),
        ("postgresql+table://postgres@127.0.0.1:5432/postgres?create_schema=maybe", {}),
        ("postgresql+table://postgres@127.0.0.1:5432/postgres?connect_timeout=-1", {}),
    ],
)
def test_bad_postgres_options_are_refused_before_connecting(url: str, options: dict[str, Any]) -> None:
    refused(url, **options)


def test_an_unknown_option_in_the_query_string_lists_the_options() -> None:
    error = refused("postgresql+table://u:secret@127.0.0.1:5432/postgres?sslmode=disable&nosuch=1&busy_timeout=2")
    assert "unknown option(s) 'busy_timeout', 'nosuch'" in str(error)
    assert "create_schema, owner_info, prepared_statements" in str(error)
    assert "invalid URI query parameter" not in str(error)
    assert "secret" not in str(error)


def test_libpq_options_of_the_url_reach_the_server_intact(postgres_server: PostgresServer, namespace: str) -> None:
    url = table_url(postgres_server) + "?application_name=lock%26aspect%20" + namespace
    with LockClient.from_url(url, namespace=namespace) as client, client.lock("k"), postgres_server.connect() as conn:
        rows = conn.execute("SELECT application_name FROM pg_stat_activity").fetchall()
        assert ("lock&aspect " + namespace,) in rows


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_server_or_a_wrong_password_fails_at_open(own_postgres: PostgresServer) -> None:
    with pytest.raises(BackendError) as info:
        LockClient.from_url(f"postgresql+table://postgres@127.0.0.1:{free_port()}/postgres")
    assert info.value.transient
    # a role with a password, password authentication for it over TCP, a database of its own
    database = f"pw_{uuid.uuid4().hex[:8]}"
    with own_postgres.connect() as conn:
        conn.execute("CREATE ROLE locker LOGIN PASSWORD 'right'")
        conn.execute(f"CREATE DATABASE {database} OWNER locker")
        hba = Path(own_postgres.data_dir) / "pg_hba.conf"
        hba.write_text("host all locker 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        conn.execute("SELECT pg_reload_conf()")
    base = f"postgresql+table://locker:%s@127.0.0.1:{own_postgres.port}/{database}"
    with pytest.raises(BackendError) as info:
        LockClient.from_url(base % "wrong")
    assert not info.value.transient  # a retry cannot cure a wrong password
    assert 'password authentication failed for user "locker"' in str(info.value)
    assert "wrong" not in str(info.value)  # the password is redacted
    assert pg_tables(own_postgres, database) == set()  # nothing created
    with LockClient.from_url(base % "right") as client, client.lock("k") as lease:
        assert lease.fencing_token > 0


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("nouser@{host}/postgres", 'role "nouser" does not exist'),
        ("postgres@{host}/nodb", 'database "nodb" does not exist'),
    ],
)
def test_a_missing_role_or_database_is_not_transient(postgres_server: PostgresServer, path: str, problem: str) -> None:
    """Refused at open for good (not transient), naming the problem in the server's words."""
    url = "postgresql+table://" + path.format(host=f"127.0.0.1:{postgres_server.port}")
    with pytest.raises(BackendError) as info:
        LockClient.from_url(url)
    assert not info.value.transient
    assert problem in str(info.value)
    assert "FATAL" not in str(info.value)


def test_sslmode_require_on_a_server_without_ssl_is_not_transient(postgres_server: PostgresServer) -> None:
    with pytest.raises(BackendError, match="server does not support SSL") as info:
        LockClient.from_url(table_url(postgres_server) + "?sslmode=require")
    assert not info.value.transient


def test_a_role_refused_after_open_fails_a_waiting_lock_at_once(own_postgres: PostgresServer, namespace: str) -> None:
    """The store's own connections classify the same way as the opener's: once the server
    refuses its role, a lock with ``wait=None`` raises instead of retrying forever."""
    role, database = f"gone_{uuid.uuid4().hex[:8]}", f"db_{uuid.uuid4().hex[:8]}"
    with own_postgres.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        conn.execute(f"CREATE DATABASE {database}")
    LockClient.from_url(table_url(own_postgres, database)).close()  # the schema, made by postgres
    url = f"postgresql+table://{role}@127.0.0.1:{own_postgres.port}/{database}"
    client = LockClient.from_url(url, namespace=namespace, create_schema=False)
    outcome: list[BaseException | None] = []
    try:
        with own_postgres.connect() as conn:
            conn.execute(f"ALTER ROLE {role} NOLOGIN")
            conn.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")

        def take() -> None:
            try:
                with client.lock("k", wait=None):
                    outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                outcome.append(exc)

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "a lock with wait=None retried a refused role forever"
    finally:
        client.close()
        with own_postgres.connect() as conn:
            conn.execute(f"DROP DATABASE {database} WITH (FORCE)")
            conn.execute(f"DROP ROLE {role}")
    [error] = outcome
    assert isinstance(error, BackendError)
    assert not error.transient
    assert f'role "{role}" is not permitted to log in' in str(error)
