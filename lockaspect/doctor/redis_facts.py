"""What doctor asks a Redis or Valkey server (the I/O), gathered into :class:`RedisFacts`;
:func:`redis_checks` turns them into verdicts (pure).

Every question is asked in a way that changes nothing: ``INFO``, ``CONFIG GET``, ``HELLO``,
``TIME``, ``PING``, ``EVAL "return 1"``, a ``PUBLISH`` to a channel of the namespace nobody
listens on, and the ACL questions (``ACL DRYRUN`` when the user may run it, else
``redis.acl_check_cmd`` in a script: neither runs the command it checks). A question the
user may not ask leaves its fact unknown, with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .commands import Command, acl_checks, acl_rule, sample_args
from .verdicts import (
    ERROR,
    OK,
    WARN,
    Check,
    clock_check,
    eviction_check,
    latency_check,
    persistence_check,
    replicas_check,
    sharded_pubsub_check,
    version_check,
)

__all__ = ["PINGS", "RedisFacts", "gather", "redis_checks"]

#: Round trips timed for the latency line.
PINGS = 5


@dataclass
class RedisFacts:
    """What one server told doctor (``None``: not known; the ``*_unknown`` field says why)."""

    where: str
    unreachable: str | None = None
    server: str = "redis"
    version: str | None = None
    compatible: str | None = None
    version_unknown: str = ""
    role: str | None = None
    replicas: int | None = None
    replication_unknown: str = ""
    policy: str | None = None
    maxmemory: int | None = None
    memory_unknown: str = ""
    aof: bool | None = None
    fsync: str | None = None
    save: str | None = None
    persistence_unknown: str = ""
    scripts_error: str | None = None
    publish_error: str | None = None
    spublish_error: str | None = None
    spublish_ok: bool | None = None
    user: str | None = None
    refused: dict[str, str] = field(default_factory=dict)
    unchecked: list[str] = field(default_factory=list)
    acl_method: str = ""
    latencies: list[float] = field(default_factory=list)
    offset: float | None = None
    clock_unknown: str = ""


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _why(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _pairs(reply: Any) -> dict[str, Any]:
    """A RESP2 map (a flat list) or a RESP3 one as a dict of str keys."""
    if isinstance(reply, dict):
        return {_text(k): v for k, v in reply.items()}
    items = list(reply or [])
    return {_text(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)}


def _ping(redis: Any, facts: RedisFacts) -> bool:
    """Time PINGs; ``False`` when the server cannot be reached at all."""
    import redis as redis_py

    for _ in range(PINGS):
        started = time.perf_counter()
        try:
            redis.execute_command("PING")
        except redis_py.exceptions.NoPermissionError:
            return True  # reachable: it answered, refusing
        except redis_py.exceptions.ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                facts.unreachable = f"authentication failed: {_why(exc)}"
                return False
            return True
        except (redis_py.exceptions.ConnectionError, redis_py.exceptions.TimeoutError, OSError) as exc:
            facts.unreachable = _why(exc)
            return False
        facts.latencies.append(time.perf_counter() - started)
    return True


def _server_info(redis: Any, facts: RedisFacts) -> None:
    import redis as redis_py

    info: dict[str, Any] = {}
    try:
        for section in ("server", "memory", "persistence", "replication"):
            info.update(redis.info(section))
    except redis_py.exceptions.ResponseError as exc:
        reason = f"INFO refused: {_why(exc)}"
        facts.version_unknown = facts.memory_unknown = facts.persistence_unknown = reason
        facts.replication_unknown = reason
        _hello(redis, facts)
        return
    if "valkey_version" in info:
        facts.server, facts.version, facts.compatible = (
            "valkey",
            str(info["valkey_version"]),
            str(info["redis_version"]),
        )
    else:
        facts.version = str(info.get("redis_version"))
    facts.role = str(info.get("role")) if "role" in info else None
    facts.replicas = int(info["connected_slaves"]) if "connected_slaves" in info else None
    facts.policy = str(info["maxmemory_policy"]) if "maxmemory_policy" in info else None
    facts.maxmemory = int(info["maxmemory"]) if "maxmemory" in info else None
    facts.aof = bool(int(info["aof_enabled"])) if "aof_enabled" in info else None
    facts.memory_unknown = "" if facts.policy else "not in INFO memory"
    try:
        config = {_text(k): _text(v) for k, v in _pairs(redis.execute_command("CONFIG", "GET", "save")).items()}
        facts.save = config.get("save")
        fsync = _pairs(redis.execute_command("CONFIG", "GET", "appendfsync"))
        facts.fsync = _text(fsync["appendfsync"]) if "appendfsync" in fsync else None
    except redis_py.exceptions.ResponseError as exc:
        facts.persistence_unknown = f"CONFIG GET refused: {_why(exc)}"


def _hello(redis: Any, facts: RedisFacts) -> None:
    """The version and role from HELLO, which every user may send (Redis 6+)."""
    import redis as redis_py

    try:
        hello = _pairs(redis.execute_command("HELLO"))
    except redis_py.exceptions.ResponseError:
        return
    name = _text(hello.get("server", "redis"))
    facts.server = "valkey" if name == "valkey" else "redis"
    facts.version = _text(hello["version"]) if "version" in hello else None
    facts.role = _text(hello["role"]) if "role" in hello else None
    facts.version_unknown = "" if facts.version else facts.version_unknown


def _features(redis: Any, facts: RedisFacts, namespace: str) -> None:
    import redis as redis_py

    try:
        redis.execute_command("EVAL", "return 1", "0")
    except redis_py.exceptions.ResponseError as exc:
        facts.scripts_error = _why(exc)
    try:
        redis.execute_command("PUBLISH", f"{namespace}{{doctor}}:wake:doctor", "doctor")
    except redis_py.exceptions.ResponseError as exc:
        facts.publish_error = _why(exc)
    started = time.time()
    try:
        seconds, micros = redis.execute_command("TIME")
    except redis_py.exceptions.ResponseError as exc:
        facts.clock_unknown = f"TIME refused: {_why(exc)}"
        return
    ended = time.time()
    facts.offset = int(seconds) + int(micros) / 1e6 - (started + ended) / 2


def _dryrun(redis: Any, user: str, calls: dict[str, list[str]], facts: RedisFacts) -> bool:
    """``ACL DRYRUN`` each call; ``False`` when the user may not (or the server cannot: Redis
    before 7)."""
    import redis as redis_py

    try:
        redis.execute_command("ACL", "DRYRUN", user, "PING")
    except redis_py.exceptions.ResponseError:
        return False
    for name, call in calls.items():
        try:
            answer = _text(redis.execute_command("ACL", "DRYRUN", user, *call))
        except redis_py.exceptions.ResponseError as exc:
            answer = _why(exc)
        if answer != "OK":
            facts.refused[name] = answer
    facts.acl_method = f"ACL DRYRUN {user}"
    return True


def _script_check(redis: Any, calls: dict[str, list[str]], facts: RedisFacts) -> bool:
    """``redis.acl_check_cmd`` for every call in one script; ``False`` when it cannot run."""
    import redis as redis_py

    source = resources.files(__package__).joinpath("acl_check.lua").read_text(encoding="utf-8")
    flat: list[str] = []
    for call in calls.values():
        flat += [str(len(call)), *call]
    try:
        replies = redis.execute_command("EVAL", source, "0", *flat)
    except redis_py.exceptions.ResponseError as exc:
        facts.acl_method = f"not checked: {_why(exc)}"
        return False
    for name, reply in zip(calls, replies, strict=True):
        if reply == 0:
            facts.refused[name] = "not allowed for this user"
        elif reply != 1:
            if "attempt to call" in _text(reply) or "nil" in _text(reply):
                facts.refused.clear()
                facts.acl_method = "not checked: no redis.acl_check_cmd (Redis < 7)"
                return False
            facts.refused[name] = _text(reply)
    facts.acl_method = "redis.acl_check_cmd"
    return True


def _acl(redis: Any, facts: RedisFacts, commands: list[Command], namespace: str) -> None:
    import redis as redis_py

    calls: dict[str, list[str]] = {}
    for command in commands:
        call = sample_args(command.name, namespace)
        if call is None:
            facts.unchecked.append(command.name)
        else:
            calls[command.name] = call
    try:
        facts.user = _text(redis.execute_command("ACL", "WHOAMI"))
    except redis_py.exceptions.ResponseError:
        facts.user = None
    if facts.user is not None and _dryrun(redis, facts.user, calls, facts):
        return
    if facts.scripts_error is None and _script_check(redis, calls, facts):
        return
    if facts.scripts_error is not None:
        facts.refused["EVAL"] = facts.scripts_error
        facts.acl_method = "EVAL refused: nothing else could be checked"
    facts.unchecked = [command.name for command in commands if command.name not in facts.refused]


def gather(redis: Any, where: str, namespace: str, commands: list[Command]) -> RedisFacts:
    """Ask one server (a redis-py client) everything doctor checks."""
    facts = RedisFacts(where)
    if not _ping(redis, facts):
        return facts
    _server_info(redis, facts)
    _features(redis, facts, namespace)
    _acl(redis, facts, commands, namespace)
    return facts


def redis_checks(
    facts: RedisFacts,
    commands: list[Command],
    namespace: str,
    *,
    wait_replicas: int | None = None,
    cluster: bool = False,
) -> tuple[list[Check], str | None]:
    """The verdicts on one server, and the ACL rule to print (``None``: unreachable)."""
    if facts.unreachable is not None:
        return [Check("reachable", ERROR, facts.unreachable)], None
    checks = [Check("reachable", OK, "answered PING" if facts.latencies else "answered")]
    checks.append(version_check(facts.server, facts.version, facts.compatible, facts.version_unknown))
    if facts.scripts_error is None:
        checks.append(Check("scripts", OK, "EVAL answered (Lua scripting)"))
    else:
        checks.append(Check("scripts", ERROR, f"EVAL refused: {facts.scripts_error}"))
    if cluster:
        pass  # a cluster's wake-ups use sharded pub/sub, checked next
    elif facts.publish_error is None:
        checks.append(Check("pub/sub", OK, "PUBLISH answered: waiters are woken at a release"))
    else:
        checks.append(Check("pub/sub", WARN, f"PUBLISH refused ({facts.publish_error}): waiters poll"))
    checks.append(
        sharded_pubsub_check(facts.version, facts.server, cluster, facts.spublish_ok, facts.spublish_error or "")
    )
    unchecked = facts.unchecked
    checks += acl_checks(commands, facts.refused, unchecked, facts.acl_method, wait_replicas is not None)
    checks.append(eviction_check(facts.policy, facts.maxmemory, facts.memory_unknown))
    checks.append(persistence_check(facts.aof, facts.fsync, facts.save, facts.persistence_unknown))
    checks.append(replicas_check(facts.role, facts.replicas, wait_replicas, facts.replication_unknown))
    checks.append(latency_check(facts.latencies))
    checks.append(clock_check(facts.offset, facts.clock_unknown))
    rule = acl_rule(facts.user or "<user>", namespace, commands, wait_replicas is not None)
    return checks, rule
