"""Client-wide and process-wide defaults of the decorator's options, and the key-template hint
given at decoration.

Precedence, from strongest: the options given to the decorator > its named policy > the
client's ``defaults=`` > ``configure(defaults=...)`` > the library's defaults. Defaults apply
to ``@distributed_lock`` and ``@distributed_semaphore``; ``client.lock()`` and the other
calls take their options from their arguments, whose defaults their signatures show.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from . import options
from .errors import ConfigurationError

__all__ = ["DEFAULT_FIELDS", "KeyTemplateWarning", "check_defaults", "set_process_defaults", "template_hint"]

#: The options a client or ``configure()`` may give a default for: those of every lock's
#: behaviour. ``key``, ``keys``, ``policy``, ``permits``, ``fair``, ``mode``, ``scope`` and
#: ``connection`` say what a function locks, so only the function (or its policy) may.
DEFAULT_FIELDS: Final = frozenset(
    {"lease", "delay_weight", "wait", "max_hold", "on_failure", "on_lost", "executor", "wait_strategy"}
)

EMPTY: Final[Mapping[str, Any]] = MappingProxyType({})

#: ``configure(defaults=...)``: beneath every client's own.
process_defaults: Mapping[str, Any] = EMPTY


class KeyTemplateWarning(UserWarning):
    """A key template looks like it meant to read an argument but reads none (warned when a
    function is decorated)."""


def check_defaults(defaults: object, where: str) -> Mapping[str, Any]:
    """``defaults=`` as given to ``where`` (``"LockClient"``, ``"configure()"``): checked and
    normalised, read-only. ``None`` is no defaults."""
    if defaults is None:
        return EMPTY
    if not isinstance(defaults, Mapping):
        raise TypeError(f"{where}: defaults must be a mapping of option names to values, got {type(defaults).__name__}")
    unknown = sorted(str(name) for name in defaults if name not in DEFAULT_FIELDS)
    if unknown:
        raise ConfigurationError(
            f"{where}: {', '.join(unknown)} cannot be a default (only {', '.join(sorted(DEFAULT_FIELDS))} can: "
            "what a function locks is set on its decorator or its policy)"
        )
    try:
        checked = options.check(dict(defaults))
    except (TypeError, ConfigurationError) as exc:
        raise type(exc)(f"{where}: defaults: {exc}") from exc
    options.check_margin(options.spec_of(checked), None, None)
    return MappingProxyType(checked)


def set_process_defaults(defaults: Mapping[str, Any]) -> None:
    global process_defaults
    process_defaults = defaults


def layered(client_defaults: Mapping[str, Any]) -> Mapping[str, Any]:
    """The defaults a decorated function starts from: the process's, then its client's (the
    same object for as long as neither changes, so a resolution can be cached by identity)."""
    if not process_defaults:
        return client_defaults
    if not client_defaults:
        return process_defaults
    found = _layers.get(id(client_defaults))
    if found is None or found[0] is not client_defaults or found[1] is not process_defaults:
        if len(_layers) > 64:
            _layers.clear()
        found = _layers[id(client_defaults)] = (
            client_defaults,
            process_defaults,
            MappingProxyType({**process_defaults, **client_defaults}),
        )
    return found[2]


_layers: dict[int, tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]] = {}


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def template_hint(template: str, read: frozenset[str], parameters: tuple[str, ...], qualname: str) -> None:
    """Warn when ``template`` reads no argument of the function (``read``: the names its
    placeholders read) but its literal text names one: ``"order:user.id"`` on ``def
    f(user)`` most likely meant ``"order:<user.id>"``."""
    if read & set(parameters):
        return
    wanted = set(parameters) - {"self", "cls"}
    suggestion = template
    found = False
    for match in reversed(list(_WORD.finditer(template))):
        if match.group().split(".")[0] in wanted:
            found = True
            suggestion = f"{suggestion[: match.start()]}<{match.group()}>{suggestion[match.end() :]}"
    if found:
        warnings.warn(
            f"the key template {template!r} of {qualname}() reads none of its arguments, so every call takes "
            f"the same lock: did you mean {suggestion!r}? (placeholders go in <...>)",
            KeyTemplateWarning,
            stacklevel=4,
        )
