"""Release notifications on Redis Cluster: :class:`ClusterNotifier` and
:class:`AsyncClusterNotifier` keep one sharded subscriber (``SSUBSCRIBE``) per primary, each a
:class:`~.notify.RedisNotifier` in sharded mode, and send a waiter's subscription to the
primary that serves its lock's slot.

When a failover or a migration moves a slot, its primary drops the slot's subscriptions (a
``sunsubscribe`` nobody asked for) or refuses new ones (``MOVED``): that node's subscriber
wakes its waiters and starts over, and the slot map is read again before the next command,
so the waiters subscribe again on the new primary. A wake-up lost meanwhile costs latency
only: waiters also poll.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis.asyncio
from redis.exceptions import RedisClusterException

from ._cluster_wire import user_key_slot
from .notify import AsyncRedisNotifier, RedisNotifier, _AsyncSubscription, _Subscription

__all__ = ["AsyncClusterNotifier", "ClusterNotifier"]


class ClusterNotifier:
    """One :class:`RedisNotifier` (sharded) per primary, chosen by the lock's slot."""

    def __init__(self, cluster: Any, channel_for: Any, wire: Any) -> None:
        self._cluster = cluster
        self._channel_for = channel_for
        self._wire = wire
        #: This notifier's waiter id, shared by its per-node subscribers.
        self.waiter_id = os.urandom(8).hex()
        self._nodes: dict[str, RedisNotifier] = {}
        self._mutex = threading.Lock()
        self._closed = False

    def _moved(self) -> None:
        self._wire._stale = True  # read the slot map again before the next command

    def _for(self, key: str) -> RedisNotifier | None:
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(user_key_slot(key))
        except (RedisClusterException, KeyError):  # KeyError: an asyncio client before its first command
            self._moved()
            return None  # nobody serves the slot right now: the waiter polls
        with self._mutex:
            if self._closed:
                return None
            notifier = self._nodes.get(node.name)
            if notifier is None:
                client = self._cluster.get_redis_connection(node)
                notifier = RedisNotifier(client, self._channel_for, sharded=True, on_moved=self._moved)
                notifier.waiter_id = self.waiter_id
                self._nodes[node.name] = notifier
            return notifier

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        notifier = self._for(key)
        if notifier is None:
            return _Subscription(self._channel_for(key, waiter or self.waiter_id).encode())
        return notifier.subscribe(key, timeout, waiter)

    def listening(self, key: str, waiter: str | None = None) -> bool:
        notifier = self._for(key)
        return notifier is not None and notifier.listening(key, waiter)

    def unsubscribe(self, subscription: Any) -> None:
        # The subscription's node may have changed since; leaving a node it never joined is a no-op.
        for notifier in list(self._nodes.values()):
            notifier.unsubscribe(subscription)

    def threads(self) -> list[threading.Thread]:
        return [thread for notifier in list(self._nodes.values()) if (thread := notifier._thread) is not None]

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            notifiers, self._nodes = list(self._nodes.values()), {}
        for notifier in notifiers:
            notifier.close()


class AsyncClusterNotifier:
    """:class:`ClusterNotifier` for one event loop: one :class:`AsyncRedisNotifier` (sharded)
    per primary, each on a client of its own for that node."""

    def __init__(self, cluster: Any, channel_for: Any, wire: Any) -> None:
        self._cluster = cluster
        self._channel_for = channel_for
        self._wire = wire
        self.waiter_id = os.urandom(8).hex()
        self._nodes: dict[str, tuple[AsyncRedisNotifier, Any]] = {}
        self._closed = False

    def _moved(self) -> None:
        self._wire._stale = True

    def _for(self, key: str) -> AsyncRedisNotifier | None:
        if self._closed:
            return None
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(user_key_slot(key))
        except (RedisClusterException, KeyError):  # KeyError: an asyncio client before its first command
            self._moved()
            return None
        entry = self._nodes.get(node.name)
        if entry is None:
            pool = redis.asyncio.ConnectionPool(
                connection_class=node.connection_class, max_connections=4, **node.connection_kwargs
            )
            client = redis.asyncio.Redis(connection_pool=pool)
            notifier = AsyncRedisNotifier(client, self._channel_for, sharded=True, on_moved=self._moved)
            notifier.waiter_id = self.waiter_id
            entry = self._nodes[node.name] = (notifier, client)
        return entry[0]

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        notifier = self._for(key)
        if notifier is None:
            return _AsyncSubscription(self._channel_for(key, waiter or self.waiter_id).encode())
        return await notifier.subscribe(key, timeout, waiter)

    def listening(self, key: str, waiter: str | None = None) -> bool:
        notifier = self._for(key)
        return notifier is not None and notifier.listening(key, waiter)

    def unsubscribe(self, subscription: Any) -> None:
        for notifier, _ in list(self._nodes.values()):
            notifier.unsubscribe(subscription)

    async def aclose(self) -> None:
        self._closed = True
        entries, self._nodes = list(self._nodes.values()), {}
        for notifier, client in entries:
            await notifier.aclose()
            await client.aclose()
