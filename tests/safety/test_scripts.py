"""The Lua scripts under hostile conditions, on real servers: a server user without ``+time``,
tokens chosen to collide with the fencing-token field, values of another type written over
lockaspect's keys, a chunk of a renewal batch refused by the server, and another client
flushing the script cache in a loop.

Each test states what a script must never do: leave a partial write behind when a command
fails, let a token pass for the owner of the fencing token, fail a whole renewal batch for
one item, or let NOSCRIPT reach a caller.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

import lockaspect.backends.redis
from lockaspect import BackendError, LockClient, LockLost
from lockaspect.backends.base import ReleaseResult, RenewItem
from lockaspect.backends.redis import AsyncRedisBackend, RedisBackend, load_script
from lockaspect.fencing import RedisFence
from lockaspect.lease import Lease
from lockaspect.testing import LockServer

LONG = 30.0
#: A fencing token seeded from the server clock (microseconds since the epoch) is above this.
CLOCK_SEEDED = 10**15
#: Tokens a caller may pass that resemble the fencing-token field or its escape.
TRICKY_TOKENS = ["fence", "#fence", "##fence", "#", "", "o:x", "o:fence"]


def wait_for(condition: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``condition`` until it is true; for states no event announces (counters, keys)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        threading.Event().wait(0.005)


def lock_keys_left(raw: Any, namespace: str) -> list[bytes]:
    """The keys under ``namespace`` except those that outlive locks on purpose: the fence
    counters and a semaphore's number of permits."""
    return sorted(key for key in raw.keys(namespace + "*") if not key.endswith((b":fence", b":permits")))


def with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def backend(lock_server: LockServer, namespace: str) -> Iterator[RedisBackend]:
    made = RedisBackend.from_url(lock_server.url, namespace=namespace)
    yield made
    made.close()


@pytest.fixture
def no_time_url(lock_server: LockServer, raw: Any) -> Iterator[str]:
    """The session server's URL for a user with every right but ``TIME``; deleted after."""
    user, password = f"no-time-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    raw.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-time")
    try:
        yield with_user(lock_server.url, user, password)
    finally:
        raw.execute_command("ACL", "DELUSER", user)


def token() -> str:
    return uuid.uuid4().hex


# -- 1. fencing tokens: no partial write when TIME is refused ------------------------------


def _take(backend: RedisBackend, kind: str, key: str, owner: str) -> list[int]:
    """Acquire ``key`` as ``kind``; its fencing token(s), or raise if it was not acquired."""
    if kind == "multi":
        multi = backend.multi_acquire([key, key + ":2"], owner, LONG)
        assert multi.acquired
        return list(multi.fencing_tokens)
    if kind == "semaphore":
        result = backend.sem_acquire(key, owner, LONG, 2)
    elif kind in ("read", "write"):
        result = backend.rw_acquire(key, owner, LONG, kind)
    else:
        result = backend.lock_acquire(key, owner, LONG, waiter="w1", fair=kind == "fair")
    assert result.acquired
    return [result.fencing_token]


class TestFenceSeed:
    @pytest.mark.parametrize("kind", ["lock", "fair", "multi", "semaphore", "read", "write"])
    def test_an_acquisition_refused_time_writes_nothing_and_the_next_fence_is_clock_seeded(
        self, kind: str, no_time_url: str, backend: RedisBackend, raw: Any, namespace: str
    ) -> None:
        """A user without +time fails to acquire and leaves no key; the next fence still starts from the clock."""
        denied = RedisBackend.from_url(no_time_url, namespace=namespace)
        try:
            with pytest.raises(BackendError):
                _take(denied, kind, "seeded", token())
        finally:
            denied.close()
        assert raw.keys(namespace + "*") == []  # no fence counter, no queue, no lock
        fences = _take(backend, kind, "seeded", token())
        assert all(fence > CLOCK_SEEDED for fence in fences), fences

    def test_a_client_whose_user_lacks_time_leaves_the_fence_counter_unborn(
        self, no_time_url: str, make_client: Callable[..., LockClient], raw: Any, namespace: str
    ) -> None:
        """Through LockClient: the refused acquisition raises BackendError, then a full user's fence is clock-seeded."""
        denied = make_client(url=no_time_url)
        with pytest.raises(BackendError), denied.lock("ledger"):
            pass
        assert raw.keys(namespace + "*") == []
        with make_client().lock("ledger") as lease:
            assert lease.fencing_token > CLOCK_SEEDED


def test_every_script_that_reads_the_clock_asks_for_effects_replication_first() -> None:
    """Redis 6.2 with ``lua-replicate-commands no`` refuses a write after TIME unless the
    script called ``redis.replicate_commands()`` before any command: each script that reads
    TIME starts with that call (its first statement, guarded for servers without it)."""
    lua = Path(lockaspect.backends.redis.__file__).parent / "lua"
    clocked = []
    for path in sorted(lua.glob("*.lua")):
        if path.name == "lib.lua":
            continue
        source = load_script(path.name)
        if "'TIME'" not in source:
            continue
        clocked.append(path.name)
        statements = [line for line in source.splitlines() if line.strip() and not line.startswith("--")]
        assert statements[:3] == ["if redis.replicate_commands then", "  redis.replicate_commands()", "end"], path.name
    assert "acquire.lua" in clocked
    assert "sem_acquire.lua" in clocked


# -- 2. no token can pass for the owner of the fencing token -------------------------------


class TestOwnerFields:
    @pytest.mark.parametrize("tricky", TRICKY_TOKENS)
    def test_a_foreign_token_resembling_the_fence_field_owns_nothing(
        self, tricky: str, backend: RedisBackend, raw: Any
    ) -> None:
        """On a held lock, such a token is busy on acquire and not the owner on re-entry, renewal and release."""
        holder = token()
        fence = backend.lock_acquire("held", holder, LONG).fencing_token
        lock = backend.lock_key("held")
        before = raw.hgetall(lock)

        busy = backend.lock_acquire("held", tricky, LONG)
        assert not busy.acquired
        assert busy.holder_ttl is not None
        assert busy.holder_ttl > 0
        assert not backend.lock_acquire("held", tricky, LONG, waiter="w1", fair=True).acquired
        multi = backend.multi_acquire(["free", "held"], tricky, LONG)
        assert (multi.acquired, multi.busy) == (False, "held")
        assert not backend.lock_reenter("held", tricky)
        assert backend.renew([("held", tricky, LONG)]) == [False]
        assert backend.release("held", tricky) == ReleaseResult.NOT_OWNER
        assert backend.lock_release("held", tricky, fair=True) == ReleaseResult.NOT_OWNER

        assert raw.hgetall(lock) == before
        assert not raw.exists(backend.lock_key("free"))
        assert backend.release("held", holder) == ReleaseResult.RELEASED
        assert backend.lock_acquire("held", holder, LONG).fencing_token == fence + 1

    @pytest.mark.parametrize("tricky", TRICKY_TOKENS)
    def test_a_token_resembling_the_fence_field_holds_a_lock_like_any_other(
        self, tricky: str, backend: RedisBackend, raw: Any
    ) -> None:
        """Such a token takes a free lock, re-enters (a check) without touching the fence, renews and releases."""
        lock = backend.lock_key("mine")
        taken = backend.lock_acquire("mine", tricky, LONG)
        assert taken.acquired
        assert taken.fencing_token > CLOCK_SEEDED
        assert backend.lock_acquire("mine", tricky, LONG).fencing_token == taken.fencing_token  # a retry
        assert backend.lock_reenter("mine", tricky)
        assert raw.hget(lock, "fence") == str(taken.fencing_token).encode()
        assert not backend.lock_acquire("mine", token(), LONG).acquired
        assert backend.renew([("mine", tricky, LONG)]) == [True]
        multi = backend.multi_acquire(["mine"], tricky, LONG)
        assert multi.fencing_tokens == (taken.fencing_token,)
        assert raw.hget(lock, "fence") == str(taken.fencing_token).encode()
        assert backend.release("mine", tricky) == ReleaseResult.RELEASED
        assert not raw.exists(lock)

    @pytest.mark.parametrize("tricky", TRICKY_TOKENS)
    def test_a_read_write_lock_writer_cannot_be_named_by_such_a_token(
        self, tricky: str, backend: RedisBackend, raw: Any
    ) -> None:
        """Against a held writer, such a token neither writes, downgrades, re-enters, renews nor releases."""
        holder = token()
        assert backend.rw_acquire("rw", holder, LONG, "write").acquired
        writer = backend.rw_keys("rw")["writer"]
        before = raw.hgetall(writer)

        assert not backend.rw_acquire("rw", tricky, LONG, "write").acquired
        assert not backend.rw_acquire("rw", token(), LONG, "read", below=tricky).acquired  # no downgrade
        assert not backend.rw_held("rw", tricky, "write")
        assert backend.renew([("rw", tricky, LONG, "write")]) == [False]
        assert backend.rw_release("rw", tricky, "write") == ReleaseResult.NOT_OWNER
        assert raw.hgetall(writer) == before

        assert backend.rw_release("rw", holder, "write") == ReleaseResult.RELEASED
        fence = backend.rw_acquire("rw", tricky, LONG, "write").fencing_token
        assert backend.rw_held("rw", tricky, "write")
        if tricky:  # below="" means no write lock held
            assert backend.rw_acquire("rw", tricky, LONG, "read", below=tricky).acquired  # its own downgrade
        assert backend.renew([("rw", tricky, LONG, "write")]) == [True]
        assert raw.hget(writer, "fence") == str(fence).encode()
        assert backend.rw_release("rw", tricky, "write") == ReleaseResult.RELEASED


# -- 3. a value of another type is not ours; one bad item fails only itself ----------------


class TestForeignValues:
    def test_a_lock_key_overwritten_by_a_string_is_busy_and_never_ours(self, backend: RedisBackend, raw: Any) -> None:
        """Every lock script answers busy or not-owner for a foreign string, with its TTL as the hint."""
        owner = token()
        lock = backend.lock_key("taken")
        raw.set(lock, "foreign", px=20_000)

        busy = backend.lock_acquire("taken", owner, LONG)
        assert not busy.acquired
        assert busy.holder_ttl is not None
        assert 0 < busy.holder_ttl <= 20
        assert not backend.lock_acquire("taken", owner, LONG, waiter="w1", fair=True).acquired
        multi = backend.multi_acquire(["other", "taken"], owner, LONG, waiter="w1")
        assert (multi.acquired, multi.busy) == (False, "taken")
        assert multi.holder_ttl is not None
        assert 0 < multi.holder_ttl <= 20
        assert not backend.lock_reenter("taken", owner)
        assert backend.release("taken", owner) == ReleaseResult.NOT_OWNER
        assert backend.lock_release("taken", owner, fair=True) == ReleaseResult.NOT_OWNER
        assert backend.renew([("taken", owner, LONG)]) == [False]
        assert raw.get(lock) == b"foreign"
        assert not raw.exists(backend.lock_key("other"))

        raw.set(lock, "foreign")  # no expiry
        assert backend.lock_acquire("taken", owner, LONG).holder_ttl is None
        assert backend.multi_acquire(["taken"], owner, LONG).holder_ttl is None

    def test_a_semaphore_overwritten_by_a_string_is_busy_and_never_ours(self, backend: RedisBackend, raw: Any) -> None:
        owner = token()
        holders = backend.semaphore_key("sem")
        raw.set(holders, "foreign", px=20_000)
        busy = backend.sem_acquire("sem", owner, LONG, 3, waiter="w1")
        assert not busy.acquired
        assert busy.holder_ttl is not None
        assert 0 < busy.holder_ttl <= 20
        assert backend.sem_release("sem", owner) == ReleaseResult.NOT_OWNER
        assert not backend.sem_reenter("sem", owner)
        assert backend.renew([("sem", owner, LONG, "semaphore")]) == [False]
        assert raw.get(holders) == b"foreign"
        raw.set(holders, "foreign")
        assert backend.sem_acquire("sem", owner, LONG, 3).holder_ttl is None

    @pytest.mark.parametrize("role", ["writer", "readers"])
    def test_a_read_write_lock_overwritten_by_a_string_is_busy_and_never_ours(
        self, role: str, backend: RedisBackend, raw: Any
    ) -> None:
        owner = token()
        key = backend.rw_keys("rw")[role]
        raw.set(key, "foreign", px=20_000)
        for mode in ("read", "write"):
            busy = backend.rw_acquire("rw", owner, LONG, mode, waiter="w1")
            assert not busy.acquired
            assert busy.holder_ttl is not None
            assert busy.holder_ttl > 0
            assert not backend.rw_held("rw", owner, mode)
            assert backend.rw_release("rw", owner, mode) == ReleaseResult.NOT_OWNER
            assert backend.renew([("rw", owner, LONG, mode)]) == [False]
        assert raw.get(key) == b"foreign"

    def test_an_overwritten_key_fails_only_its_own_renewal(self, backend: RedisBackend, raw: Any) -> None:
        """A batch with two overwritten items renews all the others and reports those two as not ours."""
        owner = token()
        for key in ("a", "b", "c"):
            assert backend.lock_acquire(key, owner, LONG).acquired
        assert backend.sem_acquire("s", owner, LONG, 2).acquired
        assert backend.rw_acquire("r", owner, LONG, "read").acquired
        raw.set(backend.lock_key("b"), "foreign")
        raw.set(backend.semaphore_key("s"), "foreign")
        items: list[RenewItem] = [
            ("a", owner, LONG),
            ("b", owner, LONG),
            ("c", owner, LONG),
            ("s", owner, LONG, "semaphore"),
            ("r", owner, LONG, "read"),
        ]
        assert backend.renew(items) == [True, False, True, False, True]

    def test_a_lease_whose_key_was_overwritten_is_lost_alone(
        self, client: LockClient, raw: Any, owner_value: Any
    ) -> None:
        """Through the watchdog: the overwritten lease is lost, the lease renewed with it keeps being renewed."""
        store = client.backend
        assert isinstance(store, RedisBackend)
        lost: list[Lease] = []
        fired = threading.Event()

        def on_lost(lease: Lease) -> None:
            lost.append(lease)
            fired.set()

        with client.lock("kept") as kept:

            def hold_while_overwritten() -> None:
                with client.lock("overwritten", on_lost=on_lost):
                    raw.set(store.lock_key("overwritten"), "foreign")
                    assert fired.wait(15), "the overwritten lease was not reported lost"

            with pytest.raises(LockLost) as exc_info:
                hold_while_overwritten()
            assert exc_info.value.reason == "not-owner"
            assert [lease.key for lease in lost] == ["overwritten"]
            renewals = client.stats().renewals
            wait_for(lambda: client.stats().renewals >= renewals + 3, what="three more renewals")
            assert not kept.lost
            assert raw.hget(store.lock_key("kept"), kept.token) == owner_value
        assert raw.get(store.lock_key("overwritten")) == b"foreign"

    def test_a_chunk_refused_by_the_server_fails_only_its_own_items(
        self, fresh_server: LockServer, namespace: str
    ) -> None:
        """With memory full, the semaphore chunk (its ZADD is refused) answers None; the lock chunk still renews."""
        backend = RedisBackend.from_url(fresh_server.url, namespace=namespace)
        raw = fresh_server.redis()
        try:
            owner = token()
            assert backend.lock_acquire("a", owner, LONG).acquired
            assert backend.lock_acquire("b", owner, LONG).acquired
            assert backend.sem_acquire("s", owner, LONG, 2).acquired
            items: list[RenewItem] = [("a", owner, LONG), ("s", owner, LONG, "semaphore"), ("b", owner, LONG)]
            assert backend.renew(items) == [True, True, True]  # the scripts are loaded
            raw.config_set("maxmemory", 1)
            try:
                assert backend.renew(items) == [True, None, True]
            finally:
                raw.config_set("maxmemory", 0)
            assert backend.renew(items) == [True, True, True]
        finally:
            raw.close()
            backend.close()


# -- 4. NOSCRIPT never reaches a caller ---------------------------------------------------


class Flusher:
    """Another client flushing the script cache in a tight loop, on a server of its own."""

    def __init__(self, server: LockServer) -> None:
        self._redis = server.redis()
        self._stop = threading.Event()
        self.flushes = 0
        self._thread = threading.Thread(target=self._run, name="script-flusher", daemon=True)

    def _run(self) -> None:
        # bounded: at most a million flushes, or until stopped
        for _ in range(1_000_000):
            if self._stop.is_set():
                return
            self._redis.execute_command("SCRIPT", "FLUSH")
            self.flushes += 1

    def __enter__(self) -> Flusher:
        self._thread.start()
        wait_for(lambda: self.flushes > 0, what="the first SCRIPT FLUSH")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._redis.close()


@pytest.fixture
def flusher(fresh_server: LockServer) -> Iterator[Flusher]:
    with Flusher(fresh_server) as running:
        yield running


@pytest.fixture
def fresh_raw(fresh_server: LockServer) -> Iterator[Any]:
    made = fresh_server.redis()
    yield made
    made.close()


class TestNoScript:
    def test_sync_lock_cycles_under_a_script_flush_loop_never_fail(
        self,
        flusher: Flusher,
        fresh_server: LockServer,
        fresh_raw: Any,
        make_client: Callable[..., LockClient],
        namespace: str,
    ) -> None:
        """200 lock/unlock cycles (plain, fair, semaphore, read, write) while another client flushes scripts."""
        client = make_client(url=fresh_server.url)
        rw = client.rw_lock("rw")
        blocks = [
            lambda i: client.lock(f"flush:{i % 7}"),
            lambda i: client.fair_lock(f"fair:{i % 3}"),
            lambda i: client.semaphore("sem", permits=2),
            lambda i: rw.read(),
            lambda i: rw.write(),
        ]
        for i in range(200):
            with blocks[i % len(blocks)](i) as lease:
                assert lease.fencing_token > 0
        start = flusher.flushes
        wait_for(lambda: flusher.flushes > start, what="the flusher to be still running")
        assert lock_keys_left(fresh_raw, namespace) == []

    def test_async_lock_cycles_under_a_script_flush_loop_never_fail(
        self,
        flusher: Flusher,
        fresh_server: LockServer,
        fresh_raw: Any,
        make_client: Callable[..., LockClient],
        namespace: str,
    ) -> None:
        """200 ``async with`` cycles while another client flushes scripts."""
        client = make_client(url=fresh_server.url)

        async def cycles() -> None:
            for i in range(200):
                async with client.lock(f"flush:{i % 7}") as lease:
                    assert lease.fencing_token > 0

        asyncio.run(cycles())
        assert lock_keys_left(fresh_raw, namespace) == []

    def test_backend_calls_with_a_replica_wait_under_a_script_flush_loop_never_fail(
        self, flusher: Flusher, fresh_server: LockServer, fresh_raw: Any, namespace: str
    ) -> None:
        """The acquire + WAIT path (sync and asyncio) falls back to EVAL as well."""
        backend = RedisBackend.from_url(fresh_server.url, namespace=namespace)
        backend.wait_for_replicas(0, 0.01)
        try:
            for i in range(100):
                owner = token()
                assert backend.lock_acquire(f"w:{i % 5}", owner, LONG).acquired
                assert backend.release(f"w:{i % 5}", owner) == ReleaseResult.RELEASED
        finally:
            backend.close()

        async def cycles() -> None:
            twin = AsyncRedisBackend.from_url(fresh_server.url, namespace=namespace)
            twin.wait_for_replicas(0, 0.01)
            try:
                for i in range(100):
                    owner = token()
                    assert (await twin.lock_acquire(f"w:{i % 5}", owner, LONG)).acquired
                    assert await twin.release(f"w:{i % 5}", owner) == ReleaseResult.RELEASED
                    assert await twin.renew([(f"x:{i}", owner, LONG)]) == [False]
            finally:
                await twin.aclose()

        asyncio.run(cycles())
        assert lock_keys_left(fresh_raw, namespace) == []

    def test_renewals_under_a_script_flush_loop_keep_the_lease(
        self, flusher: Flusher, fresh_server: LockServer, make_client: Callable[..., LockClient]
    ) -> None:
        """A lease held across several renewals with a 1 s watchdog lease is never lost to NOSCRIPT."""
        client = make_client(url=fresh_server.url, watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        with client.lock("held") as lease:
            wait_for(lambda: client.stats().renewals >= 6, what="six renewals")
            assert not lease.lost
        stats = client.stats()
        assert (stats.renewal_failures, stats.lost) == (0, 0)

    def test_fenced_writes_under_a_script_flush_loop_never_fail(
        self, flusher: Flusher, fresh_server: LockServer, namespace: str
    ) -> None:
        """RedisFence (LuaScript called through a plain client) falls back to EVAL too."""
        raw = fresh_server.redis()
        try:
            fence = RedisFence(raw, namespace=namespace)
            for i in range(1, 101):
                assert fence.write("ledger", str(i), i)
            assert fence.read("ledger") == b"100"
        finally:
            raw.close()
