"""Singleton Celery tasks on a real worker (lockaspect.contrib.celery, docs/integrations/celery.md).

One ``celery worker --pool=prefork -c 2`` runs for the module on the tasks of
celery_singleton_app.py, with the session's Valkey as its broker and result backend (a database
of its own) and as the lock store (the module's namespace). The tasks record what they did in
that namespace; the test waits on those records (BLPOP) and on the results, never on a clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.result import AsyncResult

from lockaspect import ConfigurationError, FailureContext, LockClient, LockNotAcquired, distributed_lock
from lockaspect.contrib.celery import busy_countdown, retry_when_busy
from lockaspect.testing import LockServer

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BROKER_DB = 9  # the broker's and result backend's database on the session server: this module's only
TIMEOUT = 20.0


@dataclass
class Worker:
    app: Celery  # the sending side (the test process does not import the worker's module)
    client: LockClient  # on the worker's namespace
    records: Any  # redis-py on the lock store
    namespace: str
    log: Path

    def send(self, name: str, *args: Any, **kwargs: Any) -> AsyncResult:
        return self.app.send_task(f"celery_singleton_app.{name}", args=args, kwargs=kwargs)

    def result(self, sent: AsyncResult) -> Any:
        try:
            return sent.get(timeout=TIMEOUT)
        except Exception as exc:
            raise AssertionError(f"task {sent.id} failed: {exc!r}\n{self.log_tail()}") from exc

    def log_tail(self) -> str:
        return "worker log:\n" + self.log.read_text(errors="replace")[-4000:]

    def next_event(self, account: str) -> tuple[str, str]:
        """The next (what, task id) a task of ``account`` pushed (started, retry), waiting for it."""
        popped = self.records.blpop([f"{self.namespace}records:events:{account}"], timeout=TIMEOUT)
        assert popped is not None, f"no event from {account}'s tasks; {self.log_tail()}"
        what, task_id = popped[1].decode().split(":", 1)
        return what, task_id

    def let_finish(self, task_id: str) -> None:
        self.records.rpush(f"{self.namespace}records:go:{task_id}", "go")

    def log_of(self, account: str) -> list[str]:
        return [entry.decode() for entry in self.records.lrange(f"{self.namespace}records:log:{account}", 0, -1)]


@pytest.fixture(scope="module")
def worker(lock_server: LockServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    namespace = f"t-celery-{uuid.uuid4().hex[:8]}:"
    broker = f"{lock_server.url.rsplit('/', 1)[0]}/{BROKER_DB}"
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    env = {
        **os.environ,
        "CELERY_SINGLETON_BROKER": broker,
        "CELERY_SINGLETON_NAMESPACE": namespace,
        "LOCKASPECT_URL": lock_server.url,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "celery", "-A", "celery_singleton_app", "worker", "--pool=prefork", "-c", "2"]
    command += ["--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=INFO"]
    app = Celery("sender", broker=broker, backend=broker)
    client = LockClient.from_url(lock_server.url, namespace=namespace)
    records = lock_server.redis()
    with log.open("wb") as output:
        # A session of its own: the prefork children are killed with it, whatever happens.
        process = subprocess.Popen(command, env=env, cwd=HERE, stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        started = Worker(app, client, records, namespace, log)
        assert started.result(started.send("ping")) == "pong"
        yield started
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        app.close()
        client.close()
        left = list(records.scan_iter(match=f"{namespace}*"))  # records and fencing counters
        if left:
            records.delete(*left)
        lock_server.redis(db=BROKER_DB).flushdb()
        records.close()


def assert_nothing_held(worker: Worker) -> None:
    assert list(worker.client.held_locks()) == []


def test_two_reports_of_one_account_run_one_at_a_time(worker: Worker) -> None:
    first, second = worker.send("report", "acct-1", hold=True), worker.send("report", "acct-1", hold=True)
    # One of them holds report:acct-1 (and waits for the test); the other found it busy and
    # was sent back to the queue with a countdown: only then is the holder let go.
    seen: dict[str, set[str]] = {"started": set(), "retry": set()}
    while not (seen["started"] and seen["retry"] - seen["started"]):
        what, task_id = worker.next_event("acct-1")
        seen[what].add(task_id)
    [holder] = seen["started"]
    [retried] = {first.id, second.id} - {holder}
    assert seen["retry"] == {retried}
    worker.let_finish(holder)
    # After its countdown (the holder's remaining lease, 1 s) the other one gets the lock; it
    # may have been sent back once more if it came round before the holder was done.
    while (event := worker.next_event("acct-1")) != ("started", retried):
        assert event == ("retry", retried)
    worker.let_finish(retried)

    results = {r["id"]: r for r in (worker.result(first), worker.result(second))}
    assert results[holder]["retries"] == 0
    assert results[retried]["retries"] >= 1
    assert results[retried]["fence"] > results[holder]["fence"]
    # Never interleaved: the second began after the first ended.
    assert worker.log_of("acct-1") == [f"begin:{holder}", f"end:{holder}", f"begin:{retried}", f"end:{retried}"]
    assert_nothing_held(worker)


def test_reports_of_different_accounts_run_in_parallel(worker: Worker) -> None:
    one, two = worker.send("report", "acct-2", hold=True), worker.send("report", "acct-3", hold=True)
    # Both are inside their locks at once (each waits for the test): neither waited for the other.
    assert worker.next_event("acct-2") == ("started", one.id)
    assert worker.next_event("acct-3") == ("started", two.id)
    worker.let_finish(one.id)
    worker.let_finish(two.id)
    assert worker.result(one)["retries"] == 0
    assert worker.result(two)["retries"] == 0
    assert_nothing_held(worker)


def test_a_duplicate_is_skipped_while_the_lock_is_held(worker: Worker) -> None:
    with worker.client.lock("report:acct-4", lease=30.0):
        busy = worker.result(worker.send("report_or_skip", "acct-4"))
    assert busy["skipped"] == "report:acct-4"
    assert 0 < busy["holder_ttl"] <= 30.0
    assert worker.result(worker.send("report_or_skip", "acct-4")) == {"ran": "acct-4"}
    assert_nothing_held(worker)


def test_a_task_out_of_retries_fails_with_lock_not_acquired(worker: Worker) -> None:
    with worker.client.lock("report:acct-6", lease=30.0):
        failed = worker.send("report_without_retries", "acct-6")
        # Rebuilt from the result backend's record (class name and message: JSON).
        with pytest.raises(LockNotAcquired, match=r"lock 'report:acct-6' is held by another owner"):
            failed.get(timeout=TIMEOUT)
    assert failed.state == "FAILURE"
    assert "lock 'report:acct-6' is held by another owner" in failed.traceback  # the worker's
    assert_nothing_held(worker)


def test_a_worker_killed_holding_the_lock_frees_it_when_its_lease_ends(worker: Worker) -> None:
    crashed = worker.send("crash_while_holding", "acct-5")
    with pytest.raises(WorkerLostError, match=r"signal 9 \(SIGKILL\)"):
        crashed.get(timeout=TIMEOUT, propagate=True)
    # Nobody renews the dead process's lease (1 s): the next report gets the lock, at once or
    # after a retry, with a larger fencing token.
    after = worker.result(worker.send("report", "acct-5"))
    assert after["fence"] > int(worker.records.get(f"{worker.namespace}records:crashed:acct-5"))
    assert worker.log_of("acct-5") == [f"begin:{after['id']}", f"end:{after['id']}"]
    assert_nothing_held(worker)


# In the test process, without a worker: what retry_when_busy does outside its pattern.


@contextmanager
def holding(key: str, url: str, namespace: str) -> Iterator[None]:
    """``key`` held by another client (a lock the same thread holds through the same client
    would be re-entered, not busy)."""
    with LockClient.from_url(url, namespace=namespace) as other, other.lock(key, lease=30.0):
        yield


def test_countdown_is_the_holders_remaining_lease_rounded_up_and_bounded() -> None:
    def busy(holder_ttl: float | None) -> LockNotAcquired:
        return LockNotAcquired("busy", key="k", waited=0.0, holder_ttl=holder_ttl)

    assert busy_countdown(busy(12.3)) == 13.0
    assert busy_countdown(busy(0.2)) == 1.0
    assert busy_countdown(busy(None), min_countdown=2.5) == 2.5
    assert busy_countdown(busy(29.5), max_countdown=5.0) == 5.0
    with pytest.raises(ValueError, match="max_countdown"):
        retry_when_busy(min_countdown=2.0, max_countdown=1.0)


def test_retry_when_busy_needs_a_bound_task(lock_server: LockServer, namespace: str) -> None:
    app = Celery("direct", set_as_current=False)
    with LockClient.from_url(lock_server.url, namespace=namespace) as client:

        @app.task(name="needs-bound.unbound")  # no bind=True: the function has no task argument
        @distributed_lock(key="report:<account_id>", client=client, on_failure=retry_when_busy())
        def unbound(account_id: str) -> str:
            return "ran"

        @app.task(bind=True, name="needs-bound.bound")
        @distributed_lock(key="report:<account_id>", client=client, on_failure=retry_when_busy())
        def bound(self: Any, account_id: str) -> str:
            return "ran"

        with holding("report:a", lock_server.url, namespace):
            with pytest.raises(ConfigurationError, match="bind=True"):
                unbound("a")
            # Called directly (not by a worker) Celery cannot retry: the LockNotAcquired is raised.
            with pytest.raises(LockNotAcquired):
                bound("a")
        assert bound("a") == "ran"


def test_the_failure_context_carries_the_bound_task(lock_server: LockServer, namespace: str) -> None:
    app = Celery("direct", set_as_current=False)
    seen: list[FailureContext] = []
    with LockClient.from_url(lock_server.url, namespace=namespace) as client:

        @app.task(bind=True, name="failure-context.bound")
        @distributed_lock(key="report:<account_id>", client=client, on_failure=seen.append)
        def bound(self: Any, account_id: str) -> str:
            return "ran"

        with holding("report:b", lock_server.url, namespace):
            bound("b")
        [ctx] = seen
        assert ctx.arguments["self"].name == bound.name  # the task instance (``bound`` is Celery's proxy of it)
        assert ctx.arguments["account_id"] == "b"
        assert ctx.key == "report:b"


def test_the_lock_above_the_task_decorator_is_refused() -> None:
    """Reversed, ``.delay()`` would go round the lock: refused at decoration."""
    from celery import Celery

    app = Celery("reversed", set_as_current=False)
    with pytest.raises(ConfigurationError, match="below"):

        @distributed_lock(key="report:<account_id>")
        @app.task(bind=True, name="reversed.report")
        def report(self: object, account_id: int) -> None: ...
