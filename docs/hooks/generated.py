"""MkDocs hook: pages generated from the code at build time, so they cannot drift from it.

* ``<!-- generated: config-reference -->`` becomes the table of every key of
  :class:`lmcache_async.config.LMCacheEngineConfig` (type, default, environment variable,
  description) read from the pydantic model, followed by the LMCache keys accepted without effect.
* ``<!-- generated: lmcache-keys -->`` becomes the table of every configuration key of LMCache
  0.5.6 (listed in ``lmcache_0_5_6_keys.txt`` beside this file) with what lmcache_async does with
  it, decided by ``lmcache_async.config`` itself.
* ``<!-- generated: changelog -->`` becomes the repository's root ``CHANGELOG.md`` (without its
  title); a missing file is a warning, so a strict build fails.
* Sphinx roles left in docstrings (``:class:`~a.b.C```) are shown as plain code (``C``).

The functions are pure (no MkDocs import) so ``tests/docs`` checks them directly.
"""

from __future__ import annotations

import logging
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LMCACHE_KEYS_FILE = HERE / "lmcache_0_5_6_keys.txt"
CHANGELOG = ROOT / "CHANGELOG.md"

CONFIG_MARKER = "<!-- generated: config-reference -->"
LMCACHE_MARKER = "<!-- generated: lmcache-keys -->"
CHANGELOG_MARKER = "<!-- generated: changelog -->"

HONOURED = "honoured"
ACCEPTED_NO_EFFECT = "accepted, no effect"
IGNORED_WITH_WARNING = "accepted and ignored, with a warning"
REFUSED = "refused"

_COMPAT_PREFIX = "Accepted for LMCache compatibility"


def _type_name(ann: Any) -> str:
    """A readable spelling of a field annotation (``str | None``, ``'LRU' | 'FIFO'``)."""
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{origin.__name__}[{args}]"
    if ann is type(None):
        return "None"
    return getattr(ann, "__name__", str(ann))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def env_var(key: str) -> str:
    """The environment variable that sets ``key``: encoder-cache keys (``ec_*``) are read only by
    the encoder-cache overlay, as ``LMCACHE_EC_<REST>``."""
    from lmcache_async.config import EC_ENV_PREFIX, ENV_PREFIX

    if key.startswith("ec_"):
        return f"{EC_ENV_PREFIX}{key[3:].upper()}"
    return f"{ENV_PREFIX}{key.upper()}"


def config_reference() -> str:
    """Markdown: one table row per key of the configuration model, in declaration order."""
    from lmcache_async.config import LMCACHE_KEYS_WITHOUT_EFFECT, LMCacheEngineConfig

    rows = [
        "| key | type | default | environment | meaning |",
        "|---|---|---|---|---|",
    ]
    for key, info in LMCacheEngineConfig.model_fields.items():
        default = info.get_default(call_default_factory=True)
        rows.append(
            f"| `{key}` | `{_cell(_type_name(info.annotation))}` | `{_cell(repr(default))}` "
            f"| `{env_var(key)}` | {_cell(info.description or '')} |"
        )
    ignored = ", ".join(f"`{k}`" for k in sorted(LMCACHE_KEYS_WITHOUT_EFFECT))
    return (
        "\n".join(rows)
        + f"\n\n{len(LMCacheEngineConfig.model_fields)} keys. "
        + "LMCache keys accepted from every source without effect (one warning per key per load): "
        + ignored
        + ".\n"
    )


def lmcache_keys() -> list[tuple[str, str]]:
    """``(key, note)`` for every LMCache 0.5.6 key in the key file; the note says what LMCache
    calls it (``alias of X`` / ``deprecated``) or is empty."""
    out: list[tuple[str, str]] = []
    for line in LMCACHE_KEYS_FILE.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, note = line.partition(" ")
        out.append((key, note.strip()))
    return out


def classify(key: str) -> str:
    """What lmcache_async does with the LMCache key ``key`` (one of the four labels above)."""
    from lmcache_async.config import LMCACHE_KEYS_WITHOUT_EFFECT, LMCacheEngineConfig

    info = LMCacheEngineConfig.model_fields.get(key)
    if info is not None:
        return ACCEPTED_NO_EFFECT if (info.description or "").startswith(_COMPAT_PREFIX) else HONOURED
    if key in LMCACHE_KEYS_WITHOUT_EFFECT:
        return IGNORED_WITH_WARNING
    return REFUSED


def lmcache_key_table() -> str:
    """Markdown: every LMCache 0.5.6 key with its status here, then the count of each status."""
    from lmcache_async.config import LMCacheEngineConfig

    rows = ["| LMCache key | here | notes |", "|---|---|---|"]
    counts: dict[str, int] = {}
    for key, note in lmcache_keys():
        status = classify(key)
        counts[status] = counts.get(status, 0) + 1
        info = LMCacheEngineConfig.model_fields.get(key)
        detail = (info.description or "") if info is not None and status == HONOURED else ""
        notes = "; ".join(p for p in (note, detail) if p)
        rows.append(f"| `{key}` | {status} | {_cell(notes)} |")
    summary = ", ".join(f"{n} {label}" for label, n in counts.items())
    return "\n".join(rows) + f"\n\n{sum(counts.values())} LMCache keys: {summary}.\n"


def changelog_body(path: Path = CHANGELOG) -> str | None:
    """``path``'s text without its leading ``# Changelog`` title; None when the file is absent."""
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    first, _, rest = text.partition("\n")
    return rest.lstrip("\n") if first.startswith("# ") else text


_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):<code>~?(?:[\w.]*\.)?([\w]+)</code>")


def strip_roles(html: str) -> str:
    """Render Sphinx cross-reference roles from docstrings as plain code spans."""
    return _ROLE.sub(r"<code>\1</code>", html)


# ---- MkDocs events --------------------------------------------------------------------------
def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CHANGELOG_MARKER in markdown:
        body = changelog_body()
        if body is None:
            logging.getLogger("mkdocs.hooks.generated").warning("%s is missing: the changelog page is empty", CHANGELOG)
        else:
            markdown = markdown.replace(CHANGELOG_MARKER, body)
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if LMCACHE_MARKER in markdown:
        markdown = markdown.replace(LMCACHE_MARKER, lmcache_key_table())
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return strip_roles(html)
