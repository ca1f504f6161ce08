"""Mutual exclusion across processes on a real server: worker processes increment a
non-atomic counter (GET, pause, SET) under ``@distributed_lock``, and every increment
survives; without the lock the same workload loses increments."""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from lockaspect import LockClient, current_lease, distributed_lock
from lockaspect.testing import LockServer

WORKERS = 4
INCREMENTS = 40  # per worker process
JOIN_TIMEOUT = 90.0  # a safety net against a hung worker, not a speed expectation

FORK_WARNING = "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"


def _increment(raw: redis.Redis, counter: str) -> int:
    """Read, pause, write: a read-modify-write that loses updates when two run at once."""
    value = int(raw.get(counter) or 0)
    time.sleep(0.001)  # part of the workload: widens the race window
    raw.set(counter, value + 1)
    return value


def worker(url: str, namespace: str, worker_id: int, mode: str, barrier: Any) -> None:
    """One worker process: ``INCREMENTS`` increments, locked or not, inline or on a pool.

    Under the lock every increment appends ``worker:caller:value-read:fencing-token`` to a
    log list, inside the lock, so the log is in lock order.
    """
    raw = redis.Redis.from_url(url)
    counter, log = namespace + "counter", namespace + "log"
    try:
        if mode == "unlocked":
            barrier.wait(timeout=60)
            for _ in range(INCREMENTS):
                _increment(raw, counter)
            return
        with LockClient.from_url(url, namespace=namespace) as client:
            pool = ThreadPoolExecutor(max_workers=2) if mode == "executor" else None

            @distributed_lock(key="counter", wait=None, client=client, executor=pool or "inline")
            def locked_increment(caller: int) -> None:
                lease = current_lease()
                assert lease is not None
                value = _increment(raw, counter)
                raw.rpush(log, f"{worker_id}:{caller}:{value}:{lease.fencing_token}")

            def run(caller: int, count: int) -> None:
                for _ in range(count):
                    locked_increment(caller)

            barrier.wait(timeout=60)
            if pool is None:
                run(0, INCREMENTS)
            else:
                # Two caller threads per process, each handing its bodies to the pool.
                callers = [threading.Thread(target=run, args=(c, INCREMENTS // 2)) for c in range(2)]
                for thread in callers:
                    thread.start()
                for thread in callers:
                    thread.join()
                pool.shutdown()
    finally:
        raw.close()


def run_workers(context_name: str, server: LockServer, namespace: str, mode: str) -> None:
    ctx = multiprocessing.get_context(context_name)
    barrier = ctx.Barrier(WORKERS)
    processes = [
        ctx.Process(target=worker, args=(server.url, namespace, i, mode, barrier), name=f"worker-{i}")
        for i in range(WORKERS)
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
    assert [p.exitcode for p in processes] == [0] * WORKERS


def check_log(raw: redis.Redis, namespace: str) -> None:
    """The counter is exact, and the log proves one holder at a time with rising fencing tokens."""
    assert int(raw.get(namespace + "counter") or 0) == WORKERS * INCREMENTS
    entries = [entry.decode().split(":") for entry in raw.lrange(namespace + "log", 0, -1)]
    assert len(entries) == WORKERS * INCREMENTS
    values = [int(value) for _, _, value, _ in entries]
    tokens = [int(token) for _, _, _, token in entries]
    # In lock order every increment read the previous one's result...
    assert values == list(range(WORKERS * INCREMENTS))
    # ...and every acquisition got a fresh, larger fencing token.
    assert len(set(tokens)) == len(tokens)
    assert tokens == sorted(tokens)
    by_caller: dict[tuple[str, str], list[int]] = {}
    for worker_id, caller, _, token in entries:
        by_caller.setdefault((worker_id, caller), []).append(int(token))
    assert {w for w, _ in by_caller} == {str(i) for i in range(WORKERS)}
    for sequence in by_caller.values():
        assert all(a < b for a, b in itertools.pairwise(sequence)), sequence


class TestMutualExclusionAcrossProcesses:
    @pytest.mark.filterwarnings(FORK_WARNING)
    def test_control_without_the_lock_loses_increments(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis
    ) -> None:
        """Without the lock, concurrent read-pause-write increments overwrite each other."""
        run_workers("fork", lock_server, namespace, "unlocked")
        assert int(raw.get(namespace + "counter") or 0) < WORKERS * INCREMENTS

    @pytest.mark.filterwarnings(FORK_WARNING)
    def test_forked_workers_never_lose_an_increment(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis
    ) -> None:
        """Forked workers incrementing under the lock reach the exact count, with distinct rising fencing tokens."""
        run_workers("fork", lock_server, namespace, "inline")
        check_log(raw, namespace)

    @pytest.mark.filterwarnings(FORK_WARNING)
    def test_forked_workers_with_a_thread_pool_executor(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis
    ) -> None:
        """Two caller threads per process, bodies on a thread pool: still exact, one holder at a time."""
        run_workers("fork", lock_server, namespace, "executor")
        check_log(raw, namespace)

    def test_spawned_workers_never_lose_an_increment(
        self, lock_server: LockServer, namespace: str, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Spawned workers (a fresh interpreter each) incrementing under the lock reach the exact count."""
        # The spawned interpreters import this module by name: make its root importable.
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
        run_workers("spawn", lock_server, namespace, "inline")
        check_log(raw, namespace)
