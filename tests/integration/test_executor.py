"""Where the body runs: inline by default, or on a ``concurrent.futures`` executor with the
caller's context, re-entry across threads, and the lost-lease signal while the body runs."""

from __future__ import annotations

import contextvars
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lockaspect import LockClient, LockLost, LockNotAcquired, current_lease, distributed_lock

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")


@pytest.fixture
def plain(make_client: Callable[..., LockClient]) -> LockClient:
    """A client with the library's defaults (30 s watchdog lease, 100 ms tick)."""
    return make_client()


@pytest.fixture
def pools() -> Iterator[Callable[[str], ThreadPoolExecutor]]:
    """Single-thread pools named by prefix; shut down (waiting for their bodies) after the test."""
    made: list[ThreadPoolExecutor] = []

    def make(prefix: str) -> ThreadPoolExecutor:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=prefix)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.shutdown(wait=True)


def drain(pool: ThreadPoolExecutor) -> None:
    """Return once everything submitted to a one-thread pool before, callbacks included, is done."""
    pool.submit(lambda: None).result(timeout=60)


class TestInline:
    def test_default_runs_the_body_in_the_callers_thread(self, plain: LockClient) -> None:
        """Without an executor the body runs in the caller's thread and sees its thread-local state."""
        local = threading.local()
        local.transaction = "tx-1"

        @distributed_lock(key="inline:<n>", client=plain)
        def work(n: int) -> tuple[int, str]:
            return threading.get_ident(), local.transaction

        assert work(1) == (threading.get_ident(), "tx-1")

    def test_explicit_inline_overrides_the_clients_default_executor(
        self, make_client: Callable[..., LockClient], pools: Callable[[str], ThreadPoolExecutor]
    ) -> None:
        """``executor="inline"`` runs the body in the caller's thread even when the client has a default executor."""
        client = make_client(executor=pools("default"))

        @distributed_lock(key="inline:<n>", client=client, executor="inline")
        def work(n: int) -> int:
            return threading.get_ident()

        assert work(1) == threading.get_ident()

    def test_keyboard_interrupt_propagates_and_the_lock_is_released(self, plain: LockClient, raw: Any) -> None:
        """A ``KeyboardInterrupt`` raised by an inline body reaches the caller and the lock is released first."""
        lock_key = plain.backend.lock_key("inline:1")

        @distributed_lock(key="inline:<n>", client=plain)
        def work(n: int) -> None:
            assert raw.exists(lock_key) == 1
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            work(1)
        assert raw.exists(lock_key) == 0
        assert plain.stats().held == 0
        assert plain.stats().released == 1

    def test_body_exception_propagates_and_the_lock_is_released(self, plain: LockClient, raw: Any) -> None:
        """An exception from the body reaches the caller unchanged and the lock is released."""
        error = ValueError("out of stock")

        @distributed_lock(key="inline:<n>", client=plain)
        def work(n: int) -> None:
            raise error

        with pytest.raises(ValueError, match="out of stock") as info:
            work(1)
        assert info.value is error
        assert raw.exists(plain.backend.lock_key("inline:1")) == 0


class TestThreadPoolExecutor:
    def test_body_runs_in_a_pool_thread_with_the_callers_context(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any
    ) -> None:
        """On an executor the body runs in a pool thread, sees the caller's contextvars and its own lease."""
        pool = pools("body")

        @distributed_lock(key="pool:<n>", client=plain, executor=pool)
        def work(n: int) -> tuple[int, str, str, Any, int]:
            lease = current_lease()
            assert lease is not None
            exists = raw.exists(plain.backend.lock_key(lease.key))
            return threading.get_ident(), threading.current_thread().name, REQUEST_ID.get(), lease, exists

        token = REQUEST_ID.set("req-42")
        try:
            ident, name, request_id, lease, exists = work(3)
        finally:
            REQUEST_ID.reset(token)
        assert ident != threading.get_ident()
        assert name.startswith("body")
        assert request_id == "req-42"
        assert lease.key == "pool:3"
        assert lease.fencing_token >= 1
        assert exists == 1
        assert current_lease() is None
        assert raw.exists(plain.backend.lock_key("pool:3")) == 0

    def test_body_exception_propagates_from_the_pool(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any
    ) -> None:
        """An exception raised by the body in a pool thread reaches the caller and the lock is released."""

        @distributed_lock(key="pool:<n>", client=plain, executor=pools("body"))
        def work(n: int) -> None:
            raise LookupError("no such order")

        with pytest.raises(LookupError, match="no such order"):
            work(1)
        assert raw.exists(plain.backend.lock_key("pool:1")) == 0

    def test_base_exception_from_the_pool_propagates(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any
    ) -> None:
        """A ``SystemExit`` raised by the body in a pool thread reaches the caller and the lock is released."""

        @distributed_lock(key="pool:<n>", client=plain, executor=pools("body"))
        def work(n: int) -> None:
            raise SystemExit(3)

        with pytest.raises(SystemExit) as info:
            work(2)
        assert info.value.code == 3
        assert raw.exists(plain.backend.lock_key("pool:2")) == 0
        assert plain.stats().held == 0

    def test_nested_call_in_the_pool_thread_reenters(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any, owner_value: Any
    ) -> None:
        """A nested call on the same key inside the pool thread re-enters with the same fencing token."""
        lock_key = plain.backend.lock_key("acct:5")

        @distributed_lock(key="acct:<n>", client=plain)
        def inner(n: int) -> tuple[Any, dict[bytes, bytes], int]:
            return current_lease(), raw.hgetall(lock_key), threading.get_ident()

        @distributed_lock(key="acct:<n>", client=plain, executor=pools("outer"))
        def outer(n: int) -> tuple[Any, tuple[Any, dict[bytes, bytes], int], int]:
            return current_lease(), inner(n), threading.get_ident()

        lease, (inner_lease, during, inner_ident), outer_ident = outer(5)
        assert inner_ident == outer_ident != threading.get_ident()
        assert inner_lease is lease
        assert during == {lease.token.encode(): owner_value, b"fence": str(lease.fencing_token).encode()}
        assert plain.stats().reentered == 1
        assert raw.exists(lock_key) == 0

    def test_nested_call_on_a_second_executor_reenters(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any, owner_value: Any
    ) -> None:
        """A nested call on the same key run by a second executor still re-enters with the same fencing token."""
        lock_key = plain.backend.lock_key("acct:6")

        @distributed_lock(key="acct:<n>", client=plain, executor=pools("inner"))
        def inner(n: int) -> tuple[Any, dict[bytes, bytes], str]:
            return current_lease(), raw.hgetall(lock_key), threading.current_thread().name

        @distributed_lock(key="acct:<n>", client=plain, executor=pools("outer"))
        def outer(n: int) -> tuple[Any, tuple[Any, dict[bytes, bytes], str], str]:
            return current_lease(), inner(n), threading.current_thread().name

        lease, (inner_lease, during, inner_thread), outer_thread = outer(6)
        assert outer_thread.startswith("outer")
        assert inner_thread.startswith("inner")
        assert inner_lease is lease
        assert inner_lease.fencing_token == lease.fencing_token
        assert during == {lease.token.encode(): owner_value, b"fence": str(lease.fencing_token).encode()}
        assert raw.exists(lock_key) == 0

    def test_clients_default_executor_is_used_when_the_decorator_sets_none(
        self, make_client: Callable[..., LockClient], pools: Callable[[str], ThreadPoolExecutor]
    ) -> None:
        """A client built with ``executor=`` runs the bodies of decorators that name no executor there."""
        client = make_client(executor=pools("client-default"))

        @distributed_lock(key="pool:<n>", client=client)
        def work(n: int) -> str:
            return threading.current_thread().name

        assert work(1).startswith("client-default")

    def test_lost_lease_raises_at_once_while_the_body_keeps_running(
        self, client: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any
    ) -> None:
        """A stolen key makes the caller raise ``LockLost`` while the body runs; the hold ends after the body."""
        pool = pools("body")
        lock_key = client.backend.lock_key("steal:1")
        started, proceed, lost_hook = threading.Event(), threading.Event(), threading.Event()
        body_saw: list[BaseException | None] = []
        hook_calls: list[Any] = []

        def on_lost(lease: Any) -> None:
            hook_calls.append(lease)
            lost_hook.set()

        @distributed_lock(key="steal:<n>", client=client, executor=pool, delay_weight=0.5, on_lost=on_lost)
        def work(n: int) -> str:
            lease = current_lease()
            assert lease is not None
            started.set()
            assert proceed.wait(timeout=60)
            try:
                lease.check()
            except LockLost as exc:
                body_saw.append(exc)
            else:
                body_saw.append(None)
            return "finished"

        def steal() -> None:
            assert started.wait(timeout=30)
            with raw.pipeline(transaction=True) as pipe:
                pipe.delete(lock_key)
                pipe.hset(lock_key, "intruder", 1)
                pipe.pexpire(lock_key, 60_000)
                pipe.execute()

        intruder = threading.Thread(target=steal)
        intruder.start()
        try:
            with pytest.raises(LockLost) as info:
                work(1)
        finally:
            intruder.join()
            still_running = not proceed.is_set() and body_saw == []
            held_meanwhile = client.stats().held
            proceed.set()
        assert still_running
        assert held_meanwhile == 1  # the hold ends with the body, not with the caller's wait
        assert info.value.reason == "not-owner"
        assert info.value.key == "steal:1"
        assert not info.value.has_result
        assert info.value.exception is None
        assert lost_hook.wait(timeout=30)  # on the watchdog thread, possibly just after the caller woke

        drain(pool)  # the body, and the release that follows it, are done
        [seen] = body_saw
        assert isinstance(seen, LockLost)
        assert client.stats().held == 0
        assert raw.hgetall(lock_key) == {b"intruder": b"1"}  # the intruder's lock is untouched
        assert hook_calls == [info.value.lease]

    @pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
    def test_interrupted_caller_leaves_the_lock_held_until_the_body_ends(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor], raw: Any
    ) -> None:
        """A caller interrupted while its body runs on an executor re-raises; the lock is held until the body ends."""
        pool = pools("body")
        lock_key = plain.backend.lock_key("ctrl-c:1")
        started, proceed = threading.Event(), threading.Event()
        main = threading.main_thread()
        assert threading.current_thread() is main

        @distributed_lock(key="ctrl-c:<n>", client=plain, executor=pool)
        def work(n: int) -> str:
            started.set()
            assert proceed.wait(timeout=60)
            return "finished"

        interrupted = threading.Event()

        def on_sigint(signum: int, frame: Any) -> None:
            if not interrupted.is_set():  # one KeyboardInterrupt, however many signals arrive
                interrupted.set()
                raise KeyboardInterrupt

        def interrupt() -> None:
            assert started.wait(timeout=30)
            # Signal the caller only while it is blocked waiting for the body's future. A
            # signal that lands just before the blocking call is only handled after it, so
            # repeat until the handler has run.
            while not interrupted.wait(0.01):
                if _waiting_for_body(main):
                    signal.pthread_kill(main.ident, signal.SIGINT)  # type: ignore[arg-type]

        previous = signal.signal(signal.SIGINT, on_sigint)
        interrupter = threading.Thread(target=interrupt)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                work(1)
            interrupter.join()
            held_meanwhile = raw.exists(lock_key)
        finally:
            interrupted.set()
            proceed.set()
            interrupter.join()
            signal.signal(signal.SIGINT, previous)
        assert held_meanwhile == 1
        drain(pool)
        assert raw.exists(lock_key) == 0
        assert plain.stats().held == 0

    def test_interrupt_during_submit_leaves_the_lock_held_until_the_body_ends(
        self, plain: LockClient, raw: Any
    ) -> None:
        """An interrupt that lands inside ``submit`` after the body was queued never lets the body run unlocked."""
        lock_key = plain.backend.lock_key("ctrl-c:2")
        started, proceed = threading.Event(), threading.Event()
        seen_by_body: list[int] = []
        pool = InterruptedSubmit(started)

        @distributed_lock(key="ctrl-c:<n>", client=plain, executor=pool)
        def work(n: int) -> str:
            started.set()
            assert proceed.wait(timeout=60)
            seen_by_body.append(raw.exists(lock_key))
            return "finished"

        try:
            with pytest.raises(KeyboardInterrupt):
                work(2)
            held_meanwhile = raw.exists(lock_key)
        finally:
            proceed.set()
            pool.shutdown(wait=True)
        assert held_meanwhile == 1
        assert seen_by_body == [1]
        assert raw.exists(lock_key) == 0
        assert plain.stats().held == 0

    def test_executor_that_refuses_the_body(self, plain: LockClient, raw: Any) -> None:
        """A shut-down executor raises its own error from ``submit``; the lock is released, the body never runs."""
        pool = ThreadPoolExecutor(max_workers=1)
        pool.shutdown()
        ran: list[int] = []

        @distributed_lock(key="refused:<n>", client=plain, executor=pool)
        def work(n: int) -> None:
            ran.append(n)

        with pytest.raises(RuntimeError, match="shutdown"):
            work(1)
        assert ran == []
        assert raw.exists(plain.backend.lock_key("refused:1")) == 0
        assert plain.stats().held == 0


class InterruptedSubmit(ThreadPoolExecutor):
    """A real one-thread pool whose ``submit`` is interrupted (as by Ctrl-C while it starts
    its worker thread) after the body was queued and has started."""

    def __init__(self, started: threading.Event) -> None:
        super().__init__(max_workers=1, thread_name_prefix="interrupted")
        self._body_started = started

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        super().submit(fn, *args, **kwargs)
        assert self._body_started.wait(timeout=30)
        raise KeyboardInterrupt


def _waiting_for_body(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in ``run_body``'s wait for the body's future."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    names = []
    while frame is not None and len(names) < 3:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    # Wakeup.wait <- run_body (not the Event.wait of a thread start in submit)
    return names[:2] == ["wait", "run_body"]


class TestIndependentThreads:
    def test_two_threads_on_one_key_serialise(self, plain: LockClient) -> None:
        """A second thread calling while the first holds the key gets ``LockNotAcquired``, and gets the lock after."""
        entered, proceed = threading.Event(), threading.Event()
        results: list[Any] = []

        @distributed_lock(key="shared:<n>", client=plain)
        def work(n: int, block: bool) -> int:
            if block:
                entered.set()
                assert proceed.wait(timeout=60)
            lease = current_lease()
            assert lease is not None
            return lease.fencing_token

        first = threading.Thread(target=lambda: results.append(work(1, True)))
        first.start()
        try:
            assert entered.wait(timeout=30)
            with pytest.raises(LockNotAcquired):
                work(1, False)
        finally:
            proceed.set()
            first.join()
        assert work(1, False) > results[0]

    def test_callers_on_one_executor_do_not_share_a_hold(
        self, plain: LockClient, pools: Callable[[str], ThreadPoolExecutor]
    ) -> None:
        """Two callers whose bodies run on the same kind of pool never share a hold: the second is refused."""
        entered, proceed = threading.Event(), threading.Event()
        first_pool, second_pool = pools("first"), pools("second")

        def body(n: int) -> str:
            entered.set()
            assert proceed.wait(timeout=60)
            return "done"

        first = distributed_lock(key="shared:<n>", client=plain, executor=first_pool)(body)
        second = distributed_lock(key="shared:<n>", client=plain, executor=second_pool)(body)
        results: list[str] = []
        caller = threading.Thread(target=lambda: results.append(first(2)))
        caller.start()
        try:
            assert entered.wait(timeout=30)
            with pytest.raises(LockNotAcquired):
                second(2)
        finally:
            proceed.set()
            caller.join()
        assert results == ["done"]

    def test_thread_started_inside_the_body_does_not_inherit_the_hold(self, plain: LockClient) -> None:
        """A plain thread started by the body begins with an empty context, so its call on the same key is refused."""
        outcome: list[BaseException | Any] = []

        @distributed_lock(key="spawn:<n>", client=plain)
        def child(n: int) -> str:
            return "child ran"

        @distributed_lock(key="spawn:<n>", client=plain)
        def parent(n: int) -> None:
            def attempt() -> None:
                outcome.append(current_lease())
                try:
                    outcome.append(child(n))
                except LockNotAcquired as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=attempt)
            thread.start()
            thread.join()

        parent(1)
        no_lease, error = outcome
        assert no_lease is None
        assert isinstance(error, LockNotAcquired)
        assert error.key == "spawn:1"


class FailingExecutor(ThreadPoolExecutor):
    """An executor whose own future fails without running the task, as one that pickles
    its tasks (like a process pool) would fail on an unpicklable callable."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        from concurrent.futures import Future

        future: Future[Any] = Future()
        future.set_exception(RuntimeError("cannot ship this task"))
        return future


class TestExecutorsThatCannotRunTheBody:
    def test_a_process_pool_is_refused_at_decoration(self, plain: LockClient) -> None:
        """A ProcessPoolExecutor is a TypeError when the decorator is applied (the lease lives here)."""
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=1)
        try:
            with pytest.raises(TypeError, match="ProcessPoolExecutor"):
                distributed_lock(key="pp:<n>", client=plain, executor=pool)
        finally:
            pool.shutdown()

    def test_an_executor_failing_the_task_fails_the_call_instead_of_hanging(self, plain: LockClient, raw: Any) -> None:
        """When the executor's future fails without running the body, the call raises that error and releases."""
        ran = []

        @distributed_lock(key="ship:<n>", client=plain, executor=FailingExecutor(max_workers=1))
        def work(n: int) -> None:
            ran.append(n)

        with pytest.raises(RuntimeError, match="cannot ship this task"):
            work(1)
        assert ran == []
        assert not raw.exists(plain.backend.lock_key("ship:1"))


class TestReleasedLease:
    def test_a_thread_sharing_the_context_after_the_call_is_not_protected(self, plain: LockClient, raw: Any) -> None:
        """A thread that shares a call's context and outlives it sees a released lease, not a held one."""
        after: dict[str, Any] = {}
        go = threading.Event()
        done = threading.Event()

        def outliving() -> None:
            go.wait(30)
            lease = current_lease()
            assert lease is not None
            after["held"] = lease.held
            with pytest.raises(LockLost) as excinfo:
                lease.check()
            after["reason"] = excinfo.value.reason
            # a nested lock here is a new acquisition, not a re-entry of the released lease
            with plain.lock("released:1") as fresh:
                after["fresh_token"] = fresh.token
            done.set()

        @distributed_lock(key="released:<n>", client=plain)
        def work(n: int) -> str:
            context = contextvars.copy_context()
            threading.Thread(target=context.run, args=(outliving,)).start()
            lease = current_lease()
            assert lease is not None
            return lease.token

        token = work(1)
        go.set()
        assert done.wait(30)
        assert after["held"] is False
        assert after["reason"] == "released"
        assert after["fresh_token"] != token
        assert not raw.exists(plain.backend.lock_key("released:1"))
