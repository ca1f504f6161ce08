"""The operator part of the Redis store (``AdminStore``: ``describe``, ``held_keys``,
``force_release``) against a real server: what each kind of lock looks like from outside,
finding held keys with SCAN, and a forced release that wakes waiters, tells the holder it
lost its lease and keeps fencing tokens increasing."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import LockClient, LockLost
from lockaspect.backends.base import AdminStore, KeyState
from lockaspect.backends.redis import AsyncRedisStore, RedisStore
from lockaspect.testing import LockServer

LONG = 60.0


def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def store(lock_server: LockServer, namespace: str) -> Iterator[RedisStore]:
    made = RedisStore.from_url(lock_server.url, namespace=namespace)
    yield made
    made.close()


class WakeMessages:
    """Every wake-up message published for ``keys`` (a pattern subscription of our own)."""

    def __init__(self, raw: Any, store: RedisStore, *keys: str) -> None:
        self.pubsub = raw.pubsub()
        for key in keys:
            self.pubsub.psubscribe(store.wake_channel(key, "*"))
        for _ in keys:
            assert self.pubsub.get_message(timeout=5)["type"] == "psubscribe"

    def channels(self, timeout: float = 5.0) -> set[str]:
        got: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.pubsub.get_message(timeout=0.1)
            if message is None:
                if got:
                    break
                continue
            got.add(message["channel"].decode())
        self.pubsub.close()
        return got


def one(states: list[KeyState]) -> KeyState:
    assert len(states) == 1, states
    return states[0]


class TestDescribe:
    def test_the_store_is_an_admin_store(self, store: RedisStore) -> None:
        assert isinstance(store, AdminStore)

    def test_a_free_key_has_nothing(self, store: RedisStore) -> None:
        assert store.describe("free") == []

    def test_a_lock(self, store: RedisStore) -> None:
        taken = store.lock_acquire("k", token(), LONG)
        state = one(store.describe("k"))
        assert (state.key, state.kind, state.holders, state.fencing_token) == ("k", "lock", 1, taken.fencing_token)
        assert state.remaining is not None
        assert LONG - 5 < state.remaining <= LONG
        assert (state.waiters, state.permits) == (0, None)

    def test_a_lock_with_waiters(self, store: RedisStore) -> None:
        store.lock_acquire("k", token(), LONG)
        store.lock_acquire("k", token(), LONG, waiter="w1")
        store.lock_acquire("k", token(), LONG, waiter="w2")
        assert one(store.describe("k")).waiters == 2

    def test_a_fair_lock_with_waiters(self, store: RedisStore) -> None:
        store.lock_acquire("f", token(), LONG, fair=True)
        store.lock_acquire("f", token(), LONG, waiter="w1", fair=True)
        state = one(store.describe("f"))
        assert (state.kind, state.holders, state.waiters) == ("fair", 1, 1)

    def test_a_semaphore(self, store: RedisStore) -> None:
        first = store.sem_acquire("s", token(), LONG, 3)
        second = store.sem_acquire("s", token(), 10.0, 3)
        state = one(store.describe("s"))
        assert (state.kind, state.holders, state.permits, state.waiters) == ("semaphore", 2, 3, 0)
        assert state.fencing_token == max(first.fencing_token, second.fencing_token)
        assert state.remaining is not None
        assert LONG - 5 < state.remaining <= LONG

    def test_expired_permits_are_not_counted(self, store: RedisStore) -> None:
        store.sem_acquire("s", token(), 0.05, 2)
        time.sleep(0.1)
        assert store.describe("s") == []
        store.sem_acquire("s", token(), LONG, 2)
        assert one(store.describe("s")).holders == 1

    def test_readers_and_a_writer(self, store: RedisStore) -> None:
        store.rw_acquire("rw", token(), LONG, "read")
        store.rw_acquire("rw", token(), LONG, "read")
        state = one(store.describe("rw"))
        assert (state.kind, state.holders) == ("read", 2)
        assert state.fencing_token is not None
        assert state.fencing_token > 0
        store.rw_acquire("other", token(), LONG, "write")
        state = one(store.describe("other"))
        assert (state.kind, state.holders) == ("write", 1)
        assert state.remaining is not None
        assert state.remaining > LONG - 5

    def test_one_entry_per_kind_held_under_one_key(self, store: RedisStore) -> None:
        store.lock_acquire("all", token(), LONG)
        store.sem_acquire("all", token(), LONG, 2)
        store.rw_acquire("all", token(), LONG, "write")
        assert sorted(state.kind for state in store.describe("all")) == ["lock", "semaphore", "write"]

    def test_a_foreign_value_counts_as_one_holder(self, store: RedisStore, raw: Any) -> None:
        raw.set(store.lock_key("foreign"), "x", px=30_000)
        state = one(store.describe("foreign"))
        assert (state.kind, state.holders, state.fencing_token) == ("lock", 1, None)

    def test_through_a_client_block(self, make_client: Callable[..., LockClient]) -> None:
        client = make_client()
        store = client.backend
        assert isinstance(store, RedisStore)
        with client.lock("order:42") as lease:
            state = one(store.describe("order:42"))
            assert (state.kind, state.fencing_token) == ("lock", lease.fencing_token)
        assert store.describe("order:42") == []
        with client.semaphore("pool", permits=2):
            assert one(store.describe("pool")).kind == "semaphore"
        with client.rw_lock("doc").read():
            assert one(store.describe("doc")).kind == "read"


class TestHeldKeys:
    def test_patterns(self, store: RedisStore) -> None:
        store.lock_acquire("order:1", token(), LONG)
        store.lock_acquire("order:2", token(), LONG)
        store.sem_acquire("order:2", token(), LONG, 2)  # the same user key twice: reported once
        store.rw_acquire("user:7", token(), LONG, "read")
        store.rw_acquire("user:8", token(), LONG, "write")
        store.sem_acquire("pool", token(), LONG, 1)
        assert sorted(store.held_keys()) == ["order:1", "order:2", "pool", "user:7", "user:8"]
        assert sorted(store.held_keys("order:*")) == ["order:1", "order:2"]
        assert sorted(store.held_keys("user:?")) == ["user:7", "user:8"]
        assert sorted(store.held_keys("user:[7]")) == ["user:7"]
        assert list(store.held_keys("nothing*")) == []

    def test_only_what_is_held_now(self, store: RedisStore) -> None:
        mine = token()
        store.lock_acquire("gone", mine, LONG)
        store.lock_release("gone", mine)  # its fence counter stays behind
        store.sem_acquire("expired", token(), 0.05, 1)
        store.lock_acquire("queued", mine, LONG, fair=True)
        store.lock_acquire("queued", token(), LONG, waiter="w", fair=True)
        store.lock_release("queued", mine, fair=True)  # its fair queue stays behind
        store.lock_acquire("held", token(), LONG)
        time.sleep(0.1)
        assert sorted(store.held_keys()) == ["held"]

    def test_many_keys_over_several_scan_pages(self, store: RedisStore) -> None:
        keys = {f"bulk:{i}" for i in range(1200)}
        for key in keys:
            store.lock_acquire(key, token(), LONG)
        assert sorted(store.held_keys("bulk:*")) == sorted(keys)

    def test_the_namespace_is_literal(self, lock_server: LockServer, namespace: str) -> None:
        starred = RedisStore.from_url(lock_server.url, namespace=namespace + "a*[")
        other = RedisStore.from_url(lock_server.url, namespace=namespace + "ab[")
        try:
            starred.lock_acquire("k1", token(), LONG)
            other.lock_acquire("k2", token(), LONG)
            assert list(starred.held_keys()) == ["k1"]
            assert list(other.held_keys()) == ["k2"]
        finally:
            starred.close()
            other.close()

    def test_a_pattern_with_braces_is_refused(self, store: RedisStore) -> None:
        with pytest.raises(ValueError, match="cannot contain"):
            list(store.held_keys("{x}"))


class TestForceRelease:
    def test_every_kind_is_deleted_and_fences_stay(self, store: RedisStore, raw: Any) -> None:
        store.lock_acquire("k", token(), LONG)
        store.sem_acquire("k", token(), LONG, 2)
        store.rw_acquire("k", token(), LONG, "read")
        fence = int(raw.get(store.fence_key("k")))
        assert store.force_release("k") is True
        assert store.describe("k") == []
        assert list(store.held_keys()) == []
        assert int(raw.get(store.fence_key("k"))) == fence
        assert store.permits("k") == (2, 0)  # the number of permits is configuration: kept
        assert store.force_release("k") is False

    def test_nothing_held(self, store: RedisStore) -> None:
        assert store.force_release("never") is False

    # A block whose lease was lost raises LockLost on exit, chained to whatever the block
    # raised: the tests below record inside such blocks and assert after them.

    def test_the_holder_loses_its_lease_and_tokens_keep_increasing(
        self, make_client: Callable[..., LockClient]
    ) -> None:
        client = make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        store = client.backend
        assert isinstance(store, RedisStore)
        seen: dict[str, Any] = {}

        def hold() -> None:
            with client.lock("ledger") as lease:
                seen["lease"] = lease
                seen["forced"] = store.force_release("ledger")
                deadline = time.monotonic() + 5
                while not lease.lost and time.monotonic() < deadline:
                    time.sleep(0.02)
                seen["lost while held"] = lease.lost_reason  # told by the watchdog's next renewal

        with pytest.raises(LockLost) as caught:
            hold()
        lease = seen.pop("lease")
        assert seen == {"forced": True, "lost while held": "not-owner"}
        assert caught.value.reason == "not-owner"
        with client.lock("ledger") as after:
            assert after.fencing_token > lease.fencing_token

    def test_a_fixed_lease_learns_it_at_release(self, make_client: Callable[..., LockClient]) -> None:
        client = make_client()
        store = client.backend
        assert isinstance(store, RedisStore)
        forced: list[Any] = []

        def hold() -> None:
            with client.lock("fixed", lease=LONG) as lease:
                forced.append(lease)
                forced.append(store.force_release("fixed"))
                forced.append(lease.lost)  # nothing renews a fixed lease: not known yet

        with pytest.raises(LockLost) as caught:
            hold()
        lease = forced.pop(0)
        assert forced == [True, False]
        assert caught.value.__cause__ is None
        assert lease.lost

    @pytest.mark.parametrize("fair", [False, True])
    def test_a_waiter_is_woken(self, make_client: Callable[..., LockClient], raw: Any, fair: bool) -> None:
        holder, waiter = make_client(), make_client()
        store = holder.backend
        assert isinstance(store, RedisStore)
        got: list[bool] = []
        seen: dict[str, Any] = {}

        def wait_for_it() -> None:
            with waiter.lock("busy", wait=30, fair=fair):
                got.append(True)

        def hold() -> None:
            with holder.lock("busy", lease=LONG):
                thread = threading.Thread(target=wait_for_it)
                thread.start()
                deadline = time.monotonic() + 5
                while one(store.describe("busy")).waiters == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                seen["waiters"] = one(store.describe("busy")).waiters
                messages = WakeMessages(raw, store, "busy")
                seen["forced"] = store.force_release("busy")
                seen["wake-ups"] = messages.channels()
                thread.join(10)

        with pytest.raises(LockLost) as caught:
            hold()
        assert caught.value.__cause__ is None
        assert (seen["waiters"], seen["forced"]) == (1, True)
        [channel] = seen["wake-ups"]  # one wake-up, to the first waiter still listening
        assert channel.startswith(store.wake_channel("busy", ""))
        assert got, "the waiter took the lock"

    def test_semaphore_and_read_write_waiters_are_woken(self, make_client: Callable[..., LockClient], raw: Any) -> None:
        holder, waiter = make_client(), make_client()
        store = holder.backend
        assert isinstance(store, RedisStore)
        woken: list[str] = []
        seen: dict[str, Any] = {}

        def wait(name: str, block: Any) -> None:
            with block:
                woken.append(name)

        threads = [
            threading.Thread(target=wait, args=("sem", waiter.semaphore("sem", permits=1, wait=30))),
            threading.Thread(target=wait, args=("rw", waiter.rw_lock("rw").read(wait=30))),
        ]

        def write() -> None:
            with holder.rw_lock("rw").write(lease=LONG):
                for thread in threads:
                    thread.start()
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and not all(
                    one(store.describe(key)).waiters for key in ("sem", "rw")
                ):
                    time.sleep(0.01)
                messages = WakeMessages(raw, store, "sem", "rw")
                seen["forced"] = (store.force_release("sem"), store.force_release("rw"))
                seen["woken keys"] = {channel.split(":wake:")[0] for channel in messages.channels()}
                for thread in threads:
                    thread.join(10)

        def hold() -> None:
            with holder.semaphore("sem", permits=1, lease=LONG):
                with pytest.raises(LockLost) as inner:
                    write()
                seen["inner cause"] = inner.value.__cause__

        with pytest.raises(LockLost):
            hold()
        assert seen == {
            "forced": (True, True),
            "woken keys": {store.lock_key("sem"), store.lock_key("rw")},
            "inner cause": None,
        }
        assert sorted(woken) == ["rw", "sem"]


class TestAsyncTwin:
    def test_describe_held_keys_force_release(self, lock_server: LockServer, namespace: str) -> None:
        async def scenario() -> None:
            store = AsyncRedisStore.from_url(lock_server.url, namespace=namespace)
            try:
                taken = await store.lock_acquire("a:1", token(), LONG)
                await store.sem_acquire("a:2", token(), LONG, 2)
                [state] = await store.describe("a:1")
                assert (state.kind, state.fencing_token) == ("lock", taken.fencing_token)
                assert sorted([key async for key in store.held_keys("a:*")]) == ["a:1", "a:2"]
                assert await store.force_release("a:1") is True
                assert await store.force_release("a:1") is False
                assert [key async for key in store.held_keys()] == ["a:2"]
                again = await store.lock_acquire("a:1", token(), LONG)
                assert again.fencing_token > taken.fencing_token
            finally:
                await store.aclose()

        asyncio.run(scenario())
