"""How locks read in a table: durations, holders, and the rows of ``list`` and ``inspect``
(pure functions of :class:`~lockaspect.LockInfo`)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from ._table import Column

if TYPE_CHECKING:
    from ..info import Holder, LockInfo

__all__ = ["LIST_COLUMNS", "detail_rows", "duration", "holder_label", "list_rows", "who"]

#: ``lockaspect list``'s columns: the key and the holder shrink to fit the width.
LIST_COLUMNS = (
    Column("KEY", flexible=True, min_width=8),
    Column("KIND", min_width=4),
    Column("HOLDER", flexible=True, min_width=12),
    Column("FENCE", right=True),
    Column("LEFT", right=True),
    Column("WAIT", right=True),
)


def duration(seconds: float) -> str:
    """``12.3s``, ``4m05s``, ``2h03m``; ``session`` for a hold that lasts as long as its
    holder's session (ZooKeeper, PostgreSQL advisory locks) or has no expiry."""
    if math.isinf(seconds):
        return "session"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def short_function(qualname: str) -> str:
    """The end of a qualified name, which a narrow column would cut off: its last two parts
    (``OrderService.create_order``), or the last alone when those are long."""
    parts = [part for part in qualname.split(".") if part != "<locals>"]
    name = ".".join(parts[-2:])
    return name if len(name) <= 30 else parts[-1]


def holder_label(holder: Holder) -> str:
    """``host/pid function`` (``?`` for what the store did not record; the thread or task
    when no decorated function took it; the function's name without its module, see
    :func:`short_function`), ``xN`` for a holder of N permits."""
    where = f"{holder.host or '?'}/{'?' if holder.pid is None else holder.pid}"
    what = short_function(holder.function) if holder.function else (holder.thread or "")
    label = f"{where} {what}".rstrip()
    if holder.permits > 1:
        label += f" x{holder.permits}"
    return label


def who(info: LockInfo) -> list[str]:
    """One line per holder: ``kind: host/pid function (fencing token N, token abcd1234…)``."""
    lines = [
        f"{holder.kind}: {holder_label(holder)} (fencing token {_dash(holder.fencing_token)}, "
        f"token {holder.token_prefix}…)"
        for holder in info.holders
    ]
    if info.unknown_holders:
        lines.append(f"{info.kind}: {info.unknown_holders} holder(s) lockaspect did not record")
    return lines


def _kind(info: LockInfo) -> str:
    if info.kind == "semaphore":
        return f"sem {info.in_use}/{'?' if info.permits is None else info.permits}"
    return info.kind


def list_rows(infos: list[LockInfo]) -> list[list[str]]:
    """``list``'s rows: one per holder, the key's own cells on its first row."""
    rows: list[list[str]] = []
    for info in infos:
        first = True
        for holder in info.holders:
            kind = holder.kind if info.kind == "rw" else (_kind(info) if first else "")
            rows.append(
                [
                    info.key if first else "",
                    kind,
                    holder_label(holder),
                    _dash(holder.fencing_token),
                    duration(holder.remaining),
                    str(info.waiters) if first else "",
                ]
            )
            first = False
        if info.unknown_holders or not info.holders:
            rows.append(
                [
                    info.key if first else "",
                    _kind(info) if first else "",
                    f"({info.unknown_holders} not recorded by lockaspect)",
                    _dash(info.fencing_token) if first else "",
                    duration(info.remaining) if first else "",
                    str(info.waiters) if first else "",
                ]
            )
    return rows


def _when(acquired_at: float | None, now: float) -> str:
    if acquired_at is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(acquired_at))
    return f"{stamp} ({duration(max(0.0, now - acquired_at))} ago)"


def detail_rows(info: LockInfo, now: float | None = None) -> list[list[str]]:
    """``inspect``'s label/value rows: the lock, then each holder."""
    now = time.time() if now is None else now
    rows = [
        ["key", info.key],
        ["kind", info.kind],
        ["holders", str(len(info.holders) + info.unknown_holders)],
    ]
    if info.kind == "semaphore":
        rows.append(["permits", f"{info.in_use} in use of {_dash(info.permits)}"])
    rows += [
        ["waiters", str(info.waiters)],
        ["fencing token", _dash(info.fencing_token)],
        ["remaining", duration(info.remaining)],
    ]
    if info.unknown_holders:
        rows.append(["not recorded", f"{info.unknown_holders} holder(s) whose value lockaspect did not write"])
    for number, holder in enumerate(info.holders, 1):
        rows += [
            ["", ""],
            [f"holder {number}", holder.kind + (f" ({holder.permits} permits)" if holder.permits > 1 else "")],
            ["  host", holder.host or "?"],
            ["  pid", "?" if holder.pid is None else str(holder.pid)],
            ["  thread/task", holder.thread or "?"],
            ["  function", holder.function or "-"],
            ["  template", holder.template or "-"],
            ["  acquired at", _when(holder.acquired_at, now)],
            ["  fencing token", _dash(holder.fencing_token)],
            ["  token", holder.token_prefix + "…"],
            ["  remaining", duration(holder.remaining)],
        ]
    return rows
