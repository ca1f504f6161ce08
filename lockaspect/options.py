"""Every lock option, declared once: its name, default, validator, where it may be set, and
its TOML spelling of ``None``; the rules between options; and :class:`LockSpec`, the
validated options the engine runs on.

Who reads the table:

- ``@distributed_lock`` / ``@distributed_semaphore`` (:mod:`lockaspect.aspect`): the options given explicitly
  are checked with :func:`check` when the decorator is applied; each resolution merges them over a named policy
  with :func:`merge` (defaults < policy < explicit), checks the result with :func:`check` and builds the spec
  with :func:`spec_of`; :func:`check_margin` checks ``delay_weight`` against the client's lease and tick.
- Named policies (:mod:`lockaspect.config`, a mapping or a TOML file): :data:`POLICY_FIELDS`
  lists the names a policy may set, :func:`check_policy` checks one policy's options.
- ``client.lock()``, ``fair_lock()``, ``multi_lock()``, ``semaphore()``, ``set_permits()``
  and ``rw_lock(key).read()`` / ``.write()``: :meth:`LockSpec.create`, which runs the same
  validators and rules before any I/O.

Validators return the normalised value (seconds as ``float``) or raise the error the public API documents:
:class:`TypeError` for a value of the wrong type, :class:`~lockaspect.ConfigurationError` for a bad value (a
policy wraps both into a ``ConfigurationError`` naming the policy and its source). Messages name the option and
the fix. The arithmetic (durations, margins) lives in :mod:`lockaspect._policy`; ``scope``/``connection`` and
their rules in :mod:`lockaspect._scope`.

For contributors, adding an option takes:

1. one :class:`Option` in :data:`OPTIONS` below (plus a :class:`Rule` in :data:`RULES` if it
   excludes other options, and a :class:`LockSpec` field if the engine reads it);
2. its documentation (``docs/configuration.md`` and the public docstrings);
3. the signatures of the public functions that take it: ``distributed_lock`` and ``distributed_semaphore`` in
   ``aspect.py``; ``LockClient.lock``, ``fair_lock``, ``multi_lock``, ``semaphore`` and ``RWLock.read`` /
   ``write`` in ``client.py`` (and :meth:`LockSpec.create` here), and the bodies that pass them on (to
   ``_decorator``, to ``LockSpec.create``, through ``RWLock._block``). They stay explicit keyword parameters so
   IDEs and type checkers see them (``tests/unit/test_options.py`` checks that they and this table agree).
   Everything else reads this table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from . import _policy, _scope
from .errors import ConfigurationError, KeyTemplateError
from .executor import check_executor
from .keys import KeyTemplate
from .kinds import LockKind, kind_for
from .lease import Lease

__all__ = [
    "OPTIONS",
    "POLICY_FIELDS",
    "RULES",
    "UNSET",
    "WAIT_STRATEGIES",
    "LockSpec",
    "OnLost",
    "Option",
    "Rule",
    "Surface",
    "check",
    "check_margin",
    "check_policy",
    "merge",
    "spec_of",
]

WAIT_STRATEGIES = ("notify", "poll")
MODES = ("read", "write")

OnLost = Callable[[Lease], object]


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


#: Marks a decorator option the caller did not pass, so a named policy can supply it.
UNSET: Any = _Unset()


class Surface(enum.Flag):
    """Where an option may be set."""

    #: ``@distributed_lock`` / ``@distributed_semaphore``.
    DECORATOR = enum.auto()
    #: ``client.lock()`` and its family (``fair_lock``, ``multi_lock``, ``semaphore``,
    #: ``rw_lock(key).read()`` / ``.write()``).
    CLIENT = enum.auto()
    #: A named policy given as a mapping to ``configure(policies=...)``.
    POLICY = enum.auto()
    #: A ``[locks."<name>"]`` table of a TOML policy file (no functions, no objects, no null).
    TOML = enum.auto()


_EVERYWHERE = Surface.DECORATOR | Surface.CLIENT | Surface.POLICY | Surface.TOML


# -- validators: the value, normalised, or TypeError / ConfigurationError ------------------


def _key(value: object) -> object:
    if value is None or callable(value):
        return value
    if not isinstance(value, str):
        raise TypeError(f"key must be a template string or a callable, got {type(value).__name__}")
    if not value:
        raise KeyTemplateError("key template is empty", template=value)
    return value


class Keys:
    """``keys=`` of the decorator, checked: several key templates, or a function of the bound
    arguments returning the keys."""

    __slots__ = ("fn", "templates")

    def __init__(self, value: object) -> None:
        self.fn: Callable[[Mapping[str, Any]], Any] | None = None
        self.templates: tuple[str, ...] = ()
        if isinstance(value, Keys):
            self.fn, self.templates = value.fn, value.templates
            return
        if callable(value):
            self.fn = value
            return
        if isinstance(value, str):  # one template; a placeholder may yield a list of values
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"keys must be a list of key templates or a callable, got {type(value).__name__}")
        if not value:
            raise ConfigurationError("keys must name at least one key")
        for template in value:
            if not isinstance(template, str):
                raise TypeError(f"every key template must be a str, got {type(template).__name__}")
            if not template:
                raise KeyTemplateError("key template is empty", template=template)
        self.templates = tuple(value)


def _keys(value: object) -> Keys | None:
    return None if value is None else Keys(value)


def _policy_name(value: object) -> object:
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"policy must be a non-empty str, got {value!r}")
    return value


def _callable(name: str) -> Callable[[object], object]:
    def check_callable(value: object) -> object:
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        return value

    return check_callable


def _wait_strategy(value: object) -> str:
    if value not in WAIT_STRATEGIES:
        if not isinstance(value, str):
            raise TypeError(f"wait_strategy must be a str, got {type(value).__name__}")
        raise ConfigurationError(f"wait_strategy must be 'notify' or 'poll', got {value!r}")
    return str(value)


def _fair(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fair must be a bool, got {type(value).__name__}")
    return value


def _permits(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"permits must be an int, got {type(value).__name__}")
    if value < 1:
        raise ConfigurationError(f"permits must be at least 1, got {value}")
    return value


def _mode(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"mode must be a str, got {type(value).__name__}")
    if value not in MODES:
        raise ConfigurationError(f"mode must be 'read' or 'write', got {value!r}")
    return value


def _delay_weight(value: object) -> float | None:
    return None if value is None else _policy.check_delay_weight(value)


def _max_hold(value: object) -> float | None:
    return _policy.seconds(value, "max_hold", allow_none=True)


def _executor(value: object) -> object:
    check_executor(value)
    return value  # not normalised: "inline" overrides a client's default executor, None does not


def _parse_template(value: object) -> None:
    """A policy's key template is parsed at configure (the decorator's, with the function's
    names, when it is resolved)."""
    if isinstance(value, str):
        KeyTemplate.parse(value)


# -- the table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One option.

    Attributes:
        name: The keyword, the same on every surface.
        default: Its value when nothing sets it.
        check: The validator: returns the normalised value or raises.
        surfaces: Where it may be set.
        spec: A field of :class:`LockSpec` (what the engine reads).
        toml_none: The string a policy writes for ``None`` (TOML has no null).
        none_is_unset: At the decorator, ``None`` is the same as not passing it (a policy's
            value applies).
        policy_none: A policy may set it to ``None``.
        on_policy: An extra check when a policy sets it.
    """

    name: str
    default: Any
    check: Callable[[Any], Any]
    surfaces: Surface
    spec: bool = False
    toml_none: str | None = None
    none_is_unset: bool = False
    policy_none: bool = True
    on_policy: Callable[[Any], None] | None = None


#: Every option, in the order they are checked.
OPTIONS: Final[tuple[Option, ...]] = (
    Option(
        "key",
        None,
        _key,
        Surface.DECORATOR | Surface.POLICY | Surface.TOML,
        none_is_unset=True,
        policy_none=False,
        on_policy=_parse_template,
    ),
    Option("keys", None, _keys, Surface.DECORATOR, none_is_unset=True),
    Option("policy", None, _policy_name, Surface.DECORATOR, none_is_unset=True),
    Option("on_lost", None, _callable("on_lost"), Surface.DECORATOR | Surface.CLIENT | Surface.POLICY, spec=True),
    Option("wait_strategy", "notify", _wait_strategy, _EVERYWHERE, spec=True),
    Option("fair", False, _fair, _EVERYWHERE, spec=True),
    Option("permits", None, _permits, Surface.DECORATOR | Surface.CLIENT, spec=True),
    Option("mode", None, _mode, _EVERYWHERE, spec=True),
    Option("lease", None, _policy.lease_seconds, _EVERYWHERE, spec=True, toml_none="watchdog"),
    Option("delay_weight", None, _delay_weight, _EVERYWHERE, spec=True, policy_none=False),
    Option("wait", 0.0, _policy.wait_seconds, _EVERYWHERE, spec=True, toml_none="forever"),
    Option("max_hold", None, _max_hold, _EVERYWHERE, spec=True, toml_none="none"),
    Option("on_failure", None, _callable("on_failure"), Surface.DECORATOR | Surface.POLICY),
    # TOML: only executor = "inline" (the validator refuses other strings).
    Option("executor", None, _executor, Surface.DECORATOR | Surface.POLICY | Surface.TOML),
    Option("scope", "session", _scope.check_scope, Surface.DECORATOR | Surface.CLIENT),
    Option("connection", None, _scope.check_connection, Surface.DECORATOR | Surface.CLIENT, none_is_unset=True),
)

BY_NAME: Final[Mapping[str, Option]] = {option.name: option for option in OPTIONS}
DEFAULTS: Final[dict[str, Any]] = {option.name: option.default for option in OPTIONS}
_VALIDATORS: Final = tuple((option.name, option.check) for option in OPTIONS)
SPEC_FIELDS: Final[tuple[str, ...]] = tuple(option.name for option in OPTIONS if option.spec)

#: Options a named policy may set.
POLICY_FIELDS: Final = frozenset(option.name for option in OPTIONS if Surface.POLICY in option.surfaces)


@dataclass(frozen=True)
class Rule:
    """A rule between options: ``broken`` tells, from all the options (defaults for those
    not set, validated), whether the combination is refused with ``message``."""

    names: tuple[str, ...]
    broken: Callable[[Mapping[str, Any]], bool]
    message: str


#: The rules between options, checked (in this order) after every option passed its validator.
RULES: Final[tuple[Rule, ...]] = (
    Rule(
        ("key", "keys"),
        lambda o: o["key"] is not None and o["keys"] is not None,
        "give key= or keys=, not both",
    ),
    Rule(
        ("fair", "permits"),
        lambda o: o["permits"] is not None and o["fair"],
        "a semaphore cannot be fair (fair=True with permits)",
    ),
    Rule(
        ("mode", "fair", "permits"),
        lambda o: o["mode"] is not None and (o["fair"] or o["permits"] is not None),
        "a read-write lock (mode=) cannot also be fair or a semaphore",
    ),
    Rule(
        ("keys", "fair", "permits", "mode"),
        lambda o: o["keys"] is not None and (o["fair"] or o["permits"] is not None or o["mode"] is not None),
        "keys= takes a plain lock on every key: it cannot be fair, a semaphore or read-write",
    ),
    Rule(
        ("keys", "executor"),
        lambda o: o["keys"] is not None and check_executor(o["executor"]) is not None,
        "keys= runs the body in the caller (inline): an executor is not supported yet",
    ),
)

# The delay_weight margin is a rule too, but against the client's lease and tick: check_margin.


# -- the checks ---------------------------------------------------------------------------


def check(values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``values`` (a subset of the options), then the rules over them and the
    defaults of the others; return the given options normalised."""
    checked = {name: validator(values[name]) for name, validator in _VALIDATORS if name in values}
    if len(checked) != len(values):
        unknown = sorted(set(values) - set(checked))
        raise TypeError(f"unknown lock option(s) {', '.join(unknown)}")
    everything = DEFAULTS | checked
    for rule in RULES:
        if rule.broken(everything):
            raise ConfigurationError(rule.message)
    _scope.check_rules(everything)
    return checked


def explicit(given: Mapping[str, Any]) -> dict[str, Any]:
    """The decorator options the caller passed: not :data:`UNSET`, and not ``None`` for an
    option whose ``None`` means "not given"."""
    return {
        name: value
        for name, value in given.items()
        if value is not UNSET and not (value is None and BY_NAME[name].none_is_unset)
    }


def check_policy(values: dict[str, Any], *, toml: bool) -> dict[str, Any]:
    """Check one policy's options (names already known to be in :data:`POLICY_FIELDS`).

    Replaces the TOML spellings of ``None`` (in a mapping too) and returns ``values``
    otherwise as given; raises as :func:`check` does.
    """
    for name, value in values.items():
        option = BY_NAME[name]
        if option.toml_none is not None and isinstance(value, str) and value == option.toml_none:
            values[name] = None
        elif value is None and not option.policy_none:
            raise TypeError(f"{name} cannot be None in a policy: leave it out for its default")
        if toml and Surface.TOML not in option.surfaces:
            raise ConfigurationError(
                f"{name} cannot be set in a TOML file (it takes a function or an object): "
                "set it in a configure(policies={...}) mapping or on the decorator"
            )
    check(values)
    for name, value in values.items():
        on_policy = BY_NAME[name].on_policy
        if on_policy is not None:
            on_policy(value)
    return values


def merge(policy: Mapping[str, Any] | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option: the defaults, overridden by the policy's, overridden by those given
    explicitly (see :func:`explicit`). With ``keys=`` given, a policy's ``key`` is ignored."""
    merged = dict(DEFAULTS)
    if policy:
        merged.update(policy)
        if given.get("keys") is not None:
            merged["key"] = None
    merged.update(given)
    return merged


def spec_of(values: Mapping[str, Any]) -> LockSpec:
    """The spec of options already through :func:`check` (defaults for those missing)."""
    return LockSpec(*[values.get(name, DEFAULTS[name]) for name in _FIELDS])


def check_margin(spec: LockSpec, watchdog_lease: float | None, tick: float | None) -> None:
    """The ``delay_weight`` rule: a watchdog lease given a ``delay_weight`` must leave
    ``(1 - delay_weight) * watchdog_lease > tick + 0.1 s``. Without a client yet, a
    client's defaults (30 s, 0.1 s) stand in; a client's own default ``delay_weight`` was
    checked when the client was built."""
    if spec.lease is None and spec.delay_weight is not None:
        _policy.check_margin(
            30.0 if watchdog_lease is None else watchdog_lease, spec.delay_weight, 0.1 if tick is None else tick
        )


# -- LockSpec ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LockSpec:
    """Validated lock options, shared by the decorator and ``client.lock``.

    Attributes:
        lease: Seconds of fixed lease, or ``None`` for watchdog mode.
        delay_weight: First renewal attempt at ``delay_weight * lease``; ``None`` takes
            the client's default.
        wait: Seconds to wait for the lock; 0 tries once; ``None`` waits forever.
        max_hold: Stop renewing after this many seconds; the lease then ends and is lost.
        on_lost: Called once with the lease when it is lost.
        wait_strategy: ``"notify"``: waiters wake on the release message (falling back to
            bounded polling when pub/sub is unavailable); ``"poll"``: jittered polling
            bounded by the holder's remaining lease, for stores or proxies without pub/sub.
        fair: A fair lock: callers get it in the order they asked (see
            :meth:`LockClient.fair_lock`).
        permits: A semaphore with this many permits (see :meth:`LockClient.semaphore`);
            ``None`` for a lock.
        mode: ``"read"`` or ``"write"`` for a read-write lock (see
            :meth:`LockClient.rw_lock`); ``None`` for a lock.
    """

    lease: float | None = None
    delay_weight: float | None = None
    wait: float | None = 0.0
    max_hold: float | None = None
    on_lost: OnLost | None = None
    wait_strategy: str = "notify"
    fair: bool = False
    permits: int | None = None
    mode: str | None = None

    @property
    def kind(self) -> LockKind:
        """The lock kind these options name (see :mod:`lockaspect.kinds`)."""
        return kind_for(self.fair, self.permits, self.mode)

    @classmethod
    def create(
        cls,
        *,
        lease: object = None,
        delay_weight: object = None,
        wait: object = 0.0,
        max_hold: object = None,
        on_lost: object = None,
        wait_strategy: object = "notify",
        fair: object = False,
        permits: object = None,
        mode: object = None,
    ) -> LockSpec:
        args = (lease, delay_weight, wait, max_hold, on_lost, wait_strategy, fair, permits, mode)
        types = tuple(map(type, args))
        if args == _DEFAULT_ARGS and types == _DEFAULT_TYPES:
            return DEFAULT_SPEC  # the common case (client.lock(key)), without running the validators
        # Other plain values (client.lock(key, lease=10) in a loop) are validated once; the key
        # has the types, so True is not taken for 1. Hooks are not kept: a fresh one per call.
        cache = on_lost is None
        if cache:
            try:
                found = _SPECS.get((args, types))
            except TypeError:  # an unhashable value: the validators say what is wrong with it
                found, cache = None, False
            if found is not None:
                return found
        values = {
            "lease": lease,
            "delay_weight": delay_weight,
            "wait": wait,
            "max_hold": max_hold,
            "on_lost": on_lost,
            "wait_strategy": wait_strategy,
            "fair": fair,
            "permits": permits,
            "mode": mode,
        }
        spec = spec_of(check(values))
        if cache and len(_SPECS) < 256:
            _SPECS[(args, types)] = spec
        return spec


#: Specs made from plain option values, by the values and their types (see create).
_SPECS: dict[tuple[tuple[object, ...], tuple[type, ...]], LockSpec] = {}

#: The spec of a call that sets no option.
DEFAULT_SPEC: Final = LockSpec()
#: LockSpec's fields in their order (also LockSpec.create's), and their values when no option is set.
_FIELDS: Final = tuple(LockSpec.__dataclass_fields__)
_DEFAULT_ARGS: Final = tuple(DEFAULTS[name] for name in _FIELDS)
_DEFAULT_TYPES: Final = tuple(map(type, _DEFAULT_ARGS))
