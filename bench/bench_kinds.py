"""Lock kinds side by side (issue 4, item 8), one run:

1. uncontended lock/unlock cycles per kind, relative to the core mutex in the same run;
2. a read-heavy workload (95% reads, 5% writes, 1 ms sections) from P processes on one key:
   the read-write lock against the mutex taking every section exclusively (what a user
   without a read-write lock would do). Fair-lock contention figures come from
   ``bench_async.py --libraries la-sync,la-fair,prl``;
3. RedLock over 5 local servers: lockaspect's ``LockClient.from_urls`` against pottery's
   ``Redlock`` (the Python peer), uncontended cycles, relative to lockaspect's single-server lock.

The multi-key rows (issue 15, target 3: a 2-key cycle >= 0.85x a mutex cycle) include the
same cycle with the set given back key by key (a store without ``release_many``: the path
before the one-round-trip release, and still the one of stores without it).

    python bench/bench_kinds.py [--cycles 5000] [--rounds 5] [--procs 4] [--seconds 3] [--url redis://...]
    python bench/bench_kinds.py --cycles-only      # section 1 alone
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from lockaspect import LockClient
from lockaspect.backends.redis import RedisStore

WARMUP = 500
SECTION = 0.001  # seconds inside each contended section
READS = 0.95


class _KeyByKey(RedisStore):
    """The Redis store without ``release_many``: the engine gives a multi-key set back key by key."""

    release_many = None  # type: ignore[assignment]


def kinds(client: LockClient, key_by_key: LockClient) -> dict[str, Callable[[str], Any]]:
    """name -> how to take one lock of that kind (a context manager)."""
    return {
        "client.lock (mutex)": client.lock,
        "client.fair_lock": client.fair_lock,
        "client.semaphore(4)": lambda key: client.semaphore(key, permits=4),
        "client.rw_lock().read()": lambda key: client.rw_lock(key).read(),
        "client.rw_lock().write()": lambda key: client.rw_lock(key).write(),
        "client.multi_lock(2 keys)": lambda key: client.multi_lock([key, key + ":2"]),
        "multi_lock(2), key by key": lambda key: key_by_key.multi_lock([key, key + ":2"]),
    }


def measure(take: Callable[[str], Any], cycles: int) -> float:
    for _ in range(WARMUP):
        with take("bench:kinds"):
            pass
    start = time.perf_counter()
    for _ in range(cycles):
        with take("bench:kinds"):
            pass
    return cycles / (time.perf_counter() - start)


def worker(url: str, namespace: str, how: str, start: float, stop: float, seed: int) -> None:
    """One contending process: sections until ``stop``; prints its counts as JSON."""
    rng = random.Random(seed)
    reads = writes = 0
    with LockClient.from_url(url, namespace=namespace) as client:
        rw = client.rw_lock("bench:doc")
        time.sleep(max(0.0, start - time.time()))
        while time.time() < stop:
            reading = rng.random() < READS
            if how == "rw":
                block = rw.read(wait=None) if reading else rw.write(wait=None)
            else:
                block = client.lock("bench:doc", wait=None)
            with block:
                time.sleep(SECTION)
            reads += reading
            writes += not reading
    print(json.dumps({"reads": reads, "writes": writes}))


def contend(url: str, how: str, procs: int, seconds: float) -> float:
    start = time.time() + 2.0  # time for the processes to start and connect
    stop = start + seconds
    namespace = f"bench-kinds-{how}-{random.getrandbits(32):x}:"
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", url, namespace, how, repr(start), repr(stop), str(seed)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(procs)
    ]
    total = 0
    for child in children:
        out, _ = child.communicate(timeout=seconds + 60)
        counts = json.loads(out.strip().splitlines()[-1])
        total += counts["reads"] + counts["writes"]
    return total / seconds


def redlock_rates(cycles: int, rounds: int) -> dict[str, float]:
    """Uncontended cycles/s over 5 throwaway servers: lockaspect RedLock vs pottery Redlock."""
    import redis
    from pottery import Redlock

    from lockaspect.testing import LockServer

    with ExitStack() as stack:
        servers = [stack.enter_context(LockServer()) for _ in range(5)]
        client = stack.enter_context(LockClient.from_urls([s.url for s in servers], namespace="bench-redlock:"))
        masters = {redis.Redis.from_url(s.url) for s in servers}
        single = stack.enter_context(LockClient.from_url(servers[0].url, namespace="bench-single:"))

        def pottery(key: str) -> Any:
            return Redlock(key=key, masters=masters, auto_release_time=10)

        takers: dict[str, Callable[[str], Any]] = {
            "lockaspect client.lock, 1 server": single.lock,
            "lockaspect RedLock, 5 servers": client.lock,
            "pottery Redlock, 5 masters": pottery,
        }
        rates: dict[str, list[float]] = {name: [] for name in takers}
        for _ in range(rounds):
            for name, take in takers.items():
                rates[name].append(measure(take, cycles))
        for master in masters:
            master.close()
        return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        url, namespace, how, start, stop, seed = sys.argv[2:8]
        worker(url, namespace, how, float(start), float(stop), int(seed))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--url", help="a running server (default: start a throwaway valkey-server)")
    parser.add_argument("--cycles-only", action="store_true", help="section 1 alone")
    args = parser.parse_args()
    with ExitStack() as stack:
        url = args.url
        if url is None:
            from lockaspect.testing import LockServer

            url = stack.enter_context(LockServer()).url
        client = stack.enter_context(LockClient.from_url(url, namespace="bench-kinds:"))
        key_by_key = stack.enter_context(LockClient(_KeyByKey.from_url(url, namespace="bench-kinds-kbk:")))
        takers = kinds(client, key_by_key)
        rates: dict[str, list[float]] = {name: [] for name in takers}
        names = list(takers)
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for name in order:
                rates[name].append(measure(takers[name], args.cycles))
        print(f"1. uncontended cycles/s, median of {args.rounds} interleaved runs of {args.cycles:,} ({url})")
        print("   x mutex: the median of each round's ratio to the mutex run of that round; spread: min-max")
        print(f"{'kind':<28} {'cycles/s':>10} {'x mutex':>8} {'spread':>13}")
        for name in names:
            ratios = [rate / base for rate, base in zip(rates[name], rates[names[0]], strict=True)]
            median = statistics.median(rates[name])
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(f"{name:<28} {median:>10,.0f} {statistics.median(ratios):>7.2f}x {spread:>13}")
        print()
        if args.cycles_only:
            return
        print(
            f"2. read-heavy contention: {args.procs} processes, {READS:.0%} reads, {SECTION * 1000:g} ms sections, "
            f"{args.seconds:g} s"
        )
        mutex = contend(url, "mutex", args.procs, args.seconds)
        rw = contend(url, "rw", args.procs, args.seconds)
        print(f"{'how':<40} {'sections/s':>10} {'x mutex':>8}")
        print(f"{'client.lock for every section':<40} {mutex:>10,.0f} {1:>7.2f}x")
        print(f"{'client.rw_lock: read or write':<40} {rw:>10,.0f} {rw / mutex:>7.2f}x")
        print()
        runs = f"median of {args.rounds} runs of {args.cycles // 5:,}"
        print(f"3. RedLock, uncontended cycles/s over 5 local servers, {runs}")
        red = redlock_rates(args.cycles // 5, args.rounds)
        base_single = next(iter(red.values()))
        print(f"{'library':<40} {'cycles/s':>10} {'x 1 server':>10}")
        for name, rate in red.items():
            print(f"{name:<40} {rate:>10,.0f} {rate / base_single:>9.2f}x")


if __name__ == "__main__":
    main()
