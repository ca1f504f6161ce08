"""The ``postgresql://`` store (session advisory locks) on a real PostgreSQL server: what the
contract suite cannot show for a session-bound store. No sleeps as synchronisation: events,
process pipes and the server's own ``pg_locks`` order the steps; timeouts only bound a hang.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import BackendError, ConfigurationError, LockClient, LockLost
from lockaspect.backends.base import AcquireRequest, ReleaseResult
from lockaspect.backends.sql._keys import advisory_key
from lockaspect.backends.sql.advisory import PostgresAdvisoryStore, open_postgres_store

BOUND = 30.0  # seconds: how long a broken store may hang a test


@pytest.fixture
def pg_namespace() -> str:
    return f"pg-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def make_pg(postgres_server: Any, pg_namespace: str) -> Iterator[Callable[..., LockClient]]:
    made: list[LockClient] = []

    def make(url: str | None = None, **options: Any) -> LockClient:
        options.setdefault("namespace", pg_namespace)
        options.setdefault("watchdog_lease", 0.5)
        options.setdefault("tick", 0.05)
        client = LockClient.from_url(url or postgres_server.url, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def waiting_on(conn: Any, namespace: str, key: str) -> int:
    """How many sessions wait in the server's queue for ``key``."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND NOT l.granted"
        " AND ((l.classid::bigint << 32) | l.objid::bigint) = %s",
        (advisory_key(namespace + key),),
    ).fetchone()
    return int(row[0])


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a condition only the server can tell (no event exists for it), bounded."""
    pause = threading.Event()
    for _ in range(int(BOUND / 0.01)):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- processes --------------------------------------------------------------------------------

COUNTER_WORKER = """
import sys
from pathlib import Path
from lockaspect import LockClient

url, namespace, counter, rounds = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
with LockClient.from_url(url, namespace=namespace, watchdog_lease=2.0, tick=0.05) as client:
    for _ in range(rounds):
        with client.lock("counter", wait=120):
            value = int(counter.read_text())   # read, then write: not atomic without the lock
            counter.write_text(str(value + 1))
"""


@pytest.mark.slow
def test_processes_keep_an_exact_non_atomic_counter(postgres_server: Any, pg_namespace: str, tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    workers, rounds = 4, 50
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", COUNTER_WORKER, postgres_server.url, pg_namespace, str(counter), str(rounds)],
            stderr=subprocess.PIPE,
        )
        for _ in range(workers)
    ]
    failures = []
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        if process.returncode:
            failures.append(stderr.decode())
    assert failures == []
    assert int(counter.read_text()) == workers * rounds


def _hold_forever(url: str, namespace: str, held: Any) -> None:
    with LockClient.from_url(url, namespace=namespace, watchdog_lease=50.0) as client, client.lock("crash"):
        held.send(os.getpid())
        threading.Event().wait()


@pytest.mark.slow
def test_a_killed_holder_frees_the_lock_at_once(
    make_pg: Callable[..., LockClient], postgres_server: Any, pg_namespace: str
) -> None:
    """kill -9 of a holder (lease 50 s) lets a queued waiter in at once: the server sees the
    socket close; no lease has to run out (the waiter waits 25 s at most)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    holder = context.Process(target=_hold_forever, args=(postgres_server.url, pg_namespace, theirs), daemon=True)
    holder.start()
    assert ours.poll(BOUND)
    ours.recv()
    waiter = make_pg(watchdog_lease=5.0)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(_take(waiter, "crash", 25.0)), daemon=True)
    thread.start()
    with postgres_server.connect() as conn:
        until(lambda: waiting_on(conn, pg_namespace, "crash") == 1, "the waiter to queue")
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(BOUND)
    thread.join(BOUND)
    assert len(got) == 1
    assert got[0] > 0


def _take(client: LockClient, key: str, wait: float) -> int:
    with client.lock(key, wait=wait) as lease:
        return lease.fencing_token


# -- losing the session ---------------------------------------------------------------------


def _terminate_holder(postgres_server: Any, namespace: str, key: str) -> None:
    with postgres_server.connect() as conn:
        conn.execute(
            "SELECT pg_terminate_backend(l.pid, 5000) FROM pg_locks l WHERE l.locktype = 'advisory'"
            " AND l.objsubid = 1 AND l.granted AND ((l.classid::bigint << 32) | l.objid::bigint) = %s",
            (advisory_key(namespace + key),),
        )


def test_terminated_backend_is_a_lost_lock(
    make_pg: Callable[..., LockClient], postgres_server: Any, pg_namespace: str
) -> None:
    """pg_terminate_backend of the holder's connection: on_lost is called, the lease is lost,
    the block raises LockLost; the client takes new locks on new connections."""
    client = make_pg()
    called = threading.Event()
    seen: list[Any] = []

    def hold() -> None:
        with client.lock("term", on_lost=lambda lease: called.set()) as lease:
            seen.append(lease)
            _terminate_holder(postgres_server, pg_namespace, "term")
            assert called.wait(BOUND)
            assert lease.lost

    with pytest.raises(LockLost):
        hold()
    with client.lock("term", wait=BOUND) as again:
        assert again.fencing_token > seen[0].fencing_token


@pytest.mark.slow
def test_a_lost_session_is_noticed_long_before_the_lease_would_be_renewed(
    make_pg: Callable[..., LockClient], postgres_server: Any, pg_namespace: str
) -> None:
    """With the default 30 s watchdog lease, renewals fall due after 27 s, but the server frees
    a terminated session's locks at once: the holder's session is probed every second
    (watchdog.SESSION_PROBE), so it is told while most of its lease is still ahead."""
    client = make_pg(watchdog_lease=30.0, tick=0.1)
    told: list[float] = []
    called = threading.Event()

    def on_lost(lease: Any) -> None:
        told.append(time.monotonic())
        called.set()

    taken: list[float] = []

    def hold() -> None:
        with client.lock("soon", on_lost=on_lost):
            taken.append(time.monotonic())
            _terminate_holder(postgres_server, pg_namespace, "soon")
            called.wait(BOUND + 30)

    with pytest.raises(LockLost):
        hold()
    # told while most of the lease was ahead: the first renewal is due only after 27 s
    assert told[0] - taken[0] < 15.0


def test_terminated_backend_cancels_an_async_body(
    make_pg: Callable[..., LockClient], postgres_server: Any, pg_namespace: str
) -> None:
    client = make_pg()

    async def main() -> None:
        started = asyncio.Event()

        async def body() -> None:
            async with client.lock("aterm"):
                started.set()
                await asyncio.Event().wait()  # only a cancel ends this

        task = asyncio.create_task(body())
        await started.wait()
        await asyncio.get_running_loop().run_in_executor(
            None, _terminate_holder, postgres_server, pg_namespace, "aterm"
        )
        with pytest.raises((LockLost, asyncio.CancelledError)):
            await asyncio.wait_for(task, BOUND)
        assert task.done()

    asyncio.run(main())


@pytest.fixture
def own_server() -> Iterator[Any]:
    """A server of the test's own (restarted by it)."""
    from lockaspect.testing import PostgresServer

    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.mark.slow
def test_server_restart_loses_the_leases_and_the_client_recovers(own_server: Any) -> None:
    client = LockClient.from_url(own_server.url, watchdog_lease=0.5, tick=0.05)
    try:
        lost = threading.Event()

        def hold() -> None:
            with client.lock("restart", on_lost=lambda lease: lost.set()):
                own_server.restart()
                assert lost.wait(BOUND)

        with pytest.raises(LockLost):
            hold()
        with client.lock("restart", wait=BOUND) as lease:  # a new session: the client recovered
            assert not lease.lost
        with client.lock("another", wait=BOUND):
            pass
    finally:
        client.close()


# -- waiting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "fair"])
def test_waiters_get_the_lock_in_the_order_they_queued(
    make_pg: Callable[..., LockClient], postgres_server: Any, pg_namespace: str, kind: str
) -> None:
    """Five waiters (each its own client, so none coalesce) queued one after the other get
    the lock in that order: the server's FIFO queue, kept across the engine's rechecks."""
    holder = make_pg()
    order: list[int] = []
    threads = []
    with postgres_server.connect() as conn, holder.lock("fifo") if kind == "lock" else holder.fair_lock("fifo"):
        for i in range(5):
            waiter = make_pg()

            def wait(i: int = i, waiter: LockClient = waiter) -> None:
                block = waiter.lock("fifo", wait=BOUND) if kind == "lock" else waiter.fair_lock("fifo", wait=BOUND)
                with block:
                    order.append(i)

            thread = threading.Thread(target=wait, daemon=True)
            thread.start()
            threads.append(thread)
            until(lambda i=i: waiting_on(conn, pg_namespace, "fifo") == i + 1, f"waiter {i} to queue")
        # Let the engine's rechecks (1 s apart) pass while queued: they must not lose the places.
        threading.Event().wait(1.5)
        assert waiting_on(conn, pg_namespace, "fifo") == 5
    for thread in threads:
        thread.join(BOUND)
    assert order == [0, 1, 2, 3, 4]


def test_a_wait_that_runs_out_leaves_the_server_queue(
    make_pg: Callable[..., LockClient], postgres_server: Any, pg_namespace: str
) -> None:
    from lockaspect import LockNotAcquired

    holder, waiter = make_pg(), make_pg()
    with postgres_server.connect() as conn, holder.lock("out"):
        with pytest.raises(LockNotAcquired), waiter.lock("out", wait=0.3):
            pass
        assert waiting_on(conn, pg_namespace, "out") == 0


def test_release_hands_the_lock_to_the_queued_waiter(postgres_server: Any, pg_namespace: str) -> None:
    """Store level: a release grants the lock to the waiter queued in the server; its
    subscription wakes, another token's try is refused, the waiter's attempt claims it. An
    unqueued waiter is gone from the server's queue."""
    store = open_postgres_store(postgres_server.url, namespace=pg_namespace)
    try:
        notifier = store.notifier()
        assert notifier is not None
        waiter = store.waiter_id(True)

        def req(owner: str, who: str | None = None) -> AcquireRequest:
            return AcquireRequest("lock", ("q",), owner, 10.0, who)

        assert store.acquire(req("holder")).acquired
        assert not store.acquire(req("w1", waiter)).acquired
        subscription = notifier.subscribe("q", 5.0, waiter)
        assert store.release("q", "holder") == ReleaseResult.RELEASED
        assert subscription.wait(BOUND)
        assert not store.acquire(req("other")).acquired  # it is the waiter's
        claimed = store.acquire(req("w1", waiter))
        assert claimed.acquired
        assert not store.acquire(req("w2", waiter + "x")).acquired  # queued behind w1
        store.unqueue("q", waiter + "x")
        with postgres_server.connect() as conn:
            assert waiting_on(conn, pg_namespace, "q") == 0
        assert store.release("q", "w1") == ReleaseResult.RELEASED
        assert store.acquire(req("other")).acquired
        notifier.unsubscribe(subscription)
    finally:
        store.close()


def test_a_multi_key_waiter_busy_on_one_key_gives_up_a_grant_on_another(
    postgres_server: Any, pg_namespace: str
) -> None:
    """A multi-key waiter queued on its second key, granted it by a release, then finding its
    first key taken meanwhile, waits on the first key only: the grant on the second is given
    up, never kept while it waits (the first key's holder may need the second: a deadlock)."""
    store = open_postgres_store(postgres_server.url, namespace=pg_namespace)
    try:
        notifier = store.notifier()
        assert notifier is not None
        waiter = store.waiter_id(True)
        multi = AcquireRequest("lock", ("m:a", "m:b"), "w", 10.0, waiter)
        assert store.acquire(AcquireRequest("lock", ("m:b",), "b-holder", 10.0)).acquired
        assert not store.acquire(multi).acquired  # queued on m:b, m:a given back
        subscription = notifier.subscribe("m:b", 5.0, waiter)
        assert store.acquire(AcquireRequest("lock", ("m:a",), "a-holder", 10.0)).acquired
        assert store.release("m:b", "b-holder") == ReleaseResult.RELEASED
        assert subscription.wait(BOUND)  # the server granted m:b to the waiter's queued wait
        notifier.unsubscribe(subscription)
        assert not store.acquire(multi).acquired  # m:a is busy: queued on m:a now
        assert store.acquire(AcquireRequest("lock", ("m:b",), "other", 10.0)).acquired
        assert store.release("m:b", "other") == ReleaseResult.RELEASED
        assert store.release("m:a", "a-holder") == ReleaseResult.RELEASED
        taken = store.acquire(multi)
        assert taken.acquired
        assert len(taken.fencing_tokens or ()) == 2
        for key in multi.keys:
            assert store.release(key, "w") == ReleaseResult.RELEASED
        with postgres_server.connect() as conn:
            assert waiting_on(conn, pg_namespace, "m:a") == 0
            assert waiting_on(conn, pg_namespace, "m:b") == 0
    finally:
        store.close()


def test_owners_of_one_client_exclude_each_other_on_one_session(postgres_server: Any, pg_namespace: str) -> None:
    """With one connection, a second owner's try would be granted by the server (a session
    takes its own lock again): the client refuses it first."""
    store = open_postgres_store(postgres_server.url, namespace=pg_namespace, pool_size=1)
    try:
        assert store.acquire(AcquireRequest("lock", ("one",), "a", 10.0)).acquired
        assert not store.acquire(AcquireRequest("lock", ("one",), "b", 10.0)).acquired
        assert not store.acquire(AcquireRequest("write", ("one",), "b", 10.0)).acquired
        assert store.release("one", "a") == ReleaseResult.RELEASED
        assert store.acquire(AcquireRequest("lock", ("one",), "b", 10.0)).acquired
    finally:
        store.close()


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:secret@host:notaport/db",
        "postgresql://u:secret@host/db?nosuchparam=1",
        "postgresql://u:secret@a b/db",
        "mysql://u:secret@host/db",
    ],
)
def test_malformed_urls_are_refused_with_the_password_redacted(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_postgres_store(url)
    assert "secret" not in str(info.value)


def test_unknown_options_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="lease_time"):
        LockClient.from_url("postgresql://u:secret@127.0.0.1/db", lease_time=5)
    with pytest.raises(ConfigurationError, match="pool_size"):
        open_postgres_store("postgresql://127.0.0.1/db", pool_size=0)


def test_options_in_the_query_string(postgres_server: Any, pg_namespace: str) -> None:
    """The store's options may be given in the URL (parsed as the keywords are, keywords
    winning); libpq's own parameters stay in the URL for libpq."""
    query = (
        "?idle_session_timeout=0&pool_size=2&create_schema=false&connect_timeout=5&max_waiters=8"
        "&application_name=from%20the%20url&target_session_attrs=any&sslmode=disable"
    )
    store = open_postgres_store(postgres_server.url + query, namespace=pg_namespace, max_waiters=3)
    settings = store.settings
    assert (settings.pool_size, settings.max_waiters, settings.create_schema) == (2, 3, False)
    assert (settings.connect_timeout, settings.idle_session_timeout) == (5.0, 0.0)
    assert settings.application_name == "from the url"
    assert "pool_size" not in settings.url
    assert "sslmode=disable" in settings.url
    store.close()
    with LockClient.from_url(postgres_server.url, namespace=pg_namespace) as client, client.lock("k"):
        pass  # the schema, for create_schema=false below
    url = postgres_server.url + "?application_name=lock%26aspect&pool_size=1"
    with (
        LockClient.from_url(url, namespace=pg_namespace) as client,
        client.lock("k"),
        postgres_server.connect() as conn,
    ):
        rows = conn.execute("SELECT application_name FROM pg_stat_activity").fetchall()
        assert ("lock&aspect",) in rows


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("pool_size=two", "pool_size must be an int, got 'two'"),
        ("pool_size=0", "pool_size must be at least 1"),
        ("create_schema=maybe", "create_schema must be True or False, got 'maybe'"),
        ("connect_timeout=soon", "connect_timeout must be a number of seconds"),
        ("idle_session_timeout=-1", "idle_session_timeout must be a finite number of seconds >= 0"),
        ("application_name=", "application_name must be a non-empty str"),
        ("nosuch=1&sslmode=disable&lease_time=5", "unknown option(s) 'lease_time', 'nosuch'"),
    ],
)
def test_bad_options_in_the_query_string_are_refused_like_keywords(query: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_postgres_store("postgresql://u:secret@127.0.0.1/db?" + query)
    assert message in str(info.value)
    assert "secret" not in str(info.value)
    if "unknown" in message:
        assert "pool_size" in str(info.value)  # the options are listed
        assert "sslmode" not in str(info.value).partition(" for ")[0]  # libpq's passes


def test_the_repr_hides_the_password() -> None:
    store = open_postgres_store("postgresql://u:secret@127.0.0.1:1/db")
    assert "secret" not in repr(store)
    store.close()


@pytest.fixture
def fresh_database(postgres_server: Any) -> Iterator[str]:
    name = f"fresh_{uuid.uuid4().hex[:10]}"
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield postgres_server.url.rsplit("/", 1)[0] + "/" + name
    with postgres_server.connect() as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_create_schema_false_on_a_fresh_database(fresh_database: str) -> None:
    """No schema and create_schema=False: a ConfigurationError naming the fix, and nothing
    written; with create_schema=True (the default) the schema is made and locks work."""
    import psycopg

    client = LockClient.from_url(fresh_database, create_schema=False)
    try:
        with pytest.raises(ConfigurationError, match="create_schema=True") as info, client.lock("k"):
            pass
        assert "lockaspect_fence" in str(info.value)
    finally:
        client.close()
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_class"
            " WHERE relname IN ('lockaspect_fence', 'lockaspect_advisory', 'lockaspect_semaphore')"
        ).fetchone()
        assert row is not None
        assert row[0] == 0
    with LockClient.from_url(fresh_database) as client, client.lock("k") as lease:
        assert lease.fencing_token == 1


SCHEMA_KEY = -8111973515212196337  # the advisory key of ``_sql.SCHEMA_LOCK``


def _first_attempt(store: PostgresAdvisoryStore, driver: str) -> BaseException | bool:
    """A first attempt on ``store`` by ``driver`` (its first session checks the schema):
    whether it took the lock, or what it raised."""
    request = AcquireRequest("lock", ("k",), "t", 10.0)
    try:
        if driver == "thread":
            return store.acquire(request).acquired

        async def attempt() -> bool:
            twin = store.asyncio_twin()
            try:
                return (await twin.acquire(request)).acquired
            finally:
                await twin.aclose()

        return asyncio.run(attempt())
    except BaseException as exc:  # noqa: BLE001 - the outcome the test checks
        return exc


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
@pytest.mark.parametrize("driver", ["thread", "asyncio"])
def test_a_session_that_waited_for_another_schema_maker_leaves_the_tables_alone(
    fresh_database: str, pg_namespace: str, driver: str, isolation: str
) -> None:
    """Sessions opened at once on a fresh database all find the schema missing; one makes it
    under the schema lock, the others wait for that lock, and must then find the schema made
    and run no DDL: an ``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` with nothing to add still
    waits for the table's ACCESS EXCLUSIVE lock behind every statement using the table (a
    queued wait's blocking statement uses it while it waits) and holds up every new one: all
    the client's sessions stalled for the schema's lock_timeout (5 s), then a failed attempt.
    Here the other maker is a raw session, and a transaction reading the table stands for the
    queued wait. Also where the server's default isolation is REPEATABLE READ (a snapshot taken
    before the lock would miss the other maker's schema)."""
    import psycopg

    from lockaspect.backends.sql.advisory import _sql

    with psycopg.connect(fresh_database, autocommit=True) as admin:
        admin.execute(
            f"ALTER DATABASE {fresh_database.rsplit('/', 1)[1]} SET default_transaction_isolation = '{isolation}'"
        )

    waiting_for_schema = (
        "SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND NOT l.granted"
        " AND ((l.classid::bigint << 32) | l.objid::bigint) = %s"
    )
    with (
        psycopg.connect(fresh_database, autocommit=True) as maker,
        psycopg.connect(fresh_database, autocommit=True) as user,
    ):
        maker.execute("SELECT pg_advisory_lock(%s)", (SCHEMA_KEY,))
        store = open_postgres_store(fresh_database, namespace=pg_namespace)
        outcome: list[BaseException | bool] = []
        thread = threading.Thread(target=lambda: outcome.append(_first_attempt(store, driver)), daemon=True)
        try:
            thread.start()
            until(
                lambda: maker.execute(waiting_for_schema, (SCHEMA_KEY,)).fetchone() == (1,),
                "the store's first session to wait for the schema lock",
            )
            for statement in _sql.SCHEMA:
                maker.execute(statement)
            with user.transaction():
                user.execute("SELECT count(*) FROM lockaspect_advisory")
                maker.execute("SELECT pg_advisory_unlock(%s)", (SCHEMA_KEY,))
                thread.join(BOUND)  # the ALTER TABLE would wait here for this transaction
            assert outcome == [True]
        finally:
            thread.join(BOUND)
            store.close()


def test_an_unreachable_server_is_a_transient_backend_error() -> None:
    client = LockClient.from_url("postgresql://u:secret@127.0.0.1:1/db", connect_timeout=2)
    try:
        with pytest.raises(BackendError) as info, client.lock("k"):
            pass
        assert info.value.transient
        assert "secret" not in str(info.value)
    finally:
        client.close()


def _lock_outcome(client: LockClient, key: str = "k") -> BaseException | None:
    """What ``client.lock(key, wait=None)`` raises (``None``: it took the lock), from a thread
    bounded by :data:`BOUND`, so that a retry loop fails the test instead of hanging it."""
    outcome: list[BaseException | None] = []

    def take() -> None:
        try:
            with client.lock(key, wait=None):
                outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), "a lock with wait=None retried a connection that can never succeed"
    return outcome[0]


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("nouser@{host}/postgres", 'role "nouser" does not exist'),
        ("postgres@{host}/nodb", 'database "nodb" does not exist'),
    ],
)
def test_a_missing_role_or_database_is_not_transient(postgres_server: Any, path: str, problem: str) -> None:
    """A retry cannot cure it: a lock that waits forever raises at once, naming the problem."""
    client = LockClient.from_url("postgresql://" + path.format(host=f"127.0.0.1:{postgres_server.port}"))
    try:
        error = _lock_outcome(client)
    finally:
        client.close()
    assert isinstance(error, BackendError)
    assert not error.transient
    assert problem in str(error)


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        ("InvalidPassword", False),  # 28P01
        ("InvalidAuthorizationSpecification", False),  # 28000
        ("InvalidCatalogName", False),  # 3D000
        ("AdminShutdown", True),  # 57P01
        ("CannotConnectNow", True),  # 57P03
        ("TooManyConnections", True),  # 53300
    ],
)
def test_errors_are_classified_by_sqlstate_first(error: str, transient: bool) -> None:
    import psycopg.errors

    from lockaspect.backends.sql.advisory._session import store_error

    exc = getattr(psycopg.errors, error)('role "x" does not exist' if transient else "the network")
    result = store_error(exc, "k", "postgresql://host/db")
    assert isinstance(result, BackendError)
    assert result.transient is transient


def test_sslmode_require_on_a_server_without_ssl_is_not_transient(postgres_server: Any) -> None:
    client = LockClient.from_url(postgres_server.url + "?sslmode=require")
    try:
        error = _lock_outcome(client)
    finally:
        client.close()
    assert isinstance(error, BackendError)
    assert not error.transient
    assert "server does not support SSL" in str(error)


def test_a_wrong_password_is_not_transient(own_server: Any) -> None:
    """Password authentication for one role over TCP (the test server trusts everyone else)."""
    with own_server.connect() as conn:
        conn.execute("CREATE ROLE app LOGIN SUPERUSER PASSWORD 'right'")
        hba = Path(own_server.data_dir) / "pg_hba.conf"
        hba.write_text("host all app 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        conn.execute("SELECT pg_reload_conf()")
    url = f"postgresql://app:%s@127.0.0.1:{own_server.port}/postgres"
    client = LockClient.from_url(url % "wrong")
    try:
        error = _lock_outcome(client)
    finally:
        client.close()
    assert isinstance(error, BackendError)
    assert not error.transient
    assert 'password authentication failed for user "app"' in str(error)
    assert "wrong" not in str(error)
    client = LockClient.from_url(url % "right")
    try:
        assert _lock_outcome(client) is None
    finally:
        client.close()


# -- fork -------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_touch_the_parents_sessions(postgres_server: Any, pg_namespace: str) -> None:
    store: PostgresAdvisoryStore = open_postgres_store(postgres_server.url, namespace=pg_namespace)
    try:
        assert store.acquire(AcquireRequest("lock", ("forked",), "parent", 10.0)).acquired
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: forget the parent's sessions, take a lock of its own, exit
            code = 1
            try:
                store.reset_after_fork()
                ok = store.acquire(AcquireRequest("lock", ("child",), "child", 10.0)).acquired
                busy = not store.acquire(AcquireRequest("lock", ("forked",), "child", 10.0)).acquired
                store.close()
                code = 0 if ok and busy else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
        os.close(write)
        assert os.read(read, 1) == bytes([0])
        os.waitpid(pid, 0)
        os.close(read)
        assert store.reenter("forked", "parent")  # the parent's session is untouched
        assert store.release("forked", "parent") == ReleaseResult.RELEASED
    finally:
        store.close()
