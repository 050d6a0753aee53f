"""Old names kept for one release, each warning with a ``DeprecationWarning`` when used.

:func:`moved_names` builds a module's ``__getattr__`` for names that moved to another module;
:func:`renamed` builds a method's deprecated alias. Both name the new place in the warning, which
points at the caller's line.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names", "renamed"]


def moved_names(module: str, moved: Mapping[str, str], note: str = "") -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module``: each old name in ``moved`` resolves to
    ``moved[name]`` (``"pkg.mod"``: the same name there; ``"pkg.mod:New"``: another name) with a
    ``DeprecationWarning`` naming the new place (and ``note``); any other name raises
    ``AttributeError`` as a module would. The new module is imported on first use."""

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new = target.partition(":")
        new = new or name
        place = f"{where}.{new}" if new != name else where
        warnings.warn(
            f"{module}.{name} moved to {place}; the old path goes away in the next release{note}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), new)

    return __getattr__


def renamed(owner: str, method: Callable[..., Any], old: str) -> Callable[..., Any]:
    """A deprecated alias named ``old`` of the method ``method`` of class ``owner`` (a coroutine
    function stays one): same arguments and result, with a ``DeprecationWarning`` naming the new
    name."""
    message = f"{owner}.{old} is deprecated; use {owner}.{method.__name__}"
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def alias_async(*args: Any, **kwargs: Any) -> Any:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return await method(*args, **kwargs)

        alias: Callable[..., Any] = alias_async
    else:

        @functools.wraps(method)
        def alias_sync(*args: Any, **kwargs: Any) -> Any:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return method(*args, **kwargs)

        alias = alias_sync
    alias.__name__ = old
    alias.__doc__ = f"Deprecated name of :meth:`{method.__name__}` (kept for one release; warns)."
    return alias
