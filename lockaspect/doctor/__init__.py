"""``lockaspect doctor``: check a lock store for what lockaspect needs, one verdict per line.

:func:`diagnose` opens the store a URL names, gathers facts (:mod:`.redis_facts` for Redis
and Valkey, one server, each primary of a Cluster, a Sentinel's master; :mod:`.other_stores`
for memory, SQLite, PostgreSQL and ZooKeeper) and judges them (:mod:`.verdicts`,
:mod:`.commands`: pure). The :class:`Report` carries every :class:`~.verdicts.Check`, the ACL
rule to grant (Redis) and the exit status: 0 all well, 1 warnings, 2 errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .verdicts import ERROR, INFO, Check, exit_status

__all__ = ["Check", "Report", "diagnose"]


@dataclass
class Report:
    """What doctor found: sections of checks (one per server of a topology)."""

    store: str
    namespace: str
    sections: list[tuple[str, list[Check]]] = field(default_factory=list)
    acl_rule: str | None = None

    @property
    def checks(self) -> list[Check]:
        return [check for _, checks in self.sections for check in checks]

    @property
    def status(self) -> int:
        return exit_status(self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "namespace": self.namespace,
            "sections": [{"where": where, "checks": [c.to_dict() for c in checks]} for where, checks in self.sections],
            "acl_rule": self.acl_rule,
            "exit_status": self.status,
        }


def diagnose(url: str, namespace: str = "lockaspect:", wait_replicas: int | None = None) -> Report:
    """Check the store ``url`` names.

    Raises:
        ConfigurationError: a malformed URL or an unknown scheme (nothing was checked).
    """
    from ..backends.base import redacted

    report = Report(redacted(url), namespace)
    scheme = url.partition("://")[0]
    if scheme in ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"):
        _redis(report, url, namespace, wait_replicas)
    else:
        _other(report, url, namespace, scheme)
    return report


def _open(report: Report, url: str, namespace: str) -> Any:
    """The store, or ``None`` with the reason as an error line (a store that connects when
    it is opened: SQL tables, a cluster's slot map)."""
    from ..backends import open_store
    from ..errors import BackendError

    try:
        return open_store(url, namespace=namespace)
    except BackendError as exc:
        report.sections.append((report.store, [Check("reachable", ERROR, str(exc))]))
        return None


def _redis(report: Report, url: str, namespace: str, wait_replicas: int | None) -> None:
    from .commands import needed_commands
    from .redis_facts import gather, redis_checks

    scheme = url.partition("://")[0]
    cluster = "+cluster" in scheme
    try:
        store = _open(report, url, namespace)
    except Exception as exc:
        from ..errors import ConfigurationError

        if isinstance(exc, ConfigurationError):
            raise
        report.sections.append((report.store, [Check("reachable", ERROR, str(exc))]))
        return
    if store is None:
        return
    commands = needed_commands("cluster" if cluster else "sentinel" if "+sentinel" in scheme else "single")
    try:
        for where, client, extra in _servers(store, report.store, cluster, namespace):
            facts = gather(client, where, namespace, commands)
            facts.spublish_ok = extra.get("spublish_ok")
            facts.spublish_error = extra.get("spublish_error")
            checks, rule = redis_checks(facts, commands, namespace, wait_replicas=wait_replicas, cluster=cluster)
            report.sections.append((where, [*extra.get("info", []), *checks]))
            report.acl_rule = report.acl_rule or rule
    finally:
        store.close()


def _servers(store: Any, shown: str, cluster: bool, namespace: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """(where, redis-py client, extra facts) of each server to check: the one server, the
    Sentinel master, or each Cluster primary."""
    if not cluster:
        pool = store.redis.connection_pool
        info: list[Check] = []
        if hasattr(pool, "get_master_address"):
            try:
                host, port = pool.get_master_address()
                info.append(Check("sentinel", INFO, f"the sentinels name {host}:{port} as the master"))
            except Exception as exc:  # noqa: BLE001 - redis-py's MasterNotFoundError and connection errors
                return [(shown, _Unreachable(str(exc)), {})]
        return [(shown, store.redis, {"info": info})]
    redis = store.redis
    extra: dict[str, Any] = {}
    try:
        redis.spublish(f"{namespace}{{doctor}}:wake:doctor", "doctor")
        extra["spublish_ok"] = True
    except Exception as exc:  # noqa: BLE001 - any refusal or failure is reported
        extra["spublish_ok"], extra["spublish_error"] = False, str(exc)
    return [(node.name, redis.get_redis_connection(node), extra) for node in redis.get_primaries()]


class _Unreachable:
    """A client whose every command fails as a connection error (a Sentinel with no master)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def execute_command(self, *args: Any) -> Any:
        import redis

        raise redis.ConnectionError(self.why)


def _other(report: Report, url: str, namespace: str, scheme: str) -> None:
    from . import other_stores

    store = _open(report, url, namespace)
    if store is None:
        return
    try:
        checks = other_stores.admin_checks(store)
        if checks[0].verdict != ERROR:
            checks += _specific(url, namespace, scheme)
    finally:
        store.close()
    report.sections.append((report.store, checks))


def _specific(url: str, namespace: str, scheme: str) -> list[Check]:
    from . import other_stores

    if scheme == "memory":
        return [Check("scope", INFO, "memory:// is one process's own store: nothing to configure or share")]
    if scheme == "sqlite":
        from pathlib import Path
        from urllib.parse import unquote, urlsplit

        path = str(Path(unquote(urlsplit(url).path[1:])).resolve())
        return other_stores.sqlite_checks(other_stores.sqlite_facts(path))
    if scheme in ("postgresql", "postgres", "postgresql+table", "postgres+table"):
        return other_stores.postgres_checks(other_stores.postgres_facts(url))
    if scheme == "zookeeper":
        return other_stores.zookeeper_checks(other_stores.zookeeper_facts(url, namespace))
    return [Check("store", INFO, f"{scheme}:// has no checks of its own in doctor")]
