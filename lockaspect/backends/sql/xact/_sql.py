"""The statements of a transaction-scoped lock and the order they run in, without I/O.

:func:`acquire` is a generator: it yields each statement (``(sql, params)``; ``params`` is
``None`` for a statement that returns no row) and receives its first row; an adapter drives it
(:func:`run` for a sync connection, :func:`arun` for an async one) and throws the driver's
exception into it when a statement fails. Parameters are written ``%(name)s`` (psycopg,
Django); the SQLAlchemy adapter rewrites them to ``:name``.

- ``wait=0``: one statement, no savepoint. ``pg_try_advisory_xact_lock`` and, only if it
  granted the lock, ``nextval`` of the fence sequence (a ``CASE`` fixes the order).
- ``wait>0`` / ``None``: ``SAVEPOINT``, then one statement that remembers ``lock_timeout``,
  sets it to the wait (``0``: no limit) for this transaction, waits in
  ``pg_advisory_xact_lock``, takes the fence and puts ``lock_timeout`` back; then ``RELEASE``.
  A timeout (SQLSTATE 55P03) or a deadlock (40P01) rolls back to the savepoint, which also
  undoes the setting, so the caller's transaction stays usable, and becomes
  :class:`~lockaspect.LockNotAcquired`.

Nested ``OFFSET 0`` subqueries order the steps of one statement (each is evaluated before the
query around it reads its row). The fence sequence is looked up with ``to_regclass``, so a
missing one is reported (:class:`~lockaspect.ConfigurationError`) without an error that would
abort the caller's transaction, and without taking the lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, Final

from ....errors import BackendError, ConfigurationError, LockNotAcquired

__all__ = ["FENCE_SEQUENCE", "Step", "acquire", "arun", "reenter", "run", "sqlstate"]

#: The sequence every PostgreSQL lock of lockaspect takes its fencing tokens from (shared with
#: the session-mode ``postgresql://`` store, so tokens of a key increase across both).
FENCE_SEQUENCE: Final = "lockaspect_fence"

Step = tuple[str, "Mapping[str, Any] | None"]
Row = tuple[Any, ...]

_TRY: Final = """\
SELECT f.seq IS NOT NULL,
       CASE WHEN f.seq IS NULL THEN NULL WHEN {function}(CAST(%(key)s AS bigint)) THEN nextval(f.seq) END
  FROM (SELECT to_regclass('{sequence}') AS seq OFFSET 0) AS f"""

_WAIT: Final = """\
SELECT g.seq IS NOT NULL, CASE WHEN g.seq IS NOT NULL THEN nextval(g.seq) END,
       set_config('lock_timeout', g.old, true)
  FROM (SELECT t.seq, t.old, CASE WHEN t.seq IS NOT NULL THEN {function}(CAST(%(key)s AS bigint))::text END AS granted
          FROM (SELECT o.seq, o.old, set_config('lock_timeout', %(timeout)s, true) AS changed
                  FROM (SELECT to_regclass('{sequence}') AS seq, current_setting('lock_timeout') AS old
                        OFFSET 0) AS o
                OFFSET 0) AS t
        OFFSET 0) AS g"""

_REENTER: Final = "SELECT {function}(CAST(%(key)s AS bigint))"

SAVEPOINT: Final = "SAVEPOINT lockaspect_wait"
RELEASE: Final = "RELEASE SAVEPOINT lockaspect_wait"
ROLLBACK: Final = "ROLLBACK TO SAVEPOINT lockaspect_wait"

LOCK_TIMEOUT, DEADLOCK = "55P03", "40P01"


def _function(shared: bool, wait: bool) -> str:
    return ("pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock") + ("_shared" if shared else "")


def statement(sql: str, shared: bool, wait: bool) -> str:
    return sql.format(function=_function(shared, wait), sequence=FENCE_SEQUENCE)


def timeout_setting(wait: float | None) -> str:
    """``lock_timeout`` for a wait of ``wait`` seconds (``None``: ``"0"``, no limit)."""
    return "0" if wait is None else f"{max(1, math.ceil(wait * 1000))}ms"


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error, or of the one a SQLAlchemy or Django error wraps."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        for name in ("sqlstate", "pgcode"):
            code = getattr(seen, name, None)
            if isinstance(code, str):
                return code
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


def _failed(exc: BaseException, key: str, what: str) -> BackendError:
    code = sqlstate(exc)
    state = f" (SQLSTATE {code})" if code else ""
    return BackendError(f"{what} {key!r} failed{state}: {type(exc).__name__}: {exc}", key=key)


def _missing(key: str) -> ConfigurationError:
    return ConfigurationError(
        f"cannot lock {key!r}: the fence sequence {FENCE_SEQUENCE} does not exist in this database "
        f"(looked up through the search_path). Create it once, e.g. in a migration: "
        f"CREATE SEQUENCE IF NOT EXISTS {FENCE_SEQUENCE} AS BIGINT; nothing was locked",
        key=key,
    )


def acquire(key: str, advisory: int, wait: float | None, shared: bool) -> Generator[Step, Row | None, int]:
    """Take the lock on ``advisory`` (the hash of the namespaced ``key``) in the caller's
    transaction; return the fencing token."""
    if wait == 0:
        try:
            row = yield statement(_TRY, shared, False), {"key": advisory}
        except Exception as exc:
            raise _failed(exc, key, "locking") from exc
        assert row is not None
        if not row[0]:
            raise _missing(key)
        if row[1] is None:
            raise LockNotAcquired(f"lock {key!r} is held by another session or transaction", key=key, waited=0.0)
        return int(row[1])
    started = time.monotonic()
    try:
        yield SAVEPOINT, None
    except Exception as exc:
        raise _failed(exc, key, "locking") from exc
    try:
        row = yield statement(_WAIT, shared, True), {"key": advisory, "timeout": timeout_setting(wait)}
    except Exception as exc:
        waited = time.monotonic() - started
        try:
            yield ROLLBACK, None
            yield RELEASE, None
        except Exception:  # noqa: BLE001 - the transaction is broken; the first error says why
            raise _failed(exc, key, "locking") from exc
        code = sqlstate(exc)
        if code == LOCK_TIMEOUT:
            raise LockNotAcquired(
                f"lock {key!r} stayed held by another session or transaction for {waited:.3f} s", key=key, waited=waited
            ) from None
        if code == DEADLOCK:
            raise LockNotAcquired(
                f"lock {key!r}: PostgreSQL detected a deadlock while waiting (this transaction holds a lock "
                "the holder waits for); take locks in one fixed order",
                key=key,
                waited=waited,
            ) from exc
        raise _failed(exc, key, "locking") from exc
    except BaseException:  # cancelled or interrupted while waiting: the caller's transaction stays usable
        try:
            yield ROLLBACK, None
            yield RELEASE, None
        except BaseException:  # noqa: BLE001 - the first interruption is the one to report
            pass
        raise
    try:
        yield RELEASE, None
    except Exception as exc:
        raise _failed(exc, key, "locking") from exc
    assert row is not None
    if not row[0]:
        raise _missing(key)
    return int(row[1])


def reenter(key: str, advisory: int, shared: bool) -> Generator[Step, Row | None, bool]:
    """Take the lock again in this transaction, which holds it already (granted at once;
    advisory locks stack): ``False`` if it does not hold it any more and another one does."""
    try:
        row = yield statement(_REENTER, shared, False), {"key": advisory}
    except Exception as exc:
        raise _failed(exc, key, "re-entering") from exc
    assert row is not None
    return bool(row[0])


def run(steps: Generator[Step, Row | None, Any], execute: Callable[[Step], Row | None]) -> Any:
    """Drive ``steps`` on a sync connection."""
    step = next(steps)
    while True:
        try:
            row = execute(step)
        except BaseException as exc:  # noqa: BLE001 - thrown into the steps, which map it or re-raise it
            try:
                step = steps.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            step = steps.send(row)
        except StopIteration as stop:
            return stop.value


async def arun(steps: Generator[Step, Row | None, Any], execute: Callable[[Step], Awaitable[Row | None]]) -> Any:
    """Drive ``steps`` on an async connection."""
    step = next(steps)
    while True:
        try:
            row = await execute(step)
        except BaseException as exc:  # noqa: BLE001 - thrown into the steps, which map it or re-raise it
            try:
                step = steps.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            step = steps.send(row)
        except StopIteration as stop:
            return stop.value
