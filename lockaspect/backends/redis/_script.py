"""The Lua scripts as lockaspect sends them: :func:`load_script` (a script's text with its
includes), :class:`LuaScript` (its SHA1 and its calls, pre-packed) and the RESP packing the
wires share. No I/O of its own: a script runs over a wire (:mod:`._wire`, :mod:`._async_wire`)
or a redis-py client."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

if TYPE_CHECKING:
    from ._wire import _Undo, _Wire

__all__ = ["LuaScript", "load_script"]


def load_script(name: str) -> str:
    """The text of ``lockaspect/backends/redis/lua/<name>``, with each line ``-- include: <file>``
    replaced by that file's text (Lua scripts cannot load modules; shared helpers such as
    the fencing-counter seed live once, in lib.lua)."""
    lua = resources.files(__package__).joinpath("lua")
    lines = []
    for line in lua.joinpath(name).read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith(_INCLUDE):
            line = lua.joinpath(line[len(_INCLUDE) :].strip()).read_text(encoding="utf-8")
        lines.append(line)
    return "".join(lines)


_INCLUDE = "-- include: "


class LuaScript:
    """A script's text and SHA1, loaded once per backend instance. ``sharded``: the Redis
    Cluster variant, whose release wake-ups use ``SPUBLISH`` (the channel shares the lock's
    hash tag, so it is in the slot of the script's keys).

    Every way of running it sends ``EVALSHA`` first; on NOSCRIPT (after a ``SCRIPT FLUSH``,
    a failover, a restart) it loads the script and sends ``EVALSHA`` again, and when that
    meets NOSCRIPT too (another client flushing in a loop), ``EVAL`` with the full text,
    which cannot: NOSCRIPT never reaches the caller."""

    __slots__ = ("_eval_heads", "_heads", "name", "sha", "source")

    def __init__(self, name: str, *, sharded: bool = False) -> None:
        self.name = name
        self.source = load_script(name)
        if sharded:
            # Redis Cluster: wake-ups go out with SPUBLISH, to the subscribers of the slot's
            # own primary, instead of being broadcast to every node of the cluster.
            self.source = self.source.replace("'PUBLISH'", "'SPUBLISH'")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self._heads: dict[tuple[int, int], bytes] = {}
        self._eval_heads: dict[tuple[int, int], bytes] = {}

    def packed(self, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> bytes:
        """``EVALSHA sha numkeys keys... args...`` in the wire format."""
        shape = (len(keys), len(args))
        head = self._heads.get(shape)
        if head is None:
            head = b"*%d\r\n" % (3 + shape[0] + shape[1]) + _bulk(b"EVALSHA") + _bulk(self.sha.encode())
            head += _bulk(b"%d" % shape[0])
            self._heads[shape] = head
        return head + b"".join([_bulk(part) for part in keys + args])

    def packed_eval(self, keys: tuple[bytes, ...], args: tuple[bytes, ...]) -> bytes:
        """``EVAL source numkeys keys... args...`` in the wire format (the fallback that
        cannot meet NOSCRIPT)."""
        shape = (len(keys), len(args))
        head = self._eval_heads.get(shape)
        if head is None:
            head = b"*%d\r\n" % (3 + shape[0] + shape[1]) + _bulk(b"EVAL") + _bulk(self.source.encode())
            head += _bulk(b"%d" % shape[0])
            self._eval_heads[shape] = head
        return head + b"".join([_bulk(part) for part in keys + args])

    def command(self, keys: Sequence[object], args: Sequence[object]) -> tuple[object, ...]:
        """``EVALSHA`` of ``keys`` and ``args``, unpacked (for ``execute_command``)."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def eval_command(self, keys: Sequence[object], args: Sequence[object]) -> tuple[object, ...]:
        """``EVAL`` with the full text, unpacked (for ``execute_command``)."""
        return ("EVAL", self.source, len(keys), *keys, *args)

    def run(
        self, wire: _Wire, client: Any, keys: tuple[bytes, ...], args: tuple[bytes, ...], undo: _Undo | None = None
    ) -> Any:
        """EVALSHA over the wire; on NOSCRIPT, EVAL with the full text on the same wire (which
        also caches the script for the next EVALSHA, and cannot meet NOSCRIPT). ``undo``: see
        :meth:`_Wire.call`."""
        try:
            return wire.call(self.packed(keys, args), self.command(keys, args), undo)
        except NoScriptError:
            return wire.call(self.packed_eval(keys, args), self.eval_command(keys, args), undo)

    def run_then(
        self,
        wire: _Wire,
        client: Any,
        keys: tuple[bytes, ...],
        args: tuple[bytes, ...],
        then: tuple[bytes, ...],
        undo: _Undo | None = None,
    ) -> tuple[Any, Any]:
        """:meth:`run` with the command ``then`` sent right behind it on the same connection,
        in the same write: both replies."""
        try:
            return wire.call_then(self.packed(keys, args), self.command(keys, args), then, undo)
        except NoScriptError:
            return wire.call_then(self.packed_eval(keys, args), self.eval_command(keys, args), then, undo)

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[object]) -> Any:
        """EVALSHA through ``client``; on NOSCRIPT, load the script and EVALSHA again, then
        EVAL."""
        try:
            return client.execute_command(*self.command(keys, args))
        except NoScriptError:
            pass
        try:
            client.execute_command("SCRIPT", "LOAD", self.source)
            return client.execute_command(*self.command(keys, args))
        except NoScriptError:
            return client.execute_command(*self.eval_command(keys, args))


def _pack_any(command: tuple[object, ...]) -> bytes:
    """``command`` (str, bytes and int arguments) in the wire format."""
    parts: list[bytes] = []
    for arg in command:
        if isinstance(arg, bytes):
            parts.append(arg)
        elif isinstance(arg, int):
            parts.append(b"%d" % arg)
        else:
            parts.append(str(arg).encode())
    return _packed(tuple(parts))


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _packed(command: tuple[bytes, ...]) -> bytes:
    """``command`` in the wire format."""
    return b"*%d\r\n" % len(command) + b"".join([_bulk(part) for part in command])
