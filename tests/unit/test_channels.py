"""The pure subscription bookkeeping shared by the sync and async release notifiers
(``lockaspect.backends.redis._channels.ChannelTable``): no I/O, so no server."""

from __future__ import annotations

import pytest

from lockaspect.backends.redis._channels import IDLE_UNSUBSCRIBE, PENDING_WAKE, ChannelTable

#: Wake channels of one notifier's waiter id on two locks (see ``_RedisLocks.wake_channel``).
A = b"ns:{a}:wake:w1"
B = b"ns:{b}:wake:w1"


class Waiter:
    """A local waiter as the notifiers make them: a channel, an active flag, a wake count."""

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.active = True
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def subscribed_table(*channels: bytes) -> tuple[ChannelTable, list[Waiter]]:
    """A table with one waiter per channel, each channel's SUBSCRIBE confirmed."""
    table = ChannelTable()
    waiters = [Waiter(channel) for channel in channels]
    for waiter in waiters:
        assert table.join(waiter)
        assert table.reply(b"subscribe", waiter.channel)
    return table, waiters


def wake(table: ChannelTable, channel: bytes, now: float = 0.0) -> None:
    """What a notifier does with a release message: wake every waiter the table names."""
    for waiter in table.message(channel, now):
        waiter.wake()


def vacated_table() -> ChannelTable:
    """A table whose channel A is subscribed but has no waiter left (its only one left)."""
    table, (first,) = subscribed_table(A)
    table.leave(first, 0.0)
    return table


class TestJoin:
    def test_first_waiter_of_an_unsubscribed_channel_must_subscribe(self) -> None:
        """The first waiter on a channel nobody subscribed to gets True (send SUBSCRIBE)."""
        assert ChannelTable().join(Waiter(A)) is True

    def test_later_waiters_share_a_pending_subscribe(self) -> None:
        """Waiters joining while the SUBSCRIBE is unanswered send nothing of their own."""
        table = ChannelTable()
        assert table.join(Waiter(A)) is True
        assert [table.join(Waiter(A)) for _ in range(5)] == [False] * 5

    def test_waiters_on_a_subscribed_channel_send_nothing(self) -> None:
        """Once the channel is subscribed, a new waiter needs no SUBSCRIBE."""
        table, _ = subscribed_table(A)
        assert table.join(Waiter(A)) is False
        assert table.subscribed(A)

    def test_channels_are_independent(self) -> None:
        """A waiter on another channel must subscribe to that channel itself."""
        table = ChannelTable()
        assert table.join(Waiter(A)) is True
        assert table.join(Waiter(B)) is True
        assert table.join(Waiter(B)) is False

    def test_waiter_on_a_channel_being_unsubscribed_must_subscribe_again(self) -> None:
        """Joining while an idle UNSUBSCRIBE is in flight asks for a new SUBSCRIBE."""
        table, (first,) = subscribed_table(A)
        table.leave(first, 100.0)
        assert table.idle(100.0 + IDLE_UNSUBSCRIBE) == [A]
        assert table.join(Waiter(A)) is True
        assert not table.subscribed(A)


class TestReplies:
    def test_not_subscribed_before_the_confirmation(self) -> None:
        """A channel whose SUBSCRIBE is unanswered does not count as subscribed."""
        table = ChannelTable()
        table.join(Waiter(A))
        assert not table.subscribed(A)

    def test_subscribed_after_the_confirmation(self) -> None:
        """The confirmation settles the channel as subscribed, and reply() says so."""
        table = ChannelTable()
        table.join(Waiter(A))
        assert table.reply(b"subscribe", A) is True
        assert table.subscribed(A)
        assert not table.subscribed(B)

    def test_subscribe_unsubscribe_subscribe_in_order_ends_subscribed(self) -> None:
        """SUBSCRIBE, idle UNSUBSCRIBE, SUBSCRIBE: only the last in-order reply settles it, as subscribed."""
        table, (first,) = subscribed_table(A)
        table.leave(first, 0.0)
        assert table.idle(IDLE_UNSUBSCRIBE) == [A]
        assert table.join(Waiter(A)) is True
        assert table.reply(b"unsubscribe", A) is False
        assert not table.subscribed(A), "a late UNSUBSCRIBE must not pass for the newer SUBSCRIBE"
        assert table.reply(b"subscribe", A) is True
        assert table.subscribed(A)

    def test_unsubscribe_confirmation_ends_the_subscription(self) -> None:
        """A confirmed idle UNSUBSCRIBE leaves the channel unsubscribed, and the next waiter subscribes."""
        table, (first,) = subscribed_table(A)
        table.leave(first, 0.0)
        table.idle(IDLE_UNSUBSCRIBE)
        assert table.reply(b"unsubscribe", A) is True
        assert not table.subscribed(A)
        assert table.join(Waiter(A)) is True

    def test_unsubscribed_channels_are_not_kept(self) -> None:
        """Channels whose idle UNSUBSCRIBE was confirmed leave the table, so it does not grow with every key."""
        table = ChannelTable()
        for n in range(100):
            waiter = Waiter(b"ns:{order:%d}:wake:w1" % n)
            table.join(waiter)
            table.reply(b"subscribe", waiter.channel)
            table.leave(waiter, 0.0)
        assert len(table.idle(IDLE_UNSUBSCRIBE)) == 100
        for n in range(100):
            assert table.reply(b"unsubscribe", b"ns:{order:%d}:wake:w1" % n) is True
        assert table._channels == {}

    def test_reply_for_an_unknown_channel_changes_nothing(self) -> None:
        """A confirmation for a channel the table does not know is ignored."""
        table = ChannelTable()
        assert table.reply(b"subscribe", A) is False
        assert not table.subscribed(A)
        assert table.join(Waiter(A)) is True


class TestIdle:
    def test_channel_with_waiters_is_never_idle(self) -> None:
        """A subscribed channel someone waits on is not unsubscribed, however late it is."""
        table, _ = subscribed_table(A)
        assert table.idle(1e9) == []

    @pytest.mark.parametrize("short", [0.0, IDLE_UNSUBSCRIBE / 2, IDLE_UNSUBSCRIBE - 0.001])
    def test_not_idle_before_the_idle_period(self, short: float) -> None:
        """A channel left by its last waiter is kept until IDLE_UNSUBSCRIBE seconds have passed."""
        table, (first,) = subscribed_table(A)
        table.leave(first, 50.0)
        assert table.idle(50.0 + short) == []
        assert table.subscribed(A)

    def test_idle_after_the_idle_period_once(self) -> None:
        """After IDLE_UNSUBSCRIBE idle seconds the channel is named once, and then counts as unsubscribed."""
        table, (first,) = subscribed_table(A)
        table.leave(first, 50.0)
        assert table.idle(50.0 + IDLE_UNSUBSCRIBE) == [A]
        assert table.idle(50.0 + 2 * IDLE_UNSUBSCRIBE) == []
        assert not table.subscribed(A)

    def test_idle_period_counts_from_the_last_leave(self) -> None:
        """The idle period restarts when the last of several waiters leaves."""
        table, (first,) = subscribed_table(A)
        second = Waiter(A)
        table.join(second)
        table.leave(first, 0.0)
        table.leave(second, IDLE_UNSUBSCRIBE)
        assert table.idle(IDLE_UNSUBSCRIBE + 1.0) == []
        assert table.idle(2 * IDLE_UNSUBSCRIBE) == [A]

    def test_rejoined_channel_is_not_idle(self) -> None:
        """A waiter that joins again before the idle period ends keeps the subscription."""
        table, (first,) = subscribed_table(A)
        table.leave(first, 0.0)
        assert table.join(Waiter(A)) is False
        assert table.idle(10 * IDLE_UNSUBSCRIBE) == []

    def test_pending_subscribe_is_not_unsubscribed(self) -> None:
        """A channel whose SUBSCRIBE is unanswered is not unsubscribed even when nobody waits."""
        table = ChannelTable()
        waiter = Waiter(A)
        table.join(waiter)
        table.leave(waiter, 0.0)
        assert table.idle(10 * IDLE_UNSUBSCRIBE) == []

    def test_only_idle_channels_are_named(self) -> None:
        """Of two subscribed channels, only the one without waiters is unsubscribed."""
        table, (a, _b) = subscribed_table(A, B)
        table.leave(a, 0.0)
        assert table.idle(IDLE_UNSUBSCRIBE) == [A]
        assert table.subscribed(B)


class TestMessage:
    def test_message_wakes_exactly_that_channels_waiters(self) -> None:
        """A release message on one channel wakes each of its waiters once and nobody else."""
        table, (a1, b1) = subscribed_table(A, B)
        a2 = Waiter(A)
        table.join(a2)
        wake(table, A)
        assert (a1.woken, a2.woken, b1.woken) == (1, 1, 0)

    def test_message_skips_waiters_that_left(self) -> None:
        """A waiter that left the channel is not woken by later messages."""
        table, (a1,) = subscribed_table(A)
        a2 = Waiter(A)
        table.join(a2)
        table.leave(a1, 0.0)
        wake(table, A)
        assert (a1.woken, a2.woken) == (0, 1)

    def test_message_on_an_unknown_channel_wakes_nobody(self) -> None:
        """A message for a channel the table does not know returns no waiters."""
        table, (a1,) = subscribed_table(A)
        assert table.message(B) == []
        assert a1.woken == 0


class TestReset:
    def test_reset_returns_every_waiter_made_inactive(self) -> None:
        """reset() hands back all waiters of all channels, each marked inactive."""
        table, waiters = subscribed_table(A, B)
        pending = Waiter(b"ns:{c}:wake:w1")
        table.join(pending)
        returned = table.reset()
        assert set(returned) == {*waiters, pending}
        assert len(returned) == 3
        assert not any(waiter.active for waiter in returned)

    def test_reset_forgets_everything(self) -> None:
        """After reset() nothing is subscribed, messages wake nobody, and the next waiter subscribes again."""
        table, (a1, _b1) = subscribed_table(A, B)
        table.reset()
        assert not table.subscribed(A)
        assert not table.subscribed(B)
        assert table.message(A) == []
        assert table.idle(10 * IDLE_UNSUBSCRIBE) == []
        assert table.reset() == []
        assert table.join(Waiter(A)) is True
        assert table.reply(b"subscribe", A) is True
        wake(table, A)
        assert a1.woken == 0


class TestPendingWake:
    """A wake-up that arrives while no local waiter listens (the waiter queued with its attempt,
    then the release came before it registered) is kept PENDING_WAKE seconds for the next one."""

    @pytest.mark.parametrize("delay", [0.0, PENDING_WAKE / 2, PENDING_WAKE * 0.999])
    def test_message_for_nobody_wakes_the_next_waiter_within_pending_wake(self, delay: float) -> None:
        """A message on a channel with no waiters wakes, once, the next waiter that joins within PENDING_WAKE."""
        table = vacated_table()
        assert table.message(A, 100.0) == []
        late = Waiter(A)
        assert table.join(late, 100.0 + delay) is False
        assert late.woken == 1
        assert table.subscribed(A)

    @pytest.mark.parametrize("delay", [PENDING_WAKE, PENDING_WAKE * 1.001, 10 * PENDING_WAKE])
    def test_message_for_nobody_is_forgotten_after_pending_wake(self, delay: float) -> None:
        """A waiter that joins PENDING_WAKE or more after the message is not woken by it."""
        table = vacated_table()
        assert table.message(A, 100.0) == []
        later = Waiter(A)
        table.join(later, 100.0 + delay)
        assert later.woken == 0

    def test_a_kept_wake_up_wakes_only_one_waiter(self) -> None:
        """The kept wake-up is used up by the first waiter that joins; a second one is not woken."""
        table = vacated_table()
        table.message(A, 100.0)
        first, second = Waiter(A), Waiter(A)
        table.join(first, 100.1)
        table.join(second, 100.1)
        assert (first.woken, second.woken) == (1, 0)

    def test_a_delivered_message_is_not_kept(self) -> None:
        """A message that woke a waiter leaves nothing pending: the next waiter to join is not woken."""
        table, (first,) = subscribed_table(A)
        wake(table, A, 100.0)
        second = Waiter(A)
        table.join(second, 100.1)
        assert (first.woken, second.woken) == (1, 0)

    def test_a_kept_wake_up_stays_on_its_channel(self) -> None:
        """A wake-up kept for channel A does not wake a waiter joining channel B."""
        table, (a1, b1) = subscribed_table(A, B)
        table.leave(a1, 0.0)
        table.leave(b1, 0.0)
        table.message(A, 100.0)
        on_b, on_a = Waiter(B), Waiter(A)
        table.join(on_b, 100.1)
        table.join(on_a, 100.1)
        assert (on_b.woken, on_a.woken) == (0, 1)

    def test_a_message_on_an_unknown_channel_is_not_kept(self) -> None:
        """A message for a channel the table does not know (never subscribed, or reset) wakes no later waiter."""
        table = ChannelTable()
        assert table.message(A, 100.0) == []
        joiner = Waiter(A)
        assert table.join(joiner, 100.1) is True
        assert joiner.woken == 0
