"""Client-wide defaults (explicit > policy > client defaults > configure() defaults > the
library's), the start-up check (``client.check()`` / ``acheck()``, ``from_url(check=True)``)
against real misconfigured servers, and the key-template hint at decoration."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import (
    BackendError,
    ConfigurationError,
    FailureContext,
    KeyTemplateWarning,
    LockClient,
    LockNotAcquired,
    config,
    configure,
    distributed_lock,
)
from lockaspect.testing import LockServer


def answer(name: str) -> Callable[[FailureContext], str]:
    def on_failure(context: FailureContext) -> str:
        return f"{name}:{context.key}"

    on_failure.__name__ = f"on_failure_{name}"
    return on_failure


@pytest.fixture
def holder(make_client: Callable[..., LockClient]) -> Iterator[Callable[[str], None]]:
    """Hold keys from another client until the test ends."""
    other = make_client()
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def hold(key: str) -> None:
        held = threading.Event()

        def run() -> None:
            with other.lock(key):
                held.set()
                stop.wait(30)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        assert held.wait(10)

    yield hold
    stop.set()
    for thread in threads:
        thread.join(10)


# -- defaults ---------------------------------------------------------------------------------


def test_client_defaults_apply_to_decorated_functions(make_client: Callable[..., LockClient], holder: Any) -> None:
    client = make_client(defaults={"on_failure": answer("client"), "wait": 0.05})
    holder("busy:1")

    @distributed_lock(key="busy:<n>", client=client)
    def work(n: int) -> str:
        return "ran"

    assert work(1) == "client:busy:1"
    assert work(2) == "ran"


def test_the_client_defaults_wait_is_waited(make_client: Callable[..., LockClient], holder: Any) -> None:
    client = make_client(defaults={"wait": 0.2})
    holder("slow")

    @distributed_lock(key="slow", client=client)
    def work() -> None: ...

    with pytest.raises(LockNotAcquired) as info:
        work()
    assert info.value.waited >= 0.2  # the deadline, not a speed: it waited at least that long


def test_precedence_explicit_over_policy_over_client_over_configure(
    make_client: Callable[..., LockClient], holder: Any
) -> None:
    client = make_client(defaults={"on_failure": answer("client")})
    configure(policies={"p": {"on_failure": answer("policy")}}, defaults={"on_failure": answer("process")})
    holder("k")

    @distributed_lock(key="k", client=client, on_failure=answer("explicit"))
    def explicit() -> None: ...

    @distributed_lock(key="k", client=client, policy="p")
    def by_policy() -> None: ...

    @distributed_lock(key="k", client=client)
    def by_client() -> None: ...

    bare = make_client()

    @distributed_lock(key="k", client=bare)
    def by_process() -> None: ...

    assert explicit() == "explicit:k"
    assert by_policy() == "policy:k"
    assert by_client() == "client:k"
    assert by_process() == "process:k"
    configure(defaults={})  # cleared: the library's default (raise) again
    with pytest.raises(LockNotAcquired):
        by_process()


def test_defaults_follow_the_default_client_when_it_changes(
    make_client: Callable[..., LockClient], holder: Any
) -> None:
    holder("k")

    @distributed_lock(key="k")
    def work() -> None: ...

    configure(make_client(defaults={"on_failure": answer("first")}))
    assert work() == "first:k"
    configure(make_client(defaults={"on_failure": answer("second")}))
    assert work() == "second:k"


def test_async_functions_take_the_defaults_too(make_client: Callable[..., LockClient], holder: Any) -> None:
    async def on_failure(context: FailureContext) -> str:
        return "async-default"

    client = make_client(defaults={"on_failure": on_failure})
    holder("k")

    @distributed_lock(key="k", client=client)
    async def work() -> str:
        return "ran"

    assert asyncio.run(work()) == "async-default"


@pytest.mark.parametrize(
    ("defaults", "error", "words"),
    [
        ({"key": "x"}, ConfigurationError, "key cannot be a default"),
        ({"permits": 3}, ConfigurationError, "permits cannot be a default"),
        ({"wiat": 2}, ConfigurationError, "wiat cannot be a default"),
        ({"wait": -1}, ConfigurationError, "wait"),
        ({"wait": "2"}, TypeError, "wait"),
        ({"on_failure": 3}, TypeError, "on_failure"),
        (["wait"], TypeError, "mapping"),
    ],
)
def test_bad_defaults_are_refused_before_anything_is_opened(defaults: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        LockClient.from_url("redis://127.0.0.1:1/0", defaults=defaults)  # nothing listens there: never reached
    with pytest.raises(error, match=words):
        configure(defaults=defaults)


def test_configure_observers_go_to_the_client_it_builds(lock_server: LockServer, namespace: str) -> None:
    seen: list[str] = []
    client = configure(url=lock_server.url, observers=[lambda event: seen.append(event.name)])
    assert client is not None
    with client.lock(f"{namespace}k"):
        pass
    assert "acquired" in seen
    assert "released" in seen
    with pytest.raises(ConfigurationError, match="its own observers"):
        configure(client, observers=[print])
    with pytest.raises(TypeError):
        configure(observers=[1])


# -- the start-up check -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded() -> Iterator[LockServer]:
    """A server of its own with 4 databases, a password user and a user without EVALSHA."""
    with LockServer(args=["--databases", "4"]) as server:
        redis = server.redis()
        redis.execute_command("ACL", "SETUSER", "locker", "on", ">secret", "~*", "&*", "+@all")
        redis.execute_command("ACL", "SETUSER", "reader", "on", ">secret", "~*", "&*", "+@read", "+ping", "+acl|whoami")
        redis.execute_command("ACL", "SETUSER", "reader", "+acl|dryrun")
        redis.close()
        yield server


def test_check_passes_on_a_well_configured_server(guarded: LockServer) -> None:
    url = f"redis://locker:secret@127.0.0.1:{guarded.port}/3"
    with LockClient.from_url(url, check=True) as client:
        client.check()
        asyncio.run(client.acheck())


@pytest.mark.parametrize(
    ("url", "error", "words"),
    [
        ("redis://locker:wrong@127.0.0.1:{port}/0", ConfigurationError, "authentication failed.*user name"),
        ("redis://127.0.0.1:{port}/9", ConfigurationError, "fewer databases"),
        ("redis://reader:secret@127.0.0.1:{port}/0", ConfigurationError, "may not run.*evalsha.*ACL SETUSER reader"),
        ("rediss://127.0.0.1:{port}/0", ConfigurationError, "TLS handshake failed.*redis://"),
        ("redis://127.0.0.1:1/0", BackendError, "nothing answers.*Is the server running"),
    ],
    ids=["password", "db-index", "acl", "tls", "refused"],
)
def test_check_fails_with_a_hint(guarded: LockServer, url: str, error: type, words: str) -> None:
    url = url.format(port=guarded.port)
    client = LockClient.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        with pytest.raises(error, match=words):
            client.check()
        with pytest.raises(error, match=words):
            asyncio.run(client.acheck())
    finally:
        client.close()
    with pytest.raises(error, match=words):
        LockClient.from_url(url, check=True, socket_connect_timeout=0.5, socket_timeout=0.5)


def test_from_url_check_closes_the_client_it_refuses(guarded: LockServer) -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigurationError):
        LockClient.from_url(f"redis://127.0.0.1:{guarded.port}/9", check=True)
    assert {t.name for t in threading.enumerate()} <= before | {"asyncio_0"}


def test_configure_check_fails_at_start_up_and_keeps_the_old_default(guarded: LockServer) -> None:
    good = configure(url=f"redis://locker:secret@127.0.0.1:{guarded.port}/0", check=True)
    with pytest.raises(ConfigurationError, match="fewer databases"):
        configure(url=f"redis://127.0.0.1:{guarded.port}/9", check=True)
    assert configure() is good
    with pytest.raises(ConfigurationError, match="url="):
        configure(check=True)


@pytest.mark.parametrize("url", ["memory://", "sqlite:///{tmp}/locks.db"])
def test_check_on_other_stores(url: str, tmp_path: Any) -> None:
    with LockClient.from_url(url.format(tmp=tmp_path), check=True) as client:
        client.check()


# -- the key-template hint --------------------------------------------------------------------


class User:
    id = 7


@pytest.mark.parametrize(
    ("template", "suggestion"),
    [("order:user.id", "order:<user.id>"), ("order:user_id", "order:<user_id>"), ("user:user", "<user>:<user>")],
)
def test_a_template_reading_no_argument_but_naming_one_warns(
    client: LockClient, template: str, suggestion: str
) -> None:
    with pytest.warns(KeyTemplateWarning, match=f"did you mean '{suggestion}'") as caught:

        @distributed_lock(key=template, client=client)
        def create(user: User, user_id: int = 1) -> None: ...

    assert caught[0].filename == __file__  # points at the decoration


@pytest.mark.parametrize("template", ["order:<user.id>", "nightly-report", "order:<user.id>:user", "self:<user.id>"])
def test_templates_that_read_an_argument_or_name_none_do_not_warn(client: LockClient, template: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Service:
            @distributed_lock(key=template, client=client)
            def create(self, user: User) -> None: ...

    assert Service


def test_a_lock_over_tls_against_a_plain_server_names_tls(guarded: LockServer) -> None:
    url = f"rediss://127.0.0.1:{guarded.port}/0"
    with LockClient.from_url(url, socket_connect_timeout=0.3) as client, pytest.raises(BackendError) as info:
        client.lock("k").__enter__()
    assert "TLS handshake failed" in str(info.value)
    assert "redis://" in str(info.value)


def test_check_on_a_cluster_and_a_sentinel_setup(valkey_cluster: Any, valkey_sentinel: Any) -> None:
    for url in (valkey_cluster.url, valkey_sentinel.url):
        with LockClient.from_url(url, check=True) as client:
            asyncio.run(client.acheck())


def test_check_of_redlock_wants_a_quorum(guarded: LockServer, lock_server: LockServer) -> None:
    good = [f"redis://locker:secret@127.0.0.1:{guarded.port}/{db}" for db in (0, 1)]
    with LockClient.from_urls([*good, lock_server.url], check=True) as client:
        client.check()
    with pytest.raises(BackendError, match="only 1 of 3 RedLock servers answered"):
        LockClient.from_urls([good[0], "redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0"], check=True)
    with pytest.raises(ConfigurationError, match="fewer databases"):
        LockClient.from_urls([*good, f"redis://127.0.0.1:{guarded.port}/9"], check=True)


def test_a_transaction_scoped_lock_takes_only_the_defaults_that_apply_to_it(
    make_client: Callable[..., LockClient],
) -> None:
    """It has no lease, watchdog, hook or executor: such defaults are for the other locks and
    do not make its decoration fail (given explicitly, they still do)."""
    client = make_client(defaults={"lease": 30, "max_hold": 60, "on_lost": print, "on_failure": answer("d")})
    configure(defaults={"delay_weight": 0.5, "wait": 1.5})

    @distributed_lock(key="t:<n>", client=client, scope="transaction", connection="conn")
    def in_transaction(conn: object, n: int) -> None: ...

    with pytest.raises(ConfigurationError, match="scope='transaction' cannot take lease="):

        @distributed_lock(key="t:<n>", client=client, scope="transaction", connection="conn", lease=30)
        def explicit(conn: object, n: int) -> None: ...


def test_configure_observers_alone_go_to_the_client_built_from_the_environment(
    lock_server: LockServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "_client", None)
    monkeypatch.setenv("LOCKASPECT_URL", lock_server.url)
    seen: list[str] = []
    configure(observers=[lambda event: seen.append(event.name)])

    @distributed_lock(key=namespace + "env")
    def work() -> None: ...

    work()
    assert "acquired" in seen
    with pytest.raises(ConfigurationError, match="exists already"):
        configure(observers=[print])  # the default client is built: it would be ignored
    config.default_client().close()
