"""The ``zookeeper://`` store on a real ZooKeeper server (the session's, from the
``zookeeper_server`` fixture): what the contract suite cannot show. URLs refused before any
I/O; the tree it writes (contender nodes, container parents reaped after 10,000 keys);
processes excluding each other on an exact counter kept in a znode; fencing tokens across
processes; an operator's force release; cancelled and timed-out waiters leaving no node;
waiters woken one at a time (no herd). Faults (server paused, killed, sessions expired,
processes killed) are in ``test_faults.py``.

No sleeps as synchronisation: events, process pipes and the server's own tree order the
steps; a deadline only bounds a hang (:func:`until` polls a condition only the server can
tell).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import BackendError, ConfigurationError, LockClient, LockLost, LockNotAcquired
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, ReleaseResult
from lockaspect.backends.zookeeper import ZooKeeperStore, open_zookeeper_store
from lockaspect.testing import ZooKeeperServer
from lockaspect.testing import zookeeper as zookeeper_module

from ._support import BOUND, contenders, parent_of, until, waiting, watches_by_session

kazoo_client = pytest.importorskip("kazoo.client")
KazooClient = kazoo_client.KazooClient

WORKTREE = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def zk(zookeeper_server: ZooKeeperServer) -> ZooKeeperServer:
    return zookeeper_server


@pytest.fixture
def namespace() -> str:
    return f"zk-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def make(zk: ZooKeeperServer, namespace: str) -> Iterator[Callable[..., LockClient]]:
    """``make(query="", **options)``: a LockClient on the session server in the test's
    namespace (``query``: the URL's ``?...``), closed after the test."""
    made: list[LockClient] = []

    def make(query: str = "", **options: Any) -> LockClient:
        options.setdefault("namespace", namespace)
        options.setdefault("tick", 0.05)
        client = LockClient.from_url(zk.url + query, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def raw(zk: ZooKeeperServer) -> Iterator[Any]:
    """A plain kazoo client on the session server, for looking at the tree."""
    client = KazooClient(hosts=zk.hosts)
    client.start(timeout=BOUND)
    yield client
    client.stop()
    client.close()


def sessions(server: ZooKeeperServer) -> int:
    """How many client sessions the server has open (its ``cons`` list)."""
    return server.four_letter("cons").count("sid=")


def session_id(client: LockClient) -> int:
    store = client.backend
    assert isinstance(store, ZooKeeperStore)
    kazoo = store._session._client
    assert kazoo is not None
    assert kazoo.client_id is not None
    return int(kazoo.client_id[0])


# -- 1. bad URLs and options: refused at creation, nothing sent ------------------------------------

BAD_URLS = [
    ("zookeeper://", "no host"),
    ("zookeeper:///chroot", "no host"),
    ("zookeeper://alice:s3cret@/chroot", "no host"),
    ("zookeeper://{host}:abc", "bad port"),
    ("zookeeper://{host}:0", "bad port"),
    ("zookeeper://{host}:70000", "bad port"),
    ("zookeeper://alice:s3cret@{host}:70000", "bad port"),
    ("zookeeper://{hosts},", "bad host"),
    ("zookeeper://{hosts}?bogus=1", "unknown option 'bogus'"),
    ("zookeeper://alice:s3cret@{hosts}?bogus=1", "unknown option 'bogus'"),
    ("zookeeper://{hosts}?session_timeout=abc", "session_timeout"),
    ("zookeeper://{hosts}?session_timeout=0", "session_timeout"),
    ("zookeeper://{hosts}?session_timeout=-1", "session_timeout"),
    ("zookeeper://{hosts}?session_timeout=nan", "session_timeout"),
    ("zookeeper://{hosts}?session_timeout=inf", "session_timeout"),
    ("zookeeper://{hosts}?connect_timeout=", "connect_timeout"),
    ("zookeeper://{hosts}?request_timeout=0", "request_timeout"),
    ("zookeeper://{hosts}?owner_info=maybe", "owner_info"),
    ("zookeeper://alice@{hosts}", "user:password"),
    ("zookeeper://:s3cret@{hosts}", "user:password"),
    ("zookeeper://{hosts}#fragment", "fragment"),
    ("zookeeper://alice:s3cret@{hosts}#fragment", "fragment"),
    ("zookeeper://{hosts}/a/../b", "chroot"),
    ("zookeeper://alice:s3cret@{hosts}/a/./b", "chroot"),
    ("zookeeper://{hosts}/a//b", "chroot"),
]


@pytest.mark.parametrize(("template", "message"), BAD_URLS)
def test_bad_urls_are_refused_at_creation_with_nothing_sent(
    zk: ZooKeeperServer, raw: Any, template: str, message: str
) -> None:
    """ConfigurationError from ``LockClient.from_url`` and ``open_store`` alike, naming the
    problem, the password redacted; no session was opened and no node written."""
    url = template.format(host="127.0.0.1", hosts=zk.hosts)
    chroots = set(raw.get_children("/"))
    before = sessions(zk)
    for opener in (LockClient.from_url, open_store, open_zookeeper_store):
        with pytest.raises(ConfigurationError) as info:
            opener(url)
        text = str(info.value)
        assert message in text
        assert "s3cret" not in text
        assert ("alice:***@" in text) == ("alice:" in url)
    assert sessions(zk) == before
    assert set(raw.get_children("/")) == chroots


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bogus": 1}, "unknown option 'bogus'"),
        ({"session_timeout": True}, "session_timeout"),
        ({"session_timeout": "soon"}, "session_timeout"),
        ({"request_timeout": -2}, "request_timeout"),
        ({"connect_timeout": float("inf")}, "connect_timeout"),
        ({"owner_info": "perhaps"}, "owner_info"),
    ],
)
def test_bad_keyword_options_are_refused_like_the_query_string(
    zk: ZooKeeperServer, options: dict[str, Any], message: str
) -> None:
    before = sessions(zk)
    # owner_info is also the client's own option (a bool), checked before the store opens
    refused = TypeError if "owner_info" in options else ConfigurationError
    with pytest.raises(refused, match=message):
        LockClient.from_url("zookeeper://alice:s3cret@" + zk.hosts, **options)
    with pytest.raises(ConfigurationError, match=message) as info:
        open_store(zk.url, **options)
    assert "s3cret" not in str(info.value)
    assert sessions(zk) == before


@pytest.mark.parametrize("url", [b"zookeeper://127.0.0.1:2181", None, 2181, Path("zookeeper://h")])
def test_a_url_that_is_not_a_str_is_a_type_error(url: Any) -> None:
    with pytest.raises(TypeError):
        LockClient.from_url(url)
    with pytest.raises(TypeError):
        open_zookeeper_store(url)


def test_wait_replicas_is_refused_before_any_io(zk: ZooKeeperServer) -> None:
    before = sessions(zk)
    with pytest.raises(ConfigurationError, match="quorum"):
        open_zookeeper_store(zk.url).wait_for_replicas(1, 1.0)
    with pytest.raises(ConfigurationError, match="replicas"):
        LockClient.from_url(zk.url, wait_replicas=(1, 1.0))
    assert sessions(zk) == before


def test_a_good_url_connects_only_on_first_use(zk: ZooKeeperServer, raw: Any) -> None:
    """Opening is free; the first lock starts the session (with the URL's timeout) and makes the
    chroot and the namespace's node."""
    chroot = f"/lazy-{uuid.uuid4().hex[:8]}"
    before = sessions(zk)
    with LockClient.from_url(zk.url + chroot + "?session_timeout=7&owner_info=false", namespace="ns:") as client:
        assert sessions(zk) == before
        assert raw.exists(chroot) is None
        with client.lock("k") as lease:
            assert sessions(zk) == before + 1
            assert "to=7000" in zk.four_letter("cons")
            (name,) = raw.get_children(f"{chroot}/ns/ns:k")
            data, stat = raw.get(f"{chroot}/ns/ns:k/{name}")
            assert data == b""  # owner_info=false
            assert stat.ephemeralOwner == session_id(client)
            assert lease.fencing_token == stat.czxid
    assert sessions(zk) == before


def kazoo_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if "zk_loop" in t.name or "_thread_worker" in t.name}


def test_an_unreachable_server_is_a_transient_error_and_a_later_server_is_used(
    zookeeper_classpath: str, namespace: str
) -> None:
    """Nothing listens on the URL's port: the first lock fails as a transient BackendError
    after connect_timeout, leaving no kazoo thread behind; once a server listens there, the
    same client takes locks; closed, it leaves no kazoo thread."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    before = kazoo_threads()
    with LockClient.from_url(f"zookeeper://127.0.0.1:{port}?connect_timeout=0.5", namespace=namespace) as client:
        with pytest.raises(BackendError) as info, client.lock("k"):
            pass
        assert info.value.transient
        assert "no connection" in str(info.value)
        assert kazoo_threads() == before
        server = ZooKeeperServer(zookeeper_classpath)
        server.port = port
        with server, client.lock("k") as lease:
            assert lease.fencing_token > 0
            assert kazoo_threads() - before
    until(lambda: kazoo_threads() == before, "the kazoo threads to end")


@pytest.mark.parametrize("chroot", ["/a/%2E%2E/b", "/a/%2e/b", "/a/%2Fb", "/a%00b"])
def test_an_escaped_bad_chroot_is_refused_at_creation(zk: ZooKeeperServer, chroot: str) -> None:
    with pytest.raises(ConfigurationError, match="chroot"):
        LockClient.from_url(zk.url + chroot).close()


def test_a_port_of_unicode_digits_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="bad port"):
        open_zookeeper_store("zookeeper://127.0.0.1:²")


@pytest.mark.parametrize("password", ["s3/cret", "s3?cret"])
def test_a_password_with_a_slash_is_never_shown(password: str) -> None:
    """Whatever the parser makes of a password with an unescaped '/' or '?', an error about
    another part of the URL (the port) shows no part of it."""
    with pytest.raises(ConfigurationError) as info:
        open_zookeeper_store(f"zookeeper://alice:{password}@127.0.0.1:70000")
    assert "s3" not in str(info.value)
    assert "cret" not in str(info.value)


# -- the tree the store writes ------------------------------------------------------------------


def test_a_hold_is_one_ephemeral_sequential_node_with_owner_data(
    make: Callable[..., LockClient], raw: Any, namespace: str
) -> None:
    client = make()
    with client.lock("order:1", lease=12.5) as lease:
        (name,) = contenders(raw, namespace, "order:1")
        assert name.startswith("_c_")
        assert "-lock-" in name
        data, stat = raw.get(f"{parent_of(namespace, 'order:1')}/{name}")
        owner = json.loads(data)
        assert owner["pid"] == os.getpid()
        assert owner["kind"] == "lock"
        assert owner["lease"] == 12.5
        assert owner["thread"] == threading.current_thread().name
        assert stat.ephemeralOwner == session_id(client)
        assert lease.fencing_token == stat.czxid
    assert contenders(raw, namespace, "order:1") == []


def test_node_names_of_each_kind(make: Callable[..., LockClient], raw: Any, namespace: str) -> None:
    client = make()
    infixes = {}
    with client.rw_lock("rw").read():
        infixes["read"] = contenders(raw, namespace, "rw")
    with client.rw_lock("rw").write():
        infixes["write"] = contenders(raw, namespace, "rw")
    with client.semaphore("sem", permits=3):
        infixes["sem"] = contenders(raw, namespace, "sem")
    with client.fair_lock("fair"):
        infixes["fair"] = contenders(raw, namespace, "fair")
    with client.multi_lock(["m1", "m2"]):
        infixes["multi"] = contenders(raw, namespace, "m1") + contenders(raw, namespace, "m2")
    assert [name.split("-")[1] for name in infixes["read"]] == ["read"]
    assert [name.split("-")[1] for name in infixes["write"]] == ["write"]
    assert [name.split("-")[1] for name in infixes["sem"]] == ["sem.3"]
    assert [name.split("-")[1] for name in infixes["fair"]] == ["lock"]
    assert [name.split("-")[1] for name in infixes["multi"]] == ["lock", "lock"]


def test_parents_are_containers_reaped_after_their_last_child(
    make: Callable[..., LockClient], raw: Any, namespace: str
) -> None:
    """The key's node goes away by itself once its last contender left (the server's
    container reaper, every 200 ms on the test server); the namespace's node stays; a lock
    taken again afterwards makes the parent again."""
    client = make()
    for _ in range(2):
        with client.lock("reaped"):
            assert raw.exists(parent_of(namespace, "reaped")) is not None
        until(lambda: raw.exists(parent_of(namespace, "reaped")) is None, "the container to be reaped")
        assert raw.exists(f"/{namespace.rstrip(':')}") is not None


@pytest.fixture
def fast_reaper(zookeeper_classpath: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ZooKeeperServer]:
    """A server of its own whose container reaper is not rate limited (ZooKeeper's default,
    ``znode.container.maxPerMinute=10000``, needs a minute for 10,000 keys)."""
    options = (*zookeeper_module.JVM_OPTIONS, "-Dznode.container.maxPerMinute=100000000")
    monkeypatch.setattr(zookeeper_module, "JVM_OPTIONS", options)
    with ZooKeeperServer(zookeeper_classpath) as server:
        yield server


@pytest.mark.slow
def test_thousands_of_keys_leave_no_node_behind(fast_reaper: ZooKeeperServer) -> None:
    """3,000 distinct keys locked and released (through the store, the fast path): once the
    reaper ran, the namespace's node has no child left; nothing of this session is left."""
    count = 3_000
    store = open_zookeeper_store(fast_reaper.url + "/many", namespace="many:")
    raw = KazooClient(hosts=fast_reaper.hosts)
    raw.start(timeout=BOUND)
    try:
        for i in range(count):
            token = uuid.uuid4().hex
            assert store.acquire(AcquireRequest("lock", (f"key-{i}",), token, 30.0)).acquired
            assert store.release(f"key-{i}", token) == ReleaseResult.RELEASED
        assert store._session.book.nodes() == []
        until(lambda: raw.get_children("/many/many") == [], "every container to be reaped")
        assert "/many/" not in fast_reaper.four_letter("dump")  # no ephemeral left (dump lists them)
    finally:
        store.close()
        raw.stop()
        raw.close()


# -- 2. processes: mutual exclusion on an exact counter, fencing across processes -------------------

COUNTER_WORKER = """
import json, sys
from kazoo.client import KazooClient
from lockaspect import LockClient

url, hosts, namespace, path, rounds, mode = sys.argv[1:7]
zk = KazooClient(hosts=hosts)
zk.start(timeout=30)
seen = []
with LockClient.from_url(url, namespace=namespace, tick=0.05) as client:
    rw = client.rw_lock("counter")
    for _ in range(int(rounds)):
        if mode == "read":
            with rw.read(wait=120):
                first = zk.get(path)[0]
                zk.sync(path)
                if zk.get(path)[0] != first:  # a writer got in while we read
                    sys.exit("a writer changed the counter under a read lock")
            continue
        if mode == "lock":
            block = client.lock("counter", wait=120)
        elif mode == "fair":
            block = client.fair_lock("counter", wait=120)
        else:
            block = rw.write(wait=120)
        with block as lease:
            value = int(zk.get(path)[0])  # read, then write: not atomic without the lock
            zk.set(path, str(value + 1).encode())
            seen.append((value, lease.fencing_token))
zk.stop()
print(json.dumps(seen))
"""


def run_workers(zk: ZooKeeperServer, namespace: str, path: str, modes: list[str], rounds: int) -> list[Any]:
    env = {**os.environ, "PYTHONPATH": WORKTREE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", COUNTER_WORKER, zk.url + "/procs", zk.hosts, namespace, path, str(rounds), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for mode in modes
    ]
    failures, seen = [], []
    for process in processes:
        out, err = process.communicate(timeout=120)
        if process.returncode:
            failures.append(err.decode()[-2000:])
        else:
            seen.extend(tuple(pair) for pair in json.loads(out))
    assert failures == []
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "modes",
    [["lock"] * 4, ["fair"] * 4, ["write", "write", "read", "read"]],
    ids=["lock", "fair_lock", "rw_lock"],
)
def test_processes_keep_an_exact_counter_in_a_znode(
    zk: ZooKeeperServer, raw: Any, namespace: str, modes: list[str]
) -> None:
    """4 processes (4 sessions) increment a counter kept in a znode, reading then writing it
    under the lock: the final value is exact; and sorted by the value each increment read
    (the order the lock was held in), the fencing tokens strictly increase across processes."""
    rounds = 25
    path = f"/counters/{uuid.uuid4().hex}"
    raw.create(path, b"0", makepath=True)
    seen = run_workers(zk, namespace, path, modes, rounds)
    writers = sum(1 for mode in modes if mode != "read")
    assert int(raw.get(path)[0]) == writers * rounds
    assert sorted(value for value, _ in seen) == list(range(writers * rounds))
    tokens = [token for _, token in sorted(seen)]
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    until(lambda: contenders(raw, namespace, "counter") == [], "the last contender to go")


# -- 9. an operator's force release -----------------------------------------------------------


def test_force_release_by_another_client_loses_the_hold_at_once(
    zk: ZooKeeperServer, make: Callable[..., LockClient], raw: Any, namespace: str
) -> None:
    """``force_release`` from an operator's client deletes the holder's node: the holder is told
    by the watch on its node (reason 'not-owner', ``on_lost`` called, LockLost at the block's
    end), without waiting for a renewal (the watchdog lease is 60 s); the waiter gets the lock
    with a larger fencing token."""
    holder, waiter, operator = make(watchdog_lease=60.0), make(), make()
    told = threading.Event()
    reasons: list[str | None] = []
    taken: list[int] = []
    queued = threading.Event()

    def wait_for_it() -> None:
        queued.wait(BOUND)
        with waiter.lock("k", wait=BOUND) as lease:
            taken.append(lease.fencing_token)

    thread = threading.Thread(target=wait_for_it, daemon=True)
    thread.start()

    def hold() -> None:
        with holder.lock("k", on_lost=lambda lease: (reasons.append(lease.lost_reason), told.set())) as lease:
            queued.set()
            until(lambda: len(waiting(zk, raw, namespace, "k")) == 1, "the waiter to queue")
            assert operator.backend.force_release("k") is True
            assert told.wait(BOUND)
            assert lease.lost
            assert lease.lost_reason == "not-owner"
            thread.join(BOUND)
            assert taken
            assert taken[0] > lease.fencing_token

    with pytest.raises(LockLost) as info:
        hold()
    assert info.value.exception is None, info.value.exception
    assert info.value.reason == "not-owner"
    assert reasons == ["not-owner"]
    assert operator.backend.force_release("k") is False  # nothing held any more
    until(lambda: contenders(raw, namespace, "k") == [], "no contender left")


def test_force_release_of_a_fixed_lease(make: Callable[..., LockClient], raw: Any, namespace: str) -> None:
    """A fixed lease (60 s) is never renewed: only the watch on its node can tell its holder of
    a force release, long before the lease would end."""
    holder, operator = make(), make()
    leases = []

    def hold() -> None:
        with holder.lock("fixed", lease=60) as lease:
            leases.append(lease)
            assert operator.backend.force_release("fixed")
            until(lambda: lease.lost, "the fixed lease to be lost")

    with pytest.raises(LockLost, match="not-owner") as info:
        hold()
    assert info.value.exception is None, info.value.exception
    with operator.lock("fixed") as again:
        assert again.fencing_token > leases[0].fencing_token


# -- 10. cancelled and timed-out waiters leave nothing ------------------------------------------


def test_a_waiter_that_times_out_leaves_no_node(make: Callable[..., LockClient], raw: Any, namespace: str) -> None:
    holder, waiter = make(), make()
    with holder.lock("k"):
        (held,) = contenders(raw, namespace, "k")
        for wait in (0, 0.2):
            with pytest.raises(LockNotAcquired), waiter.lock("k", wait=wait):
                pass
            until(lambda: contenders(raw, namespace, "k") == [held], "the waiter's node to go")
        assert waiter.backend._session.book.nodes() == []


def test_a_try_that_finds_a_key_busy_keeps_no_node_once_it_answers(
    make: Callable[..., LockClient], raw: Any, namespace: str
) -> None:
    """A try (``wait=0``) deletes its nodes before it answers busy, not in the background:
    another session looking right after finds none (a multi-key try's node on a free key
    would be its holder; a single key's, a place ahead of the next contender)."""
    holder, trier = make(), make()
    with holder.lock("m:b"):
        (held,) = contenders(raw, namespace, "m:b")
        for _ in range(20):
            with pytest.raises(LockNotAcquired), trier.multi_lock(["m:a", "m:b"], wait=0):
                pass
            assert contenders(raw, namespace, "m:a") == []
            assert contenders(raw, namespace, "m:b") == [held]
            with pytest.raises(LockNotAcquired), trier.lock("m:b", wait=0):
                pass
            assert contenders(raw, namespace, "m:b") == [held]
    assert trier.backend._session.book.nodes() == []


def test_timed_out_waiters_do_not_pile_up_watch_callbacks(
    make: Callable[..., LockClient], raw: Any, namespace: str
) -> None:
    """40 waits that time out on a key held all along leave the waiting client's kazoo with a
    bounded number of callbacks on the holder's node (the server keeps one watch per session
    and path anyway)."""
    holder, waiter = make(), make()
    with holder.lock("k"):
        (held,) = contenders(raw, namespace, "k")
        for _ in range(40):
            with pytest.raises(LockNotAcquired), waiter.lock("k", wait=0.01):
                pass
        callbacks = waiter.backend._session._client._data_watchers[f"{parent_of(namespace, 'k')}/{held}"]
        assert len(callbacks) <= 2


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4, 6, 10, "queued"])
def test_a_cancelled_async_waiter_leaves_no_node(
    zk: ZooKeeperServer, make: Callable[..., LockClient], raw: Any, namespace: str, steps: int | str
) -> None:
    """A task waiting for a busy lock is cancelled at one of its await points (after
    ``steps`` turns of the loop, or once its node is queued): its contender node is deleted,
    and the lock is free once the holder leaves."""
    holder, waiter = make(), make()

    async def main() -> None:
        async def wait_for_it() -> None:
            async with waiter.lock("k", wait=BOUND):
                raise AssertionError("the lock is held by the holder")

        with holder.lock("k"):
            (held,) = contenders(raw, namespace, "k")
            task = asyncio.create_task(wait_for_it())
            if steps == "queued":
                await asyncio.to_thread(until, lambda: waiting(zk, raw, namespace, "k"), "the waiter to queue")
            else:
                for _ in range(int(steps)):
                    await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(until, lambda: contenders(raw, namespace, "k") == [held], "the waiter's node to go")
        async with waiter.lock("k") as lease:
            assert lease.fencing_token > 0

    asyncio.run(asyncio.wait_for(main(), BOUND * 2))
    assert waiter.backend._session.book.nodes() == []
    until(lambda: contenders(raw, namespace, "k") == [], "no contender left")


# -- 11. no herd: a release wakes only the next waiter -------------------------------------------


def test_each_waiter_watches_only_its_predecessor_and_is_woken_once(
    zk: ZooKeeperServer, make: Callable[..., LockClient], raw: Any, namespace: str
) -> None:
    """5 waiters (5 sessions) queue behind a holder: each has one watch, on the node just ahead
    of it (none on the key's list of children); releases hand the lock down the queue in
    order, each waiter making exactly one more attempt after it queued (woken once: no herd)."""
    holder = make()
    waiters = [make() for _ in range(5)]
    attempts = [0] * len(waiters)
    order: list[int] = []

    for i, client in enumerate(waiters):
        store = client.backend
        acquire = store.acquire

        def counted(request: AcquireRequest, i: int = i, acquire: Any = acquire) -> Any:
            attempts[i] += 1
            return acquire(request)

        store.acquire = counted  # type: ignore[method-assign]

    def wait_for_it(i: int) -> None:
        with waiters[i].lock("k", wait=BOUND):
            order.append(i)

    threads = []
    with holder.lock("k"):
        for i in range(len(waiters)):
            thread = threading.Thread(target=wait_for_it, args=(i,), daemon=True)
            thread.start()
            threads.append(thread)
            until(lambda i=i: len(waiting(zk, raw, namespace, "k")) == i + 1, f"waiter {i} to queue")
        queue = contenders(raw, namespace, "k")
        parent = parent_of(namespace, "k")
        expected = {session_id(client): [f"{parent}/{queue[i]}"] for i, client in enumerate(waiters)}

        def watching() -> dict[int, list[str]]:
            return {sid: paths for sid, paths in watches_by_session(zk).items() if sid in expected}

        # each waiter's last attempt ends with its watch set: wait for the five to be set
        until(lambda: len(watching()) == len(expected), "every waiter to watch")
        watches = watches_by_session(zk)
        assert watching() == expected
        # the holder watches its own node at most (to hear of a force release)
        assert set(watches.get(session_id(holder), [])) <= {f"{parent}/{queue[0]}"}
        assert all(parent not in paths for paths in watches.values())
        queued = list(attempts)
    for thread in threads:
        thread.join(BOUND)
    assert order == list(range(len(waiters)))
    assert [after - before for after, before in zip(attempts, queued, strict=True)] == [1] * len(waiters)


# -- a forked child -----------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_session_of_its_own(make: Callable[..., LockClient]) -> None:
    """A child forked while its parent holds a lock locks on a new session of its own: it
    gets other keys, is kept out of the parent's, and the parent's lock is untouched."""
    client = make()
    with client.lock("parent") as held:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            outcome = "?"
            try:
                with client.lock("child", wait=BOUND) as mine:
                    outcome = f"child:{mine.fencing_token > 0}"
                try:
                    with client.lock("parent", wait=0.3):
                        outcome += ",parent:taken"
                except LockNotAcquired:
                    outcome += ",parent:refused"
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                outcome = repr(exc)
            os.write(write, outcome.encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as pipe:
            outcome = pipe.read().decode()
        assert os.waitstatus_to_exitcode(status) == 0
        assert outcome == "child:True,parent:refused"
        assert not held.lost


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_waiter_whose_watch_never_fires_rechecks_within_the_armed_trust(
    zk: ZooKeeperServer, namespace: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A queued waiter's attempts skip the round trip while its watch is armed; if that watch
    can no longer fire (here: its function taken off kazoo's watcher sets behind the hub's
    back, as a lost registration would), the armed shortcut must not answer "busy" for the
    rest of the wait: past ``ARMED_TRUST`` the attempt re-reads the queue and gets in."""
    from lockaspect.backends.zookeeper import _notify

    monkeypatch.setattr(_notify, "ARMED_TRUST", 0.3, raising=False)
    store = open_zookeeper_store(zk.url, namespace=namespace)
    try:
        permits = 1 if kind == "semaphore" else None
        holder = AcquireRequest(kind, ("k",), "holder", 30.0, None, False, "", permits)
        assert store.acquire(holder).acquired
        waiter = store.waiter_id(True)
        request = AcquireRequest(kind, ("k",), "waiter", 30.0, waiter, False, "", permits)
        assert not store.acquire(request).acquired  # queued, its watch set and armed
        session: Any = store._session
        channel = (namespace + "k", waiter)
        assert session.hub.is_armed(channel)
        watch = session.hub.wakers[channel]
        client = session._client
        for watchers in (client._data_watchers, client._child_watchers):
            for found in watchers.values():
                found.discard(watch)  # the watch is lost: nothing will disarm the channel
        assert store.release("k", "holder", kind) is ReleaseResult.RELEASED
        deadline = time.monotonic() + 5.0  # many times ARMED_TRUST; before the fix: forever
        while not store.acquire(request).acquired:
            assert time.monotonic() < deadline, "the armed shortcut kept answering busy"
            time.sleep(0.05)
        assert store.release("k", "waiter", kind) is ReleaseResult.RELEASED
    finally:
        store.close()
