"""The shop's own data (the stock, the orders, the customers, and the fenced ledger),
kept in the same store as the locks: Redis (``redis://``, ``rediss://``, ``unix://``) or
SQLite (``sqlite:///<path>``), picked by the URL's scheme.

This is the application's data, not the library's: the demo reaches it with the plain
drivers (redis-py, the standard library's ``sqlite3``), never through lockaspect. Every
run keeps its data apart from other runs under its own prefix (a key prefix on Redis, a
``run`` column on SQLite) and deletes it at the end with :meth:`ShopData.cleanup`.

The ledger is written through a fence: on Redis :class:`~lockaspect.fencing.RedisFence`,
on SQLite the fenced ``UPDATE`` that :mod:`lockaspect.fencing` documents.
"""

from __future__ import annotations

import sqlite3
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from lockaspect.fencing import RedisFence

__all__ = ["DataUnavailable", "RedisData", "ShopData", "SqliteData", "open_data", "resolve_url"]

_REDIS_SCHEMES = ("redis", "rediss", "unix")

#: Seconds an SQLite statement waits for another process's write before it fails.
SQLITE_BUSY_TIMEOUT = 10.0


class DataUnavailable(Exception):
    """The URL names no store the demo can use (a bad URL, a missing directory, no server)."""


def resolve_url(url: str) -> str:
    """``url`` as every process of the run should open it. A relative SQLite path
    (``sqlite:///demo.db``) is made absolute, so the workers find the same file whatever
    their working directory; other URLs are returned unchanged.

    Raises:
        DataUnavailable: a scheme the demo does not run on, a malformed SQLite URL, or a
            SQLite file whose directory does not exist.
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        parts = urlsplit(url)
        path = _sqlite_path(url)
        if not path.parent.is_dir():
            given = Path(unquote(parts.path[1:]))
            hint = "" if given.is_absolute() else f"; for an absolute path write sqlite:////{given}"
            raise DataUnavailable(f"cannot create {path}: the directory {str(path.parent)!r} does not exist{hint}")
        query = f"?{parts.query}" if parts.query else ""
        return f"sqlite:///{path}{query}"  # an absolute path: sqlite:////abs/path.db
    if scheme in _REDIS_SCHEMES:
        return url
    raise DataUnavailable(
        f"the demo runs on redis://host:port/db (or rediss://, unix://) or sqlite:///<path>, got {url!r}"
    )


def open_data(url: str, prefix: str, *, create: bool = False) -> ShopData:
    """The shop's data of the run ``prefix`` in the store at ``url`` (see :func:`resolve_url`).
    ``create``: prepare the store (the parent does, once; the workers only connect).

    Raises:
        DataUnavailable: the store cannot be reached or opened.
    """
    url = resolve_url(url)
    if urlsplit(url).scheme.lower() == "sqlite":
        return SqliteData(_sqlite_path(url), prefix, create=create)
    return RedisData(url, prefix)


class ShopData(ABC):
    """The shop's data of one run. ``errors`` are the driver's exceptions (a failed read of
    the final state is reported, not raised as a traceback)."""

    errors: tuple[type[Exception], ...]
    #: Where the data lives, for the demo's output.
    where: str
    #: What the demo leaves in the store for this run, and that :meth:`cleanup` deletes.
    footprint: str

    @abstractmethod
    def set_stock(self, voucher: str, left: int) -> None: ...

    @abstractmethod
    def stock_left(self, voucher: str) -> int: ...

    @abstractmethod
    def has_ordered(self, user_id: int) -> bool: ...

    @abstractmethod
    def record_order(self, user_id: int, voucher: str) -> None:
        """Append the order and add the customer, in one transaction."""

    @abstractmethod
    def order_count(self) -> int: ...

    @abstractmethod
    def customers(self) -> list[int]: ...

    @abstractmethod
    def fenced_write(self, resource: str, value: str, token: int) -> bool:
        """Write ``value`` unless a newer fencing token wrote ``resource`` first."""

    @abstractmethod
    def fenced_read(self, resource: str) -> str | None: ...

    @abstractmethod
    def high_water(self, resource: str) -> int | None:
        """The newest fencing token that wrote ``resource`` (None: never written)."""

    @abstractmethod
    def cleanup(self) -> None:
        """Delete everything of this run."""

    @abstractmethod
    def close(self) -> None: ...


class RedisData(ShopData):
    """The shop on Redis: keys under the run's prefix, the ledger behind a :class:`RedisFence`."""

    errors = (redis.RedisError,)

    def __init__(self, url: str, prefix: str) -> None:
        self.prefix = prefix
        self.where = url
        self.footprint = f"the demo's keys live under {prefix!r} and are deleted at the end"
        try:
            self.store: Any = redis.Redis.from_url(url, socket_timeout=10)
        except ValueError as exc:  # a malformed URL
            raise DataUnavailable(f"cannot use {url}: {exc}") from None
        try:
            self.store.ping()
        except redis.RedisError as exc:
            self.store.close()
            raise DataUnavailable(f"cannot reach {url}: {exc}") from None
        self.fence = RedisFence(self.store, namespace=prefix + "fenced:")

    def set_stock(self, voucher: str, left: int) -> None:
        self.store.set(self.prefix + f"stock:{voucher}", left)

    def stock_left(self, voucher: str) -> int:
        return int(self.store.get(self.prefix + f"stock:{voucher}") or 0)

    def has_ordered(self, user_id: int) -> bool:
        return bool(self.store.sismember(self.prefix + "customers", user_id))

    def record_order(self, user_id: int, voucher: str) -> None:
        pipe = self.store.pipeline(transaction=True)
        pipe.rpush(self.prefix + "orders", f"{user_id}:{voucher}")
        pipe.sadd(self.prefix + "customers", user_id)
        pipe.execute()

    def order_count(self) -> int:
        return int(self.store.llen(self.prefix + "orders"))

    def customers(self) -> list[int]:
        return [int(uid) for uid in self.store.smembers(self.prefix + "customers")]

    def fenced_write(self, resource: str, value: str, token: int) -> bool:
        return bool(self.fence.write(resource, value, token))

    def fenced_read(self, resource: str) -> str | None:
        value = self.fence.read(resource)
        return value.decode() if value is not None else None

    def high_water(self, resource: str) -> int | None:
        mark: int | None = self.fence.high_water(resource)
        return mark

    def cleanup(self) -> None:
        """Delete every key of this run (all under the prefix, the locks' keys included)."""
        keys = list(self.store.scan_iter(match=self.prefix + "*", count=500))
        for start in range(0, len(keys), 500):
            self.store.delete(*keys[start : start + 500])

    def close(self) -> None:
        self.store.close()


# -- SQLite ------------------------------------------------------------------------------

#: The demo's tables, next to the lock store's (``lockaspect_*``) in the same file. Each row
#: belongs to one run (``run``: the run's prefix).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS lockaspect_demo_stock (
    run TEXT NOT NULL, voucher TEXT NOT NULL, left INTEGER NOT NULL, PRIMARY KEY (run, voucher)
);
CREATE TABLE IF NOT EXISTS lockaspect_demo_orders (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT NOT NULL, user_id INTEGER NOT NULL, voucher TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS lockaspect_demo_orders_run ON lockaspect_demo_orders (run);
CREATE TABLE IF NOT EXISTS lockaspect_demo_customers (
    run TEXT NOT NULL, user_id INTEGER NOT NULL, PRIMARY KEY (run, user_id)
);
CREATE TABLE IF NOT EXISTS lockaspect_demo_fenced (
    run TEXT NOT NULL, name TEXT NOT NULL, value TEXT, fence INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (run, name)
);
"""
_TABLES = ("lockaspect_demo_stock", "lockaspect_demo_orders", "lockaspect_demo_customers", "lockaspect_demo_fenced")
#: The lock store's tables whose rows are named by the namespaced lock key. The demo's lock
#: namespace is unique to the run, so its rows (fencing counters included) can go with it.
_LOCK_TABLES = ("lockaspect_holds", "lockaspect_waiters", "lockaspect_fences", "lockaspect_semaphores")


def _sqlite_path(url: str) -> Path:
    """The absolute path of ``sqlite:///<path>`` (relative to the working directory) or
    ``sqlite:////<absolute path>``, as SQLAlchemy spells them."""
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/") or parts.path == "/" or parts.fragment:
        raise DataUnavailable(f"a SQLite URL is sqlite:///<relative path> or sqlite:////<absolute path>, got {url!r}")
    path = unquote(parts.path[1:])
    if path == ":memory:" or path.startswith("file:"):
        raise DataUnavailable(f"{url!r}: the demo's processes need a database file, not {path!r}")
    return Path(path).absolute()


class SqliteData(ShopData):
    """The shop in the lock store's SQLite file: tables ``lockaspect_demo_*`` with the run's
    prefix in a ``run`` column; the ledger written by a fenced ``UPDATE``."""

    errors = (sqlite3.Error,)

    def __init__(self, path: Path, prefix: str, *, create: bool) -> None:
        self.prefix = prefix
        self.where = str(path)
        self.footprint = (
            f"the demo's rows (run {prefix!r} in the tables lockaspect_demo_*, and its locks' rows "
            f"under {prefix!r}) are deleted at the end"
        )
        if not path.parent.is_dir():
            raise DataUnavailable(f"cannot create {path}: the directory {str(path.parent)!r} does not exist")
        try:
            self.conn = sqlite3.connect(
                str(path), timeout=SQLITE_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise DataUnavailable(f"cannot open {path}: {exc}") from None
        try:
            self.conn.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT * 1000)}")
            if create:
                self.conn.execute("PRAGMA journal_mode = WAL")
                self.conn.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            self.conn.close()
            raise DataUnavailable(f"cannot use {path}: {exc}") from None

    def _one(self, sql: str, *args: Any) -> Any:
        row = self.conn.execute(sql, args).fetchone()
        return None if row is None else row[0]

    def set_stock(self, voucher: str, left: int) -> None:
        self.conn.execute(
            "INSERT INTO lockaspect_demo_stock (run, voucher, left) VALUES (?, ?, ?) "
            "ON CONFLICT (run, voucher) DO UPDATE SET left = excluded.left",
            (self.prefix, voucher, left),
        )

    def stock_left(self, voucher: str) -> int:
        left = self._one("SELECT left FROM lockaspect_demo_stock WHERE run = ? AND voucher = ?", self.prefix, voucher)
        return int(left or 0)

    def has_ordered(self, user_id: int) -> bool:
        sql = "SELECT 1 FROM lockaspect_demo_customers WHERE run = ? AND user_id = ?"
        return self._one(sql, self.prefix, user_id) is not None

    def record_order(self, user_id: int, voucher: str) -> None:
        with self.conn:  # BEGIN IMMEDIATE ... COMMIT (or ROLLBACK)
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute(
                "INSERT INTO lockaspect_demo_orders (run, user_id, voucher) VALUES (?, ?, ?)",
                (self.prefix, user_id, voucher),
            )
            self.conn.execute(
                "INSERT OR IGNORE INTO lockaspect_demo_customers (run, user_id) VALUES (?, ?)", (self.prefix, user_id)
            )

    def order_count(self) -> int:
        return int(self._one("SELECT count(*) FROM lockaspect_demo_orders WHERE run = ?", self.prefix))

    def customers(self) -> list[int]:
        rows = self.conn.execute("SELECT user_id FROM lockaspect_demo_customers WHERE run = ?", (self.prefix,))
        return [int(user_id) for (user_id,) in rows]

    def fenced_write(self, resource: str, value: str, token: int) -> bool:
        # The resource's row exists from its first write on, with the lowest mark (0).
        self.conn.execute(
            "INSERT OR IGNORE INTO lockaspect_demo_fenced (run, name, value, fence) VALUES (?, ?, NULL, 0)",
            (self.prefix, resource),
        )
        # The fence is part of the write itself (lockaspect.fencing): no row updated means a
        # newer holder wrote first, and this writer is stale.
        cursor = self.conn.execute(
            "UPDATE lockaspect_demo_fenced SET value = ?, fence = ? WHERE run = ? AND name = ? AND fence <= ?",
            (value, token, self.prefix, resource, token),
        )
        return cursor.rowcount == 1

    def fenced_read(self, resource: str) -> str | None:
        value = self._one("SELECT value FROM lockaspect_demo_fenced WHERE run = ? AND name = ?", self.prefix, resource)
        return None if value is None else str(value)

    def high_water(self, resource: str) -> int | None:
        mark = self._one("SELECT fence FROM lockaspect_demo_fenced WHERE run = ? AND name = ?", self.prefix, resource)
        return None if not mark else int(mark)

    def cleanup(self) -> None:
        """Delete this run's rows: the shop's, and the lock store's under the run's prefix."""
        existing = {name for (name,) in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        with self.conn:  # BEGIN IMMEDIATE ... COMMIT (or ROLLBACK)
            self.conn.execute("BEGIN IMMEDIATE")
            for table in _TABLES:
                if table in existing:
                    self.conn.execute(f"DELETE FROM {table} WHERE run = ?", (self.prefix,))
            for table in _LOCK_TABLES:
                if table in existing:
                    self.conn.execute(
                        f"DELETE FROM {table} WHERE substr(name, 1, ?) = ?",
                        (len(self.prefix), self.prefix),
                    )

    def close(self) -> None:
        self.conn.close()
