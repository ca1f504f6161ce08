"""Resolvers and converters: what key templates may call, and how a value becomes key text.

The two registries users fill (:func:`register_resolver`, :func:`register_converter`),
and the rendering of one placeholder's value: exact ``str`` and ``int`` directly, then a
registered converter (by the value type's MRO), then enums by value, ``str``/``int``
subclasses and :class:`uuid.UUID`; everything is percent-encoded by :func:`encode_value`.
Re-exported by :mod:`lockaspect.keys` (and the register functions by :mod:`lockaspect`).

This module does no I/O.
"""

from __future__ import annotations

import enum
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

from .errors import KeyTemplateError

__all__ = ["abbreviated", "encode_value", "register_converter", "register_resolver", "render_value", "resolvers"]

# Lone surrogates (e.g. from os.fsdecode) are encoded too, so every key is valid UTF-8.
_ENCODE = re.compile(r"[%:{}*?\[\]\\\s\x00-\x1f\x7f-\x9f\ud800-\udfff]")

_registry_lock = threading.Lock()
_RESOLVERS: dict[str, Callable[..., Any]] = {}
_CONVERTERS: dict[type, Callable[[Any], str]] = {}


def register_resolver(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn`` callable as ``name(...)`` inside key templates.

    Register resolvers before decorating the functions whose templates use them: templates
    are checked when the decorator is applied. Registering a name again replaces the
    function for templates parsed afterwards.

    Example::

        register_resolver("tenant_of", lambda request: request.headers["x-tenant"])

        @distributed_lock(key="report:<tenant_of(request)>")
        def build_report(request): ...
    """
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"resolver name must be a public identifier, got {name!r}")
    if not callable(fn):
        raise TypeError(f"resolver {name!r} must be callable, got {type(fn).__name__}")
    with _registry_lock:
        _RESOLVERS[name] = fn


def register_converter(cls: type, fn: Callable[[Any], str]) -> None:
    """Let values of type ``cls`` (and subclasses) render in keys as ``fn(value)``.

    ``fn`` must return a ``str``; it is percent-encoded like any other value. Make it
    injective (distinct values, distinct strings), or distinct calls will share a lock.

    Example::

        register_converter(datetime.date, datetime.date.isoformat)
    """
    if not isinstance(cls, type):
        raise TypeError(f"converter target must be a type, got {cls!r}")
    if not callable(fn):
        raise TypeError(f"converter for {cls.__name__} must be callable")
    with _registry_lock:
        _CONVERTERS[cls] = fn


def resolvers() -> dict[str, Callable[..., Any]]:
    """A snapshot of the registered resolvers, for one template being parsed."""
    with _registry_lock:
        return dict(_RESOLVERS)


def encode_value(value: str) -> str:
    """Percent-encode the characters of ``value`` that are structural in keys."""
    if _ENCODE.search(value) is None:
        return value
    return _ENCODE.sub(_percent, value)


def _percent(match: re.Match[str]) -> str:
    return "".join(f"%{byte:02X}" for byte in match.group().encode("utf-8", "surrogatepass"))


def render_value(value: Any, expression: str, template: str, max_bytes: int) -> str:
    """One placeholder's value as key text (percent-encoded); :class:`KeyTemplateError` when
    it has no rendering, is ``None``, or is an int too long for a ``max_bytes`` key."""
    kind = type(value)
    if kind is str:
        return encode_value(value)
    if kind is int:
        return _int_text(value, expression, template, max_bytes)
    if value is None:
        raise KeyTemplateError(
            f"<{expression}> is None in key template {template!r}",
            template=template,
            expression=expression,
        )
    # A registered converter wins over the built-in rules for every type but exact str and
    # int, so a converter for a str/int subclass or an Enum is honoured.
    for cls in kind.__mro__:
        converter = _CONVERTERS.get(cls)
        if converter is not None:
            try:
                text = converter(value)
            except Exception as exc:
                raise KeyTemplateError(
                    f"converter for {cls.__name__} failed on <{expression}>: {exc!r}",
                    template=template,
                    expression=expression,
                ) from exc
            if not isinstance(text, str):
                raise KeyTemplateError(
                    f"converter for {cls.__name__} returned {type(text).__name__}, not str",
                    template=template,
                    expression=expression,
                )
            return encode_value(text)
    if isinstance(value, enum.Enum):
        return render_value(value.value, expression, template, max_bytes)
    if isinstance(value, str):
        return encode_value(str.__str__(value))
    if isinstance(value, int) and not isinstance(value, bool):  # True/1 would share a lock
        return _int_text(int(value), expression, template, max_bytes)
    if isinstance(value, uuid.UUID):
        return str(value)
    raise KeyTemplateError(
        f"<{expression}> is a {kind.__name__}, which has no key rendering; keys render "
        f"str, int, uuid.UUID and enum values, or register_converter({kind.__name__}, fn)",
        template=template,
        expression=expression,
    )


def _int_text(value: int, expression: str, template: str, max_bytes: int) -> str:
    """The decimal text of ``value``, refusing an int whose text cannot fit in a key.

    Checked on the bit length, before converting: ``str()`` of a huge int takes time
    quadratic in its size, and past :func:`sys.get_int_max_str_digits` (4300 digits by
    default) it raises ``ValueError``. An int of ``b`` bits has at least
    ``floor((b - 1) * log10(2)) + 1`` decimal digits.
    """
    bits = value.bit_length()
    digits = (bits - 1) * 30103 // 100000 + 1 if bits else 1
    if digits > max_bytes:
        raise KeyTemplateError(
            f"<{expression}> of key template {abbreviated(template)!r} is an int of at least {digits} "
            f"digits, too long for a key (cap: {max_bytes} bytes)",
            template=template,
            expression=expression,
        )
    return str(value)


def abbreviated(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
