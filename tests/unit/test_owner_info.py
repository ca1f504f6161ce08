"""The owner record (lockaspect.owner) and how the operator tools read the store's answer
(lockaspect.info): pure, no store."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest

from lockaspect import ConfigurationError
from lockaspect.backends.base import HolderState, KeyState
from lockaspect.info import Holder, check_kind, infos_from, pick
from lockaspect.owner import ORIGIN, owner_record, parse_owner


def test_a_record_is_compact_json_with_every_field() -> None:
    record = owner_record("order:1")
    fields = json.loads(record)
    assert set(fields) == {"host", "pid", "thread", "function", "template", "acquired_at"}
    assert fields["pid"] == os.getpid()
    assert fields["thread"] == threading.current_thread().name
    assert fields["function"] is None
    assert " " not in record.replace(fields["host"], "").replace(fields["thread"], "")


def test_the_origin_counts_only_for_the_decorated_calls_keys() -> None:
    token = ORIGIN.set((("Shop.order", "order:<id>"), "order:1"))
    try:
        assert parse_owner(owner_record("order:1"))["function"] == "Shop.order"
        assert parse_owner(owner_record("other"))["function"] is None
    finally:
        ORIGIN.reset(token)
    token = ORIGIN.set((("move", "a:<x>, b:<y>"), ("a:1", "b:2")))
    try:
        assert parse_owner(owner_record("b:2"))["template"] == "a:<x>, b:<y>"
    finally:
        ORIGIN.reset(token)


def test_a_task_name_replaces_the_thread_name() -> None:
    assert parse_owner(owner_record("k", "billing-7"))["thread"] == "billing-7"


@pytest.mark.parametrize("junk", ["", "1", "not json", "[1, 2]", b"\xff\xfe", None])
def test_what_is_not_a_record_reads_as_none(junk: object) -> None:
    assert parse_owner(junk) == {}  # type: ignore[arg-type]


def test_a_holder_without_a_record() -> None:
    holder = Holder.from_state(HolderState("a" * 32, "1", None, 7), "lock")
    assert (holder.host, holder.pid, holder.function) == (None, None, None)
    assert holder.remaining == math.inf
    assert holder.token_prefix == "a" * 8
    assert holder.to_dict()["remaining"] is None


def test_a_record_with_wrong_types_is_not_trusted() -> None:
    record = json.dumps({"host": 1, "pid": "x", "acquired_at": True, "thread": "t"})
    holder = Holder.from_state(HolderState("t" * 32, record, 1.5, 3), "lock")
    assert (holder.host, holder.pid, holder.acquired_at, holder.thread) == (None, None, None, "t")


def test_a_writer_with_readers_is_one_rw_lock_listed_after_the_lock() -> None:
    states = [
        KeyState("k", "semaphore", 1, 5.0, 9, 0, 3, (HolderState("s" * 32, "", 5.0, 9, 2),)),
        KeyState("k", "read", 1, 4.0, 8, 1, None, (HolderState("r" * 32, "", 4.0, 8),)),
        KeyState("k", "write", 1, 6.0, 7, 1, None, (HolderState("w" * 32, "", 6.0, 7),)),
        KeyState("k", "lock", 1, 2.0, 3, 0, None, ()),  # a value lockaspect did not write
    ]
    lock, rw, sem = infos_from("k", states)
    assert (lock.kind, lock.holders, lock.unknown_holders) == ("lock", (), 1)
    assert rw.kind == "rw"
    assert [holder.kind for holder in rw.holders] == ["read", "write"]
    assert (rw.remaining, rw.fencing_token, rw.waiters) == (6.0, 8, 1)
    assert (sem.permits, sem.in_use) == (3, 2)
    assert pick([lock, rw, sem], check_kind("semaphore")) is sem
    assert pick([lock, rw, sem], check_kind("write")) is rw
    assert pick([lock, rw, sem], None) is lock
    assert pick([rw], check_kind("fair")) is None


def test_an_unknown_kind_filter_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        check_kind("mutex")
