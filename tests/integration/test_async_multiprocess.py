"""Mutual exclusion across processes with asyncio workers, on a real server: each worker
process runs an event loop whose tasks increment a non-atomic counter (GET, pause, SET)
under an ``async def`` decorated with ``@distributed_lock``; every increment survives, also
when sync and async processes contend for the same key. Without the lock the same workload
loses increments."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from typing import Any

import pytest
import redis
import redis.asyncio

from lockaspect import LockClient, current_lease, distributed_lock
from lockaspect.testing import LockServer

PROCESSES = 4
TASKS = 2  # per async process: they contend inside the process as well as across processes
INCREMENTS = 20  # per task (sync processes run TASKS * INCREMENTS from one thread)
PER_PROCESS = TASKS * INCREMENTS
TOTAL = PROCESSES * PER_PROCESS
JOIN_TIMEOUT = 90.0  # a safety net against a hung worker, not a speed expectation

FORK = multiprocessing.get_context("fork")
FORK_WARNING = "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"


async def _increment(raw: Any, counter: str) -> int:
    """Read, pause, write: a read-modify-write that loses updates when two run at once."""
    value = int(await raw.get(counter) or 0)
    await asyncio.sleep(0.001)  # part of the workload: other tasks and processes run here
    await raw.set(counter, value + 1)
    return value


def async_worker(url: str, namespace: str, worker_id: int, locked: bool, barrier: Any) -> None:
    """One process: an event loop whose ``TASKS`` tasks each do ``INCREMENTS`` increments.

    Under the lock every increment appends ``worker:task:value-read:fencing-token`` to a log
    list, inside the lock, so the log is in lock order.
    """
    counter, log = namespace + "counter", namespace + "log"

    async def main() -> None:
        raw = redis.asyncio.Redis.from_url(url)
        client = LockClient.from_url(url, namespace=namespace)
        try:

            @distributed_lock(key="counter", wait=None, client=client)
            async def locked_increment(task_id: int) -> None:
                lease = current_lease()
                assert lease is not None
                value = await _increment(raw, counter)
                await raw.rpush(log, f"{worker_id}:{task_id}:{value}:{lease.fencing_token}")

            async def run(task_id: int) -> None:
                for _ in range(INCREMENTS):
                    if locked:
                        await locked_increment(task_id)
                    else:
                        await _increment(raw, counter)

            await asyncio.gather(*(run(task_id) for task_id in range(TASKS)))
        finally:
            await client.aclose()
            await raw.aclose()

    barrier.wait(timeout=60)
    asyncio.run(main())


def sync_worker(url: str, namespace: str, worker_id: int, locked: bool, barrier: Any) -> None:
    """One process: ``PER_PROCESS`` increments from one thread with a sync decorated function."""
    raw = redis.Redis.from_url(url)
    counter, log = namespace + "counter", namespace + "log"
    try:
        with LockClient.from_url(url, namespace=namespace) as client:

            @distributed_lock(key="counter", wait=None, client=client)
            def locked_increment() -> None:
                lease = current_lease()
                assert lease is not None
                value = int(raw.get(counter) or 0)
                time.sleep(0.001)  # part of the workload: widens the race window
                raw.set(counter, value + 1)
                raw.rpush(log, f"{worker_id}:0:{value}:{lease.fencing_token}")

            barrier.wait(timeout=60)
            for _ in range(PER_PROCESS):
                locked_increment()
    finally:
        raw.close()


def run_workers(server: LockServer, namespace: str, kinds: list[str], locked: bool = True) -> None:
    barrier = FORK.Barrier(len(kinds))
    targets = {"async": async_worker, "sync": sync_worker}
    processes = [
        FORK.Process(target=targets[kind], args=(server.url, namespace, i, locked, barrier), name=f"{kind}-worker-{i}")
        for i, kind in enumerate(kinds)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_TIMEOUT)
    hung = [p.name for p in processes if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    assert hung == []
    assert [p.exitcode for p in processes] == [0] * len(processes)


def check_log(raw: redis.Redis, namespace: str) -> list[list[str]]:
    """The counter is exact, and the log proves one holder at a time with rising fencing tokens."""
    assert int(raw.get(namespace + "counter") or 0) == TOTAL
    entries = [entry.decode().split(":") for entry in raw.lrange(namespace + "log", 0, -1)]
    assert len(entries) == TOTAL
    values = [int(value) for _, _, value, _ in entries]
    tokens = [int(token) for _, _, _, token in entries]
    # In lock order every increment read the previous one's result...
    assert values == list(range(TOTAL))
    # ...and every acquisition got a fresh, larger fencing token.
    assert len(set(tokens)) == len(tokens)
    assert tokens == sorted(tokens)
    by_caller: dict[tuple[str, str], list[int]] = {}
    for worker_id, task_id, _, token in entries:
        by_caller.setdefault((worker_id, task_id), []).append(int(token))
    for sequence in by_caller.values():
        assert all(a < b for a, b in itertools.pairwise(sequence)), sequence
    assert raw.keys(namespace + "{*}") == []  # no lock left behind
    return entries


class TestAsyncMutualExclusionAcrossProcesses:
    @pytest.mark.filterwarnings(FORK_WARNING)
    def test_control_without_the_lock_loses_increments(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis
    ) -> None:
        """Without the lock, async tasks in several processes overwrite each other's increments."""
        run_workers(lock_server, namespace, ["async"] * PROCESSES, locked=False)
        assert int(raw.get(namespace + "counter") or 0) < TOTAL

    @pytest.mark.filterwarnings(FORK_WARNING)
    def test_async_workers_never_lose_an_increment(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis
    ) -> None:
        """Async tasks in several processes incrementing under the lock reach the exact count, with distinct,
        rising fencing tokens and every task's tokens rising."""
        run_workers(lock_server, namespace, ["async"] * PROCESSES)
        entries = check_log(raw, namespace)
        assert {(worker_id, task_id) for worker_id, task_id, _, _ in entries} == {
            (str(w), str(t)) for w in range(PROCESSES) for t in range(TASKS)
        }

    @pytest.mark.filterwarnings(FORK_WARNING)
    def test_sync_and_async_workers_on_one_key_never_lose_an_increment(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis
    ) -> None:
        """Sync and async processes contending for the same key reach the exact count, one holder at a time."""
        kinds = ["sync", "async", "sync", "async"]
        run_workers(lock_server, namespace, kinds)
        entries = check_log(raw, namespace)
        per_worker = {str(w): 0 for w in range(len(kinds))}
        for worker_id, _, _, _ in entries:
            per_worker[worker_id] += 1
        assert per_worker == {str(w): PER_PROCESS for w in range(len(kinds))}
