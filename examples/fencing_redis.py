"""Fencing with Redis: a holder that paused past its lease cannot overwrite newer data.

A lease lock alone cannot stop this: a holder pauses (GC, swap, a slow call) longer than
its lease, the lock expires, someone else takes it and writes, and then the first holder
wakes up and writes too. The fencing token fixes it at the resource: every acquisition
gets a larger token, and RedisFence.write() refuses a token older than the newest that
wrote (atomically, in one Lua script).

    .venv/bin/python examples/fencing_redis.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/fencing_redis.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import redis

from lockaspect import LockClient, LockLost, configure, current_lease, distributed_lock
from lockaspect.fencing import RedisFence

RUN = uuid.uuid4().hex[:8]  # keeps this example's keys apart from anything else
fence: RedisFence  # set in main()


@distributed_lock(key="ledger:<account>", wait=5.0)
def post(account: str, entry: str) -> bool:
    """The ordinary way: write with the token of the lease this call holds."""
    lease = current_lease()
    assert lease is not None
    return fence.write(f"ledger:{account}", entry, lease.fencing_token)


def delete_keys(client: LockClient, pattern: str) -> None:
    """Delete the keys of this run (``pattern``: its namespaces): the locks are gone by now,
    but their fence counters outlive them, and this may be your own server."""
    redis = client.backend.redis
    for key in redis.scan_iter(match=pattern):
        redis.delete(key)


def main() -> None:
    # lockaspect logs a WARNING on "lockaspect.watchdog" when it learns a lease is lost.
    logging.basicConfig(level=logging.WARNING, format="  [log] %(levelname)s %(name)s: %(message)s")
    global fence
    with ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_URL")
        if not url:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
        client = stack.enter_context(LockClient.from_url(url, namespace=f"example-{RUN}:"))
        stack.callback(delete_keys, client, f"example-{RUN}*")  # the locks' and the ledger's keys
        configure(client)
        store = redis.Redis.from_url(url)
        stack.callback(store.close)
        fence = RedisFence(store, namespace=f"example-{RUN}-data:")
        other_worker = stack.enter_context(ThreadPoolExecutor(max_workers=1))

        print("1. a normal fenced write")
        assert post("acct-1", "opening balance 100")
        print(f"  ledger: {fence.read('ledger:acct-1')!r}, high-water token {fence.high_water('ledger:acct-1')}")

        print("2. a slow holder pauses past its lease; another worker takes over")
        try:
            # A fixed 1 s lease (no watchdog), to make the pause easy to stage.
            with client.lock("ledger:acct-1", lease=1.0) as slow:
                print(f"  slow holder got fencing token {slow.fencing_token}")
                time.sleep(1.3)  # the pause: the lease ends in the store meanwhile
                # Another worker (another thread here; another process in real life)
                # takes the free lock, gets a larger token, and writes.
                assert other_worker.submit(post, "acct-1", "balance 90 (withdrew 10)").result()
                print(f"  another worker wrote with token {fence.high_water('ledger:acct-1')}")
                # The slow holder wakes up and writes what it computed before the pause.
                written = fence.write("ledger:acct-1", "balance 150 (stale!)", slow.fencing_token)
                print(f"  slow holder's write with token {slow.fencing_token}: {'written' if written else 'REJECTED'}")
                assert not written, "a stale writer must be rejected"
        except LockLost as exc:
            # Leaving the block also tells the slow holder that its lock was gone.
            print(f"  and leaving its block raised LockLost: {exc} (reason {exc.reason!r})")
        else:
            raise AssertionError("the slow holder's block should have raised LockLost")

        value = fence.read("ledger:acct-1")
        print(f"  ledger: {value!r}")
        assert value == b"balance 90 (withdrew 10)", value
        print("ok")


if __name__ == "__main__":
    main()
