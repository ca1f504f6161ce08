"""Redis Sentinel: :class:`SentinelStore` and :class:`AsyncSentinelStore`, the Redis store on
the master that a set of sentinels names.

Connections are made to the master the sentinels report when they connect. Besides, before
a lock command or a renewal, the store asks the sentinels who the master is, at most once
per :data:`FOLLOW_EVERY` seconds (one caller asks, the others go on): when the master
changed, its idle connections are closed and any other is closed before its next command.
So once the sentinels name a new master, this store's lock commands go to a former master
for at most :data:`FOLLOW_EVERY` seconds more, even one that still accepts writes (after
``SENTINEL FAILOVER`` the old master stays writable until the sentinels reconfigure it,
~10 s). A former master that was already turned into a replica answers ``READONLY``:
redis-py turns that into a connection error (the command did not run), and the next attempt
reconnects to the new master.

What a failover does to a held lock is decided by the new master: a lease it has (the
acquisition had reached the replica before the failover) is renewed as before; one it does
not have is reported lost at the next renewal (``not-owner``). See docs/guarantees.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ConfigurationError
from ..base import RenewItem, redacted
from ._renewal import arenew_with
from ._script import _pack_any
from .store import AsyncRedisStore, RedisStore

__all__ = ["FOLLOW_EVERY", "AsyncSentinelStore", "SentinelStore"]

log = logging.getLogger("lockaspect.backend")

#: At most this often (seconds) a lock command or a renewal first asks the sentinels who the
#: master is.
FOLLOW_EVERY = 1.0


class _Follow:
    """Which master the store's connections are for, and when the sentinels were last asked
    (the decisions both twins share)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.master: tuple[str, int] | None = None
        self.asked_at = -FOLLOW_EVERY

    def due(self) -> bool:
        return time.monotonic() - self.asked_at >= FOLLOW_EVERY

    def seen(self, address: Any) -> bool:
        """Record the master the sentinels named; ``True`` when the connections must follow
        it (it changed, or it is the first one named: a connection made before may be on a
        former master)."""
        self.asked_at = time.monotonic()
        master = (str(address[0]), int(address[1]))
        old = self.master
        if old is not None and master != old:
            log.warning("the master of %r moved from %s:%d to %s:%d", self.service, old[0], old[1], *master)
        self.master = master
        return master != old


class SentinelStore(RedisStore):
    """A lock store on the master of a Sentinel-managed Redis or Valkey service (every lock
    kind, ``wait_replicas`` included).

    Args:
        client: ``Sentinel(...).master_for(service)``: a ``redis.Redis`` on a
            ``SentinelConnectionPool``; it should not retry commands by itself, as the clients
            :meth:`from_url` and :meth:`from_sentinel` build do not.
        service: The service name the sentinels monitor.
        namespace: Prefix of every key lockaspect writes.
        twin: Builds the asyncio twin's master client.
    """

    def __init__(
        self,
        client: Any,
        *,
        service: str,
        namespace: str = "lockaspect:",
        twin: Callable[[], Any] | None = None,
        describe: str | None = None,
        own_sentinels: bool = False,
    ) -> None:
        super().__init__(client, namespace=namespace)
        self._follow = _Follow(service)
        self._asking = threading.Lock()
        self._wire._before = self._follow_master
        self._twin = twin
        self._describe = describe or f"service {service!r}"
        self._own_sentinels = own_sentinels

    @classmethod
    def from_sentinel(
        cls, sentinel: Any, service: str, *, namespace: str = "lockaspect:", **options: Any
    ) -> SentinelStore:
        """A store on the master of ``service`` through ``sentinel`` (a ``redis.sentinel.Sentinel``
        you built); ``options`` are the master's connection options (``master_for``'s)."""
        import redis

        from ._topology_clients import _no_retry, async_sentinel_like

        client = sentinel.master_for(service, redis_class=redis.Redis, **_no_retry(options, asyncio=False))
        return cls(
            client,
            service=service,
            namespace=namespace,
            twin=lambda: async_sentinel_like(sentinel, service, options),
        )

    def __repr__(self) -> str:
        return f"<SentinelStore {redacted(self._describe)} namespace={self.namespace!r}>"

    def asyncio_twin(self) -> AsyncSentinelStore:
        if self._twin is None:
            raise ConfigurationError("asyncio needs a store built with SentinelStore.from_url or from_sentinel")
        twin = AsyncSentinelStore(self._twin(), service=self._follow.service, namespace=self.namespace)
        twin._wait_command = self._wait_command
        return twin

    def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        if leases:
            self._follow_master()
        return super().renew(leases)

    def _follow_master(self) -> None:
        """Ask the sentinels who the master is, when due (one thread asks; the others go on)."""
        if not self._follow.due() or not self._asking.acquire(blocking=False):
            return
        try:
            if self._follow.due():
                self._ask_sentinels()
        finally:
            self._asking.release()

    def close(self) -> None:
        super().close()
        if self._own_sentinels:
            for sentinel in _sentinels(self.redis):
                sentinel.close()

    def _ask_sentinels(self) -> None:
        try:
            address = self.redis.connection_pool.get_master_address()
        except Exception as exc:  # noqa: BLE001 - no master right now: the renewal will say so
            log.debug("sentinels of %r not answering: %s", self._follow.service, exc)
            self._follow.asked_at = time.monotonic()
            return
        if self._follow.seen(address):
            self._wire.follow(self._follow.master)
            self._renew_line.follow(self._follow.master)


class AsyncSentinelStore(AsyncRedisStore):
    """:class:`SentinelStore` for one event loop (``redis.asyncio.sentinel``)."""

    def __init__(self, client: Any, *, service: str, namespace: str = "lockaspect:") -> None:
        super().__init__(client, namespace=namespace)
        self._follow = _Follow(service)
        self._asking = False
        self._wire._before = self._follow_master

    async def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        """Renew on the lock commands' connections (which follow the master), not on the
        pool's (which may stay on a former master)."""
        if not leases:
            return []
        await self._follow_master()
        return await arenew_with(self, leases, self._batch)

    async def _batch(self, commands: list[tuple[object, ...]]) -> list[Any]:
        return await self._wire.batch(b"".join(_pack_any(command) for command in commands), len(commands))

    async def _follow_master(self) -> None:
        """See :meth:`SentinelStore._follow_master`."""
        if not self._follow.due() or self._asking:
            return
        self._asking = True
        try:
            address = await self.redis.connection_pool.get_master_address()
        except Exception as exc:  # noqa: BLE001 - no master right now: the command will say so
            log.debug("sentinels of %r not answering: %s", self._follow.service, exc)
            self._follow.asked_at = time.monotonic()
        else:
            if self._follow.seen(address):
                self._wire.follow(self._follow.master)
        finally:
            self._asking = False

    async def aclose(self) -> None:
        await super().aclose()
        for sentinel in _sentinels(self.redis):  # the twin's sentinel clients are always its own
            await sentinel.aclose()


def _sentinels(client: Any) -> list[Any]:
    """The sentinel clients behind a ``master_for`` client."""
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    return list(getattr(manager, "sentinels", []))
