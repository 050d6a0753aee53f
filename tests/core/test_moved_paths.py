"""Module paths that moved in 0.2.0 keep importing for one release: each old path warns with a
``DeprecationWarning`` naming the new one and yields the very module the new path names."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from lmcache_async._moved import MOVED


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("lmcache_async.backends.disk", "lmcache_async.disk.tier"),
        ("lmcache_async.backends.remote.fs", "lmcache_async.remote.fs"),
        ("lmcache_async.backends.server_tier", "lmcache_async.server.tier"),
        ("lmcache_async.integration.vllm.kv_costs", "lmcache_async.integration.vllm.kv.costs"),
        ("lmcache_async.integration.vllm.impl", "lmcache_async.integration.vllm.ec.impl"),
        ("lmcache_async.cli_bench", "lmcache_async.cli.bench"),
        ("lmcache_async.staging", "lmcache_async._manager.staging"),
    ],
)
def test_an_old_path_warns_and_is_the_new_module(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    parent = old.rpartition(".")[0]
    if parent in MOVED and parent not in sys.modules:  # an old package warns for itself first
        with pytest.warns(DeprecationWarning, match=parent):
            importlib.import_module(parent)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}; the old path goes away in 0\.3\.0"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    # the module keeps its own spec: its relative imports still resolve against its new package
    assert module.__spec__ is not None and module.__spec__.name == new
    assert module.__package__ == module.__spec__.parent


def test_every_old_path_names_a_module_that_imports() -> None:
    import importlib.util

    for old, new in MOVED.items():
        if new.startswith(("lmcache_async.nixl", "lmcache_async.integration.vllm", "lmcache_async.remote.mooncake")):
            continue  # NIXL, vLLM and Mooncake may be absent here: their specs are enough
        assert importlib.util.find_spec(new) is not None, (old, new)
        assert old not in MOVED.values(), old


def test_from_old_package_import_name_in_a_fresh_interpreter() -> None:
    code = (
        "import warnings; warnings.simplefilter('error');\n"
        "try:\n    from lmcache_async.backends import disk_store\n"
        "except DeprecationWarning as w:\n    print(w)\n"
        "warnings.simplefilter('ignore'); from lmcache_async.backends import disk_store as old\n"
        "import lmcache_async.disk.store as new; assert old is new; print('same')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [
        "lmcache_async.backends.disk_store moved to lmcache_async.disk.store; the old path goes away in 0.3.0",
        "same",
    ]
