"""The lease-table store (``sqlite:///`` and ``postgresql+table://``) against real files, real
processes and a real PostgreSQL: mutual exclusion of processes on a non-atomic counter, a
holder killed or frozen, fencing tokens across kinds, processes and reopenings, the batch
renewal, the sweep of dead holders' rows, and same-process wake-ups.

Faults, bad input and asyncio are in ``test_sql_table_faults.py``."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import ConfigurationError, LockClient, LockLost, LockNotAcquired
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, Capability, ReleaseResult, RenewItem
from lockaspect.backends.sql.table import TableStore
from lockaspect.backends.sql.table import _ops as ops_module
from lockaspect.backends.sql.table import store as store_module
from lockaspect.testing import PostgresServer

STORES = ["sqlite", "postgres_table"]
WORKTREE = str(Path(__file__).resolve().parents[2])


def table_url(postgres: PostgresServer) -> str:
    return postgres.url.replace("postgresql://", "postgresql+table://", 1)


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh lease table: a new SQLite file, or the session's PostgreSQL (tests
    keep apart by namespace)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    return table_url(postgres)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def make_client(url: str, namespace: str) -> Iterator[Callable[..., LockClient]]:
    made: list[LockClient] = []

    def make(**options: Any) -> LockClient:
        options.setdefault("watchdog_lease", 1.0)
        options.setdefault("tick", 0.05)
        client = LockClient.from_url(url, namespace=namespace, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def table(client: LockClient) -> TableStore:
    store = client.backend
    assert isinstance(store, TableStore)
    return store


def worker_env() -> dict[str, str]:
    """The environment of a worker process: this checkout's lockaspect first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [WORKTREE, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def spawn(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A worker process running ``code``; killed (and continued, if frozen) if still alive
    at the end, its pipes closed."""
    with subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
    ) as process:
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.communicate()


def read_line(process: subprocess.Popen[str], skip: str = "renewed") -> list[str]:
    """The worker's next line (but lines saying ``skip``), split; fails with its stderr if it
    ended instead."""
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if not line:
            process.wait(timeout=30)
            assert process.stderr is not None
            pytest.fail(f"the worker ended (exit {process.returncode}) without a word:\n{process.stderr.read()}")
        if line.split() != [skip]:
            return line.split()


def finish(process: subprocess.Popen[str]) -> str:
    """Wait for a worker; its remaining stdout. Fails with its stderr if it failed."""
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return out


# -- 1. processes exclude each other on a counter kept in a plain file ------------------------

COUNTER_WORKER = """
import sys, time
from pathlib import Path
from lockaspect import LockClient

url, namespace, kind, counter, rounds = sys.argv[1:]
path = Path(counter)
with LockClient.from_url(url, namespace=namespace, watchdog_lease=5.0, tick=0.05) as client:
    print("ready", flush=True)
    sys.stdin.readline()  # every worker starts at once
    for _ in range(int(rounds)):
        if kind == "lock":
            block = client.lock("counter", wait=60)
        elif kind == "fair":
            block = client.fair_lock("counter", wait=60)
        elif kind == "semaphore":
            block = client.semaphore("counter", permits=1, wait=60)
        elif kind == "write":
            block = client.rw_lock("counter").write(wait=60)
        else:
            block = client.multi_lock(["counter", "counter:second"], wait=60)
        with block:
            value = int(path.read_text())  # read, modify, write: not atomic
            time.sleep(0.001)  # widen the window a lost update needs
            path.write_text(str(value + 1))
"""

WORKERS = 4
#: Increments per worker. A fair lock hands over in queue order, and a waiter of another
#: process learns of a release only by polling (with backoff, up to a second or two), so each
#: of its handovers costs a poll interval: fewer rounds keep the test short.
ROUNDS = {"lock": 25, "fair": 4, "semaphore": 25, "write": 25, "multi": 25}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "write", "multi"])
def test_processes_count_exactly(url: str, namespace: str, tmp_path: Path, kind: str) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    with contextlib.ExitStack() as stack:
        args = (url, namespace, kind, str(counter), str(ROUNDS[kind]))
        workers = [stack.enter_context(spawn(COUNTER_WORKER, *args)) for _ in range(WORKERS)]
        for worker in workers:
            assert read_line(worker) == ["ready"]
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        for worker in workers:
            finish(worker)
    assert int(counter.read_text()) == WORKERS * ROUNDS[kind]


# -- 2. a holder killed with SIGKILL --------------------------------------------------------

HOLDER = """
import sys, threading
from lockaspect import ConfigurationError, LockClient, LockLost, LockNotAcquired

url, namespace = sys.argv[1:]
told = threading.Event()


def observe(event):
    if event.name == "renewed" and event.number == event.batch:
        print("renewed", flush=True)  # from the watchdog thread: a renewal is done


with LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0, tick=0.05, observers=[observe]) as client:
    try:
        with client.lock("held", on_lost=lambda lease: told.set()) as lease:
            print("held", lease.fencing_token, flush=True)
            sys.stdin.readline()  # the test froze us past the lease, then let us go on
            print("told", told.wait(30), lease.lost, flush=True)
    except LockLost as exc:
        print("LockLost", exc.reason, flush=True)
    else:
        print("no LockLost", flush=True)
"""


@pytest.mark.slow
def test_a_killed_holder_s_lock_is_taken_over_with_a_larger_token(
    make_client: Callable[..., LockClient], url: str, namespace: str
) -> None:
    with spawn(HOLDER, url, namespace) as holder:
        word, dead_fence = read_line(holder)
        assert word == "held"
        client = make_client()
        assert [state.fencing_token for state in table(client).describe("held")] == [int(dead_fence)]
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with client.lock("held", wait=30) as lease:
        assert lease.fencing_token > int(dead_fence)


# -- 3. a holder frozen (SIGSTOP) longer than its lease ---------------------------------------


@pytest.mark.slow
def test_a_frozen_holder_is_told_its_lease_is_lost(
    make_client: Callable[..., LockClient], url: str, namespace: str
) -> None:
    client = make_client()
    with spawn(HOLDER, url, namespace) as holder:
        word, old_fence = read_line(holder)
        assert word == "held"
        # freeze it just after a renewal, not in the middle of one: a SQLite writer frozen
        # mid-statement would keep the database's write lock
        assert read_line(holder, skip="") == ["renewed"]
        holder.send_signal(signal.SIGSTOP)
        with client.lock("held", wait=30) as lease:  # takes over once the frozen lease ended
            assert lease.fencing_token > int(old_fence)
            assert holder.stdin is not None
            holder.stdin.write("go\n")
            holder.stdin.flush()
            holder.send_signal(signal.SIGCONT)
            assert read_line(holder) == ["told", "True", "True"]  # on_lost ran, lease.lost
            assert read_line(holder)[0] == "LockLost"  # raised at the end of its block
            finish(holder)
            # the old holder's renewal and release took nothing from the new one
            assert not lease.lost
            assert [state.fencing_token for state in table(client).describe("held")] == [lease.fencing_token]


# -- 9. fencing tokens --------------------------------------------------------------------------

FENCE_WORKER = """
import sys
from lockaspect import LockClient

url, namespace = sys.argv[1:]
with LockClient.from_url(url, namespace=namespace) as client:
    with client.lock("fenced") as lease:
        print(lease.fencing_token, flush=True)
"""


def fence_of_a_process(url: str, namespace: str) -> int:
    with spawn(FENCE_WORKER, url, namespace) as worker:
        return int(finish(worker))


def fences_of_every_kind(client: LockClient, key: str) -> list[int]:
    fences = []
    with client.lock(key) as lease:
        fences.append(lease.fencing_token)
    with client.fair_lock(key) as lease:
        fences.append(lease.fencing_token)
    with client.semaphore(key, permits=2) as lease:
        fences.append(lease.fencing_token)
    with client.rw_lock(key).write() as lease:
        fences.append(lease.fencing_token)
    with client.rw_lock(key).read() as lease:
        fences.append(lease.fencing_token)
    with client.multi_lock([key, key + ":other"]) as multi:
        fences.append(multi.fencing_tokens[key])
    return fences


def test_fencing_tokens_increase_across_kinds_processes_and_force_release(
    make_client: Callable[..., LockClient], url: str, namespace: str
) -> None:
    client = make_client()
    fences = fences_of_every_kind(client, "fenced")
    fences.append(fence_of_a_process(url, namespace))
    block = client.lock("fenced")
    lease = block.__enter__()
    fences.append(lease.fencing_token)
    store = table(client)
    assert store.force_release("fenced")
    taken = store.acquire(request("fenced"))  # another owner, straight after the force-release
    assert taken.acquired
    fences.append(taken.fencing_token)
    with pytest.raises(LockLost):
        block.__exit__(None, None, None)  # the forced-out holder learns at the latest here
    assert store.force_release("fenced")
    fences.append(fence_of_a_process(url, namespace))
    fences.extend(fences_of_every_kind(client, "fenced"))
    assert fences == sorted(set(fences)), fences


def test_sqlite_fencing_tokens_survive_closing_the_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    fences = []
    for _ in range(3):
        with LockClient.from_url(url) as client:
            fences.extend(fences_of_every_kind(client, "fenced"))
            assert table(client).describe("fenced") == []  # every row released
    assert fences == sorted(set(fences)), fences


def test_postgres_table_tokens_come_from_the_shared_sequence(postgres_server: PostgresServer, namespace: str) -> None:
    with (
        LockClient.from_url(table_url(postgres_server), namespace=namespace) as client,
        postgres_server.connect() as conn,
    ):
        last = conn.execute("SELECT nextval('lockaspect_fence')").fetchone()[0]
        with client.lock("seq") as lease:
            assert lease.fencing_token > last
            row = conn.execute("SELECT fence FROM lockaspect_holds WHERE name = %s", (namespace + "seq",)).fetchone()
            assert row == (lease.fencing_token,)
        conn.execute("SELECT setval('lockaspect_fence', %s)", (lease.fencing_token + 1000,))
        with client.lock("seq") as later:  # drawn from the sequence, past where it was set
            assert lease.fencing_token + 1000 < later.fencing_token <= lease.fencing_token + 1002


# -- 8. the batch renewal ----------------------------------------------------------------------


def request(key: str, kind: str = "lock", lease: float = 30.0, **extra: Any) -> AcquireRequest:
    return AcquireRequest(kind, (key,), secrets.token_hex(16), lease, **extra)


@pytest.fixture
def store(url: str, namespace: str) -> Iterator[TableStore]:
    opened = open_store(url, namespace=namespace)
    assert isinstance(opened, TableStore)
    yield opened
    opened.close()


def expire(store: TableStore, url: str, key: str) -> None:
    """Make every hold of ``key`` expired (in the database's time) without waiting."""
    name = store.namespace + key
    if url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            conn.execute("UPDATE lockaspect_holds SET expires_at = expires_at - 3600 WHERE name = ?", (name,))
        finally:
            conn.close()
    else:
        import psycopg

        conninfo = url.replace("postgresql+table://", "postgresql://", 1)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("UPDATE lockaspect_holds SET expires_at = expires_at - 3600 WHERE name = %s", (name,))


def test_renew_answers_each_item_in_order(store: TableStore, url: str) -> None:
    held = request("held")
    read = request("shared", "read")
    permit = request("sem", "semaphore", permits=3)
    expired = request("expired")
    released = request("released", "write")
    for req in (held, read, permit, expired, released):
        assert store.acquire(req).acquired
    expire(store, url, "expired")
    assert store.release("released", released.token, "write") is ReleaseResult.RELEASED
    items = [
        RenewItem("held", held.token, 30.0, "lock"),
        RenewItem("expired", expired.token, 30.0, "lock"),
        RenewItem("shared", read.token, 30.0, "read"),
        RenewItem("held", secrets.token_hex(16), 30.0, "lock"),  # a foreign token
        RenewItem("released", released.token, 30.0, "write"),
        RenewItem("sem", permit.token, 30.0, "semaphore"),
        RenewItem("shared", read.token, 30.0, "write"),  # the right token, another kind
        RenewItem("nowhere", held.token, 30.0, "lock"),
    ]
    assert list(store.renew(items)) == [True, False, True, False, False, True, False, False]
    # an expired hold was not revived by the renewal
    assert store.describe("expired") == []


def test_renew_of_more_than_one_chunk(store: TableStore, url: str) -> None:
    count = ops_module.RENEW_CHUNK + 100
    requests = [request(f"k{i}") for i in range(count)]
    for req in requests:
        assert store.acquire(req).acquired
    expired = {3, 250, 499, 500, 501, count - 1}
    released = {5, 498, 502, 560}
    foreign = {0, 13, 507, 590}
    for i in expired:
        expire(store, url, f"k{i}")
    for i in released:
        assert store.release(f"k{i}", requests[i].token) is ReleaseResult.RELEASED
    items = [
        RenewItem(f"k{i}", secrets.token_hex(16) if i in foreign else req.token, 30.0) for i, req in enumerate(requests)
    ]
    statuses = list(store.renew(items))
    assert statuses == [i not in expired | released | foreign for i in range(count)]


# -- 10. the sweep of long-expired rows -------------------------------------------------------------


def count_rows(url: str, name: str) -> int:
    if url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            return int(conn.execute("SELECT count(*) FROM lockaspect_holds WHERE name = ?", (name,)).fetchone()[0])
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url.replace("postgresql+table://", "postgresql://", 1)) as conn:
        return int(conn.execute("SELECT count(*) FROM lockaspect_holds WHERE name = %s", (name,)).fetchone()[0])


def test_a_later_renewal_sweeps_rows_of_holds_expired_long_ago(
    store: TableStore, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = request("dead")
    recent = request("recent", lease=0.001)  # expired at once, but not long ago
    live = request("live")
    for req in (dead, recent, live):
        assert store.acquire(req).acquired
    expire(store, url, "dead")  # expired an hour ago: a crashed holder's row
    monkeypatch.setattr(store_module, "SWEEP_GRACE", 600.0)
    monkeypatch.setattr(store_module, "SWEEP_EVERY", 3600.0)
    assert list(store.renew([RenewItem("live", live.token, 30.0)])) == [True]
    assert count_rows(url, store.namespace + "dead") == 1  # not yet time to sweep
    monkeypatch.setattr(store_module, "SWEEP_EVERY", 0.0)
    assert list(store.renew([RenewItem("live", live.token, 30.0)])) == [True]
    assert count_rows(url, store.namespace + "dead") == 0
    assert count_rows(url, store.namespace + "recent") == 1  # expired, but within the grace
    assert count_rows(url, store.namespace + "live") == 1


# -- 6. same-process wake-ups ------------------------------------------------------------------


def test_a_release_wakes_a_waiting_thread_of_the_same_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    holder_store = open_store(url, namespace="w:")
    waiter_store = open_store(url, namespace="w:")  # another store on the same file: one hub
    assert isinstance(holder_store, TableStore)
    assert isinstance(waiter_store, TableStore)
    try:
        assert waiter_store.capabilities & Capability.LOCAL_NOTIFY
        assert not waiter_store.capabilities & Capability.RELEASE_NOTIFY
        held = request("k")
        assert holder_store.acquire(held).acquired
        notifier = waiter_store.notifier()
        assert notifier is not None
        subscription = notifier.subscribe("k", 60.0)
        other = notifier.subscribe("other", 60.0)
        subscribed = threading.Event()
        woken: list[bool] = []

        def wait() -> None:
            subscribed.set()
            woken.append(subscription.wait(60.0))

        thread = threading.Thread(target=wait)
        thread.start()
        subscribed.wait()
        assert not subscription.active
        assert not other.active
        assert holder_store.release("k", held.token) is ReleaseResult.RELEASED
        thread.join(timeout=60)
        assert woken == [True]
        assert not subscription.active
        assert other.wait(0.0) is False  # a release of another key wakes nobody here
        assert waiter_store.acquire(request("k")).acquired
        notifier.unsubscribe(subscription)
        notifier.unsubscribe(other)
    finally:
        holder_store.close()
        waiter_store.close()


def test_a_waiting_thread_takes_the_lock_when_the_holder_thread_releases(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    # a long watchdog lease: the waiter's poll would come late; the release wakes it
    with LockClient.from_url(url, watchdog_lease=30.0) as client:
        holding = threading.Event()
        release = threading.Event()
        order: list[str] = []

        def hold() -> None:
            with client.lock("k"):
                holding.set()
                release.wait(60)
                order.append("released")

        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait(60)
        waiter_done: list[int] = []

        def wait() -> None:
            with client.lock("k", wait=60) as lease:
                order.append("acquired")
                waiter_done.append(lease.fencing_token)

        waiter = threading.Thread(target=wait)
        waiter.start()
        release.set()
        holder.join(60)
        waiter.join(60)
        assert order == ["released", "acquired"]
        assert len(waiter_done) == 1


@pytest.mark.parametrize("prepared", ["true", "false"])
def test_prepared_statements_option(postgres_server: PostgresServer, namespace: str, prepared: str) -> None:
    """``prepared_statements`` (off by default, for PgBouncer) changes how statements are sent,
    never what they do: a cycle, a busy attempt and a renewal behave the same either way."""
    url = postgres_server.url.replace("postgresql://", "postgresql+table://", 1) + f"?prepared_statements={prepared}"
    client = LockClient.from_url(url, namespace=namespace)
    other = LockClient.from_url(url, namespace=namespace)
    try:
        for _ in range(8):  # past psycopg's automatic-prepare threshold
            with client.lock("k") as lease:
                with pytest.raises(LockNotAcquired), other.lock("k"):
                    pass
                assert not lease.lost
    finally:
        client.close()
        other.close()


def test_prepared_statements_bad_value(postgres_server: PostgresServer) -> None:
    url = postgres_server.url.replace("postgresql://", "postgresql+table://", 1) + "?prepared_statements=maybe"
    with pytest.raises(ConfigurationError, match="prepared_statements must be true or false"):
        LockClient.from_url(url)
