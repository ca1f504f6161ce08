"""Client CPU per asyncio lock round trip on :class:`AsyncRedisStore`'s wire
(lockaspect/backends/redis/_async_wire.py), against the raw redis.asyncio floor, in one process.

Rows, interleaved in each run (``--runs`` runs of ``--calls`` calls per row; the figure is
this process's CPU time per call, min over the runs, and the median beside it):

* ``redis.asyncio execute_command(SET NX PX)``: redis-py's own round trip (the raw floor's);
* ``wire: PING``: the wire's round trip on its own;
* ``store: acquire + release``: the store's two lock scripts (what ``client.lock`` pays per
  cycle in round trips, the engine excluded).

Run it under each tree to compare (``PYTHONPATH=/path/to/tree python bench/bench_async_wire.py``);
the numbers are only comparable within one machine state: alternate the trees and repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lockaspect.backends.base import AcquireRequest
from lockaspect.backends.redis import AsyncRedisStore
from lockaspect.backends.redis._script import _packed
from lockaspect.testing import LockServer


async def _rows(url: str) -> dict[str, Callable[[], Awaitable[Any]]]:
    store = AsyncRedisStore.from_url(url, namespace="wirebench:" + secrets.token_hex(4) + ":")
    raw = store.redis
    wire = store._wire
    key = "wirebench:" + secrets.token_hex(6)
    token = secrets.token_hex(16)
    ping = _packed((b"PING",))
    request = AcquireRequest("lock", (key,), token, 10.0)

    async def floor() -> Any:
        return await raw.execute_command("SET", "raw:" + key, token, "NX", "PX", 10000)

    async def wire_ping() -> Any:
        return await wire.call(ping, ("PING",))

    async def acquire_release() -> Any:
        await store.acquire(request)
        return await store.release(key, token)

    rows: dict[str, Callable[[], Awaitable[Any]]] = {
        "redis.asyncio execute_command(SET NX PX)": floor,
        "wire: PING": wire_ping,
        "store: acquire + release (2 round trips)": acquire_release,
    }
    return rows


async def _main(url: str, calls: int, runs: int) -> None:
    rows = await _rows(url)
    for call in rows.values():  # warm up: connections made, scripts loaded
        for _ in range(200):
            await call()
    figures: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(runs):
        for name, call in rows.items():
            start = time.process_time()
            for _ in range(calls):
                await call()
            figures[name].append((time.process_time() - start) / calls * 1e6)
    print(f"{'row':<45} {'min CPU us':>10} {'median':>8} {'max':>8}  (runs={runs}, calls={calls})")
    for name, values in figures.items():
        print(f"{name:<45} {min(values):>10.1f} {statistics.median(values):>8.1f} {max(values):>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; default: start one")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    if options.url:
        asyncio.run(_main(options.url, options.calls, options.runs))
        return
    with LockServer() as server:
        asyncio.run(_main(server.url, options.calls, options.runs))


if __name__ == "__main__":
    main()
