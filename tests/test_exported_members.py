"""The public surface: ``lockaspect.__all__`` is sorted, complete and documented (httpx style)."""

from __future__ import annotations
import __future__

import inspect
import types

import pytest

import lockaspect


def public_names() -> list[str]:
    """Public names bound in the package, minus submodules (bound by importing them) and ``__future__`` flags."""
    return [
        name
        for name, value in vars(lockaspect).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and not isinstance(value, __future__._Feature)
    ]


class TestExportedMembers:
    def test_all_is_sorted(self) -> None:
        """``__all__`` is kept sorted."""
        assert lockaspect.__all__ == sorted(lockaspect.__all__)

    def test_all_has_no_duplicates(self) -> None:
        """Each name appears once in ``__all__``."""
        assert len(set(lockaspect.__all__)) == len(lockaspect.__all__)

    def test_all_equals_the_public_names(self) -> None:
        """Every public name the package binds is exported, and every exported name is bound."""
        assert lockaspect.__all__ == sorted(public_names())

    def test_contract_names_are_exported(self) -> None:
        """The names DESIGN.md and issue 2 promise are all in ``__all__``."""
        promised = {
            "distributed_lock",
            "LockClient",
            "configure",
            "current_lease",
            "Lease",
            "LockError",
            "LockNotAcquired",
            "LockLost",
            "KeyTemplateError",
            "ConfigurationError",
            "BackendError",
            "register_resolver",
        }
        assert promised <= set(lockaspect.__all__)

    @pytest.mark.parametrize("name", lockaspect.__all__)
    def test_exported_member_has_a_docstring(self, name: str) -> None:
        """Every exported member carries a docstring of its own."""
        member = getattr(lockaspect, name)
        doc = vars(member).get("__doc__") if inspect.isclass(member) else member.__doc__
        assert isinstance(doc, str)
        assert doc.strip()
