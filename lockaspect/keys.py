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

This module does no I/O and knows nothing about stores or namespaces.
"""

from __future__ import annotations

import ast
import enum
import inspect
import keyword
import operator
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final

from simpleeval import AttributeDoesNotExist, FeatureNotAvailable, InvalidExpression, NameNotDefined, SimpleEval

from .errors import KeyTemplateError

__all__ = [
    "DEFAULT_MAX_KEY_BYTES",
    "MAX_EXPRESSION_DEPTH",
    "MAX_TEMPLATE_LENGTH",
    "ArgumentNames",
    "KeyTemplate",
    "check_key",
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

#: Deepest nesting of one placeholder's expression: the levels of its syntax tree, where
#: ``<user>`` is 1, ``<user.id>`` 2, ``<order.items[0].sku>`` 4 and each bracket, attribute,
#: subscript, call or unary minus adds one. Real templates stay well below it; a deeper
#: expression would cost the parser and the evaluator recursion and memory.
MAX_EXPRESSION_DEPTH: Final = 32

#: Names every template may use besides the parameters (a parameter of the same name wins).
RESERVED_NAMES: Final = frozenset({"args", "kwargs", "func"})

_P_NAME = re.compile(r"p(0|[1-9][0-9]*)\Z")
# Lone surrogates (e.g. from os.fsdecode) are encoded too, so every key is valid UTF-8.
_ENCODE = re.compile(r"[%:{}*?\[\]\\\s\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# Literal characters that separate two placeholders unambiguously: values can never
# contain them raw.
_SEPARATORS = re.compile(r"[:*?\[\]\\\s\x00-\x1f\x7f-\x9f]")

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


def encode_value(value: str) -> str:
    """Percent-encode the characters of ``value`` that are structural in keys."""
    if _ENCODE.search(value) is None:
        return value
    return _ENCODE.sub(_percent, value)


def _percent(match: re.Match[str]) -> str:
    return "".join(f"%{byte:02X}" for byte in match.group().encode("utf-8", "surrogatepass"))


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


def _render_value(value: Any, expression: str, template: str, max_bytes: int = DEFAULT_MAX_KEY_BYTES) -> str:
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
        return _render_value(value.value, expression, template, max_bytes)
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
            f"<{expression}> of key template {_abbreviated(template)!r} is an int of at least {digits} "
            f"digits, too long for a key (cap: {max_bytes} bytes)",
            template=template,
            expression=expression,
        )
    return str(value)


def _abbreviated(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


class _Placeholder:
    __slots__ = ("expression", "functions", "node", "position")

    def __init__(self, expression: str, node: ast.expr, position: int, functions: dict[str, Any]) -> None:
        self.expression = expression
        self.node = node
        self.position = position
        self.functions = functions


class KeyTemplate:
    """A parsed key template. Build with :meth:`parse`; render with :meth:`render`."""

    __slots__ = ("_pieces", "max_bytes", "names", "template")

    def __init__(self, template: str, pieces: list[str | _Placeholder], names: frozenset[str], max_bytes: int) -> None:
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
        with _registry_lock:
            resolvers = dict(_RESOLVERS)
        pieces: list[str | _Placeholder] = []
        used: set[str] = set()
        for piece in _scan(template):
            if isinstance(piece, str):
                pieces.append(piece)
                continue
            expression, position = piece
            _check_nesting(expression, position, template)
            node = _parse_expression(expression, position, template)
            functions: dict[str, Any] = {}
            _check_node(node, expression, position, template, resolvers, used, functions)
            pieces.append(_Placeholder(expression, node, position, functions))
        _check_separated(pieces, template)
        if names is not None:
            unknown = sorted(name for name in used if not names.accepts(name))
            if unknown:
                raise KeyTemplateError(
                    f"key template {template!r} uses {', '.join(unknown)}, which "
                    f"{'is not a name' if len(unknown) == 1 else 'are not names'} of "
                    f"{names.qualname}(); available names: {', '.join(names.listing())}",
                    template=template,
                    expression=unknown[0],
                )
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
            assert isinstance(piece, _Placeholder)
            out.append(self._render(piece, self._evaluate(piece, names)))
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
            assert isinstance(piece, _Placeholder)
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

    def _render(self, piece: _Placeholder, value: Any) -> str:
        """One placeholder's value as key text; any failure converting it (an int past
        Python's int-to-str digit limit, a ``__str__``, ``__int__`` or enum ``value`` that
        raises, ...) is a :class:`KeyTemplateError` naming the placeholder."""
        template = self.template
        try:
            return _render_value(value, piece.expression, template, self.max_bytes)
        except KeyTemplateError as exc:
            if exc.position is None:
                exc.position = piece.position
            raise
        except Exception as exc:
            raise KeyTemplateError(
                f"rendering <{piece.expression}> of key template {_abbreviated(template)!r} raised "
                f"{type(exc).__name__}: {_abbreviated(_safe_str(exc), 200)}",
                template=template,
                position=piece.position,
                expression=piece.expression,
            ) from exc

    def _evaluate(self, piece: _Placeholder, names: Mapping[str, Any]) -> Any:
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


def _scan(template: str) -> list[str | tuple[str, int]]:
    pieces: list[str | tuple[str, int]] = []
    literal: list[str] = []
    i, n = 0, len(template)
    while i < n:
        char = template[i]
        if char == "<":
            if template.startswith("<<", i):
                literal.append("<")
                i += 2
                continue
            end = _placeholder_end(template, i)
            expression = template[i + 1 : end]
            if not expression.strip():
                raise KeyTemplateError(
                    f"empty placeholder '<>' in key template {template!r} at position {i}",
                    template=template,
                    position=i,
                )
            if literal:
                pieces.append("".join(literal))
                literal = []
            pieces.append((expression, i + 1))
            i = end + 1
        elif char == ">":
            if template.startswith(">>", i):
                literal.append(">")
                i += 2
                continue
            raise KeyTemplateError(
                f"unbalanced '>' in key template {template!r} at position {i}; write '>>' for a literal '>'",
                template=template,
                position=i,
            )
        elif char in "{}":
            raise KeyTemplateError(
                f"{char!r} in key template {template!r} at position {i}: '{{' and '}}' are "
                "reserved for the store's hash tag",
                template=template,
                position=i,
            )
        else:
            literal.append(char)
            i += 1
    if literal:
        pieces.append("".join(literal))
    return pieces


def _placeholder_end(template: str, start: int) -> int:
    quote = ""
    depth = 0
    j = start + 1
    while j < len(template):
        char = template[j]
        if quote:
            if char == "\\":
                j += 2
                continue
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == ">" and depth <= 0:
            return j
        elif char == "<":
            break
        j += 1
    raise KeyTemplateError(
        f"unclosed '<' in key template {template!r} at position {start}",
        template=template,
        position=start,
    )


#: Characters of operators, attribute access and slices: each may add a level to the tree.
_OPERATOR_CHARS: Final = frozenset(".+-*/%@&|^~<>=!:")
#: Keywords that build a node (``not x``, ``a if c else b``, ``lambda``, ...).
_NODE_KEYWORDS: Final = frozenset(keyword.kwlist)


def _too_deep(expression: str, template: str, at: int) -> KeyTemplateError:
    return KeyTemplateError(
        f"<{_abbreviated(expression)}> in key template {_abbreviated(template)!r} at position {at}: "
        f"the expression nests more than {MAX_EXPRESSION_DEPTH} levels deep",
        template=template,
        position=at,
        expression=expression,
    )


def _check_nesting(expression: str, position: int, template: str) -> None:
    """Reject an expression nested deeper than :data:`MAX_EXPRESSION_DEPTH`, in one pass
    over its text, before :func:`ast.parse` (whose parser and tree builder recurse).

    The estimate counts, per bracket level, the operator characters, attribute dots,
    colons, keywords and the calls or subscripts chained since that level's last ``,``
    (which counts one, for a tuple); an opening bracket adds one level, and the estimate is
    1 plus the counts of all open levels. It errs on the high side (``<((x))>`` counts 3),
    and stops ``<------x>``, ``<a.b.b.b...>``, ``<a[0][0]...>`` and ``<f(f(f(...)))>``
    alike after at most ``MAX_EXPRESSION_DEPTH`` steps of nesting; the parsed tree is
    checked exactly afterwards.
    """
    levels = [0]
    depth = 1
    i, n = 0, len(expression)
    while i < n:
        start = i
        char = expression[i]
        if char in "'\"":
            i = _string_end(expression, i)
            continue
        if char.isalpha() or char == "_":
            j = i + 1
            while j < n and (expression[j].isalnum() or expression[j] == "_"):
                j += 1
            if expression[i:j] in _NODE_KEYWORDS:
                levels[-1] += 1
                depth += 1
            i = j
        else:
            if char in "([":
                levels[-1] += 1
                levels.append(0)
                depth += 1
            elif char in ")]":
                if len(levels) > 1:  # an unbalanced one is left to ast.parse to report
                    depth -= levels.pop()
            elif char == ",":
                depth -= levels[-1] - 1
                levels[-1] = 1
            elif char in _OPERATOR_CHARS:
                levels[-1] += 1
                depth += 1
            i += 1
        if depth > MAX_EXPRESSION_DEPTH:
            raise _too_deep(expression, template, position + start)


def _string_end(expression: str, start: int) -> int:
    """The index after the string literal opening at ``start`` (or the end of the text)."""
    quote = expression[start]
    if expression.startswith(quote * 3, start):
        quote *= 3
    i, n = start + len(quote), len(expression)
    while i < n:
        if expression[i] == "\\":
            i += 2
        elif expression.startswith(quote, i):
            return i + len(quote)
        else:
            i += 1
    return n


def _tree_depth(node: ast.AST) -> int:
    """Levels of the tree under ``node`` (``node`` alone: 1), without recursion; operator
    and context nodes (``ast.USub``, ``ast.Load``) do not count."""
    deepest = 0
    stack = [(node, 1)]
    while stack:
        current, depth = stack.pop()
        deepest = max(deepest, depth)
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, _LEAF_NODES):
                stack.append((child, depth + 1))
    return deepest


_LEAF_NODES: Final = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)


def _parse_expression(expression: str, position: int, template: str) -> ast.expr:
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        lead = len(expression) - len(expression.lstrip())
        offset = position + lead + max((exc.offset or 1) - 1, 0)
        raise KeyTemplateError(
            f"invalid expression <{expression}> in key template {template!r} at position {offset}: {exc.msg}",
            template=template,
            position=offset,
            expression=expression,
        ) from None
    except (MemoryError, RecursionError):  # the pre-scan should make this unreachable
        raise _too_deep(expression, template, position) from None
    if _tree_depth(tree.body) > MAX_EXPRESSION_DEPTH:
        raise _too_deep(expression, template, position)
    return tree.body


def _check_node(
    node: ast.AST,
    expression: str,
    position: int,
    template: str,
    resolvers: Mapping[str, Any],
    used: set[str],
    functions: dict[str, Any],
) -> None:
    def fail(why: str) -> KeyTemplateError:
        return KeyTemplateError(
            f"<{expression}> in key template {template!r} at position {position}: {why}",
            template=template,
            position=position,
            expression=expression,
        )

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_"):
                raise fail(f"attribute {node.attr!r} starts with '_'; private and dunder attributes are not allowed")
            visit(node.value)
        elif isinstance(node, ast.Subscript):
            index = node.slice
            if not _is_constant_index(index):
                raise fail("subscripts must be constant ints or strings, like [0] or ['tenant']")
            visit(node.value)
        elif isinstance(node, ast.Call):
            callee = node.func
            if not isinstance(callee, ast.Name):
                raise fail("only registered resolvers can be called (see register_resolver)")
            if callee.id not in resolvers:
                known = ", ".join(sorted(resolvers)) or "none registered"
                raise fail(f"{callee.id!r} is not a registered resolver ({known})")
            functions[callee.id] = resolvers[callee.id]
            for arg in node.args:
                if isinstance(arg, ast.Starred):
                    raise fail("*args are not allowed in resolver calls")
                visit(arg)
            for keyword in node.keywords:
                if keyword.arg is None:
                    raise fail("**kwargs are not allowed in resolver calls")
                visit(keyword.value)
        elif isinstance(node, ast.Constant):
            if type(node.value) not in (str, int):
                raise fail(f"constant {node.value!r} is not allowed; only str and int constants")
        else:
            raise fail(f"{type(node).__name__} expressions are not allowed in keys")

    visit(node)


def _is_constant_index(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (str, int)
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    )


def _check_separated(pieces: list[str | _Placeholder], template: str) -> None:
    for i in range(1, len(pieces)):
        piece = pieces[i]
        if not isinstance(piece, _Placeholder):
            continue
        before = pieces[i - 1]
        if isinstance(before, _Placeholder):
            raise KeyTemplateError(
                f"placeholders <{before.expression}> and <{piece.expression}> in key template "
                f"{template!r} are adjacent; separate them with ':' so distinct values cannot "
                f"render the same key",
                template=template,
                position=piece.position - 1,
            )
        if i >= 2 and isinstance(pieces[i - 2], _Placeholder) and not _SEPARATORS.search(before):
            previous = pieces[i - 2]
            assert isinstance(previous, _Placeholder)
            raise KeyTemplateError(
                f"placeholders <{previous.expression}> and <{piece.expression}> in key template "
                f"{template!r} are separated by {before!r}, which values may contain; use ':' "
                f"(or another of : * ? [ ] \\ or whitespace) so distinct values cannot render "
                f"the same key",
                template=template,
                position=piece.position - 1,
            )


# -- binding call arguments to names --------------------------------------------------------


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
