"""Owner records, weights, ``add_permits`` and the admin part of the SQL stores' asyncio twins
(``AsyncBridgeStore`` on SQLite, ``AsyncTableStore`` and ``AsyncPostgresAdvisoryStore`` on
PostgreSQL), and the advisory store's records of locks handed over by the server's queue."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from lockaspect import ConfigurationError
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, AsyncAdminStore, KeyState, ReleaseResult, RenewItem
from lockaspect.backends.sql._keys import advisory_key
from lockaspect.backends.sql.advisory import PostgresAdvisoryStore, open_postgres_store
from lockaspect.owner import owner_record, parse_owner
from lockaspect.testing import PostgresServer

STORES = ["sqlite", "postgres_table", "postgres"]
LONG = 30.0
_T = TypeVar("_T")


def token() -> str:
    return secrets.token_hex(16)


def record(name: str) -> str:
    return owner_record("k", thread=name)


def thread_of(owner: str) -> Any:
    return parse_owner(owner).get("thread")


def only(states: list[KeyState], kind: str) -> KeyState:
    found = [state for state in states if state.kind == kind]
    assert len(found) == 1, states
    return found[0]


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    if request.param == "postgres_table":
        return postgres.url.replace("postgresql://", "postgresql+table://", 1)
    return postgres.url


@pytest.fixture
def store(url: str, namespace: str) -> Iterator[Any]:
    made = open_store(url, namespace=namespace)
    yield made
    made.close()


async def take(twin: Any, kind: str, key: str, owner: str = "", **options: Any) -> tuple[str, int]:
    held = token()
    result = await twin.acquire(AcquireRequest(kind, (key,), held, LONG, owner=owner, **options))
    assert result.acquired, result
    return held, result.fencing_token


def test_the_twins_are_async_admin_stores(store: Any) -> None:
    async def main() -> None:
        twin = store.asyncio_twin()
        try:
            assert isinstance(twin, AsyncAdminStore)
            assert callable(twin.add_permits)
        finally:
            await twin.aclose()

    run(main())


def test_async_owner_records_of_every_kind(store: Any) -> None:
    async def main() -> None:
        twin = store.asyncio_twin()
        try:
            held, fence = await take(twin, "lock", "k", record("task-lock"))
            [holder] = only(await twin.describe("k"), "lock").held_by
            assert (holder.token, thread_of(holder.owner), holder.fencing_token) == (held, "task-lock", fence)
            readers = {token(): f"reader-{i}" for i in range(2)}
            for reader, name in readers.items():
                assert (await twin.acquire(AcquireRequest("read", ("doc",), reader, LONG, owner=record(name)))).acquired
            state = only(await twin.describe("doc"), "read")
            assert {holder.token: thread_of(holder.owner) for holder in state.held_by} == readers
            big, _ = await take(twin, "semaphore", "pool", record("big"), permits=3, weight=2)
            small, _ = await take(twin, "semaphore", "pool", record("small"), permits=3)
            state = only(await twin.describe("pool"), "semaphore")
            assert {holder.token: (holder.weight, thread_of(holder.owner)) for holder in state.held_by} == {
                big: (2, "big"),
                small: (1, "small"),
            }
            assert sorted([key async for key in twin.held_keys()]) == ["doc", "k", "pool"]
            assert [key async for key in twin.held_keys("p*")] == ["pool"]
        finally:
            await twin.aclose()

    run(main())


def test_async_weights_all_or_none(store: Any) -> None:
    async def main() -> None:
        twin = store.asyncio_twin()
        try:
            await take(twin, "semaphore", "pool", permits=4, weight=2)
            request = AcquireRequest("semaphore", ("pool",), token(), LONG, permits=4, weight=3)
            assert not (await twin.acquire(request)).acquired
            assert await twin.permits("pool") == (4, 2)
            with pytest.raises(ConfigurationError):
                await twin.acquire(AcquireRequest("semaphore", ("other",), token(), LONG, permits=2, weight=3))
            assert await twin.permits("other") == (None, 0)
        finally:
            await twin.aclose()

    run(main())


def test_async_add_permits(store: Any) -> None:
    async def main() -> None:
        twin = store.asyncio_twin()
        try:
            assert await twin.add_permits("fresh", 2) == (2, 0)
            assert await twin.add_permits("none", -1) == (0, 0)
            await take(twin, "semaphore", "pool", permits=2, weight=2)
            assert await twin.add_permits("pool", 3) == (5, 2)
            assert await twin.add_permits("pool", -4) == (1, 2)
            assert await twin.add_permits("pool", -9) == (0, 2)
            assert await twin.permits("pool", 4) == (4, 2)
            assert store.add_permits("pool", 1) == (5, 2)  # the sync store sees the same semaphore
        finally:
            await twin.aclose()

    run(main())


def test_async_force_release(store: Any) -> None:
    async def main() -> None:
        twin = store.asyncio_twin()
        try:
            held, fence = await take(twin, "write", "k", record("evicted"))
            [holder] = only(await twin.describe("k"), "write").held_by
            assert (holder.token, thread_of(holder.owner)) == (held, "evicted")
            assert await twin.force_release("k") is True
            assert await twin.describe("k") == []
            assert list(await twin.renew([RenewItem("k", held, LONG, "write")])) == [False]
            assert await twin.release("k", held, "write") is ReleaseResult.NOT_OWNER
            _, after = await take(twin, "write", "k")
            assert after > fence
            assert await twin.force_release("never") is False
        finally:
            await twin.aclose()

    run(main())


# -- the advisory store: a lock the server hands to a queued wait ---------------------------------


@pytest.fixture
def advisory(postgres_server: PostgresServer, namespace: str) -> Iterator[PostgresAdvisoryStore]:
    made = open_postgres_store(postgres_server.url, namespace=namespace)
    yield made
    made.close()


@pytest.mark.parametrize(("holder_kind", "kind"), [("lock", "lock"), ("write", "read"), ("semaphore", "semaphore")])
def test_a_handed_over_lock_is_recorded_as_its_claimer_s(
    advisory: PostgresAdvisoryStore, holder_kind: str, kind: str
) -> None:
    """A waiter's busy attempt queues in the server under its waiter id; the release grants
    the lock to that wait; the waiter's next attempt (another owner token, as the engine
    sends after a failed attempt) claims it, and the record names the claimer."""
    options: dict[str, Any] = {"permits": 1} if kind == "semaphore" else {}
    first = token()
    assert advisory.acquire(AcquireRequest(holder_kind, ("k",), first, LONG, **options)).acquired
    waiter = advisory.waiter_id(True)
    queued = AcquireRequest(kind, ("k",), token(), LONG, waiter=waiter, owner=record("queued"), **options)
    assert not advisory.acquire(queued).acquired
    assert advisory.release("k", first, holder_kind) is ReleaseResult.RELEASED  # waits for the grant's reply
    claimer = token()
    claim = AcquireRequest(kind, ("k",), claimer, LONG, waiter=waiter, owner=record("claimer"), **options)
    assert advisory.acquire(claim).acquired
    [holder] = only(advisory.describe("k"), kind).held_by
    assert (holder.token, thread_of(holder.owner)) == (claimer, "claimer")
    assert advisory.release("k", claimer, kind) is ReleaseResult.RELEASED
    assert advisory.describe("k") == []


def test_readers_sharing_a_session_are_each_described(postgres_server: PostgresServer, namespace: str) -> None:
    """With one holder session, a client's readers of a key share it (PostgreSQL sees one
    shared hold): each has a place of its own, and a release that leaves others there takes
    its record away, so that no released reader is described while the session holds on."""
    store = open_postgres_store(postgres_server.url, namespace=namespace, pool_size=1)
    try:
        readers = {token(): f"reader-{i}" for i in range(3)}
        for held, name in readers.items():
            assert store.acquire(AcquireRequest("read", ("doc",), held, LONG, owner=record(name))).acquired

        def described() -> dict[str, Any]:
            states = store.describe("doc")
            return {holder.token: thread_of(holder.owner) for state in states for holder in state.held_by}

        assert described() == readers
        first, second, third = readers
        for gone in (second, first):
            assert store.release("doc", gone, "read") is ReleaseResult.RELEASED
            del readers[gone]
            assert described() == readers
        assert store.release("doc", third, "read") is ReleaseResult.RELEASED
        assert store.describe("doc") == []
        again = token()
        assert store.acquire(AcquireRequest("read", ("doc",), again, LONG, owner=record("again"))).acquired
        assert described() == {again: "again"}
        with postgres_server.connect() as conn:
            sql = "SELECT count(*) FROM lockaspect_advisory_reader WHERE objkey = %s"
            assert conn.execute(sql, (advisory_key(namespace + "doc"),)).fetchone() == (1,)
    finally:
        store.close()


def test_a_weighted_attempt_gives_back_a_permit_granted_to_its_process_s_place(
    advisory: PostgresAdvisoryStore,
) -> None:
    """A process's waiters of one semaphore share a queue place: a permit the server granted
    there is one, not enough for a hold of two; kept, it would hold back a permit the hold
    needs. The weighted attempt gives it back and takes both slots."""
    holders = [token(), token()]
    for held in holders:
        assert advisory.acquire(AcquireRequest("semaphore", ("pool",), held, LONG, permits=2)).acquired
    waiter = advisory.waiter_id(True)
    assert not advisory.acquire(
        AcquireRequest("semaphore", ("pool",), token(), LONG, permits=2, waiter=waiter)
    ).acquired
    for held in holders:
        assert advisory.release("pool", held, "semaphore") is ReleaseResult.RELEASED
    both = token()
    request = AcquireRequest(
        "semaphore", ("pool",), both, LONG, permits=2, weight=2, waiter=waiter, owner=record("two")
    )
    assert advisory.acquire(request).acquired
    [holder] = only(advisory.describe("pool"), "semaphore").held_by
    assert (holder.token, holder.weight, thread_of(holder.owner)) == (both, 2, "two")
    assert advisory.permits("pool") == (2, 2)
    assert advisory.release("pool", both, "semaphore") is ReleaseResult.RELEASED
    assert advisory.permits("pool") == (2, 0)


def test_a_transaction_scoped_lock_is_seen_as_a_holder_without_a_record(
    advisory: PostgresAdvisoryStore, postgres_server: PostgresServer
) -> None:
    """``scope="transaction"`` locks write no record (the lock lives in the caller's
    transaction; a row written there would be seen only after the commit that ends it): the
    session store's ``describe`` counts such a holder of the same key, with no owner."""
    with postgres_server.connect() as conn, conn.transaction():
        key = advisory_key(advisory.namespace + "k")
        assert conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (key,)).fetchone() == (True,)
        state = only(advisory.describe("k"), "lock")
        assert (state.holders, state.held_by) == (1, ())
    assert advisory.describe("k") == []
