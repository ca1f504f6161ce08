"""asyncio against a real server: ``@distributed_lock`` on ``async def`` code and
``async with client.lock(...)``, ownership per task, the per-loop watchdog, the lost-lease
cancellation, cancellation safety (with a storm of ``asyncio.wait_for`` timeouts), and one
client serving threads and several event loops.

Every test drives its coroutines with ``asyncio.run`` from a plain test function (no
pytest-asyncio), so each test gets a fresh event loop and the code runs on Python 3.10.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import gc
import inspect
import itertools
import logging
import random
import re
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
from redis.asyncio.connection import AbstractConnection

from lockaspect import (
    ConfigurationError,
    FailureContext,
    KeyTemplateError,
    Lease,
    LockClient,
    LockLost,
    LockNotAcquired,
    _policy,
    configure,
    current_lease,
    distributed_lock,
)
from lockaspect.backends.redis import RedisBackend
from lockaspect.backends.redis._async_replies import Line
from lockaspect.testing import LockServer, ManualClock

#: The ``client`` fixture's watchdog lease, tick (seconds) and delay_weight.
LEASE = 1.0
TICK = 0.02
DW = 0.5

HEX32 = re.compile(r"[0-9a-f]{32}")

T = TypeVar("T")

PY311 = sys.version_info >= (3, 11)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh event loop (the way an application's ``asyncio.run`` does)."""
    return asyncio.run(coro)


def wait_for(condition: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``condition`` until it is true; for states no event announces (counters, keys)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        threading.Event().wait(0.005)


async def until(condition: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> None:
    """:func:`wait_for` for a coroutine: poll without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


def lock_keys_left(raw: Any, namespace: str) -> list[bytes]:
    """The keys under ``namespace`` except the fence counters (which outlive locks on purpose)."""
    return sorted(key for key in raw.keys(namespace + "*") if not key.endswith(b":fence"))


def assert_nothing_left(client: LockClient, raw: Any, namespace: str) -> None:
    """No lock in the store, no lease held, and no timeout left on the client's timer."""
    assert lock_keys_left(raw, namespace) == []
    assert client.stats().held == 0
    assert client._engine.held_keys == {}
    # A cancelled timeout leaves the wheel at its next tick.
    wait_for(lambda: len(client._engine.timer) == 0, what="the timer to empty")


def disjoint(intervals: list[tuple[int, int]]) -> bool:
    """Whether no two (start, end) intervals of one sequence overlap."""
    ordered = sorted(intervals)
    return all(end < next_start for (_, end), (next_start, _) in itertools.pairwise(ordered))


class LostHook:
    """An ``on_lost`` hook that records its calls; thread-safe to wait for."""

    def __init__(self) -> None:
        self.calls: list[Lease] = []
        self.fired = threading.Event()

    def __call__(self, lease: Lease) -> None:
        self.calls.append(lease)
        self.fired.set()

    def wait(self, timeout: float = 15.0) -> None:
        assert self.fired.wait(timeout), f"on_lost was not called within {timeout}s"


class HeldReply:
    """Holds back the reply to the next command an asyncio connection reads, until ``open()``.

    The command itself reaches the real store and runs there; only the client's reading of
    the answer is delayed, which is the window in which a cancellation loses a reply. Both
    ways a connection is read are held: redis-py's ``read_response``, and the lock wire's
    :class:`~lockaspect.backends.redis._async_replies.Line` (whose bytes are kept back, in
    order, from its ``data_received`` until the gate opens).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.sent = asyncio.Event()
        self.gate = asyncio.Event()
        real = AbstractConnection.read_response
        real_data = Line.data_received
        holder = self
        held: dict[Line, list[bytes]] = {}

        async def read_response(connection: Any, *args: Any, **kwargs: Any) -> Any:
            if holder.armed:
                holder.armed = False
                holder.sent.set()
                await holder.gate.wait()
            return await real(connection, *args, **kwargs)

        async def let_through(line: Line) -> None:
            await holder.gate.wait()
            for data in held.pop(line):
                real_data(line, data)

        def data_received(line: Line, data: bytes) -> None:
            if line in held:
                held[line].append(data)
            elif holder.armed:
                holder.armed = False
                holder.sent.set()
                held[line] = [data]
                holder.tasks.add(asyncio.get_running_loop().create_task(let_through(line)))
            else:
                real_data(line, data)

        self.tasks: set[asyncio.Task[None]] = set()
        monkeypatch.setattr(AbstractConnection, "read_response", read_response)
        monkeypatch.setattr(Line, "data_received", data_received)

    def arm(self) -> None:
        self.armed = True

    def open(self) -> None:
        self.gate.set()


async def forever() -> None:
    """Wait until cancelled."""
    await asyncio.Event().wait()


@pytest.fixture
def plain(make_client: Callable[..., LockClient]) -> LockClient:
    """A client with the library's defaults (30 s watchdog lease): nothing renews during a test."""
    return make_client()


@pytest.fixture
def other(make_client: Callable[..., LockClient]) -> LockClient:
    """A second, independent client on the same namespace: a competing owner."""
    return make_client()


@pytest.fixture
def hook() -> LostHook:
    return LostHook()


@pytest.fixture
def threads() -> Iterator[list[threading.Thread]]:
    """Threads a test started; joined after the test so none outlives it."""
    started: list[threading.Thread] = []
    yield started
    for thread in started:
        thread.join(timeout=60)
        assert not thread.is_alive(), f"thread {thread.name} did not finish"


class User:
    def __init__(self, id: Any) -> None:
        self.id = id


class Exploding:
    @property
    def id(self) -> int:
        raise ValueError("the user service is down")


class TestDecoratedCoroutines:
    def test_body_runs_as_a_task_holding_the_lock(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """An ``async def`` runs as a task of its own with ``current_lease()`` set while the store holds the key."""
        lock_key = plain.backend.lock_key("order:42")

        @distributed_lock(key="order:<order_id>", client=plain)
        async def place(order_id: int) -> tuple[Any, Lease | None, bytes | None]:
            lease = current_lease()
            assert lease is not None
            return asyncio.current_task(), lease, raw.hget(lock_key, lease.token)

        async def main() -> tuple[Any, ...]:
            outside = current_lease()
            body_task, lease, hold = await place(42)
            return asyncio.current_task(), outside, body_task, lease, hold, current_lease()

        caller, outside, body_task, lease, hold, after = run(main())
        assert body_task is not caller
        assert body_task.done()
        assert outside is None
        assert after is None
        assert lease.key == "order:42"
        assert HEX32.fullmatch(lease.token)
        assert lease.watchdog
        assert hold == owner_value
        assert raw.exists(lock_key) == 0
        stats = plain.stats()
        assert (stats.acquired, stats.released, stats.held) == (1, 1, 0)

    def test_metadata_and_coroutine_function_are_preserved(self, plain: LockClient) -> None:
        """The decorated coroutine function keeps name, docstring, signature and ``__wrapped__``, and stays async."""

        async def place(order_id: int, *, note: str = "") -> str:
            """Place an order."""
            return f"{order_id}{note}"

        decorated = distributed_lock(key="order:<order_id>", client=plain)(place)

        assert inspect.iscoroutinefunction(decorated)
        assert asyncio.iscoroutinefunction(decorated)
        assert decorated.__wrapped__ is place
        assert decorated.__name__ == "place"
        assert decorated.__qualname__ == place.__qualname__
        assert decorated.__module__ == place.__module__
        assert decorated.__doc__ == "Place an order."
        assert inspect.signature(decorated) == inspect.signature(place)
        coroutine = decorated(7, note="!")
        assert inspect.iscoroutine(coroutine)
        assert run(coroutine) == "7!"

    def test_instance_method_renders_self_attributes(self, plain: LockClient, raw: Any) -> None:
        """An ``async def`` method's key reads ``self``, so two instances lock two keys; it stays a coroutine method."""

        class Account:
            def __init__(self, id: int) -> None:
                self.id = id

            @distributed_lock(key="account:<self.id>:<amount>", client=plain)
            async def withdraw(self, amount: int) -> tuple[str, int]:
                lease = current_lease()
                assert lease is not None
                return lease.key, raw.exists(plain.backend.lock_key(lease.key))

        account = Account(1)
        assert inspect.iscoroutinefunction(Account.withdraw)
        assert inspect.iscoroutinefunction(account.withdraw)
        assert inspect.ismethod(account.withdraw)
        assert list(inspect.signature(account.withdraw).parameters) == ["amount"]

        async def main() -> list[tuple[str, int]]:
            return [
                await account.withdraw(5),
                await Account(2).withdraw(amount=7),
                await Account.withdraw(Account(3), 9),
            ]

        assert run(main()) == [("account:1:5", 1), ("account:2:7", 1), ("account:3:9", 1)]
        assert raw.keys(plain.backend.lock_key("*")) == []

    def test_classmethods_with_the_decorator_below_and_above(self, plain: LockClient) -> None:
        """An ``async def`` classmethod, under or over the decorator, reads ``cls`` in its key and stays async."""

        class Tenant:
            region = "eu"

            @classmethod
            @distributed_lock(key="below:<cls.region>:<name>", client=plain)
            async def below(cls, name: str) -> tuple[type, str]:
                lease = current_lease()
                assert lease is not None
                return cls, lease.key

            @distributed_lock(key="above:<cls.region>:<p0>", client=plain)
            @classmethod
            async def above(cls, name: str) -> tuple[type, str]:
                lease = current_lease()
                assert lease is not None
                return cls, lease.key

        for bound in (Tenant.below, Tenant().below, Tenant.above, Tenant().above):
            assert inspect.iscoroutinefunction(bound), bound
            assert inspect.ismethod(bound), bound
            assert list(inspect.signature(bound).parameters) == ["name"]

        async def main() -> list[tuple[type, str]]:
            return [
                await Tenant.below("acme"),
                await Tenant().below(name="init"),
                await Tenant.above("acme"),
                await Tenant().above("init"),
            ]

        assert run(main()) == [
            (Tenant, "below:eu:acme"),
            (Tenant, "below:eu:init"),
            (Tenant, "above:eu:acme"),
            (Tenant, "above:eu:init"),
        ]

    def test_staticmethods_with_the_decorator_below_and_above(self, plain: LockClient) -> None:
        """An ``async def`` staticmethod, under or over the decorator, gets only its arguments and stays async."""

        class Jobs:
            @staticmethod
            @distributed_lock(key="below:<name>:<p0>", client=plain)
            async def below(name: str) -> str:
                lease = current_lease()
                assert lease is not None
                return lease.key

            @distributed_lock(key="above:<name>:<p0>", client=plain)
            @staticmethod
            async def above(name: str) -> str:
                lease = current_lease()
                assert lease is not None
                return lease.key

        for static in (Jobs.below, Jobs().below, Jobs.above, Jobs().above):
            assert inspect.iscoroutinefunction(static), static
            assert not inspect.ismethod(static), static
            assert list(inspect.signature(static).parameters) == ["name"]

        async def main() -> list[str]:
            return [
                await Jobs.below("sync"),
                await Jobs().below("mail"),
                await Jobs.above("sync"),
                await Jobs().above("mail"),
            ]

        assert run(main()) == ["below:sync:sync", "below:mail:mail", "above:sync:sync", "above:mail:mail"]

    def test_fencing_tokens_increase_and_owner_tokens_differ(self, plain: LockClient) -> None:
        """Each call on a key gets a fencing token larger than the one before and a fresh owner token."""

        @distributed_lock(key="doc:<doc_id>", client=plain)
        async def edit(doc_id: int) -> Lease:
            lease = current_lease()
            assert lease is not None
            return lease

        async def main() -> list[Lease]:
            return [await edit(3) for _ in range(5)]

        leases = run(main())
        fences = [lease.fencing_token for lease in leases]
        assert all(a < b for a, b in itertools.pairwise(fences)), fences
        assert len({lease.token for lease in leases}) == 5
        assert not any(lease.lost for lease in leases)

    def test_key_templates_render_as_for_sync_functions(self, plain: LockClient) -> None:
        """Attribute, subscript and positional-alias templates, callable keys and the qualified-name default work."""

        @distributed_lock(key='t:<payload["tenant"]>:<user.id>:<p2>', client=plain)
        async def templated(payload: Mapping[str, str], user: User, n: int) -> str:
            return current_lease().key  # type: ignore[union-attr]

        @distributed_lock(key=lambda arguments: f"c:{arguments['n'] * 2}", client=plain)
        async def by_callable(n: int) -> str:
            return current_lease().key  # type: ignore[union-attr]

        @distributed_lock(client=plain)
        async def nightly(day: int) -> str:
            return current_lease().key  # type: ignore[union-attr]

        async def main() -> list[str]:
            return [await templated({"tenant": "acme"}, User(7), 3), await by_callable(21), await nightly(1)]

        assert run(main()) == ["t:acme:7:3", "c:42", f"{nightly.__module__}.{nightly.__qualname__}"]

    def test_named_policy_supplies_key_and_options(self, plain: LockClient, raw: Any) -> None:
        """``configure(policies=...)`` gives an async function its key and fixed lease; explicit options override."""
        configure(plain, policies={"orders.create": {"key": "order:<user.id>", "lease": 20}})

        @distributed_lock(policy="orders.create")
        async def create(user: User) -> tuple[Lease, int]:
            lease = current_lease()
            assert lease is not None
            return lease, raw.pttl(plain.backend.lock_key(lease.key))

        @distributed_lock(policy="orders.create", lease=None)
        async def create_renewed(user: User) -> Lease:
            lease = current_lease()
            assert lease is not None
            return lease

        async def main() -> tuple[tuple[Lease, int], Lease]:
            return await create(User(7)), await create_renewed(User(8))

        (fixed, pttl), renewed = run(main())
        assert (fixed.key, fixed.watchdog, fixed.lease_time) == ("order:7", False, 20.0)
        assert 0 < pttl <= 20_000
        assert (renewed.key, renewed.watchdog, renewed.lease_time) == ("order:8", True, plain.watchdog_lease)
        assert plain.stats().released == 2

    def test_body_exception_propagates_and_the_lock_is_released(self, plain: LockClient, raw: Any) -> None:
        """The body's own exception reaches the caller unchanged, after the lock was released."""
        failure = ValueError("disk full")

        @distributed_lock(key="fail:<n>", client=plain)
        async def work(n: int) -> None:
            assert raw.exists(plain.backend.lock_key("fail:1")) == 1
            raise failure

        with pytest.raises(ValueError) as info:
            run(work(1))
        assert info.value is failure
        assert raw.exists(plain.backend.lock_key("fail:1")) == 0
        assert plain.stats().released == 1


class TestBusyLock:
    def test_busy_lock_raises_lock_not_acquired_without_running_the_body(
        self, plain: LockClient, other: LockClient, raw: Any, owner_value: Any
    ) -> None:
        """A key held by another owner makes the call raise ``LockNotAcquired`` and the body never runs."""
        ran: list[int] = []

        @distributed_lock(key="res:<n>", client=plain)
        async def work(n: int) -> None:
            ran.append(n)

        with other.lock("res:5") as holder:
            with pytest.raises(LockNotAcquired) as info:
                run(work(5))
            assert raw.hgetall(plain.backend.lock_key("res:5"))[holder.token.encode()] == owner_value
        assert (info.value.key, info.value.waited) == ("res:5", 0.0)
        assert ran == []
        assert plain.stats().not_acquired == 1

    def test_sync_on_failure_value_is_the_result(self, plain: LockClient, other: LockClient) -> None:
        """A plain ``on_failure`` gets the context (key, function, bound arguments, waited); its value is returned."""
        seen: list[FailureContext] = []

        def fallback(ctx: FailureContext) -> str:
            seen.append(ctx)
            return "try later"

        @distributed_lock(key="res:<p0>", client=plain, on_failure=fallback)
        async def work(res_id: int, mode: str = "fast") -> str:
            return "done"

        with other.lock("res:7"):
            assert run(work(7)) == "try later"
        assert run(work(7)) == "done"
        [ctx] = seen
        assert ctx.key == "res:7"
        assert ctx.function == work.__qualname__
        assert dict(ctx.arguments) == {"res_id": 7, "mode": "fast"}
        assert ctx.waited == 0.0
        assert isinstance(ctx.error, LockNotAcquired)

    def test_async_on_failure_is_awaited_in_the_callers_task(self, plain: LockClient, other: LockClient) -> None:
        """An ``async def`` ``on_failure`` is awaited in the caller's task and its value is the call's result."""
        seen: list[Any] = []

        async def fallback(ctx: FailureContext) -> str:
            await asyncio.sleep(0)
            seen.append((asyncio.current_task(), ctx.key, current_lease()))
            return f"queued {ctx.arguments['n']}"

        @distributed_lock(key="res:<n>", client=plain, on_failure=fallback)
        async def work(n: int) -> str:
            return "done"

        async def main() -> tuple[Any, str]:
            return asyncio.current_task(), await work(3)

        with other.lock("res:3") as holder:
            caller, result = run(main())
        assert result == "queued 3"
        # the caller's own context: the failed call holds nothing (the holder's block is ours)
        assert seen == [(caller, "res:3", holder)]

    def test_on_failure_after_waiting_reports_the_wait(self, plain: LockClient, other: LockClient) -> None:
        """With ``wait=``, ``on_failure`` runs once the wait ran out and sees at least that wait."""
        seen: list[float] = []

        @distributed_lock(key="res:<n>", client=plain, wait=0.2, on_failure=lambda ctx: seen.append(ctx.waited))
        async def work(n: int) -> str:
            return "done"

        with other.lock("res:1"):
            assert run(work(1)) is None
        [waited] = seen
        assert waited >= 0.2

    def test_on_failure_does_not_handle_a_nested_calls_failure(
        self, plain: LockClient, other: LockClient, raw: Any
    ) -> None:
        """A ``LockNotAcquired`` from a nested locked call propagates past the outer call's ``on_failure``."""
        seen: list[FailureContext] = []

        @distributed_lock(key="inner:<n>", client=plain)
        async def inner(n: int) -> str:
            return "inner"

        @distributed_lock(key="outer:<n>", client=plain, on_failure=seen.append)
        async def outer(n: int) -> str:
            return await inner(n)

        with other.lock("inner:1"), pytest.raises(LockNotAcquired) as info:
            run(outer(1))
        assert info.value.key == "inner:1"
        assert seen == []
        assert raw.exists(plain.backend.lock_key("outer:1")) == 0

    def test_wait_runs_out_with_lock_not_acquired(self, plain: LockClient, other: LockClient) -> None:
        """A wait that runs out raises ``LockNotAcquired`` reporting at least the time waited."""

        @distributed_lock(key="res:<n>", client=plain, wait=0.2)
        async def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with other.lock("res:4"), pytest.raises(LockNotAcquired) as info:
            run(work(4))
        assert info.value.key == "res:4"
        assert info.value.waited >= 0.2

    @pytest.mark.parametrize("wait_strategy", ["notify", "poll"])
    @pytest.mark.parametrize("wait", [30.0, None], ids=["seconds", "forever"])
    def test_waiter_gets_the_lock_when_the_holder_releases(
        self, plain: LockClient, raw: Any, monkeypatch: pytest.MonkeyPatch, wait: float | None, wait_strategy: str
    ) -> None:
        """A waiting call takes the lock once the holder (another task on the loop) releases it, with a larger fence.
        With notify it queues once subscribed and takes the lock on its first attempt after the wake-up; with poll
        it never queues."""
        # No periodic recheck: a notified waiter's sleep ends on the wake-up (or the 30 s lease), nothing else.
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 60.0)
        queue = plain.backend.queue_key("job:1")

        @distributed_lock(key="job:<n>", client=plain, wait=wait, wait_strategy=wait_strategy)
        async def work(n: int) -> int:
            lease = current_lease()
            assert lease is not None
            return lease.fencing_token

        async def main() -> tuple[int, int, list[tuple[bool, str | None, bool]], str | None]:
            release = asyncio.Event()
            held = asyncio.Event()
            fences: list[int] = []

            async def holder() -> None:
                async with plain.lock("job:1") as lease:
                    fences.append(lease.fencing_token)
                    held.set()
                    await release.wait()

            holding = asyncio.create_task(holder())
            await held.wait()
            attempts: list[tuple[bool, str | None, bool]] = []
            backend = plain._async.state().store
            real = backend.acquire

            async def acquire(request: Any) -> Any:
                result = await real(request)
                attempts.append((result.acquired, request.waiter, request.front))
                return result

            backend.acquire = acquire
            waiting = asyncio.create_task(work(1))
            # let the holder go once the waiter has found the lock busy (and, with notify, subscribed and queued)
            await until(lambda: len(attempts) >= 2, what="the waiter's second attempt")
            waiter_id = None
            if wait_strategy == "notify":
                waiter_id = backend.notifier().waiter_id
                channel = plain.backend.wake_channel("job:1", waiter_id)
                assert raw.pubsub_numsub(channel) == [(channel.encode(), 1)]
                assert raw.lrange(queue, 0, -1) == [waiter_id.encode()]
            else:
                assert raw.exists(queue) == 0
            release.set()
            fence = await waiting
            await holding
            return fences[0], fence, attempts, waiter_id

        held_fence, fence, attempts, waiter_id = run(main())
        assert fence > held_fence
        assert [acquired for acquired, _, _ in attempts].count(True) == 1
        if wait_strategy == "notify":
            # try, retry once subscribed (queued), then the woken attempt (in front, should a barger win)
            assert attempts == [(False, None, False), (False, waiter_id, False), (True, waiter_id, True)]
        else:
            assert all(waiter is None for _, waiter, _ in attempts)
        assert raw.exists(queue) == 0


CALL_TIME_ERRORS = [
    pytest.param("user:<user.id>", User(None), id="value-is-none"),
    pytest.param("user:<user>", None, id="argument-is-none"),
    pytest.param("user:<user.id>", object(), id="missing-attribute"),
    pytest.param("user:<user.ids[0]>", SimpleNamespace(ids=[]), id="missing-index"),
    pytest.param("user:<user.id>", User(1.5), id="float"),
    pytest.param("user:<user.id>", User(True), id="bool"),
    pytest.param("user:<user.id>", User(b"42"), id="bytes"),
    pytest.param("user:<user.id>", User([4, 2]), id="list"),
    pytest.param("user:<user.id>", User("x" * 2000), id="over-the-length-cap"),
    pytest.param("user:<user.id>", Exploding(), id="property-raises"),
]


class TestCallTimeBadInput:
    @pytest.mark.parametrize(("template", "value"), CALL_TIME_ERRORS)
    def test_bad_value_fails_before_any_store_io(
        self, plain: LockClient, raw: Any, commands: Any, namespace: str, template: str, value: Any
    ) -> None:
        """An unrenderable key raises ``KeyTemplateError`` when awaited, before the body runs or any store I/O."""
        ran: list[Any] = []

        @distributed_lock(key=template, client=plain)
        async def work(user: Any) -> None:
            ran.append(user)

        with commands.assert_none(), pytest.raises(KeyTemplateError) as info:
            run(work(value))
        assert type(info.value) is KeyTemplateError
        assert info.value.template == template
        assert ran == []
        assert raw.keys(namespace + "*") == []

    def test_raising_property_is_chained(self, plain: LockClient, raw: Any, commands: Any, namespace: str) -> None:
        """A property raising while rendering gives a ``KeyTemplateError`` chained to its error, with no store I/O."""

        @distributed_lock(key="user:<user.id>", client=plain)
        async def work(user: Any) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError) as info:
            run(work(Exploding()))
        assert isinstance(info.value.__cause__, ValueError)
        assert str(info.value.__cause__) == "the user service is down"
        assert raw.keys(namespace + "*") == []

    def test_raising_key_callable_is_chained(self, plain: LockClient, raw: Any, commands: Any, namespace: str) -> None:
        """A key callable that raises gives a ``KeyTemplateError`` chained to its error, with no store I/O."""
        boom = LookupError("no tenant")

        def key(arguments: Mapping[str, Any]) -> str:
            raise boom

        @distributed_lock(key=key, client=plain)
        async def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError) as info:
            run(work(1))
        assert info.value.__cause__ is boom
        assert raw.keys(namespace + "*") == []

    @pytest.mark.parametrize("result", [42, None, "", "a{b}c", "x" * 2000], ids=repr)
    def test_key_callable_with_a_bad_result(
        self, plain: LockClient, raw: Any, commands: Any, namespace: str, result: Any
    ) -> None:
        """A key callable returning a non-str, empty, braced or oversized key fails when awaited, with no store I/O."""

        @distributed_lock(key=lambda arguments: result, client=plain)
        async def work(n: int) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError):
            run(work(1))
        assert raw.keys(namespace + "*") == []

    def test_bad_key_in_async_with_fails_before_any_store_io(self, plain: LockClient, commands: Any) -> None:
        """``client.lock()`` with a braced or empty key fails at once, before the block or any store I/O."""

        async def main() -> None:
            for bad in ("a{b}", ""):
                with pytest.raises(KeyTemplateError):
                    async with plain.lock(bad):
                        raise AssertionError("the block must not run")

        with commands.assert_none():
            run(main())


class TestAsyncWith:
    def test_block_gets_the_lease_and_releases_on_exit(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """``async with client.lock()`` yields the Lease, holds the key while the block runs, and releases on exit."""
        lock_key = plain.backend.lock_key("order:9")

        async def main() -> tuple[Lease, dict[bytes, bytes], Lease | None, Lease | None]:
            async with plain.lock("order:9") as lease:
                inside = current_lease()
                held = raw.hgetall(lock_key)
            return lease, held, inside, current_lease()

        lease, held, inside, after = run(main())
        assert inside is lease
        assert after is None
        assert held == {lease.token.encode(): owner_value, b"fence": str(lease.fencing_token).encode()}
        assert raw.exists(lock_key) == 0
        assert not lease.held
        assert (plain.stats().acquired, plain.stats().released) == (1, 1)

    def test_nested_block_on_the_same_key_reenters(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """A nested ``async with`` on the same key in the same task re-enters: same lease and fence, hold count 2."""
        lock_key = plain.backend.lock_key("acct:1")

        async def main() -> tuple[Lease, Lease, dict[bytes, bytes], dict[bytes, bytes]]:
            async with plain.lock("acct:1") as outer:
                async with plain.lock("acct:1") as inner:
                    during = raw.hgetall(lock_key)
                after_inner = raw.hgetall(lock_key)
            return outer, inner, during, after_inner

        outer, inner, during, after_inner = run(main())
        token, fence = outer.token.encode(), str(outer.fencing_token).encode()
        assert inner is outer
        assert during == {token: owner_value, b"fence": fence}  # one hold per owner: re-entries are counted here
        assert after_inner == {token: owner_value, b"fence": fence}
        assert raw.exists(lock_key) == 0
        assert (plain.stats().acquired, plain.stats().reentered, plain.stats().released) == (1, 1, 1)

    def test_decorated_call_inside_a_block_reenters(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """A decorated coroutine called inside ``async with`` on its key re-enters the block's hold."""
        lock_key = plain.backend.lock_key("acct:2")

        @distributed_lock(key="acct:<n>", client=plain)
        async def inner(n: int) -> tuple[Lease | None, bytes | None]:
            lease = current_lease()
            return lease, raw.hget(lock_key, lease.token) if lease else None

        async def main() -> tuple[Lease, Lease | None, bytes | None]:
            async with plain.lock("acct:2") as outer:
                lease, holds = await inner(2)
            return outer, lease, holds

        outer, lease, holds = run(main())
        assert lease is outer
        assert holds == owner_value  # one hold per owner in the store: re-entries are counted by the client
        assert raw.exists(lock_key) == 0

    def test_busy_key_raises_lock_not_acquired(self, plain: LockClient, other: LockClient) -> None:
        """A key held elsewhere makes ``async with`` raise ``LockNotAcquired`` at once, or after ``wait=``."""

        async def main() -> tuple[LockNotAcquired, LockNotAcquired]:
            errors = []
            for wait in (0.0, 0.2):
                with pytest.raises(LockNotAcquired) as info:
                    async with plain.lock("busy", wait=wait):
                        raise AssertionError("the block must not run")
                errors.append(info.value)
            return errors[0], errors[1]

        with other.lock("busy"):
            once, waited = run(main())
        assert (once.key, once.waited) == ("busy", 0.0)
        assert waited.waited >= 0.2
        assert plain.stats().not_acquired == 2

    def test_waiting_block_enters_when_the_holder_releases(self, plain: LockClient, raw: Any) -> None:
        """A block with ``wait=`` subscribes and queues, then enters as soon as the holding task's block exits."""
        queue = plain.backend.queue_key("handoff")

        async def main() -> tuple[int, int, list[str]]:
            order: list[str] = []
            release = asyncio.Event()
            held = asyncio.Event()

            async def holder() -> int:
                async with plain.lock("handoff") as lease:
                    held.set()
                    await release.wait()
                    order.append("holder out")
                return lease.fencing_token

            async def waiter() -> int:
                async with plain.lock("handoff", wait=30) as lease:
                    order.append("waiter in")
                return lease.fencing_token

            holding = asyncio.create_task(holder())
            await held.wait()
            waiting = asyncio.create_task(waiter())
            waiter_id = plain._async.state().store.notifier().waiter_id
            channel = plain.backend.wake_channel("handoff", waiter_id)
            await until(lambda: raw.lrange(queue, 0, -1) == [waiter_id.encode()], what="the waiter to queue")
            assert raw.pubsub_numsub(channel) == [(channel.encode(), 1)]
            assert not waiting.done()
            release.set()
            return await holding, await waiting, order

        first, second, order = run(main())
        assert second > first
        assert order == ["holder out", "waiter in"]
        assert raw.exists(queue) == 0

    def test_exception_in_the_block_propagates_and_releases(self, plain: LockClient, raw: Any) -> None:
        """An exception raised in the block reaches the caller unchanged and the key is released."""
        failure = KeyError("missing")

        async def main() -> None:
            async with plain.lock("exc"):
                raise failure

        with pytest.raises(KeyError) as info:
            run(main())
        assert info.value is failure
        assert raw.exists(plain.backend.lock_key("exc")) == 0

    def test_a_block_object_cannot_be_entered_twice(self, plain: LockClient, raw: Any) -> None:
        """Entering the same ``client.lock()`` object while it is entered is a RuntimeError and takes nothing."""

        async def main() -> None:
            block = plain.lock("twice")
            async with block:
                with pytest.raises(RuntimeError, match="already entered"):
                    await block.__aenter__()
                assert raw.hlen(plain.backend.lock_key("twice")) == 2  # one owner hold + the fence

        run(main())
        assert raw.exists(plain.backend.lock_key("twice")) == 0
        assert plain.stats().acquired == 1


class TestOwnershipPerTask:
    @staticmethod
    def _increments(
        lock: Callable[[Callable[[int], Awaitable[None]]], Callable[[int], Awaitable[None]]] | None,
        tasks: int,
        each: int,
    ) -> tuple[int, list[tuple[int, int]]]:
        """``tasks`` tasks on one loop, each doing ``each`` read-yield-write increments of one
        counter, wrapped by ``lock`` (or not): the final count and every section's interval."""
        counter = {"value": 0}
        sequence = itertools.count()
        intervals: list[tuple[int, int]] = []

        async def increment(task_id: int) -> None:
            start = next(sequence)
            value = counter["value"]
            await asyncio.sleep(0)  # every other runnable task runs here
            counter["value"] = value + 1
            intervals.append((start, next(sequence)))

        step = increment if lock is None else lock(increment)

        async def worker(task_id: int) -> None:
            for _ in range(each):
                await step(task_id)

        async def main() -> None:
            await asyncio.gather(*(worker(i) for i in range(tasks)))

        run(main())
        return counter["value"], intervals

    def test_control_unlocked_tasks_lose_increments(self) -> None:
        """Without the lock, tasks interleaving at the await overwrite each other's increments."""
        count, intervals = self._increments(None, tasks=4, each=10)
        assert count < 40
        assert not disjoint(intervals)

    def test_independent_tasks_on_one_loop_serialise(self, plain: LockClient, raw: Any, namespace: str) -> None:
        """Tasks of one loop with their own contexts exclude each other: exact count, no two sections overlap."""
        lock = distributed_lock(key="counter", client=plain, wait=None)
        count, intervals = self._increments(lock, tasks=4, each=10)
        assert count == 40
        assert len(intervals) == 40
        assert disjoint(intervals)
        stats = plain.stats()
        assert (stats.acquired, stats.reentered, stats.released, stats.lost) == (40, 0, 40, 0)
        assert_nothing_left(plain, raw, namespace)

    def test_nested_calls_in_one_task_reenter(self, plain: LockClient, raw: Any, owner_value: Any) -> None:
        """A nested locked call in the same task (through awaits) re-enters with the same lease and fencing token."""
        lock_key = plain.backend.lock_key("acct:9")

        @distributed_lock(key="acct:<account>", client=plain)
        async def inner(account: int) -> tuple[Lease | None, dict[bytes, bytes]]:
            await asyncio.sleep(0)
            return current_lease(), raw.hgetall(lock_key)

        async def middle(account: int) -> tuple[Lease | None, dict[bytes, bytes]]:
            return await inner(account)

        @distributed_lock(key="acct:<account>", client=plain)
        async def outer(account: int) -> tuple[Any, ...]:
            lease = current_lease()
            inner_lease, during = await middle(account)
            return lease, inner_lease, during, raw.hgetall(lock_key)

        lease, inner_lease, during, after_inner = run(outer(9))
        token, fence = lease.token.encode(), str(lease.fencing_token).encode()
        assert inner_lease is lease
        assert during == {token: owner_value, b"fence": fence}  # one hold per owner: re-entries are counted here
        assert after_inner == {token: owner_value, b"fence": fence}
        assert raw.exists(lock_key) == 0
        assert (plain.stats().acquired, plain.stats().reentered) == (1, 1)

    def test_a_task_outside_the_body_is_another_owner(self, plain: LockClient) -> None:
        """The task that started a locked call, awaiting the key itself while that call holds it, finds it busy."""

        async def main() -> tuple[LockNotAcquired, int, int]:
            entered, proceed = asyncio.Event(), asyncio.Event()

            @distributed_lock(key="shared", client=plain)
            async def work(hold: bool) -> int:
                if hold:
                    entered.set()
                    await proceed.wait()
                lease = current_lease()
                assert lease is not None
                return lease.fencing_token

            holding = asyncio.create_task(work(True))
            await entered.wait()
            with pytest.raises(LockNotAcquired) as info:
                await work(False)
            proceed.set()
            first = await holding
            return info.value, first, await work(False)

        error, first, later = run(main())
        assert error.key == "shared"
        assert later > first

    @pytest.mark.parametrize("spawn", ["create_task", "ensure_future", "loop.create_task"])
    def test_task_created_inside_the_body_inherits_and_shares_the_hold(
        self, client: LockClient, other: LockClient, raw: Any, namespace: str, spawn: str, owner_value: Any
    ) -> None:
        """A task started inside a locked body re-enters the body's hold; if it outlives the body the lock stays
        held (and renewed) until that task's locked call ends, and only then is the key deleted."""
        lock_key = client.backend.lock_key("job:1")

        async def main() -> None:
            started, finish = asyncio.Event(), asyncio.Event()

            @distributed_lock(key="job:<n>", client=client)
            async def child(n: int) -> Lease | None:
                started.set()
                await finish.wait()
                return current_lease()

            @distributed_lock(key="job:<n>", client=client)
            async def parent(n: int) -> tuple[Lease, asyncio.Future[Lease | None], dict[bytes, bytes]]:
                lease = current_lease()
                assert lease is not None
                coroutine = child(n)
                if spawn == "create_task":
                    task = asyncio.create_task(coroutine)
                elif spawn == "ensure_future":
                    task = asyncio.ensure_future(coroutine)
                else:
                    task = asyncio.get_running_loop().create_task(coroutine)
                await started.wait()
                # both run at once under the one hold: they do not exclude each other
                return lease, task, raw.hgetall(lock_key)

            lease, task, during = await parent(1)
            token, fence = lease.token.encode(), str(lease.fencing_token).encode()
            assert during == {token: owner_value, b"fence": fence}  # one hold per owner, re-entries counted here
            # the parent call returned, but the child still holds the lock: the key is there
            # with one hold, and the watchdog keeps renewing it
            assert raw.hgetall(lock_key) == {token: owner_value, b"fence": fence}
            assert lease.held
            assert client.stats().held == 1
            renewals = client.stats().renewals
            await until(lambda: client.stats().renewals > renewals, what="a renewal after the parent returned")
            with pytest.raises(LockNotAcquired), other.lock("job:1"):
                pass
            finish.set()
            assert await task is lease
            assert raw.exists(lock_key) == 0
            assert not lease.held

        run(main())
        stats = client.stats()
        assert (stats.acquired, stats.reentered, stats.released, stats.lost) == (1, 1, 1, 0)
        assert_nothing_left(client, raw, namespace)

    def test_gathered_calls_inside_the_body_all_share_the_hold(self, plain: LockClient, raw: Any) -> None:
        """``asyncio.gather`` of locked calls on the body's key runs them concurrently under the body's one hold."""
        lock_key = plain.backend.lock_key("batch")

        async def main() -> tuple[Lease, list[Lease | None], int]:
            both_in = asyncio.Event()
            inside: list[int] = []
            peak: list[int] = []

            @distributed_lock(key="batch", client=plain)
            async def part(i: int) -> Lease | None:
                inside.append(i)
                if len(inside) == 2:
                    peak.append(current_lease()._holds)  # type: ignore[union-attr]
                    both_in.set()
                await both_in.wait()
                return current_lease()

            @distributed_lock(key="batch", client=plain)
            async def whole() -> tuple[Lease, list[Lease | None]]:
                parts = await asyncio.gather(part(1), part(2))
                return current_lease(), parts  # type: ignore[return-value]

            lease, parts = await whole()
            return lease, parts, peak[0]

        lease, parts, peak = run(main())
        assert parts == [lease, lease]
        assert peak == 3  # the body's hold plus one per gathered call, all at once (counted by the client)
        assert raw.exists(lock_key) == 0

    def test_task_inside_the_body_that_runs_on_after_it_is_not_protected(
        self, plain: LockClient, raw: Any, namespace: str
    ) -> None:
        """A task started in the body that only locks after the body returned sees a released lease, and its
        locked call takes the lock afresh as a new owner with a larger fencing token."""

        async def main() -> tuple[Lease, Lease | None, str, Lease | None]:
            go = asyncio.Event()

            @distributed_lock(key="late", client=plain)
            async def locked() -> Lease | None:
                return current_lease()

            async def straggler() -> tuple[Lease | None, str, Lease | None]:
                await go.wait()
                seen = current_lease()
                assert seen is not None
                with pytest.raises(LockLost) as info:
                    seen.check()
                return seen, info.value.reason, await locked()

            @distributed_lock(key="late", client=plain)
            async def body() -> tuple[Lease, asyncio.Task[Any]]:
                return current_lease(), asyncio.create_task(straggler())  # type: ignore[return-value]

            lease, task = await body()
            go.set()
            seen, reason, fresh = await task
            return lease, seen, reason, fresh

        lease, seen, reason, fresh = run(main())
        assert seen is lease
        assert reason == "released"
        assert fresh is not None
        assert fresh is not lease
        assert fresh.token != lease.token
        assert fresh.fencing_token > lease.fencing_token
        assert lock_keys_left(raw, namespace) == []

    @pytest.mark.skipif(not PY311, reason="create_task(context=) is Python 3.11+")
    def test_task_with_a_fresh_context_is_another_owner(self, plain: LockClient) -> None:
        """A task created in the body with ``context=contextvars.Context()`` holds nothing and finds the key busy."""

        @distributed_lock(key="fresh", client=plain)
        async def locked() -> str:
            return "entered"

        @distributed_lock(key="fresh", client=plain)
        async def body() -> tuple[Lease | None, type[BaseException]]:
            async def probe() -> tuple[Lease | None, type[BaseException]]:
                try:
                    await locked()
                except LockNotAcquired as exc:
                    return current_lease(), type(exc)
                raise AssertionError("the fresh task re-entered")

            return await asyncio.create_task(probe(), context=contextvars.Context())  # type: ignore[call-arg]

        assert run(body()) == (None, LockNotAcquired)

    def test_to_thread_shares_the_hold_and_run_in_executor_does_not(
        self, plain: LockClient, raw: Any, owner_value: Any
    ) -> None:
        """``asyncio.to_thread`` copies the context (a sync lock there re-enters); ``run_in_executor`` does not."""
        lock_key = plain.backend.lock_key("threads")

        def sync_part() -> tuple[Lease | None, bytes | None]:
            with plain.lock("threads") as lease:
                return current_lease(), raw.hget(lock_key, lease.token)

        def sync_probe() -> type[BaseException] | None:
            try:
                with plain.lock("threads"):
                    return None
            except LockNotAcquired as exc:
                return type(exc)

        @distributed_lock(key="threads", client=plain)
        async def body() -> tuple[Lease | None, Any, Any]:
            shared = await asyncio.to_thread(sync_part)
            separate = await asyncio.get_running_loop().run_in_executor(None, sync_probe)
            return current_lease(), shared, separate

        lease, (shared_lease, holds), separate = run(body())
        assert shared_lease is lease
        assert holds == owner_value  # one hold per owner in the store: re-entries are counted by the client
        assert separate is LockNotAcquired
        assert raw.exists(lock_key) == 0


class TestWatchdog:
    @pytest.mark.slow
    def test_async_lock_outlives_its_lease_while_renewed(self, client: LockClient, raw: Any, owner_value: Any) -> None:
        """A locked coroutine running for three leases keeps its key (renewed from its loop) and releases it after."""
        lock_key = client.backend.lock_key("long:1")

        @distributed_lock(key="long:<n>", client=client)
        async def long_job(n: int) -> str:
            lease = current_lease()
            assert lease is not None
            await asyncio.sleep(3 * LEASE)  # the subject: wall time passing under the lock
            assert raw.hget(lock_key, lease.token) == owner_value
            assert raw.pttl(lock_key) > 0
            lease.check()
            # each renewal extends the lease by at most one lease from when it was sent
            assert client.stats().renewals >= 3
            return "done"

        assert run(long_job(1)) == "done"
        assert not raw.exists(lock_key)
        stats = client.stats()
        assert (stats.released, stats.lost, stats.held, stats.renewal_failures) == (1, 0, 0, 0)

    @pytest.mark.slow
    def test_many_async_leases_renew_in_few_round_trips_without_a_task_or_thread_each(
        self, client: LockClient, raw: Any, namespace: str
    ) -> None:
        """200 leases held by one task renew in batches, with no task or thread per lease."""
        before = set(threading.enumerate())

        async def main() -> None:
            me = asyncio.current_task()
            async with contextlib.AsyncExitStack() as stack:
                leases = [await stack.enter_async_context(client.lock(f"batch:{i}")) for i in range(200)]
                others: list[int] = []

                def sample() -> bool:
                    others.append(len(asyncio.all_tasks() - {me}))
                    return client.stats().renewals >= 400

                await until(sample, what="two renewals per lease")
                stats = client.stats()
                assert stats.renewal_failures == 0
                assert stats.renewal_round_trips * 10 <= stats.renewals, stats
                # beside this task, only a tick's renewal round trip or two (and the driver's
                # connection hand-backs after them): never a task per lease
                assert max(others) <= 10, max(others)
                library = client.threads()
                assert {thread.name for thread in library} <= {"lockaspect-timer", "lockaspect-watchdog"}
                assert set(threading.enumerate()) - before <= set(library)
                assert client.stats().held == 200
                assert not any(lease.lost for lease in leases)
                pipe = raw.pipeline(transaction=False)
                for lease in leases:
                    pipe.hexists(client.backend.lock_key(lease.key), lease.token)
                assert all(pipe.execute())

        run(main())
        assert client.stats().released == 200
        assert_nothing_left(client, raw, namespace)

    def test_leases_due_in_one_tick_renew_in_one_round_trip(
        self, lock_server: LockServer, namespace: str, raw: Any, threads: list[threading.Thread]
    ) -> None:
        """Leases of two loops falling due in the same tick are renewed by exactly one round trip, from the
        watchdog thread (a busy loop cannot delay its leases' renewals)."""
        # A manual clock makes "due in the same tick" exact; the store is real.
        clock = ManualClock(start=time.monotonic() + 3600)
        client = LockClient(
            RedisBackend.from_url(lock_server.url, namespace=namespace),
            watchdog_lease=LEASE,
            tick=TICK,
            delay_weight=DW,
            clock=clock,
        )
        per_loop = 150
        ready = [threading.Event(), threading.Event()]
        done = threading.Event()
        errors: list[BaseException] = []

        async def hold(loop_id: int) -> None:
            async with contextlib.AsyncExitStack() as stack:
                for i in range(per_loop):
                    await stack.enter_async_context(client.lock(f"due:{loop_id}:{i}"))
                ready[loop_id].set()
                await until(done.is_set, timeout=60, what="the test to finish")

        def loop_thread(loop_id: int) -> None:
            try:
                run(hold(loop_id))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                ready[loop_id].set()

        try:
            for loop_id in (0, 1):
                thread = threading.Thread(target=loop_thread, args=(loop_id,), name=f"loop-{loop_id}")
                thread.start()
                threads.append(thread)
            for event in ready:
                assert event.wait(30)
            assert errors == []
            assert client.stats().renewal_round_trips == 0
            clock.advance(DW * LEASE + TICK)
            wait_for(lambda: client.stats().renewals == 2 * per_loop, what="every lease renewed once")
            stats = client.stats()
            assert stats.renewal_round_trips == 1
            assert (stats.renewal_failures, stats.lost) == (0, 0)
        finally:
            done.set()
            for thread in threads:
                thread.join(30)
            client.close()
        assert errors == []
        assert client.stats().released == 2 * per_loop
        assert lock_keys_left(raw, namespace) == []


class TestLostLease:
    @pytest.mark.parametrize("hook_kind", ["sync-hook", "async-hook"])
    def test_stolen_key_cancels_the_body_and_the_call_raises_lock_lost(
        self, client: LockClient, raw: Any, hook_kind: str
    ) -> None:
        """A key deleted behind the holder's back cancels the body task; the call raises LockLost chained to the
        CancelledError with reason "not-owner", and on_lost (sync, or async on the lease's loop) runs once."""
        lock_key = client.backend.lock_key("stolen:1")
        calls: list[tuple[Lease, Any]] = []
        body_saw: list[type[BaseException]] = []
        after_cancel: list[str] = []

        def sync_hook(lease: Lease) -> None:
            calls.append((lease, None))

        async def async_hook(lease: Lease) -> None:
            calls.append((lease, asyncio.get_running_loop()))

        @distributed_lock(
            key="stolen:<n>", client=client, on_lost=sync_hook if hook_kind == "sync-hook" else async_hook
        )
        async def body(n: int) -> str:
            raw.delete(lock_key)
            try:
                await forever()
            except BaseException as exc:
                body_saw.append(type(exc))
                raise
            after_cancel.append("ran on")
            return "written"

        async def main() -> tuple[LockLost, Any]:
            with pytest.raises(LockLost) as info:
                await body(1)
            await until(lambda: calls, what="the on_lost hook")
            return info.value, asyncio.get_running_loop()

        error, loop = run(main())
        assert (error.key, error.reason) == ("stolen:1", "not-owner")
        assert isinstance(error.__cause__, asyncio.CancelledError)
        assert error.exception is error.__cause__
        assert not error.has_result
        assert body_saw == [asyncio.CancelledError]
        assert after_cancel == []
        [(lease, hook_loop)] = calls
        assert lease is error.lease
        assert lease.lost_reason == "not-owner"
        assert hook_loop is (loop if hook_kind == "async-hook" else None)
        assert not raw.exists(lock_key)
        assert (client.stats().lost, client.stats().held) == (1, 0)

    def test_lock_taken_over_is_left_to_the_new_owner(self, client: LockClient, raw: Any, hook: LostHook) -> None:
        """When another owner overwrote the key, the cancelled holder's release leaves the new owner's lock alone."""
        lock_key = client.backend.lock_key("stolen:2")
        thief = {"thief" * 6 + "ab": 1, "fence": 99}

        @distributed_lock(key="stolen:<n>", client=client, on_lost=hook)
        async def body(n: int) -> None:
            pipe = raw.pipeline(transaction=True)
            pipe.delete(lock_key)
            pipe.hset(lock_key, mapping=thief)
            pipe.pexpire(lock_key, 60_000)
            pipe.execute()
            await forever()

        with pytest.raises(LockLost) as info:
            run(body(2))
        assert info.value.reason == "not-owner"
        hook.wait()
        assert len(hook.calls) == 1
        assert raw.hgetall(lock_key) == {b"thief" * 6 + b"ab": b"1", b"fence": b"99"}
        assert raw.pttl(lock_key) > LEASE * 1000

    def test_body_that_swallows_the_cancellation_still_raises_lock_lost(self, client: LockClient, raw: Any) -> None:
        """A body that catches the lost-lease cancellation and returns makes the call raise LockLost with its result."""
        lock_key = client.backend.lock_key("stubborn")

        @distributed_lock(key="stubborn", client=client)
        async def body() -> str:
            raw.delete(lock_key)
            try:
                await forever()
            except asyncio.CancelledError:
                return "finished anyway"
            return "unreachable"

        with pytest.raises(LockLost) as info:
            run(body())
        assert info.value.reason == "not-owner"
        assert info.value.has_result
        assert info.value.result == "finished anyway"

    @pytest.mark.parametrize("nesting", ["one-block", "nested-blocks", "decorated-call-inside"])
    def test_stolen_key_ends_the_block_with_lock_lost_and_the_task_goes_on(
        self, client: LockClient, raw: Any, hook: LostHook, nesting: str
    ) -> None:
        """A lost lease cancels the task running ``async with``; the block ends with LockLost chained to that
        cancellation, and after catching it the task is not cancelled and awaits normally."""
        lock_key = client.backend.lock_key("stolen:3")

        async def steal_and_wait() -> None:
            raw.delete(lock_key)
            await forever()

        @distributed_lock(key="stolen:<n>", client=client)
        async def inner(n: int) -> None:
            await steal_and_wait()

        reached: list[str] = []
        entered: list[Lease] = []

        async def hold() -> None:
            async with client.lock("stolen:3", on_lost=hook) as lease:
                entered.append(lease)
                if nesting == "one-block":
                    await steal_and_wait()
                elif nesting == "nested-blocks":
                    async with client.lock("stolen:3"):
                        await steal_and_wait()
                else:
                    await inner(3)
                reached.append("after the await")

        async def main() -> tuple[LockLost, list[str], int | None, Lease]:
            with pytest.raises(LockLost) as info:
                await hold()
            task = asyncio.current_task()
            assert task is not None
            cancelling = task.cancelling() if PY311 else None  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)
            async with client.lock("afterwards") as later:
                await asyncio.sleep(0)
            reached.append(later.key)
            return info.value, reached, cancelling, entered[0]

        error, reached, cancelling, lease = run(main())
        assert (error.key, error.reason) == ("stolen:3", "not-owner")
        assert error.lease is lease
        # Python 3.10 cannot tell lockaspect's cancellation from the caller's, so a nested
        # block or call may end with LockLost first, which the outer block chains
        cause = error.__cause__
        while isinstance(cause, LockLost):
            assert (cause.reason, cause.lease) == ("not-owner", lease)
            cause = cause.__cause__
        assert isinstance(cause, asyncio.CancelledError)
        if PY311:
            assert isinstance(error.__cause__, asyncio.CancelledError)
        assert reached == ["afterwards"]
        if PY311:
            assert cancelling == 0
        hook.wait()
        assert len(hook.calls) == 1
        assert client.stats().held == 0

    @pytest.mark.parametrize("form", ["decorator", "async-with"])
    def test_fixed_lease_outlived_by_the_body_is_lost(self, client: LockClient, hook: LostHook, form: str) -> None:
        """A fixed lease is never renewed: a body that outlives it is cancelled and ends with LockLost "expired"."""

        @distributed_lock(key="fixed", client=client, lease=0.3, on_lost=hook)
        async def body() -> None:
            await forever()

        async def main() -> None:
            if form == "decorator":
                await body()
            else:
                async with client.lock("fixed", lease=0.3, on_lost=hook):
                    await forever()

        with pytest.raises(LockLost) as info:
            run(main())
        assert info.value.reason == "expired"
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        hook.wait()
        assert len(hook.calls) == 1
        assert client.stats().renewals == 0

    @pytest.mark.slow
    def test_a_blocked_loop_keeps_its_lease(self, client: LockClient, other: LockClient, raw: Any) -> None:
        """A loop blocked past the lease is a busy process, not a dead one: the watchdog thread renews its lease,
        nobody else can take the lock meanwhile, and the body goes on when the loop runs again."""
        resumed: list[str] = []
        lock_key = client.backend.lock_key("blocked")

        @distributed_lock(key="blocked", client=client)
        async def body() -> None:
            lease = current_lease()
            assert lease is not None
            renewals = client.stats().renewals
            deadline = time.monotonic() + 3 * LEASE
            while time.monotonic() < deadline:  # synchronous calls that block the event loop
                time.sleep(0.05)
                with pytest.raises(LockNotAcquired), other.lock("blocked"):
                    pass
            assert client.stats().renewals > renewals
            assert not lease.lost
            await asyncio.sleep(0)
            resumed.append("after the blocking calls")

        run(body())
        assert resumed == ["after the blocking calls"]
        assert not raw.exists(lock_key)
        assert not raw.exists(client.backend.lock_key("blocked"))

    def test_reentering_a_lease_the_store_lost_raises_lock_lost(self, plain: LockClient, raw: Any) -> None:
        """A nested locked call whose re-entry the store refuses raises LockLost "not-owner" and its body never runs."""
        ran: list[str] = []

        @distributed_lock(key="gone", client=plain)
        async def inner() -> None:
            ran.append("inner")

        async def hold() -> None:
            async with plain.lock("gone", lease=30):
                raw.delete(plain.backend.lock_key("gone"))
                await inner()

        async def main() -> LockLost:
            with pytest.raises(LockLost) as info:
                await hold()
            return info.value

        error = run(main())
        assert error.reason == "not-owner"
        assert isinstance(error.__cause__, LockLost)
        assert error.__cause__.reason == "not-owner"
        assert ran == []


class TestCancellation:
    def test_caller_cancelled_while_waiting_for_a_busy_key_leaves_nothing(
        self, client: LockClient, other: LockClient, raw: Any, namespace: str, owner_value: Any
    ) -> None:
        """A caller cancelled while it waits for a busy key takes nothing, registers nothing, leaves its slot and
        the lock's waiter queue."""
        queue = client.backend.queue_key("busy")
        ran: list[str] = []

        @distributed_lock(key="busy", client=client, wait=None)
        async def work() -> None:
            ran.append("body")

        async def main() -> None:
            waiting = asyncio.create_task(work())
            waiter_id = client._async.state().store.notifier().waiter_id
            await until(lambda: raw.lrange(queue, 0, -1) == [waiter_id.encode()], what="the waiter to queue")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert client._async.state().slots == {}

        with other.lock("busy") as holder:
            run(main())
            assert raw.hgetall(client.backend.lock_key("busy"))[holder.token.encode()] == owner_value
            assert raw.exists(queue) == 0, "the cancelled waiter must leave the queue"
        assert ran == []
        assert (client.stats().acquired, client.stats().not_acquired) == (0, 0)
        assert_nothing_left(client, raw, namespace)

    @pytest.mark.skipif(
        not PY311, reason="Python 3.10 has no Task.cancelling(): a cancellation redis-py's wait_for swallowed is lost"
    )
    def test_wait_for_timeout_on_a_busy_key_is_honoured_and_leaves_nothing(
        self, client: LockClient, other: LockClient, raw: Any, namespace: str
    ) -> None:
        """``asyncio.wait_for`` running out while a call waits forever for a busy key raises TimeoutError (also when
        the cancellation lands on a fresh loop's connection handshake) and leaves nothing behind."""

        @distributed_lock(key="busy", client=client, wait=None)
        async def work() -> None:
            raise AssertionError("the body must not run")

        async def attempt(timeout: float) -> BaseException | None:
            call = asyncio.ensure_future(asyncio.wait_for(work(), timeout))
            await asyncio.wait({call}, timeout=10)  # a hang detector, not a speed expectation
            if call.done():
                return call.exception()
            while not call.done():  # clean up, then fail below
                call.cancel()
                await asyncio.wait({call}, timeout=1)
            return None

        timeouts = [0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05]
        with other.lock("busy"):
            # a fresh loop per attempt: each cancellation may land on a new connection's handshake
            outcomes = [run(attempt(timeouts[i % len(timeouts)])) for i in range(64)]
        assert [type(outcome).__name__ for outcome in outcomes] == ["TimeoutError"] * 64
        assert client.stats().acquired == 0
        assert_nothing_left(client, raw, namespace)

    def test_cancelled_after_the_acquire_ran_in_the_store_releases_it(
        self, plain: LockClient, raw: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A caller cancelled after its acquire ran in the store, but before it read the reply, releases the key."""
        lock_key = plain.backend.lock_key("half")
        held = HeldReply(monkeypatch)
        entered: list[str] = []

        async def main() -> None:
            async with plain.lock("warm-up"):  # the loop's connection exists: no handshake to hold
                pass
            held.arm()

            async def enter() -> None:
                async with plain.lock("half"):
                    entered.append("block")

            task = asyncio.create_task(enter())
            await held.sent.wait()
            await until(lambda: raw.exists(lock_key), what="the acquire to run in the store")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: not raw.exists(lock_key), what="the discarding release")

        run(main())
        assert entered == []
        assert plain.stats().acquired == 1  # the warm-up; the cancelled one was never a lease
        assert_nothing_left(plain, raw, namespace)

    def test_cancelled_while_reentering_gives_the_added_hold_back(
        self, plain: LockClient, raw: Any, monkeypatch: pytest.MonkeyPatch, owner_value: Any
    ) -> None:
        """A re-entry cancelled while its check is in flight gives its hold back; the outer hold stays right (the store
        keeps one hold per owner: re-entries are counted by the client, so nothing changes there)."""
        lock_key = plain.backend.lock_key("re")
        held = HeldReply(monkeypatch)
        entered: list[str] = []

        async def main() -> tuple[bytes | None, bytes | None]:
            async with plain.lock("warm-up"), plain.lock("warm-up"):  # the scripts are loaded
                pass
            async with plain.lock("re") as outer:
                token = outer.token

                async def reenter() -> None:
                    async with plain.lock("re"):
                        entered.append("inner")

                held.arm()
                task = asyncio.create_task(reenter())  # inherits the block's hold
                await held.sent.wait()
                assert outer._holds == 2  # counted before the round trip
                task.cancel()  # while its re-entry's reply is held back
                held.open()
                with pytest.raises(asyncio.CancelledError):
                    await task
                during = raw.hget(lock_key, token)
                assert outer._holds == 1
                outer.check()
            return during, raw.hget(lock_key, token)

        during, after = run(main())
        assert during == owner_value
        assert after is None
        assert entered == []
        assert raw.exists(lock_key) == 0

    @pytest.mark.parametrize("form", ["decorator", "async-with"])
    def test_cancelled_body_still_releases_after_its_cleanup(
        self, client: LockClient, raw: Any, namespace: str, form: str
    ) -> None:
        """Cancelling the caller cancels the body, whose cleanup still runs under the lock; then the key is released."""
        lock_key = client.backend.lock_key("cancelled")
        cleanup_saw: list[int] = []

        async def body(started: asyncio.Event) -> None:
            started.set()
            try:
                await forever()
            finally:
                await asyncio.sleep(0)
                cleanup_saw.append(raw.exists(lock_key))

        @distributed_lock(key="cancelled", client=client)
        async def decorated(started: asyncio.Event) -> None:
            await body(started)

        async def with_block(started: asyncio.Event) -> None:
            async with client.lock("cancelled"):
                await body(started)

        async def main() -> None:
            started = asyncio.Event()
            task = asyncio.create_task((decorated if form == "decorator" else with_block)(started))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run(main())
        assert cleanup_saw == [1]
        stats = client.stats()
        assert (stats.acquired, stats.released, stats.lost) == (1, 1, 0)
        assert_nothing_left(client, raw, namespace)

    @pytest.mark.parametrize("form", ["decorator", "async-with"])
    def test_release_is_shielded_from_the_callers_cancellation(
        self, plain: LockClient, raw: Any, namespace: str, form: str
    ) -> None:
        """A caller cancelled while its release is under way stops waiting at once, and the release still completes."""
        lock_key = plain.backend.lock_key("shielded")

        @distributed_lock(key="shielded", client=plain)
        async def decorated() -> None:
            return None

        async def with_block() -> None:
            async with plain.lock("shielded"):
                pass

        async def main() -> None:
            backend = plain._async.state().store
            real = backend.release
            releasing, proceed = asyncio.Event(), asyncio.Event()

            async def release(key: str, token: str, fair: bool = False) -> Any:
                releasing.set()
                await proceed.wait()
                return await real(key, token, fair)

            backend.release = release
            task = asyncio.create_task(decorated() if form == "decorator" else with_block())
            await releasing.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the caller is gone, its release has not been sent yet
            assert raw.exists(lock_key) == 1
            proceed.set()
            await until(lambda: not raw.exists(lock_key), what="the shielded release")
            await until(lambda: not plain._async.state().tasks, what="the release task to finish")

        run(main())
        assert plain.stats().released == 1
        assert_nothing_left(plain, raw, namespace)

    def test_storm_of_wait_for_timeouts_leaves_nothing_behind(
        self, plain: LockClient, raw: Any, namespace: str
    ) -> None:
        """Hundreds of locked calls under ``asyncio.wait_for`` with random tiny timeouts, over a few keys, never
        overlap on a key and leave no lock in the store, no lease held and nothing on the timer."""
        keys = ["a", "b", "c"]
        rng = random.Random(20240607)
        inside = dict.fromkeys(keys, 0)
        overlaps: list[str] = []

        async def section(k: str, pause: float) -> None:
            inside[k] += 1
            if inside[k] > 1:
                overlaps.append(k)
            try:
                await asyncio.sleep(pause)
            finally:
                inside[k] -= 1

        @distributed_lock(key="storm:<k>", client=plain, wait=None)
        async def decorated(k: str, pause: float) -> str:
            await section(k, pause)
            return "done"

        async def block(k: str, pause: float) -> str:
            async with plain.lock(f"storm:{k}", wait=None):
                await section(k, pause)
            return "done"

        async def nested(k: str, pause: float) -> str:
            async with plain.lock(f"storm:{k}", wait=None):
                await asyncio.sleep(0)
                return await decorated(k, pause)  # re-enters

        forms = [decorated, block, nested]

        async def one() -> str:
            k = rng.choice(keys)
            form = rng.choice(forms)
            pause = rng.choice([0.0, rng.uniform(0, 0.003)])
            timeout = rng.choice([0.0, rng.uniform(0, 0.001), rng.uniform(0, 0.005), rng.uniform(0, 0.03), None])
            try:
                return await asyncio.wait_for(form(k, pause), timeout)
            except asyncio.TimeoutError:
                return "timeout"

        async def main() -> collections.Counter[str]:
            outcomes = collections.Counter(await asyncio.gather(*(one() for _ in range(400))))
            state = plain._async.state()
            await until(lambda: not state.tasks, what="shielded releases and discards to finish")
            assert state.slots == {}
            return outcomes

        outcomes = run(main())
        assert set(outcomes) == {"done", "timeout"}, outcomes
        assert overlaps == []
        assert inside == dict.fromkeys(keys, 0)
        stats = plain.stats()
        assert stats.lost == 0
        assert stats.released == stats.acquired
        assert_nothing_left(plain, raw, namespace)


class TestSyncAndAsyncTogether:
    def test_sync_thread_and_async_tasks_exclude_each_other(
        self, plain: LockClient, raw: Any, namespace: str, threads: list[threading.Thread]
    ) -> None:
        """One client: a thread's ``with client.lock()`` and tasks' ``async with`` on one key never overlap."""
        counter = {"value": 0}
        sequence = itertools.count()
        intervals: list[tuple[int, int]] = []
        each = 10
        go = threading.Event()

        def sync_side() -> None:
            assert go.wait(30)
            for _ in range(each):
                with plain.lock("mixed", wait=None):
                    start = next(sequence)
                    value = counter["value"]
                    time.sleep(0.001)  # part of the workload: widens the race window
                    counter["value"] = value + 1
                    intervals.append((start, next(sequence)))

        async def async_side() -> None:
            async def one() -> None:
                for _ in range(each):
                    async with plain.lock("mixed", wait=None):
                        start = next(sequence)
                        value = counter["value"]
                        await asyncio.sleep(0.001)
                        counter["value"] = value + 1
                        intervals.append((start, next(sequence)))

            go.set()
            await asyncio.gather(one(), one())

        thread = threading.Thread(target=sync_side, name="sync-side")
        thread.start()
        threads.append(thread)
        run(async_side())
        thread.join(60)
        assert counter["value"] == 3 * each
        assert disjoint(intervals)
        stats = plain.stats()
        assert (stats.acquired, stats.released, stats.lost) == (3 * each, 3 * each, 0)
        assert_nothing_left(plain, raw, namespace)

    def test_async_holder_and_sync_waiter_hand_over(
        self, plain: LockClient, raw: Any, threads: list[threading.Thread]
    ) -> None:
        """A thread finds a key held by a task busy, and with ``wait=`` queues and gets it once the task releases."""
        queue = plain.backend.queue_key("handover")
        notifier = plain.backend.notifier()
        assert notifier is not None
        queued = [notifier.waiter_id.encode()]  # the sync waiter queues under the client's own notifier
        results: dict[str, Any] = {}

        def sync_waiter(started: threading.Event) -> None:
            try:
                with plain.lock("handover"):
                    results["unexpected"] = True
            except LockNotAcquired as exc:
                results["busy"] = exc
            started.set()
            with plain.lock("handover", wait=30) as lease:
                results["fence"] = lease.fencing_token

        async def main() -> int:
            started = threading.Event()
            async with plain.lock("handover") as lease:
                thread = threading.Thread(target=sync_waiter, args=(started,), name="sync-waiter")
                thread.start()
                threads.append(thread)
                await until(started.is_set, what="the thread's first attempt")
                await until(lambda: raw.lrange(queue, 0, -1) == queued, what="the thread to queue")
            await until(lambda: "fence" in results, what="the thread to get the lock")
            return lease.fencing_token

        fence = run(main())
        assert "unexpected" not in results
        assert results["busy"].key == "handover"
        assert results["fence"] > fence
        assert raw.exists(queue) == 0

    def test_each_event_loop_gets_its_own_connections_and_they_exclude_each_other(
        self, plain: LockClient, raw: Any, namespace: str, threads: list[threading.Thread]
    ) -> None:
        """Two threads each running ``asyncio.run`` get separate backends and pools, and serialise on one key."""
        counter = {"value": 0}
        sequence = itertools.count()
        intervals: list[tuple[int, int]] = []
        states: dict[int, Any] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        async def worker(loop_id: int) -> None:
            async with plain.lock(f"warm:{loop_id}"):
                states[loop_id] = (plain._async.state(), asyncio.get_running_loop())
            barrier.wait(30)
            for _ in range(10):
                async with plain.lock("loops", wait=None):
                    start = next(sequence)
                    value = counter["value"]
                    await asyncio.sleep(0.001)
                    counter["value"] = value + 1
                    intervals.append((start, next(sequence)))

        def loop_thread(loop_id: int) -> None:
            try:
                run(worker(loop_id))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                barrier.abort()

        for loop_id in (0, 1):
            thread = threading.Thread(target=loop_thread, args=(loop_id,), name=f"loop-{loop_id}")
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(60)
        assert errors == []
        (state0, loop0), (state1, loop1) = states[0], states[1]
        assert loop0 is not loop1
        assert (state0.loop, state1.loop) == (loop0, loop1)
        assert state0.store is not state1.store
        assert state0.store.redis.connection_pool is not state1.store.redis.connection_pool
        assert counter["value"] == 20
        assert disjoint(intervals)
        assert_nothing_left(plain, raw, namespace)


class TestLastHoldReleasedByTheOtherEngine:
    def test_thread_releasing_an_async_lease_while_its_loop_renews_it(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, owner_value: Any
    ) -> None:
        """A thread that shares an async lease (``asyncio.to_thread``) and releases its last hold while the loop's
        renewal is in flight releases the key, neither waiting on the loop nor warning."""
        client = make_client(url=fresh_server.url, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)
        fresh_raw = fresh_server.redis()
        lock_key = client.backend.lock_key("shared")
        entered, leave = threading.Event(), threading.Event()
        shared: list[Lease] = []

        def sync_part() -> None:
            with client.lock("shared") as lease:  # re-enters: to_thread copies the context
                shared.append(lease)
                entered.set()
                assert leave.wait(30)

        @distributed_lock(key="shared", client=client)
        async def body() -> None:
            await asyncio.to_thread(sync_part)

        async def main() -> None:
            task = asyncio.create_task(body())
            await until(entered.is_set, what="the thread to re-enter")
            task.cancel()  # the body ends; the thread keeps running with the last hold
            with pytest.raises(asyncio.CancelledError):
                await task
            [lease] = shared
            assert fresh_raw.hget(lock_key, lease.token) == owner_value
            trips = client.stats().renewal_round_trips
            fresh_server.pause()
            try:
                await until(lambda: client.stats().renewal_round_trips > trips, what="the loop's renewal in flight")
                leave.set()
                # The release goes out at once: it waits for no renewal round trip.
                await until(lambda: lease._record.releasing_since is not None, what="the thread's release to start")
            finally:
                fresh_server.resume()
            await until(lambda: not fresh_raw.exists(lock_key), what="the thread's release")

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run(main())
                gc.collect()
            assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
            stats = client.stats()
            assert (stats.acquired, stats.reentered, stats.released, stats.held) == (1, 1, 1, 0)
        finally:
            fresh_raw.close()

    def test_task_releasing_a_thread_lease_while_the_watchdog_renews_it(
        self,
        make_client: Callable[..., LockClient],
        fresh_server: LockServer,
        threads: list[threading.Thread],
        owner_value: Any,
    ) -> None:
        """A task scheduled from a locked ``with`` block (``run_coroutine_threadsafe`` copies the context) shares the
        hold; when it releases the last hold while the watchdog thread's renewal is in flight, the key is released."""
        client = make_client(url=fresh_server.url, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)
        fresh_raw = fresh_server.redis()
        lock_key = client.backend.lock_key("shared")
        loops: list[asyncio.AbstractEventLoop] = []
        stop, entered, leave = threading.Event(), threading.Event(), threading.Event()

        async def serve() -> None:
            loops.append(asyncio.get_running_loop())
            await until(stop.is_set, timeout=60, what="the test to finish")

        loop_thread = threading.Thread(target=run, args=(serve(),), name="background-loop")
        loop_thread.start()
        threads.append(loop_thread)

        @distributed_lock(key="shared", client=client)
        async def inner() -> Lease | None:
            entered.set()
            await until(leave.is_set, timeout=30, what="the test to let go")
            return current_lease()

        try:
            wait_for(lambda: loops, what="the background loop")
            with client.lock("shared") as lease:
                future = asyncio.run_coroutine_threadsafe(inner(), loops[0])
                assert entered.wait(30)
                assert fresh_raw.hget(lock_key, lease.token) == owner_value  # re-entries are counted by the client
            assert fresh_raw.hget(lock_key, lease.token) == owner_value  # the task holds the last hold
            trips = client.stats().renewal_round_trips
            fresh_server.pause()
            try:
                wait_for(lambda: client.stats().renewal_round_trips > trips, what="the watchdog's renewal in flight")
                leave.set()
                # The release goes out at once: it waits for no renewal round trip.
                wait_for(lambda: lease._record.releasing_since is not None, what="the task's release to start")
            finally:
                fresh_server.resume()
            assert future.result(timeout=30) is lease
            wait_for(lambda: not fresh_raw.exists(lock_key), what="the task's release")
            stats = client.stats()
            assert (stats.acquired, stats.reentered, stats.released, stats.held) == (1, 1, 1, 0)
        finally:
            leave.set()
            stop.set()
            fresh_raw.close()


def _connections(raw: Any, name: str) -> int:
    return sum(1 for entry in raw.client_list() if entry.get("name") == name)


class TestConnectionsAndShutdown:
    def test_aclose_closes_the_loops_connections_and_the_client(
        self, make_client: Callable[..., LockClient], raw: Any
    ) -> None:
        """``await client.aclose()`` closes the running loop's connections (lock and subscriber) and the client."""
        name = f"la-{uuid.uuid4().hex[:8]}"
        client = make_client(client_name=name)

        async def main() -> int:
            async with client.lock("held"):
                # a waiter for a busy key opens the loop's subscriber connection too
                with pytest.raises(LockNotAcquired):
                    async with client.lock("busy", wait=0.05):
                        pass
            open_before = _connections(raw, name)
            await client.aclose()
            await until(lambda: _connections(raw, name) == 0, what="the server to see the connections closed")
            with pytest.raises(ConfigurationError, match="closed"):
                async with client.lock("held"):
                    pass
            return open_before

        with make_client().lock("busy"):
            open_before = run(main())
        assert open_before >= 2
        assert client.closed
        assert client.threads() == []

    def test_asyncio_run_without_aclose_leaks_nothing(
        self, make_client: Callable[..., LockClient], raw: Any, other: LockClient
    ) -> None:
        """Loops ended by ``asyncio.run`` without ``aclose`` close their connections, warn nothing, and are freed."""
        name = f"la-{uuid.uuid4().hex[:8]}"
        client = make_client(client_name=name)
        loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

        async def main(i: int) -> int:
            loops.append(weakref.ref(asyncio.get_running_loop()))
            async with client.lock(f"k:{i}"):
                pass
            with pytest.raises(LockNotAcquired):
                async with client.lock("busy", wait=0.05):  # opens the loop's subscriber connection
                    pass
            return _connections(raw, name)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with other.lock("busy"):
                during = [run(main(i)) for i in range(3)]
                wait_for(lambda: _connections(raw, name) == 0, what="the server to see every connection closed")
            # a released lease's cancelled timeouts (which refer to its loop) leave the wheel at its next tick
            wait_for(lambda: len(client._engine.timer) == 0, what="the timer to empty")
            gc.collect()
            gc.collect()  # what the first pass's finalizers left in reference cycles
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
        assert all(count >= 2 for count in during)
        assert [ref() for ref in loops] == [None, None, None]
        assert not client.closed

        async def again() -> Lease:
            async with client.lock("again") as lease:
                return lease

        assert run(again()).key == "again"  # the client still serves a new loop

    @pytest.mark.parametrize("renewal", ["due-after-the-loop-closed", "in-flight-when-the-loop-closed"])
    def test_loop_closing_with_a_lease_held_drops_its_renewal_cleanly(
        self,
        make_client: Callable[..., LockClient],
        fresh_server: LockServer,
        caplog: pytest.LogCaptureFixture,
        renewal: str,
    ) -> None:
        """A loop that ends while one of its leases is still held (a block entered, never exited): the hold is
        abandoned, and the client releases it (a WARNING, no error): an empty timer, and the key gone."""
        caplog.set_level(logging.DEBUG)
        client = make_client(url=fresh_server.url, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)
        fresh_raw = fresh_server.redis()
        lock_key = client.backend.lock_key("orphan")
        paused = False

        async def main() -> Lease:
            nonlocal paused
            block = client.lock("orphan")
            lease = await block.__aenter__()  # never exited: the loop ends with the lease held
            await until(lambda: client.stats().renewals >= 1, what="a first renewal")
            if renewal == "in-flight-when-the-loop-closed":
                fresh_server.pause()
                paused = True
                trips = client.stats().renewal_round_trips
                await until(
                    lambda: client.stats().renewal_round_trips > trips, what="a renewal sent to the paused store"
                )
            return lease

        try:
            lease = run(main())
        finally:
            if paused:
                fresh_server.resume()
        try:
            wait_for(lambda: not fresh_raw.exists(lock_key), timeout=3 * LEASE + 5, what="the key to be released")
            wait_for(lambda: len(client._engine.timer) == 0, what="the timer to empty")
            assert not lease.held
            assert client.stats().held == 0
            assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
            abandoned = any("abandoned" in r.getMessage() for r in caplog.records)
            # released by the sweep; or, when the interrupted round trip outlasted the lease, lost at its end
            assert abandoned or lease.lost_reason == "expired"
        finally:
            fresh_raw.close()
