"""Redis and Valkey stores through redis-py: the lock scripts, batched renewal and release
wake-ups. The import path of everything a user or a test needs; the modules each do one job:

* :mod:`.store`: :class:`RedisStore` and :class:`AsyncRedisStore` (the protocol, the
  script-level operations, the operator part), run from the operation table of
  :mod:`._layout` (key layout, request encoding, reply decoding);
* :mod:`._renewal`: batched renewal; :mod:`._admin`: what the operator part encodes;
* :mod:`._script`, :mod:`._wire`, :mod:`._async_wire`: the scripts and the fast paths that
  send them; :mod:`._client`: the redis-py clients and error mapping;
* :mod:`.notify`: release notifications; :mod:`.options`: URL and option checks;
  :mod:`.redlock`: RedLock over several servers; ``lua/``: the scripts.

``RedisBackend`` / ``AsyncRedisBackend`` (and ``RedlockBackend`` / ``AsyncRedlockBackend``
in :mod:`.redlock`) are the old names of the stores, kept as aliases.
"""

from ._client import DEFAULT_SOCKET_TIMEOUT, map_redis_error, no_retry_async_client, no_retry_client
from ._layout import _ms
from ._renewal import RENEW_CHUNK
from ._script import LuaScript, load_script
from .notify import AsyncRedisNotifier, RedisNotifier
from .store import AsyncRedisBackend, AsyncRedisStore, RedisBackend, RedisStore

__all__ = [
    "DEFAULT_SOCKET_TIMEOUT",
    "RENEW_CHUNK",
    "AsyncRedisBackend",
    "AsyncRedisNotifier",
    "AsyncRedisStore",
    "LuaScript",
    "RedisBackend",
    "RedisNotifier",
    "RedisStore",
    "_ms",
    "load_script",
    "map_redis_error",
    "no_retry_async_client",
    "no_retry_client",
]
