"""Locks in ZooKeeper: nightly jobs run once, a read-write lock, and a lost lock.

Four worker processes all try to run the nightly jobs. ``@distributed_lock`` on a
``zookeeper://`` URL lets one of them at a time into each job, which checks whether the job
already ran tonight and runs it if not: every job runs exactly once. The result is written
through a fenced SQL update. The fencing token is the creation zxid of the holder's node in
ZooKeeper, so it only grows.

Then, in one process: readers share a read-write lock and a writer waits for them (a reader
that comes after the writer waits behind it); a worker killed while it holds a lock frees it
when its ZooKeeper session expires; and an operator's force-release reaches the holder at
once (``on_lost``, then ``LockLost``), while its stale write is refused by the fence.

    .venv/bin/python examples/zookeeper_jobs.py                         # starts a throwaway ZooKeeper
    .venv/bin/python examples/zookeeper_jobs.py zookeeper://127.0.0.1:2181
    LOCKASPECT_ZK_URL=zookeeper://zk1:2181,zk2:2181/myapp .venv/bin/python examples/zookeeper_jobs.py

From the repository, after `make test` (it installs kazoo, and ZooKeeper's jars where it can), or
after `make demo` and `.venv/bin/pip install -e '.[zookeeper]'`.

Without a URL it starts a throwaway server with lockaspect.testing.ZooKeeperServer, which
needs Java and ZooKeeper's jars (Debian: apt-get install libzookeeper-java
default-jre-headless). It needs kazoo: pip install 'lockaspect[zookeeper]'.

Exits non-zero if anything it demonstrates does not hold.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from lockaspect import Lease, LockClient, LockLost, current_lease, distributed_lock

JOBS = ["billing", "reports", "cleanup"]
WORKERS = 4
# The namespace's node in ZooKeeper is /zookeeper-jobs; every key is a node under it.
NAMESPACE = "zookeeper-jobs:"
# Seconds the server keeps the session (and so the locks) of a client it no longer hears
# from. The server clamps it to its minSessionTimeout..maxSessionTimeout.
SESSION_TIMEOUT = 2.0


def fenced_write(db: str, job: str, token: int) -> bool:
    """Count one run of ``job`` unless a holder with a newer token already wrote."""
    with sqlite3.connect(db, timeout=10) as conn:
        sql = "UPDATE results SET runs = runs + 1, fence = ? WHERE job = ? AND fence < ?"
        return conn.execute(sql, (token, job, token)).rowcount == 1


def worker(url: str, db: str, ready: multiprocessing.synchronize.Barrier) -> None:
    client = LockClient.from_url(url, namespace=NAMESPACE)  # one client (one session) per process

    @distributed_lock(key="job:<job>", client=client, wait=30)
    def run_job(job: str) -> str:
        token = current_lease().fencing_token
        with sqlite3.connect(db, timeout=10) as conn:
            (runs,) = conn.execute("SELECT runs FROM results WHERE job = ?", (job,)).fetchone()
        if runs:  # checked under the lock: nobody else can be between this check and the write
            return "done already"
        # ... the job's work, then its result, written through the fence:
        return "ran" if fenced_write(db, job, token) else "stale"

    ready.wait()  # start together, so the workers really race for each job
    for job in JOBS:
        outcome = run_job(job)
        with sqlite3.connect(db, timeout=10) as conn:
            conn.execute("INSERT INTO outcomes VALUES (?, ?)", (job, outcome))
    client.close()  # ends the session: anything still held would be freed at once


def nightly_jobs(url: str, db: str) -> None:
    print(f"1. {WORKERS} worker processes race for {len(JOBS)} jobs")
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(WORKERS)
    processes = [context.Process(target=worker, args=(url, db, ready)) for _ in range(WORKERS)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert all(process.exitcode == 0 for process in processes), [p.exitcode for p in processes]
    with sqlite3.connect(db) as conn:
        outcomes = conn.execute("SELECT job, outcome FROM outcomes").fetchall()
        runs = dict(conn.execute("SELECT job, runs FROM results").fetchall())
        fences = dict(conn.execute("SELECT job, fence FROM results").fetchall())
    print(f"   outcomes: {sorted(outcomes)}")
    print(f"   fencing tokens (creation zxids of the holders' nodes): {fences}")
    for job in JOBS:
        ran = [outcome for name, outcome in outcomes if name == job and outcome == "ran"]
        assert len(ran) == 1, (job, outcomes)  # exactly once
        assert runs[job] == 1, (job, runs)
    assert len(outcomes) == WORKERS * len(JOBS)


def read_write(client: LockClient) -> None:
    print("2. a read-write lock: readers share, a writer waits for them, a later reader waits for the writer")
    rw = client.rw_lock("config")
    events: list[str] = []
    inside = threading.Barrier(3, timeout=10)  # r1, r2 and this thread
    go = threading.Event()

    def reader(name: str) -> None:
        with rw.read(wait=10):
            events.append(f"{name} reads")
            if name != "r3":
                inside.wait()  # r1 and r2 hold the read lock at the same time
                go.wait(10)
            events.append(f"{name} done")  # still inside: the release comes after it

    def writer() -> None:
        with rw.write(wait=10):
            events.append("w writes")
            events.append("w done")

    def waiting() -> int:  # waiters queued on the key, as an operator sees them
        return sum(state.waiters for state in client.backend.describe("config"))

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, events
            time.sleep(0.01)

    # One thread per reader and writer; each takes its own place in the key's queue.
    threads = [threading.Thread(target=reader, args=(name,)) for name in ("r1", "r2")]
    for thread in threads:
        thread.start()
    inside.wait()
    threads.append(threading.Thread(target=writer))
    threads[-1].start()
    until(lambda: waiting() == 1)  # w waits for the readers
    threads.append(threading.Thread(target=reader, args=("r3",)))
    threads[-1].start()
    until(lambda: waiting() == 2)  # r3 waits for w, although only readers hold the lock
    go.set()
    for thread in threads:
        thread.join(20)
    print(f"   {events}")
    assert events.index("w writes") > max(events.index("r1 done"), events.index("r2 done")), events
    assert events.index("r3 reads") > events.index("w done"), events


def crashed_holder(url: str, started: multiprocessing.synchronize.Event) -> None:
    client = LockClient.from_url(url, namespace=NAMESPACE, session_timeout=SESSION_TIMEOUT)
    client.lock("import").__enter__()  # held, and never given back: this process is killed
    started.set()
    time.sleep(60)


def crash(url: str, client: LockClient) -> None:
    print("3. a worker holding a lock is killed (kill -9): the lock frees when its session expires")
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    process = context.Process(target=crashed_holder, args=(url, started))
    process.start()
    took = started.wait(30)
    assert took, "the worker did not take the lock"
    process.kill()
    killed = time.monotonic()
    with client.lock("import", wait=30) as lease:  # woken by the server deleting the dead node
        waited = time.monotonic() - killed
        print(f"   the lock was free again {waited:.1f} s after the kill; new fencing token {lease.fencing_token}")
    process.join(10)


def lost(client: LockClient, operator: LockClient, db: str) -> None:
    print("4. an operator force-releases a held lock: the holder hears at once, and its fence is stale")
    told: list[str | None] = []

    def on_lost(lease: Lease) -> None:  # runs on a lockaspect thread: keep it short
        told.append(lease.lost_reason)

    try:
        with client.lock("job:billing", on_lost=on_lost) as lease:
            old = lease.fencing_token
            freed = operator.backend.force_release("job:billing")  # like `delete <node>` in zkCli
            assert freed
            with operator.lock("job:billing", wait=5) as newer:  # the next holder writes first
                wrote = fenced_write(db, "billing", newer.fencing_token)
                assert wrote
            deadline = time.monotonic() + 5
            while not told and time.monotonic() < deadline:
                time.sleep(0.01)
            print(f"   on_lost ran: lost_reason={lease.lost_reason!r}, lease.lost={lease.lost}")
            stale = fenced_write(db, "billing", old)  # the old holder, too late: refused
            print(f"   the old holder's write with token {old} (newer: {newer.fencing_token}) went in: {stale}")
            assert not stale
        raised = None  # not reached: leaving the block raises
    except LockLost as exc:  # leaving a block whose lease was lost raises
        raised = exc.reason
        print(f"   the block raised LockLost(reason={raised!r})")
    assert raised == "not-owner", raised
    assert told == ["not-owner"], told


def main(url: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        db = str(Path(tmp) / "app.db")
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE results (job TEXT PRIMARY KEY, runs INTEGER NOT NULL, fence INTEGER NOT NULL)")
            conn.execute("CREATE TABLE outcomes (job TEXT, outcome TEXT)")
            conn.executemany("INSERT INTO results VALUES (?, 0, 0)", [(job,) for job in JOBS])
        nightly_jobs(url, db)
        client = stack.enter_context(LockClient.from_url(url, namespace=NAMESPACE))
        operator = stack.enter_context(LockClient.from_url(url, namespace=NAMESPACE))
        read_write(client)
        crash(url, client)
        lost(client, operator, db)
    print("ok")


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LOCKASPECT_ZK_URL")
    with ExitStack() as stack:
        if not url:
            from lockaspect.testing import ZooKeeperServer

            try:
                server = ZooKeeperServer()
            except FileNotFoundError as exc:  # no java, or no ZooKeeper jars
                sys.exit(f"cannot start a throwaway ZooKeeper: {exc}")
            url = stack.enter_context(server).url
            print(f"started a throwaway ZooKeeper on {url}")
        main(url)
