"""Quick engine microbenchmark (issue 15, target 2): the client's main-thread CPU per
uncontended lock cycle, sync and asyncio, on ``memory://`` (the engine alone: no I/O) and on
a real server (a LockServer this script starts), for one or more source trees side by side.

    python bench/engine_micro.py [--rounds 5] [--cycles 3000] TREE [TREE ...]

Each round runs every tree once, alternately, each in a fresh child process with
``PYTHONPATH=TREE`` (so two versions of lockaspect are compared in the same minutes of the
same loaded machine); per case it reports the minimum and the median over the rounds of
``time.thread_time()`` per cycle (the child's main thread: the timer and watchdog threads are
not counted, they do nothing in an uncontended cycle). Not a test: CPU figures on a shared
machine are noisy, which is why the variants interleave.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r'''
import asyncio, gc, json, sys, time
from lockaspect import LockClient, distributed_lock

url, cycles = sys.argv[1], int(sys.argv[2])
out = {}

def measure(name, run):
    run(300)
    gc.collect()
    t0 = time.thread_time()
    run(cycles)
    out[name] = (time.thread_time() - t0) / cycles * 1e6

for store, u in (("memory", "memory://"), ("valkey", url)):
    client = LockClient.from_url(u)

    def block(n, client=client):
        for _ in range(n):
            with client.lock("micro:block"):
                pass

    @distributed_lock(key="micro:<n>", client=client)
    def deco(n):
        return n

    def decorated(n):
        for _ in range(n):
            deco(1)

    measure(f"{store} sync client.lock", block)
    measure(f"{store} sync decorator", decorated)

    async def amain(client=client):
        async def ablock(n):
            for _ in range(n):
                async with client.lock("micro:ablock"):
                    pass

        @distributed_lock(key="micro:a<n>", client=client)
        async def adeco(n):
            return n

        async def adecorated(n):
            for _ in range(n):
                await adeco(1)

        for name, fn in ((f"{store} async client.lock", ablock), (f"{store} async decorator", adecorated)):
            await fn(300)
            gc.collect()
            t0 = time.thread_time()
            await fn(cycles)
            out[name] = (time.thread_time() - t0) / cycles * 1e6

    asyncio.run(amain())
    stats = client.stats()
    assert stats.acquired == stats.released and not stats.lost, stats
    client.close()
print(json.dumps(out))
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=3000)
    args = parser.parse_args()
    from lockaspect.testing import LockServer

    results: dict[str, dict[str, list[float]]] = {tree: {} for tree in args.trees}
    with LockServer() as server:
        for _ in range(args.rounds):
            for tree in args.trees:
                env = dict(os.environ, PYTHONPATH=tree)
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, server.url, str(args.cycles)],
                    env=env, capture_output=True, text=True, check=True, cwd=tree,
                )  # fmt: skip
                for name, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    results[tree].setdefault(name, []).append(value)
    print(f"main-thread CPU us per cycle, {args.rounds} interleaved rounds of {args.cycles} cycles; "
          f"load average {os.getloadavg()[0]:.1f} at the end ({time.strftime('%H:%M:%S')})")  # fmt: skip
    names = list(results[args.trees[0]])
    header = f"{'case':28}" + "".join(f"  {os.path.basename(t)[:14]:>14} min/med" for t in args.trees)
    print(header)
    for name in names:
        cells = "".join(
            f"  {min(results[t][name]):11.1f} /{statistics.median(results[t][name]):6.1f}" for t in args.trees
        )
        print(f"{name:28}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
