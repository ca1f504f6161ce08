"""The operator's side of :class:`~lockaspect.LockClient`: who holds what
(:meth:`~Operations.describe`, :meth:`~Operations.held_locks`, :meth:`~Operations.locked`),
evicting a holder (:meth:`~Operations.force_release`) and a semaphore's permits, sync and
asyncio, on every store through its admin part
(:class:`~lockaspect.backends.base.AdminStore`)."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from .backends.base import AddsPermits, AdminStore, AsyncAdminStore
from .errors import ConfigurationError
from .info import LockInfo, check_kind, infos_from, pick
from .keys import check_key

if TYPE_CHECKING:
    from .engine.aio import AsyncRunner
    from .engine.core import Engine

__all__ = ["Operations"]

evict_log = logging.getLogger("lockaspect.admin")


def _pattern(pattern: object) -> str:
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str (a glob such as 'order:*'), got {type(pattern).__name__}")
    if "{" in pattern or "}" in pattern:
        raise ConfigurationError(f"a key pattern cannot contain '{{' or '}}' (no key does): {pattern!r}")
    return pattern


def _delta(delta: object) -> int:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"delta must be an int, got {type(delta).__name__}")
    return delta


def _who(info: LockInfo) -> str:
    if not info.holders:
        return f"{info.unknown_holders} holder(s) lockaspect did not record"
    parts = []
    for holder in info.holders:
        where = f"{holder.host or '?'}/{holder.pid if holder.pid is not None else '?'}"
        what = holder.function or holder.thread or "?"
        parts.append(f"{where} {what} (fencing token {holder.fencing_token}, token {holder.token_prefix}…)")
    return "; ".join(parts)


class Operations:
    """The operator tools of :class:`~lockaspect.LockClient` (a mixin: see the module)."""

    backend: Any
    _engine: Engine
    _async: AsyncRunner
    wait_replicas: tuple[int, float] | None

    # -- the start-up check -------------------------------------------------------------------

    def check(self) -> None:
        """Fail now, not at the first lock: connect, authenticate, select the database, confirm
        the permissions lockaspect needs and load its scripts.

        On Redis and Valkey (each server of a Sentinel, Cluster or RedLock setup) it sends
        ``PING``, checks every command the lock scripts and the store send with ``ACL DRYRUN``
        (or ``redis.acl_check_cmd``) for the connection's user, and ``SCRIPT LOAD``s the
        scripts; on the other stores it makes one ``describe`` round trip. It takes no lock
        and writes no key. Web-framework helpers call it at start-up, and
        ``LockClient.from_url(url, check=True)`` runs it at construction.

        Raises:
            ConfigurationError: something to change, with what to do: a TLS mismatch
                (``rediss://`` against a plain server or the reverse), a wrong user name or
                password, a database index the server does not have, a command the ACL
                user may not run (named, with the ``ACL SETUSER`` rule that grants it).
            BackendError: something to start or reach: nothing listens at the address, or no
                answer in time (``transient`` is true).
        """
        namespace = getattr(self.backend, "namespace", "lockaspect:")
        startup = importlib.import_module("lockaspect.doctor.startup")  # by name: the doctor sits above the client
        startup.check_store(self.backend, namespace, wait_replicas=self.wait_replicas is not None)

    async def acheck(self) -> None:
        """:meth:`check` for asyncio code: the same checks, run in a worker thread on the
        client's own (sync) connections, so the loop is never blocked."""
        await asyncio.get_running_loop().run_in_executor(None, self.check)

    # -- the store's admin part ---------------------------------------------------------------

    def _admin(self, what: str) -> AdminStore:
        backend = self.backend
        if not isinstance(backend, AdminStore):
            raise ConfigurationError(f"{what}: {backend!r} has no admin part (it cannot list or describe locks)")
        return backend

    def _sem_admin(self, what: str) -> AdminStore:
        backend = self.backend
        if "semaphore" not in backend.kinds or not isinstance(backend, AdminStore):
            raise ConfigurationError(f"{what}: {backend!r} does not serve semaphores")
        return backend

    def _async_admin(self, what: str) -> AsyncAdminStore | None:
        """The running loop's admin store, or ``None`` (then the sync one runs in a thread)."""
        self._admin(what)
        if self._engine.closed:
            raise ConfigurationError("this LockClient is closed")
        store = self._async.state().store
        return store if isinstance(store, AsyncAdminStore) else None

    # -- inspecting ---------------------------------------------------------------------------

    def describe(self, key: str, kind: str | None = None) -> LockInfo | None:
        """Who holds ``key`` now, or ``None`` when nobody does.

        One store round trip. The :class:`~lockaspect.info.LockInfo` lists each holder (host,
        pid, thread or task, decorated function and key template, when it was taken, its
        fencing token, the first characters of its token, its remaining lease) as the store
        recorded it, how many wait, and a semaphore's permits. A key's name may carry a lock,
        a read-write lock and a semaphore at once: ``kind`` picks one (``"lock"``/``"fair"``,
        ``"read"``/``"write"``/``"rw"``, ``"semaphore"``); ``None`` takes the first held, in
        that order.

        Example::

            info = client.describe("order:42")
            if info is not None:
                print(info.holders[0].host, info.holders[0].function, info.remaining)
        """
        group = check_kind(kind)
        key = check_key(key)
        return pick(infos_from(key, self._admin("describe").describe(key)), group)

    async def adescribe(self, key: str, kind: str | None = None) -> LockInfo | None:
        """:meth:`describe` for asyncio."""
        group = check_kind(kind)
        key = check_key(key)
        admin = self._async_admin("adescribe")
        if admin is None:
            states = await asyncio.to_thread(self._admin("adescribe").describe, key)
        else:
            states = await admin.describe(key)
        return pick(infos_from(key, states), group)

    def held_locks(self, pattern: str = "*") -> Iterator[LockInfo]:
        """Every lock held now in this client's namespace whose key matches the glob
        ``pattern`` (``*``, ``?``, ``[...]``), one :class:`~lockaspect.info.LockInfo` each
        (a key holding two kinds gives two).

        Incremental: Redis walks the namespace with ``SCAN`` (never ``KEYS``), the SQL stores
        query their table, ZooKeeper lists its lock nodes. A lock released between the listing
        and its description is left out.
        """
        pattern = _pattern(pattern)
        admin = self._admin("held_locks")
        for key in admin.held_keys(pattern):
            yield from infos_from(key, admin.describe(key))

    async def aheld_locks(self, pattern: str = "*") -> AsyncIterator[LockInfo]:
        """:meth:`held_locks` for asyncio: ``async for info in client.aheld_locks("order:*")``."""
        pattern = _pattern(pattern)
        admin = self._async_admin("aheld_locks")
        if admin is None:
            sync = self._admin("aheld_locks")
            keys = await asyncio.to_thread(lambda: list(sync.held_keys(pattern)))
            for key in keys:
                for info in infos_from(key, await asyncio.to_thread(sync.describe, key)):
                    yield info
            return
        async for key in admin.held_keys(pattern):
            for info in infos_from(key, await admin.describe(key)):
                yield info

    def locked(self, key: str) -> bool:
        """Whether anyone (this process or another) holds ``key`` now, of any kind. One round
        trip; the answer may be stale by the time it arrives."""
        key = check_key(key)
        return bool(self._admin("locked").describe(key))

    async def alocked(self, key: str) -> bool:
        """:meth:`locked` for asyncio."""
        return await self.adescribe(key) is not None

    # -- evicting -----------------------------------------------------------------------------

    def force_release(self, key: str) -> bool:
        """Delete the lock of whatever kind is at ``key``, whoever holds it, with its queue
        state, and wake its waiters; ``True`` if anything was held.

        For stuck locks (a holder that hangs while its watchdog keeps renewing). The evicted
        holder is told at its next renewal or release: its lease is lost (``on_lost`` runs,
        its block or call raises :class:`~lockaspect.LockLost`), and its writes carry a
        fencing token older than the next holder's: the fencing counter is never touched.
        Logged at WARNING on ``lockaspect.admin`` with who was evicted.
        """
        key = check_key(key)
        admin = self._admin("force_release")
        infos = infos_from(key, admin.describe(key))
        released = admin.force_release(key)
        _log_eviction(key, infos, released)
        return released

    async def aforce_release(self, key: str) -> bool:
        """:meth:`force_release` for asyncio."""
        key = check_key(key)
        admin = self._async_admin("aforce_release")
        if admin is None:
            sync = self._admin("aforce_release")
            infos = infos_from(key, await asyncio.to_thread(sync.describe, key))
            released = await asyncio.to_thread(sync.force_release, key)
        else:
            infos = infos_from(key, await admin.describe(key))
            released = await admin.force_release(key)
        _log_eviction(key, infos, released)
        return released

    # -- semaphores' permits --------------------------------------------------------------------

    def set_permits(self, key: str, permits: int) -> None:
        """Set the number of permits of the semaphore ``key`` (creating it if needed).

        Raising it wakes waiters at once. Lowering it takes no permit away: holders keep
        theirs, and new permits are handed out once fewer are held than the new number.
        Callers that still pass the old number get :class:`ConfigurationError`.
        """
        from .options import LockSpec

        spec = LockSpec.create(permits=permits)
        assert spec.permits is not None
        self._sem_admin("set_permits").permits(check_key(key), spec.permits)

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` permits to the semaphore ``key`` (negative: take some away, never
        below 0; a semaphore never used starts from 0) and return ``(permits, in use)``.

        One step on stores that can (Redis, memory, SQL, ZooKeeper), so concurrent calls add
        up. Raising the number wakes waiters; lowering it takes no permit away from holders.
        Callers that still pass the old number to :meth:`semaphore` get
        :class:`ConfigurationError`, as after :meth:`set_permits`.
        """
        delta = _delta(delta)
        key = check_key(key)
        admin = self._sem_admin("add_permits")
        if isinstance(admin, AddsPermits):
            return admin.add_permits(key, delta)
        current, _ = admin.permits(key)
        permits, in_use = admin.permits(key, max(0, (current or 0) + delta))
        return (permits or 0), in_use

    def permits(self, key: str) -> tuple[int | None, int]:
        """``(permits, in use)`` of the semaphore ``key``: its number of permits (``None`` if
        it was never used) and how many are held now (leases that have not ended; a holder
        that took several counts each)."""
        return self._sem_admin("permits").permits(check_key(key))


def _log_eviction(key: str, infos: list[LockInfo], released: bool) -> None:
    if not released:
        evict_log.info("force_release(%r): nothing was held", key)
        return
    who = "; ".join(f"{info.kind}: {_who(info)}" for info in infos) or "a holder that released meanwhile"
    evict_log.warning("force_release(%r) evicted %s", key, who)
