"""The ZooKeeper store for threads (:class:`ZooKeeperStore`) and for one event loop
(:class:`AsyncZooKeeperStore`): the Store protocol around the plans of :mod:`._ops`, driven by
waiting on kazoo's replies (a thread blocks; a task awaits one hop from kazoo's thread). See
the package docstring for what the store guarantees."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ...errors import ConfigurationError
from ..base import (
    KINDS,
    AcquireRequest,
    AcquireResult,
    Capability,
    LossCallback,
    ReleaseResult,
    RenewItem,
    RenewStatus,
    checked_request,
    new_waiter_id,
)
from . import _ops
from ._admin import AdminMixin, AsyncAdminMixin
from ._layout import root_path
from ._notify import AsyncZooKeeperNotifier, ZooKeeperNotifier
from ._options import Settings
from ._session import Session

__all__ = ["CAPABILITIES", "AsyncZooKeeperStore", "ZooKeeperStore"]

#: Holds live with the session (the watchdog's renewals answer from the session's state, no
#: round trip), fencing tokens are the nodes' creation zxids, multi-key locks are taken key
#: by key in order, and a waiter is woken by a watch on its predecessor.
CAPABILITIES = (
    Capability.SESSION_BOUND
    | Capability.BATCH_RENEW
    | Capability.FENCING
    | Capability.MULTI_KEY
    | Capability.RELEASE_NOTIFY
)


class _Base:
    capabilities = CAPABILITIES
    kinds = KINDS

    def __init__(self, session: Session, namespace: str) -> None:
        self._session = session
        self.namespace = namespace
        self.settings = session.settings

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.settings.shown} namespace={self.namespace!r}>"

    def _check(self, request: AcquireRequest) -> AcquireRequest:
        return checked_request(request, self.namespace, "the ZooKeeper store")

    @staticmethod
    def waiter_id(listens: bool) -> str:
        return new_waiter_id(listens)

    def renew(self, leases: Sequence[RenewItem]) -> list[RenewStatus]:
        """From the session's state, no round trip: ``True`` while the session holds the node
        and is connected (and, after a reconnection, re-read), ``None`` while that is not
        known (suspended, re-reading), ``False`` once the hold is gone."""
        session = self._session
        namespace = self.namespace
        out: list[RenewStatus] = []
        with session.lock:
            holds, epoch, trusted = session.book.holds, session.epoch, session.connected and session.verified
            for item in leases:
                node = holds.get((namespace + item.key, item.token))
                if node is None or node.epoch != epoch:
                    out.append(False)
                    continue
                out.append(True if trusted else None)
        return out

    def _unqueue(self, key: str, waiter: str) -> None:
        _ops.unqueue(self._session, self.namespace + key, waiter)


class ZooKeeperStore(_Base, AdminMixin):
    """ZooKeeper locks for threads (a :class:`~lockaspect.backends.base.Store`,
    :class:`~lockaspect.backends.base.AdminStore`,
    :class:`~lockaspect.backends.base.AddsPermits` and
    :class:`~lockaspect.backends.base.ReportsLosses`); open it with
    :func:`~lockaspect.backends.zookeeper.open_zookeeper_store` or
    ``LockClient.from_url("zookeeper://host:2181/chroot")``.
    """

    def __init__(self, settings: Settings) -> None:
        super().__init__(Session(settings, root_path(settings.namespace)), settings.namespace)
        self._notifier: ZooKeeperNotifier | None = None
        self._closed = False

    def _drive(self, plan: _ops.Plan, key: str | None) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                calls = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = self._session.run(calls, key)
            except BaseException as exc:  # noqa: BLE001 - thrown into the plan, which re-raises
                error = exc

    def _open(self, key: str) -> None:
        if self._closed:
            raise ConfigurationError("this ZooKeeper store is closed", key=key)

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        request = self._check(request)
        self._open(request.key)
        result: AcquireResult = self._drive(_ops.acquire(self._session, request), request.key)
        if result.busy is not None:
            result = result._replace(busy=result.busy[len(self.namespace) :])
        return result

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        code: ReleaseResult = self._drive(_ops.release(self._session, self.namespace + key, token), key)
        return code

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        """Whether ``token`` still holds ``key`` (one round trip: see ``_ops.reenter``)."""
        held: bool = self._drive(_ops.reenter(self._session, self.namespace + key, token), key)
        return held

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        self._unqueue(key, waiter)

    def notifier(self) -> ZooKeeperNotifier | None:
        if self._closed:
            return None
        if self._notifier is None:
            self._notifier = ZooKeeperNotifier(self._session.hub, self.namespace)
        return self._notifier

    def report_losses(self, callback: LossCallback) -> None:
        """Tell ``callback`` of every hold the session loses (see ``ReportsLosses``): by token,
        with the keys (without this store's namespace) when only some of a token's holds were
        lost (one key of a multi-key set)."""
        cut = len(self.namespace)

        def report(tokens: Collection[str], reason: str, keys: Collection[str] | None = None) -> None:
            callback(tokens, reason, None if keys is None else [key[cut:] for key in keys])

        self._session.on_loss = report

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        raise ConfigurationError(
            "the ZooKeeper store has no wait_replicas: every write is already acknowledged by a quorum of the ensemble"
        )

    def asyncio_twin(self) -> AsyncZooKeeperStore:
        return AsyncZooKeeperStore(self._session, self.namespace)

    def threads(self) -> list[Any]:
        return self._session.threads()

    def reset_after_fork(self) -> None:
        self._session.reset_after_fork()
        self._notifier = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._notifier is not None:
            self._notifier.close()
        self._session.close()


class AsyncZooKeeperStore(_Base, AsyncAdminMixin):
    """The asyncio twin: the same session (one ZooKeeper session per client), awaited (an
    :class:`~lockaspect.backends.base.AsyncAdminStore` with ``add_permits`` too)."""

    def __init__(self, session: Session, namespace: str) -> None:
        super().__init__(session, namespace)
        self._notifier: AsyncZooKeeperNotifier | None = None

    async def _drive(self, plan: _ops.Plan, key: str | None) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                calls = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = await self._session.arun(calls, key)
            except BaseException as exc:  # noqa: BLE001 - thrown into the plan, which re-raises
                error = exc

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        request = self._check(request)
        result: AcquireResult = await self._drive(_ops.acquire(self._session, request), request.key)
        if result.busy is not None:
            result = result._replace(busy=result.busy[len(self.namespace) :])
        return result

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        code: ReleaseResult = await self._drive(_ops.release(self._session, self.namespace + key, token), key)
        return code

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        held: bool = await self._drive(_ops.reenter(self._session, self.namespace + key, token), key)
        return held

    async def renew(self, leases: Sequence[RenewItem]) -> list[RenewStatus]:  # type: ignore[override]
        return _Base.renew(self, leases)

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        self._unqueue(key, waiter)

    def notifier(self) -> AsyncZooKeeperNotifier | None:
        if self._notifier is None:
            self._notifier = AsyncZooKeeperNotifier(self._session.hub, self.namespace)
        return self._notifier

    async def aclose(self) -> None:
        if self._notifier is not None:
            self._notifier.close()
