"""The client never trusts a lease longer than the store keeps it, and says why it ended.

* What is sent is rounded UP to whole milliseconds (1.005 s was sent as 1004 ms), and the
  client's local end stays at or before the store's (``PEXPIRETIME``).
* ``on_lost`` runs before another process can take the lock: with the holder's connection
  black-holed, a second process polling the key eagerly gets it only after the hook ran.
* A lease ended by ``max_hold`` says ``"max-hold"`` everywhere: ``lease.check()``,
  ``lease.lost_reason``, the block's ``LockLost``, the hook.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from faults import FaultProxy

from lockaspect import LockClient, LockLost
from lockaspect.backends.redis import _ms
from lockaspect.testing import LockServer


def _local_end_wall(lease: Any) -> float:
    """The lease's local end (``expires_in`` from now) on the wall clock the server uses."""
    return time.time() + lease.expires_in


class TestWhatIsSent:
    @pytest.mark.parametrize(
        ("seconds", "ms"), [(1.005, 1005), (0.3, 300), (1.0, 1000), (0.0001, 1), (2.0004, 2001), (30.0, 30000)]
    )
    def test_seconds_are_rounded_up_to_milliseconds(self, seconds: float, ms: int) -> None:
        assert _ms(seconds) == ms

    @pytest.mark.parametrize("lease", [1.005, 1.0051, 0.7777, 2.0009])
    def test_a_fixed_lease_ends_locally_before_the_store_ends_it(
        self, make_client: Callable[..., LockClient], raw: Any, lease: float
    ) -> None:
        client = make_client()
        with client.lock("rounding", lease=lease) as held:
            local = _local_end_wall(held)
            server = raw.pexpiretime(client.backend.lock_key("rounding")) / 1000
        assert local <= server

    @pytest.mark.parametrize("max_hold", [1.0037, 0.9991])
    def test_a_max_hold_cut_lease_ends_locally_before_the_store_ends_it(
        self, make_client: Callable[..., LockClient], raw: Any, max_hold: float
    ) -> None:
        client = make_client(watchdog_lease=5.0)
        with client.lock("cut", max_hold=max_hold) as held:
            local = _local_end_wall(held)
            server = raw.pexpiretime(client.backend.lock_key("cut")) / 1000
        assert local <= server


#: Another process: polls the key as eagerly as it can, prints the wall time it first got it.
POLLER = """
import sys, time, redis
client = redis.Redis.from_url(sys.argv[1])
key = sys.argv[2]
client.ping()
print("ready", flush=True)
while not client.set(key, "other", nx=True, px=60000):
    pass
print(repr(time.time()), flush=True)
"""


class TestOnLostComesFirst:
    def test_on_lost_runs_before_a_polling_process_gets_the_lock(
        self, lock_server: LockServer, make_client: Callable[..., LockClient]
    ) -> None:
        hook_at: list[float] = []
        hooked = threading.Event()

        def on_lost(_: Any) -> None:
            hook_at.append(time.time())
            hooked.set()

        with FaultProxy(("127.0.0.1", lock_server.port)) as proxy:
            holder = make_client(url=proxy.url, watchdog_lease=1.0, tick=0.1, delay_weight=0.5, socket_timeout=5.0)
            key = holder.backend.lock_key("blackhole")
            poller = subprocess.Popen(
                [sys.executable, "-c", POLLER, lock_server.url, key], stdout=subprocess.PIPE, text=True
            )
            found: list[LockLost] = []

            def body() -> None:
                assert poller.stdout is not None
                with holder.lock("blackhole", on_lost=on_lost) as lease:
                    assert poller.stdout.readline().strip() == "ready"
                    proxy.hold()  # black-holed: no renewal reaches the store any more
                    proxy.hold_new()
                    assert hooked.wait(30)
                    found.append(_poll_until_lost(lease))

            try:
                with pytest.raises(LockLost):
                    body()
                stdout, _ = poller.communicate(timeout=60)  # the poller exits once it got the lock
            finally:
                if poller.poll() is None:
                    poller.kill()
                    poller.communicate()
                proxy.release()
        free_at = float(stdout.split()[-1])
        assert len(found) == 1
        assert hook_at[0] < free_at, "on_lost ran after another process took the lock"


def _poll_until_lost(lease: Any) -> LockLost:
    """A long synchronous body: work, and ``lease.check()`` between steps, until it raises."""
    while True:
        try:
            lease.check()
        except LockLost as exc:
            return exc
        time.sleep(0.01)  # a step of the body's work


class TestMaxHoldReason:
    def test_max_hold_is_the_reason_everywhere(self, make_client: Callable[..., LockClient]) -> None:
        client = make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        hooked: list[str | None] = []
        done = threading.Event()
        seen: list[Any] = []

        def on_lost(lease: Any) -> None:
            hooked.append(lease.lost_reason)
            done.set()

        def body() -> None:
            with client.lock("capped", max_hold=1.5, on_lost=on_lost) as lease:
                seen.append(_poll_until_lost(lease).reason)
                seen.append(lease.lost_reason)
                assert done.wait(30)

        with pytest.raises(LockLost) as exit_error:
            body()
        assert seen == ["max-hold", "max-hold"]
        assert exit_error.value.reason == "max-hold"
        assert hooked == ["max-hold"]

    def test_max_hold_reason_for_a_fixed_lease_cut_short(self, make_client: Callable[..., LockClient]) -> None:
        client = make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        seen: list[Any] = []

        def body() -> None:
            with client.lock("capped-fixed", lease=5.0, max_hold=0.5) as lease:
                seen.append(_poll_until_lost(lease).reason)

        with pytest.raises(LockLost) as exit_error:
            body()
        assert seen == ["max-hold"]
        assert exit_error.value.reason == "max-hold"
