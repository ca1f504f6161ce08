"""Where a lock lives in ZooKeeper, and who holds it: pure functions, no I/O.

Layout (under the URL's chroot)::

    /<namespace>                          persistent, made once
    /<namespace>/<key>                    a container node per key (the server removes it
                                          once its last child is gone)
    /<namespace>/<key>/_c_<uuid>-<kind>-<seq>
                                          an ephemeral sequential contender node per holder
                                          or waiter; data: its token and owner
                                          record (see :mod:`._record`)

``<kind>`` is ``lock`` (plain and fair locks, and each key of a multi-key lock), ``read``,
``write``, or ``sem.<permits>`` (a semaphore contender, with the number of permits it
expects; ``sem.<permits>w<weight>`` when it takes several at once: the admission counts
weights from the names alone, with no read of any node's data). Each family decides among
its own nodes only: a plain lock, a read-write lock and a semaphore of one name never
exclude each other (as in every lockaspect store).

The ``_c_<uuid>-`` prefix is Curator's "protected" name: a create whose reply was lost (the
connection dropped) is found again by its uuid and deleted, never orphaned.

Order is the sequence suffix, which the server keeps as a signed 32-bit counter per parent:
it wraps (``2147483647`` is followed by ``-2147483648``). :func:`ordered` sorts by the
unsigned value in serial-number arithmetic (the live contenders of a key always lie within a
window far smaller than 2**31), so a wrap never reorders the queue.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = [
    "Contender",
    "Verdict",
    "contender_prefix",
    "decide",
    "decode_key",
    "encode_key",
    "family_of",
    "holders",
    "infix_of",
    "ordered",
    "parse",
    "root_path",
]

_NAME = re.compile(r"^_c_([0-9a-f]{32})-(lock|read|write|sem\.(\d{1,9})(?:w(\d{1,9}))?)-(-?\d{1,10})$")
# Characters kept as they are in a node name; anything else is %XX-escaped (UTF-8).
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:@+=,~!$&'()*;")
_WRAP = 1 << 32


@functools.lru_cache(maxsize=4096)
def encode_key(key: str) -> str:
    """``key`` as one node name: ``/``, ``%``, spaces and controls %-escaped, ``.`` and
    ``..`` (which ZooKeeper refuses) escaped too. Reversible with :func:`decode_key`."""
    if key in ("", ".", ".."):
        return "".join(f"%{b:02X}" for b in key.encode()) or "%"
    out = []
    for ch in key:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def decode_key(name: str) -> str:
    """The key of node name ``name`` (:func:`encode_key` reversed)."""
    if name == "%":
        return ""
    if "%" not in name:
        return name
    raw = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%" and _is_hex(name[i + 1 : i + 3]):
            raw.append(int(name[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(name[i].encode("utf-8"))
            i += 1
    return raw.decode("utf-8", errors="replace")


def _is_hex(text: str) -> bool:
    return len(text) == 2 and all(c in "0123456789abcdefABCDEF" for c in text)


def root_path(namespace: str) -> str:
    """The namespace's node: ``lockaspect:`` becomes ``/lockaspect``."""
    name = namespace.rstrip(":")
    return "/" + encode_key(name) if name else "/lockaspect"


def infix_of(kind: str, permits: int | None, weight: int = 1) -> str:
    """The kind part of a contender's name (a semaphore's of weight 1 is the previous
    version's name: both versions count it alike)."""
    if kind in ("lock", "fair"):
        return "lock"
    if kind == "semaphore":
        return f"sem.{permits}" if weight == 1 else f"sem.{permits}w{weight}"
    return kind


def family_of(infix: str) -> str:
    """Which contenders a node decides among: ``lock``, ``rw`` or ``sem``."""
    if infix == "lock":
        return "lock"
    if infix in ("read", "write"):
        return "rw"
    return "sem"


def contender_prefix(uuid: str, infix: str) -> str:
    """The name a contender node is created with (the server appends the sequence)."""
    return f"_c_{uuid}-{infix}-"


class Contender(NamedTuple):
    """One contender node, as listed."""

    name: str
    uuid: str
    infix: str
    seq: int  # unsigned 32-bit
    weight: int = 1  # permits it takes (semaphores)

    @property
    def family(self) -> str:
        return family_of(self.infix)

    @property
    def permits(self) -> int | None:
        return int(self.infix[4:].split("w", 1)[0]) if self.infix.startswith("sem.") else None


@functools.lru_cache(maxsize=4096)
def parse(name: str) -> Contender | None:
    """The contender ``name`` names, or ``None`` for a node lockaspect did not make (cached:
    a waiter reads the same names at each attempt)."""
    match = _NAME.match(name)
    if match is None:
        return None
    weight = int(match.group(4)) if match.group(4) else 1
    return Contender(name, match.group(1), match.group(2), int(match.group(5)) % _WRAP, weight)


def ordered(children: Iterable[str], family: str | None = None) -> list[Contender]:
    """The contenders among ``children`` (of ``family`` if given), in queue order."""
    found = [c for c in map(parse, children) if c is not None and (family is None or c.family == family)]
    if len(found) < 2:
        return found
    found.sort(key=lambda c: c.seq)
    # Start after the largest gap between neighbours (circularly): the wrap point if the
    # counter wrapped, else the gap from the highest back round to the lowest.
    best, start = -1, 0
    for i, c in enumerate(found):
        gap = (c.seq - found[i - 1].seq) % _WRAP
        if gap > best:
            best, start = gap, i
    return found[start:] + found[:start]


class Verdict(NamedTuple):
    """What a contender's place in the queue means.

    Attributes:
        holds: It holds the lock (or a permit).
        watch: When not: the node name to watch for its deletion (a predecessor), or ``""``:
            watch the list of children and the key's permits (the first semaphore waiter,
            which waits for holders to leave or for more permits).
        permits: Semaphores: the permits the earliest contender expects (what this one must
            agree with), else ``None``.
        ahead: How many contenders of its family are ahead of it.
    """

    holds: bool
    watch: str | None
    permits: int | None = None
    ahead: int = 0


def decide(queue: Sequence[Contender], mine: str, *, ignore: str = "", permits: int | None = None) -> Verdict | None:
    """The verdict for contender ``mine`` in ``queue`` (one family, in order), or ``None`` if
    it is not there. ``ignore``: a node name that does not count (the write lock a reader
    holds itself, for a downgrade). ``permits``: the semaphore's permits when set by an
    operator (overrides what the contenders expect)."""
    index = -1
    for i, c in enumerate(queue):
        if c.name == mine:
            index = i
            break
    if index < 0:
        return None
    me = queue[index]
    ahead = [c for c in queue[:index] if c.name != ignore]
    if me.infix == "lock" or me.infix == "write":
        if not ahead:
            return Verdict(True, None, None, 0)
        return Verdict(False, ahead[-1].name, None, len(ahead))
    if me.infix == "read":
        writers = [c for c in ahead if c.infix == "write"]
        if not writers:
            return Verdict(True, None, None, len(ahead))
        return Verdict(False, writers[-1].name, None, len(ahead))
    # A semaphore contender holds if the permits taken ahead of it and its own fit: in queue
    # order (a heavy one first in line is not passed by lighter ones behind it), so the
    # holders are a prefix whose weights sum to at most the permits.
    expected = permits if permits is not None else (queue[0].permits or 0)
    used = sum(c.weight for c in ahead)
    if used + me.weight <= expected:
        return Verdict(True, None, expected, len(ahead))
    if used <= expected:  # every one ahead holds: any of them leaving may let it in
        return Verdict(False, "", expected, len(ahead))
    return Verdict(False, ahead[-1].name, expected, len(ahead))


def holders(queue: Sequence[Contender], permits: int | None = None) -> list[Contender]:
    """The contenders of ``queue`` (one family, in order) that hold it now."""
    if queue and queue[0].family == "sem":
        expected = permits if permits is not None else (queue[0].permits or 0)
        found, used = [], 0
        for c in queue:
            used += c.weight
            if used > expected:
                break
            found.append(c)
        return found
    found = []
    for c in queue:
        verdict = decide(queue, c.name, permits=permits)
        if verdict is not None and verdict.holds:
            found.append(c)
    return found
