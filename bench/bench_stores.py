"""lockaspect on the stores no other bench covers: memory://, Redis Sentinel and RedLock (3 servers).

Uncontended lock/unlock cycles, one thread, empty body, each row on a key of its own, runs
interleaved (order rotated each round), as bench_core.py does for one Redis server:

* ``memory``: the floor is ``threading.Lock`` acquire/release plus a fresh token (what an
  in-process lease lock cannot do without); lockaspect's ``client.lock`` and decorator on
  ``memory://``. There is no Python peer for an in-process lease store.
* ``sentinel``: a ``lockaspect.testing.ValkeySentinel`` (master, 1 replica, 3 sentinels). The
  floor is SET NX PX + EVALSHA compare-and-delete through redis-py's ``Sentinel.master_for``
  client; peers redis-py's ``Lock`` and python-redis-lock on that client; lockaspect from the
  ``redis+sentinel://`` URL. Server CPU: the master's and the replica's ``INFO cpu``.
* ``redlock``: 3 independent servers. The floor is SET NX PX on each, then EVALSHA
  compare-and-delete on each (sequential, 6 round trips); the peer pottery's ``Redlock`` with
  the 3 masters; lockaspect's ``LockClient.from_urls``. Server CPU: the 3 servers' ``INFO cpu``.

Contention is not measured here (bench_async.py, bench_sql.py and bench_zookeeper.py do it for
their stores). Not a test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _util
from _util import heading, make_redis, median, out, spread, table
from bench_core import COMPARE_AND_DELETE, BenchError, Variant

LEASE = 10
LEASE_MS = LEASE * 1000


def lockaspect_rows(client: Any, prefix: str) -> list[Variant]:
    from lockaspect import distributed_lock

    def block(key: str, lease: float | None) -> Callable[[int], None]:
        return _util.lock_cycles(client, key, lease)

    @distributed_lock(key=f"{prefix}:deco", client=client)
    def decorated() -> None:
        return None

    def deco(n: int) -> None:
        for _ in range(n):
            decorated()

    def check() -> str:
        s = client.stats()
        bad = s.acquired != s.released or s.lost or s.not_acquired or s.held
        return f"acquired {s.acquired} released {s.released} lost {s.lost}" if bad else "ok"

    rows = [
        Variant("la-wd", "lockaspect client.lock, watchdog", block(f"{prefix}:wd", None), check),
        Variant("la-fixed", f"lockaspect client.lock, lease={LEASE}", block(f"{prefix}:fixed", LEASE)),
        Variant("la-deco", "lockaspect @distributed_lock, watchdog", deco),
    ]
    rows[-1].close = client.close
    return rows


def redis_floor(clients: list[Any], key: str, label: str) -> Variant:
    """SET NX PX on every client, then the compare-and-delete on every client."""
    shas = [c.execute_command("SCRIPT", "LOAD", COMPARE_AND_DELETE) for c in clients]

    def run(n: int) -> None:
        for _ in range(n):
            token = secrets.token_hex(16)
            for c in clients:
                if not c.execute_command("SET", key, token, "NX", "PX", LEASE_MS):
                    raise BenchError(f"{label}: {key} busy")
            for c, sha in zip(clients, shas, strict=True):
                if c.execute_command("EVALSHA", sha, 1, key, token) != 1:
                    raise BenchError(f"{label}: {key} not released")

    return Variant("floor", label, run)


def redis_py_lock(r: Any) -> Variant:
    def run(n: int) -> None:
        for _ in range(n):
            lock = r.lock("bench:stores:redis-py", timeout=LEASE)
            if not lock.acquire(blocking=False):
                raise BenchError("redis-py Lock: busy")
            lock.release()

    return Variant("redis-py", "redis-py Lock", run)


def python_redis_lock(r: Any) -> Variant:
    import redis_lock

    def run(n: int) -> None:
        for _ in range(n):
            lock = redis_lock.Lock(r, "bench:stores:prl", expire=LEASE)
            if not lock.acquire(blocking=False):
                raise BenchError("python-redis-lock: busy")
            lock.release()

    return Variant("prl", "python-redis-lock Lock", run)


def setup_memory(stack: contextlib.ExitStack) -> tuple[list[Variant], Callable[[], float | None], dict[str, str]]:
    from lockaspect import LockClient

    mutex = threading.Lock()

    def floor(n: int) -> None:
        for _ in range(n):
            secrets.token_hex(16)
            mutex.acquire()
            mutex.release()

    rows = [Variant("floor", "floor: threading.Lock + token", floor)]
    rows += lockaspect_rows(LockClient.from_url("memory://"), "memory")
    return rows, lambda: None, {"server": "none (in this process)"}


def setup_sentinel(stack: contextlib.ExitStack) -> tuple[list[Variant], Callable[[], float | None], dict[str, str]]:
    from redis.sentinel import Sentinel

    from lockaspect import LockClient
    from lockaspect.testing.sentinel import ValkeySentinel

    topology = stack.enter_context(ValkeySentinel(replicas=1, sentinels=3))
    hosts = [("127.0.0.1", node.port) for node in topology.sentinels]
    settings = {"socket_timeout": 5, "socket_connect_timeout": 5, "decode_responses": False}
    sentinel = Sentinel(hosts, **settings)
    master = sentinel.master_for(topology.service, **settings)
    stack.callback(master.close)
    data = [make_redis(f"redis://127.0.0.1:{node.port}/0") for node in topology.data_nodes]
    rows = [redis_floor([master], "bench:stores:floor", "raw floor: SET NX PX + EVALSHA del (master_for)")]
    rows += [redis_py_lock(master), python_redis_lock(master)]
    rows += lockaspect_rows(LockClient.from_url(topology.url), "sentinel")

    def server_cpu() -> float | None:
        times = [_util.server_cpu(c) for c in data]
        return None if None in times else sum(t for t in times if t is not None)

    return rows, server_cpu, {"server": f"{topology!r}", **_util.server_facts(data[0])}


def setup_redlock(stack: contextlib.ExitStack) -> tuple[list[Variant], Callable[[], float | None], dict[str, str]]:
    from pottery import Redlock

    from lockaspect import LockClient
    from lockaspect.testing import LockServer

    servers = [stack.enter_context(LockServer()) for _ in range(3)]
    clients = [make_redis(s.url) for s in servers]
    probes = [make_redis(s.url) for s in servers]

    def pottery(n: int) -> None:
        for _ in range(n):
            lock = Redlock(key="bench:stores:pottery", masters=set(clients), auto_release_time=LEASE)
            if not lock.acquire(blocking=False):
                raise BenchError("pottery Redlock: busy")
            lock.release()

    rows = [redis_floor(clients, "bench:stores:floor", "raw floor: SET NX PX x3 + EVALSHA del x3")]
    rows.append(Variant("pottery", "pottery Redlock (3 masters)", pottery))
    rows += lockaspect_rows(LockClient.from_urls([s.url for s in servers]), "redlock")

    def server_cpu() -> float | None:
        times = [_util.server_cpu(c) for c in probes]
        return None if None in times else sum(t for t in times if t is not None)

    return rows, server_cpu, {"server": "3 independent servers", **_util.server_facts(probes[0])}


STORES = {"memory": setup_memory, "sentinel": setup_sentinel, "redlock": setup_redlock}


def bench_store(name: str, args: argparse.Namespace) -> dict[str, Any]:
    out(heading(f"{name}: lock/unlock cycles, uncontended, one thread"))
    with contextlib.ExitStack() as stack:
        rows, server_cpu, facts = STORES[name](stack)
        for v in rows:
            v.run(args.warmup)
        for round_no in range(args.repeats):
            shift = round_no % len(rows)
            for v in rows[shift:] + rows[:shift]:
                gc.collect()
                s0, cpu0, t0 = server_cpu(), time.process_time(), time.perf_counter()
                v.run(args.cycles)
                wall, cpu, s1 = time.perf_counter() - t0, time.process_time() - cpu0, server_cpu()
                v.ops.append(args.cycles / wall)
                v.cpu_us.append(cpu / args.cycles * 1e6)
                if s0 is not None and s1 is not None:
                    v.server_us.append((s1 - s0) / args.cycles * 1e6)
            out(f"  round {round_no + 1}/{args.repeats} done (load {_util.loadavg()})")
        floor = rows[0]
        data: dict[str, Any] = {}
        for v in rows:
            data[v.name] = {
                "label": v.label,
                "ops_per_s": median(v.ops),
                "ops_runs": [round(x, 1) for x in v.ops],
                "us_per_cycle": 1e6 / median(v.ops),
                "cpu_us_per_cycle": median(v.cpu_us),
                "server_cpu_us_per_cycle": median(v.server_us) if v.server_us else None,
                "spread": spread(v.ops),
                "x_floor": median([a / b for a, b in zip(v.ops, floor.ops, strict=True)]),
                "check": v.check(),
            }
        for v in rows:
            v.close()
    headers = ["row", "ops/s", "spread", "us/cycle", "client CPU us", "server CPU us", "x floor", "check"]
    out(
        table(
            headers,
            [
                [
                    e["label"],
                    e["ops_per_s"],
                    f"{e['spread'] * 100:.0f}%",
                    e["us_per_cycle"],
                    e["cpu_us_per_cycle"],
                    e["server_cpu_us_per_cycle"],
                    f"{e['x_floor']:.2f}x",
                    e["check"],
                ]
                for e in data.values()
            ],
        )
    )
    return {"facts": facts, "rows": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stores", default=",".join(STORES), help=f"comma-separated subset of {','.join(STORES)}")
    p.add_argument("--quick", action="store_true", help="short runs to check the script (noisy numbers)")
    p.add_argument("--cycles", type=int, help="timed cycles per run and row (default 5000; quick 500)")
    p.add_argument("--warmup", type=int, help="warm-up cycles per row (default 500; quick 100)")
    p.add_argument("--repeats", type=int, help="interleaved runs per row (default 5; quick 3)")
    p.add_argument("--json", metavar="PATH", help="also write every result to this JSON file")
    args = p.parse_args(argv)
    args.cycles = args.cycles or (500 if args.quick else 5000)
    args.warmup = args.warmup or (100 if args.quick else 500)
    args.repeats = args.repeats or (3 if args.quick else 5)
    names = [s for s in args.stores.split(",") if s]
    if set(names) - set(STORES):
        p.error(f"unknown --stores: {', '.join(sorted(set(names) - set(STORES)))}")
    results: dict[str, Any] = {"machine": _util.machine_facts(), "stores": {}, "errors": {}}
    results["machine"]["loadavg_start"] = _util.loadavg()
    results["params"] = {"cycles": args.cycles, "warmup": args.warmup, "repeats": args.repeats, "lease_s": LEASE}
    for name in names:
        try:
            results["stores"][name] = bench_store(name, args)
        except Exception as exc:
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            out(f"  {name} FAILED: {results['errors'][name]}")
    results["machine"]["loadavg_end"] = _util.loadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
