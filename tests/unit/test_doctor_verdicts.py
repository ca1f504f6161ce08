"""doctor's decisions (pure functions of the facts) and the list of Redis commands it checks,
derived from the store's Lua scripts and kept in step with what the store sends itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lockaspect.backends.redis as redis_store
from lockaspect.doctor.commands import DIRECT, acl_checks, acl_rule, lua_commands, needed_commands, sample_args
from lockaspect.doctor.redis_facts import RedisFacts, redis_checks
from lockaspect.doctor.verdicts import (
    Check,
    clock_check,
    eviction_check,
    exit_status,
    latency_check,
    parse_version,
    persistence_check,
    replicas_check,
    version_check,
)

REDIS_SOURCES = Path(redis_store.__file__).parent


def test_exit_status_is_the_worst_verdict() -> None:
    assert exit_status([]) == 0
    assert exit_status([Check("a", "ok", ""), Check("b", "info", "")]) == 0
    assert exit_status([Check("a", "ok", ""), Check("b", "warn", "")]) == 1
    assert exit_status([Check("a", "warn", ""), Check("b", "error", ""), Check("c", "info", "")]) == 2


@pytest.mark.parametrize(
    ("policy", "verdict"),
    [
        ("noeviction", "ok"),
        ("allkeys-lru", "warn"),
        ("allkeys-lfu", "warn"),
        ("allkeys-random", "warn"),
        ("volatile-lru", "warn"),  # lock keys have a TTL: volatile-* evicts them first
        ("volatile-ttl", "warn"),
        (None, "warn"),  # not read: never ok
    ],
)
def test_only_noeviction_is_ok(policy: str | None, verdict: str) -> None:
    check = eviction_check(policy, 0, "INFO refused")
    assert check.verdict == verdict
    if policy and policy.startswith("allkeys"):
        assert "fencing counter" in check.detail


def test_persistence() -> None:
    assert persistence_check(True, "always", None).verdict == "ok"
    assert persistence_check(True, "everysec", "").verdict == "ok"
    assert "last second" in persistence_check(True, "everysec", "").detail
    assert persistence_check(False, None, "").verdict == "warn"
    assert "frees every lock" in persistence_check(False, None, "").detail
    rdb_only = persistence_check(False, "everysec", "3600 1 300 100")
    assert rdb_only.verdict == "warn"
    assert "issued again" in rdb_only.detail
    assert persistence_check(None, None, None, "INFO refused").verdict == "warn"
    assert persistence_check(False, None, None, "CONFIG refused").verdict == "warn"


def test_replicas() -> None:
    assert replicas_check("master", 0, None).verdict == "info"
    assert replicas_check("master", 2, None).verdict == "info"
    assert replicas_check("master", 2, 1).verdict == "ok"
    assert replicas_check("master", 0, 1).verdict == "error"
    assert replicas_check("slave", 0, None).verdict == "error"
    assert replicas_check(None, None, None, "INFO refused").verdict == "info"
    assert replicas_check(None, None, 1, "INFO refused").verdict == "warn"


def test_version_clock_latency() -> None:
    assert parse_version("7.2.4") == (7, 2, 4)
    assert parse_version("8.1.8-rc1") == (8, 1, 8)
    assert version_check("redis", "6.0.16", None).verdict == "error"
    assert version_check("redis", "6.2.0", None).verdict == "ok"
    assert version_check("valkey", "8.1.8", "7.2.4").detail == "Valkey 8.1.8 (Redis 7.2.4 compatible)"
    assert version_check("redis", None, None, "INFO refused").verdict == "warn"
    assert clock_check(0.2).verdict == "ok"
    assert clock_check(-1.5).verdict == "warn"
    assert clock_check(None, "TIME refused").verdict == "info"
    assert latency_check([0.001, 0.003, 0.002]).detail == "median 2.00 ms over 3 PINGs"
    assert latency_check([]).verdict == "info"


def test_the_commands_come_from_the_scripts() -> None:
    script = """
    -- redis.call('FLUSHALL') in a comment is not sent
    local a = redis.call('GET', KEYS[1])
    local b = read('HEXISTS', KEYS[1], 'x')
    redis.pcall('PUBLISH', 'c', 'm')
    redis.pcall('DEL', KEYS[1]); redis.call("DEL", KEYS[2])
    """
    strict, lenient = lua_commands([script])
    assert strict == {"GET", "HEXISTS", "DEL"}
    assert lenient == {"PUBLISH"}  # only ever pcall'd: a refusal is survived


def test_the_real_scripts_commands_match_the_documented_acl() -> None:
    """docs/stores/redis.md lists the scripts' commands; the derived list agrees."""
    single = {command.name: command.need for command in needed_commands("single")}
    cluster = {command.name: command.need for command in needed_commands("cluster")}
    assert single["EVALSHA"] == single["EVAL"] == single["HSET"] == single["TIME"] == "needed"
    assert single["PUBLISH"] == "wanted"
    assert "SPUBLISH" not in single
    assert cluster["SPUBLISH"] == "wanted"
    assert "PUBLISH" not in cluster
    assert "SUBSCRIBE" in single
    assert "SSUBSCRIBE" in cluster
    assert "SUBSCRIBE" not in cluster
    assert single["WAIT"] == "replicas"
    assert "PING" not in single  # sent only behind the asyncio Sentinel and Cluster renewal batches
    assert cluster["PING"] == "needed"
    assert {c.name: c.need for c in needed_commands("sentinel")}["PING"] == "needed"
    docs = (Path(__file__).parents[2] / "docs" / "stores" / "redis.md").read_text(encoding="utf-8")
    row = re.search(r"^\| inside the scripts .*$", docs, re.MULTILINE)
    assert row is not None
    documented = set(re.findall(r"`([A-Z]+)`", row.group(0)))
    scripts = {name for name, need in single.items() if need == "needed"} - {"EVALSHA", "EVAL"}
    assert documented <= scripts  # the scripts may call more than the docs knew: doctor follows the scripts


def test_every_command_has_sample_arguments_in_the_namespace() -> None:
    for topology in ("single", "sentinel", "cluster"):
        for command in needed_commands(topology):
            call = sample_args(command.name, "ns:")
            assert call is not None, command.name
            assert call[0] == command.name.split("|")[0]
            assert not any(arg.startswith("lockaspect") for arg in call)


def test_what_the_store_sends_itself_is_listed() -> None:
    """A command name the Redis store's Python sends on the wire is in doctor's DIRECT list
    (so a new one cannot be added without doctor checking it)."""
    sent: set[str] = set()
    for path in REDIS_SOURCES.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        sent.update(re.findall(r'(?:execute_command\(|_send\(|\(\s*b?)"([A-Z]{3,})"', text))
        if re.search(r"\.scan(?:_iter)?\(", text):
            sent.add("SCAN")
    listed = {name.split("|")[0] for name, *_ in DIRECT}
    not_commands = {"LOADING"}  # an error prefix
    assert sent - not_commands <= listed, sent - listed


def test_acl_checks_and_rule() -> None:
    commands = needed_commands("single")
    assert [c.verdict for c in acl_checks(commands, {}, [], "ACL DRYRUN", False)] == ["ok"]
    refused = {"HSET": "no permission", "SCAN": "no permission", "WAIT": "no permission"}
    checks = {c.name: c.verdict for c in acl_checks(commands, refused, [], "m", False)}
    assert checks == {"acl hset": "error", "acl scan": "warn", "acl wait": "info", "acl": "info"}
    assert {c.name: c.verdict for c in acl_checks(commands, {"WAIT": "x"}, [], "m", True)}["acl wait"] == "error"
    assert acl_checks(commands, {}, ["HSET"], "m", False)[0].verdict == "warn"
    rule = acl_rule("app", "ns:", commands, with_wait=False)
    assert rule.startswith("ACL SETUSER app on ~ns:* &ns:* +evalsha +eval +script|load ")
    assert "+wait" not in rule
    assert "+wait" in acl_rule("app", "ns:", commands, with_wait=True)


def test_redis_checks_of_gathered_facts() -> None:
    commands = needed_commands("single")
    unreachable, rule = redis_checks(RedisFacts("h:1", unreachable="Connection refused"), commands, "ns:")
    assert (exit_status(unreachable), rule) == (2, None)
    good = RedisFacts(
        "h:1", server="valkey", version="8.1.8", role="master", replicas=0, policy="noeviction", maxmemory=0,
        aof=True, fsync="always", save="", latencies=[0.001], offset=0.01, acl_method="ACL DRYRUN default",
        user="default",
    )  # fmt: skip
    checks, rule = redis_checks(good, commands, "ns:")
    assert exit_status(checks) == 0
    assert rule is not None
    assert rule.startswith("ACL SETUSER default on ~ns:*")
    good.policy = "allkeys-lru"
    assert exit_status(redis_checks(good, commands, "ns:")[0]) == 1
    good.refused = {"EVALSHA": "no permission"}
    assert exit_status(redis_checks(good, commands, "ns:")[0]) == 2
