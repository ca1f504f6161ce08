"""Fenced writes to Redis: :class:`RedisFence` and :class:`AsyncRedisFence`.

Each resource's value and high-water mark share one hash tag; one Lua script
(``fenced_write.lua``, loaded from ``lockaspect/backends/redis/lua/`` with the lock scripts)
compares the writer's token with the mark and writes only if the token is not older. The
concept, and the same pattern for SQL, are in :mod:`lockaspect.fencing`, the import path
to use (``from lockaspect.fencing import RedisFence``).
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from ..backends.redis import LuaScript, map_redis_error

__all__ = ["AsyncRedisFence", "RedisFence"]


class _Fence:
    """What the sync and async fences share: the key layout, the script, the checks."""

    def __init__(self, redis: Any, *, namespace: str = "fenced:") -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must not contain '{{' or '}}': {namespace!r}")
        self.redis = redis
        self.namespace = namespace
        self._script = LuaScript("fenced_write.lua")

    def key(self, resource: str) -> str:
        """The Redis key holding ``resource``'s value."""
        return f"{self.namespace}{{{resource}}}"

    @staticmethod
    def _check_token(fencing_token: object) -> None:
        if isinstance(fencing_token, bool) or not isinstance(fencing_token, int):
            raise TypeError(f"fencing_token must be an int, got {type(fencing_token).__name__}")


class RedisFence(_Fence):
    """Fenced writes to string values in Redis.

    Args:
        redis: A ``redis.Redis`` client (for instance ``LockClient.backend.redis``).
        namespace: Prefix of the resource keys and their high-water marks.

    Each resource ``name`` is stored at ``<namespace>{<name>}`` with its high-water mark at
    ``<namespace>{<name>}:fence``, and the script takes exactly those two keys. On Redis
    Cluster they must hash to one slot, and they do whenever ``name`` is not empty and does
    not start with ``}``: both keys then have the hash tag ``{<name>}`` (``fenced:{ledger:7}``
    and ``fenced:{ledger:7}:fence`` are both in the slot of ``ledger:7``). An empty name, or
    one starting with ``}``, makes the tag empty, Redis hashes the whole key, and the two
    keys land in different slots (redis-py raises ``RedisClusterException``). A rendered lock
    key is always a safe name: it never contains braces. ``redis`` may be a
    ``redis.cluster.RedisCluster`` (``for_client`` on a Cluster store gives one).

    Example::

        fence = RedisFence.for_client(client)

        @distributed_lock(key="ledger:<account>")
        def post(account, amount):
            lease = current_lease()
            if not fence.write(f"ledger:{account}", str(amount), lease.fencing_token):
                raise RuntimeError("stale writer: a newer lock holder already wrote")
    """

    @classmethod
    def for_client(cls, client: Any, *, namespace: str = "fenced:") -> RedisFence:
        """A fence on the same Redis as a :class:`~lockaspect.LockClient` built by ``from_url``."""
        redis = getattr(client.backend, "redis", None)
        if redis is None:
            raise TypeError(f"{type(client.backend).__name__} is not a Redis backend")
        return cls(redis, namespace=namespace)

    def write(self, resource: str, value: str | bytes | int | float, fencing_token: int) -> bool:
        """Store ``value`` unless a newer fencing token already wrote ``resource``.

        Returns ``True`` when written, ``False`` when rejected as stale. Raises
        :class:`~lockaspect.BackendError` when the store cannot be reached.
        """
        self._check_token(fencing_token)
        key = self.key(resource)
        try:
            reply = self._script(self.redis, (key, key + ":fence"), (fencing_token, value))
        except (RedisError, RedisClusterException) as exc:
            raise map_redis_error(exc, resource, "fenced write") from exc
        return bool(reply[0] == 1)

    def read(self, resource: str) -> bytes | None:
        """The current value of ``resource`` (``None`` if never written)."""
        try:
            value: bytes | None = self.redis.get(self.key(resource))
        except (RedisError, RedisClusterException) as exc:
            raise map_redis_error(exc, resource, "read") from exc
        return value

    def high_water(self, resource: str) -> int | None:
        """The newest fencing token that wrote ``resource`` (``None`` if never written)."""
        try:
            mark = self.redis.get(self.key(resource) + ":fence")
        except (RedisError, RedisClusterException) as exc:
            raise map_redis_error(exc, resource, "read") from exc
        return None if mark is None else int(mark)


class AsyncRedisFence(_Fence):
    """:class:`RedisFence` for asyncio code, on a ``redis.asyncio.Redis`` client.

    Example::

        fence = AsyncRedisFence(redis.asyncio.Redis.from_url(url))

        @distributed_lock(key="ledger:<account>")
        async def post(account, amount):
            if not await fence.write(f"ledger:{account}", str(amount), current_lease().fencing_token):
                raise RuntimeError("stale writer: a newer lock holder already wrote")
    """

    async def write(self, resource: str, value: str | bytes | int | float, fencing_token: int) -> bool:
        """:meth:`RedisFence.write`, awaited."""
        self._check_token(fencing_token)
        key = self.key(resource)
        try:
            reply = await self.redis.evalsha(self._script.sha, 2, key, key + ":fence", fencing_token, value)
        except NoScriptError:
            try:
                await self.redis.script_load(self._script.source)
                reply = await self.redis.evalsha(self._script.sha, 2, key, key + ":fence", fencing_token, value)
            except (RedisError, RedisClusterException) as exc:
                raise map_redis_error(exc, resource, "fenced write") from exc
        except (RedisError, RedisClusterException) as exc:
            raise map_redis_error(exc, resource, "fenced write") from exc
        return bool(reply[0] == 1)

    async def read(self, resource: str) -> bytes | None:
        """:meth:`RedisFence.read`, awaited."""
        try:
            value: bytes | None = await self.redis.get(self.key(resource))
        except (RedisError, RedisClusterException) as exc:
            raise map_redis_error(exc, resource, "read") from exc
        return value

    async def high_water(self, resource: str) -> int | None:
        """:meth:`RedisFence.high_water`, awaited."""
        try:
            mark = await self.redis.get(self.key(resource) + ":fence")
        except (RedisError, RedisClusterException) as exc:
            raise map_redis_error(exc, resource, "read") from exc
        return None if mark is None else int(mark)
