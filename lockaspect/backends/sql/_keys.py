"""How a lock key becomes a PostgreSQL advisory lock key: a stable 64-bit hash.

PostgreSQL's advisory locks take one ``bigint`` (or two ``int4``; lockaspect uses the single
``bigint`` form only, a key space disjoint from the two-key form). :func:`advisory_key` maps
the namespaced key to it with SHA-256: the first 8 bytes of the digest of the key's UTF-8
bytes, read big-endian as a signed 64-bit integer. The result is the same on every machine,
Python version and byte order, and never changes between releases (it is a data format: a
change would let two versions of lockaspect hold one lock at once).

Collisions: two different keys share an advisory key with probability 2**-64 per pair; with a
million distinct keys held at once, about 3 in 10**8 that any two of them collide. A collision
makes two unrelated keys exclude each other (never two holders of one key): safe, only slower.
"""

from __future__ import annotations

import hashlib

__all__ = ["advisory_key"]


def advisory_key(name: str) -> int:
    """The signed 64-bit advisory lock key of ``name`` (the namespaced lock key).

    >>> advisory_key("lockaspect:order:42")
    -1489696312192808415
    """
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
