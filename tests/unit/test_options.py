"""The option table (``lockaspect.options``): every option's validator accepts its documented
values and rejects bad ones with the exact error type, on every surface that takes it: at
decoration, at ``client.lock()`` (and its family), in a policy mapping and in a TOML policy
file. Nothing reaches a store: the client points at a listening socket that no test may
connect to (checked after each test)."""

from __future__ import annotations

import inspect
import math
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import lockaspect.client
from lockaspect import (
    ConfigurationError,
    KeyTemplateError,
    LockClient,
    config,
    distributed_lock,
    distributed_semaphore,
    options,
)
from lockaspect.options import OPTIONS, POLICY_FIELDS, LockSpec, Surface

CE, TE = ConfigurationError, TypeError


def hook(_: object) -> None:
    return None


#: option -> (accepted values, [(rejected value, error type)]): the documented values.
TABLE: dict[str, tuple[list[Any], list[tuple[Any, type[Exception]]]]] = {
    "lease": (
        [None, 5, 2.5, timedelta(seconds=3)],
        [(0, CE), (-1, CE), (math.nan, CE), (math.inf, CE), (timedelta(0), CE), (True, TE), ("30", TE), ([30], TE)],
    ),
    "delay_weight": (
        [0.5, 0.25],
        [(0, CE), (1, CE), (1.5, CE), (-0.1, CE), (math.nan, CE), (True, TE), ("0.5", TE)],
    ),
    "wait": (
        [0, 0.0, 2, None, timedelta(seconds=1)],
        [(-1, CE), (math.nan, CE), (math.inf, CE), (False, TE), ("5", TE)],
    ),
    "max_hold": ([None, 10, 0.5], [(0, CE), (-1, CE), (math.nan, CE), ("x", TE), (True, TE)]),
    "on_lost": ([None, hook], [("x", TE), (5, TE)]),
    "on_failure": ([None, hook], [("fallback", TE), (5, TE)]),
    "executor": ([None, "inline"], [("threads", TE), (5, TE)]),
    "wait_strategy": (["notify", "poll"], [("sometimes", CE), ("NOTIFY", CE), (42, TE), (None, TE)]),
    "fair": ([True, False], [("yes", TE), (1, TE), (None, TE)]),
    "permits": ([1, 4], [(0, CE), (-1, CE), ("2", TE), (True, TE), (2.0, TE)]),
    "mode": ([None, "read", "write"], [("rw", CE), ("READ", CE), (1, TE)]),
    # "transaction" needs connection= (tests/integration/test_postgres_xact.py), and connection= needs it.
    "scope": (["session"], [("global", CE), ("transaction", CE), (1, TE)]),
    "connection": ([None], [(object(), CE), ("conn", CE)]),
}


def cases(surface: Surface, *, good: bool) -> list[Any]:
    params = []
    for option in OPTIONS:
        if option.name not in TABLE or surface not in option.surfaces:
            continue
        accepted, rejected = TABLE[option.name]
        if good:
            params += [pytest.param(option.name, value, id=f"{option.name}={value!r}") for value in accepted]
        else:
            params += [
                pytest.param(option.name, value, error, id=f"{option.name}={value!r}") for value, error in rejected
            ]
    return params


@pytest.fixture
def store() -> Iterator[socket.socket]:
    """A listening socket standing in for the store; the test fails if anything connected to it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield listener
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        pass
    else:
        connection.close()
        pytest.fail("something connected to the store")
    finally:
        listener.close()


@pytest.fixture
def offline(store: socket.socket) -> Iterator[LockClient]:
    """A client of the socket above: building it connects to nothing (redis-py connects lazily)."""
    client = LockClient.from_url(f"redis://127.0.0.1:{store.getsockname()[1]}/0", socket_connect_timeout=0.2)
    yield client
    client.close()


def decorate(client: LockClient, name: str, value: Any, **more: Any) -> Any:
    def work(n: int = 0) -> int:
        return n

    if name == "permits":
        return distributed_semaphore("k", permits=value, client=client, **more)(work)
    return distributed_lock("k", client=client, **{name: value}, **more)(work)


def client_call(client: LockClient, name: str, value: Any) -> Any:
    """The client-family method that takes ``name``, called with ``value`` (never entered)."""
    if name == "permits":
        return client.semaphore("k", permits=value)
    if name == "mode":
        if value == "read":
            return client.rw_lock("k").read()
        if value == "write":
            return client.rw_lock("k").write()
        return LockSpec.create(mode=value)  # what read() / write() call with their mode
    return client.lock("k", **{name: value})


class TestTheTable:
    def test_one_option_per_lockspec_field(self) -> None:
        assert {o.name for o in OPTIONS if o.spec} == {f.name for f in fields(LockSpec)}

    def test_names_are_unique(self) -> None:
        assert len({o.name for o in OPTIONS}) == len(OPTIONS)

    def test_defaults_make_the_default_spec(self) -> None:
        assert options.spec_of({}) == LockSpec() == LockSpec.create()
        assert LockSpec.create() is options.DEFAULT_SPEC

    def test_lockspec_still_imports_from_the_client(self) -> None:
        assert lockaspect.client.LockSpec is LockSpec
        assert lockaspect.client.WAIT_STRATEGIES == ("notify", "poll")

    def test_policy_fields_come_from_the_table(self) -> None:
        assert config.POLICY_FIELDS is POLICY_FIELDS
        assert {
            "key",
            "lease",
            "delay_weight",
            "wait",
            "max_hold",
            "on_failure",
            "on_lost",
            "executor",
            "wait_strategy",
            "fair",
            "mode",
        } == POLICY_FIELDS

    def test_toml_spellings_of_none(self) -> None:
        assert {o.name: o.toml_none for o in OPTIONS if o.toml_none} == {
            "lease": "watchdog",
            "wait": "forever",
            "max_hold": "none",
        }

    def test_decorator_options_are_keyword_parameters_of_the_decorators(self) -> None:
        """The signatures are the one other place an option is named: they must agree with the table."""
        taken = set(inspect.signature(distributed_lock).parameters) | set(
            inspect.signature(distributed_semaphore).parameters
        )
        declared = {o.name for o in OPTIONS if Surface.DECORATOR in o.surfaces}
        assert declared == taken - {"client"}

    def test_client_options_are_keyword_parameters_of_the_client_family(self) -> None:
        methods: list[Callable[..., Any]] = [
            LockClient.lock,
            LockClient.fair_lock,
            LockClient.multi_lock,
            LockClient.semaphore,
            lockaspect.client.RWLock.read,
            lockaspect.client.RWLock.write,
        ]
        taken = set().union(*(inspect.signature(m).parameters for m in methods)) - {"self", "key", "keys"}
        taken -= {"count"}  # a semaphore hold's permits: lockaspect.manual.weighted checks it
        declared = {o.name for o in OPTIONS if Surface.CLIENT in o.surfaces}
        assert taken == declared - {"mode"}  # mode: rw_lock(key).read() / .write()

    def test_create_keeps_its_signature(self) -> None:
        parameters = inspect.signature(LockSpec.create).parameters
        assert list(parameters) == [f.name for f in fields(LockSpec)]
        assert {name: p.default for name, p in parameters.items()} == {
            name: options.DEFAULTS[name] for name in parameters
        }


class TestAtDecoration:
    @pytest.mark.parametrize(("name", "value"), cases(Surface.DECORATOR, good=True))
    def test_accepts(self, offline: LockClient, name: str, value: Any) -> None:
        decorate(offline, name, value)

    @pytest.mark.parametrize(("name", "value", "error"), cases(Surface.DECORATOR, good=False))
    def test_rejects(self, offline: LockClient, name: str, value: Any, error: type[Exception]) -> None:
        with pytest.raises(error, match=name) as info:
            decorate(offline, name, value)
        assert type(info.value) is error

    @pytest.mark.parametrize(("name", "value", "error"), cases(Surface.DECORATOR, good=False))
    def test_rejects_with_a_policy_not_configured_yet(
        self, offline: LockClient, name: str, value: Any, error: type[Exception]
    ) -> None:
        """Explicit options are checked at decoration even when the policy is merged in later."""
        config.configure(policies={})
        with pytest.raises(error, match=name):
            decorate(offline, name, value, policy="later")

    def test_executor_objects(self, offline: LockClient) -> None:
        with ThreadPoolExecutor(max_workers=1) as pool:
            decorate(offline, "executor", pool)
        processes = ProcessPoolExecutor(max_workers=1)
        try:
            with pytest.raises(TypeError, match="ProcessPoolExecutor"):
                decorate(offline, "executor", processes)
        finally:
            processes.shutdown()

    @pytest.mark.parametrize(
        ("given", "error", "match"),
        [
            ({"fair": True, "mode": "read"}, CE, "read-write"),
            ({"keys": ["a", "b"], "fair": True}, CE, "keys="),
            ({"keys": ["a", "b"], "mode": "write"}, CE, "keys="),
            ({"keys": ["a"], "key": "b"}, CE, "not both"),
            ({"keys": []}, CE, "at least one"),
            ({"keys": 5}, TE, "keys"),
            ({"keys": [""]}, KeyTemplateError, "empty"),
            ({"key": 42}, TE, "key must be a template string or a callable"),
            ({"key": ""}, KeyTemplateError, "empty"),
            ({"policy": ""}, TE, "policy"),
            ({"delay_weight": 0.995}, CE, "0.150s"),  # the margin against a 30 s watchdog lease, 0.1 s tick
        ],
    )
    def test_rules(self, offline: LockClient, given: dict[str, Any], error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match) as info:
            distributed_lock(client=offline, **given)(lambda: None)
        assert type(info.value) is error

    def test_semaphore_cannot_be_fair(self) -> None:
        with pytest.raises(ConfigurationError, match="cannot be fair"):
            options.check({"permits": 2, "fair": True})

    def test_keys_and_an_executor(self, offline: LockClient) -> None:
        with ThreadPoolExecutor(max_workers=1) as pool, pytest.raises(ConfigurationError, match="executor"):
            distributed_lock(keys=["a", "b"], executor=pool, client=offline)(lambda: None)
        distributed_lock(keys=["a", "b"], executor="inline", client=offline)(lambda: None)

    def test_a_fixed_lease_skips_the_margin(self, offline: LockClient) -> None:
        distributed_lock("k", lease=5, delay_weight=0.999, client=offline)(lambda: None)


class TestPolicyMergedWithExplicit:
    def test_explicit_wins_including_none(self) -> None:
        merged = options.merge({"lease": 30, "wait": 5, "key": "p"}, {"lease": None})
        assert (merged["lease"], merged["wait"], merged["key"], merged["fair"]) == (None, 5, "p", False)

    def test_keys_drop_the_policys_key(self) -> None:
        assert options.merge({"key": "p"}, {"keys": ["a"]})["key"] is None

    def test_a_rule_across_policy_and_explicit_fails_at_decoration(self, offline: LockClient) -> None:
        config.configure(policies={"desk": {"fair": True}})
        with pytest.raises(ConfigurationError, match="keys="):
            distributed_lock(keys=["a", "b"], policy="desk", client=offline)(lambda: None)

    def test_a_rule_across_a_later_policy_and_explicit_fails_at_the_first_call(self, offline: LockClient) -> None:
        """With the policy not configured at decoration, the call fails, before any I/O."""
        config.configure(policies={})
        work: Callable[[], None] = distributed_lock(keys=["a", "b"], policy="desk", client=offline)(lambda: None)
        config.configure(policies={"desk": {"fair": True}})
        with pytest.raises(ConfigurationError, match="keys="):
            work()

    def test_a_policy_margin_is_checked_against_the_client(self, offline: LockClient) -> None:
        config.configure(policies={"tight": {"delay_weight": 0.995}})
        with pytest.raises(ConfigurationError, match=r"delay_weight=0\.995"):
            distributed_lock("k", policy="tight", client=offline)(lambda: None)


class TestAtClientLock:
    def test_building_the_client_connects_to_nothing(self, offline: LockClient, store: socket.socket) -> None:
        with pytest.raises(BlockingIOError):
            store.accept()

    @pytest.mark.parametrize(("name", "value"), cases(Surface.CLIENT, good=True))
    def test_accepts(self, offline: LockClient, name: str, value: Any) -> None:
        client_call(offline, name, value)

    @pytest.mark.parametrize(("name", "value", "error"), cases(Surface.CLIENT, good=False))
    def test_rejects(self, offline: LockClient, name: str, value: Any, error: type[Exception]) -> None:
        with pytest.raises(error, match=name) as info:
            client_call(offline, name, value)
        assert type(info.value) is error

    @pytest.mark.parametrize(
        "method",
        [
            lambda c, **o: c.lock("k", **o),
            lambda c, **o: c.fair_lock("k", **o),
            lambda c, **o: c.multi_lock(["a", "b"], **o),
            lambda c, **o: c.semaphore("k", permits=2, **o),
            lambda c, **o: c.rw_lock("k").read(**o),
            lambda c, **o: c.rw_lock("k").write(**o),
        ],
        ids=["lock", "fair_lock", "multi_lock", "semaphore", "read", "write"],
    )
    @pytest.mark.parametrize(
        ("given", "error"),
        [
            ({"lease": -1}, CE),
            ({"wait": "5"}, TE),
            ({"delay_weight": 2}, CE),
            ({"max_hold": 0}, CE),
            ({"on_lost": "x"}, TE),
            ({"wait_strategy": 1}, TE),
        ],
        ids=str,
    )
    def test_every_method_checks(
        self, offline: LockClient, method: Callable[..., Any], given: dict[str, Any], error: type[Exception]
    ) -> None:
        with pytest.raises(error, match=next(iter(given))) as info:
            method(offline, **given)
        assert type(info.value) is error

    def test_wait_false_is_not_zero(self, offline: LockClient) -> None:
        with pytest.raises(TypeError, match="wait"):
            offline.lock("k", wait=False)

    def test_set_permits_checks_before_any_io(self, offline: LockClient) -> None:
        with pytest.raises(ConfigurationError, match="permits"):
            offline.set_permits("k", 0)


def toml_literal(value: Any) -> str | None:
    """``value`` written in TOML, or ``None`` if TOML cannot write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    return None


class TestInAPolicy:
    @pytest.mark.parametrize(("name", "value"), [*cases(Surface.POLICY, good=True), ("lease", "watchdog")])
    def test_mapping_accepts(self, name: str, value: Any) -> None:
        if value is None and not options.BY_NAME[name].policy_none:
            pytest.skip(f"{name}=None is refused in a policy")
        config.configure(policies={"p": {name: value}})
        assert config.get_policy("p") == {name: None if value == "watchdog" else value}

    @pytest.mark.parametrize(("name", "value", "error"), cases(Surface.POLICY, good=False))
    def test_mapping_rejects(self, name: str, value: Any, error: type[Exception]) -> None:
        """In a policy every bad value is a ConfigurationError naming the policy, its source and the option."""
        config.configure(policies={"good": {"key": "good"}})
        with pytest.raises(ConfigurationError, match=rf"^policy 'p' in configure\(\): .*{name}"):
            config.configure(policies={"p": {name: value}})
        assert config.policy_names() == ["good"]

    @pytest.mark.parametrize("name", ["key", "delay_weight"])
    def test_none_that_means_the_default_is_refused(self, name: str) -> None:
        with pytest.raises(ConfigurationError, match=name):
            config.configure(policies={"p": {name: None}})

    @pytest.mark.parametrize("name", ["permits", "keys", "policy", "client"])
    def test_decorator_only_options_are_unknown(self, name: str) -> None:
        with pytest.raises(ConfigurationError, match=f"unknown option.*{name}"):
            config.configure(policies={"p": {name: 2}})

    def test_a_key_template_is_parsed(self) -> None:
        with pytest.raises(ConfigurationError, match="order"):
            config.configure(policies={"p": {"key": "order:<user.>"}})

    def test_rules_apply_within_a_policy(self) -> None:
        with pytest.raises(ConfigurationError, match="read-write"):
            config.configure(policies={"p": {"mode": "read", "fair": True}})

    @pytest.mark.parametrize(("name", "value"), cases(Surface.TOML, good=True))
    def test_toml_accepts(self, tmp_path: Path, name: str, value: Any) -> None:
        literal = toml_literal(value) or next(
            (f'"{o.toml_none}"' for o in OPTIONS if o.name == name and o.toml_none and value is None), None
        )
        if literal is None:
            pytest.skip("TOML cannot write this value")
        path = tmp_path / "locks.toml"
        path.write_text(f'[locks."p"]\n{name} = {literal}\n', encoding="utf-8")
        policies = config.load_policies(path)
        expected = value.total_seconds() if isinstance(value, timedelta) else value
        assert policies == {"p": {name: expected}}

    @pytest.mark.parametrize(("name", "value", "error"), cases(Surface.TOML, good=False))
    def test_toml_rejects(self, tmp_path: Path, name: str, value: Any, error: type[Exception]) -> None:
        literal = toml_literal(value)
        if literal is None:
            pytest.skip("TOML cannot write this value")
        path = tmp_path / "locks.toml"
        path.write_text(f'[locks."p"]\n{name} = {literal}\n', encoding="utf-8")
        with pytest.raises(ConfigurationError, match=rf"policy 'p' in .*locks\.toml: .*{name}"):
            config.configure(policies=path)

    @pytest.mark.parametrize("name", ["on_failure", "on_lost"])
    def test_toml_cannot_set_a_hook(self, tmp_path: Path, name: str) -> None:
        path = tmp_path / "locks.toml"
        path.write_text(f'[locks."p"]\n{name} = "module.function"\n', encoding="utf-8")
        with pytest.raises(ConfigurationError, match=f"{name} cannot be set in a TOML file"):
            config.load_policies(path)

    def test_toml_executor_inline_only(self, tmp_path: Path) -> None:
        path = tmp_path / "locks.toml"
        path.write_text('[locks."p"]\nexecutor = "inline"\n[locks."q"]\nexecutor = "threads"\n', encoding="utf-8")
        with pytest.raises(ConfigurationError, match=r"policy 'q'.*executor"):
            config.load_policies(path)
