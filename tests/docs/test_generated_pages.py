"""The pages the docs build generates from the code (docs/hooks/generated.py) say what the code does."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from types import ModuleType

import pytest

from lmcache_async.config import LMCACHE_KEYS_WITHOUT_EFFECT, LMCacheEngineConfig
from lmcache_async.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generated_hook", DOCS / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _load_hook()


def test_config_reference_has_one_row_per_key_with_its_default() -> None:
    table = hook.config_reference()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", table, re.M)}
    assert list(rows) == list(LMCacheEngineConfig.model_fields)
    assert "`256`" in rows["chunk_size"] and "`LMCACHE_CHUNK_SIZE`" in rows["chunk_size"]
    assert "`LMCACHE_EC_MODEL_NAME`" in rows["ec_model_name"]
    assert "'LRU' \\| 'FIFO'" in rows["cache_policy"]


def test_config_reference_lists_every_key_without_effect() -> None:
    table = hook.config_reference()
    for key in LMCACHE_KEYS_WITHOUT_EFFECT:
        assert f"`{key}`" in table, key


def test_the_lmcache_key_list_has_no_duplicates_and_covers_the_keys_we_ignore() -> None:
    keys = [k for k, _ in hook.lmcache_keys()]
    assert len(keys) == len(set(keys))
    assert set(keys) >= LMCACHE_KEYS_WITHOUT_EFFECT


def _behaviour(key: str, caplog: pytest.LogCaptureFixture) -> str:
    """What from_defaults does with ``key`` set to its LMCache-compatible default."""
    info = LMCacheEngineConfig.model_fields.get(key)
    value = info.get_default(call_default_factory=True) if info is not None else None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        try:
            LMCacheEngineConfig.from_defaults(**{key: value})
        except ConfigError:
            return hook.REFUSED
    warned = any(key in r.getMessage() and "no effect" in r.getMessage() for r in caplog.records)
    if warned:
        return hook.IGNORED_WITH_WARNING
    return hook.HONOURED if info is not None else "unexplained"


def test_every_lmcache_key_is_classified_as_the_config_behaves(caplog: pytest.LogCaptureFixture) -> None:
    seen: dict[str, int] = {}
    for key, _ in hook.lmcache_keys():
        status = hook.classify(key)
        seen[status] = seen.get(status, 0) + 1
        expected = hook.HONOURED if status == hook.ACCEPTED_NO_EFFECT else status
        assert _behaviour(key, caplog) == expected, key
    assert set(seen) == {hook.HONOURED, hook.ACCEPTED_NO_EFFECT, hook.IGNORED_WITH_WARNING, hook.REFUSED}


def test_the_key_table_counts_every_key() -> None:
    table = hook.lmcache_key_table()
    assert table.count("\n| `") == len(hook.lmcache_keys())
    assert f"{len(hook.lmcache_keys())} LMCache keys" in table


def test_strip_roles_shows_sphinx_roles_as_code() -> None:
    html = "see :class:<code>~lmcache_async.errors.ConfigError</code> and :meth:<code>put</code>"
    assert hook.strip_roles(html) == "see <code>ConfigError</code> and <code>put</code>"


def test_no_page_points_at_files_outside_the_repository() -> None:
    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        assert "SPEC.md" not in text and "SPEC §" not in text and "../shared" not in text, page
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|svg|png))(?:#[^)]*)?\)", text):
            assert (page.parent / target).resolve().is_file(), f"{page}: {target}"


def test_changelog_body_drops_the_title_and_reports_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "CHANGELOG.md"
    assert hook.changelog_body(path) is None
    path.write_text("# Changelog\n\n## Unreleased\n- a change\n", encoding="utf-8")
    assert hook.changelog_body(path) == "## Unreleased\n- a change\n"
