"""Fenced writes: the resource refuses a writer whose fencing token is older than one it saw."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis.asyncio

from lockaspect import BackendError, LockClient, LockLost
from lockaspect.fencing import AsyncRedisFence, RedisFence
from lockaspect.testing import LockServer


class TestRedisFence:
    def test_older_tokens_are_rejected_and_equal_ones_pass(self, lock_server: LockServer, namespace: str) -> None:
        """A write with a token below the high-water mark is refused; the same token may write again."""
        with lock_server.redis() as raw:
            fence = RedisFence(raw, namespace=namespace)
            assert fence.write("ledger", "first", 10)
            assert not fence.write("ledger", "stale", 9)
            assert fence.write("ledger", "again", 10)
            assert fence.write("ledger", "newer", 11)
            assert fence.read("ledger") == b"newer"
            assert fence.high_water("ledger") == 11

    def test_a_stale_lock_holder_cannot_overwrite_a_newer_one(self, client: LockClient, raw: Any) -> None:
        """The holder whose lock was taken over cannot write after the new holder did."""
        fence = RedisFence.for_client(client, namespace=client.backend.namespace + "fenced:")
        newer: dict[str, int] = {}

        def new_holder() -> None:  # another thread: its own context, so a holder of its own
            with client.lock("ledger", lease=5) as lease:
                newer["token"] = lease.fencing_token
                assert fence.write("ledger", "by new", lease.fencing_token)

        def old_holder() -> None:
            with client.lock("ledger", lease=5) as old:
                raw.delete(client.backend.lock_key("ledger"))  # the old lease is gone (say, it expired)
                thread = threading.Thread(target=new_holder)
                thread.start()
                thread.join()
                assert newer["token"] > old.fencing_token
                assert not fence.write("ledger", "by old", old.fencing_token)

        with pytest.raises(LockLost):  # and the old holder is told, at the end of its block
            old_holder()
        assert fence.read("ledger") == b"by new"

    def test_token_must_be_an_int(self, raw: Any, namespace: str) -> None:
        """A fencing token of another type is a TypeError, before any write."""
        fence = RedisFence(raw, namespace=namespace)
        with pytest.raises(TypeError):
            fence.write("ledger", "x", True)
        with pytest.raises(TypeError):
            fence.write("ledger", "x", "12")  # type: ignore[arg-type]
        assert fence.read("ledger") is None

    def test_a_dead_server_is_a_backend_error(self, fresh_server: LockServer) -> None:
        """A fenced write to a server that went away raises BackendError, chained."""
        raw = fresh_server.redis(socket_timeout=1)
        fence = RedisFence(raw)
        fresh_server.kill()
        with pytest.raises(BackendError) as excinfo:
            fence.write("ledger", "x", 1)
        assert excinfo.value.__cause__ is not None
        raw.close()


class TestAsyncRedisFence:
    def test_the_async_fence_behaves_like_the_sync_one(self, lock_server: LockServer, namespace: str) -> None:
        """AsyncRedisFence refuses older tokens, survives SCRIPT FLUSH, and reads back, all awaited."""

        async def scenario() -> tuple[list[bool], bytes | None, int | None]:
            client = redis.asyncio.Redis.from_url(lock_server.url)
            try:
                fence = AsyncRedisFence(client, namespace=namespace)
                results = [await fence.write("acc", "a", 5), await fence.write("acc", "b", 4)]
                await client.script_flush()
                results.append(await fence.write("acc", "c", 6))
                return results, await fence.read("acc"), await fence.high_water("acc")
            finally:
                await client.aclose()

        assert asyncio.run(scenario()) == ([True, False, True], b"c", 6)
