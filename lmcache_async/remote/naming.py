"""Where an entry lives: names derived from the key, namespaced by prefix and model.

Redis-family layout (``<model>`` percent-encoded, ``<digest>`` = xxh3-128 of the full key
string, 32 hex digits)::

    <prefix>:<model>:{<digest>}                    the record (header, then payload or manifest)
    <prefix>:<model>:{<digest>}:<token>:<i>        part i of a multi-part record

The ``{...}`` hash tag puts an entry's record and its parts into one Redis Cluster slot, so one
MULTI/EXEC can publish them together. The digest is only an address: the record header holds
the full key string, and a reader that finds another key there treats it as a miss.

Filesystem layout: ``<root>/<prefix>/<model>/<digest[:2]>/<digest>.rec``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import quote

import xxhash

from lmcache_async.keys import CacheEngineKey

__all__ = ["EntryName", "check_prefix", "encode_segment", "entry_name"]

MAX_SEGMENT = 96
"""Longer model names are shortened to a readable prefix plus a hash (file names stay short)."""

# Everything outside this set is percent-encoded: ':' separates fields, '{' '}' would form a
# Cluster hash tag, '*?[]' are SCAN patterns, '/' and '.' leading names matter on filesystems.
_SAFE = "-_~+=,;!'()"


@functools.lru_cache(maxsize=4096)
def encode_segment(text: str) -> str:
    """``text`` as a key/path segment: percent-encoded, never empty, ``.``/``..`` escaped,
    and at most about :data:`MAX_SEGMENT` characters (longer ones keep a prefix plus a hash)."""
    enc = quote(text, safe=_SAFE)
    if enc in ("", ".", ".."):
        enc = "%" + enc.encode().hex() if enc else "%00empty"
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > MAX_SEGMENT:
        digest = xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
        head = enc[: MAX_SEGMENT - 20]
        if "%" in head[-2:]:  # do not cut an escape in half
            head = head[: head.rfind("%")]
        enc = f"{head}~{digest}"
    return enc


@dataclass(frozen=True)
class EntryName:
    """The names of one entry. ``key`` is the full key string stored in the record header."""

    key: str
    prefix: str
    model: str
    """The model name as a segment (see :func:`encode_segment`)."""
    digest: str

    @property
    def namespace(self) -> str:
        """``<prefix>:<model>``: every Redis name of the entry starts with it."""
        return f"{self.prefix}:{self.model}"

    @property
    def record(self) -> str:
        """Name of the record key (Redis)."""
        return f"{self.namespace}:{{{self.digest}}}"

    def part(self, token: str, index: int) -> str:
        """Name of part ``index`` of the multi-part write identified by ``token``."""
        return f"{self.namespace}:{{{self.digest}}}:{token}:{index}"

    @property
    def relpath(self) -> str:
        """Path of the record file below the filesystem root."""
        return f"{self.prefix}/{self.model}/{self.digest[:2]}/{self.digest}.rec"


def entry_name(prefix: str, key: CacheEngineKey) -> EntryName:
    """The names of ``key``'s entry below namespace ``prefix``."""
    s = key.to_string()
    digest = xxhash.xxh3_128_hexdigest(s.encode("utf-8"))
    return EntryName(key=s, prefix=prefix, model=encode_segment(key.model_name), digest=digest)


_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")


def check_prefix(prefix: object) -> str:
    """Validate ``remote_key_prefix``: letters, digits, ``_ - . :``, not starting with ``.``."""
    if not isinstance(prefix, str):
        raise TypeError(f"remote_key_prefix must be a str, got {type(prefix).__name__}")
    if not prefix or prefix.startswith(".") or not set(prefix) <= _PREFIX_CHARS or len(prefix) > 128:
        raise ValueError(
            f"remote_key_prefix {prefix!r} must be 1-128 characters from letters, digits, "
            "'_', '-', '.', ':' and must not start with '.'"
        )
    return prefix
