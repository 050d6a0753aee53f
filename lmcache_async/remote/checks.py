"""What the remote tier will make of ``remote_url``, answered before the tier is built.

The manager's configuration check (:mod:`lmcache_async.config.check`) asks each configured tier
through the backend registry; this is the remote tier's answer: the URL's scheme is known (with
"did you mean" for a typo, and a clear word for LMCache's ``lm://``) and the URL parses as its
connector will parse it. Pure: nothing is connected or imported beyond the URL parser.
"""

from __future__ import annotations

import difflib

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.remote.connector import known_schemes
from lmcache_async.remote.url import parse_remote_url, redact

__all__ = ["config_findings"]


def config_findings(config: LMCacheEngineConfig) -> list[str]:
    """Errors that would stop the remote tier of ``config`` from starting (``[]``: none; also
    when ``remote_url`` is unset). Secrets in the URL are redacted in the messages."""
    url = config.remote_url
    if not url:
        return []
    schemes = known_schemes()
    scheme = url.partition("://")[0].strip().lower()
    shown = repr(redact(url))
    if scheme == "lm":
        return [
            f"{shown}: lm:// is LMCache's own server protocol, which has no equal here; use one of "
            f"{', '.join(s + '://' for s in schemes)}, or a node cache server (lmcache-async serve, "
            "cache_server_socket)"
        ]
    if scheme not in schemes:
        close = difflib.get_close_matches(scheme, schemes, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}://? " if close else ""
        return [f"{shown}: scheme {scheme!r} is not supported; {hint}known: {', '.join(schemes)}"]
    if scheme == "fs":  # a directory: checked when the tier opens it
        return []
    try:
        parse_remote_url(url)
    except ValueError as exc:
        return [str(exc)]
    return []
