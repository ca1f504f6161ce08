"""Owner records: who holds a lock, as the store keeps it with the hold.

Every acquisition sends a compact JSON object with the hold (``AcquireRequest.owner``)::

    {"host": "web-3", "pid": 4121, "thread": "MainThread", "function": "create_order",
     "template": "order:<user.id>", "acquired_at": 1795500000.123}

``function`` and ``template`` are the decorated function's qualified name and key template
(``null`` for ``client.lock``); ``thread`` is the thread's name, or the asyncio task's. The
operator tools (:meth:`LockClient.describe <lockaspect.LockClient.describe>`, the
``lockaspect`` command) read it back. A client made with ``owner_info=False`` sends ``""``
and the store records nothing.

Building a record is on the hot path: everything but the thread's name and the time is cached
per (function, template), so a record costs one dictionary lookup, quoting the name, and one
float formatting.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextvars import ContextVar
from json.encoder import encode_basestring
from typing import Any

__all__ = ["ORIGIN", "Origin", "owner_record", "parse_owner", "template_of"]

#: ``(function, template)`` of a decorated function.
Origin = tuple[str, "str | None"]
#: The decorated call running in this context: its origin and the key(s) it locks, set by the
#: aspect around the call; an acquisition of another key in its body (``client.lock``) is not
#: the decorated call's and records no function.
ORIGIN: ContextVar[tuple[Origin, str | tuple[str, ...]] | None] = ContextVar("lockaspect_origin", default=None)

_CACHE_LIMIT = 4096
# Per origin: the record's text before and after the thread's name. Keyed by origin alone: a
# key per thread name would miss for every asyncio task (task-1, task-2, ...) and churn.
_heads: dict[Origin | None, tuple[str, str]] = {}
_host = socket.gethostname()
_pid = os.getpid()


def _head(origin: Origin | None) -> tuple[str, str]:
    function, template = origin if origin is not None else (None, None)
    fields = {"host": _host, "pid": _pid, "thread": "", "function": function, "template": template}
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)[:-1] + ',"acquired_at":'
    before, after = text.split(',"thread":"",', 1)
    if len(_heads) >= _CACHE_LIMIT:
        _heads.clear()
    head = _heads[origin] = (before + ',"thread":', "," + after)
    return head


def owner_record(key: str, thread: str | None = None) -> str:
    """The owner record of an acquisition of ``key`` made now by this context (``thread``: the
    asyncio task's name; default the current thread's)."""
    if thread is None:
        thread = threading.current_thread().name
    call = ORIGIN.get()
    origin = None
    if call is not None:
        keys = call[1]
        if key == keys or (isinstance(keys, tuple) and key in keys):
            origin = call[0]
    head = _heads.get(origin)
    if head is None:
        head = _head(origin)
    # encode_basestring is what json.dumps(ensure_ascii=False) quotes a str with (in C).
    return f"{head[0]}{encode_basestring(thread)}{head[1]}{time.time():.3f}}}"


def template_of(key: str) -> str:
    """The key template of the decorated call running in this context when it locks ``key``
    (its qualified name when the key is a callable; the templates joined by ``", "`` for a
    multi-key call), else ``""``: a label for metrics, never the rendered key."""
    call = ORIGIN.get()
    if call is None:
        return ""
    (function, template), keys = call
    if key == keys or (isinstance(keys, tuple) and key in keys):
        return function if template is None else template
    return ""


def parse_owner(record: str | bytes | None) -> dict[str, Any]:
    """The fields of an owner record (``{}`` for none, or for a value that is not one: a
    store written by an older version, or by hand)."""
    if not record:
        return {}
    try:
        fields = json.loads(record)
    except (ValueError, UnicodeDecodeError):
        return {}
    return fields if isinstance(fields, dict) else {}


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    _heads.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
