"""lockaspect Redis Cluster store benchmark: lockaspect against the raw redis-py RedisCluster
floor and redis-py's own Lock, and the renewal round trips of 5,000 held locks, in one run.

Sections:

1. Lock/unlock cycles per second, uncontended, one thread, empty body. Each row cycles over keys
   of its own, as many on every primary (``--keys-per-primary``): the raw floor (a redis-py
   ``RedisCluster`` built as the store builds its own: ``SET key token NX PX 30000`` +
   ``EVALSHA`` of a compare-and-delete loaded once, NOSCRIPT answered by loading it), redis-py's
   ``RedisCluster.lock`` (``redis.lock.Lock``), lockaspect's ``client.lock`` (watchdog and a
   fixed 30 s lease) and ``@distributed_lock``; then, on one event loop, a
   ``redis.asyncio.RedisCluster`` floor and lockaspect's ``async with client.lock``. Runs
   interleaved; ratios to the floors of the same round.
2. Renewal round trips: hold ``--locks`` locks over all primaries through the store, call its
   ``renew`` with all of them several times and count, per call, the writes
   (``send_packed_command``) and commands (``pack_commands``) per node; then hold as many
   ``client.lock`` blocks and count the same per watchdog tick.
3. TARGETS: ``client.lock`` >= 0.9x the raw floor; at most one round trip per primary per
   renewal tick. Printed MET / MISSED; the exit status is 0 whatever they say (a report), 1 only
   if an integrity check failed (a key left behind, a lease lost or not renewed).

It starts its own ``lockaspect.testing.ValkeyCluster`` (3 primaries + 3 replicas on loopback)
unless ``--url redis+cluster://...`` names a running one. Not a test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _util
import redis
from _cluster_renewal import bench_renewal
from _util import heading, median, out, spread, table
from bench_core import COMPARE_AND_DELETE, BenchError, Variant
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from lockaspect.backends.redis._topology import parse_topology_url
from lockaspect.backends.redis._topology_clients import _cluster

#: lockaspect's client.lock (and the other rows, for information) against the raw floor.
TARGET_VS_FLOOR = 0.9
#: The lease of every section-1 lock, as the floor's ``PX``; lockaspect's watchdog lease is 30 s too.
LEASE = 30


def cluster_client(url: str, *, asyncio: bool = False) -> Any:
    """A redis-py (or redis.asyncio) ``RedisCluster`` built by the recipe the store uses for its
    own (``_topology_clients._cluster``): no retries, ``decode_responses=False``, its timeouts."""
    return _cluster(parse_topology_url(url), {}, asyncio=asyncio)


def cluster_settings(cluster: Any) -> dict[str, Any]:
    kwargs = cluster.nodes_manager.connection_kwargs
    return {
        "socket_timeout": kwargs.get("socket_timeout"),
        "socket_connect_timeout": kwargs.get("socket_connect_timeout"),
        "decode_responses": kwargs.get("decode_responses", False),
        "retries": getattr(kwargs.get("retry"), "_retries", None),
    }


@dataclasses.dataclass
class Env:
    """The cluster of this run: a seed client, a plain client per node (for INFO)."""

    url: str
    probe: Any
    nodes: dict[str, redis.Redis]  # "host:port" -> client, primaries first
    primaries: list[str]

    @classmethod
    def open(cls, url: str) -> Env:
        probe = cluster_client(url)
        found = probe.cluster_nodes()  # {"host:port": {"flags": ...}}, replicas too
        names = sorted(found, key=lambda name: ("master" not in found[name]["flags"], name))
        nodes = {name: redis.Redis.from_url(f"redis://{name}", socket_timeout=5) for name in names}
        return cls(url, probe, nodes, [name for name in names if "master" in found[name]["flags"]])

    def primary_of(self, key: str) -> str:
        return str(self.probe.nodes_manager.get_node_from_slot(key_slot(key.encode())).name)

    def server_cpu(self) -> float | None:
        """CPU seconds of every node (replicas too: they apply every write) so far."""
        times = [_util.server_cpu(client) for client in self.nodes.values()]
        return None if None in times else sum(t for t in times if t is not None)

    def close(self) -> None:
        for client in self.nodes.values():
            client.close()
        self.probe.close()


def spread_keys(env: Env, make: Callable[[int], str], per_primary: int) -> list[str]:
    """``make(i)`` for the first ``i`` that give ``per_primary`` keys on every primary, in turn."""
    by_node: dict[str, list[str]] = {name: [] for name in env.primaries}
    i = 0
    while any(len(keys) < per_primary for keys in by_node.values()):
        key = make(i)
        keys = by_node[env.primary_of(key)]
        if len(keys) < per_primary:
            keys.append(key)
        i += 1
    return [key for group in zip(*by_node.values(), strict=True) for key in group]


# -- section 1: cycles ---------------------------------------------------------------------------


def raw_floors(env: Env, loop: asyncio.AbstractEventLoop, per_primary: int) -> list[Variant]:
    """The floor on a sync and on an asyncio RedisCluster: a fresh token, ``SET NX PX``, then
    ``EVALSHA`` of the compare-and-delete (loaded again if a node answers NOSCRIPT)."""
    sync, aio = cluster_client(env.url), cluster_client(env.url, asyncio=True)
    sha = sync.script_load(COMPARE_AND_DELETE)  # every primary (redis-py sends SCRIPT LOAD to all)
    keys = spread_keys(env, lambda i: f"bench-cl:raw:{i}", per_primary)
    akeys = spread_keys(env, lambda i: f"bench-cl:araw:{i}", per_primary)

    def floor(n: int) -> None:
        for i in range(n):
            key, token = keys[i % len(keys)], secrets.token_hex(16)
            if not sync.execute_command("SET", key, token, "NX", "PX", LEASE * 1000):
                raise BenchError(f"raw floor: {key} busy")
            try:
                released = sync.execute_command("EVALSHA", sha, 1, key, token)
            except NoScriptError:
                sync.script_load(COMPARE_AND_DELETE)
                released = sync.execute_command("EVALSHA", sha, 1, key, token)
            if released != 1:
                raise BenchError(f"raw floor: {key} not released")

    async def acycles(n: int) -> None:
        for i in range(n):
            key, token = akeys[i % len(akeys)], secrets.token_hex(16)
            if not await aio.execute_command("SET", key, token, "NX", "PX", LEASE * 1000):
                raise BenchError(f"async floor: {key} busy")
            try:
                released = await aio.execute_command("EVALSHA", sha, 1, key, token)
            except NoScriptError:
                await aio.script_load(COMPARE_AND_DELETE)
                released = await aio.execute_command("EVALSHA", sha, 1, key, token)
            if released != 1:
                raise BenchError(f"async floor: {key} not released")

    def check() -> str:
        left = [k for k in keys + akeys if sync.exists(k)]
        return "ok" if not left else f"{len(left)} keys left behind"

    def close() -> None:
        loop.run_until_complete(aio.aclose())
        sync.close()

    return [
        Variant(
            "raw", "raw floor: RedisCluster SET NX PX + EVALSHA del", floor, check, settings=cluster_settings(sync)
        ),
        Variant("araw", "async floor: asyncio RedisCluster, the same", lambda n: loop.run_until_complete(acycles(n))),
        Variant(
            "redis-py", "redis-py RedisCluster.lock(): acquire + release", redis_py_lock(env, per_primary), close=close
        ),
    ]


def redis_py_lock(env: Env, per_primary: int) -> Callable[[int], None]:
    r = cluster_client(env.url)
    keys = spread_keys(env, lambda i: f"bench-cl:redis-py:{i}", per_primary)

    def run(n: int) -> None:
        for i in range(n):
            lock = r.lock(keys[i % len(keys)], timeout=LEASE)
            if not lock.acquire(blocking=False):
                raise BenchError("redis-py Lock: busy")
            lock.release()

    return run


LOCKASPECT_ROWS = {
    "la-wd": "lockaspect with client.lock(key), watchdog",
    "la-fixed": f"lockaspect with client.lock(key, lease={LEASE})",
    "la-deco": "lockaspect @distributed_lock(client=...), watchdog",
    "la-async": "lockaspect async with client.lock(key), watchdog",
}


def lockaspect_variants(env: Env, loop: asyncio.AbstractEventLoop, per_primary: int) -> list[Variant]:
    """The lockaspect rows on ONE ``LockClient.from_url(url)`` (as an application has it)."""
    from lockaspect import LockClient, distributed_lock

    client = LockClient.from_url(env.url)
    wd, fixed, aio = (spread_keys(env, lambda i, r=r: f"bench-cl:{r}:{i}", per_primary) for r in ("wd", "fx", "as"))
    deco_args = [int(k.rsplit(":", 1)[1]) for k in spread_keys(env, lambda i: f"bench-cl:deco:{i}", per_primary)]

    def block(keys: list[str], lease: float | None) -> Callable[[int], None]:
        def run(n: int) -> None:
            for i in range(n):
                with client.lock(keys[i % len(keys)], lease=lease):
                    pass

        return run

    @distributed_lock(key="bench-cl:deco:<n>", client=client)
    def decorated(n: int) -> int:
        return n

    def deco(n: int) -> None:
        for i in range(n):
            decorated(deco_args[i % len(deco_args)])

    async def acycles(n: int) -> None:
        for i in range(n):
            async with client.lock(aio[i % len(aio)]):
                pass

    def check() -> str:
        s = client.stats()
        if s.acquired != s.released or s.lost or s.not_acquired or s.held:
            return f"acquired={s.acquired} released={s.released} lost={s.lost} not_acquired={s.not_acquired}"
        return "ok"

    variants = [
        Variant("la-wd", LOCKASPECT_ROWS["la-wd"], block(wd, None), settings=cluster_settings(client.backend.redis)),
        Variant("la-fixed", LOCKASPECT_ROWS["la-fixed"], block(fixed, LEASE)),
        Variant("la-deco", LOCKASPECT_ROWS["la-deco"], deco),
        Variant("la-async", LOCKASPECT_ROWS["la-async"], lambda n: loop.run_until_complete(acycles(n))),
    ]
    variants[-1].check = check  # after every row ran
    variants[-1].close = lambda: loop.run_until_complete(client.aclose())
    return variants


def bench_cycles(env: Env, args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading("1. Lock/unlock cycles, uncontended, one thread"))
    loop = asyncio.new_event_loop()
    variants = raw_floors(env, loop, args.keys_per_primary) + lockaspect_variants(env, loop, args.keys_per_primary)
    settings = [v.settings for v in variants if v.settings]
    out(f"client settings (floor, lockaspect's store): {settings}")
    if any(s != settings[0] for s in settings):
        out("  !!! the RedisCluster clients are not set up alike: compare with care")
    out(
        f"{args.cycles:,} cycles per timed run, {args.repeats} runs per row interleaved (order rotated each round), "
        f"after {args.warmup:,} warm-up cycles each; each row cycles over {args.keys_per_primary} keys of its own "
        f"on each of the {len(env.primaries)} primaries; lease {LEASE} s"
    )
    for v in variants:  # warm-up: connections to every primary, scripts, threads
        v.run(args.warmup)
    for round_no in range(args.repeats):
        shift = round_no % len(variants)
        for v in variants[shift:] + variants[:shift]:
            gc.collect()
            server0, cpu0, t0 = env.server_cpu(), time.process_time(), time.perf_counter()
            v.run(args.cycles)
            wall, cpu, server1 = time.perf_counter() - t0, time.process_time() - cpu0, env.server_cpu()
            v.ops.append(args.cycles / wall)
            v.cpu_us.append(cpu / args.cycles * 1e6)
            if server0 is not None and server1 is not None:
                v.server_us.append((server1 - server0) / args.cycles * 1e6)
        out(f"  round {round_no + 1}/{args.repeats} done (load {_util.loadavg()})")

    by = {v.name: v for v in variants}

    def ratio(v: Variant, base: str) -> float:
        return median([a / b for a, b in zip(v.ops, by[base].ops, strict=True)])

    rows, data = [], {}
    for v in variants:
        entry = {
            "label": v.label,
            "ops_per_s": median(v.ops),
            "ops_runs": [round(x, 1) for x in v.ops],
            "spread": spread(v.ops),
            "cpu_us": median(v.cpu_us),
            "server_us": median(v.server_us) if v.server_us else None,
            "x_raw": ratio(v, "raw"),
            "x_async_floor": ratio(v, "araw") if v.name in ("araw", "la-async") else None,
            "x_redis_py": ratio(v, "redis-py"),
            "check": v.check(),
        }
        data[v.name] = entry
        x_async = entry["x_async_floor"]
        rows.append(
            [
                v.label,
                entry["ops_per_s"],
                f"{entry['spread'] * 100:.0f}%",
                1e6 / entry["ops_per_s"],
                entry["cpu_us"],
                entry["server_us"],
                f"{entry['x_raw']:.2f}x",
                None if x_async is None else f"{x_async:.2f}x",
                f"{entry['x_redis_py']:.2f}x",
            ]
        )
    out()
    headers = ["row", "cycles/s", "spread", "us/cycle", "client CPU us", "server CPU us", "x raw floor"]
    out(table([*headers, "x async floor", "x redis-py Lock"], rows))
    out("  cycles/s: median of the runs; spread: (max-min)/median; ratios: median of the per-round ratios")
    out("  (each run against the floor's run of the same round), above 1.0 is faster; client CPU: this")
    out("  process, all threads, per cycle; server CPU: all 6 nodes' used_cpu_user+sys (INFO cpu) per cycle.")
    for entry in data.values():
        if entry["check"] != "ok":
            out(f"  check {entry['label']}: {entry['check']}")
    if args.profile:
        for name in ("raw", "la-wd"):
            total, text = _util.profile_top(lambda name=name: by[name].run(args.profile_cycles), args.profile_top)
            out(f"\n  cProfile of {args.profile_cycles:,} cycles of '{by[name].label}' ({total:.2f} s own time):")
            out(text)
    for v in variants:
        v.close()
    loop.close()
    results["cycles"] = {"params": {k: getattr(args, k) for k in ("cycles", "warmup", "repeats")}, "rows": data}


# -- targets and main ----------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    cycles = results.get("cycles", {}).get("rows", {})
    for name, label in LOCKASPECT_ROWS.items():
        entry = cycles.get(name)
        info = name not in ("la-wd", "la-fixed")
        target = f"{'(info) ' if info else ''}uncontended: {label} >= {TARGET_VS_FLOOR}x raw floor"
        if entry is None:
            rows.append([target, "-", "not run", ""])
            continue
        x = entry["x_raw"]
        note = f"{entry['ops_per_s']:,.0f} vs {cycles['raw']['ops_per_s']:,.0f} cycles/s"
        if name == "la-async":
            note += f"; {entry['x_async_floor']:.2f}x the asyncio floor"
        rows.append([target, f"{x:.2f}x", "info" if info else ("MET" if x >= TARGET_VS_FLOOR else "MISSED"), note])
    renewal = results.get("renewal", {})
    for part, label, field in (
        ("store", "store.renew of all held: writes per primary per call", "max_writes_per_primary"),
        ("watchdog", "watchdog: writes per primary per tick", "max_writes_per_primary_per_tick"),
    ):
        entry = renewal.get(part)
        if entry is None:
            rows.append([f"renewal, {label} <= 1", "-", "not run", ""])
            continue
        status = "MET" if entry[field] <= 1 else "MISSED"
        rows.append([f"renewal, {label} <= 1", f"max {entry[field]}", status, ""])
    watchdog = renewal.get("watchdog")
    if watchdog is not None:
        lost = watchdog["lost"]
        rows.append(["watchdog: no lease lost while held", f"{lost} lost", "MISSED" if lost else "MET", ""])
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running cluster (redis+cluster://host:port,...) instead of starting one")
    p.add_argument("--quick", action="store_true", help="short runs to check the script (noisy numbers)")
    p.add_argument("--cycles", type=int, help="timed cycles per run and row (default 5000; quick 500)")
    p.add_argument("--warmup", type=int, help="warm-up cycles per row (default 500; quick 100)")
    p.add_argument("--repeats", type=int, help="interleaved runs per row (default 7; quick 3)")
    p.add_argument("--keys-per-primary", type=int, default=16, help="keys each row cycles over, per primary")
    p.add_argument("--locks", type=int, default=5000, help="locks held in section 2 (default 5000)")
    p.add_argument("--renews", type=int, default=5, help="counted store.renew calls (default 5)")
    p.add_argument("--hold", type=float, help="seconds the watchdog holds them (default 6; quick 3)")
    p.add_argument("--sections", default="cycles,renewal", help="subset of cycles,renewal (default both)")
    p.add_argument("--profile", action="store_true", help="cProfile the raw floor and client.lock cycles")
    p.add_argument("--profile-cycles", type=int, default=3000, help="cycles under cProfile (default 3000)")
    p.add_argument("--profile-top", type=int, default=15, help="functions shown per profile (default 15)")
    p.add_argument("--json", metavar="PATH", help="also write every result to this JSON file")
    args = p.parse_args(argv)
    args.cycles = args.cycles or (500 if args.quick else 5000)
    args.warmup = args.warmup if args.warmup is not None else (100 if args.quick else 500)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.hold = args.hold or (3.0 if args.quick else 6.0)
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if args.sections - {"cycles", "renewal"}:
        p.error(f"unknown section(s): {', '.join(sorted(args.sections - {'cycles', 'renewal'}))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.url:
            url, how = args.url, "given by --url"
        else:
            from lockaspect.testing import ValkeyCluster

            url, how = stack.enter_context(ValkeyCluster()).url, "started by the benchmark: ValkeyCluster()"
        env = Env.open(url)
        stack.callback(env.close)
        facts = _util.machine_facts()
        for dist in ("python_redis_lock", "pottery"):
            facts.pop(dist)
        facts.update(_util.server_facts(next(iter(env.nodes.values()))))
        results["machine"] = facts
        out(heading("lockaspect Redis Cluster store benchmark"))
        out(f"CPU: {facts['cpu_model']}, {facts['cpu_logical']} logical; load average {facts['loadavg_start']}")
        out(f"Python: {facts['python']} on {facts['platform']}")
        out(f"lockaspect {facts['lockaspect']}, redis-py {facts['redis_py']} (parser {_parser()})")
        replicas = len(env.nodes) - len(env.primaries)
        out(f"{facts['kind']} {facts['version']} cluster ({how}): {len(env.primaries)} primaries + {replicas} replicas")
        out(f"  loopback TCP; primaries {', '.join(env.primaries)}; all on the same machine")
        if args.quick:
            out("QUICK RUN: short runs; numbers are for checking the script, not for the record")
        if "cycles" in args.sections:
            bench_cycles(env, args, results)
        if "renewal" in args.sections:
            bench_renewal(env, args, results)
        out(heading("TARGETS"))
        rows = targets(results)
        out(table(["target", "measured", "status", "note"], rows))
        met, missed = (sum(1 for r in rows if r[2] == s) for s in ("MET", "MISSED"))
        out(f"{met} met, {missed} missed (a report: the exit status is 0 unless an integrity check failed)")
        results["targets"] = rows
        out(f"\nload average at the end: {_util.loadavg()}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    checks = [e["check"] for e in results.get("cycles", {}).get("rows", {}).values()]
    renewal = results.get("renewal", {})
    broken = any(c != "ok" for c in checks) or renewal.get("store", {}).get("not_renewed", 0)
    return 1 if broken or renewal.get("watchdog", {}).get("problems", 0) else 0


def _parser() -> str:
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "python"


if __name__ == "__main__":
    sys.exit(main())
