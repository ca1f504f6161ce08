"""Locks across the processes of one host with no server at all: SQLite.

Four worker processes (say, four cron jobs or gunicorn workers) all try to run the nightly
jobs. ``@distributed_lock`` on a ``sqlite:///`` URL lets one of them at a time into each job,
which checks whether the job already ran tonight and runs it if not: every job runs exactly
once. The result is written through a fenced SQL update, so a holder whose lease had ended
could never overwrite a newer holder's result.

    .venv/bin/python examples/sqlite_jobs.py            # uses a temporary directory

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).

Exits non-zero if anything it demonstrates does not hold.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import sys
import tempfile
from pathlib import Path

from lockaspect import LockClient, current_lease, distributed_lock

JOBS = ["billing", "reports", "cleanup"]
WORKERS = 4


def worker(url: str, db: str, ready: multiprocessing.synchronize.Barrier) -> None:
    client = LockClient.from_url(url)  # one client per process

    @distributed_lock(key="job:<job>", client=client, wait=30)
    def run_job(job: str) -> str:
        token = current_lease().fencing_token
        with sqlite3.connect(db, timeout=10) as conn:
            (runs,) = conn.execute("SELECT runs FROM results WHERE job = ?", (job,)).fetchone()
            if runs:  # checked under the lock: nobody else can be between this check and the write
                return "done already"
            # ... the job's work, then its result, written through the fence:
            updated = conn.execute(
                "UPDATE results SET runs = runs + 1, fence = ? WHERE job = ? AND fence < ?", (token, job, token)
            ).rowcount
        return "ran" if updated else "stale"

    ready.wait()  # start together, so the workers really race for each job
    for job in JOBS:
        outcome = run_job(job)
        with sqlite3.connect(db, timeout=10) as conn:
            conn.execute("INSERT INTO outcomes VALUES (?, ?)", (job, outcome))
    client.close()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "app.db")
        # The locks get a file of their own: SQLite has one writer per file, so an application
        # transaction on the same file would hold up every lock operation until it commits.
        url = f"sqlite:///{Path(tmp) / 'locks.db'}"  # an absolute path: sqlite:////tmp/.../locks.db
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE results (job TEXT PRIMARY KEY, runs INTEGER NOT NULL, fence INTEGER NOT NULL)")
            conn.execute("CREATE TABLE outcomes (job TEXT, outcome TEXT)")
            conn.executemany("INSERT INTO results VALUES (?, 0, 0)", [(job,) for job in JOBS])
        LockClient.from_url(url).close()  # create the lock tables before the race
        context = multiprocessing.get_context("spawn")
        ready = context.Barrier(WORKERS)
        processes = [context.Process(target=worker, args=(url, db, ready)) for _ in range(WORKERS)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        with sqlite3.connect(db) as conn:
            outcomes = conn.execute("SELECT job, outcome FROM outcomes").fetchall()
            runs = dict(conn.execute("SELECT job, runs FROM results").fetchall())
    print(f"{WORKERS} workers x {len(JOBS)} jobs: {sorted(outcomes)}")
    for job in JOBS:
        ran = [outcome for name, outcome in outcomes if name == job and outcome == "ran"]
        assert len(ran) == 1, (job, outcomes)  # exactly once
        assert runs[job] == 1, (job, runs)
    assert all(process.exitcode == 0 for process in processes), [p.exitcode for p in processes]
    assert len(outcomes) == WORKERS * len(JOBS)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
