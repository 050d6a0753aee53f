"""One registry type for everything chosen by name and imported on first use.

A :class:`LazyRegistry` maps names to objects. An entry is either the object itself or a dotted
path, ``"package.module:attr"`` (or ``"package.module"``), that is imported the first time the
name is looked up and then cached. Optional third-party entries come from an entry-point group,
read once on the first lookup or listing. The storage tiers (:mod:`lmcache_async.tiers`), the
remote tier's connectors (:mod:`lmcache_async.remote.connector`) and the package's
lazily imported engine classes (:mod:`lmcache_async`) are each one instance.

Threads: every method may be called from any thread. Imports run outside the registry's lock
(the import system has its own), so a slow import never blocks a listing on another thread.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Generic, TypeVar, cast

__all__ = ["ImportFailure", "LazyRegistry", "UnknownError"]

T = TypeVar("T")

UnknownError = Callable[[str, list[str]], Exception]
"""Builds the exception raised for a name nobody registered: ``(name, known names)``."""
ImportFailure = Callable[[str, ImportError], Exception]
"""Builds the exception raised when a dotted path cannot be imported: ``(name, the ImportError)``."""


class LazyRegistry(Generic[T]):
    """Names to objects, each given directly or as a dotted path imported on first use.

    ``what`` names the kind of entry in messages (``"backend"``). ``builtins`` are the entries
    present from the start. ``default_attr`` is the attribute a path without ``":attr"`` names
    (``"create"``); when it is None such a path names the module itself. ``entry_point_group``,
    when given, adds the installed distributions' entry points of that group on first use;
    they never replace a built-in or an explicit :meth:`register`. ``normalize`` maps a name to
    its stored form (``str.lower`` for URL schemes); lookups and registrations both go through it.

    ``unknown`` and ``import_failed`` build the exceptions :meth:`get` raises for a name nobody
    registered and for a path that does not import; by default a :class:`LookupError` naming the
    name and the known ones, and the :class:`ImportError` itself (a missing attribute is
    reported as an :class:`ImportError` too, as ``from module import attr`` does).
    """

    def __init__(
        self,
        what: str,
        builtins: Mapping[str, T | str] | None = None,
        *,
        default_attr: str | None = None,
        entry_point_group: str | None = None,
        normalize: Callable[[str], str] | None = None,
        unknown: UnknownError | None = None,
        import_failed: ImportFailure | None = None,
    ) -> None:
        if not isinstance(what, str) or not what:
            raise ValueError(f"what must be a non-empty str, got {what!r}")
        self._what = what
        self._default_attr = default_attr
        self._group = entry_point_group
        self._normalize = normalize
        self._unknown = unknown
        self._import_failed = import_failed
        self._lock = threading.Lock()
        self._entries: dict[str, T | str] = {}
        for name, target in (builtins or {}).items():
            self._entries[self._key(name)] = target
        self._entry_points_read = entry_point_group is None

    @property
    def what(self) -> str:
        """The kind of entry, as messages name it."""
        return self._what

    def register(self, name: str, target: T | str, *, replace: bool = False) -> None:
        """Add ``target`` (a callable, or a ``"module:attr"`` path imported on first use) as
        ``name``. Raises ValueError for an empty name or, unless ``replace``, a taken one;
        TypeError when ``target`` is neither callable nor a str."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not (callable(target) or isinstance(target, str)):
            raise TypeError(f"target must be callable or a 'module:attr' string, got {type(target).__name__}")
        key = self._key(name)
        with self._lock:
            if key in self._entries and not replace:
                raise ValueError(f"{self._what} {key!r} is already registered")
            self._entries[key] = target

    def names(self) -> list[str]:
        """Every registered name, sorted (entry points included)."""
        self._read_entry_points()
        with self._lock:
            return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        self._read_entry_points()
        key = self._key(name)
        with self._lock:
            return key in self._entries

    def get(self, name: str) -> T:
        """The object registered as ``name``, importing its path on the first lookup.

        Raises what ``unknown`` builds for a name nobody registered and what ``import_failed``
        builds when the path does not import (see the class docstring for the defaults).
        The result is cached: later lookups return the same object without importing.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        self._read_entry_points()
        key = self._key(name)
        with self._lock:
            entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            known = self.names()
            if self._unknown is not None:
                raise self._unknown(key, known)
            raise LookupError(f"unknown {self._what} {key!r}; known: {', '.join(known)}")
        if not isinstance(entry, str):
            return cast(T, entry)
        try:
            value = cast(T, self._import(entry))
        except ImportError as exc:
            if self._import_failed is not None:
                raise self._import_failed(key, exc) from exc
            raise
        with self._lock:
            if self._entries.get(key) == entry:  # a concurrent register(replace=True) wins
                self._entries[key] = value
        return value

    def _key(self, name: str) -> str:
        return self._normalize(name) if self._normalize is not None else name

    def _import(self, path: str) -> object:
        module_name, sep, attr = path.partition(":")
        module = importlib.import_module(module_name)
        if not sep:
            if self._default_attr is None:
                return module
            attr = self._default_attr
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ImportError(f"cannot import name {attr!r} from {module_name!r}", name=module_name) from None

    def _read_entry_points(self) -> None:
        if self._entry_points_read:
            return
        found = entry_points(group=cast(str, self._group))
        with self._lock:
            if self._entry_points_read:
                return
            for ep in found:
                self._entries.setdefault(self._key(ep.name), ep.value)
            self._entry_points_read = True


_MISSING = object()
