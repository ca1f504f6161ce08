"""Multi-key locks against real servers: all or nothing, waiting on the busy key, no deadlock
with overlapping sets from several processes, re-entry, renewal together, loss, async, and
bad input."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lockaspect import (
    ConfigurationError,
    FailureContext,
    KeyTemplateError,
    LockClient,
    LockLost,
    LockNotAcquired,
    MultiLease,
    _policy,
    current_lease,
    distributed_lock,
)
from lockaspect.testing import LockServer

LIVENESS = 30.0  # deadlock guard, not a speed expectation

WORKER = """
import random, sys, time
import redis
from lockaspect import LockClient

url, namespace, sections, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
raw = redis.Redis.from_url(url)
rng = random.Random(seed)
keys = [f"k{i}" for i in range(5)]
with LockClient.from_url(url, namespace=namespace) as client:
    for _ in range(sections):
        chosen = rng.sample(keys, rng.choice([2, 3]))
        with client.multi_lock(chosen, wait=None):
            for key in chosen:  # non-atomic read-modify-write per key
                value = int(raw.get(namespace + "count:" + key) or 0)
                time.sleep(0.0005)
                raw.set(namespace + "count:" + key, value + 1)
        for key in chosen:
            raw.incr(namespace + "expected:" + key)
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


def hold(client: LockClient, key: str) -> tuple[threading.Event, threading.Thread]:
    """Hold ``key`` on a thread of its own until the returned event is set."""
    held, done = threading.Event(), threading.Event()

    def run() -> None:
        with client.lock(key):
            held.set()
            done.wait(3 * LIVENESS)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert held.wait(LIVENESS)
    return done, thread


class TestAllOrNothing:
    def test_takes_every_key_deduplicated_and_sorted(self, client: LockClient) -> None:
        with client.multi_lock(["b", "a", "b"]) as multi:
            assert isinstance(multi, MultiLease)
            assert multi.keys == ("a", "b")
            assert set(multi.fencing_tokens) == {"a", "b"}
            for key in ("a", "b"):
                assert client.backend.redis.exists(client.backend.lock_key(key)) == 1
        for key in ("a", "b"):
            assert client.backend.redis.exists(client.backend.lock_key(key)) == 0

    def test_one_busy_key_means_none_is_taken(self, client: LockClient) -> None:
        done, thread = hold(client, "b")
        with pytest.raises(LockNotAcquired) as caught, client.multi_lock(["a", "b", "c"]):
            pytest.fail("b is held")
        assert caught.value.key == "b"
        assert caught.value.holder_ttl is not None
        assert client.backend.redis.exists(client.backend.lock_key("a")) == 0
        assert client.backend.redis.exists(client.backend.lock_key("c")) == 0
        done.set()
        thread.join(LIVENESS)

    def test_a_waiter_holds_nothing_until_it_holds_everything(self, client: LockClient) -> None:
        done, thread = hold(client, "b")
        got: list[dict[str, int]] = []
        waiter = threading.Thread(target=lambda: got.append(_take(client, ["a", "b"])))
        waiter.start()
        wait_until(lambda: client.backend.redis.llen(client.backend.queue_key("b")) == 1, "the waiter queued on b")
        assert client.backend.redis.exists(client.backend.lock_key("a")) == 0, "nothing is held while waiting"
        done.set()
        waiter.join(LIVENESS)
        thread.join(LIVENESS)
        assert len(got) == 1
        assert set(got[0]) == {"a", "b"}
        assert client.backend.redis.llen(client.backend.queue_key("b")) == 0

    def test_a_multi_waiter_woken_for_a_key_it_cannot_use_passes_the_wake_up_on(
        self, lock_server: LockServer, namespace: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A released, M (waiting for A and B) is woken but B is still busy: S, queued on A behind M, must be
        woken at once (60 s leases, no periodic re-check: only that wake-up lets S in within LIVENESS)."""
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 120.0)
        with LockClient.from_url(lock_server.url, namespace=namespace, watchdog_lease=60.0) as slow:
            release_a, holder_a = hold(slow, "A")
            release_b, holder_b = hold(slow, "B")
            multi = threading.Thread(target=lambda: _take(slow, ["A", "B"]), daemon=True)
            multi.start()
            wait_until(lambda: slow.backend.redis.llen(slow.backend.queue_key("A")) == 1, "M queued on A")
            got: list[int] = []
            single = threading.Thread(target=lambda: got.append(_take_one(slow, "A")), daemon=True)
            single.start()
            wait_until(lambda: slow.backend.redis.llen(slow.backend.queue_key("A")) == 2, "S queued on A")
            release_a.set()
            single.join(LIVENESS)
            assert got, "S was not woken when A became free"
            release_b.set()
            multi.join(LIVENESS)
            holder_a.join(LIVENESS)
            holder_b.join(LIVENESS)


def _take_one(client: LockClient, key: str) -> int:
    with client.lock(key, wait=None) as lease:
        return lease.fencing_token


def _take(client: LockClient, keys: list[str]) -> dict[str, int]:
    with client.multi_lock(keys, wait=None) as multi:
        return multi.fencing_tokens


class TestAcrossProcesses:
    def test_overlapping_sets_from_four_processes_never_deadlock_or_lose_an_update(
        self, lock_server: LockServer, namespace: str
    ) -> None:
        raw = lock_server.redis()
        procs = [
            subprocess.Popen([sys.executable, "-c", WORKER, lock_server.url, namespace, "25", str(seed)])
            for seed in range(4)
        ]
        for proc in procs:
            assert proc.wait(LIVENESS * 3) == 0
        for i in range(5):
            expected = int(raw.get(f"{namespace}expected:k{i}") or 0)
            assert int(raw.get(f"{namespace}count:k{i}") or 0) == expected


class TestReentryAndRenewal:
    def test_a_key_of_the_set_re_enters_and_the_whole_set_re_enters(self, client: LockClient) -> None:
        with client.multi_lock(["a", "b"]) as multi:
            with client.lock("a") as inner:
                assert inner is multi.leases[0]
            with client.multi_lock(["b", "a"]) as again:
                assert again.leases == multi.leases
        assert client.stats().held == 0

    def test_holding_part_of_the_set_is_refused_before_any_io(self, client: LockClient, commands: Any) -> None:
        with (
            client.lock("x"),
            commands.assert_none(),
            pytest.raises(ConfigurationError, match="deadlock"),
            client.multi_lock(["x", "y"]),
        ):
            pytest.fail("refused")

    def test_the_watchdog_renews_every_key_together(self, client: LockClient) -> None:
        with client.multi_lock(["r1", "r2", "r3"]) as multi:
            wait_until(lambda: client.stats().renewals >= 6, "two renewals of each key")
            stats = client.stats()
            assert stats.renewal_round_trips * 3 <= stats.renewals + 3, "the keys go in the same round trips"
            assert not multi.lost
        assert client.stats().lost == 0

    def test_losing_one_key_fails_the_block(self, client: LockClient) -> None:
        def lose_l2(multi: MultiLease) -> None:
            client.backend.redis.delete(client.backend.lock_key("l2"))
            wait_until(lambda: multi.lost, "the watchdog to find l2 gone")

        with pytest.raises(LockLost) as caught, client.multi_lock(["l1", "l2"]) as multi:
            lose_l2(multi)
        assert caught.value.key == "l2"
        assert client.backend.redis.exists(client.backend.lock_key("l1")) == 0, "the rest is released"


class TestOneRoundTripRelease:
    """The set is given back with one script call (multi_release.lua), counted by the server:
    ``INFO commandstats`` before and after shows one EVALSHA and no other command sent by a
    client (the others counted are the script's own and the INFO). A fixed lease, so no
    renewal runs in between; a first cycle beforehand, so the server has the script cached
    (a first EVALSHA meets NOSCRIPT and is followed by an EVAL, once per server)."""

    KEYS = ("rt:a", "rt:b", "rt:c")
    SCRIPT_RUNS = frozenset({"hget", "llen", "lpop", "publish", "del"})

    @staticmethod
    def calls(raw: Any) -> dict[str, int]:
        return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in raw.info("commandstats").items()}

    def assert_one_script_call(self, raw: Any, before: dict[str, int]) -> None:
        after = self.calls(raw)
        changed = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
        assert changed.pop("evalsha", 0) == 1, changed
        assert set(changed) <= {"info", *self.SCRIPT_RUNS}, changed
        assert raw.exists(*(f"{self.namespace}{{{key}}}" for key in self.KEYS)) == 0

    @pytest.fixture(autouse=True)
    def _namespace(self, namespace: str) -> None:
        self.namespace = namespace

    def test_sync(self, client: LockClient, raw: Any) -> None:
        with client.multi_lock(list(self.KEYS), lease=30):
            pass
        with client.multi_lock(list(self.KEYS), lease=30):
            before = self.calls(raw)
        self.assert_one_script_call(raw, before)

    def test_async(self, client: LockClient, raw: Any) -> None:
        async def main() -> dict[str, int]:
            async with client.multi_lock(list(self.KEYS), lease=30):
                pass
            before: dict[str, int] = {}
            async with client.multi_lock(list(self.KEYS), lease=30):
                before.update(self.calls(raw))  # blocking, on purpose: nothing else runs meanwhile
            return before

        before = asyncio.run(main())
        self.assert_one_script_call(raw, before)

    def test_a_stolen_key_is_reported_lost_and_the_rest_released(
        self, client: LockClient, raw: Any, lock_server: LockServer
    ) -> None:
        thief = LockClient.from_url(lock_server.url, namespace=self.namespace)
        block = client.multi_lock(list(self.KEYS), lease=30)

        def steal() -> tuple[Any, Any, Any]:
            multi = block.__enter__()
            raw.delete(f"{self.namespace}{{rt:b}}")
            with thief, thief.lock("rt:b", wait=0) as stolen, pytest.raises(LockLost) as caught:
                block.__exit__(None, None, None)
            return multi, stolen, caught

        # In a context of its own: the blocks above exit out of order, and the held-lease
        # stack they leave behind must not reach the tests run after this one.
        multi, stolen, caught = contextvars.copy_context().run(steal)
        assert caught.value.key == "rt:b"
        assert [lease.lost for lease in multi.leases] == [False, True, False]
        assert stolen.key == "rt:b"


class TestAsync:
    def test_async_with_and_a_lost_key_cancels_the_block(self, client: LockClient) -> None:
        async def main() -> tuple[dict[str, int], BaseException | None]:
            async with client.multi_lock(["p", "q"]) as multi:
                tokens = multi.fencing_tokens
            error: BaseException | None = None
            try:
                async with client.multi_lock(["p", "q"]):
                    client.backend.redis.delete(client.backend.lock_key("q"))
                    await asyncio.sleep(LIVENESS)  # cancelled when the watchdog finds q gone
            except LockLost as exc:
                error = exc
            await client.aclose()
            return tokens, error

        tokens, error = asyncio.run(main())
        assert set(tokens) == {"p", "q"}
        assert isinstance(error, LockLost)
        assert isinstance(error.__cause__, asyncio.CancelledError)


class TestBadInput:
    @pytest.mark.parametrize(
        ("keys", "error"),
        [([], ConfigurationError), ("ab", TypeError), ([1], TypeError), (["{bad}"], KeyTemplateError)],
    )
    def test_rejected_at_once_before_any_io(self, client: LockClient, commands: Any, keys: Any, error: Any) -> None:
        with commands.assert_none(), pytest.raises(error):
            client.multi_lock(keys)


class TestDecorator:
    def test_key_templates_lock_every_key_for_the_call(self, client: LockClient) -> None:
        seen: list[tuple[int, int]] = []

        @distributed_lock(keys=["account:<src>", "account:<dst>"], client=client)
        def transfer(src: int, dst: int) -> str:
            redis = client.backend.redis
            seen.append(
                (
                    redis.exists(client.backend.lock_key(f"account:{src}")),
                    redis.exists(client.backend.lock_key(f"account:{dst}")),
                )
            )
            return "done"

        assert transfer(1, 2) == "done"
        assert seen == [(1, 1)]
        assert client.stats().held == 0

    def test_a_keys_function_and_on_failure_with_the_busy_key(self, client: LockClient) -> None:
        failures: list[FailureContext] = []

        @distributed_lock(keys=lambda a: [f"sku:{s}" for s in a["skus"]], client=client, on_failure=failures.append)
        def reserve(skus: list[str]) -> str:
            return ",".join(skus)

        assert reserve(["x", "y"]) == "x,y"
        done, thread = hold(client, "sku:y")
        assert reserve(["x", "y"]) is None
        done.set()
        thread.join(LIVENESS)
        assert len(failures) == 1
        assert failures[0].key == "sku:y"

    def test_a_template_whose_placeholder_yields_a_list(self, client: LockClient) -> None:
        """keys="sku:<skus>" locks one key per element of skus, all at once."""
        seen: list[list[int]] = []

        @distributed_lock(keys="order:<order>:sku:<skus>", client=client)
        def reserve(order: int, skus: list[str]) -> None:
            seen.append([client.backend.redis.exists(client.backend.lock_key(f"order:{order}:sku:{s}")) for s in skus])

        reserve(7, ["a", "b", "c"])
        assert seen == [[1, 1, 1]]
        with pytest.raises(KeyTemplateError, match="no values"):
            reserve(7, [])

    def test_two_list_valued_placeholders_are_refused_at_call(self, client: LockClient, commands: Any) -> None:
        @distributed_lock(keys="<xs>:<ys>", client=client)
        def cross(xs: list[int], ys: list[int]) -> None: ...

        with commands.assert_none(), pytest.raises(KeyTemplateError, match="only one placeholder"):
            cross([1], [2])

    def test_async_def(self, client: LockClient) -> None:
        @distributed_lock(keys=["a:<n>", "b:<n>"], client=client)
        async def work(n: int) -> tuple[str, ...]:
            lease = current_lease()
            assert lease is not None
            return tuple(sorted(client.backend.redis.keys(client.backend.namespace + "*")))

        async def main() -> tuple[str, ...]:
            result = await work(3)
            await client.aclose()
            return result

        assert len(asyncio.run(main())) >= 2

    @pytest.mark.parametrize(
        ("options", "error"),
        [
            ({"keys": []}, ConfigurationError),
            ({"keys": 5}, TypeError),
            ({"keys": [1]}, TypeError),
            ({"keys": ["a"], "key": "b"}, ConfigurationError),
            ({"keys": ["a", "b"], "fair": True}, ConfigurationError),
            ({"keys": ["a:<nope>"]}, KeyTemplateError),
        ],
    )
    def test_bad_keys_are_rejected_at_decoration(self, client: LockClient, options: dict[str, Any], error: Any) -> None:
        with pytest.raises(error):

            @distributed_lock(client=client, **options)
            def work(n: int) -> None: ...

    def test_a_keys_function_returning_no_list_fails_before_any_io(self, client: LockClient, commands: Any) -> None:
        @distributed_lock(keys=lambda a: "not-a-list", client=client)
        def work() -> None: ...

        with commands.assert_none(), pytest.raises(KeyTemplateError):
            work()

    def test_an_executor_is_refused_at_decoration(self, client: LockClient) -> None:
        with ThreadPoolExecutor(max_workers=1) as pool, pytest.raises(ConfigurationError, match="executor"):

            @distributed_lock(keys=["a", "b"], client=client, executor=pool)
            def work() -> None: ...
