"""Running :mod:`._ops` generators on database connections: a pool of idle connections, the
sync driver (any DB-API connection in autocommit: sqlite3, psycopg) and the async one
(psycopg's ``AsyncConnection``). Both drive the same generators, so they share every
decision; what differs per database comes in a :class:`Backend`.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, NamedTuple, TypeVar

from ....errors import BackendError
from ._ops import Begin, Counted, Op, Query, Rollback
from ._sql import Dialect

__all__ = ["AsyncDriver", "Backend", "Pool", "SyncDriver", "socket_alive"]

_T = TypeVar("_T")
_C = TypeVar("_C")


class Backend(NamedTuple):
    """What a driver needs to know of one database.

    Attributes:
        dialect: Its statements.
        label: How errors name it (a path or a redacted URL).
        transient: For a driver exception: ``True`` when a retry may succeed (busy, a lost
            connection), ``False`` when not, ``None`` when it is not the driver's.
        broken: For a driver exception: the connection cannot be used again.
        serialise: The statement (one ``:k`` parameter) that serialises writers of one key
            inside a transaction, and the key's parameter, or ``None`` (SQLite: its write
            transaction serialises every writer).
        alive: For an idle connection about to be used: ``False`` when it is known dead (the
            server closed it: a restart, a terminated backend), so that it is replaced before
            an operation fails on it; ``None``: no such check (SQLite: no server).
    """

    dialect: Dialect
    label: str
    transient: Callable[[BaseException], bool | None]
    broken: Callable[[BaseException], bool]
    serialise: tuple[str, Callable[[str], int]] | None = None
    alive: Callable[[Any], bool] | None = None
    hint: Callable[[BaseException], str] | None = None


def socket_alive(conn: Any) -> bool:
    """Whether libpq connection ``conn`` (idle, in autocommit) may still be used: open, out of
    any transaction, and with nothing to read. An idle connection is sent nothing, so anything
    readable is the server's goodbye (the end of the stream, or the error that precedes it)."""
    try:
        if conn.closed or conn.info.transaction_status != 0:  # 0: TransactionStatus.IDLE
            return False
        fd = conn.pgconn.socket
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
            return not poller.poll(0)
        return not select.select([fd], [], [], 0)[0]  # pragma: no cover - Windows only
    except Exception:  # noqa: BLE001 - a connection we cannot even inspect is not usable
        return False


class Pool(Generic[_C]):
    """Idle connections, handed out one per operation; at most ``keep`` are kept idle. An idle
    connection that ``alive`` finds dead is closed and replaced when taken."""

    def __init__(
        self,
        connect: Callable[[], _C],
        close: Callable[[_C], None],
        keep: int = 8,
        alive: Callable[[_C], bool] | None = None,
    ) -> None:
        self._connect = connect
        self._close = close
        self._keep = keep
        self._alive = alive
        self._idle: list[_C] = []
        self._lock = threading.Lock()
        self.closed = False

    def take(self) -> _C:
        while True:
            try:
                conn = self._idle.pop()  # atomic: no lock on the hot path
            except IndexError:
                return self._connect()
            if self._alive is None or self._alive(conn):
                return conn
            self.discard(conn)

    def give(self, conn: _C) -> None:
        if not self.closed and len(self._idle) < self._keep:  # racing gives may keep one or two more
            self._idle.append(conn)
            self._close_if_closed()  # close() may have run meanwhile and missed it
            return
        self.discard(conn)

    def _close_if_closed(self) -> None:
        if self.closed:
            self.close()

    def discard(self, conn: _C) -> None:
        try:
            self._close(conn)
        except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is gone anyway
            pass

    def forget(self) -> None:
        """In a forked child: the idle connections are the parent's; drop them unclosed (closing
        would end the parent's sessions)."""
        self._lock = threading.Lock()
        self._idle = []

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            self.discard(conn)


def _rows(cursor: Any) -> list[Any]:
    return list(cursor.fetchall()) if cursor.description is not None else []


class _DriverBase:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.dialect = backend.dialect
        self._now = f"SELECT {backend.dialect.now}"

    def error(self, exc: BaseException, key: str | None, action: str) -> BaseException:
        """``exc`` as lockaspect reports it: a :class:`BackendError` for the driver's errors."""
        transient = self.backend.transient(exc)
        if transient is None:
            return exc
        hint = self.backend.hint(exc) if self.backend.hint is not None else ""
        message = f"{action} on {self.backend.label} failed: {exc}".rstrip() + hint
        return BackendError(message, key=key, transient=transient)


class SyncDriver(_DriverBase):
    """Runs operations on pooled connections (each in autocommit; a :class:`Begin` opens an
    explicit transaction, committed when the operation returns)."""

    def __init__(self, backend: Backend, pool: Pool[Any]) -> None:
        super().__init__(backend)
        self.pool = pool

    def rows(self, query: Query, key: str | None, action: str) -> list[Any]:
        """The rows of one statement in autocommit (errors as :meth:`run` raises them)."""
        rows: list[Any] = self._one(query, key, action, False)
        return rows

    def count(self, query: Query, key: str | None, action: str) -> int:
        """How many rows one statement without results changed, in autocommit."""
        count: int = self._one(query, key, action, True)
        return count

    def _one(self, query: Query, key: str | None, action: str, count: bool) -> Any:
        pool = self.pool
        conn = None
        try:
            conn = pool.take()
            cursor = conn.execute(query.sql, query.params)
            if count:
                rows: Any = cursor.rowcount
            else:
                rows = list(cursor.fetchall()) if cursor.description is not None else []
        except BaseException as exc:
            self._failed(exc, conn)
            failure = self.error(exc, key, action)
            if failure is exc:
                raise
            raise failure from exc
        pool.give(conn)
        return rows

    def _failed(self, exc: BaseException, conn: Any) -> None:
        """Give back or drop ``conn`` after ``exc``: a driver error on a healthy connection
        keeps it; anything else (an interrupt mid-statement) leaves its state unknown."""
        if conn is None:
            return
        in_transaction = getattr(conn, "in_transaction", False) is True  # sqlite3's; libpq's is checked when taken
        if self.backend.transient(exc) is not None and not self.backend.broken(exc) and not in_transaction:
            self.pool.give(conn)
        else:
            self.pool.discard(conn)

    def run(self, op: Op[_T], key: str | None, action: str) -> _T:
        """The result of ``op``; driver errors raised as :class:`BackendError` carrying ``key``."""
        try:
            conn = self.pool.take()
        except BaseException as exc:
            op.close()
            failure = self.error(exc, key, action)
            if failure is exc:
                raise
            raise failure from exc
        try:
            result = self._drive(conn, op)
        except BaseException as exc:
            self._failed(exc, conn)
            failure = self.error(exc, key, action)
            if failure is exc:
                raise
            raise failure from exc
        self.pool.give(conn)
        return result

    def _drive(self, conn: Any, op: Op[_T]) -> _T:
        in_transaction = False
        try:
            step = next(op)
            while True:
                if type(step) is Query:
                    sent: Any = _rows(conn.execute(step.sql, step.params))
                elif type(step) is Counted:
                    sent = conn.execute(step.sql, step.params).rowcount
                else:
                    assert isinstance(step, Begin)
                    conn.execute(self.dialect.begin)
                    in_transaction = True
                    serialise = self.backend.serialise
                    if serialise is not None:
                        for name in sorted(step.names):
                            conn.execute(serialise[0], {"k": serialise[1](name)})
                    sent = float(conn.execute(self._now).fetchone()[0])
                step = op.send(sent)
        except StopIteration as stop:
            if in_transaction:
                self._end(conn, "COMMIT")
            return stop.value  # type: ignore[no-any-return]
        except Rollback as rollback:
            self._end(conn, "ROLLBACK")
            return rollback.result  # type: ignore[no-any-return]
        except BaseException:
            op.close()
            if in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except Exception:  # noqa: BLE001 - the caller discards the connection
                    pass
            raise

    @staticmethod
    def _end(conn: Any, sql: str) -> None:
        """End the transaction with ``sql``; if that fails (SQLite's COMMIT is busy while
        another connection reads a file in rollback-journal mode, a full disk), roll it back,
        so that the connection goes back to the pool outside any transaction (else it would
        keep the file's write lock, and run later statements in a transaction never committed)."""
        try:
            conn.execute(sql)
        except BaseException:
            try:
                conn.execute("ROLLBACK")
            except Exception:  # noqa: BLE001 - _failed drops a connection still in a transaction
                pass
            raise


class AsyncDriver(_DriverBase):
    """:class:`SyncDriver` for psycopg's ``AsyncConnection`` (one event loop)."""

    def __init__(self, backend: Backend, connect: Callable[[], Awaitable[Any]], keep: int = 8) -> None:
        super().__init__(backend)
        self._connect = connect
        self._keep = keep
        self._idle: list[Any] = []
        self.closed = False

    async def rows(self, query: Query, key: str | None, action: str) -> list[Any]:
        """The rows of one statement in autocommit."""

        def one() -> Op[list[Any]]:
            return (yield query)  # type: ignore[no-any-return]

        return await self.run(one(), key, action)

    async def count(self, query: Query, key: str | None, action: str) -> int:
        """How many rows one statement without results changed, in autocommit."""

        def one() -> Op[int]:
            return (yield Counted(query.sql, query.params))  # type: ignore[no-any-return]

        return await self.run(one(), key, action)

    async def _take(self) -> Any:
        alive = self.backend.alive
        while self._idle:
            conn = self._idle.pop()
            if alive is None or alive(conn):
                return conn
            await self._discard(conn)
        return await self._connect()

    async def run(self, op: Op[_T], key: str | None, action: str) -> _T:
        try:
            conn = await self._take()
        except BaseException as exc:
            op.close()
            failure = self.error(exc, key, action)
            if failure is exc:
                raise
            raise failure from exc
        try:
            result = await self._drive(conn, op)
        except BaseException as exc:
            broken = self.backend.transient(exc) is None or self.backend.broken(exc)
            await self._discard(conn) if broken else self._give(conn)
            failure = self.error(exc, key, action)
            if failure is exc:
                raise
            raise failure from exc
        self._give(conn)
        return result

    def _give(self, conn: Any) -> None:
        if not self.closed and len(self._idle) < self._keep:
            self._idle.append(conn)
        else:
            conn.pgconn.finish()  # closes the socket without awaiting: nothing is in flight

    @staticmethod
    async def _discard(conn: Any) -> None:
        try:
            await conn.close()
        except Exception:  # noqa: BLE001 - it is gone anyway
            pass

    async def _drive(self, conn: Any, op: Op[_T]) -> _T:
        in_transaction = False
        try:
            step = next(op)
            while True:
                if type(step) is Query:
                    cursor = await conn.execute(step.sql, step.params)
                    sent: Any = await cursor.fetchall() if cursor.description is not None else []
                elif type(step) is Counted:
                    sent = (await conn.execute(step.sql, step.params)).rowcount
                else:
                    assert isinstance(step, Begin)
                    await conn.execute(self.dialect.begin)
                    in_transaction = True
                    serialise = self.backend.serialise
                    if serialise is not None:
                        for name in sorted(step.names):
                            await conn.execute(serialise[0], {"k": serialise[1](name)})
                    cursor = await conn.execute(self._now)
                    sent = float((await cursor.fetchone())[0])
                step = op.send(sent)
        except StopIteration as stop:
            if in_transaction:
                await conn.execute("COMMIT")
            return stop.value  # type: ignore[no-any-return]
        except Rollback as rollback:
            await conn.execute("ROLLBACK")
            return rollback.result  # type: ignore[no-any-return]
        except BaseException:
            op.close()
            raise  # the caller discards the connection: its transaction state is unknown

    async def aclose(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._discard(conn)

    def forget(self) -> None:
        self._idle = []
