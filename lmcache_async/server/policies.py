"""Who may join a namespace of the node cache server: ``cache_server_namespaces`` parsed into
:class:`NamespacePolicy` objects (the server's admission check reads them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NamespacePolicy", "parse_namespace_policies"]


@dataclass(frozen=True, slots=True)
class NamespacePolicy:
    """Who may join one namespace: peers whose uid is in ``uids`` or whose primary gid is in
    ``gids`` (none given: the server's own user and root), presenting ``token`` (None: the
    server's ``cache_server_token``, if any)."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    token: str | None = None


def parse_namespace_policies(raw: object) -> dict[str, NamespacePolicy]:
    """``cache_server_namespaces`` (a mapping of namespace name to ``{uids, gids, token}``) as
    policies; ``ValueError`` naming the setting for anything else."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"cache_server_namespaces must be a mapping of namespace to policy, got {raw!r}")
    out: dict[str, NamespacePolicy] = {}
    for name, pol in raw.items():
        if not isinstance(name, str) or not name or any(ord(c) < 32 for c in name):
            raise ValueError(f"cache_server_namespaces: bad namespace name {name!r}")
        if not isinstance(pol, dict) or set(pol) - {"uids", "gids", "token"}:
            raise ValueError(f"cache_server_namespaces[{name!r}] must be a mapping with uids, gids and/or token")
        ids: dict[str, frozenset[int]] = {}
        for field_name in ("uids", "gids"):
            vals = pol.get(field_name) or []
            if not isinstance(vals, list | tuple) or not all(isinstance(v, int) and v >= 0 for v in vals):
                raise ValueError(f"cache_server_namespaces[{name!r}].{field_name} must be a list of ids, got {vals!r}")
            ids[field_name] = frozenset(vals)
        token = pol.get("token")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError(f"cache_server_namespaces[{name!r}].token must be a non-empty str")
        out[name] = NamespacePolicy(ids["uids"], ids["gids"], token)
    return out
