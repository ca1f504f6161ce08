"""Binding a call's arguments to the names a key template may read.

:class:`ArgumentNames` is built once per decorated function: it knows the function's
parameters and turns each call's ``args``/``kwargs`` into a mapping of names (the
parameters, plus ``args``, ``kwargs``, ``p0``..``pN`` and ``func``), on a fast path when
the signature allows it. Re-exported by :mod:`lockaspect.keys`.

This module does no I/O and knows nothing about templates or stores.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["RESERVED_NAMES", "ArgumentNames", "name_after"]

#: Names every template may use besides the parameters (a parameter of the same name wins).
RESERVED_NAMES: Final = frozenset({"args", "kwargs", "func"})

_P_NAME = re.compile(r"p(0|[1-9][0-9]*)\Z")


class ArgumentNames:
    """Turns a call's arguments into the names a key template sees.

    Built once per decorated function. The names are the function's parameters (defaults
    applied; ``self``/``cls`` included for methods), ``args`` (the positional argument
    values after ``self``/``cls``), ``kwargs`` (keyword-only and extra keyword arguments),
    ``p0``..``pN`` (aliases of ``args[i]``, like SpEL's ``#p0``) and ``func`` (the
    function's qualified name). A parameter with one of these names shadows it. When the
    function takes ``**kwargs``, extra keyword arguments are also names of their own.
    """

    __slots__ = (
        "_all",
        "_defaults",
        "_fast",
        "_nparams",
        "_npositional",
        "_pos_index",
        "_pos_names",
        "_signature",
        "has_var_keyword",
        "has_var_positional",
        "method_like",
        "parameters",
        "qualname",
    )

    def __init__(self, func: Callable[..., Any]) -> None:
        signature = inspect.signature(func, follow_wrapped=False)
        self._signature = signature
        self.qualname: str = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        params = list(signature.parameters.values())
        kinds = {param.kind for param in params}
        self.parameters = tuple(param.name for param in params)
        self.has_var_positional = inspect.Parameter.VAR_POSITIONAL in kinds
        self.has_var_keyword = inspect.Parameter.VAR_KEYWORD in kinds
        self._fast = not (self.has_var_positional or self.has_var_keyword or inspect.Parameter.POSITIONAL_ONLY in kinds)
        self._pos_names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._pos_index = {name: i for i, name in enumerate(self._pos_names)}
        for param in params:
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                self._pos_index[param.name] = 1 << 30
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._nparams = len(params)
        self._all = frozenset(self.parameters) | RESERVED_NAMES
        # p-aliases index the arguments after self/cls. Whether a function becomes a method
        # is only known per call, so the decoration-time check goes by the usual names.
        self._npositional = sum(
            p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params
        )
        #: The first parameter is ``self``/``cls``: not an argument for ``args``/``p<i>``.
        self.method_like = bool(params) and params[0].name in ("self", "cls") and self._npositional > 0
        if self.method_like:
            self._npositional -= 1

    def accepts(self, name: str) -> bool:
        """Whether a template may read ``name`` for this function."""
        if name in self._all or self.has_var_keyword:
            return True
        match = _P_NAME.match(name)
        return match is not None and (self.has_var_positional or int(match.group(1)) < self._npositional)

    def listing(self) -> list[str]:
        """The names a template may read, for error messages."""
        names = sorted(set(self.parameters) - RESERVED_NAMES)
        names += sorted(RESERVED_NAMES)
        if self.has_var_positional:
            names.append("p0..pN")
        elif self._npositional:
            names.append(f"p0..p{self._npositional - 1}" if self._npositional > 1 else "p0")
        return names

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The parameter names with their values; ``TypeError`` if the call does not bind."""
        if self._fast and len(args) <= len(self._pos_names):
            names = self._defaults.copy()
            names.update(zip(self._pos_names, args, strict=False))
            if kwargs:
                index = self._pos_index
                count = len(args)
                for name, value in kwargs.items():
                    at = index.get(name)
                    if at is None or at < count:
                        return self._slow_bind(args, kwargs)
                    names[name] = value
            if len(names) == self._nparams:
                return names
        return self._slow_bind(args, kwargs)

    def _slow_bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        names = dict(bound.arguments)
        if self.has_var_keyword:
            for param in self._signature.parameters.values():
                if param.kind is inspect.Parameter.VAR_KEYWORD:
                    for name, value in names[param.name].items():
                        names.setdefault(name, value)
        return names

    def extend(self, names: dict[str, Any], wanted: frozenset[str], skip: int) -> dict[str, Any]:
        """Add the reserved names a template reads (``args``, ``kwargs``, ``p<i>``, ``func``).

        ``skip`` is 1 for a bound method or classmethod (``self``/``cls`` is not an
        argument), else 0.
        """
        extra = wanted.difference(names)
        if not extra:
            return names
        positional: tuple[Any, ...] | None = None
        for name in extra:
            if name == "func":
                names["func"] = self.qualname
            elif name == "kwargs":
                names["kwargs"] = self._keywords(names)
            elif name == "args" or _P_NAME.match(name):
                if positional is None:
                    positional = self._positional(names)[skip:]
                if name == "args":
                    names["args"] = positional
                else:
                    index = int(name[1:])
                    if index < len(positional):
                        names[name] = positional[index]
        return names

    def _positional(self, names: Mapping[str, Any]) -> tuple[Any, ...]:
        values: list[Any] = []
        for param in self._signature.parameters.values():
            if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                values.append(names[param.name])
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                values.extend(names[param.name])
        return tuple(values)

    def _keywords(self, names: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for param in self._signature.parameters.values():
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                values[param.name] = names[param.name]
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(names[param.name])
        return values


def name_after(wrapper: Callable[..., Any], target: Any) -> None:
    """Give ``wrapper`` the ``__name__`` and ``__qualname__`` of ``target`` (of the function
    inside, for a ``functools.partial``), so the coroutines it creates carry them."""
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(target, "__name__", None)
    qualname = getattr(target, "__qualname__", name)
    if isinstance(name, str):
        wrapper.__name__ = name
    if isinstance(qualname, str):
        wrapper.__qualname__ = qualname
