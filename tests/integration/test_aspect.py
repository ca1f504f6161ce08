"""``@distributed_lock`` against a real server: what it decorates, how it renders keys,
re-entry, busy locks and waiting, and every bad input the issue lists."""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from lockaspect import (
    ConfigurationError,
    FailureContext,
    KeyTemplateError,
    LockClient,
    LockNotAcquired,
    _policy,
    current_lease,
    distributed_lock,
)
from lockaspect.backends.base import AcquireRequest

HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def plain(make_client: Callable[..., LockClient]) -> LockClient:
    """A client with the library's defaults (30 s watchdog lease, 100 ms tick), so the
    default ``delay_weight=0.9`` is valid and nothing is renewed during a test."""
    return make_client()


@pytest.fixture
def other(make_client: Callable[..., LockClient]) -> LockClient:
    """A second, independent client on the same namespace: a competing lock holder."""
    return make_client()


class User:
    def __init__(self, id: Any) -> None:
        self.id = id


class Exploding:
    @property
    def id(self) -> int:
        raise ValueError("the user service is down")


class Spy:
    """Counts the acquire round trips a backend makes (each still reaches the real store),
    records the waiter id and ``front`` flag each was sent with, and sets ``second_busy`` when
    the second attempt found the lock busy."""

    def __init__(self, client: LockClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts = 0
        self.queued: list[tuple[str | None, bool]] = []
        self.second_busy = threading.Event()
        real = client.backend.acquire

        def acquire(request: AcquireRequest) -> Any:
            result = real(request)
            self.queued.append((request.waiter, request.front))
            self.attempts += 1
            if self.attempts == 2 and not result.acquired:
                self.second_busy.set()
            return result

        monkeypatch.setattr(client.backend, "acquire", acquire)


def _holder(client: LockClient, key: str, release: threading.Event) -> tuple[threading.Thread, dict[str, Any]]:
    """Start a thread that holds ``key`` on ``client`` until ``release`` is set."""
    state: dict[str, Any] = {"held": threading.Event()}

    def hold() -> None:
        with client.lock(key) as lease:
            state["fencing_token"] = lease.fencing_token
            state["held"].set()
            release.wait(timeout=60)

    thread = threading.Thread(target=hold, name="holder")
    thread.start()
    assert state["held"].wait(timeout=30)
    return thread, state


@pytest.fixture
def threads() -> Iterator[list[threading.Thread]]:
    """Threads a test started; joined after the test so none outlives it."""
    started: list[threading.Thread] = []
    yield started
    for thread in started:
        thread.join(timeout=60)
        assert not thread.is_alive(), f"thread {thread.name} did not finish"


class TestDecoratedCallables:
    def test_plain_function_runs_under_the_lock_and_releases_it(self, plain: LockClient, raw: Any) -> None:
        """A decorated function runs while the store holds its rendered key; the key is gone after."""
        lock_key = plain.backend.lock_key("order:42")

        @distributed_lock(key="order:<order_id>", client=plain)
        def place(order_id: int) -> tuple[int, bool]:
            return order_id * 2, bool(raw.exists(lock_key))

        assert place(42) == (84, True)
        assert raw.exists(lock_key) == 0

    def test_instance_method_renders_self_attributes(self, plain: LockClient, raw: Any) -> None:
        """An instance method's key can read ``self``, so two instances lock two different keys."""

        class Account:
            def __init__(self, id: int) -> None:
                self.id = id

            @distributed_lock(key="account:<self.id>:<amount>", client=plain)
            def withdraw(self, amount: int) -> str:
                lease = current_lease()
                assert lease is not None
                assert raw.exists(plain.backend.lock_key(lease.key)) == 1
                return lease.key

        assert Account(1).withdraw(5) == "account:1:5"
        assert Account(2).withdraw(amount=7) == "account:2:7"
        assert Account.withdraw(Account(3), 9) == "account:3:9"
        assert raw.keys(plain.backend.lock_key("*")) == []

    def test_classmethod_with_the_decorator_below(self, plain: LockClient) -> None:
        """Under ``@classmethod`` the key reads ``cls`` and the body gets the class, via the class or an instance."""

        class Tenant:
            region = "eu"

            @classmethod
            @distributed_lock(key="tenant:<cls.region>:<name>", client=plain)
            def create(cls, name: str) -> tuple[type, str]:
                lease = current_lease()
                assert lease is not None
                return cls, lease.key

        assert Tenant.create("acme") == (Tenant, "tenant:eu:acme")
        assert Tenant().create(name="init") == (Tenant, "tenant:eu:init")

    def test_classmethod_with_the_decorator_above(self, plain: LockClient) -> None:
        """Over ``@classmethod`` the key reads ``cls`` and positional aliases skip it."""

        class Tenant:
            region = "us"

            @distributed_lock(key="tenant:<cls.region>:<p0>", client=plain)
            @classmethod
            def create(cls, name: str) -> tuple[type, str]:
                lease = current_lease()
                assert lease is not None
                return cls, lease.key

        assert Tenant.create("acme") == (Tenant, "tenant:us:acme")
        assert Tenant().create("init") == (Tenant, "tenant:us:init")

    def test_staticmethod_with_the_decorator_below(self, plain: LockClient) -> None:
        """Under ``@staticmethod`` the function gets only its own arguments, via the class or an instance."""

        class Jobs:
            @staticmethod
            @distributed_lock(key="job:<name>:<p0>", client=plain)
            def run(name: str) -> str:
                lease = current_lease()
                assert lease is not None
                return lease.key

        assert Jobs.run("sync") == "job:sync:sync"
        assert Jobs().run("mail") == "job:mail:mail"

    def test_staticmethod_with_the_decorator_above(self, plain: LockClient) -> None:
        """Over ``@staticmethod`` the function gets only its own arguments, via the class or an instance."""

        class Jobs:
            @distributed_lock(key="job:<name>:<p0>", client=plain)
            @staticmethod
            def run(name: str) -> str:
                lease = current_lease()
                assert lease is not None
                return lease.key

        assert Jobs.run("sync") == "job:sync:sync"
        assert Jobs().run("mail") == "job:mail:mail"

    def test_function_metadata_and_inspect_answers_are_preserved(self, plain: LockClient) -> None:
        """The decorated function keeps its name, docstring, signature and ``__wrapped__``, and is still a function."""

        def place(order_id: int, *, note: str = "") -> str:
            """Place an order."""
            return f"{order_id}{note}"

        decorated = distributed_lock(key="order:<order_id>", client=plain)(place)

        assert decorated.__wrapped__ is place
        assert decorated.__name__ == "place"
        assert decorated.__qualname__ == place.__qualname__
        assert decorated.__module__ == place.__module__
        assert decorated.__doc__ == "Place an order."
        assert inspect.signature(decorated) == inspect.signature(place)
        assert inspect.isfunction(decorated)
        assert not inspect.ismethod(decorated)
        assert decorated(7, note="!") == "7!"

    def test_method_inspect_answers_are_preserved(self, plain: LockClient) -> None:
        """Bound methods, classmethods and staticmethods answer ``inspect`` and ``signature`` like undecorated ones."""

        class Shop:
            @distributed_lock(key="m:<x>", client=plain)
            def method(self, x: int) -> int:
                """A method."""
                return x

            @classmethod
            @distributed_lock(key="c:<x>", client=plain)
            def below(cls, x: int) -> int:
                return x

            @distributed_lock(key="c:<x>", client=plain)
            @classmethod
            def above(cls, x: int) -> int:
                return x

            @staticmethod
            @distributed_lock(key="s:<x>", client=plain)
            def static_below(x: int) -> int:
                return x

            @distributed_lock(key="s:<x>", client=plain)
            @staticmethod
            def static_above(x: int) -> int:
                return x

        shop = Shop()
        one_param = inspect.signature(lambda x: x).parameters.keys()
        assert inspect.ismethod(shop.method)
        assert inspect.isfunction(Shop.method)
        assert shop.method.__doc__ == "A method."
        assert list(inspect.signature(Shop.method).parameters) == ["self", "x"]
        for bound in (shop.method, Shop.below, Shop.above, shop.below, shop.above):
            assert inspect.ismethod(bound), bound
            assert inspect.signature(bound).parameters.keys() == one_param
        for static in (Shop.static_below, Shop.static_above, shop.static_below, shop.static_above):
            assert inspect.isfunction(static), static
            assert not inspect.ismethod(static), static
            assert inspect.signature(static).parameters.keys() == one_param
        assert Shop.below.__name__ == "below"
        assert Shop.above.__name__ == "above"
        assert Shop.static_above.__name__ == "static_above"


class TestKeys:
    def test_key_is_rendered_once_so_a_mutating_body_releases_what_it_locked(self, plain: LockClient, raw: Any) -> None:
        """A body that changes the argument its key was rendered from still releases the key it locked."""

        @distributed_lock(key="order:<user.id>", client=plain)
        def place(user: User) -> str:
            user.id = 2
            lease = current_lease()
            assert lease is not None
            return lease.key

        user = User(1)
        assert place(user) == "order:1"
        assert raw.exists(plain.backend.lock_key("order:1")) == 0
        assert raw.exists(plain.backend.lock_key("order:2")) == 0
        user.id = 1
        assert place(user) == "order:1"  # free again, not left held

    def test_key_none_locks_on_the_qualified_name(self, plain: LockClient) -> None:
        """Without a key every call takes one lock named after the function's module and qualified name."""

        @distributed_lock(client=plain)
        def nightly(day: int) -> str:
            lease = current_lease()
            assert lease is not None
            return lease.key

        expected = f"{nightly.__module__}.{nightly.__qualname__}"
        assert "<locals>" in expected
        assert nightly(1) == expected
        assert nightly(2) == expected

    def test_callable_key_gets_the_bound_arguments(self, plain: LockClient) -> None:
        """A callable key receives the bound arguments with defaults applied and its result is the key."""
        received: list[dict[str, Any]] = []

        def key(arguments: Mapping[str, Any]) -> str:
            received.append(dict(arguments))
            return f"report:{arguments['tenant']}:{arguments['kind']}"

        @distributed_lock(key=key, client=plain)
        def build(tenant: str, kind: str = "daily") -> str:
            lease = current_lease()
            assert lease is not None
            return lease.key

        assert build("acme") == "report:acme:daily"
        assert received == [{"tenant": "acme", "kind": "daily"}]

    def test_callable_key_on_a_method_gets_self(self, plain: LockClient) -> None:
        """On an instance method a callable key sees ``self`` among the bound arguments."""

        class Cart:
            id = 12

            @distributed_lock(key=lambda a: f"cart:{a['self'].id}:{a['item']}", client=plain)
            def add(self, item: str) -> str:
                lease = current_lease()
                assert lease is not None
                return lease.key

        assert Cart().add("pen") == "cart:12:pen"


class TestCurrentLease:
    def test_current_lease_inside_and_outside(self, plain: LockClient) -> None:
        """``current_lease()`` gives key, 32-hex token and rising fencing tokens inside the body; None outside."""

        @distributed_lock(key="doc:<doc_id>", client=plain)
        def edit(doc_id: int) -> Any:
            return current_lease()

        assert current_lease() is None
        first = edit(3)
        second = edit(3)
        assert current_lease() is None
        assert first.key == second.key == "doc:3"
        assert HEX32.fullmatch(first.token)
        assert HEX32.fullmatch(second.token)
        assert first.token != second.token
        assert second.fencing_token > first.fencing_token
        assert not first.lost
        assert not second.lost


class TestReentry:
    def test_same_key_reenters_with_the_same_fencing_token(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """A nested call on the same key re-enters: same fencing token, hold count 2, deleted after the outer call."""
        lock_key = plain.backend.lock_key("acct:9")

        @distributed_lock(key="acct:<account>", client=plain)
        def inner(account: int) -> tuple[Any, dict[bytes, bytes]]:
            return current_lease(), raw.hgetall(lock_key)

        @distributed_lock(key="acct:<account>", client=plain)
        def outer(account: int) -> tuple[Any, Any, dict[bytes, bytes], dict[bytes, bytes]]:
            lease = current_lease()
            inner_lease, during = inner(account)
            return lease, inner_lease, during, raw.hgetall(lock_key)

        lease, inner_lease, during, after_inner = outer(9)
        token, fence = lease.token.encode(), str(lease.fencing_token).encode()
        assert inner_lease is lease
        assert inner_lease.fencing_token == lease.fencing_token
        assert during == {token: owner_value, b"fence": fence}  # one hold per owner: re-entries are counted here
        assert after_inner == {token: owner_value, b"fence": fence}
        assert raw.exists(lock_key) == 0
        assert plain.stats().reentered == 1

    def test_different_keys_nest_independently(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """A nested call on another key takes a lock of its own and releases it before the outer one."""
        outer_key, inner_key = plain.backend.lock_key("a:1"), plain.backend.lock_key("b:1")

        @distributed_lock(key="b:<n>", client=plain)
        def inner(n: int) -> tuple[Any, int]:
            return current_lease(), raw.exists(outer_key, inner_key)

        @distributed_lock(key="a:<n>", client=plain)
        def outer(n: int) -> tuple[Any, Any, int, Any, dict[bytes, bytes]]:
            lease = current_lease()
            inner_lease, both = inner(n)
            return lease, inner_lease, both, current_lease(), raw.hgetall(outer_key)

        lease, inner_lease, both, after, outer_hash = outer(1)
        assert (lease.key, inner_lease.key) == ("a:1", "b:1")
        assert inner_lease.token != lease.token
        assert both == 2
        assert after is lease
        assert outer_hash[lease.token.encode()] == owner_value
        assert raw.exists(outer_key, inner_key) == 0


class TestBusyLock:
    def test_busy_lock_raises_lock_not_acquired(
        self, plain: LockClient, other: LockClient, raw: Any, owner_value: Any
    ) -> None:
        """A lock held elsewhere makes the call raise ``LockNotAcquired`` with the key, without running the body."""
        ran: list[int] = []

        @distributed_lock(key="res:<res_id>", client=plain)
        def work(res_id: int) -> None:
            ran.append(res_id)

        with other.lock("res:5") as holder:
            with pytest.raises(LockNotAcquired) as info:
                work(5)
            assert raw.hgetall(plain.backend.lock_key("res:5"))[holder.token.encode()] == owner_value
        assert info.value.key == "res:5"
        assert info.value.waited == 0.0
        assert ran == []

    def test_on_failure_gets_the_context_and_its_value_is_the_result(
        self, plain: LockClient, other: LockClient
    ) -> None:
        """``on_failure`` gets key, function, bound arguments and waited; its return value is the result."""
        seen: list[tuple[FailureContext, Any]] = []

        def fallback(ctx: FailureContext) -> str:
            seen.append((ctx, current_lease()))
            return "try later"

        @distributed_lock(key="res:<p0>", client=plain, on_failure=fallback)
        def work(res_id: int, mode: str = "fast") -> str:
            return "done"

        with other.lock("res:7") as holder:
            assert work(7) == "try later"
        assert work(7) == "done"
        [(ctx, lease_in_fallback)] = seen
        assert lease_in_fallback is holder  # the caller's own context: the failed call holds nothing
        assert ctx.key == "res:7"
        assert ctx.function == work.__qualname__
        assert dict(ctx.arguments) == {"res_id": 7, "mode": "fast"}
        assert ctx.waited == 0.0
        assert isinstance(ctx.error, LockNotAcquired)

    def test_on_failure_reports_the_time_waited(self, plain: LockClient, other: LockClient) -> None:
        """After waiting in vain, ``on_failure`` sees at least the wait it was given."""
        seen: list[float] = []

        @distributed_lock(key="res:<n>", client=plain, wait=0.2, on_failure=lambda ctx: seen.append(ctx.waited))
        def work(n: int) -> str:
            return "done"

        with other.lock("res:1"):
            assert work(1) is None
        [waited] = seen
        assert waited >= 0.2

    def test_on_failure_does_not_handle_a_nested_calls_failure(
        self, plain: LockClient, other: LockClient, raw: Any
    ) -> None:
        """A ``LockNotAcquired`` from a nested call inside the body propagates past the outer ``on_failure``."""
        seen: list[FailureContext] = []

        @distributed_lock(key="inner:<n>", client=plain)
        def inner(n: int) -> str:
            return "inner"

        @distributed_lock(key="outer:<n>", client=plain, on_failure=seen.append)
        def outer(n: int) -> str:
            return inner(n)

        with other.lock("inner:1"), pytest.raises(LockNotAcquired) as info:
            outer(1)
        assert info.value.key == "inner:1"
        assert seen == []
        assert raw.exists(plain.backend.lock_key("outer:1")) == 0

    def test_wait_zero_tries_once(
        self, plain: LockClient, other: LockClient, raw: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``wait=0`` makes one acquire attempt, neither queues for a wake-up nor subscribes to any wake channel."""
        spy = Spy(plain, monkeypatch)

        @distributed_lock(key="res:<n>", client=plain, wait=0)
        def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with other.lock("res:3"):
            with pytest.raises(LockNotAcquired) as info:
                work(3)
            assert raw.pubsub_channels(plain.backend.wake_channel("res:3", "*")) == []
            assert raw.exists(plain.backend.queue_key("res:3")) == 0
        assert spy.attempts == 1
        assert spy.queued == [(None, False)]
        assert info.value.waited == 0.0

    def test_wait_expires_with_lock_not_acquired(self, plain: LockClient, other: LockClient) -> None:
        """A wait that runs out raises ``LockNotAcquired`` reporting at least the time waited."""

        @distributed_lock(key="res:<n>", client=plain, wait=0.2)
        def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with other.lock("res:4"), pytest.raises(LockNotAcquired) as info:
            work(4)
        assert info.value.key == "res:4"
        assert info.value.waited >= 0.2

    @pytest.mark.parametrize("wait", [30.0, timedelta(seconds=30), None], ids=["seconds", "timedelta", "forever"])
    def test_waiter_gets_the_lock_when_the_holder_releases(
        self,
        plain: LockClient,
        other: LockClient,
        monkeypatch: pytest.MonkeyPatch,
        raw: Any,
        threads: list[threading.Thread],
        wait: Any,
    ) -> None:
        """A waiter queues once subscribed and sleeps until the holder's release wakes it, then takes the lock on its
        next attempt, which leaves the queue."""
        # No periodic recheck: the waiter's sleep ends on the wake-up (or the 30 s lease), nothing else.
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 60.0)
        spy = Spy(plain, monkeypatch)
        release = threading.Event()
        holder, state = _holder(other, "job:1", release)
        threads.append(holder)

        # The holder lets go once the waiter has subscribed and found the lock still busy.
        releaser = threading.Thread(target=lambda: spy.second_busy.wait(timeout=30) and release.set())
        releaser.start()
        threads.append(releaser)

        @distributed_lock(key="job:<n>", client=plain, wait=wait)
        def work(n: int) -> int:
            lease = current_lease()
            assert lease is not None
            return lease.fencing_token

        fencing_token = work(1)
        assert release.is_set()
        assert fencing_token > state["fencing_token"]
        # try, retry once subscribed (queued), then one more try after the wake-up: no polling
        assert spy.attempts == 3
        waiter_id = plain.backend.notifier().waiter_id
        # the woken attempt goes in front, should a barger have taken the lock meanwhile
        assert spy.queued == [(None, False), (waiter_id, False), (waiter_id, True)]
        assert not raw.exists(plain.backend.queue_key("job:1"))


class CallCase:
    def __init__(self, template: str, value: Any, expression: str | None) -> None:
        self.template = template
        self.value = value
        self.expression = expression


CALL_TIME_ERRORS = [
    pytest.param(CallCase("user:<user.id>", User(None), "user.id"), id="value-is-none"),
    pytest.param(CallCase("user:<user.id>", object(), "user.id"), id="missing-attribute"),
    pytest.param(CallCase("user:<user.ids[0]>", SimpleNamespace(ids=[]), "user.ids[0]"), id="missing-index"),
    pytest.param(CallCase('user:<user["tenant"]>', {"name": "x"}, 'user["tenant"]'), id="missing-mapping-key"),
    pytest.param(CallCase("user:<user.id>", User(1.5), "user.id"), id="float"),
    pytest.param(CallCase("user:<user.id>", User(True), "user.id"), id="bool"),
    pytest.param(CallCase("user:<user.id>", User(b"42"), "user.id"), id="bytes"),
    pytest.param(CallCase("user:<user.id>", User([4, 2]), "user.id"), id="list"),
    pytest.param(CallCase("user:<user.id>", User({"a": 1}), "user.id"), id="dict"),
    pytest.param(CallCase("user:<user.id>", User(object()), "user.id"), id="object"),
    pytest.param(CallCase("user:<user>", None, "user"), id="argument-is-none"),
    pytest.param(CallCase("user:<user.id>", User("x" * 2000), None), id="over-the-length-cap"),
    pytest.param(CallCase("user:<user.id>", Exploding(), "user.id"), id="property-raises"),
]


class TestCallTimeBadInput:
    @pytest.mark.parametrize("case", CALL_TIME_ERRORS)
    def test_bad_value_fails_before_any_store_io(
        self, plain: LockClient, raw: Any, commands: Any, namespace: str, case: CallCase
    ) -> None:
        """An unrenderable key raises ``KeyTemplateError`` before the body runs or anything reaches the store."""
        ran: list[Any] = []

        @distributed_lock(key=case.template, client=plain)
        def work(user: Any) -> None:
            ran.append(user)

        with commands.assert_none(), pytest.raises(KeyTemplateError) as info:
            work(case.value)
        assert ran == []
        assert raw.keys(namespace + "*") == []
        assert info.value.template == case.template
        if case.expression is not None:
            assert info.value.expression == case.expression
            assert case.expression in str(info.value)
        else:
            assert "cap" in str(info.value)

    def test_property_that_raises_is_chained(self, plain: LockClient, raw: Any, commands: Any, namespace: str) -> None:
        """A property that raises while rendering gives a ``KeyTemplateError`` chained to the original error."""

        @distributed_lock(key="user:<user.id>", client=plain)
        def work(user: Any) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError) as info:
            work(Exploding())
        assert isinstance(info.value.__cause__, ValueError)
        assert str(info.value.__cause__) == "the user service is down"
        assert raw.keys(namespace + "*") == []

    def test_callable_key_that_raises_is_chained(
        self, plain: LockClient, raw: Any, commands: Any, namespace: str
    ) -> None:
        """A key callable that raises gives a ``KeyTemplateError`` chained to its error, with no store I/O."""
        boom = LookupError("no tenant")

        def key(arguments: Mapping[str, Any]) -> str:
            raise boom

        @distributed_lock(key=key, client=plain)
        def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError) as info:
            work(1)
        assert info.value.__cause__ is boom
        assert raw.keys(namespace + "*") == []

    @pytest.mark.parametrize("result", [42, None, b"k", "", "a{b}c", "x" * 2000], ids=repr)
    def test_callable_key_with_a_bad_result(
        self, plain: LockClient, raw: Any, commands: Any, namespace: str, result: Any
    ) -> None:
        """A key callable returning a non-str, empty, braced or oversized key fails at call, with no store I/O."""

        @distributed_lock(key=lambda arguments: result, client=plain)
        def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError):
            work(1)
        assert raw.keys(namespace + "*") == []


def _function(n: int) -> int:
    return n


class TestDecorationTimeBadOptions:
    @pytest.mark.parametrize("lease", [0, -1, 0.0, math.nan, math.inf, -math.inf, timedelta(0)])
    def test_bad_lease_value(self, plain: LockClient, lease: Any) -> None:
        """A lease that is not a positive finite duration is a ``ConfigurationError`` at decoration."""
        with pytest.raises(ConfigurationError, match="lease"):
            distributed_lock(key="k", lease=lease, client=plain)(_function)

    @pytest.mark.parametrize("lease", [True, False, "30", [30]])
    def test_bad_lease_type(self, plain: LockClient, lease: Any) -> None:
        """A lease of the wrong type (bool, str, list) is a ``TypeError`` at decoration."""
        with pytest.raises(TypeError, match="lease"):
            distributed_lock(key="k", lease=lease, client=plain)(_function)

    def test_lease_as_timedelta(self, plain: LockClient, raw: Any) -> None:
        """A ``timedelta`` lease is a fixed lease of that many seconds, set as the key's TTL."""

        @distributed_lock(key="k", lease=timedelta(seconds=20), client=plain)
        def work() -> tuple[Any, int]:
            return current_lease(), raw.pttl(plain.backend.lock_key("k"))

        lease, pttl = work()
        assert lease.lease_time == 20.0
        assert not lease.watchdog
        assert 0 < pttl <= 20_000

    @pytest.mark.parametrize("delay_weight", [0, 0.0, 1, 1.0, 1.5, -0.1, math.nan])
    def test_delay_weight_outside_the_open_unit_interval(self, plain: LockClient, delay_weight: float) -> None:
        """A ``delay_weight`` outside (0, 1) is a ``ConfigurationError`` at decoration."""
        with pytest.raises(ConfigurationError, match="delay_weight"):
            distributed_lock(key="k", delay_weight=delay_weight, client=plain)(_function)

    def test_delay_weight_too_close_to_one_for_the_lease_and_tick(self, client: LockClient) -> None:
        """With a 1 s watchdog lease and 20 ms tick, 0.9 leaves 0.1 s; the error names the margin, tick and need."""
        with pytest.raises(ConfigurationError) as info:
            distributed_lock(key="k", delay_weight=0.9, client=client)(_function)
        message = str(info.value)
        assert "delay_weight=0.9" in message
        assert "0.100s" in message
        assert "tick 0.02s" in message
        assert "0.120s" in message

    def test_delay_weight_too_close_to_one_for_the_default_lease(self, plain: LockClient) -> None:
        """With the default 30 s lease and 100 ms tick, 0.995 leaves 0.15 s, below the 0.2 s needed."""
        with pytest.raises(ConfigurationError) as info:
            distributed_lock(key="k", delay_weight=0.995, client=plain)(_function)
        assert "0.150s" in str(info.value)
        assert "0.200s" in str(info.value)

    def test_delay_weight_margin_is_not_checked_for_a_fixed_lease(self, client: LockClient) -> None:
        """A fixed lease is never renewed, so a ``delay_weight`` near 1 is accepted with it."""
        work = distributed_lock(key="k", lease=5.0, delay_weight=0.99, client=client)(_function)
        assert work(3) == 3

    def test_generator_function(self, plain: LockClient) -> None:
        """A generator function is rejected at decoration with ``ConfigurationError``."""

        def numbers() -> Iterator[int]:
            yield 1

        with pytest.raises(ConfigurationError, match="generator"):
            distributed_lock(key="k", client=plain)(numbers)

    def test_async_generator_function(self, plain: LockClient) -> None:
        """An async generator function is rejected at decoration with ``ConfigurationError``."""

        async def numbers() -> Any:
            yield 1

        with pytest.raises(ConfigurationError, match="generator"):
            distributed_lock(key="k", client=plain)(numbers)

    def test_async_def_with_an_executor_is_rejected(self, plain: LockClient) -> None:
        """An ``async def`` given an executor is a ConfigurationError at decoration: its body runs on the loop."""

        async def place() -> None:
            return None

        pool = ThreadPoolExecutor(max_workers=1)
        try:
            with pytest.raises(ConfigurationError, match="runs as a task on the running event loop"):
                distributed_lock(key="k", client=plain, executor=pool)(place)
        finally:
            pool.shutdown()

    def test_async_def_staticmethod_stays_a_coroutine_function(self, plain: LockClient) -> None:
        """An ``async def`` staticmethod under the decorator is still a coroutine function, and runs locked."""

        class Service:
            @distributed_lock(key="svc", client=plain)
            @staticmethod
            async def place() -> str:
                lease = current_lease()
                assert lease is not None
                return lease.key

        assert inspect.iscoroutinefunction(Service.place)
        assert asyncio.run(Service.place()) == "svc"

    @pytest.mark.parametrize(
        "options",
        [
            {"on_failure": "fallback"},
            {"on_failure": 42},
            {"on_lost": "log"},
            {"on_lost": 1.0},
            {"executor": "threads"},
            {"executor": 4},
            {"client": "redis://127.0.0.1:6379/0"},
            {"policy": 42},
            {"policy": ""},
        ],
        ids=lambda options: "-".join(f"{k}={v!r}" for k, v in options.items()),
    )
    def test_wrong_typed_option(self, options: dict[str, Any]) -> None:
        """A hook, executor, client or policy of the wrong type is a ``TypeError`` at decoration."""
        with pytest.raises(TypeError):
            distributed_lock(key="k", **options)(_function)

    @pytest.mark.parametrize("key", [42, b"order", ["order"]], ids=repr)
    def test_key_of_the_wrong_type(self, key: Any) -> None:
        """A key that is neither a str nor a callable is a ``TypeError`` at decoration."""
        with pytest.raises(TypeError, match="key"):
            distributed_lock(key=key)(_function)

    def test_empty_key(self) -> None:
        """An empty key template is a ``KeyTemplateError`` at decoration."""
        with pytest.raises(KeyTemplateError):
            distributed_lock(key="")(_function)

    @pytest.mark.parametrize("wait", [-1, math.nan, math.inf])
    def test_bad_wait(self, plain: LockClient, wait: float) -> None:
        """A negative or non-finite wait is a ``ConfigurationError`` at decoration."""
        with pytest.raises(ConfigurationError, match="wait"):
            distributed_lock(key="k", wait=wait, client=plain)(_function)
