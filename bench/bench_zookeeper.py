"""lockaspect ZooKeeper store benchmark: lockaspect against kazoo's own Lock recipe and the raw
kazoo floors, in one run.

Sections:

1. Lock/unlock cycles per second, uncontended, one thread, one key per row, empty body: the raw
   kazoo floor (``create(ephemeral, sequence, include_data)`` + ``delete``), the raw floor of
   what a lock needs (create + ``get_children`` + delete), lockaspect's own requests sent raw
   (for information), kazoo's ``Lock`` recipe (the same object reused, and a new object each
   cycle), lockaspect's ``client.lock`` (watchdog and fixed lease) and ``@distributed_lock``;
   then, on one event loop, an asyncio floor (``create_async`` + ``delete_async`` bridged with
   ``rawlink`` + ``loop.call_soon_threadsafe``) and lockaspect's ``async with client.lock``.
   Runs interleaved; ratios to the floors and to kazoo's Lock of the same round.
2. Contention: P = 2, 4, 8 worker processes on ONE key, each looping acquire -> read a counter
   file, sleep 1 ms, write counter+1 -> release, for lockaspect's ``client.lock(key,
   wait=None)``, its ``client.fair_lock`` and kazoo's ``Lock``: sections/s, handoff, waiter
   p50/p99, Jain's index over the workers' section counts, an exact counter check, and what
   each section costs the clients and the server.
3. TARGETS: lockaspect >= kazoo's Lock, uncontended (cycles/s) and under contention
   (sections/s, per P). Printed MET / MISSED; the exit status is 0 whatever they say (a report),
   1 only if a counter check shows mutual exclusion broken.

The benchmark starts its own ZooKeeper (``lockaspect.testing.ZooKeeperServer``: loopback, no
fsync, tick 200 ms) unless ``--zk-hosts`` names a running one.

Run ``python bench/bench_zookeeper.py --help``; see bench/README.md for how to read it. Not a
test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _util
from _util import heading, median, out, spread, table
from bench_async import _barrier, analyse
from bench_core import BenchError, Variant
from bench_sql import CONTENTION_HEADERS, _child_error, contention_row, longest_wait

# -- what the issue asks for -------------------------------------------------------------------

#: lockaspect's rows against kazoo's Lock recipe (same object): at least as fast.
TARGET_VS_KAZOO = 1.0

#: Fixed lease (seconds) of the lockaspect row with a lease.
LEASE = 10
#: The think time inside each contended critical section (1 ms).
THINK = 0.001
#: Where the raw rows and kazoo's recipe live (lockaspect's own nodes are under /lockaspect).
BENCH_ROOT = "/bench-zk"

HERE = Path(__file__).resolve()


# -- kazoo clients, built as lockaspect builds its own -------------------------------------------


def store_defaults() -> dict[str, Any]:
    """The ZooKeeper store's defaults (session and connect timeouts), read from lockaspect."""
    from lockaspect.backends.zookeeper._options import DEFAULTS

    return dict(DEFAULTS)


def make_kazoo(hosts: str) -> Any:
    """A started ``KazooClient`` set up as lockaspect's store sets up its own (see
    ``lockaspect.backends.zookeeper._session.Session._start``): the threading handler, the
    store's default session timeout, the same connection retry, no command retry."""
    from kazoo.client import KazooClient
    from kazoo.retry import KazooRetry

    defaults = store_defaults()
    retry = KazooRetry(max_tries=-1, delay=0.05, backoff=2, max_delay=1.0, max_jitter=0.1)
    client = KazooClient(hosts=hosts, timeout=float(defaults["session_timeout"]), connection_retry=retry)
    client.start(timeout=float(defaults["connect_timeout"]))
    return client


def stop_kazoo(client: Any) -> None:
    with contextlib.suppress(Exception):
        client.stop()
        client.close()


def kazoo_settings(client: Any) -> dict[str, Any]:
    """What matters for speed in a kazoo client, to show that every client matches."""
    return {
        "handler": type(client.handler).__name__,
        "session_timeout_ms": getattr(client, "_session_timeout", None),
        "command_retry": client._retry is not None and getattr(client._retry, "max_tries", None),
    }


def lockaspect_kazoo(client: Any) -> Any:
    """The kazoo client inside a lockaspect ``LockClient`` on ``zookeeper://`` (after its first
    use), or ``None``."""
    session = getattr(client.backend, "_session", None)
    return getattr(session, "_client", None)


# -- the server ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Env:
    """The ZooKeeper of this run."""

    hosts: str  # 127.0.0.1:port
    server: Any = None  # the ZooKeeperServer we started, or None (--zk-hosts)

    @property
    def url(self) -> str:
        return f"zookeeper://{self.hosts}"


def four_letter(hosts: str, command: str) -> str:
    host, _, port = hosts.split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as sock:
            sock.sendall(command.encode("ascii"))
            chunks = []
            while data := sock.recv(65536):
                chunks.append(data)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


def server_counters(env: Env) -> tuple[float | None, float | None]:
    """(the started JVM's CPU seconds, requests the server received) so far, each ``None``
    where unknown. Requests: ``srvr``'s ``Received`` (every client's packets, pings included),
    less the ``srvr`` that asked."""
    cpu = None
    if env.server is not None and env.server.process is not None:
        try:
            import psutil

            times = psutil.Process(env.server.pid).cpu_times()
            cpu = times.user + times.system
        except Exception:
            cpu = None
    received = None
    match = re.search(r"^Received: (\d+)", four_letter(env.hosts, "srvr"), re.MULTILINE)
    if match:
        received = float(match.group(1)) - 1
    return cpu, received


def machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy (every core, every process), or ``None``."""
    try:
        import psutil

        t = psutil.cpu_times()
    except Exception:
        return None
    # guest time is counted in user time already; iowait is idle.
    idle = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return float(sum(t)) - idle


def jvm_cpu(env: Env) -> float | None:
    """The started ZooKeeper JVM's CPU seconds so far, or ``None``."""
    if env.server is None or env.server.process is None:
        return None
    try:
        import psutil

        times = psutil.Process(env.server.pid).cpu_times()
        return float(times.user + times.system)
    except Exception:
        return None


def server_facts(env: Env) -> dict[str, Any]:
    reply = four_letter(env.hosts, "srvr")
    first = reply.splitlines()[0] if reply else "?"
    version = first.partition(":")[2].split(",")[0].strip() or "?"
    mode = re.search(r"^Mode: (\S+)", reply, re.MULTILINE)
    conf = four_letter(env.hosts, "conf")
    settings = {}
    for name in ("tickTime", "minSessionTimeout", "maxSessionTimeout"):
        found = re.search(rf"^{name}=(\S+)", conf, re.MULTILINE)
        if found:
            settings[name] = found.group(1)
    return {"zookeeper": version, "mode": mode.group(1) if mode else "?", "settings": settings}


def java_version() -> str:
    try:
        from lockaspect.testing import find_java

        done = subprocess.run([find_java(), "-version"], capture_output=True, text=True, timeout=30)
        return done.stderr.splitlines()[0].strip() if done.stderr else "?"
    except Exception as exc:
        return f"? ({type(exc).__name__})"


# -- section 1: uncontended cycles ---------------------------------------------------------------


def _lowest(children: Sequence[str], name: str) -> bool:
    """Whether ``name`` is the first contender (all have the same prefix: the 10-digit
    sequence decides)."""
    return bool(children) and min(children) == name


def kazoo_floors(hosts: str, loop: asyncio.AbstractEventLoop) -> list[Variant]:
    """The raw floors on one kazoo client: (a) create + delete, (b) create + get_children +
    delete (what a lock needs: is ours the lowest?), (info) lockaspect's requests, and the
    asyncio floor (a) bridged to ``loop``. Each row on a persistent parent of its own."""
    zk = make_kazoo(hosts)
    parents = {name: f"{BENCH_ROOT}/{name}" for name in ("floor", "floor-list", "requests", "afloor")}
    for parent in parents.values():
        zk.ensure_path(parent)

    def floor(n: int) -> None:
        prefix = parents["floor"] + "/lock-"
        for _ in range(n):
            path, _stat = zk.create(prefix, ephemeral=True, sequence=True, include_data=True)
            zk.delete(path)

    def floor_list(n: int) -> None:
        parent = parents["floor-list"]
        prefix = parent + "/lock-"
        for _ in range(n):
            path, _stat = zk.create(prefix, ephemeral=True, sequence=True, include_data=True)
            if not _lowest(zk.get_children(parent), path.rsplit("/", 1)[1]):
                raise BenchError(f"lock floor: {parent} busy")
            zk.delete(path)

    def requests(n: int) -> None:
        # What lockaspect sends per cycle, without lockaspect: a protected-name contender with
        # its JSON owner metadata and the listing, pipelined (one round trip); the exists-watch
        # on the held node (not waited for); the delete.
        parent = parents["requests"]

        def noop(event: Any) -> None:
            pass

        for _ in range(n):
            info = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "thread": threading.current_thread().name,
                "kind": "lock",
                "lease": 30.0,
                "acquired_at": time.time(),
            }
            data = json.dumps(info, separators=(",", ":")).encode()
            created = zk.create_async(
                f"{parent}/_c_{os.urandom(16).hex()}-lock-", data, ephemeral=True, sequence=True, include_data=True
            )
            listed = zk.get_children_async(parent)
            path, _stat = created.get()
            if not _lowest([c.rsplit("-", 1)[1] for c in listed.get()], path.rsplit("-", 1)[1]):
                raise BenchError(f"lockaspect's requests: {parent} busy")
            zk.exists_async(path, watch=noop)
            zk.delete(path)

    def bridge(async_result: Any) -> asyncio.Future[Any]:
        future = loop.create_future()

        def done(result: Any) -> None:
            def settle() -> None:
                if future.cancelled():
                    return
                try:
                    future.set_result(result.get_nowait())
                except Exception as exc:
                    future.set_exception(exc)

            loop.call_soon_threadsafe(settle)

        async_result.rawlink(done)
        return future

    async def acycles(n: int) -> None:
        prefix = parents["afloor"] + "/lock-"
        for _ in range(n):
            path, _stat = await bridge(zk.create_async(prefix, ephemeral=True, sequence=True, include_data=True))
            await bridge(zk.delete_async(path))

    def check() -> str:
        left = {name: len(zk.get_children(parent)) for name, parent in parents.items()}
        left = {k: v for k, v in left.items() if v}
        return "ok" if not left else f"nodes left behind: {left}"

    variants = [
        Variant("floor", "raw floor (a): create(eph, seq, include_data) + delete", floor),
        Variant("floor-list", "raw lock floor (b): create + get_children + delete", floor_list),
        Variant(
            "requests", "(info) lockaspect's requests raw: [create + get_children], exists-watch, delete", requests
        ),
        Variant(
            "afloor",
            "asyncio floor: create_async + delete_async, rawlink bridge",
            lambda n: loop.run_until_complete(acycles(n)),
        ),
    ]
    variants[0].check = check
    variants[0].close = lambda: stop_kazoo(zk)
    variants[0].settings = {"kazoo": kazoo_settings(zk)}
    return variants


def kazoo_lock_variants(hosts: str) -> list[Variant]:
    """kazoo's Lock recipe on a kazoo client of its own: one object reused, and a new object
    each cycle (as ``with client.Lock(path):`` at each call would)."""
    zk = make_kazoo(hosts)
    same_path, new_path = f"{BENCH_ROOT}/kazoo-lock", f"{BENCH_ROOT}/kazoo-lock-new"
    lock = zk.Lock(same_path)

    def same(n: int) -> None:
        for _ in range(n):
            if not lock.acquire():
                raise BenchError("kazoo Lock: not acquired")
            lock.release()

    def new(n: int) -> None:
        for _ in range(n):
            fresh = zk.Lock(new_path)
            if not fresh.acquire():
                raise BenchError("kazoo Lock (new object): not acquired")
            fresh.release()

    def check() -> str:
        left = {p: len(zk.get_children(p)) for p in (same_path, new_path) if zk.exists(p)}
        left = {k: v for k, v in left.items() if v}
        return "ok" if not left else f"nodes left behind: {left}"

    variants = [
        Variant("kazoo", "kazoo Lock(path).acquire() + release(), same object", same),
        Variant("kazoo-new", "kazoo client.Lock(path), a new object each cycle", new),
    ]
    variants[0].check = check
    variants[0].close = lambda: stop_kazoo(zk)
    variants[0].settings = {"kazoo": kazoo_settings(zk)}
    return variants


LOCKASPECT_ROWS = {
    "la-wd": "lockaspect with client.lock(key), watchdog",
    "la-fixed": f"lockaspect with client.lock(key, lease={LEASE})",
    "la-deco": "lockaspect @distributed_lock(client=...), watchdog",
    "la-async": "lockaspect async with client.lock(key), watchdog",
}


def lockaspect_variants(url: str, loop: asyncio.AbstractEventLoop) -> list[Variant]:
    """client.lock in watchdog mode and with a fixed lease, the decorator and ``async with``,
    on ONE client (one ZooKeeper session), each on its own key."""
    from lockaspect import LockClient, distributed_lock

    client = LockClient.from_url(url)

    def block(key: str, lease: float | None) -> Callable[[int], None]:
        return _util.lock_cycles(client, key, lease)

    @distributed_lock(key="bench-zk:<n>", client=client)
    def decorated(n: int) -> int:
        return n

    def deco(n: int) -> None:
        for _ in range(n):
            decorated(1)

    async def acycles(n: int) -> None:
        for _ in range(n):
            async with client.lock("bench-zk:la-async"):
                pass

    def check() -> str:
        s = client.stats()
        problems = []
        if s.acquired != s.released:
            problems.append(f"acquired {s.acquired} != released {s.released}")
        if s.lost or s.not_acquired or s.held:
            problems.append(f"lost={s.lost} not_acquired={s.not_acquired} held={s.held}")
        return "; ".join(problems) or "ok"

    def close() -> None:
        loop.run_until_complete(client.aclose())

    variants = [
        Variant("la-wd", LOCKASPECT_ROWS["la-wd"], block("bench-zk:la-watchdog", None)),
        Variant("la-fixed", LOCKASPECT_ROWS["la-fixed"], block("bench-zk:la-fixed", LEASE)),
        Variant("la-deco", LOCKASPECT_ROWS["la-deco"], deco),
        Variant("la-async", LOCKASPECT_ROWS["la-async"], lambda n: loop.run_until_complete(acycles(n))),
    ]
    variants[-1].check = check  # after every row ran
    variants[-1].close = close
    variants[0].settings = {"client": client}
    return variants


#: The rows of section 1, in the order of the table; async rows compare with the asyncio floor.
ASYNC_ROWS = ("afloor", "la-async")


def bench_cycles(env: Env, args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading("1. Lock/unlock cycles, uncontended, one thread"))
    out(
        f"{args.cycles:,} cycles per timed run, {args.repeats} runs per row interleaved (order rotated each "
        f"round), after {args.warmup:,} warm-up cycles each; one key (parent node) per row, empty body; "
        "lockaspect: one client (one ZooKeeper session), watchdog rows on its default 30s watchdog lease"
    )
    loop = asyncio.new_event_loop()
    variants: list[Variant] = []
    errors: dict[str, str] = {}
    try:
        variants += kazoo_floors(env.hosts, loop)
        variants += kazoo_lock_variants(env.hosts)
        variants += lockaspect_variants(env.url, loop)
        order = ["floor", "floor-list", "requests", "kazoo", "kazoo-new", "la-wd", "la-fixed", "la-deco"]
        order += list(ASYNC_ROWS)
        by_name = {v.name: v for v in variants}
        variants = [by_name[name] for name in order]
        for variant in list(variants):  # warm-up: connect, make parents, start threads
            try:
                variant.run(args.warmup)
            except Exception as exc:
                errors[variant.name] = f"warm-up failed: {type(exc).__name__}: {exc}"
                variants.remove(variant)
        la_client = next((v.settings["client"] for v in variants if v.settings and "client" in v.settings), None)
        settings = [v.settings["kazoo"] for v in variants if v.settings and "kazoo" in v.settings]
        inner = lockaspect_kazoo(la_client) if la_client is not None else None
        if inner is not None:
            settings.append(kazoo_settings(inner))
        out(f"kazoo clients (floors, kazoo Lock, lockaspect's): {settings}")
        if any(s != settings[0] for s in settings):
            out("  !!! the kazoo clients are not set up alike: compare with care")

        counters: dict[str, list[float]] = {v.name: [] for v in variants}
        main_us: dict[str, list[float]] = {v.name: [] for v in variants}
        others: list[float] = []  # other processes' CPU during each run, in cores
        for round_no in range(args.repeats):
            round_others = len(others)
            shift = round_no % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                gc.collect()
                server0, received0 = server_counters(env)
                busy0 = machine_busy()
                cpu0 = time.process_time()
                main0 = time.thread_time()
                t0 = time.perf_counter()
                variant.run(args.cycles)
                wall = time.perf_counter() - t0
                main = time.thread_time() - main0
                cpu = time.process_time() - cpu0
                busy1 = machine_busy()
                main_us[variant.name].append(main / args.cycles * 1e6)
                server1, received1 = server_counters(env)
                if busy0 is not None and busy1 is not None and server0 is not None and server1 is not None:
                    others.append((busy1 - busy0 - cpu - (server1 - server0)) / wall)
                variant.ops.append(args.cycles / wall)
                variant.cpu_us.append(cpu / args.cycles * 1e6)
                if server0 is not None and server1 is not None:
                    variant.server_us.append((server1 - server0) / args.cycles * 1e6)
                if received0 is not None and received1 is not None:
                    counters[variant.name].append((received1 - received0) / args.cycles)
            busy = others[round_others:]
            seen = f", other processes' CPU {max(0.0, median(busy)):.2f} cores" if busy else ""
            out(f"  round {round_no + 1}/{args.repeats} done (load {_util.loadavg()}{seen})")

        profile = None
        if args.profile and la_client is not None:
            kazoo_row = next((v for v in variants if v.name == "kazoo"), None)
            profile = profile_rows(la_client, kazoo_row, args)
    finally:
        checks = {}
        for v in variants:
            try:
                checks[v.name] = v.check()
            except Exception as exc:
                checks[v.name] = f"check failed: {type(exc).__name__}: {exc}"
        for v in variants:
            with contextlib.suppress(Exception):
                v.close()
        loop.close()

    by_name = {v.name: v for v in variants}

    def ratio(v: Variant, ref_name: str) -> float:
        ref = by_name.get(ref_name)
        if ref is None or not ref.ops:
            return float("nan")
        return median([a / b for a, b in zip(v.ops, ref.ops, strict=True)])

    rows = []
    data: dict[str, Any] = {}
    for v in variants:
        ops = median(v.ops)
        floor_name = "afloor" if v.name in ASYNC_ROWS else "floor"
        entry = {
            "label": v.label,
            "ops_per_s": ops,
            "ops_runs": [round(x, 1) for x in v.ops],
            "us_per_cycle": 1e6 / ops,
            "cpu_us_per_cycle": median(v.cpu_us),
            "main_thread_cpu_us_per_cycle": median(main_us[v.name]),
            "other_threads_cpu_us_per_cycle": median([a - b for a, b in zip(v.cpu_us, main_us[v.name], strict=True)]),
            "server_cpu_us_per_cycle": median(v.server_us) if v.server_us else None,
            "requests_per_cycle": median(counters[v.name]) if counters[v.name] else None,
            "spread": spread(v.ops),
            "x_floor": ratio(v, floor_name),
            "x_lock_floor": ratio(v, "floor-list"),
            "x_kazoo": ratio(v, "kazoo"),
        }
        data[v.name] = entry
        rows.append(
            [
                v.label,
                ops,
                f"{entry['spread'] * 100:.0f}%",
                entry["us_per_cycle"],
                entry["cpu_us_per_cycle"],
                entry["main_thread_cpu_us_per_cycle"],
                entry["other_threads_cpu_us_per_cycle"],
                entry["server_cpu_us_per_cycle"],
                None if entry["requests_per_cycle"] is None else f"{entry['requests_per_cycle']:.2f}",
                f"{entry['x_floor']:.2f}x" + (" (async)" if v.name in ASYNC_ROWS else ""),
                f"{entry['x_lock_floor']:.2f}x",
                f"{entry['x_kazoo']:.2f}x",
            ]
        )
    out()
    out(
        table(
            [
                "row",
                "cycles/s",
                "spread",
                "us/cycle",
                "client CPU us",
                "caller thr",
                "kazoo thr",
                "ZK CPU us",
                "ZK requests",
                "x raw floor",
                "x lock floor",
                "x kazoo Lock",
            ],
            rows,
        )
    )
    out("  cycles/s: median of the runs; spread: (max-min)/median; x ...: median of the per-round ratios to")
    out("  that round's run of the raw floor (a) (async rows: the asyncio floor), the lock floor (b) and kazoo's")
    out("  Lock (same object); above 1.0 is faster. client CPU: this process's CPU (all threads, kazoo's")
    out("  included) per cycle, the column that stays stable on a noisy machine, split into the calling")
    out("  thread's (caller thr: the library's Python and kazoo's request calls; for async rows the event loop)")
    out("  and the rest (kazoo thr: mostly kazoo's connection thread, which packs, sends, reads and unpacks")
    out("  every packet, and its callback threads); ZK CPU: the ZooKeeper JVM's CPU per cycle (psutil); ZK")
    out("  requests: packets the server received per cycle (srvr 'Received'). other processes' CPU (in the")
    out("  round lines): the machine's busy CPU during each run less this process's and the JVM's (median).")
    for name, check in checks.items():
        if check != "ok":
            out(f"  check {name}: {check}")
    for name, message in errors.items():
        out(f"  SKIPPED {name}: {message}")
    engine = engine_alone(args)
    if engine:
        shown = ", ".join(f"{LOCKASPECT_ROWS[k].removeprefix('lockaspect ')} {v:.0f} us" for k, v in engine.items())
        out(f"  lockaspect's own CPU per cycle on memory:// (no I/O; median of 3 runs): {shown}")
    if profile is not None:
        for what, text in profile.items():
            out()
            out(f"  cProfile of {what}, calling thread only, top functions by own time:")
            out(text)
    results["cycles"] = {
        "params": {"cycles": args.cycles, "warmup": args.warmup, "repeats": args.repeats, "lease_s": LEASE},
        "rows": data,
        "engine_cpu_us_per_cycle": engine,
        "other_processes_cpu_cores": [round(x, 3) for x in others],
        "errors": errors,
        "checks": checks,
    }


def engine_alone(args: argparse.Namespace) -> dict[str, float]:
    """lockaspect's own CPU per cycle with no I/O: the lockaspect rows on a ``memory://``
    store (what the engine, the options and the decorator cost, around any store)."""
    try:
        loop = asyncio.new_event_loop()
        variants = lockaspect_variants("memory://", loop)
    except Exception as exc:
        out(f"  (the memory:// engine measurement is not available: {type(exc).__name__}: {exc})")
        return {}
    timings: dict[str, list[float]] = {v.name: [] for v in variants}
    try:
        for v in variants:
            v.run(args.warmup)
        for _ in range(3):
            for v in variants:
                gc.collect()
                cpu0 = time.process_time()
                v.run(args.cycles)
                timings[v.name].append((time.process_time() - cpu0) / args.cycles * 1e6)
    finally:
        for v in variants:
            with contextlib.suppress(Exception):
                v.close()
        loop.close()
    return {name: median(values) for name, values in timings.items()}


def profile_rows(client: Any, kazoo_row: Variant | None, args: argparse.Namespace) -> dict[str, str]:
    """cProfile over ``--profile-cycles`` cycles of lockaspect's ``client.lock`` (watchdog)
    and of kazoo's Lock (same object): the top functions by own time. cProfile sees the
    calling thread only (not kazoo's connection thread), and slows Python code, not the
    server: read shares, not absolute times."""
    texts = {}

    def la(n: int) -> None:
        for _ in range(n):
            with client.lock("bench-zk:profile"):
                pass

    runs = [(f"{args.profile_cycles:,} x `with client.lock(key)`", la)]
    if kazoo_row is not None:
        runs.append((f"{args.profile_cycles:,} x kazoo Lock acquire() + release()", kazoo_row.run))
    for what, run in runs:
        run(10)
        profiler = cProfile.Profile()
        profiler.enable()
        run(args.profile_cycles)
        profiler.disable()
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.sort_stats("tottime").print_stats(args.profile_top)
        lines = [line for line in stream.getvalue().splitlines() if line.strip()]
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        text = "\n".join(
            "    " + re.sub(r"/\S*/(site-packages|lib/python[0-9.]+)/", "", line) for line in lines[start:]
        )
        texts[what] = text.replace(str(HERE.parent.parent) + "/", "")
    return texts


# -- section 2: contention -----------------------------------------------------------------------

CONTENTION_ROWS = {
    "la-lock": "lockaspect client.lock(wait=None)",
    "la-fair": "lockaspect client.fair_lock(wait=None)",
    "kazoo": "kazoo Lock (with lock:)",
}


def child_main(spec: dict[str, Any]) -> int:
    """One contention worker: its own client (its own ZooKeeper session), warm-up on a
    private key, the start barrier, then critical sections on the hot key until the stop time."""
    try:
        result = child_run(spec)
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(spec["out"]).write_text(json.dumps(result), encoding="utf-8")
    return 0 if "error" not in result else 1


def child_run(spec: dict[str, Any]) -> dict[str, Any]:
    impl = spec["impl"]
    stats: dict[str, int] | None = None
    if impl == "kazoo":
        zk = make_kazoo(spec["hosts"])
        hot, warm = zk.Lock(spec["kazoo_path"]), zk.Lock(spec["kazoo_warm_path"])

        def enter(key: str) -> Any:
            return hot if key == spec["key"] else warm

        def finish() -> None:
            stop_kazoo(zk)

    else:
        from lockaspect import LockClient

        client = LockClient.from_url(spec["url"])
        take = client.fair_lock if impl == "la-fair" else client.lock

        def enter(key: str) -> Any:
            return take(key, wait=None)

        def finish() -> None:
            nonlocal stats
            s = client.stats()
            stats = {"acquired": s.acquired, "released": s.released, "lost": s.lost, "held": s.held}
            client.close()

    key, think, pause = spec["key"], spec["think"], spec["pause"]
    fd = os.open(spec["counter"], os.O_RDWR)
    records: list[tuple[float, float, float, float]] = []
    cpu = main = 0.0
    try:
        for _ in range(spec["warm_cycles"]):  # connect, make the parent; a private key
            with enter(spec["warm_key"]):
                pass
        start, stop = _barrier()
        time.sleep(max(0.0, start - time.time()))
        now = time.time
        cpu0 = time.process_time()
        main0 = time.thread_time()
        while True:
            ask = now()
            if ask >= stop:
                break
            with enter(key):
                acquired = now()
                value = int(os.pread(fd, 32, 0))  # the non-atomic critical section: read,
                time.sleep(think)  # think,
                os.pwrite(fd, b"%20d" % (value + 1), 0)  # write back
                released = now()
            records.append((ask, acquired, released, now()))
            if pause:
                time.sleep(pause)
        main = time.thread_time() - main0
        cpu = time.process_time() - cpu0
    finally:
        os.close(fd)
        finish()
    return {"records": {"0": records}, "cpu_s": cpu, "main_cpu_s": main, "stats": stats}


def run_contention(env: Env, impl: str, procs: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One (lock, P) configuration: P fresh worker processes, a start barrier, a fixed run
    time, then the analysis (bench_async's)."""
    scratch = Path(tempfile.mkdtemp(prefix="lockaspect-bench-zk-"))
    counter = scratch / "counter"
    counter.write_bytes(b"%20d" % 0)
    children: list[subprocess.Popen[str]] = []
    result: dict[str, Any] = {"procs": procs}
    try:
        for i in range(procs):
            spec = {
                "impl": impl,
                "url": env.url,
                "hosts": env.hosts,
                "key": f"bench-zk:{tag}:hot",
                "warm_key": f"bench-zk:{tag}:warm:{i}",
                "kazoo_path": f"{BENCH_ROOT}/{tag}/hot",
                "kazoo_warm_path": f"{BENCH_ROOT}/{tag}/warm-{i}",
                "counter": str(counter),
                "think": THINK,
                "pause": args.pause,
                "warm_cycles": args.warm_cycles,
                "out": str(scratch / f"{i}.json"),
            }
            with (scratch / f"{i}.err").open("w", encoding="utf-8") as stderr:
                children.append(
                    subprocess.Popen(
                        [sys.executable, str(HERE), "--child", json.dumps(spec)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        text=True,
                    )
                )
        deadline = time.monotonic() + 120
        for i, child in enumerate(children):
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = child.stdout.readline() if ready else ""
            if line.strip() != "READY":
                child.wait(timeout=5) if child.poll() is None else None
                noise = (scratch / f"{i}.err").read_text(encoding="utf-8").strip().splitlines()
                detail = _child_error(scratch / f"{i}.json") or " | ".join(noise[-3:])
                raise BenchError(f"worker {i} did not get ready (exit {child.poll()}): {detail}")
        server0, received0 = server_counters(env)
        start = time.time() + 0.2
        stop = start + args.settle + args.duration
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"{start!r} {stop!r}\n")
            child.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        busy0, jvm0 = machine_busy(), jvm_cpu(env)
        time.sleep(max(0.0, stop - time.time()))
        busy1, jvm1 = machine_busy(), jvm_cpu(env)
        for child in children:
            try:
                child.wait(timeout=max(1.0, stop - time.time()) + 60)
            except subprocess.TimeoutExpired as exc:
                raise BenchError("a worker did not finish within 60 s of the stop time") from exc
        server1, received1 = server_counters(env)
        per_proc = []
        client_cpu = main_cpu = 0.0
        stats = {"acquired": 0, "released": 0, "lost": 0, "held": 0}
        for i, child in enumerate(children):
            path = scratch / f"{i}.json"
            if not path.exists():
                noise = (scratch / f"{i}.err").read_text(encoding="utf-8").strip().splitlines()
                raise BenchError(f"worker {i} wrote no result (exit {child.returncode}): {' | '.join(noise[-3:])}")
            data = json.loads(path.read_text(encoding="utf-8"))
            if "error" in data:
                raise BenchError(f"worker {i} failed: {data['error']}\n{data.get('traceback', '')}")
            per_proc.append(data["records"])
            client_cpu += data["cpu_s"]
            main_cpu += data["main_cpu_s"]
            for k in stats:
                stats[k] += (data["stats"] or {}).get(k, 0)
        observed = int(counter.read_bytes())
        result.update(analyse(per_proc, start, args.settle, stop, observed))
        result["expected"] = result["sections_total"]
        result.update(longest_wait(per_proc, start + args.settle, stop))
        if busy0 is not None and busy1 is not None and jvm0 is not None and jvm1 is not None:
            # The machine's busy CPU in [start, stop] less the workers' (their measured loops) and the JVM's.
            others = busy1 - busy0 - client_cpu - (jvm1 - jvm0)
            result["other_processes_cpu_cores"] = max(0.0, others / (stop - start))
        total = result["sections_total"]
        if total:
            result["client_cpu_us_per_section"] = client_cpu / total * 1e6
            result["main_thread_cpu_us_per_section"] = main_cpu / total * 1e6
            # Over the whole run (warm-up, tail and the workers' session closes included).
            if server0 is not None and server1 is not None:
                result["server_cpu_us_per_section"] = (server1 - server0) / total * 1e6
            if received0 is not None and received1 is not None:
                result["requests_per_section"] = (received1 - received0) / total
        if impl != "kazoo":
            result["lockaspect_stats"] = stats
        noise = [
            line
            for i in range(procs)
            for line in (scratch / f"{i}.err").read_text(encoding="utf-8").strip().splitlines()
            if line.strip()
        ]
        if noise:
            result["stderr"] = noise[:10]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()  # only our own workers, by their Popen handle
                child.wait()
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def cost_row(label: str, res: dict[str, Any]) -> list[Any]:
    if "error" in res:
        return [label, res["procs"], *([None] * 9)]
    requests = res.get("requests_per_section")
    client, main = res.get("client_cpu_us_per_section"), res.get("main_thread_cpu_us_per_section")
    return [
        label,
        res["procs"],
        client,
        main,
        None if client is None or main is None else client - main,
        res.get("server_cpu_us_per_section"),
        None if requests is None else f"{requests:.2f}",
        res["hold_p50_ms"],
        res["handoff_mean_ms"],
        res["release_call_p50_ms"],
        res.get("other_processes_cpu_cores"),
    ]


def bench_contention(env: Env, args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading(f"2. Contention: P worker processes on ONE key (P = {', '.join(map(str, args.procs))})"))
    after = f"sleep {args.pause * 1e3:g} ms and ask again" if args.pause else "ask again at once"
    out(
        "each worker (its own client, its own ZooKeeper session): take the lock (lockaspect: "
        "with client.lock(key, wait=None) / client.fair_lock(key, wait=None), watchdog mode; kazoo: "
        f"with lock: on one Lock(path) per worker), read the counter file, sleep {THINK * 1e3:g} ms, write "
        f"counter+1, release; then {after}. {args.settle:g}s warm-up + {args.duration:g}s measured after a "
        "start barrier; fresh processes per configuration"
    )
    out(f"machine: {os.cpu_count()} logical CPUs shared by the workers and the ZooKeeper server")
    configs = [name for name in CONTENTION_ROWS if name in args.locks]
    raw: dict[str, dict[str, Any]] = {name: {} for name in configs}
    tag0 = f"{os.getpid()}-{int(time.time())}"
    for p_index, procs in enumerate(args.procs):
        turn = p_index % max(1, len(configs))
        for name in configs[turn:] + configs[:turn]:
            res = run_contention(env, name, procs, args, f"{tag0}-{name}-{procs}")
            raw[name][str(procs)] = res
            if "error" in res:
                summary = f"ERROR {res['error'].splitlines()[0]}"
            else:
                exact = "exact" if res["counter_ok"] and not res["overlaps"] else "FAIL"
                summary = (
                    f"{res['sections_per_s']:,.0f} sections/s, waiter p99 {res['waiter_p99_ms']:.1f} ms, "
                    f"Jain {res['jain']:.3f}, counter {exact}"
                )
            busy = res.get("other_processes_cpu_cores")
            seen = "" if busy is None else f", other processes' CPU {busy:.2f} cores"
            out(f"  {CONTENTION_ROWS[name]} P={procs}: {summary} (load {_util.loadavg()}{seen})")
    rows = [contention_row(CONTENTION_ROWS[name], raw[name][str(p)]) for p in args.procs for name in configs]
    out()
    out(table(["lock", *CONTENTION_HEADERS[1:]], rows))
    out("  sections/s: critical sections entered in the measured window / its length. handoff: from a")
    out("  holder leaving its section (time.time() before release) to the next holder (another worker)")
    out("  holding it. waiter: a request made while another worker held the lock, from asking to holding;")
    out("  longest wait: the longest wait that overlapped the window, also one asked before it. waiters:")
    out("  their share of the requests. Jain: fairness of the per-process section counts (1.0 = equal,")
    out("  1/P = one took all). same again: sections whose previous holder was the same worker. CPU: all")
    out("  workers' process CPU per section. counter: sections recorded = the file counter, and no two")
    out("  holds overlapped in time, else FAIL.")
    out()
    cost = [cost_row(CONTENTION_ROWS[name], raw[name][str(p)]) for p in args.procs for name in configs]
    out(
        table(
            [
                "lock (cost per section)",
                "P",
                "client CPU us",
                "caller thr",
                "kazoo thr",
                "ZK CPU us",
                "ZK requests",
                "hold p50 ms",
                "handoff mean ms",
                "release call p50 ms",
                "others' CPU cores",
            ],
            cost,
        )
    )
    out("  client CPU: all workers' process CPU per section (measured loop only), split into the calling")
    out("  threads' (caller thr) and the rest (kazoo thr: kazoo's connection and callback threads, lockaspect's")
    out("  timer); ZK CPU and ZK requests: the ZooKeeper JVM's CPU and the packets it received over the whole")
    out("  run (warm-up, tail and session closes included) per section; hold: acquired to leaving the section")
    out("  (the 1 ms think + the file); release call: from leaving the section until the release returned;")
    out("  others' CPU: the machine's busy CPU during the run less the workers' measured loops and the JVM's,")
    out("  in cores: other processes' work (and the workers' few cycles outside their loops).")
    for name, by_p in raw.items():
        for p, res in by_p.items():
            if "counter_ok" in res and (not res["counter_ok"] or res["overlaps"]):
                out(
                    f"  !!! FAIL {name} P={p}: counter {res['counter']} vs {res['expected']} sections recorded, "
                    f"{res['overlaps']} overlapping holds: MUTUAL EXCLUSION BROKEN"
                )
            stats = res.get("lockaspect_stats")
            if stats and (stats["lost"] or stats["held"] or stats["acquired"] != stats["released"]):
                out(f"  check {name} P={p}: lockaspect stats {stats}")
            if res.get("stderr"):
                out(f"  stderr {name} P={p}: {res['stderr'][0]}")
            if "error" in res and "\n" in res["error"]:
                out(f"  error {name} P={p}: {res['error']}")
    results["contention"] = {
        "params": {
            "procs": args.procs,
            "duration_s": args.duration,
            "settle_s": args.settle,
            "think_s": THINK,
            "pause_s": args.pause,
            "warm_cycles": args.warm_cycles,
        },
        "rows": raw,
    }


# -- targets -------------------------------------------------------------------------------------


def targets(results: dict[str, Any], args: argparse.Namespace) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(target: str, measured: str, met: bool | None, note: str = "") -> None:
        status = "not run" if met is None else ("MET" if met else "MISSED")
        rows.append([target, measured, status, note])

    cycles = results.get("cycles", {}).get("rows", {})
    kazoo = cycles.get("kazoo")
    for name, label in LOCKASPECT_ROWS.items():
        target = f"uncontended: {label} >= kazoo Lock"
        entry = cycles.get(name)
        if entry is None or kazoo is None:
            add(target, "-", None, "" if "cycles" in args.sections else "section not run")
            continue
        ratio = entry["x_kazoo"]
        note = f"{entry['ops_per_s']:,.0f} vs {kazoo['ops_per_s']:,.0f} cycles/s"
        if name == "la-async":
            note += " (kazoo has no asyncio Lock: its sync Lock)"
        add(target, f"{ratio:.2f}x", ratio >= TARGET_VS_KAZOO, note)

    contention = results.get("contention", {}).get("rows", {})
    broken = []
    for procs in args.procs:
        ref = contention.get("kazoo", {}).get(str(procs))
        for name in ("la-lock", "la-fair"):
            target = f"P={procs}: {CONTENTION_ROWS[name]} sections/s >= kazoo Lock"
            res = contention.get(name, {}).get(str(procs))
            if res is None or ref is None or "sections_per_s" not in res or "sections_per_s" not in ref:
                why = next((r["error"][:60] for r in (res, ref) if r is not None and "error" in r), "")
                if not why and "contention" not in args.sections:
                    why = "section not run"
                add(target, "-", None, why)
                continue
            ratio = res["sections_per_s"] / ref["sections_per_s"] if ref["sections_per_s"] else float("nan")
            note = (
                f"{res['sections_per_s']:,.0f} vs {ref['sections_per_s']:,.0f}/s; waiter p99 "
                f"{res['waiter_p99_ms']:.1f} vs {ref['waiter_p99_ms']:.1f} ms; "
                f"Jain {res['jain']:.3f} vs {ref['jain']:.3f}"
            )
            add(target, f"{ratio:.2f}x", ratio >= TARGET_VS_KAZOO, note)
    for name, by_p in contention.items():
        for p, res in by_p.items():
            if "counter_ok" in res and (not res["counter_ok"] or res["overlaps"]):
                broken.append(f"{name} P={p}")
    if contention:
        add(
            "mutual exclusion (every counter exact, no overlap)",
            "FAIL: " + ", ".join(broken) if broken else "exact",
            not broken,
        )
    return rows


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--zk-hosts", help="use this running ZooKeeper (host:port) instead of starting one")
    p.add_argument("--quick", action="store_true", help="short runs to check the script (noisy numbers)")
    p.add_argument("--cycles", type=int, help="timed cycles per run and row (default 1000; quick 200)")
    p.add_argument("--warmup", type=int, help="warm-up cycles per row (default 200; quick 50)")
    p.add_argument("--repeats", type=int, help="interleaved runs per row (default 5; quick 3)")
    p.add_argument("--procs", default="2,4,8", help="worker process counts for contention (default 2,4,8)")
    p.add_argument("--locks", default=",".join(CONTENTION_ROWS), help="contention rows (default all)")
    p.add_argument("--duration", type=float, help="measured seconds per contention run (default 5; quick 1.5)")
    p.add_argument("--settle", type=float, help="contended warm-up seconds before measuring (default 0.5; quick 0.3)")
    p.add_argument("--pause", type=float, default=0.0, help="seconds each worker sleeps between sections (default 0)")
    p.add_argument("--warm-cycles", type=int, default=20, help="uncontended cycles per worker before the barrier")
    p.add_argument("--sections", default="cycles,contention", help="subset of cycles,contention (default both)")
    p.add_argument("--profile", action="store_true", help="also cProfile lockaspect's and kazoo's cycles")
    p.add_argument("--profile-cycles", type=int, default=1000, help="cycles under cProfile (default 1000)")
    p.add_argument("--profile-top", type=int, default=20, help="functions shown per profile (default 20)")
    p.add_argument("--json", metavar="PATH", help="also write every result to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.cycles = args.cycles or (200 if quick else 1000)
    args.warmup = args.warmup if args.warmup is not None else (50 if quick else 200)
    args.repeats = args.repeats or (3 if quick else 5)
    args.duration = args.duration or (1.5 if quick else 5.0)
    args.settle = args.settle if args.settle is not None else (0.3 if quick else 0.5)
    try:
        args.procs = [int(x) for x in args.procs.split(",") if x.strip()]
    except ValueError:
        p.error("--procs takes comma-separated integers, e.g. 2,4,8")
    if not args.procs or min(args.procs) < 1:
        p.error("--procs needs positive process counts")
    args.locks = [x.strip() for x in args.locks.split(",") if x.strip()]
    if set(args.locks) - set(CONTENTION_ROWS):
        p.error(f"unknown --locks: {', '.join(sorted(set(args.locks) - set(CONTENTION_ROWS)))}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if args.sections - {"cycles", "contention"}:
        p.error(f"unknown section(s): {', '.join(sorted(args.sections - {'cycles', 'contention'}))}")
    return args


def machine_facts(env: Env) -> dict[str, Any]:
    facts = _util.machine_facts()
    for dist in ("python_redis_lock", "pottery", "redis_py"):
        facts.pop(dist, None)  # Redis peers: not part of this benchmark
    facts["kazoo"] = _util.version_of("kazoo")
    facts.update(server_facts(env))
    facts["java"] = java_version() if env.server is not None else "? (--zk-hosts)"
    facts["zk_started_by_bench"] = env.server is not None
    return facts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.zk_hosts:
            env = Env(hosts=args.zk_hosts)
        else:
            from lockaspect.testing import ZooKeeperServer

            server = stack.enter_context(ZooKeeperServer())
            env = Env(hosts=server.hosts, server=server)
        facts = machine_facts(env)
        results["machine"] = facts
        out(heading("lockaspect ZooKeeper store benchmark"))
        out(
            f"CPU: {facts['cpu_model']}, {facts['cpu_logical']} logical / {facts['cpu_physical']} physical; "
            f"load average {facts['loadavg_start']}"
        )
        out(f"Python: {facts['python']} on {facts['platform']}")
        out(f"lockaspect {facts['lockaspect']}, kazoo {facts['kazoo']} (threading handler), psutil {facts['psutil']}")
        how = "started by the benchmark: lockaspect.testing.ZooKeeperServer" if env.server else "given by --zk-hosts"
        out(
            f"ZooKeeper {facts['zookeeper']} {facts['mode']} ({how}), TCP {env.hosts}, {facts['settings']}"
            + (f", forceSync=no, {facts['java']}" if env.server else "")
        )
        if args.quick:
            out("QUICK RUN: short runs; numbers are for checking the script, not for the record")

        if "cycles" in args.sections:
            bench_cycles(env, args, results)
        if "contention" in args.sections:
            bench_contention(env, args, results)

        out(heading("TARGETS (lockaspect >= kazoo's Lock)"))
        rows = targets(results, args)
        out(table(["target", "measured", "status", "note"], rows))
        results["targets"] = [dict(zip(["target", "measured", "status", "note"], row, strict=True)) for row in rows]
        met = sum(1 for r in rows if r[2] == "MET")
        missed = sum(1 for r in rows if r[2] == "MISSED")
        out(
            f"{met} met, {missed} missed, {len(rows) - met - missed} not run "
            "(a report: the exit status is 0 unless mutual exclusion broke)"
        )
        results["machine"]["loadavg_end"] = _util.loadavg()
        out(f"\nload average at the end: {results['machine']['loadavg_end']}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
            out(f"results written to {args.json}")
    broken = any(
        "counter_ok" in res and (not res["counter_ok"] or res["overlaps"])
        for by_p in results.get("contention", {}).get("rows", {}).values()
        for res in by_p.values()
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
