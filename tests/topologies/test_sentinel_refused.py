"""A command refused by a demoted Sentinel master (READONLY) did not run: it is sent again to
the new master, and nothing undoes it (an undo of the first attempt, a release with the same
token, would race the retried acquire and could release the lock the caller now holds)."""

from __future__ import annotations

import asyncio

import pytest

from lockaspect import LockLost, LockNotAcquired
from lockaspect.backends.redis import sentinel as sentinel_module
from lockaspect.backends.redis._layout import SCRIPTS
from lockaspect.backends.redis._script import LuaScript
from lockaspect.testing import ValkeySentinel

from ._support import has_key, lock_key


def test_async_lock_acquired_through_the_demoted_retry_is_still_held(
    sentinel: ValkeySentinel, make, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failover happens within FOLLOW_EVERY of the store's last question to the
    # sentinels (any busy client): the kept connection is still on the old master.
    monkeypatch.setattr(sentinel_module, "FOLLOW_EVERY", 3600.0)
    client = make(sentinel.url)
    other = make(sentinel.url)
    name = lock_key(client, key)

    async def main() -> tuple[bool, bool, bool]:
        try:
            async with client.lock(key):
                pass  # leaves an idle connection on the (soon demoted) master
            # The replica has the scripts cached (it was master before, or any client loaded
            # them there): the retried EVALSHA runs at once, no NOSCRIPT round trip.
            [replica] = sentinel.replicas
            with replica.client() as direct:
                for script in SCRIPTS:
                    direct.script_load(LuaScript(script).source)
            new = await asyncio.to_thread(sentinel.failover, True)
            seen: list[bool] = []
            try:
                async with client.lock(key) as lease:
                    await asyncio.sleep(0.3)  # the spawned undo has long finished
                    seen.append(await asyncio.to_thread(has_key, new, name))
                    try:
                        async with other.lock(key):
                            seen.append(False)
                    except LockNotAcquired:
                        seen.append(True)
                    seen.append(lease.held)
            except LockLost:
                pass
            return seen[0], seen[1], seen[2]
        finally:
            await client.aclose()
            await other.aclose()

    still, exclusive, held = asyncio.run(main())
    assert exclusive, "another client got the lock while it was held"
    assert still, "the lock key is gone from the new master while the holder is in its body"
    assert held, "the lease was reported lost right after it was acquired"
