"""Key templates: ``"order:<user.id>"`` parsed once, rendered per call.

A template is literal text with ``<expr>`` placeholders. Each expression is parsed when
the decorator is applied and checked against an allow-list: names, attribute access
(never ``_``-prefixed), constant subscripts (``<items[0]>``, ``<payload["tenant"]>``) and
calls of registered resolvers (``<tenant_of(request)>``). Nothing else: no operators,
lambdas, comprehensions or arbitrary calls. Per call a fresh :mod:`simpleeval` evaluator
computes each value from the bound arguments.

Values render only from ``str``, ``int``, :class:`uuid.UUID` and :class:`enum.Enum` (by
value), or through a converter registered with :func:`register_converter`. Inside values
the characters that are structural in store keys (``% : { } * ? [ ] \\``, whitespace and
control characters) are percent-encoded, and two placeholders must be separated by such a
character, so distinct arguments always give distinct keys. ``<<`` and ``>>`` write literal
``<`` and ``>``. ``{`` and ``}`` may not appear in templates: they delimit the store's
hash tag.

Parsing and rendering take bounded time and memory whatever the input: a template is at
most :data:`MAX_TEMPLATE_LENGTH` characters and each expression nests at most
:data:`MAX_EXPRESSION_DEPTH` levels, checked by a linear pre-scan before :func:`ast.parse`
sees the text (so ``<---...---x>`` or ``<a.b.b...b>`` cannot exhaust the parser or the
recursion limit) and again on the parsed tree. At call time an ``int`` too long for a key
(or one past Python's int-to-str digit limit), and any value whose conversion raises,
gives a :class:`KeyTemplateError` naming the placeholder, before any I/O.

The work is split by job: :mod:`lockaspect._template_syntax` scans and checks templates,
:mod:`lockaspect._resolvers` holds the resolver and converter registries and renders one
value, :mod:`lockaspect._arguments` binds a call's arguments to names. This module is the
public face (:class:`KeyTemplate`, :func:`check_key` and the re-exported names) and
evaluates placeholders.

This module does no I/O and knows nothing about stores or namespaces.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final

from simpleeval import AttributeDoesNotExist, FeatureNotAvailable, InvalidExpression, NameNotDefined, SimpleEval

from ._arguments import RESERVED_NAMES as RESERVED_NAMES
from ._arguments import ArgumentNames as ArgumentNames
from ._resolvers import abbreviated, render_value, resolvers
from ._resolvers import encode_value as encode_value
from ._resolvers import register_converter as register_converter
from ._resolvers import register_resolver as register_resolver
from ._template_syntax import MAX_EXPRESSION_DEPTH as MAX_EXPRESSION_DEPTH
from ._template_syntax import Placeholder, parse_pieces
from .errors import ConfigurationError, KeyTemplateError

__all__ = [
    "DEFAULT_MAX_KEY_BYTES",
    "MAX_EXPRESSION_DEPTH",
    "MAX_TEMPLATE_LENGTH",
    "ArgumentNames",
    "KeyTemplate",
    "check_key",
    "check_keys",
    "encode_value",
    "register_converter",
    "register_resolver",
]

#: Longest rendered key accepted, in UTF-8 bytes.
DEFAULT_MAX_KEY_BYTES: Final = 1024

#: Longest key template accepted, in characters (4 KiB of ASCII text): four times the
#: :data:`DEFAULT_MAX_KEY_BYTES` a rendered key may have, so no real template comes near it.
#: Checked first, so nothing else ever looks at more text than this.
MAX_TEMPLATE_LENGTH: Final = 4096


def check_keys(keys: object) -> tuple[str, ...]:
    """A multi-key lock's keys: each checked, deduplicated and sorted (the order they are taken
    in); at least one."""
    if isinstance(keys, str) or not isinstance(keys, Iterable):
        raise TypeError("keys must be an iterable of keys, not a single str (use client.lock)")
    checked = []
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"every key must be a str, got {type(key).__name__}")
        checked.append(check_key(key))
    if not checked:
        raise ConfigurationError("multi_lock needs at least one key")
    return tuple(sorted(set(checked)))


def check_key(key: object, *, max_bytes: int = DEFAULT_MAX_KEY_BYTES, template: str | None = None) -> str:
    """Validate a finished key (a literal, a rendered template, or a key callable's result)."""
    if not isinstance(key, str):
        raise KeyTemplateError(f"a lock key must be a str, got {type(key).__name__}", template=template)
    if not key:
        raise KeyTemplateError("a lock key must not be empty", template=template)
    if "{" in key or "}" in key:
        raise KeyTemplateError(
            f"lock key {key!r} contains '{{' or '}}', which are reserved for the store's hash tag",
            template=template,
            key=key,
        )
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise KeyTemplateError(
                f"lock key {key!r} is not valid UTF-8 (lone surrogate at position {exc.start})",
                template=template,
            ) from None
    if len(key) * 4 > max_bytes and len(key.encode("utf-8")) > max_bytes:
        raise KeyTemplateError(
            f"lock key is {len(key.encode('utf-8'))} bytes, over the {max_bytes}-byte cap (starts {key[:40]!r})",
            template=template,
        )
    return key


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a user's __str__ must not replace the KeyTemplateError
        return f"<unprintable {type(exc).__name__}>"


# -- evaluation ---------------------------------------------------------------------------


class _Evaluator(SimpleEval):  # type: ignore[misc]
    """A fresh, cheap simpleeval evaluator per render.

    ``SimpleEval.__init__`` rebuilds its dispatch table per instance and enters
    ``warnings.catch_warnings()``, which mutates process-global state and is not
    thread-safe; we share one class-level table instead. And simpleeval walks every
    container an expression touches (``_check_disallowed_items`` recurses into lists and
    dicts), which would traverse a huge or cyclic argument that the template merely
    indexes into; the allow-list checked at parse time already rules out calls of
    anything but registered resolvers, so only the value itself is checked here.
    """

    _dispatch: ClassVar[dict[type, Callable[[Any, Any], Any]]] = {}

    def __init__(self, names: Mapping[str, Any], functions: Mapping[str, Any]) -> None:
        self.names = names
        self.functions = functions
        self.operators: dict[Any, Any] = {ast.USub: operator.neg}  # negative indices: <items[-1]>
        self.allowed_attrs = None
        self.ATTR_INDEX_FALLBACK = True
        self.expr = ""

    def _eval(self, node: Any) -> Any:
        try:
            handler = self._dispatch[type(node)]
        except KeyError:
            raise FeatureNotAvailable(f"{type(node).__name__} is not available") from None
        return handler(self, node)

    def _check_disallowed_items(self, item: Any) -> None:
        return None

    def __del__(self) -> None:
        return None


_Evaluator._dispatch = {
    ast.Name: SimpleEval._eval_name,
    ast.Attribute: SimpleEval._eval_attribute,
    ast.Subscript: SimpleEval._eval_subscript,
    ast.Call: SimpleEval._eval_call,
    ast.keyword: SimpleEval._eval_keyword,
    # A staticmethod in simpleeval: unwrap it, since handlers are called as handler(self, node).
    ast.Constant: lambda _self, node: SimpleEval._eval_constant(node),
    ast.UnaryOp: SimpleEval._eval_unaryop,
}


class KeyTemplate:
    """A parsed key template. Build with :meth:`parse`; render with :meth:`render`."""

    __slots__ = ("_pieces", "max_bytes", "names", "template")

    def __init__(self, template: str, pieces: list[str | Placeholder], names: frozenset[str], max_bytes: int) -> None:
        self.template = template
        self._pieces = pieces
        #: Every name the template's expressions read (resolver names excluded).
        self.names = names
        self.max_bytes = max_bytes

    @classmethod
    def parse(
        cls,
        template: str,
        *,
        names: ArgumentNames | None = None,
        max_bytes: int = DEFAULT_MAX_KEY_BYTES,
    ) -> KeyTemplate:
        """Parse and check ``template``; raise :class:`KeyTemplateError` on any problem.

        Args:
            template: The template text.
            names: The decorated function's names; every name an expression reads must be
                one of them. ``None`` skips the check.
            max_bytes: Cap on the rendered key's UTF-8 length.

        A template longer than :data:`MAX_TEMPLATE_LENGTH` characters, or with an
        expression nested deeper than :data:`MAX_EXPRESSION_DEPTH` levels, is rejected
        before any of it is parsed.
        """
        if not isinstance(template, str):
            raise TypeError(f"key template must be a str, got {type(template).__name__}")
        if not template:
            raise KeyTemplateError("key template is empty", template=template)
        if len(template) > MAX_TEMPLATE_LENGTH:
            raise KeyTemplateError(
                f"key template is {len(template)} characters, over the {MAX_TEMPLATE_LENGTH}-character cap "
                f"(starts {template[:40]!r})",
                template=template,
            )
        pieces, used = parse_pieces(template, resolvers())
        if names is not None:
            _check_names(template, used, names)
        return cls(template, pieces, frozenset(used), max_bytes)

    @property
    def is_constant(self) -> bool:
        return all(isinstance(piece, str) for piece in self._pieces)

    def render(self, names: Mapping[str, Any]) -> str:
        """Render the key for one call; raises :class:`KeyTemplateError` before any I/O."""
        out: list[str] = []
        for piece in self._pieces:
            if type(piece) is str:
                out.append(piece)
                continue
            assert isinstance(piece, Placeholder)
            node = piece.node
            if type(node) is ast.Name and node.id in names:
                # A bare argument name (the usual ``<order_id>``): what simpleeval's name
                # lookup returns, without an evaluator per call.
                value = names[node.id]
            else:
                value = self._evaluate(piece, names)
            out.append(self._render(piece, value))
        return self._checked("".join(out))

    def render_many(self, names: Mapping[str, Any]) -> list[str]:
        """Render one key per element when one placeholder yields a list, tuple or set
        (``"sku:<skus>"`` with ``skus=["a", "b"]`` gives ``sku:a`` and ``sku:b``); else the
        one key. Raises :class:`KeyTemplateError` for several list-valued placeholders or
        an empty list, before any I/O."""
        template = self.template
        values: list[Any] = []
        expanded: int | None = None
        for index, piece in enumerate(self._pieces):
            if type(piece) is str:
                values.append(piece)
                continue
            assert isinstance(piece, Placeholder)
            value = self._evaluate(piece, names)
            if isinstance(value, (list, tuple, set, frozenset)):
                if expanded is not None:
                    raise KeyTemplateError(
                        f"key template {template!r}: only one placeholder may yield a list of values",
                        template=template,
                        position=piece.position,
                        expression=piece.expression,
                    )
                if not value:
                    raise KeyTemplateError(
                        f"<{piece.expression}> of key template {template!r} yields no values, so no keys",
                        template=template,
                        position=piece.position,
                        expression=piece.expression,
                    )
                expanded = index
            values.append(value)
        rows: list[list[Any]] = [values]
        if expanded is not None:
            rows = [[*values[:expanded], item, *values[expanded + 1 :]] for item in values[expanded]]
        keys = []
        for row in rows:
            out = []
            for piece, value in zip(self._pieces, row, strict=True):
                out.append(value if isinstance(piece, str) else self._render(piece, value))
            keys.append(self._checked("".join(out)))
        return keys

    def _render(self, piece: Placeholder, value: Any) -> str:
        """One placeholder's value as key text; any failure converting it (an int past
        Python's int-to-str digit limit, a ``__str__``, ``__int__`` or enum ``value`` that
        raises, ...) is a :class:`KeyTemplateError` naming the placeholder."""
        template = self.template
        try:
            return render_value(value, piece.expression, template, self.max_bytes)
        except KeyTemplateError as exc:
            if exc.position is None:
                exc.position = piece.position
            raise
        except Exception as exc:
            raise KeyTemplateError(
                f"rendering <{piece.expression}> of key template {abbreviated(template)!r} raised "
                f"{type(exc).__name__}: {abbreviated(_safe_str(exc), 200)}",
                template=template,
                position=piece.position,
                expression=piece.expression,
            ) from exc

    def _evaluate(self, piece: Placeholder, names: Mapping[str, Any]) -> Any:
        template = self.template
        try:
            return _Evaluator(names, piece.functions).eval(piece.expression, previously_parsed=piece.node)
        except KeyTemplateError:
            raise
        except (NameNotDefined, AttributeDoesNotExist, KeyError, IndexError, InvalidExpression) as exc:
            raise KeyTemplateError(
                f"cannot render <{piece.expression}> of key template {template!r}: {_describe(exc)}",
                template=template,
                position=piece.position,
                expression=piece.expression,
            ) from exc
        except Exception as exc:
            raise KeyTemplateError(
                f"evaluating <{piece.expression}> of key template {template!r} raised {type(exc).__name__}: {exc}",
                template=template,
                position=piece.position,
                expression=piece.expression,
            ) from exc

    def _checked(self, key: str) -> str:
        template = self.template
        if len(key) * 4 > self.max_bytes and len(key.encode("utf-8")) > self.max_bytes:
            raise KeyTemplateError(
                f"key rendered from {template!r} is {len(key.encode('utf-8'))} bytes, over the "
                f"{self.max_bytes}-byte cap",
                template=template,
            )
        return key

    def __repr__(self) -> str:
        return f"KeyTemplate({self.template!r})"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NameNotDefined):
        return f"name {exc.name!r} is not defined"
    if isinstance(exc, AttributeDoesNotExist):
        return f"no attribute {exc.attr!r}"
    if isinstance(exc, KeyError):
        return f"no item {exc.args[0]!r}" if exc.args else "missing item"
    if isinstance(exc, IndexError):
        return "index out of range"
    return str(exc)


def _check_names(template: str, used: set[str], names: ArgumentNames) -> None:
    """Every name the template reads must be one of the decorated function's names."""
    unknown = sorted(name for name in used if not names.accepts(name))
    if unknown:
        raise KeyTemplateError(
            f"key template {template!r} uses {', '.join(unknown)}, which "
            f"{'is not a name' if len(unknown) == 1 else 'are not names'} of "
            f"{names.qualname}(); available names: {', '.join(names.listing())}",
            template=template,
            expression=unknown[0],
        )
