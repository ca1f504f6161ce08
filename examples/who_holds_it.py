"""Who holds a lock, and evicting a stuck holder.

A worker process takes ``report:daily`` and hangs while its watchdog keeps the lock alive. An
operator asks who holds it (host, pid, the decorated function and key template, the fencing
token, the lease left), force-releases it, and takes it; the hung worker learns at its next
renewal that it lost the lock, and its fencing token is older than the operator's. Then the
per-lease API: a lock taken in one function and released in another, extended on the way.

    .venv/bin/python examples/who_holds_it.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/who_holds_it.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).

The same from a shell: ``lockaspect list``, ``lockaspect inspect report:daily``,
``lockaspect release report:daily --force`` (see docs/operations.md). Exits non-zero if
anything it demonstrates does not hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from contextlib import ExitStack

from lockaspect import Lease, LockClient

WORKER = """
import sys, threading
from lockaspect import LockClient, LockLost, distributed_lock

client = LockClient.from_url(sys.argv[1], namespace=sys.argv[2], watchdog_lease=2.0)
lost = threading.Event()

@distributed_lock(key="report:<day>", client=client, on_lost=lambda lease: lost.set())
def build_report(day):
    print("holding", flush=True)
    lost.wait(60)  # hangs, while the watchdog keeps the lock alive, until it is evicted

try:
    build_report("daily")
except LockLost as exc:
    print("worker lost the lock:", exc.reason, flush=True)
"""


def start(stack: ExitStack) -> str:
    url = os.environ.get("LOCKASPECT_URL")
    if url is None:
        from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

        url = stack.enter_context(LockServer()).url
    return url


def take(client: LockClient) -> Lease:
    return client.acquire("nightly-export", lease=5)


def finish(lease: Lease) -> None:
    lease.extend(5)  # a slow night: five more seconds
    assert lease.remaining() > 5
    lease.release()


def delete_keys(client: LockClient, pattern: str) -> None:
    """Delete the keys of this run (``pattern``: its namespaces): the locks are gone by now,
    but their fence counters outlive them, and this may be your own server."""
    redis = client.backend.redis
    for key in redis.scan_iter(match=pattern):
        redis.delete(key)


def main() -> None:
    with ExitStack() as stack:
        url = start(stack)
        namespace = f"example-{uuid.uuid4().hex[:8]}:"
        client = stack.enter_context(LockClient.from_url(url, namespace=namespace))
        stack.callback(delete_keys, client, f"{namespace}*")
        worker = subprocess.Popen([sys.executable, "-c", WORKER, url, namespace], stdout=subprocess.PIPE, text=True)
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "holding"

        info = client.describe("report:daily")
        assert info is not None
        (holder,) = info.holders
        print(
            f"{info.key}: held by {holder.host} pid {holder.pid} in {holder.function}() "
            f"(template {holder.template!r}), fencing token {holder.fencing_token}, "
            f"{holder.remaining:.1f}s of lease left"
        )
        assert holder.pid == worker.pid
        assert holder.template == "report:<day>"
        assert [found.key for found in client.held_locks("report:*")] == ["report:daily"]

        assert client.force_release("report:daily")  # logged at WARNING with who was evicted
        with client.lock("report:daily") as mine:
            assert holder.fencing_token is not None
            assert mine.fencing_token > holder.fencing_token  # the worker's writes are now stale
            print(f"the operator holds it now, fencing token {mine.fencing_token}")
            said = worker.stdout.readline().strip()
            print(said)
            assert said == "worker lost the lock: not-owner"
        assert worker.wait(30) == 0

        lease = take(client)
        assert client.locked("nightly-export")
        finish(lease)
        assert not client.locked("nightly-export")
        print("ok")


if __name__ == "__main__":
    main()
