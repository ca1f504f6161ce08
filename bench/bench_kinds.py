"""Uncontended lock/unlock cycles per lock kind, relative to the core mutex in the same run
(issue 4, item 8). Kinds so far: the fair lock and the semaphore. Contention figures for the fair lock come
from ``bench_async.py --libraries la-sync,la-fair,prl``.

    python bench/bench_kinds.py [--cycles 5000] [--rounds 5] [--url redis://...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from lockaspect import LockClient

WARMUP = 500


def kinds(client: LockClient) -> dict[str, Callable[[str], Any]]:
    """name -> how to take one lock of that kind (a context manager)."""
    return {
        "client.lock (mutex)": client.lock,
        "client.fair_lock": client.fair_lock,
        "client.semaphore(4)": lambda key: client.semaphore(key, permits=4),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--url", help="a running server (default: start a throwaway valkey-server)")
    args = parser.parse_args()
    with ExitStack() as stack:
        url = args.url
        if url is None:
            from lockaspect.testing import LockServer

            url = stack.enter_context(LockServer()).url
        client = stack.enter_context(LockClient.from_url(url, namespace="bench-kinds:"))
        takers = kinds(client)
        rates: dict[str, list[float]] = {name: [] for name in takers}
        names = list(takers)
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for name in order:
                rates[name].append(measure(takers[name], args.cycles))
        base = statistics.median(rates[names[0]])
        print(f"uncontended cycles/s, median of {args.rounds} interleaved runs of {args.cycles:,} ({url})")
        print(f"{'kind':<24} {'cycles/s':>10} {'x mutex':>8}")
        for name in names:
            median = statistics.median(rates[name])
            print(f"{name:<24} {median:>10,.0f} {median / base:>7.2f}x")


if __name__ == "__main__":
    main()
