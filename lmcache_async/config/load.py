"""Loading the configuration: entries ``(key, raw value, source)`` read from mappings, YAML
files and the environment, applied in order over the defaults (:func:`build_config`); the base
config (:func:`load_engine_config`) and the encoder-cache overlay (:func:`load_ec_engine_config`).

Precedence for the base config: defaults < ``LMCACHE_CONFIG_FILE`` YAML < ``LMCACHE_<KEY>`` env.
Loading reads files synchronously: do it before any loop starts, never on a manager's loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lmcache_async.config.convert import convert_value, did_you_mean
from lmcache_async.config.keys import (
    CONFIG_FILE_ENV,
    EC_ENV_PREFIX,
    ENV_PREFIX,
    LMCACHE_KEYS_WITHOUT_EFFECT,
    strip_file_scheme,
)
from lmcache_async.config.model import LMCacheEngineConfig
from lmcache_async.errors import ConfigError
from lmcache_async.tiers.registry import flatten_tiers_section

# The logger of the configuration as a whole: its warnings keep the name users filter on.
logger = logging.getLogger("lmcache_async.config")

__all__ = [
    "EC_DEFAULT_CPU_SIZE",
    "EC_DEFAULT_DISK_SIZE",
    "Entry",
    "build_config",
    "env_entries",
    "file_entries",
    "load_ec_engine_config",
    "load_engine_config",
    "mapping_entries",
    "read_yaml",
]

Entry = tuple[str, Any, str]  # key, raw value, source


def _is_overlay_key(key: str) -> bool:
    return key == "ec" or key.startswith("ec_")


def mapping_entries(data: Mapping[str, Any], source: str) -> list[Entry]:
    """The entries of ``data``: our keys and LMCache's keys without effect; the encoder-cache
    overlay's keys (``ec``, ``ec_*``) are left to it, anything else is warned about and dropped."""
    fields = LMCacheEngineConfig.model_fields
    out: list[Entry] = []
    for key, value in data.items():
        if not isinstance(key, str):
            logger.warning("configuration key %r (from %s) is not a string; dropped", key, source)
            continue
        if key in fields or key in LMCACHE_KEYS_WITHOUT_EFFECT:  # build_config warns about the latter
            out.append((key, value, source))
        elif _is_overlay_key(key):
            continue  # the encoder-cache overlay reads these
        else:
            logger.warning("unknown configuration key %r (from %s) dropped%s", key, source, did_you_mean(key))
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping; ``ConfigError`` for unreadable files and non-mapping documents."""
    p = Path(strip_file_scheme(os.fspath(path)) or "")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"configuration file {p} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. an integer of > 4300 digits
        raise ConfigError(f"configuration file {p} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"configuration file {p} nests too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {p} must hold a mapping, got {type(data).__name__}")
    return data


def file_entries(path: str | os.PathLike[str]) -> list[Entry]:
    """The entries of the YAML file at ``path`` (source ``file <path>``)."""
    return mapping_entries(read_yaml(path), f"file {os.fspath(path)}")


def env_entries(environ: Mapping[str, str]) -> list[Entry]:
    """The entries of ``LMCACHE_<KEY>`` variables (source ``env <VAR>``); an unknown variable
    is warned about once per process, the encoder-cache overlay's ``LMCACHE_EC_*`` left to it."""
    fields = LMCacheEngineConfig.model_fields
    out: list[Entry] = []
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV or var.startswith(EC_ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key in fields or key in LMCACHE_KEYS_WITHOUT_EFFECT:  # build_config warns about the latter
            out.append((key, value, f"env {var}"))
        elif not var.startswith(_OTHER_ENV_PREFIXES) and var not in _warned_env:
            _warned_env.add(var)  # once per process: configurations are loaded more than once
            logger.warning("unknown configuration variable %s ignored%s", var, did_you_mean(key, ENV_PREFIX))
    return out


# LMCACHE_* variables that are not configuration keys: this project's tools and tests, and
# LMCache's own process settings a migrating user may still export.
_OTHER_ENV_PREFIXES = (
    "LMCACHE_ASYNC_",
    "LMCACHE_E2E_",
    "LMCACHE_VLLM_",
    "LMCACHE_SGLANG_",
    "LMCACHE_ENV_",
    "LMCACHE_PYTHON",
    "LMCACHE_LOG_LEVEL",
    "LMCACHE_TRACK_USAGE",
    "LMCACHE_USE_EXPERIMENTAL",
)
_warned_env: set[str] = set()


def build_config(entries: Iterable[Entry], base: LMCacheEngineConfig | None = None) -> LMCacheEngineConfig:
    """Apply ``entries`` in order over ``base`` (or the defaults); later entries win.

    An entry of one of LMCache's keys without effect here (``LMCACHE_KEYS_WITHOUT_EFFECT``) is
    dropped with one warning per key, naming the key and its first source. Raises one
    :class:`ConfigError` for the first unknown key or invalid value, naming key, value and source.
    """
    fields = LMCacheEngineConfig.model_fields
    values: dict[str, tuple[Any, Any, str]] = {}
    without_effect: dict[str, str] = {}
    for key, raw, source in _expand_tiers(entries):
        if key not in fields and key in LMCACHE_KEYS_WITHOUT_EFFECT:
            without_effect.setdefault(key, source)
            continue
        values[key] = (convert_value(key, raw, source), raw, source)
    serde = values.get("remote_serde")
    if serde is not None and serde[0] not in (None, "naive"):
        logger.warning(
            "remote_serde %r (from %s) has no effect here: records are stored as they are, self-describing "
            "(LMCache's serializers such as cachegen are not used)",
            serde[0],
            serde[2],
        )
    for key, source in without_effect.items():
        logger.warning(
            "configuration key %r (from %s) is an LMCache setting with no effect in lmcache_async; ignored",
            key,
            source,
        )
    data = base.model_dump() if base is not None else {}
    data.update({k: v[0] for k, v in values.items()})
    backends = values["nixl_backends"][0] if "nixl_backends" in values else None
    if "nixl_backend" not in values and isinstance(backends, list) and backends and isinstance(backends[0], str):
        data["nixl_backend"] = backends[0]  # anything else is reported by the validation below
    try:
        cfg = LMCacheEngineConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        raw, source = (values[key][1], values[key][2]) if key in values else (data.get(key), "base")
        raise ConfigError(f"invalid value for {key}: {raw!r} (from {source}): {err['msg']}") from None
    cfg._sources = dict(base._sources) if base is not None else {}
    for key, (_, _, source) in values.items():
        cfg._sources[key] = source
    return cfg


def _expand_tiers(entries: Iterable[Entry]) -> list[Entry]:
    """``entries`` with each ``tiers`` entry split: built-in sections become flat entries in its
    place (so later entries still win), the other tiers' sections merge into one ``tiers`` entry."""
    out: list[Entry] = []
    for key, raw, source in entries:
        if key != "tiers":
            out.append((key, raw, source))
            continue
        section = convert_value(key, raw, source)
        if not isinstance(section, Mapping):
            raise ConfigError(f"invalid value for tiers: {raw!r} (from {source}): expected a mapping")
        flat, rest = flatten_tiers_section(section, source)
        out += flat
        merged = dict(next((v for k, v, _ in reversed(out) if k == "tiers"), {}))
        merged.update(rest)
        out.append(("tiers", merged, source))
    return out


def load_engine_config(path: str | os.PathLike[str] | None = None) -> LMCacheEngineConfig:
    """The base config: defaults, then the YAML at ``path`` (or ``$LMCACHE_CONFIG_FILE``), then
    ``LMCACHE_<KEY>`` environment variables. The EC overlay keys are ignored here."""
    entries: list[Entry] = []
    file_path = path if path is not None else os.environ.get(CONFIG_FILE_ENV) or None
    if file_path is not None:
        entries.extend(file_entries(file_path))
    entries.extend(env_entries(os.environ))
    return build_config(entries)


# ---- encoder-cache overlay -----------------------------------------------------------------------
EC_DEFAULT_CPU_SIZE = 1.0
EC_DEFAULT_DISK_SIZE = 64.0


def _ec_entries(data: Mapping[str, Any], path: str) -> list[Entry]:
    fields = LMCacheEngineConfig.model_fields
    prefixed: list[Entry] = []
    mapped: list[Entry] = []
    for key, value in data.items():
        if not isinstance(key, str):
            continue
        if key.startswith("ec_"):
            sub = key[3:]
            if sub in fields:
                prefixed.append((sub, value, f"file {path} key {key}"))
            elif key in fields:  # a key of the encoder cache's own (ec_model_name)
                prefixed.append((key, value, f"file {path} key {key}"))
            else:
                logger.warning("unknown encoder-cache key %r (from file %s) dropped", key, path)
    ec_map = data.get("ec")
    if ec_map is not None:
        if not isinstance(ec_map, dict):
            raise ConfigError(f"invalid value for ec: {ec_map!r} (from file {path}): must be a mapping")
        for sub, value in ec_map.items():
            if isinstance(sub, str) and sub in fields:
                mapped.append((sub, value, f"file {path} map ec.{sub}"))
            else:
                logger.warning("unknown encoder-cache key ec.%s (from file %s) dropped", sub, path)
    return prefixed + mapped  # the ec: map wins over ec_ keys


def _ec_env_entries(environ: Mapping[str, str]) -> list[Entry]:
    fields = LMCacheEngineConfig.model_fields
    out: list[Entry] = []
    for var, value in environ.items():
        if not var.startswith(EC_ENV_PREFIX):
            continue
        key = var[len(EC_ENV_PREFIX) :].lower()
        if key not in fields and f"ec_{key}" in fields:  # LMCACHE_EC_MODEL_NAME: ec_model_name
            key = f"ec_{key}"
        if key in fields:
            out.append((key, value, f"env {var}"))
        else:
            logger.warning("unknown encoder-cache variable %s dropped", var)
    return out


def load_ec_engine_config(
    base_config: LMCacheEngineConfig | None = None,
    config_file_path: str | os.PathLike[str] | None = None,
) -> LMCacheEngineConfig:
    """The encoder-cache config: a clone of the base with the EC overlay and EC defaults.

    Base: ``base_config`` (never modified) or :func:`load_engine_config` of ``config_file_path``.
    Overlay, later wins: YAML ``ec_<key>`` keys, the YAML ``ec:`` map, ``LMCACHE_EC_<KEY>``
    env. Unknown overlay keys are logged and dropped; invalid values raise ``ConfigError``.
    Defaults: ``local_cpu`` on; ``max_local_cpu_size`` 1 GiB when no source set it or it is
    <= 0; ``max_local_disk_size`` 64 GiB when ``local_disk`` is set and the size is <= 0.
    """
    base = base_config.clone() if base_config is not None else load_engine_config(config_file_path)
    file_path = config_file_path if config_file_path is not None else os.environ.get(CONFIG_FILE_ENV) or None
    entries: list[Entry] = []
    if file_path is not None:
        entries.extend(_ec_entries(read_yaml(file_path), os.fspath(file_path)))
    entries.extend(_ec_env_entries(os.environ))
    cfg = build_config(entries, base=base)
    if not cfg.local_cpu:
        cfg.set("local_cpu", True, "encoder-cache default")
    if not cfg.is_set("max_local_cpu_size") or cfg.max_local_cpu_size <= 0:
        cfg.set("max_local_cpu_size", EC_DEFAULT_CPU_SIZE, "encoder-cache default")
    if cfg.local_disk and cfg.max_local_disk_size <= 0:
        cfg.set("max_local_disk_size", EC_DEFAULT_DISK_SIZE, "encoder-cache default")
    return cfg
