"""Validation of the key strings clients send to the node cache server, fast on the hot path.

Pure functions, any thread. A key the grammar of :mod:`lmcache_async.keys` refuses is a
:class:`~lmcache_async.server.protocol.ProtocolError` (the server closes that connection).
"""

from __future__ import annotations

import re

from lmcache_async.keys import CacheEngineKey
from lmcache_async.server.protocol import ProtocolError

__all__ = ["checked_key"]

#: Canonical lower-case hex of an unsigned 64-bit integer (a key's chunk-hash field).
_HEX_U64 = re.compile(rb"0|[1-9a-f][0-9a-f]{0,15}")
#: Key strings with their chunk hash set to 0 that passed the full check (bounded).
_GOOD_TEMPLATES: set[bytes] = set()
_GOOD_TEMPLATES_MAX = 4096


def checked_key(raw: bytes) -> bytes:
    """``raw`` when it is a canonical key string (:mod:`lmcache_async.keys` grammar).

    The chunk-hash field is independent of the others in that grammar, so a key is canonical
    exactly when its hash field is canonical hex and the same string with hash 0 is a
    canonical key; the latter is checked in full once per model/rank/dtype/tags and remembered.
    """
    parts = raw.split(b"@", 4)
    if len(parts) == 5 and _HEX_U64.fullmatch(parts[3]):
        parts[3] = b"0"
        template = b"@".join(parts)
        if template in _GOOD_TEMPLATES:
            return raw
        _full_key_check(template)
        if len(_GOOD_TEMPLATES) >= _GOOD_TEMPLATES_MAX:
            _GOOD_TEMPLATES.clear()
        _GOOD_TEMPLATES.add(template)
        return raw
    _full_key_check(raw)
    return raw


def _full_key_check(raw: bytes) -> None:
    try:
        CacheEngineKey.from_string(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise ProtocolError(f"invalid key: {exc}") from None
