"""The watchdog against real servers and real processes: renewal past the lease, batched
renewal, a killed holder, stolen, expired and capped leases, a hung store, cancellation
before release, the thread budget and fork safety."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from lockaspect import Lease, LockClient, LockLost, LockNotAcquired, current_lease, distributed_lock
from lockaspect.backends.redis import RedisBackend, load_script
from lockaspect.testing import LockServer, ManualClock

#: The ``client`` fixture's watchdog lease, tick (seconds) and delay_weight; clients made
#: here use the same. First renewal at half the lease leaves 0.5 s of margin under load.
LEASE = 1.0
TICK = 0.02
DW = 0.5

FORK = multiprocessing.get_context("fork")

#: Python 3.12+ warns when a process with threads forks; these tests fork on purpose.
fork_warning = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until it is true; for states no event announces (counters, keys)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        threading.Event().wait(0.005)


def let_time_pass(seconds: float) -> None:
    """Let wall time pass, for tests whose subject is what happens (or not) as time passes."""
    threading.Event().wait(seconds)


def evalsha_calls(raw: Any) -> int:
    stats = raw.info("commandstats").get("cmdstat_evalsha")
    return int(stats["calls"]) if stats else 0


class LostHook:
    """An ``on_lost`` hook that records its calls and can be awaited."""

    def __init__(self) -> None:
        self.calls: list[Lease] = []
        self.threads: list[threading.Thread] = []
        self.fired = threading.Event()

    def __call__(self, lease: Lease) -> None:
        self.calls.append(lease)
        self.threads.append(threading.current_thread())
        self.fired.set()

    def wait(self, timeout: float = 10.0) -> None:
        assert self.fired.wait(timeout), f"on_lost was not called within {timeout}s"


@pytest.fixture
def hook() -> LostHook:
    return LostHook()


@pytest.fixture
def fresh_raw(fresh_server: LockServer) -> Iterator[Any]:
    client = fresh_server.redis()
    yield client
    client.close()


def _receive(connection: Connection, timeout: float = 15.0) -> Any:
    assert connection.poll(timeout), f"no message from the child within {timeout}s"
    return connection.recv()


# -- child processes (fork context: these run in the forked copy of the test process) ----


def _hold_until_killed(url: str, namespace: str, key: str, out: Connection) -> None:
    client = LockClient.from_url(url, namespace=namespace, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)
    with client.lock(key) as lease:
        # Tell the parent only once the watchdog has kept the lock past a renewal.
        wait_for(lambda: client.stats().renewals >= 1, what="the holder's first renewal")
        out.send((lease.fencing_token, lease.token))
        let_time_pass(60)  # SIGKILLed long before


def _fork() -> int:
    """``os.fork()``, without Python 3.12's warning about forking a process with threads."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _hold_and_fork(url: str, namespace: str, key: str, child_key: str, out: Connection, stop: Connection) -> None:
    try:
        client = LockClient.from_url(url, namespace=namespace, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)
        with client.lock(key) as lease:
            pid = _fork()
            if pid == 0:
                _forked_child(client, child_key, out, stop)
            out.send(("holder", pid, lease.fencing_token))
            let_time_pass(60)  # SIGKILLed long before
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
        out.send(("holder-error", repr(exc)))
    finally:
        os._exit(1)


def _forked_child(client: LockClient, key: str, out: Connection, stop: Connection) -> None:
    code = 1
    try:
        inherited = client.stats()
        with client.lock(key) as lease:
            wait_for(lambda: client.stats().renewals > inherited.renewals, what="the child's own renewal")
            out.send(("child", os.getpid(), lease.fencing_token, inherited.held))
            stop.poll(30)  # until the parent has taken the lock of the killed holder
            lease.check()
        out.send(("child-released", client.stats().released - inherited.released))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
        out.send(("child-error", repr(exc)))
    finally:
        os._exit(code)


class TestRenewal:
    @pytest.mark.slow
    def test_lock_outlives_its_lease_while_the_holder_renews(
        self, client: LockClient, raw: Any, owner_value: Any
    ) -> None:
        """A decorated call running for three leases keeps its lock, and releases it at the end."""
        lock_key = client.backend.lock_key("long:1")

        @distributed_lock(key="long:<n>", client=client)
        def long_job(n: int) -> str:
            lease = current_lease()
            assert lease is not None
            let_time_pass(3 * LEASE)
            assert raw.hget(lock_key, lease.token) == owner_value
            assert raw.pttl(lock_key) > 0
            lease.check()
            # Each renewal extends the lease by at most one lease from when it was sent,
            # so surviving 3 leases takes at least 3 renewals.
            assert client.stats().renewals >= 3
            return "done"

        assert long_job(1) == "done"
        assert not raw.exists(lock_key)
        stats = client.stats()
        assert (stats.released, stats.lost, stats.held) == (1, 0, 0)

    @pytest.mark.slow
    def test_leases_due_in_the_same_tick_are_renewed_in_one_round_trip(self, client: LockClient, raw: Any) -> None:
        """200 leases held at once are renewed in far fewer round trips than renewals."""
        with contextlib.ExitStack() as stack:
            leases = [stack.enter_context(client.lock(f"batch:{i}")) for i in range(200)]
            wait_for(lambda: client.stats().renewals >= 400, what="two renewals per lease")
            stats = client.stats()
            assert stats.renewal_failures == 0
            # 400 renewals need about 2 round trips per acquisition tick (a few ticks).
            assert stats.renewal_round_trips * 10 <= stats.renewals, stats
            assert not any(lease.lost for lease in leases)
            pipe = raw.pipeline(transaction=False)
            for lease in leases:
                pipe.hexists(client.backend.lock_key(lease.key), lease.token)
            assert all(pipe.execute())
        assert client.stats().released == 200

    def test_every_lease_due_in_one_tick_is_renewed_in_exactly_one_round_trip(
        self, lock_server: LockServer, namespace: str, raw: Any
    ) -> None:
        """300 leases that fall due together are renewed by one round trip of two chunked script calls."""
        # A manual clock makes "due in the same tick" exact; the store is real. It starts far
        # ahead of time.monotonic(), which Lease.lost compares against.
        clock = ManualClock(start=time.monotonic() + 3600)
        backend = RedisBackend.from_url(lock_server.url, namespace=namespace)
        client = LockClient(backend, watchdog_lease=LEASE, tick=TICK, delay_weight=DW, clock=clock)
        try:
            with contextlib.ExitStack() as stack:
                for i in range(300):
                    stack.enter_context(client.lock(f"due:{i}"))
                raw.script_load(load_script("renew.lua"))  # no NOSCRIPT retry to count below
                before, calls_before = client.stats(), evalsha_calls(raw)
                assert (before.renewals, before.renewal_round_trips) == (0, 0)

                clock.advance(DW * LEASE + TICK)
                wait_for(lambda: client.stats().renewals == 300, what="300 renewals")
                after = client.stats()
                assert after.renewal_round_trips == 1
                assert evalsha_calls(raw) - calls_before == 2  # ceil(300 / 256) in one pipeline
                assert (after.renewal_failures, after.lost) == (0, 0)
            assert client.stats().released == 300
        finally:
            client.close()

    @pytest.mark.slow
    @pytest.mark.parametrize("outcome", ["return", "raise", "interrupt"])
    def test_nothing_renews_a_key_after_its_call_returned(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, fresh_raw: Any, outcome: str
    ) -> None:
        """Once a call has returned, raised or been interrupted, its lease is never renewed again."""
        client = make_client(url=fresh_server.url, watchdog_lease=LEASE, tick=TICK, delay_weight=DW)

        @distributed_lock(key="job:<n>", client=client)
        def job(n: int) -> int:
            wait_for(lambda: client.stats().renewals >= 1, what="a renewal while the body runs")
            if outcome == "raise":
                raise ValueError("body failed")
            if outcome == "interrupt":
                raise KeyboardInterrupt
            return n

        expected: type[BaseException] | None = {"raise": ValueError, "interrupt": KeyboardInterrupt}.get(outcome)
        if expected is None:
            assert job(1) == 1
        else:
            with pytest.raises(expected):
                job(1)

        assert not fresh_raw.exists(client.backend.lock_key("job:1"))
        before, calls_before = client.stats(), evalsha_calls(fresh_raw)
        let_time_pass(1.5 * LEASE)  # a renewal that survived the call would be due by now
        after, calls_after = client.stats(), evalsha_calls(fresh_raw)
        assert (after.renewals, after.renewal_round_trips, after.renewal_failures) == (
            before.renewals,
            before.renewal_round_trips,
            before.renewal_failures,
        )
        assert calls_after == calls_before
        assert (after.released, after.held, after.lost) == (1, 0, 0)

    def test_at_most_two_library_threads_for_500_held_locks(self, client: LockClient) -> None:
        """Holding and renewing 500 locks costs the client two threads: the timer and the watchdog."""
        before = set(threading.enumerate())
        with contextlib.ExitStack() as stack:
            for i in range(500):
                stack.enter_context(client.lock(f"many:{i}"))
            wait_for(lambda: client.stats().renewals >= 500, what="a renewal of every lease")
            library = client.threads()
            started = set(threading.enumerate()) - before
            assert len(library) <= 2
            assert started <= set(library)
            assert client.stats().held == 500
        assert client.stats().held == 0


class TestKilledHolder:
    @pytest.mark.slow
    @fork_warning
    def test_lock_of_a_sigkilled_holder_frees_within_the_watchdog_lease(
        self, client: LockClient, lock_server: LockServer, namespace: str
    ) -> None:
        """After kill -9 of a process holding a renewed watchdog lock, another process gets it within the lease."""
        receiver, sender = FORK.Pipe(duplex=False)
        holder = FORK.Process(target=_hold_until_killed, args=(lock_server.url, namespace, "victim", sender))
        holder.start()
        try:
            fence, holder_token = _receive(receiver)
            with pytest.raises(LockNotAcquired), client.lock("victim"):
                pass
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(10)
            assert holder.exitcode == -signal.SIGKILL

            with client.lock("victim", wait=2 * LEASE) as lease:
                assert lease.fencing_token == fence + 1
                assert lease.token != holder_token
        finally:
            if holder.is_alive():
                holder.kill()
                holder.join()


class TestLostLease:
    def test_deleted_key_is_noticed_at_the_next_renewal(
        self, client: LockClient, raw: Any, hook: LostHook, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A lock deleted behind the holder's back flips the lease, fires on_lost once, logs and raises."""
        caplog.set_level(logging.WARNING, logger="lockaspect.watchdog")
        held: list[Lease] = []

        def hold_while_stolen() -> None:
            with client.lock("stolen:1", on_lost=hook) as lease:
                held.append(lease)
                assert not lease.lost
                raw.delete(client.backend.lock_key("stolen:1"))
                hook.wait()
                assert lease.lost
                assert lease.lost_reason == "not-owner"
                with pytest.raises(LockLost) as check_info:
                    lease.check()
                assert (check_info.value.key, check_info.value.reason) == ("stolen:1", "not-owner")

        with pytest.raises(LockLost) as exc_info:
            hold_while_stolen()
        [lease] = held
        assert exc_info.value.reason == "not-owner"
        assert exc_info.value.lease is lease
        assert hook.calls == [lease]
        assert hook.threads[0] is not threading.current_thread()
        warnings_logged = [
            r for r in caplog.records if r.name == "lockaspect.watchdog" and r.levelno == logging.WARNING
        ]
        assert len(warnings_logged) == 1
        assert "stolen:1" in warnings_logged[0].getMessage()
        assert "not-owner" in warnings_logged[0].getMessage()
        assert client.stats().lost == 1

    def test_lock_taken_over_by_another_owner_is_left_to_it(self, client: LockClient, raw: Any, hook: LostHook) -> None:
        """When another owner overwrote the lock, the old holder is told and its release leaves the new owner alone."""
        lock_key = client.backend.lock_key("stolen:2")

        def hold_while_taken_over() -> None:
            with client.lock("stolen:2", on_lost=hook):
                pipe = raw.pipeline(transaction=True)
                pipe.delete(lock_key)
                pipe.hset(lock_key, mapping={"thief" * 6 + "ab": 1, "fence": 99})
                pipe.pexpire(lock_key, 60_000)
                pipe.execute()
                hook.wait()

        with pytest.raises(LockLost) as exc_info:
            hold_while_taken_over()
        assert exc_info.value.reason == "not-owner"
        assert len(hook.calls) == 1
        assert raw.hgetall(lock_key) == {b"thief" * 6 + b"ab": b"1", b"fence": b"99"}
        assert raw.pttl(lock_key) > LEASE * 1000

    def test_decorated_call_raises_lock_lost_carrying_its_result(
        self, client: LockClient, raw: Any, hook: LostHook
    ) -> None:
        """A decorated body that finishes after losing its lock raises LockLost with the return value."""

        @distributed_lock(key="stolen:<n>", client=client, on_lost=hook)
        def body(n: int) -> str:
            raw.delete(client.backend.lock_key(f"stolen:{n}"))
            hook.wait()
            return "written"

        with pytest.raises(LockLost) as exc_info:
            body(3)
        error = exc_info.value
        assert (error.key, error.reason) == ("stolen:3", "not-owner")
        assert error.has_result
        assert error.result == "written"
        assert error.exception is None
        assert len(hook.calls) == 1

    def test_decorated_call_raises_lock_lost_chained_to_its_exception(
        self, client: LockClient, raw: Any, hook: LostHook
    ) -> None:
        """A decorated body that raises after losing its lock raises LockLost chained to that exception."""
        failure = ValueError("disk full")

        @distributed_lock(key="stolen:<n>", client=client, on_lost=hook)
        def body(n: int) -> str:
            raw.delete(client.backend.lock_key(f"stolen:{n}"))
            hook.wait()
            raise failure

        with pytest.raises(LockLost) as exc_info:
            body(4)
        error = exc_info.value
        assert error.reason == "not-owner"
        assert error.exception is failure
        assert error.__cause__ is failure
        assert not error.has_result
        assert len(hook.calls) == 1

    def test_fixed_lease_outlived_by_the_body_is_lost(self, client: LockClient, hook: LostHook) -> None:
        """A fixed lease is never renewed; a body that outlives it gets on_lost and LockLost at return."""

        @distributed_lock(key="fixed:<n>", client=client, lease=0.3, on_lost=hook)
        def body(n: int) -> int:
            hook.wait()
            return n * 2

        with pytest.raises(LockLost) as exc_info:
            body(21)
        assert exc_info.value.reason == "expired"
        assert exc_info.value.result == 42
        assert len(hook.calls) == 1
        assert client.stats().renewals == 0

    @pytest.mark.slow
    def test_max_hold_stops_renewal_and_loses_the_lease(self, client: LockClient, raw: Any, hook: LostHook) -> None:
        """With max_hold, renewal stops at the cap: the key expires in the store and the lease is lost."""
        lock_key = client.backend.lock_key("capped")

        def hold_past_the_cap() -> None:
            with client.lock("capped", max_hold=1.2, on_lost=hook) as lease:
                hook.wait()
                assert lease.lost_reason == "max-hold"
                renewals = client.stats().renewals
                assert renewals == 1  # at 0.5 s, up to the cap at 1.2 s; none after
                wait_for(lambda: not raw.exists(lock_key), timeout=5, what="the capped key to expire")
                assert client.stats().renewals == renewals

        with pytest.raises(LockLost) as exc_info:
            hold_past_the_cap()
        assert exc_info.value.reason == "max-hold"
        assert len(hook.calls) == 1

    @pytest.mark.slow
    @pytest.mark.timeout(60)
    def test_holder_is_told_when_the_store_hangs_past_the_lease(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, hook: LostHook
    ) -> None:
        """With the store stopped, the lease is declared lost at its end although the renewal round trip still hangs."""
        client = make_client(
            url=fresh_server.url, watchdog_lease=LEASE, tick=TICK, delay_weight=DW, socket_timeout=10.0
        )

        def hold_while_the_store_hangs() -> None:
            with client.lock("hung", on_lost=hook) as lease:
                fresh_server.pause()
                try:
                    wait_for(lambda: client.stats().renewal_round_trips >= 1, what="the renewal to be sent")
                    wait_for(lambda: lease.lost, timeout=5, what="the lease to be declared lost")
                    with pytest.raises(LockLost) as check_info:
                        lease.check()
                    assert check_info.value.reason == "expired"
                    stats = client.stats()
                    assert (stats.renewals, stats.renewal_failures) == (0, 0)  # still in flight
                    # the hook runs on its own thread, not behind the hung round trip
                    hook.wait(15)
                finally:
                    fresh_server.resume()

        with pytest.raises(LockLost) as exc_info:
            hold_while_the_store_hangs()
        assert exc_info.value.reason == "expired"
        assert len(hook.calls) == 1

    @pytest.mark.slow
    @pytest.mark.timeout(60)
    def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Failing renewals log one WARNING when they start failing and one INFO when they succeed again."""
        caplog.set_level(logging.INFO, logger="lockaspect.watchdog")
        client = make_client(url=fresh_server.url, watchdog_lease=3.0, tick=TICK, delay_weight=0.3, socket_timeout=0.2)
        with client.lock("outage") as lease:
            wait_for(lambda: client.stats().renewals >= 1, what="a first renewal")
            fresh_server.pause()
            try:
                wait_for(lambda: client.stats().renewal_failures >= 2, what="two failed renewal attempts")
            finally:
                fresh_server.resume()
            wait_for(lambda: any("succeed again" in r.message for r in caplog.records), what="the recovery")
            assert not lease.lost
        failing = [r for r in caplog.records if "renewals are failing" in r.message]
        assert len(failing) == 1
        assert failing[0].levelno == logging.WARNING


class TestFork:
    @pytest.mark.slow
    def test_forked_child_neither_renews_the_parents_lock_nor_breaks(
        self, client: LockClient, lock_server: LockServer, namespace: str, raw: Any
    ) -> None:
        """A child forked while its parent holds a watchdog lease never renews that lease, and locks normally."""
        receiver, sender = FORK.Pipe(duplex=False)
        # A pipe, not a multiprocessing.Event: a SIGKILLed sleeper would wedge Event.set().
        stop, stopper = FORK.Pipe(duplex=False)
        # Plain os.fork, not multiprocessing.Process: the grandchild inherits the Process
        # sentinel, so join() would wait for the grandchild instead of the holder.
        holder = _fork()
        if holder == 0:
            _hold_and_fork(lock_server.url, namespace, "parent", "child", sender, stop)
        holder_reaped = False
        child_pid = None
        try:
            messages = {}
            for _ in range(2):
                message = _receive(receiver)
                assert message[0] in ("holder", "child"), message
                messages[message[0]] = message
            _, child_pid, holder_fence = messages["holder"]
            _, reported_pid, child_fence, child_held = messages["child"]
            assert reported_pid == child_pid
            assert child_held == 0
            assert holder_fence > 0
            assert child_fence > 0

            os.kill(holder, signal.SIGKILL)
            _, status = os.waitpid(holder, 0)
            holder_reaped = True
            assert os.WIFSIGNALED(status)
            assert os.WTERMSIG(status) == signal.SIGKILL
            # Only the forked child, which keeps renewing its own lock, could keep the
            # parent's lock alive now.
            with client.lock("parent", wait=2 * LEASE) as lease:
                assert lease.fencing_token == holder_fence + 1
                os.kill(child_pid, 0)  # the child is still alive and running its watchdog
                assert raw.exists(client.backend.lock_key("child"))

            stopper.send("stop")
            assert _receive(receiver) == ("child-released", 1)
            assert not raw.exists(client.backend.lock_key("child"))
        finally:
            stopper.close()
            if not holder_reaped:
                os.kill(holder, signal.SIGKILL)
                os.waitpid(holder, 0)
            if child_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child_pid, signal.SIGKILL)


class _ChildUnwinds(Exception):
    pass


class TestForkedChildUnwinding:
    @fork_warning
    def test_a_child_forked_inside_a_block_does_not_release_the_parents_lock(
        self, client: LockClient, raw: Any, owner_value: Any
    ) -> None:
        """A child forked inside a locked block is told it holds nothing, and unwinding the block
        leaves the parent's lock in place."""
        key = client.backend.lock_key("forked-block")
        _PARENT_PID[0] = os.getpid()
        try:
            with client.lock("forked-block") as lease:
                pid = _fork()
                if pid == 0:
                    # the child holds nothing: the inherited lease says so...
                    reason = None
                    try:
                        lease.check()
                    except LockLost as lost:
                        reason = lost.reason
                    if lease.held or reason != "forked":
                        os._exit(3)
                    raise _ChildUnwinds  # ...and unwinding the inherited block releases nothing
                _, status = os.waitpid(pid, 0)
                assert os.WIFEXITED(status)
                assert os.WEXITSTATUS(status) == 0
                assert raw.hget(key, lease.token) == owner_value
        except _ChildUnwinds:
            os._exit(0)
        except BaseException:
            if os.getpid() != _PARENT_PID[0]:
                os._exit(1)
            raise
        assert not raw.exists(key)


_PARENT_PID = [os.getpid()]
