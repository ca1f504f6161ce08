"""Read-write locks against real servers: many readers or one writer across processes,
re-entry, downgrade, a refused upgrade, writer preference, dead waiting writers, the
watchdog, the decorator's ``mode``, async, and bad input."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import ConfigurationError, LockClient, LockNotAcquired, _policy, config, current_lease, distributed_lock
from lockaspect.testing import LockServer

LIVENESS = 30.0  # deadlock guard, not a speed expectation

WORKER = """
import random, sys, time
import redis
from lockaspect import LockClient

url, namespace, sections, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
raw = redis.Redis.from_url(url)
rng = random.Random(seed)
rw = None
with LockClient.from_url(url, namespace=namespace) as client:
    rw = client.rw_lock("doc")
    for _ in range(sections):
        if rng.random() < 0.8:
            with rw.read(wait=None):
                readers = raw.incr(namespace + "readers")
                if int(raw.get(namespace + "writers") or 0) != 0:
                    raw.rpush(namespace + "violations", "reader saw a writer")
                raw.rpush(namespace + "reader-peaks", readers)
                time.sleep(0.002)
                raw.decr(namespace + "readers")
        else:
            with rw.write(wait=None):
                writers = raw.incr(namespace + "writers")
                if writers != 1 or int(raw.get(namespace + "readers") or 0) != 0:
                    raw.rpush(namespace + "violations", "writer not alone")
                time.sleep(0.002)
                raw.decr(namespace + "writers")
                raw.incr(namespace + "writes")
"""


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIVENESS
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def client(lock_server: LockServer, namespace: str) -> Iterator[LockClient]:
    with LockClient.from_url(lock_server.url, namespace=namespace, watchdog_lease=1.0) as made:
        yield made


class Holder:
    """Holds a read or write lock on a thread of its own until :meth:`release`."""

    def __init__(self, client: LockClient, key: str, mode: str, **options: Any) -> None:
        self.acquired = threading.Event()
        self._done = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                with getattr(client.rw_lock(key), mode)(**options):
                    self.acquired.set()
                    self._done.wait(3 * LIVENESS)  # longer than any wait of the test for others
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._done.set()
        self._thread.join(LIVENESS)
        assert self.error is None, self.error


def busy(client: LockClient, key: str, mode: str) -> bool:
    """Whether another context (a thread of its own) trying once finds ``key`` busy for ``mode``."""
    found: list[bool] = []

    def attempt() -> None:
        try:
            with getattr(client.rw_lock(key), mode)():
                found.append(False)
        except LockNotAcquired:
            found.append(True)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(LIVENESS)
    assert len(found) == 1, "the attempt failed otherwise"
    return found[0]


class TestAcrossProcesses:
    def test_readers_share_and_writers_are_alone(self, lock_server: LockServer, namespace: str) -> None:
        """Four processes, 40 sections each, 80% reads: no reader ever saw a writer, no writer had company."""
        raw = lock_server.redis()
        procs = [
            subprocess.Popen([sys.executable, "-c", WORKER, lock_server.url, namespace, "40", str(seed)])
            for seed in range(4)
        ]
        for proc in procs:
            assert proc.wait(LIVENESS * 3) == 0
        assert raw.lrange(namespace + "violations", 0, -1) == []
        assert int(raw.get(namespace + "writes") or 0) > 0


class TestSharingAndExclusion:
    def test_readers_share_writers_exclude(self, client: LockClient) -> None:
        first = Holder(client, "doc", "read")
        assert first.acquired.wait(LIVENESS)
        assert not busy(client, "doc", "read"), "a second reader comes in"
        assert busy(client, "doc", "write"), "no writer while a reader holds it"
        first.release()
        writer = Holder(client, "doc", "write")
        assert writer.acquired.wait(LIVENESS)
        assert busy(client, "doc", "read")
        assert busy(client, "doc", "write")
        writer.release()
        assert not busy(client, "doc", "write")

    def test_a_waiting_writer_keeps_new_readers_out(self, client: LockClient) -> None:
        """Writer preference: reader holds, writer waits, a new reader must wait too; the writer goes next."""
        reader = Holder(client, "pref", "read")
        assert reader.acquired.wait(LIVENESS)
        writer = Holder(client, "pref", "write", wait=LIVENESS)
        keys = client.backend.rw_keys("pref")
        wait_until(lambda: client.backend.redis.zcard(keys["waiting writers"]) == 1, "the writer waiting")
        assert busy(client, "pref", "read"), "a new reader waits behind the waiting writer"
        reader.release()
        assert writer.acquired.wait(LIVENESS)
        writer.release()
        assert not busy(client, "pref", "read")

    def test_a_dead_waiting_writer_stops_counting(self, client: LockClient) -> None:
        """A waiting writer last seen longer ago than FAIR_GONE_AFTER no longer keeps readers out."""
        keys = client.backend.rw_keys("stale")
        seconds, micros = client.backend.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        client.backend.redis.zadd(keys["waiting writers"], {"w-dead": now_ms - 10_000})
        assert not busy(client, "stale", "read")
        client.backend.redis.zadd(keys["waiting writers"], {"w-alive": now_ms})
        assert busy(client, "stale", "read"), "a live waiting writer keeps readers out"


class TestWakeUps:
    def test_a_writer_that_gives_up_lets_the_readers_it_kept_out_in(
        self, lock_server: LockServer, namespace: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Reader holds, a writer waits then gives up, a second reader queued behind the writer is woken at once
        (with 60 s leases and no periodic re-check, only that wake-up can let it in within LIVENESS)."""
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 60.0)
        with LockClient.from_url(lock_server.url, namespace=namespace, watchdog_lease=60.0) as slow:
            reader = Holder(slow, "gone", "read")
            assert reader.acquired.wait(LIVENESS)
            writer = Holder(slow, "gone", "write", wait=1.0)
            keys = slow.backend.rw_keys("gone")
            wait_until(lambda: slow.backend.redis.zcard(keys["waiting writers"]) == 1, "the writer waiting")
            second = Holder(slow, "gone", "read", wait=None)
            wait_until(lambda: slow.backend.redis.llen(keys["waiters"]) >= 2, "the second reader queued")
            assert second.acquired.wait(LIVENESS)
            second.release()
            writer._thread.join(LIVENESS)
            assert isinstance(writer.error, LockNotAcquired)
            reader.release()

    def test_many_expired_readers_are_cleaned_up(self, client: LockClient) -> None:
        """Thousands of readers whose leases ended (a mass crash) are dropped by the next acquisition."""
        keys = client.backend.rw_keys("crowd")
        redis = client.backend.redis
        redis.zadd(keys["readers"], {f"dead-{i}": 1 for i in range(10_000)})
        redis.hset(keys["fences"], mapping={f"dead-{i}": i for i in range(10_000)})
        with client.rw_lock("crowd").write():
            assert redis.zcard(keys["readers"]) == 0
            assert redis.hlen(keys["fences"]) == 0


class TestReentry:
    def test_read_in_read_and_write_in_write_reenter(self, client: LockClient) -> None:
        rw = client.rw_lock("re")
        with rw.read() as outer, rw.read() as inner:
            assert inner is outer
        with rw.write() as outer_w, rw.write() as inner_w:
            assert inner_w is outer_w
        assert not busy(client, "re", "write")

    def test_a_writer_may_read_inside_its_write_block(self, client: LockClient) -> None:
        rw = client.rw_lock("down")
        with rw.write() as write:
            with rw.read() as read:
                assert read.kind == "read"
                assert read is not write
                assert read.fencing_token > write.fencing_token
            assert busy(client, "down", "read"), "others still wait for the writer"
        assert not busy(client, "down", "write")

    def test_a_reader_asking_to_write_gets_an_error_not_a_deadlock(self, client: LockClient, commands: Any) -> None:
        rw = client.rw_lock("up")
        with (
            rw.read(),
            commands.assert_none(),
            pytest.raises(ConfigurationError, match="read lock"),
            rw.write(wait=None),
        ):
            pytest.fail("an upgrade must be refused")
        assert not busy(client, "up", "write")


class TestLeases:
    def test_the_watchdog_renews_readers_and_writers(self, client: LockClient) -> None:
        rw = client.rw_lock("long")
        with rw.read() as read:
            wait_until(lambda: client.stats().renewals >= 2, "two renewals of the read lease")
            assert not read.lost
            assert busy(client, "long", "write")
        before = client.stats().renewals
        with rw.write() as write:
            wait_until(lambda: client.stats().renewals >= before + 2, "two renewals of the write lease")
            assert not write.lost
            assert busy(client, "long", "read")
        assert client.stats().lost == 0


class TestDecoratorAsyncAndPolicies:
    def test_decorator_modes_sync_and_async(self, client: LockClient) -> None:
        @distributed_lock("doc:<n>", mode="read", client=client)
        def read(n: int) -> str | None:
            lease = current_lease()
            return None if lease is None else lease.kind

        @distributed_lock("doc:<n>", mode="write", client=client)
        async def write(n: int) -> str | None:
            lease = current_lease()
            return None if lease is None else lease.kind

        async def main() -> str | None:
            result = await write(1)
            await client.aclose()
            return result

        assert read(1) == "read"
        assert asyncio.run(main()) == "write"

    def test_async_readers_share_and_a_writer_waits(self, client: LockClient) -> None:
        async def main() -> list[str]:
            events: list[str] = []
            both = asyncio.Event()
            inside = 0
            rw = client.rw_lock("tasks")

            async def reader(name: str) -> None:
                nonlocal inside
                async with rw.read(wait=LIVENESS):
                    inside += 1
                    events.append(f"read {name}")
                    if inside == 2:
                        both.set()
                    await asyncio.wait_for(both.wait(), LIVENESS)
                    inside -= 1
                    # Inside the block: after it, the writer may run before this task resumes.
                    events.append(f"done {name}")

            async def writer() -> None:
                await asyncio.wait_for(both.wait(), LIVENESS)
                async with rw.write(wait=LIVENESS):
                    events.append("write")

            await asyncio.gather(reader("a"), reader("b"), writer())
            await client.aclose()
            return events

        events = asyncio.run(main())
        assert sorted(events[:2]) == ["read a", "read b"]
        assert events.index("write") > max(events.index("done a"), events.index("done b"))

    def test_policy_sets_the_mode(self, client: LockClient) -> None:
        config.configure(policies={"reports": {"key": "report", "mode": "read"}})

        @distributed_lock(policy="reports", client=client)
        def report() -> str | None:
            lease = current_lease()
            return None if lease is None else lease.kind

        assert report() == "read"


class TestBadInput:
    @pytest.mark.parametrize(
        ("mode", "error"), [("rw", ConfigurationError), ("READ", ConfigurationError), (1, TypeError)]
    )
    def test_bad_mode_is_rejected_at_decoration(self, mode: Any, error: type[Exception]) -> None:
        with pytest.raises(error, match="mode"):

            @distributed_lock("k", mode=mode)
            def work() -> None: ...

    def test_mixed_kinds_are_rejected_at_decoration(self) -> None:
        with pytest.raises(ConfigurationError, match="read-write"):

            @distributed_lock("k", mode="read", fair=True)
            def work() -> None: ...

    def test_policy_with_a_bad_mode_fails_in_configure(self) -> None:
        with pytest.raises(ConfigurationError, match="mode"):
            config.configure(policies={"p": {"mode": "sometimes"}})
