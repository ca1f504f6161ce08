"""``@distributed_lock``: the decorator.

Per call: bind the arguments, render the key (no I/O yet), acquire (waiting if asked),
apply ``on_failure`` if the lock stays busy, register the watchdog, run the body through
the executor with the caller's context, cancel the watchdog, release, and raise
:class:`~lockaspect.LockLost` instead of returning if the lease was lost meanwhile.

Everything that can be checked without a call is checked when the decorator is applied.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import wrapt

from . import _defaults, config, options
from ._arguments import name_after
from .blocks import arun_multi, run_multi
from .client import LockClient
from .errors import ConfigurationError, KeyTemplateError, LockNotAcquired
from .executor import check_executor
from .keys import ArgumentNames, KeyTemplate, check_key
from .options import UNSET as _UNSET
from .options import LockSpec
from .owner import ORIGIN, Origin
from .xact import ConnectionPlan

__all__ = ["FailureContext", "distributed_lock", "distributed_semaphore"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class FailureContext:
    """What ``on_failure`` receives when the lock stays busy.

    Attributes:
        key: The rendered key that could not be locked.
        function: The decorated function's qualified name.
        arguments: The bound arguments (defaults applied), by parameter name.
        waited: Seconds spent waiting (0.0 for a single try).
        error: The :class:`~lockaspect.LockNotAcquired` that would otherwise be raised.
    """

    key: str
    function: str
    arguments: Mapping[str, Any]
    waited: float
    error: LockNotAcquired


@dataclass(frozen=True)
class _Resolved:
    spec: LockSpec
    template: KeyTemplate | None
    key_fn: Callable[[Mapping[str, Any]], str] | None
    executor: Executor | None
    executor_set: bool
    on_failure: Callable[[FailureContext], Any] | None
    generation: int
    #: A multi-key lock: its key templates, or a function of the bound arguments returning the keys.
    templates: tuple[KeyTemplate, ...] = ()
    keys_fn: Callable[[Mapping[str, Any]], Any] | None = None
    #: scope="transaction": how a call finds its connection (lockaspect.xact).
    xact: ConnectionPlan | None = None
    #: What the owner record names (lockaspect.owner): the function and its key template(s).
    origin: Origin = ("?", None)
    #: The defaults merged in (their identity tells when the call's client has others).
    defaults: Mapping[str, Any] | None = None

    @property
    def multi(self) -> bool:
        return bool(self.templates) or self.keys_fn is not None


class _LockAspect:
    __slots__ = ("_explicit", "_names", "_policy", "_resolved", "client", "function")

    def __init__(self, function: Callable[..., Any], explicit: dict[str, Any], client: LockClient | None) -> None:
        self.function = function
        self.client = client
        self._explicit = explicit
        self._policy: str | None = explicit.get("policy")
        self._names = ArgumentNames(function)
        self._resolved: _Resolved | None = None

    def resolve(self, *, at_call: bool, client: LockClient | None = None) -> _Resolved | None:
        """Merge the library's defaults < configure()'s < the client's < the policy's < the
        explicit options and check them all (``client``: the one the call uses).

        At decoration a policy that is not configured yet is left for the first call,
        unless policies are configured and this one is not among them.
        """
        generation = config.generation()
        resolved = self._resolved
        if client is None and not at_call:
            client = config._client
        defaults = _defaults.layered(client.defaults if client is not None else _defaults.EMPTY)
        if resolved is not None and resolved.generation == generation and resolved.defaults is defaults:
            return resolved
        policy = None
        if self._policy is not None:
            policy = config.get_policy(self._policy)
            if policy is None:
                if not at_call and not config.has_policies():
                    return None
                known = ", ".join(config.policy_names()) or "none configured"
                raise ConfigurationError(
                    f"unknown lock policy {self._policy!r} for {self._names.qualname}() (known: {known})"
                )
        scope = self._explicit.get("scope", (policy or {}).get("scope"))
        checked = options.check(
            options.merge({**_defaults.for_scope(defaults, scope), **(policy or {})}, self._explicit)
        )
        spec = options.spec_of(checked)
        key, keys = checked["key"], checked["keys"]
        multi: tuple[KeyTemplate, ...] = ()
        keys_fn = None
        if keys is not None:
            multi = tuple(KeyTemplate.parse(t, names=self._names) for t in keys.templates)
            keys_fn = keys.fn
            template: KeyTemplate | None = None
            key_fn = None
        elif key is None:
            key = f"{getattr(self.function, '__module__', '?')}.{self._names.qualname}"
            template = KeyTemplate.parse(key.replace("<", "<<").replace(">", ">>"))
            key_fn = None
        elif isinstance(key, str):
            template, key_fn = KeyTemplate.parse(key, names=self._names), None
            if not at_call:
                _defaults.template_hint(key, template.names, self._names.parameters, self._names.qualname)
        else:
            template, key_fn = None, key
        on_failure = checked["on_failure"]
        executor_set = checked["executor"] is not None  # "inline" overrides the client's executor
        executor = check_executor(checked["executor"])
        if client is None:
            options.check_margin(spec, None, None)
        else:
            options.check_margin(spec, client.watchdog_lease, client.tick)
        xact = None
        if checked.get("scope") == "transaction":
            xact = ConnectionPlan(checked["connection"], self._names)
        if multi:
            shown: str | None = ", ".join(t.template for t in multi)
        else:
            shown = template.template if template is not None and key_fn is None else None
        origin = (self._names.qualname, shown)
        resolved = _Resolved(
            spec,
            template,
            cast(Any, key_fn),
            executor,
            executor_set,
            on_failure,
            generation,
            multi,
            keys_fn,
            xact,
            origin,
            defaults,
        )
        self._resolved = resolved
        return resolved

    def render_all(self, resolved: _Resolved, names: dict[str, Any], skip: int) -> tuple[str, ...]:
        """A multi-key lock's keys for one call (checked; at least one)."""
        if resolved.keys_fn is not None:
            try:
                keys = resolved.keys_fn(names)
            except Exception as exc:
                raise KeyTemplateError(
                    f"keys function for {self._names.qualname}() raised {type(exc).__name__}: {exc}"
                ) from exc
            if isinstance(keys, str) or not isinstance(keys, (list, tuple, set, frozenset)):
                raise KeyTemplateError(
                    f"keys function for {self._names.qualname}() must return a list of keys, got {type(keys).__name__}"
                )
            rendered = [check_key(key) for key in keys]
        else:
            rendered = []
            for template in resolved.templates:
                if template.names and not names.keys() >= template.names:
                    names = self._names.extend(dict(names), template.names, skip)
                rendered += template.render_many(names)
        if not rendered:
            raise KeyTemplateError(f"keys function for {self._names.qualname}() returned no key")
        return tuple(sorted(set(rendered)))

    def render(self, resolved: _Resolved, names: dict[str, Any], skip: int) -> str:
        if resolved.template is not None:
            template = resolved.template
            if template.names and not names.keys() >= template.names:
                # A copy: ``names`` is also what on_failure gets as the bound arguments,
                # which must not grow the template's extra names (args, p0, func, ...).
                names = self._names.extend(dict(names), template.names, skip)
            return template.render(names)
        assert resolved.key_fn is not None
        try:
            key = resolved.key_fn(names)
        except Exception as exc:
            raise KeyTemplateError(
                f"key function for {self._names.qualname}() raised {type(exc).__name__}: {exc}"
            ) from exc
        return check_key(key)

    def prepare(
        self, client: LockClient | None, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Resolved, Any, dict[str, Any]]:
        """Per call, before any I/O: the options, the bound arguments and the rendered key."""
        resolved = self.resolve(at_call=True, client=client)
        assert resolved is not None
        if instance is None:
            # No instance: a function, a staticmethod, or (Python 3.13+, where classmethod no
            # longer passes through wrapt's descriptor) a classmethod called with cls first.
            names, skip = self._names.bind(args, kwargs), int(self._names.method_like)
        else:
            names, skip = self._names.bind((instance, *args), kwargs), 1
        if resolved.multi:
            return resolved, self.render_all(resolved, names, skip), names
        return resolved, self.render(resolved, names, skip), names

    def failure(
        self, resolved: _Resolved, key: str | None, names: dict[str, Any]
    ) -> Callable[[LockNotAcquired], Any] | None:
        """``on_failure`` bound to this call (its result may be awaitable for async calls);
        ``key=None``: the busy key the error names (a multi-key lock)."""
        on_failure = resolved.on_failure
        if on_failure is None:
            return None
        qualname = self._names.qualname

        def failed(exc: LockNotAcquired) -> Any:
            return on_failure(FailureContext(key or exc.key or "", qualname, names, exc.waited, exc))

        return failed

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        resolved, key, names = self.prepare(self.client or config._client, instance, args, kwargs)
        client = self.client or config.default_client()
        origin = ORIGIN.set((resolved.origin, key))
        try:
            if resolved.xact is not None:
                failure = self.failure(resolved, key, names)
                return resolved.xact.run(client, key, resolved.spec, names, (wrapped, args, kwargs), failure)
            if resolved.multi:
                return run_multi(
                    client._engine, key, resolved.spec, wrapped, args, kwargs, self.failure(resolved, None, names)
                )
            executor = resolved.executor if resolved.executor_set else client.executor
            return client._engine.sync.run(
                key, resolved.spec, executor, wrapped, args, kwargs, self.failure(resolved, key, names)
            )
        finally:
            ORIGIN.reset(origin)

    async def acall(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        resolved, key, names = self.prepare(self.client or config._client, instance, args, kwargs)
        client = self.client or config.default_client()
        origin = ORIGIN.set((resolved.origin, key))
        try:
            if resolved.xact is not None:
                failure = self.failure(resolved, key, names)
                return await resolved.xact.arun(client, key, resolved.spec, names, (wrapped, args, kwargs), failure)
            if resolved.multi:
                failure = self.failure(resolved, None, names)
                return await arun_multi(client._engine, key, resolved.spec, wrapped, args, kwargs, failure)
            return await client._engine.aio.run(
                key, resolved.spec, wrapped, args, kwargs, self.failure(resolved, key, names)
            )
        finally:
            ORIGIN.reset(origin)


def distributed_lock(
    key: str | Callable[[Mapping[str, Any]], str] | None = None,
    *,
    lease: float | None = _UNSET,
    delay_weight: float = _UNSET,
    wait: float | None = _UNSET,
    on_failure: Callable[[FailureContext], Any] | None = _UNSET,
    on_lost: Callable[[Any], object] | None = _UNSET,
    executor: Executor | str | None = _UNSET,
    client: LockClient | None = None,
    policy: str | None = None,
    max_hold: float | None = _UNSET,
    wait_strategy: str = _UNSET,
    fair: bool = _UNSET,
    mode: str | None = _UNSET,
    keys: list[str] | tuple[str, ...] | Callable[[Mapping[str, Any]], Any] | None = None,
    scope: str = _UNSET,
    connection: Any = None,
) -> Callable[[F], F]:
    """Run the decorated function under a distributed lock named by ``key``.

    Args:
        key: A template rendered from the call's arguments, e.g. ``"order:<user.id>"``
            (see :mod:`lockaspect.keys`), or a callable that takes the bound arguments (a
            mapping of parameter names to values) and returns the key. ``None`` locks on the
            function's qualified name (one lock for all calls), unless ``policy`` gives a key.
        lease: ``None`` (default): watchdog mode. The lock is taken for the client's
            ``watchdog_lease`` (30 s by default) and renewed until the call completes, so
            a call can run as long as it needs while its process is alive and reaches the
            store; if the process dies, the lock frees within one watchdog lease.
            A number of seconds: a fixed lease that is never renewed; if the call outlives
            it, the call raises :class:`~lockaspect.LockLost`.
        delay_weight: In watchdog mode, the first renewal attempt is made at
            ``delay_weight * lease`` after acquisition and failed attempts are retried until
            the lease ends. Default: the client's (0.9 unless configured).
            ``(1 - delay_weight) * lease`` must exceed the timer tick plus 0.1 s.
        wait: Seconds to wait for a busy lock (0, the default, tries once; ``None`` waits
            forever). Waiters wake when the holder releases, not by polling.
        on_failure: Called with a :class:`FailureContext` when the lock stays busy; its
            return value becomes the call's result. Default: raise
            :class:`~lockaspect.LockNotAcquired`.
        on_lost: Called once with the :class:`~lockaspect.Lease` when the lease is lost
            (on a lockaspect thread: keep it short).
        executor: Where the body runs: ``None`` (the client's default, inline unless set),
            ``"inline"`` (the caller's thread), or a :class:`concurrent.futures.Executor`.
            With an executor, a lost lease makes the caller raise at once while the body
            keeps running.
        client: The :class:`~lockaspect.LockClient` to use; default: the configured one.
        policy: Name of a policy configured with :func:`~lockaspect.configure`; options
            passed here override the policy's.
        max_hold: Stop renewing after this many seconds; the lease then ends and is lost.
        wait_strategy: ``"notify"`` (default): a waiter wakes on the holder's release
            message, falling back to bounded polling when pub/sub is unavailable;
            ``"poll"``: jittered polling bounded by the holder's remaining lease, for
            deployments without pub/sub.
        fair: ``True`` for a fair lock: callers get it in the order they asked, across
            processes (see :meth:`LockClient.fair_lock
            <lockaspect.LockClient.fair_lock>`). Default ``False``.
        mode: ``"read"`` or ``"write"`` for a read-write lock on ``key``: many readers or
            one writer (see :meth:`LockClient.rw_lock <lockaspect.LockClient.rw_lock>`).
            Default ``None``: a plain lock.
        keys: Instead of ``key``, several keys to lock all at once (see
            :meth:`LockClient.multi_lock <lockaspect.LockClient.multi_lock>`): a list of key
            templates (``["account:<src>", "account:<dst>"]``), or a callable that takes the
            bound arguments and returns a list of keys (for a set that depends on the call,
            e.g. ``lambda a: [f"sku:{s}" for s in a["skus"]]``). The body runs inline;
            ``on_failure`` gets the busy key.
        scope: ``"session"`` (default): the client's store holds the lock. ``"transaction"``:
            a PostgreSQL advisory lock taken in ``connection``'s open transaction and held
            until it commits or rolls back (no lease, no watchdog; docs/stores/sql.md).
        connection: With ``scope="transaction"``: the connection (psycopg 3, SQLAlchemy
            ``Session``/``Connection``, Django), the name of the parameter that holds it
            (``connection="session"``), or a callable taking the bound arguments.

    Raises:
        KeyTemplateError: At decoration, for a malformed template or a name the function
            does not have; at call time (before any store I/O, the body not run) when the
            key cannot be rendered for the arguments.
        ConfigurationError: At decoration, for bad options, generator functions, and
            ``async def`` functions given an executor.
        TypeError: At decoration, for options of the wrong type.

    At call time the decorated function raises what the body raises, plus
    :class:`~lockaspect.LockNotAcquired`, :class:`~lockaspect.LockLost` and
    :class:`~lockaspect.BackendError`.

    Example::

        @distributed_lock(key="order:<user.id>", wait=2.0)
        def create_order(user, voucher_id):
            lease = current_lease()
            ledger.write(user, voucher_id, fence=lease.fencing_token)
    """
    return _decorator(
        key,
        client,
        policy,
        lease=lease,
        delay_weight=delay_weight,
        wait=wait,
        on_failure=on_failure,
        on_lost=on_lost,
        executor=executor,
        max_hold=max_hold,
        wait_strategy=wait_strategy,
        fair=fair,
        mode=mode,
        keys=keys,
        scope=scope,
        connection=connection,
    )


def _decorator(key: Any, client: Any, policy: Any, **given: Any) -> Callable[[F], F]:
    """Check the options given explicitly (``_UNSET``: not given, a policy may supply it) and
    return the decorator (shared by the lock and the semaphore)."""
    if client is not None and not isinstance(client, LockClient):
        raise TypeError(f"client must be a LockClient, got {type(client).__name__}")
    explicit = options.explicit({"key": key, "policy": policy, **given})
    # Check the explicit options now, even if a policy will be merged in later.
    options.check(explicit)

    def decorate(function: F) -> F:
        target: Any = function
        if isinstance(target, (classmethod, staticmethod)):
            target = target.__func__
        if not callable(target):
            raise TypeError(f"@distributed_lock decorates functions, not {type(function).__name__}")
        if callable(getattr(target, "apply_async", None)) and callable(getattr(target, "delay", None)):
            raise ConfigurationError(  # a Celery task: .delay() would go round the lock
                f"@distributed_lock is above the task decorator of {getattr(target, 'name', target)!r}: put it "
                "below (@app.task(...) first, then @distributed_lock(...)), so the worker runs the body locked"
            )
        if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
            raise ConfigurationError(
                f"@distributed_lock cannot decorate generator function {target.__qualname__}(): "
                "the lock would be released when the generator is created, not when it is done; "
                "lock inside the generator with client.lock() instead"
            )
        is_async = inspect.iscoroutinefunction(target)
        if is_async and explicit.get("executor") not in (None, "inline"):
            raise ConfigurationError(
                f"executor= does not apply to async def {target.__qualname__}(): its body runs as a "
                "task on the running event loop"
            )
        aspect = _LockAspect(target, explicit, client)
        aspect.resolve(at_call=False, client=client)

        if is_async:

            async def async_wrapper(
                wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                return await aspect.acall(wrapped, instance, args, kwargs)

            # A call returns the coroutine of this function, which takes its __name__ and
            # __qualname__ from it: name it after the decorated function (a new function
            # per decoration), so "coroutine 'Jobs.run' was never awaited" says whose.
            name_after(async_wrapper, target)
            return cast(F, wrapt.decorator(async_wrapper)(function))

        @wrapt.decorator
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return aspect(wrapped, instance, args, kwargs)

        return cast(F, wrapper(function))

    return decorate


def distributed_semaphore(
    key: str | Callable[[Mapping[str, Any]], str] | None = None,
    *,
    permits: int,
    lease: float | None = _UNSET,
    delay_weight: float = _UNSET,
    wait: float | None = _UNSET,
    on_failure: Callable[[FailureContext], Any] | None = _UNSET,
    on_lost: Callable[[Any], object] | None = _UNSET,
    executor: Executor | str | None = _UNSET,
    client: LockClient | None = None,
    policy: str | None = None,
    max_hold: float | None = _UNSET,
    wait_strategy: str = _UNSET,
) -> Callable[[F], F]:
    """Run the decorated function holding one of ``permits`` permits of the semaphore ``key``.

    At most ``permits`` calls (across all processes using the key) run at once; the next
    waits (``wait``) or fails. Each permit has a lease of its own, renewed by the watchdog
    while its call runs (``lease=None``) or fixed (``lease=seconds``), so the permit of a
    process that dies comes back when its lease ends. Every other argument means what it
    means for :func:`distributed_lock`; :func:`~lockaspect.current_lease` returns the
    permit's lease (``lease.permits``, ``lease.fencing_token``). A nested call on the same
    semaphore in the same context re-enters the permit it holds.

    ``permits`` is checked against the store: a semaphore created with another number fails
    the call with :class:`~lockaspect.ConfigurationError`; change the number explicitly with
    :meth:`LockClient.set_permits <lockaspect.LockClient.set_permits>`.

    Raises:
        TypeError: At decoration, ``permits`` is not an ``int``.
        ConfigurationError: At decoration, ``permits`` < 1, and as for
            :func:`distributed_lock`.

    Example::

        @distributed_semaphore(key="pdf-render", permits=4, wait=30)
        def render(doc): ...
    """
    return _decorator(
        key, client, policy, permits=permits, lease=lease, delay_weight=delay_weight, wait=wait,
        on_failure=on_failure, on_lost=on_lost, executor=executor, max_hold=max_hold, wait_strategy=wait_strategy,
    )  # fmt: skip
