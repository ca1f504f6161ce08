"""How a :class:`~lockaspect.LockClient` is made from URLs: :meth:`~Factories.from_url` (one
store of any kind) and :meth:`~Factories.from_urls` (RedLock over several Redis servers), a
mixin of the client."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar, cast

from . import _defaults
from .backends.base import Store
from .observe import Observer

__all__ = ["Factories"]

C = TypeVar("C", bound="Factories")


def _check_owner_info(owner_info: object) -> None:
    if not isinstance(owner_info, bool):
        raise TypeError(f"owner_info must be a bool, got {type(owner_info).__name__}")


class Factories:
    """The client's constructors from URLs (a mixin: see the module)."""

    @classmethod
    def from_url(
        cls: type[C],
        url: str,
        *,
        namespace: str = "lockaspect:",
        watchdog_lease: float = 30.0,
        tick: float = 0.1,
        delay_weight: float | None = None,
        executor: Executor | str | None = None,
        wait_replicas: tuple[int, float] | None = None,
        observers: Iterable[Observer] | None = None,
        owner_info: bool = True,
        defaults: Mapping[str, Any] | None = None,
        check: bool = False,
        **redis_options: Any,
    ) -> C:
        """A client for the lock store ``url`` names: a Redis or Valkey server, or this
        process's memory.

        The store is opened by :func:`lockaspect.backends.open_store`, which picks the
        factory registered for the URL's scheme (entry points of the group
        ``lockaspect.stores``, or :func:`~lockaspect.backends.register_store`).

        Args:
            url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for TLS, or
                ``unix:///path/to/socket[?db=0]``: query parameters are passed to redis-py.
                ``redis+cluster://``, ``redis+sentinel://``: see docs/stores/redis.md.
                ``memory://``: a store in this process's memory, private to this client, or
                ``memory://<name>``: shared by every client of that name in this process
                (for tests of single-process code: see
                :mod:`lockaspect.backends.memory`; it takes no options).
            namespace: Prefix of every key the client writes. Must not contain ``{``/``}``
                (Redis). The other settings: see :class:`LockClient`.
            check: Run :meth:`check` before returning: a wrong password, database index,
                TLS setting or ACL permission raises here (and the client is closed) rather
                than at the first lock.
            **redis_options: Passed to the store's factory; for Redis to
                ``redis.Redis.from_url`` (``socket_timeout`` defaults to 2 s; redis-py's own
                command retries are switched off, because whether a lock command may be
                repeated is lockaspect's decision).

        Raises:
            ConfigurationError: at once, before any connection is made, for an unknown
                scheme (listing the registered ones), a malformed URL (bad port or db) or an
                option the store would not accept (for Redis naming it, with the closest
                allowed name and the allowed ones).
        """
        from .backends import open_store

        _check_owner_info(owner_info)  # before the store is opened
        settings = {"watchdog_lease": watchdog_lease, "tick": tick, "delay_weight": delay_weight}
        _defaults.check_defaults(defaults, "LockClient.from_url")
        return cls._on(
            open_store(url, namespace=namespace, **redis_options),
            check,
            **settings,
            executor=executor,
            wait_replicas=wait_replicas,
            observers=observers,
            owner_info=owner_info,
            defaults=defaults,
        )

    @classmethod
    def from_urls(
        cls: type[C],
        urls: Sequence[str],
        *,
        namespace: str = "lockaspect:",
        watchdog_lease: float = 30.0,
        tick: float = 0.1,
        delay_weight: float | None = None,
        executor: Executor | str | None = None,
        observers: Iterable[Observer] | None = None,
        owner_info: bool = True,
        defaults: Mapping[str, Any] | None = None,
        check: bool = False,
        **redis_options: Any,
    ) -> C:
        """A client whose locks are RedLock locks over several independent servers.

        A lock is held when a majority of the servers granted it within its validity time
        (the lease minus the time the requests took minus a clock-drift allowance of 1% +
        2 ms); otherwise it is released on every server. Renewals count when a majority
        renewed; releases go to every server; waiters poll (random, PTTL-bounded delays).
        Read docs/concepts/redlock.md before relying on it: it assumes bounded clock drift
        and pauses, and its fencing tokens are not strictly increasing.

        Args:
            urls: At least 3 server URLs (5 is usual: it survives 2 servers down), each an
                independent master, not a replica of another.
            redis_options: As for :meth:`from_url`; ``socket_timeout`` and
                ``socket_connect_timeout`` default to 0.25 s here, so a dead server costs
                little.
            defaults, check: As for :meth:`from_url` (the check wants a quorum of the
                servers reachable, and every one that answers configured right).

        Only plain locks work on such a client; the other kinds raise
        :class:`ConfigurationError` when used, before any I/O.
        """
        from .backends import open_redlock

        settings = {"watchdog_lease": watchdog_lease, "tick": tick, "delay_weight": delay_weight}
        _defaults.check_defaults(defaults, "LockClient.from_urls")
        store = open_redlock(urls, namespace=namespace, **redis_options)
        options = {"executor": executor, "observers": observers, "owner_info": owner_info, "defaults": defaults}
        return cls._on(store, check, **settings, **options)

    @classmethod
    def _on(cls: type[C], store: Store, check: bool, **settings: Any) -> C:
        """A client on ``store``, which is closed if the settings are refused (or, with
        ``check``, if :meth:`check` fails)."""
        try:
            client: Any = cast(Any, cls)(store, **settings)
        except BaseException:
            store.close()
            raise
        if check:
            try:
                client.check()
            except BaseException:
                client.close()
                raise
        return cast(C, client)
