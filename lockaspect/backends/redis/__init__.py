"""Redis and Valkey stores (the module moved into a package; split in the next commits)."""

from .store import (
    _RELEASE_CODES,
    DEFAULT_SOCKET_TIMEOUT,
    RENEW_CHUNK,
    AsyncRedisBackend,
    AsyncRedisNotifier,
    LuaScript,
    RedisBackend,
    RedisNotifier,
    _ms,
    load_script,
    map_redis_error,
    no_retry_async_client,
    no_retry_client,
)

__all__ = [
    "DEFAULT_SOCKET_TIMEOUT",
    "RENEW_CHUNK",
    "_RELEASE_CODES",
    "AsyncRedisBackend",
    "AsyncRedisNotifier",
    "LuaScript",
    "RedisBackend",
    "RedisNotifier",
    "_ms",
    "load_script",
    "map_redis_error",
    "no_retry_async_client",
    "no_retry_client",
]
