"""The operator tools and the owner records, on every store (see conftest): ``describe``,
``held_locks``, ``locked``, ``force_release`` (sync and asyncio), what each kind's holders look
like, and the evicted holder being told. Peer libraries' own scenarios for the per-lease API
are in test_peer_scenarios.py.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from lockaspect import (
    ConfigurationError,
    Holder,
    KeyTemplateError,
    Lease,
    LockClient,
    LockInfo,
    LockLost,
    distributed_lock,
)
from lockaspect.backends.base import Capability

from .conftest import ALL_KINDS, block, skip_unless_served

BOUND = 20.0


def session_bound(client: LockClient) -> bool:
    return bool(client.backend.capabilities & Capability.SESSION_BOUND)


def check_remaining(client: LockClient, holder: Holder | LockInfo, lease: float) -> None:
    if session_bound(client):
        assert holder.remaining == math.inf
    else:
        assert 0 < holder.remaining <= lease + 0.01


def check_owner(holder: Holder, lease: Lease, *, thread: str | None = None) -> None:
    assert holder.host == socket.gethostname()
    assert holder.pid == os.getpid()
    assert holder.thread == (thread or threading.current_thread().name)
    assert holder.fencing_token == lease.fencing_token
    assert 4 <= len(holder.token_prefix) < len(lease.token)
    assert lease.token.startswith(holder.token_prefix)
    assert holder.acquired_at is not None
    assert abs(holder.acquired_at - lease.acquired_at) < 60


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_describe_names_who_holds_each_kind(client: LockClient, kind: str) -> None:
    skip_unless_served(client, kind)
    assert client.describe("who") is None
    with block(client, kind, "who", lease=30) as held:
        lease = held.leases[0] if kind == "multi" else held
        info = client.describe("who")
        assert info is not None
        assert info.key == "who"
        assert info.kind == {"multi": "lock", "semaphore": "semaphore"}.get(kind, kind)
        (holder,) = info.holders
        check_owner(holder, lease)
        assert holder.function is None
        assert holder.template is None
        check_remaining(client, holder, 30)
        assert info.fencing_token == lease.fencing_token
        assert info.permits == (1 if kind == "semaphore" else None)
        assert client.locked("who")
    assert client.describe("who") is None
    assert not client.locked("who")


def test_a_decorated_call_records_its_function_and_template(client: LockClient) -> None:
    seen: list[LockInfo | None] = []

    @distributed_lock(key="order:<order_id>", client=client)
    def place(order_id: int) -> None:
        seen.append(client.describe(f"order:{order_id}"))
        with client.lock("inner"):  # another key in its body is not the decorated call's
            seen.append(client.describe("inner"))

    place(42)
    outer, inner = seen
    assert outer is not None
    assert inner is not None
    assert outer.holders[0].function == place.__qualname__
    assert outer.holders[0].template == "order:<order_id>"
    assert inner.holders[0].function is None


def test_several_readers_and_semaphore_holders_are_listed(client: LockClient) -> None:
    skip_unless_served(client, "read")
    skip_unless_served(client, "semaphore")
    done = threading.Event()
    ready = threading.Barrier(3)

    def read_in_thread() -> None:
        with client.rw_lock("rw").read(wait=BOUND), client.semaphore("sem", permits=3, wait=BOUND):
            ready.wait(BOUND)
            done.wait(BOUND)

    threads = [threading.Thread(target=read_in_thread, name=f"reader-{n}") for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        ready.wait(BOUND)
        readers = client.describe("rw")
        assert readers is not None
        assert readers.kind == "read"
        assert sorted(holder.thread or "" for holder in readers.holders) == ["reader-0", "reader-1"]
        sem = client.describe("sem", kind="semaphore")
        assert sem is not None
        assert sem.permits == 3
        assert sem.in_use == 2
        assert {holder.thread for holder in sem.holders} == {"reader-0", "reader-1"}
        assert client.permits("sem") == (3, 2)
    finally:
        done.set()
        for thread in threads:
            thread.join(BOUND)


def test_owner_info_false_records_nobody(make_client: Callable[..., LockClient]) -> None:
    client = make_client(owner_info=False)
    with client.lock("anon") as lease:
        info = client.describe("anon")
        assert info is not None
        (holder,) = info.holders
        assert (holder.host, holder.pid, holder.thread, holder.function) == (None, None, None, None)
        assert holder.fencing_token == lease.fencing_token


def test_held_locks_lists_the_namespace_by_pattern(client: LockClient) -> None:
    with client.lock("job:1"), client.lock("job:2"), client.lock("other"):
        assert sorted(info.key for info in client.held_locks("job:*")) == ["job:1", "job:2"]
        assert sorted(info.key for info in client.held_locks()) == ["job:1", "job:2", "other"]
        assert list(client.held_locks("nothing*")) == []
    assert list(client.held_locks()) == []


def test_force_release_evicts_the_holder_who_is_told(make_client: Callable[..., LockClient]) -> None:
    holder_client, operator = make_client(), make_client()
    lost = threading.Event()
    held = holder_client.lock("stuck", on_lost=lambda lease: lost.set())
    lease = held.__enter__()
    assert operator.force_release("stuck")
    assert not operator.locked("stuck")
    with operator.lock("stuck") as taker:  # free at once; the counter was not touched
        assert taker.fencing_token > lease.fencing_token
    assert lost.wait(BOUND)  # the holder's next renewal (or probe) found it gone
    with pytest.raises(LockLost) as caught:
        held.__exit__(None, None, None)
    assert caught.value.reason == "not-owner"
    assert not operator.force_release("stuck")


def test_force_release_wakes_a_waiter(make_client: Callable[..., LockClient]) -> None:
    holder_client, waiter_client, operator = make_client(), make_client(), make_client()
    got: list[int] = []
    held = holder_client.lock("wake")
    lease = held.__enter__()
    waiting = threading.Thread(target=lambda: got.append(_take(waiter_client, "wake")), name="waiter", daemon=True)
    waiting.start()
    assert operator.force_release("wake")
    waiting.join(BOUND)
    assert got
    assert got[0] > lease.fencing_token
    with pytest.raises(LockLost):  # its release finds the lock gone
        held.__exit__(None, None, None)


def _take(client: LockClient, key: str) -> int:
    with client.lock(key, wait=BOUND) as lease:
        return lease.fencing_token


def test_bad_input_is_refused_before_any_io(client: LockClient) -> None:
    with pytest.raises(KeyTemplateError):  # as client.lock(42)
        client.describe(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        client.describe("k", kind="mutex")
    with pytest.raises(TypeError):
        list(client.held_locks(7))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        list(client.held_locks("a{b}"))
    with pytest.raises(KeyTemplateError):
        client.force_release(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LockClient(client.backend, owner_info="yes")  # type: ignore[arg-type]


# -- asyncio --------------------------------------------------------------------------------------


def test_the_async_twins(make_client: Callable[..., LockClient]) -> None:
    holder_client, operator = make_client(), make_client()

    async def main() -> None:
        assert await operator.adescribe("a") is None
        assert not await operator.alocked("a")
        lease = await holder_client.aacquire("a", lease=30)
        info = await operator.adescribe("a")
        assert info is not None
        task = asyncio.current_task()
        assert task is not None
        check_owner(info.holders[0], lease, thread=task.get_name())
        assert await operator.alocked("a")
        assert [found.key async for found in operator.aheld_locks("a*")] == ["a"]
        assert await operator.aforce_release("a")
        assert not await operator.aforce_release("a")
        assert await operator.adescribe("a") is None
        with pytest.raises(LockLost):
            await lease.arelease()

    asyncio.run(main())


def test_a_task_records_its_name(client: LockClient) -> None:
    infos: list[Any] = []

    async def worker() -> None:
        async with client.lock("task-key"):
            infos.append(await client.adescribe("task-key"))

    async def main() -> None:
        await asyncio.create_task(worker(), name="billing-worker")

    asyncio.run(main())
    assert infos[0].holders[0].thread == "billing-worker"
