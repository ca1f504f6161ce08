"""Key templates and values of any size fail with ``KeyTemplateError`` in bounded time and memory.

Before: ``"<" + "-" * 100000 + "x>"`` made the parser raise ``MemoryError``, a 1,000-deep
attribute chain or 50k nested subscripts a ``RecursionError`` (or ``MemoryError``) when the
decorator was applied, and an ``int`` over Python's 4,300-digit int-to-str limit a raw
``ValueError`` at call time. Now a template is capped at 4096 characters
(``keys.MAX_TEMPLATE_LENGTH``) and an expression at 32 levels of nesting
(``keys.MAX_EXPRESSION_DEPTH``), checked by a linear pre-scan before ``ast.parse`` and again on
the tree; and a value that cannot be converted is a ``KeyTemplateError`` naming its
placeholder, raised before anything reaches the store.

"Bounded" is not timed here: each test simply has to finish (the suite's per-test timeout
is 120 s), and the old code fails these tests with the wrong exception type.
"""

from __future__ import annotations

import asyncio
import enum
import sys
import uuid
from typing import Any

import pytest

from lockaspect import (
    KeyTemplateError,
    LockClient,
    _resolvers,
    _template_syntax,
    distributed_lock,
    keys,
    register_resolver,
)
from lockaspect.keys import KeyTemplate

#: Python's int-to-str digit limit (0: unlimited, or a Python without one).
INT_DIGITS_LIMIT: int = getattr(sys, "get_int_max_str_digits", lambda: 0)()

needs_digit_limit = pytest.mark.skipif(INT_DIGITS_LIMIT == 0, reason="no int-to-str digit limit in this Python")

#: Templates that used to raise MemoryError / RecursionError while being parsed.
PATHOLOGICAL = {
    "unary-minus-100k": "<" + "-" * 100_000 + "x>",
    "attribute-chain-1000": "<a" + ".b" * 1000 + ">",
    "subscript-chain-50k": "<a" + "[0]" * 50_000 + ">",
    "nested-subscripts-50k": "<a" + "[a" * 50_000 + "]" * 50_000 + ">",
    "subscript-chain-1000": "<a" + "[0]" * 1000 + ">",
    "nested-subscripts-1000": "<a" + "[a" * 1000 + "]" * 1000 + ">",
    "unary-minus-1000": "k:<" + "-" * 1000 + "x>",
    "nested-parentheses-150": "<" + "(" * 150 + "x" + ")" * 150 + ">",
}


@pytest.fixture(autouse=True)
def _isolated_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolvers and converters registered by one test are gone in the next."""
    monkeypatch.setattr(_resolvers, "_RESOLVERS", dict(_resolvers._RESOLVERS))
    monkeypatch.setattr(_resolvers, "_CONVERTERS", dict(_resolvers._CONVERTERS))


def job(a: Any = None, x: Any = None) -> str:
    return "ran"


def cap_message(template: str) -> str:
    return "4096-character cap" if len(template) > 4096 else "nests more than 32 levels"


class TestTemplateCaps:
    @pytest.mark.parametrize("template", list(PATHOLOGICAL.values()), ids=list(PATHOLOGICAL))
    def test_decoration_raises_key_template_error(self, template: str) -> None:
        """``@distributed_lock(key=...)`` raises ``KeyTemplateError`` (not MemoryError/RecursionError)."""
        with pytest.raises(KeyTemplateError, match=cap_message(template)) as info:
            distributed_lock(key=template)(job)
        assert type(info.value) is KeyTemplateError
        assert info.value.template == template

    @pytest.mark.parametrize("template", list(PATHOLOGICAL.values()), ids=list(PATHOLOGICAL))
    def test_parse_raises_key_template_error(self, template: str) -> None:
        """``KeyTemplate.parse`` itself, and the multi-key ``keys=`` form, raise the same."""
        with pytest.raises(KeyTemplateError, match=cap_message(template)):
            KeyTemplate.parse(template)
        with pytest.raises(KeyTemplateError, match=cap_message(template)):
            distributed_lock(keys=["first:<a>", template])(job)

    def test_depth_error_names_the_expression_and_position(self) -> None:
        template = "order:<a" + ".b" * 1000 + ">"
        with pytest.raises(KeyTemplateError) as info:
            KeyTemplate.parse(template)
        error = info.value
        assert error.expression == "a" + ".b" * 1000
        assert error.position is not None
        assert 7 <= error.position < len(template)
        assert len(str(error)) < 500  # the message abbreviates a long expression

    def test_length_cap_boundary(self) -> None:
        """4096 characters of template parse; 4097 do not."""
        at_cap = "k:" + "a" * 4094
        assert len(at_cap) == 4096
        assert KeyTemplate.parse(at_cap).is_constant
        with pytest.raises(KeyTemplateError, match="4097 characters, over the 4096-character cap"):
            KeyTemplate.parse(at_cap + "a")

    def test_depth_cap_boundary(self) -> None:
        """An attribute chain 32 levels deep parses; 33 levels do not."""
        assert KeyTemplate.parse("<a" + ".b" * 31 + ">").names == {"a"}
        with pytest.raises(KeyTemplateError, match="nests more than 32 levels"):
            KeyTemplate.parse("<a" + ".b" * 32 + ">")

    def test_top_level_tuple_counts_a_level(self) -> None:
        """``<a.b...b, c>`` is a tuple around the chain: one level deeper than the chain alone."""
        with pytest.raises(KeyTemplateError, match="nests more than 32 levels"):
            KeyTemplate.parse("<a" + ".b" * 31 + ", c>")

    def test_tree_check_backs_up_the_pre_scan(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With the text pre-scan switched off, the check of the parsed tree still stops a deep expression."""
        monkeypatch.setattr(_template_syntax, "_check_nesting", lambda *args: None)
        assert KeyTemplate.parse("<a" + ".b" * 31 + ">").names == {"a"}
        for template in ("<a" + ".b" * 32 + ">", "<a" + "[0]" * 40 + ">", "<a" + ".b" * 1000 + ">"):
            with pytest.raises(KeyTemplateError, match="nests more than 32 levels"):
                KeyTemplate.parse(template)

    def test_ordinary_templates_are_unaffected(self) -> None:
        register_resolver("tenant_of", lambda *values, **named: "t")
        for template in (
            "order:<user.id>:<items[-1]>",
            "k:<payload['a>b']>:<payload[\"x[y\"]>",
            "report:<tenant_of(user.org.id, region=user.region)>:<order.items[0].sku>",
            "k:<((user.id))>",
        ):
            KeyTemplate.parse(template)

    def test_caps_are_named_constants(self) -> None:
        assert keys.MAX_TEMPLATE_LENGTH == 4096  # type: ignore[attr-defined]
        assert keys.MAX_EXPRESSION_DEPTH == 32  # type: ignore[attr-defined]
        assert {"MAX_TEMPLATE_LENGTH", "MAX_EXPRESSION_DEPTH"} <= set(keys.__all__)


class Color(enum.Enum):
    RED = "red"

    @property
    def value(self) -> Any:  # type: ignore[override]
        raise RuntimeError("no value today")


class BadUUID(uuid.UUID):
    def __str__(self) -> str:
        raise RuntimeError("unprintable id")


class TestRenderConversions:
    @needs_digit_limit
    def test_int_past_the_digit_limit(self, client: LockClient, commands: Any) -> None:
        """An int over Python's int-to-str limit: ``KeyTemplateError`` naming ``<x>``, nothing sent, body not run."""
        ran: list[int] = []

        @distributed_lock(key="acct:<x>", client=client)
        def transfer(x: int) -> None:
            ran.append(x)

        with commands.assert_none(), pytest.raises(KeyTemplateError, match="<x>") as info:
            transfer(10 ** (INT_DIGITS_LIMIT + 1))
        assert type(info.value) is KeyTemplateError
        assert info.value.expression == "x"
        assert info.value.template == "acct:<x>"
        assert info.value.position == 6
        assert ran == []

    @needs_digit_limit
    def test_int_past_the_digit_limit_with_a_raised_key_cap(self) -> None:
        """With a key cap that would admit its digits, ``str()`` raises ValueError: converted, chained."""
        template = KeyTemplate.parse("acct:<x>", max_bytes=10 * INT_DIGITS_LIMIT)
        with pytest.raises(KeyTemplateError, match=r"<x>.*ValueError") as info:
            template.render({"x": 10 ** (INT_DIGITS_LIMIT + 1)})
        assert isinstance(info.value.__cause__, ValueError)
        assert info.value.expression == "x"

    def test_int_too_long_for_a_key(self) -> None:
        """An int with more digits than the key cap is refused before converting it."""
        with pytest.raises(KeyTemplateError, match=r"<x>.*an int of at least 199[89] digits, too long for a key"):
            KeyTemplate.parse("acct:<x>").render({"x": 10**1999})

    def test_int_subclass_past_the_digit_limit(self) -> None:
        class Big(int):
            pass

        limit = INT_DIGITS_LIMIT or 4300
        with pytest.raises(KeyTemplateError, match="<x>"):
            KeyTemplate.parse("acct:<x>", max_bytes=10 * limit).render({"x": Big(10 ** (limit + 1))})

    @pytest.mark.parametrize(("value", "cause"), [(BadUUID(int=7), "unprintable id"), (Color.RED, "no value today")])
    def test_value_whose_conversion_raises(self, client: LockClient, commands: Any, value: Any, cause: str) -> None:
        """A ``__str__`` or an enum ``value`` that raises: ``KeyTemplateError`` naming the placeholder, chained."""

        @distributed_lock(key="item:<x>", client=client)
        def handle(x: Any) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError, match=f"<x>.*{cause}") as info:
            handle(value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert info.value.expression == "x"

    @needs_digit_limit
    def test_multi_key_element_past_the_digit_limit(self, client: LockClient, commands: Any) -> None:
        """``keys=["sku:<skus>"]`` renders each element: a huge one fails before any key is locked."""

        @distributed_lock(keys=["sku:<skus>"], client=client)
        def reserve(skus: list[int]) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError, match="<skus>") as info:
            reserve([1, 10 ** (INT_DIGITS_LIMIT + 1)])
        assert type(info.value) is KeyTemplateError

    @needs_digit_limit
    def test_async_call_past_the_digit_limit(self, client: LockClient, commands: Any) -> None:
        @distributed_lock(key="acct:<x>", client=client)
        async def transfer(x: int) -> None:
            raise AssertionError("the body must not run")

        with commands.assert_none(), pytest.raises(KeyTemplateError, match="<x>"):
            asyncio.run(transfer(10 ** (INT_DIGITS_LIMIT + 1)))

    def test_ordinary_ints_still_render(self) -> None:
        template = KeyTemplate.parse("acct:<x>")
        assert template.render({"x": -(10**500)}) == "acct:-" + "1" + "0" * 500
        assert template.render({"x": 0}) == "acct:0"
