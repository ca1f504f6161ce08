"""A fair lock: callers at a ticket desk are served in the order they arrived.

Four threads ask for the desk while a clerk holds it, one after another. With
``fair=True`` they get it in exactly that order, even though each release leaves the
lock free for a moment (a plain lock would let a newcomer in then).

    .venv/bin/python examples/fair_queue.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/fair_queue.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).

Exits non-zero if anything it demonstrates does not hold.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from contextlib import ExitStack

from lockaspect import LockClient, current_lease, distributed_lock


def delete_keys(client: LockClient, pattern: str) -> None:
    """Delete the keys of this run (``pattern``: its namespaces): the locks are gone by now,
    but their fence counters outlive them, and this may be your own server."""
    redis = client.backend.redis
    for key in redis.scan_iter(match=pattern):
        redis.delete(key)


def main() -> None:
    with ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_URL")
        if url is None:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
            print(f"started a throwaway server on {url}")
        namespace = f"example-{uuid.uuid4().hex[:8]}:"
        client = stack.enter_context(LockClient.from_url(url, namespace=namespace))
        stack.callback(delete_keys, client, f"{namespace}*")
        served: list[str] = []

        @distributed_lock(key="desk:<desk>", fair=True, wait=30, client=client)
        def serve(desk: int, customer: str) -> None:
            lease = current_lease()
            assert lease is not None
            assert lease.fair
            served.append(customer)

        customers = [f"customer-{n}" for n in range(4)]
        threads = []
        with client.fair_lock("desk:1") as clerk:
            print(f"the clerk holds desk 1 (fencing token {clerk.fencing_token})")
            for customer in customers:
                thread = threading.Thread(target=serve, args=(1, customer))
                thread.start()
                threads.append(thread)
                # Wait until this customer has its place in line before the next one comes.
                queue = client.backend.fair_queue_key("desk:1")
                while client.backend.redis.llen(queue) < len(threads):
                    time.sleep(0.01)
            print(f"{len(customers)} customers queued")
        for thread in threads:
            thread.join()
        print("served in order:", ", ".join(served))
        assert served == customers, served
    print("ok")


if __name__ == "__main__":
    main()
