"""Regenerate docs/benchmarks.md and its plots from one run of every store's benchmark.

``python bench/make_page.py`` runs bench_core.py (cycles), bench_async.py, bench_cluster.py
(cycles), bench_sql.py, bench_zookeeper.py and bench_stores.py one after the other, each with
``--json`` into ``--json-dir`` (its printed output beside it as .txt), then writes the page:
the machine and every version, and per store a table of uncontended cycles against the raw
floor and the best Python peer, a stacked bar of the cycle's cost (client CPU / server CPU /
wire and the rest), and where the store has a contention bench, sections/s against processes
and the waiters' latency CDF. ``--from-json DIR`` skips the runs and reads DIR's JSON.
``--quick`` runs every bench with its own ``--quick`` (a few minutes; the page says so).
Not a test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _util
from _util import median

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> (script, extra arguments for every run, extra arguments for a full run)
BENCHES: dict[str, tuple[str, list[str], list[str]]] = {
    "core": ("bench_core.py", ["--sections", "cycles"], ["--cycles", "10000"]),
    "async": ("bench_async.py", [], ["--cycles", "10000"]),
    "cluster": ("bench_cluster.py", ["--sections", "cycles"], []),
    "sql": ("bench_sql.py", [], []),
    "zookeeper": ("bench_zookeeper.py", [], []),
    "stores": ("bench_stores.py", [], []),
}


def cycles_of(bench: str, *path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def get(data: dict[str, Any]) -> dict[str, Any]:
        node: Any = data.get(bench, {})
        for part in path:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}

    return get


# One entry per store: where its cycle rows are, which row is the floor, which are peers; and
# where its contention rows are ({label: {P: result}}).
STORES: list[dict[str, Any]] = [
    {
        "slug": "redis",
        "title": "Redis / Valkey, one server",
        "cycles": cycles_of("core", "cycles", "libraries"),
        "floor": "raw",
        "peers": ["redis-py", "prl", "pottery"],
        "contention": (
            "async",
            ["la-sync", "la-async", "la-async-tasks", "la-fair", "redis-py", "prl", "pottery", "aioredlock"],
        ),
        "peer_contention": ["redis-py", "prl", "pottery", "aioredlock"],
    },
    {
        "slug": "redis-asyncio",
        "title": "Redis / Valkey, one server: asyncio cycles",
        "cycles": cycles_of("async", "cycles", "libraries"),
        "floor": "raw",
        "peers": ["redis-py", "aioredlock"],
        "contention_note": "Contention: see the section above (lockaspect async, 1 and 4 tasks a process).",
    },
    {
        "slug": "cluster",
        "title": "Redis Cluster (3 primaries + 3 replicas)",
        "cycles": cycles_of("cluster", "cycles", "rows"),
        "floor": "raw",
        "async_floor": ("araw", ["la-async"]),
        "peers": ["redis-py"],
    },
    {
        "slug": "sentinel",
        "title": "Redis Sentinel (master + 1 replica, 3 sentinels)",
        "cycles": cycles_of("stores", "stores", "sentinel", "rows"),
        "floor": "floor",
        "peers": ["redis-py", "prl"],
    },
    {
        "slug": "redlock",
        "title": "RedLock (3 independent servers)",
        "cycles": cycles_of("stores", "stores", "redlock", "rows"),
        "floor": "floor",
        "peers": ["pottery"],
    },
    {
        "slug": "postgres-advisory",
        "title": "PostgreSQL advisory locks (postgresql://)",
        "cycles": cycles_of("sql", "cycles", "stores", "pg-session", "rows"),
        "floor": "floor",
        "peers": [],
        "contention": ("sql", ["pg-session/lock", "pg-session/fair_lock"]),
    },
    {
        "slug": "postgres-table",
        "title": "PostgreSQL lease table (postgresql+table://)",
        "cycles": cycles_of("sql", "cycles", "stores", "pg-table", "rows"),
        "floor": "floor",
        "peers": [],
        "contention": ("sql", ["pg-table/lock", "pg-table/fair_lock", "pg-table-prepared/lock"]),
    },
    {
        "slug": "sqlite",
        "title": "SQLite (sqlite:///)",
        "cycles": cycles_of("sql", "cycles", "stores", "sqlite", "rows"),
        "floor": "floor",
        "peers": [],
        "contention": ("sql", ["sqlite/lock", "sqlite/fair_lock"]),
    },
    {
        "slug": "zookeeper",
        "title": "ZooKeeper (zookeeper://)",
        "cycles": cycles_of("zookeeper", "cycles", "rows"),
        "floor": "floor",
        "async_floor": ("afloor", ["la-async"]),
        "peers": ["kazoo", "kazoo-new"],
        "contention": ("zookeeper", ["la-lock", "la-fair", "kazoo"]),
        "peer_contention": ["kazoo"],
    },
    {
        "slug": "memory",
        "title": "In-process memory:// store",
        "cycles": cycles_of("stores", "stores", "memory", "rows"),
        "floor": "floor",
        "peers": [],
    },
]


def run_benches(names: list[str], json_dir: Path, quick: bool) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        script, always, full = BENCHES[name]
        command = [sys.executable, str(HERE / script), *always, *(["--quick"] if quick else full)]
        command += ["--json", str(json_dir / f"{name}.json")]
        print(f"== {name}: {' '.join(command[1:])} (load {_util.loadavg()})", flush=True)
        t0 = time.perf_counter()
        with open(json_dir / f"{name}.txt", "w", encoding="utf-8") as log:
            code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        runs[name] = {"exit": code, "seconds": round(time.perf_counter() - t0, 1)}
        print(f"   exit {code} after {runs[name]['seconds']:.0f} s", flush=True)
    return runs


def machine() -> dict[str, Any]:
    return {
        "cpu_model": _util.cpu_model(),
        "cpu_logical": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "os": platform.platform(),
        "loadavg_start": _util.loadavg(),
    }


def versions(data: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Every library and server version the benches recorded (their ``machine`` facts)."""
    skip = ("url", "path", "loadavg", "cpu", "platform", "python", "started", "fs", "settings", "transport", "mode")
    found: dict[str, str] = {}
    for bench in data.values():
        for source in [bench.get("machine", {})] + [s.get("facts", {}) for s in bench.get("stores", {}).values()]:
            for key, value in source.items():
                if any(word in key for word in skip):
                    continue
                if key == "server" and isinstance(value, dict) and "version" in value:
                    found.setdefault("redis/valkey server", f"{value.get('kind', '')} {value['version']}".strip())
                elif key in ("kind", "version", "server"):  # bench_stores' server facts, the same server
                    continue
                elif isinstance(value, (str, int, float)):
                    found.setdefault(key.replace("_", "-"), str(value))
    return dict(sorted(found.items()))


# -- figures ---------------------------------------------------------------------------------


def fnum(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:,.{digits}f}"


def ratio(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """Median of the per-round ratios when both have the same rounds (interleaved runs), else
    the ratio of the medians."""
    if base is None:
        return None
    a, b = row.get("ops_runs") or [], base.get("ops_runs") or []
    if a and len(a) == len(b):
        return median([x / y for x, y in zip(a, b, strict=True)])
    return row["ops_per_s"] / base["ops_per_s"]


def cost(row: dict[str, Any]) -> tuple[float, float, float]:
    """(client CPU, server CPU, wire and the rest) in us per cycle; the last is what the wall
    time leaves over the two CPUs (loopback, scheduling, the other side's wait), never below 0."""
    wall = 1e6 / row["ops_per_s"]
    client = row.get("cpu_us_per_cycle", row.get("cpu_us")) or 0.0
    server = row.get("server_cpu_us_per_cycle", row.get("server_us")) or 0.0
    return client, server, max(0.0, wall - client - server)


def cycle_table(rows: dict[str, Any], floor: str, peers: list[str]) -> tuple[list[str], str | None]:
    base = rows.get(floor)
    present = [p for p in peers if p in rows]
    best = max(present, key=lambda p: rows[p]["ops_per_s"]) if present else None
    lines = [
        "| row | ops/s | spread | us/cycle | client CPU us | server CPU us | wire/other us | x raw floor "
        "| x best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        client, _, wire = cost(row)
        server_txt = fnum(row.get("server_cpu_us_per_cycle", row.get("server_us")), 1)
        mark = " (floor)" if name == floor else " (best peer)" if name == best else ""
        x_floor, x_peer = ratio(row, base), ratio(row, rows[best] if best else None)
        lines.append(
            f"| {row['label']}{mark} | {fnum(row['ops_per_s'])} | {row.get('spread', 0) * 100:.0f}% | "
            f"{fnum(1e6 / row['ops_per_s'], 1)} | {fnum(client, 1)} | {server_txt} | {fnum(wire, 1)} | "
            f"{'-' if x_floor is None else f'{x_floor:.2f}x'} | {'-' if x_peer is None else f'{x_peer:.2f}x'} |"
        )
    return lines, best


def plot_cost(path: Path, title: str, rows: dict[str, Any], keep: list[str]) -> None:
    import matplotlib.pyplot as plt

    names = [n for n in keep if n in rows]
    parts = [cost(rows[n]) for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.4))
    left = [0.0] * len(names)
    stacks = (("client CPU", "#4c72b0"), ("server CPU", "#dd8452"), ("wire/other", "#999999"))
    for k, (label, colour) in enumerate(stacks):
        widths = [p[k] for p in parts]
        ax.barh(range(len(names)), widths, left=left, color=colour, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    walls = [1e6 / rows[n]["ops_per_s"] for n in names]
    ax.scatter(walls, range(len(names)), marker="|", s=400, color="black", label="wall time", zorder=3)
    ax.set_xlim(0, max([*left, *walls], default=1.0) * 1.04)
    ax.set_yticks(range(len(names)), [rows[n]["label"][:48] for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us per uncontended lock/unlock cycle")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def plot_contention(path_tp: Path, path_cdf: Path, title: str, series: dict[str, dict[str, Any]]) -> int | None:
    import matplotlib.pyplot as plt
    from bench_async import CDF_QUANTILES

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, by_p in series.items():
        ps = sorted((int(p), r) for p, r in by_p.items() if isinstance(r, dict) and "sections_per_s" in r)
        ax.plot([p for p, _ in ps], [r["sections_per_s"] for _, r in ps], marker="o", label=label)
    ax.set_xlabel("processes contending for one key")
    ax.set_ylabel("critical sections / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path_tp, dpi=90, bbox_inches="tight")
    plt.close(fig)
    all_p = sorted({int(p) for by_p in series.values() for p in by_p})
    at = 4 if 4 in all_p else all_p[-1] if all_p else None
    if not any((by_p.get(str(at)) or {}).get("waiter_cdf_ms") for by_p in series.values()):
        return None  # JSON from before the benches sampled the CDF
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, by_p in series.items():
        curve = (by_p.get(str(at)) or {}).get("waiter_cdf_ms") or []
        if curve:
            ax.plot([max(v, 1e-3) for v in curve], CDF_QUANTILES[: len(curve)], label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"waiter latency, ms (log scale), P = {at}")
    ax.set_ylabel("share of waiters")
    ax.set_title(f"{title}: waiters' latency CDF", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path_cdf, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return at


def contention_series(data: dict[str, Any], store: dict[str, Any]) -> dict[str, dict[str, Any]]:
    bench, names = store["contention"]
    section = data.get(bench, {}).get("contention", {})
    rows = section.get("libraries") or section.get("rows") or {}
    labels = section.get("labels", {})
    return {labels.get(n, n): rows[n] for n in names if rows.get(n)}


def contention_table(series: dict[str, dict[str, Any]], peer_labels: list[str]) -> list[str]:
    all_p = sorted({int(p) for by_p in series.values() for p in by_p})
    head = "| library | " + " | ".join(f"P={p} sections/s | P={p} x best peer | P={p} waiter p99 ms" for p in all_p)
    lines = [head + " | exact counter |", "|---|" + "---|" * (3 * len(all_p) + 1)]
    for label, by_p in series.items():
        cells, exact = [], True
        for p in all_p:
            r = by_p.get(str(p)) or {}
            peers = [series[q].get(str(p), {}).get("sections_per_s") for q in peer_labels if q in series]
            best = max((x for x in peers if x), default=None)
            tp = r.get("sections_per_s")
            cells += [fnum(tp), f"{tp / best:.2f}x" if tp and best else "-", fnum(r.get("waiter_p99_ms"), 1)]
            exact = exact and r.get("counter_ok", True) and not r.get("overlaps")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
    return lines


def store_section(store: dict[str, Any], data: dict[str, Any], img: Path) -> list[str]:
    lines = [f"## {store['title']}", ""]
    rows = store["cycles"](data)
    if not rows:
        return [*lines, "Not measured in this run (its bench failed or was not run: see its .txt log).", ""]
    sync_rows, async_rows = rows, {}
    if "async_floor" in store:
        afloor, anames = store["async_floor"]
        async_rows = {n: rows[n] for n in [afloor, *anames] if n in rows}
        sync_rows = {n: r for n, r in rows.items() if n not in async_rows}
    table, best = cycle_table(sync_rows, store["floor"], store["peers"])
    peer = sync_rows[best]["label"] if best else "none: no Python library for this store was measured"
    lines += ["Uncontended lock/unlock cycles, one thread, a key per row, runs interleaved.", ""]
    lines += [f"Best Python peer: {peer}.", "", *table, ""]
    if async_rows:
        atable, _ = cycle_table(async_rows, store["async_floor"][0], [])
        lines += ["asyncio, on one event loop, against the asyncio floor:", "", *atable, ""]
    keep = [store["floor"], *([best] if best else []), *[n for n in sync_rows if n.startswith("la-")]]
    name = f"bench-{store['slug']}-cost.png"
    plot_cost(img / name, f"{store['title']}: cost of one cycle", sync_rows, keep)
    lines += [f"![{store['title']}: cost of one cycle]({img.name}/{name})", ""]
    if "contention" in store:
        series = contention_series(data, store)
        if series:
            tp, cdf = f"bench-{store['slug']}-throughput.png", f"bench-{store['slug']}-waiters.png"
            at = plot_contention(img / tp, img / cdf, store["title"], series)
            peers = [contention_label(data, store, n) for n in store.get("peer_contention", [])]
            lines += ["P processes contend for ONE key (acquire, GET + SET a counter, release, 1 ms pause).", ""]
            lines += [*contention_table(series, peers), ""]
            lines += [f"![{store['title']}: sections/s against processes]({img.name}/{tp})", ""]
            if at is not None:
                lines += [f"![{store['title']}: waiters' latency CDF at P = {at}]({img.name}/{cdf})", ""]
    else:
        lines += [store.get("contention_note", "Contention on one key is not measured for this store yet."), ""]
    return lines


def contention_label(data: dict[str, Any], store: dict[str, Any], name: str) -> str:
    bench, _ = store["contention"]
    return data.get(bench, {}).get("contention", {}).get("labels", {}).get(name, name)


def write_page(data: dict[str, Any], meta: dict[str, Any], out: Path, img: Path) -> None:
    img.mkdir(parents=True, exist_ok=True)
    m = meta["machine"]
    quick = meta["quick"]
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by bench/make_page.py (make bench); rerun it to refresh the figures. -->",
        "",
        "Every store lockaspect has, measured in one run on one machine: uncontended lock/unlock",
        "cycles against the store's raw floor (the least a correct lock costs with the same driver)",
        "and the best Python peer, the cost of one cycle split into client CPU, server CPU and what",
        "remains (the wire and scheduling), and, where the store has a contention bench, critical",
        "sections per second against processes and the waiters' latency CDF. Ratios above 1.0 are",
        "faster than the row compared with. The scripts and their fairness rules are in",
        "[bench/README.md](https://github.com/lockaspect/lockaspect/blob/main/bench/README.md).",
        "",
        "## How to run",
        "",
        "```sh",
        "make bench                                   # every bench, then this page (about 25 minutes on 2 cores)",
        ".venv/bin/python bench/make_page.py --quick  # the same page from short runs (a few minutes; noisy)",
        ".venv/bin/python bench/make_page.py --from-json bench/results/page-DATE  # the page again from saved JSON",
        "```",
        "",
        "## The run below",
        "",
    ]
    if quick:
        lines += ["**Quick run: noisy.** Every bench ran with `--quick`; read shapes, not figures.", ""]
    lines += [
        f"* date: {meta['date']}; command: `{meta['command']}`",
        f"* CPU: {m['cpu_model']}, {m['cpu_logical']} logical cores; load average {m['loadavg_start']} at the start, "
        f"{m.get('loadavg_end', '?')} at the end",
        f"* {m['python']} on {m['os']}",
        "* versions: " + ", ".join(f"{k} {v}" for k, v in versions(data).items()),
        "* every server runs on the same machine as the client, on loopback; the CPU columns come from",
        "  `time.process_time` (client) and the server's own CPU time (Redis `INFO cpu`, the PostgreSQL and",
        "  ZooKeeper processes through psutil; SQLite and memory:// have no server)",
        "* wire/other: the wall time of a cycle less the client's and the server's CPU time (loopback, scheduling,",
        "  waits); it reads 0 where the two CPU times add up to more than the wall time, as they can when the",
        "  server works while the client already runs its next step (the asyncio rows often do)",
        "* ratios: the median over the interleaved rounds of a row's run divided by the floor's (or the best",
        "  peer's) run of the same round",
    ]
    for name, run in meta.get("runs", {}).items():
        if run["exit"]:
            lines.append(f"* {name}: exit status {run['exit']} (see its .txt log beside the JSON)")
    if meta.get("high_load"):
        lines.append(f"* {meta['high_load']}")
    lines.append("")
    for store in STORES:
        lines += store_section(store, data, img)
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="every bench with --quick (a few minutes; noisy)")
    p.add_argument("--from-json", metavar="DIR", help="read DIR's JSON instead of running the benches")
    p.add_argument("--json-dir", help="where the runs' JSON and logs go (default bench/results/page-<date>[-quick])")
    p.add_argument("--benches", default=",".join(BENCHES), help=f"subset of {','.join(BENCHES)}")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="the page to write")
    p.add_argument("--img", default=str(ROOT / "docs" / "img"), help="the folder of its plots")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    if args.from_json:
        json_dir = Path(args.from_json)
        meta = json.loads((json_dir / "page.json").read_text(encoding="utf-8"))
    else:
        stamp = datetime.date.today().isoformat() + ("-quick" if args.quick else "")
        json_dir = Path(args.json_dir or HERE / "results" / f"page-{stamp}")
        json_dir.mkdir(parents=True, exist_ok=True)
        names = [n for n in args.benches.split(",") if n]
        meta = {"machine": machine(), "quick": args.quick, "date": datetime.date.today().isoformat()}
        meta["command"] = "python bench/make_page.py" + (" --quick" if args.quick else "")
        meta["runs"] = run_benches(names, json_dir, args.quick)
        meta["machine"]["loadavg_end"] = _util.loadavg()
        (json_dir / "page.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    data = {}
    for name in BENCHES:
        path = json_dir / f"{name}.json"
        if path.exists():
            data[name] = json.loads(path.read_text(encoding="utf-8"))
    write_page(data, meta, Path(args.out), Path(args.img))
    print(f"wrote {args.out} and its plots in {args.img} from {json_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
