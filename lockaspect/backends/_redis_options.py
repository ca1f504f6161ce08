"""The old import path of :mod:`lockaspect.backends.redis.options` (kept working)."""

from .redis.options import SCHEMES, allowed_redis_options, check_redis_options

__all__ = ["SCHEMES", "allowed_redis_options", "check_redis_options"]
