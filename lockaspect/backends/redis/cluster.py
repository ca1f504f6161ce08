"""Redis Cluster: :class:`ClusterStore` (threads) and :class:`AsyncClusterStore` (one event
loop), the Redis store's scripts on a cluster.

* Every script touches the keys of one lock, which share the hash tag ``{<key>}``: one slot.
* Lock commands go on connections of our own to the primary serving the slot
  (:mod:`._cluster_wire`), following ``MOVED`` and ``ASK``.
* Renewals are grouped per slot and sent as one cluster pipeline per watchdog tick: one round
  trip per primary, however many locks and slots.
* Release wake-ups use sharded pub/sub (``SPUBLISH``), with one subscriber connection per
  primary (:mod:`._cluster_notify`); where the server has no sharded pub/sub (Redis 6), the
  ``SPUBLISH`` fails quietly inside the scripts and waiters poll.
* A multi-key lock whose keys share a slot is one script to take and one to give back; over
  several slots, its keys are taken one by one in sorted order (those taken are given back
  when one is busy), and given back one by one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import RedisClusterException, RedisError

from ...errors import BackendError, ConfigurationError
from ..base import AcquireResult, ReleaseStatus, RenewItem, redacted
from ._admin import SCAN_COUNT, held_candidates, held_flags, held_new, scan_match
from ._client import map_redis_error
from ._cluster_notify import AsyncClusterNotifier, ClusterNotifier
from ._cluster_wire import _AsyncClusterLine, _AsyncClusterWire, _ClusterLine, _ClusterWire, user_key_slot
from ._renewal import arenew_with
from .store import AsyncRedisStore, RedisStore

__all__ = ["AsyncClusterStore", "ClusterStore", "multi_order", "multi_result"]


def multi_order(keys: Sequence[str]) -> list[str]:
    """The order a multi-key lock over several slots takes its keys in: sorted, each once
    (every caller takes overlapping sets in one order, and never waits holding a part)."""
    return sorted(set(keys))


def multi_result(keys: Sequence[str], results: dict[str, AcquireResult]) -> AcquireResult:
    """The acquisition of ``keys`` from each key's: fencing tokens in the request's order, the
    fewest replicas any key reached."""
    fences = tuple(int(results[key].fencing_token or 0) for key in keys)
    replicas = [result.replicas for result in results.values() if result.replicas is not None]
    return AcquireResult(True, fences[0], fencing_tokens=fences, replicas=min(replicas) if replicas else None)


def given_back_or_raise(busy: str, failed: list[str]) -> None:
    """After a busy key, the keys taken before it must all be given back: a release that
    failed (it may still arrive) makes the attempt fail transiently instead of busy, so that
    the next attempt uses a new token that such a late release cannot delete."""
    if failed:
        raise BackendError(
            f"multi-key acquire: {busy!r} is busy and giving back {', '.join(map(repr, failed))} failed "
            "(their leases end them)",
            key=failed[0],
            transient=True,
        )


def _one_slot(keys: Sequence[str]) -> bool:
    return len({user_key_slot(key) for key in keys}) == 1


def _cluster_error(exc: RedisClusterException) -> redis.ConnectionError:
    return redis.ConnectionError(f"{type(exc).__name__}: {exc}")


class ClusterStore(RedisStore):
    """A lock store on a Redis or Valkey Cluster (7.0 or newer for sharded wake-ups; 6.2
    polls), every lock kind, built from a ``redis.cluster.RedisCluster``.

    Args:
        cluster: The cluster client. Lock commands go on connections of the store's own, made
            with the cluster's connection settings; renewals and admin scans go through the
            client itself. It should not retry commands by itself (``retry`` with 0 retries),
            as the clients :meth:`from_url` builds do.
        namespace: Prefix of every key lockaspect writes.
        twin: Builds the asyncio twin's cluster client (set by :meth:`from_url` and
            :meth:`from_cluster`).
    """

    slot_of: Callable[[str], int] | None = staticmethod(user_key_slot)

    def __init__(
        self,
        cluster: Any,
        *,
        namespace: str = "lockaspect:",
        twin: Callable[[], Any] | None = None,
        describe: str = "a redis-py RedisCluster",
    ) -> None:
        super().__init__(cluster, namespace=namespace, sharded=True)
        self._cluster_wire = _ClusterWire(cluster)
        self._wire = self._cluster_wire  # type: ignore[assignment]
        self._renew_line = _ClusterLine(cluster, self._cluster_wire)  # type: ignore[assignment]
        self._twin = twin
        self._describe = describe

    @classmethod
    def from_cluster(cls, cluster: Any, *, namespace: str = "lockaspect:") -> ClusterStore:
        """A store on a ``RedisCluster`` you built; its asyncio twin connects to the same
        startup nodes with the same options.

        Raises:
            ConfigurationError: the client decodes replies (``decode_responses=True``): the
                store reads raw replies.
        """
        from ._topology_clients import async_cluster_like

        if cluster.nodes_manager.connection_kwargs.get("decode_responses"):
            raise ConfigurationError(
                "ClusterStore.from_cluster needs a RedisCluster built with decode_responses=False "
                "(the store reads raw replies)"
            )

        return cls(cluster, namespace=namespace, twin=lambda: async_cluster_like(cluster))

    def __repr__(self) -> str:
        return f"<ClusterStore {redacted(self._describe)} namespace={self.namespace!r}>"

    def _socket_timeout(self) -> float | None:
        timeout = self.redis.nodes_manager.connection_kwargs.get("socket_timeout")
        return None if timeout is None else float(timeout)

    def asyncio_twin(self) -> AsyncClusterStore:
        """An :class:`AsyncClusterStore` on the same cluster and namespace, for the running
        event loop."""
        if self._twin is None:
            raise ConfigurationError(
                "asyncio needs a store built with ClusterStore.from_url or ClusterStore.from_cluster"
            )
        twin = AsyncClusterStore(self._twin(), namespace=self.namespace)
        twin._wait_command = self._wait_command
        return twin

    # -- what differs on a cluster --

    def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None, owner: str = ""
    ) -> AcquireResult:
        """All of ``keys`` or none: one script when they share a slot; otherwise one key at a
        time in :func:`multi_order`, giving back those taken when one is busy or fails."""
        if _one_slot(keys):
            return super().multi_acquire(keys, token, lease, waiter, owner)
        results: dict[str, AcquireResult] = {}
        try:
            for key in multi_order(keys):
                result = self.lock_acquire(key, token, lease, waiter, owner=owner)
                if not result.acquired:
                    given_back_or_raise(key, self._give_back(results, token))
                    return result._replace(busy=key)
                results[key] = result
        except BaseException:
            self._give_back(results, token)
            raise
        return multi_result(keys, results)

    def release_many(self, keys: Sequence[str], token: str) -> list[ReleaseStatus]:
        """One script when ``keys`` share a slot; otherwise one release per key, each key's
        failure its own (the other keys are still released)."""
        if _one_slot(keys):
            return list(super().release_many(keys, token))
        statuses: list[ReleaseStatus] = []
        for key in keys:
            try:
                statuses.append(self.lock_release(key, token))
            except BackendError as exc:
                statuses.append(exc)
        return statuses

    def _give_back(self, taken: dict[str, AcquireResult], token: str) -> list[str]:
        """Release the keys ``taken``, last first; the keys whose release failed."""
        failed = []
        for key in reversed(list(taken)):
            try:
                self.lock_release(key, token)
            except BackendError:
                failed.append(key)
        return failed

    def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        """Renew ``leases``: one script call per slot (per :data:`RENEW_CHUNK` items), all of a
        primary's in one write, every primary's written before any reply is read. A primary
        that fails leaves only its own leases unrenewed (``None``: retried at the next tick)."""
        return super().renew(leases)

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The held user keys matching ``pattern``: ``SCAN`` on every primary, then held.lua
        per slot."""
        match = scan_match(self.namespace, pattern)
        seen: set[str] = set()
        try:
            names = self.redis.scan_iter(match=match, count=SCAN_COUNT)
            page: list[bytes] = []
            for name in names:
                page.append(name)
                if len(page) >= SCAN_COUNT:
                    yield from self._held_page(page, seen)
                    page = []
            yield from self._held_page(page, seen)
        except RedisError as exc:
            raise map_redis_error(exc, None, "held_keys") from exc
        except RedisClusterException as exc:
            raise map_redis_error(_cluster_error(exc), None, "held_keys") from exc

    def _held_page(self, page: list[bytes], seen: set[str]) -> list[str]:
        held: list[str] = []
        for group in _by_slot(held_candidates(self.namespace, page, seen)):
            names = tuple(name for _, name in group)
            flags = self._call(self._scripts["held.lua"], names, (), held_flags, None, "held_keys")
            held += held_new(group, flags, seen)
        return held

    def notifier(self) -> ClusterNotifier | None:  # type: ignore[override]
        """One sharded subscriber per primary (see :mod:`._cluster_notify`); ``None`` (waiters
        poll) with a redis-py whose ``PubSub`` has no ``ssubscribe`` (before 5.0)."""
        if not hasattr(redis.client.PubSub, "ssubscribe"):
            return None
        with self._notifier_lock:
            if self._closed:
                return None
            if self._notifier is None:
                self._notifier = ClusterNotifier(self.redis, self.wake_channel, self._wire)  # type: ignore[assignment]
            return self._notifier  # type: ignore[return-value]

    def threads(self) -> list[Any]:
        notifier: Any = self._notifier
        return [] if notifier is None else list(notifier.threads())

    def reset_after_fork(self) -> None:
        super().reset_after_fork()
        self._renew_line = _ClusterLine(self.redis, self._cluster_wire)  # type: ignore[assignment]
        self._cluster_wire._after_fork()


def _by_slot(found: list[tuple[str, bytes]]) -> list[list[tuple[str, bytes]]]:
    groups: dict[int, list[tuple[str, bytes]]] = {}
    for key, name in found:
        groups.setdefault(user_key_slot(key), []).append((key, name))
    return list(groups.values())


class AsyncClusterStore(AsyncRedisStore):
    """:class:`ClusterStore` for one event loop (``redis.asyncio.cluster.RedisCluster``)."""

    slot_of: Callable[[str], int] | None = staticmethod(user_key_slot)

    def __init__(self, cluster: Any, *, namespace: str = "lockaspect:") -> None:
        super().__init__(cluster, namespace=namespace, sharded=True)
        wire = _AsyncClusterWire(cluster)
        self._wire = wire  # type: ignore[assignment]
        self._renew_line = _AsyncClusterLine(wire)

    async def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None, owner: str = ""
    ) -> AcquireResult:
        """See :meth:`ClusterStore.multi_acquire`."""
        if _one_slot(keys):
            return await super().multi_acquire(keys, token, lease, waiter, owner)
        results: dict[str, AcquireResult] = {}
        try:
            for key in multi_order(keys):
                result = await self.lock_acquire(key, token, lease, waiter, owner=owner)
                if not result.acquired:
                    given_back_or_raise(key, await self._give_back(results, token))
                    return result._replace(busy=key)
                results[key] = result
        except BaseException:
            await self._give_back(results, token)
            raise
        return multi_result(keys, results)

    async def release_many(self, keys: Sequence[str], token: str) -> list[ReleaseStatus]:
        """See :meth:`ClusterStore.release_many`."""
        if _one_slot(keys):
            return list(await super().release_many(keys, token))
        statuses: list[ReleaseStatus] = []
        for key in keys:
            try:
                statuses.append(await self.lock_release(key, token))
            except BackendError as exc:
                statuses.append(exc)
        return statuses

    async def _give_back(self, taken: dict[str, AcquireResult], token: str) -> list[str]:
        failed = []
        for key in reversed(list(taken)):
            try:
                await self.lock_release(key, token)
            except BackendError:
                failed.append(key)
        return failed

    async def renew(self, leases: Sequence[RenewItem]) -> list[bool | None]:
        """See :meth:`ClusterStore.renew`: one batch per primary, all in flight at once."""
        return await arenew_with(self, leases, self._renew_line.round_trip)

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        match = scan_match(self.namespace, pattern)
        seen: set[str] = set()
        page: list[bytes] = []
        try:
            async for name in self.redis.scan_iter(match=match, count=SCAN_COUNT):
                page.append(name)
                if len(page) >= SCAN_COUNT:
                    for key in await self._held_page(page, seen):
                        yield key
                    page = []
            for key in await self._held_page(page, seen):
                yield key
        except RedisError as exc:
            raise map_redis_error(exc, None, "held_keys") from exc
        except RedisClusterException as exc:
            raise map_redis_error(_cluster_error(exc), None, "held_keys") from exc

    async def _held_page(self, page: list[bytes], seen: set[str]) -> list[str]:
        held: list[str] = []
        for group in _by_slot(held_candidates(self.namespace, page, seen)):
            names = tuple(name for _, name in group)
            flags = await self._call(self._scripts["held.lua"], names, (), held_flags, None, "held_keys")
            held += held_new(group, flags, seen)
        return held

    def notifier(self) -> AsyncClusterNotifier | None:  # type: ignore[override]
        """See :meth:`ClusterStore.notifier`; ``None`` (waiters poll) with a redis-py whose
        asyncio ``PubSub`` has no ``ssubscribe`` (before 8.0)."""
        if not hasattr(redis.asyncio.client.PubSub, "ssubscribe"):
            return None
        if self._notifier is None:
            self._notifier = AsyncClusterNotifier(self.redis, self.wake_channel, self._wire)  # type: ignore[assignment]
        return self._notifier  # type: ignore[return-value]
