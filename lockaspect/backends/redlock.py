"""The old import path of :mod:`lockaspect.backends.redis.redlock` (kept working)."""

from .redis.redlock import DRIFT_FACTOR, DRIFT_MIN, AsyncRedlockBackend, AsyncRedlockStore, RedlockBackend, RedlockStore

__all__ = ["DRIFT_FACTOR", "DRIFT_MIN", "AsyncRedlockBackend", "AsyncRedlockStore", "RedlockBackend", "RedlockStore"]
