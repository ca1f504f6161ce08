"""Owner records, weighted semaphore holds, ``add_permits`` and who ``describe`` and
``force_release`` name, on real servers: one server, Redis Cluster and Sentinel, sync and
asyncio (each scenario is written once for the asyncio interface; a sync store runs it behind
:class:`Blocking`); RedLock hands the record to every node; holds written before records
were kept are still described, renewed and released."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from lockaspect.backends import open_store
from lockaspect.backends.base import (
    AcquireRequest,
    AcquireResult,
    AddsPermits,
    AsyncAdminStore,
    HolderState,
    KeyState,
    ReleaseResult,
    RenewItem,
    checked_request,
)
from lockaspect.backends.redis import AsyncRedisStore, RedisStore
from lockaspect.backends.redis.redlock import RedlockStore
from lockaspect.errors import BackendError, ConfigurationError
from lockaspect.testing import LockServer

LONG = 60.0
RELEASED, NOT_OWNER = ReleaseResult.RELEASED, ReleaseResult.NOT_OWNER

#: A scenario: a store (the asyncio interface) and a raw client of its server.
Scenario = Callable[[Any, Any], Awaitable[None]]


def token() -> str:
    return secrets.token_hex(16)


def record(thread: str) -> str:
    """An owner record as lockaspect.owner makes them (the store keeps it as it is)."""
    fields = {"host": "web-1", "pid": 41, "thread": thread, "function": "f", "template": "t", "acquired_at": 1.5}
    return json.dumps(fields, separators=(",", ":"))


class Blocking:
    """A sync store behind its asyncio twin's interface, so one scenario runs on both."""

    CALLS = frozenset({"acquire", "release", "renew", "describe", "force_release", "permits", "add_permits"})

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if name not in self.CALLS:
            return method

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return call


def runner(url: str, namespace: str, raw: Any, mode: str) -> Callable[[Scenario], None]:
    def run(scenario: Scenario) -> None:
        store = open_store(url, namespace=namespace)
        try:
            if mode == "sync":
                asyncio.run(scenario(Blocking(store), raw))
                return

            async def main() -> None:
                twin = store.asyncio_twin()
                try:
                    await scenario(twin, raw)
                finally:
                    await twin.aclose()

            asyncio.run(main())
        finally:
            store.close()

    return run


@pytest.fixture(params=["sync", "async"])
def on_redis(
    request: pytest.FixtureRequest, lock_server: LockServer, namespace: str, raw: Any
) -> Callable[[Scenario], None]:
    """Runs a scenario on a single server's store, sync or async."""
    return runner(lock_server.url, namespace, raw, request.param)


@pytest.fixture(
    params=["redis-sync", "redis-async", "cluster-sync", "cluster-async", "sentinel-sync", "sentinel-async"]
)
def on_any(request: pytest.FixtureRequest, namespace: str) -> Iterator[Callable[[Scenario], None]]:
    """Runs a scenario on each Redis store (one server, Cluster, Sentinel), sync or async."""
    topology, mode = request.param.split("-")
    if topology == "cluster":
        cluster = request.getfixturevalue("valkey_cluster")
        url, raw = cluster.url, cluster.client()
    elif topology == "sentinel":
        sentinel = request.getfixturevalue("valkey_sentinel")
        url, raw = sentinel.url, sentinel.master.client()
    else:
        yield runner(request.getfixturevalue("lock_server").url, namespace, request.getfixturevalue("raw"), mode)
        return
    yield runner(url, namespace, raw, mode)
    raw.close()


async def take(
    store: Any,
    kind: str,
    key: str,
    tok: str,
    rec: str = "",
    *,
    permits: int | None = None,
    weight: int = 1,
    **more: Any,
) -> AcquireResult:
    result: AcquireResult = await store.acquire(
        AcquireRequest(kind, (key,), tok, more.pop("lease", LONG), permits=permits, owner=rec, weight=weight, **more)
    )
    return result


def state_of(states: list[KeyState], kind: str) -> KeyState:
    [state] = [state for state in states if state.kind == kind]
    return state


def by_token(state: KeyState) -> dict[str, HolderState]:
    assert len(state.held_by) == state.holders
    for holder in state.held_by:
        assert holder.remaining is not None
        assert 0 < holder.remaining <= LONG
    return {holder.token: holder for holder in state.held_by}


def sem_keys(store: Any, key: str) -> tuple[str, str]:
    """A semaphore's fencing tokens (with the owner records) and its weights."""
    return store.semaphore_key(key) + ":fences", store.semaphore_key(key) + ":weights"


# -- owner records, every kind --


@pytest.mark.parametrize("kind", ["lock", "fair", "write"])
def test_the_holder_of_an_exclusive_kind_is_described_with_its_record(on_any: Any, kind: str) -> None:
    """A retry with the same token keeps the first record; a fair waiter is counted, not listed."""

    async def scenario(store: Any, raw: Any) -> None:
        tok, rec = token(), record("holder")
        taken = await take(store, kind, "k", tok, rec)
        assert (await take(store, kind, "k", tok, record("retry"))).fencing_token == taken.fencing_token
        if kind == "fair":
            assert [state.kind for state in await store.describe("k")] == ["fair"]  # without waiters too
            assert not (await take(store, "fair", "k", token(), record("waiter"), waiter="w1")).acquired
        state = state_of(await store.describe("k"), kind)
        held = by_token(state)
        assert held[tok] == HolderState(tok, rec, held[tok].remaining, taken.fencing_token, 1)
        assert (state.fencing_token, state.waiters) == (taken.fencing_token, 1 if kind == "fair" else 0)
        assert await store.release("k", tok, kind) == RELEASED
        assert await store.describe("k") == []

    on_any(scenario)


def test_every_reader_is_described_with_its_own_record(on_any: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        readers = {token(): record(f"reader-{i}") for i in range(3)}
        readers[token()] = ""  # a reader that sent no record
        fences = {tok: (await take(store, "read", "rw", tok, rec)).fencing_token for tok, rec in readers.items()}
        first = next(iter(readers))
        assert (await take(store, "read", "rw", first, record("retry"))).fencing_token == fences[first]
        held = by_token(state_of(await store.describe("rw"), "read"))
        assert {tok: (h.owner, h.fencing_token, h.weight) for tok, h in held.items()} == {
            tok: (rec, fences[tok], 1) for tok, rec in readers.items()
        }
        assert await store.release("rw", first, "read") == RELEASED
        assert first not in by_token(state_of(await store.describe("rw"), "read"))
        assert not raw.hexists(store.rw_keys("rw")["fences"], first)

    on_any(scenario)


def test_every_semaphore_holder_is_described_with_its_record_and_weight(on_any: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        holds = {token(): (record("a"), 2), token(): (record("b"), 1), token(): ("", 2)}
        fences = {}
        for tok, (rec, weight) in holds.items():
            fences[tok] = (await take(store, "semaphore", "s", tok, rec, permits=5, weight=weight)).fencing_token
        first = next(iter(holds))  # a retry keeps the first record and weight
        retry = await take(store, "semaphore", "s", first, record("retry"), permits=5, weight=1)
        assert retry.fencing_token == fences[first]
        state = state_of(await store.describe("s"), "semaphore")
        assert (state.holders, state.permits, state.fencing_token) == (3, 5, max(fences.values()))
        assert {tok: (h.owner, h.fencing_token, h.weight) for tok, h in by_token(state).items()} == {
            tok: (rec, fences[tok], weight) for tok, (rec, weight) in holds.items()
        }
        assert await store.permits("s") == (5, 5)
        rec, _ = holds[first]  # the record rides with the fencing token
        assert raw.hget(sem_keys(store, "s")[0], first) == f"{fences[first]} {rec}".encode()

    on_any(scenario)


def test_a_multi_key_lock_records_its_owner_on_every_key(on_redis: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        tok, rec = token(), record("multi")
        taken = await store.acquire(AcquireRequest("lock", ("a", "b"), tok, LONG, owner=rec))
        for key, fence in zip(("a", "b"), taken.fencing_tokens, strict=True):
            [holder] = state_of(await store.describe(key), "lock").held_by
            assert (holder.token, holder.owner, holder.fencing_token) == (tok, rec, fence)

    on_redis(scenario)


def test_redlock_records_the_owner_on_every_node(lock_server: LockServer, namespace: str) -> None:
    nodes = [RedisStore.from_url(lock_server.url, namespace=f"{namespace}n{i}:") for i in range(3)]
    redlock = RedlockStore(nodes)
    try:
        tok, rec = token(), record("redlock")
        assert redlock.acquire(AcquireRequest("lock", ("r",), tok, LONG, owner=rec)).acquired
        for node in nodes:
            assert node.describe("r")[0].held_by[0][:2] == (tok, rec)
    finally:
        redlock.close()


# -- weights --


def test_a_weighted_request_takes_all_its_permits_or_none(on_any: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        for _ in range(2):
            assert (await take(store, "semaphore", "w", token(), record("one"), permits=4)).acquired
        greedy = token()
        busy = await take(store, "semaphore", "w", greedy, record("greedy"), permits=4, weight=3)
        assert not busy.acquired
        assert busy.holder_ttl is not None
        assert await store.permits("w") == (4, 2)
        assert greedy not in by_token(state_of(await store.describe("w"), "semaphore"))
        assert raw.zscore(store.semaphore_key("w"), greedy) is None
        assert not any(raw.hexists(name, greedy) for name in sem_keys(store, "w"))
        assert (await take(store, "semaphore", "w", token(), "", permits=4, weight=2)).acquired
        assert await store.permits("w") == (4, 4)  # in use: the weights summed
        assert not (await take(store, "semaphore", "w", token(), "", permits=4)).acquired

    on_any(scenario)


def test_a_request_for_more_permits_than_there_are_is_refused_before_any_io(commands: Any) -> None:
    with commands.assert_none():
        for bad in (
            AcquireRequest("semaphore", ("s",), token(), LONG, permits=2, weight=3),
            AcquireRequest("semaphore", ("s",), token(), LONG, permits=2, weight=0),
            AcquireRequest("lock", ("s",), token(), LONG, weight=2),
        ):
            with pytest.raises(ConfigurationError):
                checked_request(bad, "ns:", "redis")


class WakeUps:
    """The wake-up messages of some waiters of ``key`` (a subscription of our own)."""

    def __init__(self, raw: Any, store: Any, key: str, waiters: list[str]) -> None:
        self.pubsub = raw.pubsub()
        self.channels = {store.wake_channel(key, waiter).encode(): waiter for waiter in waiters}
        self.pubsub.subscribe(*self.channels)
        for _ in waiters:
            assert self.pubsub.get_message(timeout=5)["type"] == "subscribe"

    def woken(self, count: int) -> list[str]:
        """The first ``count`` waiters woken (waits for them; a deadlock guard of 15 s)."""
        got: list[str] = []
        deadline = time.monotonic() + 15
        while len(got) < count and time.monotonic() < deadline:
            message = self.pubsub.get_message(timeout=0.5)
            if message is not None:
                got.append(self.channels[message["channel"]])
        return got

    def close(self) -> None:
        self.pubsub.close()


async def queue_two_waiters(store: Any, raw: Any, key: str) -> tuple[WakeUps, list[str]]:
    """Two waiters of one permit each, queued (and listening) on the full semaphore ``key``."""
    waiters = ["w1", "w2"]
    tokens = [token(), token()]
    for tok, waiter in zip(tokens, waiters, strict=True):
        assert not (await take(store, "semaphore", key, tok, permits=2, waiter=waiter)).acquired
    return WakeUps(raw, store, key, waiters), tokens


def test_releasing_a_weight_2_hold_lets_two_waiters_in(on_redis: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        heavy = token()
        assert (await take(store, "semaphore", "s", heavy, permits=2, weight=2)).acquired
        wake_ups, tokens = await queue_two_waiters(store, raw, "s")
        try:
            assert await store.release("s", heavy, "semaphore") == RELEASED
            assert sorted(wake_ups.woken(2)) == ["w1", "w2"]
        finally:
            wake_ups.close()
        for tok, waiter in zip(tokens, ["w1", "w2"], strict=True):
            assert (await take(store, "semaphore", "s", tok, permits=2, waiter=waiter)).acquired
        assert await store.permits("s") == (2, 2)

    on_redis(scenario)


def test_releasing_a_hold_of_one_permit_wakes_one_waiter(on_redis: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        light = [token(), token()]
        for tok in light:
            assert (await take(store, "semaphore", "s", tok, permits=2)).acquired
        wake_ups, _ = await queue_two_waiters(store, raw, "s")
        try:
            assert await store.release("s", light[0], "semaphore") == RELEASED
            assert wake_ups.woken(1) == ["w1"]
            assert raw.lrange(store.semaphore_key("s") + ":waiters", 0, -1) == [b"w2"]  # not woken
            assert await store.add_permits("s", 1) == (3, 1)  # one more permit: one more wake-up
            assert wake_ups.woken(1) == ["w2"]
        finally:
            wake_ups.close()

    on_redis(scenario)


def test_expired_weighted_holds_free_their_permits_and_leave_nothing(on_redis: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        short = token()
        assert (await take(store, "semaphore", "s", short, record("short"), permits=4, weight=3, lease=0.2)).acquired
        deadline = time.monotonic() + 15  # polls the store's state: nothing announces an expiry
        while (await store.permits("s"))[1] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await store.permits("s") == (4, 0)
        assert await store.describe("s") == []
        assert (await take(store, "semaphore", "s", token(), "", permits=4, weight=4)).acquired
        assert not any(raw.hexists(name, short) for name in sem_keys(store, "s"))  # dropped by that acquisition

    on_redis(scenario)


def test_a_renewal_extends_the_records_and_weights_with_the_hold(on_redis: Any) -> None:
    async def scenario(store: Any, raw: Any) -> None:
        sem, reader = token(), token()
        assert (await take(store, "semaphore", "s", sem, record("s"), permits=3, weight=2, lease=1.0)).acquired
        assert (await take(store, "read", "r", reader, record("r"), lease=1.0)).acquired
        items = [RenewItem("s", sem, LONG, "semaphore"), RenewItem("r", reader, LONG, "read")]
        assert await store.renew(items) == [True, True]
        for name in (*sem_keys(store, "s"), store.rw_keys("r")["fences"]):
            assert raw.pttl(name) > 1000, name  # the 1 s lease became 60 s

    on_redis(scenario)


# -- add_permits --


def test_add_permits(on_any: Any) -> None:
    assert issubclass(RedisStore, AddsPermits)
    assert issubclass(AsyncRedisStore, AsyncAdminStore)

    async def scenario(store: Any, raw: Any) -> None:
        assert await store.add_permits("fresh", 3) == (3, 0)  # a semaphore never used starts from 0
        assert await store.add_permits("never", -2) == (0, 0)
        assert (await take(store, "semaphore", "s", token(), permits=3, weight=2)).acquired
        assert await store.add_permits("s", -2) == (1, 2)  # holders keep theirs
        assert not (await take(store, "semaphore", "s", token(), permits=1)).acquired
        assert await store.add_permits("s", -5) == (0, 2)  # never below 0
        assert await store.add_permits("s", 4) == (4, 2)
        assert (await take(store, "semaphore", "s", token(), permits=4, weight=2)).acquired
        assert await store.permits("s") == (4, 4)
        for bad in (1.5, True, "1"):
            with pytest.raises(TypeError):
                await store.add_permits("s", bad)

    on_any(scenario)


# -- force_release --


def test_force_release_names_every_holder_then_evicts_them(on_any: Any) -> None:
    """Lock, semaphore and readers under one key: described with their records, all evicted
    (renewal and release say not-owner), records and weights deleted, fences keep growing."""

    async def scenario(store: Any, raw: Any) -> None:
        holds = [("lock", token(), 1), ("semaphore", token(), 2), ("semaphore", token(), 1), ("read", token(), 1)]
        fences = {}
        for kind, tok, weight in holds:
            taken = await take(
                store, kind, "busy", tok, record(tok), permits=4 if kind == "semaphore" else None, weight=weight
            )
            fences[tok] = taken.fencing_token
        states = await store.describe("busy")
        named = {
            h.token: (h.owner, h.weight)
            for kind in ("lock", "semaphore", "read")
            for h in state_of(states, kind).held_by
        }
        assert named == {tok: (record(tok), weight) for _, tok, weight in holds}
        assert await store.force_release("busy")
        assert await store.describe("busy") == []
        assert not raw.exists(*sem_keys(store, "busy"), store.rw_keys("busy")["fences"])
        assert not await store.force_release("busy")
        items = [RenewItem("busy", tok, LONG, kind) for kind, tok, _ in holds]
        assert await store.renew(items) == [False] * len(holds)
        for kind, tok, _ in holds:
            assert await store.release("busy", tok, kind) == NOT_OWNER
        for kind in ("lock", "semaphore", "read"):
            taken = await take(store, kind, "busy", token(), permits=4 if kind == "semaphore" else None)
            assert taken.fencing_token > max(fences.values())

    on_any(scenario)


# -- holds written before owner records were kept --


def test_holds_written_without_a_record_are_described_renewed_and_released(on_redis: Any) -> None:
    """Values of the previous version (an owner field holding 1; semaphore holders and readers
    without record or weight entries), and holds taken with an empty record."""

    async def scenario(store: Any, raw: Any) -> None:
        now_ms = int(raw.time()[0]) * 1000
        lock, writer, sem, reader, fresh = (token() for _ in range(5))
        raw.hset(store.lock_key("old"), mapping={lock: "1", "fence": "7"})
        raw.hset(store.rw_keys("old")["writer"], mapping={writer: "1", "fence": "8"})
        raw.zadd(store.semaphore_key("old"), {sem: now_ms + 30_000})
        raw.hset(store.semaphore_key("old") + ":fences", sem, "9")
        raw.zadd(store.rw_keys("other")["readers"], {reader: now_ms + 30_000})
        raw.hset(store.rw_keys("other")["fences"], reader, "10")
        for name in raw.keys(store.namespace + "*"):
            raw.pexpire(name, 30_000)
        states = await store.describe("old") + await store.describe("other")
        expected = {"lock": (lock, 7), "write": (writer, 8), "semaphore": (sem, 9), "read": (reader, 10)}
        assert {s.kind: (s.held_by[0].token, s.held_by[0].fencing_token) for s in states} == expected
        assert {(h.owner, h.weight) for s in states for h in s.held_by} == {("", 1)}
        items = [
            RenewItem("old", lock, LONG),
            RenewItem("old", writer, LONG, "write"),
            RenewItem("old", sem, LONG, "semaphore"),
        ]
        assert await store.renew([*items, RenewItem("other", reader, LONG, "read")]) == [True] * 4
        for key, kind, tok in (("old", "lock", lock), ("old", "write", writer), ("old", "semaphore", sem)):
            assert await store.release(key, tok, kind) == RELEASED
        assert await store.release("other", reader, "read") == RELEASED
        assert (await take(store, "lock", "fresh", fresh, "")).acquired
        assert raw.hget(store.lock_key("fresh"), fresh) == b"1"  # as the previous version wrote it
        assert state_of(await store.describe("fresh"), "lock").held_by[0].owner == ""

    on_redis(scenario)


def test_a_foreign_value_at_the_weights_fails_acquisitions_and_leaves_nothing(on_redis: Any) -> None:
    """The weights decide who gets in: a semaphore whose weights hash holds another type
    takes no hold (the error names the key), and its holders still release."""

    async def scenario(store: Any, raw: Any) -> None:
        holder = token()
        assert (await take(store, "semaphore", "s", holder, record("s"), permits=3)).acquired
        weights = sem_keys(store, "s")[1]
        raw.set(weights, "foreign", px=30_000)
        with pytest.raises(BackendError) as info:
            await take(store, "semaphore", "s", token(), record("t"), permits=3)
        assert info.value.key == "s"
        assert raw.zcard(store.semaphore_key("s")) == 1
        with pytest.raises(BackendError):
            await store.release("s", holder, "semaphore")
        raw.delete(weights)
        assert await store.release("s", holder, "semaphore") == RELEASED

    on_redis(scenario)


def test_describe_lists_more_holders_than_one_script_call_unpacks(on_redis: Any) -> None:
    """1,500 semaphore holders: describe reads their entries in chunks (Lua's unpack limit)."""

    async def scenario(store: Any, raw: Any) -> None:
        tokens = [token() for _ in range(1500)]
        for i, tok in enumerate(tokens):
            assert (await take(store, "semaphore", "many", tok, record(str(i)), permits=2000)).acquired
        held = by_token(state_of(await store.describe("many"), "semaphore"))
        assert [held[tok].owner for tok in tokens] == [record(str(i)) for i in range(1500)]

    on_redis(scenario)
