"""Owner records, semaphore weights, ``add_permits`` and ``force_release`` on the SQL stores
(the lease table on SQLite and PostgreSQL, and PostgreSQL advisory locks), through the store
protocol, against a real file and a real server.

Each test runs on the three stores (``sqlite``, ``postgres_table``, ``postgres``). The asyncio
twins and the upgrade of tables made by the previous version are in
``test_sql_owner_async.py`` and ``test_sql_owner_upgrade.py``."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import ConfigurationError, LockClient
from lockaspect.backends import open_store
from lockaspect.backends.base import (
    AcquireRequest,
    AddsPermits,
    AdminStore,
    HolderState,
    KeyState,
    ReleaseResult,
    RenewItem,
    Store,
)
from lockaspect.backends.sql._keys import advisory_key
from lockaspect.backends.sql.advisory import PostgresAdvisoryStore
from lockaspect.backends.sql.table import TableStore
from lockaspect.owner import owner_record, parse_owner
from lockaspect.testing import PostgresServer

STORES = ["sqlite", "postgres_table", "postgres"]
#: Below the advisory store's idle_session_timeout (60 s): long enough to outlive any test.
LONG = 30.0


def token() -> str:
    return secrets.token_hex(16)


def record(name: str) -> str:
    """An owner record as the engine makes them, told apart by its thread name."""
    return owner_record("k", thread=name)


def store_url(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if name == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    if name == "postgres_table":
        return postgres.url.replace("postgresql://", "postgresql+table://", 1)
    return postgres.url


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(str(request.param), tmp_path, request)


@pytest.fixture
def store(url: str, namespace: str) -> Iterator[Any]:
    made = open_store(url, namespace=namespace)
    yield made
    made.close()


def take(store: Store, kind: str, key: str, owner: str = "", **options: Any) -> tuple[str, int]:
    """Acquire ``key`` as a fresh owner: its token and fencing token (it must succeed)."""
    held = token()
    result = store.acquire(AcquireRequest(kind, (key,), held, LONG, owner=owner, **options))
    assert result.acquired, result
    assert result.fencing_token is not None
    return held, result.fencing_token


def only(states: list[KeyState], kind: str) -> KeyState:
    found = [state for state in states if state.kind == kind]
    assert len(found) == 1, states
    return found[0]


def session_bound(store: Any) -> bool:
    return isinstance(store, PostgresAdvisoryStore)


def check_remaining(store: Any, holder: HolderState) -> None:
    if session_bound(store):
        assert holder.remaining is None  # a session lock has no expiry of its own
    else:
        assert holder.remaining is not None
        assert 0 < holder.remaining <= LONG


# -- owner records ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "fair", "write"])
def test_an_exclusive_hold_is_described_with_its_owner_record(store: Any, kind: str) -> None:
    owner = record("worker-1")
    held, fence = take(store, kind, "k", owner)
    state = only(store.describe("k"), kind)
    assert (state.holders, state.fencing_token) == (1, fence)
    [holder] = state.held_by
    assert (holder.token, holder.owner, holder.fencing_token, holder.weight) == (held, owner, fence, 1)
    assert parse_owner(holder.owner)["thread"] == "worker-1"
    check_remaining(store, holder)
    assert store.release("k", held, kind) is ReleaseResult.RELEASED
    assert store.describe("k") == []


def test_every_reader_is_described_with_its_own_record(store: Any) -> None:
    readers = {token(): record(f"reader-{i}") for i in range(3)}
    fences = {}
    for held, owner in readers.items():
        result = store.acquire(AcquireRequest("read", ("doc",), held, LONG, owner=owner))
        assert result.acquired
        fences[held] = result.fencing_token
    state = only(store.describe("doc"), "read")
    assert state.holders == 3
    assert {holder.token: holder.owner for holder in state.held_by} == readers
    assert {holder.token: holder.fencing_token for holder in state.held_by} == fences
    first = next(iter(readers))
    assert store.release("doc", first, "read") is ReleaseResult.RELEASED
    state = only(store.describe("doc"), "read")
    assert {holder.token for holder in state.held_by} == set(readers) - {first}


def test_every_semaphore_holder_is_described_with_its_record_and_weight(store: Any) -> None:
    big_owner, small_owner = record("big"), record("small")
    big, big_fence = take(store, "semaphore", "pool", big_owner, permits=5, weight=3)
    small, small_fence = take(store, "semaphore", "pool", small_owner, permits=5)
    state = only(store.describe("pool"), "semaphore")
    assert (state.holders, state.permits) == (2, 5)
    found = {holder.token: holder for holder in state.held_by}
    assert set(found) == {big, small}
    assert (found[big].weight, found[big].fencing_token, found[big].owner) == (3, big_fence, big_owner)
    assert (found[small].weight, found[small].fencing_token, found[small].owner) == (1, small_fence, small_owner)
    check_remaining(store, found[big])
    assert store.permits("pool") == (5, 4)  # in use: the sum of the weights


def test_a_multi_key_lock_records_its_owner_on_every_key(store: Any) -> None:
    owner = record("multi")
    held = token()
    result = store.acquire(AcquireRequest("lock", ("a", "b"), held, LONG, owner=owner))
    assert result.acquired
    for key, fence in zip(("a", "b"), result.fencing_tokens or (), strict=True):
        [holder] = only(store.describe(key), "lock").held_by
        assert (holder.token, holder.owner, holder.fencing_token) == (held, owner, fence)


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_retried_acquisition_keeps_the_first_record(store: Any, kind: str) -> None:
    options = {"permits": 2} if kind == "semaphore" else {}
    held, fence = take(store, kind, "k", record("first"), **options)
    again = store.acquire(AcquireRequest(kind, ("k",), held, LONG, owner=record("retry"), **options))
    assert (again.acquired, again.fencing_token) == (True, fence)
    [holder] = only(store.describe("k"), kind).held_by
    assert parse_owner(holder.owner)["thread"] == "first"


def test_a_hold_without_an_owner_record_is_described_with_an_empty_one(store: Any) -> None:
    held, fence = take(store, "lock", "k")
    [holder] = only(store.describe("k"), "lock").held_by
    assert (holder.token, holder.owner, holder.fencing_token) == (held, "", fence)
    held_read, _ = take(store, "read", "r")
    [reader] = only(store.describe("r"), "read").held_by
    assert (reader.token, reader.owner) == (held_read, "")


# -- weights ---------------------------------------------------------------------------------------


def test_a_weighted_request_takes_all_of_its_permits_or_none(store: Any) -> None:
    first, _ = take(store, "semaphore", "pool", permits=4, weight=2)
    busy = store.acquire(AcquireRequest("semaphore", ("pool",), token(), LONG, permits=4, weight=3))
    assert not busy.acquired
    assert store.permits("pool") == (4, 2)  # nothing of the busy request stayed
    assert [holder.token for holder in only(store.describe("pool"), "semaphore").held_by] == [first]
    second, _ = take(store, "semaphore", "pool", permits=4, weight=2)  # exactly what is left
    assert store.permits("pool") == (4, 4)
    assert not store.acquire(AcquireRequest("semaphore", ("pool",), token(), LONG, permits=4)).acquired
    assert store.release("pool", second, "semaphore") is ReleaseResult.RELEASED
    assert store.permits("pool") == (4, 2)


def test_releasing_a_weight_two_hold_lets_two_single_permits_in(store: Any) -> None:
    big, _ = take(store, "semaphore", "pool", permits=2, weight=2)
    waiting = [token(), token()]
    for held in waiting:
        assert not store.acquire(AcquireRequest("semaphore", ("pool",), held, LONG, permits=2)).acquired
    assert store.release("pool", big, "semaphore") is ReleaseResult.RELEASED
    for held in waiting:
        assert store.acquire(AcquireRequest("semaphore", ("pool",), held, LONG, permits=2)).acquired
    assert store.permits("pool") == (2, 2)
    assert not store.acquire(AcquireRequest("semaphore", ("pool",), token(), LONG, permits=2)).acquired


def test_a_weight_above_the_permits_is_refused_before_anything_is_sent(store: Any) -> None:
    with pytest.raises(ConfigurationError, match="1 to 2 permits"):
        store.acquire(AcquireRequest("semaphore", ("pool",), token(), LONG, permits=2, weight=3))
    with pytest.raises(ConfigurationError, match="only a semaphore"):
        store.acquire(AcquireRequest("lock", ("k",), token(), LONG, weight=2))
    assert store.permits("pool") == (None, 0)  # the semaphore was never created
    assert store.describe("pool") == []
    assert store.describe("k") == []


def test_a_weighted_hold_is_renewed_re_entered_and_released_whole(store: Any) -> None:
    held, fence = take(store, "semaphore", "pool", permits=3, weight=3)
    assert list(store.renew([RenewItem("pool", held, LONG, "semaphore")])) == [True]
    assert store.reenter("pool", held, "semaphore")
    assert store.release("pool", held, "semaphore") is ReleaseResult.RELEASED
    assert store.permits("pool") == (3, 0)
    _, later = take(store, "semaphore", "pool", permits=3, weight=3)
    assert later > fence


def test_waiting_clients_get_in_when_a_weighted_hold_is_released(url: str, namespace: str) -> None:
    """Two threads wait in ``client.semaphore`` (one permit each) while a hold of both permits
    is taken through the store; its release lets both in at once."""
    with LockClient.from_url(url, namespace=namespace, watchdog_lease=2.0, tick=0.05) as client:
        store = client.backend
        big, _ = take(store, "semaphore", "pool", permits=2, weight=2)
        inside = threading.Barrier(3, timeout=30)
        errors: list[BaseException] = []

        def wait_for_a_permit() -> None:
            try:
                with client.semaphore("pool", permits=2, wait=None):
                    inside.wait()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                inside.abort()

        threads = [threading.Thread(target=wait_for_a_permit) for _ in range(2)]
        for thread in threads:
            thread.start()
        assert store.release("pool", big, "semaphore") is ReleaseResult.RELEASED
        inside.wait()  # both threads hold a permit at once
        for thread in threads:
            thread.join(30)
        assert errors == []


# -- add_permits ---------------------------------------------------------------------------------


def test_add_permits_up_down_and_never_below_zero(store: Any) -> None:
    assert isinstance(store, AddsPermits)
    take(store, "semaphore", "pool", permits=3, weight=2)
    assert store.add_permits("pool", 2) == (5, 2)
    assert store.add_permits("pool", -4) == (1, 2)  # lowering takes nothing from holders
    assert only(store.describe("pool"), "semaphore").holders == 1
    assert store.add_permits("pool", -10) == (0, 2)
    assert store.permits("pool") == (0, 2)
    assert store.add_permits("pool", 3) == (3, 2)


def test_add_permits_to_a_semaphore_never_used(store: Any) -> None:
    assert store.add_permits("fresh", 3) == (3, 0)
    assert store.add_permits("other", -2) == (0, 0)
    assert store.permits("other") == (0, 0)
    take(store, "semaphore", "fresh", permits=3, weight=3)  # the new number is the semaphore's
    with pytest.raises(ConfigurationError):
        store.add_permits("fresh", 1.5)


# -- force_release -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "write", "read", "semaphore"])
def test_force_release_evicts_every_holder_and_keeps_fencing_tokens(store: Any, kind: str) -> None:
    options = {"permits": 3} if kind == "semaphore" else {}
    count = 2 if kind in ("read", "semaphore") else 1
    holders = {token(): record(f"holder-{i}") for i in range(count)}
    fences = []
    for held, owner in holders.items():
        result = store.acquire(AcquireRequest(kind, ("k",), held, LONG, owner=owner, **options))
        assert result.acquired
        fences.append(result.fencing_token)
    before = only(store.describe("k"), kind)
    assert {holder.token: holder.owner for holder in before.held_by} == holders
    assert isinstance(store, AdminStore)
    assert store.force_release("k") is True
    assert store.describe("k") == []
    assert list(store.held_keys()) == []
    for held in holders:
        assert list(store.renew([RenewItem("k", held, LONG, kind)])) == [False]
        assert store.release("k", held, kind) is ReleaseResult.NOT_OWNER
    _, after = take(store, kind, "k", **options)
    assert after > max(fences)
    assert store.force_release("never") is False


def test_force_release_drops_the_owner_records(store: Any, url: str, request: pytest.FixtureRequest) -> None:
    take(store, "lock", "k", record("evicted"))
    take(store, "read", "r", record("evicted-reader"))
    assert store.force_release("k")
    assert store.force_release("r")
    name = store.namespace + "k"
    if url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(url[len("sqlite:///") :])
        try:
            assert conn.execute("SELECT count(*) FROM lockaspect_holds WHERE name = ?", (name,)).fetchone() == (0,)
            assert conn.execute("SELECT max(fence) FROM lockaspect_fences WHERE name = ?", (name,)).fetchone()[0]
        finally:
            conn.close()
        return
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    with postgres.connect() as conn:
        if session_bound(store):
            row = conn.execute(
                "SELECT token, owner, fence FROM lockaspect_advisory WHERE objkey = %s", (advisory_key(name),)
            )
            assert row.fetchone()[:2] == (None, None)
            readers = conn.execute(
                "SELECT count(*) FROM lockaspect_advisory_reader WHERE objkey = %s",
                (advisory_key(store.namespace + "r"),),
            )
            assert readers.fetchone() == (0,)
        else:
            rows = conn.execute(
                "SELECT info FROM lockaspect_holds WHERE name = ANY(%s)", ([name, store.namespace + "r"],)
            )
            assert all(info is None for (info,) in rows.fetchall())


def test_the_stores_are_admin_stores(store: Any) -> None:
    assert isinstance(store, (TableStore, PostgresAdvisoryStore))
    assert isinstance(store, AdminStore)
    assert isinstance(store, AddsPermits)
