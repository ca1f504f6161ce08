"""The ZooKeeper store's operator protocol on a real server (the session's ZooKeeper): owner
records kept in the hold's node and given back by ``describe`` for every kind, sync and async;
semaphore holds of several permits (all or none, in use counted in permits, a release letting
as many waiters in, across processes); ``add_permits`` in one versioned step; ``force_release``
of holders and waiters; nodes written by the previous version.

Store-level calls throughout (``AcquireRequest`` in, ``KeyState`` out): what the client builds
on. No sleeps as synchronisation: a waiter's subscription tells of its wake-up, and
:func:`until` bounds what only the server can tell.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import ConfigurationError
from lockaspect.backends.base import (
    AcquireRequest,
    AddsPermits,
    AdminStore,
    AsyncAdminStore,
    HolderState,
    KeyState,
    ReleaseResult,
    RenewItem,
)
from lockaspect.backends.zookeeper import ZooKeeperStore, _admin, open_zookeeper_store
from lockaspect.backends.zookeeper._layout import decide, holders, infix_of, ordered
from lockaspect.backends.zookeeper._record import encode, read
from lockaspect.owner import owner_record, parse_owner
from lockaspect.testing import ZooKeeperServer

from ._support import BOUND, contenders, parent_of, until

kazoo_client = pytest.importorskip("kazoo.client")

WORKTREE = str(Path(__file__).resolve().parents[2])
LEASE = 30.0


@pytest.fixture
def namespace() -> str:
    return f"zo-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def stores(zookeeper_server: ZooKeeperServer, namespace: str) -> Iterator[list[ZooKeeperStore]]:
    """Stores (each its own session) on the session server in the test's namespace: append
    with :func:`new_store`; closed after the test."""
    made: list[ZooKeeperStore] = []
    yield made
    for store in made:
        store.close()


def new_store(zk: ZooKeeperServer, namespace: str, made: list[ZooKeeperStore], query: str = "") -> ZooKeeperStore:
    store = open_zookeeper_store(zk.url + query, namespace=namespace)
    made.append(store)
    return store


@pytest.fixture
def store(zookeeper_server: ZooKeeperServer, namespace: str, stores: list[ZooKeeperStore]) -> ZooKeeperStore:
    return new_store(zookeeper_server, namespace, stores)


@pytest.fixture
def raw(zookeeper_server: ZooKeeperServer) -> Iterator[Any]:
    client = kazoo_client.KazooClient(hosts=zookeeper_server.hosts)
    client.start(timeout=BOUND)
    yield client
    client.stop()
    client.close()


def token() -> str:
    return os.urandom(16).hex()


def record(who: str) -> str:
    """An owner record as the client makes it, told apart by its thread name."""
    return owner_record("k", thread=who)


def req(
    kind: str, key: str, tok: str, owner: str = "", *, permits: int = 4, weight: int = 1, waiter: str | None = None
) -> AcquireRequest:
    """A request of ``kind`` (``permits`` and ``weight``: a semaphore's)."""
    sem = kind == "semaphore"
    return AcquireRequest(kind, (key,), tok, LEASE, waiter, False, "", permits if sem else None, owner, weight)


def one(states: list[KeyState]) -> KeyState:
    assert len(states) == 1, states
    return states[0]


# -- owner records, every kind ----------------------------------------------------------------


def test_the_stores_have_the_admin_parts(store: ZooKeeperStore) -> None:
    assert isinstance(store, AdminStore)
    assert isinstance(store, AddsPermits)
    twin = store.asyncio_twin()
    assert isinstance(twin, AsyncAdminStore)
    assert isinstance(twin, AddsPermits)


@pytest.mark.parametrize("kind", ["lock", "fair", "write"])
def test_the_one_holder_of_an_exclusive_kind_is_described_with_its_owner_record(
    store: ZooKeeperStore, kind: str
) -> None:
    mine, owner = token(), record("exclusive")
    taken = store.acquire(req(kind, "k", mine, owner))
    assert taken.acquired
    assert store.acquire(req(kind, "k", mine, record("retried"))).acquired  # the same token: the first record
    waiter = store.waiter_id(True)
    assert not store.acquire(req(kind, "k", token(), record("waiting"), waiter=waiter)).acquired
    state = one(store.describe("k"))
    assert (state.key, state.kind, state.holders, state.waiters) == ("k", kind, 1, 1)
    assert state.fencing_token == taken.fencing_token
    assert state.held_by == (HolderState(mine, owner, None, taken.fencing_token, 1),)
    assert parse_owner(state.held_by[0].owner)["thread"] == "exclusive"
    assert store.release("k", mine, kind) is ReleaseResult.RELEASED


def test_every_reader_is_described_with_its_owner_record(store: ZooKeeperStore, stores: list[Any]) -> None:
    other = new_store_like(store, stores)
    readers = [(token(), record(f"reader-{i}")) for i in range(3)]
    fences = {}
    for i, (tok, owner) in enumerate(readers):
        by = store if i % 2 == 0 else other  # two sessions
        fences[tok] = by.acquire(req("read", "rw", tok, owner)).fencing_token
    state = one(other.describe("rw"))
    assert (state.kind, state.holders, state.waiters, state.fencing_token) == ("read", 3, 0, max(fences.values()))
    assert sorted(state.held_by) == sorted(HolderState(tok, owner, None, fences[tok], 1) for tok, owner in readers)


def test_every_semaphore_holder_is_described_with_its_weight(store: ZooKeeperStore) -> None:
    holds = [(token(), record(f"sem-{weight}"), weight) for weight in (1, 2, 1)]
    fences = {}
    for tok, owner, weight in holds:
        fences[tok] = store.acquire(req("semaphore", "sem", tok, owner, permits=5, weight=weight)).fencing_token
    state = one(store.describe("sem"))
    assert (state.kind, state.holders, state.permits, state.waiters) == ("semaphore", 3, 5, 0)
    assert list(state.held_by) == [HolderState(tok, owner, None, fences[tok], w) for tok, owner, w in holds]
    assert store.permits("sem") == (5, 4)


def test_a_hold_without_an_owner_record(
    zookeeper_server: ZooKeeperServer, namespace: str, stores: list[ZooKeeperStore], raw: Any
) -> None:
    """The client's ``owner_info=False`` sends ``""``: the token is still described. The URL's
    ``owner_info=false`` writes nothing into the node: token and owner read as ``""``."""
    plain = new_store(zookeeper_server, namespace, stores)
    mine = token()
    fence = plain.acquire(req("lock", "a", mine)).fencing_token
    assert one(plain.describe("a")).held_by == (HolderState(mine, "", None, fence, 1),)
    bare = new_store(zookeeper_server, namespace, stores, "?owner_info=false")
    fence = bare.acquire(req("lock", "b", token(), record("unseen"))).fencing_token
    (name,) = contenders(raw, namespace, "b")
    assert raw.get(f"{parent_of(namespace, 'b')}/{name}")[0] == b""
    assert one(bare.describe("b")).held_by == (HolderState("", "", None, fence, 1),)


def test_a_shared_queue_place_held_for_another_token_gets_that_tokens_record(store: ZooKeeperStore) -> None:
    """Waiters of one process may share a queue place (one waiter id): the node made for the
    first is held by whichever attempt finds it first in line, and then names that one."""
    holder = token()
    assert store.acquire(req("lock", "k", holder)).acquired
    shared = store.waiter_id(True)
    assert not store.acquire(req("lock", "k", token(), record("first"), waiter=shared)).acquired
    store.release("k", holder)
    second = token()
    # The place is first in line once this session has seen the holder's node go (a watch
    # event, asynchronous): attempt as a woken waiter does, until then.
    pause = threading.Event()
    for _ in range(200):
        taken = store.acquire(req("lock", "k", second, record("second"), waiter=shared))
        if taken.acquired:
            break
        pause.wait(0.05)
    assert taken.acquired
    (held,) = one(store.describe("k")).held_by  # the same session: after the rewrite
    assert (held.token, held.fencing_token) == (second, taken.fencing_token)
    assert parse_owner(held.owner)["thread"] == "second"


# -- nodes of the previous version --------------------------------------------------------------


def previous_node(raw: Any, namespace: str, key: str, infix: str, data: bytes) -> tuple[str, int]:
    """A contender node as the previous version wrote it (its own JSON, no token)."""
    raw.ensure_path(parent_of(namespace, key))
    path, stat = raw.create(
        f"{parent_of(namespace, key)}/_c_{uuid.uuid4().hex}-{infix}-",
        data,
        ephemeral=True,
        sequence=True,
        include_data=True,
    )
    return path, stat.czxid


def test_nodes_of_the_previous_version_are_described_and_still_exclude(
    store: ZooKeeperStore, raw: Any, namespace: str
) -> None:
    old = {"host": "old-host", "pid": 77, "thread": "T", "kind": "lock", "lease": 12.5, "acquired_at": 1.5}
    path, fence = previous_node(raw, namespace, "k", "lock", json.dumps(old).encode())
    state = one(store.describe("k"))
    assert (state.kind, state.fencing_token, state.remaining) == ("lock", fence, 12.5)
    (held,) = state.held_by
    assert (held.token, held.remaining, held.fencing_token, held.weight) == ("", None, fence, 1)
    fields = parse_owner(held.owner)
    assert (fields["host"], fields["pid"], fields["thread"], fields["acquired_at"]) == ("old-host", 77, "T", 1.5)
    assert not store.acquire(req("lock", "k", token())).acquired  # it holds the lock
    raw.delete(path)
    assert store.acquire(req("lock", "k", token())).fencing_token > fence
    # A semaphore holder of the previous version (empty data, ``owner_info=false``) takes one permit.
    _, fence = previous_node(raw, namespace, "sem", "sem.2", b"")
    ours = token()
    assert store.acquire(req("semaphore", "sem", ours, permits=2)).acquired
    assert not store.acquire(req("semaphore", "sem", token(), permits=2)).acquired
    state = one(store.describe("sem"))
    assert state.held_by[0] == HolderState("", "", None, fence, 1)
    assert (state.holders, store.permits("sem")) == (2, (2, 2))
    assert store.force_release("sem")
    assert contenders(raw, namespace, "sem") == []


def test_node_data_keeps_the_previous_fields_and_reads_back_exactly() -> None:
    owner = record("codec")
    data = encode("t0ken", "semaphore", 12.5, owner)
    fields = json.loads(data)  # one flat object, as before: the previous version's describe reads it
    assert (fields["token"], fields["kind"], fields["lease"]) == ("t0ken", "semaphore", 12.5)
    assert (fields["pid"], fields["thread"]) == (os.getpid(), "codec")
    for odd in ["", "plain", "{}", '{"owner":"x"}', '{"not json}', "x\ny"]:
        assert read(encode('a "quoted" token', "lock", 1, odd))[:2] == ('a "quoted" token', odd)
    assert read(encode("t", "read", 2.0, owner)) == ("t", owner, 2.0, "read")
    assert read(b"\xff") == read(b"[1]") == read(b"") == ("", "", None, "")


# -- weights ----------------------------------------------------------------------------------


def test_weighted_names_and_who_holds() -> None:
    """A hold of k permits is one node ``sem.<N>w<k>``; one permit keeps the previous name.
    The holders are the queue's prefix whose weights fit."""
    assert (infix_of("semaphore", 4), infix_of("semaphore", 4, 3)) == ("sem.4", "sem.4w3")
    names = [f"_c_{i:032x}-{infix}-{i:010d}" for i, infix in enumerate(["sem.4w3", "sem.4", "sem.4w2", "sem.4"])]
    queue = ordered(names)
    assert [(c.permits, c.weight) for c in queue] == [(4, 3), (4, 1), (4, 2), (4, 1)]
    assert [c.name for c in holders(queue)] == names[:2]
    assert [c.name for c in holders(queue, permits=6)] == names[:3]
    third = decide(queue, names[2])
    assert third is not None
    assert (third.holds, third.watch) == (False, "")  # the first waiter: watches the queue
    fourth = decide(queue, names[3])
    assert fourth is not None
    assert (fourth.holds, fourth.watch) == (False, names[2])


def test_a_weighted_hold_takes_all_its_permits_or_none(store: ZooKeeperStore) -> None:
    for _ in range(2):
        assert store.acquire(req("semaphore", "sem", token(), permits=4)).acquired
    busy = store.acquire(req("semaphore", "sem", token(), permits=4, weight=3))
    assert not busy.acquired
    state = one(store.describe("sem"))  # the same session: after the try's delete
    assert (state.holders, state.waiters) == (2, 0)  # the try left nothing
    assert store.permits("sem") == (4, 2)
    two = token()
    assert store.acquire(req("semaphore", "sem", two, permits=4, weight=2)).acquired
    assert store.permits("sem") == (4, 4)
    assert not store.acquire(req("semaphore", "sem", token(), permits=4)).acquired
    store.release("sem", two, "semaphore")
    assert store.permits("sem") == (4, 2)


def test_more_permits_than_the_semaphore_has_are_refused_before_anything_is_sent(store: ZooKeeperStore) -> None:
    for weight in (5, 0):
        with pytest.raises(ConfigurationError):
            store.acquire(req("semaphore", "sem", token(), permits=4, weight=weight))
    with pytest.raises(ConfigurationError):
        store.acquire(req("lock", "k", token(), weight=2))
    assert store._session._client is None  # no session was even started


def test_a_heavy_waiter_first_in_line_is_not_passed_by_a_light_one(store: ZooKeeperStore) -> None:
    assert store.acquire(req("semaphore", "sem", token(), permits=3, weight=2)).acquired
    heavy = req("semaphore", "sem", token(), permits=3, weight=2, waiter=store.waiter_id(True))
    assert not store.acquire(heavy).acquired
    assert not store.acquire(req("semaphore", "sem", token(), permits=3)).acquired  # one permit free, but queued behind
    assert store.permits("sem") == (3, 2)


def test_releasing_a_weight_two_hold_lets_two_waiters_in(store: ZooKeeperStore, stores: list[Any]) -> None:
    """Two weight-1 waiters (two sessions) queue behind a weight-2 holder of a 2-permit
    semaphore, a third behind them: the release wakes the first, whose hold wakes the second
    (the chain a ZooKeeper queue wakes along); the third stays queued."""
    holder = token()
    assert store.acquire(req("semaphore", "sem", holder, permits=2, weight=2)).acquired
    others = [new_store_like(store, stores) for _ in range(3)]
    waiters = []
    for i, by in enumerate(others):
        request = req("semaphore", "sem", token(), record(f"waiter-{i}"), permits=2, waiter=by.waiter_id(True))
        assert not by.acquire(request).acquired
        notifier = by.notifier()
        assert notifier is not None
        waiters.append((by, request, notifier.subscribe("sem", BOUND, request.waiter)))
    assert one(store.describe("sem")).waiters == 3
    store.release("sem", holder, "semaphore")
    for by, request, subscription in waiters[:2]:
        assert subscription.wait(BOUND)
        assert by.acquire(request).acquired
    state = one(store.describe("sem"))
    assert [parse_owner(h.owner)["thread"] for h in state.held_by] == ["waiter-0", "waiter-1"]
    assert (state.waiters, store.permits("sem")) == (1, (2, 2))
    by, request, _ = waiters[2]
    assert not by.acquire(request).acquired


SEMAPHORE_WORKER = """
import fcntl, json, os, sys
from lockaspect.backends.base import AcquireRequest
from lockaspect.backends.zookeeper import open_zookeeper_store

url, namespace, path, rounds, weight = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
PERMITS = 4


def count(change):
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        used = int(f.read() or 0) + change
        if used > PERMITS:
            sys.exit(f"{used} permits in use, {PERMITS} exist")
        f.seek(0)
        f.truncate()
        f.write(str(used))
        return used


store = open_zookeeper_store(url, namespace=namespace)
notifier = store.notifier()
waiter = store.waiter_id(True)
peak = 0
for _ in range(rounds):
    token = os.urandom(16).hex()
    request = AcquireRequest("semaphore", ("sem",), token, 30.0, waiter, False, "", PERMITS, "", weight)
    while True:
        subscription = notifier.subscribe("sem", 1.0, waiter)
        try:
            if store.acquire(request).acquired:
                break
            subscription.wait(1.0)
        finally:
            notifier.unsubscribe(subscription)
    peak = max(peak, count(weight))
    count(-weight)
    assert store.release("sem", token, "semaphore").name == "RELEASED"
store.close()
print(json.dumps(peak))
"""


@pytest.mark.slow
def test_processes_never_hold_more_permits_than_the_semaphore_has(
    zookeeper_server: ZooKeeperServer, namespace: str, raw: Any, tmp_path: Path
) -> None:
    """Four processes (four sessions) take holds of 1, 2, 3 and 1 permits of a 4-permit
    semaphore in a loop, each adding its weight to a shared count while it holds: the count
    never passes 4."""
    counter = tmp_path / "in-use"
    counter.write_text("0")
    env = {**os.environ, "PYTHONPATH": WORKTREE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", SEMAPHORE_WORKER, zookeeper_server.url, namespace, str(counter), "15", str(weight)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for weight in (1, 2, 3, 1)
    ]
    failures = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        if process.returncode:
            failures.append(err.decode()[-2000:])
        else:
            assert 1 <= json.loads(out) <= 4
    assert failures == []
    assert counter.read_text() == "0"
    until(lambda: contenders(raw, namespace, "sem") == [], "the last contender to go")


# -- add_permits ------------------------------------------------------------------------------


def test_add_permits(store: ZooKeeperStore) -> None:
    assert store.add_permits("new", 3) == (3, 0)  # a semaphore never used starts from 0
    assert store.permits("new") == (3, 0)
    assert store.add_permits("new", -1) == (2, 0)
    assert store.add_permits("new", -10) == (0, 0)  # never below 0
    assert store.acquire(req("semaphore", "used", token(), permits=4, weight=2)).acquired
    assert store.add_permits("used", 1) == (5, 2)  # from what the holders expect
    assert store.acquire(req("semaphore", "used", token(), permits=4)).permits == 5
    assert store.add_permits("used", -4) == (1, 2)  # lowering takes nothing from the holders
    assert not store.acquire(req("semaphore", "used", token(), permits=1)).acquired
    for bad in (1.5, True, "1"):
        with pytest.raises(TypeError):
            store.add_permits("new", bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        store.permits("new", -1)


def test_concurrent_add_permits_lose_no_change(
    zookeeper_server: ZooKeeperServer, namespace: str, stores: list[ZooKeeperStore]
) -> None:
    """Four sessions add 1 twenty times each, and one sets the permits in between, all at
    once: every addition after the set counts (versioned writes, retried)."""
    adders = [new_store(zookeeper_server, namespace, stores) for _ in range(4)]
    start = threading.Barrier(len(adders))
    errors: list[BaseException] = []

    def add(by: ZooKeeperStore) -> None:
        try:
            start.wait(BOUND)
            for _ in range(20):
                by.add_permits("sem", 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(by,)) for by in adders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND)
    assert errors == []
    assert adders[0].permits("sem") == (80, 0)


def test_raising_the_permits_wakes_the_first_waiter(store: ZooKeeperStore, stores: list[Any]) -> None:
    """The first waiter of a full semaphore watches the key's node too: more permits wake it,
    and its next attempt sees the number changed (a waiter asking for another number is told
    so, as by every store)."""
    assert store.permits("sem", 1) == (1, 0)
    assert store.acquire(req("semaphore", "sem", token(), permits=1)).acquired
    other = new_store_like(store, stores)
    request = req("semaphore", "sem", token(), permits=1, waiter=other.waiter_id(True))
    assert not other.acquire(request).acquired
    notifier = other.notifier()
    assert notifier is not None
    subscription = notifier.subscribe("sem", BOUND, request.waiter)
    assert store.add_permits("sem", 1) == (2, 1)
    assert subscription.wait(BOUND)
    assert other.acquire(request).permits == 2


# -- force_release ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "write", "read", "semaphore"])
def test_force_release_deletes_every_holder_and_waiter(
    store: ZooKeeperStore, stores: list[Any], raw: Any, namespace: str, kind: str
) -> None:
    """Holders (two for read and semaphore, in two sessions), then a waiter: describe names the
    holders; force_release deletes every node of the key, wakes the waiter, and the holders'
    re-entry, renewal and release say not-owner; the next hold's fencing token is larger."""
    operator = new_store_like(store, stores)
    shared = kind in ("read", "semaphore")
    holds = [(store, token()), (operator, token())] if shared else [(store, token())]
    fences = [by.acquire(req(kind, "k", tok, record(tok[:6]), permits=2)).fencing_token for by, tok in holds]
    blocker = "write" if kind == "read" else kind
    waiting = req(blocker, "k", token(), permits=2, waiter=operator.waiter_id(True))
    assert not operator.acquire(waiting).acquired
    notifier = operator.notifier()
    assert notifier is not None
    subscription = notifier.subscribe("k", BOUND, waiting.waiter)
    states = operator.describe("k")
    evicted = {holder.token for state in states for holder in state.held_by}
    assert evicted == {tok for _, tok in holds}
    assert operator.force_release("k")
    assert contenders(raw, namespace, "k") == []
    assert operator.describe("k") == []
    assert subscription.wait(BOUND)
    for by, tok in holds:
        assert not by.reenter("k", tok, kind)  # a round trip: no need to wait for the watch
        assert by.renew([RenewItem("k", tok, LEASE, kind)]) == [False]
        assert by.release("k", tok, kind) is ReleaseResult.NOT_OWNER
    assert not operator.force_release("k")
    retried = operator.acquire(waiting)
    if not retried.acquired:  # its place was deleted: the next attempt queues afresh
        retried = operator.acquire(waiting)
    assert retried.acquired
    assert retried.fencing_token > max(fences)


def test_force_release_deletes_in_one_transaction_and_looks_again_if_the_queue_changed(
    store: ZooKeeperStore, stores: list[Any], raw: Any, namespace: str
) -> None:
    """The plan driven by hand on the store's session: a waiter leaves between the look and
    the deletes, so the transaction deletes nothing (the holder is still there, no waiter
    held for a moment); the plan looks again and deletes what is there now."""
    holder = token()
    assert store.acquire(req("lock", "k", holder)).acquired
    other = new_store_like(store, stores)
    assert not other.acquire(req("lock", "k", token(), waiter=other.waiter_id(True))).acquired
    first, leaving = contenders(raw, namespace, "k")
    session: Any = store._session
    plan = _admin.force_release(session, namespace, "k")
    calls = plan.send(None)  # the look
    calls = plan.send(session.run(calls))  # the transaction
    assert [call.op for call in calls] == ["deletes"]
    raw.delete(f"{parent_of(namespace, 'k')}/{leaving}")  # the waiter gives up meanwhile
    results = session.run(calls)
    assert any(isinstance(result, Exception) for result in results[0])
    assert contenders(raw, namespace, "k") == [first]  # nothing deleted
    calls = plan.send(results)  # looks again
    calls = plan.send(session.run(calls))
    with pytest.raises(StopIteration) as done:
        plan.send(session.run(calls))
    assert done.value.value is True
    assert contenders(raw, namespace, "k") == []
    assert not store.reenter("k", holder)


# -- the asyncio twin ---------------------------------------------------------------------------


def test_the_async_twin_describes_adds_and_force_releases(store: ZooKeeperStore) -> None:
    twin = store.asyncio_twin()

    async def main() -> None:
        lock, owner = token(), record("async-lock")
        fence = (await twin.acquire(req("lock", "a:lock", lock, owner))).fencing_token
        (state,) = await twin.describe("a:lock")
        assert state.held_by == (HolderState(lock, owner, None, fence, 1),)
        readers = [(token(), record(f"async-reader-{i}")) for i in range(2)]
        for tok, rec in readers:
            assert (await twin.acquire(req("read", "a:rw", tok, rec))).acquired
        (state,) = await twin.describe("a:rw")
        assert state.kind == "read"
        assert sorted((h.token, h.owner) for h in state.held_by) == sorted(readers)
        for weight in (2, 1):
            taken = await twin.acquire(req("semaphore", "a:sem", token(), record(f"w{weight}"), weight=weight))
            assert taken.acquired
        (state,) = await twin.describe("a:sem")
        assert [h.weight for h in state.held_by] == [2, 1]
        assert await twin.permits("a:sem") == (4, 3)
        assert await twin.add_permits("a:sem", 2) == (6, 3)
        assert await twin.add_permits("a:new", -1) == (0, 0)
        assert await twin.permits("a:new", 2) == (2, 0)
        assert sorted([key async for key in twin.held_keys("a:*")]) == ["a:lock", "a:rw", "a:sem"]
        assert await twin.force_release("a:sem")
        assert not await twin.force_release("a:sem")
        assert await twin.describe("a:sem") == []
        assert await twin.release("a:lock", lock) is ReleaseResult.RELEASED
        assert sorted([key async for key in twin.held_keys()]) == ["a:rw"]
        await twin.aclose()

    asyncio.run(asyncio.wait_for(main(), BOUND))
    assert store.permits("a:sem") == (6, 0)


def new_store_like(store: ZooKeeperStore, stores: list[Any]) -> ZooKeeperStore:
    """Another store (another session) on ``store``'s server and namespace."""
    made = ZooKeeperStore(store.settings)
    stores.append(made)
    return made
