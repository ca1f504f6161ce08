"""The start-up check behind :meth:`LockClient.check <lockaspect.LockClient.check>`: fail fast,
with a hint that says what to do, instead of at the first lock.

It uses the client's own store and connections (so its TLS and socket options count):

- Redis and Valkey (one server, a Sentinel's master, each Cluster primary, each RedLock node):
  connect, authenticate and select the database (a PING), confirm with ``ACL DRYRUN`` (or
  ``redis.acl_check_cmd``) that the user may run every command lockaspect needs, and load the
  lock scripts (``SCRIPT LOAD``, so the first lock does not pay for it).
- Every other store: one ``describe`` round trip (connect, authenticate, find the schema).

Driver errors are mapped to :class:`~lockaspect.ConfigurationError` (TLS mismatch, wrong
password, wrong database index, missing ACL permission: something to change) or
:class:`~lockaspect.BackendError` (nothing listens, no answer: something to start or reach),
each with the hint.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import redacted
from ..errors import BackendError, ConfigurationError, LockError

__all__ = ["check_store", "explain"]

_CHECK_KEY = "check"


def check_store(store: Any, namespace: str, url: str = "", *, wait_replicas: bool = False) -> None:
    """Raise :class:`ConfigurationError` or :class:`BackendError` (with a hint) unless ``store``
    is reachable and lets lockaspect do everything it needs; ``url`` names it in messages."""
    shown = redacted(url) if url else repr(store)
    nodes = getattr(store, "nodes", None)
    if nodes is not None and hasattr(store, "quorum"):  # RedLock: every node, a quorum reachable
        unreachable: list[BackendError] = []
        for node in nodes:
            try:
                check_store(node, namespace, wait_replicas=wait_replicas)
            except ConfigurationError:
                raise
            except BackendError as exc:
                unreachable.append(exc)
        if len(nodes) - len(unreachable) < store.quorum:
            raise BackendError(
                f"only {len(nodes) - len(unreachable)} of {len(nodes)} RedLock servers answered (a quorum is "
                f"{store.quorum}): {'; '.join(str(e) for e in unreachable)}"
            )
        return
    if hasattr(store, "redis"):
        _check_redis(store, namespace, shown, wait_replicas)
        return
    try:
        store.describe(_CHECK_KEY)
    except LockError:
        raise
    except Exception as exc:  # a driver's error the store did not map: still a hint
        raise explain(exc, shown) from exc


def _check_redis(store: Any, namespace: str, shown: str, wait_replicas: bool) -> None:
    from . import _servers
    from .commands import acl_rule, needed_commands, script_sources
    from .redis_facts import RedisFacts, _acl

    cluster = hasattr(store.redis, "get_primaries")
    sentinel = not cluster and hasattr(store.redis.connection_pool, "get_master_address")
    topology = "cluster" if cluster else "sentinel" if sentinel else "single"
    commands = needed_commands(topology)
    try:
        servers = _servers(store, shown, cluster, namespace)
    except Exception as exc:  # the cluster's slot map could not be read
        raise explain(exc, shown) from exc
    for where, redis, _ in servers:
        try:
            redis.execute_command("PING")
        except Exception as exc:  # mapped to a hint
            if type(exc).__name__ != "NoPermissionError":  # it answered: the ACL check says the rest
                raise explain(exc, where) from exc
        facts = RedisFacts(where)
        _acl(redis, facts, commands, namespace)
        needed = ("needed", "replicas") if wait_replicas else ("needed",)
        refused = [c for c in commands if c.name in facts.refused and c.need in needed]
        if refused:
            user = facts.user or "<user>"
            names = ", ".join(f"{c.name.lower()} ({facts.refused[c.name]})" for c in refused)
            raise ConfigurationError(
                f"{where}: the user {user!r} may not run what lockaspect needs: {names}. Grant it with: "
                f"{acl_rule(user, namespace, commands, wait_replicas)}  (`lockaspect doctor --url ...` checks the rest)"
            )
        if "SCRIPT|LOAD" not in facts.refused:
            for source in script_sources(cluster):
                try:
                    redis.execute_command("SCRIPT", "LOAD", source)
                except Exception as exc:  # EVAL still works: loading only saves a round trip
                    if type(exc).__name__ in ("ConnectionError", "TimeoutError"):
                        raise explain(exc, where) from exc
                    break


def explain(exc: BaseException, where: str) -> LockError:
    """``exc``, a driver's error on connecting to ``where``, as a :class:`LockError` whose
    message says what to do."""
    text = str(exc).strip() or type(exc).__name__
    cause = exc.__context__ or exc.__cause__
    detail = f"{text} ({cause})" if cause is not None and str(cause) not in text else text
    name = type(exc).__name__
    tls = where.startswith("rediss") or "ssl" in detail.lower() or "handshake" in detail.lower()
    if name == "AuthenticationError" or "WRONGPASS" in text or "NOAUTH" in text or "authenticated" in text:
        return ConfigurationError(
            f"{where}: authentication failed: {text}. Check the user name and password in the URL "
            "(redis://user:password@host:port/db; a password alone is redis://:password@host)"
        )
    if "DB index is out of range" in text or "invalid DB index" in text:
        return ConfigurationError(
            f"{where}: {text}: the server has fewer databases than the URL's /<db> asks for "
            "(its `databases` setting, 16 by default): use a smaller index"
        )
    if name == "NoPermissionError" or text.startswith("NOPERM"):
        return ConfigurationError(
            f"{where}: {text}. Run `lockaspect doctor --url ...` for the ACL SETUSER rule that grants what is missing"
        )
    if tls and ("timed out" in detail.lower() or name == "TimeoutError" or "SSL" in detail):
        return ConfigurationError(
            f"{where}: the TLS handshake failed: {detail}. Is the server serving TLS on this port? "
            "For a plain server use redis:// (not rediss://); for TLS check ssl_ca_certs / ssl_cert_reqs"
        )
    if "Connection reset" in detail or "Connection closed by server" in detail:
        return BackendError(
            f"{where}: the server closed the connection: {detail}. If it requires TLS, use rediss://",
            transient=True,
        )
    if "refused" in detail.lower() or "No such file" in detail or "Name or service not known" in detail:
        return BackendError(
            f"{where}: nothing answers: {detail}. Is the server running, and are the host and port right?",
            transient=True,
        )
    if name == "TimeoutError" or "timed out" in detail.lower() or "Timeout" in text:
        return BackendError(
            f"{where}: no answer in time: {detail}. Is the host reachable (firewall, port), and is the server paused?",
            transient=True,
        )
    if isinstance(exc, LockError):
        return exc
    return BackendError(f"{where}: {name}: {detail}", transient=True)
