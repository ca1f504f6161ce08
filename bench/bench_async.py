"""lockaspect asyncio and contention benchmark: one run, everything side by side (issue 3, item 8).

Sections:

1. Async lock/unlock cycles per second, uncontended, one task on one event loop: the raw
   async floor (``redis.asyncio`` ``SET NX PX`` + ``EVALSHA`` compare-and-delete),
   redis-py's asyncio ``Lock``, aioredlock, and lockaspect's ``async with client.lock``
   and ``@distributed_lock`` on ``async def``, each in watchdog mode and with a fixed lease.
2. Contention: P = 2, 4, 8 worker processes on ONE key, each looping acquire (blocking,
   each library's default wait strategy), a non-atomic counter increment (GET then SET),
   release, 1 ms pause; for lockaspect sync and async and for redis-py ``Lock``,
   python-redis-lock, pottery ``Redlock`` and aioredlock. Sections per second, handoff
   latency, waiter wait, Jain's fairness index, and an exact counter check.
3. TARGETS: every target of the issue with MET / MISSED and the measured value.

``--plot PATH`` writes a PNG (sections/s and waiter p99 against P), ``--markdown PATH``
writes the figures page (docs/benchmarks.md), ``--json PATH`` every number.

Run ``python bench/bench_async.py --help``; see bench/README.md and docs/benchmarks.md for
how to read it. It starts (and stops) its own server unless ``--url`` is given. Not a test:
pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import itertools
import json
import math
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import _util
from _util import SOCKET_CONNECT_TIMEOUT, SOCKET_TIMEOUT, heading, make_redis, median, out, spread, table

# -- what the issue asks for (issue 3, item 8) -----------------------------------------------

TARGET_ASYNC_RAW_RATIO = 0.9  # lockaspect async cycle >= 0.9x the raw async floor

#: Fixed lease (seconds) for every library, in both sections: never expires during a cycle
#: or a critical section, and the same for all.
LEASE = 10
LEASE_MS = LEASE * 1000

#: The pause after each release in the contention section (the issue's 1 ms).
PAUSE = 0.001

#: The raw floor's release: delete the key only if it still holds our token.
COMPARE_AND_DELETE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"

HERE = Path(__file__).resolve()


class BenchError(RuntimeError):
    """A library misbehaved during the benchmark (a lock not acquired, a wrong reply)."""


def make_async_redis(url: str) -> Any:
    """``_util.make_redis`` for ``redis.asyncio``: the options lockaspect's async backend
    gives its own client (socket and connect timeouts, no redis-py retries, bytes)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff

    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_CONNECT_TIMEOUT,
        retry=AsyncRetry(backoff=NoBackoff(), retries=0),
        decode_responses=False,
    )


def import_aioredlock() -> Any:
    """aioredlock (0.7.3, unmaintained, on aioredis 1.x), or raise with the reason."""
    with warnings.catch_warnings():
        # It imports distutils' StrictVersion (deprecated; gone in Python 3.12).
        warnings.simplefilter("ignore", DeprecationWarning)
        import aioredlock
    return aioredlock


def aioredlock_connection(url: str) -> Any:
    """The connection argument aioredlock passes to ``aioredis.create_redis_pool``, from a
    redis:// or unix:// URL, with the same connect timeout as every other client. aioredis
    1.x has no per-command socket timeout: that option cannot be matched."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        return parts.path  # aioredlock takes a socket path as a plain string (db 0)
    if parts.scheme != "redis":
        raise BenchError(f"aioredlock: unsupported URL scheme {parts.scheme!r}")
    db = int((parts.path or "/0").lstrip("/") or query.get("db", ["0"])[0])
    connection: dict[str, Any] = {
        "host": parts.hostname or "localhost",
        "port": parts.port or 6379,
        "db": db,
        "timeout": SOCKET_CONNECT_TIMEOUT,
    }
    if parts.password:
        connection["password"] = parts.password
    return connection


def redis_parser() -> str:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return "?"
    return "hiredis" if HIREDIS_AVAILABLE else "pure Python"


# -- section 1: async lock/unlock cycles -------------------------------------------------------


async def _ok() -> str:
    return "ok"


async def _nothing() -> None:
    return None


@dataclasses.dataclass
class AVariant:
    name: str
    label: str
    run: Callable[[int], Awaitable[None]]
    check: Callable[[], Awaitable[str]] = _ok
    close: Callable[[], Awaitable[None]] = _nothing
    settings: dict[str, Any] | None = None
    ops: list[float] = dataclasses.field(default_factory=list)
    cpu_us: list[float] = dataclasses.field(default_factory=list)
    server_us: list[float] = dataclasses.field(default_factory=list)


def _agone(r: Any, key: str) -> Callable[[], Awaitable[str]]:
    async def check() -> str:
        return "ok" if not await r.exists(key) else f"key {key} left behind"

    return check


async def raw_async(url: str) -> AVariant:
    """The least a correct lease lock costs with ``redis.asyncio``: a fresh 128-bit token,
    ``SET key token NX PX ms``, then ``EVALSHA`` of a compare-and-delete loaded once."""
    r = make_async_redis(url)
    sha = await r.execute_command("SCRIPT", "LOAD", COMPARE_AND_DELETE)
    key = "bench-async:raw"

    async def run(n: int) -> None:
        for _ in range(n):
            token = secrets.token_hex(16)
            if not await r.execute_command("SET", key, token, "NX", "PX", LEASE_MS):
                raise BenchError(f"raw async floor: {key} busy")
            if await r.execute_command("EVALSHA", sha, 1, key, token) != 1:
                raise BenchError(f"raw async floor: {key} not released")

    return AVariant("raw", "raw async floor: SET NX PX + EVALSHA del", run, _agone(r, key), r.aclose)


def _bulk(part: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(part), part)


async def raw_async_packed(url: str) -> AVariant:
    """For information: the same two commands pre-packed in RESP and sent with a pooled
    connection's ``send_packed_command`` / ``read_response`` (what lockaspect's async
    backend does for its scripts), skipping ``execute_command``."""
    r = make_async_redis(url)
    sha = await r.execute_command("SCRIPT", "LOAD", COMPARE_AND_DELETE)
    sha = sha if isinstance(sha, bytes) else str(sha).encode()
    pool = r.connection_pool
    key = b"bench-async:raw-packed"
    set_head = b"*6\r\n" + _bulk(b"SET") + _bulk(key)
    set_tail = _bulk(b"NX") + _bulk(b"PX") + _bulk(b"%d" % LEASE_MS)
    del_head = b"*5\r\n" + _bulk(b"EVALSHA") + _bulk(sha) + _bulk(b"1") + _bulk(key)

    async def call(packed: bytes) -> Any:
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command((packed,), check_health=False)
            return await connection.read_response()
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)

    async def run(n: int) -> None:
        for _ in range(n):
            token = _bulk(secrets.token_hex(16).encode())
            if await call(set_head + token + set_tail) != b"OK":
                raise BenchError("packed raw async floor: key busy")
            if await call(del_head + token) != 1:
                raise BenchError("packed raw async floor: key not released")

    return AVariant("raw-packed", "(info) raw async floor, pre-packed RESP", run, _agone(r, key.decode()), r.aclose)


async def redis_py_async_lock(url: str) -> AVariant:
    r = make_async_redis(url)
    key = "bench-async:redis-py"

    async def run(n: int) -> None:
        for _ in range(n):
            lock = r.lock(key, timeout=LEASE)
            if not await lock.acquire(blocking=False):
                raise BenchError(f"redis-py asyncio Lock: {key} busy")
            await lock.release()

    return AVariant("redis-py", "redis-py asyncio Lock", run, _agone(r, key), r.aclose)


async def aioredlock_variant(url: str) -> AVariant:
    aioredlock = import_aioredlock()
    manager = aioredlock.Aioredlock([aioredlock_connection(url)])
    key = "bench-async:aioredlock"
    probe = make_async_redis(url)

    async def run(n: int) -> None:
        for _ in range(n):
            lock = await manager.lock(key, lock_timeout=LEASE)  # raises LockError if busy
            await manager.unlock(lock)

    async def close() -> None:
        await manager.destroy()
        await probe.aclose()

    return AVariant("aioredlock", "aioredlock (1 instance)", run, _agone(probe, key), close)


LOCKASPECT_LABELS = {
    "la-block-wd": "lockaspect async with client.lock, watchdog",
    "la-block-fixed": f"lockaspect async with client.lock, lease={LEASE}",
    "la-deco-wd": "lockaspect @distributed_lock async def, watchdog",
    "la-deco-fixed": f"lockaspect @distributed_lock async def, lease={LEASE}",
}


async def lockaspect_async_variants(url: str) -> list[AVariant]:
    """``async with client.lock`` and the decorator on ``async def``, watchdog mode and
    fixed lease, on ONE client (as an application would have it)."""
    from lockaspect import LockClient, distributed_lock

    client = LockClient.from_url(url)

    def block(key: str, lease: float | None) -> Callable[[int], Awaitable[None]]:
        async def run(n: int) -> None:
            for _ in range(n):
                async with client.lock(key, lease=lease):
                    pass

        return run

    @distributed_lock(key="bench-async:<n>", client=client)
    async def decorated_watchdog(n: int) -> int:
        return n

    @distributed_lock(key="bench-async:<n>", lease=LEASE, client=client)
    async def decorated_fixed(n: int) -> int:
        return n

    def call(fn: Callable[[int], Awaitable[int]], arg: int) -> Callable[[int], Awaitable[None]]:
        async def run(n: int) -> None:
            for _ in range(n):
                await fn(arg)

        return run

    async def check() -> str:
        s = client.stats()
        problems = []
        if s.acquired != s.released:
            problems.append(f"acquired {s.acquired} != released {s.released}")
        if s.lost or s.not_acquired or s.held:
            problems.append(f"lost={s.lost} not_acquired={s.not_acquired} held={s.held}")
        return "; ".join(problems) or f"ok ({s.acquired:,} acquired and released, 0 lost)"

    variants = [
        AVariant("la-block-wd", LOCKASPECT_LABELS["la-block-wd"], block("bench-async:la-watchdog", None)),
        AVariant("la-block-fixed", LOCKASPECT_LABELS["la-block-fixed"], block("bench-async:la-fixed", LEASE)),
        AVariant("la-deco-wd", LOCKASPECT_LABELS["la-deco-wd"], call(decorated_watchdog, 1)),
        AVariant("la-deco-fixed", LOCKASPECT_LABELS["la-deco-fixed"], call(decorated_fixed, 2)),
    ]
    # The loop's connections exist after the first lock: read their settings then.
    async with client.lock("bench-async:settings"):
        pass
    try:  # private: the running loop's async backend and its redis.asyncio client
        variants[0].settings = _util.connection_settings(client._async.state().store.redis)
    except Exception as exc:
        out(f"  (cannot read lockaspect's async client settings: {type(exc).__name__}: {exc})")
    variants[0].check = check
    variants[-1].close = client.aclose
    return variants


async def bench_cycles_async(url: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading("1. Async lock/unlock cycles, uncontended, one task on one event loop"))
    loop = asyncio.get_running_loop()
    out(f"event loop: {type(loop).__module__}.{type(loop).__name__}")
    variants: list[AVariant] = []
    errors: dict[str, str] = {}
    factories: list[tuple[str, Callable[[str], Awaitable[AVariant]]]] = [
        ("raw", raw_async),
        ("raw-packed", raw_async_packed),
        ("redis-py", redis_py_async_lock),
        ("aioredlock", aioredlock_variant),
    ]
    for name, factory in factories:
        try:
            variants.append(await factory(url))
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    try:
        variants.extend(await lockaspect_async_variants(url))
    except Exception as exc:
        errors["lockaspect"] = f"{type(exc).__name__}: {exc}"

    reference = next((v.settings for v in variants if v.settings is not None), None)
    if reference is not None:
        probe_client = make_async_redis(url)
        mine = _util.connection_settings(probe_client)
        await probe_client.aclose()
        if mine != reference:
            raise BenchError(f"peer client settings {mine} differ from lockaspect's {reference}")
        out(f"every redis.asyncio client: its own client and pool, {reference}")
    if "aioredlock" not in errors:
        out(
            f"aioredlock: its own aioredis 1.x pool, connect timeout {SOCKET_CONNECT_TIMEOUT:g}s "
            "(aioredis 1.x has no command timeout and no retries)"
        )
    out(
        f"{args.cycles:,} cycles per timed run, {args.repeats} runs per library, interleaved "
        f"(order rotated each round), after {args.warmup:,} warm-up cycles each; lease {LEASE}s for all"
    )
    for variant in list(variants):  # warm-up: connect, load scripts
        try:
            await variant.run(args.warmup)
        except Exception as exc:
            errors[variant.name] = f"warm-up failed: {type(exc).__name__}: {exc}"
            variants.remove(variant)
    probe = make_redis(url)  # reads the server's CPU time around each run (outside the timing)
    for round_no in range(args.repeats):
        shift = round_no % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            gc.collect()
            server0 = _util.server_cpu(probe)
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            await variant.run(args.cycles)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            server1 = _util.server_cpu(probe)
            variant.ops.append(args.cycles / wall)
            variant.cpu_us.append(cpu / args.cycles * 1e6)
            if server0 is not None and server1 is not None:
                variant.server_us.append((server1 - server0) / args.cycles * 1e6)
        out(f"  round {round_no + 1}/{args.repeats} done (load {_util.loadavg()})")
    probe.close()

    by_name = {v.name: v for v in variants}
    raw = by_name.get("raw")
    redispy = by_name.get("redis-py")
    packed = by_name.get("raw-packed")

    def per_round_ratio(v: AVariant, base: AVariant | None) -> float:
        if base is None:
            return float("nan")
        return median([a / b for a, b in zip(v.ops, base.ops, strict=True)])

    rows = []
    data: dict[str, Any] = {}
    for v in variants:
        ops = median(v.ops)
        entry = {
            "label": v.label,
            "ops_per_s": ops,
            "ops_runs": [round(x, 1) for x in v.ops],
            "us_per_cycle": 1e6 / ops,
            "cpu_us_per_cycle": median(v.cpu_us),
            "server_cpu_us_per_cycle": median(v.server_us) if v.server_us else None,
            "spread": spread(v.ops),
            "x_raw": per_round_ratio(v, raw),
            "x_redis_py": per_round_ratio(v, redispy),
            "x_raw_packed": per_round_ratio(v, packed),
            "check": await v.check(),
        }
        data[v.name] = entry
        rows.append(cycle_row(entry))
    for name, message in errors.items():
        data.setdefault(name, {"label": name, "unavailable": message})
    out()
    out(table(CYCLE_HEADERS, rows))
    out("  ops/s: median of the runs; spread: (max-min)/median; ratios: median of the per-round ratios")
    out("  (each run against the raw async floor / redis-py asyncio Lock run of the same round); client")
    out("  CPU: this process's CPU (all threads) per cycle; server CPU: INFO cpu per cycle. The target uses")
    out("  x raw floor; (x packed) is for information (lockaspect sends its scripts pre-packed).")
    for v in variants:
        status = data[v.name]["check"]
        if status != "ok":
            out(f"  check {v.label}: {status}")
    for name, message in errors.items():
        out(f"  UNAVAILABLE {name}: {message}")
    for v in variants:
        try:
            await v.close()
        except Exception:
            pass
    results["cycles"] = {
        "params": {"cycles": args.cycles, "warmup": args.warmup, "repeats": args.repeats, "lease": LEASE},
        "event_loop": f"{type(loop).__module__}.{type(loop).__name__}",
        "libraries": data,
        "errors": errors,
    }


CYCLE_HEADERS = [
    "library",
    "ops/s",
    "spread",
    "us/cycle",
    "client CPU us",
    "server CPU us",
    "x raw floor",
    "x redis-py Lock",
    "(x packed)",
]


def cycle_row(entry: dict[str, Any]) -> list[Any]:
    return [
        entry["label"],
        entry["ops_per_s"],
        f"{entry['spread'] * 100:.0f}%",
        entry["us_per_cycle"],
        entry["cpu_us_per_cycle"],
        entry["server_cpu_us_per_cycle"],
        f"{entry['x_raw']:.2f}x",
        f"{entry['x_redis_py']:.2f}x",
        f"{entry['x_raw_packed']:.2f}x",
    ]


class _InMemory:
    """A lock store that answers at once (every lock free): timing lockaspect on it measures
    the async engine alone (options, lease, watchdog registration, context stack, the
    release task, for the decorator the body task, binding and rendering)."""

    def __init__(self) -> None:
        from lockaspect.backends.base import AcquireResult, Capability, ReleaseResult

        self.capabilities = Capability.RENEWABLE | Capability.BATCH_RENEW | Capability.FENCING
        self.kinds = frozenset({"lock"})
        self._acquired = AcquireResult
        self._released = ReleaseResult.RELEASED
        self._fence = 0

    def asyncio_twin(self) -> _InMemory:
        return self

    async def acquire(self, request: Any) -> Any:
        self._fence += 1
        return self._acquired(True, self._fence)

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        return True

    async def release(self, key: str, token: str, kind: str = "lock") -> Any:
        return self._released

    async def renew(self, leases: Any) -> list[bool]:
        return [True] * len(leases)

    def notifier(self) -> None:
        return None

    def threads(self) -> list[Any]:
        return []

    def waiter_id(self, listens: bool) -> str:
        return ""

    async def aclose(self) -> None:
        pass

    def close(self) -> None:
        pass


async def bench_engine_async(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """lockaspect's own CPU per async cycle on an in-memory backend (no I/O), with the cost
    of the asyncio primitives it uses per cycle for scale."""
    from lockaspect import LockClient, distributed_lock

    client = LockClient(_InMemory())  # type: ignore[arg-type]

    @distributed_lock(key="bench:<n>", client=client)
    async def decorated_watchdog(n: int) -> int:
        return n

    @distributed_lock(key="bench:<n>", lease=LEASE, client=client)
    async def decorated_fixed(n: int) -> int:
        return n

    def block(lease: float | None) -> Callable[[int], Awaitable[None]]:
        async def run(n: int) -> None:
            for _ in range(n):
                async with client.lock("bench:engine", lease=lease):
                    pass

        return run

    def call(fn: Callable[[int], Awaitable[int]]) -> Callable[[int], Awaitable[None]]:
        async def run(n: int) -> None:
            for _ in range(n):
                await fn(1)

        return run

    async def noop() -> None:
        return None

    async def shielded_task(n: int) -> None:  # what each lockaspect release costs in asyncio
        loop = asyncio.get_running_loop()
        for _ in range(n):
            await asyncio.shield(loop.create_task(noop()))

    async def sleep0(n: int) -> None:  # one trip through the event loop
        for _ in range(n):
            await asyncio.sleep(0)

    cases: dict[str, Callable[[int], Awaitable[None]]] = {
        "la-block-wd": block(None),
        "la-block-fixed": block(LEASE),
        "la-deco-wd": call(decorated_watchdog),
        "la-deco-fixed": call(decorated_fixed),
        "asyncio: await shield(create_task(noop()))": shielded_task,
        "asyncio: await sleep(0)": sleep0,
    }
    timings: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for run in cases.values():
            await run(args.warmup)
        for _ in range(3):
            for name, run in cases.items():
                gc.collect()
                cpu0 = time.process_time()
                await run(args.cycles)
                timings[name].append((time.process_time() - cpu0) / args.cycles * 1e6)
    finally:
        await client.aclose()
    rows = [
        [LOCKASPECT_LABELS.get(name, f"(scale) {name}"), median(values), f"{spread(values) * 100:.0f}%"]
        for name, values in timings.items()
    ]
    out()
    out("lockaspect's own CPU per async cycle on an in-memory backend (no I/O; median of 3 runs):")
    out(table(["lockaspect", "engine CPU us/cycle", "spread"], rows))
    results.setdefault("cycles", {})["engine_cpu_us_per_cycle"] = {name: median(v) for name, v in timings.items()}


# -- section 2: contention (worker processes) ----------------------------------------------------

#: name -> (label, peer?). The order is the table's order.
CONTENTION_LIBS: dict[str, tuple[str, bool]] = {
    "la-sync": ("lockaspect sync", False),
    "la-async": ("lockaspect async, 1 task/proc", False),
    "la-async-tasks": ("lockaspect async, {tasks} tasks/proc", False),
    "la-fair": ("lockaspect fair lock (sync)", False),
    "redis-py": ("redis-py Lock (sleep 0.1)", True),
    "prl": ("python-redis-lock (BLPOP)", True),
    "pottery": ("pottery Redlock", True),
    "aioredlock": ("aioredlock (retry 3x 0.1-0.3s)", True),
}
#: lockaspect rows the targets are checked for; the tasks row shows coalescing (information).
TARGET_ROWS = ("la-sync", "la-async")
#: The fair lock's sections/s against the mutex's (la-fair / la-sync), same run (issue 15).
TARGET_FAIR_RATIO = 0.9


def lib_label(name: str, args: argparse.Namespace) -> str:
    return CONTENTION_LIBS[name][0].format(tasks=args.tasks)


class SyncLib:
    """One sync library in a worker: ``acquire(key)`` blocks until held (the library's
    default wait strategy) and returns what ``release`` needs."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.extra: dict[str, Any] = {}

    def acquire(self, key: str) -> Any:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LockaspectSync(SyncLib):
    def __init__(self, url: str) -> None:
        super().__init__()
        from lockaspect import LockClient

        self.client = LockClient.from_url(url)

    def acquire(self, key: str) -> Any:
        block = self.client.lock(key, wait=None)  # as `with client.lock(key, wait=None):`
        block.__enter__()
        return block

    def release(self, handle: Any) -> None:
        handle.__exit__(None, None, None)

    def close(self) -> None:
        s = self.client.stats()
        self.extra["stats"] = {"acquired": s.acquired, "released": s.released, "lost": s.lost, "held": s.held}
        self.client.close()


class LockaspectFair(LockaspectSync):
    def acquire(self, key: str) -> Any:
        block = self.client.fair_lock(key, wait=None)  # as `with client.fair_lock(key, wait=None):`
        block.__enter__()
        return block


class RedisPyLock(SyncLib):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.r = make_redis(url)

    def acquire(self, key: str) -> Any:
        lock = self.r.lock(key, timeout=LEASE)  # blocking, sleep=0.1 (its defaults)
        if not lock.acquire():
            raise BenchError("redis-py Lock: blocking acquire returned False")
        return lock

    def release(self, handle: Any) -> None:
        handle.release()

    def close(self) -> None:
        self.r.close()


class PythonRedisLock(SyncLib):
    def __init__(self, url: str) -> None:
        super().__init__()
        import redis
        import redis_lock

        self.redis_lock = redis_lock
        self.timeout_error = redis.exceptions.TimeoutError
        self.r = make_redis(url)

    def acquire(self, key: str) -> Any:
        lock = self.redis_lock.Lock(self.r, key, expire=LEASE)
        while True:
            try:
                if lock.acquire():  # blocking: SET NX, then BLPOP on the release signal
                    return lock
            except self.timeout_error:
                # Its BLPOP blocks for up to `expire` (10 s), longer than the socket timeout
                # every client here has (2 s): counted, and the worker asks again.
                self.errors["BLPOP socket timeout"] += 1

    def release(self, handle: Any) -> None:
        handle.release()

    def close(self) -> None:
        self.r.close()


class PotteryRedlock(SyncLib):
    def __init__(self, url: str) -> None:
        super().__init__()
        from pottery import Redlock

        self.redlock = Redlock
        self.r = make_redis(url)

    def acquire(self, key: str) -> Any:
        lock = self.redlock(key=key, masters={self.r}, auto_release_time=LEASE)
        if not lock.acquire():  # blocking, retries after random.uniform(0, 0.2) s
            raise BenchError("pottery Redlock: blocking acquire returned False")
        return lock

    def release(self, handle: Any) -> None:
        handle.release()

    def close(self) -> None:
        self.r.close()


SYNC_LIBS: dict[str, Callable[[str], SyncLib]] = {
    "la-sync": LockaspectSync,
    "la-fair": LockaspectFair,
    "redis-py": RedisPyLock,
    "prl": PythonRedisLock,
    "pottery": PotteryRedlock,
}


class AsyncLib:
    """:class:`SyncLib` for one event loop."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.extra: dict[str, Any] = {}

    async def start(self) -> None:
        pass

    async def acquire(self, key: str) -> Any:
        raise NotImplementedError

    async def release(self, handle: Any) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class LockaspectAsync(AsyncLib):
    def __init__(self, url: str) -> None:
        super().__init__()
        from lockaspect import LockClient

        self.client = LockClient.from_url(url)

    async def acquire(self, key: str) -> Any:
        block = self.client.lock(key, wait=None)  # as `async with client.lock(key, wait=None):`
        await block.__aenter__()
        return block

    async def release(self, handle: Any) -> None:
        await handle.__aexit__(None, None, None)

    async def close(self) -> None:
        s = self.client.stats()
        self.extra["stats"] = {"acquired": s.acquired, "released": s.released, "lost": s.lost, "held": s.held}
        await self.client.aclose()


class AioredlockLib(AsyncLib):
    def __init__(self, url: str) -> None:
        super().__init__()
        aioredlock = import_aioredlock()
        self.lock_error = aioredlock.LockError
        self.manager = aioredlock.Aioredlock([aioredlock_connection(url)])

    async def acquire(self, key: str) -> Any:
        while True:
            try:
                # Its default retry: 3 attempts, random 0.1-0.3 s apart, then LockError.
                return await self.manager.lock(key, lock_timeout=LEASE)
            except self.lock_error:
                self.errors["LockError after 3 attempts (asked again)"] += 1

    async def release(self, handle: Any) -> None:
        await self.manager.unlock(handle)

    async def close(self) -> None:
        await self.manager.destroy()


ASYNC_LIBS: dict[str, Callable[[str], AsyncLib]] = {
    "la-async": LockaspectAsync,
    "la-async-tasks": LockaspectAsync,
    "aioredlock": AioredlockLib,
}


def _barrier() -> tuple[float, float]:
    """Tell the parent this worker is warm, then wait for its start and stop times."""
    print("READY", flush=True)
    line = sys.stdin.readline()
    start, stop = (float(x) for x in line.split())
    return start, stop


def child_sync(spec: dict[str, Any]) -> dict[str, Any]:
    lib = SYNC_LIBS[spec["impl"]](spec["url"])
    r = make_redis(spec["url"])
    key, counter, pause = spec["key"], spec["counter"], spec["pause"]
    try:
        for _ in range(spec["warm_cycles"]):  # connect, load scripts; private keys
            handle = lib.acquire(spec["warm_key"])
            r.set(spec["warm_counter"], int(r.get(spec["warm_counter"]) or 0) + 1)
            lib.release(handle)
        start, stop = _barrier()
        time.sleep(max(0.0, start - time.time()))
        now = time.time
        cpu0 = time.process_time()
        records: list[tuple[float, float, float, float]] = []
        while True:
            ask = now()
            if ask >= stop:
                break
            handle = lib.acquire(key)
            acquired = now()
            value = r.get(counter)  # the non-atomic critical section: GET, then SET
            r.set(counter, int(value or 0) + 1)
            released = now()
            lib.release(handle)
            records.append((ask, acquired, released, now()))
            time.sleep(pause)
        cpu = time.process_time() - cpu0
    finally:
        lib.close()
        r.close()
    return {"records": {"0": records}, "errors": dict(lib.errors), "extra": lib.extra, "cpu_s": cpu}


async def child_async(spec: dict[str, Any]) -> dict[str, Any]:
    lib = ASYNC_LIBS[spec["impl"]](spec["url"])
    r = make_async_redis(spec["url"])
    key, counter, pause = spec["key"], spec["counter"], spec["pause"]
    records: dict[str, list[tuple[float, float, float, float]]] = {}
    try:
        for _ in range(spec["warm_cycles"]):
            handle = await lib.acquire(spec["warm_key"])
            await r.set(spec["warm_counter"], int(await r.get(spec["warm_counter"]) or 0) + 1)
            await lib.release(handle)
        loop = asyncio.get_running_loop()
        start, stop = await loop.run_in_executor(None, _barrier)
        await asyncio.sleep(max(0.0, start - time.time()))
        now = time.time

        async def worker(mine: list[tuple[float, float, float, float]]) -> None:
            while True:
                ask = now()
                if ask >= stop:
                    return
                handle = await lib.acquire(key)
                acquired = now()
                value = await r.get(counter)
                await r.set(counter, int(value or 0) + 1)
                released = now()
                await lib.release(handle)
                mine.append((ask, acquired, released, now()))
                await asyncio.sleep(pause)

        for task_no in range(spec["tasks"]):
            records[str(task_no)] = []
        cpu0 = time.process_time()
        await asyncio.gather(*(worker(records[str(t)]) for t in range(spec["tasks"])))
        cpu = time.process_time() - cpu0
    finally:
        await lib.close()
        await r.aclose()
    return {"records": records, "errors": dict(lib.errors), "extra": lib.extra, "cpu_s": cpu}


def child_main(spec: dict[str, Any]) -> int:
    try:
        if spec["impl"] in SYNC_LIBS:
            result = child_sync(spec)
        else:
            result = asyncio.run(child_async(spec))
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(spec["out"]).write_text(json.dumps(result), encoding="utf-8")
    return 0 if "error" not in result else 1


# -- section 2: the parent -------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    k = (n - 1) * q
    f = math.floor(k)
    c = min(f + 1, n - 1)
    return sorted_values[f] + (sorted_values[c] - sorted_values[f]) * (k - f)


# The fixed quantiles a contention row's waiter latency CDF is sampled at (bench/make_page.py
# plots them): every 2 %, then the tail that p99 alone hides.
CDF_QUANTILES = (*(i / 50 for i in range(50)), 0.99, 0.995, 0.999, 1.0)


def cdf(sorted_values: Sequence[float]) -> list[float]:
    """The values at CDF_QUANTILES (empty when there is no value)."""
    return [percentile(sorted_values, q) for q in CDF_QUANTILES] if sorted_values else []


def jain(counts: Sequence[float]) -> float:
    """Jain's fairness index: 1.0 when every process got the same share, 1/n when one got all."""
    total = sum(counts)
    squares = sum(c * c for c in counts)
    return total * total / (len(counts) * squares) if squares else float("nan")


def analyse(
    per_proc: list[dict[str, list[list[float]]]], start: float, settle: float, stop: float, counter: int
) -> dict[str, Any]:
    """Turn the workers' records into the table's figures; check exclusion and the counter."""
    sections = []  # (acquired, released, ask, freed, proc, worker)
    for proc, workers in enumerate(per_proc):
        for worker, records in workers.items():
            for ask, acquired, released, freed in records:
                sections.append((acquired, released, ask, freed, proc, f"{proc}.{worker}"))
    sections.sort()
    window0 = start + settle
    window = stop - window0
    in_window = [s for s in sections if window0 <= s[0] < stop]
    handoffs = []
    same_worker = 0
    overlaps = 0
    for prev, cur in itertools.pairwise(sections):
        if cur[0] < prev[1]:
            overlaps += 1  # two holders at once: mutual exclusion broken
        if not window0 <= cur[0] < stop:
            continue
        if cur[5] == prev[5]:
            same_worker += 1
        else:
            handoffs.append((cur[0] - prev[1]) * 1e3)
    handoffs.sort()
    # Waits of every request made in the window, also those granted after it closed, so a
    # waiter starved until the end is not left out. A request is a WAITER when another
    # worker held the lock while it waited: the hold just before its own (holds are
    # disjoint, sorted by acquisition) belongs to another worker and ended after it asked.
    # The others found the lock free: a holder re-acquiring after its pause, mostly.
    waits: list[float] = []
    waiter_waits: list[float] = []
    for k, cur in enumerate(sections):
        if not window0 <= cur[2] < stop:
            continue
        wait = (cur[0] - cur[2]) * 1e3
        waits.append(wait)
        prev = sections[k - 1] if k else None
        if prev is not None and prev[5] != cur[5] and prev[1] > cur[2]:
            waiter_waits.append(wait)
    waits.sort()
    waiter_waits.sort()
    per_process = [sum(1 for s in in_window if s[4] == proc) for proc in range(len(per_proc))]
    release_ms = sorted((s[3] - s[1]) * 1e3 for s in in_window)
    hold_ms = sorted((s[1] - s[0]) * 1e3 for s in in_window)
    return {
        "sections_total": len(sections),
        "counter": counter,
        "counter_ok": counter == len(sections),
        "overlaps": overlaps,
        "window_s": window,
        "sections_in_window": len(in_window),
        "sections_per_s": len(in_window) / window if window > 0 else float("nan"),
        "handoffs": len(handoffs),
        "handoff_p50_ms": percentile(handoffs, 0.5),
        "handoff_p99_ms": percentile(handoffs, 0.99),
        "handoff_mean_ms": sum(handoffs) / len(handoffs) if handoffs else float("nan"),
        "same_worker_again": same_worker,
        "same_worker_again_share": same_worker / len(in_window) if in_window else float("nan"),
        "requests": len(waits),
        "waiters": len(waiter_waits),
        "waiter_share": len(waiter_waits) / len(waits) if waits else float("nan"),
        "waiter_p50_ms": percentile(waiter_waits, 0.5),
        "waiter_p99_ms": percentile(waiter_waits, 0.99),
        "waiter_max_ms": waiter_waits[-1] if waiter_waits else float("nan"),
        "waiter_cdf_ms": cdf(waiter_waits),
        "all_cdf_ms": cdf(waits),
        "all_p50_ms": percentile(waits, 0.5),
        "all_p99_ms": percentile(waits, 0.99),
        "all_max_ms": waits[-1] if waits else float("nan"),
        "release_call_p50_ms": percentile(release_ms, 0.5),
        "hold_p50_ms": percentile(hold_ms, 0.5),
        "per_process": per_process,
        "jain": jain(per_process),
    }


def server_counters(r: Any) -> dict[str, float]:
    """The server's CPU seconds and command counts so far (read around a contention run)."""
    counters: dict[str, float] = {"_cpu": _util.server_cpu(r) or float("nan")}
    try:
        counters["_total"] = float(r.info("stats")["total_commands_processed"])
        for name, stats in r.info("commandstats").items():
            counters[name.removeprefix("cmdstat_")] = float(stats["calls"])
    except Exception:
        pass
    return counters


def server_costs(before: dict[str, float], after: dict[str, float], sections: int) -> dict[str, Any]:
    """What the server did per critical section over a whole run (warm-up and tail included):
    commands processed (also those run inside scripts) and its CPU time, plus the commands
    that dominate. Our own INFO calls are left out."""
    if not sections:
        return {}
    calls = {
        name: (after[name] - before.get(name, 0.0)) / sections
        for name in after
        if not name.startswith("_") and name != "info" and after[name] > before.get(name, 0.0)
    }
    top = dict(sorted(calls.items(), key=lambda kv: -kv[1])[:5])
    info_calls = after.get("info", 0.0) - before.get("info", 0.0)
    return {
        "server_cmds_per_section": (after.get("_total", 0.0) - before.get("_total", 0.0) - info_calls) / sections,
        "server_cpu_us_per_section": (after["_cpu"] - before["_cpu"]) / sections * 1e6,
        "server_calls_per_section": {name: round(value, 3) for name, value in top.items()},
    }


def run_contention(name: str, procs: int, url: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One (library, P) configuration: P fresh worker processes, a start barrier, a fixed
    run time, then the analysis."""
    scratch = Path(tempfile.mkdtemp(prefix="lockaspect-bench-"))
    key = f"bench-contention:{tag}:lock"
    counter = f"bench-contention:{tag}:counter"
    r = make_redis(url)
    r.delete(counter)
    tasks = args.tasks if name == "la-async-tasks" else 1
    children: list[subprocess.Popen[str]] = []
    result: dict[str, Any] = {"library": name, "procs": procs, "tasks_per_proc": tasks}
    try:
        for i in range(procs):
            spec = {
                "impl": name,
                "url": url,
                "key": key,
                "counter": counter,
                "warm_key": f"bench-contention:{tag}:warm:{i}",
                "warm_counter": f"bench-contention:{tag}:warm-counter:{i}",
                "warm_cycles": args.warm_cycles,
                "pause": PAUSE,
                "tasks": tasks,
                "out": str(scratch / f"{i}.json"),
            }
            stderr = (scratch / f"{i}.err").open("w", encoding="utf-8")
            children.append(
                subprocess.Popen(
                    [sys.executable, str(HERE), "--child", json.dumps(spec)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
            )
            stderr.close()
        # The start barrier: every worker has connected and warmed up.
        deadline = time.monotonic() + 120
        for child in children:
            assert child.stdout is not None
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([child.stdout], [], [], max(0.0, remaining))
            line = child.stdout.readline() if ready else ""
            if line.strip() != "READY":
                raise BenchError(f"a worker did not get ready (exit code {child.poll()})")
        server0 = server_counters(r)
        start = time.time() + 0.2
        stop = start + args.settle + args.duration
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"{start!r} {stop!r}\n")
            child.stdin.flush()
        for child in children:
            try:
                child.wait(timeout=max(1.0, stop - time.time()) + 60)
            except subprocess.TimeoutExpired as exc:
                raise BenchError("a worker did not finish within 60 s of the stop time") from exc
        per_proc = []
        errors: Counter[str] = Counter()
        extras = []
        client_cpu = 0.0
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
            errors.update(data["errors"])
            extras.append(data["extra"])
        noise = [
            line
            for i in range(procs)
            for line in (scratch / f"{i}.err").read_text(encoding="utf-8").strip().splitlines()
            if line
        ]
        server1 = server_counters(r)
        value = r.get(counter)
        result.update(analyse(per_proc, start, args.settle, stop, int(value or 0)))
        result.update(server_costs(server0, server1, result["sections_total"]))
        if result["sections_total"]:
            result["client_cpu_us_per_section"] = client_cpu / result["sections_total"] * 1e6
        result["errors"] = dict(errors)
        if noise:
            result["stderr"] = noise[:10]
        lost = [e["stats"] for e in extras if "stats" in e]
        if lost:
            result["lockaspect_stats"] = {k: sum(s[k] for s in lost) for k in ("acquired", "released", "lost", "held")}
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()  # only our own workers, by their Popen handle
                child.wait()
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        try:
            r.delete(key, counter, *(f"bench-contention:{tag}:warm-counter:{i}" for i in range(procs)))
        finally:
            r.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def contention_available(name: str) -> str | None:
    """Why a library cannot run here, or ``None``."""
    try:
        if name == "aioredlock":
            import_aioredlock()
        elif name == "prl":
            import redis_lock  # noqa: F401
        elif name == "pottery":
            import pottery  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


CONTENTION_HEADERS = [
    "library",
    "P",
    "sections/s",
    "handoff p50 ms",
    "handoff p99 ms",
    "waiter p50 ms",
    "waiter p99 ms",
    "waiter max ms",
    "waiters",
    "all p99 ms",
    "Jain",
    "same again",
    "counter",
    "notes",
]


def contention_row(name: str, res: dict[str, Any], args: argparse.Namespace) -> list[Any]:
    label = lib_label(name, args)
    if "error" in res:
        return [label, res["procs"], "ERROR", *([None] * 10), res["error"][:60]]
    if "unavailable" in res:
        return [label, res["procs"], "unavailable", *([None] * 10), res["unavailable"][:60]]
    counter = "exact" if res["counter_ok"] and not res["overlaps"] else "FAIL"
    notes = "; ".join(f"{k} x{v}" for k, v in res["errors"].items())
    return [
        label,
        res["procs"],
        res["sections_per_s"],
        res["handoff_p50_ms"],
        res["handoff_p99_ms"],
        res["waiter_p50_ms"],
        res["waiter_p99_ms"],
        res["waiter_max_ms"],
        f"{res['waiter_share'] * 100:.0f}%",
        res["all_p99_ms"],
        f"{res['jain']:.3f}",
        f"{res['same_worker_again_share'] * 100:.0f}%",
        counter,
        notes,
    ]


MEDIAN_KEYS = (
    "sections_per_s",
    "handoff_p50_ms",
    "handoff_p99_ms",
    "waiter_p50_ms",
    "waiter_p99_ms",
    "waiter_max_ms",
    "waiter_share",
    "all_p50_ms",
    "all_p99_ms",
    "all_max_ms",
    "jain",
    "same_worker_again_share",
    "release_call_p50_ms",
    "hold_p50_ms",
    "handoff_mean_ms",
    "client_cpu_us_per_section",
    "server_cmds_per_section",
    "server_cpu_us_per_section",
)


COST_HEADERS = [
    "library",
    "P",
    "hold p50 ms",
    "handoff mean ms",
    "release call p50 ms",
    "client CPU us/section",
    "server cmds/section",
    "server CPU us/section",
    "server calls per section (top)",
]


def cost_row(name: str, res: dict[str, Any], args: argparse.Namespace) -> list[Any] | None:
    if "sections_per_s" not in res:
        return None
    top = ", ".join(f"{k} {v:.2f}" for k, v in res.get("server_calls_per_section", {}).items())
    return [
        lib_label(name, args),
        res["procs"],
        res["hold_p50_ms"],
        res["handoff_mean_ms"],
        res["release_call_p50_ms"],
        res.get("client_cpu_us_per_section"),
        res.get("server_cmds_per_section"),
        res.get("server_cpu_us_per_section"),
        top,
    ]


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of a configuration: medians of the figures; the counter and
    exclusion checks must hold in every round; errors add up."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {**failed[0], "rounds": runs}
    combined = dict(runs[-1])
    for key in MEDIAN_KEYS:
        values = [r[key] for r in runs if key in r]
        if values:
            combined[key] = median(values)
    for key in ("waiter_cdf_ms", "all_cdf_ms"):  # pointwise: the median round at each quantile
        curves = [r[key] for r in runs if r.get(key)]
        combined[key] = [median(column) for column in zip(*curves, strict=True)] if curves else []
    combined["counter_ok"] = all(r["counter_ok"] for r in runs)
    combined["overlaps"] = sum(r["overlaps"] for r in runs)
    errors: Counter[str] = Counter()
    for r in runs:
        errors.update(r["errors"])
    combined["errors"] = dict(errors)
    combined["rounds"] = runs
    return combined


def bench_contention(url: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading(f"2. Contention: P worker processes on ONE key ({', '.join(map(str, args.procs))})"))
    out(
        f"each worker: acquire (blocking, the library's default wait) -> GET counter, SET counter+1 -> "
        f"release -> sleep {PAUSE * 1e3:g} ms; lease {LEASE}s (lockaspect: watchdog mode, "
        f"client.lock(key, wait=None)); {args.settle:g}s warm-up + {args.duration:g}s measured after a start "
        f"barrier; each configuration in fresh processes; {args.rounds} round(s), order rotated"
    )
    out(f"machine: {os.cpu_count()} logical CPUs shared by the workers and the server")
    libs = [name for name in CONTENTION_LIBS if name in args.libraries]
    unavailable = {name: why for name in libs if (why := contention_available(name)) is not None}
    runnable = [name for name in libs if name not in unavailable]
    raw: dict[str, dict[int, list[dict[str, Any]]]] = {name: {p: [] for p in args.procs} for name in libs}
    configs = [(name, p) for p in args.procs for name in runnable]
    tag0 = f"{os.getpid()}-{int(time.time())}"
    for round_no in range(args.rounds):
        shift = round_no % max(1, len(runnable))
        for p_index, procs in enumerate(args.procs):
            order = [n for n, p in configs if p == procs]
            turn = (shift + p_index) % max(1, len(order))
            for name in order[turn:] + order[:turn]:
                res = run_contention(name, procs, url, args, f"{tag0}-{round_no}-{name}-{procs}")
                raw[name][procs].append(res)
                if "error" in res:
                    summary = f"ERROR {res['error'].splitlines()[0]}"
                else:
                    summary = (
                        f"{res['sections_per_s']:,.0f} sections/s, waiter p99 {res['waiter_p99_ms']:.1f} ms, "
                        f"counter {'exact' if res['counter_ok'] and not res['overlaps'] else 'FAIL'}"
                    )
                out(
                    f"  round {round_no + 1}/{args.rounds} {lib_label(name, args)} P={procs}: {summary} "
                    f"(load {_util.loadavg()})"
                )
    combined: dict[str, dict[str, Any]] = {}
    rows = []
    for procs in args.procs:
        for name in libs:
            if name in unavailable:
                res = {"library": name, "procs": procs, "unavailable": unavailable[name]}
            else:
                res = combine_rounds(raw[name][procs])
            combined.setdefault(name, {})[str(procs)] = res
            rows.append(contention_row(name, res, args))
    out()
    out(table(CONTENTION_HEADERS, rows))
    out("  sections/s: critical sections entered in the measured window / its length. handoff: from a")
    out("  holder calling release to the next holder (another worker) holding it. waiter: a request made")
    out("  while another worker held the lock, from asking to holding (requests made in the window, also")
    out("  those granted after it closed); waiters: their share of the requests; all p99: over every")
    out("  request, also those that found the lock free. Jain: fairness of per-process section counts")
    out("  (1.0 = equal). same again: sections whose previous holder was the same worker. counter: the")
    out("  non-atomic counter equals the sections recorded and no two holds overlapped, else FAIL.")
    cost_rows = [row for p in args.procs for name in libs if (row := cost_row(name, combined[name][str(p)], args))]
    if cost_rows:
        out()
        out("Where the time goes, per critical section:")
        out(table(COST_HEADERS, cost_rows))
        out("  hold: acquired -> release called (the GET + SET); handoff mean: the mean of the handoff column")
        out("  (throughput follows hold + handoff); release call: how long release() took; client CPU: all")
        out("  workers' process CPU (all threads) while looping; server: commands processed (also inside")
        out("  scripts) and server CPU over the whole run. All per critical section. With the workers and")
        out("  the server on the same cores, client + server CPU per section bounds the throughput.")
    if args.rounds > 1:
        out("  Several rounds: medians over the rounds; the counter must be exact in every round.")
    failures = [
        (name, p, res)
        for name, by_p in combined.items()
        for p, res in by_p.items()
        if "counter_ok" in res and (not res["counter_ok"] or res["overlaps"])
    ]
    for name, p, res in failures:
        out(
            f"  !!! FAIL {lib_label(name, args)} P={p}: counter {res['counter']} vs {res['sections_total']} "
            f"sections recorded, {res['overlaps']} overlapping holds: MUTUAL EXCLUSION BROKEN"
        )
    for name, by_p in combined.items():
        for p, res in by_p.items():
            stats = res.get("lockaspect_stats")
            if stats and (stats["lost"] or stats["held"] or stats["acquired"] != stats["released"]):
                out(f"  check {lib_label(name, args)} P={p}: lockaspect stats {stats}")
            if res.get("stderr"):
                out(f"  stderr {lib_label(name, args)} P={p}: {res['stderr'][0]}")
    for name, why in unavailable.items():
        out(f"  UNAVAILABLE {lib_label(name, args)}: {why}")
    results["contention"] = {
        "params": {
            "procs": args.procs,
            "duration_s": args.duration,
            "settle_s": args.settle,
            "rounds": args.rounds,
            "tasks": args.tasks,
            "pause_s": PAUSE,
            "lease_s": LEASE,
            "warm_cycles": args.warm_cycles,
        },
        "labels": {name: lib_label(name, args) for name in libs},
        "libraries": combined,
        "unavailable": unavailable,
    }


# -- targets ---------------------------------------------------------------------------------


def targets(results: dict[str, Any], args: argparse.Namespace) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(target: str, measured: str, met: bool | None, note: str = "", missed: str = "MISSED") -> None:
        status = "not run" if met is None else ("MET" if met else missed)
        rows.append([target, measured, status, note])

    cycles = results.get("cycles", {}).get("libraries", {})
    for name, label in LOCKASPECT_LABELS.items():
        entry = cycles.get(name)
        if entry is None or "x_raw" not in entry:
            add(f"{label}: >= {TARGET_ASYNC_RAW_RATIO}x raw async floor", "-", None)
            continue
        x_raw = entry["x_raw"]
        add(f"{label}: >= {TARGET_ASYNC_RAW_RATIO}x raw async floor", f"{x_raw:.3f}x", x_raw >= TARGET_ASYNC_RAW_RATIO)

    contention = results.get("contention", {}).get("libraries", {})
    if not contention:
        add("contention targets", "-", None)
        return rows
    labels = results["contention"]["labels"]
    peers = [name for name in contention if CONTENTION_LIBS[name][1]]

    def ok(res: dict[str, Any]) -> bool:
        return "sections_per_s" in res and res["counter_ok"] and not res["overlaps"]

    for procs in args.procs:
        p = str(procs)
        peer_rows = {name: contention[name][p] for name in peers if ok(contention[name].get(p, {}))}
        best_rate = max(peer_rows.items(), key=lambda kv: kv[1]["sections_per_s"], default=None)
        # A peer with no waiters (it never had to wait) has no waiter p99: it cannot be the best.
        peer_rows = {k: v for k, v in peer_rows.items() if not math.isnan(v["waiter_p99_ms"])}
        best_p99 = min(peer_rows.items(), key=lambda kv: kv[1]["waiter_p99_ms"], default=None)
        for name in TARGET_ROWS:
            res = contention.get(name, {}).get(p)
            if res is None or not ok(res) or best_rate is None or best_p99 is None:
                add(f"P={procs} {labels.get(name, name)}: sections/s >= best peer", "-", None)
                add(f"P={procs} {labels.get(name, name)}: waiter p99 <= best peer", "-", None)
                continue
            rate, peer_rate = res["sections_per_s"], best_rate[1]["sections_per_s"]
            add(
                f"P={procs} {labels[name]}: sections/s >= best peer",
                f"{rate:,.0f} vs {peer_rate:,.0f}",
                rate >= peer_rate,
                f"best peer: {labels[best_rate[0]]} ({rate / peer_rate:.2f}x)",
            )
            p99, peer_p99 = res["waiter_p99_ms"], best_p99[1]["waiter_p99_ms"]
            add(
                f"P={procs} {labels[name]}: waiter p99 <= best peer",
                f"{p99:.1f} ms vs {peer_p99:.1f} ms",
                p99 <= peer_p99,
                f"best peer: {labels[best_p99[0]]}",
            )
        # issue 15, target 4: the fair lock keeps up with the mutex, in strict order
        fair, mutex = contention.get("la-fair", {}).get(p), contention.get("la-sync", {}).get(p)
        if fair is None or mutex is None or not ok(fair) or not ok(mutex):
            add(f"P={procs} fair lock: sections/s >= {TARGET_FAIR_RATIO}x the mutex, Jain >= 0.99", "-", None)
        else:
            ratio = fair["sections_per_s"] / mutex["sections_per_s"]
            add(
                f"P={procs} fair lock: sections/s >= {TARGET_FAIR_RATIO}x the mutex, Jain >= 0.99",
                f"{ratio:.2f}x, Jain {fair['jain']:.3f}",
                ratio >= TARGET_FAIR_RATIO and fair["jain"] >= 0.99,
                f"{fair['sections_per_s']:,.0f} vs {mutex['sections_per_s']:,.0f} sections/s",
            )
    checked = [res for by_p in contention.values() for res in by_p.values() if "sections_per_s" in res]
    broken = [res for res in checked if not (res["counter_ok"] and not res["overlaps"])]
    add(
        "mutual exclusion: counter exact, no overlapping holds, every run",
        f"{len(checked) - len(broken)}/{len(checked)} runs exact",
        not broken if checked else None,
        "broken in: " + ", ".join(f"{labels[r['library']]} P={r['procs']}" for r in broken) if broken else "",
        missed="FAIL",
    )
    return rows


# -- plot and markdown -----------------------------------------------------------------------------


def write_plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contention = results["contention"]["libraries"]
    labels = results["contention"]["labels"]
    fig, (ax_rate, ax_p99) = plt.subplots(1, 2, figsize=(12, 5.4))
    styles = {
        "la-sync": ("tab:blue", "o", "-"),
        "la-async": ("tab:orange", "s", "-"),
        "la-async-tasks": ("tab:brown", "D", "--"),
        "la-fair": ("tab:cyan", "h", "--"),
        "redis-py": ("tab:gray", "v", ":"),
        "prl": ("tab:green", "^", ":"),
        "pottery": ("tab:purple", "P", ":"),
        "aioredlock": ("tab:red", "X", ":"),
    }
    for name, by_p in contention.items():
        xs, rates, p99s = [], [], []
        for procs in args.procs:
            res = by_p.get(str(procs), {})
            if "sections_per_s" in res:
                xs.append(procs)
                rates.append(res["sections_per_s"])
                p99s.append(res["waiter_p99_ms"])
        if not xs:
            continue
        color, marker, line = styles.get(name, ("black", "o", "-"))
        width = 2.2 if name.startswith("la-") else 1.4
        kwargs = {"color": color, "marker": marker, "linestyle": line, "linewidth": width, "label": labels[name]}
        ax_rate.plot(xs, rates, **kwargs)
        ax_p99.plot(xs, p99s, **kwargs)
    machine = results["machine"]
    for ax in (ax_rate, ax_p99):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(args.procs), [str(p) for p in args.procs])
        ax.set_xlabel("worker processes P on one key")
        ax.grid(True, which="both", alpha=0.3)
    ax_rate.set_ylabel("critical sections per second (higher is better)")
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_title("Throughput")
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("waiter wait p99, ms (log; lower is better)")
    ax_p99.set_title("Waiter wait p99")
    handles, names = ax_rate.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    quick = ", QUICK RUN" if args.quick else ""
    fig.suptitle(
        f"One key, 1 ms pause after release; {machine['cpu_logical']} CPUs shared with the server "
        f"(P=8 oversubscribes); {args.duration:g}s per point{quick}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_util._cell(v).replace("|", "\\|") for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def write_markdown(
    results: dict[str, Any], args: argparse.Namespace, path: Path, plot: Path | None, argv: list[str]
) -> None:
    m = results["machine"]
    srv = m["server"]
    command = "python bench/bench_async.py " + " ".join(argv)
    lines = [
        "# Benchmarks: asyncio and contention",
        "",
        "<!-- Written by bench/bench_async.py --markdown; rerun it to refresh the figures. -->",
        "",
        "`bench/bench_async.py` compares lockaspect with the raw minimum and with its Python peers in",
        "one run, side by side, on one machine and one server: (1) uncontended async lock/unlock cycles",
        "on one event loop, and (2) several processes contending for ONE key. The core (sync)",
        "benchmark is `bench/bench_core.py`; both are described in [bench/README.md](https://github.com/lockaspect/lockaspect/blob/main/bench/README.md).",
        "",
        "## How to run",
        "",
        "```sh",
        "make bench-async                                # .venv with the bench extra, then the full run",
        ".venv/bin/python bench/bench_async.py           # full run: about 7 minutes on 2 cores",
        ".venv/bin/python bench/bench_async.py --quick   # short runs, to check the script (about 2 minutes)",
        ".venv/bin/python bench/bench_async.py --json out.json --plot docs/img/contention.png "
        "--markdown docs/benchmarks.md",
        "```",
        "",
        "Run it on a quiet machine: the server and every worker share the same cores, so other work",
        "moves the numbers. The load average is printed at the start and the end.",
        "",
        "## The run below",
        "",
        f"* command: `{command}`",
        f"* CPU: {m['cpu_model']}, {m['cpu_logical']} logical / {m['cpu_physical']} physical; "
        f"load average {m['loadavg_start']} at the start, {m.get('loadavg_end', '?')} at the end",
        f"* {m['python']} on {m['platform']}; event loop "
        f"{results.get('cycles', {}).get('event_loop', 'asyncio default')}",
        f"* redis-py {m['redis_py']} (parser: {m['redis_parser']}), lockaspect {m['lockaspect']}, "
        f"python-redis-lock {m['python_redis_lock']}, pottery {m['pottery']}, aioredlock {m['aioredlock']} "
        f"(aioredis {m['aioredis']})",
        f"* server: {srv['kind']} {srv['version']}, {m['transport']}, on the same machine",
    ]
    if args.quick:
        lines += [
            "",
            "> **Quick run**: short runs on a machine with other work running. These numbers check",
            "> the script; they are not the record. Rerun without `--quick` on a quiet machine.",
        ]
    cycles = results.get("cycles")
    if cycles:
        rows = [cycle_row(e) for e in cycles["libraries"].values() if "ops_per_s" in e]
        rows += [
            [e["label"], f"unavailable: {e['unavailable']}"] + [""] * 7
            for e in cycles["libraries"].values()
            if "unavailable" in e
        ]
        params = cycles["params"]
        lines += [
            "",
            "## 1. Async lock/unlock cycles (uncontended, one task, one event loop)",
            "",
            f"{params['cycles']:,} cycles per timed run, {params['repeats']} interleaved runs per library, "
            f"{params['warmup']:,} warm-up cycles each, lease {LEASE} s for all. Each library locks its own key.",
            "",
            md_table(CYCLE_HEADERS, rows),
        ]
        engine = cycles.get("engine_cpu_us_per_cycle")
        if engine:
            lines += [
                "",
                "lockaspect's own CPU per async cycle on an in-memory backend (no I/O), with two asyncio",
                "primitives for scale:",
                "",
                md_table(
                    ["case", "CPU us/cycle"],
                    [[LOCKASPECT_LABELS.get(k, k), v] for k, v in engine.items()],
                ),
            ]
    contention = results.get("contention")
    if contention:
        params = contention["params"]
        rows = [
            contention_row(name, by_p[str(p)], args)
            for p in params["procs"]
            for name, by_p in contention["libraries"].items()
        ]
        lines += [
            "",
            "## 2. Contention: P processes on one key",
            "",
            "Each worker process loops: acquire (blocking, the library's default way of waiting), a non-atomic",
            f"increment of a counter in the server (GET, then SET), release, then a {PAUSE * 1e3:g} ms pause.",
            f"After a start barrier: {params['settle_s']:g} s of warm-up, then {params['duration_s']:g} s measured;",
            f"{params['rounds']} round(s); every configuration in fresh processes; lease {LEASE} s (lockaspect:",
            "watchdog mode).",
            "",
            md_table(CONTENTION_HEADERS, rows),
        ]
        cost_rows = [
            row
            for p in params["procs"]
            for name, by_p in contention["libraries"].items()
            if (row := cost_row(name, by_p[str(p)], args))
        ]
        if cost_rows:
            lines += ["", "Where the time goes, per critical section:", "", md_table(COST_HEADERS, cost_rows)]
        if plot is not None:
            rel = os.path.relpath(plot.resolve(), path.resolve().parent)
            lines += ["", f"![sections per second and waiter wait p99 against P]({rel})"]
        for name, why in contention["unavailable"].items():
            lines += ["", f"{contention['labels'][name]}: unavailable: {why}"]
    rows = results.get("targets_rows", [])
    if rows:
        lines += ["", "## Targets (issue 3, item 8)", "", md_table(["target", "measured", "status", "note"], rows)]
    lines += ["", HOW_TO_READ.strip(), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


HOW_TO_READ = """
## How to read the figures

**Section 1.** `ops/s` is the median of the interleaved runs; `x raw floor` is the median of the
per-round ratios to the raw async floor (`redis.asyncio` `SET key token NX PX` then `EVALSHA` of a
compare-and-delete, through `execute_command`, with the same client options as lockaspect's async
client: 2 s socket and connect timeouts, no redis-py retries). Above 1.0 is faster; the target is
0.9. The `(info) pre-packed` row sends the same two commands pre-packed, as lockaspect's async
backend sends its scripts, so it shows how much of a lead comes from the cheaper client path.
lockaspect does more per cycle than the floor: a fencing token (an `INCR` inside the acquire
script), a hash with a hold count (re-entrancy), a release message for waiters (`PUBLISH`), the
watchdog or deadline entry on the timer wheel, the per-task context stack, and the release in a
shielded task of its own (so that a cancelled caller still releases); the decorator also runs
the body as a task (so that a lost lease can cancel it). The in-memory table prices that work
without I/O, next to the price of one shielded task and of one trip through the event loop.
aioredlock runs on aioredis 1.x (its own pool; no command timeout).

**Section 2.** All workers and the server share the machine's cores: with 2 cores, P=8 (eight
worker processes plus the server) oversubscribes the CPU, and a woken waiter may wait for a core
before it can ask. Then every microsecond of CPU a library spends per handoff shows up in the
throughput, and the second table (client and server CPU per section) says where it went.

* `sections/s`: critical sections entered per second over the measured window. With a 1 ms
  pause after each release, a handoff gap of a few hundred microseconds is a large share of
  each cycle, so throughput follows hold time + handoff latency.
* `handoff`: time from a holder calling release to the next holder (a different worker) holding
  the lock, both stamped with `time.time()` on the same host. It prices the release round trip
  plus the waking: a release message (lockaspect), a `BLPOP` wake-up (python-redis-lock), or the
  next poll (redis-py: 0.1 s sleep; pottery: random 0-0.2 s; aioredlock: random 0.1-0.3 s).
* `waiter`: a request made while another worker held the lock, from asking to holding. Requests
  made in the window count, also those granted after it closed, so a waiter starved until the
  end is not left out. `waiters` is their share of all requests, and `all p99` the p99 over
  every request. The two differ for libraries whose holder re-acquires during the 1 ms pause
  while the others sleep out a poll interval: nearly all requests then find the lock free, so
  the p99 over all requests looks small while the few real waiters wait hundreds of
  milliseconds. The targets use the waiter p99.
* `Jain`: Jain's fairness index over the per-process section counts, (sum x)^2 / (P * sum x^2):
  1.0 when every process got the same share, 1/P when one process got everything. A high Jain
  with a high `same again` means turns of long streaks, not fair hand-over.
* `same again`: share of sections whose previous holder was the same worker.
* `counter`: every worker increments a counter with GET then SET inside the lock. `exact` means
  the final counter equals the number of sections recorded, and no two recorded holds overlapped
  in time; anything else is printed as FAIL: mutual exclusion was broken.
* `notes`: library errors the workers absorbed (python-redis-lock's `BLPOP` can outlive the
  2 s socket timeout all clients share; aioredlock gives up after 3 attempts and is asked again).
* The cost table: `hold` is the critical section (GET + SET); `client CPU us/section` adds up
  all workers' process CPU while they loop; `server cmds/section` counts every command the server
  ran (also those inside scripts), and the top commands show how each library waits: for
  lockaspect, the `EVALSHA` calls per section beyond the release are acquire attempts, so a value
  that grows with P means that each release sends every waiting process to the server, of which
  one wins.

The lockaspect rows use `client.lock(key, wait=None)` in watchdog mode: waiters subscribe to the
lock's release channel and retry when the holder's release script publishes; same-process waiters
(the `tasks/proc` row) coalesce, so one task per process talks to the server at a time. The async
rows run everything, the critical section's GET and SET included, on `redis.asyncio`, whose
client CPU per command is about twice that of sync redis-py here.
"""


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="use this running server (redis://, unix://) instead of starting one")
    p.add_argument("--server", choices=["valkey", "redis"], default="valkey", help="server to start (default valkey)")
    p.add_argument("--unix", action="store_true", help="talk to the started server over its unix socket")
    p.add_argument("--quick", action="store_true", help="short runs to check the script (noisy numbers)")
    p.add_argument("--cycles", type=int, help="timed async cycles per run and library (default 20000; quick 2000)")
    p.add_argument("--warmup", type=int, help="warm-up async cycles per library (default 2000; quick 200)")
    p.add_argument("--repeats", type=int, help="interleaved async runs per library (default 5; quick 3)")
    p.add_argument("--procs", default="2,4,8", help="worker process counts for contention (default 2,4,8)")
    p.add_argument("--duration", type=float, help="measured seconds per contention run (default 5; quick 1.5)")
    p.add_argument("--settle", type=float, help="contended warm-up seconds before measuring (default 0.5; quick 0.3)")
    p.add_argument("--rounds", type=int, default=1, help="contention rounds; medians over rounds (default 1)")
    p.add_argument("--tasks", type=int, default=4, help="tasks per process in the coalescing row (default 4)")
    p.add_argument("--warm-cycles", type=int, default=20, help="uncontended cycles per worker before the barrier")
    p.add_argument(
        "--libraries",
        default=",".join(CONTENTION_LIBS),
        help=f"contention rows to run (default all: {','.join(CONTENTION_LIBS)})",
    )
    p.add_argument("--sections", default="cycles,contention", help="subset of cycles,contention (default both)")
    p.add_argument("--json", metavar="PATH", help="also write every result to this JSON file")
    p.add_argument("--plot", metavar="PNG", help="write the contention plot (e.g. docs/img/contention.png)")
    p.add_argument("--markdown", metavar="MD", help="write an asyncio-only page (not docs/benchmarks.md)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.cycles = args.cycles or (2000 if quick else 20_000)
    args.warmup = args.warmup if args.warmup is not None else (200 if quick else 2000)
    args.repeats = args.repeats or (3 if quick else 5)
    args.duration = args.duration or (1.5 if quick else 5.0)
    args.settle = args.settle if args.settle is not None else (0.3 if quick else 0.5)
    try:
        args.procs = [int(x) for x in args.procs.split(",") if x.strip()]
    except ValueError:
        p.error("--procs takes comma-separated integers, e.g. 2,4,8")
    if not args.procs or min(args.procs) < 1:
        p.error("--procs needs positive process counts")
    args.libraries = [x.strip() for x in args.libraries.split(",") if x.strip()]
    unknown = set(args.libraries) - set(CONTENTION_LIBS)
    if unknown:
        p.error(f"unknown librar(y/ies): {', '.join(sorted(unknown))}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if args.sections - {"cycles", "contention"}:
        p.error(f"unknown section(s): {', '.join(sorted(args.sections - {'cycles', 'contention'}))}")
    if args.unix and args.url:
        p.error("--unix applies to the server the benchmark starts; with --url pass a unix:// URL")
    if args.plot and "contention" not in args.sections:
        p.error("--plot needs the contention section")
    return args


async def section_one(url: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    await bench_cycles_async(url, args, results)
    try:
        await bench_engine_async(args, results)
    except Exception as exc:  # it leans on the backend protocol, which may move
        out(f"  SKIPPED the in-memory engine measurement: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    server = None
    results: dict[str, Any] = {}
    try:
        if args.url:
            url = args.url
        else:
            from lockaspect.testing import LockServer, find_server_binary

            server = LockServer(find_server_binary(args.server)).start()
            url = server.unix_url if args.unix else server.url
        probe = make_redis(url)
        facts = _util.machine_facts()
        facts["aioredlock"] = _util.version_of("aioredlock")
        facts["aioredis"] = _util.version_of("aioredis")
        facts["matplotlib"] = _util.version_of("matplotlib")
        facts["redis_parser"] = redis_parser()
        facts["server"] = _util.server_facts(probe)
        facts["server_started_by_bench"] = server is not None
        facts["transport"] = "unix socket" if url.startswith("unix://") else "TCP"
        facts["url"] = url
        probe.close()
        results["machine"] = facts
        out(heading("lockaspect asyncio and contention benchmark"))
        out(
            f"CPU: {facts['cpu_model']}, {facts['cpu_logical']} logical / {facts['cpu_physical']} physical; "
            f"load average {facts['loadavg_start']}"
        )
        out(f"Python: {facts['python']} on {facts['platform']}")
        out(
            f"redis-py {facts['redis_py']} (parser: {facts['redis_parser']}), lockaspect {facts['lockaspect']}, "
            f"python-redis-lock {facts['python_redis_lock']}, pottery {facts['pottery']}, aioredlock "
            f"{facts['aioredlock']} (aioredis {facts['aioredis']}), matplotlib {facts['matplotlib']}"
        )
        srv = facts["server"]
        out(
            f"server: {srv['kind']} {srv['version']} ({'started by the benchmark' if server else 'given by --url'}), "
            f"{facts['transport']}, {url}"
        )
        if args.quick:
            out("QUICK RUN: short runs; numbers are for checking the script, not for the record")

        if "cycles" in args.sections:
            asyncio.run(section_one(url, args, results))
        if "contention" in args.sections:
            bench_contention(url, args, results)

        out(heading("TARGETS (issue 3, item 8)"))
        rows = targets(results, args)
        out(table(["target", "measured", "status", "note"], rows))
        results["targets_rows"] = rows
        results["targets"] = [dict(zip(["target", "measured", "status", "note"], row, strict=True)) for row in rows]
        results["machine"]["loadavg_end"] = _util.loadavg()
        out(f"\nload average at the end: {results['machine']['loadavg_end']}")
        plot = Path(args.plot) if args.plot else None
        if plot is not None:
            write_plot(results, args, plot)
            out(f"plot written to {plot}")
        if args.markdown:
            write_markdown(results, args, Path(args.markdown), plot, argv)
            out(f"figures page written to {args.markdown}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
            out(f"results written to {args.json}")
    finally:
        if server is not None:
            server.stop()
    broken = [t for t in results.get("targets", []) if t["target"].startswith("mutual exclusion")]
    return 1 if broken and broken[0]["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
