"""Key templates: parsed and checked once when the decorator is applied, rendered per call.

Every key row of issue 2's "Bad input" table is a test here. "Decoration" rows apply
``@distributed_lock`` to a function (which only parses: no client, no server); "call" rows
render through :class:`ArgumentNames` and :class:`KeyTemplate` exactly as the aspect does,
or call a decorated function with no client configured, which proves the error comes before
any store could be reached.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockaspect import (
    ConfigurationError,
    KeyTemplateError,
    _resolvers,
    config,
    distributed_lock,
    register_converter,
    register_resolver,
)
from lockaspect.keys import DEFAULT_MAX_KEY_BYTES, ArgumentNames, KeyTemplate, check_key, encode_value

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(autouse=True)
def _isolated_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolvers and converters registered by one test are gone in the next."""
    monkeypatch.setattr(_resolvers, "_RESOLVERS", dict(_resolvers._RESOLVERS))
    monkeypatch.setattr(_resolvers, "_CONVERTERS", dict(_resolvers._CONVERTERS))


@pytest.fixture
def no_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """No default client and no LOCKASPECT_URL: a call that gets past rendering fails on the client lookup."""
    monkeypatch.delenv(config.ENV_URL, raising=False)
    monkeypatch.setattr(config, "_client", None)


class User:
    def __init__(self, id: object) -> None:
        self.id = id


def place(user: Any, voucher_id: Any = None) -> str:
    return "placed"


def render_call(template: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Parse against ``func`` and render for one call, the way the aspect does."""
    names = ArgumentNames(func)
    parsed = KeyTemplate.parse(template, names=names)
    bound = names.bind(args, kwargs)
    return parsed.render(names.extend(bound, parsed.names, 0))


def render_value(value: object, template: str = "k:<x>") -> str:
    return KeyTemplate.parse(template).render({"x": value})


class Capture:
    """A resolver that records what a template passed it, to see the names a call exposes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *values: Any) -> str:
        self.calls.append(values)
        return "k"


class TestParseErrors:
    @pytest.mark.parametrize(
        ("template", "low", "high"),
        [
            ("order:<user.>", 6, 12),
            ("order:<user.id", 6, 6),
            ("order:<>", 6, 6),
            ("order:<   >", 6, 6),
            ("order:<user.id>>", 15, 15),
            ("order:user>", 10, 10),
            ("order:<user.id)>", 6, 15),
            ("order:<user[>", 6, 12),
        ],
    )
    def test_decoration_reports_the_template_and_position(self, template: str, low: int, high: int) -> None:
        """A malformed template fails when the decorator is applied, naming the template and the position."""
        with pytest.raises(KeyTemplateError) as info:
            distributed_lock(key=template)(place)
        error = info.value
        assert error.template == template
        assert error.position is not None
        assert low <= error.position <= high
        assert repr(template) in str(error)
        assert f"position {error.position}" in str(error)
        assert error.key is None

    def test_unclosed_placeholder_reports_where_it_opens(self) -> None:
        """An unbalanced ``<`` is reported at the offset of that ``<``."""
        with pytest.raises(KeyTemplateError, match=r"unclosed '<'.*position 6") as info:
            KeyTemplate.parse("order:<user.id")
        assert info.value.position == 6

    def test_empty_placeholder_reports_its_position(self) -> None:
        """An empty ``<>`` is reported at the offset of its ``<``."""
        with pytest.raises(KeyTemplateError, match=r"empty placeholder.*position 6") as info:
            KeyTemplate.parse("order:<>")
        assert info.value.position == 6

    def test_a_placeholder_opening_inside_another_is_unbalanced(self) -> None:
        """``<a<b>`` is an unclosed ``<`` at the first bracket, not a nested placeholder."""
        with pytest.raises(KeyTemplateError, match="unclosed") as info:
            KeyTemplate.parse("x:<user<voucher_id>")
        assert info.value.position == 2

    def test_syntax_error_names_the_expression(self) -> None:
        """A placeholder that is not a Python expression is reported with its text."""
        with pytest.raises(KeyTemplateError, match=r"invalid expression <user\.>") as info:
            KeyTemplate.parse("order:<user.>")
        assert info.value.expression == "user."

    def test_the_decorator_factory_alone_does_not_parse(self) -> None:
        """The template is parsed when the decorator is applied to a function, not before."""
        decorator = distributed_lock(key="order:<user.>")
        with pytest.raises(KeyTemplateError):
            decorator(place)


class TestKeyArgument:
    def test_empty_key_is_rejected_at_decoration(self) -> None:
        """``key=""`` is a KeyTemplateError before any function is even given."""
        with pytest.raises(KeyTemplateError, match="empty"):
            distributed_lock(key="")

    def test_empty_template_is_rejected_by_parse(self) -> None:
        """``KeyTemplate.parse("")`` raises KeyTemplateError."""
        with pytest.raises(KeyTemplateError, match="empty"):
            KeyTemplate.parse("")

    @pytest.mark.parametrize("key", [42, b"order:1", ["order"], 1.5, True])
    def test_key_neither_str_nor_callable_is_a_type_error(self, key: object) -> None:
        """A key that is neither a template string nor a callable is a TypeError at decoration."""
        with pytest.raises(TypeError, match="key must be a template string or a callable"):
            distributed_lock(key=key)  # type: ignore[arg-type]

    def test_parse_rejects_a_non_string_with_type_error(self) -> None:
        """``KeyTemplate.parse`` of a non-str raises TypeError, not KeyTemplateError."""
        with pytest.raises(TypeError):
            KeyTemplate.parse(b"order:<user.id>")  # type: ignore[arg-type]

    def test_callable_key_is_accepted_at_decoration(self) -> None:
        """A callable key is not parsed, so decorating with one succeeds."""
        decorated = distributed_lock(key=lambda bound: f"order:{bound['user'].id}")(place)
        assert decorated.__wrapped__ is place

    @pytest.mark.usefixtures("no_client")
    @pytest.mark.parametrize("result", ["", 42, None, "a{b}"])
    def test_callable_key_with_a_bad_result_fails_at_call(self, result: object) -> None:
        """A key callable returning an empty, non-str or hash-tag-breaking key fails before any client lookup."""
        ran: list[bool] = []

        @distributed_lock(key=lambda bound: result)
        def body(user: Any) -> None:
            ran.append(True)

        with pytest.raises(KeyTemplateError):
            body(User(1))
        assert ran == []

    @pytest.mark.usefixtures("no_client")
    def test_callable_key_that_raises_is_chained(self) -> None:
        """A key callable that raises gives a KeyTemplateError chained to its exception."""
        boom = LookupError("no tenant")

        def key(bound: Mapping[str, Any]) -> str:
            raise boom

        decorated = distributed_lock(key=key)(place)
        with pytest.raises(KeyTemplateError) as info:
            decorated(User(1))
        assert info.value.__cause__ is boom

    @pytest.mark.usefixtures("no_client")
    def test_callable_key_receives_the_bound_arguments(self) -> None:
        """A key callable gets the bound arguments with defaults applied, then the call goes on to the client."""
        seen: list[dict[str, Any]] = []

        def key(bound: Mapping[str, Any]) -> str:
            seen.append(dict(bound))
            return "order:1"

        user = User(1)
        decorated = distributed_lock(key=key)(place)
        with pytest.raises(ConfigurationError, match="no lock client is configured"):
            decorated(user)
        assert seen == [{"user": user, "voucher_id": None}]

    def test_check_key_rejects_a_non_str(self) -> None:
        """``check_key`` rejects a key that is not a str with KeyTemplateError."""
        with pytest.raises(KeyTemplateError, match="must be a str"):
            check_key(7)


class TestNames:
    def test_unknown_name_lists_the_available_names(self) -> None:
        """``<usr.id>`` on a function without ``usr`` fails at decoration, listing every usable name."""
        with pytest.raises(KeyTemplateError) as info:
            distributed_lock(key="order:<usr.id>")(place)
        message = str(info.value)
        assert "usr" in message
        assert "available names: user, voucher_id, args, func, kwargs, p0..p1" in message
        assert info.value.expression == "usr"
        assert info.value.template == "order:<usr.id>"

    def test_several_unknown_names_are_all_reported(self) -> None:
        """Every unknown name of a template is named in the one error."""
        with pytest.raises(KeyTemplateError, match="uses tenant, usr, which are not names"):
            KeyTemplate.parse("o:<usr.id>:<tenant>", names=ArgumentNames(place))

    def test_any_name_is_allowed_when_the_function_takes_kwargs(self) -> None:
        """With ``**kwargs`` a name that is not a parameter parses, and renders from the extra keyword."""

        def create(user: Any, **extra: Any) -> None: ...

        distributed_lock(key="order:<usr.id>")(create)
        assert render_call("order:<usr.id>", create, User(1), usr=User(7)) == "order:7"

    def test_kwargs_name_missing_at_call_names_the_expression(self) -> None:
        """A ``**kwargs`` name the call did not pass fails at render, naming the expression."""

        def create(user: Any, **extra: Any) -> None: ...

        with pytest.raises(KeyTemplateError, match="usr") as info:
            render_call("order:<usr.id>", create, User(1))
        assert info.value.expression == "usr.id"

    def test_defaults_are_applied(self) -> None:
        """A parameter the call leaves out renders from its default."""

        def create(user: Any, region: str = "eu", *, tier: int = 3) -> None: ...

        assert render_call("o:<region>:<tier>:<user.id>", create, User(1)) == "o:eu:3:1"
        assert render_call("o:<region>:<tier>:<user.id>", create, User(1), tier=5, region="us") == "o:us:5:1"

    def test_args_is_the_positional_tuple(self) -> None:
        """``args`` is the tuple of positional argument values, also for arguments passed by keyword."""

        def create(a: Any, b: Any, *rest: Any) -> None: ...

        assert render_call("o:<args[0]>:<args[-1]>", create, "x", "y", "z") == "o:x:z"
        assert render_call("o:<args[1]>", create, a="x", b="y") == "o:y"

    def test_kwargs_holds_keyword_only_and_extra_keywords(self) -> None:
        """``kwargs`` maps keyword-only and extra keyword arguments to their values."""

        def create(a: Any, *, tenant: str, **extra: Any) -> None: ...

        assert render_call('o:<kwargs["tenant"]>:<kwargs["zone"]>', create, 1, tenant="t1", zone="z9") == "o:t1:z9"

    def test_p_aliases_index_the_positional_arguments(self) -> None:
        """``p0``..``pN`` are the positional argument values in order."""

        def create(a: Any, b: Any) -> None: ...

        assert render_call("o:<p1>:<p0>", create, "x", "y") == "o:y:x"
        assert render_call("o:<p1>", create, "x", b="y") == "o:y"

    def test_p_alias_past_the_parameters_is_rejected_at_decoration(self) -> None:
        """``<p2>`` on a two-parameter function fails at decoration, listing ``p0..p1``."""

        def create(a: Any, b: Any) -> None: ...

        with pytest.raises(KeyTemplateError, match=r"p2.*p0\.\.p1"):
            distributed_lock(key="o:<p2>")(create)

    def test_p_alias_past_star_args_fails_at_call(self) -> None:
        """With ``*args`` any ``pN`` parses, and one past the call's arguments fails at render naming it."""

        def create(*items: Any) -> None: ...

        assert render_call("o:<p2>", create, "a", "b", "c") == "o:c"
        with pytest.raises(KeyTemplateError, match="p2") as info:
            render_call("o:<p2>", create, "a")
        assert info.value.expression == "p2"

    def test_func_is_the_qualified_name(self) -> None:
        """``func`` renders the decorated function's qualified name."""
        assert render_call("lock:<func>", place, User(1)) == "lock:place"

    def test_a_parameter_shadows_a_reserved_name(self) -> None:
        """A parameter called ``args`` is that parameter, not the positional tuple."""

        def create(args: str, other: str) -> None: ...

        assert render_call("o:<args>", create, "mine", "x") == "o:mine"

    def test_positional_only_parameters_are_names(self) -> None:
        """Positional-only parameters are names too."""

        def create(a: Any, /, b: Any) -> None: ...

        assert render_call("o:<a>:<b>:<p0>", create, "x", b="y") == "o:x:y:x"

    def test_listing_for_a_method_starts_p_aliases_after_self(self) -> None:
        """For a method, ``self`` is a name and the p-aliases count the arguments after it."""

        def method(self: Any, a: Any, b: Any) -> None: ...

        names = ArgumentNames(method)
        assert names.listing() == ["a", "b", "self", "args", "func", "kwargs", "p0..p1"]
        assert names.accepts("p1")
        assert not names.accepts("p2")


@pytest.mark.usefixtures("no_client")
class TestMethods:
    """Through the decorator; a capturing resolver shows what the template saw, then the
    call fails on the missing client (proof that the key rendered)."""

    @pytest.fixture
    def capture(self) -> Capture:
        capture = Capture()
        register_resolver("capture", capture)
        return capture

    def test_instance_method_sees_self_and_p_aliases_after_it(self, capture: Capture) -> None:
        """In an instance method ``self`` is the instance, ``p0`` the first argument after it, ``args`` excludes it."""

        class Orders:
            @distributed_lock(key="o:<capture(self, p0, p1, args, func)>")
            def create(self, a: Any, b: Any = "dflt") -> None: ...

        orders = Orders()
        with pytest.raises(ConfigurationError):
            orders.create("x")
        with pytest.raises(ConfigurationError):
            Orders.create(orders, "y", b="z")
        qualname = f"{Orders.__qualname__}.create"
        assert capture.calls == [
            (orders, "x", "dflt", ("x", "dflt"), qualname),
            (orders, "y", "z", ("y", "z"), qualname),
        ]

    @pytest.mark.parametrize("order", ["lock_outside", "lock_inside"])
    def test_classmethod_sees_cls(self, capture: Capture, order: str) -> None:
        """In a classmethod ``cls`` is the class and ``p0`` the first argument after it, in either decorator order."""
        if order == "lock_outside":

            class Orders:
                @distributed_lock(key="o:<capture(cls, p0, args)>")
                @classmethod
                def create(cls, a: Any) -> None: ...

        else:

            class Orders:  # type: ignore[no-redef]
                @classmethod
                @distributed_lock(key="o:<capture(cls, p0, args)>")
                def create(cls, a: Any) -> None: ...

        with pytest.raises(ConfigurationError):
            Orders.create("x")
        with pytest.raises(ConfigurationError):
            Orders().create("y")
        assert capture.calls == [(Orders, "x", ("x",)), (Orders, "y", ("y",))]

    def test_staticmethod_has_no_self(self, capture: Capture) -> None:
        """In a staticmethod ``p0`` is the first argument."""

        class Orders:
            @distributed_lock(key="o:<capture(p0, args)>")
            @staticmethod
            def create(a: Any) -> None: ...

        with pytest.raises(ConfigurationError):
            Orders.create("x")
        with pytest.raises(ConfigurationError):
            Orders().create("y")
        assert capture.calls == [("x", ("x",)), ("y", ("y",))]

    def test_self_attribute_renders(self) -> None:
        """``<self.tenant>`` reads the instance's attribute; a missing one fails at call, naming the expression."""

        class Orders:
            def __init__(self, tenant: str | None) -> None:
                self.tenant = tenant

            @distributed_lock(key="orders:<self.tenant>:<p0>")
            def create(self, order_id: int) -> None:
                raise AssertionError("the body must not run")

        with pytest.raises(ConfigurationError):
            Orders("acme").create(1)
        with pytest.raises(KeyTemplateError, match=r"<self\.tenant> is None"):
            Orders(None).create(1)


class TestAllowList:
    @pytest.mark.parametrize(
        ("template", "why"),
        [
            ("o:<user._id>", "starts with '_'"),
            ("o:<user.__class__>", "starts with '_'"),
            ("o:<user.__class__.__name__>", "starts with '_'"),
            ("o:<user.id.__doc__>", "starts with '_'"),
            ("o:<lambda: user>", "Lambda"),
            ("o:<(lambda: 1)()>", "only registered resolvers"),
            ("o:<[u for u in user]>", "ListComp"),
            ("o:<(u for u in user)>", "GeneratorExp"),
            ("o:<{u for u in user}>", "SetComp"),
            ("o:<{u: 1 for u in user}>", "DictComp"),
            ("o:<len(user)>", "not a registered resolver"),
            ("o:<getattr(user, 'id')>", "not a registered resolver"),
            ("o:<__import__('os')>", "not a registered resolver"),
            ("o:<user.id()>", "only registered resolvers"),
            ("o:<user + 1>", "BinOp"),
            ("o:<-voucher_id>", "UnaryOp"),
            ("o:<user.id == 1>", "Compare"),
            ("o:<user if user else voucher_id>", "IfExp"),
            ("o:<user[voucher_id]>", "constant"),
            ("o:<user[0:2]>", "constant"),
            ("o:<user[1.5]>", "constant"),
            ("o:<None>", "not allowed"),
            ("o:<1.5>", "not allowed"),
            ("o:<True>", "not allowed"),
            ("o:<(user, voucher_id)>", "Tuple"),
            ("o:<[user]>", "List"),
            ("o:<(x := user)>", "NamedExpr"),
        ],
    )
    def test_disallowed_construct_fails_at_decoration(self, template: str, why: str) -> None:
        """A construct outside the allow-list is a KeyTemplateError when the decorator is applied."""
        with pytest.raises(KeyTemplateError, match=why) as info:
            distributed_lock(key=template)(place)
        assert info.value.template == template
        assert info.value.expression == template[3:-1]
        assert info.value.position == 3

    def test_registered_resolver_renders(self) -> None:
        """A registered resolver can be called in a template, with positional and keyword arguments."""
        register_resolver("tenant_of", lambda request, suffix="": request["tenant"] + suffix)

        def report(request: Any) -> None: ...

        distributed_lock(key="report:<tenant_of(request)>")(report)
        assert render_call("report:<tenant_of(request)>", report, {"tenant": "acme"}) == "report:acme"
        assert render_call('report:<tenant_of(request, suffix="-eu")>', report, {"tenant": "acme"}) == "report:acme-eu"

    def test_resolver_result_is_checked_like_any_value(self) -> None:
        """A resolver's result is percent-encoded, and one of an unsupported type fails at call."""
        register_resolver("raw", lambda value: value)

        def report(request: Any) -> None: ...

        assert render_call("r:<raw(request)>", report, "a:b") == "r:a%3Ab"
        with pytest.raises(KeyTemplateError, match="float"):
            render_call("r:<raw(request)>", report, 1.5)

    def test_resolver_that_raises_is_chained(self) -> None:
        """A resolver that raises gives a KeyTemplateError chained to its exception."""
        boom = PermissionError("denied")

        def deny(request: Any) -> str:
            raise boom

        register_resolver("deny", deny)
        with pytest.raises(KeyTemplateError, match="PermissionError") as info:
            render_value("x", "r:<deny(x)>")
        assert info.value.__cause__ is boom

    def test_unregistered_resolver_lists_the_registered_ones(self) -> None:
        """Calling a name that is not a registered resolver names the ones that are."""
        register_resolver("tenant_of", lambda request: "t")
        with pytest.raises(KeyTemplateError, match=r"'region_of' is not a registered resolver \(tenant_of\)"):
            KeyTemplate.parse("r:<region_of(x)>")

    def test_a_template_keeps_the_resolver_it_was_parsed_with(self) -> None:
        """Registering a name again affects templates parsed afterwards, not earlier ones."""
        register_resolver("tag", lambda value: "old")
        before = KeyTemplate.parse("r:<tag(x)>")
        register_resolver("tag", lambda value: "new")
        after = KeyTemplate.parse("r:<tag(x)>")
        assert before.render({"x": "v"}) == "r:old"
        assert after.render({"x": "v"}) == "r:new"

    def test_resolver_name_is_not_a_template_name(self) -> None:
        """A resolver name used bare (not called) is not a parameter, so it is rejected at decoration."""
        register_resolver("tenant_of", lambda request: "t")
        with pytest.raises(KeyTemplateError, match="tenant_of"):
            distributed_lock(key="r:<tenant_of>")(place)

    @pytest.mark.parametrize("name", ["_private", "not an identifier", "1st", ""])
    def test_register_resolver_rejects_bad_names(self, name: str) -> None:
        """Resolver names must be public identifiers."""
        with pytest.raises(ValueError, match="public identifier"):
            register_resolver(name, str)

    def test_register_resolver_rejects_non_callables(self) -> None:
        """A resolver must be callable."""
        with pytest.raises(TypeError, match="callable"):
            register_resolver("tenant_of", "not callable")  # type: ignore[arg-type]


class TestEscapes:
    @pytest.mark.parametrize(
        ("template", "expected"),
        [
            ("a<<b>>:<x>", "a<b>:v"),
            ("<<<x>>>", "<v>"),
            ("<<>>", "<>"),
            ("<<<<:<x>", "<<:v"),
            ('k:<x>:<m[">"]>', "k:v:gt"),
            ("k:<x>:<m['<']>", "k:v:lt"),
        ],
    )
    def test_doubled_brackets_are_literal(self, template: str, expected: str) -> None:
        """``<<`` and ``>>`` render one literal bracket; brackets inside quoted constants do not close a placeholder."""
        parsed = KeyTemplate.parse(template)
        assert parsed.render({"x": "v", "m": {">": "gt", "<": "lt"}}) == expected

    def test_a_template_of_escapes_only_is_constant(self) -> None:
        """A template with no placeholder is constant and renders its literal text."""
        parsed = KeyTemplate.parse("jobs:<<nightly>>")
        assert parsed.is_constant
        assert parsed.names == frozenset()
        assert parsed.render({}) == "jobs:<nightly>"

    @pytest.mark.parametrize(("template", "position"), [("o:{<x>}", 2), ("o:<x>}", 5), ("{o}:<x>", 0)])
    def test_braces_are_rejected(self, template: str, position: int) -> None:
        """``{`` and ``}`` are reserved for the hash tag and rejected at parse, with their position."""
        with pytest.raises(KeyTemplateError, match="hash tag") as info:
            KeyTemplate.parse(template)
        assert info.value.position == position


class TestSeparation:
    @pytest.mark.parametrize(
        "template",
        ["k:<x><y>", "k:<x>-<y>", "k:<x>.<y>", "k:<x>/<y>", "k:<x>%<y>", "k:<x>ab<y>", "k:<x><<<y>", "k:<x>:<y>_<x>"],
    )
    def test_placeholders_need_a_structural_separator(self, template: str) -> None:
        """Placeholders adjacent or separated only by characters values may contain are rejected at parse."""

        def f(x: Any, y: Any) -> None: ...

        with pytest.raises(KeyTemplateError, match=r"adjacent|separated by") as info:
            distributed_lock(key=template)(f)
        assert info.value.template == template
        assert info.value.position is not None

    @pytest.mark.parametrize(
        ("template", "expected"),
        [
            ("k:<x>:<y>", "k:a:b"),
            ("k:<x> <y>", "k:a b"),
            ("k:<x>*<y>", "k:a*b"),
            ("k:<x>?<y>", "k:a?b"),
            ("k:<x>[<y>]", "k:a[b]"),
            ("k:<x>\\<y>", "k:a\\b"),
            ("k:<x>\t<y>", "k:a\tb"),
            ("k:<x>-v:<y>", "k:a-v:b"),
        ],
    )
    def test_structural_separators_are_accepted(self, template: str, expected: str) -> None:
        """A separator that contains a character values can never contain raw is accepted."""
        assert KeyTemplate.parse(template).render({"x": "a", "y": "b"}) == expected


class TestRenderErrors:
    def test_none_value_names_the_expression(self) -> None:
        """A referenced value that is None fails at call, naming the expression."""
        with pytest.raises(KeyTemplateError, match=r"<user\.id> is None in key template 'order:<user\.id>'") as info:
            render_call("order:<user.id>", place, User(None))
        assert info.value.expression == "user.id"
        assert info.value.template == "order:<user.id>"

    def test_none_argument_names_the_expression(self) -> None:
        """An argument that is None where the template reads an attribute of it fails at call, naming the expression."""
        with pytest.raises(KeyTemplateError, match=r"<user\.id>") as info:
            render_call("order:<user.id>", place, None)
        assert info.value.expression == "user.id"

    def test_missing_attribute_names_the_expression(self) -> None:
        """A missing attribute fails at call, naming the expression and the attribute."""
        with pytest.raises(KeyTemplateError, match=r"cannot render <user\.id>.*no attribute 'id'") as info:
            render_call("order:<user.id>", place, object())
        assert info.value.expression == "user.id"
        assert info.value.position == 7

    def test_missing_key_names_the_expression(self) -> None:
        """A missing mapping key fails at call, naming the expression and the key."""
        with pytest.raises(KeyTemplateError, match=r"<user\[.tenant.\]>.*no item 'tenant'") as info:
            render_call('order:<user["tenant"]>', place, {"zone": "eu"})
        assert info.value.expression == 'user["tenant"]'

    def test_missing_index_names_the_expression(self) -> None:
        """An index past the end fails at call, naming the expression."""
        with pytest.raises(KeyTemplateError, match=r"<user\[3\]>.*index out of range") as info:
            render_call("order:<user[3]>", place, ["a"])
        assert info.value.expression == "user[3]"

    def test_subscript_of_none_names_the_expression(self) -> None:
        """Indexing a None argument fails at call, naming the expression."""
        with pytest.raises(KeyTemplateError) as info:
            render_call("order:<user[0]>", place, None)
        assert info.value.expression == "user[0]"

    def test_constant_subscripts_render(self) -> None:
        """String keys, int indices and negative indices select from the argument."""
        order = {"items": [{"sku": "A-1"}, {"sku": "B-2"}]}
        assert render_call('o:<user["items"][0]["sku"]>:<user["items"][-1].sku>', place, order) == "o:A-1:B-2"

    def test_attribute_falls_back_to_a_mapping_key(self) -> None:
        """``<payload.tenant>`` on a dict reads the ``tenant`` key, as simpleeval does."""
        assert render_call("o:<user.tenant>", place, {"tenant": "acme"}) == "o:acme"

    @pytest.mark.usefixtures("no_client")
    def test_render_error_stops_the_call_before_the_client(self) -> None:
        """A decorated call whose key cannot render raises KeyTemplateError before the client lookup and the body."""
        ran: list[bool] = []

        @distributed_lock(key="order:<user.id>")
        def create(user: Any) -> None:
            ran.append(True)

        with pytest.raises(KeyTemplateError, match="is None"):
            create(User(None))
        with pytest.raises(KeyTemplateError, match="no attribute"):
            create(object())
        with pytest.raises(ConfigurationError, match="no lock client is configured"):
            create(User(1))
        assert ran == []


class Color(enum.Enum):
    RED = "red"
    BLUE = "b:lue"


class Level(enum.IntEnum):
    HIGH = 3


class Shade(str, enum.Enum):
    DARK = "dark"


class Weird(enum.Enum):
    PI = 3.14


class TaggedStr(str):
    def __str__(self) -> str:
        return "tagged"


class TaggedInt(int):
    def __str__(self) -> str:
        return "tagged"


class TestValueTypes:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            ("abc", "abc"),
            ("", ""),
            ("ünïcødé", "ünïcødé"),
            (42, "42"),
            (0, "0"),
            (-7, "-7"),
            (10**30, "1" + "0" * 30),
            (uuid.UUID("12345678-1234-5678-1234-567812345678"), "12345678-1234-5678-1234-567812345678"),
            (Color.RED, "red"),
            (Color.BLUE, "b%3Alue"),
            (Level.HIGH, "3"),
            (Shade.DARK, "dark"),
            (TaggedStr("raw"), "raw"),
            (TaggedInt(5), "5"),
        ],
    )
    def test_supported_values_render(self, value: object, expected: str) -> None:
        """str, int, UUID and Enum values render; enums by value, subclasses by their raw value."""
        assert render_value(value) == f"k:{expected}"

    @pytest.mark.parametrize(
        "value",
        [
            1.5,
            float("nan"),
            True,
            False,
            b"bytes",
            bytearray(b"x"),
            [1],
            (1,),
            {"a": 1},
            {1},
            frozenset({1}),
            object(),
            1j,
            decimal.Decimal("1"),
            datetime.date(2024, 1, 2),
            Weird.PI,
        ],
    )
    def test_unsupported_values_fail_at_call(self, value: object) -> None:
        """Floats, bools, bytes, containers and other objects fail at call, naming the expression and the type."""
        with pytest.raises(KeyTemplateError, match="has no key rendering") as info:
            render_value(value)
        assert info.value.expression == "x"
        inner = value.value if isinstance(value, enum.Enum) else value
        assert f"is a {type(inner).__name__}," in str(info.value)

    def test_bool_does_not_share_a_lock_with_int(self) -> None:
        """True and False are rejected even though they are ints, so they cannot collide with 1 and 0."""
        assert render_value(1) == "k:1"
        with pytest.raises(KeyTemplateError, match="bool"):
            render_value(True)

    def test_registered_converter_renders(self) -> None:
        """A converter registered for a type renders its values, percent-encoded."""
        register_converter(datetime.date, datetime.date.isoformat)
        assert render_value(datetime.date(2024, 1, 2)) == "k:2024-01-02"

    def test_converter_applies_to_subclasses(self) -> None:
        """A converter for a base class serves its subclasses (by MRO), and its output is percent-encoded."""
        register_converter(datetime.date, lambda value: value.isoformat())
        assert render_value(datetime.datetime(2024, 1, 2, 3, 4, 5)) == "k:2024-01-02T03%3A04%3A05"

    def test_converter_for_bool(self) -> None:
        """Registering a converter for bool makes booleans render through it."""
        register_converter(bool, lambda flag: "yes" if flag else "no")
        assert render_value(True) == "k:yes"
        assert render_value(False) == "k:no"
        assert render_value(1) == "k:1"

    def test_converter_for_float(self) -> None:
        """Registering a converter for float makes floats render through it."""
        register_converter(float, float.hex)
        assert render_value(1.5) == f"k:{(1.5).hex()}"

    def test_converter_returning_non_str_fails(self) -> None:
        """A converter that returns something other than str fails at call."""
        register_converter(datetime.date, lambda value: value.toordinal())
        with pytest.raises(KeyTemplateError, match="returned int, not str"):
            render_value(datetime.date(2024, 1, 2))

    def test_converter_that_raises_is_chained(self) -> None:
        """A converter that raises gives a KeyTemplateError chained to its exception."""
        boom = ValueError("naive datetime")

        def convert(value: datetime.date) -> str:
            raise boom

        register_converter(datetime.date, convert)
        with pytest.raises(KeyTemplateError, match="converter for date failed") as info:
            render_value(datetime.date(2024, 1, 2))
        assert info.value.__cause__ is boom

    def test_register_converter_validates_its_arguments(self) -> None:
        """The target must be a type and the converter callable."""
        with pytest.raises(TypeError, match="must be a type"):
            register_converter("date", str)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="must be callable"):
            register_converter(datetime.date, "isoformat")  # type: ignore[arg-type]


class TestLengthCap:
    def test_key_at_the_cap_renders(self) -> None:
        """A key of exactly the cap in UTF-8 bytes renders."""
        assert render_value("a" * (DEFAULT_MAX_KEY_BYTES - 2)) == "k:" + "a" * (DEFAULT_MAX_KEY_BYTES - 2)

    def test_key_over_the_cap_fails_at_call(self) -> None:
        """A key one byte over the cap fails at call, naming the cap and the size."""
        with pytest.raises(KeyTemplateError, match=r"is 1025 bytes, over the 1024-byte cap") as info:
            render_value("a" * (DEFAULT_MAX_KEY_BYTES - 1))
        assert info.value.template == "k:<x>"

    def test_cap_counts_utf8_bytes(self) -> None:
        """The cap is in UTF-8 bytes, not characters."""
        assert render_value("é" * 511).encode() == ("k:" + "é" * 511).encode()
        with pytest.raises(KeyTemplateError, match="1026 bytes"):
            render_value("é" * 512)

    def test_cap_counts_the_encoded_value(self) -> None:
        """Percent-encoding counts towards the cap: 341 colons make a 1025-byte key once encoded."""
        with pytest.raises(KeyTemplateError, match="over the 1024-byte cap"):
            render_value(":" * 341)

    def test_cap_is_configurable(self) -> None:
        """``max_bytes`` sets the cap."""
        parsed = KeyTemplate.parse("k:<x>", max_bytes=8)
        assert parsed.render({"x": "123456"}) == "k:123456"
        with pytest.raises(KeyTemplateError, match="over the 8-byte cap"):
            parsed.render({"x": "1234567"})


class TestPercentEncoding:
    @pytest.mark.parametrize(
        ("char", "encoded"),
        [
            (":", "%3A"),
            ("{", "%7B"),
            ("}", "%7D"),
            ("*", "%2A"),
            ("?", "%3F"),
            ("[", "%5B"),
            ("]", "%5D"),
            ("%", "%25"),
            ("\\", "%5C"),
            (" ", "%20"),
            ("\n", "%0A"),
            ("\r", "%0D"),
            ("\t", "%09"),
            ("\x00", "%00"),
            ("\x1b", "%1B"),
            ("\x7f", "%7F"),
            ("\x85", "%C2%85"),
            ("\xa0", "%C2%A0"),
            ("\u2028", "%E2%80%A8"),
            ("\u3000", "%E3%80%80"),
            ("\udcff", "%ED%B3%BF"),
        ],
    )
    def test_structural_character_is_percent_encoded(self, char: str, encoded: str) -> None:
        """Each structural, whitespace or control character renders as its UTF-8 bytes in %XX form."""
        assert render_value(f"a{char}b") == f"k:a{encoded}b"

    def test_ordinary_characters_are_kept(self) -> None:
        """Characters that are not structural render unchanged."""
        text = "héllo-wörld_1.2/3@x<y>z!#$&'()+,;=~"
        assert render_value(text) == f"k:{text}"

    def test_braces_cannot_break_the_hash_tag(self) -> None:
        """A value full of braces renders a key without any brace."""
        key = render_value("}{tag}{")
        assert "{" not in key
        assert "}" not in key

    def test_lone_surrogate_gives_a_utf8_key(self) -> None:
        """A str with a lone surrogate (as os.fsdecode makes) renders a key that encodes as UTF-8."""
        key = render_value("file-\udcff")
        assert key.encode("utf-8") == b"k:file-%ED%B3%BF"

    @PROPERTY
    @given(value=st.text(st.characters(exclude_categories=())))
    def test_encoding_decodes_back(self, value: str) -> None:
        """Percent-decoding an encoded value gives the value back, so encoding is injective."""
        encoded = encode_value(value)
        assert urllib.parse.unquote(encoded, errors="surrogatepass") == value
        encoded.encode("utf-8")  # always valid UTF-8


TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
VALUES = st.one_of(TEXT, st.integers())
SEPARATOR_CHARS = st.sampled_from([":", "*", "?", "[", "]", "\\", " ", "\t", "\n"])
LITERAL = st.text(st.characters(exclude_characters="<>{}", exclude_categories=("Cs",)), max_size=4)


class TestInjectivity:
    @PROPERTY
    @given(first=st.tuples(TEXT, TEXT), second=st.tuples(TEXT, TEXT))
    def test_distinct_strings_give_distinct_keys(self, first: tuple[str, str], second: tuple[str, str]) -> None:
        """Two calls with distinct string arguments never render the same key."""
        parsed = KeyTemplate.parse("a:<x>:<y>")
        keys_ = {parsed.render(dict(zip("xy", args, strict=True))) for args in (first, second)}
        assert len(keys_) == len({first, second})

    @PROPERTY
    @given(first=st.tuples(st.integers(), st.integers()), second=st.tuples(st.integers(), st.integers()))
    def test_distinct_ints_give_distinct_keys(self, first: tuple[int, int], second: tuple[int, int]) -> None:
        """Two calls with distinct int arguments never render the same key."""
        parsed = KeyTemplate.parse("a:<x>:<y>")
        keys_ = {parsed.render(dict(zip("xy", args, strict=True))) for args in (first, second)}
        assert len(keys_) == len({first, second})

    @PROPERTY
    @given(
        first=st.tuples(TEXT, st.integers(), TEXT),
        second=st.tuples(TEXT, st.integers(), TEXT),
    )
    def test_distinct_mixed_arguments_give_distinct_keys(
        self, first: tuple[str, int, str], second: tuple[str, int, str]
    ) -> None:
        """Three placeholders of fixed types with distinct arguments never render the same key."""
        parsed = KeyTemplate.parse("a:<x>:<y> <z>")
        keys_ = {parsed.render(dict(zip("xyz", args, strict=True))) for args in (first, second)}
        assert len(keys_) == len({first, second})

    @PROPERTY
    @given(
        data=st.data(),
        prefix=LITERAL,
        suffix=LITERAL,
        before=LITERAL,
        after=LITERAL,
        separator=SEPARATOR_CHARS,
    )
    def test_any_accepted_template_is_injective(
        self, data: st.DataObject, prefix: str, suffix: str, before: str, after: str, separator: str
    ) -> None:
        """For any template that parses, distinct string arguments render distinct keys."""
        template = f"{prefix}<x>{before}{separator}{after}<y>{suffix}"
        parsed = KeyTemplate.parse(template)
        first = data.draw(st.tuples(TEXT, TEXT), label="first")
        second = data.draw(st.tuples(TEXT, TEXT), label="second")
        keys_ = {parsed.render(dict(zip("xy", args, strict=True))) for args in (first, second)}
        assert len(keys_) == len({first, second})

    def test_structural_values_do_not_collide(self) -> None:
        """Values that would collide if ``:`` were kept raw render distinct keys."""
        parsed = KeyTemplate.parse("a:<x>:<y>")
        assert parsed.render({"x": "1:2", "y": "3"}) != parsed.render({"x": "1", "y": "2:3"})
        assert parsed.render({"x": "%3A", "y": "b"}) != parsed.render({"x": ":", "y": "b"})


class Trap:
    """An argument that fails loudly if anything walks, compares, hashes or prints it."""

    def _walked(self, *args: object) -> Any:
        raise AssertionError("the argument was walked")

    __iter__ = __len__ = __eq__ = __hash__ = __repr__ = __str__ = __contains__ = _walked
    __getitem__ = __getattr__ = __reduce__ = __sizeof__ = _walked


class TrapMapping(Mapping[str, Any]):
    """A mapping whose only usable operation is ``m["tenant"]``."""

    def __getitem__(self, key: str) -> Any:
        if key == "tenant":
            return "acme"
        raise AssertionError(f"read {key!r}")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the mapping was iterated")

    def __len__(self) -> int:
        raise AssertionError("the mapping was measured")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("the mapping was compared")

    __hash__ = None  # type: ignore[assignment]


def huge_list() -> list[int]:
    return list(range(10**6))


def cyclic_list() -> list[Any]:
    cycle: list[Any] = []
    cycle.append(cycle)
    return cycle


def deep_list() -> list[Any]:
    nested: list[Any] = []
    for _ in range(10**4):
        nested = [nested]
    return nested


class TestArgumentsAreNotWalked:
    @pytest.mark.parametrize("make", [huge_list, cyclic_list, deep_list, Trap])
    def test_unreferenced_argument_is_not_walked(self, make: Callable[[], Any]) -> None:
        """An argument the template does not reference, however huge, cyclic or deep, does not disturb rendering."""

        def create(user: Any, blob: Any) -> None: ...

        assert render_call("order:<user.id>", create, User(7), make()) == "order:7"

    @pytest.mark.parametrize("make", [huge_list, cyclic_list, deep_list, Trap])
    def test_argument_in_args_is_not_walked(self, make: Callable[[], Any]) -> None:
        """Reading ``args`` or ``p0`` builds the positional tuple without walking the other arguments."""

        def create(user: Any, blob: Any) -> None: ...

        assert render_call("order:<p0.id>:<args[0].id>", create, User(7), make()) == "order:7:7"

    def test_huge_referenced_dict_is_indexed_not_walked(self) -> None:
        """``<payload["tenant"]>`` on a dict of a million entries reads one entry."""
        payload: dict[Any, Any] = dict.fromkeys(range(10**6), 0)
        payload["tenant"] = "acme"
        assert render_call('t:<user["tenant"]>', place, payload) == "t:acme"

    def test_cyclic_referenced_dict_is_indexed_not_walked(self) -> None:
        """``<payload["tenant"]>`` on a dict that contains itself renders."""
        payload: dict[str, Any] = {"tenant": "acme"}
        payload["self"] = payload
        payload["deep"] = deep_list()
        assert render_call('t:<user["tenant"]>', place, payload) == "t:acme"

    def test_referenced_mapping_is_only_indexed(self) -> None:
        """Rendering ``<payload["tenant"]>`` performs exactly one lookup on the mapping and nothing else."""
        assert render_call('t:<user["tenant"]>', place, TrapMapping()) == "t:acme"

    def test_resolver_argument_is_not_walked(self) -> None:
        """An argument passed to a resolver reaches it untouched."""
        trap = Trap()
        register_resolver("ident", lambda value: "ok" if value is trap else "other")
        assert render_call("t:<ident(user)>", place, trap) == "t:ok"


class Account:
    def __init__(self, error: Exception) -> None:
        self._error = error

    @property
    def id(self) -> str:
        raise self._error


class TestRaisingProperty:
    @pytest.mark.parametrize("error", [RuntimeError("db down"), ValueError("bad"), KeyError("k"), ZeroDivisionError()])
    def test_property_error_is_chained(self, error: Exception) -> None:
        """A property that raises while rendering gives a KeyTemplateError chained to the original error."""
        with pytest.raises(KeyTemplateError) as info:
            render_call("order:<user.id>", place, Account(error))
        assert info.value.__cause__ is error
        assert info.value.expression == "user.id"
        assert "<user.id>" in str(info.value)

    @pytest.mark.usefixtures("no_client")
    def test_property_error_stops_the_decorated_call(self) -> None:
        """Through the decorator, a raising property stops the call before the body and before any client lookup."""
        ran: list[bool] = []
        error = RuntimeError("db down")

        @distributed_lock(key="order:<user.id>")
        def create(user: Any) -> None:
            ran.append(True)

        with pytest.raises(KeyTemplateError) as info:
            create(Account(error))
        assert info.value.__cause__ is error
        assert ran == []


class TestThreadSafety:
    def test_concurrent_renders_use_their_own_arguments(self) -> None:
        """One template rendered from 8 threads at once gives each call the key of its own arguments."""
        register_resolver("upper", str.upper)
        parsed = KeyTemplate.parse('o:<user.id>:<payload["t"]>:<upper(payload["t"])>:<items[-1]>')
        start = threading.Barrier(8)

        def work(n: int) -> list[str]:
            start.wait(timeout=30)
            wrong = []
            for i in range(300):
                tenant = f"t{n}-{i}"
                key = parsed.render({"user": User(n), "payload": {"t": tenant}, "items": [0, i]})
                expected = f"o:{n}:{tenant}:{tenant.upper()}:{i}"
                if key != expected:
                    wrong.append(f"{key!r} != {expected!r}")
            return wrong

        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(work, n) for n in range(8)]
            # result() re-raises here any exception a render raised in its thread
            assert [future.result(timeout=60) for future in futures] == [[]] * 8
