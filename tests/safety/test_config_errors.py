"""Unknown redis options and malformed URLs fail when the client is built.

redis-py connects lazily, so ``LockClient.from_url(url, lease_time=5)`` used to be accepted
and blow up at the first lock with redis-py's raw ``TypeError``, and
``redis://127.0.0.1:notaport/0`` gave redis-py's ``ValueError``. Both are a
:class:`~lockaspect.ConfigurationError` now, raised by
:func:`lockaspect.backends._redis_options.check_redis_options` before any connection is
made: the server sees neither a connection nor a command.

The ``LockClient`` tests go through the public constructors; the ``check_redis_options``
tests check the function itself (the constructors call it first). The function is
imported inside the tests, so each test fails on its own merits on code without it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from lockaspect import ConfigurationError, LockClient
from lockaspect.testing import LockServer


def check(url: str, options: Mapping[str, Any] | None = None) -> None:
    module = importlib.import_module("lockaspect.backends._redis_options")
    module.check_redis_options(url, dict(options or {}))


@contextmanager
def nothing_reaches(raw: Any) -> Iterator[None]:
    """Fail if the server received a connection or a command (other than our own INFOs)
    inside the block."""
    before = raw.info("stats")
    yield
    after = raw.info("stats")
    assert after["total_connections_received"] == before["total_connections_received"], "a connection was made"
    # the second INFO itself is counted once
    assert after["total_commands_processed"] - before["total_commands_processed"] == 1, "a command reached the store"


def build(factory: Callable[..., LockClient], *args: Any, **options: Any) -> None:
    """Build a client and close it at once: where the build wrongly succeeds, the test fails
    without leaving a client (and its threads) behind."""
    factory(*args, **options).close()


def urls_of(server: LockServer) -> list[str]:
    """Three distinct URLs of the one server (RedLock wants distinct URLs; the check comes first)."""
    return [f"redis://127.0.0.1:{server.port}/{db}" for db in range(3)]


class TestLockClientFromUrl:
    def test_unknown_option(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """``lease_time=5`` (not a redis-py option) is a ``ConfigurationError`` naming it at construction."""
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="'lease_time'") as info:
            build(LockClient.from_url, lock_server.url, namespace=namespace, lease_time=5)
        assert "socket_timeout" in str(info.value)  # the allowed options are listed

    def test_misspelt_option_gets_a_suggestion(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """A near miss names the option it was probably meant to be."""
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="did you mean 'socket_timeout'"):
            build(LockClient.from_url, lock_server.url, namespace=namespace, socket_timout=1.0)

    def test_port_that_is_not_a_number(self, namespace: str, raw: Any) -> None:
        """``redis://127.0.0.1:notaport/0`` is a ``ConfigurationError`` about the port, not redis-py's ValueError."""
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="port") as info:
            build(LockClient.from_url, "redis://127.0.0.1:notaport/0", namespace=namespace)
        assert type(info.value) is ConfigurationError

    def test_db_that_is_not_a_number(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """redis-py would silently use db 0 for ``/x``: rejected instead."""
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="db"):
            build(LockClient.from_url, f"redis://127.0.0.1:{lock_server.port}/x", namespace=namespace)

    def test_unknown_query_parameter(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """A query parameter is an option too: an unknown one fails at construction."""
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="'lease_time'"):
            build(LockClient.from_url, f"{lock_server.url}?lease_time=5", namespace=namespace)

    def test_valid_options_still_build_a_working_client(
        self, make_client: Callable[..., LockClient], lock_server: LockServer
    ) -> None:
        """Real redis-py options (and a unix:// URL with ``?db=``) are accepted and the client locks."""
        for url in (lock_server.url, lock_server.unix_url):
            client = make_client(url, socket_timeout=1.5, health_check_interval=0, client_name="la-test")
            with client.lock("cfg:ok") as lease:
                assert lease.fencing_token >= 1


class TestLockClientFromUrls:
    def test_unknown_option(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """RedLock's constructor checks the options too, before any connection."""
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="'lease_time'"):
            build(LockClient.from_urls, urls_of(lock_server), namespace=namespace, lease_time=5)

    def test_malformed_url(self, lock_server: LockServer, namespace: str, raw: Any) -> None:
        """One bad URL among the servers is a ``ConfigurationError`` about its port."""
        urls = [*urls_of(lock_server)[:2], "redis://127.0.0.1:notaport/0"]
        with nothing_reaches(raw), pytest.raises(ConfigurationError, match="port") as info:
            build(LockClient.from_urls, urls, namespace=namespace)
        assert type(info.value) is ConfigurationError


class TestCheckRedisOptions:
    @pytest.mark.parametrize(
        ("url", "problem"),
        [
            ("redis://127.0.0.1:notaport/0", "port must be an integer from 1 to 65535"),
            ("redis://127.0.0.1:99999/0", "port must be an integer from 1 to 65535"),
            ("redis://127.0.0.1:0/0", "port must be an integer from 1 to 65535"),
            ("redis:///0", "missing host"),
            ("redis://:6379/0", "missing host"),
            ("rediss://", "missing host"),
            ("redis://127.0.0.1:6379/zero", "db"),
            ("redis://127.0.0.1:6379/0/1", "path"),
            ("unix://", "missing socket path"),
            ("redis://127.0.0.1:6379/0?socket_timeout=soon", "socket_timeout"),
            ("redis://127.0.0.1:6379/0?db=x", "'db'"),
            ("redis://[::1/0", "IPv6"),
            ("http://127.0.0.1:6379", r"redis://, rediss://, .*unix://"),
            ("REDIS://127.0.0.1", r"redis://, rediss://, .*unix://"),
            ("", r"redis://, rediss://, .*unix://"),
        ],
    )
    def test_malformed_url(self, url: str, problem: str) -> None:
        """Each malformed URL is a ``ConfigurationError`` saying what is wrong."""
        with pytest.raises(ConfigurationError, match=problem):
            check(url)

    def test_url_of_the_wrong_type(self) -> None:
        with pytest.raises(TypeError, match="url must be a str"):
            check(b"redis://127.0.0.1")  # type: ignore[arg-type]

    def test_password_is_not_in_the_message(self) -> None:
        """The URL in the message has its password masked, in the userinfo and in the query."""
        with pytest.raises(ConfigurationError) as info:
            check("redis://app:hunter2@127.0.0.1:notaport/0")
        assert "hunter2" not in str(info.value)
        assert "app:***@" in str(info.value)
        with pytest.raises(ConfigurationError) as info:
            check("unix:///tmp/s.sock?password=hunter2&lease=1")
        assert "hunter2" not in str(info.value)

    def test_unknown_option_message(self) -> None:
        """The message names the option, suggests the closest allowed one and lists them all."""
        with pytest.raises(ConfigurationError) as info:
            check("redis://127.0.0.1:6379/0", {"socket_timout": 1, "lease_time": 5})
        message = str(info.value)
        assert "'socket_timout'" in message
        assert "did you mean 'socket_timeout'?" in message
        assert "also unknown: 'lease_time'" in message
        for allowed in ("socket_timeout", "socket_connect_timeout", "retry", "max_connections", "db", "password"):
            assert allowed in message

    @pytest.mark.parametrize(
        ("url", "options", "hint"),
        [
            ("redis://127.0.0.1", {"ssl": True}, "rediss://"),
            ("redis://127.0.0.1", {"ssl_certfile": "c.pem"}, "rediss://"),
            ("redis://127.0.0.1", {"unix_socket_path": "/tmp/s"}, "unix://"),
            ("redis://127.0.0.1", {"connection_pool": None}, "connection pool"),
            ("unix:///tmp/s.sock", {"port": 6380}, "unix://"),
            ("unix:///tmp/s.sock", {"socket_keepalive": True}, "unix://"),
        ],
    )
    def test_redis_constructor_arguments_that_from_url_rejects(
        self, url: str, options: dict[str, Any], hint: str
    ) -> None:
        """``redis.Redis()`` takes these, ``Redis.from_url`` passes them to a connection class that does not:
        rejected with a hint."""
        with pytest.raises(ConfigurationError, match=f"{next(iter(options))!r}.*{hint}"):
            check(url, options)

    @pytest.mark.parametrize(
        ("url", "options"),
        [
            # what lockaspect itself passes
            (
                "redis://127.0.0.1:6379/0",
                {"socket_timeout": 2.0, "socket_connect_timeout": 2.0, "retry": None, "decode_responses": False},
            ),
            ("redis://user:pw@127.0.0.1:6379/3", {"single_connection_client": False, "max_connections": 8}),
            ("redis://localhost", {"health_check_interval": 5, "client_name": "x", "username": "u", "password": "p"}),
            ("redis://[::1]:6379", {"socket_keepalive": True, "protocol": 3}),
            ("rediss://127.0.0.1:6380/0", {"ssl_certfile": "c.pem", "ssl_cert_reqs": "none", "ssl_ca_certs": "ca"}),
            ("unix:///tmp/s.sock?db=2", {"socket_timeout": 1.0, "db": 1}),
            ("redis://127.0.0.1/0?socket_timeout=1.5&health_check_interval=2&client_name=x", {}),
        ],
    )
    def test_valid_urls_and_options_pass(self, url: str, options: dict[str, Any]) -> None:
        check(url, options)

    def test_a_connection_class_option_decides_what_is_allowed(self) -> None:
        """With ``connection_class=SSLConnection`` on a redis:// URL, ssl_* options are the class's own."""
        check("redis://127.0.0.1", {"connection_class": redis.connection.SSLConnection, "ssl_certfile": "c.pem"})

    def test_a_connection_class_that_cannot_take_what_the_url_sets(self) -> None:
        """A TCP connection class on a unix:// URL would get the URL's socket ``path`` and fail at the first lock."""
        with pytest.raises(ConfigurationError, match="'path'"):
            check("unix:///tmp/s.sock", {"connection_class": redis.connection.Connection})

    @pytest.mark.parametrize("kind", ["tcp", "unix"])
    def test_allowed_set_matches_what_redis_py_accepts(self, lock_server: LockServer, kind: str) -> None:
        """For every ``redis.Redis()`` argument (and the pool's and connections' own), the check agrees with
        redis-py: it rejects exactly the names for which building the connection raises "unexpected keyword
        argument"."""
        url = lock_server.url if kind == "tcp" else lock_server.unix_url
        candidates: set[str] = set()
        for function in (
            redis.Redis.__init__,
            redis.ConnectionPool.__init__,
            redis.connection.Connection.__init__,
            redis.connection.SSLConnection.__init__,
            redis.connection.UnixDomainSocketConnection.__init__,
            getattr(redis.connection, "AbstractConnection", redis.connection.Connection).__init__,
        ):
            for parameter in inspect.signature(function).parameters.values():
                if parameter.name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD:
                    candidates.add(parameter.name)
        candidates.discard("single_connection_client")  # True would connect at once; covered above
        disagreements = []
        for name in sorted(candidates):
            value: Any = redis.connection.Connection if name == "connection_class" else None
            try:
                client = redis.Redis.from_url(url, **{name: value})
                try:
                    client.connection_pool.make_connection()
                finally:
                    client.close()
            except TypeError as exc:
                accepted = "unexpected keyword argument" not in str(exc)
            except Exception:  # noqa: BLE001 - got past the keyword check; the value itself was the problem
                accepted = True
            else:
                accepted = True
            try:
                check(url, {name: value})
            except ConfigurationError:
                checked = False
            else:
                checked = True
            if accepted != checked:
                disagreements.append((name, accepted, checked))
        assert disagreements == []
