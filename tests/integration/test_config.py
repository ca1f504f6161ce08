"""Process-wide configuration against a real server: the default client (explicit, from a
URL, from ``LOCKASPECT_URL``), named policies (dict and TOML), and client construction."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import (
    ConfigurationError,
    FailureContext,
    LockClient,
    LockNotAcquired,
    configure,
    current_lease,
    distributed_lock,
)
from lockaspect import config as lockconfig
from lockaspect.testing import LockServer


@pytest.fixture(autouse=True)
def _close_clients_configure_built() -> Iterator[None]:
    """Close a default client that configure() or LOCKASPECT_URL built during the test."""
    before = lockconfig._client
    yield
    built = lockconfig._client
    if built is not None and built is not before and lockconfig._owned:
        built.close()


@pytest.fixture
def unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No default client, no policies and no ``LOCKASPECT_URL`` (conftest restores the rest)."""
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    lockconfig._client, lockconfig._owned, lockconfig._policies = None, False, {}
    lockconfig._generation += 1


@pytest.fixture
def plain(make_client: Callable[..., LockClient]) -> LockClient:
    """A client with the library's defaults (30 s watchdog lease, 100 ms tick)."""
    return make_client()


class User:
    def __init__(self, id: int) -> None:
        self.id = id


def unique(prefix: str) -> str:
    """A key no other test in the session uses (for clients in the default namespace)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class TestDefaultClient:
    def test_configured_client_is_used_by_decorators_without_one(
        self, unconfigured: None, plain: LockClient, raw: Any
    ) -> None:
        """After ``configure(client)`` a decorator that names no client locks on that client's store."""
        assert configure(plain) is plain

        @distributed_lock(key="cfg:<n>")
        def work(n: int) -> int:
            return raw.exists(plain.backend.lock_key("cfg:1"))

        assert work(1) == 1
        assert raw.exists(plain.backend.lock_key("cfg:1")) == 0

    def test_client_is_looked_up_at_call_time(self, unconfigured: None, plain: LockClient, raw: Any) -> None:
        """A function decorated before any configuration uses the client configured later."""

        @distributed_lock(key="late:<n>")
        def work(n: int) -> int:
            return raw.exists(plain.backend.lock_key("late:2"))

        configure(plain)
        assert work(2) == 1

    def test_configure_url_builds_a_client_and_closes_it_when_replaced(
        self, unconfigured: None, lock_server: LockServer, plain: LockClient
    ) -> None:
        """A client built by ``configure(url=...)`` is closed when replaced; a client passed in stays open."""
        first = configure(url=lock_server.url)
        assert isinstance(first, LockClient)
        assert not first.closed
        with first.lock(unique("built")) as lease:
            assert lease.fencing_token >= 1

        second = configure(url=lock_server.url)
        assert second is not first
        assert first.closed
        assert not second.closed

        assert configure(plain) is plain
        assert second.closed

        third = configure(url=lock_server.url)
        assert third is not plain
        assert not plain.closed  # the caller's client stays the caller's

    def test_configure_without_arguments_keeps_the_current_client(self, plain: LockClient) -> None:
        """``configure()`` with neither client nor URL changes nothing and returns the current default."""
        configure(plain)
        assert configure() is plain
        assert not plain.closed

    def test_no_client_and_no_environment_variable(self, unconfigured: None, commands: Any) -> None:
        """With no client and no ``LOCKASPECT_URL``, a decorated call raises a ``ConfigurationError`` naming it."""
        ran: list[int] = []

        @distributed_lock(key="nothing:<n>")
        def work(n: int) -> None:
            ran.append(n)

        assert configure() is None
        with commands.assert_none(), pytest.raises(ConfigurationError, match="LOCKASPECT_URL"):
            work(1)
        assert ran == []

    def test_default_client_built_lazily_from_the_environment(
        self, unconfigured: None, lock_server: LockServer, raw: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With ``LOCKASPECT_URL`` set, the default client is built on the first call, not at decoration."""
        monkeypatch.setenv("LOCKASPECT_URL", lock_server.url)
        key = unique("env")

        @distributed_lock(key="<name>")
        def work(name: str) -> tuple[Any, int]:
            lease = current_lease()
            assert lease is not None
            return lease, raw.exists(f"lockaspect:{{{name}}}")

        assert lockconfig._client is None
        lease, exists = work(key)
        assert lease.key == key
        assert exists == 1  # held in the default namespace of the server the variable names
        built = lockconfig._client
        assert isinstance(built, LockClient)
        assert work(key)[0].fencing_token == lease.fencing_token + 1
        assert lockconfig._client is built  # built once

    def test_client_and_url_together(self, plain: LockClient, lock_server: LockServer) -> None:
        """Passing both a client and a URL is a ``ConfigurationError``."""
        with pytest.raises(ConfigurationError, match="not both"):
            configure(plain, url=lock_server.url)

    def test_client_of_the_wrong_type(self, lock_server: LockServer) -> None:
        """A client that is not a ``LockClient`` (say, a URL passed positionally) is a ``TypeError``."""
        with pytest.raises(TypeError, match="LockClient"):
            configure(lock_server.url)  # type: ignore[arg-type]

    def test_bad_url_keeps_the_current_client(self, plain: LockClient) -> None:
        """A URL with an unsupported scheme raises ``ConfigurationError`` and leaves the default client as it was."""
        configure(plain)
        with pytest.raises(ConfigurationError, match="scheme"):
            configure(url="http://127.0.0.1:6379")
        assert configure() is plain


ORDERS_TOML = """
[locks."orders.create"]
key = "order:<user.id>"
lease = 12.5

[locks."reports.nightly"]
key = "report"
wait = 0

[locks."reports.patient"]
key = "report"
lease = "watchdog"
wait = "forever"
max_hold = "none"
"""


class TestPolicies:
    def test_policy_from_a_mapping(self, plain: LockClient, raw: Any) -> None:
        """A policy configured as a mapping gives the decorated function its key and fixed lease."""
        configure(plain, policies={"orders.create": {"key": "order:<user.id>", "lease": 30}})

        @distributed_lock(policy="orders.create")
        def create(user: User) -> tuple[Any, int]:
            return current_lease(), raw.pttl(plain.backend.lock_key("order:7"))

        lease, pttl = create(User(7))
        assert lease.key == "order:7"
        assert not lease.watchdog
        assert lease.lease_time == 30.0
        assert 0 < pttl <= 30_000

    @pytest.mark.parametrize("as_text", [False, True], ids=["path", "str"])
    def test_policy_from_a_toml_file(self, plain: LockClient, tmp_path: Path, as_text: bool) -> None:
        """Policies load from ``[locks."<name>"]`` tables of a TOML file, given as a path or a str."""
        path = tmp_path / "locks.toml"
        path.write_text(ORDERS_TOML, encoding="utf-8")
        configure(plain, policies=str(path) if as_text else path)

        @distributed_lock(policy="orders.create")
        def create(user: User) -> Any:
            return current_lease()

        @distributed_lock(policy="reports.nightly")
        def nightly() -> Any:
            return current_lease()

        lease = create(User(3))
        assert (lease.key, lease.lease_time, lease.watchdog) == ("order:3", 12.5, False)
        report = nightly()
        assert (report.key, report.watchdog) == ("report", True)

        @distributed_lock(policy="reports.patient")
        def patient() -> Any:
            return current_lease()

        assert patient().watchdog  # lease = "watchdog" and wait = "forever" stand for None
        assert lockconfig.get_policy("reports.patient") == {
            "key": "report",
            "lease": None,
            "wait": None,
            "max_hold": None,
        }

    def test_explicit_arguments_override_the_policy(self, plain: LockClient) -> None:
        """Arguments given to the decorator win over the policy's, including ``lease=None`` over a fixed lease."""
        configure(plain, policies={"orders.create": {"key": "order:<user.id>", "lease": 30, "wait": 5}})

        @distributed_lock(key="custom:<user.id>", lease=None, policy="orders.create")
        def create(user: User) -> Any:
            return current_lease()

        lease = create(User(4))
        assert lease.key == "custom:4"
        assert lease.watchdog
        assert lease.lease_time == plain.watchdog_lease

    def test_policy_wait_and_on_failure_apply(self, plain: LockClient, make_client: Callable[..., LockClient]) -> None:
        """A policy's ``on_failure`` hook handles a busy lock, and an explicit ``on_failure=None`` restores raising."""
        seen: list[FailureContext] = []

        def fallback(ctx: FailureContext) -> str:
            seen.append(ctx)
            return "busy"

        configure(plain, policies={"jobs": {"key": "job:<n>", "wait": 0, "on_failure": fallback}})

        @distributed_lock(policy="jobs")
        def job(n: int) -> str:
            return "ran"

        @distributed_lock(policy="jobs", on_failure=None)
        def strict_job(n: int) -> str:
            return "ran"

        with make_client().lock("job:1"):
            assert job(1) == "busy"
            with pytest.raises(LockNotAcquired):
                strict_job(1)
        assert job(1) == "ran"
        assert [ctx.key for ctx in seen] == ["job:1"]

    def test_unknown_policy_at_decoration_when_policies_are_configured(self, plain: LockClient) -> None:
        """Naming a policy that the configured policies lack fails at decoration, listing the known ones."""
        configure(plain, policies={"orders.create": {"key": "order"}})
        with pytest.raises(ConfigurationError, match=r"orders\.craete.*known: orders\.create"):

            @distributed_lock(policy="orders.craete")
            def create() -> None:
                return None

    def test_unknown_policy_at_first_call_when_none_were_configured(
        self, unconfigured: None, plain: LockClient, commands: Any
    ) -> None:
        """With no policies configured at decoration, an unknown policy fails at the first call, before any I/O."""
        ran: list[int] = []

        @distributed_lock(policy="orders.create", client=plain)
        def create(n: int) -> None:
            ran.append(n)

        with commands.assert_none(), pytest.raises(ConfigurationError, match="unknown lock policy"):
            create(1)
        configure(policies={"other": {"key": "other"}})
        with commands.assert_none(), pytest.raises(ConfigurationError, match="known: other"):
            create(1)
        assert ran == []

    def test_policy_configured_after_decoration_is_used(self, unconfigured: None, plain: LockClient) -> None:
        """Policies configured after the decorator was applied are picked up by the first call."""

        @distributed_lock(policy="orders.create", client=plain)
        def create(user: User) -> Any:
            return current_lease()

        configure(policies={"orders.create": {"key": "order:<user.id>", "lease": 9}})
        lease = create(User(5))
        assert (lease.key, lease.lease_time) == ("order:5", 9.0)

    def test_reconfigured_policy_applies_to_the_next_call(self, plain: LockClient) -> None:
        """Configuring policies again changes the options of already decorated functions from the next call."""
        configure(plain, policies={"p": {"key": "first"}})

        @distributed_lock(policy="p")
        def work() -> Any:
            return current_lease()

        assert work().key == "first"
        configure(policies={"p": {"key": "second", "lease": 3}})
        lease = work()
        assert (lease.key, lease.lease_time) == ("second", 3.0)

    @pytest.mark.parametrize(
        ("policies", "match"),
        [
            ({"orders": {"leese": 5}}, "unknown option.*leese"),
            ({"orders": {"client": "x"}}, "unknown option.*client"),
            ({"orders": {"lease": -1}}, "lease"),
            ({"orders": {"lease": 0}}, "lease"),
            ({"orders": {"lease": "30"}}, "lease"),
            ({"orders": {"lease": float("nan")}}, "lease"),
            ({"orders": {"delay_weight": 1.5}}, "delay_weight"),
            ({"orders": {"wait": -2}}, "wait"),
            ({"orders": {"max_hold": 0}}, "max_hold"),
            ({"orders": {"key": 42}}, "key"),
            ({"orders": {"key": "order:<user.>"}}, "order"),
            ({"orders": {"on_failure": "fallback"}}, "on_failure"),
            ({"orders": {"executor": "threads"}}, "executor"),
            ({"orders": 5}, "table of options"),
            ({"": {"key": "k"}}, "non-empty"),
        ],
        ids=lambda value: str(value) if isinstance(value, dict) else None,
    )
    def test_bad_policy_is_rejected_at_configure(self, plain: LockClient, policies: dict[str, Any], match: str) -> None:
        """A policy with an unknown option or a bad value is a ``ConfigurationError`` at ``configure()``."""
        configure(plain, policies={"good": {"key": "good"}})
        with pytest.raises(ConfigurationError, match=match):
            configure(policies=policies)
        assert lockconfig.policy_names() == ["good"]  # the previous policies stay

    @pytest.mark.parametrize(
        ("text", "match"),
        [
            ('[locks."orders"]\nlease = -5\n', "orders.*lease"),
            ('[locks."orders"]\nretries = 3\n', "unknown option.*retries"),
            ("[locks\n", "not valid TOML"),
            ('[other."orders"]\nlease = 5\n', "no \\[locks"),
        ],
        ids=["bad-value", "unknown-option", "invalid-toml", "no-locks-table"],
    )
    def test_bad_toml_policy_file(self, tmp_path: Path, text: str, match: str) -> None:
        """A TOML policy file that is malformed or holds a bad policy is a ``ConfigurationError`` at ``configure()``."""
        path = tmp_path / "locks.toml"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigurationError, match=match):
            configure(policies=path)

    def test_missing_toml_file(self, tmp_path: Path) -> None:
        """A policy file that does not exist is a ``ConfigurationError`` naming it."""
        with pytest.raises(ConfigurationError, match=r"missing\.toml"):
            configure(policies=tmp_path / "missing.toml")


class TestClientConstruction:
    def test_unix_socket_url(
        self, make_client: Callable[..., LockClient], lock_server: LockServer, raw: Any, owner_value: Any
    ) -> None:
        """A ``unix://`` URL reaches the same server through its socket."""
        client = make_client(url=lock_server.unix_url)
        with client.lock("unix:1") as lease:
            assert raw.hgetall(client.backend.lock_key("unix:1"))[lease.token.encode()] == owner_value
        assert raw.exists(client.backend.lock_key("unix:1")) == 0

    @pytest.mark.parametrize(
        "url", ["http://127.0.0.1:6379", "memcached://127.0.0.1", "127.0.0.1:6379", "valkey+sentinel://h", ""]
    )
    def test_unsupported_scheme(self, url: str) -> None:
        """A URL whose scheme is not redis, rediss or unix is a ``ConfigurationError`` naming the allowed ones."""
        with pytest.raises(
            ConfigurationError, match=r"redis://, redis\+cluster://, redis\+sentinel://, rediss://, .*unix://"
        ):
            LockClient.from_url(url)

    def test_url_of_the_wrong_type(self) -> None:
        """A URL that is not a str is a ``TypeError``."""
        with pytest.raises(TypeError):
            LockClient.from_url(b"redis://127.0.0.1")  # type: ignore[arg-type]

    @pytest.mark.parametrize("namespace", ["app{1}:", "app{", "app}:"])
    def test_namespace_with_a_brace(self, lock_server: LockServer, namespace: str) -> None:
        """A namespace containing ``{`` or ``}`` would break the hash tag and is a ``ConfigurationError``."""
        with pytest.raises(ConfigurationError, match="namespace"):
            LockClient.from_url(lock_server.url, namespace=namespace)

    def test_closed_client_refuses_to_lock(self, plain: LockClient, commands: Any) -> None:
        """After ``close()`` (idempotent) decorated calls and ``client.lock`` raise ``ConfigurationError``, no I/O."""
        ran: list[int] = []

        @distributed_lock(key="closed:<n>", client=plain)
        def work(n: int) -> None:
            ran.append(n)

        plain.close()
        plain.close()
        assert plain.closed
        with commands.assert_none():
            with pytest.raises(ConfigurationError, match="closed"):
                work(1)
            with pytest.raises(ConfigurationError, match="closed"), plain.lock("closed:1"):
                pass
        assert ran == []

    def test_client_as_a_context_manager(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """A client used in ``with`` works inside the block and is closed, its threads stopped, after it."""
        with LockClient.from_url(lock_server.url, namespace=namespace) as client:

            @distributed_lock(key="cm:<n>", client=client)
            def work(n: int) -> int:
                return raw.exists(client.backend.lock_key("cm:1"))

            assert work(1) == 1
            assert not client.closed
        assert client.closed
        assert client.threads() == []
        with pytest.raises(ConfigurationError):
            work(1)


class TestClientDelayWeight:
    def test_a_short_watchdog_lease_works_with_the_default_delay_weight(self, make_client: Any) -> None:
        """A 2 s watchdog lease without a delay_weight gets one that fits, and locks work."""
        client = make_client(watchdog_lease=2.0)
        assert client.delay_weight == pytest.approx(0.8)
        with client.lock("short-lease") as lease:
            assert lease.watchdog

    def test_an_explicit_delay_weight_that_does_not_fit_fails_when_the_client_is_built(
        self, lock_server: Any, namespace: str
    ) -> None:
        """An explicit delay_weight=0.9 on a 2 s watchdog lease is refused at construction, with the numbers."""
        with pytest.raises(ConfigurationError, match=r"delay_weight=0\.9 leaves"):
            LockClient.from_url(lock_server.url, namespace=namespace, watchdog_lease=2.0, delay_weight=0.9)
