"""lockaspect SQL stores benchmark: each store against its own raw floor, in one run (issue 10, part 4).

Sections:

1. Lock/unlock cycles per second, uncontended, one thread, one key per row, empty body, for
   every SQL store: the raw floor of that store (SQLite: stdlib ``sqlite3`` upsert + delete on
   a WAL file; PostgreSQL lease table: the same upsert + delete on one psycopg connection;
   PostgreSQL session mode: ``pg_try_advisory_lock`` + ``pg_advisory_unlock``), and
   lockaspect's ``client.lock`` (fixed lease and watchdog), ``@distributed_lock`` and
   ``async with client.lock``, runs interleaved, with the ratio to the floor of the same round.
2. Contention: P = 2, 4, 8 worker processes on ONE key, each looping
   ``with client.lock("hot", wait=None)`` around a non-atomic counter increment in a file with
   a 1 ms think inside the section: sections/s, handoff, waiter p50/p99, Jain's index over the
   workers' section counts, and an exact counter check.
3. TARGETS: >= 0.8x the raw floor uncontended per store; PostgreSQL session mode FIFO under
   contention (Jain >= 0.99) with waiter p99 <= 2x the handoff time. Printed MET / MISSED;
   the exit status is 0 whatever they say (this is a report).

The stores are the rows of ``STORES``: a store whose URL scheme is not registered in this
lockaspect (``lockaspect.backends.registered_schemes()``) is skipped with the reason. SQLite
runs on a file in a temporary directory; PostgreSQL on a throwaway server
(``lockaspect.testing.PostgresServer``) unless ``--pg-url`` is given.

Run ``python bench/bench_sql.py --help``; see bench/README.md for how to read it. Not a test:
pytest only collects ``tests/``.
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
import secrets
import select
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import _util
from _util import heading, median, out, spread, table
from bench_async import _barrier, analyse
from bench_core import BenchError, Variant

# -- what the issue asks for (issue 10, part 4) ----------------------------------------------

TARGET_FLOOR_RATIO = 0.8  # every lockaspect cycle row >= 0.8x the raw floor of its store
TARGET_JAIN = 0.99  # PostgreSQL session mode under contention: FIFO
TARGET_P99_OVER_HANDOFF = 2.0  # ... and waiter p99 <= 2x the handoff time (median)

#: Fixed lease (seconds) of the raw floors and of the lockaspect rows with a lease.
LEASE = 10
#: The think time inside each contended critical section (the issue's 1 ms).
THINK = 0.001

HERE = Path(__file__).resolve()

#: The database's clock, seconds since the epoch, as lockaspect's lease table reads it.
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
PG_NOW = "extract(epoch FROM clock_timestamp())::float8"


@dataclasses.dataclass
class Env:
    """Where the stores live in this run."""

    sqlite_path: str
    pg_url: str | None  # plain postgresql://user@host:port/db, or None without PostgreSQL
    pg_missing: str = ""  # why there is no PostgreSQL
    pg_server: Any = None  # the PostgresServer we started (for its CPU time), or None


def _with_scheme(url: str, scheme: str) -> str:
    return scheme + url[url.index("://") :]


# -- raw floors --------------------------------------------------------------------------------


def _floor_table_sql(real: str) -> str:
    return (
        "CREATE TABLE IF NOT EXISTS bench_floor "
        f"(name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at {real} NOT NULL)"
    )


def _upsert_sql(now: str, param: str) -> str:
    """Take ``name`` for ``owner`` unless a live lease holds it; a row back means acquired."""
    return (
        f"INSERT INTO bench_floor (name, owner, expires_at) VALUES ({param}, {param}, {now} + {LEASE}) "
        "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at "
        f"WHERE bench_floor.expires_at <= {now} RETURNING owner"
    )


def _upsert_delete(label: str, name: str, conn: Any, upsert: str, delete: str) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            token = secrets.token_hex(16)
            if not conn.execute(upsert, (name, token)).fetchall():
                raise BenchError(f"{label}: {name} busy")
            if conn.execute(delete, (name, token)).rowcount != 1:
                raise BenchError(f"{label}: {name} not released")

    return run


def _sqlite_connect(path: str) -> sqlite3.Connection:
    """A connection set up as lockaspect's own: autocommit, WAL, synchronous=NORMAL."""
    conn = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def sqlite_floors(env: Env, store_url: str) -> list[Variant]:
    """The raw floor: an upsert that takes a free or expired row and a compare-and-delete,
    stdlib sqlite3 on the store's own file; and, for information, lockaspect's two hot
    statements driven the same way."""
    conn = _sqlite_connect(env.sqlite_path)
    conn.execute(_floor_table_sql("REAL"))
    upsert = _upsert_sql(SQLITE_NOW, "?")
    delete = "DELETE FROM bench_floor WHERE name = ? AND owner = ?"
    floor = Variant("floor", "raw floor: sqlite3 upsert + delete", _upsert_delete("floor", "raw", conn, upsert, delete))
    floor.close = conn.close
    floor.check = lambda: _floor_gone(conn, "SELECT count(*) FROM bench_floor")
    variants = [floor]
    try:
        variants.append(lockaspect_statements(_sqlite_connect(env.sqlite_path), "sqlite"))
    except Exception as exc:  # it leans on lockaspect's private statement module
        out(f"  (the lockaspect-statements row is not available: {type(exc).__name__}: {exc})")
    return variants


def _pg_connect(url: str, prepare: bool) -> Any:
    import psycopg

    options: dict[str, Any] = {} if prepare else {"prepare_threshold": None}
    return psycopg.Connection.connect(url, autocommit=True, **options)


def pg_table_floors(env: Env, store_url: str) -> list[Variant]:
    """The lease table's raw floor on PostgreSQL: the same upsert + delete through one
    psycopg connection in autocommit (psycopg's defaults: it prepares a statement on its 5th
    use). For information: the floor without prepared statements (lockaspect's lease table
    connects with ``prepare_threshold=None`` so that it works behind PgBouncer), and
    lockaspect's own two statements driven raw."""
    assert env.pg_url is not None
    variants = []
    for prepare in (True, False):
        conn = _pg_connect(env.pg_url, prepare)
        conn.execute(_floor_table_sql("DOUBLE PRECISION"))
        name = "raw" if prepare else "raw-unprepared"
        upsert = _upsert_sql(PG_NOW, "%s")
        delete = "DELETE FROM bench_floor WHERE name = %s AND owner = %s"
        label = "raw floor: psycopg upsert + delete" if prepare else "(info) raw floor, no prepared statements"
        v = Variant(
            "floor" if prepare else "floor-unprepared", label, _upsert_delete(label, name, conn, upsert, delete)
        )
        v.close = conn.close
        v.check = lambda conn=conn, name=name: _floor_gone(
            conn, f"SELECT count(*) FROM bench_floor WHERE name = '{name}'"
        )
        variants.append(v)
    try:
        variants.append(lockaspect_statements(_pg_connect(env.pg_url, False), "postgresql"))
    except Exception as exc:
        out(f"  (the lockaspect-statements row is not available: {type(exc).__name__}: {exc})")
    return variants


def pg_advisory_floors(env: Env, store_url: str) -> list[Variant]:
    """Session advisory locks' raw floor: ``SELECT pg_try_advisory_lock(k)`` then ``SELECT
    pg_advisory_unlock(k)`` on one psycopg connection in autocommit (psycopg's defaults), and
    the same without prepared statements for information."""
    from lockaspect.backends.sql._keys import advisory_key

    assert env.pg_url is not None
    key = advisory_key("bench-sql:raw")
    variants = []
    for prepare in (True, False):
        conn = _pg_connect(env.pg_url, prepare)

        def run(n: int, conn: Any = conn) -> None:
            for _ in range(n):
                if not conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
                    raise BenchError("advisory floor: key busy")
                if not conn.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone()[0]:
                    raise BenchError("advisory floor: key not released")

        label = "raw floor: pg_try_advisory_lock + unlock" if prepare else "(info) raw floor, no prepared statements"
        v = Variant("floor" if prepare else "floor-unprepared", label, run)
        v.close = conn.close
        variants.append(v)
    return variants


def _floor_gone(conn: Any, sql: str) -> str:
    left = conn.execute(sql).fetchone()[0]
    return "ok" if not left else f"{left} floor row(s) left behind"


def lockaspect_statements(conn: Any, dialect: str) -> Variant:
    """For information: lockaspect's own claim and release statements (the two a
    ``client.lock`` cycle sends), with the parameters it sends, on one connection set up as
    its own, without the library around them. The gap to the floor is the statements' cost
    (fencing counter, metadata, wider key); the gap to the lockaspect rows is the library's."""
    from lockaspect.backends.sql.table._sql import POSTGRES, SQLITE
    from lockaspect.owner import owner_record

    d = SQLITE if dialect == "sqlite" else POSTGRES
    name = "lockaspect:bench-sql:statements"

    def run(n: int) -> None:
        for _ in range(n):
            token = secrets.token_hex(16)
            claim = {
                "name": name,
                "space": "lock",
                "owner": token,
                "kind": "lock",
                "lease": LEASE,
                "info": owner_record(name),
            }
            if not conn.execute(d.claim, claim).fetchall():
                raise BenchError("lockaspect statements: key busy")
            release = {"name": name, "space": "lock", "slot": "", "owner": token}
            if conn.execute(d.release_exclusive, release).rowcount != 1:
                raise BenchError("lockaspect statements: key not released")

    v = Variant("statements", "(info) lockaspect's 2 statements, raw", run)
    v.close = conn.close
    return v


# -- the stores --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """One SQL store of the benchmark. Adding a store is adding one of these to ``STORES``."""

    name: str  # short id, used in --stores, JSON and the targets
    label: str
    scheme: str  # the URL scheme it must be registered under
    url: Callable[[Env], str | None]  # its lockaspect URL in this run (None: not available here)
    floors: Callable[[Env, str], list[Variant]]  # its raw floor first, then (info) rows
    fair: bool = False  # also a contention row with client.fair_lock
    fifo_target: bool = False  # the session-mode targets (Jain, p99 vs handoff) apply


STORES: tuple[StoreSpec, ...] = (
    StoreSpec(
        "sqlite",
        "SQLite lease table (sqlite://)",
        "sqlite",
        lambda env: "sqlite:///" + env.sqlite_path,
        sqlite_floors,
        fair=True,
    ),
    StoreSpec(
        "pg-table",
        "PostgreSQL lease table (postgresql+table://)",
        "postgresql+table",
        lambda env: env.pg_url and _with_scheme(env.pg_url, "postgresql+table"),
        pg_table_floors,
    ),
    StoreSpec(
        "pg-table-prepared",
        "PostgreSQL lease table, prepared_statements=true (postgresql+table://...?prepared_statements=true)",
        "postgresql+table",
        lambda env: env.pg_url and _with_scheme(env.pg_url, "postgresql+table") + "?prepared_statements=true",
        pg_table_floors,
    ),
    StoreSpec(
        "pg-session",
        "PostgreSQL session advisory locks (postgresql://)",
        "postgresql",
        lambda env: env.pg_url,
        pg_advisory_floors,
        fifo_target=True,
    ),
)


def store_unavailable(spec: StoreSpec, env: Env) -> tuple[str, str] | None:
    """Why ``spec`` cannot run here (a short reason for the targets, and the whole story), or
    ``None``. A store that is registered is opened once to find out."""
    from lockaspect import LockClient
    from lockaspect.backends import registered_schemes

    schemes = registered_schemes()
    if spec.scheme not in schemes:
        return (
            f"{spec.scheme}:// not registered",
            f"the scheme {spec.scheme}:// is not registered in this lockaspect "
            f"(registered: {', '.join(s + '://' for s in schemes)})",
        )
    url = spec.url(env)
    if url is None:
        return "no PostgreSQL", env.pg_missing or "no URL for it in this run"
    try:
        LockClient.from_url(url).close()
    except Exception as exc:
        return "cannot open", f"{_util_redact(url)} cannot be opened: {type(exc).__name__}: {exc}"
    return None


# -- section 1: uncontended cycles -------------------------------------------------------------

LOCKASPECT_ROWS = {
    "la-fixed": f"lockaspect client.lock, lease={LEASE}",
    "la-wd": "lockaspect client.lock, watchdog",
    "la-deco": "lockaspect @distributed_lock, watchdog",
    "la-async": "lockaspect async with client.lock, watchdog",
}


def lockaspect_variants(url: str) -> list[Variant]:
    """client.lock with a fixed lease and in watchdog mode, the decorator and ``async with``,
    on ONE client, each on its own key."""
    from lockaspect import LockClient, distributed_lock

    client = LockClient.from_url(url)
    loop = asyncio.new_event_loop()

    def block(key: str, lease: float | None) -> Callable[[int], None]:
        return _util.lock_cycles(client, key, lease)

    @distributed_lock(key="bench-sql:<n>", client=client)
    def decorated(n: int) -> int:
        return n

    def deco(n: int) -> None:
        for _ in range(n):
            decorated(1)

    async def acycles(n: int) -> None:
        for _ in range(n):
            async with client.lock("bench-sql:la-async"):
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
        try:
            loop.run_until_complete(client.aclose())
        finally:
            loop.close()

    variants = [
        Variant("la-fixed", LOCKASPECT_ROWS["la-fixed"], block("bench-sql:la-fixed", LEASE)),
        Variant("la-wd", LOCKASPECT_ROWS["la-wd"], block("bench-sql:la-watchdog", None)),
        Variant("la-deco", LOCKASPECT_ROWS["la-deco"], deco),
        Variant("la-async", LOCKASPECT_ROWS["la-async"], lambda n: loop.run_until_complete(acycles(n))),
    ]
    variants[-1].check = check  # after every row ran
    variants[-1].close = close
    variants[0].settings = {"client": client}
    return variants


def server_cpu(env: Env) -> float | None:
    """CPU seconds of the PostgreSQL server we started (postmaster and every backend), or
    ``None`` (no server of ours, or psutil cannot see it). Read around each run: the backends
    of a run's connections live through it."""
    server = env.pg_server
    if server is None or server.process is None:
        return None
    try:
        import psutil

        root = psutil.Process(server.pid)
        total = 0.0
        for proc in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.NoSuchProcess):
                times = proc.cpu_times()
                total += times.user + times.system
        return total
    except Exception:
        return None


def bench_store_cycles(spec: StoreSpec, env: Env, args: argparse.Namespace) -> dict[str, Any]:
    url = spec.url(env)
    assert url is not None
    variants = spec.floors(env, url) + lockaspect_variants(url)
    uses_server = spec.name != "sqlite"
    errors: dict[str, str] = {}
    for variant in list(variants):  # warm-up: connect, prepare, start threads
        try:
            variant.run(args.warmup)
        except Exception as exc:
            errors[variant.name] = f"warm-up failed: {type(exc).__name__}: {exc}"
            variants.remove(variant)
    for round_no in range(args.repeats):
        shift = round_no % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            gc.collect()
            server0 = server_cpu(env) if uses_server else None
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            variant.run(args.cycles)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            server1 = server_cpu(env) if uses_server else None
            variant.ops.append(args.cycles / wall)
            variant.cpu_us.append(cpu / args.cycles * 1e6)
            if server0 is not None and server1 is not None:
                variant.server_us.append((server1 - server0) / args.cycles * 1e6)
        out(f"  {spec.name}: round {round_no + 1}/{args.repeats} done (load {_util.loadavg()})")

    profile = None
    client = next((v.settings["client"] for v in variants if v.settings), None)
    if args.profile and client is not None:
        profile = profile_lockaspect(client, args)

    floor = next((v for v in variants if v.name == "floor"), None)
    rows = []
    data: dict[str, Any] = {}
    for v in variants:
        ops = median(v.ops)
        x_floor = median([a / b for a, b in zip(v.ops, floor.ops, strict=True)]) if floor is not None else float("nan")
        entry = {
            "label": v.label,
            "ops_per_s": ops,
            "ops_runs": [round(x, 1) for x in v.ops],
            "us_per_cycle": 1e6 / ops,
            "cpu_us_per_cycle": median(v.cpu_us),
            "server_cpu_us_per_cycle": median(v.server_us) if v.server_us else None,
            "spread": spread(v.ops),
            "x_floor": x_floor,
            "check": v.check(),
        }
        data[v.name] = entry
        rows.append(
            [
                v.label,
                ops,
                f"{entry['spread'] * 100:.0f}%",
                entry["us_per_cycle"],
                entry["cpu_us_per_cycle"],
                entry["server_cpu_us_per_cycle"],
                f"{x_floor:.2f}x",
            ]
        )
    for v in variants:
        with contextlib.suppress(Exception):
            v.close()
    out()
    out(spec.label + ", " + _util_redact(url))
    out(
        table(
            ["row", "cycles/s", "spread", "us/cycle", "client CPU us", "server CPU us", "x raw floor"],
            rows,
        )
    )
    for entry in data.values():
        if entry["check"] != "ok":
            out(f"  check {entry['label']}: {entry['check']}")
    for name, message in errors.items():
        out(f"  SKIPPED {name}: {message}")
    if profile is not None:
        out()
        what = f"{args.profile_cycles:,} x `with client.lock(key, lease={LEASE})`"
        out(f"  cProfile of {what} on {spec.name}, top functions by own time:")
        out(profile["text"])
    return {"url": _util_redact(url), "rows": data, "errors": errors, **({"profile": profile} if profile else {})}


def _util_redact(url: str) -> str:
    from lockaspect.backends.base import redacted

    return redacted(url)


def profile_lockaspect(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    """cProfile over ``--profile-cycles`` fixed-lease cycles: the top functions by own time
    (cProfile slows Python code, not the database: read shares, not absolute times)."""
    key = "bench-sql:profile"
    with client.lock(key, lease=LEASE):
        pass
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_cycles):
        with client.lock(key, lease=LEASE):
            pass
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(args.profile_top)
    lines = [line for line in stream.getvalue().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    text = "\n".join("    " + re.sub(r"/\S*/(site-packages|lib/python[0-9.]+)/", "", line) for line in lines[start:])
    text = text.replace(str(HERE.parent.parent) + "/", "")
    total = stats.total_tt  # type: ignore[attr-defined]
    return {"cycles": args.profile_cycles, "total_s": total, "text": text}


def bench_cycles(env: Env, stores: Sequence[StoreSpec], args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading("1. Lock/unlock cycles, uncontended, one thread"))
    out(
        f"{args.cycles:,} cycles per timed run, {args.repeats} runs per row interleaved (order rotated each "
        f"round), after {args.warmup:,} warm-up cycles each; one key per row, empty body, fresh 128-bit token "
        f"per floor cycle, lease {LEASE}s (watchdog rows: the client's 30s watchdog lease)"
    )
    data: dict[str, Any] = {}
    for spec in stores:
        try:
            data[spec.name] = bench_store_cycles(spec, env, args)
        except Exception as exc:
            out(f"  ERROR {spec.name}: {type(exc).__name__}: {exc}")
            data[spec.name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    out()
    out("  cycles/s: median of the runs; spread: (max-min)/median; x raw floor: median of the per-round")
    out("  ratios against the floor run of the same round (above 1.0 is faster), the ratio the target uses;")
    out("  client CPU: this process's CPU time (all threads) per cycle, the column that stays stable on a")
    out("  noisy machine; server CPU: the PostgreSQL server's processes' CPU per cycle (psutil; SQLite runs")
    out("  in this process, so it has none). The async row uses the same sync floor.")
    results["cycles"] = {
        "params": {"cycles": args.cycles, "warmup": args.warmup, "repeats": args.repeats, "lease_s": LEASE},
        "stores": data,
    }


# -- section 2: contention ---------------------------------------------------------------------


def child_main(spec: dict[str, Any]) -> int:
    """One contention worker: its own client, warm-up on a private key, the start barrier,
    then critical sections on the hot key until the stop time."""
    try:
        result = child_run(spec)
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(spec["out"]).write_text(json.dumps(result), encoding="utf-8")
    return 0 if "error" not in result else 1


def child_run(spec: dict[str, Any]) -> dict[str, Any]:
    from lockaspect import LockClient

    client = LockClient.from_url(spec["url"])
    enter = client.fair_lock if spec["fair"] else client.lock
    key, think, pause = spec["key"], spec["think"], spec["pause"]
    fd = os.open(spec["counter"], os.O_RDWR)
    records: list[tuple[float, float, float, float]] = []
    try:
        for _ in range(spec["warm_cycles"]):  # connect, first statements; a private key
            with enter(spec["warm_key"], wait=None):
                pass
        start, stop = _barrier()
        time.sleep(max(0.0, start - time.time()))
        now = time.time
        cpu0 = time.process_time()
        while True:
            ask = now()
            if ask >= stop:
                break
            with enter(key, wait=None):
                acquired = now()
                value = int(os.pread(fd, 32, 0))  # the non-atomic critical section: read,
                time.sleep(think)  # think,
                os.pwrite(fd, b"%20d" % (value + 1), 0)  # write back
                released = now()
            records.append((ask, acquired, released, now()))
            if pause:
                time.sleep(pause)
        cpu = time.process_time() - cpu0
    finally:
        os.close(fd)
        s = client.stats()
        stats = {"acquired": s.acquired, "released": s.released, "lost": s.lost, "held": s.held}
        client.close()
    return {"records": {"0": records}, "cpu_s": cpu, "stats": stats}


def run_contention(url: str, fair: bool, procs: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One (store, lock kind, P) configuration: P fresh worker processes, a start barrier, a
    fixed run time, then the analysis (bench_async's)."""
    scratch = Path(tempfile.mkdtemp(prefix="lockaspect-bench-sql-"))
    counter = scratch / "counter"
    counter.write_bytes(b"%20d" % 0)
    children: list[subprocess.Popen[str]] = []
    result: dict[str, Any] = {"procs": procs}
    try:
        for i in range(procs):
            spec = {
                "url": url,
                "fair": fair,
                "key": f"bench-sql:{tag}:hot",
                "warm_key": f"bench-sql:{tag}:warm:{i}",
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
        client_cpu = 0.0
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
            for k in stats:
                stats[k] += data["stats"][k]
        observed = int(counter.read_bytes())
        result.update(analyse(per_proc, start, args.settle, stop, observed))
        result["expected"] = result["sections_total"]
        result.update(longest_wait(per_proc, start + args.settle, stop))
        if result["sections_total"]:
            result["client_cpu_us_per_section"] = client_cpu / result["sections_total"] * 1e6
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


def longest_wait(per_proc: list[dict[str, list[list[float]]]], window0: float, stop: float) -> dict[str, Any]:
    """The longest wait that overlapped the measured window, also one asked before it (the
    waiter table counts requests made in the window only, so a worker starved from the start
    would not show there)."""
    waits = [
        (acquired - ask) * 1e3
        for workers in per_proc
        for records in workers.values()
        for ask, acquired, _released, _freed in records
        if ask < stop and acquired >= window0
    ]
    return {"longest_wait_ms": max(waits) if waits else float("nan")}


def _child_error(path: Path) -> str:
    try:
        return str(json.loads(path.read_text(encoding="utf-8"))["error"])
    except Exception:
        return ""


CONTENTION_HEADERS = [
    "store / lock",
    "P",
    "sections/s",
    "handoff p50 ms",
    "handoff p99 ms",
    "waiter p50 ms",
    "waiter p99 ms",
    "waiter max ms",
    "longest wait ms",
    "waiters",
    "Jain",
    "same again",
    "CPU us/section",
    "counter (expected = observed)",
]


def contention_row(label: str, res: dict[str, Any]) -> list[Any]:
    if "error" in res:
        return [label, res["procs"], "ERROR", *([None] * 10), res["error"].splitlines()[0][:70]]
    ok = res["counter_ok"] and not res["overlaps"]
    counter = f"{res['expected']:,} = {res['counter']:,}" if ok else f"FAIL {res['expected']:,} != {res['counter']:,}"
    if res["overlaps"]:
        counter += f", {res['overlaps']} overlaps"
    return [
        label,
        res["procs"],
        res["sections_per_s"],
        res["handoff_p50_ms"],
        res["handoff_p99_ms"],
        res["waiter_p50_ms"],
        res["waiter_p99_ms"],
        res["waiter_max_ms"],
        res["longest_wait_ms"],
        f"{res['waiter_share'] * 100:.0f}%",
        f"{res['jain']:.3f}",
        f"{res['same_worker_again_share'] * 100:.0f}%",
        res.get("client_cpu_us_per_section"),
        counter,
    ]


def contention_configs(stores: Sequence[StoreSpec]) -> list[tuple[str, StoreSpec, bool]]:
    """(row id, store, fair) for every contention row."""
    configs = []
    for spec in stores:
        configs.append((f"{spec.name}/lock", spec, False))
        if spec.fair:
            configs.append((f"{spec.name}/fair_lock", spec, True))
    return configs


def bench_contention(env: Env, stores: Sequence[StoreSpec], args: argparse.Namespace, results: dict[str, Any]) -> None:
    out(heading(f"2. Contention: P worker processes on ONE key (P = {', '.join(map(str, args.procs))})"))
    after = f"sleep {args.pause * 1e3:g} ms and ask again" if args.pause else "ask again at once"
    out(
        f"each worker: with client.lock(key, wait=None) (watchdog mode; fair_lock for the fair rows): read the "
        f"counter file, sleep {THINK * 1e3:g} ms, write counter+1; then {after}. {args.settle:g}s "
        f"warm-up + {args.duration:g}s measured after a start barrier; fresh processes per configuration"
    )
    out(f"machine: {os.cpu_count()} logical CPUs shared by the workers (and the PostgreSQL server)")
    configs = contention_configs(stores)
    raw: dict[str, dict[str, Any]] = {row: {} for row, _, _ in configs}
    tag0 = f"{os.getpid()}-{int(time.time())}"
    for p_index, procs in enumerate(args.procs):
        turn = p_index % max(1, len(configs))
        for row, spec, fair in configs[turn:] + configs[:turn]:
            url = spec.url(env)
            assert url is not None
            tag = f"{tag0}-{row.replace('/', '-')}-{procs}"
            res = run_contention(url, fair, procs, args, tag)
            raw[row][str(procs)] = res
            if "error" in res:
                summary = f"ERROR {res['error'].splitlines()[0]}"
            else:
                exact = "exact" if res["counter_ok"] and not res["overlaps"] else "FAIL"
                summary = (
                    f"{res['sections_per_s']:,.0f} sections/s, waiter p99 {res['waiter_p99_ms']:.1f} ms, "
                    f"Jain {res['jain']:.3f}, counter {exact}"
                )
            out(f"  {row} P={procs}: {summary} (load {_util.loadavg()})")
    rows = [contention_row(row, raw[row][str(p)]) for p in args.procs for row, _, _ in configs]
    out()
    out(table(CONTENTION_HEADERS, rows))
    out("  sections/s: critical sections entered in the measured window / its length. handoff: from a")
    out("  holder leaving its section (time.time() before release) to the next holder (another worker)")
    out("  holding it. waiter: a request made while another worker held the lock, from asking to holding;")
    out("  longest wait: the longest wait that overlapped the window, also one asked before it (a worker")
    out("  starved from the start). waiters: their share of the requests. Jain: fairness of the per-process")
    out("  section counts (1.0 = equal, 1/P = one took all). same again: sections whose previous holder was")
    out("  the same worker. CPU: all workers' process CPU per section. counter: sections recorded = the")
    out("  file counter, and no two holds overlapped in time, else FAIL.")
    for row, by_p in raw.items():
        for p, res in by_p.items():
            if "counter_ok" in res and (not res["counter_ok"] or res["overlaps"]):
                out(
                    f"  !!! FAIL {row} P={p}: counter {res['counter']} vs {res['expected']} sections recorded, "
                    f"{res['overlaps']} overlapping holds: MUTUAL EXCLUSION BROKEN"
                )
            stats = res.get("lockaspect_stats")
            if stats and (stats["lost"] or stats["held"] or stats["acquired"] != stats["released"]):
                out(f"  check {row} P={p}: lockaspect stats {stats}")
            if res.get("stderr"):
                out(f"  stderr {row} P={p}: {res['stderr'][0]}")
            if "error" in res and "\n" in res["error"]:
                out(f"  error {row} P={p}: {res['error']}")
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


# -- targets -----------------------------------------------------------------------------------


def targets(
    results: dict[str, Any], stores: Sequence[StoreSpec], skipped: dict[str, str], args: argparse.Namespace
) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(target: str, measured: str, met: bool | None, note: str = "") -> None:
        status = "not run" if met is None else ("MET" if met else "MISSED")
        rows.append([target, measured, status, note])

    cycles = results.get("cycles", {}).get("stores", {})
    for spec in STORES:
        for name, label in LOCKASPECT_ROWS.items():
            target = f"{spec.name}: {label} >= {TARGET_FLOOR_RATIO}x raw floor"
            entry = cycles.get(spec.name, {}).get("rows", {}).get(name)
            if entry is None:
                add(target, "-", None, skipped.get(spec.name, "" if "cycles" in args.sections else "section not run"))
                continue
            ratio = entry["x_floor"]
            add(target, f"{ratio:.2f}x", ratio >= TARGET_FLOOR_RATIO)

    contention = results.get("contention", {}).get("rows", {})
    for spec in STORES:
        if not spec.fifo_target:
            continue
        for procs in args.procs:
            res = contention.get(f"{spec.name}/lock", {}).get(str(procs))
            jain_target = f"{spec.name} P={procs}: Jain >= {TARGET_JAIN}"
            p99_target = f"{spec.name} P={procs}: waiter p99 <= {TARGET_P99_OVER_HANDOFF:g}x handoff p50"
            if res is None or "jain" not in res:
                why = res.get("error", "")[:60] if res is not None else skipped.get(spec.name, "")
                if res is None and not why and "contention" not in args.sections:
                    why = "section not run"
                add(jain_target, "-", None, why)
                add(p99_target, "-", None, why)
                continue
            add(jain_target, f"{res['jain']:.3f}", res["jain"] >= TARGET_JAIN)
            ratio = res["waiter_p99_ms"] / res["handoff_p50_ms"] if res["handoff_p50_ms"] > 0 else float("nan")
            fifo_wait = (procs - 1) * 1e3 / res["sections_per_s"] if res["sections_per_s"] else float("nan")
            add(
                p99_target,
                f"{res['waiter_p99_ms']:.2f} / {res['handoff_p50_ms']:.2f} ms = {ratio:.1f}x",
                ratio <= TARGET_P99_OVER_HANDOFF,
                f"FIFO: a waiter waits out {procs - 1} other hold(s), ~{fifo_wait:.1f} ms",
            )
    return rows


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    names = ",".join(s.name for s in STORES)
    p.add_argument("--stores", default=names, help=f"comma-separated subset of {names} (default all)")
    p.add_argument(
        "--pg-url", help="use this running PostgreSQL (postgresql://user@host:port/db) instead of starting one"
    )
    p.add_argument("--sqlite-dir", help="directory for the SQLite file (default a fresh temporary directory)")
    p.add_argument("--quick", action="store_true", help="short runs to check the script (noisy numbers)")
    p.add_argument("--cycles", type=int, help="timed cycles per run and row (default 3000; quick 500)")
    p.add_argument("--warmup", type=int, help="warm-up cycles per row (default 300; quick 100)")
    p.add_argument("--repeats", type=int, help="interleaved runs per row (default 5; quick 3)")
    p.add_argument("--procs", default="2,4,8", help="worker process counts for contention (default 2,4,8)")
    p.add_argument("--duration", type=float, help="measured seconds per contention run (default 5; quick 2)")
    p.add_argument("--settle", type=float, help="contended warm-up seconds before measuring (default 0.5; quick 0.3)")
    p.add_argument("--pause", type=float, default=0.0, help="seconds each worker sleeps between sections (default 0)")
    p.add_argument("--warm-cycles", type=int, default=20, help="uncontended cycles per worker before the barrier")
    p.add_argument("--sections", default="cycles,contention", help="subset of cycles,contention (default both)")
    p.add_argument("--profile", action="store_true", help="also cProfile lockaspect's fixed-lease cycle per store")
    p.add_argument("--profile-cycles", type=int, default=2000, help="cycles under cProfile (default 2000)")
    p.add_argument("--profile-top", type=int, default=15, help="functions shown per profile (default 15)")
    p.add_argument("--json", metavar="PATH", help="also write every result to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.cycles = args.cycles or (500 if quick else 3000)
    args.warmup = args.warmup if args.warmup is not None else (100 if quick else 300)
    args.repeats = args.repeats or (3 if quick else 5)
    args.duration = args.duration or (2.0 if quick else 5.0)
    args.settle = args.settle if args.settle is not None else (0.3 if quick else 0.5)
    try:
        args.procs = [int(x) for x in args.procs.split(",") if x.strip()]
    except ValueError:
        p.error("--procs takes comma-separated integers, e.g. 2,4,8")
    if not args.procs or min(args.procs) < 1:
        p.error("--procs needs positive process counts")
    args.stores = [x.strip() for x in args.stores.split(",") if x.strip()]
    unknown = set(args.stores) - {s.name for s in STORES}
    if unknown:
        p.error(f"unknown store(s): {', '.join(sorted(unknown))}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if args.sections - {"cycles", "contention"}:
        p.error(f"unknown section(s): {', '.join(sorted(args.sections - {'cycles', 'contention'}))}")
    if args.pg_url and urlsplit(args.pg_url).scheme not in ("postgresql", "postgres"):
        p.error("--pg-url takes a plain postgresql:// URL (the script derives postgresql+table:// from it)")
    return args


def machine_facts(env: Env) -> dict[str, Any]:
    facts = _util.machine_facts()
    for dist in ("python_redis_lock", "pottery", "redis_py"):
        facts.pop(dist, None)  # Redis peers: not part of this benchmark
    facts["psycopg"] = _util.version_of("psycopg")
    facts["psycopg_impl"] = "?"
    facts["sqlite"] = sqlite3.sqlite_version
    facts["sqlite_path"] = env.sqlite_path
    facts["sqlite_fs"] = _filesystem(env.sqlite_path)
    facts["postgres"] = None
    if env.pg_url is not None:
        try:
            import psycopg

            facts["psycopg_impl"] = psycopg.pq.__impl__
            with _pg_connect(env.pg_url, True) as conn:
                facts["postgres"] = conn.execute("SHOW server_version").fetchone()[0]
                settings = conn.execute(
                    "SELECT name, setting FROM pg_settings WHERE name IN "
                    "('fsync', 'synchronous_commit', 'max_connections', 'shared_buffers')"
                ).fetchall()
                facts["postgres_settings"] = dict(settings)
        except Exception as exc:
            facts["postgres"] = f"? ({type(exc).__name__}: {exc})"
    facts["pg_started_by_bench"] = env.pg_server is not None
    return facts


def _filesystem(path: str) -> str:
    """The file system type of ``path``'s mount (Linux /proc/mounts), or '?'."""
    best, kind = "", "?"
    try:
        target = os.path.realpath(os.path.dirname(path))
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                inside = len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/"))
                if inside and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    results: dict[str, Any] = {}
    chosen = [s for s in STORES if s.name in args.stores]
    scratch = Path(args.sqlite_dir or tempfile.mkdtemp(prefix="lockaspect-bench-sql-"))
    env = Env(sqlite_path=str((scratch / "locks.db").resolve()), pg_url=args.pg_url)
    with contextlib.ExitStack() as stack:
        if not args.sqlite_dir:
            stack.callback(shutil.rmtree, scratch, True)
        if env.pg_url is None and any(s.name.startswith("pg") for s in chosen):
            try:
                from lockaspect.testing import PostgresServer

                env.pg_server = stack.enter_context(PostgresServer())
                env.pg_url = env.pg_server.url
            except Exception as exc:
                env.pg_missing = f"no PostgreSQL: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        facts = machine_facts(env)
        results["machine"] = facts
        out(heading("lockaspect SQL stores benchmark"))
        out(
            f"CPU: {facts['cpu_model']}, {facts['cpu_logical']} logical / {facts['cpu_physical']} physical; "
            f"load average {facts['loadavg_start']}"
        )
        out(f"Python: {facts['python']} on {facts['platform']}")
        out(
            f"lockaspect {facts['lockaspect']}, psycopg {facts['psycopg']} ({facts['psycopg_impl']}), "
            f"psutil {facts['psutil']}, SQLite {facts['sqlite']}"
        )
        out(f"SQLite file: {env.sqlite_path} ({facts['sqlite_fs']}), WAL, synchronous=NORMAL")
        if env.pg_url is not None:
            how = "started by the benchmark" if env.pg_server is not None else "given by --pg-url"
            out(
                f"PostgreSQL {facts['postgres']} ({how}), TCP {_util_redact(env.pg_url)}, "
                f"settings {facts.get('postgres_settings', {})}"
            )
        else:
            out(f"PostgreSQL: none ({env.pg_missing})")
        if args.quick:
            out("QUICK RUN: short runs; numbers are for checking the script, not for the record")

        skipped: dict[str, str] = {}
        stores = []
        for spec in chosen:
            why = store_unavailable(spec, env)
            if why is None:
                stores.append(spec)
            else:
                skipped[spec.name] = why[0]
                out(f"SKIPPED store {spec.name} ({spec.label}): {why[1]}")
        for spec in STORES:
            if spec not in chosen:
                skipped[spec.name] = "not in --stores"
        results["skipped"] = skipped

        if "cycles" in args.sections and stores:
            bench_cycles(env, stores, args, results)
        if "contention" in args.sections and stores:
            bench_contention(env, stores, args, results)

        out(heading("TARGETS (issue 10, part 4)"))
        rows = targets(results, stores, skipped, args)
        out(table(["target", "measured", "status", "note"], rows))
        results["targets"] = [dict(zip(["target", "measured", "status", "note"], row, strict=True)) for row in rows]
        met = sum(1 for r in rows if r[2] == "MET")
        missed = sum(1 for r in rows if r[2] == "MISSED")
        out(f"{met} met, {missed} missed, {len(rows) - met - missed} not run (a report: the exit status is 0)")
        results["machine"]["loadavg_end"] = _util.loadavg()
        out(f"\nload average at the end: {results['machine']['loadavg_end']}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
            out(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
