"""Transaction-scoped locks (``scope="transaction"``): the ``with`` / ``async with`` block,
its :class:`Lease`, and the decorated call (``@distributed_lock(..., scope="transaction",
connection=...)``).

The lock is PostgreSQL's ``pg_advisory_xact_lock`` plus a fencing token, taken in the caller's
own open transaction; it ends when that transaction commits or rolls back. The statements and
the connection adapters (psycopg 3, SQLAlchemy, Django) are a store-side package,
:mod:`lockaspect.backends.sql.xact`, imported by name on first use (so the core never imports a
driver); this module is the lock's life around them. The user's guide:
``docs/stores/sql.md#transaction-scoped-advisory-locks``.
"""

from __future__ import annotations

import importlib
import math
import secrets
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .blocks import LockBlock, arun_in, run_in
from .engine.core import Engine
from .engine.outcome import raise_if_lost
from .errors import ConfigurationError, KeyTemplateError, LockNotAcquired
from .keys import ArgumentNames
from .lease import _HELD, Lease, _push, find_held
from .options import LockSpec
from .renewal import Renewal

if TYPE_CHECKING:
    from .backends.sql.xact import Adapter

__all__ = ["ConnectionPlan", "TransactionLease", "TransactionLockBlock", "open_block"]


def _store() -> Any:
    """:mod:`lockaspect.backends.sql.xact`, imported by name (it imports the drivers it needs)."""
    return importlib.import_module("lockaspect.backends.sql.xact")


#: Why a transaction-scoped lease is lost: its transaction ended while the block was open.
ENDED = "transaction-ended"


class TransactionLease(Lease):
    """The :class:`~lockaspect.Lease` of a transaction-scoped lock.

    It has no lease time (``expires_in`` is infinite, ``watchdog`` is ``False``): the lock is
    the transaction's until it commits or rolls back. ``lost`` (and :meth:`check`) also look,
    without I/O, at whether the connection says that transaction has ended while the block is
    open (a commit or rollback inside it, a closed connection): then the lease is lost with
    reason ``"transaction-ended"``.
    """

    __slots__ = ("_ended",)

    def __init__(
        self, *, owner: object, key: str, kind: str, family: str, fencing_token: int, ended: Callable[[], bool]
    ) -> None:
        now = time.monotonic()
        record = Renewal(
            key=key,
            token=secrets.token_hex(16),
            kind=kind,
            lease_time=math.inf,
            delay_weight=1.0,
            sent=now,
            granted=math.inf,
            max_hold=None,
            guard=0.0,
            clock=time.monotonic,
        )
        super().__init__(
            owner=owner, record=record, fencing_token=fencing_token, watchdog=False, on_lost=None, family=family
        )
        self._ended = ended

    @property
    def lost(self) -> bool:
        if super().lost:
            return True
        if self._holds > 0 and self._ended():
            self._mark_lost(ENDED)
            return True
        return False


class TransactionLockBlock(LockBlock):
    """The block ``client.lock(key, scope="transaction", connection=...)`` returns.

    Entering takes ``pg_advisory_xact_lock`` (``_shared`` for ``mode="read"``) on the hash of
    the namespaced key, plus a fencing token from the sequence ``lockaspect_fence``, in the
    connection's open transaction. Exiting releases nothing: the lock ends when that transaction
    commits or rolls back. A nested block on the same key, connection and namespace in the same
    context re-enters the outer one's lease (same fencing token). See
    ``docs/stores/sql.md#transaction-scoped-advisory-locks``.
    """

    __slots__ = ("_adapter", "_family", "_lease", "_ref")

    def __init__(self, engine: Engine, key: str, spec: LockSpec, namespace: str, connection: object) -> None:
        super().__init__(engine, key, spec)
        self._adapter: Adapter = _store().adapt(connection, key)
        self._family = "xact:" + namespace
        self._lease: TransactionLease | None = None
        self._ref: object = None

    # -- the steps shared by with and async with -----------------------------------------

    def _refuse(self, problem: str | None, is_async: bool) -> None:
        adapter, key = self._adapter, self._key
        if adapter.is_async != is_async:
            use = "async with" if adapter.is_async else "with"
            problem = f"it is {'an async' if adapter.is_async else 'a sync'} connection: use `{use}`"
        if problem is not None:
            raise ConfigurationError(
                f"cannot lock {key!r} with scope='transaction' on this {adapter.label}: {problem}", key=key
            )
        if self._lease is not None:
            raise RuntimeError("this lock block is already entered; call client.lock() again")

    def _held(self) -> TransactionLease | None:
        """The lease this context holds on the key through this connection, if any (re-entry)."""
        held = find_held(self._adapter.owner, self._key, self._family)
        if isinstance(held, TransactionLease) and (held.kind != "read" or self._spec.mode == "read"):
            return held
        return None

    def _entered(self, lease: TransactionLease) -> TransactionLease:
        self._ref = ref = object()
        lease._refs.append(ref)
        self._lease = lease
        self._token = _push(lease)
        return lease

    def _new_lease(self, fence: int) -> TransactionLease:
        adapter = self._adapter
        adapter.began()
        kind = self._spec.mode or "lock"
        return TransactionLease(
            owner=adapter.owner,
            key=self._key,
            kind=kind,
            family=self._family,
            fencing_token=fence,
            ended=adapter.ended,
        )

    def _advisory(self) -> int:
        return int(_store().advisory_key(self._family[len("xact:") :] + self._key))

    def _leave(self, exc: BaseException | None) -> None:
        lease, self._lease = self._lease, None
        assert lease is not None
        _ = lease.lost  # a transaction that ended inside the block marks the lease lost
        try:
            _HELD.reset(self._token)
        finally:
            if self._ref in lease._refs:
                lease._refs.remove(self._ref)
        raise_if_lost(lease, exc)

    # -- with ---------------------------------------------------------------------------

    def __enter__(self) -> TransactionLease:
        adapter = self._adapter
        self._refuse(None if adapter.is_async else adapter.problem(), False)
        shared = self._spec.mode == "read"
        held = self._held()
        if held is not None:
            if _store().run(_store().reenter(self._key, self._advisory(), shared), adapter.execute):
                return self._entered(held)
            held._mark_lost(ENDED)
        steps = _store().acquire(self._key, self._advisory(), self._spec.wait, shared)
        return self._entered(self._new_lease(_store().run(steps, adapter.execute)))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave(exc)

    # -- async with ---------------------------------------------------------------------

    async def __aenter__(self) -> TransactionLease:
        adapter = self._adapter
        self._refuse(await adapter.aproblem() if adapter.is_async else None, True)
        shared = self._spec.mode == "read"
        held = self._held()
        if held is not None:
            if await _store().arun(_store().reenter(self._key, self._advisory(), shared), adapter.aexecute):
                return self._entered(held)
            held._mark_lost(ENDED)
        steps = _store().acquire(self._key, self._advisory(), self._spec.wait, shared)
        return self._entered(self._new_lease(await _store().arun(steps, adapter.aexecute)))

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave(exc)

    def __repr__(self) -> str:
        return f"<TransactionLockBlock {self._key!r} on {self._adapter.label}>"


class ConnectionPlan:
    """``connection=`` of a decorator with ``scope="transaction"``: the connection object, the
    name of a parameter holding it, or a function of the bound arguments returning it."""

    __slots__ = ("_get",)

    def __init__(self, value: object, names: ArgumentNames) -> None:
        qualname = names.qualname
        if isinstance(value, str):
            if value not in names.parameters and not names.has_var_keyword:
                known = ", ".join(names.parameters) or "none"
                raise ConfigurationError(
                    f"connection={value!r} is not a parameter of {qualname}() (its parameters: {known})"
                )

            def by_name(bound: Mapping[str, Any]) -> Any:
                try:
                    return bound[value]
                except KeyError:
                    raise ConfigurationError(f"the call of {qualname}() has no argument {value!r}") from None

            self._get: Callable[[Mapping[str, Any]], Any] = by_name
        elif callable(value) and not _store().is_connection(value):
            function = value

            def by_function(bound: Mapping[str, Any]) -> Any:
                try:
                    return function(bound)
                except Exception as exc:
                    raise KeyTemplateError(
                        f"connection function for {qualname}() raised {type(exc).__name__}: {exc}"
                    ) from exc

            self._get = by_function
        else:
            self._get = lambda bound: value

    def block(self, client: Any, key: str, spec: LockSpec, bound: Mapping[str, Any]) -> TransactionLockBlock:
        namespace = getattr(client.backend, "namespace", "lockaspect:")
        return TransactionLockBlock(client._engine, key, spec, namespace, self._get(bound))

    def run(
        self,
        client: Any,
        key: str,
        spec: LockSpec,
        bound: Mapping[str, Any],
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
        on_failure: Callable[[LockNotAcquired], Any] | None,
    ) -> Any:
        """A decorated call: the body runs in the caller's thread, inside the block."""
        fn, args, kwargs = call
        return run_in(self.block(client, key, spec, bound), fn, args, kwargs, on_failure)

    async def arun(
        self,
        client: Any,
        key: str,
        spec: LockSpec,
        bound: Mapping[str, Any],
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
        on_failure: Callable[[LockNotAcquired], Any] | None,
    ) -> Any:
        """:meth:`run` for ``async def``."""
        fn, args, kwargs = call
        return await arun_in(self.block(client, key, spec, bound), fn, args, kwargs, on_failure)


def open_block(client: Any, key: str, spec: LockSpec, connection: object) -> TransactionLockBlock:
    """The block of ``client.lock(key, scope="transaction", connection=connection)``."""
    if isinstance(connection, str):
        raise ConfigurationError(
            f"connection={connection!r}: client.lock() takes the connection object itself "
            "(a parameter name is for @distributed_lock)",
            key=key,
        )
    namespace = getattr(client.backend, "namespace", "lockaspect:")
    return TransactionLockBlock(client._engine, key, spec, namespace, connection)
