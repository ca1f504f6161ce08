"""The wait loop's decisions (lockaspect.engine.waiting), with no store and no clock: each test
drives a Waiting by hand, as a runner would, and checks the steps it asks for."""

from __future__ import annotations

import pytest

from lockaspect import ConfigurationError, LockNotAcquired
from lockaspect.backends.base import AcquireResult
from lockaspect.engine.waiting import ATTEMPT, LISTEN, PAUSE, SUBSCRIBE_TIMEOUT, SpareIds, Waiting
from lockaspect.errors import BackendError
from lockaspect.kinds import FAIR, MUTEX

BUSY = AcquireResult(False, holder_ttl=5.0)


def waiting(**options: object) -> Waiting:
    defaults: dict[str, object] = {
        "keys": ("k",),
        "kind": MUTEX,
        "token": "t0",
        "lease": 30.0,
        "start": 100.0,
        "deadline": 110.0,
        "wait": 10.0,
        "result": BUSY,
    }
    defaults.update(options)
    keys, kind, token, lease, start, deadline, wait, result = (
        defaults.pop(name) for name in ("keys", "kind", "token", "lease", "start", "deadline", "wait", "result")
    )
    return Waiting(keys, kind, token, lease, start, deadline, wait, result, **defaults)  # type: ignore[arg-type]


class TestSingleKey:
    def test_a_notified_waiter_subscribes_first_then_retries_at_once(self) -> None:
        w = waiting(notify=True)
        assert w.step(101.0, False, False) == LISTEN
        assert (w.listen_key, w.listen_as) == ("k", None)
        assert w.listen_timeout() == SUBSCRIBE_TIMEOUT
        w.listened(True, "proc")
        assert w.step(101.0, False, True) == ATTEMPT
        request = w.request(101.0)
        assert (request.keys, request.token, request.waiter, request.front) == (("k",), "t0", "proc", False)

    def test_a_waiter_queued_by_its_first_attempt_waits_for_the_wake_up(self) -> None:
        w = waiting(notify=True, queued="proc")
        assert w.step(101.0, False, False) == LISTEN
        w.listened(True, "proc")
        assert w.step(101.0, False, True) == PAUSE  # no attempt: it is queued already
        w.paused(True)
        assert w.step(102.0, False, True) == ATTEMPT
        assert w.request(102.0).front  # woken but beaten to it: keep the head of the queue

    def test_the_subscribe_timeout_ends_at_the_deadline_counted_from_the_step(self) -> None:
        w = waiting(notify=True)
        assert w.step(109.5, False, False) == LISTEN
        assert w.listen_timeout() == pytest.approx(0.5)

    def test_an_unconfirmed_subscription_is_not_made_again_and_the_waiter_polls(self) -> None:
        w = waiting(notify=True)
        assert w.step(101.0, False, False) == LISTEN
        w.listened(False, "proc")
        assert w.step(101.0, False, False) == ATTEMPT
        assert not w.attempted(BUSY)
        assert w.step(101.1, False, False) == PAUSE
        assert 0 < w.pause <= 10.0

    def test_a_lost_subscription_is_made_again(self) -> None:
        """The notifier lost a confirmed subscription (its connection, or a Redis Cluster slot
        moved): the waiter listens again, once; an unconfirmed one it then gets is kept."""
        w = waiting(notify=True)
        assert w.step(101.0, False, False) == LISTEN
        w.listened(True, "proc")
        assert w.step(101.0, False, True) == ATTEMPT
        assert not w.attempted(BUSY)
        assert w.step(101.1, False, True) == PAUSE
        w.paused(False)
        assert w.step(102.0, False, False) == ATTEMPT  # woken by the loss: try first
        assert not w.attempted(BUSY)
        assert w.step(102.0, False, False) == LISTEN  # lost: listen again
        w.listened(False, "proc")
        assert w.step(102.0, False, False) == ATTEMPT
        assert not w.attempted(BUSY)
        assert w.step(102.1, False, False) == PAUSE  # not confirmed this time: poll, no loop

    def test_without_notifications_it_polls_within_the_holders_lease(self) -> None:
        w = waiting()
        assert w.step(101.0, False, False) == PAUSE
        assert 0 < w.pause <= BUSY.holder_ttl + 0.5  # type: ignore[operator]
        w.paused(False)
        assert w.step(101.0, False, False) == ATTEMPT

    def test_the_deadline_raises_lock_not_acquired_with_the_wait(self) -> None:
        w = waiting()
        with pytest.raises(LockNotAcquired) as caught:
            w.step(110.0, False, False)
        assert caught.value.key == "k"
        assert caught.value.waited == pytest.approx(10.0)
        assert caught.value.holder_ttl == 5.0

    def test_a_closed_client_stops_the_wait(self) -> None:
        with pytest.raises(ConfigurationError, match="closed"):
            waiting().step(101.0, True, False)

    def test_an_acquisition_ends_the_wait_and_leaves_no_queue_place(self) -> None:
        w = waiting(notify=True)
        w.step(101.0, False, False)
        w.listened(True, "proc")
        w.step(101.0, False, True)
        w.request(101.0)
        assert w.attempted(AcquireResult(True, 7))
        assert w.leaving(False) is None

    def test_giving_up_leaves_the_process_place_only_without_other_waiters(self) -> None:
        w = waiting(notify=True)
        w.step(101.0, False, False)
        w.listened(True, "proc")
        assert w.leaving(False) == ("k", "proc")
        assert w.leaving(True) is None  # another waiter of ours takes over the place

    def test_a_transient_failure_retries_with_a_fresh_token_until_the_deadline(self) -> None:
        w = waiting()
        failure = BackendError("down", key="k", transient=True)
        w.failed(failure, 101.0)
        assert w.token != "t0"
        assert w.step(101.0, False, False) == PAUSE
        with pytest.raises(BackendError) as caught:
            w.step(110.0, False, False)
        assert caught.value is failure  # the last failure, not "busy"

    def test_a_permanent_failure_raises_at_once(self) -> None:
        failure = BackendError("bad", key="k", transient=False)
        with pytest.raises(BackendError):
            waiting().failed(failure, 101.0)


class TestOwnPlace:
    def test_a_fair_waiter_keeps_its_own_place_and_always_leaves_it(self) -> None:
        w = waiting(kind=FAIR, notify=True, queued="n-own", own_id="n-own", listens=True)
        assert w.step(101.0, False, False) == LISTEN
        assert w.listen_as == "n-own"
        w.listened(True, "proc")
        assert w.step(101.0, False, True) == ATTEMPT
        request = w.request(101.0)
        assert (request.kind, request.waiter, request.front) == ("fair", "n-own", False)
        assert w.leaving(True) == ("k", "n-own")


class TestHandoff:
    """A fair waiter on a store with FAIR_HANDOFF: the release's wake-up may say it holds the lock."""

    def fair(self, **options: object) -> Waiting:
        return waiting(kind=FAIR, notify=True, queued="n1", own_id="n1", handoff=True, **options)

    def test_a_grant_for_the_registered_token_is_the_lock_without_a_round_trip(self) -> None:
        w = self.fair()
        assert w.step(101.0, False, False) == LISTEN
        w.listened(True, "proc")
        assert w.step(101.0, False, True) == ATTEMPT
        assert w.request(101.0).waiter == "n1"
        assert not w.attempted(BUSY)
        assert w.step(101.5, False, True) == PAUSE
        assert w.paused(True, 7, 103.0)
        assert (w.result.acquired, w.result.fencing_token, w.sent, w.token) == (True, 7, 101.0, "t0")
        assert w.leaving(False) is None  # the release took it off the queue

    def test_the_first_attempt_registers_too_and_a_plain_wake_up_is_retried(self) -> None:
        w = self.fair()
        assert w.granted_tokens() == ["t0"]  # the queueing first attempt (sent at the start)
        assert not w.paused(True, 0, 101.0)
        assert w.step(101.0, False, False) == ATTEMPT

    def test_a_grant_with_less_than_half_the_lease_left_is_confirmed_by_an_attempt(self) -> None:
        w = self.fair(deadline=None, wait=None)
        assert not w.paused(True, 7, 100.0 + 15.0)  # sent at 100, lease 30
        assert w.step(115.0, False, False) == ATTEMPT  # it finds the lock its own, renewed from then

    def test_a_grant_after_a_failed_attempt_gives_the_replaced_token_back(self) -> None:
        """The failed attempt's undo cannot take back the registration an earlier attempt made
        for the queue place: a release may still make the replaced token the owner. A grant
        then is not taken (it may be that token's, which the failed attempt's undo may still
        release); the replaced token is given back (passing the lock on if it has it), and the
        next attempt finds the lock its own if the grant was for the current token."""
        w = self.fair()
        w.failed(BackendError("reset", transient=True), 101.0)
        assert w.token != "t0"
        assert w.granted_tokens() == ["t0"]  # what a wait given up now gives back
        assert not w.paused(True, 7, 101.5)
        assert w.discards() == ["t0"]
        assert w.discards() == []  # once
        assert w.step(101.5, False, False) == ATTEMPT
        assert not w.attempted(BUSY)  # registers the current token with the place
        assert w.granted_tokens() == ["t0", w.token]
        assert not w.paused(True, 8, 102.0)  # still not trusted: the old token's grant may be late
        assert w.discards() == ["t0"]
        assert not w.paused(True, 0, 102.5)  # a plain wake-up gives nothing back
        assert w.discards() == []

    def test_a_waiter_heard_since_before_its_queueing_attempt_waits_without_another(self) -> None:
        w = self.fair(primed=True)
        assert w.step(101.0, False, False) == LISTEN
        w.listened(True, "proc")
        assert w.step(101.0, False, True) == PAUSE  # no attempt: no wake-up can have been missed
        w.listened(False, "proc")  # not confirmed after all: it may have missed one
        assert w.step(101.0, False, False) == ATTEMPT

    def test_spare_ids_are_handed_out_once_and_bounded(self) -> None:
        spare = SpareIds()
        assert spare.take("k") is None
        spare.give("k", "n1")
        assert (spare.take("k"), spare.take("k")) == ("n1", None)
        for i in range(20):
            spare.give("k", f"n{i}")
        taken = [spare.take("k") for _ in range(20)]
        assert taken == [f"n{i}" for i in range(15, -1, -1)] + [None] * 4  # at most 16 per key
        for i in range(300):
            spare.give(f"key{i}", "n")
        assert spare.take("key0") is None  # the oldest keys are forgotten
        assert spare.take("key299") == "n"

    def test_a_waiter_that_gives_up_gives_back_its_registered_token(self) -> None:
        w = self.fair()
        assert w.leaving(False) == ("k", "n1")
        assert w.granted_tokens() == ["t0"]
        assert waiting(kind=FAIR, queued="n1", own_id="n1").granted_tokens() == []  # no FAIR_HANDOFF


class TestMultiKey:
    def test_it_attempts_first_then_listens_on_the_busy_key(self) -> None:
        w = waiting(keys=("a", "b"), notify=True, own_id="n-own", multi=True, result=AcquireResult(False))
        assert w.step(100.0, False, False) == ATTEMPT
        assert w.request(100.0).waiter is None
        assert not w.attempted(AcquireResult(False, holder_ttl=2.0, busy="b"))
        assert w.step(100.1, False, False) == LISTEN
        assert (w.listen_key, w.listen_as) == ("b", "n-own")
        assert w.leave_watched() is None
        w.listened(True, "proc")
        assert w.step(100.1, False, True) == ATTEMPT
        assert w.request(100.1).waiter == "n-own"
        assert not w.attempted(AcquireResult(False, holder_ttl=2.0, busy="a"))
        assert w.step(100.2, False, True) == LISTEN  # another key is busy now
        assert w.leave_watched() == ("b", "n-own")

    def test_a_wait_that_ends_right_after_the_busy_key_moved_leaves_the_new_place(self) -> None:
        """The last attempt found another key busy (the store moved the queue place there:
        PostgreSQL's wait, ZooKeeper's last node) and the wait runs out before the waiter
        listens there: it gives back the place where the store has it, not the key it
        listened on (that left the place queued, and a release granted the key to nobody)."""
        w = waiting(keys=("a", "b"), notify=True, own_id="n-own", multi=True, result=AcquireResult(False))
        assert w.step(100.0, False, False) == ATTEMPT
        assert not w.attempted(AcquireResult(False, holder_ttl=2.0, busy="b"))
        assert w.step(100.1, False, False) == LISTEN
        w.listened(True, "proc")
        assert w.step(100.1, False, True) == ATTEMPT
        assert not w.attempted(AcquireResult(False, holder_ttl=2.0, busy="a"))
        with pytest.raises(LockNotAcquired):
            w.step(110.0, False, True)
        assert w.leaving(False) == ("a", "n-own")

    def test_a_failed_attempt_with_no_wait_raises(self) -> None:
        w = waiting(keys=("a", "b"), wait=0.0, deadline=100.0, multi=True, result=AcquireResult(False))
        assert w.step(100.0, False, False) == ATTEMPT
        with pytest.raises(BackendError):
            w.failed(BackendError("down", key="a", transient=True), 100.0)
