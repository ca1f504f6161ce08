"""What a contender node's data says: the hold's token, its kind, the lease it asked for and
its owner record (``AcquireRequest.owner``), written by the ``create`` that makes the node.

The data is one JSON object, the previous version's (``{"host": ..., "pid": ..., "thread":
..., "kind": ..., "lease": ..., "acquired_at": ...}``) extended: our fields come first, then
the owner record's own fields, so the whole still reads as one flat object (``kind`` and
``lease`` where the previous version put them)::

    {"token":"<token>","kind":"lock","lease":30.0,"host":"web-3","pid":4121,...}

An owner record that is not a JSON object goes in an ``"owner"`` string instead, and none at
all leaves ``{"token":...,"kind":...,"lease":...}``. A node of the previous version (no
``token``) reads as token ``""`` with an owner record rebuilt from its host, pid, thread and
acquired_at; empty data (the URL's ``owner_info=false``) or data lockaspect did not write
reads as token and owner ``""``.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

__all__ = ["Record", "encode", "read"]

# Our fields, always first and in this order: read back without parsing the owner record (an
# opaque string: its exact text is what describe gives back).
_HEAD = re.compile(r'\{"token":("(?:[^"\\]|\\.)*"),"kind":"(\w+)","lease":([0-9.eE+-]+)(\}|,)')
_STRING_OWNER = '"owner":"'
_OLD_FIELDS = ("host", "pid", "thread", "function", "template", "acquired_at")


class Record(NamedTuple):
    """A contender node's data, read."""

    token: str = ""
    owner: str = ""
    lease: float | None = None
    kind: str = ""


def _string(text: str) -> str:
    return f'"{text}"' if text.isalnum() and text.isascii() else json.dumps(text)


def encode(token: str, kind: str, lease: float, owner: str) -> bytes:
    """The data of a contender node for ``token`` (see the module docstring)."""
    head = f'{{"token":{_string(token)},"kind":"{kind}","lease":{float(lease)!r}'
    if not owner:
        return (head + "}").encode()
    if owner.startswith('{"') and owner.endswith("}") and not owner.startswith("{" + _STRING_OWNER):
        return f"{head},{owner[1:]}".encode()
    return f"{head},{_STRING_OWNER[:-1]}{json.dumps(owner)}}}".encode()


def read(data: Any) -> Record:
    """What ``data`` (a node's bytes) says; :class:`Record` ``()`` for data lockaspect did not
    write."""
    if not isinstance(data, bytes) or not data:
        return Record()
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return Record()
    match = _HEAD.match(text)
    if match is None:
        return _previous(text)
    try:
        token = json.loads(match.group(1))
        lease = float(match.group(3))
    except ValueError:
        return Record()
    rest = text[match.end() :]
    if match.group(4) == "}":
        owner = ""
    elif rest.startswith(_STRING_OWNER):
        try:
            owner = json.loads("{" + rest).get("owner", "")
        except (ValueError, AttributeError):
            owner = ""
    else:
        owner = "{" + rest
    token = token if isinstance(token, str) else ""
    return Record(token, owner if isinstance(owner, str) else "", lease, match.group(2))


def _previous(text: str) -> Record:
    """A node of the previous version: its owner fields as an owner record (no token)."""
    try:
        fields = json.loads(text)
    except ValueError:
        return Record()
    if not isinstance(fields, dict):
        return Record()
    lease = fields.get("lease")
    lease = float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) else None
    owner = {name: fields.get(name) for name in _OLD_FIELDS} if "pid" in fields or "host" in fields else None
    kind = fields.get("kind")
    record = json.dumps(owner, separators=(",", ":")) if owner else ""
    return Record("", record, lease, kind if isinstance(kind, str) else "")
