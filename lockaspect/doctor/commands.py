"""The exact Redis commands lockaspect sends, for the ACL check and the rule doctor prints.

Derived at run time from the store's scripts (every ``redis.call('CMD'``, ``redis.pcall('CMD'``
and lib.lua's ``read('CMD'`` in the scripts of :data:`~lockaspect.backends.redis._layout.SCRIPTS`,
as loaded with their includes; the Cluster variant's ``SPUBLISH`` for ``PUBLISH``), plus the
commands the store sends itself (:data:`DIRECT`). Each command is *needed* (without it locks
fail), *wanted* (without it something degrades: waiters poll, ``lockaspect list`` fails) or
needed only with ``wait_replicas``. Also: sample arguments for each, in the namespace, for
``ACL DRYRUN`` and ``redis.acl_check_cmd``. No I/O but reading the package's Lua files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .verdicts import ERROR, INFO, OK, WARN, Check

__all__ = ["DIRECT", "Command", "acl_checks", "acl_rule", "lua_commands", "needed_commands", "sample_args"]

_STRICT = re.compile(r"""(?:redis\.call|\bread)\(\s*['"]([A-Za-z]+)['"]""")
_LENIENT = re.compile(r"""redis\.pcall\(\s*['"]([A-Za-z]+)['"]""")


@dataclass(frozen=True)
class Command:
    """A command (``SCRIPT|LOAD`` for a subcommand) and why lockaspect sends it."""

    name: str
    need: str  # "needed", "wanted" or "replicas"
    why: str

    @property
    def acl(self) -> str:
        """Its ACL rule: ``+evalsha``, ``+script|load``."""
        return "+" + self.name.lower()


#: The topologies a :data:`DIRECT` command is sent on.
ALL = ("single", "sentinel", "cluster")
NOT_CLUSTER = ("single", "sentinel")
ASYNC_BATCHES = ("sentinel", "cluster")
CLUSTER = ("cluster",)

#: What the store sends itself, outside the scripts (lockaspect/backends/redis/*.py):
#: (name, need, why, the topologies that send it).
DIRECT: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("EVALSHA", "needed", "every lock operation (_script.py)", ALL),
    ("EVAL", "needed", "a script after NOSCRIPT (_script.py, _renewal.py)", ALL),
    ("SCRIPT|LOAD", "wanted", "renewals after NOSCRIPT, else EVAL with the full text (_renewal.py)", ALL),
    ("SUBSCRIBE", "wanted", "release wake-ups; without it waiters poll (notify.py)", NOT_CLUSTER),
    ("UNSUBSCRIBE", "wanted", "release wake-ups (notify.py)", NOT_CLUSTER),
    ("SSUBSCRIBE", "wanted", "release wake-ups on a cluster; without it waiters poll (_cluster_notify.py)", CLUSTER),
    ("SUNSUBSCRIBE", "wanted", "release wake-ups on a cluster (_cluster_notify.py)", CLUSTER),
    ("SCAN", "wanted", "held_locks() and lockaspect list (store.py)", ALL),
    ("PING", "needed", "behind each asyncio renewal batch (_async_wire.py)", ASYNC_BATCHES),
    ("WAIT", "replicas", "wait_replicas (_layout.py)", ALL),
    ("CLUSTER|SLOTS", "needed", "the cluster client's slot map (redis-py)", CLUSTER),
    ("COMMAND", "needed", "the cluster client's key positions (redis-py)", CLUSTER),
    ("ASKING", "wanted", "commands during a slot migration (_cluster_wire.py)", CLUSTER),
)


def lua_commands(sources: Iterable[str]) -> tuple[set[str], set[str]]:
    """The commands the scripts ``sources`` call with ``redis.call`` (or lib.lua's ``read``,
    which runs its command again with ``redis.call`` when ``pcall`` failed), and those they
    call only with ``redis.pcall``, whose refusal a script survives (the wake-up ``PUBLISH``)."""
    strict: set[str] = set()
    lenient: set[str] = set()
    for source in sources:
        code = "\n".join(line.split("--", 1)[0] for line in source.splitlines())
        strict.update(match.group(1).upper() for match in _STRICT.finditer(code))
        lenient.update(match.group(1).upper() for match in _LENIENT.finditer(code))
    return strict, lenient - strict


def script_sources(sharded: bool) -> list[str]:
    """The text of every script the Redis store runs (the Cluster variant with ``sharded``)."""
    from ..backends.redis._layout import SCRIPTS
    from ..backends.redis._script import LuaScript

    return [LuaScript(name, sharded=sharded).source for name in SCRIPTS]


def needed_commands(topology: str = "single", sources: Sequence[str] | None = None) -> list[Command]:
    """Every command the store of ``topology`` (``"single"``, ``"sentinel"`` or
    ``"cluster"``) sends, in the order of :data:`DIRECT` then the scripts' (sorted)."""
    texts = script_sources(topology == "cluster") if sources is None else list(sources)
    strict, lenient = lua_commands(texts)
    commands = [Command(name, need, why) for name, need, why, where in DIRECT if topology in where]
    for name in sorted(strict | lenient):
        if name in lenient:
            commands.append(Command(name, "wanted", "release wake-ups inside the scripts; without it waiters poll"))
        else:
            commands.append(Command(name, "needed", "called by the Lua scripts"))
    return commands


#: Arguments after the key for the scripts' commands (the shortest call the arity allows).
_AFTER_KEY = {
    "SET": 1, "PEXPIRE": 1, "HGET": 1, "HSET": 2, "HDEL": 1, "HEXISTS": 1, "HMGET": 1, "LPOS": 1, "LPUSH": 1,
    "RPUSH": 1, "LRANGE": 2, "LREM": 2, "LTRIM": 2, "ZADD": 2, "ZCOUNT": 2, "ZRANGE": 2, "ZRANGEBYSCORE": 2,
    "ZREM": 1, "ZREMRANGEBYSCORE": 2, "ZSCORE": 1, "EXPIRE": 1, "PEXPIREAT": 1, "HINCRBY": 2, "SETEX": 2,
}  # fmt: skip
_NO_KEY = {"TIME": 0, "PING": 0}


def sample_args(name: str, namespace: str) -> list[str] | None:
    """A call of ``name`` on a key (and a channel) of ``namespace``, for the ACL checks;
    ``None`` when its shape is not known here (then it is not checked)."""
    key = f"{namespace}{{doctor}}"
    channel = f"{key}:wake:doctor"
    special = {
        "EVALSHA": ["EVALSHA", "0" * 40, "1", key],
        "EVAL": ["EVAL", "return 1", "1", key],
        "SCRIPT|LOAD": ["SCRIPT", "LOAD", "return 1"],
        "SUBSCRIBE": ["SUBSCRIBE", channel],
        "UNSUBSCRIBE": ["UNSUBSCRIBE", channel],
        "SSUBSCRIBE": ["SSUBSCRIBE", channel],
        "SUNSUBSCRIBE": ["SUNSUBSCRIBE", channel],
        "PUBLISH": ["PUBLISH", channel, "doctor"],
        "SPUBLISH": ["SPUBLISH", channel, "doctor"],
        "SCAN": ["SCAN", "0", "MATCH", f"{namespace}*", "COUNT", "500"],
        "WAIT": ["WAIT", "0", "0"],
        "CLUSTER|SLOTS": ["CLUSTER", "SLOTS"],
        "COMMAND": ["COMMAND"],
        "ASKING": ["ASKING"],
    }
    if name in special:
        return special[name]
    if name in _NO_KEY:
        return [name]
    if name in ("GET", "INCR", "DEL", "EXISTS", "TYPE", "PTTL", "HLEN", "LLEN", "LPOP", "ZCARD", "TTL", "HGETALL"):
        return [name, key]
    if name in _AFTER_KEY:
        return [name, key, *["0"] * _AFTER_KEY[name]]
    return None


def acl_rule(user: str, namespace: str, commands: Iterable[Command], with_wait: bool) -> str:
    """``ACL SETUSER`` adding what lockaspect needs to ``user``: the namespace's keys and
    channels, and every needed and wanted command (``WAIT`` with ``wait_replicas``)."""
    grants = [c.acl for c in commands if c.need != "replicas" or with_wait]
    return f"ACL SETUSER {user} on ~{namespace}* &{namespace}* " + " ".join(grants)


def acl_checks(
    commands: Sequence[Command], refused: Mapping[str, str], unchecked: Sequence[str], method: str, with_wait: bool
) -> list[Check]:
    """The verdicts of the ACL check: ``refused`` maps each command refused to why;
    ``unchecked`` names the commands not checked; ``with_wait``: the clients use
    ``wait_replicas`` (then ``WAIT`` is needed)."""
    checks: list[Check] = []
    bad = 0
    for command in commands:
        if command.name not in refused:
            continue
        why = f"refused: {refused[command.name]} ({command.why})"
        if command.need == "needed" or (command.need == "replicas" and with_wait):
            checks.append(Check(f"acl {command.name.lower()}", ERROR, why))
            bad += 1
        elif command.need == "wanted":
            checks.append(Check(f"acl {command.name.lower()}", WARN, why))
            bad += 1
        else:
            checks.append(Check(f"acl {command.name.lower()}", INFO, f"{why}; needed only with wait_replicas"))
    if unchecked:
        checks.append(Check("acl unchecked", WARN, f"not checked: {', '.join(unchecked)}"))
    allowed = len(commands) - len(refused) - len(unchecked)
    if not bad and not unchecked:
        checks.append(Check("acl", OK, f"the user may run the {allowed} commands lockaspect needs ({method})"))
    else:
        checks.append(Check("acl", INFO, f"{allowed} of {len(commands)} commands allowed ({method})"))
    return checks
