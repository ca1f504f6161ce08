"""The Lua contract of ``RedisBackend`` against real servers (valkey, and Debian's
redis-server when installed): fencing, re-entry, release codes, batched renewal, NOSCRIPT
recovery, the cluster hash tag, the waiter queue and its wake-ups, and a server that dies or
hangs."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.connection

from lockaspect import BackendError, LockClient
from lockaspect.backends.base import ReleaseResult
from lockaspect.backends.redis import RENEW_CHUNK, RedisBackend
from lockaspect.testing import LockServer

#: Seconds; long enough that nothing expires during a test unless the test wants it to.
LONG = 60.0


def token() -> str:
    return secrets.token_hex(16)


def evalsha_calls(raw: Any) -> int:
    """How many EVALSHA commands the server has executed (``INFO commandstats``)."""
    stats = raw.info("commandstats").get("cmdstat_evalsha")
    return int(stats["calls"]) if stats else 0


def script_loaded(raw: Any, sha: str) -> bool:
    return bool(raw.script_exists(sha)[0])


def crc16_xmodem(data: bytes) -> int:
    """CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, as Redis Cluster uses."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the first non-empty ``{...}``, else all."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def key_slot(key: str) -> int:
    return crc16_xmodem(hash_tag(key).encode()) % 16384


@pytest.fixture
def backend(any_server: LockServer, namespace: str) -> Iterator[RedisBackend]:
    """A backend on each installed server kind, in the test's own namespace."""
    backend = RedisBackend.from_url(any_server.url, namespace=namespace)
    yield backend
    backend.close()


@pytest.fixture
def server_raw(any_server: LockServer) -> Iterator[Any]:
    """A plain redis-py client on the same server as ``backend``."""
    client = any_server.redis()
    yield client
    client.close()


@pytest.fixture
def expirations(server_raw: Any) -> Iterator[Any]:
    """A pub/sub connection subscribed to the server's key-expiry events."""
    previous = server_raw.config_get("notify-keyspace-events")["notify-keyspace-events"]
    server_raw.config_set("notify-keyspace-events", "Ex")
    pubsub = server_raw.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("__keyevent@0__:expired")
    try:
        yield pubsub
    finally:
        pubsub.close()
        server_raw.config_set("notify-keyspace-events", previous)


def await_message(pubsub: Any, timeout: float = 10.0, about: bytes | None = None) -> tuple[str, bytes]:
    """The next published message on ``pubsub`` as ``(channel, payload)``, waiting up to
    ``timeout`` seconds; with ``about``, the next whose payload it is (the server is shared:
    other tests' keys expire too)."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=remaining)
        if message is None or message["type"] not in ("message", "pmessage"):
            continue
        if about is None or bytes(message["data"]) == about:
            return bytes(message["channel"]).decode(), bytes(message["data"])
    raise AssertionError(f"no message arrived within {timeout}s")


class TestAcquire:
    def test_successive_first_acquisitions_get_consecutive_fences(self, backend: RedisBackend) -> None:
        """Each first acquisition of a key gets the next fencing token: n, n + 1, n + 2."""
        fences = []
        for _ in range(3):
            owner = token()
            result = backend.lock_acquire("order:1", owner, LONG)
            assert result.acquired
            fences.append(result.fencing_token)
            assert backend.release("order:1", owner) is ReleaseResult.RELEASED
        assert fences == [fences[0], fences[0] + 1, fences[0] + 2]

    def test_fence_keeps_growing_after_the_lock_expired(
        self, backend: RedisBackend, server_raw: Any, expirations: Any
    ) -> None:
        """A lock that expired (was never released) does not reset its key's fence counter."""
        first = backend.lock_acquire("order:2", token(), 0.001)
        assert first.acquired
        expired = backend.lock_key("order:2").encode()
        assert await_message(expirations, about=expired) == ("__keyevent@0__:expired", expired)
        assert not server_raw.exists(backend.lock_key("order:2"))

        second = backend.lock_acquire("order:2", token(), LONG)
        assert second.acquired
        assert second.fencing_token > first.fencing_token
        assert second.fencing_token == first.fencing_token + 1

    def test_reentry_checks_the_owner_and_changes_nothing(self, backend: RedisBackend, server_raw: Any) -> None:
        """Re-entry with the owner's token says it still holds the lock and writes nothing: no hold (the client
        counts re-entries), no new fence, the TTL left alone."""
        owner = token()
        lock = backend.lock_key("order:3")
        fence = backend.lock_acquire("order:3", owner, LONG).fencing_token
        server_raw.pexpire(lock, 5_000)

        again = backend.lock_reenter("order:3", owner)
        assert again
        assert backend.lock_reenter("order:3", owner)

        assert server_raw.hget(lock, owner) == b"1"
        assert server_raw.hget(lock, "fence") == str(fence).encode()
        assert server_raw.get(backend.fence_key("order:3")) == str(fence).encode()
        assert 0 < server_raw.pttl(lock) <= 5_000

    def test_reentry_never_takes_a_foreign_or_free_lock(self, backend: RedisBackend, server_raw: Any) -> None:
        """Re-entry with a token that holds nothing fails and writes nothing."""
        holder = token()
        fence = backend.lock_acquire("order:4", holder, LONG).fencing_token
        foreign = backend.lock_reenter("order:4", token())
        assert not foreign
        assert server_raw.hgetall(backend.lock_key("order:4")) == {holder.encode(): b"1", b"fence": str(fence).encode()}

        free = backend.lock_reenter("order:5", token())
        assert not free
        assert not server_raw.exists(backend.lock_key("order:5"), backend.fence_key("order:5"))

    def test_repeated_first_acquire_with_the_same_token_adds_no_hold(
        self, backend: RedisBackend, server_raw: Any
    ) -> None:
        """A retried first acquisition is answered again with the same fence and one hold."""
        owner = token()
        first = backend.lock_acquire("order:6", owner, LONG)
        retry = backend.lock_acquire("order:6", owner, LONG)
        assert retry.acquired
        assert retry.fencing_token == first.fencing_token
        assert server_raw.hget(backend.lock_key("order:6"), owner) == b"1"
        assert server_raw.get(backend.fence_key("order:6")) == str(first.fencing_token).encode()
        assert backend.release("order:6", owner) is ReleaseResult.RELEASED

    def test_busy_lock_returns_the_holders_pttl(self, backend: RedisBackend, server_raw: Any) -> None:
        """A busy lock is not taken, costs no fence, and reports the holder's remaining lease."""
        holder = token()
        fence = backend.lock_acquire("order:7", holder, 10.0).fencing_token
        busy = backend.lock_acquire("order:7", token(), LONG)
        assert not busy.acquired
        assert busy.fencing_token == 0
        assert busy.holder_ttl is not None
        assert 0 < busy.holder_ttl <= 10.0
        assert server_raw.get(backend.fence_key("order:7")) == str(fence).encode()
        assert server_raw.hkeys(backend.lock_key("order:7")) == [holder.encode(), b"fence"]

    def test_busy_lock_without_expiry_reports_no_ttl(self, backend: RedisBackend, server_raw: Any) -> None:
        """A lock whose TTL was removed by hand is busy with an unknown holder TTL."""
        backend.lock_acquire("order:8", token(), 10.0)
        server_raw.persist(backend.lock_key("order:8"))
        busy = backend.lock_acquire("order:8", token(), LONG)
        assert not busy.acquired
        assert busy.holder_ttl is None


class TestFenceCounterLoss:
    def test_a_lost_counter_restarts_above_every_token_it_issued(self, backend: RedisBackend, server_raw: Any) -> None:
        """If the fence counter disappears (an eviction, a manual delete), the next token is still larger."""
        tokens = []
        for _ in range(3):
            owner = token()
            tokens.append(backend.lock_acquire("fenced", owner, LONG).fencing_token)
            backend.release("fenced", owner)
        server_raw.delete(backend.fence_key("fenced"))
        owner = token()
        after = backend.lock_acquire("fenced", owner, LONG).fencing_token
        assert after > max(tokens)

    @pytest.mark.slow
    def test_a_restart_without_persistence_does_not_reissue_tokens(self, fresh_server: LockServer) -> None:
        """A server restarted without its data (no persistence) still hands out larger fencing tokens."""
        backend = RedisBackend.from_url(fresh_server.url, namespace="restart:")
        try:
            owner = token()
            before = backend.lock_acquire("ledger", owner, LONG).fencing_token
            backend.release("ledger", owner)
            fresh_server.kill()
            fresh_server.restart()
            assert backend.redis.exists(backend.fence_key("ledger")) == 0  # the counter is gone
            after = backend.lock_acquire("ledger", token(), LONG).fencing_token
            assert after > before
        finally:
            backend.close()


class TestDroppedConnections:
    def test_a_connection_the_server_closed_is_replaced_without_an_error(
        self, backend: RedisBackend, server_raw: Any
    ) -> None:
        """After the server kills the backend's kept connections, the next commands still succeed."""
        owner = token()
        assert backend.lock_acquire("dropped", owner, LONG).acquired
        killed = server_raw.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        assert backend.release("dropped", owner) is ReleaseResult.RELEASED
        again = token()
        assert backend.lock_acquire("dropped", again, LONG).acquired
        assert backend.release("dropped", again) is ReleaseResult.RELEASED


class TestRelease:
    def test_release_codes(self, backend: RedisBackend, server_raw: Any) -> None:
        """Release answers RELEASED (also after re-entry checks: the store keeps one hold per owner), NOT_OWNER
        after."""
        owner = token()
        fence = backend.lock_acquire("order:10", owner, LONG).fencing_token
        backend.lock_reenter("order:10", owner)
        assert backend.release("order:10", owner) is ReleaseResult.RELEASED
        assert not server_raw.exists(backend.lock_key("order:10"))
        assert server_raw.get(backend.fence_key("order:10")) == str(fence).encode()
        assert backend.release("order:10", owner) is ReleaseResult.NOT_OWNER

    def test_foreign_token_can_neither_release_nor_renew(self, backend: RedisBackend, server_raw: Any) -> None:
        """A token that does not own the lock cannot release or extend it; the owner's lock is untouched."""
        owner, thief = token(), token()
        lock = backend.lock_key("order:11")
        backend.lock_acquire("order:11", owner, 10.0)
        before = server_raw.hgetall(lock)

        assert backend.release("order:11", thief) is ReleaseResult.NOT_OWNER
        assert backend.renew([("order:11", thief, 1000.0)]) == [False]

        assert server_raw.hgetall(lock) == before
        assert 0 < server_raw.pttl(lock) <= 10_000
        assert backend.release("order:11", owner) is ReleaseResult.RELEASED

    def test_final_release_publishes_once_to_the_first_queued_waiter(
        self, backend: RedisBackend, server_raw: Any
    ) -> None:
        """Only the release that frees the lock wakes a waiter: one "released" on the first queued waiter's channel."""
        owner = token()
        first, second = backend.wake_channel("order:12", "first"), backend.wake_channel("order:12", "second")
        pubsub = server_raw.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(first, second)
            backend.lock_acquire("order:12", owner, LONG)
            assert not backend.lock_acquire("order:12", token(), LONG, waiter="first").acquired
            assert not backend.lock_acquire("order:12", token(), LONG, waiter="second").acquired
            backend.lock_reenter("order:12", owner)  # a check: it publishes nothing
            assert server_raw.lrange(backend.queue_key("order:12"), 0, -1) == [b"first", b"second"]
            # Messages on one connection arrive in publish order: had the re-entry check
            # published, its message would come before this marker.
            server_raw.publish(first, "marker")
            assert backend.release("order:12", owner) is ReleaseResult.RELEASED
            assert await_message(pubsub) == (first, b"marker")
            assert await_message(pubsub) == (first, b"released")
            server_raw.publish(second, "marker")
            assert await_message(pubsub) == (second, b"marker"), "one release wakes one waiter"
            assert server_raw.lrange(backend.queue_key("order:12"), 0, -1) == [b"second"]
        finally:
            pubsub.close()

    def test_release_with_nobody_queued_publishes_nothing(self, backend: RedisBackend, server_raw: Any) -> None:
        """A final release with an empty waiter queue sends no message on any of the lock's wake channels."""
        owner = token()
        pubsub = server_raw.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.psubscribe(backend.wake_channel("order:13", "*"))
            marker = backend.wake_channel("order:13", "marker")
            backend.lock_acquire("order:13", owner, LONG)
            assert not backend.lock_acquire("order:13", token(), LONG).acquired  # no waiter id: not queued
            assert not server_raw.exists(backend.queue_key("order:13"))
            assert backend.release("order:13", owner) is ReleaseResult.RELEASED
            server_raw.publish(marker, "marker")
            assert await_message(pubsub) == (marker, b"marker")
        finally:
            pubsub.close()


class TestWaiterQueue:
    def test_busy_attempts_queue_each_waiter_once_in_arrival_order(
        self, backend: RedisBackend, server_raw: Any
    ) -> None:
        """A busy attempt with a waiter id appends it to the lock's queue, once however often it retries."""
        backend.lock_acquire("q:1", token(), LONG)
        for waiter in ["a", "b", "a", "c", "b"]:
            busy = backend.lock_acquire("q:1", token(), LONG, waiter=waiter)
            assert not busy.acquired
            assert busy.holder_ttl is not None
        assert server_raw.lrange(backend.queue_key("q:1"), 0, -1) == [b"a", b"b", b"c"]

    def test_front_puts_a_woken_waiter_back_at_the_head(self, backend: RedisBackend, server_raw: Any) -> None:
        """A busy attempt with ``front`` queues the waiter first; an id already queued keeps its place."""
        backend.lock_acquire("q:2", token(), LONG)
        backend.lock_acquire("q:2", token(), LONG, waiter="a")
        backend.lock_acquire("q:2", token(), LONG, waiter="b")
        backend.lock_acquire("q:2", token(), LONG, waiter="woken", front=True)
        backend.lock_acquire("q:2", token(), LONG, waiter="b", front=True)
        assert server_raw.lrange(backend.queue_key("q:2"), 0, -1) == [b"woken", b"a", b"b"]

    def test_successful_acquire_takes_the_waiter_off_the_queue(self, backend: RedisBackend, server_raw: Any) -> None:
        """A waiter that gets the lock leaves the queue; the other waiters keep their order."""
        holder = token()
        backend.lock_acquire("q:3", holder, LONG)
        for waiter in ["a", "b", "c"]:
            backend.lock_acquire("q:3", token(), LONG, waiter=waiter)
        server_raw.delete(backend.lock_key("q:3"))  # the holder's lease ran out: no release, no wake-up
        assert backend.lock_acquire("q:3", token(), LONG, waiter="b").acquired
        assert server_raw.lrange(backend.queue_key("q:3"), 0, -1) == [b"a", b"c"]

    def test_attempt_without_a_waiter_id_leaves_the_queue_alone(self, backend: RedisBackend, server_raw: Any) -> None:
        """Busy or successful attempts without a waiter id (wait=0, polling) neither create nor change the queue."""
        holder = token()
        backend.lock_acquire("q:4", holder, LONG)
        backend.lock_acquire("q:4", token(), LONG)
        assert not server_raw.exists(backend.queue_key("q:4"))
        backend.lock_acquire("q:4", token(), LONG, waiter="a")
        backend.lock_acquire("q:4", token(), LONG)
        backend.release("q:4", holder)
        server_raw.rpush(backend.queue_key("q:4"), "b")
        assert backend.lock_acquire("q:4", token(), LONG).acquired
        assert server_raw.lrange(backend.queue_key("q:4"), 0, -1) == [b"b"]

    def test_queue_expires_and_every_busy_attempt_renews_its_expiry(
        self, backend: RedisBackend, server_raw: Any
    ) -> None:
        """The queue carries a TTL of at most 60 s (waiters that died leave no key forever); each re-queue renews it."""
        queue = backend.queue_key("q:5")
        backend.lock_acquire("q:5", token(), LONG)
        backend.lock_acquire("q:5", token(), LONG, waiter="a")
        assert 0 < server_raw.pttl(queue) <= 60_000
        server_raw.pexpire(queue, 1_000)
        backend.lock_acquire("q:5", token(), LONG, waiter="a")  # already queued: still renews the expiry
        assert 1_000 < server_raw.pttl(queue) <= 60_000

    def test_unqueue_removes_only_that_waiter(self, backend: RedisBackend, server_raw: Any) -> None:
        """``unqueue`` takes one waiter off the queue, is a no-op for an id not queued, and removes the emptied key."""
        queue = backend.queue_key("q:6")
        backend.lock_acquire("q:6", token(), LONG)
        backend.lock_acquire("q:6", token(), LONG, waiter="a")
        backend.lock_acquire("q:6", token(), LONG, waiter="b")
        backend.unqueue("q:6", "a")
        assert server_raw.lrange(queue, 0, -1) == [b"b"]
        backend.unqueue("q:6", "nobody")
        backend.unqueue("other", "b")
        assert server_raw.lrange(queue, 0, -1) == [b"b"]
        backend.unqueue("q:6", "b")
        assert not server_raw.exists(queue)

    def test_release_skips_waiters_nobody_listens_to(self, backend: RedisBackend, server_raw: Any) -> None:
        """Dead waiters (ids nobody subscribes to) ahead in the queue are dropped; the first live one is woken."""
        owner = token()
        live = backend.wake_channel("q:7", "live")
        pubsub = server_raw.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(live)
            backend.lock_acquire("q:7", owner, LONG)
            server_raw.rpush(backend.queue_key("q:7"), "dead:1", "dead:2")
            backend.lock_acquire("q:7", token(), LONG, waiter="live")
            backend.lock_acquire("q:7", token(), LONG, waiter="behind")
            assert backend.release("q:7", owner) is ReleaseResult.RELEASED
            assert await_message(pubsub) == (live, b"released")
            assert server_raw.lrange(backend.queue_key("q:7"), 0, -1) == [b"behind"]
        finally:
            pubsub.close()

    def test_release_gives_up_after_sixteen_dead_waiters(self, backend: RedisBackend, server_raw: Any) -> None:
        """One release drops at most 16 dead waiters: a live one behind 17 is not woken by it, and stays queued."""
        owner = token()
        live = backend.wake_channel("q:8", "live")
        pubsub = server_raw.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(live)
            backend.lock_acquire("q:8", owner, LONG)
            server_raw.rpush(backend.queue_key("q:8"), *[f"dead:{n}" for n in range(17)])
            backend.lock_acquire("q:8", token(), LONG, waiter="live")
            assert backend.release("q:8", owner) is ReleaseResult.RELEASED
            server_raw.publish(live, "marker")
            assert await_message(pubsub) == (live, b"marker")
            assert server_raw.lrange(backend.queue_key("q:8"), 0, -1) == [b"dead:16", b"live"]
        finally:
            pubsub.close()

    def test_release_by_a_user_without_pubsub_rights_still_releases(self, fresh_server: LockServer) -> None:
        """With waiters queued, a release by a server user that may not PUBLISH frees the lock all the same."""
        admin = fresh_server.redis()
        admin.execute_command("ACL", "SETUSER", "nopubsub", "on", ">pw", "~*", "&*", "+@all", "-@pubsub")
        backend = RedisBackend.from_url(f"redis://nopubsub:pw@127.0.0.1:{fresh_server.port}/0", namespace="acl:")
        try:
            owner = token()
            backend.lock_acquire("q:9", owner, LONG)
            backend.lock_acquire("q:9", token(), LONG, waiter="a")
            backend.lock_acquire("q:9", token(), LONG, waiter="b")
            assert backend.release("q:9", owner) is ReleaseResult.RELEASED
            assert not admin.exists(backend.lock_key("q:9"))
            refused = [entry for entry in admin.acl_log() if entry["object"] == "publish"]
            assert sum(int(entry["count"]) for entry in refused) == 1, "the release stops at the first refusal"
            assert admin.lrange(backend.queue_key("q:9"), 0, -1) == [b"b"]
            assert backend.lock_acquire("q:9", token(), LONG, waiter="b").acquired
        finally:
            backend.close()
            admin.close()


class TestRenew:
    def test_batch_answers_one_status_per_key(self, backend: RedisBackend, server_raw: Any) -> None:
        """One renew call over owned, foreign and missing keys (more than a chunk) answers each correctly."""
        n = 2 * RENEW_CHUNK + 88
        mine, theirs = token(), token()
        requests = []
        expected = []
        for i in range(n):
            key = f"batch:{i}"
            kind = i % 3
            if kind == 0:  # ours, about to be extended
                backend.lock_acquire(key, mine, 5.0)
            elif kind == 1:  # someone else's
                backend.lock_acquire(key, theirs, 5.0)
            requests.append((key, mine, 100.0))
            expected.append(kind == 0)

        assert backend.renew(requests) == expected

        pipe = server_raw.pipeline(transaction=False)
        for key, _, _ in requests:
            pipe.pttl(backend.lock_key(key))
        ttls = pipe.execute()
        for i, ttl in enumerate(ttls):
            if i % 3 == 0:
                assert ttl > 5_000, f"batch:{i} was not extended"
            elif i % 3 == 1:
                assert 0 < ttl <= 5_000, f"batch:{i} (foreign) was extended"
            else:
                assert ttl == -2, f"batch:{i} (missing) was created"

    def test_batch_is_one_round_trip_of_chunked_evalsha(
        self, backend: RedisBackend, server_raw: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A renew of n keys sends ceil(n / 256) EVALSHA in a single write to the server."""
        n = 2 * RENEW_CHUNK + 1
        owner = token()
        requests = [(f"rt:{i}", owner, 10.0) for i in range(n)]
        for key, _, _ in requests:
            backend.lock_acquire(key, owner, 10.0)
        backend.renew(requests[:1])  # the script is loaded: no NOSCRIPT retry below

        writes = []
        original = redis.connection.AbstractConnection.send_packed_command

        def counting(self: Any, command: Any, check_health: bool = True) -> None:
            writes.append(command)
            original(self, command, check_health)

        before = evalsha_calls(server_raw)
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
        statuses = backend.renew(requests)
        monkeypatch.undo()
        after = evalsha_calls(server_raw)

        assert statuses == [True] * n
        assert after - before == math.ceil(n / RENEW_CHUNK) == 3
        assert len(writes) == 1

    def test_empty_batch_sends_nothing(self, backend: RedisBackend, server_raw: Any) -> None:
        """Renewing no leases is answered locally without a round trip."""
        before = int(server_raw.info("stats")["total_commands_processed"])
        assert backend.renew([]) == []
        after = int(server_raw.info("stats")["total_commands_processed"])
        assert after - before == 1  # our own second INFO


class TestNoScript:
    def test_acquire_recovers_after_script_flush(self, backend: RedisBackend, server_raw: Any) -> None:
        """Acquire reloads its script when the server forgot it."""
        backend.lock_acquire("ns:warm", token(), LONG)
        server_raw.script_flush()
        assert not script_loaded(server_raw, backend._acquire.sha)
        result = backend.lock_acquire("ns:1", token(), LONG)
        assert result.acquired
        assert result.fencing_token > 0
        assert script_loaded(server_raw, backend._acquire.sha)

    def test_release_recovers_after_script_flush(self, backend: RedisBackend, server_raw: Any) -> None:
        """Release reloads its script when the server forgot it."""
        owner = token()
        backend.lock_acquire("ns:2", owner, LONG)
        server_raw.script_flush()
        assert backend.release("ns:2", owner) is ReleaseResult.RELEASED
        assert not server_raw.exists(backend.lock_key("ns:2"))
        assert script_loaded(server_raw, backend._release.sha)

    def test_renew_recovers_after_script_flush(self, backend: RedisBackend, server_raw: Any) -> None:
        """A chunked renew reloads its script when the server forgot it and renews every key."""
        owner = token()
        requests = [(f"ns:r{i}", owner, 100.0) for i in range(RENEW_CHUNK + 44)]
        for key, _, _ in requests:
            backend.lock_acquire(key, owner, 5.0)
        server_raw.script_flush()
        assert backend.renew(requests) == [True] * len(requests)
        assert server_raw.pttl(backend.lock_key("ns:r0")) > 5_000
        assert server_raw.pttl(backend.lock_key(f"ns:r{RENEW_CHUNK + 43}")) > 5_000
        assert script_loaded(server_raw, backend._renew.sha)


class TestKeyLayout:
    def test_slot_helper_matches_redis_cluster(self) -> None:
        """The test's CRC16 slot function gives the values the Redis Cluster spec documents."""
        assert crc16_xmodem(b"123456789") == 0x31C3
        assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
        assert key_slot("foo{}{bar}") == crc16_xmodem(b"foo{}{bar}") % 16384

    @pytest.mark.parametrize("key", ["order:42", "a", "tenant:acme:order:%7B1%7D", "x" * 200])
    def test_lock_fence_queue_and_wake_channel_share_one_slot(
        self, backend: RedisBackend, server_raw: Any, key: str
    ) -> None:
        """The lock key, the fence counter, the waiter queue and a waiter's wake channel hash to one cluster slot."""
        names = [backend.lock_key(key), backend.fence_key(key), backend.queue_key(key), backend.wake_channel(key, "w1")]
        assert [hash_tag(name) for name in names] == [key] * 4
        assert len({key_slot(name) for name in names}) == 1

        owner = token()
        backend.lock_acquire(key, owner, LONG)
        backend.lock_acquire(key, token(), LONG, waiter="w1")
        written = {name.decode() for name in server_raw.scan_iter(match=f"{backend.namespace}*")}
        assert written == {backend.lock_key(key), backend.fence_key(key), backend.queue_key(key)}
        backend.release(key, owner)  # pops w1 (nobody listens), which empties the queue
        written = {name.decode() for name in server_raw.scan_iter(match=f"{backend.namespace}*")}
        assert written == {backend.fence_key(key)}


def _operations(backend: RedisBackend) -> list[tuple[str, Callable[[], object]]]:
    owner = token()
    return [
        ("acquire", lambda: backend.lock_acquire("down:1", owner, LONG)),
        ("release", lambda: backend.release("down:1", owner)),
        ("renew", lambda: backend.renew([("down:1", owner, LONG), ("down:2", owner, LONG)])),
    ]


class TestServerFailure:
    @pytest.mark.timeout(30)
    def test_killed_server_raises_backend_error_chained_to_the_driver(
        self, fresh_server: LockServer, namespace: str
    ) -> None:
        """With the server gone, acquire, release and renew raise BackendError from the redis error."""
        backend = RedisBackend.from_url(fresh_server.url, namespace=namespace)
        try:
            assert backend.lock_acquire("up", token(), LONG).acquired  # a pooled, connected socket
            fresh_server.kill()
            for name, operation in _operations(backend):
                with pytest.raises(BackendError) as exc_info:
                    operation()
                assert isinstance(exc_info.value.__cause__, redis.exceptions.ConnectionError), name
                assert exc_info.value.key == ("down:1" if name != "renew" else None), name
        finally:
            backend.close()

    @pytest.mark.slow
    @pytest.mark.timeout(30)
    def test_paused_server_raises_backend_error_after_the_socket_timeout(
        self, fresh_server: LockServer, namespace: str
    ) -> None:
        """With the server stopped (SIGSTOP), every operation gives up with BackendError after the socket timeout."""
        backend = RedisBackend.from_url(fresh_server.url, namespace=namespace, socket_timeout=0.5)
        try:
            assert backend.lock_acquire("up", token(), LONG).acquired
            fresh_server.pause()
            try:
                for name, operation in _operations(backend):
                    with pytest.raises(BackendError) as exc_info:
                        operation()
                    assert isinstance(exc_info.value.__cause__, redis.exceptions.TimeoutError), name
            finally:
                fresh_server.resume()
            result = backend.lock_acquire("after-resume", token(), LONG)
            assert result.acquired
            assert result.fencing_token > 0
        finally:
            backend.close()

    @pytest.mark.timeout(30)
    def test_backend_works_again_after_the_server_restarts(self, fresh_server: LockServer, namespace: str) -> None:
        """After a kill and restart on the same port, the same backend acquires, renews and releases again."""
        backend = RedisBackend.from_url(fresh_server.url, namespace=namespace)
        try:
            backend.lock_acquire("up", token(), LONG)
            fresh_server.kill()
            with pytest.raises(BackendError):
                backend.lock_acquire("again", token(), LONG)
            fresh_server.restart()

            owner = token()
            result = backend.lock_acquire("again", owner, LONG)
            assert result.acquired
            assert backend.renew([("again", owner, LONG)]) == [True]
            assert backend.release("again", owner) is ReleaseResult.RELEASED
        finally:
            backend.close()

    @pytest.mark.timeout(30)
    def test_lock_client_works_again_after_the_server_restarts(self, fresh_server: LockServer, namespace: str) -> None:
        """A LockClient whose server was killed raises BackendError, then locks normally once it is back."""
        with LockClient.from_url(fresh_server.url, namespace=namespace) as client:
            with client.lock("job"):
                pass
            fresh_server.kill()
            with pytest.raises(BackendError) as exc_info, client.lock("job"):
                pass
            assert isinstance(exc_info.value.__cause__, redis.exceptions.ConnectionError)
            fresh_server.restart()

            with client.lock("job") as lease:
                assert not lease.lost
            stats = client.stats()
            assert (stats.acquired, stats.released, stats.held) == (2, 2, 0)
