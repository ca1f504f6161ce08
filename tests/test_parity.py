"""The sync and async twins expose the same names and parameters.

The engine's decisions are shared (lockaspect.engine.core and .waiting); the runners only do
the round trips. These checks keep the twins from drifting apart: a method added to one runner
or store protocol must be added to the other, or named here with the reason it has no twin.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from lockaspect.backends.base import AsyncNotifier, AsyncStore, Notifier, Store
from lockaspect.blocks import LockBlock, MultiLockBlock
from lockaspect.engine.aio import AsyncRunner
from lockaspect.engine.sync import SyncRunner

#: Methods with no twin, and why.
SYNC_ONLY = {
    "unqueue": "the async runner leaves queues in a shielded task (_quietly)",
    "release_abandoned": "the watchdog thread's sweep releases abandoned holds (threads only)",
    "release_vanished": "the watchdog thread releases leases nobody holds (threads only)",
    "release_when_done": "an executor's body that outlived its caller (async bodies are tasks)",
}
ASYNC_ONLY = {
    "state": "the per-event-loop store and waiter slots",
    "close_loop": "closing the running loop's connections",
}
#: Parameters only the async twin takes: its loop's state.
ASYNC_EXTRA_PARAMETERS = {"state"}
#: Parameters only the sync twin takes: the executor a sync body runs in (an async body is a task).
SYNC_EXTRA_PARAMETERS = {"executor"}

STORE_SYNC_ONLY = {
    "wait_for_replicas": "configured once on the sync store; its async twins copy it",
    "asyncio_twin": "made from the sync store",
    "threads": "async stores start no threads",
    "reset_after_fork": "async stores belong to one loop of one process",
    "close": "the async twin closes with aclose()",
}
STORE_ASYNC_ONLY = {"aclose": "the async twin of close()"}


def _public(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (inspect.isfunction(member) or inspect.iscoroutinefunction(member))
    }


def _parameters(function: Any, drop: set[str]) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name not in drop]


def test_the_runners_have_the_same_methods() -> None:
    sync, aio = _public(SyncRunner), _public(AsyncRunner)
    assert set(sync) - set(SYNC_ONLY) == set(aio) - set(ASYNC_ONLY)
    assert set(SYNC_ONLY) <= set(sync)
    assert set(ASYNC_ONLY) <= set(aio)


@pytest.mark.parametrize("name", sorted(set(_public(SyncRunner)) - set(SYNC_ONLY)))
def test_runner_twins_take_the_same_parameters_and_one_is_awaited(name: str) -> None:
    sync, aio = getattr(SyncRunner, name), getattr(AsyncRunner, name)
    assert _parameters(sync, SYNC_EXTRA_PARAMETERS) == _parameters(aio, ASYNC_EXTRA_PARAMETERS)
    plain = {"reset_after_fork"}  # bookkeeping, no I/O
    assert inspect.iscoroutinefunction(aio) == (name not in plain)
    assert not inspect.iscoroutinefunction(sync)


def _protocol_members(protocol: type) -> dict[str, Any]:
    return {
        name: getattr(protocol, name)
        for name in dir(protocol)
        if not name.startswith("_") and callable(getattr(protocol, name))
    }


def test_the_store_protocols_are_twins() -> None:
    sync, aio = _protocol_members(Store), _protocol_members(AsyncStore)
    assert set(sync) - set(STORE_SYNC_ONLY) == set(aio) - set(STORE_ASYNC_ONLY)
    for name in set(sync) - set(STORE_SYNC_ONLY):
        assert _parameters(sync[name], set()) == _parameters(aio[name], set()), name
    blocking = {"acquire", "release", "reenter", "renew", "unqueue"}
    for name in blocking:
        assert inspect.iscoroutinefunction(aio[name]), name


def test_the_notifier_protocols_are_twins() -> None:
    sync, aio = _protocol_members(Notifier), _protocol_members(AsyncNotifier)
    assert set(sync) - {"close"} == set(aio)
    for name in aio:
        assert _parameters(sync[name], set()) == _parameters(aio[name], set()), name


@pytest.mark.parametrize("block", [LockBlock, MultiLockBlock])
def test_blocks_enter_and_exit_both_ways(block: type) -> None:
    assert _parameters(block.__exit__, set()) == _parameters(block.__aexit__, set())
    assert inspect.iscoroutinefunction(block.__aenter__)
    assert inspect.iscoroutinefunction(block.__aexit__)
