"""The lazy registry: names to objects or dotted paths imported on first use, plus entry points."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import lmcache_async
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.lazy_registry import LazyRegistry
from lmcache_async.remote import known_schemes, make_connector, register_connector
from lmcache_async.remote.connector import ConnectorSettings
from lmcache_async.tiers import get_backend_factory, known_backends, register_backend

Factory = Callable[[], str]


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` for throwaway plugin modules; they leave ``sys.modules`` after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("lazyreg_"):
            del sys.modules[name]


def _module(where: Path, name: str, body: str) -> None:
    (where / f"{name}.py").write_text(body, encoding="utf-8")


def _dist(where: Path, dist: str, group: str, entries: dict[str, str]) -> None:
    info = where / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n", encoding="utf-8")
    lines = [f"[{group}]"] + [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_path_is_imported_on_first_lookup_only(plugin_dir: Path) -> None:
    _module(plugin_dir, "lazyreg_first", "IMPORTS = [1]\ndef make():\n    return 'made'\n")
    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_first:make"})
    assert "lazyreg_first" not in sys.modules
    assert "w" in reg and reg.names() == ["w"]
    assert "lazyreg_first" not in sys.modules  # listing and membership do not import
    factory = reg.get("w")
    assert factory() == "made"
    assert reg.get("w") is factory
    assert sys.modules["lazyreg_first"].IMPORTS == [1]


def test_a_path_without_attr_names_default_attr_or_the_module(plugin_dir: Path) -> None:
    _module(plugin_dir, "lazyreg_mod", "def create():\n    return 'created'\n")
    with_default: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_mod"}, default_attr="create")
    assert with_default.get("w")() == "created"
    modules: LazyRegistry[object] = LazyRegistry("suite", {"s": "lazyreg_mod"})
    assert modules.get("s") is sys.modules["lazyreg_mod"]


def test_an_object_given_directly_is_returned_as_is() -> None:
    def make() -> str:
        return "direct"

    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"d": make})
    assert reg.get("d") is make


def test_an_unknown_name_names_itself_and_the_known_ones() -> None:
    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"alpha": "x:y", "beta": "x:y"})
    with pytest.raises(LookupError, match=r"unknown widget 'gamma'; known: alpha, beta"):
        reg.get("gamma")


def test_the_unknown_hook_builds_the_error() -> None:
    def unknown(name: str, known: list[str]) -> Exception:
        return KeyError((name, tuple(known)))

    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"alpha": "x:y"}, unknown=unknown)
    with pytest.raises(KeyError) as err:
        reg.get("nope")
    assert err.value.args == (("nope", ("alpha",)),)


def test_a_module_that_does_not_import_is_an_import_error(plugin_dir: Path) -> None:
    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_absent_module:make"})
    with pytest.raises(ImportError, match="lazyreg_absent_module"):
        reg.get("w")
    assert "w" in reg  # still registered: a later install can make it importable


def test_a_missing_attribute_is_an_import_error(plugin_dir: Path) -> None:
    _module(plugin_dir, "lazyreg_noattr", "X = 1\n")
    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_noattr:make"})
    with pytest.raises(ImportError, match="'make'.*'lazyreg_noattr'"):
        reg.get("w")


def test_the_import_hook_wraps_the_import_error(plugin_dir: Path) -> None:
    def failed(name: str, exc: ImportError) -> Exception:
        return RuntimeError(f"{name} is not installed: {exc}")

    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_absent_module"}, import_failed=failed)
    with pytest.raises(RuntimeError, match="w is not installed: .*lazyreg_absent_module") as err:
        reg.get("w")
    assert isinstance(err.value.__cause__, ImportError)


def test_register_refuses_a_taken_name_unless_replace() -> None:
    def one() -> str:
        return "one"

    def two() -> str:
        return "two"

    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": one})
    with pytest.raises(ValueError, match="widget 'w' is already registered"):
        reg.register("w", two)
    assert reg.get("w") is one
    reg.register("w", two, replace=True)
    assert reg.get("w") is two


def test_register_checks_its_arguments() -> None:
    reg: LazyRegistry[object] = LazyRegistry("widget")
    with pytest.raises(ValueError, match="name"):
        reg.register("", "x:y")
    with pytest.raises(TypeError, match="target"):
        reg.register("w", 42)
    with pytest.raises(TypeError, match="name"):
        reg.get(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="what"):
        LazyRegistry("")
    assert 3 not in reg


def test_normalize_applies_to_lookups_and_registrations() -> None:
    def make() -> str:
        return "m"

    reg: LazyRegistry[Factory] = LazyRegistry("scheme", normalize=str.lower)
    reg.register("MyScheme", make)
    assert reg.names() == ["myscheme"]
    assert "MYSCHEME" in reg and reg.get("myScheme") is make
    with pytest.raises(ValueError, match="'myscheme' is already registered"):
        reg.register("myscheme", make)


def test_entry_points_add_names_but_never_replace_builtins(plugin_dir: Path) -> None:
    _module(plugin_dir, "lazyreg_plugin", "def make():\n    return 'plugin'\ndef shadow():\n    return 'shadow'\n")
    _dist(plugin_dir, "lazyreg_dist", "lazyreg.widgets", {"plug": "lazyreg_plugin:make", "w": "lazyreg_plugin:shadow"})

    def builtin() -> str:
        return "builtin"

    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": builtin}, entry_point_group="lazyreg.widgets")
    assert reg.names() == ["plug", "w"]
    assert reg.get("plug")() == "plugin"
    assert reg.get("w") is builtin


def test_an_explicit_registration_wins_over_an_entry_point(plugin_dir: Path) -> None:
    _module(plugin_dir, "lazyreg_plugin2", "def make():\n    return 'plugin'\n")
    _dist(plugin_dir, "lazyreg_dist2", "lazyreg.widgets2", {"plug": "lazyreg_plugin2:make"})

    def mine() -> str:
        return "mine"

    reg: LazyRegistry[Factory] = LazyRegistry("widget", entry_point_group="lazyreg.widgets2")
    reg.register("plug", mine)
    assert reg.get("plug") is mine


def test_a_replacement_during_the_import_is_kept(plugin_dir: Path) -> None:
    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_replacer:make"})

    def replacement() -> str:
        return "replacement"

    # Importing the module replaces the entry, as a register(replace=True) on another thread
    # during the import would: the caller gets what it imported, the registry keeps the replacement.
    _module(plugin_dir, "lazyreg_hook", "REPLACE = None\n")
    _module(
        plugin_dir,
        "lazyreg_replacer",
        "import lazyreg_hook\nlazyreg_hook.REPLACE()\ndef make():\n    return 'original'\n",
    )
    import lazyreg_hook  # type: ignore[import-not-found]  # found on sys.path at run time

    lazyreg_hook.REPLACE = lambda: reg.register("w", replacement, replace=True)
    assert reg.get("w")() == "original"
    assert reg.get("w") is replacement


def test_threads_looking_up_at_once_get_one_object(plugin_dir: Path) -> None:
    _module(plugin_dir, "lazyreg_threads", "def make():\n    return 'made'\n")
    reg: LazyRegistry[Factory] = LazyRegistry("widget", {"w": "lazyreg_threads:make"})
    got: list[Factory] = []
    start = threading.Barrier(8)

    def look() -> None:
        start.wait()
        got.append(reg.get("w"))

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len({id(f) for f in got}) == 1


# ---- the registries built on it -----------------------------------------------------------------
def test_unknown_backend_names_itself_and_the_known_ones() -> None:
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'nosuchtier'; known: .*cpu.*disk"):
        get_backend_factory("nosuchtier")


def test_builtin_backends_are_known_and_resolve_to_their_create() -> None:
    from lmcache_async.cpu import tier as cpu

    assert {"cpu", "disk", "remote", "nixl", "server"} <= set(known_backends())
    assert get_backend_factory("cpu") is cpu.create


def test_a_backend_that_does_not_import_is_unavailable_naming_it() -> None:
    register_backend("lazyregbroken", "lazyreg_absent_module:create", replace=True)
    with pytest.raises(BackendUnavailableError, match="backend 'lazyregbroken' cannot be imported"):
        get_backend_factory("lazyregbroken")
    with pytest.raises(ValueError, match="'lazyregbroken' is already registered"):
        register_backend("lazyregbroken", "lazyreg_absent_module:create")
    with pytest.raises(TypeError, match="factory"):
        register_backend("lazyregbad", 3)  # type: ignore[arg-type]


def test_unknown_scheme_names_itself_and_the_known_ones() -> None:
    settings = ConnectorSettings(timeout_s=1.0, part_size=1 << 20, ttl_s=None)
    with pytest.raises(ValueError, match=r"scheme 'gopher' is not supported \(known: .*fs.*mooncake.*redis"):
        make_connector("gopher://h", settings)


def test_connector_schemes_are_case_insensitive() -> None:
    register_connector("LazyRegScheme", "lazyreg_absent_module:create", replace=True)
    assert "lazyregscheme" in known_schemes()
    settings = ConnectorSettings(timeout_s=1.0, part_size=1 << 20, ttl_s=None)
    with pytest.raises(BackendUnavailableError, match="lazyregscheme:// connector cannot be imported"):
        make_connector("LAZYREGSCHEME://h", settings)


def test_package_engines_are_imported_on_first_access() -> None:
    from lmcache_async.engines.encoder_cache import ECCacheEngine
    from lmcache_async.engines.kv import LMCacheEngine

    assert lmcache_async.LMCacheEngine is LMCacheEngine
    assert lmcache_async.ECCacheEngine is ECCacheEngine
    with pytest.raises(AttributeError, match="'lmcache_async' has no attribute 'NoSuchName'"):
        _ = lmcache_async.NoSuchName
