"""The tier registry: each tier's factory, when it is on, and its settings, by name.

Every tier — built-in or third-party — is one :class:`TierSpec`:

* ``factory`` builds the tier from a :class:`~lmcache_async.tiers.abc.BackendContext` (or returns
  None when the configuration does not enable it);
* ``enabled(config)`` says whether the configuration turns it on (the built-ins: their flat key,
  such as ``local_disk``, is set); a tier without one is on whenever it is named;
* ``settings``, an optional pydantic model, validates the tier's section of the ``tiers:``
  configuration mapping; the validated model reaches the factory as ``ctx.settings``.

Built-ins are registered by dotted path and imported only when configured (no redis or NIXL
import otherwise). Third parties register with :func:`register_tier` or through the
``lmcache_async.backends`` entry-point group, whose value names a :class:`TierSpec` or a bare
factory (a tier without settings, on when named).

The ``tiers:`` section (YAML, ``LMCACHE_TIERS`` as JSON, or a dict) names tiers and their
settings::

    tiers:
      disk: {path: /var/cache/kv, size_gib: 64}   # the same as local_disk / max_local_disk_size
      mytier: {root: /srv/cache}                   # a third-party tier: validated by its model

A built-in's section maps onto the flat LMCache keys (:data:`FLAT_KEYS`), which keep working
unchanged; a third-party tier named there and absent from ``tier_order`` is searched after the
tiers ``tier_order`` names. :func:`configured_tiers` is the one answer to "which tiers does this
configuration build, in which order", used by the manager and the node server alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel, ValidationError

from lmcache_async.errors import BackendUnavailableError, ConfigError
from lmcache_async.lazy_registry import LazyRegistry

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.tiers.abc import BackendContext, StorageBackend

__all__ = [
    "BUILTIN_TIER_KEYS",
    "ENTRY_POINT_GROUP",
    "FLAT_KEYS",
    "TIER_NAMES",
    "BackendFactory",
    "TierSpec",
    "configured_tiers",
    "get_backend_factory",
    "get_tier_spec",
    "is_configured",
    "known_backends",
    "register_backend",
    "register_tier",
    "tier_config_errors",
    "tier_settings",
]

ENTRY_POINT_GROUP = "lmcache_async.backends"

BackendFactory = Callable[["BackendContext"], "StorageBackend | None"]
"""Builds a tier from the context, or returns None when the config does not enable it."""


@dataclass(frozen=True)
class TierSpec:
    """One tier as the registry knows it; see the module docstring.

    ``factory`` and ``settings`` may be ``"module:attr"`` paths, imported on first use.
    ``enabled``: None means "on whenever named". ``config_check``: a ``(config) -> list[str]``
    of errors the tier finds in the configuration before it is built (``"module:attr"``)."""

    factory: BackendFactory | str
    enabled: Callable[[LMCacheEngineConfig], bool] | None = None
    settings: type[BaseModel] | str | None = None
    config_check: str | None = None
    flat_keys: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, ctx: BackendContext) -> StorageBackend | None:
        """Build the tier (a spec is a factory too)."""
        return self.build_factory()(ctx)

    def build_factory(self) -> BackendFactory:
        """The factory (imported when given as a path)."""
        return _resolve(self.factory) if isinstance(self.factory, str) else self.factory

    def settings_model(self) -> type[BaseModel] | None:
        """The settings model (imported when given as a path), or None."""
        return _resolve(self.settings) if isinstance(self.settings, str) else self.settings


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr or "create")
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"{path!r} cannot be imported: {exc}") from exc


def _flag(key: str) -> Callable[[LMCacheEngineConfig], bool]:
    def enabled(config: LMCacheEngineConfig) -> bool:
        return bool(getattr(config, key))

    enabled.__doc__ = f"True when ``{key}`` is set."
    return enabled


#: The built-in tiers, in their default search order: the one list of built-in names.
TIER_NAMES: Final = ("cpu", "server", "nixl", "disk", "remote")

#: The configuration key whose value turns each built-in tier on.
BUILTIN_TIER_KEYS: Final[dict[str, str]] = {
    "cpu": "local_cpu",
    "disk": "local_disk",
    "remote": "remote_url",
    "nixl": "nixl_path",
    "server": "cache_server_socket",
}

#: Per built-in tier: the names its ``tiers:`` section accepts → the flat LMCache key each sets.
#: (The flat key names themselves are accepted in the section too.)
FLAT_KEYS: Final[dict[str, dict[str, str]]] = {
    "cpu": {"enabled": "local_cpu", "size_gib": "max_local_cpu_size", "policy": "cache_policy"},
    "disk": {"path": "local_disk", "size_gib": "max_local_disk_size"},
    "remote": {"url": "remote_url", "key_prefix": "remote_key_prefix", "ttl_s": "remote_ttl_s"},
    "nixl": {"path": "nixl_path", "backend": "nixl_backend"},
    "server": {"socket": "cache_server_socket", "namespace": "cache_server_namespace", "token": "cache_server_token"},
}

_BUILTINS: dict[str, TierSpec] = {
    name: TierSpec(
        factory=f"lmcache_async.{module}:create",
        enabled=_flag(BUILTIN_TIER_KEYS[name]),
        config_check="lmcache_async.remote.checks:config_findings" if name == "remote" else None,
        flat_keys=FLAT_KEYS[name],
    )
    for name, module in (
        ("cpu", "cpu.tier"),
        ("disk", "disk.tier"),
        ("remote", "remote"),
        ("nixl", "nixl.tier"),
        ("server", "server.tier"),
    )
}

_registry: LazyRegistry[TierSpec | BackendFactory] = LazyRegistry(
    "backend",
    _BUILTINS,
    default_attr="create",
    entry_point_group=ENTRY_POINT_GROUP,
    unknown=lambda name, known: BackendUnavailableError(f"unknown backend {name!r}; known: {', '.join(known)}"),
    import_failed=lambda name, exc: BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}"),
)


def register_tier(name: str, spec: TierSpec | BackendFactory | str, *, replace: bool = False) -> None:
    """Register tier ``name``: a :class:`TierSpec`, a bare factory or a ``"module:attr"`` path
    (imported on first use). ValueError for an empty or (unless ``replace``) taken name,
    TypeError for anything else."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not (isinstance(spec, TierSpec | str) or callable(spec)):
        raise TypeError("spec must be a TierSpec, a factory or a 'module:attr' string")
    _registry.register(name, spec, replace=replace)


register_backend = register_tier
"""The older name of :func:`register_tier` (same arguments)."""


def get_tier_spec(name: str) -> TierSpec:
    """The spec registered as ``name`` (a bare factory is wrapped). Raises
    :class:`BackendUnavailableError` for an unknown name or one that does not import."""
    entry = _registry.get(name)
    return entry if isinstance(entry, TierSpec) else TierSpec(factory=entry)


def get_backend_factory(name: str) -> BackendFactory:
    """The factory of tier ``name`` (importing it on first use); errors as :func:`get_tier_spec`."""
    return get_tier_spec(name).build_factory()


def known_backends() -> list[str]:
    """Names that can be used in ``tier_order`` and ``tiers:`` (entry points included)."""
    return _registry.names()


def is_configured(name: str, config: LMCacheEngineConfig) -> bool:
    """True when ``config`` turns tier ``name`` on: a built-in whose key is set; any other tier
    named in ``tier_order`` or ``tiers:`` whose ``enabled`` (if it has one) says so. Imports a
    third-party tier's spec; an unknown name is not configured."""
    key = BUILTIN_TIER_KEYS.get(name)
    if key is not None:
        return bool(getattr(config, key))
    if name not in config.tier_order and name not in config.tiers:
        return False
    try:
        spec = get_tier_spec(name)
    except BackendUnavailableError:
        return name in config.tier_order  # an unknown name: the build reports it
    return spec.enabled is None or bool(spec.enabled(config))


def configured_tiers(config: LMCacheEngineConfig) -> list[str]:
    """The tiers ``config`` builds, in search order: ``cpu`` first when named, then the others
    of ``tier_order``, then the ``tiers:`` names ``tier_order`` leaves out; only those
    :func:`is_configured` says are on."""
    order = list(config.tier_order)
    order += [n for n in config.tiers if n not in order and n not in BUILTIN_TIER_KEYS]
    if "cpu" in order:
        order.remove("cpu")
        order.insert(0, "cpu")
    return [n for n in order if is_configured(n, config)]


def tier_settings(name: str, config: LMCacheEngineConfig) -> BaseModel | None:
    """Tier ``name``'s ``tiers:`` section validated by its settings model (defaults when the
    section is absent); None for a tier without a model. :class:`ConfigError` naming the tier
    and field for an invalid section."""
    model = get_tier_spec(name).settings_model()
    if model is None:
        return None
    try:
        return model.model_validate(dict(config.tiers.get(name, {})))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"invalid tiers.{name}.{where}: {err['msg']}") from None


def tier_config_errors(name: str, config: LMCacheEngineConfig) -> list[str]:
    """The errors tier ``name`` finds in ``config`` before it is built (``[]`` for a tier
    without such a check, or one that is not configured)."""
    if not is_configured(name, config):
        return []
    try:
        spec = get_tier_spec(name)
    except BackendUnavailableError:
        return []
    out: list[str] = []
    if spec.config_check is not None:
        check: Callable[[LMCacheEngineConfig], list[str]] = _resolve(spec.config_check)
        out += list(check(config))
    if spec.settings is not None:
        try:
            tier_settings(name, config)
        except ConfigError as exc:
            out.append(str(exc))
    return out


def flatten_tiers_section(section: Mapping[str, Any], source: str) -> tuple[list[tuple[str, Any, str]], dict[str, Any]]:
    """Split a ``tiers:`` mapping into flat entries for the built-ins' keys (``(key, value,
    source)``) and the sections of the other tiers (kept as given). :class:`ConfigError` for a
    section that is no mapping or a built-in setting nobody knows."""
    flat: list[tuple[str, Any, str]] = []
    rest: dict[str, Any] = {}
    for name, body in section.items():
        if not isinstance(name, str) or not isinstance(body, Mapping):
            raise ConfigError(f"tiers.{name} (from {source}) must be a mapping of settings")
        keys = FLAT_KEYS.get(name)
        if keys is None:
            rest[name] = dict(body)
            continue
        for sub, value in body.items():
            key = keys.get(sub, sub if sub in keys.values() else None)
            if key is None:
                known = ", ".join(sorted(keys))
                raise ConfigError(f"unknown setting tiers.{name}.{sub} (from {source}); known: {known}")
            flat.append((key, value, f"{source} (tiers.{name}.{sub})"))
    return flat, rest
