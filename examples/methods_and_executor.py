"""Methods, executors and re-entry.

* An instance method keys its lock on the instance: ``key="account:<self.id>"``.
* A locked call that calls another locked call on the same key re-enters (the hold count
  goes up, the fencing token stays the same) instead of deadlocking on itself.
* ``executor=`` runs the body on a thread pool. The lease travels with the call
  (contextvars), so a nested call re-enters even on another thread, while an unrelated
  thread is a different owner and finds the lock busy.

    .venv/bin/python examples/methods_and_executor.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/methods_and_executor.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from lockaspect import LockClient, LockNotAcquired, configure, current_lease, distributed_lock

# The pool the report bodies run on (it must exist when the decorator is applied).
reports = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reports")


class Account:
    def __init__(self, account_id: str) -> None:
        self.id = account_id
        self.balance = 0

    @distributed_lock(key="account:<self.id>")
    def deposit(self, amount: int) -> int:
        lease = current_lease()
        assert lease is not None
        self.balance += amount
        # Same key, same call chain: re-enters the hold instead of waiting for itself.
        self.audit(f"deposit {amount}", lease.fencing_token)
        return lease.fencing_token

    @distributed_lock(key="account:<self.id>")
    def audit(self, what: str, outer_token: int) -> None:
        lease = current_lease()
        assert lease is not None
        print(f"  audit {self.id}: {what} (fencing token {lease.fencing_token}, re-entered)")
        assert lease.fencing_token == outer_token, "re-entry keeps the fencing token"


@distributed_lock(key="report:<name>")
def publish(name: str) -> tuple[int, str, int]:
    """Runs inline (in the caller's thread) and calls a locked body that runs on the pool."""
    lease = current_lease()
    assert lease is not None
    where, token = render(name)  # same key: re-enters, though it runs on another thread
    return lease.fencing_token, where, token


@distributed_lock(key="report:<name>", executor=reports)
def render(name: str) -> tuple[str, int]:
    lease = current_lease()  # the caller's lease: the context travelled to the pool thread
    assert lease is not None
    return threading.current_thread().name, lease.fencing_token


def delete_keys(client: LockClient, pattern: str) -> None:
    """Delete the keys of this run (``pattern``: its namespaces): the locks are gone by now,
    but their fence counters outlive them, and this may be your own server."""
    redis = client.backend.redis
    for key in redis.scan_iter(match=pattern):
        redis.delete(key)


def main() -> None:
    with ExitStack() as stack:
        stack.callback(reports.shutdown)
        url = os.environ.get("LOCKASPECT_URL")
        if not url:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
        namespace = f"example-{uuid.uuid4().hex[:8]}:"
        client = stack.enter_context(LockClient.from_url(url, namespace=namespace))
        stack.callback(delete_keys, client, f"{namespace}*")
        configure(client)

        print("1. an instance method, keyed on self.id, re-entering through another method")
        alice, bob = Account("alice"), Account("bob")
        token = alice.deposit(100)
        bob.deposit(5)  # a different account, a different lock
        assert alice.balance == 100
        assert bob.balance == 5
        print(f"  alice's deposit held account:alice with fencing token {token}")

        print("2. a body on a thread pool, re-entered from the call chain")
        outer, where, inner = publish("daily")
        print(f"  publish held report:daily with token {outer} in {threading.current_thread().name};")
        print(f"  render ran in {where} and re-entered with token {inner}")
        assert where.startswith("reports")
        assert inner == outer

        print("3. an unrelated thread is another owner: it does not share the hold")
        with client.lock("report:daily") as lease:
            assert current_lease() is lease
            # A plain thread starts with an empty context: no hold to re-enter.
            other = ThreadPoolExecutor(max_workers=1)
            stack.callback(other.shutdown)
            try:
                other.submit(render, "daily").result()
            except LockNotAcquired:
                print("  a call from another thread found report:daily busy (LockNotAcquired)")
            else:
                raise AssertionError("another thread must not share this thread's hold")
            # ... while this call chain re-enters, even though render runs on the pool.
            where, token = render("daily")
            assert token == lease.fencing_token
            print(f"  the holder's own call re-entered on {where} (token {token})")
        print("ok")


if __name__ == "__main__":
    main()
