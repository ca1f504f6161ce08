"""Scale: many locks held by one process under the watchdog (issue 15, target 5).

Each scenario runs in a child process of its own (so its RSS and threads are its own) against
an embedded Valkey server:

- ``sync``: one thread takes N locks (``client.lock(key).__enter__()``) with a 2 s watchdog
  lease, then holds them all for a window of 10 s while the watchdog renews them;
- ``asyncio``: N tasks on one event loop, each holding one lock (``async with client.lock``)
  through the same window; its RSS per lock is net of the same N tasks holding nothing (run
  in another child), so the tasks' own frames are not counted as the locks'. All N start at
  once, so N attempts are in flight together: their high-water mark stays in the RSS (pymalloc
  keeps an arena while any object in it lives). ``(info) staggered`` starts each task once the
  one before holds its lock: the memory of a held lock without that burst.

For each it prints: locks lost (target 0), the library's threads (target <= 2), RSS per held
lock (the process's RSS growth from before the first acquisition to all held, divided by N;
target <= 3 KiB), and the process CPU per renewal during the window (process CPU time of the
window divided by the renewals the client counted in it; target <= 15 us).

    .venv/bin/python bench/bench_scale.py                 # 50,000 sync, 5,000 asyncio
    .venv/bin/python bench/bench_scale.py --sync 20000 --tasks 2000 --window 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from lockaspect.testing import LockServer

CHILD = textwrap.dedent(
    """
    import asyncio, gc, json, os, sys, threading, time
    import psutil
    from lockaspect import LockClient, LockLost

    mode, url, n, window = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    me = psutil.Process()
    client = LockClient.from_url(url, namespace=f"scale-{os.getpid()}:", watchdog_lease=2.0)
    with client.lock("warm-up"):
        pass
    gc.collect()
    rss_before = me.memory_info().rss

    def measure():
        lost_acquiring = client.stats().lost
        gc.collect()
        rss_held = me.memory_info().rss
        renewals, cpu, started = client.stats().renewals, me.cpu_times(), time.monotonic()
        time.sleep(window)
        cpu_after, renewed = me.cpu_times(), client.stats().renewals - renewals
        used = (cpu_after.user - cpu.user) + (cpu_after.system - cpu.system)
        return {
            "lost_acquiring": lost_acquiring,
            "held": client.stats().held,
            "lost": client.stats().lost,
            "threads": len(client.threads()),
            "all_threads": threading.active_count(),
            "rss_per_lock": (rss_held - rss_before) / n,
            "renewals": renewed,
            "cpu_per_renewal_us": used / renewed * 1e6 if renewed else None,
            "window": time.monotonic() - started,
        }

    if mode == "sync":
        started = time.monotonic()
        blocks = [client.lock(f"k{i}") for i in range(n)]
        for block in blocks:
            block.__enter__()
        acquired_in = time.monotonic() - started
        report = measure()
        for block in reversed(blocks):
            try:
                block.__exit__(None, None, None)
            except LockLost:
                pass  # counted in stats().lost
    else:
        async def main():
            ready, done = asyncio.Event(), asyncio.Event()
            count = 0

            async def hold(i):
                nonlocal count
                if mode == "asyncio-bare":  # the tasks alone, for the baseline
                    count += 1
                    if count == n:
                        ready.set()
                    await done.wait()
                    return
                try:
                    async with client.lock(f"k{i}"):
                        count += 1
                        if count == n:
                            ready.set()
                        await done.wait()
                except LockLost:
                    pass  # counted in stats().lost

            started = time.monotonic()
            if mode == "asyncio-staggered":  # each task starts once the one before holds its lock
                tasks = []
                for i in range(n):
                    tasks.append(asyncio.create_task(hold(i)))
                    while count <= i:
                        await asyncio.sleep(0)
            else:
                tasks = [asyncio.create_task(hold(i)) for i in range(n)]
            await ready.wait()
            acquired_in = time.monotonic() - started
            report = await asyncio.get_running_loop().run_in_executor(None, measure)
            done.set()
            await asyncio.gather(*tasks)
            await client.aclose()
            return acquired_in, report

        acquired_in, report = asyncio.run(main())
    report["acquired_in"] = acquired_in
    report["lost_after"] = client.stats().lost
    client.close()
    print(json.dumps(report))
    """
)


def run(mode: str, url: str, n: int, window: float) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, url, str(n), str(window)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", type=int, default=50_000, help="locks held by one thread (default 50,000)")
    parser.add_argument("--tasks", type=int, default=5_000, help="asyncio tasks holding one lock each (default 5,000)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds held under the watchdog (default 10)")
    args = parser.parse_args()
    with LockServer() as server:
        rows = [("sync", args.sync, run("sync", server.url, args.sync, args.window))]
        held = run("asyncio", server.url, args.tasks, args.window)
        staggered = run("asyncio-staggered", server.url, args.tasks, args.window)
        bare = run("asyncio-bare", server.url, args.tasks, 0.5)
        for row in (held, staggered):
            row["rss_per_lock"] -= bare["rss_per_lock"]  # the tasks' own memory is not the locks'
        rows += [("asyncio", args.tasks, held), ("(info) staggered", args.tasks, staggered)]
    print(f"lockaspect scale benchmark: 2 s watchdog lease, {args.window:g} s held; {os.cpu_count()} CPUs")
    print(f"server: {server.kind} {server.version}; Python {sys.version.split()[0]}")
    header = ("scenario", "locks", "acquired s", "lost (acq.)", "threads", "RSS/lock KiB", "renewals", "CPU/renew us")
    print("  ".join(f"{h:>15}" for h in header))
    for name, n, r in rows:
        cpu = r["cpu_per_renewal_us"]
        cells = (
            name, f"{n:,}", f"{r['acquired_in']:.1f}", f"{int(r['lost_after'])} ({int(r['lost_acquiring'])})",
            f"{int(r['threads'])}", f"{r['rss_per_lock'] / 1024:.2f}", f"{int(r['renewals']):,}",
            "-" if cpu is None else f"{cpu:.1f}",
        )  # fmt: skip
        print("  ".join(f"{c:>15}" for c in cells))
    print("targets: 0 lost, <= 2 library threads, <= 3 KiB RSS per lock, <= 15 us of process CPU per renewal")
    print(
        "asyncio RSS/lock is net of the same tasks holding nothing (bare: %.2f KiB per task); (info) staggered:"
        % (bare["rss_per_lock"] / 1024)
    )
    print("  the tasks start one after another, so no burst of attempts in flight adds its high-water mark")


if __name__ == "__main__":
    main()
