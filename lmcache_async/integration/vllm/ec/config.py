"""Configuration of the encoder-cache connector: the engine config built from vLLM's
``ec_connector_extra_config`` (plus file and environment), and the connector's own keys."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from lmcache_async.config import (
    CONFIG_FILE_ENV,
    LMCacheEngineConfig,
    load_ec_engine_config,
    load_engine_config,
)

__all__ = ["CONFIG_FILE_KEY", "CONNECTOR_KEYS", "load_connector_config", "strip_file_url"]

logger = logging.getLogger(__name__)

CONFIG_FILE_KEY = "config_file"
"""``ec_connector_extra_config`` key naming a YAML configuration file."""
CONNECTOR_KEYS: dict[str, float] = {"prefetch_deadline_s": 5.0, "hold_ttl_s": 60.0, "lease_max_age_s": 600.0}
"""``ec_connector_extra_config`` keys read by the connector itself (not engine config keys)."""


def load_connector_config(extra_config: Mapping[str, Any] | None = None) -> LMCacheEngineConfig:
    """The engine config of the connector.

    Base: the YAML named by ``extra_config["config_file"]`` (else ``$LMCACHE_CONFIG_FILE``),
    then ``LMCACHE_<KEY>`` env, then the other ``extra_config`` keys given inline (plain keys,
    then ``ec_``-prefixed ones). On top, :func:`load_ec_engine_config` applies the EC overlay
    of that file (``ec_<key>``, ``ec:``), ``LMCACHE_EC_<KEY>`` env and the EC defaults.
    Unknown inline keys are logged and dropped; invalid values raise ``ConfigError``.
    """
    extra = dict(extra_config or {})
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"ec_connector_extra_config[{CONFIG_FILE_KEY!r}] must be a path, got {type(path).__name__}")
    file_path = path if path else os.environ.get(CONFIG_FILE_ENV) or None
    base = load_engine_config(file_path)
    fields = LMCacheEngineConfig.model_fields
    plain: list[tuple[str, Any]] = []
    prefixed: list[tuple[str, Any]] = []
    for key, value in extra.items():
        if key in fields:
            plain.append((key, value))
        elif isinstance(key, str) and key.startswith("ec_") and key[3:] in fields:
            prefixed.append((key[3:], value))
        elif key == "ec" and isinstance(value, Mapping):
            prefixed.extend((k, v) for k, v in value.items() if isinstance(k, str) and k in fields)
        else:
            logger.warning("unknown ec_connector_extra_config key %r dropped", key)
    for key, value in plain + prefixed:
        base.set(key, value, "ec_connector_extra_config")
    return load_ec_engine_config(base_config=base, config_file_path=file_path)


def strip_file_url(path: str) -> str:
    """``path`` without a leading ``file://`` (a ``local_disk`` value may carry one)."""
    return path[len("file://") :] if path.startswith("file://") else path
