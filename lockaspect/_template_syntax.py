"""Key template syntax: scanning ``<expr>`` placeholders and checking each expression.

:func:`parse_pieces` splits a template into literal text and :class:`Placeholder` s, and
checks every expression before anything evaluates it: the nesting pre-scan (linear, before
:func:`ast.parse` sees the text), the parse, the allow-list of node types (names,
attributes not starting with ``_``, constant subscripts, registered resolvers' calls,
``str``/``int`` constants) and that two placeholders are separated by a character values
can never contain raw. :class:`lockaspect.keys.KeyTemplate` builds on it.

This module does no I/O and does not evaluate anything.
"""

from __future__ import annotations

import ast
import keyword
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from ._resolvers import abbreviated
from .errors import KeyTemplateError

__all__ = ["MAX_EXPRESSION_DEPTH", "Placeholder", "parse_pieces"]

#: Deepest nesting of one placeholder's expression: the levels of its syntax tree, where
#: ``<user>`` is 1, ``<user.id>`` 2, ``<order.items[0].sku>`` 4 and each bracket, attribute,
#: subscript, call or unary minus adds one. Real templates stay well below it; a deeper
#: expression would cost the parser and the evaluator recursion and memory.
MAX_EXPRESSION_DEPTH: Final = 32

# Literal characters that separate two placeholders unambiguously: values can never
# contain them raw.
_SEPARATORS = re.compile(r"[:*?\[\]\\\s\x00-\x1f\x7f-\x9f]")


class Placeholder:
    """One ``<expr>`` of a template: its text, parsed tree, position and the resolvers it calls."""

    __slots__ = ("expression", "functions", "node", "position")

    def __init__(self, expression: str, node: ast.expr, position: int, functions: dict[str, Any]) -> None:
        self.expression = expression
        self.node = node
        self.position = position
        self.functions = functions


def parse_pieces(
    template: str, resolvers: Mapping[str, Callable[..., Any]]
) -> tuple[list[str | Placeholder], set[str]]:
    """The template's literal pieces and checked placeholders, and every name they read.

    Raises :class:`KeyTemplateError` on any problem; ``resolvers`` are the callables an
    expression may call (a snapshot of the registry).
    """
    pieces: list[str | Placeholder] = []
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
        pieces.append(Placeholder(expression, node, position, functions))
    _check_separated(pieces, template)
    return pieces, used


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
        f"<{abbreviated(expression)}> in key template {abbreviated(template)!r} at position {at}: "
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


def _check_separated(pieces: list[str | Placeholder], template: str) -> None:
    for i in range(1, len(pieces)):
        piece = pieces[i]
        if not isinstance(piece, Placeholder):
            continue
        before = pieces[i - 1]
        if isinstance(before, Placeholder):
            raise KeyTemplateError(
                f"placeholders <{before.expression}> and <{piece.expression}> in key template "
                f"{template!r} are adjacent; separate them with ':' so distinct values cannot "
                f"render the same key",
                template=template,
                position=piece.position - 1,
            )
        if i >= 2 and isinstance(pieces[i - 2], Placeholder) and not _SEPARATORS.search(before):
            previous = pieces[i - 2]
            assert isinstance(previous, Placeholder)
            raise KeyTemplateError(
                f"placeholders <{previous.expression}> and <{piece.expression}> in key template "
                f"{template!r} are separated by {before!r}, which values may contain; use ':' "
                f"(or another of : * ? [ ] \\ or whitespace) so distinct values cannot render "
                f"the same key",
                template=template,
                position=piece.position - 1,
            )
