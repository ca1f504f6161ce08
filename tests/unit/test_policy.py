"""Pure lease and wait arithmetic in ``lockaspect._policy``, and the decoration-time option rows
of issue 2's "Bad input" table (``lease``, ``delay_weight``, ``wait``), which need no server."""

from __future__ import annotations

import decimal
import math
import random
import types
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockaspect import ConfigurationError, _policy, config, distributed_lock
from lockaspect._policy import (
    MIN_SAFETY_MARGIN,
    NOTIFY_RECHECK,
    POLL_CAP,
    POLL_FLOOR,
    RETRY_BASE,
    RETRY_CAP,
    check_delay_weight,
    check_margin,
    first_renewal_at,
    lease_seconds,
    renewal_lease,
    renewal_retry_at,
    retry_sleep,
    seconds,
    wait_deadline,
    wait_seconds,
)

PROPERTY = settings(max_examples=500, deadline=None, database=None)

NOT_FINITE = [math.nan, math.inf, -math.inf, 10**400]
WRONG_TYPES = [True, False, "30", b"30", decimal.Decimal("30"), [30], object()]


class FixedRandom(random.Random):
    """A ``random.Random`` whose ``random()`` always returns ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def place(user: Any) -> None: ...


class TestSeconds:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [(1, 1.0), (0.25, 0.25), (timedelta(seconds=1.5), 1.5), (timedelta(milliseconds=1), 0.001)],
    )
    def test_accepts_numbers_and_timedelta(self, value: object, expected: float) -> None:
        """ints, floats and timedeltas convert to float seconds."""
        result = seconds(value, "lease")
        assert result == expected
        assert type(result) is float

    @pytest.mark.parametrize("value", [0, 0.0, -1, -0.001, timedelta(0), timedelta(seconds=-1), *NOT_FINITE])
    def test_rejects_non_positive_and_non_finite(self, value: object) -> None:
        """Zero, negatives, NaN, infinities and ints too large for a float are ConfigurationErrors naming the option."""
        with pytest.raises(ConfigurationError, match=r"^lease must be"):
            seconds(value, "lease")

    @pytest.mark.parametrize("value", WRONG_TYPES)
    def test_rejects_wrong_types(self, value: object) -> None:
        """bool, str and other non-number types are TypeErrors naming the option and the type."""
        with pytest.raises(TypeError, match=rf"^lease must be seconds .* not {type(value).__name__}$"):
            seconds(value, "lease")

    def test_zero_only_when_allowed(self) -> None:
        """Zero passes with ``allow_zero`` while negatives still fail."""
        assert seconds(0, "wait", allow_zero=True) == 0.0
        with pytest.raises(ConfigurationError, match=">= 0"):
            seconds(-1, "wait", allow_zero=True)

    def test_none_only_when_allowed(self) -> None:
        """None passes through with ``allow_none`` and is a ConfigurationError otherwise."""
        assert seconds(None, "lease", allow_none=True) is None
        with pytest.raises(ConfigurationError, match="not None"):
            seconds(None, "lease")

    def test_configuration_error_is_a_value_error(self) -> None:
        """A bad duration can be caught as ValueError."""
        with pytest.raises(ValueError, match="finite"):
            seconds(math.nan, "lease")


class TestLeaseAndWait:
    def test_lease_none_is_watchdog_mode(self) -> None:
        """``lease=None`` stays None (watchdog mode)."""
        assert lease_seconds(None) is None

    @pytest.mark.parametrize("value", [0, -5, *NOT_FINITE])
    def test_bad_lease_is_a_configuration_error(self, value: object) -> None:
        """A lease <= 0, NaN or infinite is a ConfigurationError."""
        with pytest.raises(ConfigurationError, match="lease"):
            lease_seconds(value)

    @pytest.mark.parametrize("value", WRONG_TYPES)
    def test_lease_of_wrong_type_is_a_type_error(self, value: object) -> None:
        """A lease that is a bool, str or other non-number is a TypeError."""
        with pytest.raises(TypeError, match="lease"):
            lease_seconds(value)

    def test_wait_accepts_zero_positive_none_and_timedelta(self) -> None:
        """``wait`` is 0 (try once), positive seconds, a timedelta, or None (forever)."""
        assert wait_seconds(0) == 0.0
        assert wait_seconds(2.5) == 2.5
        assert wait_seconds(timedelta(seconds=3)) == 3.0
        assert wait_seconds(None) is None

    @pytest.mark.parametrize("value", [-1, -0.5, *NOT_FINITE])
    def test_bad_wait_is_a_configuration_error(self, value: object) -> None:
        """A negative, NaN or infinite wait is a ConfigurationError (forever is spelled None)."""
        with pytest.raises(ConfigurationError, match="wait"):
            wait_seconds(value)

    @pytest.mark.parametrize("value", WRONG_TYPES)
    def test_wait_of_wrong_type_is_a_type_error(self, value: object) -> None:
        """A wait that is a bool, str or other non-number is a TypeError."""
        with pytest.raises(TypeError, match="wait"):
            wait_seconds(value)

    def test_wait_deadline(self) -> None:
        """The wait deadline is start plus wait, or None for waiting forever."""
        assert wait_deadline(100.0, 2.5) == 102.5
        assert wait_deadline(100.0, 0.0) == 100.0
        assert wait_deadline(100.0, None) is None


class TestDelayWeight:
    @pytest.mark.parametrize("value", [0.5, 0.9, 0.01, 0.999])
    def test_accepts_fractions_strictly_between_0_and_1(self, value: float) -> None:
        """A delay_weight in (0, 1) is returned as a float."""
        assert check_delay_weight(value) == value

    @pytest.mark.parametrize("value", [0, 1, 0.0, 1.0, -0.1, 1.5, *NOT_FINITE])
    def test_rejects_values_outside_the_open_interval(self, value: object) -> None:
        """0, 1, values outside (0, 1), NaN and infinities are ConfigurationErrors."""
        with pytest.raises(ConfigurationError, match=r"delay_weight must be in \(0, 1\)"):
            check_delay_weight(value)

    @pytest.mark.parametrize("value", [True, "0.9", None, timedelta(seconds=1), decimal.Decimal("0.5")])
    def test_rejects_wrong_types(self, value: object) -> None:
        """A delay_weight that is not an int or float (bool included) is a TypeError."""
        with pytest.raises(TypeError, match="delay_weight"):
            check_delay_weight(value)


class TestCheckMargin:
    def test_default_leaves_enough_margin(self) -> None:
        """The defaults (30 s lease, 0.9, 100 ms tick) pass."""
        check_margin(30.0, 0.9, 0.1)

    def test_too_little_margin_names_the_numbers(self) -> None:
        """A margin below tick plus safety margin is a ConfigurationError that shows every number."""
        with pytest.raises(ConfigurationError) as info:
            check_margin(1.0, 0.95, 0.1)
        message = str(info.value)
        for number in ("delay_weight=0.95", "(1 - 0.95) * 1s", "0.050s", "tick 0.1s", "safety margin 0.1s", "0.200s"):
            assert number in message

    def test_margin_equal_to_the_minimum_is_rejected(self) -> None:
        """The margin must strictly exceed tick plus safety margin."""
        with pytest.raises(ConfigurationError):
            check_margin(1.0, 0.5, 0.5 - MIN_SAFETY_MARGIN)

    def test_margin_just_above_the_minimum_passes(self) -> None:
        """A margin a little over tick plus safety margin passes."""
        check_margin(1.0, 0.5, 0.39)

    def test_a_longer_tick_needs_a_longer_margin(self) -> None:
        """The same lease and weight that pass with a short tick fail with a long one."""
        check_margin(3.0, 0.9, 0.1)
        with pytest.raises(ConfigurationError, match=r"tick 0\.25s"):
            check_margin(3.0, 0.9, 0.25)


@pytest.fixture
def _no_default_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_client", None)


@pytest.mark.usefixtures("_no_default_client")
class TestDecorationRejectsBadOptions:
    @pytest.mark.parametrize("lease", [0, -1, math.nan, math.inf])
    def test_bad_lease(self, lease: float) -> None:
        """``lease`` <= 0, NaN or inf is a ConfigurationError at decoration."""
        with pytest.raises(ConfigurationError, match="lease"):
            distributed_lock(key="k:<user>", lease=lease)(place)

    @pytest.mark.parametrize("lease", [True, "30"])
    def test_lease_of_wrong_type(self, lease: object) -> None:
        """A bool or str ``lease`` is a TypeError at decoration."""
        with pytest.raises(TypeError, match="lease"):
            distributed_lock(key="k:<user>", lease=lease)(place)  # type: ignore[arg-type]

    @pytest.mark.parametrize("delay_weight", [0.0, 1.0, 1.5, -0.5, math.nan])
    def test_delay_weight_outside_the_open_interval(self, delay_weight: float) -> None:
        """A ``delay_weight`` outside (0, 1) is a ConfigurationError at decoration."""
        with pytest.raises(ConfigurationError, match="delay_weight"):
            distributed_lock(key="k:<user>", delay_weight=delay_weight)(place)

    def test_delay_weight_too_close_to_one_names_the_numbers(self) -> None:
        """In watchdog mode a ``delay_weight`` leaving too little margin is a ConfigurationError with the numbers."""
        with pytest.raises(ConfigurationError) as info:
            distributed_lock(key="k:<user>", delay_weight=0.999)(place)
        message = str(info.value)
        assert "delay_weight=0.999" in message
        assert "* 30s = 0.030s" in message
        assert "= 0.200s" in message

    def test_fixed_lease_is_not_held_to_the_renewal_margin(self) -> None:
        """A fixed lease is never renewed, so a high ``delay_weight`` is accepted with it."""
        decorated = distributed_lock(key="k:<user>", lease=10.0, delay_weight=0.999)(place)
        assert decorated.__wrapped__ is place

    @pytest.mark.parametrize(
        ("wait", "error"), [(-1, ConfigurationError), (math.nan, ConfigurationError), ("1", TypeError)]
    )
    def test_bad_wait(self, wait: object, error: type[Exception]) -> None:
        """A negative or NaN ``wait`` is a ConfigurationError and a str is a TypeError, at decoration."""
        with pytest.raises(error, match="wait"):
            distributed_lock(key="k:<user>", wait=wait)(place)  # type: ignore[arg-type]

    def test_timedelta_options_are_accepted(self) -> None:
        """``lease`` and ``wait`` accept timedeltas at decoration."""
        decorated = distributed_lock(key="k:<user>", lease=timedelta(seconds=5), wait=timedelta(seconds=1))(place)
        assert decorated.__wrapped__ is place


class TestRenewalSchedule:
    def test_first_renewal_at_delay_weight_of_the_lease(self) -> None:
        """The first renewal is due ``delay_weight * lease`` after the last (re)newal."""
        assert first_renewal_at(100.0, 30.0, 0.9) == pytest.approx(127.0)

    def test_no_retry_once_only_a_tick_remains(self) -> None:
        """With a tick or less of lease left there is no retry."""
        assert renewal_retry_at(now=9.9, attempt=1, expires_at=10.0, tick=0.1) is None
        assert renewal_retry_at(now=10.5, attempt=1, expires_at=10.0, tick=0.1) is None

    def test_backoff_grows_then_caps(self) -> None:
        """Retry delays double from RETRY_BASE per attempt up to RETRY_CAP."""
        delays = [renewal_retry_at(0.0, attempt, 1000.0, 0.001) for attempt in range(8)]
        assert delays == [min(RETRY_BASE * 2**attempt, RETRY_CAP) for attempt in range(8)]
        assert delays[0] < delays[1] < delays[2] < delays[3] < delays[4]

    def test_retry_is_at_least_one_tick_away(self) -> None:
        """A retry is never sooner than one tick, the timer's resolution."""
        assert renewal_retry_at(0.0, 0, 10.0, 0.1) == 0.1

    def test_retry_leaves_room_before_the_lease_end(self) -> None:
        """With little lease left the retry comes within a third of what remains."""
        assert renewal_retry_at(9.7, 10, 10.0, 0.01) == pytest.approx(9.8)

    def test_huge_attempt_counts_do_not_overflow(self) -> None:
        """A very high attempt number still yields the capped delay."""
        assert renewal_retry_at(0.0, 10**9, 1000.0, 0.01) == RETRY_CAP

    @PROPERTY
    @given(
        now=st.floats(0.0, 1e6),
        attempt=st.integers(0, 100),
        remaining=st.floats(-10.0, 100.0),
        tick=st.floats(0.001, 1.0),
    )
    def test_retry_is_within_the_lease(self, now: float, attempt: int, remaining: float, tick: float) -> None:
        """A retry, when there is one, is at least one tick out and before the lease end."""
        expires_at = now + remaining
        at = renewal_retry_at(now, attempt, expires_at, tick)
        if expires_at - now <= tick:
            assert at is None
        else:
            assert at is not None
            assert now + tick <= at <= expires_at


class TestRenewalLease:
    def test_full_lease_without_max_hold(self) -> None:
        """Without ``max_hold`` every renewal asks for the full lease."""
        assert renewal_lease(100.0, 30.0, None) == 30.0

    def test_full_lease_while_max_hold_is_far(self) -> None:
        """A max_hold deadline beyond the lease does not shorten it."""
        assert renewal_lease(100.0, 30.0, 500.0) == 30.0

    def test_lease_cut_to_end_at_max_hold(self) -> None:
        """Near the max_hold deadline the renewal asks only for what is left of it."""
        assert renewal_lease(100.0, 30.0, 115.0) == 15.0

    @PROPERTY
    @given(now=st.floats(0.0, 1e6), lease=st.floats(0.01, 1e4), hold=st.floats(0.0, 1e4))
    def test_renewal_never_passes_max_hold(self, now: float, lease: float, hold: float) -> None:
        """A renewal never extends past the max_hold deadline nor asks for more than the lease."""
        asked = renewal_lease(now, lease, now + hold)
        assert asked <= lease
        assert now + asked <= now + hold + 1e-6


class TestRetrySleep:
    @PROPERTY
    @given(
        now=st.floats(0.0, 1e6),
        until_deadline=st.one_of(st.none(), st.floats(-5.0, 60.0)),
        holder_ttl=st.one_of(st.none(), st.floats(-1.0, 60.0)),
        attempt=st.integers(0, 1000),
        notified=st.booleans(),
        jitter=st.floats(0.0, 0.999999),
    )
    def test_sleep_is_bounded(
        self,
        now: float,
        until_deadline: float | None,
        holder_ttl: float | None,
        attempt: int,
        notified: bool,
        jitter: float,
    ) -> None:
        """A sleep is never negative, never past the deadline, when notified never past NOTIFY_RECHECK (plus 10 %
        jitter), and when polling never past the holder's TTL."""
        deadline = None if until_deadline is None else now + until_deadline
        sleep = retry_sleep(
            now=now,
            deadline=deadline,
            holder_ttl=holder_ttl,
            attempt=attempt,
            notified=notified,
            rng=FixedRandom(jitter),
        )
        assert sleep >= 0.0
        if deadline is not None:
            assert sleep <= max(deadline - now, 0.0)
        if notified:
            assert sleep <= NOTIFY_RECHECK * 1.1
        else:
            assert sleep <= POLL_CAP
            if holder_ttl is not None and holder_ttl > 0:
                assert sleep <= max(holder_ttl, POLL_FLOOR)

    def test_deadline_passed_means_no_sleep(self) -> None:
        """Once the wait deadline has passed the sleep is zero."""
        assert retry_sleep(now=10.0, deadline=9.0, holder_ttl=5.0, attempt=0, notified=True) == 0.0

    def test_notified_waiter_sleeps_out_a_short_hint(self) -> None:
        """With release notifications and a hint below NOTIFY_RECHECK the waiter sleeps the holder's TTL (plus at
        most 10 % jitter), woken early by a release."""
        hint = NOTIFY_RECHECK / 2
        sleep = retry_sleep(now=0.0, deadline=None, holder_ttl=hint, attempt=0, notified=True, rng=FixedRandom(0.5))
        assert hint <= sleep <= hint * 1.1

    @pytest.mark.parametrize("hint", [NOTIFY_RECHECK * 2, 30.0, 3600.0, None])
    @pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999999])
    def test_notified_waiter_rechecks_within_notify_recheck(self, hint: float | None, jitter: float) -> None:
        """A notified waiter never sleeps more than NOTIFY_RECHECK (plus at most 10 % jitter), however long the
        holder's lease: a lost wake-up costs at most that long. With a long hint it sleeps at least NOTIFY_RECHECK."""
        sleep = retry_sleep(now=0.0, deadline=None, holder_ttl=hint, attempt=0, notified=True, rng=FixedRandom(jitter))
        assert sleep <= NOTIFY_RECHECK * 1.1
        if hint is not None:
            assert sleep >= NOTIFY_RECHECK

    def test_notified_sleep_is_cut_at_the_deadline(self) -> None:
        """A notified waiter still wakes at its wait deadline."""
        sleep = retry_sleep(now=0.0, deadline=0.5, holder_ttl=2.0, attempt=0, notified=True, rng=FixedRandom(0.5))
        assert sleep == 0.5

    def test_polling_backs_off_with_attempts(self) -> None:
        """Without notifications and a long hint, later attempts sleep longer, up to the cap."""
        sleeps = [
            retry_sleep(now=0.0, deadline=None, holder_ttl=60.0, attempt=a, notified=False, rng=FixedRandom(0.5))
            for a in range(12)
        ]
        assert sleeps[:8] == sorted(sleeps[:8])
        assert sleeps[0] < sleeps[4] < sleeps[8]
        assert max(sleeps) <= POLL_CAP

    def test_polling_without_hint_uses_the_backoff(self) -> None:
        """Without a TTL hint, polling sleeps follow the backoff from POLL_FLOOR."""
        first = retry_sleep(now=0.0, deadline=None, holder_ttl=None, attempt=0, notified=False, rng=FixedRandom(0.0))
        assert first == pytest.approx(POLL_FLOOR * 0.5)

    def test_jitter_spreads_waiters(self) -> None:
        """Different jitter draws give different sleeps, so waiters do not retry in lockstep."""
        sleeps = {
            retry_sleep(now=0.0, deadline=None, holder_ttl=1.0, attempt=5, notified=False, rng=FixedRandom(j))
            for j in (0.0, 0.3, 0.6, 0.9)
        }
        assert len(sleeps) == 4


class TestLayering:
    def test_policy_module_imports_no_io_or_clock(self) -> None:
        """``_policy`` imports no I/O library and no clock: callers pass ``now`` in."""
        modules = {value.__name__ for value in vars(_policy).values() if isinstance(value, types.ModuleType)}
        assert modules.isdisjoint({"redis", "socket", "time", "threading", "asyncio", "selectors"})


class TestDefaultDelayWeight:
    def test_long_leases_keep_the_classic_default(self) -> None:
        """A lease long enough for 0.9 gets 0.9."""
        assert _policy.default_delay_weight(30.0, 0.1) == 0.9

    def test_short_leases_get_a_weight_that_leaves_twice_the_margin(self) -> None:
        """A 2 s lease with a 0.1 s tick gets 0.8: (1 - 0.8) * 2 = 0.4 = 2 * (0.1 + 0.1)."""
        weight = _policy.default_delay_weight(2.0, 0.1)
        assert weight == pytest.approx(0.8)
        _policy.check_margin(2.0, weight, 0.1)  # and it passes the strict check

    def test_a_lease_too_short_for_any_weight_is_refused_with_the_numbers(self) -> None:
        """A lease that cannot leave the margin at all is a ConfigurationError naming the bound."""
        with pytest.raises(ConfigurationError, match=r"0\.400s"):
            _policy.default_delay_weight(0.3, 0.1)


class TestFairLockBounds:
    def test_a_live_fair_waiter_is_never_counted_gone(self) -> None:
        """A waiting fair waiter's longest gap between attempts (its longest sleep, plus one
        round trip cut off by the socket timeout) stays below FAIR_GONE_AFTER."""
        from lockaspect.backends.redis import DEFAULT_SOCKET_TIMEOUT

        for hint in (None, 0.001, 1.0, 30.0):
            for jitter in (0.0, 0.999999):
                for notified in (True, False):
                    sleep = retry_sleep(
                        now=0.0,
                        deadline=None,
                        holder_ttl=hint,
                        attempt=64,
                        notified=notified,
                        rng=FixedRandom(jitter),
                    )
                    assert sleep + DEFAULT_SOCKET_TIMEOUT < _policy.FAIR_GONE_AFTER

    def test_subscribe_grace_outlasts_the_subscribe_timeout(self) -> None:
        """A fair waiter that is still subscribing is not skipped as gone by a release."""
        from lockaspect.engine.waiting import SUBSCRIBE_TIMEOUT

        assert SUBSCRIBE_TIMEOUT < _policy.FAIR_SUBSCRIBE_GRACE < _policy.FAIR_GONE_AFTER
