"""Configuration: one pydantic model, YAML/env loaders and the encoder-cache overlay.

Precedence for the base config: defaults < ``LMCACHE_CONFIG_FILE`` YAML < ``LMCACHE_<KEY>`` env.
Every value remembers where it came from (``describe()``), and an invalid value raises one
:class:`~lmcache_async.errors.ConfigError` naming key, value and source. Loading reads files
synchronously: do it before any loop starts, never on a manager's loop.

This module is the public face; the work is split by job:

* :mod:`lmcache_async.config.keys`: environment prefixes, the built-in tier order, LMCache's
  keys accepted without effect;
* :mod:`lmcache_async.config.model`: :class:`LMCacheEngineConfig`, its fields and validators;
* :mod:`lmcache_async.config.convert`: raw values (environment text, YAML scalars) to each
  key's type;
* :mod:`lmcache_async.config.load`: entries from mappings, files and the environment, the base
  config and the encoder-cache overlay.
* :mod:`lmcache_async.config.check`: what a loaded configuration will do, checked before anything
  is built from it;
* :mod:`lmcache_async.config.units`: byte counts in binary units, as messages print them.
"""

from __future__ import annotations

from lmcache_async.config.convert import convert_value
from lmcache_async.config.keys import (
    CONFIG_FILE_ENV,
    DEFAULT_TIER_ORDER,
    EC_ENV_PREFIX,
    ENV_PREFIX,
    LMCACHE_KEYS_WITHOUT_EFFECT,
)
from lmcache_async.config.load import (
    EC_DEFAULT_CPU_SIZE,
    EC_DEFAULT_DISK_SIZE,
    Entry,
    build_config,
    load_ec_engine_config,
    load_engine_config,
    read_yaml,
)
from lmcache_async.config.model import LMCacheEngineConfig

__all__ = [
    "CONFIG_FILE_ENV",
    "DEFAULT_TIER_ORDER",
    "EC_DEFAULT_CPU_SIZE",
    "EC_DEFAULT_DISK_SIZE",
    "EC_ENV_PREFIX",
    "ENV_PREFIX",
    "LMCACHE_KEYS_WITHOUT_EFFECT",
    "Entry",
    "LMCacheEngineConfig",
    "build_config",
    "convert_value",
    "load_ec_engine_config",
    "load_engine_config",
    "read_yaml",
]
