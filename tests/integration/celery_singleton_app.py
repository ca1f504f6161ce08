"""The Celery app tests/integration/test_celery.py runs a real worker on (``celery -A
celery_singleton_app worker``, with this directory on PYTHONPATH).

Configured from the environment the test sets: ``CELERY_SINGLETON_BROKER`` (the broker and
result backend), ``LOCKASPECT_URL`` and ``CELERY_SINGLETON_NAMESPACE`` (the lock store and the
test's namespace, where the tasks also write their records).

The lock client is built here, at import, in the worker's main process: the prefork pool's
children are forked from it afterwards (lockaspect resets a client in a forked child). Its 1 s
watchdog lease keeps the countdowns (the holder's remaining lease) at 1 s.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import redis
from celery import Celery
from celery.signals import task_retry

from lockaspect import FailureContext, LockClient, configure, current_lease, distributed_lock
from lockaspect.contrib.celery import retry_when_busy

BROKER = os.environ["CELERY_SINGLETON_BROKER"]
NAMESPACE = os.environ["CELERY_SINGLETON_NAMESPACE"]

app = Celery("celery_singleton_app", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_enable_remote_control=False,  # no pidbox keys on the broker
    worker_hijack_root_logger=False,
    task_track_started=True,
)

configure(LockClient.from_url(os.environ["LOCKASPECT_URL"], namespace=NAMESPACE, watchdog_lease=1.0, tick=0.02))
records = redis.Redis.from_url(os.environ["LOCKASPECT_URL"])


# The tasks record what they did in the test's namespace, per account; the test reads them back.
def log_of(account_id: str) -> str:
    """Where a report task writes begin:<task id> and end:<task id>."""
    return f"{NAMESPACE}records:log:{account_id}"


def events_of(account_id: str) -> str:
    """Where started:<task id> (in the lock) and retry:<task id> (sent back) are pushed."""
    return f"{NAMESPACE}records:events:{account_id}"


@task_retry.connect
def _record_retry(request: Any, **_: Any) -> None:
    records.rpush(events_of(request.args[0]), f"retry:{request.id}")


@app.task
def ping() -> str:
    return "pong"


@app.task(bind=True, max_retries=20)
@distributed_lock(key="report:<account_id>", on_failure=retry_when_busy())
def report(self: Any, account_id: str, hold: bool = False) -> dict[str, Any]:
    """The singleton task: one report per account at a time; a busy account retries later.
    ``hold``: stay in the lock until the test pushes to ``go:<task id>``."""
    lease = current_lease()
    assert lease is not None
    task_id = self.request.id
    records.rpush(log_of(account_id), f"begin:{task_id}")
    records.rpush(events_of(account_id), f"started:{task_id}")
    if hold and records.blpop([f"{NAMESPACE}records:go:{task_id}"], timeout=20) is None:
        raise TimeoutError("the test never let this report finish")
    records.rpush(log_of(account_id), f"end:{task_id}")
    return {"id": task_id, "retries": self.request.retries, "fence": lease.fencing_token}


@app.task(bind=True, max_retries=0)
@distributed_lock(key="report:<account_id>", on_failure=retry_when_busy())
def report_without_retries(self: Any, account_id: str) -> str:
    return "ran"


def skipped(ctx: FailureContext) -> dict[str, Any]:
    return {"skipped": ctx.key, "holder_ttl": ctx.error.holder_ttl}


@app.task(bind=True)
@distributed_lock(key="report:<account_id>", on_failure=skipped)
def report_or_skip(self: Any, account_id: str) -> dict[str, Any]:
    """The other pattern: a duplicate sent while one runs is dropped (its result says so)."""
    return {"ran": account_id}


@app.task(bind=True)
@distributed_lock(key="report:<account_id>")
def crash_while_holding(self: Any, account_id: str) -> None:
    """Record the fencing token, then die holding the lock, as a worker killed mid-task (the
    prefork pool replaces the process)."""
    lease = current_lease()
    assert lease is not None
    records.set(f"{NAMESPACE}records:crashed:{account_id}", lease.fencing_token)
    os.kill(os.getpid(), signal.SIGKILL)
